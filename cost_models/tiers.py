"""The memory tiers a model state can live in, as the config spells them: what the cost models,
the config's schema and the runtime's tier backends all enumerate. A new tier is a member here
(and a backend in zerofx/runtime/offload/tiers.py, NOTE [Tier backends]); every list of tier names
derives from this enum."""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    """Where an optimizer-state record, parameter shard or gradient shard lives between uses. The
    values are the config's spellings (``zero_optimization.offload_optimizer.device`` and the
    other ``device`` keys), and the runtime gives each member a backend
    (``zerofx.runtime.offload.tiers``, NOTE [Tier backends])."""

    DEVICE = "device"
    CPU = "cpu"
    NVME = "nvme"


# The config's ``device`` keys name a tier to offload to, or ``NO_OFFLOAD`` to keep the state on
# the device: every tier but the device itself, whose config spelling is "none" (DeepSpeed's).
NO_OFFLOAD = "none"
OFFLOAD_TIERS: tuple[Tier, ...] = tuple(t for t in Tier if t is not Tier.DEVICE)
# The placement a state may be asked for: on the device ("none"), one offload tier, or "auto"
# (the planner picks the tier by bandwidth, NOTE [Placing model states by bandwidth]).
AUTO_PLACEMENT = "auto"
PLACEMENT_CHOICES: tuple[str, ...] = (NO_OFFLOAD, *(t.value for t in OFFLOAD_TIERS), AUTO_PLACEMENT)
