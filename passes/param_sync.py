"""Graph builder (stages 1 and 2): after the optimizer updates this rank's shards, all-gather
them so every rank holds the full updated parameters again.

Placeholders: one shard ``[shard_numel]`` per trainable parameter, in ``plan.reduce_order``.
Outputs: the full padded flat ``[padded_numel]`` of each, same order. Returns None at stages 0
and 3, where no such step exists (stage 0 updates full parameters; stage 3 keeps only shards).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import _compat, meta
from passes.plan import Plan, ZeroStage


def build_param_sync(plan: Plan, *, group_name: str) -> fx.GraphModule | None:
    if plan.stage not in (ZeroStage.ONE, ZeroStage.TWO):
        return None
    graph = fx.Graph()
    fake_mode = _compat.FakeTensorMode()
    outputs = []
    for fqn in plan.reduce_order:
        p = plan.param(fqn)
        shard = graph.placeholder(f"shard_{len(outputs)}")
        with fake_mode:
            shard.meta["val"] = torch.empty(p.shard_numel, dtype=p.torch_dtype)
        shard.meta[meta.ROLE] = meta.Role.PARAM
        shard.meta[meta.FQN] = fqn
        gathered = meta.add_call(graph, _compat.ALL_GATHER, (shard, plan.world_size, group_name))  # (padded,)
        gathered.meta[meta.COMM_FQN] = fqn
        gathered.meta[meta.COMM_BYTES] = p.shard_numel * p.itemsize
        outputs.append(meta.add_call(graph, _compat.WAIT, (gathered,)))
    graph.output(outputs)
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph)
