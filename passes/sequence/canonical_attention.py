"""Rewrite: attention written out as matmuls and softmax becomes one ``scaled_dot_product_attention``.

Expects the pre-autograd ATen forward that ``make_fx(..., pre_dispatch=True)`` records
(``aten.matmul`` and ``aten.softmax`` still whole), with ``meta['val']`` on every node. Runs
before ``plan_sequence_parallel`` (zerofx/compiler/pipeline.py) and returns a new GraphModule, so the sequence-parallel
analysis, its attention mixer and the rewrite see one form of attention. Postconditions: each
matched attention is one ``aten.scaled_dot_product_attention.default`` node with the matched
scale and additive mask (a 3-d mask unsqueezed to 4-d), ``meta['val']`` of the same shape and dtype as the output it replaces;
the matmuls, scale, mask add, softmax, casts and zero dropout it replaces are gone. A graph with no
written-out attention, or run a second time, is returned unchanged. Reads and writes no
``zerofx_`` meta keys.

NOTE [Attention written out is SDPA]
Hugging Face models in eager attention (``attn_implementation="eager"``), ``nn.MultiheadAttention``
with ``need_weights=True`` and hand-written models compute attention as
``softmax(q @ kᵀ · scale + mask) @ v`` with a few spellings: the scale as a multiply or a divide
by a Python number, applied to the scores or to q before the product (``(q · c) @ kᵀ``), an
additive float mask or position bias (a causal ``where(..., 0, -inf)``, ALiBi, a relative bias),
a cast of the probabilities and a dropout of probability 0. That is exactly
``scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)`` (SDPA adds the mask after
scaling, so a mask added before a scale is not matched), and the sequence-parallel mixers already
shard SDPA by Ulysses or ring. So one pattern, the one ``seq_regions.match_softmax_attention``
finds for tiling too, is folded into SDPA here, and nothing downstream learns a second form. The
match is a walk over single-user chains from each ``matmul(q, transpose(k, -2, -1))`` rather than
torch's ``subgraph_rewriter`` or Inductor's pattern matcher: both match one literal spelling per
registered pattern (each combination of scale op, scale position, mask, cast and dropout would be
its own pattern), and Inductor's are traced after decomposition (``bmm``, ``expand``), not on the
pre-dispatch graph (``aten.matmul`` whole) that sequence parallelism reads. Attention with dropout
of nonzero probability, a boolean mask filled into the scores, or q, k and v other than
(batch, heads, sequence, head_dim) is left as it is, and sequence parallelism refuses it by op and
module as before.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes import meta
from zerofx.passes.sequence.seq_regions import AttentionMatch, match_softmax_attention, op_packet

aten = torch.ops.aten


def _prescaled(q: fx.Node) -> tuple[fx.Node, float] | None:
    """``q · c`` or ``q / c`` by a Python number, read only by the scores: (q, c)."""
    pk = op_packet(q)
    if pk not in (aten.mul, aten.div) or len(q.users) != 1 or not isinstance(q.args[0], fx.Node):
        return None
    c = q.args[1]
    if not isinstance(c, (int, float)) or isinstance(c, bool) or c == 0:
        return None
    return q.args[0], float(c) if pk is aten.mul else 1.0 / c


def _chain(m: AttentionMatch) -> list[fx.Node]:
    """The nodes from the scores to the output, in graph order: what the SDPA node replaces."""
    assert m.scores is not None
    nodes, cur = [m.scores], m.scores
    while cur is not m.output:
        cur = next(iter(cur.users))
        nodes.append(cur)
    return nodes


def _matches(graph: fx.Graph) -> list[AttentionMatch]:
    return [m for n in graph.nodes if op_packet(n) is aten.matmul
            if (m := match_softmax_attention(n)) is not None and m.reason is None]


def canonicalize_attention_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A new forward in which each attention written as ``softmax(q @ kᵀ · scale [+ mask]) @ v`` is one
    SDPA node (NOTE [Attention written out is SDPA]); ``gm`` itself when it has none, and left alone."""
    if not _matches(gm.graph):
        return gm
    gm = meta.clone_graph_module(gm)
    graph = gm.graph
    for m in _matches(graph):
        q, scale = m.q, m.scale
        if (pre := _prescaled(q)) is not None:
            q, scale = pre[0], scale * pre[1]
        qv, kv, out = (x.meta["val"] for x in (q, m.k, m.output))
        if out.dtype != qv.dtype or tuple(out.shape) != (*qv.shape[:-1], m.v.meta["val"].shape[-1]):
            continue  # probabilities cast to another dtype than q's: not SDPA's output
        kwargs: dict = {"scale": scale}
        if qv.shape[1] != kv.shape[1]:
            kwargs["enable_gqa"] = True  # fewer key/value heads, broadcast by the matmul
        with graph.inserting_before(m.output):
            mask = m.mask
            if mask is not None and mask.meta["val"].dim() == 3:  # (H, T, T): broadcast as (1, H, T, T), the 4-d form ring attention cuts
                mask = meta.add_call(graph, aten.unsqueeze.default, (mask, 0))
            sdpa = graph.call_function(aten.scaled_dot_product_attention.default, (q, m.k, m.v, mask, 0.0, False), kwargs)
        sdpa.meta.update(m.output.meta)  # the same shape and dtype (checked above): its fake value stands
        m.output.replace_all_uses_with(sdpa)
        kt = m.scores.args[1]
        for node in reversed(_chain(m)):
            graph.erase_node(node)
        if not kt.users:
            graph.erase_node(kt)
        if pre is not None and not m.q.users:
            graph.erase_node(m.q)
    graph.lint()
    gm.recompile()
    return gm
