"""Attention as a sequence mixer (NOTE [Sequence mixers] in passes/sequence/sequence_mixers.py): each
``scaled_dot_product_attention`` runs by Ulysses (all-to-all to head shards and back) or by ring
attention (passes/sequence/ring_attention.py), as NOTE [Sequence parallelism as a rewrite] in
passes/sequence/sequence_parallel.py describes, and ``"auto"`` chooses between them (``choose_attention``)
by the bytes of cost_models/sequence.py. Reads and writes no node meta, except the sequence-dim
mark on the last op of each attention's output (NOTE [Tiling a sequence-parallel forward] in
zerofx/compiler/pipeline.py).

Attention is one mixer with two strategies, not two mixers: both strategies own the same node
(the registry gives each node to the first mixer that matches it, so a second attention mixer
would never be asked), both read the same site (``AttentionShape``), and ``"auto"`` compares the
two on it. So one config key, ``sequence_parallel.mixers.attention``, names the strategy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from zerofx.common.errors import SequenceParallelError
from zerofx.common.units import format_bytes
from zerofx.cost_models.sequence import AttentionDims, ring_exchange_bytes, ulysses_exchange_bytes
from zerofx.passes import _compat, meta
from zerofx.passes.sequence.ring_attention import ring_attention, ring_exchanges
from zerofx.passes.plan.sequence import ATTENTION_KEY, SequenceAttention
from zerofx.passes.sequence.seq_regions import is_sdpa
from zerofx.passes.sequence.sequence_mixers import MixerCheck, MixerRewrite, all_to_all, bytes_by_strategy


@dataclass(frozen=True)
class AttentionShape(AttentionDims):
    """One attention as the choice between Ulysses and ring sees it (whole sequence): the mixer's site."""

    ulysses_refusal: str | None  # why Ulysses cannot run it, or None


def choose_attention(heads: list[AttentionShape], size: int) -> tuple[SequenceAttention, str]:
    """``"auto"``: ring where Ulysses cannot run (S does not divide the query heads) or sends
    more bytes per step; Ulysses on a tie (two collectives per attention and direction instead of
    S - 1 ring steps in a row)."""
    refused = next((h.ulysses_refusal for h in heads if h.ulysses_refusal), None)
    if refused:
        return SequenceAttention.RING, f"sequence parallelism: ring chosen ({refused})"
    sent = {SequenceAttention(s): b for s, b in bytes_by_strategy(ATTENTION, heads, size).items()}
    kind = SequenceAttention.RING if sent[SequenceAttention.RING] < sent[SequenceAttention.ULYSSES] else SequenceAttention.ULYSSES
    q, kv = heads[0].q_heads, heads[0].kv_heads
    repeat = f", key/value heads repeated to {q} since {size} does not divide {kv}" if kv % size else ""
    return kind, (f"sequence parallelism: {kind.value} chosen for {q} query heads ({kv} key/value) over {size} ranks: one rank sends "
                  f"{format_bytes(sent[SequenceAttention.ULYSSES])} per step (forward and backward) with ulysses (all-to-all{repeat}), "
                  f"{format_bytes(sent[SequenceAttention.RING])} with ring; a tie goes to ulysses")


def _seq_to_heads(xs: list[torch.Tensor], size: int, group_name: str) -> list[torch.Tensor]:
    """Each of ``xs`` from (B, H, T/S, D) to (B, H/S, T, D); one all-to-all per distinct shape
    (one for q, k and v; two under grouped-query attention)."""
    shapes = [tuple(x.shape) for x in xs]
    if len(set(shapes)) != 1:  # grouped-query attention: q apart, k and v together
        out: dict[int, torch.Tensor] = {}
        for shape in dict.fromkeys(shapes):
            same = [i for i, s in enumerate(shapes) if s == shape]
            out.update(zip(same, _seq_to_heads([xs[i] for i in same], size, group_name)))
        return [out[i] for i in range(len(xs))]
    n = len(xs)
    b, h, tl, d = xs[0].shape  # (B, H, T/S, D)
    x = torch.stack(xs).reshape(n, b, size, h // size, tl, d)
    x = x.permute(2, 0, 1, 3, 4, 5).contiguous()  # (S, n, B, H/S, T/S, D): chunk j to rank j
    y = all_to_all(x, size, group_name, grad=True)  # (S, n, B, H/S, T/S, D): chunk j is rank j's positions
    y = y.permute(1, 2, 3, 0, 4, 5).reshape(n, b, h // size, size * tl, d)  # (n, B, H/S, T, D)
    return list(y.unbind(0))


def _heads_to_seq(y: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    b, hs, t, d = y.shape  # (B, H/S, T, D)
    y = y.reshape(b, hs, size, t // size, d).permute(2, 0, 1, 3, 4).contiguous()  # (S, B, H/S, T/S, D): chunk j to rank j
    x = all_to_all(y, size, group_name, grad=True).permute(1, 0, 2, 3, 4)  # (B, S, H/S, T/S, D): chunk j is rank j's heads
    with _compat.annotate({meta.SEQUENCE_DIM: 2}):  # NOTE [Tiling a sequence-parallel forward] in zerofx/compiler/pipeline.py
        return x.reshape(b, size * hs, t // size, d)  # (B, H, T/S, D)


def _is_causal(node: fx.Node) -> bool:
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))


class AttentionMixer:
    """``scaled_dot_product_attention`` by Ulysses or ring; its sites are ``AttentionShape``."""

    name = ATTENTION_KEY.name
    strategies = ATTENTION_KEY.strategies
    supports = "scaled_dot_product_attention (or written out as softmax(q @ k.T * scale + mask) @ v)"
    runs_zigzag = True
    doc = ATTENTION_KEY.doc

    def matches(self, node: fx.Node) -> bool:
        return is_sdpa(node)

    def check(self, node: fx.Node, ctx: MixerCheck) -> AttentionShape:
        an, local, size = ctx.analysis, ctx.local, ctx.size
        q, k, v = node.args[:3]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        where = f"scaled_dot_product_attention in module {ctx.module!r}"
        if not all(x in local and an.sdim.get(x) == 2 and x.meta["val"].dim() == 4 for x in (q, k, v)):
            raise SequenceParallelError(f"sequence parallelism needs q, k and v of {where} as (batch, heads, sequence, head_dim) "
                                        "computed token by token")
        qv, kv, vv = (x.meta["val"] for x in (q, k, v))
        h, hkv = qv.shape[1], kv.shape[1]
        if h % hkv:
            raise SequenceParallelError(f"{where}: {h} query heads are not a multiple of {hkv} key/value heads")
        if dropout:
            raise SequenceParallelError(f"{where} has dropout_p={dropout}; sequence parallelism supports dropout-free attention (0.0)")
        refusal = None if h % size == 0 else (f"{where} has {h} query heads, which sequence_parallel.size={size} does not divide, "
                                              "as Ulysses needs")
        if isinstance(mask, fx.Node):
            mv = mask.meta["val"]
            if mask in local:
                raise SequenceParallelError(f"{where} has a mask computed from sequence-sharded values; supported are no mask, is_causal, "
                                            "or a mask computed from the inputs alone")
            if mv.dim() >= 3 and mv.shape[-3] != 1:
                refusal = refusal or f"{where} has a mask that differs per head, which Ulysses cannot split by heads"
        return AttentionShape(batch=qv.shape[0], seq_len=an.seq_len, q_heads=h, kv_heads=hkv, qk_dim=qv.shape[-1], v_dim=vv.shape[-1],
                              itemsize=qv.element_size(), ulysses_refusal=refusal)

    def exchange_bytes(self, site: AttentionShape, strategy: str, size: int) -> float:
        by = ulysses_exchange_bytes if SequenceAttention(strategy) is SequenceAttention.ULYSSES else ring_exchange_bytes
        return by(site, size)

    def choose(self, sites: Sequence[AttentionShape], size: int) -> tuple[str, str]:
        kind, why = choose_attention(list(sites), size)
        return kind.value, why

    def accept(self, sites: Sequence[AttentionShape], strategy: str, size: int) -> None:
        for h in sites:
            if strategy == SequenceAttention.ULYSSES.value and h.ulysses_refusal:
                raise SequenceParallelError(f"{h.ulysses_refusal}; sequence_parallel.attention \"ring\" or \"auto\" accepts it")

    def describe(self, sites: Sequence[AttentionShape], strategy: str, size: int, seq_len: int) -> str:
        how = ("each an all-to-all to heads before (one per q/k/v shape) and one back after" if strategy == SequenceAttention.ULYSSES.value
               else f"each one zerofx::ring_attention op: {size - 1} send(s) of k and v forward, {size - 1} of k and v and {size} of "
                    f"their gradients backward, {seq_len // size} keys and values saved per rank (NOTE [Ring attention] in "
                    "passes/sequence/ring_attention.py)")
        return f"{len(sites)} attention(s), {how}"

    def zigzag_balances(self, graph: fx.Graph, strategy: str) -> bool:
        return strategy == SequenceAttention.RING.value and any(is_sdpa(n) and _is_causal(n) for n in graph.nodes)

    def rewrite(self, node: fx.Node, args: tuple, kwargs: dict, ctx: MixerRewrite) -> torch.Tensor:
        size, group = ctx.size, ctx.group_name
        q, k, v, *rest = args
        kwargs = dict(kwargs)
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):  # whole, as attention reads it (never sequence-sharded: ``check``)
            if len(node.args) > 3:
                rest[0] = ctx.whole(mask)
            else:
                kwargs["attn_mask"] = ctx.whole(mask)
        if ctx.strategy == SequenceAttention.RING.value:
            named = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), rest)) | kwargs
            scale = named.get("scale") or q.shape[-1] ** -0.5
            with _compat.annotate({meta.SEQUENCE_DIM: 2}):  # NOTE [Tiling a sequence-parallel forward] in zerofx/compiler/pipeline.py
                return ring_attention(q, k, v, named.get("attn_mask"), is_causal=bool(named.get("is_causal", False)), scale=scale,
                                      size=size, group_name=group, zigzag=ctx.zigzag)  # (B, H, T/S, D)
        if k.shape[1] % size:  # key/value heads S does not divide: repeat them to the query heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            kwargs.pop("enable_gqa", None)
        q, k, v = _seq_to_heads([q, k, v], size, group)  # each (B, H/S, T, D)
        y = node.target(q, k, v, *rest, **kwargs)  # the whole sequence for this rank's heads, mask and is_causal unchanged
        return _heads_to_seq(y, size, group)  # (B, H, T/S, D), its last op marked with the sequence dim


    def op_exchanges(self, node: fx.Node) -> tuple[tuple[str, int], ...]:
        return tuple(("ring_shift", nbytes) for nbytes in ring_exchanges(node))


ATTENTION = AttentionMixer()
