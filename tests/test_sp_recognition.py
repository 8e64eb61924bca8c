"""Sequence parallelism recognizes computations, not spellings: attention written out as matmuls
and softmax folds into SDPA (NOTE [Attention written out is SDPA] in
passes/canonical_attention.py) and shards as SDPA does, checked on the graph and by SGD parity
with plain PyTorch in real gloo process groups."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from tests.support import sp_recognition_workers as workers
from tests.support.dist_utils import run_ranks
from zerofx.common.errors import CaptureError
from zerofx.compiler.pipeline import StepCapture
from zerofx.passes import meta
from zerofx.passes.canonical_attention import canonicalize_attention_pass
from zerofx.passes.sequence_parallel import SequenceParallelSpec
from zerofx.passes.seq_regions import is_sdpa

aten = torch.ops.aten
STEPS = 3


def recorded(net: torch.nn.Module) -> fx.GraphModule:
    ids, labels = workers.batches(1)
    return StepCapture(net, (ids[0],), {"labels": labels[0]}).forward_record()


def count(gm: fx.GraphModule, packet: object) -> int:
    return sum(1 for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is packet)


class ScaleAfterMask(torch.nn.Module):
    """``softmax((q kᵀ + mask) · c) v``: the scale after the mask is not SDPA's order."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(workers.VOCAB, 8)
        self.head = torch.nn.Linear(8, workers.VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).unsqueeze(1)  # (B, 1, T, 8)
        t = ids.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        y = (((x @ x.transpose(-2, -1)) + mask) * 0.5).softmax(-1) @ x
        return torch.nn.functional.cross_entropy(self.head(y.squeeze(1)).reshape(-1, workers.VOCAB), labels.reshape(-1))


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
    params = dict(net.named_parameters()) | dict(net.named_buffers())
    flat = [params[ph.meta[meta.FQN]] if ph.meta.get(meta.ROLE) is not meta.Role.INPUT else None for ph in meta.placeholders(gm.graph)]
    inputs = iter([ids[0], labels[0]])
    got = gm(*[v if v is not None else next(inputs) for v in flat])
    assert torch.allclose(got, expected, atol=1e-6), (got, expected)
    assert canonicalize_attention_pass(gm) is gm


def test_scale_after_mask_is_left_alone() -> None:
    """A scale applied after the mask is not SDPA's order: the graph is unchanged, and sequence
    parallelism refuses its matmul by op, as any attention it cannot shard."""
    gm = recorded(ScaleAfterMask())
    assert canonicalize_attention_pass(gm) is gm
    ids, labels = workers.batches(1)
    capture = StepCapture(ScaleAfterMask(), (ids[0],), {"labels": labels[0]}, sequence_parallel=SequenceParallelSpec(size=2))
    with pytest.raises(CaptureError, match="cannot shard aten.matmul"):
        capture.sequence_forward()


@pytest.mark.multiprocess
def test_parity_written_attention_sequence_2() -> None:
    """World 2, sequence-parallel size 2: Hugging Face Llama in eager attention with ring at
    stage 3 (its additive causal mask cut to each block) and the hand-written ALiBi attention
    with ring at stage 0 (a bias that differs per head) match plain PyTorch within 1e-5 after 3
    SGD steps, each attention sharded as SDPA is (one ring op per layer)."""
    cases = [("llama_eager", 3, "ring"), ("written", 0, "ring")]
    results = run_ranks(2, workers.train, cases, STEPS)
    for case in cases:
        expected = workers.reference(case[0], STEPS)
        layers = 2 if case[0] == "llama_eager" else 1
        for rank, by_case in enumerate(results):
            res = by_case[case]
            diff = max((res["state"][k].double() - v.double()).abs().max().item() for k, v in expected["state"].items())
            assert diff < 1e-5, (rank, case, diff)
            assert res["losses"] == pytest.approx(expected["losses"], abs=1e-5), (rank, case)
            assert res["ring_ops"] == layers, (rank, case)
            assert any(f"{layers} attention(s)" in d for d in res["decisions"]), (rank, case)
