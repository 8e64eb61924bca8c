"""Communication cost: an alpha-beta model of ring collectives.

Pure: a function of bytes, world size and a frozen ``CommSpec``. Planners take the spec as an
argument (tests pass their own); nothing here measures the machine.

NOTE [Ring collectives]
With N ranks and a message of B bytes in total (the gathered output for all-gather, the input
for reduce-scatter), a ring all-gather or reduce-scatter takes N - 1 steps, each sending B / N
bytes: ``t = (N - 1) * (alpha + B / (N * bandwidth))``. An all-reduce is a reduce-scatter
followed by an all-gather: twice that. ``bandwidth`` is the per-link bus bandwidth in bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommSpec:
    """Latency (s) and bus bandwidth (bytes/s) of one link, within a node and across nodes."""

    name: str
    intra_alpha_s: float
    intra_bandwidth: float
    inter_alpha_s: float
    inter_bandwidth: float
    ranks_per_node: int

    def link(self, world_size: int) -> tuple[float, float]:
        """The slowest link a ring over ``world_size`` ranks crosses: (alpha_s, bandwidth)."""
        if world_size <= self.ranks_per_node:
            return self.intra_alpha_s, self.intra_bandwidth
        return self.inter_alpha_s, self.inter_bandwidth


# Measured on this project's CPU machine with `zerofx calibrate` (2 gloo ranks over loopback):
# 450 us per ring step (Python dispatch included) and 0.48 GB/s bus bandwidth, in line with the
# 0.4-0.75 GB/s ANCHORS.md reports for all-gather and reduce-scatter.
CPU_GLOO = CommSpec("cpu-gloo", 450e-6, 0.48e9, 450e-6, 0.48e9, ranks_per_node=64)
# 8 H100 per node on NVLink (~370 GB/s bus bandwidth for NCCL ring collectives), nodes joined by
# 8 x 400 Gb/s InfiniBand (~45 GB/s per rank).
H100_NVLINK_IB = CommSpec("8xH100-nvlink-ib400", 10e-6, 370e9, 20e-6, 45e9, ranks_per_node=8)

PROFILES = {spec.name: spec for spec in (CPU_GLOO, H100_NVLINK_IB)}


def estimate_all_gather_s(total_bytes: float, world_size: int, spec: CommSpec) -> float:
    if world_size == 1:
        return 0.0
    alpha, bw = spec.link(world_size)
    return (world_size - 1) * (alpha + total_bytes / (world_size * bw))


def estimate_reduce_scatter_s(total_bytes: float, world_size: int, spec: CommSpec) -> float:
    return estimate_all_gather_s(total_bytes, world_size, spec)


def estimate_all_reduce_s(total_bytes: float, world_size: int, spec: CommSpec) -> float:
    return 2 * estimate_all_gather_s(total_bytes, world_size, spec)


def efficient_bucket_bytes(world_size: int, spec: CommSpec, efficiency: float = 0.9) -> int:
    """The smallest message (total bytes) whose ring collective spends at least ``efficiency``
    of its time moving data rather than paying per-step latency.

    Bandwidth time over total time is ``(B / (N bw)) / (alpha + B / (N bw)) >= e``, so
    ``B >= N * bw * alpha * e / (1 - e)``. Smaller buckets are latency-bound: merge them.
    """
    assert 0 < efficiency < 1
    alpha, bw = spec.link(world_size)
    return int(world_size * bw * alpha * efficiency / (1 - efficiency))
