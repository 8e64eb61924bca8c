"""``zerofx plan MODEL --sweep world-size=8,64,...``: the plan the planner chooses at each world
size next to the flat stage-3 plan, with the predicted step time, weak-scaling efficiency and
memory per rank.

Weak scaling: each rank keeps its batch (the example inputs), so the compute per rank is the
same at every world size and is estimated once, from one capture on fake tensors (no parameter
memory). The plans come from the parameters' shapes (NOTE [A plan from shapes alone]), so a
1,024-rank plan of a billion-parameter model costs no more than an 8-rank one. The step time is
``cost_models/hierarchy.py``'s (NOTE [Hierarchical sharding cost]).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from zerofx.compiler.capture import traced_param_infos
from zerofx.compiler.pipeline import capture_step
from zerofx.config import ZeroConfig
from zerofx.cost_models.comm import CommSpec
from zerofx.cost_models.compute import DeviceSpec
from zerofx.cost_models.hierarchy import estimate_step_comm_s, estimate_step_s
from zerofx.passes import Plan, ZeroStage
from zerofx.passes.zero.plan_shard_groups import bucket_bytes, device_budget, estimate_compute_s, plan_shard_group_size, prefetch_from_profile
from zerofx.passes.zero.plan_sharding import plan_sharding_from_shapes
from zerofx.common.errors import UsageError
from zerofx.common.units import format_bytes


@dataclass(frozen=True)
class PlanPoint:
    """One plan's predicted figures at one world size."""

    shard_group_size: int
    step_s: float
    efficiency: float  # step time at the smallest world size (same plan kind) over this one
    model_state_bytes: float
    prefetch_distance: int
    num_gather_buckets: int
    num_reduce_buckets: int
    largest_bucket_bytes: float
    comm_intra_s: float
    comm_inter_s: float
    cross_group_algorithm: str


@dataclass(frozen=True)
class SweepRow:
    world_size: int
    chosen: PlanPoint
    flat: PlanPoint
    decision: str


@dataclass(frozen=True)
class Sweep:
    label: str
    profile: str
    stage: int
    compute_s: float
    tokens_per_rank: int
    memory_budget_bytes: float | None
    rows: tuple[SweepRow, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _point(plan: Plan, *, compute_s: float, comm: CommSpec, overlap: bool) -> tuple[PlanPoint, float]:
    sizes = bucket_bytes(plan)
    est = estimate_step_comm_s(sizes, world_size=plan.world_size, shard_group_size=plan.shard_group_size, stage=int(plan.stage), spec=comm)
    step_s = estimate_step_s(est, compute_s, overlap=overlap)
    point = PlanPoint(plan.shard_group_size, step_s, 1.0, float(sum(plan.estimates.values())), plan.prefetch_distance,
                      len(plan.gather_buckets), len(plan.reduce_buckets), max(sizes, default=0.0), est.intra_s, est.inter_s,
                      est.cross_group_algorithm)
    return point, step_s


def sweep_world_sizes(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, label: str, cfg: ZeroConfig,
                      world_sizes: Sequence[int], comm: CommSpec, device: DeviceSpec, profile: str) -> Sweep:
    """The chosen and the flat plan at each world size (``cfg`` gives the stage, optimizer,
    precision and limits; its own world size and shard group size are ignored)."""
    stage, optimizer, options = ZeroStage(cfg.stage), cfg.optimizer.kind, cfg.schedule
    captured = capture_step(model, args, kwargs, compute_dtype=cfg.compute_dtype)
    compute_s = estimate_compute_s(captured.joint, device)
    tokens = max((a.numel() for a in args if hasattr(a, "numel")), default=0)
    infos = [(i.fqn, i.shape, i.dtype, i.requires_grad) for i in traced_param_infos(model, compute_dtype=cfg.compute_dtype)]
    budget = device_budget(device, options.memory_budget_bytes)

    def plan_at(n: int, k: int) -> Plan:
        plan = plan_sharding_from_shapes(infos, world_size=n, stage=stage, optimizer=optimizer, options=options, comm=comm, shard_group_size=k)
        if stage is ZeroStage.THREE and options.prefetch_distance is None:
            distance = prefetch_from_profile(plan, compute_s=compute_s, comm=comm)
            plan = plan_sharding_from_shapes(infos, world_size=n, stage=stage, optimizer=optimizer, comm=comm, shard_group_size=k,
                                             options=replace(options, prefetch_distance=distance))
        return plan

    rows = []
    for n in sorted(world_sizes):
        k, decision, _ = plan_shard_group_size(lambda k, n=n: plan_at(n, k), world_size=n, compute_s=compute_s, comm=comm,
                                               memory_budget_bytes=budget, overlap=options.overlap)
        chosen, _ = _point(plan_at(n, k), compute_s=compute_s, comm=comm, overlap=options.overlap)
        flat, _ = _point(plan_at(n, n), compute_s=compute_s, comm=comm, overlap=options.overlap)
        rows.append(SweepRow(n, chosen, flat, decision))
    base_chosen, base_flat = rows[0].chosen.step_s, rows[0].flat.step_s
    rows = [replace(r, chosen=replace(r.chosen, efficiency=base_chosen / r.chosen.step_s),
                    flat=replace(r.flat, efficiency=base_flat / r.flat.step_s)) for r in rows]
    return Sweep(label, profile, int(stage), compute_s, tokens, budget, tuple(rows))


def _buckets(p: PlanPoint) -> str:
    return f"{p.num_gather_buckets}/{p.num_reduce_buckets} (max {format_bytes(p.largest_bucket_bytes)})"


def format_sweep(sweep: Sweep) -> str:
    """The sweep as a table: the chosen plan's columns, then the flat plan's."""
    from tabulate import tabulate

    headers = ["world size", "step ms", "efficiency", "memory/rank", "K", "prefetch", "buckets g/r", "cross-group",
               "flat step ms", "flat efficiency", "flat memory/rank", "flat prefetch", "flat buckets g/r"]
    rows = []
    for r in sweep.rows:
        c, f = r.chosen, r.flat
        rows.append([r.world_size, f"{c.step_s * 1e3:.1f}", f"{c.efficiency:.1%}", format_bytes(c.model_state_bytes), c.shard_group_size,
                     c.prefetch_distance, _buckets(c), c.cross_group_algorithm or "-", f"{f.step_s * 1e3:.1f}", f"{f.efficiency:.1%}",
                     format_bytes(f.model_state_bytes), f.prefetch_distance, _buckets(f)])
    budget = "none" if sweep.memory_budget_bytes is None else format_bytes(sweep.memory_budget_bytes)
    lines = [f"zerofx plan {sweep.label} --sweep: ZeRO stage {sweep.stage}, profile {sweep.profile}, weak scaling at "
             f"{sweep.tokens_per_rank:,} tokens per rank; compute {sweep.compute_s * 1e3:.1f} ms per step per rank (compute model), "
             f"memory budget {budget}; memory is model state per rank (parameters, gradients, optimizer states)",
             tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)]
    lines += [f"decision at {r.world_size}: {r.decision}" for r in sweep.rows]
    return "\n".join(lines)


def plot_sweep(sweep: Sweep, path: Path) -> None:
    """Weak-scaling efficiency and step time against world size, chosen and flat, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r.world_size for r in sweep.rows]
    fig, (eff_ax, step_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points, style in (("chosen", [r.chosen for r in sweep.rows], "o-"), ("flat stage 3", [r.flat for r in sweep.rows], "s--")):
        eff_ax.plot(sizes, [p.efficiency * 100 for p in points], style, label=name)
        step_ax.plot(sizes, [p.step_s * 1e3 for p in points], style, label=name)
    for r in sweep.rows:
        eff_ax.annotate(f"K={r.chosen.shard_group_size}", (r.world_size, r.chosen.efficiency * 100), xytext=(4, 6),
                        textcoords="offset points", fontsize=8)
    for ax in (eff_ax, step_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size (ranks)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    eff_ax.set_ylabel("weak-scaling efficiency (%)")
    eff_ax.axhline(90, color="gray", ls=":", lw=1)
    step_ax.set_ylabel("predicted step (ms)")
    step_ax.axhline(sweep.compute_s * 1e3, color="gray", ls=":", lw=1, label="compute")
    fig.suptitle(f"zerofx plan {sweep.label} --sweep, profile {sweep.profile}, {sweep.tokens_per_rank:,} tokens per rank", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_sweep(text: str) -> list[int]:
    """``world-size=8,64,512`` -> [8, 64, 512]; ValueError naming what is accepted."""
    key, _, values = text.partition("=")
    if key.strip() != "world-size" or not values:
        raise UsageError(f"--sweep {text!r}; accepted: world-size=N1,N2,... (e.g. world-size=8,64,512,1024)")
    try:
        sizes = [int(v) for v in values.split(",")]
    except ValueError:
        raise UsageError(f"--sweep {text!r}: world sizes must be integers; accepted: world-size=N1,N2,...") from None
    if any(s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
        raise UsageError(f"--sweep {text!r}: world sizes must be distinct integers >= 1")
    return sorted(sizes)
