"""Sequence tiling (issue #8): which ops get tiled, that the tiled graphs never hold an n x n
tensor, parity of the tiled step with eager PyTorch (loss and gradients within 1e-5, fp32) in
one process and through the engine at stages 0 and 3 on 2 gloo ranks, and clear errors.
"""

from __future__ import annotations

import re
import collections
import logging

import pytest
import torch
import torch.nn.functional as F

import zerofx
from zerofx.passes import partition_joint, tiled_kernels  # noqa: F401  (registers zerofx:: ops)
from zerofx.passes.plan import Plan
from zerofx.passes.plan.tiling import TilingOptions
from tests.support.dist_utils import run_ranks
from tests.test_core_passes import collectives
from tests.support.tiling_models import BATCH, SEQ, dna_lm, llama, padding_mask, softmax_lm, tokens
from tests.support.tiling_workers import tiled_vs_untiled
from zerofx.compiler.capture import flatten_call
from zerofx.compiler.pipeline import capture_step
from zerofx.config import parse_bytes
from zerofx.common.errors import ConfigError

ON = TilingOptions(enabled=True, block_size=16, attention_block_size=16)
OFF = TilingOptions(enabled=False)
TOL = 1e-5
zf = torch.ops.zerofx


def run_partitioned(model, args, kwargs, tiling):
    """Capture, partition with the min-cut partitioner, and run the forward and backward graphs
    on the model's real tensors: the loss, the gradients by FQN, and both graphs."""
    cap = capture_step(model, args, kwargs, tiling=tiling)
    fw, bw = partition_joint(cap.joint)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    flat = [params[p.fqn].detach() for p in cap.params] + [buffers[b.fqn] for b in cap.buffers]
    flat += flatten_call(cap, model, args, kwargs, None)
    loss, *saved = fw(*flat)
    grads = bw(*saved, torch.ones((), dtype=loss.dtype))
    return cap, loss, {p.fqn: g for p, g in zip(cap.params, grads)}, (fw, bw)


def eager(model, args, kwargs):
    out = model(*args, **kwargs)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [dict(model.named_parameters())[n] for n in names])
    return loss.detach(), dict(zip(names, grads))


def assert_parity(model, args, kwargs, tiling: TilingOptions = ON) -> tuple:
    ref_loss, ref_grads = eager(model, args, kwargs)
    cap, loss, grads, graphs = run_partitioned(model, args, kwargs, tiling)
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert ref_grads.keys() <= grads.keys()
    for name, g in ref_grads.items():
        assert (grads[name] - g).abs().max().item() < TOL, name
    return cap, graphs


def graph_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of ``gm`` and of the loop bodies it holds (NOTE [One body per tiled region])."""
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]


def square_tensors(graphs, seq: int = SEQ) -> list[tuple[str, tuple[int, ...]]]:
    """Nodes whose value has two dimensions of the full sequence length: an n x n tensor."""
    found = []
    for gm in graphs:
        for n in graph_nodes(gm):
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and sum(1 for d in v.shape if d == seq) >= 2:
                found.append((n.name, tuple(v.shape)))
    return found


def count(gm, target) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=target))


# --------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float64 runs the plain-tensor loops
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("causal", [True, False])
def test_blocked_attention_matches_sdpa(mask_kind: str, causal: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    keep = torch.ones(2, 37, dtype=torch.bool)
    keep[0, 25:] = False
    mask = {"none": None, "bool": keep[:, None, None, :], "additive": torch.where(keep, 0.0, -1e9).to(dtype)[:, None, None, :]}[mask_kind]
    ref_mask = mask
    if causal and mask is not None:  # SDPA rejects attn_mask with is_causal: fold the diagonal in
        tril = torch.ones(37, 37, dtype=torch.bool).tril()
        ref_mask = (mask & tril) if mask.dtype == torch.bool else mask.masked_fill(~tril, float("-inf"))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask, is_causal=causal and mask is None)
    out, lse = zf.blocked_attention(q, k, v, mask, causal, 8**-0.5, 8, 5)  # blocks that do not divide 37
    assert lse.shape == (2, 3, 37)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(ref, (q, k, v), g), torch.autograd.grad(out, (q, k, v), g)):
        assert (a - b).abs().max().item() < TOL
    assert (out - ref).abs().max().item() < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocked_attention_grouped_query_heads(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 6, 21, 8, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 2, 21, 8, dtype=dtype, requires_grad=True) for _ in range(2))  # 3 query heads per key/value head
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out, _ = zf.blocked_attention(q, k, v, None, True, 8**-0.5, 8, 5)
    assert (out - ref).abs().max().item() < TOL
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(ref, (q, k, v), g), torch.autograd.grad(out, (q, k, v), g)):
        assert a.shape == b.shape and (a - b).abs().max().item() < TOL


def test_chunked_loss_matches_cross_entropy() -> None:
    torch.manual_seed(0)
    h, w, b = torch.randn(50, 16, requires_grad=True), torch.randn(7, 16, requires_grad=True), torch.randn(7, requires_grad=True)
    t = torch.randint(0, 7, (50,))
    t[3] = -100
    ref = F.cross_entropy(F.linear(h, w, b), t, reduction="sum")
    out = zf.chunked_linear_cross_entropy(h, w, b, t, -100, 16)
    assert abs(ref.item() - out.item()) < TOL
    for x, y in zip(torch.autograd.grad(ref, (h, w, b)), torch.autograd.grad(out, (h, w, b))):
        assert (x - y).abs().max().item() < TOL


# --------------------------------------------------------------------------- rewrite, in one process
def test_dna_lm_sdpa_causal_regions_and_loss() -> None:
    model, ids = dna_lm(), tokens()
    cap, (fw, bw) = assert_parity(model, (ids,), {"labels": ids})
    kinds = [(op.kind, op.block_size) for op in cap.tiling.ops]
    # Two SDPA layers; five token-wise regions: the embedding, per layer the attention inputs (norm,
    # QKV, rotary) and then out-proj..MLP, the final norm; the loss.
    assert kinds == [("attention", 16)] * 2 + [("region", 16)] * 5 + [("loss", 16)]
    assert [op.what.endswith("attention inputs") for op in cap.tiling.ops if op.kind == "region"] == [False, True, False, True, False]
    assert count(fw, zf.blocked_attention.default) == 2 and count(bw, zf.blocked_attention_backward.default) == 2
    assert count(fw, zf.chunked_linear_cross_entropy.default) == 1
    assert count(fw, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) == 0
    # Each region is one loop in forward and one in backward per chunk length (16, and the last 8),
    # over one body each (NOTE [One body per tiled region]); the MLP's matmuls run in the bodies,
    # per chunk of 16 tokens (2 x 16 rows), in forward and again in backward.
    assert count(fw, torch.ops.higher_order.map_impl) == 5 * 2 and count(bw, torch.ops.higher_order.scan) == 5 * 2
    assert count(fw, torch.ops.aten.mm.default) == count(bw, torch.ops.aten.mm.default) == 0
    # Each backward loop stacks a per-chunk output, a scalar where only weights take gradients
    # (the embedding's): Inductor lowers no scan without one.
    scans = bw.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan)
    assert all(len(n.meta["val"]) > len(n.args[1]) for n in scans)
    mm_rows = {n.meta["val"].shape[0] for gm in (fw, bw) for n in graph_nodes(gm) if n.target is torch.ops.aten.mm.default}
    assert BATCH * SEQ not in mm_rows and BATCH * 16 in mm_rows and BATCH * 8 in mm_rows
    # Saved for backward: no (B, T, ffn) activation; untiled saves several.
    ffn = model.cfg.ffn_dim
    saved = [n.meta["val"].shape for n in fw.graph.output_node().args[0][1:]]
    assert not any(ffn in s and (SEQ in s or BATCH * SEQ in s) for s in saved)
    # Nor q, k and v: per layer only the attention's output (B, nh, T, hs) is kept; q, k and v are recomputed.
    heads = (BATCH, model.cfg.num_heads, SEQ, model.cfg.head_dim)
    assert sum(tuple(s) == heads for s in saved) == model.cfg.num_layers
    _, _, _, (fw0, _) = run_partitioned(model, (ids,), {"labels": ids}, OFF)
    saved0 = [n.meta["val"].shape for n in fw0.graph.output_node().args[0][1:]]
    assert any(ffn in s and BATCH * SEQ in s for s in saved0)


def test_loops_run_as_fx_code_match_torchs_operators() -> None:
    """Graphs run as FX code call ``run_map`` and ``run_scan`` for the tiled regions' loops
    (NOTE [One body per tiled region]): the same loss and gradients, bit for bit, as torch's
    ``map_impl`` and ``scan``, with chunks of two lengths (16, 16 and 8)."""
    from zerofx.passes.tiling.chunk_loop import eager_loops_pass, run_map, run_scan

    model, ids = dna_lm(), tokens()
    cap = capture_step(model, (ids,), {"labels": ids}, tiling=ON)
    fw, bw = partition_joint(cap.joint)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    flat = [params[p.fqn].detach() for p in cap.params] + [buffers[b.fqn] for b in cap.buffers]
    flat += flatten_call(cap, model, (ids,), {"labels": ids}, None)
    results = []
    for forward, backward in ((fw, bw), (eager_loops_pass(fw), eager_loops_pass(bw))):
        loss, *saved = forward(*flat)
        results.append((loss, backward(*saved, torch.ones((), dtype=loss.dtype))))
    eager_fw, eager_bw = eager_loops_pass(fw), eager_loops_pass(bw)
    assert count(eager_fw, run_map) == count(fw, torch.ops.higher_order.map_impl) > 0
    assert count(eager_bw, run_scan) == count(bw, torch.ops.higher_order.scan) > 0
    assert count(eager_fw, torch.ops.higher_order.map_impl) == count(eager_bw, torch.ops.higher_order.scan) == 0
    assert eager_loops_pass(eager_fw) is eager_fw  # nothing left to retarget: unchanged
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and all(a is b is None or torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_softmax_attention_with_padding_mask() -> None:
    model, ids, mask = softmax_lm(), tokens(vocab=7), padding_mask()
    kwargs = {"attention_mask": mask, "labels": ids}
    cap, graphs = assert_parity(model, (ids,), kwargs)
    # Written out, folded into SDPA before tiling plans (NOTE [Attention written out is SDPA]).
    assert [op.what for op in cap.tiling.ops if op.kind == "attention"] == ["sdpa attention masked"] * 2
    assert square_tensors(graphs) == []
    _, _, _, untiled = run_partitioned(model, (ids,), kwargs, OFF)
    assert square_tensors(untiled), "the untiled graphs hold the (B, H, T, T) scores; the check above can fail"


@pytest.mark.parametrize("kind,layers", [("spelled", 4), ("written", 1)])
def test_written_out_attention_tiles_without_sequence_parallelism(kind: str, layers: int) -> None:
    """Each spelling sequence parallelism folds into SDPA (a boolean mask filled with -inf or the
    dtype's lowest value, a scale after the mask, 3-d bmm over (B·H, T, d); ALiBi per head) is
    tiled as attention with no sequence parallelism, and the tiled step matches eager."""
    from tests.support import sp_recognition_workers as rec

    ids, labels = rec.batches(1)
    blocks = TilingOptions(enabled=True, block_size=4, attention_block_size=4)
    cap, (fw, bw) = assert_parity(rec.model(kind), (ids[0],), {"labels": labels[0]}, blocks)
    assert [op.kind for op in cap.tiling.ops].count("attention") == layers
    assert count(fw, zf.blocked_attention.default) == layers and count(bw, zf.blocked_attention_backward.default) == layers
    assert not [n for gm in (fw, bw) for n in gm.graph.nodes if n.op == "call_function" and "softmax" in str(n.target)]


def test_llama_sdpa() -> None:
    model, ids = llama(), tokens(vocab=16)
    cap, graphs = assert_parity(model, (ids,), {"labels": ids})
    assert sorted({op.kind for op in cap.tiling.ops}) == ["attention", "loss", "region"]
    assert square_tensors(graphs) == []


def test_grouped_query_attention_llama() -> None:
    # transformers passes enable_gqa=True to SDPA here (4 query heads, 2 key/value heads).
    model, ids = llama(kv_heads=2), tokens(vocab=16)
    cap, graphs = assert_parity(model, (ids,), {"labels": ids})
    assert [op.shape for op in cap.tiling.ops if op.kind == "attention"] == [(BATCH, 4, SEQ, 16)] * 2
    assert square_tensors(graphs) == []


def test_dropout_attention_is_left_alone_with_a_reason(caplog: pytest.LogCaptureFixture) -> None:
    class DropoutAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.qkv = torch.nn.Embedding(5, 8), torch.nn.Linear(8, 24)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.embed(ids)).view(BATCH, SEQ, 3, 2, 4).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).float().pow(2).mean()

    with caplog.at_level(logging.INFO, logger="zerofx.tiling"):
        cap = capture_step(DropoutAttention(), (tokens(),), {}, tiling=ON)
    assert not [op for op in cap.tiling.ops if op.kind == "attention"]
    assert [s.reason for s in cap.tiling.skipped if s.kind == "attention"] == ["dropout_p=0.1; only dropout-free attention is tiled (accepted: 0.0)"]
    assert "not tiled" in caplog.text


def test_auto_tiles_only_over_budget() -> None:
    model, ids = dna_lm(), tokens()
    small = capture_step(model, (ids,), {"labels": ids}, tiling=TilingOptions(block_size=16, budget_bytes=1 << 30))
    assert small.tiling.ops == ()  # everything fits 1 GiB: nothing tiled
    tight = capture_step(model, (ids,), {"labels": ids}, tiling=TilingOptions(block_size=16, budget_bytes=1_000_000))
    chosen = tight.tiling
    assert chosen.ops and chosen.estimate_tiled_bytes <= 1_000_000 < chosen.estimate_untiled_bytes
    assert len(chosen.ops) < sum(chosen.num_candidates)  # only as much as the budget needs
    # Largest savings first: a region (the MLP layer) is chosen before the 3 KiB loss.
    assert chosen.ops[0].kind in ("attention", "region") and "loss" not in [o.kind for o in chosen.ops]


@pytest.mark.slow
def test_auto_tiling_is_checked_against_the_memory_timeline() -> None:
    """The per-op estimates alone over-tile; ``auto`` keeps the fewest tiles whose lowered
    graphs' memory timeline fits the budget (NOTE [Tiling checked against the memory timeline])."""
    model, ids = dna_lm(), tokens()
    blocks = {"block_size": 16, "attention_block_size": 16}

    def compiled(tiling: dict) -> zerofx.Program:
        return zerofx.compile(model, world_size=1, stage=0, example_inputs=(ids,), example_kwargs={"labels": ids},
                              config={"zerofx": {"tiling": {**blocks, **tiling}}})

    def activations(program: zerofx.Program) -> int:
        report = program.report(0)
        return report.peak.live_bytes - report.persistent_bytes

    def estimates_alone(program: zerofx.Program) -> int:
        """How many ops the per-op estimates alone tile at the program's budget (its decision)."""
        return int(re.search(r"the estimates alone tile (\d+) ops", program.plan.decisions[-1]).group(1))

    untiled = activations(compiled({"enabled": False}))
    roomy = compiled({"enabled": "auto", "budget": untiled})
    assert estimates_alone(roomy) > 0  # the estimates would tile at a budget the untiled program fits
    assert roomy.plan.tiling is None and activations(roomy) == untiled
    assert roomy.plan.decisions[-1].endswith("kept 0 tiled ops, which fit")
    # In this tiny model a weight's gradient is as large as a chunk's activations, and each loop
    # adds its chunks' weight gradients into a sum of its own: every op tiled saves a quarter of
    # the activations less than the regions alone, which save over a fifth.
    tight = untiled * 4 // 5
    auto = compiled({"enabled": "auto", "budget": tight})
    assert auto.plan.tiling.ops and activations(auto) <= tight < untiled
    assert len(auto.plan.tiling.ops) < estimates_alone(auto)
    assert auto.plan.decisions[-1].endswith("which fit")
    hopeless = compiled({"enabled": "auto", "budget": 1})  # nothing fits: the least memory tried
    assert hopeless.plan.decisions[-1].endswith("which do not fit") and activations(hopeless) < untiled


def test_plan_carries_tiling_and_round_trips() -> None:
    model, ids = dna_lm(), tokens()
    program = zerofx.compile(model, world_size=2, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids},
                             config={"zerofx": {"tiling": {"enabled": True, "block_size": 16, "attention_block_size": 16}}})
    plan = program.plan
    assert Plan.from_json(plan.to_json()) == plan
    text = str(plan)
    assert "tiled op" in text and "linear + cross_entropy" in text and "sdpa attention causal" in text
    untiled = zerofx.compile(model, world_size=2, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids})
    assert untiled.plan.tiling is None and untiled.plan.fingerprint() != plan.fingerprint()


# --------------------------------------------------------------------------- engine, 2 gloo ranks
def test_engine_parity_tiled_and_weight_tiled_vs_untiled_at_stage_3() -> None:
    """Through the engine on 2 gloo ranks at stage 3, where tiling meets sharding (every weight
    gathered before use and reduce-scattered after); the tiled graphs' own numerics against
    eager are the single-process parity tests above."""
    results = run_ranks(2, tiled_vs_untiled, [3])
    initial = dna_lm().state_dict()
    stage = 3
    for res in (r[stage] for r in results):
        tiled, untiled = res["tiled"], res["untiled"]
        assert ("attention", 16) in tiled["tiled_ops"] and ("region", 16) in tiled["tiled_ops"] and untiled["tiled_ops"] == []
        assert abs(tiled["loss"].item() - untiled["loss"].item()) < TOL
        for k, v in untiled["state"].items():  # SGD with lr 1: the state difference is the gradient difference
            assert (tiled["state"][k] - v).abs().max().item() < TOL, k
        assert max((untiled["state"][k] - v).abs().max().item() for k, v in initial.items()) > 1e-3
        # Weight tiles (NOTE [One weight tile at a time]): the same step within 1e-5, gathered one
        # tile at a time, also with the shards offloaded to host memory.
        for name in ("weights", "weights_offloaded"):
            weights = res[name]
            assert [k for k, _ in weights["tiled_ops"]].count("weight") == 8 and ("attention", 16) in weights["tiled_ops"]
            assert len(weights["tile_gathered"]) == 8
            assert abs(weights["loss"].item() - untiled["loss"].item()) < TOL, name
            for k, v in untiled["state"].items():
                assert (weights["state"][k] - v).abs().max().item() < TOL, (name, k)
    assert results[0][stage]["tiled"]["fingerprint"] == results[1][stage]["tiled"]["fingerprint"]
    assert results[0][stage]["weights"]["fingerprint"] == results[1][stage]["weights"]["fingerprint"]


# --------------------------------------------------------------------------- weight tiles
# Every linear weight over 4 KiB in tiles of at most 4 KiB; sequence tiling off.
WEIGHTS = {"enabled": True, "attention": False, "region": False, "loss": False, "weight_tile_bytes": 4096}


@pytest.mark.parametrize("bias", [True, False])
def test_feature_tiled_linear_matches_linear(bias: bool) -> None:
    from zerofx.passes.tiled_kernels import tile_bounds

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(7, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    for tiles in (1, 3, 7):
        assert torch.allclose(zf.feature_tiled_linear(x, w, b, tiles), F.linear(x, w, b))
        inputs = (x, w, b) if bias else (x, w)
        assert torch.autograd.gradcheck(lambda x, w, b=None, tiles=tiles: zf.feature_tiled_linear(x, w, b, tiles), inputs)
    assert tile_bounds(7, 3) == [0, 3, 5, 7] and tile_bounds(88, 3) == [0, 30, 59, 88]
    for bad in (0, 8, True):
        with pytest.raises(ValueError, match=f"tiles={bad!r} cannot split 7 rows"):
            tile_bounds(7, bad)


def test_weight_tiles_llama_parity() -> None:
    """transformers' Llama with its projections and MLP weights tiled (and attention blocked):
    loss and gradients within 1e-5 of eager."""
    model, ids = llama(), tokens(vocab=16)
    tiling = TilingOptions(enabled=True, kinds=("attention", "weight"), attention_block_size=16, weight_tile_bytes=8192)
    cap, (fw, bw) = assert_parity(model, (ids,), {"labels": ids}, tiling)
    weights = {op.param: op.block_size for op in cap.tiling.ops if op.kind == "weight"}
    assert weights == {f"model.layers.{i}.{m}.weight": t for i in range(2) for m, t in
                       [("self_attn.q_proj", 2), ("self_attn.k_proj", 2), ("self_attn.v_proj", 2), ("self_attn.o_proj", 2),
                        ("mlp.gate_proj", 4), ("mlp.up_proj", 4), ("mlp.down_proj", 4)]}
    assert count(fw, zf.feature_tiled_linear.default) == 14 and count(bw, zf.feature_tiled_linear_backward.default) == 14


def weight_tiled_program(world_size: int, model_fn=dna_lm, vocab: int = 5, **tiling: object) -> zerofx.Program:
    with torch.device("meta"):
        model = model_fn()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return zerofx.compile(model, world_size=world_size, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids},
                          config={"zerofx": {"tiling": {**WEIGHTS, **tiling}}})


def assert_schedule_is_issued(program: zerofx.Program) -> dict:
    mods = program.graph_modules(rank=0)
    issued = collections.Counter((k, f, g, b) for g, gm in mods.items() for k, f, b in collectives(gm))
    assert issued == collections.Counter((c.kind.value, c.fqns, c.graph, c.bytes_per_rank) for c in program.plan.schedule)
    return mods


def test_stage3_gathers_and_reduces_one_weight_tile_at_a_time() -> None:
    """NOTE [One weight tile at a time]: per tiled weight, forward gathers its tiles in turn,
    backward gathers each again and reduce-scatters its gradient right away; the whole weight
    never exists on a rank, and the plan's schedule is exactly what the graphs issue."""
    from zerofx.passes import meta
    from zerofx.passes.zero.tile_weights import WEIGHT_TILE

    program = weight_tiled_program(4)
    plan = program.plan
    tiled = dict(plan.tile_gathered)
    assert tiled == {f"blocks.{i}.{m}.weight": 3 for i in range(2) for m in ("attn.qkv", "mlp.gate", "mlp.up", "mlp.down")}
    assert not set(tiled) & {f for b in plan.gather_buckets + plan.reduce_buckets for f in b}
    assert Plan.from_json(plan.to_json()) == plan and "blocks.0.mlp.up.weight in 3 tiles of at most" in str(plan)
    # offload_param's I/O estimate times every shard's fetch, tiled weights too, in first-use order.
    from zerofx.runtime.offload.plan import _fetch_groups

    groups = _fetch_groups(plan)
    assert sorted(f for g in groups for f in g) == sorted(plan.gather_order) and {(f,) for f in tiled} <= set(groups)
    mods = assert_schedule_is_issued(program)
    full_shapes = {tuple(plan.param(f).shape) for f in tiled}
    for name in ("forward", "backward"):
        gm = mods[name]
        nodes = list(gm.graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        assert not [n for n in nodes if isinstance(n.meta.get("val"), torch.Tensor) and tuple(n.meta["val"].shape) in full_shapes]
        gathers = [n for n in nodes if meta.is_all_gather(n) and WEIGHT_TILE in n.meta]
        assert len(gathers) == 8 * 3
        for fqn in tiled:
            mine = [g for g in gathers if g.meta[WEIGHT_TILE][0] == fqn]
            assert [g.meta[WEIGHT_TILE][1] for g in mine] == [0, 1, 2]
            for this, following in zip(mine, mine[1:]):  # tile t is dead before tile t + 1 is gathered
                tile = next(iter(this.users))  # its wait
                last_use = max(position[u] for v in tile.users for u in [v, *v.users])
                assert last_use < position[following]
        for r in (n for n in nodes if meta.is_reduce_scatter(n) and WEIGHT_TILE in n.meta):
            assert meta.is_wait(r.next) and r.next.args[0] is r  # waited for at once: one tile gradient in flight
    assert [n.meta[WEIGHT_TILE][1] for n in mods["backward"].graph.nodes if meta.is_reduce_scatter(n) and WEIGHT_TILE in n.meta] == [0, 1, 2] * 8


@pytest.mark.slow
def test_weight_tiles_that_cannot_split_fall_back_with_a_decision() -> None:
    # 3 ranks: qkv's 96 rows split, the MLP's 88 and 32 do not; those are gathered whole.
    program = weight_tiled_program(3)
    assert [f for f, _ in program.plan.tile_gathered] == ["blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"]
    whole = [d for d in program.plan.decisions if "gathered whole" in d]
    assert len(whole) == 6
    assert "weight blocks.0.mlp.gate.weight is gathered whole, not in 3 tiles: its 88 output features do not split evenly over 3 ranks" in whole
    assert_schedule_is_issued(program)
    # Tiles of 256 bytes would be 48 for qkv; at 4 ranks a tile cannot be less than one row per rank (24).
    lowered = weight_tiled_program(4, weight_tile_bytes=256)
    assert dict(lowered.plan.tile_gathered)["blocks.0.attn.qkv.weight"] == 24
    assert any("blocks.0.attn.qkv.weight: 24 tiles instead of 48" in d for d in lowered.plan.decisions)
    assert_schedule_is_issued(lowered)


@pytest.mark.slow
def test_auto_keeps_weight_tiles_whatever_the_activation_budget() -> None:
    """Weights follow weight_tile_bytes, not the activation budget: with the activations well
    inside it, ``auto`` tiles no attention or region but still every weight over 4 KiB."""
    model, ids = dna_lm(), tokens()
    for budget in ("1GiB", 1):  # roomy; and nothing fits, so the timeline check builds several programs
        program = zerofx.compile(model, world_size=2, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids},
                                 config={"zerofx": {"tiling": {"enabled": "auto", "budget": budget, "block_size": 16,
                                                               "attention_block_size": 16, "weight_tile_bytes": 4096}}})
        tiling = program.plan.tiling
        weights = [op for op in tiling.ops if op.kind == "weight"]
        skipped = [s for s in tiling.skipped if s.kind == "weight"]
        assert len(weights) + len(skipped) == 8 and len(program.plan.tile_gathered) == len(weights)
        if budget == "1GiB":
            assert [op.kind for op in tiling.ops] == ["weight"] * 8
        else:  # regions run in chunks now; their weights are left whole, with the reason
            assert skipped and all("inside token-wise region" in s.reason for s in skipped)


def _dna_lm_frozen_up() -> torch.nn.Module:
    model = dna_lm()
    model.blocks[0].mlp.up.weight.requires_grad_(False)
    return model


def test_frozen_tiled_weight_reduces_no_gradient() -> None:
    """A frozen weight's tiles are gathered in forward and again in backward (for dx), and no
    tile gradient is computed or reduced: the graphs issue exactly the planned collectives."""
    program = weight_tiled_program(4, model_fn=_dna_lm_frozen_up)
    mods = assert_schedule_is_issued(program)
    kinds = [k for gm in mods.values() for k, f, _ in collectives(gm) if f == ("blocks.0.mlp.up.weight",)]
    assert sorted(kinds) == ["all_gather"] * 6  # 3 tiles, forward and backward


def test_weight_tiles_llama_stage3_planning_at_8_ranks() -> None:
    program = weight_tiled_program(8, model_fn=llama, weight_tile_bytes=8192)
    assert len(program.plan.tile_gathered) == 14
    assert_schedule_is_issued(program)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "16"])
def test_bad_block_sizes_raise_naming_the_value(bad: object) -> None:
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(").replace(".", r"\.")):
        TilingOptions(block_size=bad)
    with pytest.raises(ConfigError, match="block_size"):
        zerofx.compile(dna_lm(), world_size=1, stage=0, example_inputs=(tokens(),), example_kwargs={"labels": tokens()},
                       config={"zerofx": {"tiling": {"block_size": bad}}})


def test_bad_tiling_values() -> None:
    with pytest.raises(ValueError, match="'sometimes'"):
        TilingOptions(enabled="sometimes")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"weight_tile_bytes={bad!r}"):
            TilingOptions(weight_tile_bytes=bad)
    for bad in (0, "0B", "much"):
        with pytest.raises(ConfigError, match="weight_tile_bytes"):
            zerofx.compile(dna_lm(), world_size=1, stage=0, example_inputs=(tokens(),), example_kwargs={"labels": tokens()},
                           config={"zerofx": {"tiling": {"weight_tile_bytes": bad}}})
    with pytest.raises(ValueError, match="'lots'"):
        parse_bytes("lots")
    assert parse_bytes("2GiB") == 2 << 30
    with pytest.raises(ConfigError, match="budget"):
        zerofx.compile(dna_lm(), world_size=1, stage=0, example_inputs=(tokens(),), example_kwargs={"labels": tokens()},
                       config={"zerofx": {"tiling": {"budget": "-3GB"}}})


# --------------------------------------------------------------------------- the rewrite alone
def _mlp_forward(seq: int = SEQ):
    """The pre-autograd forward of embedding -> MLP -> mean, with roles tagged as capture tags them."""
    from zerofx.passes import _compat, meta
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(emb: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, emb)  # (B, T, 8)
        return (x + F.linear(F.gelu(F.linear(x, w1)), w2)).pow(2).mean()

    with _compat.FakeTensorMode() as mode:
        args = [torch.randn(5, 8), torch.randn(32, 8), torch.randn(8, 32), torch.randint(0, 5, (BATCH, seq))]
    del mode
    gm = make_fx(step, pre_dispatch=True)(*args)
    roles = [meta.Role.PARAM] * 3 + [meta.Role.INPUT]
    for ph, role in zip(gm.graph.find_nodes(op="placeholder"), roles):
        ph.meta[meta.ROLE] = role
    return gm


def test_region_pass_structure_and_idempotence() -> None:
    from zerofx.passes.tiling.chunk_loop import chunk_loop
    from zerofx.passes.tiling.plan_tiling import plan_tiling
    from zerofx.passes.tiling.tile_forward import TILE_REGION, tile_forward_pass

    gm = _mlp_forward()
    plan = plan_tiling(gm, ON)
    assert [(op.kind, op.block_size) for op in plan.ops] == [("region", 16)]
    before = str(gm.graph)
    assert tile_forward_pass(gm, None) is gm and str(gm.graph) == before  # nothing planned: unchanged
    tiled = tile_forward_pass(gm, plan)
    # Chunks of 16, 16 and 8: one loop over the two chunks of 16 and one over the chunk of 8, each
    # with its body written once (NOTE [One body per tiled region]).
    assert not tiled.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
    loops = tiled.graph.find_nodes(op="call_function", target=chunk_loop)
    assert [n.args[4].meta["val"].shape[:3] for n in loops] == [(2, BATCH, 16), (1, BATCH, 8)]
    assert all(n.meta[TILE_REGION] == 0 and "recompute" not in n.meta for n in loops)
    for length, loop in zip((16, 8), loops):
        body = getattr(tiled, loop.args[0].target)
        linears = body.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
        assert [n.meta["val"].shape[1] for n in linears] == [length, length]
    assert len(tiled.graph.find_nodes(op="call_function", target=torch.ops.aten.split_with_sizes.default)) == 1
    with pytest.raises(ValueError, match="already tiled"):  # a second run is refused
        tile_forward_pass(tiled, plan)


def test_planner_picks_the_fewest_chunks_that_fit_the_budget(caplog: pytest.LogCaptureFixture) -> None:
    from zerofx.passes.tiling.plan_tiling import MIN_AUTO_BLOCK, block_choices, plan_tiling

    assert block_choices(1000, TilingOptions()) == [512, 256]  # 2 and 4 even chunks, rounded up to 64 tokens
    assert block_choices(1000, TilingOptions(block_size=100)) == [100]
    assert block_choices(300, TilingOptions()) == [1024] and MIN_AUTO_BLOCK == 256  # halves under 256 tokens: not split
    gm = _mlp_forward(seq=1024)  # (2, 1024, 32) hidden, fake tensors only
    roomy = plan_tiling(gm, TilingOptions(enabled=True, budget_bytes=1 << 30))
    assert [(op.kind, op.block_size) for op in roomy.ops] == [("region", 512)]
    with caplog.at_level(logging.INFO, logger="zerofx.tiling"):
        tight = plan_tiling(gm, TilingOptions(enabled=True, budget_bytes=1))
    assert [(op.kind, op.block_size) for op in tight.ops] == [("region", 256)]
    assert tight.estimate_tiled_bytes < roomy.estimate_tiled_bytes
    assert "exceeds the budget" in caplog.text
