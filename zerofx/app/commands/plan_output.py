"""What ``zerofx plan`` prints and writes beyond the planner's own tables: the line naming the
hardware the times are for, the plot's title, what folding did, a rank's resident memory, the
memory timeline and compute/communication Gantt chart as a PNG (``--plot``), and the plan,
schedule and memory as JSON (``--format json``). Imports no torch at module level (NOTE [A
command line that answers at once] in zerofx/app/cli.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerofx.common.units import binary_unit, format_bytes

if TYPE_CHECKING:
    from zerofx.compiler.program import Program
    from zerofx.passes.analysis.analyze_schedule import ScheduleReport
    from zerofx.planner.folding import FoldedReport
    from zerofx.planner.solve import ModelSpec

# The hardware a plan's times are for, after "estimated step N ms". The default profile models
# one CPU core per rank over gloo, which a reader planning for GPUs would not guess.
DEFAULT_PROFILE = "cpu"


def step_note(profile: str, comm: Any, device: Any) -> str:
    """What follows the summary's step time: the hardware it is for, and, for the default CPU
    profile, how to pick another."""
    if profile == DEFAULT_PROFILE:
        return (f" for CPU gloo, one core per rank (the default profile, {comm.name} / {device.name}; "
                "--profile h100 or a file from zerofx calibrate estimates other hardware)")
    return f" for profile {comm.name} / {device.name}"


def plot_title(label: str, *, world_size: int, stage: int, profile: str) -> str:
    """The plot's title: what was planned, for how many ranks, at which stage, on which hardware."""
    return f"zerofx plan {label}: ZeRO stage {stage}, world size {world_size}, profile {profile}"


def shapes(spec: ModelSpec) -> str:
    import torch

    return ", ".join(str(tuple(t.shape)) for t in [*spec.args, *spec.kwargs.values()] if isinstance(t, torch.Tensor))


def folded_explanation(folded: FoldedReport, *, block_params: int, num_params: int) -> str:
    """One line saying what folding did, so that the whole model's parameter count and the smaller
    one of the plan printed after it (the larger cut's) read together."""
    blocks, (low, high) = folded.blocks, folded.cuts
    if folded.planned_whole:
        return (f"folded: {blocks.path!r} holds {blocks.count} identical blocks of {block_params:,} parameters; {folded.whole_because} "
                f"(docs/planner.md#layer-folding-planning-a-20b-model-in-seconds), so zerofx planned all {blocks.count}:")
    return (f"folded: {blocks.path!r} holds {blocks.count} identical blocks of {block_params:,} parameters; zerofx planned "
            f"copies of the model cut to {low} and {high} blocks, and the whole model's figures are the {high}-block copy's "
            f"plus {blocks.count - high} times what one more block adds (--fold off plans all {blocks.count}). "
            f"The plan below is the {high}-block copy's:")


def rank_runtime_bytes(device: Any, cfg: Any) -> float:
    """What a rank holds besides the step's tensors: the runtime's baseline, and what Inductor keeps
    resident where the config compiles with it (NOTE [What Inductor keeps resident] in cost_models/memory.py)."""
    from zerofx.config.options import GraphCompiler
    from zerofx.cost_models.memory import inductor_resident_bytes

    compiled = inductor_resident_bytes(device) if cfg.graph_compiler is GraphCompiler.INDUCTOR else 0.0
    return device.runtime_bytes + compiled


# The Gantt chart's colours: one per graph on the compute lane, one per collective kind.
_GRAPH_COLORS = {"forward": "tab:green", "backward": "tab:olive", "param_sync": "tab:cyan"}
_COMM_COLORS = {"all_gather_into_tensor": ("tab:blue", "all-gather"), "reduce_scatter_tensor": ("tab:orange", "reduce-scatter"),
                "all_reduce": ("tab:purple", "all-reduce")}


def plot_report(report: ScheduleReport, path: Path, *, title: str, budget_bytes: float | None = None) -> Any:
    """Two panels on one time axis (ms from the step's start, estimated): live memory per rank,
    with the peak marked and labelled, and a Gantt chart of compute (each graph, and the time
    compute waits on communication) and of the collectives. ``title`` heads the figure (the
    CLI's names the model, world size, stage and profile). Writes a PNG to ``path`` and returns
    the matplotlib Figure (closed: for reading, not showing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (mem_ax, gantt_ax) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    ms = 1e3
    top = max([report.peak.live_bytes, *([budget_bytes] if budget_bytes is not None else [])])
    unit, scale = binary_unit(top)
    # Memory: the live bytes after each node, held until the next one (a step function of time).
    times = [x * ms for x in report.timeline_s] if report.timeline_s else list(range(len(report.timeline)))
    live = [p.live_bytes / scale for p in report.timeline]
    mem_ax.step(times, live, where="post", lw=1, color="tab:blue", label="live memory per rank")
    mem_ax.axhline(report.persistent_bytes / scale, color="gray", ls=":", label=f"persistent model state ({format_bytes(report.persistent_bytes)})")
    if budget_bytes is not None:
        mem_ax.axhline(budget_bytes / scale, color="red", ls="--", label=f"budget ({format_bytes(budget_bytes)})")
    at = report.timeline.index(report.peak)
    peak_x, peak_y = times[at], report.peak.live_bytes / scale
    where = f"{report.peak.graph}" + (f", {report.peak_module}" if report.peak_module else "")
    mem_ax.plot([peak_x], [peak_y], "o", color="red", ms=6, zorder=3)
    mem_ax.annotate(f"peak {format_bytes(report.peak.live_bytes)} ({where})", (peak_x, peak_y), xytext=(10, 10),
                    textcoords="offset points", va="bottom", fontsize=9, color="red",
                    bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "red", "alpha": 0.9})
    mem_ax.set_ylim(0, max(live + [top / scale]) * 1.3)
    mem_ax.set_ylabel(f"live memory per rank ({unit})")
    mem_ax.legend(loc="lower center", fontsize=8)
    mem_ax.grid(alpha=0.3)
    # Gantt: each graph's compute, the time it waits on a collective (exposed), the collectives.
    for span in report.spans:
        gantt_ax.barh("compute", (span.end_s - span.start_s) * ms, left=span.start_s * ms, color=_GRAPH_COLORS.get(span.graph, "tab:gray"),
                      edgecolor="white", height=0.6)
        gantt_ax.text((span.start_s + span.end_s) / 2 * ms, 0, span.graph, ha="center", va="center", fontsize=8)
        mem_ax.text((span.start_s + span.end_s) / 2 * ms, 0.97, span.graph, transform=mem_ax.get_xaxis_transform(), ha="center",
                    va="top", fontsize=9, color="dimgray")
        for ax in (mem_ax, gantt_ax):
            ax.axvline(span.start_s * ms, color="black", lw=0.5)
    for row in report.rows:
        if row.exposed_s > 0:
            gantt_ax.barh("compute", row.exposed_s * ms, left=(row.end_s - row.exposed_s) * ms, color="red", height=0.6)
        gantt_ax.barh("communication", (row.end_s - row.start_s) * ms, left=row.start_s * ms, color=_COMM_COLORS.get(row.op, ("gray", ""))[0],
                      linewidth=0, height=0.6)
    ops = {row.op for row in report.rows}
    handles = [Patch(color=c, label=label) for op, (c, label) in _COMM_COLORS.items() if op in ops]
    handles.append(Patch(color="red", label="compute waiting (exposed communication)"))
    gantt_ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(handles), fontsize=8, frameon=False)
    gantt_ax.set_xlabel("time from the step's start (ms, estimated)" if report.timeline_s else "node")
    gantt_ax.set_xlim(0, report.step_s * ms)
    gantt_ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{title}\nstep {report.step_s * ms:.1f} ms; communication {report.comm_s * ms:.1f} ms, of which exposed "
                 f"{report.exposed_s * ms:.1f} ms; peak {format_bytes(report.peak.live_bytes)} per rank", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def report_json(program: Program, report: ScheduleReport, budget_bytes: float | None, *, device_peak_bytes: float | None = None,
                micro_batches: int = 1) -> str:
    """The plan, the schedule's rows, memory with the fits verdict, and the summary, as ``zerofx plan --format json`` prints them."""
    from zerofx.passes.analysis.analyze_schedule import summary_json

    plan = json.loads(program.plan.to_json())
    return json.dumps(
        {
            "plan": plan,
            "schedule": [r.__dict__ for r in report.rows],
            "memory": {
                "persistent_bytes": report.persistent_bytes,
                "peak_bytes": report.peak.live_bytes,
                "peak_at": f"{report.peak.graph}:{report.peak.node}",
                "peak_module": report.peak_module,
                "budget_bytes": budget_bytes,
                # With offload, the device's bytes: the peak less what host memory and NVMe hold.
                "fits": None if budget_bytes is None else (report.peak.live_bytes if device_peak_bytes is None else device_peak_bytes) <= budget_bytes,
            },
            "summary": summary_json(report, micro_batches=micro_batches),
        },
        indent=1,
        default=list,
    )
