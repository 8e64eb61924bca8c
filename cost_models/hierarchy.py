"""Step communication and memory of flat and hierarchical sharding, and the choice of the shard
group size.

Pure: functions of the buckets' bytes, the world size, the shard group size K, the ZeRO stage
and a frozen ``CommSpec``; nothing here reads a graph or measures the machine.

NOTE [Hierarchical sharding cost]
With shard groups of K consecutive ranks (K divides N), ZeRO state is sharded within a group and
replicated across the N / K groups (MiCS, ZeRO++ hpZ, FSDP2's HSDP). Per bucket of B bytes (the
full, unsharded message) a stage-3 step issues, within the group, an all-gather of B in forward,
another in backward, and a reduce-scatter of the gradient; across groups, an all-reduce of the
B / K shard among the N / K ranks that hold the same shard. Stages 1 and 2 issue the
reduce-scatter, the cross-group all-reduce and one all-gather of the updated shard (2 bytes moved
per parameter byte within the group, as the ZeRO paper's stage 1); stage 0 all-reduces B over
all N ranks. K = N is the flat plan: no cross-group all-reduce, every collective spans all N.

A collective whose ranks sit on one node runs on the intra-node link; one that spans nodes runs
at the inter-node link's bandwidth. The two links work at the same time, so with overlap the
communication costs ``max(intra, inter)``, hidden under compute up to the compute's length:
``step = max(compute, intra, inter) + tail``. The tail is what nothing can hide: the first
bucket's all-gather before the forward's first matmul, and the last bucket's reduction after the
backward's last one. Without overlap: ``step = compute + intra + inter``.

Model state per rank at stage 3 is 16P/K bytes for mixed-precision Adam (``memory.py``'s
accounting at world size K): halving K doubles it. The chooser takes the K with the least
predicted step time whose memory fits the budget; among steps within 0.5% of it, the one with the
least inter-node time, then the larger K.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zerofx.cost_models.comm import (
    CommSpec,
    all_reduce_algorithm,
    estimate_all_gather_s,
    estimate_all_reduce_s,
    estimate_reduce_scatter_s,
)
from zerofx.cost_models.memory import estimate_model_state_bytes
from zerofx.common.units import format_bytes
from zerofx.common.errors import PlanError


@dataclass(frozen=True)
class StepCommEstimate:
    """Predicted communication of one step, split by the link each collective runs on."""

    world_size: int
    shard_group_size: int
    intra_s: float  # collectives within one node
    inter_s: float  # collectives that span nodes
    tail_s: float  # the first gather and the last reduction: never overlapped
    num_collectives: int
    cross_group_algorithm: str  # "ring", "tree" or "" (flat: no cross-group all-reduce)

    @property
    def comm_s(self) -> float:
        return self.intra_s + self.inter_s


@dataclass(frozen=True)
class StepEstimate:
    comm: StepCommEstimate
    compute_s: float
    step_s: float
    model_state_bytes: float


def check_shard_group_size(world_size: int, shard_group_size: int) -> None:
    if not (1 <= shard_group_size <= world_size and world_size % shard_group_size == 0):
        raise PlanError(f"shard group size {shard_group_size} does not divide world size {world_size}; "
                         f"accepted: a divisor of {world_size}")


def _spans_nodes(group: int, ranks_per_node: int) -> bool:
    return group > ranks_per_node


def estimate_step_comm_s(bucket_bytes: Sequence[float], *, world_size: int, shard_group_size: int, stage: int,
                         spec: CommSpec) -> StepCommEstimate:
    """NOTE [Hierarchical sharding cost]. ``bucket_bytes`` are the buckets' full (unsharded)
    message sizes, in the order the forward gathers them."""
    n, k = world_size, shard_group_size
    check_shard_group_size(n, k)
    rpn = spec.ranks_per_node
    groups = n // k
    # The ranks holding the same shard: one per group, rpn // K of them on a node when K < rpn.
    cross_ppn = max(1, rpn // k) if k < rpn else 1
    group_link_inter = _spans_nodes(k, rpn)
    cross_link_inter = groups > 1 and _spans_nodes(n, rpn)
    intra = inter = 0.0
    count = 0
    per_bucket: list[tuple[float, float]] = []  # (gather s, reduction s) of each bucket
    algorithm = ""
    for b in bucket_bytes:
        gather = estimate_all_gather_s(b, k, spec) if k > 1 else 0.0
        if stage == 0:
            reduce_group, cross = 0.0, estimate_all_reduce_s(b, n, spec)
            inter_cross = _spans_nodes(n, rpn)
            gathers = 0
        else:
            reduce_group = estimate_reduce_scatter_s(b, k, spec) if k > 1 else 0.0
            cross = estimate_all_reduce_s(b / k, groups, spec, ranks_per_node=cross_ppn) if groups > 1 else 0.0
            inter_cross = cross_link_inter
            gathers = 2 if stage == 3 else 1
            if groups > 1:
                algorithm = all_reduce_algorithm(b / k, groups, spec, ranks_per_node=cross_ppn).value
        group_s = gathers * gather + reduce_group
        if group_link_inter:
            inter += group_s
        else:
            intra += group_s
        if inter_cross:
            inter += cross
        else:
            intra += cross
        count += (gathers + 1 if k > 1 and stage > 0 else 0) + (1 if cross > 0 else 0)
        per_bucket.append((gather if stage == 3 else 0.0, reduce_group + cross))
    tail = (per_bucket[0][0] + per_bucket[-1][1]) if per_bucket else 0.0
    return StepCommEstimate(n, k, intra, inter, tail, count, algorithm)


def estimate_step_s(comm: StepCommEstimate, compute_s: float, *, overlap: bool = True) -> float:
    """NOTE [Hierarchical sharding cost]: the step's time from its compute and communication."""
    if not overlap:
        return compute_s + comm.intra_s + comm.inter_s
    return max(compute_s, comm.intra_s, comm.inter_s) + comm.tail_s


@dataclass(frozen=True)
class _Sizes:
    """One parameter's sizes at a world size, as ``estimate_model_state_bytes`` reads them."""

    fqn: str
    numel: int
    shard_numel: int
    padded_numel: int
    itemsize: int
    requires_grad: bool


def model_state_bytes(params: Sequence[tuple[str, int, int, bool]], *, shard_group_size: int, stage: int,
                      optimizer: str = "AdamW") -> float:
    """Bytes of parameters, gradients and optimizer states per rank with state sharded over
    ``shard_group_size`` ranks; ``params`` as (fqn, numel, itemsize, requires_grad)."""
    k = shard_group_size
    sizes = []
    for fqn, numel, itemsize, requires_grad in params:
        shard = -(-numel // k)
        sizes.append(_Sizes(fqn, numel, shard, shard * k, itemsize, requires_grad))
    return float(sum(estimate_model_state_bytes(sizes, stage=stage, optimizer=optimizer).values()))


def shard_group_candidates(world_size: int) -> list[int]:
    """Every divisor of the world size, smallest first."""
    small = [d for d in range(1, math.isqrt(world_size) + 1) if world_size % d == 0]
    return sorted(set(small) | {world_size // d for d in small})


# Steps within this share of the fastest predicted one count as tied (see the chooser).
STEP_TIE_FRACTION = 0.005


def choose_shard_group_size(world_size: int, *, stage: int, spec: CommSpec, compute_s: float,
                            buckets_for: Callable[[int], Sequence[float]], memory_for: Callable[[int], float],
                            memory_budget_bytes: float | None, overlap: bool = True) -> tuple[int, str, dict[int, StepEstimate]]:
    """The shard group size with the least predicted step time whose memory per rank fits the
    budget (NOTE [Hierarchical sharding cost]), a one-line reason, and every candidate's estimate.

    ``buckets_for(K)`` gives the buckets' full bytes when sharding over K ranks, ``memory_for(K)``
    the bytes per rank the budget is checked against (model state, plus whatever else the caller
    counts). Among steps within ``STEP_TIE_FRACTION`` of the fastest, the K with the least
    inter-node communication time wins (then the larger K); when no K fits, the flat plan (the least memory)
    is taken and the reason says so.
    """
    estimates: dict[int, StepEstimate] = {}
    for k in shard_group_candidates(world_size):
        comm = estimate_step_comm_s(buckets_for(k), world_size=world_size, shard_group_size=k, stage=stage, spec=spec)
        estimates[k] = StepEstimate(comm, compute_s, estimate_step_s(comm, compute_s, overlap=overlap), memory_for(k))
    flat = estimates[world_size]
    fits = [k for k, e in estimates.items() if memory_budget_bytes is None or e.model_state_bytes <= memory_budget_bytes]
    if not fits:
        return world_size, (f"shard group size {world_size} (flat): no group size fits the memory budget "
                            f"{format_bytes(memory_budget_bytes)} per rank; flat needs the least "
                            f"({format_bytes(flat.model_state_bytes)})"), estimates
    best_s = min(estimates[k].step_s for k in fits)
    tied = [k for k in fits if estimates[k].step_s <= best_s * (1 + STEP_TIE_FRACTION)]
    # Among ties (communication hidden under compute alike), the least time on the inter-node link
    # (the scarce one) leaves the most slack for the overlap the model assumes; then the larger K,
    # the less memory.
    chosen = min(tied, key=lambda k: (round(estimates[k].comm.inter_s, 9), -k))
    e = estimates[chosen]
    budget = "no memory budget" if memory_budget_bytes is None else f"budget {format_bytes(memory_budget_bytes)}"
    rpn = spec.ranks_per_node
    where = (f"{chosen // rpn} node(s) of {rpn}" if chosen > rpn and chosen % rpn == 0 else
             "one node" if chosen == rpn else f"{chosen} of a node's {rpn} ranks" if chosen < rpn else f"{chosen} ranks")
    versus = "flat" if chosen == world_size else f"vs {flat.step_s * 1e3:.3g} ms flat"
    too_big = sorted(k for k in estimates if k not in fits)
    limit = f"; groups of {', '.join(map(str, too_big))} do not fit" if too_big else ""
    return chosen, (f"shard group size {chosen} ({where}) of {world_size} ranks on {spec.name}: predicted step "
                    f"{e.step_s * 1e3:.3g} ms {versus}, model state {format_bytes(e.model_state_bytes)} per rank "
                    f"({budget}){limit}"), estimates


def choose_prefetch_distance_s(gather_s: float, compute_per_bucket_s: float, *, max_distance: int = 4) -> int:
    """Buckets to gather ahead so that a gather is done before its bucket's compute starts: the
    gather of one bucket over the compute of one, rounded up, at least 1 and at most
    ``max_distance`` (each bucket ahead is gathered memory alive at once)."""
    if compute_per_bucket_s <= 0:
        return max_distance
    return max(1, min(max_distance, math.ceil(gather_s / compute_per_bucket_s)))
