"""Rewrite: gradients are averaged across ranks, by bucket, as backward produces them.

Expects the joint graph (after ``shard_params_pass`` if stage 3), outputs
``[loss, grad per primal]``. For each bucket of ``plan.reduce_buckets``, right after its last
gradient is produced, each gradient is flattened and padded to ``padded_numel`` and the bucket
becomes one message (NOTE [Bucket layout] in ``bucket_ops``):

- stage 0: ``all_reduce(sum)``; the graph outputs each full padded flat ``[padded_numel]``;
- stage 1: no collective; the graph outputs each local padded flat ``[padded_numel]``, which the
  engine accumulates and ``grad_sync`` reduce-scatters once per optimizer step (NOTE [Stages 1
  and 2 move 2 Psi]);
- stages 2 and 3: ``reduce_scatter_tensor(sum)`` over the shard group; it outputs this rank's
  shards ``[shard_numel]``. With shard groups smaller than the world, an ``all_reduce(sum)`` of
  the shard over the replicate group follows (NOTE [Shard groups of consecutive ranks]).

Then ``wait_tensor`` and ``div(world_size)``. Sum then divide, rather than ``avg``, because gloo
has no AVG reduction; it matches data parallel's mean of per-rank gradients. Where the wait
goes is the scheduler's business (``schedule_overlap``); here it follows the collective.
Writes ``zerofx_comm_fqns``/``zerofx_comm_bytes`` (and ``zerofx_comm_group``) on each
collective. Running it twice changes nothing: buckets whose outputs already went through it are
skipped.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes import _compat, meta
from zerofx.passes.zero import bucket_ops
from zerofx.passes.plan import REPLICATE, SHARD, ParamPlacement, Plan, ZeroStage

aten = torch.ops.aten


def reduce_grads_pass(gm: fx.GraphModule, plan: Plan, *, group_name: str, replicate_group_name: str | None = None) -> fx.GraphModule:
    graph = gm.graph
    out = meta.output_node(graph)
    outputs = list(out.args[0])
    primals = [n for n in meta.placeholders(graph) if n.meta[meta.ROLE] is not meta.Role.TANGENT]
    index_of = {ph.meta[meta.FQN]: i for i, ph in enumerate(primals, start=1) if ph.meta[meta.ROLE] is meta.Role.PARAM}
    position = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for bucket in plan.reduce_buckets:
        grads = [outputs[index_of[f]] for f in bucket]
        if any(meta.COMM_FQNS in g.meta for g in grads):
            continue
        params = [plan.param(f) for f in bucket]
        last = max(grads, key=position.__getitem__)
        with graph.inserting_before(last.next):
            flats = []
            for g, p in zip(grads, params):
                flat = meta.add_call(graph, aten.reshape.default, (g, [-1]))  # (numel,)
                if p.padded_numel != p.numel:
                    flat = meta.add_call(graph, aten.constant_pad_nd.default, (flat, [0, p.padded_numel - p.numel]))
                flats.append(flat)  # (padded_numel,)
            if plan.stage is ZeroStage.ONE:
                pieces = flats  # local gradients: grad_sync reduces them once per optimizer step
            elif plan.stage is ZeroStage.ZERO:
                message, _ = bucket_ops.pack(graph, flats)  # (sum padded,)
                comm = meta.add_call(graph, _compat.ALL_REDUCE, (message, "sum", group_name))  # (sum padded,)
                comm.meta[meta.COMM_FQNS] = bucket
                comm.meta[meta.COMM_BYTES] = sum(p.padded_numel * p.itemsize for p in params)
                waited = meta.add_call(graph, _compat.WAIT, (comm,))
                mean = meta.add_call(graph, aten.div.Tensor, (waited, plan.world_size))
                pieces = bucket_ops.split(graph, mean, [p.padded_numel for p in params])
            else:
                pieces = add_bucket_reduce_scatter(graph, flats, params, bucket, plan, group_name=group_name,
                                                   replicate_group_name=replicate_group_name)
            for f, piece in zip(bucket, pieces):
                piece.meta[meta.COMM_FQNS] = bucket
                outputs[index_of[f]] = piece
        changed = True
    if not changed:
        return gm
    out.args = (outputs,)
    graph.lint()
    gm.recompile()
    return gm


def add_bucket_reduce_scatter(graph: fx.Graph, flats: list[fx.Node], params: list[ParamPlacement], bucket: tuple[str, ...], plan: Plan,
                              *, group_name: str, replicate_group_name: str | None) -> list[fx.Node]:
    """Insert, at the graph's insertion point, the reduction of one bucket of padded flat
    gradients ``(padded_numel,)`` into this rank's mean shards ``(shard_numel,)``, returned in
    bucket order: a reduce-scatter over the shard group of K ranks, and with K below the world
    size an all-reduce of the shard over the replicate group, each waited, then the division by
    the world size. Shared by ``reduce_grads_pass`` (stages 2-3) and ``build_grad_sync`` (stage 1)."""
    k = plan.shard_group_size
    rows = [meta.add_call(graph, aten.view.default, (flat, [k, p.shard_numel])) for flat, p in zip(flats, params)]
    message, _ = bucket_ops.pack(graph, rows, dim=1)  # (K, S)
    flat_in = meta.add_call(graph, aten.view.default, (message, [-1]))  # (K * S,)
    comm = meta.add_call(graph, _compat.REDUCE_SCATTER, (flat_in, "sum", k, group_name))  # (S,)
    comm.meta[meta.COMM_FQNS] = bucket
    comm.meta[meta.COMM_BYTES] = sum(p.padded_numel * p.itemsize for p in params)
    comm.meta[meta.COMM_GROUP] = SHARD
    reduced = meta.add_call(graph, _compat.WAIT, (comm,))
    if k < plan.world_size:
        assert replicate_group_name is not None, "shard groups smaller than the world need the replicate group"
        across = meta.add_call(graph, _compat.ALL_REDUCE, (reduced, "sum", replicate_group_name))  # (S,)
        across.meta[meta.COMM_FQNS] = bucket
        across.meta[meta.COMM_BYTES] = sum(p.shard_numel * p.itemsize for p in params)
        across.meta[meta.COMM_GROUP] = REPLICATE
        reduced = meta.add_call(graph, _compat.WAIT, (across,))
    mean = meta.add_call(graph, aten.div.Tensor, (reduced, plan.world_size))
    return bucket_ops.split(graph, mean, [p.shard_numel for p in params])
