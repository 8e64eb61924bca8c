"""The DeepSpeed-shaped config: parsing and validation.

A config is a dict or a path to a JSON file, in DeepSpeed's shape, so a team keeps its
``ds_config.json``. zerofx's own additions live in a ``"zerofx"`` section, which DeepSpeed
ignores.

Every key is declared once in ``SCHEMA`` below, with its type, its accepted values and whether
zerofx acts on it yet. An unknown key, a wrong type or a bad value raises ``ConfigError``
naming the key, the value and what is accepted; so does a number that is not finite (JSON as
Python reads it allows ``Infinity`` and ``NaN``) or a ``true``/``false`` where a number belongs. A
known key that zerofx does not act on yet is reported once, by name, as a warning.

``parse_config`` returns a frozen ``ZeroConfig``: typed properties for what the runtime reads, and
``fingerprint_fields()``, the settings every rank must share (NOTE [What ranks must agree on]).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from zerofx.cost_models.profiles import BUILTIN as BUILTIN_PROFILES
from zerofx.passes.plan import ScheduleOptions
from zerofx.passes.plan_tiling import KINDS, TilingOptions
from zerofx.passes.sequence_parallel import SequenceAttention, SequenceParallelSpec
from zerofx.errors import ConfigError, did_you_mean
from zerofx.offload.options import GradOffloadOptions, OffloadOptions, ParamOffloadOptions
from zerofx.schedulers import SCHEDULER_TYPES, SchedulerSpec, is_finite_number
from zerofx.units import parse_bytes

OPTIMIZER_TYPES = ("AdamW", "Adam", "SGD")
# The optimizer.params keys each type takes (torch's argument names).
OPTIMIZER_PARAMS = {
    "AdamW": ("lr", "betas", "eps", "weight_decay"),
    "Adam": ("lr", "betas", "eps", "weight_decay"),
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
}

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
# fp16.initial_scale_power: the scale 2**p multiplies an fp32 loss, and 2**128 is inf in fp32.
MAX_INITIAL_SCALE_POWER = 127
# fp16.loss_scale and fp16.min_loss_scale: the same bound for a static scale and the dynamic floor.
MAX_LOSS_SCALE = 2.0**MAX_INITIAL_SCALE_POWER


@dataclass(frozen=True)
class LossScaleOptions:
    """fp16 loss scaling (the ``fp16`` section, DeepSpeed's keys and defaults); ``zerofx.loss_scaling``
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
    it is absent or not enabled; ``zerofx.monitors`` writes them on rank 0."""

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


class GraphCompiler(Enum):
    """What runs each rank's forward and backward graphs (config key ``zerofx.compile``)."""

    NONE = "none"  # the GraphModules' generated Python, op by op in eager ATen
    INDUCTOR = "inductor"  # compiled once per program with TorchInductor


@dataclass(frozen=True)
class Key:
    """One config key: its accepted types, an optional value check, and whether it is acted on."""

    types: tuple[type, ...]
    doc: str
    check: Callable[[Any], bool] | None = None
    accepted: str = ""
    acted_on: bool = True
    children: Mapping[str, Key] | None = None
    # True when ranks may set it differently: it changes only where or how fast a rank keeps its
    # own state, or what it prints, never the collectives or the numbers (NOTE [What ranks must
    # agree on]).
    per_rank: bool = False


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _bytes_ok(v: Any) -> bool:
    if isinstance(v, str):
        try:
            parse_bytes(v)
        except ConfigError:
            return False
        return True
    return _nonneg_int(v)


def _bytes_pos(v: Any) -> bool:
    if isinstance(v, str):
        try:
            return parse_bytes(v) >= 1
        except ConfigError:
            return False
    return _pos_int(v)


_NUM = (int, float)

# parse_bytes ('80GiB', '1.5 TB', '123' or a number -> bytes) lives in zerofx.units, torch-free
# for the command line's --budget; config imports it from there (and keeps the name).


def _size(v: Any) -> bool:
    try:
        return parse_bytes(v) > 0
    except ConfigError:
        return False


_OFFLOAD_DEVICE = Key((str,), "where the state lives", lambda v: v in ("none", "cpu", "nvme"), "none, cpu or nvme")
_OFFLOAD_OPTIMIZER = {
    "device": _OFFLOAD_DEVICE,
    "nvme_path": Key((str,), "folder for NVMe offload files (one subfolder per rank)", per_rank=True),
    "pin_memory": Key((bool,), "pin host memory for offloaded state (CUDA)", per_rank=True),
    "buffer_count": Key((int,), "host buffers NVMe records pass through: the window", _pos_int, "an integer >= 1", per_rank=True),
    "ratio": Key(_NUM, "fraction of the optimizer state to offload (the rest stays on the device)", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
}
_OFFLOAD_PARAM = {
    "device": Key((str,), "where stage-3 parameter shards live between uses", lambda v: v in ("none", "cpu", "nvme"), "none, cpu or nvme"),
    "nvme_path": Key((str,), "folder for NVMe parameter files (one subfolder per rank)", per_rank=True),
    "pin_memory": Key((bool,), "pin host memory for offloaded parameters (CUDA)", per_rank=True),
    "buffer_count": Key((int,), "NVMe parameter reads in flight ahead of use: the window", _pos_int, "an integer >= 1", per_rank=True),
    "max_in_cpu": Key(_NUM, "with device nvme, parameter elements per rank kept in host memory (zerofx default 0)", lambda v: v >= 0, "a number >= 0"),
    "buffer_size": Key(_NUM, "elements per NVMe buffer (zerofx sizes each read to its shard)", lambda v: v > 0, "a number > 0", False),
}
_OFFLOAD_GRADIENTS = {
    "device": Key((str,), "where reduced gradient shards live until the optimizer step", lambda v: v in ("none", "cpu", "nvme"),
                  "none, cpu or nvme"),
    "nvme_path": Key((str,), "folder for NVMe gradient files (one subfolder per rank)", per_rank=True),
    "pin_memory": Key((bool,), "pin host memory for offloaded gradients (CUDA)", per_rank=True),
    "buffer_count": Key((int,), "NVMe gradient reads ahead of the update, and accumulations in flight", _pos_int, "an integer >= 1",
                        per_rank=True),
}
_BYTES = lambda v: v >= 0  # noqa: E731  (a validator, written like the inline lambdas it sits among)
_ZEROFX_OFFLOAD = {
    "delayed_update": Key((bool,), "one-step delayed parameter update (DPU): the optimizer step runs during the next forward/backward; changes the numerics"),
    "device_budget_bytes": Key(_NUM, "optimizer-state bytes per rank kept on the device (default: (1 - ratio) x all)", _BYTES, "a number >= 0",
                               per_rank=True),
    "cpu_budget_bytes": Key(_NUM, "optimizer-state bytes per rank in host memory (default: all with device cpu, 0 with nvme)", _BYTES,
                            "a number >= 0", per_rank=True),
    "host_copy_bytes_per_s": Key(_NUM, "measured host <-> device copy bandwidth, for the placement plan", lambda v: v > 0, "a number > 0",
                                 per_rank=True),
    "nvme_read_bytes_per_s": Key(_NUM, "measured NVMe read bandwidth, for the placement plan", lambda v: v > 0, "a number > 0", per_rank=True),
    "nvme_write_bytes_per_s": Key(_NUM, "measured NVMe write bandwidth, for the placement plan", lambda v: v > 0, "a number > 0", per_rank=True),
}


def _non_empty(v: Any) -> bool:
    return v != ""


def _log_dir_monitor(what: str) -> dict[str, Key]:
    """The keys of DeepSpeed's ``tensorboard`` and ``csv_monitor`` sections."""
    return {
        "enabled": Key((bool,), f"write {what} of each optimizer step's metrics (every rank then computes the gradient norm: a collective)"),
        "output_path": Key((str,), "folder the job's folder goes in (default: the working directory)", per_rank=True),
        "job_name": Key((str,), f"the job's folder inside output_path (default {DEFAULT_MONITOR_JOB_NAME!r})", _non_empty, "a non-empty string",
                        per_rank=True),
    }


_FP16 = LossScaleOptions()  # the defaults, for the docs below

SCHEMA: dict[str, Key] = {
    "zero_optimization": Key((dict,), "ZeRO settings", children={
        "stage": Key((int,), "ZeRO stage", lambda v: v in (0, 1, 2, 3), "0, 1, 2 or 3"),
        "overlap_comm": Key((bool,), "overlap collectives with compute"),
        "contiguous_gradients": Key((bool,), "copy gradients into a contiguous buffer", acted_on=False),
        "reduce_scatter": Key((bool,), "use reduce-scatter for gradients", acted_on=False),
        "reduce_bucket_size": Key(_NUM, "elements per gradient bucket", lambda v: v >= 1, "a number >= 1"),
        "allgather_bucket_size": Key(_NUM, "elements per all-gather bucket", lambda v: v >= 1, "a number >= 1"),
        "allgather_partitions": Key((bool,), "all-gather updated partitions", acted_on=False),
        "stage3_prefetch_bucket_size": Key(_NUM, "elements prefetched ahead", lambda v: v >= 0, "a number >= 0"),
        "stage3_max_live_parameters": Key(_NUM, "max gathered elements alive", lambda v: v >= 0, "a number >= 0"),
        "stage3_max_reuse_distance": Key(_NUM, "reuse distance for keeping a gathered parameter", lambda v: v >= 0, "a number >= 0", False),
        "stage3_param_persistence_threshold": Key(_NUM, "parameters smaller than this stay unsharded", lambda v: v >= 0, "a number >= 0"),
        "stage3_gather_16bit_weights_on_model_save": Key((bool,), "gather 16-bit weights when saving", acted_on=False),
        "offload_optimizer": Key((dict,), "optimizer-state offload: fp32 masters and optimizer states", children=_OFFLOAD_OPTIMIZER),
        "offload_param": Key((dict,), "parameter offload (stage 3): shards fetched into the graph before their all-gather", children=_OFFLOAD_PARAM),
        "sub_group_size": Key(_NUM, "optimizer sub-group size", lambda v: v > 0, "a number > 0", False),
    }),
    "optimizer": Key((dict,), "the optimizer", children={
        "type": Key((str,), "optimizer class", lambda v: v in OPTIMIZER_TYPES, ", ".join(OPTIMIZER_TYPES)),
        "params": Key((dict,), "optimizer arguments", children={
            "lr": Key(_NUM, "learning rate", lambda v: v >= 0, "a number >= 0"),
            "betas": Key((list, tuple), "Adam betas", lambda v: len(v) == 2 and all(is_finite_number(b) and 0 <= b < 1 for b in v),
                         "a list of two numbers in [0, 1)"),
            "eps": Key(_NUM, "Adam epsilon", lambda v: v > 0, "a number > 0"),
            "weight_decay": Key(_NUM, "weight decay", lambda v: v >= 0, "a number >= 0"),
            "momentum": Key(_NUM, "SGD momentum", lambda v: v >= 0, "a number >= 0"),
            "nesterov": Key((bool,), "SGD Nesterov momentum"),
            "dampening": Key(_NUM, "SGD dampening", lambda v: v >= 0, "a number >= 0"),
        }),
    }),
    "train_batch_size": Key((int,), "global batch size", _pos_int, "an integer >= 1"),
    "train_micro_batch_size_per_gpu": Key((int,), "batch per rank per micro-step", _pos_int, "an integer >= 1"),
    "gradient_accumulation_steps": Key((int,), "micro-steps per optimizer step", _pos_int, "an integer >= 1"),
    "gradient_clipping": Key(_NUM, "max global gradient norm (0: off)", lambda v: v >= 0, "a number >= 0"),
    "steps_per_print": Key((int,), "rank 0 logs every N optimizer steps (default: no log)", _pos_int, "an integer >= 1", per_rank=True),
    "scheduler": Key((dict,), "learning-rate scheduler (zerofx/schedulers.py says which keys each type takes and requires)", children={
        "type": Key((str,), "scheduler (required when the section is given)", lambda v: v in SCHEDULER_TYPES, ", ".join(SCHEDULER_TYPES)),
        "params": Key((dict,), "scheduler arguments", children={
            "warmup_min_lr": Key(_NUM, "learning rate at step 0", lambda v: v >= 0, "a number >= 0"),
            "warmup_max_lr": Key(_NUM, "learning rate after warm-up", lambda v: v >= 0, "a number >= 0"),
            "warmup_num_steps": Key((int,), "warm-up steps", _nonneg_int, "an integer >= 0"),
            "warmup_type": Key((str,), "warm-up curve", lambda v: v in ("log", "linear"), "log or linear"),
            "total_num_steps": Key((int,), "WarmupDecayLR, WarmupCosineLR (required): steps until the schedule ends", _pos_int,
                                   "an integer >= 1, and > warmup_num_steps"),
            "warmup_min_ratio": Key(_NUM, "WarmupCosineLR: start ratio of the optimizer's lr", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
            "cos_min_ratio": Key(_NUM, "WarmupCosineLR: final ratio of the optimizer's lr", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
            "last_batch_iteration": Key((int,), "resume position", lambda v: v >= -1, "an integer >= -1", acted_on=False),
        }),
    }),
    "bf16": Key((dict,), "bfloat16 mixed precision", children={
        "enabled": Key((bool,), "train in bfloat16 with fp32 master weights"),
    }),
    "fp16": Key((dict,), "float16 mixed precision with loss scaling", children={
        "enabled": Key((bool,), "train in float16 with fp32 master weights"),
        "loss_scale": Key(_NUM, f"static loss scale; 0 for dynamic (default {_FP16.loss_scale:g})", lambda v: 0 <= v <= MAX_LOSS_SCALE,
                          f"a number >= 0 and <= 2**{MAX_INITIAL_SCALE_POWER} (0: dynamic)"),
        "initial_scale_power": Key((int,), f"dynamic scale starts at 2**this (default {_FP16.initial_scale_power})",
                                   lambda v: _nonneg_int(v) and v <= MAX_INITIAL_SCALE_POWER, f"an integer in [0, {MAX_INITIAL_SCALE_POWER}]"),
        "loss_scale_window": Key((int,), f"overflow-free steps before the scale doubles (default {_FP16.loss_scale_window})", _pos_int,
                                 "an integer >= 1"),
        "hysteresis": Key((int,), f"overflows tolerated before the scale halves (default {_FP16.hysteresis})", _pos_int, "an integer >= 1"),
        "min_loss_scale": Key(_NUM, f"the dynamic scale's floor (default {_FP16.min_loss_scale:g})", lambda v: 0 < v <= MAX_LOSS_SCALE,
                              f"a number > 0 and <= 2**{MAX_INITIAL_SCALE_POWER}"),
        "auto_cast": Key((bool,), "cast inputs to fp16", acted_on=False),
        "consecutive_hysteresis": Key((bool,), "refill hysteresis after a good step", acted_on=False),
    }),
    "wall_clock_breakdown": Key((bool,), "timing breakdown", acted_on=False, per_rank=True),
    "tensorboard": Key((dict,), "TensorBoard event file of the training metrics, written by rank 0 (needs the tensorboard package)",
                       children=_log_dir_monitor("TensorBoard events")),
    "csv_monitor": Key((dict,), "CSV files of the training metrics, one per metric, written by rank 0", children=_log_dir_monitor("CSV files")),
    "wandb": Key((dict,), "Weights & Biases run of the training metrics, logged by rank 0 (needs the wandb package)", children={
        "enabled": Key((bool,), "log each optimizer step's metrics to wandb (every rank then computes the gradient norm: a collective)"),
        "project": Key((str,), f"wandb project (default {DEFAULT_WANDB_PROJECT!r})", _non_empty, "a non-empty string", per_rank=True),
        "group": Key((str,), "wandb group, to group runs together", per_rank=True),
        "team": Key((str,), "wandb team (wandb.init's entity)", per_rank=True),
    }),
    "zerofx": Key((dict,), "zerofx's own settings (DeepSpeed ignores this section)", children={
        "world_size": Key((int,), "number of ranks to plan for", _pos_int, "an integer >= 1"),
        "prefetch_distance": Key((int,), "stage-3 all-gather buckets issued ahead of use", _nonneg_int, "an integer >= 0"),
        "memory_budget": Key((int, float, str), "memory per rank the step's peak must fit (the planner lowers the prefetch "
                             "distance to fit it)", _size, "bytes > 0, as a number or a size like '80GiB'"),
        "tiling": Key((dict,), "sequence tiling of attention, token-wise regions and the loss; feature tiling of large weights", children={
            "enabled": Key((bool, str), "tile: true, false, or \"auto\" (from the activation estimate and the budget)",
                           lambda v: v in (True, False, "auto"), "true, false or \"auto\""),
            "block_size": Key((int,), "tokens per chunk of token-wise regions and of the loss", _pos_int, "an integer >= 1"),
            "attention_block_size": Key((int,), "query and key block of tiled attention", _pos_int, "an integer >= 1"),
            "budget": Key((int, str), "activation bytes to fit (\"auto\" tiles until the estimate fits)", _bytes_ok,
                          "bytes >= 0 or a size such as \"2GiB\""),
            "attention": Key((bool,), "may tile attention"),
            "region": Key((bool,), "may tile token-wise regions (MLP, norms, projections) with per-chunk recompute"),
            "loss": Key((bool,), "may tile the vocabulary projection and cross-entropy"),
            "weight": Key((bool,), "may tile large linear weights along their output features (at stage 3 gathered one tile at a time)"),
            "weight_tile_bytes": Key((int, str), "the largest weight tile: bigger weights are used in tiles of at most this size", _bytes_pos,
                                     "bytes >= 1 or a size such as \"64MiB\""),
        }),
        "compile": Key((str,), "compile each rank's forward and backward graphs: none (run them as FX code) or inductor",
                       lambda v: v in {c.value for c in GraphCompiler}, ", ".join(c.value for c in GraphCompiler)),
        "fused_optimizer": Key((bool,), "Adam/AdamW with fused=True (one kernel over all of a rank's shards)"),
        "offload": Key((dict,), "offload planning and the delayed update (with zero_optimization.offload_optimizer)", children=_ZEROFX_OFFLOAD),
        "offload_gradients": Key((dict,), "gradient offload (stages 2-3): each reduced gradient shard goes to host memory or NVMe "
                                 "as soon as its bucket's reduction completes, and the optimizer reads it there", children=_OFFLOAD_GRADIENTS),
        "collective_timeout_s": Key(_NUM, f"seconds a collective may wait for its peers before the process group raises (default "
                                    f"{DEFAULT_COLLECTIVE_TIMEOUT_S:g}; torch's own is 1800)", lambda v: 0 < v <= MAX_COLLECTIVE_TIMEOUT_S,
                                    f"a number of seconds in (0, {MAX_COLLECTIVE_TIMEOUT_S:g}]"),
        "program_cache_size": Key((int,), f"compiled programs (one per input shape) kept, least recently used dropped first (default "
                                  f"{DEFAULT_PROGRAM_CACHE_SIZE})", _pos_int, "an integer >= 1"),
        "shard_group_size": Key((int, str), "ranks that share one sharded copy of the ZeRO state: groups of this many consecutive "
                                "ranks, replicated across groups (default: the world size, flat; \"auto\": the planner chooses)",
                                lambda v: v == "auto" or _pos_int(v), "an integer >= 1 that divides the world size, or \"auto\""),
        "sequence_parallel": Key((dict,), "sequence parallelism: groups of `size` consecutive ranks share each sequence, each rank "
                                 "running 1/size of it (NOTE [Sequence parallelism as a rewrite])", children={
            "size": Key((int,), "ranks per sequence group; data-parallel size = world size / size", _pos_int,
                        "an integer >= 1 that divides the world size"),
            "attention": Key((str,), "how attention exchanges data: \"ulysses\" (all-to-all to head sharding, the default), \"ring\" "
                             "(key/value blocks passed around the group, NOTE [Ring attention]) or \"auto\" (the one that sends fewer "
                             "bytes, ring where the size does not divide the query heads)", lambda v: v in {a.value for a in SequenceAttention},
                             ", ".join(f'"{a.value}"' for a in SequenceAttention)),
            "load_balance": Key((bool,), "with ring attention and a causal mask, each rank holds sequence chunks r and 2·size - 1 - r "
                                "(zigzag) so every rank does the same attention work (default true; needs the sequence length divisible "
                                "by 2·size, else contiguous slices; NOTE [Zigzag layout for causal rings])"),
        }),
        "profile": Key((str,), "hardware the planner sizes buckets, prefetch and shard groups for: a built-in profile "
                       f"({', '.join(BUILTIN_PROFILES)}) or a JSON file from zerofx calibrate (default: cpu, gloo on CPU cores)",
                       lambda v: v in BUILTIN_PROFILES or Path(v).is_file(), f"{', '.join(BUILTIN_PROFILES)}, or a profile file that exists"),
        "plan_cache": Key((str, bool), "directory of the plan cache: each rank's captured and lowered graphs, loaded again by the next "
                          f"launch with the same model, inputs, config and world layout (default: ${PLAN_CACHE_ENV}, else "
                          "~/.cache/zerofx/plans); false turns it off", lambda v: v is False or (isinstance(v, str) and v != ""),
                          "a directory path, or false", per_rank=True),
    }),
}

_WARNED: set[str] = set()


def schema_rows(schema: Mapping[str, Key] = SCHEMA, prefix: str = "") -> list[tuple[str, str, str, str, str]]:
    """(key, type, accepted, acted on?, meaning) for every key, depth first: the config's
    documentation, generated from ``SCHEMA`` so it is never written twice."""
    rows = []
    for name, key in schema.items():
        path = f"{prefix}{name}"
        rows.append((path, _type_names(key.types), key.accepted or "-", "yes" if key.acted_on else "read, warns", key.doc))
        if key.children is not None:
            rows += schema_rows(key.children, f"{path}.")
    return rows


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


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer to build on each rank's shard, and with what arguments."""

    type: str = "AdamW"
    params: Mapping[str, Any] = field(default_factory=lambda: {"lr": 1e-3})

    def resolved_params(self) -> dict[str, Any]:
        """Every argument the config may set for this type, with torch's default where it is
        silent: what each rank's optimizer runs with. Numbers as floats, betas as a list."""
        defaults = inspect.signature(_TORCH_OPTIMIZERS[self.type]).parameters
        out: dict[str, Any] = {}
        for key in OPTIMIZER_PARAMS[self.type]:
            v = self.params.get(key, defaults[key].default)
            out[key] = bool(v) if key == "nesterov" else [float(b) for b in v] if key == "betas" else float(v)
        return out


_TORCH_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}


@dataclass(frozen=True)
class ZeroConfig:
    """The validated config, as zerofx uses it."""

    stage: int | None
    world_size: int | None
    optimizer: OptimizerSpec
    raw: Mapping[str, Any]
    scheduler: SchedulerSpec | None = None  # the ``scheduler`` section; None without one
    offload: OffloadOptions | None = None  # ``offload_optimizer`` with ``zerofx.offload``; None when off
    param_offload: ParamOffloadOptions | None = None  # ``offload_param``; None when off
    grad_offload: GradOffloadOptions | None = None  # ``zerofx.offload_gradients``; None when off
    loss_scaling: LossScaleOptions | None = None  # the ``fp16`` section's loss scaling; None unless fp16 is enabled
    steps_per_print: int | None = None  # rank 0 logs every this many optimizer steps; None: never
    monitors: MonitorOptions = MonitorOptions()  # tensorboard, csv_monitor, wandb; all None when off
    # ``zerofx.shard_group_size``: an int dividing the world size, "auto" (the planner chooses),
    # or None (flat: one group of all ranks). NOTE [Shard groups of consecutive ranks].
    shard_group_size: int | str | None = None

    @property
    def collective_timeout_s(self) -> float:
        """Seconds a collective waits for its peers before the process group raises
        (``zerofx.collective_timeout_s``; NOTE [The collective timeout])."""
        return float(self.raw.get("zerofx", {}).get("collective_timeout_s", DEFAULT_COLLECTIVE_TIMEOUT_S))

    @property
    def train_batch_size(self) -> int | None:
        """The global batch (``train_batch_size``); None when the config leaves it out."""
        return self.raw.get("train_batch_size")

    @property
    def train_micro_batch_size_per_gpu(self) -> int | None:
        """The batch per rank per micro-step (``train_micro_batch_size_per_gpu``); None when left out."""
        return self.raw.get("train_micro_batch_size_per_gpu")

    @property
    def profile(self) -> str:
        """The hardware profile the planner plans for (``zerofx.profile``): a built-in name or a
        file from ``zerofx calibrate``."""
        return str(self.raw.get("zerofx", {}).get("profile", "cpu"))

    @property
    def program_cache_size(self) -> int:
        """Compiled programs (one per input signature) kept at once, least recently used dropped
        first (``zerofx.program_cache_size``)."""
        return int(self.raw.get("zerofx", {}).get("program_cache_size", DEFAULT_PROGRAM_CACHE_SIZE))

    @property
    def plan_cache_dir(self) -> Path | None:
        """Where the plan cache keeps its entries (``zerofx.plan_cache``, else ``$ZEROFX_PLAN_CACHE``,
        else ``$XDG_CACHE_HOME/zerofx/plans`` or ``~/.cache/zerofx/plans``); None when it is off."""
        value = self.raw.get("zerofx", {}).get("plan_cache")
        if value is None:
            value = os.environ.get(PLAN_CACHE_ENV)
            if value is not None and value.strip().lower() in ("", "off", "0", "false", "no"):
                return None
        if value is False:
            return None
        if value is None:
            base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            return Path(base) / "zerofx" / "plans"
        return Path(os.path.expanduser(str(value)))

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """bfloat16 or float16 when mixed precision is on, else None (train in the model's dtype)."""
        if self.raw.get("bf16", {}).get("enabled"):
            return torch.bfloat16
        if self.raw.get("fp16", {}).get("enabled"):
            return torch.float16
        return None

    @property
    def graph_compiler(self) -> GraphCompiler:
        return GraphCompiler(self.raw.get("zerofx", {}).get("compile", GraphCompiler.NONE.value))

    @property
    def fused_optimizer(self) -> bool:
        return bool(self.raw.get("zerofx", {}).get("fused_optimizer", False))

    @property
    def gradient_accumulation_steps(self) -> int:
        return int(self.raw.get("gradient_accumulation_steps", 1))

    @property
    def gradient_clipping(self) -> float:
        return float(self.raw.get("gradient_clipping", 0.0))

    def sequence_parallel(self) -> SequenceParallelSpec | None:
        """``zerofx.sequence_parallel`` as a spec without its group (the engine names it); None
        when the section is absent or its size is 1."""
        section = self.raw.get("zerofx", {}).get("sequence_parallel")
        if section is None or section.get("size", 1) == 1:
            return None
        return SequenceParallelSpec(size=section["size"], attention=SequenceAttention(section.get("attention", "ulysses")),
                                    load_balance=section.get("load_balance", True))

    def tiling_options(self) -> TilingOptions | None:
        """The ``zerofx.tiling`` section as ``TilingOptions``; None when the section is absent."""
        section = self.raw.get("zerofx", {}).get("tiling")
        return None if section is None else tiling_options(section)

    def schedule_options(self) -> ScheduleOptions:
        """The communication-schedule limits the config sets (DeepSpeed's keys, in elements)."""
        zero = self.raw.get("zero_optimization", {})
        own = self.raw.get("zerofx", {})

        def numel(key: str) -> int | None:
            return int(zero[key]) if key in zero else None

        return ScheduleOptions(
            gather_bucket_numel=numel("stage3_prefetch_bucket_size"),
            reduce_bucket_numel=numel("reduce_bucket_size"),
            sync_bucket_numel=numel("allgather_bucket_size"),
            prefetch_distance=own.get("prefetch_distance"),
            max_live_numel=float(zero.get("stage3_max_live_parameters", float("inf"))),
            persistence_threshold=int(zero.get("stage3_param_persistence_threshold", 0)),
            overlap=zero.get("overlap_comm", True),
            memory_budget_bytes=parse_bytes(own["memory_budget"]) if "memory_budget" in own else None,
        )

    # NOTE [What ranks must agree on]
    # A setting that changes the collectives a rank issues (stage, buckets, prefetch, overlap,
    # clipping, accumulation, offload and tiling choices, the program cache, whether a monitor is
    # on: then every rank joins the gradient norm's all-reduce) or the numbers it
    # computes (the optimizer and every argument, the schedule, precision and loss scaling, the
    # compiler) must be the same on every rank: otherwise ranks hang in a collective or train
    # silently apart. ``fingerprint_fields`` is those settings, resolved (defaults filled in, so
    # ``"gradient_clipping": 0`` and no key agree, and ``lr`` 1 and 1.0 agree), as JSON; the engine
    # compares them across ranks before the first collective, and ``first_config_difference`` names
    # the first setting that differs. Left out: keys zerofx reads but does not act on, and the keys
    # marked ``per_rank`` in ``SCHEMA`` (paths, pinning, I/O windows, measured bandwidths and
    # per-rank budgets of the offload placement, logging): they change only where or how fast one
    # rank keeps its own state, so ranks may differ in them (different mounts or NVMe drives).

    def fingerprint_fields(self) -> dict[str, Any]:
        """The settings every rank must share (NOTE [What ranks must agree on]): a JSON-ready dict,
        the same for equal settings however they were written."""
        zero = self.raw.get("zero_optimization", {})
        own = self.raw.get("zerofx", {})
        zero_keys, own_keys = SCHEMA["zero_optimization"].children, SCHEMA["zerofx"].children
        assert zero_keys is not None and own_keys is not None
        tiling = self.tiling_options()
        fields = {
            "stage": self.stage,
            "world_size": self.world_size,
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "gradient_clipping": self.gradient_clipping,
            "optimizer": {"type": self.optimizer.type, "params": self.optimizer.resolved_params(), "fused": self.fused_optimizer},
            "scheduler": None if self.scheduler is None else self.scheduler.to_json(),
            "precision": {
                "compute_dtype": None if self.compute_dtype is None else str(self.compute_dtype).removeprefix("torch."),
                "loss_scaling": None if self.loss_scaling is None else asdict(self.loss_scaling),
            },
            "communication": asdict(self.schedule_options()),
            "offload": {
                "optimizer": _canonical(zero.get("offload_optimizer", {}), zero_keys["offload_optimizer"].children),
                "param": _canonical(zero.get("offload_param", {}), zero_keys["offload_param"].children),
                "gradients": _canonical(own.get("offload_gradients", {}), own_keys["offload_gradients"].children),
                "zerofx": _canonical(own.get("offload", {}), own_keys["offload"].children),
            },
            "tiling": None if tiling is None else asdict(tiling),
            "compile": self.graph_compiler.value,
            "program_cache_size": self.program_cache_size,
            "collective_timeout_s": self.collective_timeout_s,
            "shard_group_size": self.shard_group_size,
            "profile": self.profile,  # sizes buckets and prefetch: the collectives every rank issues
            "sequence_parallel": _canonical(own.get("sequence_parallel", {}), own_keys["sequence_parallel"].children),
            # A monitor on adds the gradient norm's all-reduce to every step (zerofx.monitors).
            "monitors": {"tensorboard": self.monitors.tensorboard is not None, "csv_monitor": self.monitors.csv_monitor is not None,
                         "wandb": self.monitors.wandb is not None},
        }
        return _jsonable(fields)

    def fingerprint(self) -> str:
        """A short hash of ``fingerprint_fields()``: equal on ranks whose settings agree."""
        text = json.dumps(self.fingerprint_fields(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def first_config_difference(fields_by_rank: list[Mapping[str, Any]]) -> str | None:
    """The first setting, in key order, on which ranks' ``fingerprint_fields()`` differ, as
    ``"gradient_clipping: rank 0 has 0.0, rank 1 has 1.0"``; None when they all agree."""
    flat = [_flatten(f) for f in fields_by_rank]
    for path in sorted(set().union(*flat)):
        values = [f.get(path, "(absent)") for f in flat]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r} has {json.dumps(v)}" for r, v in enumerate(values[:8]))
            return f"{path}: {shown}{', ...' if len(values) > 8 else ''}"
    return None


def _flatten(fields: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in fields.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _canonical(section: Mapping[str, Any], schema: Mapping[str, Key] | None) -> dict[str, Any]:
    """A schema-checked section as the fingerprint sees it: keys that are acted on and not
    ``per_rank``; numbers that may be fractional as floats, so 1 and 1.0 agree."""
    assert schema is not None
    out: dict[str, Any] = {}
    for name, value in section.items():
        key = schema[name]
        if key.per_rank or not key.acted_on:
            continue
        if key.children is not None:
            out[name] = _canonical(value, key.children)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and float in key.types:
            out[name] = float(value)
        else:
            out[name] = value
    return out


def _jsonable(value: Any) -> Any:
    """Plain JSON values: enums by value, tuples as lists, paths as strings, and the non-finite
    floats an option may default to (an unbounded ``max_live_numel``) as strings."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Enum):
        return _jsonable(value.value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    assert value is None or isinstance(value, (bool, int, float, str)), f"not JSON: {value!r}"
    return value


def _type_names(types: tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", str: "string", bool: "true/false", dict: "object", list: "list", tuple: "list"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


def _show(value: Any) -> str:
    """``repr(value)``, cut short when a pasted value is very long (a 400-digit number)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def _not_finite(value: Any) -> bool:
    """A number, or a list holding one, that is NaN, +-Infinity or too large for a float."""
    if isinstance(value, (list, tuple)):
        return any(_not_finite(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not is_finite_number(value)


def _validate(section: Mapping[str, Any], schema: Mapping[str, Key], prefix: str) -> None:
    for name, value in section.items():
        path = f"{prefix}{name}"
        if name not in schema:
            raise ConfigError(
                f"unknown config key {path!r}{did_you_mean(name, schema)}; accepted keys here: {', '.join(sorted(schema))}"
            )
        key = schema[name]
        is_bool = isinstance(value, bool)
        if not isinstance(value, key.types) or (is_bool and bool not in key.types):
            raise ConfigError(f"config key {path!r} must be {_a(_type_names(key.types))}, got {_show(value)}")
        if _not_finite(value):
            raise ConfigError(f"config key {path!r} got {_show(value)}, which is not a finite number; accepted: {key.accepted or 'a finite number'}")
        if key.check is not None and not key.check(value):
            raise ConfigError(f"config key {path!r} got {_show(value)}; accepted: {key.accepted}")
        if key.children is not None:
            _validate(value, key.children, f"{path}.")
        elif not key.acted_on and path not in _WARNED:
            _WARNED.add(path)
            warnings.warn(f"zerofx reads config key {path!r} but does not act on it yet", stacklevel=4)


def load_config(config: str | Path | Mapping[str, Any] | None) -> dict[str, Any]:
    """Read a config from a dict, a JSON file path, or None (an empty config)."""
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        return _read_config_file(Path(config))
    if isinstance(config, Mapping):
        return dict(config)
    raise ConfigError(f"config must be a dict, a path to a JSON file, or None; got {type(config).__name__}")


_FILE_ACCEPTED = "accepted: a JSON object ({...}) in UTF-8"


def _read_config_file(path: Path) -> dict[str, Any]:
    """A config file's top-level JSON object. Every failure is one ``ConfigError`` line naming the
    file and what is accepted: missing, unreadable, not UTF-8, not JSON, a key given twice in one
    object (DeepSpeed refuses that too), or a top level that is not an object."""
    name = str(path)
    if not path.is_file():
        raise ConfigError(f"config file {name!r} does not exist; pass a path to a JSON file or a dict")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {name!r} cannot be read ({exc.strerror or exc}); {_FILE_ACCEPTED}") from None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"config file {name!r} is UTF-16 text (it starts with a UTF-16 byte-order mark); {_FILE_ACCEPTED}: save it as UTF-8")
    try:
        text = data.decode("utf-8-sig")  # a UTF-8 byte-order mark is harmless: skip it
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {name!r} is not UTF-8 text (byte {exc.start} is {data[exc.start:exc.start + 1]!r}); "
                          f"{_FILE_ACCEPTED}") from None
    try:
        raw = json.loads(text, object_pairs_hook=_object_without_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {name!r} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                          f"{_FILE_ACCEPTED}") from None
    except _DuplicateKey as exc:
        raise ConfigError(f"config file {name!r} gives the key {exc.args[0]!r} twice in one object; {_FILE_ACCEPTED}, "
                          "each key once") from None
    if not isinstance(raw, dict):
        kind = {list: "a list", str: "a string", bool: "true/false", type(None): "null"}.get(type(raw), "a number")
        raise ConfigError(f"config file {name!r} holds {kind} at the top level, not an object; {_FILE_ACCEPTED}")
    return raw


class _DuplicateKey(Exception):
    """Raised inside ``json.loads``; ``_read_config_file`` turns it into a ``ConfigError``."""


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_config(
    config: str | Path | Mapping[str, Any] | None,
    *,
    stage: int | None = None,
    world_size: int | None = None,
) -> ZeroConfig:
    """Validate ``config`` and reconcile it with the ``stage=``/``world_size=`` arguments.

    A value given both ways must agree; otherwise that is an error naming both.
    """
    raw = load_config(config)
    _validate(raw, SCHEMA, "")
    if raw.get("bf16", {}).get("enabled") and raw.get("fp16", {}).get("enabled"):
        raise ConfigError("bf16.enabled and fp16.enabled are both true; enable at most one")
    zero = raw.get("zero_optimization", {})
    cfg_stage = zero.get("stage")
    if stage is not None and cfg_stage is not None and stage != cfg_stage:
        raise ConfigError(f"stage={stage} disagrees with the config's zero_optimization.stage={cfg_stage}; give one or make them equal")
    cfg_world = _config_world_size(raw)
    if world_size is not None and cfg_world is not None and world_size != cfg_world:
        raise ConfigError(f"world_size={world_size} disagrees with the config, which implies world size {cfg_world}; give one or make them equal")
    opt = raw.get("optimizer", {})
    params = dict(opt.get("params", {"lr": 1e-3}))
    params.setdefault("lr", 1e-3)
    kind = opt.get("type", "AdamW")
    bad = sorted(set(params) - set(OPTIMIZER_PARAMS[kind]))
    if bad:
        raise ConfigError(f"optimizer.params {bad} do not apply to optimizer type {kind!r}")
    if params.get("nesterov") and (params.get("momentum", 0) <= 0 or params.get("dampening", 0) != 0):
        # torch.optim.SGD refuses this when the engine builds it; say so at parse time.
        raise ConfigError(f"config key 'optimizer.params.nesterov' is true with momentum={params.get('momentum', 0)!r} and "
                          f"dampening={params.get('dampening', 0)!r}; accepted: nesterov with momentum > 0 and dampening 0")
    scheduler = SchedulerSpec.from_config(raw["scheduler"]) if raw.get("scheduler") else None
    offload, param_offload = OffloadOptions.from_config(raw), ParamOffloadOptions.from_config(raw)
    if param_offload is not None and offload is None and raw.get("zerofx", {}).get("offload", {}).get("delayed_update"):
        raise ConfigError("zerofx.offload.delayed_update needs zero_optimization.offload_optimizer; "
                          "it is not supported with offload_param alone")
    resolved_stage = stage if stage is not None else cfg_stage
    resolved_world = world_size if world_size is not None else cfg_world
    shard_group_size = raw.get("zerofx", {}).get("shard_group_size")
    check_shard_group_size(shard_group_size, stage=resolved_stage, world_size=resolved_world)
    check_sequence_parallel(raw, world_size=resolved_world)
    return ZeroConfig(
        stage=resolved_stage,
        world_size=resolved_world,
        shard_group_size=shard_group_size,
        optimizer=OptimizerSpec(type=kind, params=params),
        raw=raw,
        scheduler=scheduler,
        offload=offload,
        param_offload=param_offload,
        grad_offload=GradOffloadOptions.from_config(raw, stage=stage if stage is not None else cfg_stage),
        loss_scaling=LossScaleOptions.from_config(raw["fp16"]) if raw.get("fp16", {}).get("enabled") else None,
        steps_per_print=raw.get("steps_per_print"),
        monitors=MonitorOptions.from_config(raw),
    )


def check_shard_group_size(value: int | str | None, *, stage: int | None, world_size: int | None) -> None:
    """``zerofx.shard_group_size`` against what is known of the stage and world size: K must
    divide the world size, and stage 0 (nothing sharded) takes no K below the world size. Called
    at parse time and again at initialize, once the process group's size is known."""
    if value is None or value == "auto":
        return
    if world_size is not None and world_size % value:
        raise ConfigError(f"config key 'zerofx.shard_group_size' got {value}, which does not divide the world size {world_size}; "
                          f"accepted: a divisor of {world_size} ({', '.join(str(k) for k in range(1, world_size + 1) if world_size % k == 0)}) "
                          "or \"auto\"")
    if stage == 0 and (world_size is None or value < world_size):
        raise ConfigError(f"config key 'zerofx.shard_group_size' got {value} at ZeRO stage 0, which shards nothing; accepted at "
                          "stage 0: leave it out (or the world size); shard groups apply at stages 1-3")


def check_sequence_parallel(raw: Mapping[str, Any], *, world_size: int | None) -> None:
    """``zerofx.sequence_parallel`` against the world size and the features it does not compose
    with, each refused with the reason. Called at parse time and again at initialize, once the
    process group's size is known. Offload (optimizer, parameters, gradients), bf16, fp16 and
    shard groups compose: the rewrite acts on the forward before autograd and its exchanges run
    over the sequence group; offload acts on the optimizer step, the stage-3 fetch of shards and
    the backward's reduced shards; shard groups only change how gradients are averaged over all
    ranks; the loss's sum and token count are exchanged in fp32 at least; tiling plans each
    rank's slice (NOTE [Tiling a sequence-parallel forward] in zerofx/capture.py)
    (docs/sequence-parallel.md, "What composes with sequence parallelism")."""
    section = raw.get("zerofx", {}).get("sequence_parallel")
    if section is None:
        return
    if "size" not in section:
        raise ConfigError("config key 'zerofx.sequence_parallel.size' is missing; accepted: an integer >= 1 that divides the world size")
    size = section["size"]
    if world_size is not None and world_size % size:
        raise ConfigError(f"config key 'zerofx.sequence_parallel.size' got {size}, which does not divide the world size {world_size}; "
                          f"accepted: a divisor of {world_size} ({', '.join(str(k) for k in range(1, world_size + 1) if world_size % k == 0)})")
    if size == 1:
        return
    own = raw.get("zerofx", {})
    refused = [  # (key, the value set, whether refused, why, what is accepted with sequence parallelism)
        ("zerofx.compile", own.get("compile"), own.get("compile", "none") != "none",
         "Inductor lowers and runs the rewritten forward (its all-to-alls are functional collectives; the ring's "
         "zerofx::ring_attention is a custom op it calls as an opaque kernel), but no parity run "
         "has checked Inductor-compiled sequence-parallel graphs against plain PyTorch yet", '"none" (the graphs run eagerly)'),
    ]
    for key, value, present, why, accepted in refused:
        if present:
            raise ConfigError(f"config key {key!r} got {value!r}, which zerofx.sequence_parallel (size {size}) does not compose "
                              f"with: {why}; accepted with sequence parallelism: {accepted}")


def _config_world_size(raw: Mapping[str, Any]) -> int | None:
    """The world size a config states (``zerofx.world_size``) or implies (DeepSpeed's batch rule)."""
    explicit = raw.get("zerofx", {}).get("world_size")
    tbs, micro = raw.get("train_batch_size"), raw.get("train_micro_batch_size_per_gpu")
    gas = raw.get("gradient_accumulation_steps", 1)
    implied = None
    if tbs is not None and micro is not None:
        if tbs % (micro * gas):
            raise ConfigError(
                f"train_batch_size={tbs} is not train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={gas} x world size"
            )
        implied = tbs // (micro * gas)
        # The ranks of a sequence group share their batch: the rule counts data-parallel groups.
        implied *= raw.get("zerofx", {}).get("sequence_parallel", {}).get("size", 1)
    if explicit is not None and implied is not None and explicit != implied:
        raise ConfigError(f"zerofx.world_size={explicit} disagrees with the batch sizes, which imply {implied}")
    return explicit if explicit is not None else implied
