"""The typed offload options ``parse_config`` builds from ``zero_optimization.offload_optimizer``,
``zero_optimization.offload_param`` and ``zerofx.offload``: below the config and the rest of the offload
runtime, so both import them (NOTE [Layers] in pyproject.toml)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofx.cost_models.offload import TierSpec
from zerofx.cost_models.tiers import NO_OFFLOAD, OFFLOAD_TIERS, Tier
from zerofx.common.errors import ConfigError

# Defaults when the config gives no measured bandwidth: a PCIe 4 x16 link (host <-> device) and
# a datacenter NVMe drive; `zerofx.offload.*_bytes_per_s` overrides them.
DEFAULT_HOST_COPY_BYTES_PER_S = 12e9
DEFAULT_NVME_READ_BYTES_PER_S = 3e9
DEFAULT_NVME_WRITE_BYTES_PER_S = 1.5e9

# "cpu or nvme": the tiers a ``device`` key may name, as its messages list them.
_OFFLOAD_TIER_NAMES = " or ".join(t.value for t in OFFLOAD_TIERS)


@dataclass(frozen=True)
class OffloadOptions:
    """What the config asks for (``zero_optimization.offload_optimizer`` and ``zerofx.offload``)."""

    device: Tier  # the slowest tier records may go to: CPU or NVME
    nvme_path: Path | None
    pin_memory: bool
    buffer_count: int
    ratio: float
    delayed_update: bool
    device_budget_bytes: float | None
    cpu_budget_bytes: float | None
    host_copy_bytes_per_s: float
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> OffloadOptions | None:
        """None when optimizer offload is off. ``ConfigError`` for settings that contradict."""
        zero = raw.get("zero_optimization", {})
        own = raw.get("zerofx", {}).get("offload", {})
        section = zero.get("offload_optimizer", {})
        device = section.get("device", NO_OFFLOAD)
        if device == NO_OFFLOAD:
            if own and zero.get("offload_param", {}).get("device", NO_OFFLOAD) == NO_OFFLOAD:
                raise ConfigError(f"zerofx.offload is set but zero_optimization.offload_optimizer.device is not; set it to {_OFFLOAD_TIER_NAMES}")
            return None
        if Tier(device) is Tier.NVME and not section.get("nvme_path"):
            raise ConfigError("zero_optimization.offload_optimizer.device is nvme but nvme_path is missing; accepted: a writable folder")
        ratio = float(section.get("ratio", 1.0))
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError(f"config key 'zero_optimization.offload_optimizer.ratio' got {ratio!r}; accepted: a number in [0, 1]")
        return cls(
            device=Tier(device),
            nvme_path=Path(section["nvme_path"]) if section.get("nvme_path") else None,
            pin_memory=bool(section.get("pin_memory", False)),
            buffer_count=int(section.get("buffer_count", 4)),
            ratio=ratio,
            delayed_update=bool(own.get("delayed_update", False)),
            device_budget_bytes=own.get("device_budget_bytes"),
            cpu_budget_bytes=own.get("cpu_budget_bytes"),
            host_copy_bytes_per_s=float(own.get("host_copy_bytes_per_s", DEFAULT_HOST_COPY_BYTES_PER_S)),
            nvme_read_bytes_per_s=float(own.get("nvme_read_bytes_per_s", DEFAULT_NVME_READ_BYTES_PER_S)),
            nvme_write_bytes_per_s=float(own.get("nvme_write_bytes_per_s", DEFAULT_NVME_WRITE_BYTES_PER_S)),
        )

    @classmethod
    def on_device(cls) -> OffloadOptions:
        """Every record on the device: what the engine uses when only ``offload_param`` is set, so
        that one optimizer streams the offloaded shards through the update (NOTE [Stepping
        offloaded shards]; ``parse_config`` refuses ``delayed_update`` then)."""
        return cls(
            device=Tier.CPU, nvme_path=None, pin_memory=False, buffer_count=1, ratio=0.0, delayed_update=False,
            device_budget_bytes=None, cpu_budget_bytes=0.0, host_copy_bytes_per_s=DEFAULT_HOST_COPY_BYTES_PER_S,
            nvme_read_bytes_per_s=DEFAULT_NVME_READ_BYTES_PER_S, nvme_write_bytes_per_s=DEFAULT_NVME_WRITE_BYTES_PER_S,
        )

    def tier_specs(self, total_bytes: int, *, device_is_cpu: bool) -> dict[Tier, TierSpec]:
        """Budgets and bandwidths per tier. The device keeps ``(1 - ratio)`` of the records unless
        ``device_budget_bytes`` says otherwise; host memory is unbounded when it is the slowest
        tier, else it holds ``cpu_budget_bytes`` (default 0); NVMe is unbounded."""
        device_budget = self.device_budget_bytes if self.device_budget_bytes is not None else (1.0 - self.ratio) * total_bytes
        copy = math.inf if device_is_cpu else self.host_copy_bytes_per_s
        if self.device is Tier.CPU:
            cpu_budget = self.cpu_budget_bytes if self.cpu_budget_bytes is not None else math.inf
        else:
            cpu_budget = self.cpu_budget_bytes if self.cpu_budget_bytes is not None else 0.0
        tiers = {Tier.DEVICE: TierSpec(device_budget, math.inf, math.inf), Tier.CPU: TierSpec(cpu_budget, copy, copy)}
        if self.device is Tier.NVME:
            tiers[Tier.NVME] = TierSpec(math.inf, self.nvme_read_bytes_per_s, self.nvme_write_bytes_per_s)
        return tiers



DEFAULT_PARAM_BUFFER_COUNT = 5  # DeepSpeed's offload_param.buffer_count default


@dataclass(frozen=True)
class ParamOffloadOptions:
    """What ``zero_optimization.offload_param`` asks for (bandwidths from ``zerofx.offload``)."""

    device: Tier  # CPU or NVME
    nvme_path: Path | None
    pin_memory: bool
    buffer_count: int
    max_in_cpu: float  # elements per rank kept in host memory with device nvme
    host_copy_bytes_per_s: float
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> ParamOffloadOptions | None:
        """None when parameter offload is off. ``ConfigError`` for settings that contradict."""
        section = raw.get("zero_optimization", {}).get("offload_param", {})
        own = raw.get("zerofx", {}).get("offload", {})
        device = section.get("device", NO_OFFLOAD)
        if device == NO_OFFLOAD:
            return None
        if Tier(device) is Tier.NVME and not section.get("nvme_path"):
            raise ConfigError("zero_optimization.offload_param.device is nvme but nvme_path is missing; accepted: a writable folder")
        return cls(
            device=Tier(device),
            nvme_path=Path(section["nvme_path"]) if section.get("nvme_path") else None,
            pin_memory=bool(section.get("pin_memory", False)),
            buffer_count=int(section.get("buffer_count", DEFAULT_PARAM_BUFFER_COUNT)),
            max_in_cpu=float(section.get("max_in_cpu", 0)),
            host_copy_bytes_per_s=float(own.get("host_copy_bytes_per_s", DEFAULT_HOST_COPY_BYTES_PER_S)),
            nvme_read_bytes_per_s=float(own.get("nvme_read_bytes_per_s", DEFAULT_NVME_READ_BYTES_PER_S)),
            nvme_write_bytes_per_s=float(own.get("nvme_write_bytes_per_s", DEFAULT_NVME_WRITE_BYTES_PER_S)),
        )

    def tier_specs(self, itemsize: int, *, device_is_cpu: bool) -> dict[Tier, TierSpec]:
        """Nothing stays on the device (DeepSpeed offloads every sharded parameter). Host memory
        holds everything with device cpu, ``max_in_cpu`` elements with nvme; NVMe the rest."""
        copy = math.inf if device_is_cpu else self.host_copy_bytes_per_s
        cpu_budget = math.inf if self.device is Tier.CPU else self.max_in_cpu * itemsize
        tiers = {Tier.DEVICE: TierSpec(0.0, math.inf, math.inf), Tier.CPU: TierSpec(cpu_budget, copy, copy)}
        if self.device is Tier.NVME:
            tiers[Tier.NVME] = TierSpec(math.inf, self.nvme_read_bytes_per_s, self.nvme_write_bytes_per_s)
        return tiers


DEFAULT_GRAD_BUFFER_COUNT = 4


@dataclass(frozen=True)
class GradOffloadOptions:
    """What ``zerofx.offload_gradients`` asks for: where each reduced gradient shard goes once
    its bucket's reduction completes in the backward graph (DeepSpeed has no key of its own for
    this; its gradients follow ``offload_optimizer``). Stages 2-3 only, where a rank's gradients
    are shards."""

    device: Tier  # CPU or NVME
    nvme_path: Path | None
    pin_memory: bool
    buffer_count: int  # NVMe: gradient reads ahead of the update, and accumulations in flight

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], *, stage: int | None) -> GradOffloadOptions | None:
        """None when gradient offload is off. ``ConfigError`` naming both keys for settings that
        contradict (``stage`` is the resolved ZeRO stage, None when not known yet)."""
        section = raw.get("zerofx", {}).get("offload_gradients", {})
        device = section.get("device", NO_OFFLOAD)
        if device == NO_OFFLOAD:
            return None
        check_grad_offload_stage(device, stage)
        if Tier(device) is Tier.NVME and not section.get("nvme_path"):
            raise ConfigError("zerofx.offload_gradients.device is nvme but zerofx.offload_gradients.nvme_path is missing; "
                              "accepted: a writable folder")
        return cls(
            device=Tier(device),
            nvme_path=Path(section["nvme_path"]) if section.get("nvme_path") else None,
            pin_memory=bool(section.get("pin_memory", False)),
            buffer_count=int(section.get("buffer_count", DEFAULT_GRAD_BUFFER_COUNT)),
        )


def check_grad_offload_stage(device: str, stage: int | None) -> None:
    """Gradient offload against the resolved ZeRO stage (None: not known yet)."""
    if stage is not None and stage < 2:
        raise ConfigError(
            f"zerofx.offload_gradients.device is {device} but zero_optimization.stage is {stage}; gradients are "
            f"sharded only at stages 2 and 3: set stage 2 or 3, or offload_gradients.device {NO_OFFLOAD}"
        )
