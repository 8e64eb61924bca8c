"""The selective scan as a sequence mixer (NOTE [Sequence mixers] in passes/sequence/sequence_mixers.py):
each ``zerofx::selective_scan`` node (zerofx/models/scan.py, NOTE [The selective scan op]) runs
by state passing. Expects the pre-autograd forward of NOTE [Sequence parallelism as a rewrite];
reads and writes no node meta.

NOTE [Scan by state passing]
The scan is linear in its state: from state h at the start of rank r's slice, the state at the
slice's end is P_r h + h_r, where h_r is the slice scanned from a zero state and
P_r = exp(A · Σ_{t in slice} delta[t]) (B, E, N) the slice's total decay (a product of the
per-step decays exp(delta[t] A), elementwise in (E, N)). So each rank
1. scans its slice from zero: h_r (the op's h_last; its y is not used);
2. sends the pair (h_r, P_r), fp32 at least, to every rank: one ``all_to_all`` of
   (S, 2, B, E, N), every chunk the same pair;
3. folds the pairs of the lower ranks, in rank order, into the state its slice starts from:
   c_0 = h0 (the op's own initial state, whole on every rank), c_{j+1} = P_j c_j + h_j, and
   h_in = c_r, picked by the rank's index (``ctx.positions``: contiguous slices, so
   r = positions[0] / (T/S)); every rank computes all S + 1 of the c_j, the same ops on every
   rank (NOTE [Sequence parallelism as a rewrite]: one graph for all ranks);
4. scans its slice again from h_in: y, this rank's slice of the whole scan's output.
c_S is the whole sequence's final state, which the op's h_last is under sequence parallelism;
it is the same on every rank, a value no token-wise op can read as sharded, so a forward that
uses h_last is refused. The all-to-all is autograd's, so the gradient of h_in reaches the ranks
whose h_j and P_j it came from, and the first scan's backward takes it from there (its
gradient of y is zero). Cost: twice the scan's compute, and per rank and direction
(S - 1) · 2 · B·E·N fp32 elements sent whatever T is (``state_passing_exchange_bytes`` in
cost_models/sequence.py). The exchange assumes rank r holds the r-th contiguous slice, so the
mixer does not run on the zigzag layout (NOTE [Zigzag layout for causal rings]).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from zerofx.common.errors import SequenceParallelError
from zerofx.common.units import format_bytes
from zerofx.cost_models.sequence import ScanDims, state_passing_exchange_bytes
from zerofx.models.scan import scan_dtype
from zerofx.passes.plan.sequence import SCAN_KEY, ScanStrategy
from zerofx.passes.sequence.sequence_mixers import MixerCheck, MixerRewrite, all_to_all

SCAN_OP = torch.ops.zerofx.selective_scan.default


def is_selective_scan(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is SCAN_OP


def _is_scan_output(node: fx.Node) -> bool:
    """``getitem`` of a scan's (y, h_last)."""
    return (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and is_selective_scan(node.args[0]))


class ScanMixer:
    """``zerofx::selective_scan`` and the ``getitem`` of its outputs; its sites are ``ScanDims``."""

    name = SCAN_KEY.name
    strategies = SCAN_KEY.strategies
    supports = "zerofx::selective_scan (state passing)"
    runs_zigzag = False
    doc = SCAN_KEY.doc

    def matches(self, node: fx.Node) -> bool:
        return is_selective_scan(node) or _is_scan_output(node)

    def check(self, node: fx.Node, ctx: MixerCheck) -> ScanDims | None:
        where = f"zerofx::selective_scan in module {ctx.module!r}"
        if _is_scan_output(node):
            if node.args[1] == 1 and node.users:
                raise SequenceParallelError(f"{where}: its final state (h_last) is read; sequence parallelism shards a scan whose "
                                            "output y alone is used")
            return None  # y: the scan's site is the scan node's
        an, local = ctx.analysis, ctx.local
        x, delta, a, b, c, d, h0 = node.args[:7]
        if not all(v in local and an.sdim.get(v) == 1 and v.meta["val"].dim() == 3 for v in (x, delta, b, c)):
            raise SequenceParallelError(f"sequence parallelism needs x, delta, B and C of {where} as (batch, sequence, channels) "
                                        "computed token by token")
        if any(v in local or an.sdim.get(v) is not None for v in (a, d, h0)):
            raise SequenceParallelError(f"{where}: A, D and the initial state must not depend on the sequence")
        xv = x.meta["val"]
        return ScanDims(batch=xv.shape[0], seq_len=an.seq_len, inner_dim=xv.shape[2], state_dim=a.meta["val"].shape[1],
                        state_itemsize=torch.empty((), dtype=scan_dtype(xv)).element_size())

    def whole_args(self, node: fx.Node) -> tuple[fx.Node, ...]:
        """A, D and the initial state: read per channel, never along the sequence (NOTE [Prefix slices
        read along the sequence] in passes/sequence/seq_regions.py)."""
        if not is_selective_scan(node):
            return ()
        return tuple(a for a in (node.args[2], node.args[5], node.args[6]) if isinstance(a, fx.Node))

    def exchange_bytes(self, site: ScanDims, strategy: str, size: int) -> float:
        return state_passing_exchange_bytes(site, size)

    def choose(self, sites: Sequence[ScanDims], size: int) -> tuple[str, str]:
        return ScanStrategy.STATE_PASSING.value, "sequence parallelism: state passing chosen for the scans (the one strategy)"

    def accept(self, sites: Sequence[ScanDims], strategy: str, size: int) -> None:
        pass  # state passing runs any scan ``check`` accepts

    def describe(self, sites: Sequence[ScanDims], strategy: str, size: int, seq_len: int) -> str:
        sent = sum(self.exchange_bytes(s, strategy, size) for s in sites)
        return (f"{len(sites)} selective scan(s) by state passing, each scanning its slice twice and one all-to-all of each "
                f"rank's final state and decay (B, E, N) to every rank: {format_bytes(sent)} sent per rank and step in all "
                "(NOTE [Scan by state passing] in passes/sequence/mixer_scan.py)")

    def zigzag_balances(self, graph: fx.Graph, strategy: str) -> bool:
        return False

    def rewrite(self, node: fx.Node, args: tuple, kwargs: dict, ctx: MixerRewrite) -> object:
        if _is_scan_output(node):
            return args[0][args[1]]  # (y, h_last) as ``rewrite`` below returns them for the scan node
        x, delta, a, b, c, d, h0, chunk_len = args
        size = ctx.size
        # 1. this slice from a zero state: its final state h_r (B, E, N)
        _, h_mine = SCAN_OP(x, delta, a, b, c, d, torch.zeros_like(h0), chunk_len)
        dtype = h_mine.dtype
        decay = torch.exp(delta.to(dtype).sum(1)[..., None] * a.to(dtype))  # (B, E, N): P_r
        # 2. (h_r, P_r) to every rank; chunk j of what arrives is rank j's pair
        pair = torch.stack([h_mine, decay]).expand(size, 2, *h_mine.shape).contiguous()  # (S, 2, B, E, N)
        pairs = all_to_all(pair, size, ctx.group_name, grad=True)  # (S, 2, B, E, N)
        # 3. c_0 = h0, c_{j+1} = P_j c_j + h_j; this rank starts from c_r
        carries = [h0.to(dtype)]
        for j in range(size):
            carries.append(pairs[j, 1] * carries[-1] + pairs[j, 0])
        rank = ctx.positions(x)[:1] // x.shape[1]  # (1,): contiguous slices of T/S positions
        h_in = torch.index_select(torch.stack(carries[:size]), 0, rank).squeeze(0)  # (B, E, N)
        # 4. this slice from its true initial state
        y, _ = SCAN_OP(x, delta, a, b, c, d, h_in.to(h0.dtype), chunk_len)
        return y, carries[size].to(h0.dtype)

    def op_exchanges(self, node: fx.Node) -> tuple[tuple[str, int], ...]:
        return ()  # the state exchange is an all-to-all in the graph


SCAN = ScanMixer()
