"""Sequence parallelism recognizes computations, not spellings: attention written out as matmuls
and softmax folds into SDPA (NOTE [Attention written out is SDPA] in
passes/sequence/canonical_attention.py) and shards as SDPA does, and views that merge the sequence with
the batch keep the ops over them token-wise (NOTE [The sequence axis merged with the batch] in
passes/sequence/seq_merged.py); checked on the graph and by SGD parity with plain PyTorch in real gloo
process groups."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx

from tests.support import sp_recognition_workers as workers
from tests.support.dist_utils import run_ranks
from zerofx.common.errors import CaptureError
from zerofx.compiler.pipeline import StepCapture
from zerofx.passes import meta
from zerofx.passes.sequence.canonical_attention import canonicalize_attention_pass
from zerofx.passes.sequence.canonical_fft import canonicalize_fft_conv_pass
from zerofx.passes.plan.sequence import SequenceParallelSpec
from zerofx.passes.sequence.seq_regions import is_sdpa

aten = torch.ops.aten
STEPS = 3


def recorded(net: torch.nn.Module) -> fx.GraphModule:
    ids, labels = workers.batches(1)
    return StepCapture(net, (ids[0],), {"labels": labels[0]}).forward_record()


def run(gm: fx.GraphModule, net: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A recorded forward run on the model's parameters and buffers and these inputs."""
    state = dict(net.named_parameters()) | dict(net.named_buffers())
    inputs = iter([ids, labels])
    return gm(*[next(inputs) if ph.meta.get(meta.ROLE) is meta.Role.INPUT else state[ph.meta[meta.FQN]]
                for ph in meta.placeholders(gm.graph)])


def count(gm: fx.GraphModule, packet: object) -> int:
    return sum(1 for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is packet)


class TinyLM(torch.nn.Module):
    """An embedding, ``mix`` (each subclass's spelling) and a head with the loss over every position."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(workers.VOCAB, 8)
        self.head = torch.nn.Linear(8, workers.VOCAB)

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.mix(self.embed(ids))  # (B, T, 8)
        return torch.nn.functional.cross_entropy(self.head(x).reshape(-1, workers.VOCAB), labels.reshape(-1))


class AttentionDropoutLM(TinyLM):
    """``dropout(softmax(q kᵀ · c + mask), p=0.1) v`` in training: random per call, not SDPA without dropout."""

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        x, t = x.unsqueeze(1), x.shape[1]  # (B, 1, T, 8)
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        return (torch.nn.functional.dropout((x @ x.transpose(-2, -1) * 0.5 + mask).softmax(-1), 0.1) @ x).squeeze(1)


class MergedCumsumLM(TinyLM):
    """A running sum over the rows of ``(B·T, C)``: it runs across the batch's sequences, which no mixer shards."""

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        return x.reshape(b * t, c).cumsum(0).reshape(b, t, c)


@pytest.mark.parametrize("kind, layers", [("llama_eager", 2), ("written", 1)])
def test_written_attention_becomes_one_sdpa(kind: str, layers: int) -> None:
    """Each written-out attention is one SDPA node with its scale and additive mask, no softmax
    or matmul of it is left, the graph lints, and the result matches the model's eager output;
    a second run changes nothing."""
    net = workers.model(kind)
    gm = recorded(net)
    assert count(gm, aten.softmax) == layers and not any(is_sdpa(n) for n in gm.graph.nodes)
    ids, labels = workers.batches(1)
    expected = workers.loss_of(net, ids[0], labels[0])
    original, recorded_graph = gm, str(gm.graph)
    gm = canonicalize_attention_pass(original)
    assert gm is not original and str(original.graph) == recorded_graph  # a new forward; the input is left alone
    sdpas = [n for n in gm.graph.nodes if is_sdpa(n)]
    assert len(sdpas) == layers and count(gm, aten.softmax) == 0 and count(gm, aten.matmul) == 0
    assert all(isinstance(n.args[3], fx.Node) for n in sdpas)  # the causal mask (and bias) as an additive mask
    if kind == "written":  # q's factor moved into the scale: 1/sqrt(8) on the scores
        assert sdpas[0].kwargs["scale"] == pytest.approx(8 ** -0.5)
    got = run(gm, net, ids[0], labels[0])
    assert torch.allclose(got, expected, atol=1e-6), (got, expected)
    assert canonicalize_attention_pass(gm) is gm


@pytest.mark.parametrize("spelling", workers.ATTENTION_SPELLINGS)
def test_attention_spellings_become_one_sdpa(spelling: str) -> None:
    """A boolean mask filled into the scores (``-inf`` or the dtype's lowest value), a scale after
    the mask, and 3-d ``bmm`` over (B·H, T, d) are each one SDPA with scale 1/sqrt(d) and an
    additive float mask: no softmax, matmul or bmm of the attention is left, the graph lints, the
    loss is the model's, the input is left alone, and a second run changes nothing."""
    net = workers.model(f"spelled_{spelling}")
    gm = recorded(net)
    assert count(gm, aten.softmax) == 1 and not any(is_sdpa(n) for n in gm.graph.nodes)
    ids, labels = workers.batches(1)
    expected = workers.loss_of(net, ids[0], labels[0])
    original, recorded_graph = gm, str(gm.graph)
    gm = canonicalize_attention_pass(original)
    assert gm is not original and str(original.graph) == recorded_graph
    [sdpa] = [n for n in gm.graph.nodes if is_sdpa(n)]
    assert count(gm, aten.softmax) == count(gm, aten.matmul) == count(gm, aten.bmm) == 0
    assert sdpa.kwargs["scale"] == pytest.approx(8 ** -0.5)
    mask = sdpa.args[3].meta["val"]
    assert mask.dtype == torch.float32 and tuple(mask.shape) == (workers.SEQ, workers.SEQ)
    q = sdpa.args[0].meta["val"]  # (B, H, T, D), or the bmm's (B·H, T, D) as (1, B·H, T, D)
    assert tuple(q.shape) == ((1, 4, workers.SEQ, 8) if spelling == "bmm" else (workers.BATCH, 2, workers.SEQ, 8))
    gm.graph.lint()
    assert torch.allclose(run(gm, net, ids[0], labels[0]), expected, atol=1e-6)
    assert canonicalize_attention_pass(gm) is gm


def test_multihead_attention_returning_its_weights_is_one_sdpa() -> None:
    """``nn.MultiheadAttention`` with ``need_weights=True`` (its default) computes attention as
    ``baddbmm(mask, q · c, kᵀ)`` and ``bmm`` over (B·H, T, d) and averages the weights over the
    heads; the caller drops them. It is one SDPA over (1, B·H, T, d) with the (1, 1, T, T) causal
    mask, the dropped weights are gone with the softmax, and the loss is the model's."""
    net = workers.model("mha_weights")
    gm = recorded(net)
    assert count(gm, aten.baddbmm) == count(gm, aten.bmm) == count(gm, aten.mean) == 1
    ids, labels = workers.batches(1)
    gm = canonicalize_attention_pass(gm)
    [sdpa] = [n for n in gm.graph.nodes if is_sdpa(n)]
    assert count(gm, aten.softmax) == count(gm, aten.baddbmm) == count(gm, aten.bmm) == count(gm, aten.mean) == 0
    assert tuple(sdpa.args[0].meta["val"].shape) == (1, 4, workers.SEQ, 8)
    assert tuple(sdpa.args[3].meta["val"].shape) == (1, 1, workers.SEQ, workers.SEQ)
    assert sdpa.kwargs["scale"] == pytest.approx(8 ** -0.5)
    assert torch.allclose(run(gm, net, ids[0], labels[0]), workers.loss_of(net, ids[0], labels[0]), atol=1e-6)
    assert canonicalize_attention_pass(gm) is gm


def test_attention_dropout_is_left_alone() -> None:
    """Attention dropout of nonzero probability is random per call, not SDPA's: the graph is
    unchanged, and sequence parallelism refuses its matmul by op, as any attention it cannot shard."""
    gm = recorded(AttentionDropoutLM())
    assert canonicalize_attention_pass(gm) is gm
    ids, labels = workers.batches(1)
    capture = StepCapture(AttentionDropoutLM(), (ids[0],), {"labels": labels[0]}, sequence_parallel=SequenceParallelSpec(size=2))
    with pytest.raises(CaptureError, match="cannot shard aten.matmul"):
        capture.sequence_forward()


def sequence_forward(net: torch.nn.Module, kind: str = "") -> fx.GraphModule:
    ids, labels = workers.batches(1)
    capture = StepCapture(net, (workers.padded_ids(kind, ids[0]),), workers.keywords(kind, ids[0], labels[0]),
                          sequence_parallel=SequenceParallelSpec(size=2))
    return capture.sequence_forward()[0]


@pytest.mark.parametrize("kind", ["gpt2", "gpt2_eager", "encoder", "encoder_causal", "flat_rows"])
def test_views_merging_batch_and_sequence_stay_tokenwise(kind: str) -> None:
    """GPT-2's ``Conv1D`` (``addmm`` over (B·T, C)), ``nn.MultiheadAttention``'s projections
    over (T·B, C) and a model whose position ids, projections and loss run over (B·T, ·) rows
    run on each rank's B·T/S rows: every projection of the rewritten forward reads that many
    tokens, and each attention is one SDPA between all-to-alls."""
    gm = sequence_forward(workers.model(kind), kind)
    rows = [n.meta["val"].numel() // n.meta["val"].shape[-1] for n in gm.graph.nodes
            if getattr(n.target, "overloadpacket", None) in (aten.addmm, aten.linear)]
    assert rows and set(rows) == {workers.BATCH * workers.SEQ // 2}, rows
    assert sum(1 for n in gm.graph.nodes if is_sdpa(n)) == (2 if kind.startswith("gpt2") else 1)


@pytest.mark.parametrize("kind", workers.PADDED)
def test_values_indexed_by_position_take_the_ranks_positions(kind: str) -> None:
    """BERT's position ids and token types (buffers cut to T, a token type read by ``gather`` at
    each position) and ESM's positions (a cumsum over the padding, computed whole) are cut to the
    rank's positions: every embedding of the rewritten forward looks up T/S positions, and ESM's
    cumsum runs whole, outside the prefix mixer (no cumsum site in the plan)."""
    net = workers.model(kind)
    ids, labels = workers.batches(1)
    capture = StepCapture(net, (workers.padded_ids(kind, ids[0]),), workers.keywords(kind, ids[0], labels[0]),
                          sequence_parallel=SequenceParallelSpec(size=2))
    gm, plan = capture.sequence_forward()
    lookups = [n.meta["val"].shape[-2] for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is aten.embedding]
    assert len(lookups) == (3 if kind == "bert" else 2) and set(lookups) == {workers.SEQ // 2}, lookups
    assert plan.strategies == (("attention", "ulysses"),)


def test_a_mixer_over_merged_axes_is_refused() -> None:
    """A cumsum over (B·T, C) runs across sequences: refused by op and module, naming the merged shape."""
    with pytest.raises(CaptureError, match=r"cannot shard aten.cumsum.* in module 'embed'.*merged with another axis, shape \(32, 8\)"):
        sequence_forward(MergedCumsumLM())


class GainedFFTConvLM(TinyLM):
    """A filter spectrum scaled by a learned gain (a tensor, not a number): not folded."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(()))

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        u, n = x.transpose(1, 2), 2 * x.shape[1]  # (B, C, T)
        y = torch.fft.irfft(torch.fft.rfft(u, n=n) * (torch.fft.rfft(u, n=n) * self.gain), n=n, norm="forward")
        return y[..., : x.shape[1]].transpose(1, 2)


def test_a_row_masked_everywhere_by_minus_infinity_adds_nothing() -> None:
    """A block's row whose additive mask is -inf on every key has output 0 and log-sum-exp +inf
    (what ring attention's online softmax skips), as a boolean mask gives it, not the fused
    kernel's 0, which counted the block as one more unit of softmax mass."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen) for _ in range(3))
    additive = torch.zeros(1, 1, 4, 4)
    additive[..., 1, :] = float("-inf")
    out, lse = torch.ops.zerofx.blocked_attention(q, k, v, additive, False, 8 ** -0.5, 4, 4)
    _, lse_bool = torch.ops.zerofx.blocked_attention(q, k, v, additive == 0, False, 8 ** -0.5, 4, 4)
    assert torch.isposinf(lse[..., 1]).all() and torch.isposinf(lse_bool[..., 1]).all() and (out[..., 1, :] == 0).all()
    assert torch.allclose(lse[..., [0, 2, 3]], lse_bool[..., [0, 2, 3]], atol=1e-5)


@pytest.mark.parametrize("kind, factor", [("fft_reference", None), ("fft_ortho", 1 / math.sqrt(2 * workers.SEQ))])
def test_fft_norms_and_scalars_fold_into_one_factor(kind: str, factor: float | None) -> None:
    """HyenaDNA's ``rfft(k) / n`` with ``irfft(norm="forward")`` is the plain convolution (no factor
    left); ortho norms leave 1/sqrt(n) after the cut to T. Every FFT's norm is unset, the product
    reads the two rffts, the loss is the model's, the input is left alone, and a second run
    changes nothing."""
    net = workers.model(kind)
    gm = recorded(net)
    ids, labels = workers.batches(1)
    expected = workers.loss_of(net, ids[0], labels[0])
    original, recorded_graph = gm, str(gm.graph)
    gm = canonicalize_fft_conv_pass(original)
    assert gm is not original and str(original.graph) == recorded_graph
    ffts = [n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) in (aten.fft_rfft, aten.fft_irfft)]
    assert len(ffts) == 3 and all((n.args[3] if len(n.args) > 3 else n.kwargs.get("norm")) is None for n in ffts)
    irfft = ffts[-1]
    assert [getattr(a.target, "overloadpacket", None) for a in irfft.args[0].args] == [aten.fft_rfft, aten.fft_rfft]
    cut = next(iter(irfft.users))
    scales = [u.args[1] for u in cut.users if getattr(u.target, "overloadpacket", None) is aten.mul and u.args[0] is cut]
    assert scales == ([] if factor is None else [pytest.approx(factor)])
    assert torch.allclose(run(gm, net, ids[0], labels[0]), expected, atol=1e-6)
    assert canonicalize_fft_conv_pass(gm) is gm


def test_a_tensor_scale_on_a_spectrum_is_left_alone() -> None:
    gm = recorded(GainedFFTConvLM())
    assert canonicalize_fft_conv_pass(gm) is gm


def test_an_unsqueeze_of_a_spectrum_moves_before_its_fft() -> None:
    """``rfft(k) / n`` unsqueezed to (1, C, T + 1) before the product is the FFT of the unsqueezed
    filter: the product reads two rffts, the filter's reads the unsqueeze, the factor folds to 1,
    the loss is the model's, and a second run changes nothing."""
    net = workers.model("fft_unsqueeze")
    gm = recorded(net)
    ids, labels = workers.batches(1)
    gm = canonicalize_fft_conv_pass(gm)
    [irfft] = [n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is aten.fft_irfft]
    rffts = irfft.args[0].args
    assert [getattr(a.target, "overloadpacket", None) for a in rffts] == [aten.fft_rfft, aten.fft_rfft]
    assert getattr(rffts[1].args[0].target, "overloadpacket", None) is aten.unsqueeze
    assert tuple(rffts[1].meta["val"].shape) == (1, 8, workers.SEQ + 1)
    assert count(gm, aten.unsqueeze) == 2 and not any(getattr(u.target, "overloadpacket", None) is aten.mul
                                                      for u in next(iter(irfft.users)).users)  # the skip's and the filter's
    assert torch.allclose(run(gm, net, ids[0], labels[0]), workers.loss_of(net, ids[0], labels[0]), atol=1e-6)
    assert canonicalize_fft_conv_pass(gm) is gm


def test_a_filter_cut_to_t_takes_the_ranks_positions() -> None:
    """A filter computed from parameters over the buffers' 2T positions and cut to T before its FFT
    is cut again to each rank's T/S positions: the channel all-to-all sends the filter's (C, T/S)
    lags, so both rffts of the rewritten forward run on C/S channels over the whole sequence."""
    gm = sequence_forward(workers.model("fft_long_filter"))
    rffts = [tuple(n.args[0].meta["val"].shape) for n in gm.graph.nodes
             if getattr(n.target, "overloadpacket", None) is aten.fft_rfft]
    assert sorted(rffts) == [(workers.BATCH, 4, workers.SEQ), (4, workers.SEQ)], rffts


def check(results: list[dict], case: tuple, world_size: int) -> None:
    """fp32 parity with plain PyTorch on the same global batch within 1e-5 after the steps, and each
    mixer sharded as SDPA or the FFT convolution is: per attention one ring op, or two all-to-alls
    (and the loss's and the rank's two); per FFT convolution three all-to-alls."""
    size, attention = workers.layout(case, world_size)
    expected = workers.reference(case[0], STEPS, world_size // size)
    layers = {"llama_eager": 2, "gpt2": 2, "spelled": len(workers.ATTENTION_SPELLINGS), **dict.fromkeys(workers.PADDED, 2),
              **dict.fromkeys(workers.HF_CORPUS, 2)}.get(case[0], 1)
    for rank, by_case in enumerate(results):
        res = by_case[case]
        diff = max((res["state"][k].double() - v.double()).abs().max().item() for k, v in expected["state"].items())
        assert diff < 1e-5, (rank, case, diff)
        assert res["losses"] == pytest.approx([step[rank // size] for step in expected["losses"]], abs=1e-5), (rank, case)
        if case[0].startswith("fft_"):  # the signal, the filter and the output; the rank's position and the loss
            assert res["ring_ops"] == 0 and res["all_to_alls"] == 5, (rank, case)
            assert any("1 FFT convolution(s)" in d for d in res["decisions"]), (rank, case)
            continue
        if attention == "ring":
            assert res["ring_ops"] == layers and res["all_to_alls"] == 2, (rank, case)
        else:
            assert res["ring_ops"] == 0 and res["all_to_alls"] == 2 * layers + 2, (rank, case)
        assert any(f"{layers} attention(s)" in d for d in res["decisions"]), (rank, case)


@pytest.mark.multiprocess
def test_parity_models_as_written_sequence_2() -> None:
    """World 2, sequence-parallel size 2, one launch: Hugging Face Llama in eager attention with
    ring at stage 3 (its additive causal mask cut to each block), the hand-written ALiBi attention
    with ring at stage 0 (a bias that differs per head), GPT-2 with Ulysses at stage 3, and
    ``nn.TransformerEncoderLayer`` with a causal mask by ring at stage 3 and without one by
    Ulysses at stage 0, and token-wise work, position ids and the loss over flattened (B·T, C)
    rows by ring at stage 3 match plain PyTorch within 1e-5 after 3 SGD steps, each attention
    sharded as SDPA is; so do BERT by Ulysses at stage 0 and ESM with absolute positions by ring
    at stage 3, each with a padded row (``attention_mask``); the attention spellings (a boolean
    mask filled into the scores, a scale after the mask, 3-d ``bmm``), a layer each, by ring at
    stage 0 and by Ulysses at stage 3, and ``nn.MultiheadAttention`` returning its weights (3-d
    ``baddbmm`` and ``bmm``) by ring at stage 3; and the FFT convolution in HyenaDNA's spelling
    (stage 3), in ortho norms (stage 0), with its filter cut to T (stage 3) and with an unsqueezed
    spectrum (stage 0) by the long-conv mixer's channel all-to-alls; and a rotary model that
    caches its tables on itself during ``forward`` (NOTE [Module state across a trace]) by
    Ulysses at stage 3; and Hugging Face GPT-J (rotary tables repeated and stacked along the head
    dim) by Ulysses at stage 0 and MPT (ALiBi per head, the scores cast before the softmax, a
    boolean causal mask filled with the dtype's lowest value) by ring at stage 3."""
    cases = [("llama_eager", 3, "ring"), ("written", 0, "ring"), ("gpt2", 3, "ulysses"), ("encoder_causal", 3, "ring"),
             ("encoder", 0, "ulysses"), ("flat_rows", 3, "ring"), ("bert", 0, "ulysses"), ("esm_absolute", 3, "ring"),
             ("spelled", 0, "ring"), ("spelled", 3, "ulysses"), ("mha_weights", 3, "ring"), ("fft_reference", 3, "ulysses"),
             ("fft_ortho", 0, "ulysses"), ("fft_long_filter", 3, "ulysses"), ("fft_unsqueeze", 0, "ulysses"),
             ("cached_rotary", 3, "ulysses"), ("gptj", 0, "ulysses"), ("mpt", 3, "ring")]
    results = run_ranks(2, workers.train, cases, STEPS)
    for case in cases:
        check(results, case, 2)


@pytest.mark.multiprocess
def test_parity_bert_and_gpt2_sequence_4_and_data_2_x_sequence_2() -> None:
    """World 4, stage 3: padded BERT by Ulysses and GPT-2 by ring (causal: the zigzag layout) over
    one sequence group of 4 ranks (T/S = 4 positions each), and BERT by ring and GPT-2 by Ulysses
    over 2 data-parallel groups of 2, each group on its own batch, match plain PyTorch on the
    global batch within 1e-5 after 3 SGD steps; so does GPT-2 by ring over 4 ranks at stage 0."""
    cases = [("bert", 3, 4, "ulysses"), ("gpt2", 3, 4, "ring"), ("gpt2", 0, 4, "ring"), ("bert", 3, 2, "ring"),
             ("gpt2", 3, 2, "ulysses")]
    results = run_ranks(4, workers.train, cases, STEPS)
    for case in cases:
        check(results, case, 4)
