"""Rewrite (stage 3): weights the plan tile-gathers are gathered, used and reduced one tile at a time.

Expects the captured joint graph, before ``shard_params_pass``, and ``plan.tile_gathered``
(``plan_sharding`` chose it, see ``tile_gatherable``): for each ``(fqn, tiles)`` the parameter's
placeholder is read only by one ``zerofx::feature_tiled_linear`` (as its weight) and by that op's
backward, and its output features split evenly over the ranks. After it, the placeholder holds
this rank's flat shard (``meta['val']`` of shape ``[shard_numel]``, ``zerofx_comm_fqns`` set, as
``shard_params_pass`` leaves a sharded parameter) and neither custom op remains for it.

NOTE [One weight tile at a time]
Rank r owns rows [r·R, (r+1)·R) of a weight [out, in], R = out / N (``ParamPlacement``: a flat
shard of a weight whose rows split evenly is a block of whole rows). Split every rank's block
the same way into tiles of r_t rows at offsets a_t (``tiled_kernels.tile_bounds``). All-gathering
tile t from every rank gives N row blocks: rows k·R + a_t + j for k < N, j < r_t, i.e. an
[N·r_t, in] weight. So, with y viewed as [M, N, R]:
- forward: y[:, :, a_t : a_t + r_t] = (x @ W_tᵀ) viewed [M, N, r_t]; the tiles are concatenated
  along the last dim, then the bias is added;
- backward: dy_t = dy[:, :, a_t : a_t + r_t] as [M, N·r_t]; dx = Σ_t dy_t @ W_t; and
  dW_t = dy_tᵀ @ x is [N·r_t, in] whose k-th block of r_t rows is rank k's part of tile t, so
  ``reduce_scatter(sum)`` of it hands each rank exactly its own tile: the rank's gradient shard
  is the concatenation of its tiles, divided by N as ``reduce_grads_pass`` does.
No tile depends on another, and the gathered W_t is read only by its own matmuls. As in
``shard_params_pass`` the slice, gather, wait and view of each tile are tagged
``MUST_RECOMPUTE`` (NOTE [Why the gather is tagged for recompute]), so the partitioner saves the
shard, not a tile, and backward gathers each tile again right before its first use. These
collectives are marked ``zerofx_weight_tile``: the overlap passes leave them where they are,
so a weight has one tile gathered at a time and one tile gradient in flight (each is waited for
right after its issue). That costs exposed communication per tile; it is the trade this tiling
makes, for a weight too large to gather whole.

Writes ``zerofx_comm_fqns``/``zerofx_comm_bytes`` on each collective, like the other rewrites,
so ``plan.schedule`` predicts them. Returns the graph unchanged below stage 3 or when nothing is
tile-gathered; a weight already rewritten (its placeholder has ``zerofx_comm_fqns``) is skipped.
"""

from __future__ import annotations

import itertools
import operator

import torch
import torch.fx as fx

from zerofx.passes import _compat, meta
from zerofx.passes.plan import ParamPlacement, Plan, ZeroStage
from zerofx.passes.tiled_kernels import tile_bounds

aten = torch.ops.aten
FORWARD = torch.ops.zerofx.feature_tiled_linear.default
BACKWARD = torch.ops.zerofx.feature_tiled_linear_backward.default
WEIGHT_TILE = "zerofx_weight_tile"  # (fqn, t): on the gathers and reductions of a weight's tile t
_MUST_RECOMPUTE = _compat.CheckpointPolicy.MUST_RECOMPUTE


def tile_gatherable(ph: fx.Node, world_size: int) -> str | None:
    """Why the parameter ``ph`` of a joint graph cannot be gathered one tile at a time on
    ``world_size`` ranks, or None when it can (read by one feature-tiled linear, as its weight,
    and that op's backward; output features split evenly over the ranks)."""
    forward = [u for u in ph.users if u.target is FORWARD and len(u.args) > 1 and u.args[1] is ph]
    backward = [u for u in ph.users if u.target is BACKWARD and len(u.args) > 2 and u.args[2] is ph]
    if len(forward) != 1 or len(forward) + len(backward) != len(ph.users) or len(backward) > 1:
        return "read by other ops than one feature-tiled linear"
    out_features = ph.meta["val"].shape[0]
    if out_features % world_size:
        return f"its {out_features} output features do not split evenly over {world_size} ranks"
    return None


def tile_weights_pass(gm: fx.GraphModule, plan: Plan, *, group_name: str) -> fx.GraphModule:
    if plan.stage is not ZeroStage.THREE or not plan.tile_gathered:
        return gm
    # Tiles are gathered over all ranks; the planner tiles no weight under shard groups.
    assert plan.shard_group_size == plan.world_size, "weight tiles need flat sharding"
    graph = gm.graph
    ph_of = {ph.meta[meta.FQN]: ph for ph in meta.placeholders(graph, meta.Role.PARAM)}
    changed = False
    for fqn, tiles in plan.tile_gathered:
        ph = ph_of[fqn]
        if meta.COMM_FQNS in ph.meta:
            continue
        reason = tile_gatherable(ph, plan.world_size)
        assert reason is None, f"{fqn} cannot be tile-gathered: {reason}"
        _rewrite(graph, ph, plan, tiles, group_name)
        changed = True
    if not changed:
        return gm
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm


def _rewrite(graph: fx.Graph, ph: fx.Node, plan: Plan, tiles: int, group_name: str) -> None:
    p = plan.param(ph.meta[meta.FQN])
    n = plan.world_size
    out_features, in_features = p.shape
    rows = out_features // n
    bounds = tile_bounds(rows, tiles)
    forward = next(u for u in ph.users if u.target is FORWARD)
    backward = next((u for u in ph.users if u.target is BACKWARD), None)
    full = ph.meta["val"]
    with full.fake_mode:
        ph.meta["val"] = torch.empty(p.shard_numel, dtype=full.dtype, device=full.device)
    ph.meta[meta.COMM_FQNS] = (p.fqn,)

    x, _, bias, _ = forward.args
    lead = list(x.meta["val"].shape[:-1])
    with graph.inserting_before(forward):
        x2 = meta.add_call(graph, aten.reshape.default, (x, [-1, in_features]))  # (M, in)
        weights, outs = [], []
        for t, (a, e) in enumerate(itertools.pairwise(bounds)):
            weight = _gather_tile(graph, ph, p, t, a, e, in_features, n, group_name)  # (N * r_t, in)
            weights.append(weight)
            wt = meta.add_call(graph, aten.t.default, (weight,))
            wt.meta["recompute"] = _MUST_RECOMPUTE
            y = meta.add_call(graph, aten.mm.default, (x2, wt))  # (M, N * r_t)
            outs.append(meta.add_call(graph, aten.view.default, (y, [-1, n, e - a])))
        y = meta.add_call(graph, aten.cat.default, (outs, 2)) if len(outs) > 1 else outs[0]  # (M, N, R)
        y = meta.add_call(graph, aten.view.default, (y, [*lead, out_features]))
        if bias is not None:
            y = meta.add_call(graph, aten.add.Tensor, (y, bias))
    forward.replace_all_uses_with(y)
    graph.erase_node(forward)
    if backward is None:  # a frozen weight with an input that needs no gradient either
        return

    grad, x_saved, _, _, with_bias = backward.args
    # Build only the outputs backward reads: a frozen weight's tiles must not reduce a gradient
    # (the plan counts no such collective, and DCE keeps it: ``wait_tensor`` is impure in FX).
    wanted = {user.args[1] for user in backward.users}
    with graph.inserting_before(backward):
        dy = meta.add_call(graph, aten.reshape.default, (grad, [-1, n, rows]))  # (M, N, R)
        xb = meta.add_call(graph, aten.reshape.default, (x_saved, [-1, in_features]))  # (M, in)
        dx = dshard = db = None
        pieces = []
        accumulate = torch.float32 if len(bounds) > 2 and p.torch_dtype.itemsize < 4 else None
        for t, (a, e) in enumerate(itertools.pairwise(bounds)):
            cols = meta.add_call(graph, aten.slice.Tensor, (dy, 2, a, e))
            dy_t = meta.add_call(graph, aten.reshape.default, (cols, [-1, n * (e - a)]))  # (M, N * r_t), a copy
            if 0 in wanted:
                dx_t = meta.add_call(graph, aten.mm.default, (dy_t, weights[t]))  # (M, in)
                if accumulate is not None:  # sum the tiles' shares of dx in fp32, as one matmul would
                    dx_t = meta.add_call(graph, aten._to_copy.default, (dx_t,), {"dtype": accumulate})
                dx = dx_t if dx is None else meta.add_call(graph, aten.add.Tensor, (dx, dx_t))
            if 1 not in wanted:
                continue
            dyt_t = meta.add_call(graph, aten.t.default, (dy_t,))
            dw_t = meta.add_call(graph, aten.mm.default, (dyt_t, xb))  # (N * r_t, in)
            flat = meta.add_call(graph, aten.view.default, (dw_t, [-1]))
            reduced = meta.add_call(graph, _compat.REDUCE_SCATTER, (flat, "sum", n, group_name))  # (r_t * in,)
            reduced.meta[meta.COMM_FQNS] = (p.fqn,)
            reduced.meta[meta.COMM_BYTES] = n * (e - a) * in_features * p.itemsize
            reduced.meta[WEIGHT_TILE] = (p.fqn, t)
            pieces.append(meta.add_call(graph, _compat.WAIT, (reduced,)))
        if pieces:
            shard = meta.add_call(graph, aten.cat.default, (pieces,)) if len(pieces) > 1 else pieces[0]  # (R * in,)
            dshard = meta.add_call(graph, aten.div.Tensor, (shard, n))
            dshard.meta[meta.COMM_FQNS] = (p.fqn,)
        if dx is not None:
            if accumulate is not None:
                dx = meta.add_call(graph, aten._to_copy.default, (dx,), {"dtype": x_saved.meta["val"].dtype})
            dx = meta.add_call(graph, aten.view.default, (dx, list(x_saved.meta["val"].shape)))
        if with_bias and 2 in wanted:
            db = meta.add_call(graph, aten.sum.dim_IntList, (meta.add_call(graph, aten.reshape.default, (grad, [-1, out_features])), [0]))
    replacement = {0: dx, 1: dshard, 2: db}
    for user in list(backward.users):
        assert user.target is operator.getitem, f"{user} should take one output of {backward}"
        user.replace_all_uses_with(replacement[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(backward)


def _gather_tile(graph: fx.Graph, ph: fx.Node, p: ParamPlacement, t: int, a: int, e: int, in_features: int, n: int,
                 group_name: str) -> fx.Node:
    """Tile t of the weight from every rank, [N * r_t, in]; NOTE [One weight tile at a time]."""
    chunk = meta.add_call(graph, aten.slice.Tensor, (ph, 0, a * in_features, e * in_features))  # (r_t * in,)
    gathered = meta.add_call(graph, _compat.ALL_GATHER, (chunk, n, group_name))  # (N * r_t * in,)
    gathered.meta[meta.COMM_FQNS] = (p.fqn,)
    gathered.meta[meta.COMM_BYTES] = (e - a) * in_features * p.itemsize
    gathered.meta[WEIGHT_TILE] = (p.fqn, t)
    waited = meta.add_call(graph, _compat.WAIT, (gathered,))
    weight = meta.add_call(graph, aten.view.default, (waited, [n * (e - a), in_features]))
    for node in (chunk, gathered, waited, weight):
        node.meta["recompute"] = _MUST_RECOMPUTE
    return weight
