"""Rewrite: attention written out as matmuls and softmax becomes one ``scaled_dot_product_attention``.

Expects the pre-autograd ATen forward that ``make_fx(..., pre_dispatch=True)`` records
(``aten.matmul`` and ``aten.softmax`` still whole), with ``meta['val']`` on every node. Runs
before ``plan_sequence_parallel`` and ``plan_tiling`` (zerofx/compiler/pipeline.py) and returns a new GraphModule, so the
sequence-parallel analysis, its attention mixer, the rewrite and tiling see one form of attention. Postconditions: each
written-out attention is first rewritten into the one form ``softmax(matmul(q, kᵀ) · c + mask) @ v``
over 4-d q, k and v; each one SDPA can replace is one ``aten.scaled_dot_product_attention.default``
node with that scale and additive mask (a 3-d mask unsqueezed to 4-d), ``meta['val']`` of the
same shape and dtype as the output it replaces; the matmuls, scale, mask add, softmax, casts and
zero dropout it replaces are gone. A graph with no written-out attention, or run a second time,
is returned unchanged. Reads and writes no ``zerofx_`` meta keys.

NOTE [Attention written out is SDPA]
Hugging Face models in eager attention (``attn_implementation="eager"``), ``nn.MultiheadAttention``
with ``need_weights=True`` and hand-written models compute attention as
``softmax(q @ kᵀ · scale + mask) @ v`` in many spellings. All of them are the one form
``scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)`` computes, which the
sequence-parallel mixers shard by Ulysses or ring, so each is first canonicalized
(``written_attention`` finds it, ``_canonicalize`` rewrites it) and then one form is matched
and replaced:

- scalars move to one factor on the scores: a multiply or divide by a Python number on q or k
  before the product (``(q · c) @ kᵀ``), on the scores, before or after the mask, and
  ``baddbmm``'s alpha (its beta scales its mask). A scale after the mask scales the mask too:
  ``(s + m) · c = s · c + m · c``. A cast of the scores before the softmax (``.float()``) is
  dropped: SDPA computes the scores in q's dtype.
- masks become one additive float mask: masks added one after another are summed; a boolean
  mask filled into the scores (``masked_fill(b, v)``, ``where(b, s, v)``, v a number or a 0-d
  tensor) becomes ``masked_fill(zeros_like(b), b, v)`` (or that mask so filled). With v = -inf
  this is exact. With the dtype's lowest value, ``s + v`` rounds to v for any score far below
  1e31 in fp32, so the probabilities are the same, a row masked everywhere included (uniform).
- 3-d attention over (N, T, d) (``bmm``, ``baddbmm(mask, q, kᵀ)``, a 3-d ``matmul``) is the 4-d
  one over (1, N, T, d): each of its N independent rows (batch times heads) is one head, so
  Ulysses shards the N rows as heads and ring passes them as they are. The output is squeezed
  back to (N, T, d).

A cast of the probabilities and a dropout of probability 0 stay between the softmax and ``@ v``.
The match is a walk over single-user chains from each product of q and ``transpose(k, -2, -1)``
rather than torch's ``subgraph_rewriter`` or Inductor's pattern matcher: both match one literal
spelling per registered pattern (each combination of scale op, scale position, mask, fill, rank,
cast and dropout would be its own pattern), and Inductor's are traced after decomposition
(``bmm``, ``expand``), not on the pre-dispatch graph (``aten.matmul`` whole) that sequence
parallelism reads. ``seq_regions.match_softmax_attention`` then matches the one form, as it
does for tiling. Attention with dropout of nonzero probability, a scale by a tensor, or q, k and
v of another rank is left as it is, and sequence parallelism refuses it by op and module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from zerofx.passes import _compat, meta
from zerofx.passes.sequence.seq_regions import AttentionMatch, match_softmax_attention, op_packet

aten = torch.ops.aten

_PRODUCTS = (aten.matmul, aten.bmm)
_POST = (aten.to, aten._to_copy, aten.dropout)


def _val(node: object) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _rank(node: object) -> int | None:
    v = _val(node)
    return None if v is None else v.dim()


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fill(x: object) -> bool:
    """A fill value: a Python number or a 0-d tensor (``torch.full([], finfo.min)``)."""
    return _number(x) or (_rank(x) == 0)


def _bool(x: object) -> bool:
    v = _val(x)
    return v is not None and v.dtype == torch.bool


# Ops without side effects that a dropped value passes through.
_PURE = {aten.view, aten.reshape, aten._unsafe_view, aten.mean, aten.sum, aten.transpose, aten.permute, aten.to,
         aten._to_copy, aten.squeeze, aten.unsqueeze, aten.clone, aten.contiguous, aten.detach, aten.alias}


def _dead(node: fx.Node) -> bool:
    """Whether ``node`` computes a value nothing reads, without side effects: the attention
    weights ``nn.MultiheadAttention(need_weights=True)`` averages over the heads for a caller that drops them."""
    return op_packet(node) in _PURE and all(_dead(u) for u in node.users)


def _live_user(node: fx.Node) -> fx.Node | None:
    """The one user of ``node`` that is not dead, or None."""
    live = [u for u in node.users if not _dead(u)]
    return live[0] if len(live) == 1 else None


def _erase(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` once nothing but dead values reads it, those first."""
    if all(_dead(u) for u in node.users):
        for user in list(node.users):
            _erase(graph, user)
        graph.erase_node(node)


def _strip(node: fx.Node) -> tuple[fx.Node, float, list[fx.Node]]:
    """``node`` under multiplies and divides by nonzero Python numbers, each read only by the next
    op: (the value under them, their factor, the scalar nodes from the outermost)."""
    factor, scalars = 1.0, []
    while (op_packet(node) in (aten.mul, aten.div) and len(node.users) == 1 and isinstance(node.args[0], fx.Node)
           and _number(node.args[1]) and node.args[1] != 0):
        c = node.args[1]
        factor *= float(c) if op_packet(node) is aten.mul else 1.0 / c
        scalars.append(node)
        node = node.args[0]
    return node, factor, scalars


def _transposed(kt: object, rank: int) -> fx.Node | None:
    """k of ``kt = transpose(k, -2, -1)`` (either order, any spelling of the dims) of rank ``rank``."""
    if not isinstance(kt, fx.Node) or op_packet(kt) is not aten.transpose or _rank(kt) != rank:
        return None
    return kt.args[0] if {kt.args[1] % rank, kt.args[2] % rank} == {rank - 2, rank - 1} else None


def _step(node: fx.Node, cur: fx.Node) -> bool:
    """Whether ``node`` is one step from the scores to the softmax: a scale by a number, an
    additive float mask, or a fill where a boolean mask says (``masked_fill``, ``where``)."""
    pk, args = op_packet(node), node.args
    if pk in (aten.mul, aten.div):
        return args[0] is cur and _number(args[1]) and args[1] != 0
    if pk is aten.add:
        other = args[1] if args[0] is cur else args[0]
        v = _val(other)
        return (cur in args[:2] and other is not cur and len(args) == 2 and not node.kwargs and v is not None
                and v.is_floating_point())
    if pk in (aten.to, aten._to_copy):  # a cast of the scores (``.float()`` before the softmax): SDPA's own precision
        v = _val(node)
        return args[0] is cur and v is not None and v.is_floating_point()
    if pk is aten.masked_fill:
        return args[0] is cur and _bool(args[1]) and _fill(args[2])
    if pk is aten.where and len(args) == 3:
        return _bool(args[0]) and (args[1] is cur) != (args[2] is cur) and _fill(args[2] if args[1] is cur else args[1])
    return False


@dataclass(frozen=True)
class WrittenAttention:
    """An attention as the model wrote it, from the scores to the output (NOTE [Attention written out is SDPA])."""

    scores: fx.Node  # matmul or bmm of (q, kᵀ), or baddbmm(mask, q, kᵀ)
    rank: int  # 4: (batch, heads, sequence, head_dim); 3: (batch·heads, sequence, head_dim)
    q: fx.Node  # under its scalars
    k: fx.Node  # under its scalars, before the transpose
    factor: float  # the scalars' on q and k
    scalars: tuple[fx.Node, ...]  # on q, then on k, each from the outermost
    steps: tuple[fx.Node, ...]  # between the scores and the softmax
    softmax: fx.Node
    post: tuple[fx.Node, ...]  # casts and dropouts of probability 0 between the softmax and the output
    output: fx.Node  # matmul or bmm of (probabilities, v)

    @property
    def canonical(self) -> bool:
        """``softmax(matmul(q, kᵀ) [* c] [+ mask]) @ v`` over 4-d q, k and v: the form SDPA replaces."""
        kinds = [op_packet(n) for n in self.steps]
        return (self.rank == 4 and op_packet(self.scores) is aten.matmul and not self.scalars
                and kinds in ([], [aten.mul], [aten.add], [aten.mul, aten.add]))


def written_attention(scores: fx.Node) -> WrittenAttention | None:
    """The attention whose scores ``scores`` computes, or None where it is not one."""
    pk = op_packet(scores)
    if pk is aten.baddbmm:  # beta · mask + alpha · (q @ kᵀ)
        if (len(scores.args) != 3 or not all(_number(scores.kwargs.get(w, 1)) for w in ("beta", "alpha"))
                or scores.kwargs.get("alpha", 1) == 0 or not isinstance(scores.args[0], fx.Node)
                or (v := _val(scores.args[0])) is None or not v.is_floating_point()):
            return None
        q, kt = scores.args[1:]
    elif pk in _PRODUCTS:
        q, kt = scores.args[:2]
    else:
        return None
    rank = _rank(scores)
    k = _transposed(kt, rank) if rank in (3, 4) else None
    if k is None or len(kt.users) != 1 or _rank(q) != rank:
        return None
    q, fq, q_scalars = _strip(q)
    k, fk, k_scalars = _strip(k)
    steps, cur = [], scores
    while len(cur.users) == 1 and _step(nxt := next(iter(cur.users)), cur):
        steps.append(nxt)
        cur = nxt
    sm = next(iter(cur.users)) if len(cur.users) == 1 else None
    if sm is None or op_packet(sm) is not aten.softmax or sm.args[0] is not cur or sm.args[1] % rank != rank - 1 \
            or _rank(sm) != rank:
        return None
    post, cur = [], sm
    while (nxt := _live_user(cur)) is not None and op_packet(nxt) in _POST and nxt.args[0] is cur:
        if op_packet(nxt) is aten.dropout and nxt.args[1] != 0 and nxt.args[2]:
            return None
        post.append(nxt)
        cur = nxt
    out = _live_user(cur)
    if out is None or op_packet(out) not in _PRODUCTS or out.args[0] is not cur or _rank(out.args[1]) != rank or _rank(out) != rank:
        return None
    alpha = float(scores.kwargs.get("alpha", 1)) if pk is aten.baddbmm else 1.0
    return WrittenAttention(scores, rank, q, k, fq * fk * alpha, (*q_scalars, *k_scalars), tuple(steps), sm, tuple(post), out)


def _call(graph: fx.Graph, target: object, *args: object, **kwargs: object) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` with its fake value, computed in the fake mode of the
    graph's placeholders: constants the model built while traced (a causal mask from ``ones``)
    carry fake values of modes of their own."""
    node = graph.call_function(target, args, kwargs)
    mode = _compat.detect_fake_mode([ph.meta["val"] for ph in meta.placeholders(graph) if "val" in ph.meta])
    assert mode is not None, "canonicalize_attention_pass needs fake values on the placeholders"

    def fake(n: fx.Node) -> object:
        v = n.meta["val"]
        if not isinstance(v, torch.Tensor) or getattr(v, "fake_mode", None) is mode:
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)

    with mode:
        vals = fx.node.map_arg((args, kwargs), fake)
        node.meta["val"] = target(*vals[0], **vals[1])
    return node


def _mask(graph: fx.Graph, w: WrittenAttention) -> tuple[float, fx.Node | None]:
    """The steps as ``scores · c + mask``: (c, the mask's node, new, or None). A scale after the
    mask scales the mask too; a fill where a boolean mask says sets the mask there."""
    factor, mask = w.factor, None
    if op_packet(w.scores) is aten.baddbmm:
        mask, beta = w.scores.args[0], w.scores.kwargs.get("beta", 1)
        mask = mask if beta == 1 else _call(graph, aten.mul.Tensor, mask, beta)
    dtype = _val(w.scores).dtype
    for node in w.steps:
        pk, args = op_packet(node), node.args
        if pk in (aten.to, aten._to_copy):
            continue  # the scores in q's dtype, as SDPA computes them
        if pk in (aten.mul, aten.div):
            factor = factor * args[1] if pk is aten.mul else factor / args[1]
            mask = None if mask is None else _call(graph, node.target, mask, args[1])
        elif pk is aten.add:
            other = args[1] if args[0] in w.steps or args[0] is w.scores else args[0]
            mask = other if mask is None else _call(graph, aten.add.Tensor, mask, other)
        else:  # masked_fill(scores, where, value), or where(cond, scores, value) and where(cond, value, scores)
            cond = args[1] if pk is aten.masked_fill else args[0]
            base = mask if mask is not None else _call(graph, aten.zeros_like.default, cond, dtype=dtype)
            new_args = tuple(base if isinstance(a, fx.Node) and (a in w.steps or a is w.scores) else a for a in args)
            mask = _call(graph, node.target, *new_args, **node.kwargs)
    return factor, mask


def _canonicalize(graph: fx.Graph, w: WrittenAttention) -> None:
    """Rewrite ``w`` into the one form SDPA replaces (NOTE [Attention written out is SDPA])."""
    v = w.output.args[1]
    with graph.inserting_before(w.output):
        factor, mask = _mask(graph, w)
        q, k = w.q, w.k
        if w.rank == 3:  # (N, T, D) as (1, N, T, D): each of the N rows one head
            q, k, v = (_call(graph, aten.unsqueeze.default, x, 0) for x in (q, k, v))
            if mask is not None and _rank(mask) == 3:
                mask = _call(graph, aten.unsqueeze.default, mask, 0)
        x = _call(graph, aten.matmul.default, q, _call(graph, aten.transpose.int, k, -2, -1))
        if factor != 1.0:
            x = _call(graph, aten.mul.Tensor, x, factor)
        if mask is not None:
            x = _call(graph, aten.add.Tensor, x, mask)
        x = _call(graph, w.softmax.target, x, -1, *w.softmax.args[2:], **w.softmax.kwargs)
        for node in w.post:
            x = _call(graph, node.target, x, *node.args[1:], **node.kwargs)
        x = _call(graph, aten.matmul.default, x, v)
        if w.rank == 3:
            x = _call(graph, aten.squeeze.dim, x, 0)
    w.output.replace_all_uses_with(x)
    kt = w.scores.args[2] if op_packet(w.scores) is aten.baddbmm else w.scores.args[1]
    for node in (w.output, *reversed(w.post), w.softmax, *reversed(w.steps), w.scores, kt, *w.scalars):
        _erase(graph, node)


def _written(graph: fx.Graph) -> list[WrittenAttention]:
    return [w for n in graph.nodes if op_packet(n) in (*_PRODUCTS, aten.baddbmm) if (w := written_attention(n)) is not None]


def _matches(graph: fx.Graph) -> list[AttentionMatch]:
    return [m for n in graph.nodes if op_packet(n) is aten.matmul
            if (m := match_softmax_attention(n)) is not None and m.reason is None]


def canonicalize_attention_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A new forward in which each attention written out is one SDPA node (NOTE [Attention written
    out is SDPA]); ``gm`` itself when it has none, and left alone."""
    if not any(not w.canonical for w in _written(gm.graph)) and not _matches(gm.graph):
        return gm
    gm = meta.clone_graph_module(gm)
    graph = gm.graph
    for w in _written(graph):
        if not w.canonical:
            _canonicalize(graph, w)
    for m in _matches(graph):
        qv, kv, out = (x.meta["val"] for x in (m.q, m.k, m.output))
        if out.dtype != qv.dtype or tuple(out.shape) != (*qv.shape[:-1], m.v.meta["val"].shape[-1]):
            continue  # probabilities cast to another dtype than q's: not SDPA's output
        kwargs: dict = {"scale": m.scale}
        if qv.shape[1] != kv.shape[1]:
            kwargs["enable_gqa"] = True  # fewer key/value heads, broadcast by the matmul
        with graph.inserting_before(m.output):
            mask = m.mask
            if mask is not None and mask.meta["val"].dim() == 3:  # (H, T, T): broadcast as (1, H, T, T), the 4-d form ring attention cuts
                mask = meta.add_call(graph, aten.unsqueeze.default, (mask, 0))
            sdpa = graph.call_function(aten.scaled_dot_product_attention.default, (m.q, m.k, m.v, mask, 0.0, False), kwargs)
        sdpa.meta.update(m.output.meta)  # the same shape and dtype (checked above): its fake value stands
        m.output.replace_all_uses_with(sdpa)
        kt = m.scores.args[1]
        for node in reversed(_chain(m)):
            graph.erase_node(node)
        if not kt.users:
            graph.erase_node(kt)
    graph.lint()
    gm.recompile()
    return gm


def _chain(m: AttentionMatch) -> list[fx.Node]:
    """The nodes from the scores to the output, in graph order: what the SDPA node replaces."""
    assert m.scores is not None
    nodes, cur = [m.scores], m.scores
    while cur is not m.output:
        cur = next(iter(cur.users))
        nodes.append(cur)
    return nodes
