"""Sequence parallelism through the scan and flip mixers (passes/sequence/mixer_scan.py, passes/sequence/mixer_flip.py):
the plan's decisions and the rewritten forward's ops, what is refused, and parity with plain
PyTorch in real gloo groups on conv-free scan models and on the bundled Mamba and BiMamba."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import zerofx
from tests.support import scan_mixer_workers as workers
from tests.support.dist_utils import run_ranks
from zerofx.common.errors import CaptureError, SequenceParallelError
from zerofx.models import build_model
from zerofx.models.long_conv import lm_loss
from zerofx.models.scan import selective_scan_with_state
from zerofx.passes.meta import is_all_to_all

STEPS = 3
SCAN = torch.ops.zerofx.selective_scan.default


def _compile(net: torch.nn.Module, kind: str, size: int, seq_len: int) -> zerofx.Program:
    ids, labels = workers.batches(kind, 1, 1, seq_len)
    return zerofx.compile(net, world_size=size, stage=3, example_inputs=(ids[0, 0],), example_kwargs={"labels": labels[0, 0]},
                          config={"zerofx": {"sequence_parallel": {"size": size}}})


def _ops(program: zerofx.Program) -> Counter:
    forward = program.graph_modules(0)["forward"]
    return Counter("all_to_all" if is_all_to_all(n) else n.target for n in forward.graph.nodes if n.op == "call_function")


# --------------------------------------------------------------------------- the plan and the rewritten forward
def test_a_scan_runs_by_state_passing() -> None:
    """One scan of (B, E, N) = (2, 16, 4) over 2 ranks: the decisions name state passing and its
    bytes (each rank sends its fp32 final state and decay, 2 · 16 · 4 · 4 B each, to the other
    rank, and as many gradients back: 2 KiB); the forward scans the slice twice, once from zero
    and once from the state passed in, and holds the state's all-to-all besides the rank's
    position and the loss's."""
    program = _compile(workers.ScanLM(bidirectional=False), "scan", 2, 64)
    decisions = "\n".join(program.plan.decisions)
    assert "sequence parallelism (state_passing) over 2 ranks: 64 tokens -> 32 per rank" in decisions
    assert "1 selective scan(s) by state passing" in decisions and "2 KiB sent per rank and step" in decisions
    assert "sequence layout: contiguous slices, as the scan exchange(s) need rank r to hold the r-th slice" in decisions
    ops = _ops(program)
    assert ops[SCAN] == 2 and ops["all_to_all"] == 3, ops


def test_a_bidirectional_scan_flips_by_two_all_to_alls() -> None:
    """Two scans and two flips along the sequence: per flip a local flip, two all-to-alls of the
    slice and the reversal of the arrived chunks (NOTE [Flip along the sequence]); its bytes are
    2 · 2 · (S-1)/S of the (2, 32, 16) fp32 slice, 8 KiB, so 16 KiB for the two."""
    program = _compile(workers.ScanLM(bidirectional=True), "biscan", 2, 64)
    decisions = "\n".join(program.plan.decisions)
    assert "2 selective scan(s) by state passing" in decisions and "4 KiB sent per rank and step" in decisions
    assert "2 flip(s) along the sequence" in decisions and "16 KiB sent per rank and step" in decisions
    ops = _ops(program)
    assert ops[SCAN] == 4 and ops[torch.ops.aten.flip.default] == 4 and ops["all_to_all"] == 2 * 1 + 2 * 2 + 2, ops


@pytest.mark.parametrize("size", ["mamba-tiny", "bimamba-tiny"])
def test_mamba_is_planned_with_state_passing(size: str) -> None:
    """The bundled models over 2 ranks: one state passing scan per direction and layer, each
    scanned twice in the forward."""
    program = _compile(build_model(size, device="meta"), size, 2, 64)
    scans = 2 * (2 if size.startswith("bi") else 1)
    assert any(f"{scans} selective scan(s) by state passing" in d for d in program.plan.decisions), program.plan.decisions
    assert _ops(program)[SCAN] == 2 * scans


class StateLM(torch.nn.Module):
    """Reads the scan's final state: what state passing refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = workers.ScanLM(bidirectional=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ssm = self.inner.ssm
        x = self.inner.embed(ids)
        dt, b, c = ssm.x_proj(x).split((1, ssm.n, ssm.n), dim=-1)
        y, h_last = selective_scan_with_state(x, torch.nn.functional.softplus(ssm.dt_proj(dt)), -torch.exp(ssm.A_log), b, c, ssm.D,
                                              chunk_len=ssm.chunk_len)
        return lm_loss(self.inner.head(y + h_last.sum(-1)[:, None]), labels, causal=True)


def test_reading_the_final_state_is_refused() -> None:
    with pytest.raises(CaptureError) as err:
        _compile(StateLM(), "scan", 2, 64)
    assert isinstance(err.value.__cause__, SequenceParallelError)
    assert "its final state (h_last) is read" in str(err.value) and "zerofx::selective_scan in module" in str(err.value)


# --------------------------------------------------------------------------- parity in gloo groups
def _check(results: list[dict], case: tuple[str, int, int, int], world_size: int) -> None:
    kind, _, size, seq_len = case
    expected = workers.reference(kind, world_size // size, STEPS, seq_len)
    initial = workers.reference(kind, world_size // size, 0, seq_len)
    assert max((expected["state"][k] - initial["state"][k]).abs().max().item() for k in initial["state"]) > 1e-3  # training moved
    for rank, by_case in enumerate(results):
        res = by_case[case]
        state = res["state"]
        assert state.keys() == expected["state"].keys(), (rank, case)
        diff = max((state[k].double() - expected["state"][k].double()).abs().max().item() for k in state)
        assert diff < 1e-5, (rank, case, diff)
        assert res["losses"] == pytest.approx([step[rank // size] for step in expected["losses"]], abs=1e-5), (rank, case)
        assert any("by state passing" in d for d in res["decisions"]), res["decisions"]


def test_parity_sequence_2_causal_and_bidirectional_scans() -> None:
    """Stage 0 causal (T 64, 32 per rank: 4 chunks of 8 each) and stage 3 bidirectional (T 128),
    with ignored labels, SGD: within 1e-5 of plain PyTorch after 3 steps."""
    cases = [("scan", 0, 2, 64), ("biscan", 3, 2, 128)]
    results = run_ranks(2, workers.train, cases, STEPS)
    for case in cases:
        _check(results, case, 2)


def test_parity_sequence_4_and_data_2_x_sequence_2() -> None:
    """World 4: one sequence group of 4 (the state folded over three lower ranks; the flip's
    pieces crossing all four), and two data groups of 2."""
    cases = [("biscan", 3, 4, 128), ("scan", 3, 2, 64)]
    results = run_ranks(4, workers.train, cases, STEPS)
    for case in cases:
        _check(results, case, 4)


def test_parity_mamba_tiny_and_bimamba_tiny() -> None:
    """The bundled models (conv, scan, flip): Mamba causal over 2 ranks at stage 0, BiMamba
    masked LM over 2 data groups of 2 at stage 3."""
    cases = [("mamba-tiny", 0, 2, 64), ("bimamba-tiny", 3, 2, 64)]
    results = run_ranks(4, workers.train, cases, STEPS)
    for case in cases:
        _check(results, case, 4)
