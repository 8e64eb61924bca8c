"""Graph builder (stages 1 and 2): after the optimizer updates this rank's shards, all-gather
them by bucket so every rank holds the full updated parameters again.

Placeholders: one shard ``[shard_numel]`` per trainable parameter, in ``plan.sync_buckets``
order (the same as ``plan.reduce_order``). Outputs: the full padded flat ``[padded_numel]`` of
each, same order. At stage 3 only the persistent parameters (kept whole) take part. Returns
None when there is nothing to gather (stage 0 updates full parameters; stage 3 without
persistent parameters keeps only shards).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import _compat, bucket_ops, meta
from passes.plan import Plan


def build_param_sync(plan: Plan, *, group_name: str) -> fx.GraphModule | None:
    if not plan.sync_buckets:
        return None
    graph = fx.Graph()
    fake_mode = _compat.FakeTensorMode()
    outputs: list[fx.Node] = []
    for bucket in plan.sync_buckets:
        params = [plan.param(f) for f in bucket]
        shards = []
        for p in params:
            shard = graph.placeholder(f"shard_{len(outputs) + len(shards)}")
            with fake_mode:
                shard.meta["val"] = torch.empty(p.shard_numel, dtype=p.torch_dtype)
            shard.meta[meta.ROLE] = meta.Role.PARAM
            shard.meta[meta.FQN] = p.fqn
            shards.append(shard)
        message, _ = bucket_ops.pack(graph, shards)  # (S,)
        gathered = meta.add_call(graph, _compat.ALL_GATHER, (message, plan.world_size, group_name))  # (N * S,)
        gathered.meta[meta.COMM_FQNS] = bucket
        gathered.meta[meta.COMM_BYTES] = sum(p.shard_numel * p.itemsize for p in params)
        waited = meta.add_call(graph, _compat.WAIT, (gathered,))
        outputs += bucket_ops.unpack_gathered(graph, waited, [p.shard_numel for p in params], plan.world_size)
    graph.output(outputs)
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph)
