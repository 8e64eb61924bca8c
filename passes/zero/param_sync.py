"""Graph builder (stages 1 and 2): after the optimizer updates this rank's shards, all-gather
them by bucket so every rank holds the full updated parameters again.

Placeholders: one shard ``[shard_numel]`` per trainable parameter, in ``plan.sync_buckets``
order (the same as ``plan.reduce_order``), then the engine's full padded flat
``[padded_numel]`` of each, same order. The graph copies each gathered bucket into those flats
(``aten.copy_``, in place) right after its wait, so one bucket's gathered buffer is alive at a
time; returning every gathered parameter instead held a second copy of the whole model until
the engine had copied them all (4P bytes in fp32). Outputs: the flats, aliases of the inputs.
At stage 3 only the persistent parameters (kept whole) take part. Returns None when there is
nothing to gather (stage 0 updates full parameters; stage 3 without persistent parameters
keeps only shards).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes import _compat, meta
from zerofx.passes.zero import bucket_ops
from zerofx.passes.plan import Plan

aten = torch.ops.aten


def build_param_sync(plan: Plan, *, group_name: str) -> fx.GraphModule | None:
    if not plan.sync_buckets:
        return None
    graph = fx.Graph()
    fake_mode = _compat.FakeTensorMode()
    params = {f: plan.param(f) for bucket in plan.sync_buckets for f in bucket}
    shards, fulls = {}, {}
    for i, p in enumerate(params.values()):
        shards[p.fqn] = shard = graph.placeholder(f"shard_{i}")
        with fake_mode:
            shard.meta["val"] = torch.empty(p.shard_numel, dtype=p.torch_dtype)
        shard.meta[meta.ROLE] = meta.Role.PARAM
        shard.meta[meta.FQN] = p.fqn
    for i, p in enumerate(params.values()):
        fulls[p.fqn] = full = graph.placeholder(f"full_{i}")
        with fake_mode:
            full.meta["val"] = torch.empty(p.padded_numel, dtype=p.torch_dtype)
        full.meta[meta.FQN] = p.fqn
    outputs: list[fx.Node] = []
    n = plan.shard_group_size  # gathered within the shard group: its K ranks hold the K shards
    for bucket in plan.sync_buckets:
        message, _ = bucket_ops.pack(graph, [shards[f] for f in bucket])  # (S,)
        gathered = meta.add_call(graph, _compat.ALL_GATHER, (message, n, group_name))  # (K * S,)
        gathered.meta[meta.COMM_FQNS] = bucket
        gathered.meta[meta.COMM_BYTES] = sum(params[f].shard_numel * params[f].itemsize for f in bucket)
        waited = meta.add_call(graph, _compat.WAIT, (gathered,))
        total = sum(params[f].shard_numel for f in bucket)
        grid = meta.add_call(graph, aten.view.default, (waited, [n, total]))  # (K, S): shard i's in row i
        offset = 0
        for f in bucket:
            s = params[f].shard_numel
            cols = meta.add_call(graph, aten.slice.Tensor, (grid, 1, offset, offset + s))  # (K, s), strided
            target = meta.add_call(graph, aten.view.default, (fulls[f], [n, s]))
            outputs.append(meta.add_call(graph, aten.copy_.default, (target, cols)))
            offset += s
    graph.output(outputs)
    graph.lint()
    return _compat.make_graph_module(torch.nn.Module(), graph)
