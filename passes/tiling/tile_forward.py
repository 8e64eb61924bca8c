"""Rewrite: tile attention, token-wise regions and the vocabulary loss along the sequence.

Expects the pre-autograd forward graph (``make_fx(..., pre_dispatch=True)``, see ``seq_regions``)
and a ``TilingPlan`` from ``plan_tiling`` for it. AOTAutograd derives the backward of the
rewritten forward afterwards. Postconditions:
- each planned attention (SDPA or the explicit softmax pattern) is one
  ``zerofx::blocked_attention`` node (see NOTE [Blocked attention] in ``tiled_kernels``);
- each planned loss is one ``zerofx::chunked_linear_cross_entropy`` node, divided by the count of
  non-ignored targets for a mean;
- each planned weight's ``linear`` is one ``zerofx::feature_tiled_linear`` node (NOTE [Feature-tiled
  linear] in ``tiled_kernels``), which stage 3 gathers one tile at a time (``tile_weights``);
- each planned region runs in chunks of ``block_size`` tokens as a loop over one body subgraph
  (``chunk_loop``, NOTE [One body per tiled region] in ``chunk_loop``): its sequence-carrying
  inputs are viewed as stacked chunks, its nodes are written once into the body, and each output
  is the loop's stacked output laid out whole. The loop and its glue carry ``zerofx_tile_region``;
  those of a region that only computes attention inputs also carry ``meta['recompute'] =
  CheckpointPolicy.MUST_RECOMPUTE`` (NOTE [Attention inputs are recomputed, not saved] in
  ``seq_regions``);
- each planned convolution span's nodes carry ``meta['recompute'] = MUST_RECOMPUTE`` (NOTE
  [Convolutions recomputed in backward] in ``plan_tiling``); an FFT convolution planned in
  channel chunks is a loop over one body too, tagged the same.

NOTE [Per-chunk recompute through the partitioner]
AOTAutograd copies a forward node's ``recompute`` tag onto the joint graph's node when it traces
under ``torch.fx.traceback.preserve_node_meta`` (capture does), so the min-cut partitioner
recomputes what is tagged in backward instead of saving it: a convolution span's nodes, and the
loop of a region of attention inputs or of a channel-chunked convolution, whose outputs are then
made again just before their backward. A region's own intermediates never reach the
partitioner: they live in the loop's body, and its backward recomputes one chunk at a time
(NOTE [One body per tiled region] in ``chunk_loop``). This is the mechanism
``torch.utils.checkpoint``'s selective policies use under ``torch.compile``.

Meta keys written: ``zerofx_tile_region`` (int, the region's index) and ``zerofx_tiled`` (the
kind) on inserted nodes. Returns the graph unchanged when the plan tiles nothing. A graph that is
already tiled (a node carries ``zerofx_tiled``), or whose candidates differ from the plan's,
raises ``ValueError`` instead of being tiled twice.
"""

from __future__ import annotations

import heapq
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from zerofx.passes import _compat, meta
from zerofx.passes.sequence import seq_regions
from zerofx.passes.plan.tiling import TilingPlan
from zerofx.passes.tiling.chunk_loop import differentiable_nodes, emit_chunk_loop
from zerofx.passes.tiling.plan_tiling import analyze_for_tiling, channel_chunks_allowed, weight_linears
from zerofx.common.errors import PlanError

aten = torch.ops.aten
TILE_REGION = "zerofx_tile_region"
TILED = "zerofx_tiled"
_MUST_RECOMPUTE = _compat.CheckpointPolicy.MUST_RECOMPUTE
# int, for this pass only: the tiles a planned weight's linear gets once the regions are chunked.
_WEIGHT_TILES = "zerofx_weight_tiles"
_CONV_SPAN = "zerofx_conv_span"  # int, for this pass only: the planned convolution span a node belongs to


def tile_forward_pass(gm: fx.GraphModule, plan: TilingPlan | None) -> fx.GraphModule:
    if plan is None or not plan.ops:
        return gm
    if any(TILED in n.meta for n in gm.graph.nodes):
        raise PlanError("this graph is already tiled; plan again for the original graph instead of tiling twice")
    analysis = analyze_for_tiling(gm, plan.seq_len)
    linears = weight_linears(gm, plan.weight_tile_bytes)
    found = (len(analysis.attention), len(analysis.regions), len(analysis.losses), len(linears), len(analysis.conv_spans))
    if found != tuple(plan.num_candidates):
        raise PlanError(f"the tiling plan was made for {tuple(plan.num_candidates)} (attention, region, loss, weight, conv) candidates, "
                         f"this graph has {found}; plan again for this graph")
    graph = gm.graph
    # Chunking regions copies the graph; the tag travels with the node (no chosen region holds one).
    for i, op in plan.chosen("weight").items():
        linears[i][0].meta[_WEIGHT_TILES] = op.block_size
    for i in plan.chosen("conv"):  # NOTE [Convolutions recomputed in backward] in plan_tiling
        for n in analysis.conv_spans[i]:
            n.meta["recompute"] = _MUST_RECOMPUTE
            n.meta[_CONV_SPAN] = i  # found again after the regions are chunked (which copies the graph)
    for i, op in plan.chosen("attention").items():
        _replace_attention(graph, analysis.attention[i], op.block_size)
    for i, op in plan.chosen("loss").items():
        _replace_loss(graph, analysis.losses[i], op.block_size)
    graph.eliminate_dead_code()
    regions = plan.chosen("region")
    if regions:
        after = analyze_for_tiling(gm, plan.seq_len)
        assert len(after.regions) == plan.num_candidates[1], "replacing attention and losses must keep the regions"
        gm = _chunk_regions(gm, after, {i: op.block_size for i, op in regions.items()})
    # After the regions: a channel split is token-wise and would join the signal's region.
    spans: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if _CONV_SPAN in n.meta:
            spans.setdefault(n.meta[_CONV_SPAN], []).append(n)
    channel_chunked = {i: op for i, op in plan.chosen("conv").items() if op.block_size > 1}
    if channel_chunked:
        _propagate_vals(gm)  # the chunked regions' outputs, which the spans read, have no value yet
    for i, op in channel_chunked.items():
        _chunk_channels(gm, spans[i], i, op.block_size)
    gm.graph.eliminate_dead_code()
    _replace_weight_linears(gm.graph)
    _propagate_vals(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def _chunk_channels(gm: fx.GraphModule, span: list[fx.Node], index: int, chunks: int) -> None:
    """``span`` (an FFT convolution) run as a loop over ``chunks`` slices of its channels, dim -2
    (NOTE [Long convolutions in channel chunks] in ``plan_tiling``, NOTE [One body per tiled
    region] in ``chunk_loop``)."""
    graph = gm.graph
    channels = channel_chunks_allowed(span)
    if channels == 0 or chunks > channels:
        raise PlanError(f"the tiling plan chunks an FFT convolution into {chunks} channel pieces that this graph cannot take "
                        f"({channels} channels); plan again for this graph")
    sizes = [channels // chunks + (1 if c < channels % chunks else 0) for c in range(chunks)]
    inside = set(span)
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    position = {n: i for i, n in enumerate(graph.nodes)}
    first_user = min((u for o in outputs for u in o.users if u not in inside), key=position.__getitem__)
    inputs = list({a: None for n in span for a in n.all_input_nodes if a not in inside})
    chunked = {x: x.meta["val"].dim() - 2 for x in inputs if x.meta["val"].shape[-2] == channels}

    def tag(n: fx.Node) -> fx.Node:
        n.meta["recompute"] = _MUST_RECOMPUTE  # the convolution's outputs are recomputed, not saved
        n.meta[TILED] = "conv"
        return n

    differentiable = differentiable_nodes(graph)
    with graph.inserting_before(first_user):
        new = emit_chunk_loop(gm, graph, name=f"tiled_conv_{index}", nodes=span, lookup=lambda x: x, chunked=chunked,
                              whole=[x for x in inputs if x not in chunked],
                              outputs=[(o, o.meta["val"].dim() - 2, tuple(range(o.meta["val"].dim()))) for o in outputs],
                              sizes=sizes, differentiable=differentiable, tag=tag)
    for o, out in new.items():
        o.replace_all_uses_with(out, delete_user_cb=lambda u: u not in inside)


def _replace_attention(graph: fx.Graph, m: seq_regions.AttentionMatch, block: int) -> None:
    with graph.inserting_before(m.output):
        node = meta.add_call(
            graph, torch.ops.zerofx.blocked_attention.default, (m.q, m.k, m.v, m.mask, m.is_causal, m.scale, block, block)
        )
        out = meta.add_call(graph, operator.getitem, (node, 0))
    for n in (node, out):
        n.meta[TILED] = "attention"
    m.output.replace_all_uses_with(out)
    graph.erase_node(m.output)


def _replace_loss(graph: fx.Graph, m: seq_regions.LossMatch, block: int) -> None:
    h, w = m.linear.args[0], m.linear.args[1]
    b = m.linear.args[2] if len(m.linear.args) > 2 else m.linear.kwargs.get("bias")
    d = h.meta["val"].shape[-1]
    new: list[fx.Node] = []
    with graph.inserting_before(m.output):
        cur = h
        for c in m.chain:  # replay the views on the hidden states: (..., V) -> (..., D)
            pk = seq_regions.op_packet(c)
            if pk in (aten.view, aten.reshape, aten._unsafe_view):
                shape = list(c.meta["val"].shape)
                shape[-1] = d
                cur = meta.add_call(graph, aten.reshape.default, (cur, shape))
                new.append(cur)
            elif pk is aten.slice:
                cur = meta.add_call(graph, c.target, (cur, *c.args[1:]), dict(c.kwargs))
                new.append(cur)
        total = meta.add_call(
            graph, torch.ops.zerofx.chunked_linear_cross_entropy.default, (cur, w, b, m.target, m.ignore_index, block)
        )
        new.append(total)
        loss = total
        if m.reduction == 1:  # mean over the targets that are not ignored, as cross_entropy's mean
            keep = meta.add_call(graph, aten.ne.Scalar, (m.target, m.ignore_index))
            count = meta.add_call(graph, aten.sum.default, (keep,))
            loss = meta.add_call(graph, aten.div.Tensor, (total, count))
            new += [keep, count, loss]
    for n in new:
        n.meta[TILED] = "loss"
    m.output.replace_all_uses_with(loss)
    graph.erase_node(m.output)


def _replace_weight_linears(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        tiles = node.meta.pop(_WEIGHT_TILES, None)
        if tiles is None:
            continue
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        with graph.inserting_before(node):
            tiled = meta.add_call(graph, torch.ops.zerofx.feature_tiled_linear.default, (x, w, b, tiles))
        tiled.meta[TILED] = "weight"
        node.replace_all_uses_with(tiled)
        graph.erase_node(node)


def _chunk_sizes(t: int, block: int) -> list[int]:
    return [min(block, t - s) for s in range(0, t, block)]


def _chunk_args(node: fx.Node, args: tuple, sdim: int, length: int) -> tuple:
    """Shape arguments of a view or expand, with the sequence dim set to the chunk's length."""
    pk = seq_regions.op_packet(node)
    if pk in (aten.view, aten.reshape, aten._unsafe_view):
        shape = list(node.meta["val"].shape)
        shape[sdim] = length
        return (args[0], shape, *args[2:])
    if pk is aten.expand:
        sizes = list(args[1])
        sizes[sdim] = length
        return (args[0], sizes, *args[2:])
    return args


def _chunk_regions(gm: fx.GraphModule, a: seq_regions.SeqAnalysis, blocks: dict[int, int]) -> fx.GraphModule:
    """A new graph where each region in ``blocks`` runs in chunks; see NOTE [Regions and levels]."""
    old = gm.graph
    position = {n: i for i, n in enumerate(old.nodes)}
    region_of = {n: r for r in blocks for n in a.regions[r]}
    # Units: one per chunked region, one per other node. Topologically sorted, ties by position.
    def unit(n: fx.Node) -> Any:
        return ("region", region_of[n]) if n in region_of else n

    members: dict[Any, list[fx.Node]] = {}
    for n in old.nodes:
        if n.op != "output":
            members.setdefault(unit(n), []).append(n)
    deps: dict[Any, set[Any]] = {u: set() for u in members}
    users: dict[Any, set[Any]] = {u: set() for u in members}
    for u, nodes in members.items():
        for n in nodes:
            for inp in n.all_input_nodes:
                if unit(inp) != u:
                    deps[u].add(unit(inp))
                    users[unit(inp)].add(u)
    key = {u: min(position[n] for n in nodes) for u, nodes in members.items()}
    ready = [(key[u], i, u) for i, u in enumerate(members) if not deps[u]]
    heapq.heapify(ready)
    order, counter = [], len(members)
    remaining = {u: len(d) for u, d in deps.items()}
    while ready:
        _, _, u = heapq.heappop(ready)
        order.append(u)
        for v in users[u]:
            remaining[v] -= 1
            if remaining[v] == 0:
                counter += 1
                heapq.heappush(ready, (key[v], counter, v))
    assert len(order) == len(members), "regions must be convex (see NOTE [Regions and levels])"

    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    differentiable = differentiable_nodes(old)
    for u in order:
        if isinstance(u, tuple):
            _emit_region(gm, new, env, a, members[u], u[1], blocks[u[1]], recompute_outputs=a.feeds_attention[u[1]],
                         differentiable=differentiable)
        else:
            env[u] = new.node_copy(u, lambda x: env[x])
    new.output(fx.map_arg(meta.output_node(old).args[0], lambda x: env[x]))
    out = _compat.make_graph_module(gm, new)
    return out


def _emit_region(gm: fx.GraphModule, g: fx.Graph, env: dict[fx.Node, fx.Node], a: seq_regions.SeqAnalysis, region: list[fx.Node],
                 index: int, block: int, *, recompute_outputs: bool, differentiable: set[fx.Node]) -> None:
    """``region`` written into ``g`` as a loop over chunks of ``block`` tokens (NOTE [One body per
    tiled region] in ``chunk_loop``); its outputs' new nodes go into ``env``."""
    inputs = a.region_inputs(region)

    def tag(n: fx.Node) -> fx.Node:
        if recompute_outputs:  # NOTE [Attention inputs are recomputed, not saved]
            n.meta["recompute"] = _MUST_RECOMPUTE
        n.meta[TILE_REGION] = index
        n.meta[TILED] = "region"
        return n

    outputs = []
    for o in a.region_outputs(region):
        assert isinstance(o.meta.get("val"), torch.Tensor), "a region output must be one tensor"
        # (B, H, T, D) attention inputs are laid out (B, T, H, D), the layout the attention kernel
        # reads fastest (NOTE [Layout at the op boundary] in ``tiled_kernels``).
        bthd = recompute_outputs and o.meta["val"].dim() == 4 and a.sdim[o] == 2
        outputs.append((o, a.sdim[o], (0, 2, 1, 3) if bthd else tuple(range(o.meta["val"].dim()))))
    new = emit_chunk_loop(gm, g, name=f"tiled_region_{index}", nodes=region, lookup=env.__getitem__,
                          chunked={x: a.sdim[x] for x in inputs if a.sdim.get(x) is not None},
                          whole=[x for x in inputs if a.sdim.get(x) is None], outputs=outputs,
                          sizes=_chunk_sizes(a.seq_len, block), differentiable=differentiable, tag=tag,
                          chunk_args=lambda n, args, length: _chunk_args(n, args, a.sdim[n], length) if a.sdim.get(n) is not None else args)
    env.update(new)


def _propagate_vals(gm: fx.GraphModule) -> None:
    """Recompute ``meta['val']`` of every node on the placeholders' fake values."""
    vals = [ph.meta["val"] for ph in gm.graph.find_nodes(op="placeholder")]
    fake_mode = _compat.detect_fake_mode(vals)
    assert fake_mode is not None, "tile_forward_pass expects fake values on the placeholders"
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*vals)
