"""DeepSpeed's learning-rate schedulers as the config states them: the parsed ``SchedulerSpec``.

``SchedulerSpec.from_config(section)`` reads a config's ``"scheduler"`` section and refuses, with a
``ConfigError`` naming the key, anything DeepSpeed would refuse or silently misread: a missing or
unknown ``type``, a key the type does not take, a missing required key, a value out of range.
The learning rate each step gets is ``zerofx.runtime.schedulers.lr_at``.

NOTE [Scheduler keys, as DeepSpeed takes them]
DeepSpeed builds a scheduler as ``cls(optimizer, **params)``, so the keys each type accepts are its
constructor's arguments (``deepspeed/runtime/lr_schedules.py``) and any other key is a
``TypeError`` there. ``WarmupDecayLR`` and ``WarmupCosineLR`` take ``total_num_steps`` with no
default: without it DeepSpeed fails, and zerofx used to decay to 0 right after the warm-up. Both
types also need ``total_num_steps > warmup_num_steps``: at equality the decay has no steps
(DeepSpeed's cosine divides by zero), below it the decay never starts (DeepSpeed only warns).
``warmup_num_steps`` defaults to 1000, so a short ``total_num_steps`` without it is refused, and
the message says that the 1000 is the default. OneCycle and LRRangeTest are not implemented: they
are refused by name with the list of accepted types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from zerofx.common.errors import ConfigError
from zerofx.config.options import is_finite_number


class SchedulerType(Enum):
    """The ``scheduler.type`` values zerofx implements (DeepSpeed's class names)."""

    WARMUP_LR = "WarmupLR"
    WARMUP_DECAY_LR = "WarmupDecayLR"
    WARMUP_COSINE_LR = "WarmupCosineLR"


class WarmupType(Enum):
    """The warm-up curve (``scheduler.params.warmup_type``)."""

    LOG = "log"
    LINEAR = "linear"


SCHEDULER_TYPES = tuple(t.value for t in SchedulerType)

# The keys each type takes, in DeepSpeed's argument order (NOTE [Scheduler keys, as DeepSpeed takes them]).
# last_batch_iteration is accepted by every type and read, not acted on (the engine keeps the step).
SCHEDULER_PARAMS: dict[SchedulerType, tuple[str, ...]] = {
    SchedulerType.WARMUP_LR: ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    SchedulerType.WARMUP_DECAY_LR: ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                    "last_batch_iteration"),
    SchedulerType.WARMUP_COSINE_LR: ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                                     "last_batch_iteration"),
}
_DECAYS = (SchedulerType.WARMUP_DECAY_LR, SchedulerType.WARMUP_COSINE_LR)  # these need total_num_steps
DEFAULT_WARMUP_NUM_STEPS = 1000  # DeepSpeed's default


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad(key: str, value: Any, accepted: str) -> ConfigError:
    return ConfigError(f"config key 'scheduler.params.{key}' got {value!r}; accepted: {accepted}")


@dataclass(frozen=True)
class SchedulerSpec:
    """A validated ``scheduler`` section. Fields a type does not take keep their defaults and are
    left out of ``to_json``."""

    type: SchedulerType
    warmup_num_steps: int = DEFAULT_WARMUP_NUM_STEPS
    warmup_type: WarmupType = WarmupType.LOG
    warmup_min_lr: float = 0.0  # WarmupLR, WarmupDecayLR
    warmup_max_lr: float = 0.001  # WarmupLR, WarmupDecayLR
    total_num_steps: int | None = None  # WarmupDecayLR, WarmupCosineLR: required
    warmup_min_ratio: float = 0.0  # WarmupCosineLR
    cos_min_ratio: float = 0.0001  # WarmupCosineLR

    def __post_init__(self) -> None:
        if not isinstance(self.type, SchedulerType):
            raise ConfigError(f"config key 'scheduler.type' got {self.type!r}; accepted: {', '.join(SCHEDULER_TYPES)}")
        if not isinstance(self.warmup_type, WarmupType):
            raise _bad("warmup_type", self.warmup_type, "log or linear")
        if not _is_int(self.warmup_num_steps) or self.warmup_num_steps < 0:
            raise _bad("warmup_num_steps", self.warmup_num_steps, "an integer >= 0")
        for key in ("warmup_min_lr", "warmup_max_lr"):
            v = getattr(self, key)
            if not is_finite_number(v) or v < 0:
                raise _bad(key, v, "a finite number >= 0")
        for key in ("warmup_min_ratio", "cos_min_ratio"):
            v = getattr(self, key)
            if not is_finite_number(v) or not 0 <= v <= 1:
                raise _bad(key, v, "a number in [0, 1]")
        if self.type in _DECAYS:
            if self.total_num_steps is None:
                raise ConfigError(
                    f"scheduler type {self.type.value} needs 'scheduler.params.total_num_steps' (DeepSpeed requires it too); "
                    f"accepted: an integer > warmup_num_steps ({self.warmup_num_steps})"
                )
            if not _is_int(self.total_num_steps) or self.total_num_steps <= self.warmup_num_steps:
                raise _bad("total_num_steps", self.total_num_steps, f"an integer > warmup_num_steps ({self.warmup_num_steps}"
                           f"{', the default' if self.warmup_num_steps == DEFAULT_WARMUP_NUM_STEPS else ''}), so that the decay has steps")
        elif self.total_num_steps is not None:
            raise ConfigError(f"config key 'scheduler.params.total_num_steps' does not apply to scheduler type {self.type.value}; "
                              f"accepted for {self.type.value}: {', '.join(SCHEDULER_PARAMS[self.type])}")

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> SchedulerSpec:
        """The spec of a config's ``scheduler`` section: ``{"type": ..., "params": {...}}``."""
        if not isinstance(section, Mapping):
            raise ConfigError(f"config key 'scheduler' must be an object, got {section!r}")
        unknown = sorted(set(section) - {"type", "params"})
        if unknown:
            raise ConfigError(f"unknown config key 'scheduler.{unknown[0]}'; accepted keys here: params, type")
        if "type" not in section:
            raise ConfigError(f"config key 'scheduler.type' is missing (the section has {sorted(section)}); "
                              f"accepted: {', '.join(SCHEDULER_TYPES)}, or no scheduler section")
        name = section["type"]
        if name not in SCHEDULER_TYPES:
            raise ConfigError(f"config key 'scheduler.type' got {name!r}; accepted: {', '.join(SCHEDULER_TYPES)}")
        kind = SchedulerType(name)
        params = section.get("params", {})
        if not isinstance(params, Mapping):
            raise ConfigError(f"config key 'scheduler.params' must be an object, got {params!r}")
        for key in params:
            if key not in SCHEDULER_PARAMS[kind]:
                raise ConfigError(f"config key 'scheduler.params.{key}' does not apply to scheduler type {name}; "
                                  f"accepted for {name}: {', '.join(SCHEDULER_PARAMS[kind])}")
        kwargs = {k: v for k, v in params.items() if k != "last_batch_iteration"}
        if "warmup_type" in kwargs:
            if kwargs["warmup_type"] not in {w.value for w in WarmupType}:
                raise _bad("warmup_type", kwargs["warmup_type"], "log or linear")
            kwargs["warmup_type"] = WarmupType(kwargs["warmup_type"])
        return cls(type=kind, **kwargs)

    def to_json(self) -> dict[str, Any]:
        """``{"type": ..., "params": {...}}`` with every key the type takes, defaults filled in
        (rates and ratios as floats, so 0 and 0.0 agree)."""
        params: dict[str, Any] = {}
        for key in SCHEDULER_PARAMS[self.type]:
            if key == "last_batch_iteration":
                continue
            v = getattr(self, key)
            params[key] = v.value if isinstance(v, Enum) else v if key.endswith("_steps") else float(v)
        return {"type": self.type.value, "params": params}
