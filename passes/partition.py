"""Split the rewritten joint graph into a forward and a backward graph.

Expects a joint graph whose outputs are ``[loss, grad per primal]`` (one forward output) and
whose placeholders are ``primals_*`` then ``tangents_1``. Runs ``passes.cse`` on it (in place),
then AOTAutograd's min-cut partitioner, which honours the ``MUST_RECOMPUTE`` tags
``shard_params_pass`` sets.

Postconditions, relied on by the runtime and checked here:
- forward placeholders are the primals, in order; its outputs are ``[loss, *saved]``;
- backward placeholders are the saved values (same order) then the tangent; its outputs are one
  gradient (or None) per primal.
Placeholder metadata (``zerofx_role``/``zerofx_fqn``) is carried over to both graphs.
"""

from __future__ import annotations

import torch.fx as fx

from zerofx.passes import _compat, meta
from zerofx.passes.cse import eliminate_common_subexpressions


def partition_joint(joint: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule]:
    nodes = meta.placeholders(joint.graph)
    primal_vals = [n.meta["val"] for n in nodes if n.meta[meta.ROLE] is not meta.Role.TANGENT]
    tangent_vals = [n.meta["val"] for n in nodes if n.meta[meta.ROLE] is meta.Role.TANGENT]
    eliminate_common_subexpressions(joint)
    # NOTE [Code written on first use] in passes/_compat.py: the partitioner's own modules, and
    # the two it returns, which the graph passes rewrite next.
    with _compat.lazy_graph_modules():
        fw, bw = _compat.min_cut_partition_without_cse(joint, (primal_vals, tangent_vals), num_fwd_outputs=1)
    fw, bw = _compat.lazy_graph_module(fw), _compat.lazy_graph_module(bw)

    joint_meta = {n.name: n.meta for n in nodes}
    for gm in (fw, bw):
        for ph in meta.placeholders(gm.graph):
            src = joint_meta.get(ph.name)
            if src is not None:
                ph.meta[meta.ROLE] = src[meta.ROLE]
                ph.meta[meta.FQN] = src[meta.FQN]
    fw_inputs = [n.name for n in meta.placeholders(fw.graph)]
    assert fw_inputs == [n.name for n in nodes if n.meta[meta.ROLE] is not meta.Role.TANGENT], "forward inputs must be the primals"
    saved = [a.name for a in meta.output_node(fw.graph).args[0][1:]]
    bw_inputs = [n.name for n in meta.placeholders(bw.graph)]
    assert bw_inputs[: len(saved)] == saved and len(bw_inputs) == len(saved) + 1, "backward inputs must be the saved values then the tangent"
    return fw, bw
