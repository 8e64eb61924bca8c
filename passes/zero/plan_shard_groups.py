"""Planner: the shard group size K for ``"zerofx": {"shard_group_size": "auto"}``.

Takes a function that plans the step at a given K (``plan_sharding`` or
``plan_sharding_from_shapes`` with everything else bound), the step's compute time and the
hardware profile; reads the plans' buckets and model-state estimates and changes nothing.
The prediction and the choice are ``cost_models/hierarchy.py``'s (NOTE [Hierarchical sharding
cost]); this module only turns plans into its inputs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch.fx as fx

from zerofx.cost_models.comm import CommSpec
from zerofx.cost_models.compute import DeviceSpec, estimate_node_s, fused_node_seconds
from zerofx.cost_models.comm import estimate_all_gather_s
from zerofx.cost_models.hierarchy import StepEstimate, choose_prefetch_distance_s, choose_shard_group_size
from zerofx.passes.plan import Plan, ScheduleOptions, ZeroStage
from zerofx.passes.zero.plan_sharding import plan_sharding


def estimate_compute_s(joint: fx.GraphModule, device: DeviceSpec, *, fused: bool = False) -> float:
    """Seconds of compute in one step of the captured joint graph (forward and backward), from
    the compute model: the same on every rank and at every world size (weak scaling). ``fused``:
    as Inductor runs it (NOTE [Fused kernels under Inductor] in cost_models/compute.py)."""
    if fused:
        return sum(fused_node_seconds(joint.graph, device).values())
    return sum(estimate_node_s(n, device) for n in joint.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)


def bucket_bytes(plan: Plan) -> list[float]:
    """The full (unsharded) bytes of each bucket the step communicates: the stage-3 gather
    buckets (the reductions use the same parameters), else the gradient buckets."""
    buckets = plan.gather_buckets if plan.stage is ZeroStage.THREE and plan.gather_buckets else plan.reduce_buckets
    return [float(sum(plan.param(f).padded_numel * plan.param(f).itemsize for f in b)) for b in buckets]


def plan_shard_group_size(plan_at: Callable[[int], Plan], *, world_size: int, compute_s: float, comm: CommSpec,
                          memory_budget_bytes: float | None, overlap: bool = True) -> tuple[int, str, dict[int, StepEstimate]]:
    """The shard group size with the least predicted step time whose model state fits the
    budget, the decision line, and every candidate's estimate (keyed by K)."""
    plans: dict[int, Plan] = {}

    def at(k: int) -> Plan:
        if k not in plans:
            plans[k] = plan_at(k)
        return plans[k]

    stage = int(at(world_size).stage)
    return choose_shard_group_size(
        world_size, stage=stage, spec=comm, compute_s=compute_s,
        buckets_for=lambda k: bucket_bytes(at(k)), memory_for=lambda k: float(sum(at(k).estimates.values())),
        memory_budget_bytes=memory_budget_bytes, overlap=overlap,
    )


def prefetch_from_profile(plan: Plan, *, compute_s: float, comm: CommSpec) -> int:
    """Stage 3: gather buckets ahead so that the largest bucket's gather over the shard group is
    done in the compute of the buckets before it (``choose_prefetch_distance_s``); each gather
    bucket stands for its share of the step's compute (forward and backward each gather it)."""
    sizes = bucket_bytes(plan)
    if plan.stage is not ZeroStage.THREE or not sizes:
        return plan.prefetch_distance
    per_bucket_s = compute_s / (2 * len(sizes))
    gather_s = estimate_all_gather_s(max(sizes), plan.shard_group_size, comm)
    return choose_prefetch_distance_s(gather_s, per_bucket_s)


def device_budget(device: DeviceSpec, memory_budget_bytes: float | None) -> float | None:
    """The memory the chooser fits model state in: the config's budget, else the device's memory."""
    return memory_budget_bytes if memory_budget_bytes is not None else device.memory_capacity_bytes


def plan_auto_shard_group_size(joint: fx.GraphModule, *, world_size: int, stage: ZeroStage, optimizer: str,
                               options: ScheduleOptions, comm: CommSpec, device: DeviceSpec) -> tuple[int, str]:
    """``"shard_group_size": "auto"``: K and the decision line, from the captured step's compute
    estimate and ``plan_sharding``'s buckets and model state at each candidate K. Stage 0 shards
    nothing, so it stays flat."""
    if stage is ZeroStage.ZERO:
        return world_size, f"shard group size {world_size} (flat): ZeRO stage 0 shards nothing"
    compute_s = estimate_compute_s(joint, device)

    def plan_at(k: int) -> Plan:
        return plan_sharding(joint, world_size=world_size, stage=stage, optimizer=optimizer, options=options, comm=comm, shard_group_size=k)

    k, reason, _ = plan_shard_group_size(plan_at, world_size=world_size, compute_s=compute_s, comm=comm,
                                         memory_budget_bytes=device_budget(device, options.memory_budget_bytes), overlap=options.overlap)
    return k, reason
