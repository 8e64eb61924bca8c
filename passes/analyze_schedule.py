"""Planner (read only): where a rank's step spends its time and memory, from the lowered graphs.

Expects one rank's graph modules (``forward``, ``backward``, optionally ``param_sync``) as
``zerofx.pipeline.lower`` makes them, and the Plan they came from. Changes nothing.

NOTE [The overlap model]
A small discrete-event simulation. Compute runs node by node in graph order, each taking
``estimate_node_s``. Collectives run one at a time on a communication channel, in the order
they are issued; each starts when it is issued and the channel is free, and takes its
alpha-beta time. A ``wait_tensor`` blocks compute until its collective is done: the time it
blocks is *exposed* communication. The rest is hidden behind compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from zerofx.cost_models.comm import CommSpec, estimate_all_gather_s, estimate_all_reduce_s, estimate_reduce_scatter_s
from zerofx.cost_models.compute import DeviceSpec, estimate_node_s
from zerofx.cost_models.memory_timeline import TimelinePoint, peak, step_timeline
from zerofx.passes import meta
from zerofx.passes.check_collectives import GRAPH_ORDER
from zerofx.passes.plan import Plan


@dataclass(frozen=True)
class CollectiveRow:
    order: int
    graph: str
    op: str
    bucket: tuple[str, ...]
    bytes_per_rank: int
    issued_after: str  # the node after which it is issued
    waited_at: str  # the wait node
    overlap_compute_s: float  # compute that runs between issue and wait
    comm_s: float
    exposed_s: float
    start_s: float  # when the channel starts it, from the step's start (simulated)
    end_s: float


@dataclass(frozen=True)
class Span:
    """A stretch of one graph's execution on the compute timeline (simulated)."""

    graph: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class ScheduleReport:
    rows: tuple[CollectiveRow, ...]
    spans: tuple[Span, ...]
    compute_s: Mapping[str, float]
    exposed_s: float
    step_s: float
    persistent_bytes: int
    peak: TimelinePoint
    timeline: tuple[TimelinePoint, ...]

    @property
    def comm_s(self) -> float:
        return sum(r.comm_s for r in self.rows)

    @property
    def bytes_moved_per_rank(self) -> int:
        return sum(r.bytes_per_rank for r in self.rows)


def _comm_s(node: fx.Node, world_size: int, spec: CommSpec) -> float:
    val = node.args[0].meta["val"]
    nbytes = val.numel() * val.element_size()
    if meta.is_all_gather(node):
        return estimate_all_gather_s(nbytes * world_size, world_size, spec)
    if meta.is_reduce_scatter(node):
        return estimate_reduce_scatter_s(nbytes, world_size, spec)
    return estimate_all_reduce_s(nbytes, world_size, spec)


def analyze_schedule(modules: Mapping[str, fx.GraphModule], plan: Plan, *, comm: CommSpec, device: DeviceSpec) -> ScheduleReport:
    rows: list[CollectiveRow] = []
    compute: dict[str, float] = {}
    t = 0.0
    channel_free = 0.0
    exposed_total = 0.0
    issued = 0
    spans: list[Span] = []
    begins: dict[fx.Node, float] = {}
    for name in GRAPH_ORDER:
        gm = modules.get(name)
        if gm is None:
            continue
        graph_start = t
        start_compute = 0.0
        pending: dict[fx.Node, tuple[float, float, float, str, int]] = {}  # collective -> (done, dur, compute at issue, issued after, issue #)
        previous = "start"
        for node in gm.graph.nodes:
            if meta.is_collective(node):
                dur = _comm_s(node, plan.world_size, comm)
                begin = max(t, channel_free)
                channel_free = begin + dur
                pending[node] = (channel_free, dur, start_compute, previous, issued)
                begins[node] = begin
                issued += 1
            elif meta.is_wait(node) and node.args[0] in pending:
                coll = node.args[0]
                done, dur, compute_at_issue, issued_after, issue_index = pending.pop(coll)
                blocked = max(0.0, done - t)
                t += blocked
                exposed_total += blocked
                val = coll.args[0].meta["val"]
                rows.append(
                    CollectiveRow(
                        order=issue_index, graph=name, op=meta.collective_name(coll), bucket=tuple(coll.meta.get(meta.COMM_FQNS, ())),
                        bytes_per_rank=val.numel() * val.element_size(), issued_after=issued_after, waited_at=node.name,
                        overlap_compute_s=start_compute - compute_at_issue, comm_s=dur, exposed_s=blocked,
                        start_s=begins[coll], end_s=done,
                    )
                )
            else:
                dt = estimate_node_s(node, device)
                t += dt
                start_compute += dt
            if node.op != "placeholder":
                previous = node.name
        compute[name] = start_compute
        spans.append(Span(name, graph_start, t))
    rows.sort(key=lambda r: r.order)
    persistent = sum(plan.estimates.values())
    timeline = step_timeline(modules["forward"], modules["backward"], persistent_bytes=persistent)
    return ScheduleReport(
        rows=tuple(rows), spans=tuple(spans), compute_s=compute, exposed_s=exposed_total, step_s=t,
        persistent_bytes=persistent, peak=peak(timeline), timeline=tuple(timeline),
    )


def format_report(report: ScheduleReport, *, budget_bytes: float | None = None) -> str:
    from tabulate import tabulate

    from zerofx.passes.plan import format_bytes

    table = [
        (r.order, r.graph, r.op.replace("_into_tensor", "").replace("_tensor", ""),
         f"{len(r.bucket)}: {r.bucket[0] if r.bucket else ''}{' ...' if len(r.bucket) > 1 else ''}",
         format_bytes(r.bytes_per_rank), r.issued_after, r.waited_at, f"{r.overlap_compute_s * 1e3:.2f}", f"{r.comm_s * 1e3:.2f}", f"{r.exposed_s * 1e3:.2f}")
        for r in report.rows
    ]
    lines = [
        "communication schedule (one row per collective; times in ms, estimated):",
        tabulate(table, headers=["#", "graph", "op", "bucket (params: first)", "bytes/rank", "issued after", "waited at", "overlaps compute", "comm",
                                 "exposed"]),
        "",
        f"memory per rank: persistent model state {format_bytes(report.persistent_bytes)}, "
        f"peak {format_bytes(report.peak.live_bytes)} at {report.peak.graph} node {report.peak.node}",
    ]
    if budget_bytes is not None:
        verdict = "fits" if report.peak.live_bytes <= budget_bytes else "does NOT fit"
        lines.append(f"budget {format_bytes(budget_bytes)}: {verdict}")
    lines.append(format_summary(report, "summary"))
    return "\n".join(lines)


def format_summary(report: ScheduleReport | Any, label: str) -> str:
    """The one-line step summary of a report, or of anything with the same summary fields
    (``zerofx.folding.FoldedReport``)."""
    from zerofx.passes.plan import format_bytes

    return (
        f"{label}: {format_bytes(report.bytes_moved_per_rank)} sent in per rank per step; compute "
        + ", ".join(f"{g} {s * 1e3:.1f} ms" for g, s in report.compute_s.items())
        + f"; communication {report.comm_s * 1e3:.1f} ms of which exposed {report.exposed_s * 1e3:.1f} ms; "
        f"estimated step {report.step_s * 1e3:.1f} ms"
    )


def summary_json(report: ScheduleReport | Any) -> dict[str, Any]:
    """The step summary as ``zerofx plan --format json`` writes it."""
    return {
        "bytes_moved_per_rank": report.bytes_moved_per_rank,
        "compute_s": dict(report.compute_s),
        "comm_s": report.comm_s,
        "exposed_comm_s": report.exposed_s,
        "step_s": report.step_s,
    }
