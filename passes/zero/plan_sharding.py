"""Planner: how each parameter is sharded, and which collectives the rewrite will issue.

Expects the captured joint graph (``zerofx.compiler.capture``), placeholders tagged with ``zerofx_role``
and ``zerofx_fqn``; outputs ``[loss, grad per primal]``. Reads only; changes nothing.
``plan_sharding_from_shapes`` plans from the parameters alone, before any capture, through the
same code (NOTE [A plan from shapes alone]).

The schedule it predicts is the one ``tile_weights_pass`` + ``shard_params_pass`` +
``reduce_grads_pass`` + the partitioner produce; a test checks the two agree collective for
collective. At stage 3 it also chooses which feature-tiled weights are gathered one tile at a
time (``Plan.tile_gathered``) and which are gathered whole, with the reason in ``decisions``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Sequence

import torch
import torch.fx as fx

from zerofx.cost_models.comm import CPU_GLOO, CommSpec, efficient_bucket_bytes
from zerofx.cost_models.memory import estimate_model_state_bytes
from zerofx.passes import meta
from zerofx.passes.plan import (
    REPLICATE,
    Collective,
    CommKind,
    ParamPlacement,
    Plan,
    ScheduleOptions,
    ZeroStage,
)
from zerofx.passes.zero.plan_buckets import choose_prefetch_distance, plan_buckets, repeated_blocks_of
from zerofx.passes.zero.tile_weights import BACKWARD as TILED_BACKWARD
from zerofx.passes.zero.tile_weights import FORWARD as TILED_FORWARD
from zerofx.passes.zero.tile_weights import tile_gatherable
from zerofx.passes.tiled_kernels import tile_bounds

_tiling_log = logging.getLogger("zerofx.tiling")  # weights gathered whole, with the reason


def place_param(fqn: str, shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool, world_size: int,
                shard_group_size: int | None = None) -> ParamPlacement:
    """A parameter's flat layout: padded to a multiple of the shard group size K (the world size
    when flat), 1/K of it per rank; rank r holds shard ``r % K`` (NOTE [Shard groups of
    consecutive ranks])."""
    k = world_size if shard_group_size is None else shard_group_size
    assert k >= 1 and world_size % k == 0, (world_size, k)
    numel = math.prod(shape)
    shard = -(-numel // k)
    return ParamPlacement(fqn, tuple(shape), str(dtype), requires_grad, numel, shard, shard * k)


DEFAULT_MAX_BUCKET_NUMEL = 50_000_000
_DEFAULT_OPTIONS = ScheduleOptions()  # frozen, so one shared default is safe


def persistent_params(placements: list[ParamPlacement], stage: ZeroStage, threshold: int) -> frozenset[str]:
    """Stage-3 parameters small enough to keep whole on every rank: gathering them would cost a
    collective's latency for a few bytes (DeepSpeed's ``stage3_param_persistence_threshold``)."""
    if stage is not ZeroStage.THREE:
        return frozenset()
    return frozenset(p.fqn for p in placements if p.numel < threshold)


def plan_sharding(
    joint: fx.GraphModule,
    *,
    world_size: int,
    stage: ZeroStage,
    optimizer: str,
    options: ScheduleOptions = _DEFAULT_OPTIONS,
    comm: CommSpec = CPU_GLOO,
    shard_group_size: int | None = None,
) -> Plan:
    assert world_size >= 1 and stage in ZeroStage
    k = world_size if shard_group_size is None else shard_group_size
    graph = joint.graph
    primals = [n for n in meta.placeholders(graph) if n.meta[meta.ROLE] is not meta.Role.TANGENT]
    grads = meta.output_node(graph).args[0][1:]
    params = meta.placeholders(graph, meta.Role.PARAM)
    grad_of = {ph: g for ph, g in zip(primals, grads)}
    position = {n: i for i, n in enumerate(graph.nodes)}

    placements = [
        place_param(ph.meta[meta.FQN], tuple(ph.meta["val"].shape), ph.meta["val"].dtype, grad_of[ph] is not None, world_size, k)
        for ph in params
    ]

    def first_use(ph: fx.Node) -> int:
        return min((position[u] for u in ph.users), default=len(position))

    persistent = persistent_params(placements, stage, options.persistence_threshold)
    tiled, decisions = ({}, [])
    read_in_backward: frozenset[str] = frozenset()
    if stage is ZeroStage.THREE:
        tiled, decisions = _tile_gathered(params, {p.fqn: p for p in placements}, world_size, persistent, k)
        # Backward gathers a bucket again if it reads the full value (or a view or cast) of any member.
        backward = meta.backward_region(graph)
        chains = meta.derived_only_from(graph, [ph for ph in params if ph.users], backward)
        read_in_backward = frozenset(ph.meta[meta.FQN] for ph, chain in chains.items() if any(u in backward for n in chain for u in n.users))
    trainable = [ph for ph in params if grad_of[ph] is not None]
    return _plan(
        placements,
        forward_order=tuple(ph.meta[meta.FQN] for ph in sorted(params, key=first_use) if ph.users),
        reduce_order=tuple(ph.meta[meta.FQN] for ph in sorted(trainable, key=lambda ph: position[grad_of[ph]])),
        read_in_backward=read_in_backward, persistent=persistent, tiled=tiled, decisions=decisions,
        world_size=world_size, shard_group_size=k, stage=stage, optimizer=optimizer, options=options, comm=comm,
    )


def plan_sharding_from_shapes(
    params: Sequence[tuple[str, tuple[int, ...], torch.dtype, bool]],
    *,
    world_size: int,
    stage: ZeroStage,
    optimizer: str,
    options: ScheduleOptions = _DEFAULT_OPTIONS,
    comm: CommSpec = CPU_GLOO,
    shard_group_size: int | None = None,
) -> Plan:
    """The plan from the parameters alone, as (fqn, shape, dtype, requires_grad) in registration
    order, each once: what ``zerofx.compile`` gives before any capture.

    NOTE [A plan from shapes alone]
    Placements, persistence and the bytes per rank need only the parameters, and come out of the
    same code as ``plan_sharding``'s, so they agree with the capture's plan. What the graph
    would tell is assumed instead: the forward uses the parameters in registration order, the
    backward produces their gradients in reverse, every trainable parameter gets one, and at
    stage 3 backward reads every gathered bucket again. No weight is tiled (tiling comes from
    the capture). A model whose forward keeps its registration order (the bundled DNA LM does)
    plans identically; where it does not (Hugging Face's Llama registers each block's norms
    after its linears), the capture's plan orders the same parameters by first use.
    """
    assert world_size >= 1 and stage in ZeroStage
    k = world_size if shard_group_size is None else shard_group_size
    placements = [place_param(fqn, tuple(shape), dtype, requires_grad, world_size, k) for fqn, shape, dtype, requires_grad in params]
    persistent = persistent_params(placements, stage, options.persistence_threshold)
    return _plan(
        placements,
        forward_order=tuple(p.fqn for p in placements),
        reduce_order=tuple(p.fqn for p in reversed(placements) if p.requires_grad),
        read_in_backward=frozenset(p.fqn for p in placements) if stage is ZeroStage.THREE else frozenset(),
        persistent=persistent, tiled={}, decisions=[],
        world_size=world_size, shard_group_size=k, stage=stage, optimizer=optimizer, options=options, comm=comm,
    )


def _plan(
    placements: list[ParamPlacement],
    *,
    forward_order: tuple[str, ...],
    reduce_order: tuple[str, ...],
    read_in_backward: frozenset[str],
    persistent: frozenset[str],
    tiled: dict[str, tuple[int, bool, bool]],
    decisions: list[str],
    world_size: int,
    shard_group_size: int,
    stage: ZeroStage,
    optimizer: str,
    options: ScheduleOptions,
    comm: CommSpec,
) -> Plan:
    """The plan from what both planners know: the placements, the parameters the forward reads
    in order of first use, the trainable ones in order of gradient production, the ones backward
    reads, and the weights gathered one tile at a time."""
    by_fqn = {p.fqn: p for p in placements}
    gather_order = tuple(f for f in forward_order if f not in persistent)

    # Bucket caps: the config's (in elements), else the smallest message the ring moves efficiently.
    itemsize = placements[0].itemsize if placements else 4
    # At large world sizes the efficient message grows with N (N - 1 latencies per ring); bound it
    # by DeepSpeed's default stage3_prefetch_bucket_size (5e7 elements) so gathered memory stays sane.
    # Gathers and reduce-scatters run over the shard group, so the ring that sets the size has K ranks.
    default_cap = min(efficient_bucket_bytes(shard_group_size, comm), DEFAULT_MAX_BUCKET_NUMEL * itemsize)

    def cap(numel: int | None) -> int:
        return default_cap if numel is None else int(numel) * itemsize

    padded_bytes = {p.fqn: p.padded_numel * p.itemsize for p in placements}
    block_of = repeated_blocks_of({p.fqn: p.shape for p in placements})
    buckets = functools.partial(plan_buckets, block_of=block_of)
    gather_buckets = reduce_buckets = sync_buckets = ()
    prefetch = 0
    if stage is ZeroStage.THREE:
        gather_buckets = buckets([f for f in gather_order if f not in tiled], padded_bytes, cap(options.gather_bucket_numel))
        preferred = 1 if options.prefetch_distance is None else options.prefetch_distance
        numels = [sum(by_fqn[f].padded_numel for f in b) for b in gather_buckets]
        prefetch = choose_prefetch_distance(numels, options.max_live_numel, preferred=preferred) if options.overlap else 0
    reduce_buckets = buckets([f for f in reduce_order if f not in tiled], padded_bytes, cap(options.reduce_bucket_numel))
    if stage in (ZeroStage.ONE, ZeroStage.TWO):
        sync_buckets = buckets(reduce_order, padded_bytes, cap(options.sync_bucket_numel))
    elif stage is ZeroStage.THREE and persistent:
        sync_buckets = buckets([f for f in reduce_order if f in persistent], padded_bytes, cap(options.sync_bucket_numel))

    def shard_bytes(bucket: tuple[str, ...]) -> int:
        return sum(by_fqn[f].shard_numel * by_fqn[f].itemsize for f in bucket)

    schedule: list[Collective] = []
    if stage is ZeroStage.THREE:
        schedule += [Collective(CommKind.ALL_GATHER, b, "forward", shard_bytes(b)) for b in gather_buckets]
        needed = read_in_backward - persistent
        schedule += [Collective(CommKind.ALL_GATHER, b, "backward", shard_bytes(b)) for b in gather_buckets if needed & set(b)]
    # NOTE [Stages 1 and 2 move 2 Psi]: gradients are reduce-scattered (stage 2 in backward,
    # stage 1 once per optimizer step in grad_sync), then updated shards all-gathered.
    for b in reduce_buckets:
        if stage is ZeroStage.ZERO:
            schedule.append(Collective(CommKind.ALL_REDUCE, b, "backward", sum(padded_bytes[f] for f in b)))
            continue
        graph = "grad_sync" if stage is ZeroStage.ONE else "backward"
        schedule.append(Collective(CommKind.REDUCE_SCATTER, b, graph, sum(padded_bytes[f] for f in b)))
        if shard_group_size < world_size:  # the shard, averaged across the replicas (NOTE [Shard groups of consecutive ranks])
            schedule.append(Collective(CommKind.ALL_REDUCE, b, graph, shard_bytes(b), group=REPLICATE))
    schedule += [Collective(CommKind.ALL_GATHER, b, "param_sync", shard_bytes(b)) for b in sync_buckets]
    for fqn, (tiles, gathers_in_backward, reduces) in tiled.items():  # NOTE [One weight tile at a time]
        p = by_fqn[fqn]
        bounds = tile_bounds(p.shape[0] // world_size, tiles)
        tile_bytes = [(e - a) * p.shape[1] * p.itemsize for a, e in itertools.pairwise(bounds)]
        schedule += [Collective(CommKind.ALL_GATHER, (fqn,), "forward", b) for b in tile_bytes]
        schedule += [Collective(CommKind.ALL_GATHER, (fqn,), "backward", b) for b in tile_bytes if gathers_in_backward]
        schedule += [Collective(CommKind.REDUCE_SCATTER, (fqn,), "backward", world_size * b) for b in tile_bytes if reduces]

    # NOTE [gloo's reduce-scatter as an all-to-all] (passes/zero/reduce_scatter_all_to_all.py)
    by_all_to_all = comm.backend == "gloo" if options.reduce_scatter_by_all_to_all is None else options.reduce_scatter_by_all_to_all
    return Plan(
        world_size=world_size,
        stage=stage,
        optimizer=optimizer,
        params=tuple(placements),
        gather_order=gather_order,
        reduce_order=reduce_order,
        gather_buckets=gather_buckets,
        reduce_buckets=reduce_buckets,
        sync_buckets=sync_buckets,
        prefetch_distance=prefetch,
        overlap=options.overlap,
        persistent=tuple(sorted(persistent)),
        schedule=tuple(schedule),
        estimates=estimate_model_state_bytes(placements, stage=int(stage), optimizer=optimizer, persistent=persistent),
        decisions=tuple(decisions),
        tile_gathered=tuple((f, t) for f, (t, _, _) in tiled.items()),
        shard_group_size=shard_group_size,
        reduce_scatter_by_all_to_all=by_all_to_all,
    )


def _tile_gathered(params: list[fx.Node], by_fqn: dict[str, ParamPlacement], world_size: int,
                   persistent: set[str] | frozenset[str], shard_group_size: int) -> tuple[dict[str, tuple[int, bool, bool]], list[str]]:
    """Stage 3: the weights of feature-tiled linears that are gathered one tile at a time, as
    fqn -> (tiles, whether backward gathers the tiles again, whether their gradient is reduced),
    and a decision for each such weight gathered whole instead (NOTE [One weight tile at a time])."""
    tiled: dict[str, tuple[int, bool, bool]] = {}
    decisions: list[str] = []
    for ph in params:
        forward = next((u for u in ph.users if u.target is TILED_FORWARD and u.args[1] is ph), None)
        if forward is None:
            continue
        fqn, tiles = ph.meta[meta.FQN], forward.args[3]
        if fqn in persistent:
            reason = "it is below the persistence threshold (kept whole on every rank)"
        elif shard_group_size < world_size:
            reason = f"weight tiles are gathered over all ranks, and shard groups of {shard_group_size} ranks are set"
        else:
            reason = tile_gatherable(ph, world_size)
        if reason is not None:
            decisions.append(f"weight {fqn} is gathered whole, not in {tiles} tiles: {reason}")
            continue
        rows = by_fqn[fqn].shape[0] // world_size
        if tiles > rows:
            decisions.append(f"weight {fqn}: {rows} tiles instead of {tiles}, one row of the weight per rank and tile "
                             f"({by_fqn[fqn].shape[0]} output features over {world_size} ranks)")
            tiles = rows
        backward = next((u for u in ph.users if u.target is TILED_BACKWARD), None)
        used = {u.args[1] for u in backward.users} if backward is not None else set()
        tiled[fqn] = (tiles, 0 in used, 1 in used)
    for d in decisions:
        _tiling_log.info("%s", d)
    return tiled, decisions
