"""Static check: every rank's graphs issue the same collectives, in the same order, with the
same sizes. A mismatch would hang the job in its first differing collective; this finds it
before anything runs and names it.

``collective_sequence`` reads one rank's graph modules (read only); ``first_divergence``
compares the sequences of all ranks (gathered by the runtime) and describes the first
difference, or returns None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.fx as fx

from zerofx.passes import meta

GRAPH_ORDER = ("forward", "backward", "grad_sync", "param_sync")


@dataclass(frozen=True)
class CollectiveCall:
    graph: str
    index: int  # position among this graph's collectives
    op: str
    numel: int  # elements this rank sends in
    dtype: str
    group_size: int

    def __str__(self) -> str:
        return f"{self.graph} collective #{self.index}: {self.op} of {self.numel} x {self.dtype} over {self.group_size} ranks"


def _group_size(node: fx.Node) -> int:
    # all_gather_into_tensor(x, group_size, group), reduce_scatter_tensor(x, op, group_size, group),
    # all_reduce(x, op, group): the group size is not an argument of all_reduce.
    if meta.is_all_gather(node):
        return int(node.args[1])
    if meta.is_all_to_all(node) or meta.is_reduce_scatter_by_all_to_all(node):
        return len(node.args[1])  # all_to_all_single(x, output_splits, input_splits, group): one split per rank
    if meta.is_reduce_scatter(node):
        return int(node.args[2])
    return -1


def collective_sequence(modules: Mapping[str, fx.GraphModule]) -> tuple[CollectiveCall, ...]:
    calls = []
    for name in GRAPH_ORDER:
        gm = modules.get(name)
        if gm is None:
            continue
        index = 0
        for node in gm.graph.nodes:
            if meta.is_collective(node):
                val = node.args[0].meta["val"]
                calls.append(CollectiveCall(name, index, meta.collective_name(node), val.numel(), str(val.dtype), _group_size(node)))
                index += 1
    return tuple(calls)


def first_divergence(sequences: Sequence[Sequence[CollectiveCall]]) -> str | None:
    """None if every rank's sequence is the same, else which rank differs first, and where."""
    reference = sequences[0]
    for rank, seq in enumerate(sequences[1:], start=1):
        for i in range(max(len(reference), len(seq))):
            mine = reference[i] if i < len(reference) else None
            theirs = seq[i] if i < len(seq) else None
            if mine != theirs:
                return (
                    f"rank 0 and rank {rank} diverge at collective #{i} of the step: "
                    f"rank 0 issues {mine or 'nothing more'}, rank {rank} issues {theirs or 'nothing more'}"
                )
    return None
