"""Sequence parallelism through the convolution and cumsum mixers (passes/sequence/mixer_conv.py, NOTE
[Convolutions along the sequence]): the plans of the Hyena models, the ops refused by name, and
parity with plain single-process PyTorch in real gloo process groups."""

from __future__ import annotations

import pytest
import torch

import zerofx
from tests.support import sp_conv_workers as workers
from tests.support.dist_utils import run_ranks
from zerofx.common.errors import CaptureError
from zerofx.common.units import format_bytes
from zerofx.cost_models.comm import CommSpec, estimate_all_to_all_s
from zerofx.cost_models.sequence import (HaloDims, LongConvDims, PrefixDims, channels_exchange_bytes, channels_exchange_s,
                                         halo_exchange_bytes, halo_exchange_s, prefix_exchange_bytes, prefix_exchange_s)
from zerofx.models import build_model
from zerofx.passes.meta import is_all_to_all

STEPS = 3


def compile_sp(net: torch.nn.Module, size: int, seq_len: int = workers.SEQ, attention: str = "ulysses") -> zerofx.Program:
    ids = torch.randint(0, workers.VOCAB, (workers.BATCH, seq_len))
    return zerofx.compile(net, world_size=size, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids},
                          config={"zerofx": {"sequence_parallel": {"size": size, "attention": attention}}})


def all_to_alls(program: zerofx.Program) -> dict[str, int]:
    return {name: sum(1 for n in gm.graph.nodes if is_all_to_all(n)) for name, gm in program.graph_modules(0).items()}


# Forward all-to-alls: the rank's position in its group and the loss's sum and count (2), one per
# short conv (the halo), three per FFT conv (signal and filter to channels, output back), two
# per Ulysses attention. Backward: the gradient of each that carries one (not the first two).
# hyena-tiny: 2 layers of a short conv and an FFT conv; striped-tiny (SDH*): 3 short convs of the
# streams, the SE and MR filters' direct convs, one FFT conv (H), one attention.
# The Conv1d + cumsum model: one short conv, and the cumsum's totals count as one more. The long
# direct convs: two halos, each gathering every rank's slice.
EXPECTED = {"hyena": (2, 2, 0), "striped": (5, 1, 1), "convsum": (2, 0, 0), "longconv": (2, 0, 0)}


@pytest.mark.parametrize("kind", ["hyena", "striped"])
def test_hyena_models_plan_with_halo_and_channel_all_to_alls(kind: str) -> None:
    short, long, attention = EXPECTED[kind]
    program = compile_sp(workers.model(kind), 2)
    exchanges = short + 3 * long + 2 * attention
    assert all_to_alls(program) == {"forward": 2 + exchanges, "backward": exchanges}
    decision = next(d for d in program.plan.decisions if d.startswith("sequence parallelism ("))
    b, c, t, s = workers.BATCH, 32, workers.SEQ, 2
    taps = {"hyena": [3, 3], "striped": [3, 7, 3, 16, 3]}[kind]  # the streams' convs (3 taps, 3C channels); SE and MR (C)
    halo = sum(halo_exchange_bytes(HaloDims(b, 3 * c if k == 3 else c, k, 4), s) for k in taps)
    # each rank sends its last K-1 positions to both ranks: (S-1)/S of S copies, forward and backward
    assert halo == sum(2 * b * (3 * c if k == 3 else c) * (k - 1) * 4 for k in taps)
    channels = long * channels_exchange_bytes(LongConvDims(b, c, t, 4), s)
    assert channels == long * 2 * 0.5 * (2 * b + 1) * c * (t // s) * 4
    assert f"{short} short convolution(s)" in decision and "halo all-to-all" in decision
    assert f"{long} FFT convolution(s), each a channel all-to-all" in decision and f"{c // s} of {c} channels" in decision
    assert format_bytes(halo) in decision and format_bytes(channels) in decision
    layout = next(d for d in program.plan.decisions if d.startswith("sequence layout"))
    assert layout.startswith("sequence layout: contiguous slices, as the short_conv, long_conv exchange(s)")


class _Conv(torch.nn.Module):
    def __init__(self, conv: torch.nn.Conv1d, cut: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(workers.VOCAB, 8)
        self.conv, self.cut = conv, cut
        self.head = torch.nn.Linear(conv.out_channels, workers.VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.conv(self.embed(ids).transpose(1, 2))
        x = x[..., :t] if self.cut else x
        labels = labels[:, : x.shape[-1]]  # a strided conv's fewer outputs: refused before the loss is read
        return torch.nn.functional.cross_entropy(self.head(x.transpose(1, 2)).reshape(-1, workers.VOCAB), labels.reshape(-1))


@pytest.mark.parametrize("conv, cut, words", [
    (torch.nn.Conv1d(8, 8, 3, padding=4, dilation=2, groups=8), True, ["stride 1 and dilation 2"]),
    (torch.nn.Conv1d(8, 8, 3, padding=2, stride=2, groups=8), False, ["stride 2 and dilation 1"]),
    (torch.nn.Conv1d(8, 8, 3, padding=2, groups=2), True, ["groups=2 for 8 channels", "depthwise"]),
    (torch.nn.Conv1d(8, 8, 3, padding=1, groups=8), False, ["is not causal", "padding=2 sliced to the first 64"]),
])
def test_convolutions_that_are_not_short_causal_depthwise_are_refused(conv: torch.nn.Conv1d, cut: bool, words: list[str]) -> None:
    with pytest.raises(CaptureError) as err:
        compile_sp(_Conv(conv, cut), 2)
    text = str(err.value)
    assert "aten.conv1d in module 'conv'" in text, text
    for word in words:
        assert word in text, text


@pytest.mark.parametrize("size", [2, 4])
def test_a_halo_longer_than_the_slice_gathers_every_slice(size: int) -> None:
    """Filters of 64 and 40 taps over 64 / S positions a rank: each conv's one all-to-all (and its
    gradient's) carries every rank's whole slice, S copies, not its last K - 1 positions."""
    program = compile_sp(workers.model("longconv"), size)
    assert all_to_alls(program) == {"forward": 4, "backward": 2}
    b, c, local = workers.BATCH, 8, workers.SEQ // size
    sent = sum(halo_exchange_bytes(HaloDims(b, c, k, 4, slice_len=local), size) for k in (64, 40))
    assert sent == 2 * 2 * (size - 1) / size * size * b * c * local * 4  # (S-1)/S of S whole slices, each way
    decision = next(d for d in program.plan.decisions if d.startswith("sequence parallelism ("))
    assert f"2 of them reach past the left neighbour (K-1 > {local} positions a rank)" in decision, decision
    assert format_bytes(sent) in decision, decision


def test_fft_conv_refuses_a_size_that_does_not_divide_the_channels() -> None:
    """hyena-tiny's FFT conv runs over 32 channels; 3 ranks cannot split them (the short convs could)."""
    with pytest.raises(CaptureError) as err:
        compile_sp(build_model("hyena-tiny"), 3, seq_len=48)
    text = str(err.value)
    assert "aten.fft_rfft in module 'blocks.0.mixer" in text and "32 channels, which sequence_parallel.size=3 does not divide" in text


def test_exchange_seconds_are_the_all_to_alls_of_those_bytes() -> None:
    """Each mixer's seconds: its all-to-alls, forward and backward, of one rank's input (S copies
    of the halo or of the totals; the signal, the filter and the output of an FFT conv)."""
    spec = CommSpec("test", 1e-5, 1e9, 1e-4, 1e8, ranks_per_node=2)  # two links: the group of 4 crosses nodes
    b, c, t, s = 2, 32, 64, 4
    assert halo_exchange_s(HaloDims(b, c, 4, 4), s, spec) == 2 * estimate_all_to_all_s(s * b * c * 3 * 4, s, spec)
    assert halo_exchange_s(HaloDims(b, c, 1, 4), s, spec) == 0.0  # one tap: nothing to exchange
    signal, filt = b * c * (t // s) * 4, c * (t // s) * 4
    assert channels_exchange_s(LongConvDims(b, c, t, 4), s, spec) == pytest.approx(
        2 * (2 * estimate_all_to_all_s(signal, s, spec) + estimate_all_to_all_s(filt, s, spec)))
    assert prefix_exchange_s(PrefixDims(rows=b * c, itemsize=4), s, spec) == 2 * estimate_all_to_all_s(s * b * c * 4, s, spec)


def test_prefix_bytes() -> None:
    """A cumsum of (B, T, d) sends each rank's d·B totals to every rank, forward and backward."""
    assert prefix_exchange_bytes(PrefixDims(rows=32, itemsize=4), 4) == 2 * 3 / 4 * 4 * 32 * 4
    program = compile_sp(workers.model("convsum"), 2)
    decision = next(d for d in program.plan.decisions if d.startswith("sequence parallelism ("))
    assert "1 short convolution(s) (4 taps)" in decision and "1 cumsum(s), each an all-to-all of the slice totals" in decision
    assert all_to_alls(program) == {"forward": 4, "backward": 2}


def check(results: list[dict], case: tuple, world_size: int) -> None:
    kind, stage, size, attention = case[:4]
    expected = workers.reference(kind, world_size // size, STEPS)
    for rank, by_case in enumerate(results):
        res = by_case[case]
        diff = max((res["state"][k].double() - v.double()).abs().max().item() for k, v in expected["state"].items())
        assert diff < 1e-5, (rank, case, diff)
        assert res["losses"] == pytest.approx([step[rank // size] for step in expected["losses"]], abs=1e-5), (rank, case)
        short, long, attention_ops = EXPECTED[kind]
        exchanges = short + 3 * long + 2 * attention_ops * (attention == "ulysses")
        assert res["all_to_alls"] == {"forward": 2 + exchanges, "backward": exchanges}, (rank, case)
        # Tiled: the rank's token-wise regions between the mixers and the loss, in chunks.
        assert ("loss" in res["tiled"] and "region" in res["tiled"]) if "tiled" in case[4:] else not res["tiled"], (rank, case)
    # Causal ring attention alone takes the zigzag layout; beside a convolution, whose halo needs
    # rank r to hold the r-th slice, it keeps contiguous slices (``runs_zigzag``).
    layout = next(d for d in results[0][case]["decisions"] if d.startswith("sequence layout"))
    assert layout.startswith("sequence layout: contiguous slices, as the short_conv"), (case, layout)


@pytest.mark.multiprocess
def test_parity_sequence_2() -> None:
    """World 2, one group of 2: hyena-tiny at stage 0 with each rank's slice tiled (the mixers'
    outputs marked as the sequence again, NOTE [Tiling a sequence-parallel forward]),
    striped-tiny with causal ring attention striped in at stage 3, and the Conv1d + cumsum model
    at stage 3, and the long direct convs (halos past the left neighbour) at stage 0."""
    cases = [("hyena", 0, 2, "ulysses", "tiled"), ("striped", 3, 2, "ring"), ("convsum", 3, 2, "ulysses"),
             ("longconv", 0, 2, "ulysses")]
    results = run_ranks(2, workers.train, cases, STEPS)
    for case in cases:
        check(results, case, 2)


@pytest.mark.multiprocess
def test_parity_sequence_4_and_data_2_x_sequence_2() -> None:
    """World 4: one group of 4 on striped-tiny with Ulysses attention at stage 0 (16 positions a
    rank: the MR filter's halo of 15 fits), 2 data groups of 2 on hyena-tiny at stage 3, and the
    long direct convs over one group of 4 at stage 3 (16 positions a rank: the 64-tap filter reads
    every earlier rank)."""
    cases = [("striped", 0, 4, "ulysses"), ("hyena", 3, 2, "ulysses"), ("longconv", 3, 4, "ulysses")]
    results = run_ranks(4, workers.train, cases, STEPS)
    for case in cases:
        check(results, case, 4)


@pytest.mark.multiprocess
def test_cumsum_accumulates_16_bit_in_fp32() -> None:
    """The prefix rewrite on 2 ranks against the whole sequence's cumsum in fp64: in bf16 and
    fp16 within one rounding of the result, as an fp32 sum rounded once gives (the lower rank's
    total added in bf16 rounds twice: 2.5 against a bound of 2.06, measured), its gradient
    likewise, the output in the input's dtype; fp32 within fp32 sums' error (measured 5e-5)."""
    for rank, by_dtype in enumerate(run_ranks(2, workers.cumsum_errors)):
        for dtype, res in by_dtype.items():
            assert str(res["dtype"]) == dtype, (rank, dtype)
            slack = 1e-3  # fp32 sums of 512 values near 500
            assert res["error"] <= res["rounding"] + slack and res["grad_error"] <= res["grad_rounding"] + slack, (rank, dtype, res)
