"""The seam through which sequence parallelism shards an op that mixes positions: the
``SequenceMixer`` protocol, what a mixer reads while planning and rewriting, and the
all-to-all over the sequence group that mixers and the rewrite share.

Read by passes/sequence/sequence_parallel.py, whose ``MIXERS`` tuple lists the mixers; the first
implementation is attention (passes/sequence/mixer_attention.py). Reads and writes no node meta.

NOTE [Sequence mixers]
Token-wise ops run on each rank's slice as they are (NOTE [Sequence parallelism as a rewrite]);
an op that reads the sequence axis across positions runs sharded only through a mixer. ``MIXERS``
in passes/sequence/sequence_parallel.py is one ordered tuple, and the first mixer whose ``matches``
accepts a node owns it. ``plan_sequence_parallel`` calls the owner's ``check`` on each node it
owns, which returns what the mixer needs of the node (its site: shapes, refusals; None where the
node adds no site of its own, such as a convolution's pad) or raises
``SequenceParallelError`` naming the op and its module; it then resolves the mixer's strategy
from ``sequence_parallel.mixers.<name>`` (``"auto"``: the mixer's ``choose``, from its
``exchange_bytes`` per rank in cost_models/sequence.py, summed by ``bytes_by_strategy``), lets the mixer refuse a site the
strategy cannot run (``accept``), and records the strategy and the mixer's ``describe`` in the
plan's decisions. The rewrite calls the owner's ``rewrite`` for each node it owns, with the
sequence-sharded inputs as this rank's slices, and the value it returns is this rank's slice of
the output. A node no mixer owns that reads a sharded value across positions is refused with
the ops that are supported (the token-wise ops, each mixer's ``supports``, the loss). A mixer that needs the sequence cut another way than in contiguous
slices says so in ``zigzag_balances`` (NOTE [Zigzag layout for causal rings]). The plan's
schedule (passes/analysis/analyze_schedule.py) sees a mixer's exchanges in the graph it traces: each
``all_to_all`` below is a collective of its bytes there; sends inside an op of the mixer's own
(ring attention's point-to-point steps) are what its ``op_exchanges`` returns for a node of the
compiled graph, which the schedule asks every mixer of ``MIXERS``. A mixer whose exchanges assume
rank r holds the r-th contiguous slice (a halo from the left neighbour, a state passed in rank
order) says ``runs_zigzag = False``, and the layout stays contiguous whenever it is in the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx

from zerofx.passes import _compat
from zerofx.passes.sequence.seq_regions import SeqAnalysis

@dataclass(frozen=True)
class MixerCheck:
    """What ``SequenceMixer.check`` reads of the analysed forward for one node."""

    analysis: SeqAnalysis  # the sequence axis of every node (NOTE [Sequence dimension propagation])
    local: Set[fx.Node]  # the nodes held as this rank's slice
    size: int  # ranks of the sequence group
    module: str  # the node's module, for the errors (NOTE [Naming a node by its module])


@dataclass(frozen=True)
class MixerRewrite:
    """What ``SequenceMixer.rewrite`` reads while the forward is traced again for one rank."""

    strategy: str  # as the plan resolved it
    size: int
    group_name: str  # the sequence group the collectives run over
    zigzag: bool  # the ranks hold the zigzag layout (NOTE [Zigzag layout for causal rings])
    whole: Callable[[fx.Node], Any]  # a node's value as computed whole on every rank (inputs, masks)
    positions: Callable[[torch.Tensor], torch.Tensor]  # this rank's sequence positions, on the device of the tensor given


class SequenceMixer(Protocol):
    """One op class that mixes positions and the ways it runs on a sequence-sharded forward."""

    name: str  # the op class: its key under ``sequence_parallel.mixers``
    strategies: tuple[str, ...]  # the ways it shards, the default first; ``"auto"`` picks among them
    doc: str  # the config key's meaning
    supports: str  # the ops it owns, as the refusal of an op no mixer owns lists what is supported
    runs_zigzag: bool  # whether its rewrite is correct on the zigzag layout (NOTE [Zigzag layout for causal rings])

    def matches(self, node: fx.Node) -> bool:
        """Whether this mixer owns ``node``."""
        ...

    def check(self, node: fx.Node, ctx: MixerCheck) -> Any:
        """The node's site (what ``choose``, ``accept`` and ``describe`` read), or raise
        ``SequenceParallelError`` naming the op and ``ctx.module`` when no strategy can shard it;
        None for a node the plan counts no site for (one off the sharded sequence, an output of a
        multi-output op, or one part of another node's site, such as a convolution's pad)."""
        ...

    def exchange_bytes(self, site: Any, strategy: str, size: int) -> float:
        """Bytes one rank sends for the site's forward and backward under ``strategy``, from the
        mixer's formulas in cost_models/sequence.py."""
        ...

    def choose(self, sites: Sequence[Any], size: int) -> tuple[str, str]:
        """``"auto"``: the strategy for these sites, and the decision saying why (by
        ``bytes_by_strategy``, where bytes decide)."""
        ...

    def accept(self, sites: Sequence[Any], strategy: str, size: int) -> None:
        """Raise ``SequenceParallelError`` for a site ``strategy`` cannot run, naming what can."""
        ...

    def describe(self, sites: Sequence[Any], strategy: str, size: int, seq_len: int) -> str:
        """The plan's words for these sites under ``strategy``: how many, and what each exchanges."""
        ...

    def zigzag_balances(self, graph: fx.Graph, strategy: str) -> bool:
        """Whether the zigzag layout evens out this mixer's work over the ranks of ``graph``."""
        ...

    def rewrite(self, node: fx.Node, args: tuple, kwargs: dict, ctx: MixerRewrite) -> Any:
        """This rank's slice of ``node``'s output, from its arguments as this rank holds them."""
        ...

    def op_exchanges(self, node: fx.Node) -> tuple[tuple[str, int], ...]:
        """For a node of the compiled (post-autograd) graph: the blocking sends one rank makes
        inside it, in order, as (name, bytes); () for a node that is not the mixer's own op. The
        schedule times each as one send to a neighbour."""
        ...


def all_to_all(x: torch.Tensor, size: int, group_name: str, *, grad: bool) -> torch.Tensor:
    """Rank r's chunk j of ``x`` (dim 0, ``size`` equal chunks) goes to rank j, as chunk r."""
    splits = [x.shape[0] // size] * size
    return _compat.WAIT((_compat.ALL_TO_ALL_AUTOGRAD if grad else _compat.ALL_TO_ALL)(x, splits, splits, group_name))


def bytes_by_strategy(mixer: SequenceMixer, sites: Sequence[Any], size: int) -> dict[str, float]:
    """What one rank sends for all of ``sites`` under each of ``mixer``'s strategies, in their
    order: what a ``choose`` that goes by bytes compares."""
    return {strategy: sum(mixer.exchange_bytes(site, strategy, size) for site in sites) for strategy in mixer.strategies}
