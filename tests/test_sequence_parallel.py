"""Sequence parallelism (``zerofx.sequence_parallel``): parity with plain single-process PyTorch
on the same global batch in real gloo process groups, the config's checks, and the ops the
rewrite refuses by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zerofx
from tests.support import sequence_parallel_workers as workers
from tests.support.dist_utils import run_ranks
from tests.support.programs import saved_views_of_inputs_bytes
from zerofx.common.errors import CaptureError, ConfigError
from zerofx.config.options import GraphCompiler
from zerofx.passes.analysis.analyze_schedule import schedule_table
from zerofx.passes.meta import is_all_to_all
from zerofx.passes.sequence.mixer_attention import AttentionShape, choose_attention
from zerofx.passes.plan.sequence import SequenceAttention
from zerofx.passes.sequence.ring_attention import is_ring_attention
from zerofx.app.training import TrainOptions, _cycle_batches, check_train_options, data_layout

STEPS = 3
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "dna_lm_sp.json"


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def check(results: list[dict], case: tuple[str, int, int, str, str], world_size: int) -> None:
    """fp32 parity (offload included) with plain PyTorch on the same global batch, and the exchanges."""
    kind, stage, size, attention, feature = case
    expected = workers.reference(world_size // size, STEPS, kind)
    for rank, by_case in enumerate(results):
        res = by_case[case]
        assert max_diff(res["state"], expected["state"]) < 1e-5, (rank, case)
        group_losses = [step[rank // size] for step in expected["losses"]]
        assert res["losses"] == pytest.approx(group_losses, abs=1e-5), (rank, case)
        check_exchanges(res, case)


def check_exchanges(res: dict, case: tuple[str, int, int, str, str]) -> None:
    kind, stage, size, attention, feature = case
    # The forward's two small all-to-alls: the rank's position in its group, the loss's sum and count.
    layers, forward = 2, 2
    if attention == "ulysses":
        # Per layer, q, k and v go to head sharding in one all-to-all (k and v apart from q
        # under grouped-query attention) and come back in one.
        exchanges = 3 if kind == "llama" else 2
        assert res["all_to_alls"] == {"forward": exchanges * layers + forward, "backward": exchanges * layers}, case
        assert res["ring_ops"] == {"forward": 0, "backward": 0}, case
    else:  # ring: per layer one op each way; S - 1 sends of k and of v, and in the backward S of their gradients
        assert attention == "ring", case
        assert res["all_to_alls"] == {"forward": forward, "backward": 0}, case
        assert res["ring_ops"] == {"forward": layers, "backward": layers}, case
        assert res["ring_sends"] == {"forward": 2 * (size - 1) * layers, "backward": (2 * (size - 1) + 2 * size) * layers}, case
    # Causal rings hold the zigzag layout unless it is turned off (NOTE [Zigzag layout for causal rings]).
    # Tiled: every token-wise region of the rank's slice (embedding, then one per layer), the
    # loss, and Ulysses' attention of the whole sequence for H/S heads; the ring op is blockwise already.
    tiled = ["region"] * 3 + ["loss"] + ["attention"] * 2 * (attention == "ulysses")
    assert res["tiled"] == ([] if feature != "tiled" else sorted(tiled)), case
    layout = next(d for d in res["decisions"] if d.startswith("sequence layout"))
    zigzag = attention == "ring" and kind != "esm" and feature != "contiguous"
    assert layout.startswith("sequence layout: zigzag" if zigzag else "sequence layout: contiguous"), (case, layout)


# Mixed precision rounds every value the forward and backward compute: bf16 keeps 8 significant
# bits (epsilon 2^-7, each rounding off by up to 2^-8 of the value), fp16 11 (epsilon 2^-10,
# rounding 2^-11). A sequence-parallel run rounds other intermediates than a run without it
# (per-slice partial gradients summed over the group, the ring's block-wise softmax), so after 3
# steps their fp32 masters differ by a few such roundings of each update. Measured, norm-wise per
# parameter: bf16 with ring against fp32 at most 1.45% of the update (bf16 without sequence
# parallelism is 0.5-1.3% from fp32, and the two bf16 runs 0.5-1.2% apart); fp16 with Ulysses
# against fp32 0.1-0.4%, as far as the fp16 run without it. The bounds, 2^-5 (4 bf16 epsilons)
# and 2^-6 (16 fp16 epsilons), are 2.1x and 4x the largest measured; a wrong slice, scale or exchange moves an update by tens of
# percent. Losses (fp32 from rounded logits): within one rounding, 2^-8 and 2^-11 (measured
# 2.4e-4 and 1.3e-5).
MIXED_TOLERANCES = {"bf16": (2.0 ** -5, 2.0 ** -8), "fp16": (2.0 ** -6, 2.0 ** -11)}


def check_mixed(results: list[dict], case: tuple[str, int, int, str, str]) -> None:
    """Mixed precision with sequence parallelism against fp32 plain PyTorch on the same global
    batch: every fp32 master within MIXED_TOLERANCES of the update fp32 makes to it, and the losses."""
    kind, feature = case[0], case[4]
    update_tol, loss_tol = MIXED_TOLERANCES[feature]
    initial, fp32 = workers.model(kind).state_dict(), workers.reference(1, STEPS, kind)
    for rank, by_case in enumerate(results):
        sp = by_case[case]
        assert sp["masters"], rank
        for fqn, master in sp["masters"].items():
            update = (fp32["state"][fqn] - initial[fqn]).norm()
            assert (master - fp32["state"][fqn]).norm() <= update_tol * update, (rank, fqn)
        assert sp["losses"] == pytest.approx([step[0] for step in fp32["losses"]], rel=loss_tol), rank
        check_exchanges(sp, case)


@pytest.mark.multiprocess
def test_parity_sequence_2_ulysses_and_ring_dna_llama_esm(tmp_path: Path) -> None:
    """World 2, sequence-parallel size 2, one launch: the DNA LM with Ulysses at stage 3 and ring
    at stage 0 in contiguous slices and at stage 3 in the zigzag layout (with optimizer, parameter
    and gradient offload to CPU), Hugging Face Llama
    (causal, grouped-query attention) with ring, and Hugging Face ESM (bidirectional masked LM,
    rotary, a padding attention mask) with both; the DNA LM with Ulysses and Llama with ring,
    each rank's slice tiled (NOTE [Tiling a sequence-parallel forward]); the DNA LM in bf16 with
    ring and in fp16 with Ulysses, each against fp32. The first engine's
    checkpoint saves and loads, and refuses ranks of a group passing different batches."""
    cases = [("dna", 3, 2, "ulysses", "fp32"), ("dna", 0, 2, "ring", "contiguous"), ("dna", 3, 2, "ring", "offload"),
             ("llama", 3, 2, "ring", "fp32"), ("esm", 0, 2, "ulysses", "fp32"), ("esm", 3, 2, "ring", "fp32"),
             ("dna", 3, 2, "ulysses", "tiled"), ("llama", 3, 2, "ring", "tiled")]
    bf16, fp16 = ("dna", 3, 2, "ring", "bf16"), ("dna", 3, 2, "ulysses", "fp16")
    results = run_ranks(2, workers.train, [*cases, bf16, fp16], STEPS, str(tmp_path))
    for case in cases:
        check(results, case, 2)
    check_mixed(results, bf16)
    check_mixed(results, fp16)
    assert any("(ulysses)" in d for d in results[0][cases[0]]["decisions"])
    assert any("(ring)" in d for d in results[0][cases[1]]["decisions"])
    assert all(r["checkpoint"] == {"moved": True, "restored": True} for r in results)
    for r in results:
        assert r["mismatch"] is not None and "passed different batches" in r["mismatch"]


@pytest.mark.multiprocess
def test_ring_attention_matches_sdpa_in_a_group() -> None:
    """The ring by itself (NOTE [Ring attention]) on 2 gloo ranks: output and gradients of each
    rank's slice match SDPA over the whole sequence, causal, bidirectional, masked, in fp32,
    bf16 and fp16, and causal in the zigzag layout (NOTE [Zigzag layout for causal rings]);
    autograd saves the rank's T/S keys and values only."""
    for rank, by_case in enumerate(run_ranks(2, workers.ring_attention_errors)):
        assert set(by_case) == {"causal", "gqa", "additive", "boolean", "bf16", "fp16", "zigzag_gqa", "zigzag_boolean"}
        for case, res in by_case.items():
            assert res["error"] < RING_TOLERANCES.get(case, 1e-5), (rank, case, res["error"])
            assert not res["dtypes"], (rank, case)  # the output and gradients in the inputs' dtype
            check_saved_keys_and_values(res["shape"], res["saved"], 2, case)


# Ring attention in bf16/fp16 against fp32 SDPA on the same rounded inputs: the kernel rounds
# each block's output and gradients to the dtype before the fp32 combination, and the result
# once more; values here are O(1) to O(10) (gradients over 8 keys), so a few roundings of 2^-8
# (bf16) and 2^-11 (fp16) relative. Measured largest differences: 0.032 (bf16) and 0.0021
# (fp16); the bounds are about 4x those. A block dropped or counted twice moves values by O(1).
RING_TOLERANCES = {"bf16": 2.0 ** -3, "fp16": 2.0 ** -7}


def check_saved_keys_and_values(shape: tuple[int, ...], saved: list[tuple[int, ...]], size: int, case: str) -> None:
    """What autograd saved for the ring's backward holds this rank's T/S keys and T/S values
    (an unrolled ring saves every step's block: T of each), and T/S queries."""
    b, h, kv_heads, t, d = shape
    positions = [s[2] for s in saved if len(s) == 4 and s[:2] == (b, kv_heads) and s[3] == d]
    if kv_heads == h:  # q and the output have the key/value shape too
        assert sum(positions) == 4 * t // size, (case, saved)
    else:
        assert sum(positions) == 2 * t // size, (case, saved)
        assert sum(s[2] for s in saved if len(s) == 4 and s[:2] == (b, h) and s[3] == d) == 2 * t // size, (case, saved)  # q, out


@pytest.mark.multiprocess
def test_parity_data_2_x_sequence_2_and_sequence_4() -> None:
    """World 4: Ulysses on Hugging Face Llama (grouped-query attention: k and v exchanged apart
    from q) over 2 data-parallel groups of 2, and ring on the DNA LM over one group of 4 with
    shard groups of 2 (each cuts the sequence group in half)."""
    cases = [("llama", 3, 2, "ulysses", "fp32"), ("dna", 3, 4, "ring", "shard2")]
    results = run_ranks(4, workers.train, cases, STEPS)
    for case in cases:
        check(results, case, 4)


@pytest.mark.parametrize("section, words", [
    ({"size": 3}, ["'zerofx.sequence_parallel.size'", "does not divide the world size 4", "1, 2, 4"]),
    ({"size": 2, "attention": "sideways"}, ["'zerofx.sequence_parallel.attention'", "'sideways'", '"ulysses"']),
    ({"attention": "auto"}, ["'zerofx.sequence_parallel.size' is missing"]),
])
def test_config_errors_name_the_key(section: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        zerofx.compile(workers.model(), world_size=4, stage=3, config={"zerofx": {"sequence_parallel": section}})
    for word in words:
        assert word in str(err.value)


def test_offload_mixed_precision_and_inductor_are_accepted() -> None:
    """Parsing only: the combinations the parity tests train are not refused (Inductor's parity
    run: tests/test_sp_inductor.py)."""
    for feature in ("offload", "bf16", "fp16", "shard2"):
        extra = workers.FEATURES[feature]
        config = {**extra, "zero_optimization": {"stage": 3, **extra.get("zero_optimization", {})},
                  "zerofx": {**extra.get("zerofx", {}), "sequence_parallel": {"size": 2}}}
        assert zerofx.parse_config(config, world_size=4).sequence_parallel.size == 2
    compiled = zerofx.parse_config({"zerofx": {"compile": "inductor", "sequence_parallel": {"size": 2}}}, world_size=2)
    assert compiled.graph_compiler is GraphCompiler.INDUCTOR and compiled.sequence_parallel.size == 2


@pytest.mark.parametrize("model, op, module", [
    (workers.CumprodLM, "aten.cumprod", "'mix'"),
    (workers.PoolLM, "aten.avg_pool1d", "'filter'"),
])
def test_ops_mixing_positions_are_refused_by_name(model: type, op: str, module: str) -> None:
    ids = torch.randint(0, workers.CONFIG.vocab_size, (2, 16))
    with pytest.raises(CaptureError) as err:
        zerofx.compile(model(), world_size=2, stage=3, example_inputs=(ids, ids), config={"zerofx": {"sequence_parallel": {"size": 2}}})
    text = str(err.value)
    assert op in text and f"in module {module}" in text and "Supported are" in text and "scaled_dot_product_attention" in text


def test_loss_sum_and_count_are_exchanged_in_fp32() -> None:
    """A loss over fp16 logits (the parity test's models upcast theirs): the rank's sum of token
    losses and its token count cross the group in fp32, where fp16 overflows above 65504 (bf16,
    which counts exactly only up to 256, takes the same path)."""
    ids = torch.randint(0, workers.CONFIG.vocab_size, (2, 16))
    program = zerofx.compile(workers.TokenLM(), world_size=2, stage=3, example_inputs=(ids, ids),
                             config={"fp16": {"enabled": True}, "zerofx": {"sequence_parallel": {"size": 2, "attention": "ring"}}})
    forward = program.graph_modules(0)["forward"]
    exchanged = [n.args[0].meta["val"].dtype for n in forward.graph.nodes if is_all_to_all(n)]
    assert exchanged == [torch.int64, torch.float32]  # the rank's position in its group; the loss's sum and count


def test_sequence_length_must_divide() -> None:
    ids = torch.randint(0, workers.CONFIG.vocab_size, (2, 15))
    with pytest.raises(CaptureError, match="sequence length 15 is not divisible by sequence_parallel.size=2"):
        zerofx.compile(workers.model(), world_size=2, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids},
                       config={"zerofx": {"sequence_parallel": {"size": 2}}})


@pytest.mark.parametrize("attention", ["auto", "ring"])
def test_planned_without_a_process_group(attention: str) -> None:
    """zerofx.compile shows the exchanges in the schedule, with their bytes, and the choice in the decisions."""
    ids = torch.randint(0, workers.CONFIG.vocab_size, (2, 16))
    program = zerofx.compile(workers.model(), world_size=4, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids},
                             config={"zerofx": {"sequence_parallel": {"size": 4, "attention": attention}}})
    rows, layers = program.report(0).rows, workers.CONFIG.num_layers
    ops = [row.op for row in rows]
    if attention == "auto":  # 4 heads over 4 ranks, per layer: Ulysses sends 2·(3/4)·4 blocks of q, k, v, o; ring 2·3·2 of k, v and 4·2 of their gradients
        assert any(d.startswith("sequence parallelism: ulysses chosen for 4 query heads (4 key/value) over 4 ranks")
                   and "12 KiB per step (forward and backward) with ulysses" in d and "40 KiB with ring" in d for d in program.plan.decisions)
        assert ops.count("all_to_all_single") == 4 * layers + 2 and "ring_shift" not in ops
        return
    assert any("(ring) over 4 ranks" in d for d in program.plan.decisions)
    assert ops.count("all_to_all_single") == 2
    shifts = [row for row in rows if row.op == "ring_shift"]
    block_bytes = 2 * workers.CONFIG.num_heads * 4 * workers.CONFIG.head_dim * 4  # (B, H, T/S, D) fp32
    # Per layer: the forward sends k and v 3 times; the backward sends them 3 times and their gradients 4.
    assert [row.graph for row in shifts] == ["forward"] * (6 * layers) + ["backward"] * (14 * layers)
    assert all(row.bytes_per_rank == block_bytes and row.comm_s > 0 for row in shifts)
    assert "ring_shift" in schedule_table(rows)
    check_saved_for_ring_backward(program.graph_modules(0), layers, block_bytes)
    # The memory timeline's activations per rank are those of the whole step on T/S tokens.
    short = ids[:, : ids.shape[1] // 4]
    sharded = program.report(0)
    whole_program = zerofx.compile(workers.model(), world_size=4, stage=3, example_inputs=(short,), example_kwargs={"labels": short})
    whole = whole_program.report(0)
    difference = (sharded.peak.live_bytes - sharded.persistent_bytes) - (whole.peak.live_bytes - whole.persistent_bytes)
    assert 0 <= difference <= saved_views_of_inputs_bytes(whole_program)  # the rank's copies of its input slices


def check_saved_for_ring_backward(graphs: dict, layers: int, block_bytes: int) -> None:
    """The forward saves, per attention, this rank's T/S positions of q, k, v and the output
    (each ``block_bytes``) and nothing else of (B, H, ·, D) shape: an unrolled ring saves each
    step's key/value block, T positions of each."""
    forward, backward = graphs["forward"], graphs["backward"]
    saved = {n.name: n.meta["val"] for n in forward.graph.find_nodes(op="output")[0].args[0][1:] if n.op == "call_function"}
    q = next(n for n in forward.graph.nodes if is_ring_attention(n)).args[0].meta["val"]
    attention_shaped = [v for v in saved.values() if v.dim() == 4 and v.shape[:2] == q.shape[:2] and v.shape[-1] == q.shape[-1]]
    assert sum(v.numel() * v.element_size() for v in attention_shaped) == layers * 4 * block_bytes
    ops = [n for n in backward.graph.nodes if is_ring_attention(n)]
    assert len(ops) == layers
    for op in ops:  # its own k and v: saved by the forward, T/S positions each
        assert all(a.op == "placeholder" and saved[a.name].numel() * saved[a.name].element_size() == block_bytes for a in op.args[2:4])


@pytest.mark.parametrize("q_heads, kv_heads, size, expected, words", [
    (4, 4, 4, SequenceAttention.ULYSSES, ["6 KiB per step (forward and backward) with ulysses", "20 KiB with ring"]),
    (4, 4, 2, SequenceAttention.ULYSSES, ["8 KiB per step (forward and backward) with ulysses", "16 KiB with ring"]),
    (6, 2, 2, SequenceAttention.ULYSSES, ["8 KiB per step (forward and backward) with ulysses", "8 KiB with ring", "a tie goes to ulysses"]),
    (4, 2, 2, SequenceAttention.ULYSSES, ["6 KiB per step (forward and backward) with ulysses", "8 KiB with ring"]),
    (8, 2, 2, SequenceAttention.RING, ["10 KiB per step (forward and backward) with ulysses", "8 KiB with ring"]),
    (8, 2, 4, SequenceAttention.RING, ["key/value heads repeated to 8 since 4 does not divide 2", "12 KiB per step (forward and backward) with ulysses",
                                       "10 KiB with ring"]),
    (6, 6, 4, SequenceAttention.RING, ["6 query heads, which sequence_parallel.size=4 does not divide"]),
])
def test_auto_chooses_by_bytes_and_heads(q_heads: int, kv_heads: int, size: int, expected: SequenceAttention, words: list[str]) -> None:
    """One attention, batch 2, 16 tokens, head_dim 8, fp32: per step one rank sends
    2 · (S-1)/S · (2·Hq + 2·Hkv') · B·T/S·D·4 bytes with Ulysses (Hkv' = Hq where S does not divide
    Hkv), forward and backward alike, and (2·(S-1) + S) · 2·Hkv · B·T/S·D·4 with ring (k and v
    S - 1 times each way, their fp32 gradients S times)."""
    refusal = None if q_heads % size == 0 else f"attention has {q_heads} query heads, which sequence_parallel.size={size} does not divide"
    shape = AttentionShape(batch=2, seq_len=16, q_heads=q_heads, kv_heads=kv_heads, qk_dim=8, v_dim=8, itemsize=4, ulysses_refusal=refusal)
    kind, why = choose_attention([shape], size)
    assert kind is expected and why.startswith(f"sequence parallelism: {expected.value} chosen")
    for word in words:
        assert word in why


def test_ulysses_refuses_heads_the_size_does_not_divide() -> None:
    ids = torch.randint(0, workers.CONFIG.vocab_size, (2, 18))
    with pytest.raises(CaptureError, match="4 query heads, which sequence_parallel.size=3 does not divide.*\"ring\" or \"auto\" accepts it"):
        zerofx.compile(workers.model(), world_size=3, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids},
                       config={"zerofx": {"sequence_parallel": {"size": 3, "attention": "ulysses"}}})


def test_train_hands_a_sequence_group_the_same_windows() -> None:
    """zerofx train's data path: ranks r // S share windows, different groups get different ones."""
    opts = check_train_options(TrainOptions(config=EXAMPLE, world_size=4, seq_len=64))
    assert [data_layout(opts, rank) for rank in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    first = [next(_cycle_batches(opts, rank)) for rank in range(4)]
    for a, b in ((0, 1), (2, 3)):
        assert torch.equal(first[a][0], first[b][0]) and torch.equal(first[a][1], first[b][1])
    assert not torch.equal(first[0][0], first[2][0])
    assert first[0][0].shape == (2, 64)  # the config's micro-batch per group, whole sequences
