"""Cost models and the schedule analysis, against closed-form answers."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import zerofx
from zerofx.cost_models.comm import CPU_GLOO, estimate_all_gather_s, estimate_reduce_scatter_s
from zerofx.cost_models.compute import (
    CPU_CORE,
    DeviceSpec,
    estimate_flops,
    estimate_node_s,
    estimate_optimizer_step_s,
    fused_node_seconds,
    is_view_op,
    rebuild_seconds,
    memory_rate,
    rank_device,
)
from zerofx.cost_models.memory import estimate_model_state_bytes, estimate_process_peak_bytes, zero_paper_bytes
from zerofx.passes import meta
from zerofx.passes.analysis.analyze_schedule import format_report
from tests.support.programs import SMALL_BUCKETS, meta_program


def test_zero_paper_figure_1() -> None:
    # 7.5B parameters on 64 GPUs: 120, 31.4, 16.6 and 1.9 GB (ZeRO paper, Figure 1).
    got = [zero_paper_bytes(7.5e9, stage=s, world_size=64) / 1e9 for s in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.06)
    assert zero_paper_bytes(20e9, stage=3, world_size=8) / 1e9 == pytest.approx(40)


def test_model_state_bytes_closed_form() -> None:
    @dataclasses.dataclass
    class P:
        fqn: str
        numel: int
        shard_numel: int
        padded_numel: int
        itemsize: int = 4
        requires_grad: bool = True

    params = [P("a", 10, 3, 12), P("b", 8, 2, 8)]  # N = 4
    assert estimate_model_state_bytes(params, stage=3, optimizer="AdamW") == {"params": 20, "grads": 20, "optimizer_states": 48}
    assert estimate_model_state_bytes(params, stage=0, optimizer="SGD") == {"params": 80, "grads": 80, "optimizer_states": 0}


def test_flops_of_matmul_and_attention() -> None:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 16, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.proj(x).view(2, 8, 4, 4).transpose(1, 2)  # (B, nh, T, hd)
            return nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()

    program = zerofx.compile(Attn(), world_size=1, stage=0, example_inputs=(torch.ones(2, 8, 16),))
    fw = program.graph_modules(0)["forward"]
    flops = {
        n.target.__name__: estimate_flops(n)
        for n in fw.graph.nodes
        if n.op == "call_function" and "mm" in n.target.__name__ or "scaled_dot" in str(n.target)
    }
    assert flops["mm.default"] == 2 * 16 * 16 * 16  # (B*T, d) x (d, d)
    attn = next(v for k, v in flops.items() if "scaled_dot_product" in k)
    assert attn == 2 * 2 * (2 * 4) * 8 * 8 * 4  # QK^T and PV over (B*nh) heads of T x T x hd


def test_flops_of_zerofx_custom_ops_are_the_products_they_run() -> None:
    """NOTE [Custom ops' FLOPs]: the tiled attention counts as SDPA, a ring attention over every
    rank's keys, the tiled linear and the chunked loss as their products; all take the roofline."""
    import zerofx.passes.sequence.ring_attention  # noqa: F401  (registers zerofx::ring_attention)
    import zerofx.passes.tiled_kernels  # noqa: F401

    graph = torch.fx.Graph()

    def call(target, *args, **kwargs):
        node = graph.call_function(target, args, kwargs)
        node.meta["val"] = torch.empty(1, device="meta")
        return node

    def tensor(*shape):
        node = graph.placeholder(f"t{len(graph.nodes)}")
        node.meta["val"] = torch.empty(shape, device="meta")
        return node

    q, k = tensor(2, 8, 64, 32), tensor(2, 8, 64, 32)
    sdpa = 2 * 2 * (2 * 8) * 64 * 64 * 32
    ops = torch.ops.zerofx
    blocked = call(ops.blocked_attention.default, q, k, k, None, True, 0.1, 16, 16)
    blocked_bwd = call(ops.blocked_attention_backward.default, q, q, k, k, q, q, None, True, 0.1, 16, 16)
    ring = call(ops.ring_attention.default, q, k, k, None, True, 0.1, "group", 4, False)
    ring_bwd = call(ops.ring_attention_backward.default, q, q, k, k, q, q, None, True, 0.1, "group", 4, False)
    x, w = tensor(2, 64, 48), tensor(96, 48)
    linear = call(ops.feature_tiled_linear.default, x, w, None, 4)
    linear_bwd = call(ops.feature_tiled_linear_backward.default, x, x, w, 4, False)
    loss_bwd = call(ops.chunked_linear_cross_entropy_backward.default, x, x, w, None, x, -100, 32)
    assert estimate_flops(blocked) == sdpa and estimate_flops(blocked_bwd) == 2 * sdpa
    assert estimate_flops(ring) == 4 * sdpa and estimate_flops(ring_bwd) == 8 * sdpa
    product = 2 * (2 * 64) * 48 * 96
    assert estimate_flops(linear) == product and estimate_flops(linear_bwd) == 2 * product and estimate_flops(loss_bwd) == 3 * product
    slow = DeviceSpec("slow-flops", 1e9, 1e15)
    assert estimate_node_s(blocked, slow) == pytest.approx(sdpa / 1e9)


def test_overlap_hides_communication_in_the_model() -> None:
    on = meta_program(3, 2, **SMALL_BUCKETS).report(0)
    off = meta_program(3, 2, overlap_comm=False, **SMALL_BUCKETS).report(0)
    assert on.comm_s == pytest.approx(off.comm_s)
    assert off.exposed_s == pytest.approx(off.comm_s)  # nothing overlaps when every wait follows its issue
    assert on.exposed_s < off.exposed_s and on.step_s < off.step_s
    # With free compute, nothing can hide communication.
    free = DeviceSpec("free", float("inf"), float("inf"))
    program = meta_program(3, 2, **SMALL_BUCKETS)
    assert program.report(0, device=free).exposed_s == pytest.approx(program.report(0, device=free).comm_s)
    # Each row's time is the alpha-beta model of its message.
    for row in on.rows:
        total = row.bytes_per_rank * 2 if "all_gather" in row.op else row.bytes_per_rank
        model = estimate_all_gather_s if "all_gather" in row.op else estimate_reduce_scatter_s
        assert row.comm_s == pytest.approx(model(total, 2, CPU_GLOO))
    assert [r.order for r in on.rows] == list(range(len(on.rows)))
    text = format_report(on, budget_bytes=1)
    assert "does NOT fit" in text and "exposed" in text


def test_ranks_sharing_cores_compute_at_their_share() -> None:
    # NOTE [Ranks sharing cores]: 4 ranks on 2 cores run at half a core's rate each.
    core = DeviceSpec("core", 100e9, 4e9, cores=2, fresh_s_per_byte=2e-10, update_s_per_element_pass=3e-10)
    assert rank_device(core, 1) == core and rank_device(core, 2) == core
    half = rank_device(core, 4)
    assert (half.matmul_flops_per_s, half.memory_bytes_per_s) == (50e9, 2e9)
    # per-core costs stretch alike: page faults and the timed update take twice as long
    assert (half.fresh_s_per_byte, half.update_s_per_element_pass) == (4e-10, 6e-10)
    own = DeviceSpec("gpu", 1e12, 1e12)  # a device per rank: never shared
    assert rank_device(own, 64) == own
    # The report's compute at 4 ranks on 2 cores is twice that with a core per rank; at 2 ranks
    # the same; and of the collectives only their new buffers' page faults, which the shared
    # cores take (NOTE [A collective's new buffers fault in]): the comm model's times do not.
    alone = dataclasses.replace(core, cores=None)
    for world, factor in ((4, 2.0), (2, 1.0)):
        program = meta_program(3, world, **SMALL_BUCKETS)
        shared, own_core = program.report(0, device=core), program.report(0, device=alone)
        assert shared.compute_s.keys() == own_core.compute_s.keys()
        for graph, seconds in own_core.compute_s.items():
            assert shared.compute_s[graph] == pytest.approx(factor * seconds) and seconds > 0
        no_faults = [program.report(0, device=dataclasses.replace(d, fresh_s_per_byte=0.0)) for d in (core, alone)]
        assert no_faults[0].comm_s == pytest.approx(no_faults[1].comm_s)
        faults = [r.comm_s - n.comm_s for r, n in zip((shared, own_core), no_faults)]
        assert faults[1] > 0 and faults[0] == pytest.approx(factor * faults[1])
    # Ranks on several nodes share only their node's cores.
    nodes = dataclasses.replace(CPU_GLOO, ranks_per_node=2)
    program = meta_program(3, 4, **SMALL_BUCKETS)
    assert program.report(0, comm=nodes, device=core).compute_s == pytest.approx(program.report(0, comm=nodes, device=alone).compute_s)


def test_process_peak_adds_the_runtime_baseline(tmp_path: Path) -> None:
    # NOTE [What a rank's resident memory holds]: the timeline's peak plus the profile's baseline,
    # as zerofx plan --format json reports it.
    from zerofx.app.cli import main
    from zerofx.cost_models.profiles import save_profile

    assert estimate_process_peak_bytes(100, 0) == 100 and estimate_process_peak_bytes(2**20, 3 * 2**20) == 4 * 2**20
    profile = tmp_path / "profile.json"
    save_profile(profile, CPU_GLOO, DeviceSpec("calibrated-cpu-core", 74e9, 2.2e9, cores=2, runtime_bytes=345_678_912,
                                               inductor_bytes=50 * 2**20))
    compiled = tmp_path / "compiled.json"
    compiled.write_text(json.dumps({"zerofx": {"compile": "inductor"}}))
    data = {}
    for name, extra in (("cpu", []), (str(profile), []), ("compiled", ["--profile", str(profile), "--config", str(compiled)])):
        out = io.StringIO()
        args = ["--profile", name] if not extra else extra
        with contextlib.redirect_stdout(out):
            assert main(["plan", "tiny", "--world-size", "2", "--stage", "3", "--seq-len", "32", *args, "--format", "json"]) == 0
        data[name] = json.loads(out.getvalue())["memory"]
    assert data["cpu"]["process_peak_bytes"] == data["cpu"]["peak_bytes"]  # the built-in profile states no baseline
    assert data[str(profile)]["process_peak_bytes"] == data[str(profile)]["peak_bytes"] + 345_678_912
    # NOTE [What Inductor keeps resident]: a config compiling with Inductor holds that too.
    assert data["compiled"]["process_peak_bytes"] == data["compiled"]["peak_bytes"] + 345_678_912 + 50 * 2**20


def _aten_graph(fn, *shapes: tuple[int, ...]) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*(torch.empty(s) for s in shapes))


def test_views_move_nothing() -> None:
    # NOTE [Views move nothing]: a transpose and a view cost 0; the multiply that reads them streams its bytes.
    gm = _aten_graph(lambda x: x.t().reshape(-1) * 2, (64, 32))
    spec = DeviceSpec("d", 1e12, 1e9)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    views = [n for n in nodes if is_view_op(n)]
    assert views and all(estimate_node_s(n, spec) == 0.0 for n in views)
    (mul,) = [n for n in nodes if n.target is torch.ops.aten.mul.Tensor]
    assert not is_view_op(mul) and estimate_node_s(mul, spec) == pytest.approx(2 * 64 * 32 * 4 / 1e9)


def test_a_matmul_is_bound_by_its_bytes_too() -> None:
    # NOTE [A matmul is bound by its bytes too]: (128, 768) @ (768, 2048) at 106 GFLOP/s and 1.8 GB/s.
    gm = _aten_graph(torch.mm, (128, 768), (768, 2048))
    (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    flops, moved = 2 * 128 * 768 * 2048, 4 * (128 * 768 + 768 * 2048 + 128 * 2048)
    assert estimate_node_s(mm, DeviceSpec("cpu", 106e9, 1.8e9)) == pytest.approx(moved / 1.8e9)  # memory-bound
    assert estimate_node_s(mm, DeviceSpec("fast-memory", 106e9, 1e12)) == pytest.approx(flops / 106e9)  # FLOP-bound


def test_new_tensors_pay_for_their_pages() -> None:
    # NOTE [New tensors' pages]: an output at least fresh_min_bytes large pays fresh_s_per_byte on
    # top of its bandwidth; a smaller one and a view pay nothing more; 0 (unmeasured) changes nothing.
    gm = _aten_graph(lambda x: x.t().reshape(-1) * 2, (64, 32))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    (mul,) = [n for n in nodes if n.target is torch.ops.aten.mul.Tensor]
    out = 64 * 32 * 4
    plain = DeviceSpec("d", 1e12, 1e9)
    paged = DeviceSpec("d", 1e12, 1e9, fresh_s_per_byte=0.4e-9, fresh_min_bytes=out)
    assert estimate_node_s(mul, paged) == pytest.approx(estimate_node_s(mul, plain) + out * 0.4e-9)
    assert estimate_node_s(mul, DeviceSpec("d", 1e12, 1e9, fresh_s_per_byte=0.4e-9, fresh_min_bytes=out + 1)) == estimate_node_s(mul, plain)
    assert all(estimate_node_s(n, paged) == 0.0 for n in nodes if is_view_op(n))
    # Writing into a given tensor allocates nothing: copy_ pays its bytes only.
    g = torch.fx.Graph()
    dst, src = g.placeholder("dst"), g.placeholder("src")
    for ph in (dst, src):
        ph.meta["val"] = torch.empty(64, 32, device="meta")
    copy = g.call_function(torch.ops.aten.copy_.default, (dst, src))
    copy.meta["val"] = torch.empty(64, 32, device="meta")
    assert estimate_node_s(copy, paged) == pytest.approx(estimate_node_s(copy, plain)) and estimate_node_s(copy, plain) > 0


def test_optimizer_update_time() -> None:
    # NOTE [The optimizer update's time]: AdamW makes 20 passes of 4 bytes per element.
    dram = DeviceSpec("d", 1e12, 2e9)
    assert estimate_optimizer_step_s([1000, 0, 3000], "AdamW", dram) == pytest.approx(20 * 4 * 4000 / 2e9)
    assert estimate_optimizer_step_s([1000], "SGD", dram) == pytest.approx(3 * 4 * 1000 / 2e9)
    # NOTE [Bandwidth by working-set size]: each parameter's passes at the rate of its working set.
    cached = dataclasses.replace(dram, memory_curve=((2**20, 40e9), (2**27, 2e9)))
    assert memory_rate(cached, 2**20) == 40e9 and memory_rate(cached, 2**20 + 1) == 2e9 and memory_rate(cached, 2**30) == 2e9
    assert memory_rate(dram, 10) == 2e9
    small, large = 2**16, 2**22  # 3 x 256 KiB fits the first point; 3 x 16 MiB does not
    assert estimate_optimizer_step_s([small, large], "AdamW", cached) == pytest.approx(80 * small / 40e9 + 80 * large / 2e9)
    # A measured update prices every element pass alike, scaled by the optimizer's passes.
    measured = dataclasses.replace(cached, update_s_per_element_pass=3e-10)
    assert estimate_optimizer_step_s([small, large], "AdamW", measured) == pytest.approx(20 * (small + large) * 3e-10)
    assert estimate_optimizer_step_s([1000], "SGD", measured) == pytest.approx(3 * 1000 * 3e-10)
    # The schedule counts it once per step, over the shards this rank owns, between backward and param_sync.
    program = meta_program(2, 2, **SMALL_BUCKETS)
    report = program.report(0, device=dram)
    owned = [p.shard_numel for p in program.plan.params if p.requires_grad]
    assert report.compute_s["optimizer"] == pytest.approx(estimate_optimizer_step_s(owned, "AdamW", dram))
    assert [s.graph for s in report.spans][-2:] == ["optimizer", "param_sync"]
    assert report.step_s == pytest.approx(sum(report.compute_s.values()) + report.exposed_s)


def test_inductor_runs_price_their_outside_bytes_once() -> None:
    """NOTE [Fused kernels under Inductor]: the pointwise ops and the reduction between two
    products are one run, priced by what it reads from outside (the first product's output, the
    bias) and writes for outside (its input to the second product), at its last node; eager prices
    every op's own bytes. The products keep their own price, and a run never crosses them."""
    def block(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ w + b) * 2  # add, relu, mul: one run between the two products
        return (h.t().t() @ w).sum()  # the views do not split it; the sum is a run of its own

    gm = _aten_graph(block, (64, 32), (32, 32), (32,))
    spec = DeviceSpec("d", 1e12, 1e9)
    fused = fused_node_seconds(gm.graph, spec)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    products = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert len(products) == 2 and all(fused[n] == estimate_node_s(n, spec) for n in products)
    run = [n for n in nodes if n.target in (torch.ops.aten.add.Tensor, torch.ops.aten.relu.default, torch.ops.aten.mul.Tensor)]
    assert len(run) == 3 and [fused[n] for n in run[:-1]] == [0.0, 0.0]
    out = 64 * 32 * 4
    assert fused[run[-1]] == pytest.approx((out + 32 * 4 + out) / 1e9)  # read the product and the bias, write the input to the next
    assert sum(estimate_node_s(n, spec) for n in run) == pytest.approx((6 * out + 32 * 4) / 1e9)  # each op reads and writes its own
    (total,) = [n for n in nodes if n.target is torch.ops.aten.sum.default]
    assert fused[total] == estimate_node_s(total, spec)  # alone in its run: the same bytes
    assert all(fused[n] == 0.0 for n in nodes if is_view_op(n))


def test_a_rebuilt_run_under_inductor_costs_reading_its_inputs() -> None:
    """``rebuild_seconds``: eager, each rebuilt op costs its own bytes; under Inductor the fused
    ops read only what comes from outside the rebuilt set (their output feeds the backward
    kernel unwritten), and a product keeps its price."""
    gm = _aten_graph(lambda x, w, b: torch.relu(x @ w + b) * 2, (64, 32), (32, 32), (32,))
    spec = DeviceSpec("d", 1e12, 1e9)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    eager = rebuild_seconds(nodes, spec)
    fused = rebuild_seconds(nodes, spec, fused=True)
    assert eager == {n: estimate_node_s(n, spec) for n in nodes}
    (mm,) = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert fused[mm] == eager[mm]
    add, relu, mul = (n for n in nodes if n is not mm)
    assert fused[add] == pytest.approx(32 * 4 / 1e9)  # the bias; the product is rebuilt too
    assert fused[relu] == fused[mul] == 0.0 and sum(fused.values()) < sum(eager.values())


def test_the_fused_update_and_the_compiled_schedule() -> None:
    """torch's fused AdamW makes 7 passes where the default makes 20; a program whose config
    compiles with Inductor is priced with its runs fused, faster than the same plan eager, and
    ``report(compiler=...)`` overrides the config."""
    from zerofx.config.options import GraphCompiler

    dram = DeviceSpec("d", 1e12, 2e9)
    assert estimate_optimizer_step_s([1000], "AdamW", dram, fused=True) == pytest.approx(7 * 4 * 1000 / 2e9)
    assert estimate_optimizer_step_s([1000], "SGD", dram, fused=True) == estimate_optimizer_step_s([1000], "SGD", dram)
    program = meta_program(2, 2, **SMALL_BUCKETS)
    eager = program.report(0, device=dram)
    compiled = program.report(0, device=dram, compiler=GraphCompiler.INDUCTOR, fused_optimizer=True)
    assert compiled.compute_s["forward"] < eager.compute_s["forward"] and compiled.compute_s["backward"] < eager.compute_s["backward"]
    assert compiled.compute_s["optimizer"] == pytest.approx(7 / 20 * eager.compute_s["optimizer"])
    assert compiled.peak.live_bytes == eager.peak.live_bytes  # the memory timeline is the graphs', compiled or not


def test_collectives_take_the_core_where_ranks_fill_the_cores() -> None:
    # NOTE [Collectives on the ranks' cores]: with 2 ranks on 2 cores nothing hides communication.
    program = meta_program(3, 2, **SMALL_BUCKETS)
    gpu_like = DeviceSpec("d", 74e9, 2.2e9)
    host = dataclasses.replace(gpu_like, cores=2)
    overlapped, serial = program.report(0, device=gpu_like), program.report(0, device=host)
    assert overlapped.exposed_s < overlapped.comm_s
    assert serial.exposed_s == pytest.approx(serial.comm_s) and serial.comm_s == pytest.approx(overlapped.comm_s)
    assert serial.step_s == pytest.approx(sum(serial.compute_s.values()) + serial.comm_s)
    # More cores than ranks: a core is free for gloo, and the overlap model applies.
    spare = program.report(0, device=dataclasses.replace(gpu_like, cores=4))
    assert spare.exposed_s == pytest.approx(overlapped.exposed_s)


def test_memory_timeline() -> None:
    program = meta_program(3, 2, **SMALL_BUCKETS)
    report = program.report(0)
    persistent = sum(program.plan.estimates.values())
    assert report.persistent_bytes == persistent
    assert all(p.live_bytes >= persistent for p in report.timeline)
    # The peak holds at least one gathered bucket on top of the model state.
    largest_bucket = max(sum(program.plan.param(f).padded_numel * 4 for f in b) for b in program.plan.gather_buckets)
    assert report.peak.live_bytes >= persistent + largest_bucket
    # At the end of forward the saved activations are alive: at least the largest of them.
    fw = program.graph_modules(0)["forward"]
    end_of_forward = [p for p in report.timeline if p.graph == "forward"][-1]
    saved = [a for a in meta.output_node(fw.graph).args[0][1:] if a.op != "placeholder"]
    assert end_of_forward.live_bytes >= persistent + max(a.meta["val"].numel() * 4 for a in saved)
    # Stage 0 all-reduces full gradients, stage 3 keeps only shards: after backward, stage 0
    # holds N times the gradient bytes of stage 3 (padding aside).
    stage0 = meta_program(0, 2, **SMALL_BUCKETS).report(0)
    grads0 = stage0.timeline[-1].live_bytes - stage0.persistent_bytes
    grads3 = report.timeline[-1].live_bytes - persistent
    assert grads0 == pytest.approx(2 * grads3, rel=0.01)


@pytest.mark.parametrize("stage", [2, 3])
def test_gloo_collectives_hold_a_copy_of_their_buffer_from_issue_to_wait(stage: int) -> None:
    # NOTE [gloo copies a collective's buffer]: with the profile's collective_copies, each point of
    # the timeline holds the whole buffers of the all-gathers and reduce-scatters issued and not
    # yet waited on, and nothing more; at the end of each graph every one has been waited on.
    # gloo's own reduce-scatter (not the all-to-all zerofx issues there by default).
    functional = torch.ops._c10d_functional
    program = meta_program(stage, 2, own={"reduce_scatter_by_all_to_all": False}, **SMALL_BUCKETS)
    plain = program.report(0)
    copied = program.report(0, comm=dataclasses.replace(CPU_GLOO, collective_copies=True))
    assert copied.step_s == plain.step_s and copied.peak.live_bytes > plain.peak.live_bytes
    expected, issued = [], 0
    for graph in ("forward", "backward"):
        in_flight: dict[torch.fx.Node, int] = {}
        for node in program.graph_modules(0)[graph].graph.nodes:
            if node.target in (functional.all_gather_into_tensor_out.default, functional.all_gather_into_tensor.default):
                in_flight[node] = node.meta["val"].numel() * node.meta["val"].element_size()
            elif node.target is functional.reduce_scatter_tensor.default:
                in_flight[node] = node.args[0].meta["val"].numel() * node.args[0].meta["val"].element_size()
            issued += node in in_flight
            expected.append(sum(in_flight.values()))
            if node.target is functional.wait_tensor.default:
                in_flight.pop(node.args[0], None)
        assert not in_flight
    assert issued and [c.live_bytes - p.live_bytes for c, p in zip(copied.timeline, plain.timeline)] == expected


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_saved_view_of_a_parameter_is_not_counted_again(stage: int) -> None:
    # NOTE [A saved view of an input is that input]: every linear saves its weight's transpose, a
    # view of the parameter (at stage 3, of its gathered bucket or its shard), and the parameter
    # is in the model state already.
    from zerofx.cost_models.memory_timeline import aliases_of_inputs, graph_timeline

    program = meta_program(stage, 2, **SMALL_BUCKETS)
    gms = program.graph_modules(0)
    forward, backward = gms["forward"], gms["backward"]
    saved = [a for a in meta.output_node(forward.graph).args[0][1:] if isinstance(a, torch.fx.Node)]
    aliases = aliases_of_inputs(forward)
    views_of_inputs = [a for a in saved if a.name in aliases and a.op == "call_function"]
    if stage < 3:
        assert any(a.target is torch.ops.aten.t.default for a in views_of_inputs)  # the weights' transposes
    counted = [a.name for a in saved if a.name not in aliases]
    report = program.report(0)
    entering_backward = next(p for p in report.timeline if p.graph == "backward")
    alone = graph_timeline(backward, "backward", counted_inputs=counted)[0]
    assert entering_backward.live_bytes == report.persistent_bytes + alone.live_bytes
    with_views = graph_timeline(backward, "backward", counted_inputs=[a.name for a in saved])[0]
    assert with_views.live_bytes - alone.live_bytes == sum(a.meta["val"].numel() * a.meta["val"].element_size()
                                                           for a in saved if a.name in aliases)
    if stage < 3:
        assert with_views.live_bytes > alone.live_bytes


@pytest.mark.parametrize("stage", [2, 3])
def test_a_collectives_new_buffers_pay_their_page_faults(stage: int) -> None:
    # NOTE [A collective's new buffers fault in]: each all-gather and reduce-scatter takes its new
    # output (not an out= one's) and, where the backend copies, that copy, at fresh_s_per_byte.
    # gloo's own reduce-scatter (not the all-to-all zerofx issues there by default).
    functional = torch.ops._c10d_functional
    program = meta_program(stage, 2, own={"reduce_scatter_by_all_to_all": False}, **SMALL_BUCKETS)
    faulting = dataclasses.replace(CPU_CORE, fresh_s_per_byte=1e-9, fresh_min_bytes=1.0)
    expected = {True: 0, False: 0}  # collective_copies -> new bytes over the step
    for gm in program.graph_modules(0).values():
        for node in gm.graph.nodes:
            if node.target in (functional.all_gather_into_tensor.default, functional.reduce_scatter_tensor.default):
                out = node.meta["val"].numel() * node.meta["val"].element_size()
                expected[False] += out
                expected[True] += out + (node.args[0].meta["val"].numel() * node.args[0].meta["val"].element_size()
                                         if node.target is functional.reduce_scatter_tensor.default else out)
            elif node.target is functional.all_gather_into_tensor_out.default:  # writes into its given output
                expected[True] += node.meta["val"].numel() * node.meta["val"].element_size()
    assert expected[False] > 0
    for copies in (False, True):
        comm = dataclasses.replace(CPU_GLOO, collective_copies=copies)
        plain = program.report(0, comm=comm, device=CPU_CORE)
        paged = program.report(0, comm=comm, device=faulting)
        assert sum(r.comm_s for r in paged.rows) - sum(r.comm_s for r in plain.rows) == pytest.approx(expected[copies] * 1e-9)
    # Buffers under fresh_min_bytes come from memory the allocator keeps: nothing to fault in.
    kept = dataclasses.replace(faulting, fresh_min_bytes=float(2**40))
    assert [r.comm_s for r in program.report(0, device=kept).rows] == [r.comm_s for r in program.report(0, device=CPU_CORE).rows]


@pytest.mark.parametrize("fold", ["off", "on"])
def test_zerofx_plan_reports_the_optimizer_step_of_several_micro_batches(tmp_path: Path, fold: str) -> None:
    # NOTE [An optimizer step of several micro-batches]: forward and backward once per
    # micro-batch, the update and its collectives once.
    from zerofx.app.cli import main

    reports = {}
    for accumulation in (1, 3):
        config = tmp_path / f"accumulation{accumulation}.json"
        config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
                                      "zero_optimization": {"stage": 2}, "zerofx": {"world_size": 2}}))
        for fmt in ("json", "table"):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main(["plan", "small", "--config", str(config), "--seq-len", "32", "--fold", fold, "--format", fmt]) == 0
            reports[accumulation, fmt] = out.getvalue()
    one, three = (json.loads(reports[a, "json"])["summary"] for a in (1, 3))
    assert one["micro_batches"] == 1 and one["optimizer_step_s"] == one["step_s"]
    assert three["step_s"] == pytest.approx(one["step_s"]) and 0 < three["micro_batch_s"] < three["step_s"]
    assert three["micro_batch_s"] >= three["compute_s"]["forward"] + three["compute_s"]["backward"]
    assert three["optimizer_step_s"] == pytest.approx(three["step_s"] + 2 * three["micro_batch_s"])
    assert "optimizer step of 3 micro-batches" in reports[3, "table"] and "optimizer step of" not in reports[1, "table"]


def test_the_memory_curve_copies_into_memory_already_mapped() -> None:
    # NOTE [The memory curve is mapped memory]: the curve's copies write into one destination per
    # size, so no new output's page faults (priced apart) enter the bandwidth (a clone per copy
    # allocated up to 128 new tensors per size), from a source written before.
    from torch.utils._python_dispatch import TorchDispatchMode

    from zerofx.app.calibrate import COPY_SIZES, measure_memory_curve

    class NewTensors(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0
            self.written: set[int] = set()  # data pointers of tensors some op has written
            self.unwritten_sources = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            schema = func._schema
            in_place = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
            view = any(r.alias_info is not None for r in schema.returns)
            self.count += not (in_place or view)
            if func is torch.ops.aten.copy_.default:
                self.unwritten_sources += args[1].data_ptr() not in self.written
            out = func(*args, **(kwargs or {}))
            if in_place:
                self.written.add(args[0].data_ptr())
            elif not view and func not in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default):
                self.written.add(out.data_ptr())
            return out

    with NewTensors() as counted:
        curve = measure_memory_curve(repeats=1)
    assert [size for size, _ in curve] == [float(s) for s in COPY_SIZES] and all(rate > 0 for _, rate in curve)
    assert len(COPY_SIZES) <= counted.count <= 2 * len(COPY_SIZES)  # a source and a destination per size
    # A source never written reads the shared zero page, from cache: every copy reads written memory.
    assert counted.unwritten_sources == 0


def test_a_profile_warns_in_a_process_with_another_malloc_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [A profile holds for its allocator]: a CPU profile calibrated with the threshold at
    # 256 KiB, loaded where it is unset (and the other way round), warns once; under its own
    # setting, or for a built-in profile, it does not.
    from zerofx.cost_models.profiles import FRESH_PROBE_BYTES, allocator_mismatch, load_profile, save_profile

    calibrated = DeviceSpec("calibrated-cpu-core", 1e11, 5e9, fresh_s_per_byte=2e-10, fresh_min_bytes=262144.0)
    path = tmp_path / "profile.json"
    save_profile(path, CPU_GLOO, calibrated)
    assert allocator_mismatch(calibrated, "262144") is None
    assert "MALLOC_MMAP_THRESHOLD_=262144" in allocator_mismatch(calibrated, None)
    assert "unset" in allocator_mismatch(dataclasses.replace(calibrated, fresh_min_bytes=float(FRESH_PROBE_BYTES)), "262144")
    assert allocator_mismatch(CPU_CORE, None) is None
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "262144")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile(str(path))
        load_profile("cpu")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    with pytest.warns(UserWarning, match="calibrated with MALLOC_MMAP_THRESHOLD_=262144, and this process runs with MALLOC_MMAP_THRESHOLD_ unset"):
        load_profile(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile(str(path))  # once per profile and setting


def test_zerofx_plan_prices_with_the_configs_profile_unless_told_otherwise(tmp_path: Path) -> None:
    # A config's zerofx.profile sizes the plan's buckets and recompute; without --profile the
    # times are for it too, and --profile still wins.
    from zerofx.app.cli import main
    from zerofx.cost_models.profiles import save_profile

    profile = tmp_path / "profile.json"
    save_profile(profile, dataclasses.replace(CPU_GLOO, name="calibrated-gloo"), DeviceSpec("calibrated-cpu-core", 74e9, 2.2e9, cores=2))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "zerofx": {"world_size": 2, "profile": str(profile)}}))
    first_lines = {}
    for extra in ([], ["--profile", "cpu"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["plan", "tiny", "--config", str(config), "--seq-len", "32", *extra]) == 0
        first_lines[tuple(extra)] = out.getvalue().splitlines()[0]
    assert first_lines[()].endswith("profile calibrated-gloo / calibrated-cpu-core")
    assert first_lines[("--profile", "cpu")].endswith("profile cpu-gloo / cpu-core")
