"""Rewrite (stage 3): parameters become shards, all-gathered by bucket before first use.

Expects the captured joint graph, before partitioning, with ``zerofx_role``/``zerofx_fqn`` on
placeholders. After it, each parameter placeholder holds this rank's flat shard
(``meta['val']`` of shape ``[shard_numel]``). For each bucket of ``plan.gather_buckets``,
right before the first use of any member: ``cat(shards) -> all_gather_into_tensor ->
wait_tensor -> unpack -> slice (if padded) -> view(shape)`` (see NOTE [Bucket layout] in
``bucket_ops``).

NOTE [Why the gather is tagged for recompute]
The joint graph is split into forward and backward afterwards. Left alone, the partitioner
would save the gathered parameter (or its transpose) for backward, so stage 3 would hold every
full parameter from forward to backward and save nothing. We tag the pack, the gather, its
wait, and every node computed from the gathered bucket alone with
``CheckpointPolicy.MUST_RECOMPUTE``; the min-cut partitioner then saves only the shards and
backward gathers again. This is the approach DeepCompile and SimpleFSDP take on the joint graph.

Writes ``zerofx_comm_fqns`` and ``zerofx_comm_bytes`` on each all-gather. Returns the graph
unchanged below stage 3, and when every bucket is already sharded.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes import _compat, meta
from zerofx.passes.zero import bucket_ops
from zerofx.passes.plan import Plan, ZeroStage

aten = torch.ops.aten


def shard_params_pass(gm: fx.GraphModule, plan: Plan, *, group_name: str) -> fx.GraphModule:
    if plan.stage is not ZeroStage.THREE:
        return gm
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    backward = meta.backward_region(graph)  # inserting forward gathers does not change it
    ph_of = {ph.meta[meta.FQN]: ph for ph in meta.placeholders(graph, meta.Role.PARAM)}
    gathers, packs = [], []
    for bucket in plan.gather_buckets:
        phs = [ph_of[f] for f in bucket]
        if any(meta.COMM_FQNS in ph.meta for ph in phs):  # already sharded
            continue
        params = [plan.param(f) for f in bucket]
        users = {ph: list(ph.users) for ph in phs}
        for ph, p in zip(phs, params):
            full_val = ph.meta["val"]
            with full_val.fake_mode:
                ph.meta["val"] = torch.empty(p.shard_numel, dtype=full_val.dtype, device=full_val.device)
            ph.meta[meta.COMM_FQNS] = bucket
        first_user = min((u for us in users.values() for u in us), key=position.__getitem__)
        with graph.inserting_before(first_user):
            message, added = bucket_ops.pack(graph, phs)  # (S,)
            packs += added
            k = plan.shard_group_size  # gathered within the shard group (NOTE [Shard groups of consecutive ranks])
            gathered = meta.add_call(graph, _compat.ALL_GATHER, (message, k, group_name))  # (K * S,)
            gathered.meta[meta.COMM_FQNS] = bucket
            gathered.meta[meta.COMM_BYTES] = sum(p.shard_numel * p.itemsize for p in params)
            waited = meta.add_call(graph, _compat.WAIT, (gathered,))
            flats = bucket_ops.unpack_gathered(graph, waited, [p.shard_numel for p in params], k)
            for ph, p, flat in zip(phs, params, flats):
                if p.padded_numel != p.numel:
                    flat = meta.add_call(graph, aten.slice.Tensor, (flat, 0, 0, p.numel))  # (numel,)
                full = meta.add_call(graph, aten.view.default, (flat, list(p.shape)))  # p.shape
                for user in users[ph]:
                    user.replace_input_with(ph, full)
        gathers.append(gathered)
    if not gathers:
        return gm
    to_recompute = list(packs)
    for chain in meta.derived_only_from(graph, gathers, backward).values():
        to_recompute += chain
    for node in to_recompute:
        node.meta["recompute"] = _compat.CheckpointPolicy.MUST_RECOMPUTE
    graph.lint()
    gm.recompile()
    return gm
