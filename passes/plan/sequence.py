"""The sequence-parallel plan's types and the config's words for the bundled mixers.

``SequenceParallelSpec`` is what ``zerofx.sequence_parallel`` asks for, ``SequenceParallelPlan``
what ``plan_sequence_parallel`` (passes/sequence/sequence_parallel.py) decided for one captured forward
(part of the ``Plan``, ``Plan.sequence_parallel``). ``MixerKey`` is what the config knows of each
bundled sequence mixer (NOTE [Sequence mixers]): the op class that names its key under
``sequence_parallel.mixers``, the strategies the key accepts (the default first; ``AUTO`` too)
and the key's meaning. The mixers in ``MIXERS`` take their name, strategies and doc from these
keys, so the config's schema and defaults read them without importing the mixers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

AUTO = "auto"  # every mixer accepts it: its ``choose`` picks one of its strategies


class SequenceAttention(enum.Enum):
    """The attention mixer's strategies, the default first."""

    ULYSSES = "ulysses"
    RING = "ring"


class ScanStrategy(enum.Enum):
    """The scan mixer's strategies, the default first."""

    STATE_PASSING = "state_passing"


@dataclass(frozen=True)
class MixerKey:
    """One bundled sequence mixer as the config names it."""

    name: str  # the op class: its key under ``sequence_parallel.mixers``
    strategies: tuple[str, ...]  # the ways it shards, the default first; ``AUTO`` picks among them
    doc: str  # the config key's meaning


ATTENTION_KEY = MixerKey(
    "attention", tuple(s.value for s in SequenceAttention),
    "how attention exchanges data: \"ulysses\" (all-to-all to head sharding, the default), \"ring\" (key/value blocks "
    "passed around the group, NOTE [Ring attention]) or \"auto\" (the one that sends fewer bytes, ring where the size "
    "does not divide the query heads)")
SHORT_CONV_KEY = MixerKey(
    "short_conv", ("halo",),
    "how a short causal depthwise conv1d along the sequence exchanges data: \"halo\" (the K-1 positions before each "
    "rank's slice from its left neighbour, one all-to-all; NOTE [Convolutions along the sequence]) or \"auto\" (the same)")
LONG_CONV_KEY = MixerKey(
    "long_conv", ("channels",),
    "how a long causal convolution by FFT exchanges data: \"channels\" (all-to-all to channel shards for the FFTs and "
    "back; NOTE [Convolutions along the sequence]) or \"auto\" (the same)")
CUMSUM_KEY = MixerKey(
    "cumsum", ("prefix",),
    "how a cumsum along the sequence exchanges data: \"prefix\" (each rank's slice totals to every rank, one all-to-all; "
    "NOTE [Convolutions along the sequence]) or \"auto\" (the same)")
SCAN_KEY = MixerKey(
    "scan", tuple(s.value for s in ScanStrategy),
    "how a selective scan (zerofx::selective_scan) exchanges data: \"state_passing\" (each rank's final state and "
    "decay to every rank, NOTE [Scan by state passing]) or \"auto\" (the same)")
FLIP_KEY = MixerKey(
    "flip", ("all_to_all",),
    "how a flip along the sequence exchanges data: \"all_to_all\" (two all-to-alls move each rank's flipped slice to "
    "rank S - 1 - r, NOTE [Flip along the sequence]) or \"auto\" (the same)")

# In the order of ``MIXERS`` (passes/sequence/sequence_parallel.py), which asserts that it lists these.
MIXER_KEYS: tuple[MixerKey, ...] = (ATTENTION_KEY, SHORT_CONV_KEY, LONG_CONV_KEY, CUMSUM_KEY, SCAN_KEY, FLIP_KEY)


class NamedMixer(Protocol):
    """What the spec and the plan read of a mixer: a ``SequenceMixer`` or its ``MixerKey``."""

    name: str
    strategies: tuple[str, ...]


@dataclass(frozen=True)
class SequenceParallelSpec:
    """What the config asks for, and the sequence group the collectives run over."""

    size: int
    mixers: tuple[tuple[str, str], ...] = ()  # (op class, strategy or "auto"); an op class left out runs by its mixer's default
    group_name: str = ""
    load_balance: bool = True  # zigzag layout for causal ring attention (NOTE [Zigzag layout for causal rings])

    def strategy(self, mixer: NamedMixer) -> str:
        """The strategy asked for ``mixer``: as given, else its default (the first of its strategies)."""
        return dict(self.mixers).get(mixer.name, mixer.strategies[0])


@dataclass(frozen=True)
class SequenceParallelPlan:
    """What ``plan_sequence_parallel`` decided for one captured forward; ``sequence_parallel_pass``
    applies it (finding the same ops again by the same analysis) and decides nothing."""

    size: int
    group_name: str
    seq_len: int
    strategies: tuple[tuple[str, str], ...]  # (op class, strategy as resolved) of every mixer whose ops the forward has
    loss_shift: int
    decisions: tuple[str, ...]
    zigzag: bool = False  # each rank holds chunks r and 2S - 1 - r of 2S (NOTE [Zigzag layout for causal rings])

    @property
    def local_len(self) -> int:
        return self.seq_len // self.size

    def strategy(self, mixer: NamedMixer) -> str:
        return dict(self.strategies)[mixer.name]
