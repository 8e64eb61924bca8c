"""Node metadata keys that zerofx passes read and write, and small node predicates.

Every key is prefixed ``zerofx_``. Passes match nodes by these keys and by OpOverload identity,
never by node names.
"""

from __future__ import annotations

import enum
from typing import Any

import torch.fx as fx

from zerofx.passes import _compat

# On placeholders of the captured joint graph:
FQN = "zerofx_fqn"  # str: the parameter's, buffer's or input's name
ROLE = "zerofx_role"  # Role
# On nodes a rewrite inserts:
COMM_FQNS = "zerofx_comm_fqns"  # tuple[str, ...]: the bucket of parameters a collective moves
COMM_BYTES = "zerofx_comm_bytes"  # int: bytes this rank contributes to the collective
COMM_GROUP = "zerofx_comm_group"  # str: plan.SHARD or plan.REPLICATE, the group it runs over (absent: SHARD)
# bool, on an all-to-all that does a bucket's reduce-scatter (NOTE [gloo's reduce-scatter as an
# all-to-all] in passes/zero/reduce_scatter_all_to_all.py)
REDUCE_SCATTER_BY_ALL_TO_ALL = "zerofx_reduce_scatter_by_all_to_all"
# In ``meta["custom"]`` (``_compat.annotate``) of a pre-autograd node the sequence-parallel rewrite
# traced: the dim of its output that holds this rank's slice of the sequence (its attention outputs).
SEQUENCE_DIM = "zerofx_sequence_dim"


def marked_sequence_dim(node: fx.Node) -> int | None:
    """The sequence dim a rewrite marked on ``node`` (``SEQUENCE_DIM``), or None."""
    return node.meta.get("custom", {}).get(SEQUENCE_DIM)


class Role(str, enum.Enum):
    PARAM = "param"
    BUFFER = "buffer"
    INPUT = "input"
    TANGENT = "tangent"


def placeholders(graph: fx.Graph, role: Role | None = None) -> list[fx.Node]:
    nodes = list(graph.find_nodes(op="placeholder"))
    return nodes if role is None else [n for n in nodes if n.meta.get(ROLE) is role]


def output_node(graph: fx.Graph) -> fx.Node:
    return next(iter(graph.find_nodes(op="output")))


def is_all_gather(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (_compat.ALL_GATHER, _compat.ALL_GATHER_INTO)


def is_reduce_scatter(node: fx.Node) -> bool:
    """A bucket's reduce-scatter: the functional op, or the all-to-all that issues one on gloo
    (``is_reduce_scatter_by_all_to_all``)."""
    return node.op == "call_function" and (node.target is _compat.REDUCE_SCATTER or is_reduce_scatter_by_all_to_all(node))


def is_reduce_scatter_by_all_to_all(node: fx.Node) -> bool:
    """An all-to-all that does a bucket's reduce-scatter, a sum following its wait (NOTE [gloo's
    reduce-scatter as an all-to-all] in passes/zero/reduce_scatter_all_to_all.py)."""
    return node.op == "call_function" and node.target is _compat.ALL_TO_ALL and bool(node.meta.get(REDUCE_SCATTER_BY_ALL_TO_ALL))


def is_all_reduce(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _compat.ALL_REDUCE


def is_all_to_all(node: fx.Node) -> bool:
    """Sequence parallelism's exchange (both forms: autograd's, traced before autograd, and the
    plain one); not an all-to-all that issues a reduce-scatter."""
    return (node.op == "call_function" and node.target in (_compat.ALL_TO_ALL, _compat.ALL_TO_ALL_AUTOGRAD)
            and not is_reduce_scatter_by_all_to_all(node))


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _compat.COLLECTIVE_TARGETS


def collective_name(node: fx.Node) -> str:
    """A collective node's op as plans and errors name it: both forms of the all-gather (NOTE
    [gloo's completion race] in passes/zero/gather_into_buffers.py) are ``all_gather_into_tensor``, and
    a reduce-scatter issued as an all-to-all (NOTE [gloo's reduce-scatter as an all-to-all]) is
    ``reduce_scatter_tensor``."""
    if is_all_gather(node):
        return "all_gather_into_tensor"
    if is_reduce_scatter(node):
        return "reduce_scatter_tensor"
    return node.target._opname


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _compat.WAIT


def backward_region(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of a joint graph that depend on the tangent: the backward computation."""
    region: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.meta.get(ROLE) is Role.TANGENT:
                region.add(node)
        elif node.op != "output" and any(a in region for a in node.all_input_nodes):
            region.add(node)
    return region


def derived_only_from(graph: fx.Graph, sources: list[fx.Node], exclude: set[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """For each source, the nodes (in graph order, the source first) whose every input derives
    from that source alone.

    At stage 3 a source is a gathered parameter, and its nodes are what is computed from it and
    nothing else (a transpose, a view, a dtype cast): each is parameter-sized and must never be
    saved for backward. Nodes in ``exclude`` (the backward region) are not followed. One sweep
    over the graph for all sources.
    """
    origin: dict[fx.Node, fx.Node] = {s: s for s in sources}
    chains: dict[fx.Node, list[fx.Node]] = {s: [s] for s in sources}
    for node in graph.nodes:
        if node in origin or node in exclude or node.op != "call_function":
            continue
        found = {origin.get(a) for a in node.all_input_nodes}
        if len(found) == 1 and None not in found:
            src = found.pop()
            origin[node] = src
            chains[src].append(node)
    return chains


def add_call(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insert point, with ``meta['val']``
    computed by running the op on the inputs' fake values."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    # fx's own map over a call's arguments: a fraction of pytree's cost, and passes add many calls.
    vals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    fake_mode = _compat.detect_fake_mode([n.meta["val"] for n in node.all_input_nodes])
    assert fake_mode is not None, "add_call needs fake values on its input nodes"
    with fake_mode:
        node.meta["val"] = target(*vals[0], **vals[1])
    return node


def clone_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copy of ``gm``'s graph; node metadata dicts are copied."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # node_copy copies each node's meta dict
    return _compat.make_graph_module(gm, graph)  # NOTE [Code written on first use] in passes/_compat.py
