"""Common-subexpression elimination on a functional ATen graph, before partitioning.

NOTE [Our own CSE instead of the partitioner's]
AOTAutograd's min-cut partitioner starts with a CSE of the joint graph (``fx_graph_cse``,
switched by ``torch._functorch.config.cse``). It merges, for example, the ``t(weight)`` the
forward and the backward both compute, which changes what the partitioner saves. That
function imports TorchInductor's pattern matcher to find mutation regions, 1.6 s of
``zerofx plan``'s 10 s budget, for graphs that have no mutations: ours are functionalized by
AOTAutograd, and every rewrite we add (collectives, waits, tiling ops) is functional. So
``partition_joint`` runs this pass and turns the partitioner's own CSE off; it merges the same
nodes, which ``tests/test_core_passes.py`` checks against ``fx_graph_cse``.

Never merged: random ops (they would draw once instead of twice), ops with a mutable schema,
``aten.empty``-like allocations, anything that is not an ATen/custom ``OpOverload`` (getitem
on a multi-output op merges through its producer), collectives and their waits (merging two
all-gathers of one shard would undo stage 3's re-gather in backward), and tensors whose
storage a graph output holds (two outputs must stay separate tensors).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from zerofx.passes import _compat

_NEVER = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    *_compat.COLLECTIVE_TARGETS,
    _compat.WAIT,
}


def _mergeable(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target in _NEVER:
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not target._schema.is_mutable


def _frozen(value: Any) -> Any:
    """A hashable key for an argument; floats keep their sign (0.0 and -0.0 differ)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return ("sym", id(value))
    return value


def _output_storages(graph: fx.Graph) -> set[StorageWeakRef]:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    storages = set()
    for n in out.all_input_nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            storages.add(StorageWeakRef(val.untyped_storage()))
    return storages


def _holds_output_storage(node: fx.Node, storages: set[StorageWeakRef]) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and StorageWeakRef(val.untyped_storage()) in storages


def eliminate_common_subexpressions(gm: fx.GraphModule) -> fx.GraphModule:
    """Merge nodes that compute the same op on the same inputs; returns ``gm``, rewritten in place.

    The first node of each group is kept with its meta (its ``recompute`` tag included)."""
    storages = _output_storages(gm.graph)
    seen: dict[Any, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not _mergeable(node) or _holds_output_storage(node, storages):
            continue
        key = (node.target, _frozen(node.args), _frozen(node.kwargs))
        try:
            first = seen.setdefault(key, node)
        except TypeError:  # an unhashable argument: leave the node alone
            continue
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
    gm.recompile()
    return gm
