"""Graph builder (stage 1): once per optimizer step, reduce-scatter the accumulated gradients.

NOTE [Stages 1 and 2 move 2 Psi]
Data parallelism moves 2 Psi bytes per rank and step (an all-reduce is a reduce-scatter and an
all-gather), and so do ZeRO stages 1 and 2: gradients are reduce-scattered, each rank updates its
shard, and the updated shards are all-gathered (``param_sync``). Stage 2 reduce-scatters each
bucket in backward, as it is produced, and keeps only shards of the gradients. Stage 1 keeps a
full local gradient buffer (4 bytes per parameter in fp32, as the memory model counts): backward
adds its micro-batch's gradients there without communicating, and this graph reduce-scatters the
buffer once, at the gradient-accumulation boundary, before the optimizer. So stage 1
communicates once per optimizer step whatever the accumulation, which is its reason to exist
beside stage 2 (which communicates once per micro-batch); with one micro-batch per step both move
the same bytes. ``plan_sharding`` predicts these collectives in graph ``grad_sync``.

Placeholders: the engine's full padded flat gradient ``[padded_numel]`` of each trainable
parameter, in ``plan.reduce_buckets`` order, then, in the same order, this rank's shard of each
(``[shard_numel]``, a view into the same buffer). For each bucket the graph builds the message
as backward does at stage 2 (``add_bucket_reduce_scatter``: reduce-scatter over the shard group,
all-reduce across shard groups when there are several, divide by the world size) and copies the
mean shards into the shard views (``aten.copy_``, in place) after the waits; the collective's
input was read by then. Outputs: the shard views. Returns None below or above stage 1.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes import _compat, meta
from zerofx.passes.plan import Plan, ZeroStage
from zerofx.passes.zero.reduce_grads import add_bucket_reduce_scatter

aten = torch.ops.aten


def build_grad_sync(plan: Plan, *, group_name: str, replicate_group_name: str | None = None) -> fx.GraphModule | None:
    if plan.stage is not ZeroStage.ONE or not plan.reduce_buckets:
        return None
    graph = fx.Graph()
    fake_mode = _compat.FakeTensorMode()
    params = {f: plan.param(f) for bucket in plan.reduce_buckets for f in bucket}
    fulls, shards = {}, {}
    for i, p in enumerate(params.values()):
        fulls[p.fqn] = full = graph.placeholder(f"grad_{i}")
        with fake_mode:
            full.meta["val"] = torch.empty(p.padded_numel, dtype=p.torch_dtype)
        full.meta[meta.FQN] = p.fqn
    for i, p in enumerate(params.values()):
        shards[p.fqn] = shard = graph.placeholder(f"grad_shard_{i}")
        with fake_mode:
            shard.meta["val"] = torch.empty(p.shard_numel, dtype=p.torch_dtype)
        shard.meta[meta.FQN] = p.fqn
    outputs: list[fx.Node] = []
    for bucket in plan.reduce_buckets:
        members = [params[f] for f in bucket]
        means = add_bucket_reduce_scatter(graph, [fulls[f] for f in bucket], members, bucket, plan, group_name=group_name,
                                          replicate_group_name=replicate_group_name)
        outputs += [meta.add_call(graph, aten.copy_.default, (shards[f], mean)) for f, mean in zip(bucket, means)]
    graph.output(outputs)
    graph.lint()
    return _compat.make_graph_module(torch.nn.Module(), graph)
