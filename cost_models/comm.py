"""Communication cost: an alpha-beta model of NCCL-style ring and tree collectives.

Pure: a function of bytes, the ranks in the collective, how they sit on nodes, and a frozen
``CommSpec``. Planners take the spec as an argument (tests pass their own); nothing here
measures the machine (``zerofx calibrate`` does, once, and writes a spec).

NOTE [Ring collectives]
With N ranks and a message of B bytes in total (the gathered output for all-gather, the input
for reduce-scatter), a ring all-gather or reduce-scatter takes N - 1 steps, each sending B / N
bytes: ``t = base + (N - 1) * alpha + (N - 1) / N * B / bandwidth``. An all-reduce is a
reduce-scatter followed by an all-gather: twice the steps and twice the bytes. ``bandwidth`` is
the bus bandwidth in bytes/s of the slowest link the ring crosses. When the ranks span several
nodes (``ranks_per_node`` of them on each), the ring crosses the network once per node, so
``nodes - 1`` of its steps pay the inter-node latency and the others the intra-node one, and its
bandwidth is the inter-node link's: NCCL's own tuning model (``src/graph/tuning.cc``) counts the
steps the same way. ``base`` is the fixed cost of launching one collective.

NOTE [Tree all-reduce]
Across nodes NCCL can all-reduce on a double binary tree: a chain within each node and a tree of
depth log2(nodes) across them, once up (reduce) and once down (broadcast):
``t = base + 2 * ((ppn - 1) * tree_alpha_intra + ceil(log2 nodes) * tree_alpha_inter) + 2 B / (f * bandwidth)``
where ``f`` (below 1) is the share of the bus bandwidth a tree reaches. Its latency grows with
log2 of the nodes where the ring's grows with the ranks, so it wins for small and medium messages
at scale; the ring wins for large ones (NCCL picks per size; so does ``estimate_all_reduce_s``).
All-gather and reduce-scatter have no tree in NCCL: they are always rings.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from dataclasses import dataclass


class CollectiveAlgorithm(str, enum.Enum):
    RING = "ring"
    TREE = "tree"


@dataclass(frozen=True)
class CommSpec:
    """Per-step latency (s) and bus bandwidth (bytes/s) of the links within a node and across
    nodes, the launch cost of a collective, and the tree all-reduce's figures (None: no tree).
    ``collective_copies``: the backend holds a copy of a collective's whole buffer from its issue
    to its wait, as gloo does (NOTE [gloo copies a collective's buffer] in
    cost_models/memory_timeline.py). ``collective_scale``: (collective, factor) pairs, each
    collective's measured time over the link model's (NOTE [Each collective's own factor]); a
    collective not named keeps the model's time."""

    name: str
    intra_alpha_s: float
    intra_bandwidth: float
    inter_alpha_s: float
    inter_bandwidth: float
    ranks_per_node: int
    base_latency_s: float = 0.0
    intra_tree_alpha_s: float | None = None
    inter_tree_alpha_s: float | None = None
    tree_bandwidth_fraction: float = 0.9
    collective_copies: bool = False
    collective_scale: tuple[tuple[str, float], ...] = ()
    # The process-group backend the profile describes ("gloo", "nccl"); empty: read from the name
    # (built-in and calibrated profiles name theirs: "cpu-gloo", "calibrated-nccl").
    backend: str = ""

    def __post_init__(self) -> None:
        if not self.backend:
            object.__setattr__(self, "backend", "gloo" if "gloo" in self.name else "nccl")
        # A profile read back from JSON holds lists; the spec stays hashable.
        object.__setattr__(self, "collective_scale", tuple((str(c), float(f)) for c, f in self.collective_scale))

    def scale(self, collective: str) -> float:
        """The factor on ``collective``'s model time (NOTE [Each collective's own factor])."""
        return dict(self.collective_scale).get(collective, 1.0)

    def link(self, world_size: int) -> tuple[float, float]:
        """The slowest link a ring over ``world_size`` ranks crosses: (alpha_s, bandwidth)."""
        if world_size <= self.ranks_per_node:
            return self.intra_alpha_s, self.intra_bandwidth
        return self.inter_alpha_s, self.inter_bandwidth

    @property
    def has_tree(self) -> bool:
        return self.intra_tree_alpha_s is not None and self.inter_tree_alpha_s is not None


# Measured on this project's CPU machine with `zerofx calibrate` (2 gloo ranks over loopback):
# 450 us per ring step (Python dispatch included) and 0.48 GB/s bus bandwidth, in line with the
# 0.4-0.75 GB/s ANCHORS.md reports for all-gather and reduce-scatter. One "node": loopback only.
CPU_GLOO = CommSpec("cpu-gloo", 450e-6, 0.48e9, 450e-6, 0.48e9, ranks_per_node=64)

# DGX H100 / DGX H200: 8 GPUs per node on NVLink 4 through NVSwitch, one ConnectX-7 400 Gb/s
# NDR InfiniBand port per GPU (8 x 400 Gb/s per node). Both systems have the same fabric.
# - intra bandwidth 370 GB/s: NVLink 4 is 900 GB/s bidirectional per GPU (450 GB/s each way;
#   NVIDIA H100/H200 datasheets, DGX H100/H200 user guides); NCCL ring all-reduce on one DGX H100
#   reaches ~360-390 GB/s bus bandwidth in published nccl-tests runs (NVLS, NVLink SHARP, reaches
#   ~450-480; not modelled here).
# - inter bandwidth 45 GB/s per rank: 400 Gb/s = 50 GB/s per NIC; multi-node nccl-tests
#   all-reduce on DGX H100 SuperPODs reports ~45-48 GB/s bus bandwidth per GPU.
# - latencies: NCCL's own tuning table (src/graph/tuning.cc, LL128 protocol, the one it picks for
#   the medium messages buckets are): launch 14 us; ring step 1.9 us over NVLink, 4.0 us over the
#   network; tree step 1.2 us over NVLink, 8.5 us over the network; tree bandwidth 0.9 of the
#   ring's (the same file's ``busBw * .9``).
_NCCL_BASE_S = 14e-6
_NVLINK_RING_STEP_S, _NET_RING_STEP_S = 1.9e-6, 4.0e-6
_NVLINK_TREE_STEP_S, _NET_TREE_STEP_S = 1.2e-6, 8.5e-6
H100_NVLINK_IB = CommSpec("8xH100-nvlink-ib400", _NVLINK_RING_STEP_S, 370e9, _NET_RING_STEP_S, 45e9, ranks_per_node=8,
                          base_latency_s=_NCCL_BASE_S, intra_tree_alpha_s=_NVLINK_TREE_STEP_S,
                          inter_tree_alpha_s=_NET_TREE_STEP_S, tree_bandwidth_fraction=0.9)
H200_NVLINK_IB = CommSpec("8xH200-nvlink-ib400", _NVLINK_RING_STEP_S, 370e9, _NET_RING_STEP_S, 45e9, ranks_per_node=8,
                          base_latency_s=_NCCL_BASE_S, intra_tree_alpha_s=_NVLINK_TREE_STEP_S,
                          inter_tree_alpha_s=_NET_TREE_STEP_S, tree_bandwidth_fraction=0.9)

PROFILES = {spec.name: spec for spec in (CPU_GLOO, H100_NVLINK_IB, H200_NVLINK_IB)}


def _layout(world_size: int, spec: CommSpec, ranks_per_node: int | None) -> tuple[int, int]:
    """(ranks of the collective on each node, nodes it spans). By default its ranks are
    consecutive, so it fills nodes of ``spec.ranks_per_node``."""
    ppn = max(1, min(world_size, spec.ranks_per_node if ranks_per_node is None else ranks_per_node))
    return ppn, -(-world_size // ppn)


def _ring_latency_s(steps_per_pass: int, nodes: int, spec: CommSpec, passes: int) -> float:
    inter = nodes - 1
    return spec.base_latency_s + passes * ((steps_per_pass - inter) * spec.intra_alpha_s + inter * spec.inter_alpha_s)


def _scaled(seconds: float, collective: str, spec: CommSpec) -> float:
    """``seconds`` of a collective's model at its own factor; the launch cost after compute
    (``base_latency_s``, measured apart) unscaled (NOTE [Each collective's own factor])."""
    if seconds <= 0 or seconds == math.inf:
        return seconds
    return spec.base_latency_s + spec.scale(collective) * (seconds - spec.base_latency_s)


def _ring_pass_s(total_bytes: float, world_size: int, spec: CommSpec, ranks_per_node: int | None) -> float:
    """One pass of a ring over ``total_bytes`` (NOTE [Ring collectives]), no collective's factor."""
    if world_size == 1:
        return 0.0
    ppn, nodes = _layout(world_size, spec, ranks_per_node)
    bandwidth = spec.intra_bandwidth if nodes == 1 else spec.inter_bandwidth
    return _ring_latency_s(world_size - 1, nodes, spec, 1) + (world_size - 1) / world_size * total_bytes / bandwidth


def estimate_all_gather_s(total_bytes: float, world_size: int, spec: CommSpec, *, ranks_per_node: int | None = None) -> float:
    """A ring all-gather whose output is ``total_bytes`` (NOTE [Ring collectives])."""
    return _scaled(_ring_pass_s(total_bytes, world_size, spec, ranks_per_node), "all_gather", spec)


def estimate_reduce_scatter_s(total_bytes: float, world_size: int, spec: CommSpec, *, ranks_per_node: int | None = None) -> float:
    """A ring reduce-scatter whose input is ``total_bytes``: the all-gather's steps, reversed."""
    return _scaled(_ring_pass_s(total_bytes, world_size, spec, ranks_per_node), "reduce_scatter", spec)


def estimate_ring_all_reduce_s(total_bytes: float, world_size: int, spec: CommSpec, *, ranks_per_node: int | None = None) -> float:
    if world_size == 1:
        return 0.0
    ppn, nodes = _layout(world_size, spec, ranks_per_node)
    bandwidth = spec.intra_bandwidth if nodes == 1 else spec.inter_bandwidth
    return _scaled(_ring_latency_s(world_size - 1, nodes, spec, 2) + 2 * (world_size - 1) / world_size * total_bytes / bandwidth,
                   "all_reduce", spec)


def estimate_tree_all_reduce_s(total_bytes: float, world_size: int, spec: CommSpec, *, ranks_per_node: int | None = None) -> float:
    """NOTE [Tree all-reduce]; infinite where the spec has no tree."""
    if world_size == 1:
        return 0.0
    if not spec.has_tree:
        return math.inf
    ppn, nodes = _layout(world_size, spec, ranks_per_node)
    bandwidth = (spec.intra_bandwidth if nodes == 1 else spec.inter_bandwidth) * spec.tree_bandwidth_fraction
    depth = math.ceil(math.log2(nodes)) if nodes > 1 else 0
    latency = spec.base_latency_s + 2 * ((ppn - 1) * spec.intra_tree_alpha_s + depth * spec.inter_tree_alpha_s)
    return _scaled(latency + 2 * total_bytes / bandwidth, "all_reduce", spec)


def all_reduce_algorithm(total_bytes: float, world_size: int, spec: CommSpec, *, ranks_per_node: int | None = None) -> CollectiveAlgorithm:
    """The faster of ring and tree for this message, as NCCL's tuner picks."""
    ring = estimate_ring_all_reduce_s(total_bytes, world_size, spec, ranks_per_node=ranks_per_node)
    tree = estimate_tree_all_reduce_s(total_bytes, world_size, spec, ranks_per_node=ranks_per_node)
    return CollectiveAlgorithm.TREE if tree < ring else CollectiveAlgorithm.RING


def estimate_all_reduce_s(total_bytes: float, world_size: int, spec: CommSpec, *, ranks_per_node: int | None = None) -> float:
    """An all-reduce of ``total_bytes``: the faster of the ring and the tree."""
    return min(estimate_ring_all_reduce_s(total_bytes, world_size, spec, ranks_per_node=ranks_per_node),
               estimate_tree_all_reduce_s(total_bytes, world_size, spec, ranks_per_node=ranks_per_node))


def estimate_all_to_all_s(total_bytes: float, world_size: int, spec: CommSpec, *, ranks_per_node: int | None = None) -> float:
    """An all-to-all where each rank sends ``total_bytes / N`` to every other rank (``total_bytes``
    is one rank's input): N - 1 pairwise exchanges, those with ranks on the same node over the
    intra-node link, the others over the network."""
    if world_size == 1:
        return 0.0
    ppn, _ = _layout(world_size, spec, ranks_per_node)
    local, remote = ppn - 1, world_size - ppn
    chunk = total_bytes / world_size
    return _scaled(spec.base_latency_s + local * (spec.intra_alpha_s + chunk / spec.intra_bandwidth)
                   + remote * (spec.inter_alpha_s + chunk / spec.inter_bandwidth), "all_to_all", spec)


def efficient_bucket_bytes(world_size: int, spec: CommSpec, efficiency: float = 0.9, *, ranks_per_node: int | None = None) -> int:
    """The smallest message (total bytes) whose ring all-gather spends at least ``efficiency``
    of its time moving data rather than paying latency.

    Bandwidth time over total time is ``W / (L + W) >= e`` with ``W = (N - 1) / N * B / bw`` and
    ``L`` the ring's latency, so ``B >= N / (N - 1) * bw * L * e / (1 - e)``. Smaller buckets are
    latency-bound: merge them.
    """
    assert 0 < efficiency < 1
    if world_size == 1:  # no ring; a group of one still all-reduces its buckets across groups: one step's worth
        return int(spec.intra_bandwidth * (spec.base_latency_s + spec.intra_alpha_s) * efficiency / (1 - efficiency))
    ppn, nodes = _layout(world_size, spec, ranks_per_node)
    bandwidth = spec.intra_bandwidth if nodes == 1 else spec.inter_bandwidth
    latency = _ring_latency_s(world_size - 1, nodes, spec, 1)
    return int(world_size / (world_size - 1) * bandwidth * latency * efficiency / (1 - efficiency))


# NOTE [Fitting the comm model to a calibration]
# Within one node every collective's model time is linear in the two unknowns, the per-step
# latency alpha and the inverse bus bandwidth: ``t = steps * alpha + wire_bytes * (1 / bw)``, with
# (steps, wire_bytes) = (N - 1, (N - 1) / N * B) for all-gather, reduce-scatter and all-to-all, and
# twice that for the ring all-reduce. ``fit_link`` fits both to all the measured
# (collective, N, B, t) at once, minimizing the squared log ratio of predicted to measured time:
# an error of 2x counts the same whether over or under, and a 16 KiB message counts as much as
# an 8 MiB one. It starts from the least-squares fit of the relative error and takes Gauss-Newton
# steps (the model is linear, its logarithm nearly so).
_STEP_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2}


def model_terms(collective: str, total_bytes: float, world_size: int) -> tuple[float, float]:
    """(latency steps, bytes on the slowest link) of one collective on one node."""
    factor = _STEP_FACTOR[collective]
    return factor * (world_size - 1), factor * (world_size - 1) / world_size * total_bytes


def _solve2(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of ``a * x + b * y = r`` over (x, y, r)."""
    sxx = sum(x * x for x, _, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxr = sum(x * r for x, _, r in rows)
    syr = sum(y * r for _, y, r in rows)
    det = sxx * syy - sxy * sxy
    assert det > 0, "a fit needs at least two message sizes"
    return (sxr * syy - syr * sxy) / det, (syr * sxx - sxr * sxy) / det


def fit_link(measurements: list[tuple[str, int, float, float]], *, iterations: int = 20) -> tuple[float, float]:
    """(alpha_s, bandwidth) that best fit ``(collective, world_size, total_bytes, seconds)``
    measurements on one node (NOTE [Fitting the comm model to a calibration])."""
    terms = [(*model_terms(c, b, n), t) for c, n, b, t in measurements]
    alpha, inverse_bw = _solve2([(s / t, w / t, 1.0) for s, w, t in terms])
    floor_alpha, floor_inverse = 1e-7, 1e-13
    alpha, inverse_bw = max(alpha, floor_alpha), max(inverse_bw, floor_inverse)
    for _ in range(iterations):
        # log(pred / t) ~ residual; d log pred = (s d alpha + w d inverse) / pred.
        rows = []
        for s, w, t in terms:
            pred = s * alpha + w * inverse_bw
            rows.append((s / pred, w / pred, -math.log(pred / t)))
        d_alpha, d_inverse = _solve2(rows)
        alpha, inverse_bw = max(alpha + d_alpha, floor_alpha), max(inverse_bw + d_inverse, floor_inverse)
    return alpha, 1.0 / inverse_bw


# NOTE [Each collective's own factor]
# One latency and one bandwidth fit all four collectives only where each is the ring the model
# assumes. gloo's are not: calibrated between 2 and 4 local ranks, its reduce-scatter takes
# 1.1-1.9 times its all-gather of the same bytes (1.4-1.9 from 1 MiB up), its all-to-all
# 0.35-0.5 times, and its all-reduce about what its all-gather takes where the ring model says
# twice (fitted factors: reduce-scatter 1.74-2.23, all-gather 1.08-1.45, all-reduce 0.58-0.76,
# all-to-all 0.41-0.66). One fit is a compromise among them that leaves the all-gather
# 17% and the reduce-scatter 40% under their measured 8 MiB times, and stage 2 and 3 steps,
# which are mostly those two, under-predicted. So after the link is fitted, each collective gets
# its own factor: the median, over its measurements of at least ``SCALE_MIN_BYTES`` (where the
# bytes, not the launch, dominate; all of them where none is that large), of its measured time
# over the model's (``CommSpec.collective_scale``). The factor scales the collective's own time;
# the launch cost after compute (``base_latency_s``, NOTE [Ring collectives]) is measured apart
# and stays as it is. The built-in profiles name none.
SCALE_MIN_BYTES = 2**20


def fit_collective_scale(measurements: list[tuple[str, int, float, float]], spec: CommSpec) -> tuple[tuple[str, float], ...]:
    """Each measured collective's factor over ``spec``'s model (NOTE [Each collective's own
    factor]). The measurements are back to back, so the model they are held to leaves out the
    launch cost after compute."""
    unscaled = dataclasses.replace(spec, collective_scale=(), base_latency_s=0.0)
    factors = []
    for collective in sorted({c for c, *_ in measurements}):
        rows = [(n, b, t) for c, n, b, t in measurements if c == collective and t > 0]
        large = [r for r in rows if r[1] >= SCALE_MIN_BYTES] or rows
        ratios = [t / predict_s(collective, b, n, unscaled) for n, b, t in large if predict_s(collective, b, n, unscaled) > 0]
        if ratios:
            factors.append((collective, statistics.median(ratios)))
    return tuple(factors)


def predict_s(collective: str, total_bytes: float, world_size: int, spec: CommSpec) -> float:
    """The model's time for one measured collective: the estimate a planner would use."""
    estimate = {"all_gather": estimate_all_gather_s, "reduce_scatter": estimate_reduce_scatter_s,
                "all_reduce": estimate_ring_all_reduce_s if not spec.has_tree else estimate_all_reduce_s,
                "all_to_all": estimate_all_to_all_s}[collective]
    return estimate(total_bytes, world_size, spec)
