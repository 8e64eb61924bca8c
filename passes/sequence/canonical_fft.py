"""Rewrite: an FFT convolution's normalizations and scalars fold into one factor after it.

Expects the pre-autograd ATen forward that ``make_fx(..., pre_dispatch=True)`` records, with
``meta['val']`` on every node. Runs before ``plan_sequence_parallel`` and ``plan_tiling``
(zerofx/compiler/pipeline.py) and returns a new GraphModule, so the long-conv mixer
(passes/sequence/mixer_conv.py) and tiling's conv spans see one form.
Postcondition: each ``fft_irfft(P, n)`` whose input ``P`` is the product of two ``fft_rfft``
(through scalar multiplies and divides and unsqueezes that keep the FFT's axis last) reads
``rfft(u, n) * rfft(h, n)`` with every ``norm`` unset and no scalar between, each unsqueeze
moved onto the rfft's input (the rfft's ``meta['val']`` recomputed), and the factor those carried multiplies the irfft's first user (the
``[..., :T]`` slice of a causal convolution), or the irfft itself when it has several users. A
graph with no such convolution, or one already in this form, is returned unchanged. Reads and
writes no ``zerofx_`` meta keys.

NOTE [FFT convolutions up to scaling]
An FFT convolution is linear in each spectrum, and each ``norm`` is a constant factor against
the default (``"backward"``): ``rfft`` with ``"forward"`` divides by n and with ``"ortho"`` by
sqrt(n); ``irfft`` with ``"forward"`` skips the 1/n the default applies (a factor n) and with
``"ortho"`` applies 1/sqrt(n) instead (a factor sqrt(n)). So
``irfft(c1 · rfft(u, norm=a) * c2 · rfft(h, norm=b), norm=c) · c3`` is
``irfft(rfft(u) * rfft(h)) · f`` with f the product of the scalars and the norms' factors:
HyenaDNA's reference implementation (``rfft(k, n=2T) / 2T`` with ``irfft(..., norm="forward")``,
f = 1) and any other spelling reach the long-conv mixer as the one form it shards. An FFT along
the last dim commutes with an ``unsqueeze`` before that dim, so ``rfft(k).unsqueeze(0)`` against
the signal's spectrum (HyenaDNA's ``k_f.unsqueeze(1)`` for a 4-d signal) is ``rfft(k.unsqueeze(0))``,
and the filter the mixer exchanges keeps its sequence last. A scalar must be a Python number; a
tensor scale (a learned gain) is left where it is, and the mixer refuses what it cannot read by
op and module.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from zerofx.passes import _compat, meta
from zerofx.passes.sequence.seq_regions import op_packet

aten = torch.ops.aten


def _norm_arg(node: fx.Node) -> str | None:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("norm")


def _norm_factor(node: fx.Node, inverse: bool) -> float | None:
    """The factor of ``node``'s norm against the default; None for a norm FFT does not have."""
    n = node.args[1] if len(node.args) > 1 else node.kwargs.get("n")
    norm = _norm_arg(node)
    if norm in (None, "backward"):
        return 1.0
    if not isinstance(n, int) or norm not in ("forward", "ortho"):
        return None
    if norm == "forward":
        return float(n) if inverse else 1.0 / n
    return math.sqrt(n) if inverse else 1.0 / math.sqrt(n)


def _scalar(node: fx.Node) -> tuple[fx.Node, float] | None:
    """``x · c`` or ``x / c`` by a Python number, read only by the next op: (x, c)."""
    if op_packet(node) not in (aten.mul, aten.div) or len(node.users) != 1 or not isinstance(node.args[0], fx.Node):
        return None
    c = node.args[1]
    if not isinstance(c, (int, float)) or isinstance(c, bool) or c == 0:
        return None
    return node.args[0], float(c) if op_packet(node) is aten.mul else 1.0 / c


def _strip(node: fx.Node) -> tuple[fx.Node, float, list[fx.Node]]:
    """``node`` through scalar multiplies and divides: (the value under them, their product, the scalar nodes)."""
    factor, scalars = 1.0, []
    while (found := _scalar(node)) is not None:
        scalars.append(node)
        node, c = found
        factor *= c
    return node, factor, scalars


def _unsqueezed(node: fx.Node) -> fx.Node | None:
    """x of ``unsqueeze(x, d)`` read only by the next op, with the new dim before the last (the FFT's
    axis stays last): an FFT commutes with it."""
    if op_packet(node) is not aten.unsqueeze or len(node.users) != 1 or not isinstance(node.args[0], fx.Node):
        return None
    rank = node.meta["val"].dim()
    return node.args[0] if node.args[1] % rank < rank - 1 else None


def _spectrum(side: fx.Node) -> tuple[fx.Node, float, list[fx.Node], list[fx.Node]]:
    """``side`` through scalars and unsqueezes: (the value under them, the scalars' factor, the
    scalar nodes, the unsqueezes from the outermost)."""
    factor, scalars, unsqueezes = 1.0, [], []
    while True:
        node, c, more = _strip(side)
        factor, scalars = factor * c, scalars + more
        if (under := _unsqueezed(node)) is None:
            return node, factor, scalars, unsqueezes
        unsqueezes.append(node)
        side = under


def _conv(irfft: fx.Node) -> tuple[fx.Node, list[fx.Node], float, list[fx.Node], list[list[fx.Node]]] | None:
    """(the product, its two rffts, the factor of the scalars and norms, the scalar nodes, the
    unsqueezes between each rfft and the product) of an FFT convolution ending at ``irfft``."""
    product, factor, scalars = _strip(irfft.args[0])
    if op_packet(product) is not aten.mul or len(product.users) != 1 or len(product.args) != 2:
        return None
    rffts, unsqueezes = [], []
    for side in product.args:
        if not isinstance(side, fx.Node):
            return None
        rfft, c, more, views = _spectrum(side)
        if op_packet(rfft) is not aten.fft_rfft or len(rfft.users) != 1 or (f := _norm_factor(rfft, inverse=False)) is None:
            return None
        rffts.append(rfft)
        unsqueezes.append(views)
        factor, scalars = factor * c * f, scalars + more
    inverse = _norm_factor(irfft, inverse=True)
    return None if inverse is None else (product, rffts, factor * inverse, scalars, unsqueezes)


def _unnormed(node: fx.Node) -> None:
    """Drop ``node``'s norm argument: the default."""
    if len(node.args) > 3:
        node.args = (*node.args[:3], None, *node.args[4:])
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "norm"}


def _needs_folding(irfft: fx.Node) -> bool:
    found = _conv(irfft)
    return found is not None and (bool(found[3]) or any(found[4])
                                  or any(_norm_arg(n) not in (None, "backward") for n in (irfft, *found[1])))


def _unsqueeze_first(graph: fx.Graph, rfft: fx.Node, unsqueezes: list[fx.Node]) -> None:
    """``unsqueeze(rfft(x), d)`` as ``rfft(unsqueeze(x, d))``: the unsqueezes, innermost first, on
    the rfft's input, and the rfft's fake value recomputed for the new shape."""
    x = rfft.args[0]
    with graph.inserting_before(rfft):
        for view in reversed(unsqueezes):
            x = meta.add_call(graph, aten.unsqueeze.default, (x, view.args[1]))
    rfft.args = (x, *rfft.args[1:])
    with _compat.detect_fake_mode([x.meta["val"]]):
        vals = fx.node.map_arg((rfft.args, rfft.kwargs), lambda n: n.meta["val"])
        rfft.meta["val"] = rfft.target(*vals[0], **vals[1])


def canonicalize_fft_conv_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A new forward with each FFT convolution's scalars and norms folded into one factor after it
    (NOTE [FFT convolutions up to scaling]); ``gm`` itself when none has any, and left alone."""
    if not any(op_packet(n) is aten.fft_irfft and _needs_folding(n) for n in gm.graph.nodes):
        return gm
    gm = meta.clone_graph_module(gm)
    graph = gm.graph
    for irfft in [n for n in graph.nodes if op_packet(n) is aten.fft_irfft and _needs_folding(n)]:
        product, rffts, factor, scalars, unsqueezes = _conv(irfft)
        for rfft, views in zip(rffts, unsqueezes):
            if views:
                _unsqueeze_first(graph, rfft, views)
        product.args = tuple(rffts)
        irfft.args = (product, *irfft.args[1:])
        for node in (irfft, *rffts):
            _unnormed(node)
        spent = [*scalars, *(v for views in unsqueezes for v in views)]
        while spent:  # each once nothing reads it: scalars and unsqueezes may interleave
            node = next(n for n in spent if not n.users)
            graph.erase_node(node)
            spent.remove(node)
        after = next(iter(irfft.users)) if len(irfft.users) == 1 else irfft
        if factor != 1.0:
            with graph.inserting_after(after):
                scaled = graph.call_function(aten.mul.Tensor, (after, factor))
            scaled.meta.update(after.meta)  # a scalar multiple: the same shape and dtype
            after.replace_all_uses_with(scaled, delete_user_cb=lambda user, scaled=scaled: user is not scaled)
    graph.lint()
    gm.recompile()
    return gm
