"""Sequence parallelism: each rank of a sequence group runs 1/S of every sequence.

Expects the pre-autograd ATen forward that ``make_fx(..., pre_dispatch=True)`` records
(``aten.linear``, ``aten.scaled_dot_product_attention`` and ``aten.cross_entropy_loss`` still
whole), with ``meta['val']`` on every node and placeholders tagged with ``zerofx_role`` and
``zerofx_fqn``. ``plan_sequence_parallel`` reads it and changes nothing;
``sequence_parallel_pass`` returns a new pre-autograd forward whose autograd derivative (taken
by AOTAutograd afterwards) is the sequence-parallel backward. Reads ``zerofx_role`` and
``zerofx_fqn``; writes the same keys on the new graph's placeholders.

NOTE [Sequence parallelism as a rewrite]
Every rank of a sequence group is given the same whole batch. The sequence axis is found as
tiling finds it (NOTE [Sequence dimension propagation] in passes/sequence/seq_regions.py), and the graph
is traced again with three changes:

- Sources of the axis (inputs, ``arange(T)``, prefix slices of rotary tables) are cut to this
  rank's positions ``[r·T/S, (r+1)·T/S)`` (or the zigzag layout's two chunks, NOTE [Zigzag
  layout for causal rings]) where a token-wise op reads them; token-wise ops
  (norms, projections, MLP, residuals, rotary products) run on the local slice, their shape
  arguments with T/S in place of T. Rotary tables and position ids are cut the same way, so
  each rank applies its own offset.
- Each op that mixes positions runs through the mixer that owns it (NOTE [Sequence mixers] in
  passes/sequence/sequence_mixers.py; ``MIXERS`` lists them). Each attention core (SDPA), the mixer of
  passes/sequence/mixer_attention.py, runs in one of two ways, as ``sequence_parallel.mixers.attention``
  (or ``sequence_parallel.attention``) says
  (``"auto"``: ``choose_attention`` in passes/sequence/mixer_attention.py, ring where S does not divide
  the query heads or where Ulysses sends more bytes, recorded in the plan's decisions).
  Ulysses: an all-to-all turns q, k and v from sequence-sharded ``(B, H, T/S, D)`` into
  head-sharded ``(B, H/S, T, D)``, SDPA runs on the whole sequence for H/S heads with its own
  mask and ``is_causal`` unchanged, and an all-to-all turns the output back. Key/value heads
  that S does not divide are repeated to H first. Ring: q stays local and the key/value blocks
  pass around the group (NOTE [Ring attention] in passes/sequence/ring_attention.py).
- The loss ``cross_entropy(logits[..., :T-k, :], labels[..., k:])`` becomes a sum over the
  local positions against labels shifted on the whole batch, with ``ignore_index`` where the
  shift runs out, so a shifted label crosses slice boundaries exactly; the sum and the token
  count are summed over the group, in fp32 under mixed precision. The value returned is the global mean (a sum over the group of every
  rank's share); the gradient flows from ``S · local sum / global count`` only. ZeRO averages
  gradients over all N = D·S ranks, so each parameter gets (1/D) Σ over data groups of the
  gradient of that group's loss: the single-process gradient of the same global batch.

The rank's position in its group is not a constant of the graph: every rank's graphs are the
same code (the engine compares them), so the first op all-to-alls ``arange(S)``, from which
rank r receives S copies of r. Every collective is ``_c10d_functional.all_to_all_single`` on
the sequence group (autograd's form where a gradient flows through it), or the point-to-point
sends inside ring attention's ``zerofx::ring_attention`` op (which reads its rank from the group
at run time); the ZeRO rewrites act on all-gathers, reduce-scatters and all-reduces only, and
leave these alone.

Convolutions and cumsums along the sequence run through the mixers of passes/sequence/mixer_conv.py
(NOTE [Convolutions along the sequence]), the ``zerofx::selective_scan`` op by state passing
(passes/sequence/mixer_scan.py) and a flip along the sequence by two all-to-alls (passes/sequence/mixer_flip.py);
all of them keep the slices contiguous.

What is refused: any other op that reads the axis across positions, one no mixer owns (a
scan along the sequence written as plain ops, a convolution those mixers refuse, a shifted slice outside the loss, attention
written as matmuls and softmax, a mask computed from sequence-sharded values; for Ulysses also query heads S does not
divide and a mask that differs per head) makes ``plan_sequence_parallel`` raise
``SequenceParallelError`` naming the op and its module (NOTE [Naming a node by its module] in
passes/analysis/analyze_schedule.py).

``MIXERS`` below is the registry of sequence mixers; ``all_mixers`` adds those users declared for
ops zerofx does not know (NOTE [Declared sequence mixers] in passes/sequence/mixer_custom.py), and every
refusal names how to declare one. A new mixer of zerofx's own (NOTE [Sequence mixers]) touches:

- its module, ``passes/mixer_<op>.py``: an object with the ``SequenceMixer`` protocol (matching,
  checks, strategies, the rewrite, ``supports`` for the refusal's list of what is supported);
- its entry in ``MIXERS`` here, from which the config key ``sequence_parallel.mixers.<name>``
  (zerofx/config/schema.py) and its accepted strategies follow;
- ``cost_models/sequence.py``: the bytes and seconds of its exchanges, which its
  ``exchange_bytes`` returns;
- and outside the code: its tests, a ``MUST_AGREE`` row for the new config key in
  tests/test_config_validation.py, and its row in docs/sequence-parallel.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from zerofx.passes import _compat, meta
from zerofx.passes.sequence.mixer_attention import ATTENTION
from zerofx.passes.sequence.mixer_conv import CUMSUM, LONG_CONV, SHORT_CONV
from zerofx.passes.sequence.mixer_custom import declared_mixers
from zerofx.passes.sequence.mixer_flip import FLIP
from zerofx.passes.sequence.mixer_scan import SCAN
from zerofx.passes.sequence.ring_attention import rank_positions
from zerofx.passes.sequence.seq_regions import SeqAnalysis, analyze, op_packet, sequence_length
from zerofx.passes.plan.sequence import AUTO, MIXER_KEYS, SequenceParallelPlan, SequenceParallelSpec
from zerofx.passes.sequence.sequence_mixers import MixerCheck, MixerRewrite, SequenceMixer, all_to_all
from zerofx.common.errors import SequenceParallelError

aten = torch.ops.aten

_CASTS = {aten.to, aten._to_copy, aten.contiguous, aten.clone, aten.alias, aten.type_as}
_FLATTEN = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten}
_SHAPED = {aten.view, aten.reshape, aten._unsafe_view, aten.expand}
# The ops that mix positions and how each shards, in the order they are asked (NOTE [Sequence mixers] in passes/sequence/sequence_mixers.py).
MIXERS: tuple[SequenceMixer, ...] = (ATTENTION, SHORT_CONV, LONG_CONV, CUMSUM, SCAN, FLIP)
assert tuple(m.name for m in MIXERS) == tuple(k.name for k in MIXER_KEYS), "the config's MIXER_KEYS name MIXERS, in order"


def all_mixers() -> tuple[SequenceMixer, ...]:
    """``MIXERS``, then the mixers users declared (NOTE [Declared sequence mixers] in passes/sequence/mixer_custom.py)."""
    return (*MIXERS, *declared_mixers())


def mixer_of(node: fx.Node) -> SequenceMixer | None:
    """The first mixer of ``all_mixers()`` that owns ``node``, or None."""
    return next((m for m in all_mixers() if m.matches(node)), None)


def whole_args(node: fx.Node) -> tuple[fx.Node, ...]:
    """The arguments of ``node``'s mixer that it reads without the sequence (a mixer's optional
    ``whole_args``; NOTE [Prefix slices read along the sequence] in passes/sequence/seq_regions.py)."""
    read = getattr(mixer_of(node), "whole_args", None)
    return tuple(read(node)) if read is not None else ()


def supported() -> str:
    """What sequence parallelism shards, as its refusals list it: token-wise ops, the mixers' ops, the loss."""
    return ("token-wise ops (elementwise, norms, linear/matmul/addmm with a weight, embedding, views that keep the sequence axis "
            f"whole or merge it with the batch), {', '.join(m.supports for m in all_mixers())}, and cross_entropy over the sequence "
            "(shifted or not)")


@dataclass(frozen=True)
class LossSite:
    """``cross_entropy(flatten(casts(slice(base, seq, 0, T-shift))), flatten(target))``, ``target`` of
    shape (..., T-shift) computed from the inputs (``labels[:, shift:]``, or padded then shifted)."""

    loss: fx.Node
    base: fx.Node  # the sharded logits, (..., T, V)
    casts: tuple[fx.Node, ...]  # applied to the local logits, in order
    target: fx.Node  # the whole labels, (..., T - shift), already shifted
    target_casts: tuple[fx.Node, ...]  # applied to the local labels, in order
    shift: int
    skipped: tuple[fx.Node, ...]  # chain nodes the rewrite replaces


def module_of_nodes(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Each node's module by the parameters it reads, else the last module before it (NOTE
    [Naming a node by its module] in passes/analysis/analyze_schedule.py), on a pre-autograd graph."""
    param_of: dict[fx.Node, str] = {}
    for ph in meta.placeholders(gm.graph, meta.Role.PARAM):
        param_of[ph] = ph.meta[meta.FQN]
    out: dict[fx.Node, str] = {}
    last = "(before any parameter)"
    for node in gm.graph.nodes:
        fqns = sorted({param_of[a] for a in node.all_input_nodes if a in param_of})
        if fqns:
            parts = [f.split(".")[:-1] for f in fqns]
            common = []
            for pieces in zip(*parts):
                if len(set(pieces)) != 1:
                    break
                common.append(pieces[0])
            last = ".".join(common) or "(the model itself)"
        out[node] = last
    return out


def _describe(node: fx.Node) -> str:
    """The op as a refusal names it: ``aten.<name>.<overload>``, or ``<namespace>::<name>`` for another library's op."""
    namespace = getattr(node.target, "namespace", "aten")
    if namespace != "aten":
        return node.target.name().split(".")[0]
    return f"aten.{getattr(node.target, '__name__', node.target)}"


# NOTE [The loss's flatten at batch 1]
# A loss reads its logits as ``(B·T, V)``. Where B > 1 that flatten merges the sequence axis with
# the batch, so the analysis loses the axis there and the view is not sharded: the walk from the
# loss passes it like any op outside ``local``. Where B = 1 the flatten ``(1, T, V) -> (T, V)``
# only drops the batch dimension, the axis goes on at dim 0, and the view is a sharded token-wise
# op like any other; a walk that stopped at it would read ``(T, V)`` as logits with no batch and
# refuse the loss. A flatten that keeps the last dimension and merges every one before it is the
# same loss at every batch size: the walk passes it whether sharded or not.
def _flattens_tokens(node: fx.Node) -> bool:
    """Whether ``node`` is a view ``(..., T, V) -> (N, V)`` read only by the next op (NOTE [The loss's flatten at batch 1])."""
    if op_packet(node) not in _FLATTEN or len(node.users) != 1 or not isinstance(node.args[0], fx.Node):
        return False
    before, after = node.args[0].meta.get("val"), node.meta.get("val")
    return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dim() >= 3 and after.dim() == 2
            and after.shape[-1] == before.shape[-1] and after.shape[0] == math.prod(before.shape[:-1]))


def _labels_fit(labels: tuple[int, ...], logits: torch.Tensor, outer: int, t: int, shift: int) -> bool:
    """Labels (..., T - shift) for logits (..., T, V), or, for logits over rows (o · T, V) of o whole
    sequences (NOTE [The sequence axis merged with the batch] in passes/sequence/seq_merged.py), unshifted
    labels (..., T) of as many sequences."""
    if logits.shape[-2] == t:
        return labels == (*logits.shape[:-2], t - shift)
    return (shift == 0 and logits.shape[-2] == outer * t and len(labels) >= 1 and labels[-1] == t
            and math.prod(labels[:-1]) == outer * math.prod(logits.shape[:-2]))


def _find_loss(node: fx.Node, an: SeqAnalysis, local: set[fx.Node]) -> LossSite | None:
    """The shifted-or-not cross-entropy over the sequence, or None when ``node`` is another shape of loss."""
    if op_packet(node) is not aten.cross_entropy_loss:
        return None
    args = list(node.args) + [None] * 6
    if args[2] is not None or node.kwargs.get("weight") is not None or (args[5] or node.kwargs.get("label_smoothing", 0.0)):
        return None
    t, cur, casts, skipped, end_shift = an.seq_len, args[0], [], [], 0
    while isinstance(cur, fx.Node) and (cur not in local or _flattens_tokens(cur)):
        pk = op_packet(cur)
        if len(cur.users) != 1:
            return None
        if pk in _CASTS:
            casts.append(cur)
        elif pk is aten.slice:
            rank = cur.args[0].meta["val"].dim()
            dim = cur.args[1] % rank
            start, end = (list(cur.args[2:4]) + [None, None])[:2]
            if dim != rank - 2 or start not in (0, None) or end_shift or end is None or not -t < end < 0 and not 0 < end < t:
                return None
            end_shift = t - (end % t if end > 0 else t + end)
        elif pk not in _FLATTEN:
            return None
        skipped.append(cur)
        cur = cur.args[0]
    base = cur
    if base not in local or an.sdim.get(base) != base.meta["val"].dim() - 2:
        return None
    # The target is computed whole on every rank (from the inputs); only its flattening is replaced.
    cur, target_casts = args[1], []
    while isinstance(cur, fx.Node) and op_packet(cur) in _FLATTEN | _CASTS and len(cur.users) == 1:
        if op_packet(cur) in _CASTS:
            target_casts.append(cur)
        skipped.append(cur)
        cur = cur.args[0]
    target, bv = cur, base.meta["val"]
    tv = target.meta.get("val") if isinstance(target, fx.Node) else None
    if target in local or not isinstance(tv, torch.Tensor) or not _labels_fit(tuple(tv.shape), bv, an.outer.get(base, 1), t, end_shift):
        return None
    return LossSite(node, base, tuple(reversed(casts)), target, tuple(reversed(target_casts)), end_shift, tuple(skipped))


def _analyze(gm: fx.GraphModule, size: int) -> tuple[SeqAnalysis, set[fx.Node], list[LossSite]]:
    t = sequence_length(gm)
    if t is None:
        raise SequenceParallelError("sequence parallelism found no integer input (token ids) whose last dimension is the sequence")
    if t % size:
        raise SequenceParallelError(f"sequence length {t} is not divisible by sequence_parallel.size={size}; pad the sequence "
                                    f"to a multiple of {size}")
    an = analyze(gm, t, mixes=lambda n: mixer_of(n) is not None, merged=True, whole_args=whole_args)
    # Sharded: token-wise nodes computed from parameters or from other sharded nodes, and attention
    # outputs. Token-wise nodes computed from the inputs and buffers alone (position ids, rotary
    # tables, label casts) stay whole on every rank, cut to the rank's positions where a sharded op reads them.
    # NOTE [Parameter-derived values shard their positions]
    # "From parameters" counts what is computed from them without the sequence too (a filter's
    # decay rates exp(log_rate)): StripedHyena's long filter ``R * r * exp(-r * arange(T))``
    # then runs on the rank's T/S lags, as the FFT convolution's all-to-all expects, instead of
    # whole on every rank, (C, modes, T) of it saved for backward. A value computed from them
    # over a longer axis and cut to its first T positions (a filter of the longest context, then
    # ``k[..., :T]``) is computed whole and cut to the rank's positions at the cut.
    params = set(meta.placeholders(gm.graph, meta.Role.PARAM))
    from_params: set[fx.Node] = set()
    local: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if mixer_of(n) is not None and an.sdim.get(n) is not None and any(a in local for a in n.all_input_nodes):
            local.add(n)  # a mixer of values every rank holds whole (position ids by a cumsum of the padding) runs whole
        elif n in an.tokenwise and any(a in params or a in from_params or a in local for a in n.all_input_nodes):
            local.add(n)
        elif op_packet(n) in (aten.slice, aten.narrow) and an.sdim.get(n) is not None and n.args[0] in from_params:
            local.add(n)  # parameter-derived values cut to T: the rank's positions of them
        elif an.sdim.get(n) is None and any(a in params or a in from_params for a in n.all_input_nodes):
            from_params.add(n)
    losses = [site for n in gm.graph.nodes if (site := _find_loss(n, an, local)) is not None]
    return an, local, losses


def plan_sequence_parallel(gm: fx.GraphModule, spec: SequenceParallelSpec) -> SequenceParallelPlan:
    """Check every op that reads the sharded sequence can run sharded, and record how."""
    size = spec.size
    _check_spec(spec)
    an, local, losses = _analyze(gm, size)
    handled = {s.loss for s in losses} | {n for s in losses for n in s.skipped}
    modules = module_of_nodes(gm)
    sites: dict[str, list[Any]] = {m.name: [] for m in all_mixers()}
    for node in gm.graph.nodes:
        mixer = mixer_of(node)
        if node in local and mixer is None:
            continue
        reads_local = [a for a in node.all_input_nodes if a in local]
        if mixer is not None:
            if merged := [a for a in node.all_input_nodes if a in an.outer]:  # NOTE [The sequence axis merged with the batch]
                raise SequenceParallelError(
                    f"sequence parallelism cannot shard {_describe(node)} in module {modules[node]!r}: its input {merged[0].name} "
                    f"holds the sequence merged with another axis, shape {tuple(merged[0].meta['val'].shape)}; supported are "
                    "inputs with the sequence as a dimension of its own")
            if (site := mixer.check(node, MixerCheck(an, local, size, modules[node]))) is not None:
                sites[mixer.name].append(site)
            continue
        if not reads_local or node in handled:
            continue
        where = "the graph's output" if node.op == "output" else _describe(node)
        raise SequenceParallelError(
            f"sequence parallelism cannot shard {where} in module {modules[node]!r}: it reads the sequence axis across positions "
            f"(node {node.name}). Supported are {supported()}; for a model with this op, leave zerofx.sequence_parallel out")
    if not losses:
        raise SequenceParallelError("sequence parallelism found no cross_entropy loss over the sequence; the loss must be "
                                    f"cross_entropy of the sequence's logits (shifted or not) against labels given as input. Supported are {supported()}")
    if not any(sites.values()):
        raise SequenceParallelError("sequence parallelism found no op that mixes positions; attention written as matmuls "
                                    "and softmax is recognized as softmax(q @ k.T * scale + mask) @ v only (or use "
                                    f"F.scaled_dot_product_attention). Supported are {supported()}")
    decisions: list[str] = []
    strategies: dict[str, str] = {}
    parts: list[str] = []
    for mixer in all_mixers():
        found = sites[mixer.name]
        if not found:
            continue
        strategy = spec.strategy(mixer)
        if strategy == AUTO:
            strategy, why = mixer.choose(found, size)
            decisions.append(why)
        mixer.accept(found, strategy, size)
        strategies[mixer.name] = strategy
        parts.append(mixer.describe(found, strategy, size, an.seq_len))
    decisions.append(f"sequence parallelism ({', '.join(strategies.values())}) over {size} ranks: {an.seq_len} tokens -> "
                     f"{an.seq_len // size} per rank, {', '.join(parts)}, loss shift {losses[0].shift}")
    zigzag, layout = _choose_layout(gm, spec, strategies, an.seq_len)
    decisions.append(layout)
    return SequenceParallelPlan(size=size, group_name=spec.group_name, seq_len=an.seq_len, strategies=tuple(strategies.items()),
                                loss_shift=losses[0].shift, decisions=tuple(decisions), zigzag=zigzag)


def _check_spec(spec: SequenceParallelSpec) -> None:
    """A spec built by hand is refused as the config refuses it: an unknown op class or strategy."""
    known = {m.name: m for m in MIXERS}
    for name, strategy in spec.mixers:
        if name not in known:
            raise SequenceParallelError(f"sequence parallelism has no mixer for op class {name!r}; accepted: {', '.join(known)}")
        accepted = (*known[name].strategies, AUTO)
        if strategy not in accepted:
            raise SequenceParallelError(f"sequence parallelism cannot run {name} by {strategy!r}; accepted: "
                                        f"{', '.join(repr(a) for a in accepted)}")


def _choose_layout(gm: fx.GraphModule, spec: SequenceParallelSpec, strategies: Mapping[str, str], seq_len: int) -> tuple[bool, str]:
    """NOTE [Zigzag layout for causal rings]
    With causal ring attention and contiguous slices, rank r attends to r + 1 of the S key/value
    blocks (its own half of them causally), so rank S - 1 does about 2S - 1 times the attention
    work of rank 0, and every ring step waits for it. Cut into 2S chunks instead, rank r holding
    chunks r and 2S - 1 - r (``zigzag_chunks`` and ``rank_positions`` in passes/sequence/ring_attention.py), every rank does the
    same work: its own block causally, then at each step half a block (all its queries against
    the first chunk of an earlier rank's keys, or its second chunk's queries against all of a
    later rank's keys). Every source of the axis is cut by the same positions (``_Sharded._positions``),
    so token-wise ops, rotary tables, position ids and the shifted labels see the layout as they
    see contiguous slices; the ring op reads it for the causal blocks and the mask's rows and
    columns. Chosen for ring attention with any ``is_causal`` attention when 2S divides T and
    ``sequence_parallel.load_balance`` is on (the default); Ulysses gathers the whole sequence in
    rank order, so it keeps contiguous slices. Each mixer says whether the layout balances it
    (``SequenceMixer.zigzag_balances``)."""
    contiguous = [m.name for m in all_mixers() if m.name in strategies and not m.runs_zigzag]
    if contiguous:
        return False, (f"sequence layout: contiguous slices, as the {', '.join(contiguous)} exchange(s) need rank r to hold the r-th "
                       "slice (a halo from the left neighbour, a state passed in rank order)")
    if not any(m.zigzag_balances(gm.graph, strategies[m.name]) for m in all_mixers() if m.name in strategies):
        return False, "sequence layout: contiguous slices (zigzag balances causal ring attention only)"
    if not spec.load_balance:
        return False, "sequence layout: contiguous slices (sequence_parallel.load_balance is off)"
    if seq_len % (2 * spec.size):
        return False, (f"sequence layout: contiguous slices, so rank {spec.size - 1} does the most causal attention work: zigzag needs "
                       f"the sequence length {seq_len} divisible by 2 x size = {2 * spec.size}")
    chunk = seq_len // (2 * spec.size)
    return True, (f"sequence layout: zigzag for causal ring attention, rank r holding chunks r and {2 * spec.size - 1} - r of "
                  f"{2 * spec.size} ({chunk} tokens each), so every rank does the same attention work")


# --------------------------------------------------------------------------- the rewrite
class _Sharded(fx.Interpreter):
    """Runs the forward with each sequence-sharded value held as this rank's slice."""

    def __init__(self, gm: fx.GraphModule, plan: SequenceParallelPlan) -> None:
        super().__init__(gm, garbage_collect_values=False)  # the loss reads values past their last use in ``gm``
        self.plan = plan
        self.an, self.local, losses = _analyze(gm, plan.size)
        self.losses = {s.loss: s for s in losses}
        self.skipped = {n for s in losses for n in s.skipped}
        self.positions: torch.Tensor | None = None
        self.slices: dict[fx.Node, torch.Tensor] = {}

    def _positions(self, like: torch.Tensor) -> torch.Tensor:
        if self.positions is None:
            p = self.plan
            # Rank r receives element r from every rank: S copies of its own rank in the group.
            ranks = all_to_all(torch.arange(p.size, dtype=torch.int64, device=like.device), p.size, p.group_name, grad=False)
            # NOTE [Zigzag layout for causal rings]: contiguous, or chunks r and 2S - 1 - r.
            self.positions = rank_positions(ranks[0], p.size, p.local_len, p.zigzag, like.device)
        return self.positions

    def _local(self, node: Any) -> Any:
        """A node's value as a token-wise op reads it: local for sharded values and sources of
        the axis (cut here to this rank's positions), whole for everything else."""
        if not isinstance(node, fx.Node):
            return node
        value = self.env[node]
        if node in self.local or self.an.sdim.get(node) is None:
            return value
        if node not in self.slices:
            self.slices[node] = self._cut(node, value)
        return self.slices[node]

    def _cut(self, node: fx.Node, value: torch.Tensor) -> torch.Tensor:
        """``node``'s whole ``value``, cut to this rank's positions along its sequence dim."""
        sd, outer = self.an.sdim[node], self.an.outer.get(node, 1)
        if value.shape[sd] == self.plan.seq_len:
            return torch.index_select(value, sd, self._positions(value))
        # o · T · f elements: cut the T of each (NOTE [The sequence axis merged with the batch] in passes/sequence/seq_merged.py)
        split = value.unflatten(sd, (outer, self.plan.seq_len, -1))
        return torch.index_select(split, sd + 1, self._positions(value)).flatten(sd, sd + 2)

    def run_node(self, n: fx.Node) -> Any:
        if n in self.skipped:
            return None
        if n in self.losses:
            with self._set_current_node(n):
                return self._loss(self.losses[n])
        if n.op != "call_function" or (n not in self.local):
            return super().run_node(n)
        with self._set_current_node(n):
            args = fx.node.map_arg(n.args, self._local)
            kwargs = fx.node.map_arg(n.kwargs, self._local)
            if (mixer := mixer_of(n)) is not None:
                p = self.plan
                ctx = MixerRewrite(p.strategy(mixer), p.size, p.group_name, p.zigzag, self.env.__getitem__, self._positions)
                return mixer.rewrite(n, args, kwargs, ctx)
            pk, sd, p = op_packet(n), self.an.sdim[n], self.plan
            if pk in _SHAPED:
                shape = list(args[1])
                assert shape[sd] == -1 or shape[sd] % p.seq_len == 0, f"{n}: shape {shape} has no sequence entry at {sd}"
                shape[sd] = shape[sd] // p.size if shape[sd] != -1 else -1  # o · T · f -> o · T/S · f (merged axes, passes/sequence/seq_merged.py)
                args = (args[0], shape, *args[2:])
            elif pk in (aten.slice, aten.narrow) and (args[1] % n.args[0].meta["val"].dim()) == self.an.sdim.get(n.args[0]):
                return args[0]  # a whole slice of the sequence: the local slice itself
            elif pk in (aten.slice, aten.narrow) and self.an.sdim.get(n.args[0]) is None:
                return self._cut(n, n.target(*args, **kwargs))  # parameter-derived values cut to T (``_analyze``)
            return n.target(*args, **kwargs)

    def _loss(self, site: LossSite) -> torch.Tensor:
        p, node = self.plan, site.loss
        args = list(node.args) + [None] * 6
        reduction = args[3] if args[3] is not None else node.kwargs.get("reduction", 1)
        ignore = args[4] if args[4] is not None else node.kwargs.get("ignore_index", -100)
        logits = self.env[site.base]  # (..., T/S, V)
        for cast in site.casts:
            logits = cast.target(logits, *fx.node.map_arg(cast.args[1:], self._local), **cast.kwargs)
        logits = logits.reshape(-1, logits.shape[-1])  # (B·T/S, V)
        labels = self.env[site.target]  # (..., T - shift), shifted on the whole batch every rank holds
        if site.shift:  # positions past the end of the shifted labels are ignored
            pad = torch.full((*labels.shape[:-1], site.shift), ignore, dtype=labels.dtype, device=labels.device)
            labels = torch.cat([labels, pad], dim=-1)  # (..., T)
        labels = torch.index_select(labels, labels.dim() - 1, self._positions(labels)).reshape(-1)  # (B·T/S,)
        for cast in site.target_casts:
            labels = cast.target(labels, *fx.node.map_arg(cast.args[1:], self._local), **cast.kwargs)
        # Per-token losses in the compute dtype, as the whole-sequence loss computes them; their sum,
        # the count and the exchange in fp32 at least: fp16 overflows above 65504 (a sum of a few
        # thousand token losses), and bf16 holds integers exactly only up to 256.
        acc = torch.promote_types(logits.dtype, torch.float32)
        if logits.dtype == acc:  # one summed cross_entropy, which tiling can chunk (NOTE [Tiling a sequence-parallel forward])
            local_sum = aten.cross_entropy_loss(logits, labels, None, 2, ignore)
        else:
            local_sum = aten.cross_entropy_loss(logits, labels, None, 0, ignore).sum(dtype=acc)  # 0 where ignored
        count = (labels != ignore).sum().to(acc) if reduction == 1 else torch.ones_like(local_sum)
        mine = torch.stack([local_sum.detach(), count]).expand(p.size, 2).contiguous()  # one row to each rank
        total_sum, total_count = all_to_all(mine, p.size, p.group_name, grad=False).sum(0).unbind(0)
        carrier = local_sum * p.size / total_count  # the gradient: S x this rank's share
        return (carrier + (total_sum / total_count - carrier).detach()).to(logits.dtype)  # the value: the group's mean


def sequence_parallel_pass(gm: fx.GraphModule, plan: SequenceParallelPlan | None) -> fx.GraphModule:
    """A new pre-autograd forward that runs this rank's 1/S of the sequence; ``gm`` is left alone."""
    if plan is None or plan.size == 1:
        return gm
    phs = meta.placeholders(gm.graph)
    fakes = [ph.meta["val"] for ph in phs]
    sharded = _Sharded(gm, plan)

    def run(*flat: torch.Tensor) -> Any:
        return sharded.run(*flat)

    fake_mode = _compat.detect_fake_mode(fakes)
    assert fake_mode is not None, "the pre-autograd forward's values should be fake tensors"
    # Under the graph's fake mode, so new tensors (the ranks' arange) are fake and no collective runs.
    with _compat.preserve_node_meta(), fake_mode:
        out = _compat.make_fx(run, pre_dispatch=True)(*fakes)
    for old, new in zip(phs, meta.placeholders(out.graph)):
        for key in (meta.ROLE, meta.FQN):
            if key in old.meta:
                new.meta[key] = old.meta[key]
    out.graph.lint()
    out.recompile()
    return out

