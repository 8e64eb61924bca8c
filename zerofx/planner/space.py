"""What the whole-job search (``zerofx.planner.autoplan``) searches over: a ``Candidate``, the
``SearchSpace`` a config leaves open (``AutoOptions.fixed`` keeps the rest), a candidate written
into the user's config, and the model call resized to a candidate's micro-batch and length."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zerofx.common.errors import ZeroFXError
from zerofx.config import ZeroConfig
from zerofx.config.options import AutoOptions
from zerofx.cost_models.profiles import load_profile
from zerofx.cost_models.tiers import NO_OFFLOAD, Tier

# (micro-batch, seq_len) -> the model call's (args, kwargs) at that shape.
InputsAt = Callable[[int, int], tuple[tuple[Any, ...], Mapping[str, Any]]]
TILINGS = ("off", "auto", "on")
OFFLOADS = (NO_OFFLOAD, Tier.CPU.value)
# "off": the default min-cut saves; "auto": the fewest recomputed activations that fit the budget
# (NOTE [Selective activation recompute] in passes/memory/plan_recompute.py); "config": the config's own.
RECOMPUTES = ("off", "auto")
# "none": the graphs run as FX code in eager ATen; "inductor": compiled by Inductor, with torch's
# fused optimizer update where the optimizer has one (NOTE [Fused kernels under Inductor] in
# cost_models/compute.py); "config": the config's own zerofx.compile.
COMPILERS = ("none", "inductor")
FUSABLE_OPTIMIZERS = ("Adam", "AdamW")


def powers_of_two_dividing(n: int, *, start: int = 1) -> tuple[int, ...]:
    out, k = [], start
    while k <= n:
        if n % k == 0:
            out.append(k)
        k *= 2
    return tuple(out)


@dataclass(frozen=True)
class Candidate:
    """One configuration of the whole job."""

    stage: int
    sequence_parallel: int  # ranks per sequence group; 1: none
    shard_group_size: int | str  # K dividing the world size; "auto" when the config leaves K to the planner
    offload: str  # where the optimizer state lives: "none" or a tier ("cpu")
    tiling: str  # "off", "auto", "on", or "config" (the config's own zerofx.tiling)
    micro_batch: int  # sequences per rank per micro-step
    accumulation: int  # micro-steps per optimizer step
    recompute: str = "off"  # "off", "auto", or "config" (the config's own zerofx.recompute)
    compiler: str = "none"  # "none", "inductor", or "config" (the config's own zerofx.compile)

    @property
    def capture_group(self) -> tuple[int, int, str]:
        """What the capture depends on (NOTE [How the whole-job search prunes])."""
        return self.micro_batch, self.sequence_parallel, self.tiling

    def label(self) -> str:
        parts = [f"stage {self.stage}"]
        if self.sequence_parallel > 1:
            parts.append(f"sp {self.sequence_parallel}")
        parts.append(f"K {self.shard_group_size}")
        parts.append(f"offload {self.offload}")
        parts.append(f"tiling {self.tiling}")
        if self.recompute != "off":
            parts.append(f"recompute {self.recompute}")
        if self.compiler == "inductor":
            parts.append("inductor")
        parts.append(f"micro {self.micro_batch} x {self.accumulation}")
        return ", ".join(parts)


@dataclass(frozen=True)
class SearchSpace:
    """The values each dimension takes; one value where the config fixes it."""

    stages: tuple[int, ...]
    sequence_parallel: tuple[int, ...]
    shard_group_sizes: tuple[int | str, ...] | None  # None: every power of two >= 2 dividing the world size
    offloads: tuple[str, ...]
    tilings: tuple[str, ...]
    recomputes: tuple[str, ...]
    micro_batch: int | None  # None: searched (divisors of the sequences a data-parallel group takes per step)
    accumulation: int | None
    compilers: tuple[str, ...] = ("none",)


def search_space(cfg: ZeroConfig, auto: AutoOptions, *, world_size: int, seq_len: int, batch: int,
                 search_sequence_parallel: bool = True, search_batch: bool = True) -> SearchSpace:
    """What ``cfg`` leaves to the search: every dimension in ``auto.fixed`` (and sequence
    parallelism and the batch when their searches are off) keeps the config's value. Inductor is
    searched only where the profile measured what it keeps resident (``DeviceSpec.inductor_bytes``,
    ``zerofx calibrate``): without that figure its memory cannot be priced. The optimizer state is
    offloaded to host memory only where that is not the device's (NOTE [Host offload on a CPU
    rank] in cost_models/offload.py)."""
    fixed = auto.fixed
    stages = (cfg.stage,) if "stage" in fixed and cfg.stage is not None else (0, 1, 2, 3)
    if "sequence_parallel" in fixed or not search_sequence_parallel:
        sp: tuple[int, ...] = (1 if cfg.sequence_parallel is None else cfg.sequence_parallel.size,)
    else:
        sp = tuple(s for s in powers_of_two_dividing(world_size) if seq_len % s == 0)
    ks = (cfg.shard_group_size if cfg.shard_group_size is not None else world_size,) if "shard_group_size" in fixed else None
    device = load_profile(cfg.profile)[1]
    if "offload_optimizer" in fixed:
        offloads: tuple[str, ...] = (NO_OFFLOAD if cfg.offload is None else cfg.offload.device.value,)
    else:  # on a CPU rank host memory is the device's: offloading there frees nothing (NOTE [Host offload on a CPU rank])
        offloads = (NO_OFFLOAD,) if device.memory_is_host else OFFLOADS
    tilings = ("config",) if "tiling" in fixed else TILINGS
    recomputes = ("config",) if "recompute" in fixed else RECOMPUTES
    if "batch" in fixed or not search_batch:
        micro, accumulation = batch, cfg.gradient_accumulation_steps
    else:
        micro, accumulation = None, None
    if "compile" in fixed:
        compilers: tuple[str, ...] = ("config",)
    else:
        compilers = COMPILERS if device.inductor_bytes is not None else ("none",)
    return SearchSpace(stages, sp, ks, offloads, tilings, recomputes, micro, accumulation, compilers)


def candidate_config(base: ZeroConfig, c: Candidate, *, world_size: int, global_batch: int, fixed: frozenset[str]) -> ZeroConfig:
    """``base`` (the user's options, ``zerofx.auto`` left out) with ``c`` written in: the keys of
    the dimensions the search chose, set by ``ZeroConfig.with_keys``; those in ``fixed`` stay the
    config's. A key the search chooses anew is removed and set again, so the chosen keys follow
    the user's in the config written out."""
    keys: dict[str, Any] = {}
    drop = ["zerofx.auto"]
    if "stage" not in fixed:
        keys["zero_optimization.stage"] = c.stage
    if "offload_optimizer" not in fixed:
        if c.offload == NO_OFFLOAD:
            drop.append("zero_optimization.offload_optimizer")
        else:
            keys["zero_optimization.offload_optimizer"] = {"device": c.offload}
    if "shard_group_size" not in fixed:
        if c.shard_group_size == world_size or c.stage == 0:
            drop.append("zerofx.shard_group_size")
        else:
            keys["zerofx.shard_group_size"] = c.shard_group_size
    if "sequence_parallel" not in fixed:
        if c.sequence_parallel > 1:
            keys["zerofx.sequence_parallel"] = {"size": c.sequence_parallel, "attention": "auto"}
        else:
            drop.append("zerofx.sequence_parallel")
    if "tiling" not in fixed:
        drop.append("zerofx.tiling")
        if c.tiling == "on":
            keys["zerofx.tiling"] = {"enabled": True}
    if "recompute" not in fixed:
        drop.append("zerofx.recompute")
        if c.recompute == "auto":
            keys["zerofx.recompute"] = "auto"
    if "compile" not in fixed:
        drop.append("zerofx.compile")
        if c.compiler == "inductor":
            keys["zerofx.compile"] = "inductor"
            if base.optimizer.type in FUSABLE_OPTIMIZERS and not base.fused_optimizer_is_explicit:
                keys["zerofx.fused_optimizer"] = True
    if "batch" not in fixed:
        keys |= {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": c.micro_batch,
                 "gradient_accumulation_steps": c.accumulation}
    return base.with_keys(keys, drop=drop)


def with_auto_tiling(config: ZeroConfig, activation_budget_bytes: float) -> ZeroConfig:
    """``config`` with tiling ``"auto"`` fitted to ``activation_budget_bytes``."""
    return config.with_keys({"zerofx.tiling": {"enabled": "auto", "budget": max(int(activation_budget_bytes), 0)}})


def resize_inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> InputsAt:
    """``inputs_at`` for a call whose tensors of two or more dimensions are (batch, sequence, ...)
    like the first such tensor: each resized to (micro_batch, seq_len, ...), zeros of its dtype
    on its device (capture needs shapes only)."""
    first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if first is None:
        raise ZeroFXError("the search needs an example input of shape (batch, seq_len, ...); none of the example inputs has two dimensions")
    batch, seq = first.shape[0], first.shape[1]

    def resize(value: Any, b: int, t: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == batch and value.shape[1] == seq:
            return torch.zeros((b, t, *value.shape[2:]), dtype=value.dtype, device=value.device)
        if isinstance(value, tuple):
            return tuple(resize(v, b, t) for v in value)
        if isinstance(value, dict):
            return {k: resize(v, b, t) for k, v in value.items()}
        return value

    def inputs_at(b: int, t: int) -> tuple[tuple[Any, ...], Mapping[str, Any]]:
        return resize(tuple(args), b, t), resize(dict(kwargs), b, t)

    return inputs_at


def example_shape(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, int]:
    """(batch, seq_len) of the call's first tensor of two or more dimensions."""
    first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if first is None:
        raise ZeroFXError("the search needs an example input of shape (batch, seq_len, ...); none of the example inputs has two dimensions")
    return int(first.shape[0]), int(first.shape[1])
