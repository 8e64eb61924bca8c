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
- each planned region runs in chunks of ``block_size`` tokens: its sequence-carrying inputs are
  split along their sequence dim, the region's nodes are replayed per chunk, and each output is
  the ``cat`` of its chunks. Every node of the chunked copy carries
  ``meta['recompute'] = CheckpointPolicy.MUST_RECOMPUTE`` and ``zerofx_tile_region``; so do the
  ``cat`` outputs of a region that only computes attention inputs (NOTE [Attention inputs are
  recomputed, not saved] in ``seq_regions``);
- each planned convolution span's nodes carry ``meta['recompute'] = MUST_RECOMPUTE`` (NOTE
  [Convolutions recomputed in backward] in ``plan_tiling``).

NOTE [Per-chunk recompute through the partitioner]
AOTAutograd copies a forward node's ``recompute`` tag onto the joint graph's node when it traces
under ``torch.fx.traceback.preserve_node_meta`` (capture does), so the min-cut partitioner must
recompute the chunk's intermediates in backward and saves only the region's inputs and outputs.
Its ``reordering_to_mimic_autograd_engine`` places each recomputed chunk right before that
chunk's backward, so one chunk of the MLP's 4x-wide activations is alive at a time. This is the
mechanism ``torch.utils.checkpoint``'s selective policies use under ``torch.compile``.

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
        _chunk_channels(gm.graph, spans[i], op.block_size)
    gm.graph.eliminate_dead_code()
    _replace_weight_linears(gm.graph)
    _propagate_vals(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def _chunk_channels(graph: fx.Graph, span: list[fx.Node], chunks: int) -> None:
    """``span`` (an FFT convolution) replayed on ``chunks`` slices of its channels, dim -2
    (NOTE [Long convolutions in channel chunks] in ``plan_tiling``)."""
    channels = channel_chunks_allowed(span)
    if channels == 0 or chunks > channels:
        raise PlanError(f"the tiling plan chunks an FFT convolution into {chunks} channel pieces that this graph cannot take "
                        f"({channels} channels); plan again for this graph")
    sizes = [channels // chunks + (1 if c < channels % chunks else 0) for c in range(chunks)]
    inside = set(span)
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    position = {n: i for i, n in enumerate(graph.nodes)}
    first_user = min((u for o in outputs for u in o.users if u not in inside), key=position.__getitem__)

    def tag(n: fx.Node) -> fx.Node:
        n.meta["recompute"] = _MUST_RECOMPUTE
        n.meta[TILED] = "conv"
        return n

    with graph.inserting_before(first_user):
        pieces: dict[fx.Node, list[fx.Node]] = {}
        for x in {a: None for n in span for a in n.all_input_nodes if a not in inside}:
            v = x.meta["val"]
            if v.shape[-2] == channels:
                split = tag(graph.call_function(aten.split_with_sizes.default, (x, sizes, v.dim() - 2)))
                pieces[x] = [tag(graph.call_function(operator.getitem, (split, c))) for c in range(chunks)]
        chunk_envs = []
        for c in range(chunks):
            cenv: dict[fx.Node, fx.Node] = {}

            def lookup(x: fx.Node, cenv: dict[fx.Node, fx.Node] = cenv, c: int = c) -> fx.Node:  # bound: used within this iteration
                return cenv[x] if x in inside else pieces[x][c] if x in pieces else x

            for n in span:
                new = graph.create_node("call_function", n.target, fx.map_arg(n.args, lookup), fx.map_arg(n.kwargs, lookup))
                new.meta.update({k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")})
                cenv[n] = tag(new)
            chunk_envs.append(cenv)
        for o in outputs:
            cat = tag(graph.call_function(aten.cat.default, ([env[o] for env in chunk_envs], o.meta["val"].dim() - 2)))
            o.replace_all_uses_with(cat, delete_user_cb=lambda u, cat=cat: u not in inside and u is not cat)


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
    for u in order:
        if isinstance(u, tuple):
            _emit_region(new, env, a, members[u], u[1], blocks[u[1]], recompute_outputs=a.feeds_attention[u[1]])
        else:
            env[u] = new.node_copy(u, lambda x: env[x])
    new.output(fx.map_arg(meta.output_node(old).args[0], lambda x: env[x]))
    out = _compat.make_graph_module(gm, new)
    return out


def _emit_region(g: fx.Graph, env: dict[fx.Node, fx.Node], a: seq_regions.SeqAnalysis, region: list[fx.Node], index: int, block: int,
                 *, recompute_outputs: bool) -> None:
    sizes = _chunk_sizes(a.seq_len, block)
    inside = set(region)

    def tag(n: fx.Node) -> fx.Node:
        n.meta["recompute"] = _MUST_RECOMPUTE
        n.meta[TILE_REGION] = index
        n.meta[TILED] = "region"
        return n

    pieces: dict[fx.Node, list[fx.Node]] = {}
    for x in a.region_inputs(region):
        if a.sdim.get(x) is not None:
            split = tag(g.call_function(aten.split_with_sizes.default, (env[x], sizes, a.sdim[x])))
            pieces[x] = [tag(g.call_function(operator.getitem, (split, c))) for c in range(len(sizes))]
    chunks: list[dict[fx.Node, fx.Node]] = []
    for c, length in enumerate(sizes):
        cenv: dict[fx.Node, fx.Node] = {}

        def lookup(x: fx.Node, cenv: dict[fx.Node, fx.Node] = cenv, c: int = c) -> fx.Node:  # bound: used within this iteration
            if x in inside:
                return cenv[x]
            return pieces[x][c] if x in pieces else env[x]

        for n in region:
            args = fx.map_arg(n.args, lookup)
            kwargs = fx.map_arg(n.kwargs, lookup)
            if a.sdim.get(n) is not None:
                args = _chunk_args(n, args, a.sdim[n], length)
            new = g.create_node("call_function", n.target, args, kwargs)
            new.meta.update({k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")})
            cenv[n] = tag(new)
        chunks.append(cenv)
    for o in a.region_outputs(region):
        assert isinstance(o.meta.get("val"), torch.Tensor), "a region output must be one tensor"
        pieces_o = [ch[o] for ch in chunks]
        if recompute_outputs and _is_view(o):
            # v is a view of the chunk's whole QKV projection: copy it per chunk so each chunk's
            # projection is freed as soon as its q, k and v exist, not after the last chunk.
            pieces_o = [tag(g.call_function(aten.clone.default, (p,))) for p in pieces_o]
        if recompute_outputs and o.meta["val"].dim() == 4 and a.sdim[o] == 2:
            # (B, H, T, D) attention inputs, concatenated in the (B, T, H, D) layout the attention
            # kernel reads fastest (NOTE [Layout at the op boundary] in ``tiled_kernels``).
            pieces_o = [tag(g.call_function(aten.transpose.int, (p, 1, 2))) for p in pieces_o]
            cat = tag(g.call_function(aten.cat.default, (pieces_o, 1)))
            env[o] = g.call_function(aten.transpose.int, (cat, 1, 2))
        else:
            env[o] = g.call_function(aten.cat.default, (pieces_o, a.sdim[o]))
        if recompute_outputs:  # NOTE [Attention inputs are recomputed, not saved]
            tag(env[o])
        else:
            env[o].meta[TILED] = "region"


def _is_view(node: fx.Node) -> bool:
    return node.target is operator.getitem or seq_regions.op_packet(node) in _VIEW_OPS


_VIEW_OPS = {aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.select, aten.unbind, aten.slice,
             aten.split, aten.split_with_sizes, aten.chunk, aten.unsqueeze, aten.squeeze, aten.expand, aten.alias, aten.t, aten.narrow}


def _propagate_vals(gm: fx.GraphModule) -> None:
    """Recompute ``meta['val']`` of every node on the placeholders' fake values."""
    vals = [ph.meta["val"] for ph in gm.graph.find_nodes(op="placeholder")]
    fake_mode = _compat.detect_fake_mode(vals)
    assert fake_mode is not None, "tile_forward_pass expects fake values on the placeholders"
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*vals)
