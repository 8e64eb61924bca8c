"""The config's typed options and their defaults: what ``parse_config`` (``zerofx.config``)
builds from the schema-checked config and the runtime reads, the bounds the schema
(``zerofx.config.schema``) checks against, and the functions that turn one schema-checked
section into its options. No validation here: every value reaching these was checked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
import math
import os
from typing import Any

from zerofx.passes.plan import ScheduleOptions
from zerofx.passes.plan.recompute import RecomputeMode
from zerofx.passes.plan.tiling import KINDS, TilingOptions
from zerofx.passes.plan.sequence import MIXER_KEYS, SequenceParallelSpec
from zerofx.common.units import parse_bytes


def is_finite_number(v: Any) -> bool:
    """A real number: not a bool, not NaN or +-Infinity, not an int too large for a float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False

# The optimizer when the config names none, and its learning rate when ``optimizer.params``
# leaves it out (the types and their parameters: NOTE [One optimizer table] in cost_models/memory.py).
DEFAULT_OPTIMIZER_TYPE = "AdamW"
DEFAULT_LR = 1e-3
DEFAULT_GRADIENT_ACCUMULATION_STEPS = 1
DEFAULT_GRADIENT_CLIPPING = 0.0  # 0: no clipping
# The hardware profile the planner plans for without ``zerofx.profile``: gloo on CPU cores.
DEFAULT_PROFILE = "cpu"

# NOTE [The collective timeout]
# torch's process-group timeout defaults to 30 minutes (torch.distributed.constants.default_pg_timeout),
# and DeepSpeed keeps that 30 unless DEEPSPEED_TIMEOUT (in minutes) says otherwise. A stalled peer
# (SIGSTOP, a slow disk, a deadlocked data loader) then holds every rank, and the whole
# allocation, silently for half an hour. zerofx defaults to 300 s: a stall costs minutes, and the
# longest waits zerofx itself causes between ranks fit well inside it (a rank capturing a new
# program, about 2 s for the tiny DNA LM, or compiling it with Inductor, a minute or two on 2 CPU
# cores; a rank writing its checkpoint shard while the others wait). Raise it for Inductor compiles
# of large models or slow checkpoint storage. The ceiling, one week, is far beyond any wait worth
# having, and keeps the value inside what ``datetime.timedelta`` and the backends hold.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
MAX_COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600.0
# One compiled program per input signature, least recently used dropped first: each costs about
# 2 s to build and a few MiB to keep (the tiny DNA LM), and 8 covers a training length, an
# evaluation length and a ragged last batch of each with room to spare.
DEFAULT_PROGRAM_CACHE_SIZE = 8
# The plan cache's directory when the config names none (zerofx.plan_cache): this variable's
# value ("off", "0" or "false" turns the cache off), else under the user's cache directory.
PLAN_CACHE_ENV = "ZEROFX_PLAN_CACHE"
_PLAN_CACHE_OFF = ("", "off", "0", "false", "no")
# fp16.initial_scale_power: the scale 2**p multiplies an fp32 loss, and 2**128 is inf in fp32.
MAX_INITIAL_SCALE_POWER = 127
# fp16.loss_scale and fp16.min_loss_scale: the same bound for a static scale and the dynamic floor.
MAX_LOSS_SCALE = 2.0**MAX_INITIAL_SCALE_POWER


@dataclass(frozen=True)
class LossScaleOptions:
    """fp16 loss scaling (the ``fp16`` section, DeepSpeed's keys and defaults); ``zerofx.runtime.loss_scaling``
    runs it. ``consecutive_hysteresis`` is read and warns: zerofx does not act on it."""

    loss_scale: float = 0.0  # a static scale; 0: dynamic
    initial_scale_power: int = 16  # the dynamic scale starts at 2**this
    loss_scale_window: int = 1000  # overflow-free steps before the dynamic scale doubles
    hysteresis: int = 2  # overflowing steps before it halves
    min_loss_scale: float = 1.0  # the dynamic scale's floor

    @classmethod
    def from_config(cls, fp16: Mapping[str, Any]) -> LossScaleOptions:
        """From the schema-checked ``fp16`` section; numbers that may be fractional as floats."""
        default = cls()
        return cls(
            loss_scale=float(fp16.get("loss_scale", default.loss_scale)),
            initial_scale_power=fp16.get("initial_scale_power", default.initial_scale_power),
            loss_scale_window=fp16.get("loss_scale_window", default.loss_scale_window),
            hysteresis=fp16.get("hysteresis", default.hysteresis),
            min_loss_scale=float(fp16.get("min_loss_scale", default.min_loss_scale)),
        )


# The defaults of DeepSpeed's monitor sections (deepspeed/monitor/config.py), so a ds_config.json
# writes where it did under DeepSpeed.
DEFAULT_MONITOR_JOB_NAME = "DeepSpeedJobName"
DEFAULT_WANDB_PROJECT = "deepspeed"


@dataclass(frozen=True)
class LogDirOptions:
    """Where a file monitor (``tensorboard`` or ``csv_monitor``) writes: ``output_path/job_name``,
    relative to the working directory unless ``output_path`` is absolute (DeepSpeed's keys)."""

    output_path: str = ""
    job_name: str = DEFAULT_MONITOR_JOB_NAME

    @property
    def log_dir(self) -> Path:
        return Path(self.output_path) / self.job_name

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> LogDirOptions:
        return cls(output_path=section.get("output_path", ""), job_name=section.get("job_name", DEFAULT_MONITOR_JOB_NAME))


@dataclass(frozen=True)
class WandbOptions:
    """The ``wandb`` section: ``wandb.init(project=project, group=group, entity=team)``."""

    project: str = DEFAULT_WANDB_PROJECT
    group: str | None = None
    team: str | None = None  # wandb's entity


@dataclass(frozen=True)
class MonitorOptions:
    """DeepSpeed's monitor sections (``tensorboard``, ``csv_monitor``, ``wandb``), each None when
    it is absent or not enabled; ``zerofx.runtime.monitors`` writes them on rank 0."""

    tensorboard: LogDirOptions | None = None
    csv_monitor: LogDirOptions | None = None
    wandb: WandbOptions | None = None

    @property
    def enabled(self) -> bool:
        """Any monitor on: then every rank computes the gradient norm each step (a collective)."""
        return self.tensorboard is not None or self.csv_monitor is not None or self.wandb is not None

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> MonitorOptions:
        """From the schema-checked config; a section counts only with ``"enabled": true``, as in DeepSpeed."""
        def on(name: str) -> Mapping[str, Any] | None:
            section = raw.get(name, {})
            return section if section.get("enabled", False) else None

        tensorboard, csv_monitor, wandb = on("tensorboard"), on("csv_monitor"), on("wandb")
        return cls(
            tensorboard=None if tensorboard is None else LogDirOptions.from_config(tensorboard),
            csv_monitor=None if csv_monitor is None else LogDirOptions.from_config(csv_monitor),
            wandb=None if wandb is None else WandbOptions(
                project=wandb.get("project", DEFAULT_WANDB_PROJECT), group=wandb.get("group"), team=wandb.get("team"),
            ),
        )


# The dimensions ``zerofx.auto`` searches (zerofx/compiler/autoplan.py), each named by what the
# config sets to fix it: a dimension the config sets itself is kept as set.
AUTO_DIMENSIONS = ("stage", "sequence_parallel", "shard_group_size", "offload_optimizer", "tiling", "recompute", "compile", "batch")


@dataclass(frozen=True)
class AutoOptions:
    """``zerofx.auto: true``: search the configuration at initialize. ``fixed`` names the
    dimensions of ``AUTO_DIMENSIONS`` the config sets itself, which the search keeps."""

    fixed: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> AutoOptions | None:
        """From the schema-checked config; None unless ``zerofx.auto`` is true."""
        own, zero = raw.get("zerofx", {}), raw.get("zero_optimization", {})
        if not own.get("auto", False):
            return None
        given = {"stage": "stage" in zero, "sequence_parallel": "sequence_parallel" in own,
                 "shard_group_size": "shard_group_size" in own, "offload_optimizer": "offload_optimizer" in zero,
                 "tiling": "tiling" in own, "recompute": "recompute" in own, "compile": "compile" in own,
                 "batch": any(k in raw for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))}
        return cls(fixed=frozenset(d for d in AUTO_DIMENSIONS if given[d]))


class CacheTrust(Enum):
    """Who may write the plan cache's directory and entries (config key ``zerofx.plan_cache_trust``;
    NOTE [Who the plan cache trusts] in zerofx/compiler/cache_trust.py)."""

    PRIVATE = "private"  # the current user alone: owned by them, writable by no one else
    GROUP = "group"  # also the directory's group: any owner, group-writable, never world-writable


class NonFinite(Enum):
    """What a step does when a loss or a gradient is NaN or infinite (config key
    ``zerofx.nonfinite``; NOTE [Non-finite values] in zerofx/runtime/optimizer_step.py)."""

    ERROR = "error"  # raise NonFiniteError on every rank, naming the step, the rank and the loss or parameter
    SKIP = "skip"  # skip the update on every rank, as fp16 loss scaling skips an overflow, and say so
    OFF = "off"  # no check: the step updates with what it has


class GraphCompiler(Enum):
    """What runs each rank's forward and backward graphs (config key ``zerofx.compile``)."""

    NONE = "none"  # the GraphModules' generated Python, op by op in eager ATen
    INDUCTOR = "inductor"  # compiled once per program with TorchInductor


def tiling_options(section: Mapping[str, Any] | None) -> TilingOptions:
    """``TilingOptions`` from the config's ``zerofx.tiling`` section (already schema-checked)."""
    section = dict(section or {})
    kinds = tuple(k for k in KINDS if section.get(k, True))
    budget, tile_bytes = section.get("budget"), section.get("weight_tile_bytes")
    budget = int(parse_bytes(budget)) if isinstance(budget, str) else budget
    tile_bytes = int(parse_bytes(tile_bytes)) if isinstance(tile_bytes, str) else tile_bytes
    return TilingOptions(
        enabled=section.get("enabled", "auto"),
        block_size=section.get("block_size"),
        attention_block_size=section.get("attention_block_size"),
        budget_bytes=budget,
        kinds=kinds,
        weight_tile_bytes=tile_bytes,
    )


# NOTE [The memory margin]
# The memory model predicts a rank's peak to within about 10% (docs/predictions.md), not exactly,
# and every planner that fits a budget (``fit_prefetch``, recompute "auto", auto tiling, the
# whole-job search) lands at its edge by construction: it keeps the fastest plan that fits. A
# plan predicted 2 MiB under a hard cap then passes it by the model's error.
# ``zerofx.memory_margin`` holds a share of the budget back: the planners fit the predicted peak
# to ``memory_budget * (1 - memory_margin)``, the budget the plan carries
# (``ScheduleOptions.memory_budget_bytes``), so a config planned again fits the same figure.
# The ``zerofx`` keys that set the budget: a config planned without a budget (the cut models of a
# folded plan, NOTE [Budgets of the cut models]) drops both.
BUDGET_KEYS = ("memory_budget", "memory_margin")


def planned_budget_bytes(own: Mapping[str, Any]) -> float | None:
    """The budget the planners fit the peak to: ``zerofx.memory_budget`` less ``zerofx.memory_margin``
    of it (NOTE [The memory margin]); None without a budget."""
    if "memory_budget" not in own:
        return None
    return parse_bytes(own["memory_budget"]) * (1 - float(own.get("memory_margin", 0)))


def schedule_options(zero: Mapping[str, Any], own: Mapping[str, Any]) -> ScheduleOptions:
    """The communication-schedule limits of the ``zero_optimization`` section (DeepSpeed's keys,
    in elements) and the ``zerofx`` section (``prefetch_distance``, ``memory_budget``)."""
    def numel(key: str) -> int | None:
        return int(zero[key]) if key in zero else None

    default = ScheduleOptions()
    return ScheduleOptions(
        gather_bucket_numel=numel("stage3_prefetch_bucket_size"),
        reduce_bucket_numel=numel("reduce_bucket_size"),
        sync_bucket_numel=numel("allgather_bucket_size"),
        prefetch_distance=own.get("prefetch_distance"),
        max_live_numel=float(zero.get("stage3_max_live_parameters", default.max_live_numel)),
        persistence_threshold=int(zero.get("stage3_param_persistence_threshold", default.persistence_threshold)),
        overlap=zero.get("overlap_comm", default.overlap),
        memory_budget_bytes=planned_budget_bytes(own),
        recompute=RecomputeMode.from_config(own.get("recompute", False)).value,
        reduce_scatter_by_all_to_all=None if own.get("reduce_scatter_by_all_to_all", "auto") == "auto" else bool(own["reduce_scatter_by_all_to_all"]),
    )


def sequence_parallel_spec(section: Mapping[str, Any] | None) -> SequenceParallelSpec | None:
    """The ``zerofx.sequence_parallel`` section (schema-checked, its size present) as a spec
    without its group, which ``zerofx.config.compile_options`` names; None when the section is
    absent or its size is 1."""
    if section is None or section.get("size", 1) == 1:
        return None
    # ``attention`` and ``mixers.attention`` are one setting (check_sequence_parallel refuses them differing);
    # every mixer is named, with its default where the config leaves it out, so equal settings give equal specs.
    asked = {"attention": section["attention"]} if "attention" in section else {}
    asked |= section.get("mixers", {})
    return SequenceParallelSpec(size=section["size"], mixers=tuple((m.name, asked.get(m.name, m.strategies[0])) for m in MIXER_KEYS),
                                load_balance=section.get("load_balance", True))


def plan_cache_key_file(value: str | None) -> Path:
    """The secret the plan cache signs its entries with: ``zerofx.plan_cache_key_file``
    (``value``), else ``$XDG_CONFIG_HOME/zerofx/plan-cache.key`` or ``~/.config/zerofx/plan-cache.key``."""
    if value is not None:
        return Path(os.path.expanduser(value))
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "zerofx" / "plan-cache.key"


def plan_cache_dir(value: str | bool | None) -> Path | None:
    """Where the plan cache keeps its entries: ``zerofx.plan_cache`` (``value``), else
    ``$ZEROFX_PLAN_CACHE``, else ``$XDG_CACHE_HOME/zerofx/plans`` or ``~/.cache/zerofx/plans``;
    None when it is off (``false``, or the variable set to ``off``)."""
    if value is None:
        value = os.environ.get(PLAN_CACHE_ENV)
        if value is not None and value.strip().lower() in _PLAN_CACHE_OFF:
            return None
    if value is False:
        return None
    if value is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "zerofx" / "plans"
    return Path(os.path.expanduser(str(value)))
