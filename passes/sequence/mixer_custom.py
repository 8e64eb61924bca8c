"""Ops zerofx cannot know, as sequence mixers their users declare (NOTE [Sequence mixers] in
passes/sequence/sequence_mixers.py): a ``torch.library`` op with a fake kernel (a CUDA or Triton causal
conv, an FFT convolution, a fused attention) shards along the sequence by one of three exchanges
its user names, through ``OpSequenceMixer`` and ``register_sequence_mixer`` (the public
``zerofx.OpSequenceMixer`` and ``zerofx.register_sequence_mixer``). Expects the pre-autograd
forward of NOTE [Sequence parallelism as a rewrite]; reads and writes no node meta, except the
sequence-dim mark on the last op of a channel exchange (NOTE [Tiling a sequence-parallel forward]
in zerofx/compiler/pipeline.py).

NOTE [Declared sequence mixers]
An op the graph holds as one node (its fake kernel gives the shapes; its autograd formula, from
``torch.library.register_autograd``, the backward) reads the sequence across positions in a way
no pass can see inside. Its user says how it shards: which dim is the sequence in the op's
output and in each argument that holds it, and one exchange:

- ``"halo"``: output position t reads inputs t - h..t (a causal convolution of h + 1 taps that
  pads with zeros on the left, as ``causal_conv1d_fn`` does). Each rank sends its last h
  positions of every sequence-sharded input to every rank (one all-to-all of S copies, as the
  short-conv mixer's halo), keeps its left neighbour's (zeros on rank 0), runs the op on
  h + T/S positions and keeps the last T/S outputs. ``halo`` is a number or a function of the
  node's arguments (fake tensors) that returns one, such as ``lambda x, w, *rest: w.shape[-1] - 1``;
  refused where h > T/S.
- ``"channels"``: the op treats the channels at ``channel_dim`` of its inputs and output apart
  (a depthwise long convolution, FlashFFTConv, attention over heads). The sequence-sharded
  inputs go by all-to-all from (…, C, …, T/S) to (…, C/S, …, T), the op runs on the whole
  sequence for this rank's C/S channels, and its output goes back; whole arguments that carry
  the channels (a filter (C, L), per-channel weights) are cut to the rank's channels at the dims
  ``per_channel`` names. S must divide C.
- ``"gather"``: any op: every rank gathers the whole sequence of each sequence-sharded input
  (its slice to every rank), runs the op whole, and keeps its own positions of the output. It
  costs a whole sequence of the op's inputs on every rank.

Arguments that do not hold the sequence must be computed without it (parameters, buffers,
numbers), and the op returns one tensor whose sequence dim is the first sequence-sharded
input's. All three exchanges are functional all-to-alls, so autograd's derivative of the
rewritten forward sends the gradients back the same way, and the schedule sees them as
collectives; all three read the rank's place as the r-th contiguous slice (``runs_zigzag`` is
False). Declared mixers are asked after the bundled ones (``MIXERS`` in
passes/sequence/sequence_parallel.py), so a declaration never takes an op from them; registering an op
again replaces its declaration. The plan cache keys on each declaration (``cache_key``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from zerofx.common.errors import SequenceParallelError, ZeroFXError
from zerofx.common.units import format_bytes
from zerofx.cost_models.sequence import DeclaredOpDims, declared_exchange_bytes
from zerofx.passes import _compat
from zerofx.passes.sequence.mixer_conv import channels_to_seq, from_all, rank_index, seq_to_channels, with_halo
from zerofx.passes.sequence.sequence_mixers import MixerCheck, MixerRewrite, SequenceMixer


class Exchange(enum.Enum):
    """How a declared op's ranks exchange the sequence (NOTE [Declared sequence mixers])."""

    HALO = "halo"
    CHANNELS = "channels"
    GATHER = "gather"


def _packet(op: object) -> torch._ops.OpOverloadPacket:
    """The op's overload packet: from ``torch.ops.<ns>.<name>``, one of its overloads, or a
    ``torch.library.custom_op``."""
    op = getattr(op, "_opoverload", op)  # torch.library.custom_op's CustomOpDef
    if isinstance(op, torch._ops.OpOverload):
        return op.overloadpacket
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op
    raise ZeroFXError(f"OpSequenceMixer: op must be a torch.library op (torch.ops.<namespace>.<name>, one of its overloads, "
                      f"or a torch.library.custom_op), got {op!r}")


@dataclass(frozen=True)
class DeclaredSite:
    """One node of a declared op: its dims for the cost model, and where its sequence and channels are."""

    dims: DeclaredOpDims
    seq_dim: int  # in the output and in each sequence-sharded input (normalized)
    channels: int  # C at channel_dim ("channels" only; else 0)


@dataclass(frozen=True)
class OpSequenceMixer:
    """A ``SequenceMixer`` for one ``torch.library`` op, from its user's declaration (NOTE
    [Declared sequence mixers]). ``seq_dim``: the sequence dim of the op's output and of each
    argument that holds the sequence; ``exchange``: ``"halo"``, ``"channels"`` or ``"gather"``;
    ``halo``: positions before each output the op reads (``"halo"``), a number or a function of
    the node's arguments; ``channel_dim``: the channel dim of the output and the sequence-sharded
    arguments (``"channels"``); ``per_channel``: argument index -> channel dim of whole arguments
    cut to the rank's channels (``"channels"``)."""

    op: Any
    exchange: Exchange | str
    seq_dim: int = -1
    halo: int | Callable[..., int] = 0
    channel_dim: int = -2
    per_channel: Mapping[int, int] = field(default_factory=dict)
    runs_zigzag: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        packet = _packet(self.op)
        object.__setattr__(self, "op", packet)
        accepted = ", ".join(f'"{e.value}"' for e in Exchange)
        try:
            object.__setattr__(self, "exchange", Exchange(getattr(self.exchange, "value", self.exchange)))
        except ValueError:
            raise ZeroFXError(f"OpSequenceMixer for {self.name}: exchange {self.exchange!r} is not one zerofx has; "
                              f"accepted: {accepted}") from None
        if self.exchange is Exchange.HALO and not (callable(self.halo) or isinstance(self.halo, int) and self.halo >= 0):
            raise ZeroFXError(f"OpSequenceMixer for {self.name}: halo must be an int >= 0 or a function of the op's arguments "
                              f"returning one, got {self.halo!r}")
        if self.exchange is not Exchange.CHANNELS and self.per_channel:
            raise ZeroFXError(f"OpSequenceMixer for {self.name}: per_channel applies to exchange \"channels\" only")
        object.__setattr__(self, "per_channel", dict(self.per_channel))

    @property
    def name(self) -> str:
        return self.op._qualified_op_name

    @property
    def strategies(self) -> tuple[str, ...]:
        return (self.exchange.value,)

    @property
    def doc(self) -> str:
        return f"{self.name} as its user declared it: {self.exchange.value} (NOTE [Declared sequence mixers])"

    @property
    def supports(self) -> str:
        return f"{self.name} ({self.exchange.value}, declared)"

    def cache_key(self) -> str:
        """The declaration as text that is the same in every process (no object addresses)."""
        halo = self.halo if isinstance(self.halo, int) else f"{self.halo.__module__}.{self.halo.__qualname__}"
        return f"{self.name}: {self.exchange.value}, seq_dim {self.seq_dim}, halo {halo}, channel_dim {self.channel_dim}, " \
               f"per_channel {sorted(self.per_channel.items())}"

    def matches(self, node: fx.Node) -> bool:
        # By the op's qualified name, not the packet object: an op defined again under the same name
        # (a module imported twice, once by path and once by package) gets new packet objects.
        address = _compat.op_address(node.target) if node.op == "call_function" else None
        return address is not None and f"{address[0]}::{address[1]}" == self.name

    def check(self, node: fx.Node, ctx: MixerCheck) -> DeclaredSite | None:
        where = f"{self.name} in module {ctx.module!r}"
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor):
            raise SequenceParallelError(f"{where} returns {type(out).__name__}; a declared op returns one tensor")
        sd = self.seq_dim % out.dim()
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        sharded = [a for a in tensors if a in ctx.local or ctx.analysis.sdim.get(a) is not None]
        if not sharded:
            return None  # computed whole on every rank: runs as it is
        for a in sharded:
            if ctx.analysis.sdim.get(a) != self.seq_dim % a.meta["val"].dim():
                raise SequenceParallelError(f"{where}: its input {a.name} holds the sequence at dim {ctx.analysis.sdim.get(a)}, "
                                            f"not at seq_dim={self.seq_dim} as declared")
        t = ctx.analysis.seq_len
        if out.shape[sd] != t:
            raise SequenceParallelError(f"{where}: its output {tuple(out.shape)} has no sequence of {t} at seq_dim={self.seq_dim}")
        halo, channels = 0, 0
        if self.exchange is Exchange.HALO:
            halo = self.halo if isinstance(self.halo, int) else self.halo(*_vals(node.args), **_vals(node.kwargs))
            if not isinstance(halo, int) or halo < 0 or halo > t // ctx.size:
                raise SequenceParallelError(f"{where}: a halo of {halo!r} positions must be an int in [0, {t // ctx.size}] "
                                            f"(T/S = {t} / {ctx.size}: the halo comes from the left neighbour alone)")
        if self.exchange is Exchange.CHANNELS:
            channels = out.shape[self.channel_dim % out.dim()]
            if self.channel_dim % out.dim() == sd or channels % ctx.size:
                raise SequenceParallelError(f"{where}: channel_dim={self.channel_dim} holds {channels} channels, which "
                                            f"sequence_parallel.size={ctx.size} must divide (and not the sequence)")
        per_position = tuple(a.meta["val"].numel() // t * a.meta["val"].element_size() for a in sharded)
        dims = DeclaredOpDims(per_position, out.numel() // t * out.element_size(), t, halo)
        return DeclaredSite(dims, sd, channels)

    def exchange_bytes(self, site: DeclaredSite, strategy: str, size: int) -> float:
        return declared_exchange_bytes(site.dims, strategy, size)

    def choose(self, sites: Sequence[DeclaredSite], size: int) -> tuple[str, str]:
        return self.exchange.value, f"sequence parallelism: {self.exchange.value} for {self.name}, as declared"

    def accept(self, sites: Sequence[DeclaredSite], strategy: str, size: int) -> None:
        pass  # ``check`` refuses what the declared exchange cannot run

    def describe(self, sites: Sequence[DeclaredSite], strategy: str, size: int, seq_len: int) -> str:
        sent = sum(self.exchange_bytes(s, strategy, size) for s in sites)
        return (f"{len(sites)} {self.name} op(s) by {strategy} as declared: {format_bytes(sent)} sent per rank and step in all "
                "(NOTE [Declared sequence mixers] in passes/sequence/mixer_custom.py)")

    def zigzag_balances(self, graph: fx.Graph, strategy: str) -> bool:
        return False

    def rewrite(self, node: fx.Node, args: tuple, kwargs: dict, ctx: MixerRewrite) -> torch.Tensor:
        whole = node.meta["val"]
        sd = self.seq_dim % whole.dim()
        sharded = {i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and isinstance(args[i], torch.Tensor)
                   and args[i].shape != a.meta["val"].shape}
        if not sharded:
            return node.target(*args, **kwargs)
        args = list(args)
        if self.exchange is Exchange.HALO:
            halo = self.halo if isinstance(self.halo, int) else self.halo(*_vals(node.args), **_vals(node.kwargs))
            for i in sharded:
                args[i] = with_halo(args[i], halo, ctx, self.seq_dim % args[i].dim())
            out = node.target(*args, **kwargs)
            return out.narrow(sd, halo, out.shape[sd] - halo)
        if self.exchange is Exchange.GATHER:
            for i in sharded:
                x, d = args[i], self.seq_dim % args[i].dim()
                args[i] = from_all(x, ctx).movedim(0, d).flatten(d, d + 1)  # contiguous slices in rank order: the whole sequence
            out = node.target(*args, **kwargs)
            return torch.index_select(out, sd, ctx.positions(out))
        cd = self.channel_dim % whole.dim()
        first = args[min(sharded)]
        rank = rank_index(first, ctx, self.seq_dim % first.dim())  # (1,), read while the inputs are this rank's slices
        for i in sharded:
            x = args[i]
            d, c = self.seq_dim % x.dim(), self.channel_dim % x.dim()
            args[i] = seq_to_channels(x.movedim((c, d), (-2, -1)), ctx).movedim((-2, -1), (c, d))
        for i, c in self.per_channel.items():
            w = args[i]
            c = c % w.dim()
            args[i] = w.unflatten(c, (ctx.size, -1)).index_select(c, rank).squeeze(c)  # this rank's C/S channels
        out = node.target(*args, **kwargs)  # (…, C/S, …, T, …)
        return channels_to_seq(out.movedim((cd, sd), (-2, -1)), ctx).movedim((-2, -1), (cd, sd))

    def op_exchanges(self, node: fx.Node) -> tuple[tuple[str, int], ...]:
        return ()  # the exchanges are all-to-alls in the graph


def _vals(args: Any) -> Any:
    """The node's arguments with each node as its fake value."""
    return fx.node.map_arg(args, lambda a: a.meta["val"])


# NOTE [Declared sequence mixers]: the ops users declared, by qualified name, asked after ``MIXERS``.
_DECLARED: dict[str, SequenceMixer] = {}


def register_sequence_mixer(mixer: SequenceMixer) -> SequenceMixer:
    """Declare how an op zerofx does not know shards along the sequence: an ``OpSequenceMixer``,
    or any object with the ``SequenceMixer`` protocol (passes/sequence/sequence_mixers.py). Registering
    the same name again replaces it. Returns ``mixer``."""
    missing = [a for a in ("name", "strategies", "matches", "check", "rewrite", "describe", "exchange_bytes", "choose",
                           "accept", "zigzag_balances", "op_exchanges", "runs_zigzag", "supports") if not hasattr(mixer, a)]
    if missing:
        raise ZeroFXError(f"register_sequence_mixer: {mixer!r} is not a SequenceMixer (it lacks {', '.join(missing)}); "
                          "declare a torch.library op with zerofx.OpSequenceMixer(op, exchange=...)")
    _DECLARED[mixer.name] = mixer
    return mixer


def unregister_sequence_mixer(name: str) -> None:
    """Forget the declaration registered under ``name`` (an op's ``namespace::name``)."""
    if _DECLARED.pop(name, None) is None:
        raise ZeroFXError(f"unregister_sequence_mixer: no declared mixer {name!r}; declared: {', '.join(_DECLARED) or 'none'}")


def declared_mixers() -> tuple[SequenceMixer, ...]:
    """The registered declarations, in the order they were registered."""
    return tuple(_DECLARED.values())


def declared_cache_keys() -> list[str]:
    """Each registered declaration as text the same in every process, for the plan cache's key."""
    return [m.cache_key() if isinstance(m, OpSequenceMixer) else f"{type(m).__module__}.{type(m).__qualname__} {m.name}"
            for m in _DECLARED.values()]
