"""What ``zerofx plan`` shows for offload: the optimizer-state and parameter-shard placements the
engine would make for a ``Plan`` (the runtime's planners in ``zerofx.offload`` and
``zerofx.param_offload``, run without any storage)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerofx.offload import plan_engine_offload
from zerofx.offload_options import OffloadOptions, ParamOffloadOptions
from zerofx.param_offload import plan_engine_param_offload
from zerofx.passes.plan_offload import OffloadPlan, ParamOffloadPlan


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
