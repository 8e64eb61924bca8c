"""Rewrite: gradients are averaged across ranks, by bucket, as backward produces them.

Expects the joint graph (after ``shard_params_pass`` if stage 3), outputs
``[loss, grad per primal]``. For each bucket of ``plan.reduce_buckets``, right after its last
gradient is produced, each gradient is flattened and padded to ``padded_numel`` and the bucket
becomes one message (NOTE [Bucket layout] in ``bucket_ops``):

- stages 0 and 1: ``all_reduce(sum)``; the graph outputs each full padded flat ``[padded_numel]``;
- stages 2 and 3: ``reduce_scatter_tensor(sum)``; it outputs this rank's shards ``[shard_numel]``.

Then ``wait_tensor`` and ``div(world_size)``. Sum then divide, rather than ``avg``, because gloo
has no AVG reduction; it matches data parallel's mean of per-rank gradients. Where the wait
goes is the scheduler's business (``schedule_overlap``); here it follows the collective.
Writes ``zerofx_comm_fqns``/``zerofx_comm_bytes`` on each collective. Running it twice changes
nothing: buckets whose outputs already come from a collective are skipped.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes import _compat, bucket_ops, meta
from zerofx.passes.plan import Plan, ZeroStage

aten = torch.ops.aten


def reduce_grads_pass(gm: fx.GraphModule, plan: Plan, *, group_name: str) -> fx.GraphModule:
    graph = gm.graph
    out = meta.output_node(graph)
    outputs = list(out.args[0])
    primals = [n for n in meta.placeholders(graph) if n.meta[meta.ROLE] is not meta.Role.TANGENT]
    index_of = {ph.meta[meta.FQN]: i for i, ph in enumerate(primals, start=1) if ph.meta[meta.ROLE] is meta.Role.PARAM}
    position = {n: i for i, n in enumerate(graph.nodes)}
    scatter = plan.stage >= ZeroStage.TWO
    n = plan.world_size
    changed = False
    for bucket in plan.reduce_buckets:
        grads = [outputs[index_of[f]] for f in bucket]
        if any(meta.COMM_FQNS in g.meta for g in grads):
            continue
        params = [plan.param(f) for f in bucket]
        last = max(grads, key=position.__getitem__)
        with graph.inserting_before(last.next):
            rows = []
            for g, p in zip(grads, params):
                flat = meta.add_call(graph, aten.reshape.default, (g, [-1]))  # (numel,)
                if p.padded_numel != p.numel:
                    flat = meta.add_call(graph, aten.constant_pad_nd.default, (flat, [0, p.padded_numel - p.numel]))
                rows.append(meta.add_call(graph, aten.view.default, (flat, [n, p.shard_numel])) if scatter else flat)
            message, _ = bucket_ops.pack(graph, rows, dim=1 if scatter else 0)  # (N, S) or (sum padded,)
            if scatter:
                flat_in = meta.add_call(graph, aten.view.default, (message, [-1]))  # (N * S,)
                comm = meta.add_call(graph, _compat.REDUCE_SCATTER, (flat_in, "sum", n, group_name))  # (S,)
            else:
                comm = meta.add_call(graph, _compat.ALL_REDUCE, (message, "sum", group_name))  # (sum padded,)
            comm.meta[meta.COMM_FQNS] = bucket
            comm.meta[meta.COMM_BYTES] = sum(p.padded_numel * p.itemsize for p in params)
            waited = meta.add_call(graph, _compat.WAIT, (comm,))
            mean = meta.add_call(graph, aten.div.Tensor, (waited, n))
            sizes = [p.shard_numel if scatter else p.padded_numel for p in params]
            for f, piece in zip(bucket, bucket_ops.split(graph, mean, sizes)):
                piece.meta[meta.COMM_FQNS] = bucket
                outputs[index_of[f]] = piece
        changed = True
    if not changed:
        return gm
    out.args = (outputs,)
    graph.lint()
    gm.recompile()
    return gm
