"""The offload plans' types: which tier holds each optimizer-state record and in what order
the step swaps them in (``OffloadPlan``, from ``plan_offload``), and which tier holds each
stage-3 parameter shard between uses (``ParamOffloadPlan``, from ``plan_param_offload``); both
planners are in passes/memory/plan_offload.py. The runtime follows them and ``zerofx plan``
prints them.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

# The Tier enum is the one vocabulary of tiers (config schema, cost models, runtime backends);
# cost_models/tiers.py (and its package's __init__) import nothing, so the plan types still import no
# cost model and no torch through it.
from zerofx.cost_models.tiers import Tier
from zerofx.common.units import format_bytes

FASTEST_FIRST = (Tier.DEVICE, Tier.CPU, Tier.NVME)


class Placement(str, enum.Enum):
    """How the shards' tiers were chosen (NOTE [Placing shards by their cost per step])."""

    FIRST_FIT = "first_fit"  # largest first onto the fastest tier with room
    BANDWIDTH = "bandwidth"  # most exposed seconds saved per byte first
    BEST = "best"  # the planner's choice: whichever of the two the fetch timeline predicts faster


class _TierPlacement:
    """What both placements answer: the tier of a tensor, the tensors on a tier and their bytes.
    Subclasses are frozen dataclasses with ``tiers`` and ``_SIZES`` naming their (fqn, bytes) field."""

    tiers: tuple[tuple[str, Tier], ...]
    _SIZES: str

    def tier_of(self, fqn: str) -> Tier:
        for f, t in self.tiers:
            if f == fqn:
                return t
        raise KeyError(fqn)

    def fqns_on(self, tier: Tier) -> tuple[str, ...]:
        return tuple(f for f, t in self.tiers if t is tier)

    def bytes_on(self, tier: Tier) -> int:
        sizes = dict(getattr(self, self._SIZES))
        return sum(sizes[f] for f in self.fqns_on(tier))

    def to_json(self) -> str:
        d = asdict(self)
        d["tiers"] = [[f, t.value] for f, t in self.tiers]
        d["estimates"] = dict(d["estimates"])
        return json.dumps(d, indent=1, sort_keys=True)


@dataclass(frozen=True)
class OffloadPlan(_TierPlacement):
    """Per-parameter tiers, the update (swap-in) order, and the estimates that justified them."""

    tiers: tuple[tuple[str, Tier], ...]  # (fqn, tier), in update order
    record_bytes: tuple[tuple[str, int], ...]  # (fqn, bytes of its record), in update order
    buffer_count: int
    delayed_update: bool
    # Seconds per step: the whole optimizer step, its updates, all record I/O, and the I/O the
    # step waits for (the rest is hidden).
    estimates: Mapping[str, float]
    _SIZES = "record_bytes"

    @property
    def update_order(self) -> tuple[str, ...]:
        return tuple(f for f, _ in self.tiers)

    @classmethod
    def from_json(cls, text: str) -> OffloadPlan:
        d = json.loads(text)
        return cls(
            tiers=tuple((f, Tier(t)) for f, t in d["tiers"]),
            record_bytes=tuple((f, int(b)) for f, b in d["record_bytes"]),
            buffer_count=d["buffer_count"],
            delayed_update=d["delayed_update"],
            estimates=d["estimates"],
        )

    def __str__(self) -> str:
        from tabulate import tabulate


        e = self.estimates
        rows = [(t.value, len(self.fqns_on(t)), format_bytes(self.bytes_on(t))) for t in FASTEST_FIRST]
        lines = [
            f"offload: optimizer-state records per tier, {self.buffer_count} NVMe buffers"
            + (", one-step delayed update" if self.delayed_update else ""),
            tabulate(rows, headers=["tier", "tensors", "bytes per rank"], tablefmt="simple"),
            f"optimizer step {e['step_s'] * 1e3:.1f} ms: updates {e['update_s'] * 1e3:.1f} ms, record I/O "
            f"{e['io_s'] * 1e3:.1f} ms per step, of which hidden {e['hidden_io_s'] * 1e3:.1f} ms and "
            f"exposed {e['exposed_io_s'] * 1e3:.1f} ms",
        ]
        return "\n".join(lines)


@dataclass(frozen=True)
class ParamOffloadPlan(_TierPlacement):
    """Per-shard tiers at stage 3 (``offload_param``), in model order, and the estimated I/O.

    Shards on ``Tier.CPU`` or ``Tier.NVME`` are *offloaded*: ``fetch_params_pass`` makes the
    graphs fetch them right before their bucket's all-gather. ``Tier.DEVICE`` shards stay in the
    engine's flat buffer as without offload."""

    tiers: tuple[tuple[str, Tier], ...]  # (fqn, tier), model order
    shard_bytes: tuple[tuple[str, int], ...]
    buffer_count: int
    # Seconds per step (forward + backward reads, write-backs; exposed = waited for), and the
    # exposed seconds each placement was predicted to cost (``first_fit_exposed_io_s``,
    # ``bandwidth_exposed_io_s``).
    estimates: Mapping[str, float]
    placement: Placement = Placement.FIRST_FIT  # which placement ``tiers`` is
    _SIZES = "shard_bytes"

    @property
    def offloaded(self) -> frozenset[str]:
        return frozenset(f for f, t in self.tiers if t is not Tier.DEVICE)

    @classmethod
    def from_json(cls, text: str) -> ParamOffloadPlan:
        d = json.loads(text)
        return cls(
            tiers=tuple((f, Tier(t)) for f, t in d["tiers"]),
            shard_bytes=tuple((f, int(b)) for f, b in d["shard_bytes"]),
            buffer_count=d["buffer_count"],
            estimates=d["estimates"],
            placement=Placement(d.get("placement", Placement.FIRST_FIT.value)),
        )

    def __str__(self) -> str:
        from tabulate import tabulate


        e = self.estimates
        rows = [(t.value, len(self.fqns_on(t)), format_bytes(self.bytes_on(t))) for t in FASTEST_FIRST]
        lines = [
            f"offload_param: parameter shards per tier, {self.buffer_count} NVMe reads ahead",
            tabulate(rows, headers=["tier", "shards", "bytes per rank"], tablefmt="simple"),
            f"parameter I/O {e['io_s'] * 1e3:.3g} ms per step (reads {e['read_s'] * 1e3:.3g} ms in forward and backward, "
            f"write-backs {e['write_s'] * 1e3:.3g} ms), of which hidden {e['hidden_io_s'] * 1e3:.3g} ms and exposed "
            f"{e['exposed_io_s'] * 1e3:.3g} ms",
        ]
        if "first_fit_exposed_io_s" in e:
            ff, bw = e["first_fit_exposed_io_s"], e["bandwidth_exposed_io_s"]
            chosen = "cost per step (bandwidth-centric)" if self.placement is Placement.BANDWIDTH else "first-fit decreasing"
            lines.append(f"placement: {chosen}; predicted exposed parameter I/O {bw * 1e3:.3g} ms per step by cost per step, "
                         f"{ff * 1e3:.3g} ms by first-fit decreasing")
        return "\n".join(lines)
