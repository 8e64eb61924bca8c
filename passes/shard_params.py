"""Rewrite (stage 3): parameters become shards, all-gathered before first use.

Expects the captured joint graph, before partitioning, with ``zerofx_role``/``zerofx_fqn`` on
placeholders. After it, each parameter placeholder holds this rank's flat shard
(``meta['val']`` of shape ``[shard_numel]``) and feeds
``all_gather_into_tensor -> wait_tensor -> slice (if padded) -> view(shape)`` inserted right
before the parameter's first use.

NOTE [Why the gather is tagged for recompute]
The joint graph is split into forward and backward afterwards. Left alone, the partitioner
would save the gathered parameter (or its transpose) for backward, so stage 3 would hold every
full parameter from forward to backward and save nothing. We tag the gather, its wait, and
every node computed from the gathered parameter alone with ``CheckpointPolicy.MUST_RECOMPUTE``;
the min-cut partitioner then saves only the shard and backward gathers again. This is the
approach DeepCompile and SimpleFSDP take on the joint graph.

Writes ``zerofx_comm_fqn`` and ``zerofx_comm_bytes`` on each all-gather. Returns the graph
unchanged below stage 3.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import _compat, meta
from passes.plan import Plan, ZeroStage

aten = torch.ops.aten


def shard_params_pass(gm: fx.GraphModule, plan: Plan, *, group_name: str) -> fx.GraphModule:
    if plan.stage is not ZeroStage.THREE:
        return gm
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    backward = meta.backward_region(graph)  # inserting forward gathers does not change it
    gathers = []
    for ph in meta.placeholders(graph, meta.Role.PARAM):
        if meta.COMM_FQN in ph.meta or not ph.users:  # already sharded, or unused
            continue
        p = plan.param(ph.meta[meta.FQN])
        full_val = ph.meta["val"]
        with full_val.fake_mode:
            ph.meta["val"] = torch.empty(p.shard_numel, dtype=full_val.dtype, device=full_val.device)
        ph.meta[meta.COMM_FQN] = p.fqn
        users = list(ph.users)
        first_user = min(users, key=position.__getitem__)
        with graph.inserting_before(first_user):
            gathered = meta.add_call(graph, _compat.ALL_GATHER, (ph, plan.world_size, group_name))  # (padded,)
            gathered.meta[meta.COMM_FQN] = p.fqn
            gathered.meta[meta.COMM_BYTES] = p.shard_numel * p.itemsize
            flat = meta.add_call(graph, _compat.WAIT, (gathered,))
            if p.padded_numel != p.numel:
                flat = meta.add_call(graph, aten.slice.Tensor, (flat, 0, 0, p.numel))  # (numel,)
            full = meta.add_call(graph, aten.view.default, (flat, list(p.shape)))  # p.shape
        for user in users:
            user.replace_input_with(ph, full)
        gathers.append(gathered)
    if not gathers:
        return gm
    for chain in meta.derived_only_from(graph, gathers, backward).values():
        for node in chain:
            node.meta["recompute"] = _compat.CheckpointPolicy.MUST_RECOMPUTE
    graph.lint()
    gm.recompile()
    return gm

