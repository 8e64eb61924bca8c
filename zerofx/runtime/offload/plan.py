"""The offload plans, built from the typed options and the sizes of what is offloaded, with no
storage: ``plan_engine_offload`` (where each optimizer-state record lives) and
``plan_engine_param_offload`` (where each stage-3 parameter shard lives), which the engine
calls, and ``plan_for_program``, what ``zerofx plan`` shows for a ``Plan``. The placement itself
is the pure planner in ``passes/memory/plan_offload.py``; this module turns options into its inputs and
its ``ValueError`` into a ``ConfigError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerofx.cost_models.compute import CPU_CORE
from zerofx.cost_models.offload import FP32_BYTES, record_numels
from zerofx.common.errors import ConfigError, PlanError
from zerofx.config.offload_options import OffloadOptions, ParamOffloadOptions
from zerofx.passes.plan.offload import OffloadPlan, ParamOffloadPlan
from zerofx.passes.memory.plan_offload import plan_offload, plan_param_offload


def plan_engine_offload(
    owned_numels: Mapping[str, int], options: OffloadOptions, *, optimizer: str, mixed_precision: bool, device_is_cpu: bool,
    forward_backward_s: float = 0.0, backward_s: float = 0.0,
) -> OffloadPlan:
    """The ``OffloadPlan`` for a rank's trainable parameters (``fqn -> owned elements``, in model
    order). Backward produces gradients in about the reverse order, so records are listed that way."""
    records = [
        (f, FP32_BYTES * sum(record_numels(n, optimizer=optimizer, mixed_precision=mixed_precision)))
        for f, n in reversed(list(owned_numels.items()))
    ]
    try:
        return plan_offload(
            records,
            options.tier_specs(sum(b for _, b in records), device_is_cpu=device_is_cpu),
            buffer_count=options.buffer_count,
            update_bytes_per_s=CPU_CORE.memory_bytes_per_s,
            prefetch_lead_s=backward_s,
            delayed_update=options.delayed_update,
            forward_backward_s=forward_backward_s,
        )
    except PlanError as exc:
        raise ConfigError(str(exc)) from None


def plan_engine_param_offload(
    shards: list[tuple[str, int, int, bool]], buckets: Any, options: ParamOffloadOptions, *, device_is_cpu: bool,
    forward_s: float = 0.0, backward_s: float = 0.0,
) -> ParamOffloadPlan:
    """The ``ParamOffloadPlan`` for a rank's sharded parameters ``(fqn, shard_numel, itemsize,
    trainable)`` in model order and the plan's gather buckets."""
    itemsize = max((i for _, _, i, _ in shards), default=1)
    try:
        return plan_param_offload(
            [(f, n * i, t) for f, n, i, t in shards], [tuple(b) for b in buckets],
            options.tier_specs(itemsize, device_is_cpu=device_is_cpu), buffer_count=options.buffer_count,
            forward_s=forward_s, backward_s=backward_s,
        )
    except PlanError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class ProgramOffload:
    """What ``zerofx plan`` prints for offload: the optimizer-state placement and, at stage 3
    with ``offload_param``, the parameter-shard placement. Its JSON is the optimizer plan's
    (unchanged) with a ``params`` key added for the shards."""

    optimizer: OffloadPlan | None
    params: ParamOffloadPlan | None

    def to_json(self) -> str:
        out: dict[str, Any] = json.loads(self.optimizer.to_json()) if self.optimizer is not None else {}
        if self.params is not None:
            out["params"] = json.loads(self.params.to_json())
        return json.dumps(out, indent=1, sort_keys=True)

    def __str__(self) -> str:
        return "\n".join(str(p) for p in (self.optimizer, self.params) if p is not None)


def plan_for_program(plan: Any, options: OffloadOptions | None, param_options: ParamOffloadOptions | None, *,
                     mixed_precision: bool, device_is_cpu: bool, compute_s: Mapping[str, float]) -> ProgramOffload | None:
    """What ``zerofx plan`` shows: the engine's ``OffloadPlan`` and ``ParamOffloadPlan`` for a
    ``Plan`` (None without offload), with the schedule's estimated forward and backward times as
    the I/O's cover."""
    forward, backward = compute_s.get("forward", 0.0), compute_s.get("backward", 0.0)
    opt_plan = None
    if options is not None:
        owned = {p.fqn: p.padded_numel if int(plan.stage) == 0 else p.shard_numel for p in plan.params if p.requires_grad}
        opt_plan = plan_engine_offload(owned, options, optimizer=plan.optimizer, mixed_precision=mixed_precision,
                                       device_is_cpu=device_is_cpu, forward_backward_s=forward + backward, backward_s=backward)
    param_plan = None
    if param_options is not None and int(plan.stage) == 3:
        sharded = [p for p in plan.params if p.fqn not in plan.persistent]
        param_plan = plan_engine_param_offload(
            [(p.fqn, p.shard_numel, p.itemsize, p.requires_grad) for p in sharded], _fetch_groups(plan), param_options,
            device_is_cpu=device_is_cpu, forward_s=forward, backward_s=backward,
        )
    if opt_plan is None and param_plan is None:
        return None
    return ProgramOffload(opt_plan, param_plan)


def _fetch_groups(plan: Any) -> list[tuple[str, ...]]:
    """The stage-3 shards in the order the graphs fetch them: each gather bucket, and each weight
    gathered one tile at a time on its own, where it is first used (``plan.gather_order``)."""
    bucket_of = {f: b for b in plan.gather_buckets for f in b}
    tiled = {f for f, _ in plan.tile_gathered}
    groups: list[tuple[str, ...]] = []
    for f in plan.gather_order:
        group = (f,) if f in tiled else bucket_of.get(f)
        if group is not None and group not in groups:
            groups.append(group)
    return groups
