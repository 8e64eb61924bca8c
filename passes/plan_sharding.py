"""Planner: how each parameter is sharded, and which collectives the rewrite will issue.

Expects the captured joint graph (``zerofx.capture``), placeholders tagged with ``zerofx_role``
and ``zerofx_fqn``; outputs ``[loss, grad per primal]``. Reads only; changes nothing.

The schedule it predicts is the one ``shard_params_pass`` + ``reduce_grads_pass`` + the
partitioner produce; a test checks the two agree collective for collective.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from cost_models.memory import estimate_model_state_bytes
from passes import meta
from passes.plan import Collective, CommKind, ParamPlacement, Plan, ZeroStage


def place_param(fqn: str, shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool, world_size: int) -> ParamPlacement:
    """A parameter's flat layout: padded to a multiple of ``world_size``, 1/N of it per rank."""
    numel = math.prod(shape)
    shard = -(-numel // world_size)
    return ParamPlacement(fqn, tuple(shape), str(dtype), requires_grad, numel, shard, shard * world_size)


def plan_sharding(joint: fx.GraphModule, *, world_size: int, stage: ZeroStage, optimizer: str) -> Plan:
    assert world_size >= 1 and stage in ZeroStage
    graph = joint.graph
    primals = [n for n in meta.placeholders(graph) if n.meta[meta.ROLE] is not meta.Role.TANGENT]
    grads = meta.output_node(graph).args[0][1:]
    params = meta.placeholders(graph, meta.Role.PARAM)
    grad_of = {ph: g for ph, g in zip(primals, grads)}
    position = {n: i for i, n in enumerate(graph.nodes)}

    placements = [
        place_param(ph.meta[meta.FQN], tuple(ph.meta["val"].shape), ph.meta["val"].dtype, grad_of[ph] is not None, world_size)
        for ph in params
    ]
    by_fqn = {p.fqn: p for p in placements}

    def first_use(ph: fx.Node) -> int:
        return min((position[u] for u in ph.users), default=len(position))

    gather_order = tuple(ph.meta[meta.FQN] for ph in sorted(params, key=first_use) if ph.users)
    trainable = [ph for ph in params if grad_of[ph] is not None]
    reduce_order = tuple(ph.meta[meta.FQN] for ph in sorted(trainable, key=lambda ph: position[grad_of[ph]]))

    schedule: list[Collective] = []
    if stage is ZeroStage.THREE:
        backward = meta.backward_region(graph)
        for fqn in gather_order:
            schedule.append(Collective(CommKind.ALL_GATHER, fqn, "forward", by_fqn[fqn].shard_numel * by_fqn[fqn].itemsize))
        # Backward gathers again every parameter whose full value (or a view or cast of it) it reads.
        chains = meta.derived_only_from(graph, [ph for ph in params if ph.users], backward)
        chain_of = {ph.meta[meta.FQN]: chain for ph, chain in chains.items()}
        for fqn in gather_order:
            if any(u in backward for n in chain_of[fqn] for u in n.users):
                schedule.append(Collective(CommKind.ALL_GATHER, fqn, "backward", by_fqn[fqn].shard_numel * by_fqn[fqn].itemsize))
    grad_kind = CommKind.REDUCE_SCATTER if stage >= ZeroStage.TWO else CommKind.ALL_REDUCE
    for fqn in reduce_order:
        schedule.append(Collective(grad_kind, fqn, "backward", by_fqn[fqn].padded_numel * by_fqn[fqn].itemsize))
    if stage in (ZeroStage.ONE, ZeroStage.TWO):
        for fqn in reduce_order:
            schedule.append(Collective(CommKind.ALL_GATHER, fqn, "param_sync", by_fqn[fqn].shard_numel * by_fqn[fqn].itemsize))

    return Plan(
        world_size=world_size,
        stage=stage,
        optimizer=optimizer,
        params=tuple(placements),
        gather_order=gather_order,
        reduce_order=reduce_order,
        schedule=tuple(schedule),
        estimates=estimate_model_state_bytes(placements, stage=int(stage), optimizer=optimizer),
    )
