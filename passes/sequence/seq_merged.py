"""Analysis (reads only): the sequence axis through views that merge it with other axes.

Used by ``seq_regions.analyze(..., merged=True)``, which sequence parallelism asks for; tiling
does not (it chunks a region along a dimension of exactly ``seq_len`` positions). Expects the
pre-autograd ATen forward with ``meta['val']`` on every node; changes nothing.

NOTE [The sequence axis merged with the batch]
Real models flatten the batch and the sequence into one axis around token-wise work: GPT-2's
``Conv1D`` is ``addmm`` over ``x.view(-1, C)``, (B·T, C); ``nn.MultiheadAttention`` runs its
output projection over ``(T·B, C)`` and splits the features with ``unflatten``. A row of such a
tensor is still one (batch, position) pair, so the ops over it stay token-wise. A dimension of
size ``o · T · f`` holds the sequence with ``o`` elements of the axes merged outside it and
``f`` inside (``SeqAnalysis.outer`` keeps ``o``; ``f`` follows from the size). A view keeps the
axis when, in row-major order, the ``O`` elements before it and the ``I`` after it are split at
one output dimension j: ``prod(out[:j])`` divides O, ``prod(out[j+1:])`` divides I, and
``out[j] = O / prod(out[:j]) · T · I / prod(out[j+1:])``. On a rank's slice the same dimension has
``o · T/S · f`` elements, so the rewrite divides the view's size there by S (an inferred -1
stays). An op that reads along such a dimension (a slice, an expand, a mixer, a loss over it) is
not token-wise, as before; a mixer whose input is merged is refused by sequence parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.fx as fx

aten = torch.ops.aten

_MERGING_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten}
Rule = Callable[[fx.Node, dict[fx.Node, int | None], int], int | None]


def _val(node: object) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _packet(node: fx.Node) -> object | None:
    return getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None


def _view_sdim(node: fx.Node, s: int, outer: dict[fx.Node, int], t: int) -> int | None:
    """The output dim that holds the whole sequence axis of ``node``'s input (NOTE [The sequence axis merged with the batch])."""
    x, out = node.args[0], _val(node)
    xv = _val(x)
    if xv is None or out is None or 0 in xv.shape:
        return None
    shape_in, shape_out = list(xv.shape), list(out.shape)
    o_in = outer.get(x, 1)
    before = math.prod(shape_in[:s]) * o_in  # O: elements merged outside the axis
    after = shape_in[s] // (o_in * t) * math.prod(shape_in[s + 1:])  # I: inside it
    for j in range(len(shape_out)):
        lead, rest = math.prod(shape_out[:j]), math.prod(shape_out[j + 1:])
        if before % lead == 0 and after % rest == 0 and shape_out[j] == before // lead * t * (after // rest):
            if before // lead != 1:
                outer[node] = before // lead
            return j
    return None


def merged_tokenwise_sdim(node: fx.Node, sd: dict[fx.Node, int | None], outer: dict[fx.Node, int], t: int,
                          rule: Rule) -> int | None:
    """``node``'s sequence dim where the axis may be merged with others, else None; ``rule`` is
    the token-wise rule of ``seq_regions`` for the ops this module does not know. Records
    ``outer`` for a merged output."""
    pk, args = _packet(node), node.args
    value = node.meta.get("val")
    out = value[0] if isinstance(value, (list, tuple)) and value else value  # a split's pieces share the merged dim
    if not isinstance(out, torch.Tensor):
        return None
    x = args[0] if args else None
    s = sd.get(x) if isinstance(x, fx.Node) else None
    if pk in _MERGING_VIEWS:
        return None if s is None else _view_sdim(node, s, outer, t)
    if pk is aten.addmm:  # bias + x @ w over rows: (N, C) -> (N, C'), GPT-2's Conv1D
        bias, rows, w = args[:3]
        if sd.get(bias) is not None or sd.get(w) is not None or sd.get(rows) != 0:
            return None
        s, x = 0, rows
    elif pk is aten.repeat:  # copies of the whole axis one after another: (r · o) · T · f (position ids per sequence)
        if s is None:
            return None
        reps = list(args[1])
        s_out = s + len(reps) - _val(x).dim()
        if reps[s_out] != 1:
            outer[node] = reps[s_out] * outer.get(x, 1)
        return s_out
    elif pk is aten.repeat_interleave and isinstance(args[1] if len(args) > 1 else None, int):  # each row k times in a row
        dim = args[2] if len(args) > 2 else node.kwargs.get("dim")
        if s is None or dim is None:
            return None
        if dim % _val(x).dim() != s:
            s = rule(node, sd, t)  # along another dim: each position's values repeated (GPT-J's rotary tables)
        else:
            outer[node] = outer.get(x, 1)  # o · T · (f · k): the k copies are inside each position (a token per routed expert)
            return s
    elif pk is aten.unflatten:  # a split of another dimension (the features into heads)
        if s is None:
            return None
        d = args[1] % _val(x).dim()
        if d == s:
            return None
        s = s + len(args[2]) - 1 if d < s else s
    elif pk is aten.squeeze and len(args) > 1:
        if s is None:
            return None
        dims = [d % _val(x).dim() for d in (args[1] if isinstance(args[1], (list, tuple)) else [args[1]])]
        if s in dims:
            return None
        s = s - sum(d < s for d in dims if _val(x).shape[d] == 1)
    else:
        s = rule(node, sd, t)
    if s is None or not any(a in outer for a in node.all_input_nodes):
        return s  # no merged input: the token-wise rule as it is
    # The merged size passes unchanged from an input that carries the axis; a token-wise op never resizes it.
    size = out.shape[s]
    src = next((a for a in [x, *node.all_input_nodes] if isinstance(a, fx.Node) and sd.get(a) is not None
                and _val(a) is not None and _val(a).shape[sd[a]] == size), None)
    if src is None:
        return None
    if src in outer:
        outer[node] = outer[src]
    return s
