"""Cost models and the schedule analysis, against closed-form answers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import zerofx
from zerofx.cost_models.comm import CPU_GLOO, estimate_all_gather_s, estimate_reduce_scatter_s
from zerofx.cost_models.compute import DeviceSpec, estimate_flops
from zerofx.cost_models.memory import estimate_model_state_bytes, zero_paper_bytes
from zerofx.passes import meta
from zerofx.passes.analyze_schedule import format_report
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
