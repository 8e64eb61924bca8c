"""The loop a tiled region runs as: one body subgraph, called once per chunk, in forward and in
backward (NOTE [One body per tiled region]).

``emit_chunk_loop`` writes it into a pre-autograd forward graph (``tile_forward_pass`` calls it
for token-wise regions and for FFT convolutions in channel chunks); ``chunk_loop`` is the node's
target, which AOTAutograd traces into one ``map_impl`` in the joint graph's forward and one
``scan`` in its backward. The bodies are submodules of the graph module (``get_attr`` nodes).

NOTE [One body per tiled region]
A tiled region (token-wise ops between two mixers, or an FFT convolution cut into channel
chunks) is the same computation on every chunk, so its nodes are written once, as a body
subgraph over one chunk, and run in a loop: the graphs grow by a constant, not by a copy per
chunk, from 16k tokens to 1M (capture, AOTAutograd's trace, partitioning, the graph passes,
Inductor's lowering and the plan cache scale with the nodes).
- Forward: the chunked inputs are viewed as (chunks, ..., chunk, ...) (one ``view`` and one
  ``permute``, no copy) and ``map_impl(body, xs, whole)`` stacks the body's outputs, which a
  ``permute`` and a ``reshape`` lay out as the region's outputs (one copy, as a ``cat`` of the
  chunks was). Chunks of two lengths (an uneven last chunk) are two loops whose outputs are
  concatenated.
- Backward: ``map``'s own autograd stacks every chunk's gradient of the inputs it does not map
  (the weights: chunks times their size), so the loop is an ``autograd.Function`` whose backward
  is a ``scan`` over the chunks of a second body, traced here by ``make_fx``: it recomputes the
  chunk's forward, takes its vector-Jacobian product, and adds the gradients of the whole
  inputs into the carry. Only the loop's inputs are saved; one chunk's intermediates are alive
  at a time, in forward and in backward, as with the per-chunk recompute it replaces.
- Each body's chunked inputs are copied contiguous first: the bodies are traced on contiguous
  chunks (AOTAutograd retraces them on the first slice, copied), while a slice of the stacked
  view is strided.
- The gradients the backward body computes are fixed when it is traced: those of the inputs
  that depend on a trainable parameter (``differentiable_nodes``). The ``Function`` checks that
  autograd asks for no other.
- The memory timeline and the compute model price a loop node as its body's peak and its
  body's time per chunk (cost_models/memory_timeline.py, cost_models/compute.py).
- Graphs run as FX code (no Inductor) run their loops through ``run_map`` and ``run_scan``
  (``eager_loops_pass``): each writes a chunk's outputs into a tensor allocated once for all
  chunks. torch's own eager ``map`` keeps every chunk's outputs in a list and stacks them (twice
  the outputs at the end), and its ``scan`` writes each by ``scatter_`` through an int64 index
  as large as the output. Inductor lowers both operators to a ``while_loop`` over preallocated
  outputs itself. Measured on striped-1m at 65,536 tokens in 8 chunks, one thread, interleaved:
  steps of 3.8-4.4 s with these, 4.5-5.4 s with torch's, 3.5-4.0 s with a copy of each region per
  chunk.
- What remains of that difference: a region whose outputs are recomputed (attention's inputs, a
  convolution's filter) runs its forward twice in backward, once for the outputs its consumer's
  backward reads and once per chunk inside its own loop's backward. A copy per chunk ran it once
  and kept every chunk's intermediates until the region's backward.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from zerofx.passes import _compat, meta

aten = torch.ops.aten
Tensor = torch.Tensor
# Meta keys of the outer graph's nodes that mean nothing inside a body.
_OUTER_ONLY = ("val", "tensor_meta", "recompute")


class _ChunkLoop(torch.autograd.Function):
    """``map_impl`` of the forward body, differentiated by a ``scan`` of the backward body."""

    @staticmethod
    def forward(ctx, forward_body: fx.GraphModule, backward_body: fx.GraphModule, grad_mask: tuple[bool, ...], num_chunked: int,
                *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.save_for_backward(*inputs)
        ctx.backward_body, ctx.grad_mask, ctx.num_chunked = backward_body, grad_mask, num_chunked
        outputs = tuple(_compat.MAP_LOOP(forward_body, list(inputs[:num_chunked]), list(inputs[num_chunked:])))
        # An output computed from no parameter (a rotary table's chunk) takes no gradient: left to
        # autograd, every output of a Function would, and so would the loops that read it.
        ctx.mark_non_differentiable(*[o for o, m in zip(outputs, grad_mask[len(inputs):]) if not m])
        return outputs

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        inputs = ctx.saved_tensors
        n, mask = ctx.num_chunked, ctx.grad_mask
        input_mask, output_mask = mask[: len(inputs)], mask[len(inputs):]
        missing = [i for i, (asked, has) in enumerate(zip(ctx.needs_input_grad[4:], input_mask)) if asked and not has]
        assert not missing, f"the loop's backward body has no gradient for inputs {missing}: see NOTE [One body per tiled region]"
        whole = inputs[n:]
        init = [torch.zeros_like(w) for w, m in zip(whole, input_mask[n:]) if m]
        used = [g for g, m in zip(grads, output_mask) if m]
        out = _compat.SCAN_LOOP(ctx.backward_body, init, [*inputs[:n], *used], list(whole))
        sums, chunk_grads = iter(out[: len(init)]), iter(out[len(init):])  # a scalar per chunk where none is asked: unread
        result = [next(chunk_grads) if m else None for m in input_mask[:n]] + [next(sums) if m else None for m in input_mask[n:]]
        return (None, None, None, None, *result)


def chunk_loop(forward_body: fx.GraphModule, backward_body: fx.GraphModule, grad_mask: tuple[bool, ...], num_chunked: int,
               *inputs: Tensor) -> tuple[Tensor, ...]:
    """The forward body on each slice of the first ``num_chunked`` inputs' first dim, with the
    other inputs whole; the outputs stacked. ``grad_mask``: for each input, then each output,
    whether the backward body takes its gradient (NOTE [One body per tiled region])."""
    return _ChunkLoop.apply(forward_body, backward_body, grad_mask, num_chunked, *inputs)


def differentiable_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes computed from a parameter: what autograd may ask a loop's gradient of."""
    found: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            if n.meta.get(meta.ROLE) is meta.Role.PARAM:
                found.add(n)
        elif any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def _floating(node: fx.Node) -> bool:
    v = node.meta.get("val")
    return isinstance(v, Tensor) and (v.is_floating_point() or v.is_complex())


def chunk_groups(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``sizes`` as runs of equal chunks: (length, count) each."""
    groups: list[tuple[int, int]] = []
    for s in sizes:
        if groups and groups[-1][0] == s:
            groups[-1] = (s, groups[-1][1] + 1)
        else:
            groups.append((s, 1))
    return groups


def emit_chunk_loop(gm: fx.GraphModule, graph: fx.Graph, *, name: str, nodes: Sequence[fx.Node], lookup: Callable[[fx.Node], fx.Node],
                    chunked: Mapping[fx.Node, int], whole: Sequence[fx.Node], outputs: Sequence[tuple[fx.Node, int, tuple[int, ...]]],
                    sizes: Sequence[int], differentiable: set[fx.Node], tag: Callable[[fx.Node], fx.Node],
                    chunk_args: Callable[[fx.Node, tuple, int], tuple] | None = None) -> dict[fx.Node, fx.Node]:
    """Write ``nodes`` (in graph order) into ``graph``, at its insert point, as loops over chunks.

    ``chunked`` maps each input cut into chunks to the dim it is cut along, in ``sizes`` pieces;
    ``whole`` are the other inputs; ``lookup`` gives an input's node in ``graph``. ``outputs``:
    (node, dim, layout), where the layout orders the output's dims in memory (its dims in order
    for a contiguous output). ``chunk_args(node, args, length)`` adjusts a node's arguments to a
    chunk of ``length``. Bodies are added to ``gm`` as ``{name}_{length}_forward`` and
    ``_backward``; every inserted node of ``graph`` goes through ``tag``. Returns each output's
    new node."""
    fake_mode = _compat.detect_fake_mode([p.meta["val"] for p in graph.find_nodes(op="placeholder")])
    assert fake_mode is not None, "emit_chunk_loop needs fake values on the graph's placeholders"
    grad_mask = tuple(x in differentiable and _floating(x) for x in (*chunked, *whole))
    grad_mask += tuple(o in differentiable and _floating(o) for o, _, _ in outputs)
    pieces: dict[fx.Node, list[fx.Node]] = {o: [] for o, _, _ in outputs}
    groups = chunk_groups(sizes)

    def view_tag(n: fx.Node) -> fx.Node:
        # The inputs' views are recomputed in backward from what they view, which is saved whole
        # or recomputed itself, rather than saved as pieces.
        n.meta["recompute"] = _compat.CheckpointPolicy.MUST_RECOMPUTE
        return tag(n)

    # Each input cut once into its groups' spans: their gradients are joined by one cat.
    spans = {x: _spans(graph, lookup(x), dim, [length * count for length, count in groups], view_tag) for x, dim in chunked.items()}
    for g, (length, count) in enumerate(groups):
        forward_body = _forward_body(nodes, chunked, whole, [o for o, _, _ in outputs], length, chunk_args, fake_mode)
        backward_body = _backward_body(forward_body, grad_mask, len(chunked), fake_mode)
        names = f"{name}_{length}_forward", f"{name}_{length}_backward"
        gm.add_submodule(names[0], forward_body)
        gm.add_submodule(names[1], backward_body)
        xs = [_stacked(graph, spans[x][g], tuple(x.meta["val"].shape), dim, length, count, view_tag) for x, dim in chunked.items()]
        loop = tag(graph.call_function(chunk_loop, (tag(graph.get_attr(names[0])), tag(graph.get_attr(names[1])), grad_mask,
                                                    len(xs), *xs, *[lookup(w) for w in whole])))
        chunk_vals = [v.meta["val"] for v in meta.output_node(forward_body.graph).args[0]]
        for i, (o, dim, layout) in enumerate(outputs):
            stacked = tag(graph.call_function(operator.getitem, (loop, i)))
            pieces[o].append(_unstacked(graph, stacked, tuple(chunk_vals[i].shape), count, dim, layout, tag))
    result = {}
    for o, dim, layout in outputs:
        out = pieces[o][0] if len(pieces[o]) == 1 else tag(graph.call_function(aten.cat.default, (pieces[o], layout.index(dim))))
        if list(layout) != sorted(layout):
            out = tag(graph.call_function(aten.permute.default, (out, [layout.index(d) for d in range(len(layout))])))
        result[o] = out
    return result


def _spans(graph: fx.Graph, x: fx.Node, dim: int, lengths: list[int], tag: Callable[[fx.Node], fx.Node]) -> list[fx.Node]:
    if len(lengths) == 1:
        return [x]
    split = tag(graph.call_function(aten.split_with_sizes.default, (x, lengths, dim)))
    return [tag(graph.call_function(operator.getitem, (split, i))) for i in range(len(lengths))]


def _stacked(graph: fx.Graph, x: fx.Node, shape: tuple[int, ...], dim: int, length: int, count: int,
             tag: Callable[[fx.Node], fx.Node]) -> fx.Node:
    """``x``, ``count`` chunks of ``length`` along ``dim`` of a tensor of ``shape`` otherwise, as
    (count, ..., length, ...): views only."""
    split = tag(graph.call_function(aten.view.default, (x, [*shape[:dim], count, length, *shape[dim + 1:]])))
    order = [dim, *[d for d in range(len(shape) + 1) if d != dim]]
    return tag(graph.call_function(aten.permute.default, (split, order)))


def _unstacked(graph: fx.Graph, stacked: fx.Node, chunk: tuple[int, ...], count: int, dim: int, layout: tuple[int, ...],
               tag: Callable[[fx.Node], fx.Node]) -> fx.Node:
    """A loop's stacked output (count, *chunk) as one tensor whose dims are in ``layout`` order,
    the chunks along ``dim`` joined: one copy."""
    j = layout.index(dim)
    order = [1 + d for d in layout[:j]] + [0] + [1 + d for d in layout[j:]]
    moved = tag(graph.call_function(aten.permute.default, (stacked, order)))
    shape = [chunk[d] for d in layout]
    shape[j] *= count
    return tag(graph.call_function(aten.reshape.default, (moved, shape)))


def _forward_body(nodes: Sequence[fx.Node], chunked: Mapping[fx.Node, int], whole: Sequence[fx.Node], outputs: Sequence[fx.Node],
                  length: int, chunk_args: Callable[[fx.Node, tuple, int], tuple] | None, fake_mode: object) -> fx.GraphModule:
    """``nodes`` over one chunk of ``length``: the chunked inputs, then the whole ones, in; the
    outputs, out. An output that is a view is copied: a loop's outputs alias nothing."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    fakes = []
    # Values of the body's inputs in the graph's fake mode (a rewrite before may have given a node
    # a value of a mode of its own).
    for x, dim in chunked.items():
        v = x.meta["val"]
        shape = list(v.shape)
        shape[dim] = length
        with fake_mode:
            fakes.append(torch.empty(shape, dtype=v.dtype, device=v.device))
        env[x] = g.call_function(aten.clone.default, (g.placeholder(f"chunk_{x.name}"),), {"memory_format": torch.contiguous_format})
    for w in whole:
        env[w] = g.placeholder(w.name)
        v = w.meta["val"]
        with fake_mode:
            fakes.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device))
    for n in nodes:
        args, kwargs = fx.map_arg(n.args, env.__getitem__), fx.map_arg(n.kwargs, env.__getitem__)
        if chunk_args is not None:
            args = chunk_args(n, args, length)
        new = g.create_node("call_function", n.target, args, kwargs)
        new.meta.update({k: v for k, v in n.meta.items() if k not in _OUTER_ONLY and not k.startswith("zerofx_")})
        env[n] = new
    outs = [g.call_function(aten.clone.default, (env[o],)) if _is_view(env[o]) else env[o] for o in outputs]
    g.output(tuple(outs))
    body = _compat.make_graph_module({}, g)
    FakeTensorProp(body, mode=fake_mode).propagate_dont_convert_inputs(*fakes)
    return body


def _is_view(node: fx.Node) -> bool:
    """Whether ``node``'s value may share storage with another tensor of the body (a view, or an
    op that returns its input as it is when nothing needs changing)."""
    return (node.op == "placeholder" or node.target is operator.getitem or bool(getattr(node.target, "is_view", False))
            or getattr(node.target, "overloadpacket", None) in _MAY_ALIAS)


_MAY_ALIAS = {aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.select, aten.unbind, aten.slice,
              aten.split, aten.split_with_sizes, aten.chunk, aten.unsqueeze, aten.squeeze, aten.expand, aten.alias, aten.t,
              aten.narrow, aten.movedim, aten.flatten, aten.unflatten, aten.view_as, aten.expand_as, aten.contiguous, aten.to,
              aten.type_as, aten.real, aten.view_as_real, aten.view_as_complex, aten.diagonal}


def _backward_body(forward_body: fx.GraphModule, grad_mask: tuple[bool, ...], num_chunked: int, fake_mode: object) -> fx.GraphModule:
    """The scan body of the loop's backward: (sums of the whole inputs' gradients, a chunk of the
    chunked inputs, the chunk's output gradients, the whole inputs) -> (the sums with this
    chunk's added, the chunk's input gradients)."""
    placeholders = forward_body.graph.find_nodes(op="placeholder")
    in_fakes = [p.meta["val"] for p in placeholders]
    out_fakes = [o.meta["val"] for o in meta.output_node(forward_body.graph).args[0]]
    num_inputs = len(in_fakes)
    input_mask, output_mask = grad_mask[:num_inputs], grad_mask[num_inputs:]
    whole_fakes = in_fakes[num_chunked:]
    sums = [f for f, m in zip(whole_fakes, input_mask[num_chunked:]) if m]
    grads = [f for f, m in zip(out_fakes, output_mask) if m]

    def step(*args: Tensor) -> tuple[Tensor, ...]:
        acc, rest = args[: len(sums)], args[len(sums):]
        xs, gs, ws = rest[:num_chunked], rest[num_chunked: num_chunked + len(grads)], rest[num_chunked + len(grads):]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(m) for t, m in zip((*xs, *ws), input_mask)]
            outs = forward_body(*inputs)
            used = [o for o, m in zip(outs, output_mask) if m]
            pairs = [(o, g.clone(memory_format=torch.contiguous_format)) for o, g in zip(used, gs) if o.requires_grad]
            wrt = [t for t in inputs if t.requires_grad]
            found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) if pairs else [None] * len(wrt)
        found = [torch.zeros_like(t) if g is None else g for g, t in zip(found, wrt)]
        num_x = sum(input_mask[:num_chunked])
        # A scan with no per-chunk output (only the weights' gradients: an embedding of token ids)
        # fails Inductor's lowering of scan to while_loop, so it gets a scalar one, unread.
        per_chunk = _distinct(found[:num_x]) if num_x else [torch.zeros((), device=xs[0].device)]
        return (*[a + g for a, g in zip(acc, found[num_x:])], *per_chunk)

    with fake_mode:  # new tensors, one per argument (make_fx traces one tensor passed twice as one input); the whole ones' strides kept
        fakes = [torch.empty(f.shape, dtype=f.dtype, device=f.device) for f in (*sums, *in_fakes[:num_chunked], *grads)]
        fakes += [torch.empty_strided(f.shape, f.stride(), dtype=f.dtype, device=f.device) for f in whole_fakes]
    return _compat.lazy_graph_module(_compat.make_fx(step)(*fakes))


def _distinct(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``tensors`` with each view, and each tensor met before, copied: a loop body's outputs
    alias nothing (autograd hands the same gradient to both inputs of an ``add``)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) in seen or t._base is not None:
            t = t.clone()
        seen.add(id(t))
        out.append(t)
    return out


def run_map(body: fx.GraphModule, xs: Sequence[Tensor], args: Sequence[Tensor]) -> list[Tensor]:
    """``map_impl(body, xs, args)``: ``body`` on each slice of ``xs``' first dim, its outputs
    written into tensors allocated once (NOTE [One body per tiled region])."""
    count = xs[0].shape[0]
    outs: list[Tensor] = []
    for i in range(count):
        got = body(*[x[i] for x in xs], *args)
        if i == 0:
            outs = [g.new_empty((count, *g.shape)) for g in got]
        for out, g in zip(outs, got):
            out[i].copy_(g)
    return outs


def run_scan(body: fx.GraphModule, init: Sequence[Tensor], xs: Sequence[Tensor], args: Sequence[Tensor]) -> list[Tensor]:
    """``scan(body, init, xs, args)``: ``body`` on the carry and each slice of ``xs``' first dim,
    the carry threaded through, the other outputs written into tensors allocated once."""
    count = xs[0].shape[0]
    carry, outs = list(init), []
    for i in range(count):
        got = body(*carry, *[x[i] for x in xs], *args)
        carry, ys = list(got[: len(init)]), got[len(init):]
        if i == 0:
            outs = [y.new_empty((count, *y.shape)) for y in ys]
        for out, y in zip(outs, ys):
            out[i].copy_(y)
    return [*carry, *outs]


_EAGER_LOOPS = {_compat.MAP_LOOP: run_map, _compat.SCAN_LOOP: run_scan}


def eager_loops_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose ``map_impl`` and ``scan`` nodes call ``run_map`` and ``run_scan``
    (NOTE [One body per tiled region]); ``gm`` itself when it has none. For graphs run as FX code:
    Inductor compiles the operators."""
    if not any(n.op == "call_function" and n.target in _EAGER_LOOPS for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    value, old_output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(value, type_expr=old_output.type).meta = dict(old_output.meta)
    graph.set_codegen(_compat.graph_codegen(gm.graph))  # how the graph is called (a CodeGen is stateless)
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _EAGER_LOOPS:
            n.target = _EAGER_LOOPS[n.target]
    graph.lint()
    return fx.GraphModule(gm, graph)
