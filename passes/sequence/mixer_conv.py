"""Convolutions and running sums along the sequence as sequence mixers (NOTE [Sequence mixers] in
passes/sequence/sequence_mixers.py): a short causal depthwise ``conv1d`` by a halo from the left
neighbour, a long causal convolution by FFT (Hyena's implicit filter, Evo 2's Hyena-LI) by
all-to-alls to channel shards and back, and a ``cumsum`` by the exclusive prefix of the lower
ranks' totals. Their bytes are in cost_models/sequence.py. Reads and writes no node meta, except
the sequence-dim mark on the last op of each output (NOTE [Tiling a sequence-parallel forward] in
zerofx/compiler/pipeline.py).

NOTE [Convolutions along the sequence]
Each mixer here has one strategy, so ``"auto"`` is that strategy. All three exchange with
functional all-to-alls (``all_to_all``), which the schedule sees as collectives, so
``op_exchanges`` is empty; and all three read the rank's place in the group as the r-th
contiguous slice (``runs_zigzag = False``: the layout stays contiguous wherever one is in the plan).
The rank's index is not a graph constant: it is ``positions[0] // (T/S)`` of ``ctx.positions``.

- Short conv (``short_conv``, ``"halo"``): ``conv1d(pad(u, (K-1, 0)), w, groups=C)`` (the bundled
  models' ``causal_depthwise_conv``) or ``conv1d(u, w, padding=K-1, groups=C)[..., :T]``
  (``nn.Conv1d(padding=K-1)`` sliced, as Hugging Face Mamba's PyTorch path writes it). Output t
  reads inputs t-K+1..t, so a rank needs the K-1 positions before its slice: every rank sends its
  last K-1 positions to every rank (one all-to-all of S copies), and keeps the chunk of rank r-1
  (zeros on rank 0, by indexing a zero-padded buffer with r). The pad's rewrite returns
  ``cat(halo, u)``; the conv then runs unpadded on T/S + K - 1 positions and gives the rank's T/S
  outputs; the padded form runs with padding 0, so the slice to T after it is the whole-slice case.
  Autograd through the all-to-all sends the halo's gradient back to its owner. With K - 1 > T/S
  (a long filter written as a direct conv1d) the halo reaches past the neighbour, and every
  rank's whole slice goes to every rank instead (NOTE [A halo longer than a rank's slice]).
  Refused: stride or dilation other than 1, groups other than the channels (depthwise), any
  padding but K - 1 zeros on the left. A 1-tap conv with stride 1
  and no padding (``is_pointwise_conv1d`` in passes/sequence/seq_regions.py) reads each position alone:
  it is token-wise, not this mixer's, and runs on the rank's slice with nothing exchanged.
- Long conv (``long_conv``, ``"channels"``): ``irfft(rfft(u, n=2T) * rfft(h, n=2T), n=2T)[..., :T]``
  (``fft_causal_conv`` in zerofx/models/long_conv.py). The signal (..., C, T/S) and the filter's
  lags (C, T/S) (computed token-wise from ``arange(T)`` cut to the rank's positions, so each rank
  holds its own lags) go by all-to-all to channel shards (..., C/S, T); the FFTs, the product
  and the inverse run on the whole sequence for C/S channels; the first T outputs go back by
  all-to-all to (..., C, T/S). Refused: S not dividing C, FFT lengths other than 2T, a filter not
  computed along the sequence, or a product, inverse or slice other than that chain.
- Cumsum (``cumsum``, ``"prefix"``): the cumsum of the rank's slice, plus the sum of the slice
  totals of the lower ranks (each rank's totals to every rank by one all-to-all), accumulated in
  fp32 for 16-bit floats. A cumsum along another dimension is token-wise and runs as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from zerofx.common.errors import SequenceParallelError
from zerofx.common.units import format_bytes
from zerofx.cost_models.sequence import (HaloDims, LongConvDims, PrefixDims, channels_exchange_bytes, halo_exchange_bytes,
                                         prefix_exchange_bytes)
from zerofx.passes import _compat, meta
from zerofx.passes.plan.sequence import CUMSUM_KEY, LONG_CONV_KEY, SHORT_CONV_KEY
from zerofx.passes.sequence.seq_regions import is_empty_pad, is_pointwise_conv1d, op_packet
from zerofx.passes.sequence.sequence_mixers import MixerCheck, MixerRewrite, all_to_all

aten = torch.ops.aten

_PADS = {aten.pad, aten.constant_pad_nd}
_CONV_ARGS = ("bias", "stride", "padding", "dilation", "groups")  # aten.conv1d's after input and weight


def _arg(node: fx.Node, i: int, name: str, default: object) -> object:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _val(node: object) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _one(x: object) -> int | None:
    """A conv's per-dimension argument (an int or a one-element list) as an int."""
    if isinstance(x, int):
        return x
    if isinstance(x, (list, tuple)) and len(x) == 1 and isinstance(x[0], int):
        return x[0]
    return None


def rank_index(x: torch.Tensor, ctx: MixerRewrite, dim: int = -1) -> torch.Tensor:
    """This rank's index in its group, (1,) int64: its first position over T/S (contiguous layout),
    T/S read from ``x``'s sequence dim ``dim``."""
    return (ctx.positions(x)[:1] // x.shape[dim]).to(torch.int64)


def _marked(fn: Callable[[], torch.Tensor], dim: int) -> torch.Tensor:
    """``fn()``, one op, marked with the sequence dim of its output (every op traced inside is marked)."""
    with _compat.annotate({meta.SEQUENCE_DIM: dim}):  # NOTE [Tiling a sequence-parallel forward] in zerofx/compiler/pipeline.py
        return fn()


def from_all(x: torch.Tensor, ctx: MixerRewrite) -> torch.Tensor:
    """Every rank's ``x``: (S, *x.shape), chunk j rank j's, by one all-to-all of S copies."""
    send = x.unsqueeze(0).expand(ctx.size, *x.shape).contiguous()
    return all_to_all(send, ctx.size, ctx.group_name, grad=True)


def with_halo(x: torch.Tensor, width: int, ctx: MixerRewrite, dim: int = -1) -> torch.Tensor:
    """``x`` (…, T/S, …), sequence at ``dim``, with the ``width`` positions before it: (…, width + T/S, …),
    zeros before the sequence. A halo longer than the slice gathers the sequence (NOTE [A halo
    longer than a rank's slice])."""
    local = x.shape[dim]
    if width == 0:
        return x
    if width > local:
        return torch.cat([_gathered_halo(x, width, ctx, dim % x.dim()), x], dim=dim)
    tail = x.narrow(dim, local - width, width).contiguous()
    got = from_all(tail, ctx)  # (S, …, width, …): chunk j is rank j's tail
    padded = torch.cat([torch.zeros_like(got[:1]), got])  # index r: rank r - 1's tail; index 0: zeros
    halo = padded.index_select(0, rank_index(x, ctx, dim)).squeeze(0)
    return torch.cat([halo, x], dim=dim)


def _gathered_halo(x: torch.Tensor, width: int, ctx: MixerRewrite, dim: int) -> torch.Tensor:
    """The ``width`` positions before ``x``'s slice, ``width`` > T/S, read from the whole sequence.

    NOTE [A halo longer than a rank's slice]
    A causal convolution of K taps with K - 1 > T/S (a long filter written as a direct
    ``conv1d``) reads positions of several earlier ranks, up to every one of them. Every rank's
    whole slice goes to every rank (the all-to-all of S copies ``from_all`` sends, an
    all-gather), the slices in rank order are the sequence, and rank r reads global positions
    r·T/S - width .. r·T/S - 1 of it, zeros before position 0: ``index_select`` at
    r·T/S + arange(width) of the sequence after ``width`` zeros, r read from the positions as
    for the short halo (the rank is not a graph constant). This holds the whole sequence of that
    one activation on every rank, O(T) memory where the short halo holds K - 1 positions, and
    sends S - 1 slices per rank each way; a multi-hop halo (each rank's last positions forwarded
    along the ring, ceil((K - 1) / (T/S)) steps) would hold only K - 1, at as many steps in a
    row. Autograd sends each position's gradient back to its owner through the all-to-all.
    """
    local = x.shape[dim]
    got = from_all(x.contiguous(), ctx)  # (S, …, T/S, …): chunk j is rank j's slice
    whole = got.movedim(0, dim).flatten(dim, dim + 1)  # (…, T, …): contiguous slices in rank order
    zeros = torch.zeros_like(whole.narrow(dim, 0, 1)).expand(*whole.shape[:dim], width, *whole.shape[dim + 1:])
    padded = torch.cat([zeros, whole], dim=dim)  # (…, width + T, …): global position p at p + width
    start = rank_index(x, ctx, dim) * local  # (1,): r·T/S, the slice's first position
    return padded.index_select(dim, start + torch.arange(width, device=x.device))  # (…, width, …)


# --------------------------------------------------------------------------- short conv: halo
def _is_conv1d(node: fx.Node) -> bool:
    return op_packet(node) is aten.conv1d


def _is_causal_pad(node: fx.Node) -> bool:
    """A pad whose only user is a conv1d reading it as its input (what the short-conv mixer owns)."""
    if op_packet(node) not in _PADS or len(node.users) != 1 or is_empty_pad(node):
        return False
    user = next(iter(node.users))
    return _is_conv1d(user) and user.args[0] is node


@dataclass(frozen=True)
class ShortConvSite(HaloDims):
    """One short causal convolution, the halo mixer's site."""

    padded: bool = False  # conv1d(padding=K-1) sliced to T, not pad then conv1d


class ShortConvMixer:
    """A causal ``conv1d`` along the sequence by a halo from the left neighbour (NOTE [Convolutions along the sequence])."""

    name = SHORT_CONV_KEY.name
    strategies = SHORT_CONV_KEY.strategies
    supports = "causal depthwise conv1d with stride and dilation 1 (a pad of K-1 on the left, or padding=K-1 sliced to T)"
    runs_zigzag = False
    doc = SHORT_CONV_KEY.doc

    def matches(self, node: fx.Node) -> bool:
        return (_is_conv1d(node) and not is_pointwise_conv1d(node)) or _is_causal_pad(node)

    def check(self, node: fx.Node, ctx: MixerCheck) -> ShortConvSite | None:
        an, t, size = ctx.analysis, ctx.analysis.seq_len, ctx.size
        if op_packet(node) in _PADS:
            return None  # checked, and counted, with its conv
        x, weight = node.args[0], node.args[1]
        where = f"aten.conv1d in module {ctx.module!r}"
        src = x.args[0] if op_packet(x) in _PADS else x
        if src not in ctx.local and an.sdim.get(src) is None:
            return None  # not along the sharded sequence: runs whole
        xv, wv = _val(src), _val(weight)
        if node.target is not aten.conv1d.default or xv is None or wv is None or xv.dim() != 3 or an.sdim.get(src) != 2:
            raise SequenceParallelError(f"sequence parallelism needs {where} over (batch, channels, sequence) with integer padding")
        if weight in ctx.local:
            raise SequenceParallelError(f"sequence parallelism needs the weight of {where} free of the sequence")
        stride, pad, dilation = (_one(_arg(node, i, n, d)) for i, n, d in ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1)))
        groups, channels, k = _arg(node, 6, "groups", 1), xv.shape[1], wv.shape[-1]
        if stride != 1 or dilation != 1:
            raise SequenceParallelError(f"{where} has stride {stride} and dilation {dilation}; sequence parallelism shards a "
                                        "convolution along the sequence with stride 1 and dilation 1 only")
        if groups != channels or wv.shape[0] != channels:
            raise SequenceParallelError(f"{where} has groups={groups} for {channels} channels ({wv.shape[0]} outputs); sequence "
                                        "parallelism shards depthwise convolutions only (groups = channels = outputs)")
        padded = x is src
        causal = (pad == k - 1 and self._sliced_to(node, t)) if padded else (pad == 0 and self._left_pad(x, k))
        if not causal:
            raise SequenceParallelError(f"{where} is not causal: sequence parallelism shards a conv1d after a pad of K-1 = {k - 1} "
                                        f"zeros on the left of the sequence, or one with padding={k - 1} sliced to the first {t} "
                                        "outputs")
        return ShortConvSite(batch=xv.shape[0], channels=channels, kernel=k, itemsize=xv.element_size(), padded=padded,
                             slice_len=t // size)

    @staticmethod
    def _left_pad(pad: fx.Node, k: int) -> bool:
        """``pad(u, (K-1, 0))`` with zeros on the last dim (the sequence)."""
        widths = list(pad.args[1])
        mode = _arg(pad, 2, "mode", "constant") if op_packet(pad) is aten.pad else "constant"
        value = _arg(pad, 3 if op_packet(pad) is aten.pad else 2, "value", None)
        return widths == [k - 1, 0] and mode == "constant" and value in (None, 0, 0.0)

    @staticmethod
    def _sliced_to(conv: fx.Node, t: int) -> bool:
        """The conv's only user takes its first T outputs along the sequence."""
        if len(conv.users) != 1:
            return False
        user = next(iter(conv.users))
        if op_packet(user) is not aten.slice or user.args[0] is not conv:
            return False
        dim, start, end = (list(user.args[1:4]) + [0, None, None])[:3]
        return dim % 3 == 2 and start in (0, None) and end == t

    def exchange_bytes(self, site: ShortConvSite, strategy: str, size: int) -> float:
        return halo_exchange_bytes(site, size)

    def choose(self, sites: Sequence[ShortConvSite], size: int) -> tuple[str, str]:
        return "halo", "sequence parallelism: halo chosen for the short convolutions (their one strategy)"

    def accept(self, sites: Sequence[ShortConvSite], strategy: str, size: int) -> None:
        pass  # one strategy, and ``check`` refused what it cannot run

    def describe(self, sites: Sequence[ShortConvSite], strategy: str, size: int, seq_len: int) -> str:
        sent = sum(self.exchange_bytes(s, strategy, size) for s in sites)
        taps = sorted({s.kernel for s in sites})
        long = [s for s in sites if s.kernel - 1 > s.slice_len]
        gathered = (f"; {len(long)} of them reach past the left neighbour (K-1 > {long[0].slice_len} positions a rank) and "
                    "gather every rank's slice (the whole sequence of their input on each rank)") if long else ""
        return (f"{len(sites)} short convolution(s) ({'/'.join(map(str, taps))} taps), each a halo all-to-all of the last K-1 "
                f"positions to the right neighbour and its gradient back{gathered}: {format_bytes(sent)} per rank per step")

    def zigzag_balances(self, graph: fx.Graph, strategy: str) -> bool:
        return False

    def rewrite(self, node: fx.Node, args: tuple, kwargs: dict, ctx: MixerRewrite) -> torch.Tensor:
        if op_packet(node) in _PADS:  # pad(u, (K-1, 0)): the left neighbour's last K-1 positions, then u
            return with_halo(args[0], list(node.args[1])[0], ctx)
        x, weight, *rest = args
        if isinstance(node.args[0], fx.Node) and op_packet(node.args[0]) in _PADS:  # its input has the halo already
            return _marked(lambda: node.target(x, weight, *rest, **kwargs), 2)
        named = dict(zip(_CONV_ARGS, rest)) | kwargs
        named["padding"] = [0]  # padding=K-1 becomes the halo
        x = with_halo(x, weight.shape[-1] - 1, ctx)
        return _marked(lambda: node.target(x, weight, **named), 2)

    def op_exchanges(self, node: fx.Node) -> tuple[tuple[str, int], ...]:
        return ()


# --------------------------------------------------------------------------- long conv: channel all-to-all
def _is_fft(node: fx.Node) -> bool:
    return op_packet(node) in (aten.fft_rfft, aten.fft_irfft)


@dataclass(frozen=True)
class LongConvSite(LongConvDims):
    """One FFT convolution, the channel mixer's site."""


class LongConvMixer:
    """``irfft(rfft(u) * rfft(h))[..., :T]`` by all-to-alls to channel shards and back (NOTE [Convolutions along the sequence])."""

    name = LONG_CONV_KEY.name
    strategies = LONG_CONV_KEY.strategies
    supports = "causal FFT convolution (fft_rfft of the signal and the filter with n=2T, their product, fft_irfft, the first T outputs)"
    runs_zigzag = False
    doc = LONG_CONV_KEY.doc

    def matches(self, node: fx.Node) -> bool:
        return _is_fft(node)

    def check(self, node: fx.Node, ctx: MixerCheck) -> LongConvSite | None:
        an, t, size = ctx.analysis, ctx.analysis.seq_len, ctx.size
        op = "fft_rfft" if op_packet(node) is aten.fft_rfft else "fft_irfft"
        where = f"aten.{op} in module {ctx.module!r}"
        x = node.args[0]
        if x not in ctx.local and an.sdim.get(x) is None:
            return None  # not along the sharded sequence: runs whole
        n, dim, norm = _arg(node, 1, "n", None), _arg(node, 2, "dim", -1), _arg(node, 3, "norm", None)
        xv = _val(x)
        if n != 2 * t or norm is not None or xv is None or dim % xv.dim() != xv.dim() - 1:
            raise SequenceParallelError(f"{where} has n={n}, dim={dim}, norm={norm}; sequence parallelism shards an FFT "
                                        f"convolution with n=2T={2 * t} along the last dim, norm unset")
        if op == "fft_rfft":
            if an.sdim.get(x) != xv.dim() - 1:
                raise SequenceParallelError(f"{where}: sequence parallelism needs the signal and the filter with the sequence last "
                                            "(filter lags computed along the sequence from arange positions)")
            self._chain(node, where, t)
            channels = xv.shape[-2] if xv.dim() >= 2 else 1
            if xv.dim() < 2 or channels % size:
                raise SequenceParallelError(f"{where} has {channels} channels, which sequence_parallel.size={size} does not divide, "
                                            "as the channel all-to-all needs")
            return None  # counted with its inverse
        product = x
        ffts = [a for a in product.args if isinstance(a, fx.Node)] if op_packet(product) is aten.mul else []
        if len(ffts) != 2 or not all(op_packet(a) is aten.fft_rfft for a in ffts) or len(product.users) != 1:
            raise SequenceParallelError(f"{where} does not read the product of two fft_rfft; sequence parallelism shards an "
                                        "FFT convolution irfft(rfft(u) * rfft(h))[..., :T]")
        if not all(a in ctx.local for a in ffts):
            raise SequenceParallelError(f"{where}: the filter's FFT reads a filter not computed along the sequence; sequence "
                                        "parallelism needs its lags computed token-wise (from arange positions)")
        if not self._first_t(node, t):
            raise SequenceParallelError(f"{where} is not followed by a slice to its first {t} outputs alone")
        signal = max((_val(a.args[0]) for a in ffts), key=lambda v: v.dim())
        return LongConvSite(batch=math.prod(signal.shape[:-2]), channels=signal.shape[-2], seq_len=t, itemsize=signal.element_size())

    @staticmethod
    def _chain(rfft: fx.Node, where: str, t: int) -> None:
        """The rfft's only user is a product with another rfft, read by an irfft alone."""
        users = list(rfft.users)
        if len(users) != 1 or op_packet(users[0]) is not aten.mul or len(users[0].users) != 1 \
                or op_packet(next(iter(users[0].users))) is not aten.fft_irfft:
            raise SequenceParallelError(f"{where} is not multiplied by another fft_rfft and inverted by fft_irfft alone; sequence "
                                        "parallelism shards an FFT convolution irfft(rfft(u) * rfft(h))[..., :T]")

    @staticmethod
    def _first_t(irfft: fx.Node, t: int) -> bool:
        if len(irfft.users) != 1:
            return False
        user = next(iter(irfft.users))
        if op_packet(user) is not aten.slice:
            return False
        rank = _val(irfft).dim()
        dim, start, end = (list(user.args[1:4]) + [0, None, None])[:3]
        return dim % rank == rank - 1 and start in (0, None) and end == t

    def exchange_bytes(self, site: LongConvSite, strategy: str, size: int) -> float:
        return channels_exchange_bytes(site, size)

    def choose(self, sites: Sequence[LongConvSite], size: int) -> tuple[str, str]:
        return "channels", "sequence parallelism: channels chosen for the FFT convolutions (their one strategy)"

    def accept(self, sites: Sequence[LongConvSite], strategy: str, size: int) -> None:
        pass  # one strategy, and ``check`` refused what it cannot run

    def describe(self, sites: Sequence[LongConvSite], strategy: str, size: int, seq_len: int) -> str:
        sent = sum(self.exchange_bytes(s, strategy, size) for s in sites)
        return (f"{len(sites)} FFT convolution(s), each a channel all-to-all of the signal and of the filter to "
                f"{sites[0].channels // size} of {sites[0].channels} channels over {seq_len} positions and one back: "
                f"{format_bytes(sent)} per rank per step")

    def zigzag_balances(self, graph: fx.Graph, strategy: str) -> bool:
        return False

    def rewrite(self, node: fx.Node, args: tuple, kwargs: dict, ctx: MixerRewrite) -> torch.Tensor:
        x, *rest = args
        if op_packet(node) is aten.fft_rfft:
            return node.target(seq_to_channels(x, ctx), *rest, **kwargs)  # (..., C/S, T + 1)
        t = _arg(node, 1, "n", None) // 2  # n = 2T: ``check``
        y = node.target(x, *rest, **kwargs)[..., :t]  # (..., C/S, T): the causal outputs of this rank's channels
        return channels_to_seq(y, ctx)  # (..., C, T/S), its last op marked with the sequence dim

    def op_exchanges(self, node: fx.Node) -> tuple[tuple[str, int], ...]:
        return ()


def seq_to_channels(x: torch.Tensor, ctx: MixerRewrite) -> torch.Tensor:
    """(..., C, T/S) to (..., C/S, T): chunk j of the channels to rank j."""
    s, lead, (c, tl) = ctx.size, x.shape[:-2], x.shape[-2:]
    y = x.reshape(*lead, s, c // s, tl).movedim(-3, 0).contiguous()  # (S, ..., C/S, T/S): chunk j to rank j
    y = all_to_all(y, s, ctx.group_name, grad=True)  # (S, ..., C/S, T/S): chunk j is rank j's positions
    return y.movedim(0, -2).reshape(*lead, c // s, s * tl)


def channels_to_seq(y: torch.Tensor, ctx: MixerRewrite) -> torch.Tensor:
    """(..., C/S, T) to (..., C, T/S): chunk j of the positions to rank j."""
    s, lead, (cs, t) = ctx.size, y.shape[:-2], y.shape[-2:]
    x = y.reshape(*lead, cs, s, t // s).movedim(-2, 0).contiguous()  # (S, ..., C/S, T/S): chunk j to rank j
    x = all_to_all(x, s, ctx.group_name, grad=True).movedim(0, -3)  # (..., S, C/S, T/S): chunk j is rank j's channels
    return _marked(lambda: x.reshape(*lead, s * cs, t // s), y.dim() - 1)


# --------------------------------------------------------------------------- cumsum: prefix
@dataclass(frozen=True)
class CumsumSite(PrefixDims):
    """One cumsum along the sequence, the prefix mixer's site."""


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class CumsumMixer:
    """``cumsum`` along the sequence by the lower ranks' totals (NOTE [Convolutions along the sequence])."""

    name = CUMSUM_KEY.name
    strategies = CUMSUM_KEY.strategies
    supports = "cumsum along the sequence"
    runs_zigzag = False
    doc = CUMSUM_KEY.doc

    def matches(self, node: fx.Node) -> bool:
        return op_packet(node) is aten.cumsum

    def check(self, node: fx.Node, ctx: MixerCheck) -> CumsumSite | None:
        x, an = node.args[0], ctx.analysis
        xv = _val(x)
        if x not in ctx.local or xv is None or an.sdim.get(x) is None or node.args[1] % xv.dim() != an.sdim[x]:
            # Along another dim (token-wise), or of a value every rank holds whole (position ids
            # from a padding mask): it runs as it is, and a token-wise reader cuts the whole one.
            return None
        dtype = node.kwargs.get("dtype") or (node.args[2] if len(node.args) > 2 else None) or xv.dtype
        itemsize = torch.empty((), dtype=_accumulation(dtype)).element_size()
        return CumsumSite(rows=xv.numel() // an.seq_len, itemsize=itemsize)

    def exchange_bytes(self, site: CumsumSite, strategy: str, size: int) -> float:
        return prefix_exchange_bytes(site, size)

    def choose(self, sites: Sequence[CumsumSite], size: int) -> tuple[str, str]:
        return "prefix", "sequence parallelism: prefix chosen for the cumsums (their one strategy)"

    def accept(self, sites: Sequence[CumsumSite], strategy: str, size: int) -> None:
        pass  # one strategy, and ``check`` refused what it cannot run

    def describe(self, sites: Sequence[CumsumSite], strategy: str, size: int, seq_len: int) -> str:
        sent = sum(self.exchange_bytes(s, strategy, size) for s in sites)
        return (f"{len(sites)} cumsum(s), each an all-to-all of the slice totals, the lower ranks' added: "
                f"{format_bytes(sent)} per rank per step")

    def zigzag_balances(self, graph: fx.Graph, strategy: str) -> bool:
        return False

    def rewrite(self, node: fx.Node, args: tuple, kwargs: dict, ctx: MixerRewrite) -> torch.Tensor:
        x, dim, *rest = args
        whole = node.args[0].meta["val"]
        dim = dim % x.dim()
        if x.shape[dim] == whole.shape[dim]:  # along another dim than the sequence: token-wise
            return node.target(x, dim, *rest, **kwargs)
        dtype = kwargs.get("dtype") or (rest[0] if rest else None) or x.dtype
        acc = _accumulation(dtype)
        local = torch.cumsum(x, dim, dtype=acc)  # this slice's running sums
        totals = from_all(local.select(dim, -1), ctx)  # (S, ...): chunk j is rank j's slice total
        ranks = torch.arange(ctx.size, device=x.device).view(-1, *[1] * (totals.dim() - 1))
        lower = (totals * (ranks < rank_index(x.movedim(dim, -1), ctx)).to(acc)).sum(0)  # the exclusive prefix
        lower = lower.unsqueeze(dim)
        return _marked(lambda: local + lower, dim).to(dtype)

    def op_exchanges(self, node: fx.Node) -> tuple[tuple[str, int], ...]:
        return ()


SHORT_CONV = ShortConvMixer()
LONG_CONV = LongConvMixer()
CUMSUM = CumsumMixer()
