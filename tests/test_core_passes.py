"""Structural checks on the rewritten graphs: which collectives, in what order, how many bytes,
and what the stage-3 forward saves for backward. Planning only: no process group, meta models."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.fx as fx

import zerofx
from zerofx.passes import ZeroStage, _compat, meta, partition_joint, plan_sharding, reduce_grads_pass, shard_params_pass
from zerofx.cost_models.comm import CPU_GLOO, efficient_bucket_bytes, estimate_all_gather_s, estimate_all_reduce_s
from zerofx.passes.analysis.check_collectives import collective_sequence, first_divergence
from zerofx.passes.plan import Plan
from zerofx.passes.zero.plan_buckets import choose_prefetch_distance, plan_buckets
from zerofx.passes.zero.gather_into_buffers import gather_into_buffers_pass
from zerofx.passes.zero.schedule_overlap import prefetch_gathers_pass, sink_reduce_waits_pass
from zerofx.compiler.pipeline import lower
from tests.support.models import BATCH, SEQ, TINY
from tests.support.programs import SMALL_BUCKETS, meta_program
from zerofx.models import DNA_LM_SIZES, DNADecoderLM, DNALMConfig


def collectives(gm: fx.GraphModule) -> list[tuple[str, str, int]]:
    """(kind, bucket fqns, bytes in per rank) of each collective, in graph order."""
    kinds = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}
    out = []
    for n in gm.graph.nodes:
        if meta.is_collective(n):
            inp = n.args[0].meta["val"]
            out.append((kinds[meta.collective_name(n)], n.meta[meta.COMM_FQNS], inp.numel() * inp.element_size()))
    return out


def saved_for_backward(fw: fx.GraphModule) -> list[fx.Node]:
    return list(meta.output_node(fw.graph).args[0][1:])


def gathered_full_params_saved(fw: fx.GraphModule) -> list[str]:
    """Saved values computed from a gathered parameter alone (the parameter, its transpose...)."""
    saved = set(saved_for_backward(fw))
    gathers = [g for g in fw.graph.nodes if meta.is_all_gather(g)]
    chains = meta.derived_only_from(fw.graph, gathers, set())
    return [n.name for chain in chains.values() for n in chain if n in saved]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_collectives_per_stage(stage: int) -> None:
    world_size = 4
    program = meta_program(stage, world_size, **SMALL_BUCKETS)
    plan = program.plan
    mods = program.graph_modules(rank=0)
    trainable = {p.fqn for p in plan.params if p.requires_grad}
    fwd, bwd = collectives(mods["forward"]), collectives(mods["backward"])

    def shard_bytes(bucket: tuple[str, ...]) -> int:
        return sum(plan.param(f).shard_numel * 4 for f in bucket)

    def padded_bytes(bucket: tuple[str, ...]) -> int:
        return sum(plan.param(f).padded_numel * 4 for f in bucket)

    if stage == 3:
        # Every parameter, frozen ones included, is gathered by bucket in first-use order.
        assert len(plan.gather_buckets) > 2
        assert [f for _, f, _ in fwd] == list(plan.gather_buckets)
        assert [x for b in plan.gather_buckets for x in b] == list(plan.gather_order)
        assert set(plan.gather_order) == {p.fqn for p in plan.params}
        assert all(k == "all_gather" and b == shard_bytes(f) for k, f, b in fwd)
        assert all(padded_bytes(b) <= 3000 * 4 or len(b) == 1 for b in plan.gather_buckets)
    else:
        assert fwd == []
    grad_kind = "reduce_scatter" if stage >= 1 else "all_reduce"
    # Stage 1 reduce-scatters once per optimizer step, in grad_sync; backward communicates nothing.
    grad_graph = collectives(mods["grad_sync"]) if stage == 1 else bwd
    reductions = [(f, b) for k, f, b in grad_graph if k == grad_kind]
    assert len(plan.reduce_buckets) > 2
    assert [f for f, _ in reductions] == list(plan.reduce_buckets)
    assert {x for b in plan.reduce_buckets for x in b} == trainable
    assert all(b == padded_bytes(f) for f, b in reductions)
    assert {k for k, _, _ in bwd} == ({"all_gather", grad_kind} if stage == 3 else set() if stage == 1 else {grad_kind})
    assert ("grad_sync" in mods) == (stage == 1)
    if stage in (1, 2):
        sync = collectives(mods["param_sync"])
        assert [f for _, f, _ in sync] == list(plan.sync_buckets)
        assert [x for b in plan.sync_buckets for x in b] == list(plan.reduce_order)
        assert all(b == shard_bytes(f) for _, f, b in sync)
    else:
        assert "param_sync" not in mods
    # The plan's schedule is exactly what the graphs issue.
    issued = collections.Counter((k, f, g, b) for g, gm in mods.items() for k, f, b in collectives(gm))
    planned = collections.Counter((c.kind.value, c.fqns, c.graph, c.bytes_per_rank) for c in plan.schedule)
    assert issued == planned
    for gm in mods.values():
        gm.graph.lint()


def _positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _wait(node: fx.Node) -> fx.Node:
    return next(u for u in node.users if meta.is_wait(u))


@pytest.mark.parametrize("overlap", [True, False])
def test_prefetch_and_wait_placement(overlap: bool) -> None:
    program = meta_program(3, 4, overlap_comm=overlap, **SMALL_BUCKETS)
    assert program.plan.prefetch_distance == (1 if overlap else 0)
    for name in ("forward", "backward"):
        gm = program.graph_modules(0)[name]
        pos = _positions(gm)
        gathers = [n for n in gm.graph.nodes if meta.is_all_gather(n)]
        for k, g in enumerate(gathers):
            if overlap and k >= 1:
                # Issued right after the previous bucket's wait (only its pack in between), so
                # it runs while the previous bucket computes (and the allocation of its buffer).
                prev_wait = _wait(gathers[k - 1])
                assert pos[prev_wait] < pos[g] < pos[_wait(g)]
                between = list(gm.graph.nodes)[pos[prev_wait] + 1 : pos[g]]
                assert all(n.target in (torch.ops.aten.cat.default, torch.ops.aten.new_empty.default) for n in between)
            else:
                assert _wait(g) is g.next  # issued and waited back to back
    bw = program.graph_modules(0)["backward"]
    pos = _positions(bw)
    reductions = [n for n in bw.graph.nodes if meta.is_reduce_scatter(n)]
    # On gloo a reduce-scatter is an all-to-all whose wait a view and a sum follow (NOTE [gloo's
    # reduce-scatter as an all-to-all]): they belong to the reduction, not to backward's compute.
    assert reductions and all(meta.is_reduce_scatter_by_all_to_all(r) for r in reductions)
    summed = {n for r in reductions for v in _wait(r).users for n in (v, *v.users)}
    assert all(n.target in (torch.ops.aten.view.default, torch.ops.aten.sum.dim_IntList) for n in summed)
    compute_after = [n for n in bw.graph.nodes if n.op == "call_function" and not meta.is_wait(n) and n not in summed
                     and n.target not in (torch.ops.aten.div.Tensor, torch.ops.aten.slice.Tensor)]
    assert len(reductions) >= 3
    for i, r in enumerate(reductions):
        if overlap:
            # Waited for as late as the in-flight bound allows (NOTE [A reduction holds its
            # input until its wait]): after the next bucket's gradients are computed, right
            # before the next reduction is issued; the last one after all other backward work.
            if i + 1 < len(reductions):
                nxt = reductions[i + 1]
                assert pos[_wait(r)] < pos[nxt]
                between = list(bw.graph.nodes)[pos[_wait(r)] : pos[nxt]]
                assert all(n.target in (torch.ops.aten.div.Tensor, torch.ops.aten.slice.Tensor) or meta.is_wait(n) or n in summed
                           for n in between), between
                assert pos[_wait(r)] > max(pos[n] for n in compute_after if pos[n] < pos[nxt] and n is not r)
            else:
                assert pos[_wait(r)] > max(pos[n] for n in compute_after)
        else:
            assert _wait(r) is r.next


def test_param_sync_writes_each_bucket_in_place() -> None:
    """Stages 1-2: the parameter all-gather after the step copies each bucket into the engine's
    full flats (inputs) right after its wait, so one gathered bucket is alive at a time, not a
    second copy of the whole model."""
    from zerofx.cost_models.memory_timeline import graph_timeline
    sync = meta_program(2, 4, **SMALL_BUCKETS).graph_modules(0)["param_sync"]
    gathers = [n for n in sync.graph.nodes if meta.is_all_gather(n)]
    assert len(gathers) >= 3
    bucket_bytes = [g.meta["val"].numel() * g.meta["val"].element_size() for g in gathers]
    fulls = [n for n in sync.graph.nodes if n.op == "placeholder" and n.name.startswith("full_")]
    outputs = meta.output_node(sync.graph).args[0]
    assert len(outputs) == len(fulls) and all(o.target is torch.ops.aten.copy_.default for o in outputs)
    peak = max(p.live_bytes for p in graph_timeline(sync, "param_sync"))
    assert max(bucket_bytes) <= peak < 2 * max(bucket_bytes) < sum(bucket_bytes)


def test_reductions_in_flight_are_bounded() -> None:
    """NOTE [A reduction holds its input until its wait]: with the overlap, no point of the
    backward has more than REDUCTIONS_IN_FLIGHT reductions issued and not yet waited for."""
    from zerofx.passes.zero.schedule_overlap import REDUCTIONS_IN_FLIGHT
    bw = meta_program(3, 4, overlap_comm=True, **SMALL_BUCKETS).graph_modules(0)["backward"]
    in_flight, most = set(), 0
    for n in bw.graph.nodes:
        if meta.is_reduce_scatter(n):
            in_flight.add(n)
            most = max(most, len(in_flight))
        elif meta.is_wait(n):
            in_flight.discard(n.args[0])
    assert most == REDUCTIONS_IN_FLIGHT


def test_memory_model_holds_a_collective_input_until_its_wait() -> None:
    """A reduce-scatter's input stays counted until its wait_tensor, not its issue."""
    from zerofx.cost_models.memory_timeline import graph_timeline
    graph = fx.Graph()
    x = graph.placeholder("x")
    big = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    rs = graph.call_function(torch.ops._c10d_functional.reduce_scatter_tensor.default, (big, "sum", 2, "0"))
    other = graph.call_function(torch.ops.aten.mul.Tensor, (x, 3.0))
    done = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (rs,))
    graph.output((done, other))
    x.meta["val"], big.meta["val"] = torch.empty(1000), torch.empty(1000)
    rs.meta["val"], done.meta["val"], other.meta["val"] = torch.empty(500), torch.empty(500), torch.empty(1000)
    live = {p.node: p.live_bytes for p in graph_timeline(fx.GraphModule(torch.nn.Module(), graph), "g")}
    # After "other": big (4000, held by the reduction), rs's output (2000), other (4000).
    assert live[other.name] == 4000 + 2000 + 4000

def test_bucket_planner_closed_form() -> None:
    sizes = {"a": 10, "b": 10, "c": 30, "d": 5, "e": 5, "f": 100}
    assert plan_buckets("abcdef", sizes, 25) == (("a", "b"), ("c",), ("d", "e"), ("f",))
    assert plan_buckets("abcdef", sizes, 1000) == (tuple("abcdef"),)
    assert plan_buckets("abcdef", sizes, 1) == tuple((x,) for x in "abcdef")
    # Two buckets alive at once (current + one prefetched) must fit the live-element limit.
    assert choose_prefetch_distance([10, 10, 10], 20, preferred=1) == 1
    assert choose_prefetch_distance([10, 30, 10], 20, preferred=1) == 0
    assert choose_prefetch_distance([10, 10, 10, 10], 30, preferred=3) == 2
    assert choose_prefetch_distance([10], float("inf"), preferred=0) == 0


def test_default_buckets_come_from_the_comm_model() -> None:
    # 90% of ring time on the wire: B >= N * bw * alpha * 0.9 / 0.1.
    alpha, bandwidth = CPU_GLOO.link(4)
    assert efficient_bucket_bytes(4, CPU_GLOO) == int(4 * bandwidth * alpha * 0.9 / 0.1)
    plan = meta_program(3, 4).plan  # the tiny model is smaller than one efficient bucket
    # ... so the buckets are exactly the block boundaries: embedding, each block, final norm.
    def owners(buckets: tuple[tuple[str, ...], ...]) -> list[str]:
        return [b[0].split(".")[0] + (f".{b[0].split('.')[1]}" if b[0].startswith("blocks.") else "") for b in buckets]

    assert owners(plan.gather_buckets) == ["embed", "blocks.0", "blocks.1", "norm"]
    assert owners(plan.reduce_buckets) == ["norm", "blocks.1", "blocks.0", "embed"]
    assert all(len({f.split(".")[1] for f in b}) == 1 for b in plan.gather_buckets if b[0].startswith("blocks."))
    # Ring all-gather: (N - 1) steps of alpha + B / (N bw).
    assert estimate_all_gather_s(4e6, 4, CPU_GLOO) == pytest.approx(3 * (alpha + 1e6 / bandwidth))
    assert estimate_all_reduce_s(4e6, 4, CPU_GLOO) == pytest.approx(2 * 3 * (alpha + 1e6 / bandwidth))


def test_collective_sequence_divergence_is_named() -> None:
    program = meta_program(3, 4, **SMALL_BUCKETS)
    same = collective_sequence(program.graph_modules(0))
    assert first_divergence([same, same, same]) is None
    other = collective_sequence(meta_program(3, 4, stage3_prefetch_bucket_size=1000).graph_modules(0))
    msg = first_divergence([same, same, other])
    # The embedding's bucket is the same either way; the first block's is where the sizes differ.
    assert msg is not None and "rank 2" in msg and "forward collective #1" in msg and "all_gather_into_tensor" in msg


def test_stage3_forward_saves_only_shards() -> None:
    program = meta_program(3, 4, **SMALL_BUCKETS)
    fw = program.graph_modules(0)["forward"]
    assert gathered_full_params_saved(fw) == []
    shard_sizes = {p.shard_numel for p in program.plan.params}
    for node in saved_for_backward(fw):
        if node.op == "placeholder" and node.meta.get(meta.ROLE) is meta.Role.PARAM:
            assert tuple(node.meta["val"].shape) in {(s,) for s in shard_sizes}


def test_saved_check_catches_untagged_gathers() -> None:
    """Without the recompute tags, the partitioner saves gathered parameters: the check above
    would fail, so it is not vacuous."""
    program = meta_program(3, 4, **SMALL_BUCKETS)
    gm = meta.clone_graph_module(program.captured.joint)
    gm = shard_params_pass(gm, program.plan, group_name="g")
    for n in gm.graph.nodes:
        n.meta.pop("recompute", None)
    fw, _ = partition_joint(reduce_grads_pass(gm, program.plan, group_name="g"))
    assert gathered_full_params_saved(fw)


def test_passes_idempotent_and_noop_below_stage3() -> None:
    program = meta_program(3, 2, **SMALL_BUCKETS)
    gm = meta.clone_graph_module(program.captured.joint)
    gm = reduce_grads_pass(shard_params_pass(gm, program.plan, group_name="g"), program.plan, group_name="g")
    code = gm.code
    gm = reduce_grads_pass(shard_params_pass(gm, program.plan, group_name="g"), program.plan, group_name="g")
    assert gm.code == code
    stage2 = meta_program(2, 2)
    joint = meta.clone_graph_module(stage2.captured.joint)
    before = joint.code
    assert shard_params_pass(joint, stage2.plan, group_name="g") is joint and joint.code == before
    scheduled = lower(program.captured.joint, program.plan, group_name="g", disabled=["gather_into_buffers_pass"])
    for gm in scheduled.values():  # already scheduled: moving again changes nothing
        code = gm.code
        gm = sink_reduce_waits_pass(prefetch_gathers_pass(gm, program.plan), program.plan)
        assert gm.code == code
    for gm in program.graph_modules(0).values():  # no functional all-gather is left to replace
        code = gm.code
        assert gather_into_buffers_pass(gm).code == code
    # The captured joint graph itself is never modified by lowering.
    assert program.captured.joint.code == meta_program(3, 2).captured.joint.code


def test_padding_of_uneven_parameters() -> None:
    plan = meta_program(3, 4).plan
    norm = plan.param("blocks.0.attn_norm.weight")  # 30 elements over 4 ranks
    assert (norm.numel, norm.shard_numel, norm.padded_numel) == (30, 8, 32)
    assert norm.owned_range(3) == (24, 30)
    assert not norm.requires_grad  # frozen
    assert "head.weight" not in {p.fqn for p in plan.params}  # tied: one tensor, one shard


@pytest.mark.parametrize("world_size", [8, 1024])
def test_plan_large_world_on_meta(world_size: int) -> None:
    program = meta_program(3, world_size, cfg=DNA_LM_SIZES["small"], frozen=False)
    plan = program.plan
    mem = program.memory(rank=world_size - 1)
    p = plan.num_params
    total = sum(mem.values())
    # 16 bytes per parameter over N (fp32 params, grads and Adam's two states), plus padding and
    # Adam's 4-byte step per tensor.
    assert total >= 16 * p / world_size
    padding = sum(q.padded_numel - q.numel for q in plan.params)
    assert total <= 16 * (p + padding) / world_size + 4 * len(plan.params)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.fingerprint() == Plan.from_json(plan.to_json()).fingerprint()
    text = str(plan)
    assert f"world size {world_size}" in text and "all_gather" in text


def test_billion_parameter_plan_allocates_nothing() -> None:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # 1.2B parameters in 6 wide layers: the widths of a 7B model, fewer layers to keep the test quick.
    wide = DNALMConfig(dim=4096, num_layers=6, num_heads=32, ffn_dim=11008, max_seq_len=1024)
    program = meta_program(3, 1024, cfg=wide, frozen=False)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert program.plan.num_params > 1e9
    assert grown_kib * 1024 < 0.2 * 4 * program.plan.num_params  # far below one fp32 copy
    assert program.plan.stage is ZeroStage.THREE


def test_planner_is_read_only() -> None:
    program = meta_program(2, 2)
    before = program.captured.joint.code
    plan_sharding(program.captured.joint, world_size=3, stage=ZeroStage.THREE, optimizer="AdamW")
    assert program.captured.joint.code == before


def test_small_parameters_persist_unsharded() -> None:
    program = meta_program(3, 4, stage3_param_persistence_threshold=100, **SMALL_BUCKETS)
    plan = program.plan
    small = {p.fqn for p in plan.params if p.numel < 100}
    assert small and set(plan.persistent) == small  # the RMSNorm weights (30 elements)
    mods = program.graph_modules(0)
    gathered = {f for _, bucket, _ in collectives(mods["forward"]) for f in bucket}
    assert gathered == {p.fqn for p in plan.params} - small
    # They enter forward whole; after the step their updated shards are all-gathered.
    for ph in meta.placeholders(mods["forward"].graph, meta.Role.PARAM):
        if ph.meta[meta.FQN] in small:
            assert tuple(ph.meta["val"].shape) == plan.param(ph.meta[meta.FQN]).shape
    synced = [f for _, bucket, _ in collectives(mods["param_sync"]) for f in bucket]
    assert set(synced) == {f for f in small if plan.param(f).requires_grad}
    base = meta_program(3, 4, **SMALL_BUCKETS).plan.estimates
    extra = sum((plan.param(f).padded_numel - plan.param(f).shard_numel) * 4 for f in small)
    assert plan.estimates["params"] == base["params"] + extra


def _rewritten_joint(program: zerofx.Program) -> fx.GraphModule:
    gm = meta.clone_graph_module(program.captured.joint)
    return reduce_grads_pass(shard_params_pass(gm, program.plan, group_name="g"), program.plan, group_name="g")


@pytest.mark.parametrize("kind", ["dna_stage3", "llama_stage3"])
def test_cse_merges_what_the_partitioners_cse_merges(kind: str) -> None:
    """passes.cse replaces the min-cut partitioner's own CSE (NOTE [Our own CSE instead of the
    partitioner's]): on real joints it must produce the same graph, node for node."""
    from torch._functorch.compile_utils import fx_graph_cse

    from zerofx.passes.cse import eliminate_common_subexpressions
    from tests.support.models import llama

    if kind == "llama_stage3":
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        program = zerofx.compile(llama(), world_size=4, stage=3, config={"zero_optimization": SMALL_BUCKETS},
                                 example_inputs=(ids,), example_kwargs={"labels": ids})
    else:
        program = meta_program(int(kind[-1]), 4, **SMALL_BUCKETS)
    joint = _rewritten_joint(program)
    theirs = fx.GraphModule(joint, fx_graph_cse(meta.clone_graph_module(joint).graph))
    ours = eliminate_common_subexpressions(meta.clone_graph_module(joint))
    assert len(ours.graph.nodes) < len(joint.graph.nodes), "nothing to merge: the comparison would be vacuous"
    assert ours.code == theirs.code


def test_cse_keeps_random_ops_and_collectives_apart() -> None:
    from zerofx.passes.cse import eliminate_common_subexpressions

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)
    draws = [graph.call_function(torch.ops.aten.rand_like.default, (x,)) for _ in range(2)]
    gathers = [graph.call_function(_compat.ALL_GATHER, (x, 2, "g")) for _ in range(2)]
    twins = [graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)) for _ in range(2)]
    signed = graph.call_function(torch.ops.aten.mul.Tensor, (x, -0.0))
    zero = graph.call_function(torch.ops.aten.mul.Tensor, (x, 0.0))
    graph.output([*draws, *gathers, *twins, signed, zero])
    gm = eliminate_common_subexpressions(fx.GraphModule(torch.nn.Module(), graph))
    kept = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in kept].count(torch.ops.aten.rand_like.default) == 2
    assert [n.target for n in kept].count(_compat.ALL_GATHER) == 2
    assert len([n for n in kept if n.target is torch.ops.aten.mul.Tensor]) == 3  # the twins merged; -0.0 and 0.0 did not


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_graphs_write_into_no_buffer(stage: int) -> None:
    """NOTE [Who owns a collective's buffers]: the only in-place or out= ops in the forward and
    backward graphs are the all-gathers, each into a ``new_empty`` buffer that nothing else uses,
    so nothing in them can write into a collective's input or output while it is in flight; only
    param_sync also writes (copy_ into the full flats), each right after its bucket's wait."""
    gms = meta_program(stage, 4, **SMALL_BUCKETS).graph_modules(0)
    for gm in gms.values():
        for n in gm.graph.nodes:
            if n.op == "call_function" and _mutates(n) and meta.is_all_gather(n):
                buffer = n.kwargs["out"]
                assert buffer.target is torch.ops.aten.new_empty.default and list(buffer.users) == [n], n.format_node()
    for name in ("forward", "backward"):
        mutating = [n.format_node() for n in gms[name].graph.nodes
                    if n.op == "call_function" and _mutates(n) and not meta.is_all_gather(n)]
        assert mutating == [], (stage, name, mutating[:3])
    for sync in ("grad_sync", "param_sync"):  # grad_sync (stage 1) writes the reduced shards into the gradient buffers
        if sync not in gms:
            continue
        nodes = list(gms[sync].graph.nodes)
        for i, n in enumerate(nodes):
            if n.op == "call_function" and _mutates(n) and not meta.is_all_gather(n):
                assert n.target is torch.ops.aten.copy_.default, n.format_node()
                waits = [m for m in nodes[:i] if meta.is_wait(m)]
                source = n.args[1]
                while source.op == "call_function" and not meta.is_wait(source):
                    source = source.args[0]
                assert source in waits, n.format_node()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_functional_all_gather_is_left(stage: int) -> None:
    """NOTE [gloo's completion race]: every all-gather in the lowered graphs runs as
    ``all_gather_into_tensor_out`` (gloo's ``_ALLGATHER_BASE``), never as the functional op that
    gloo runs as ``ALLGATHER_COALESCED``; the plan still names it ``all_gather_into_tensor``."""
    program = meta_program(stage, 4, **SMALL_BUCKETS)
    gathers = 0
    for gm in program.graph_modules(0).values():
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert _compat.ALL_GATHER not in targets
        gathers += targets.count(_compat.ALL_GATHER_INTO)
    assert gathers > 0
    assert {c.op for c in collective_sequence(program.graph_modules(0))} <= {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"}


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)  # an aten or c10d OpOverload
    return schema is not None and schema.is_mutable


def test_replan_equals_a_new_capture_and_refuses_what_capture_fixed() -> None:
    """``Program.replan`` (NOTE [Planning again from one capture]): the same plan and the same
    lowered code as compiling anew, and a clear refusal for settings the capture depends on."""
    replanned = meta_program(3, 4, **SMALL_BUCKETS)  # planned again from a stage-0, 1-rank capture
    with torch.device("meta"):
        model = DNADecoderLM(TINY)
    model.blocks[0].attn_norm.weight.requires_grad_(False)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    fresh = zerofx.compile(model, world_size=4, config={"zero_optimization": {"stage": 3, **SMALL_BUCKETS}},
                           example_inputs=(ids,), example_kwargs={"labels": ids})
    assert replanned.plan == fresh.plan and replanned.world_size == 4 and replanned.stage == 3
    assert {k: gm.code for k, gm in replanned.graph_modules(0).items()} == {k: gm.code for k, gm in fresh.graph_modules(0).items()}
    assert replanned.replan(stage=1).plan == replanned.replan({"zero_optimization": {"stage": 1, **SMALL_BUCKETS}}).plan
    for config, words in (({"bf16": {"enabled": True}}, "the compute dtype"),
                          ({"zerofx": {"tiling": {"enabled": True}}}, "zerofx.tiling"),
                          ({"zerofx": {"sequence_parallel": {"size": 2}}}, "zerofx.sequence_parallel")):
        with pytest.raises(zerofx.ZeroFXError, match=f"program.replan cannot change {words}"):
            replanned.replan(config, world_size=2, stage=3)
    with pytest.raises(zerofx.MissingExampleInputsError, match="program.replan"):
        zerofx.compile(model, world_size=2, stage=3).replan(stage=1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reduce_scatters_issued_as_all_to_alls_on_gloo(stage: int) -> None:
    # NOTE [gloo's reduce-scatter as an all-to-all]: planned for gloo (the cpu profile, or a gloo
    # group), every reduce-scatter becomes an all-to-all of the same input, one equal split per
    # rank, whose wait a sum over the received chunks follows, shaped as the shard; planned for
    # NCCL (the h100 profile) they stay reduce-scatters; the config key overrides either.
    functional = torch.ops._c10d_functional

    def reductions(program: zerofx.Program) -> tuple[list[fx.Node], list[fx.Node]]:
        nodes = [n for gm in program.graph_modules(0).values() for n in gm.graph.nodes]
        return ([n for n in nodes if n.target is functional.reduce_scatter_tensor.default],
                [n for n in nodes if n.target is functional.all_to_all_single.default])

    for own, lowered in (({}, True), ({"profile": "h100"}, False), ({"reduce_scatter_by_all_to_all": False}, False),
                         ({"profile": "h100", "reduce_scatter_by_all_to_all": True}, True)):
        program = meta_program(stage, 4, own=own, **SMALL_BUCKETS)
        native, exchanges = reductions(program)
        assert program.plan.reduce_scatter_by_all_to_all is lowered, own
        assert ("reduce-scatters issued as all-to-alls" in str(program.plan)) is (lowered and stage > 0)
        if not lowered:
            assert len(native) == len(program.plan.reduce_buckets) > 2 and not exchanges, own
            continue
        assert not native and len(exchanges) == len(program.plan.reduce_buckets) > 2, own
        for a2a in exchanges:
            assert meta.is_reduce_scatter(a2a) and meta.is_reduce_scatter_by_all_to_all(a2a) and not meta.is_all_to_all(a2a)
            assert meta.collective_name(a2a) == "reduce_scatter_tensor" and a2a.meta[meta.COMM_FQNS]
            numel = a2a.args[0].meta["val"].numel()
            assert a2a.args[1] == a2a.args[2] == [numel // 4] * 4
            (wait,) = a2a.users
            (view,) = wait.users
            (summed,) = view.users
            assert view.target is torch.ops.aten.view.default and view.args[1] == [4, numel // 4]
            assert summed.target is torch.ops.aten.sum.dim_IntList and summed.args[1] == [0]
            assert tuple(summed.meta["val"].shape) == (numel // 4,)
        # The rank's collective sequence names them as the reduce-scatters they are.
        calls = collective_sequence(program.graph_modules(0))
        assert sum(c.op == "reduce_scatter_tensor" and c.group_size == 4 for c in calls) == len(exchanges)
