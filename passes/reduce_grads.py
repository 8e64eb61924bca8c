"""Rewrite: each parameter gradient is averaged across ranks as backward produces it.

Expects the joint graph (after ``shard_params_pass`` if stage 3), outputs
``[loss, grad per primal]``. For each trainable parameter's gradient ``g``, right after ``g``
is produced it inserts ``reshape(-1) -> pad to padded_numel ->`` a collective ``-> wait ->
div(world_size)``, and the graph outputs the result instead of ``g``:

- stages 0 and 1: ``all_reduce(sum)``, output the full padded flat gradient ``[padded_numel]``;
- stages 2 and 3: ``reduce_scatter_tensor(sum)``, output this rank's shard ``[shard_numel]``.

Sum then divide (rather than ``avg``) because gloo has no AVG reduction, and it matches data
parallel's mean of per-rank gradients. Writes ``zerofx_comm_fqn``/``zerofx_comm_bytes`` on each
collective. Running it twice changes nothing: outputs that already come from a collective's
wait are skipped.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import _compat, meta
from passes.plan import Plan, ZeroStage

aten = torch.ops.aten


def reduce_grads_pass(gm: fx.GraphModule, plan: Plan, *, group_name: str) -> fx.GraphModule:
    graph = gm.graph
    out = meta.output_node(graph)
    outputs = list(out.args[0])
    primals = [n for n in meta.placeholders(graph) if n.meta[meta.ROLE] is not meta.Role.TANGENT]
    changed = False
    for i, (ph, grad) in enumerate(zip(primals, outputs[1:]), start=1):
        if grad is None or ph.meta[meta.ROLE] is not meta.Role.PARAM or grad.meta.get(meta.COMM_FQN):
            continue
        p = plan.param(ph.meta[meta.FQN])
        with graph.inserting_before(grad.next):
            flat = meta.add_call(graph, aten.reshape.default, (grad, [-1]))  # (numel,)
            if p.padded_numel != p.numel:
                flat = meta.add_call(graph, aten.constant_pad_nd.default, (flat, [0, p.padded_numel - p.numel]))
            if plan.stage >= ZeroStage.TWO:
                comm = meta.add_call(graph, _compat.REDUCE_SCATTER, (flat, "sum", plan.world_size, group_name))  # (shard,)
            else:
                comm = meta.add_call(graph, _compat.ALL_REDUCE, (flat, "sum", group_name))  # (padded,)
            comm.meta[meta.COMM_FQN] = p.fqn
            comm.meta[meta.COMM_BYTES] = p.padded_numel * p.itemsize
            waited = meta.add_call(graph, _compat.WAIT, (comm,))
            mean = meta.add_call(graph, aten.div.Tensor, (waited, plan.world_size))
            mean.meta[meta.COMM_FQN] = p.fqn
        outputs[i] = mean
        changed = True
    if not changed:
        return gm
    out.args = (outputs,)
    graph.lint()
    gm.recompile()
    return gm
