"""A flip along the sequence as a sequence mixer (NOTE [Sequence mixers] in
passes/sequence/sequence_mixers.py): ``aten.flip`` of a sequence-sharded value, as BiMamba's reverse scan
reads its input (zerofx/models/mamba.py). Expects the pre-autograd forward of NOTE [Sequence
parallelism as a rewrite]; reads and writes no node meta.

NOTE [Flip along the sequence]
With contiguous slices, rank r's slice of flip(x) along the sequence is flip(rank S - 1 - r's
slice). Each rank flips its own slice, then two all-to-alls with equal chunks move it to rank
S - 1 - r, with no send that depends on the rank (every rank's graph is the same code):
1. the flipped slice, flattened (and padded with zeros to a multiple of S), is cut into S
   pieces and piece k goes to rank k: rank k then holds piece k of every rank's slice, chunk j
   of what arrived being rank j's;
2. rank k sends chunk S - 1 - d of what it holds to rank d (the arrived chunks in reverse
   order): rank d receives from every rank k piece k of rank S - 1 - d's flipped slice, which
   put back in order and unflattened is its slice of flip(x).
Each all-to-all sends (S - 1)/S of the slice per rank, so per rank and direction about twice the
slice in all (``flip_exchange_bytes`` in cost_models/sequence.py); both are autograd's, so the
backward is the same exchange of the gradients. A flip of a sharded value that leaves the
sequence axis alone is a flip of the local slice, and a flip of a whole value (a filter's taps)
is not the mixer's: it runs as it is. The exchange assumes rank r holds the r-th contiguous
slice, so the mixer does not run on the zigzag layout (NOTE [Zigzag layout for causal rings]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from zerofx.common.units import format_bytes
from zerofx.cost_models.sequence import FlipDims, flip_exchange_bytes
from zerofx.passes.plan.sequence import FLIP_KEY
from zerofx.passes.sequence.seq_regions import op_packet
from zerofx.passes.sequence.sequence_mixers import MixerCheck, MixerRewrite, all_to_all

aten = torch.ops.aten


@dataclass(frozen=True)
class FlipSite(FlipDims):
    """One flip of a sequence-sharded value: whether it reverses the sequence axis."""

    along_sequence: bool


def _dims(node: fx.Node, rank: int) -> list[int]:
    return [d % rank for d in node.args[1]]


class FlipMixer:
    """``aten.flip`` of a sequence-sharded value; its sites are ``FlipSite``."""

    name = FLIP_KEY.name
    strategies = FLIP_KEY.strategies
    supports = "flip along the sequence"
    runs_zigzag = False
    doc = FLIP_KEY.doc

    def matches(self, node: fx.Node) -> bool:
        return node.op == "call_function" and op_packet(node) is aten.flip

    def check(self, node: fx.Node, ctx: MixerCheck) -> FlipSite | None:
        x = node.args[0]
        if x not in ctx.local:
            return None  # a whole value (a filter's taps): it runs as it is
        xv = x.meta["val"]
        return FlipSite(numel=xv.numel(), itemsize=xv.element_size(),
                        along_sequence=ctx.analysis.sdim[x] in _dims(node, xv.dim()))

    def exchange_bytes(self, site: FlipSite, strategy: str, size: int) -> float:
        return flip_exchange_bytes(site, size) if site.along_sequence else 0.0

    def choose(self, sites: Sequence[FlipSite], size: int) -> tuple[str, str]:
        return self.strategies[0], "sequence parallelism: all_to_all chosen for the flips (the one strategy)"

    def accept(self, sites: Sequence[FlipSite], strategy: str, size: int) -> None:
        pass  # every flip ``check`` accepts runs

    def describe(self, sites: Sequence[FlipSite], strategy: str, size: int, seq_len: int) -> str:
        along = [s for s in sites if s.along_sequence]
        sent = sum(self.exchange_bytes(s, strategy, size) for s in along)
        return (f"{len(along)} flip(s) along the sequence, each two all-to-alls moving rank r's flipped slice to rank S - 1 - r: "
                f"{format_bytes(sent)} sent per rank and step in all (NOTE [Flip along the sequence] in passes/sequence/mixer_flip.py)")

    def zigzag_balances(self, graph: fx.Graph, strategy: str) -> bool:
        return False

    def rewrite(self, node: fx.Node, args: tuple, kwargs: dict, ctx: MixerRewrite) -> torch.Tensor:
        x, dims = args[0], args[1]
        whole = node.args[0].meta["val"]
        y = torch.flip(x, dims)
        # The sequence axis: the one dim where the local slice (T/S) and the whole value (T) differ.
        if not any(x.shape[d % x.dim()] != whole.shape[d % x.dim()] for d in dims):
            return y  # the sequence axis is not reversed: a local flip
        size, n = ctx.size, y.numel()
        flat = F.pad(y.reshape(-1), (0, -n % size))  # (S · P,)
        held = all_to_all(flat.reshape(size, -1), size, ctx.group_name, grad=True)  # (S, P): piece k of rank j's slice
        got = all_to_all(held.flip(0).contiguous(), size, ctx.group_name, grad=True)  # (S, P): piece k of rank S-1-r's
        return got.reshape(-1)[:n].reshape(y.shape)

    def op_exchanges(self, node: fx.Node) -> tuple[tuple[str, int], ...]:
        return ()  # the exchanges are all-to-alls in the graph


FLIP = FlipMixer()
