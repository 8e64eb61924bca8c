"""The recompute plan's types: the ``zerofx.recompute`` mode (``RecomputeMode``) and the
activations ``plan_recompute`` (passes/memory/plan_recompute.py) chose to recompute in backward
(``RecomputePlan``, NOTE [Selective activation recompute]). Part of the ``Plan``
(``Plan.recompute``).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

from zerofx.common.errors import PlanError
from zerofx.common.units import format_bytes


class RecomputeMode(str, enum.Enum):
    """``zerofx.recompute``: false (the partitioner's choice), "auto" (the fewest activations that
    fit ``zerofx.memory_budget``), true (every candidate)."""

    OFF = "off"
    AUTO = "auto"
    ALL = "all"

    @classmethod
    def from_config(cls, value: bool | str) -> RecomputeMode:
        if value is True:
            return cls.ALL
        if value is False:
            return cls.OFF
        if value == "auto":
            return cls.AUTO
        raise PlanError(f"zerofx.recompute {value!r} is not accepted; accepted: true, false or \"auto\"")


@dataclass(frozen=True)
class RecomputedActivation:
    """One saved activation recomputed in backward instead."""

    name: str  # the saved node of the captured joint graph
    what: str  # its op and shape, for the plan's table
    tagged: tuple[str, ...]  # the nodes tagged MUST_RECOMPUTE: the saved value and the views to its base
    bytes: int  # what the forward no longer saves
    # The device profile's estimate of rebuilding it alone (what ranks it), and of what it adds
    # to the candidates ranked before it (ops they rebuild already are not counted twice), so
    # that a plan's first n candidates sum to their recompute.
    alone_s: float
    recompute_s: float
    round: int = 1  # the round that found it (NOTE [Recompute in rounds])

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / max(self.alone_s, 1e-12)


@dataclass(frozen=True)
class RecomputePlan:
    """What ``recompute_activations_pass`` tags: the first ``len(activations)`` of ``candidates``
    candidates, which together save ``saved_bytes`` in the default partition."""

    mode: str
    activations: tuple[RecomputedActivation, ...]
    candidates: int
    saved_bytes: int

    @property
    def rounds(self) -> int:
        return max((a.round for a in self.activations), default=0)

    @property
    def recompute_s(self) -> float:
        return sum(a.recompute_s for a in self.activations)

    def tagged(self) -> frozenset[str]:
        return frozenset(n for a in self.activations for n in a.tagged)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecomputePlan:
        acts = tuple(RecomputedActivation(**{**a, "tagged": tuple(a["tagged"])}) for a in d["activations"])
        return cls(mode=d["mode"], activations=acts, candidates=d["candidates"], saved_bytes=d["saved_bytes"])

    def summary(self) -> str:
        # What the forward saves with these recomputed is the lowered graph's to say (``zerofx plan``'s
        # memory line): a candidate's bytes are what it held saved, and rebuilding it saves others
        # (NOTE [Recompute in rounds]).
        rounds = f" from {self.rounds} rounds" if self.rounds > 1 else ""
        return (f"recompute ({self.mode}): {len(self.activations)} of {self.candidates} candidates recomputed in backward{rounds}, "
                f"the default partition saving {format_bytes(self.saved_bytes)}; "
                f"predicted {_ms(self.recompute_s)} more compute per micro-step")

    def table(self, limit: int = 12) -> str:
        from tabulate import tabulate

        lines = [self.summary()]
        if self.activations:
            rows = [(a.name, a.what, a.round, format_bytes(a.bytes), _ms(a.recompute_s)) for a in self.activations[:limit]]
            lines.append(tabulate(rows, headers=["recomputed", "op and shape", "round", "held saved", "recompute"], tablefmt="simple"))
            if len(self.activations) > limit:
                lines.append(f"... {len(self.activations) - limit} more")
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
