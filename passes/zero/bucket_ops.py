"""Graph-building helpers shared by the rewrites: pack a bucket of flat tensors into one
collective message, and unpack a gathered bucket into per-parameter tensors.

NOTE [Bucket layout]
A bucket of parameters p_1..p_k with shards of s_1..s_k elements is one message of
S = sum(s_i) elements per rank: rank r sends ``cat(shard_r(p_1), ..., shard_r(p_k))``. The
all-gather output, viewed as ``(N, S)``, has rank r's message in row r, so parameter i's padded
flat is columns ``[o_i, o_i + s_i)`` read row by row. A reduce-scatter input is built the same
way: each gradient's padded flat viewed as ``(N, s_i)``, concatenated along columns, so that
the chunk rank r receives holds its shard of every gradient in the bucket.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes import meta

aten = torch.ops.aten


def pack(graph: fx.Graph, flats: list[fx.Node], dim: int = 0) -> tuple[fx.Node, list[fx.Node]]:
    """One message from several tensors (concatenated along ``dim``); returns it and the nodes
    added (none for a single tensor)."""
    if len(flats) == 1:
        return flats[0], []
    cat = meta.add_call(graph, aten.cat.default, (flats, dim))
    return cat, [cat]


def unpack_gathered(graph: fx.Graph, gathered: fx.Node, shard_numels: list[int], world_size: int) -> list[fx.Node]:
    """Per-parameter padded flats ``(N * s_i,)`` from a waited all-gather of a bucket ``(N * S,)``."""
    if len(shard_numels) == 1:
        return [gathered]
    total = sum(shard_numels)
    grid = meta.add_call(graph, aten.view.default, (gathered, [world_size, total]))  # (N, S)
    out, offset = [], 0
    for s in shard_numels:
        cols = meta.add_call(graph, aten.slice.Tensor, (grid, 1, offset, offset + s))  # (N, s_i), strided
        dense = meta.add_call(graph, aten.clone.default, (cols,), {"memory_format": torch.contiguous_format})
        out.append(meta.add_call(graph, aten.view.default, (dense, [world_size * s])))  # (N * s_i,)
        offset += s
    return out


def split(graph: fx.Graph, flat: fx.Node, sizes: list[int]) -> list[fx.Node]:
    """Consecutive slices of a 1-D tensor."""
    if len(sizes) == 1:
        return [flat]
    out, offset = [], 0
    for n in sizes:
        out.append(meta.add_call(graph, aten.slice.Tensor, (flat, 0, offset, offset + n)))
        offset += n
    return out
