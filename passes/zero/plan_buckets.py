"""Planner helpers: group parameters into collective buckets, and choose the prefetch distance.

Pure functions of names, sizes and limits; they read no graph. ``plan_sharding`` calls them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_INDEXED = re.compile(r"^(.*?)\.(\d+)\.(.+)$")


def repeated_blocks_of(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """For each parameter FQN, the repeated block it belongs to (``"blocks.3"``), or ``""``.

    A block is the first indexed component of an FQN (``<container>.<i>.<rest>``); a container's
    blocks are repeated when each holds the same ``rest`` names with
    the same shapes, as the layers of a decoder do. One block counts too: a decoder cut to one
    block (layer folding) must bucket that block as it buckets each of many.
    """
    members: dict[str, dict[int, set[tuple[str, tuple[int, ...]]]]] = {}
    for fqn, shape in shapes.items():
        m = _INDEXED.match(fqn)
        if m:
            members.setdefault(m.group(1), {}).setdefault(int(m.group(2)), set()).add((m.group(3), tuple(shape)))
    repeated = {c for c, blocks in members.items() if len({frozenset(v) for v in blocks.values()}) == 1}
    out = {}
    for fqn in shapes:
        m = _INDEXED.match(fqn)
        out[fqn] = f"{m.group(1)}.{m.group(2)}" if m and m.group(1) in repeated else ""
    return out


def plan_buckets(
    order: Sequence[str], bytes_of: Mapping[str, int], cap_bytes: int, *, block_of: Mapping[str, str] | None = None
) -> tuple[tuple[str, ...], ...]:
    """Consecutive runs of ``order`` whose bytes stay within ``cap_bytes``.

    Greedy in order (first use for gathers, gradient production for reductions), so a bucket is
    ready as early as its members allow. A single tensor larger than the cap is a bucket alone.

    NOTE [Buckets end at block boundaries]
    With ``block_of`` (``repeated_blocks_of``), a bucket never holds parameters of two different
    repeated blocks, nor of a block and the rest of the model. Every block then communicates in
    the same buckets, so its gathered memory and its collectives are the same from block to
    block (FSDP2 gets this by making each block a unit); a bucket that straddled a boundary
    would shift by a different amount in each block. It is also what makes layer folding
    (``zerofx.compiler.folding``) exact: the step of N blocks is then the step of 1 block plus N - 1
    identical increments.
    """
    buckets: list[tuple[str, ...]] = []
    current: list[str] = []
    size = 0
    for name in order:
        crosses = block_of is not None and bool(current) and block_of[name] != block_of[current[-1]]
        if current and (size + bytes_of[name] > cap_bytes or crosses):
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
