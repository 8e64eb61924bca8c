"""Transient memory over one step: bytes alive after each node of the forward and backward graphs.

Pure: reads ``node.meta['val']`` (fake tensors) of the graphs one rank runs; allocates nothing.

NOTE [What is counted]
A node that allocates (not a view) holds ``numel * itemsize`` bytes of its output from the node
that makes it until the last use of it or of any view of it. Forward values saved for backward
stay alive to the end of forward and then until their last use in backward. Graph inputs that
belong to the persistent model state (parameters, buffers, user inputs) are not counted here:
``Plan.estimates`` holds them, and so is a saved value that aliases one (NOTE [A saved view of
an input is that input]). Gathered stage-3 parameters, activations, gradients before they
are reduced, and collective buffers are all transient and counted; a collective's inputs count
until its ``wait_tensor``, because its work object holds them until then (NOTE [A reduction
holds its input until its wait] in passes/zero/schedule_overlap.py). The backward graph's outputs
(this rank's reduced gradients) are counted until the end of backward, when the engine adds them
into its persistent gradient buffers; with gradient offload they are no outputs, and each is
counted until its hand-off (NOTE [Gradients leave at their bucket's wait] in
passes/memory/offload_grads.py).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from zerofx.cost_models.compute import loop_body, value_bytes

aten = torch.ops.aten
_functional = torch.ops._c10d_functional
# An all-gather into a buffer the graph allocated: its output is that buffer (its ``out``).
_GATHER_INTO = _functional.all_gather_into_tensor_out.default
# A collective reads its input until its wait, so the input lives that long.
_COLLECTIVES = {_functional.all_gather_into_tensor.default, _GATHER_INTO, _functional.reduce_scatter_tensor.default, _functional.all_reduce.default,
                _functional.all_to_all_single.default}
_WAIT = _functional.wait_tensor.default

# Ops whose output shares its input's storage.
VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int, aten.permute.default,
    aten.expand.default, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.default, aten.alias.default, aten.detach.default, aten.as_strided.default, aten.reshape.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
    aten.copy_.default,  # in place: returns its first argument
    torch.ops._c10d_functional.wait_tensor.default,  # returns the collective's output itself
}


@dataclass(frozen=True)
class TimelinePoint:
    graph: str
    node: str
    live_bytes: int


def _is_view(node: fx.Node) -> bool:
    if node.target in VIEW_OPS:
        return True
    # getitem of a multi-output op (e.g. unbind, split) returns a view of that op's storage
    return node.target is operator.getitem


# NOTE [gloo copies a collective's buffer]
# gloo's all-gather gathers into a buffer of its own and copies it out, and its reduce-scatter
# reduces a copy of the whole input, made when it is issued, on the caller's thread. Measured
# with torch 2.13 on this project's machine: a 64 MiB reduce-scatter raises a rank's peak
# resident set by 66 MiB beyond its input, a 64 MiB all-gather by 64 MiB beyond its output, and
# four 16 MiB reduce-scatters issued while the peer is late hold 65 MiB at once before any
# completes. Where the comm profile says so (``CommSpec.collective_copies``, which ``zerofx
# calibrate`` sets for gloo; the built-in profiles leave it off, as they leave the host's cores
# unstated), each all-gather and reduce-scatter holds one more buffer of its whole size (the
# gathered output, the unreduced input) from its issue to its wait. Without it the 100m DNA LM's
# 4-rank steps peaked 90-115 MiB over the timeline's prediction.
_COPIED = {_functional.all_gather_into_tensor.default, _GATHER_INTO, _functional.reduce_scatter_tensor.default}


def collective_copy_bytes(node: fx.Node) -> int:
    """The whole buffer a gloo collective copies: an all-gather's output, a reduce-scatter's
    input; 0 for any other node (NOTE [gloo copies a collective's buffer])."""
    if node.op != "call_function" or node.target not in _COPIED:
        return 0
    if node.target is _functional.reduce_scatter_tensor.default:
        return value_bytes(node.args[0].meta.get("val"))
    return value_bytes(node.meta.get("val"))


def graph_timeline(gm: fx.GraphModule, name: str, *, counted_inputs: Iterable[str] = (), keep_outputs: bool = False,
                   collective_copies: bool = False) -> list[TimelinePoint]:
    """Bytes alive after each node of ``gm``. Placeholders named in ``counted_inputs`` (e.g.
    saved activations entering backward) count until their last use; other placeholders are
    persistent state, counted elsewhere. With ``keep_outputs`` the graph's outputs stay alive to
    its end (forward's saved values do anyway: they are the output). With ``collective_copies``
    each all-gather and reduce-scatter also holds a copy of its whole buffer until its wait
    (NOTE [gloo copies a collective's buffer])."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    counted = set(counted_inputs)
    owner: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "call_function" and n.target is _GATHER_INTO:
            owner[n] = owner[n.kwargs["out"]]
        elif n.op == "call_function" and _is_view(n) and n.all_input_nodes:
            owner[n] = owner.get(n.all_input_nodes[0], n.all_input_nodes[0])
        else:
            owner[n] = n
    end = len(nodes)
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        use = end if (n.op == "output") else position[n]
        if n.op == "call_function" and n.target in _COLLECTIVES:
            # Held by the collective until its wait (the graph's end if it has none).
            use = max([position[u] for u in n.users if u.target is _WAIT] or [end])
        for a in n.all_input_nodes:
            o = owner[a]
            last_use[o] = max(last_use.get(o, position[o]), use)
    size = {}
    for n in nodes:
        if owner[n] is not n:
            continue
        if n.op == "placeholder" and n.name not in counted:
            continue
        if n.op in ("placeholder", "call_function"):
            size[n] = value_bytes(n.meta.get("val"))
    frees: dict[int, int] = {}
    for o, nbytes in size.items():
        if o not in last_use:
            last_use[o] = position[o]  # unused: freed right away
        free_at = end if (keep_outputs and last_use[o] == end) else last_use[o]
        frees[free_at] = frees.get(free_at, 0) + nbytes
    copies: dict[fx.Node, int] = {}
    if collective_copies:
        for n in nodes:
            if n.op == "call_function" and n.target in _COPIED:
                copies[n] = collective_copy_bytes(n)
                wait = max([position[u] for u in n.users if u.target is _WAIT] or [end])
                frees[wait] = frees.get(wait, 0) + copies[n]
    live = sum(size[o] for o in size if o.op == "placeholder")
    points = []
    for n in nodes:
        if n.op == "call_function" and n in size:
            live += size[n]
        live += copies.get(n, 0)
        points.append(TimelinePoint(name, n.name, live + loop_body_bytes(n)))
        live -= frees.get(position[n], 0)
    return points


def loop_body_bytes(node: fx.Node) -> int:
    """What one chunk of a loop node's body holds at its peak beyond its inputs (NOTE [A loop is
    its body, per chunk] in cost_models/compute.py); 0 for any other node."""
    loop = loop_body(node)
    if loop is None:
        return 0
    return max((p.live_bytes for p in graph_timeline(loop[0], "body", keep_outputs=True)), default=0)


# NOTE [A saved view of an input is that input]
# Entering backward a saved value is a placeholder, and nothing there says what storage it shares.
# Every linear layer saves its weight's transpose (``t``), a view of the parameter: at stages 0-2
# the parameter is a graph input, already in the model state, and the view holds no byte of its
# own. Counted as an activation, it put a second copy of every weight into the backward peak (the
# 100m DNA LM at stage 2: 378 MiB). So a saved value that is a graph input, or a chain of views
# of one, is not counted in backward, as the input is not counted in forward. A view of a gathered
# stage-3 bucket aliases a node, not an input, and stays counted: saving it keeps the bucket alive.
def aliases_of_inputs(gm: fx.GraphModule) -> set[str]:
    """The names of ``gm``'s placeholders and of the nodes that are views of one, through any chain
    of views (NOTE [A saved view of an input is that input])."""
    aliases = set(gm.graph.find_nodes(op="placeholder"))
    for n in gm.graph.nodes:
        if n.op == "call_function" and _is_view(n) and n.all_input_nodes and n.all_input_nodes[0] in aliases:
            aliases.add(n)
    return {n.name for n in aliases}


def saved_activations(forward: fx.GraphModule) -> list[fx.Node]:
    """What ``forward`` saves for backward that holds bytes of its own: its outputs after the
    first, less inputs and views of them (NOTE [A saved view of an input is that input])."""
    aliases = aliases_of_inputs(forward)
    return [a for a in forward.graph.find_nodes(op="output")[0].args[0][1:] if isinstance(a, fx.Node) and a.name not in aliases]


def step_timeline(forward: fx.GraphModule, backward: fx.GraphModule, *, persistent_bytes: int = 0,
                  collective_copies: bool = False) -> list[TimelinePoint]:
    """The whole step: forward then backward, plus ``persistent_bytes`` of model state throughout;
    ``collective_copies`` as ``graph_timeline`` takes it."""
    saved = {a.name for a in saved_activations(forward)}
    fwd = graph_timeline(forward, "forward", keep_outputs=True, collective_copies=collective_copies)
    bwd_inputs = [n.name for n in backward.graph.find_nodes(op="placeholder")]
    # Saved values are forward outputs; entering backward they are its placeholders.
    bwd = graph_timeline(backward, "backward", counted_inputs=[n for n in bwd_inputs if n in saved], keep_outputs=True,
                         collective_copies=collective_copies)
    return [TimelinePoint(p.graph, p.node, p.live_bytes + persistent_bytes) for p in fwd + bwd]


def peak(points: list[TimelinePoint]) -> TimelinePoint:
    return max(points, key=lambda p: p.live_bytes)
