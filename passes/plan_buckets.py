"""Planner helpers: group parameters into collective buckets, and choose the prefetch distance.

Pure functions of names, sizes and limits; they read no graph. ``plan_sharding`` calls them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def plan_buckets(order: Sequence[str], bytes_of: Mapping[str, int], cap_bytes: int) -> tuple[tuple[str, ...], ...]:
    """Consecutive runs of ``order`` whose bytes stay within ``cap_bytes``.

    Greedy in order (first use for gathers, gradient production for reductions), so a bucket is
    ready as early as its members allow. A single tensor larger than the cap is a bucket alone.
    """
    buckets: list[tuple[str, ...]] = []
    current: list[str] = []
    size = 0
    for name in order:
        if current and size + bytes_of[name] > cap_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(name)
        size += bytes_of[name]
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


def choose_prefetch_distance(bucket_numels: Sequence[int], max_live_numel: float, *, preferred: int = 1) -> int:
    """How many buckets ahead to issue all-gathers: at most ``preferred``, and small enough that
    the gathered parameters alive at once (the current bucket plus the prefetched ones, for the
    worst window) stay within ``max_live_numel`` elements. 0 means no prefetch.
    """
    distance = max(0, preferred)
    while distance > 0:
        window = distance + 1
        worst = max((sum(bucket_numels[i : i + window]) for i in range(max(1, len(bucket_numels) - window + 1))), default=0)
        if worst <= max_live_numel:
            break
        distance -= 1
    return distance
