"""The DeepSpeed-shaped config: parsing and validation.

A config is a dict or a path to a JSON file, in DeepSpeed's shape, so a team keeps its
``ds_config.json``. zerofx's own additions live in a ``"zerofx"`` section, which DeepSpeed
ignores.

Every key is declared once in ``SCHEMA`` below, with its type, its accepted values and whether
zerofx acts on it yet. An unknown key, a wrong type or a bad value raises ``ConfigError``
naming the key, the value and what is accepted. A known key that zerofx does not act on yet is
reported once, by name, as a warning.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from passes.plan import ScheduleOptions
from passes.plan_tiling import TilingOptions, tiling_options
from zerofx.errors import ConfigError, did_you_mean

OPTIMIZER_TYPES = ("AdamW", "Adam", "SGD")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


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

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | float) -> float:
    """'80GiB', '1.5 TB', '123' or a number -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a size; accepted: a number with an optional unit among B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    return float(m.group(1)) * _UNITS[m.group(2).upper()]


def _size(v: Any) -> bool:
    try:
        return parse_bytes(v) > 0
    except ConfigError:
        return False


_OFFLOAD_DEVICE = Key((str,), "where the state lives", lambda v: v in ("none", "cpu", "nvme"), "none, cpu or nvme")
_OFFLOAD_OPTIMIZER = {
    "device": _OFFLOAD_DEVICE,
    "nvme_path": Key((str,), "folder for NVMe offload files (one subfolder per rank)"),
    "pin_memory": Key((bool,), "pin host memory for offloaded state (CUDA)"),
    "buffer_count": Key((int,), "host buffers NVMe records pass through: the window", _pos_int, "an integer >= 1"),
    "ratio": Key(_NUM, "fraction of the optimizer state to offload (the rest stays on the device)", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
}
_OFFLOAD_PARAM = {
    "device": Key((str,), "where stage-3 parameter shards live between uses", lambda v: v in ("none", "cpu", "nvme"), "none, cpu or nvme"),
    "nvme_path": Key((str,), "folder for NVMe parameter files (one subfolder per rank)"),
    "pin_memory": Key((bool,), "pin host memory for offloaded parameters (CUDA)"),
    "buffer_count": Key((int,), "NVMe parameter reads in flight ahead of use: the window", _pos_int, "an integer >= 1"),
    "max_in_cpu": Key(_NUM, "with device nvme, parameter elements per rank kept in host memory (zerofx default 0)", lambda v: v >= 0, "a number >= 0"),
    "buffer_size": Key(_NUM, "elements per NVMe buffer (zerofx sizes each read to its shard)", lambda v: v > 0, "a number > 0", False),
}
_BYTES = lambda v: v >= 0  # noqa: E731
_ZEROFX_OFFLOAD = {
    "delayed_update": Key((bool,), "one-step delayed parameter update (DPU): the optimizer step runs during the next forward/backward; changes the numerics"),
    "device_budget_bytes": Key(_NUM, "optimizer-state bytes per rank kept on the device (default: (1 - ratio) x all)", _BYTES, "a number >= 0"),
    "cpu_budget_bytes": Key(_NUM, "optimizer-state bytes per rank in host memory (default: all with device cpu, 0 with nvme)", _BYTES, "a number >= 0"),
    "host_copy_bytes_per_s": Key(_NUM, "measured host <-> device copy bandwidth, for the placement plan", lambda v: v > 0, "a number > 0"),
    "nvme_read_bytes_per_s": Key(_NUM, "measured NVMe read bandwidth, for the placement plan", lambda v: v > 0, "a number > 0"),
    "nvme_write_bytes_per_s": Key(_NUM, "measured NVMe write bandwidth, for the placement plan", lambda v: v > 0, "a number > 0"),
}

SCHEMA: dict[str, Key] = {
    "zero_optimization": Key((dict,), "ZeRO settings", children={
        "stage": Key((int,), "ZeRO stage", lambda v: v in (0, 1, 2, 3), "0, 1, 2 or 3"),
        "overlap_comm": Key((bool,), "overlap collectives with compute"),
        "contiguous_gradients": Key((bool,), "copy gradients into a contiguous buffer", acted_on=False),
        "reduce_scatter": Key((bool,), "use reduce-scatter for gradients", acted_on=False),
        "reduce_bucket_size": Key(_NUM, "elements per gradient bucket", lambda v: v > 0, "a number > 0"),
        "allgather_bucket_size": Key(_NUM, "elements per all-gather bucket", lambda v: v > 0, "a number > 0"),
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
            "betas": Key((list, tuple), "Adam betas", lambda v: len(v) == 2 and all(isinstance(b, _NUM) and 0 <= b < 1 for b in v), "two numbers in [0, 1)"),
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
    "steps_per_print": Key((int,), "log every N optimizer steps", _pos_int, "an integer >= 1"),
    "scheduler": Key((dict,), "learning-rate scheduler", children={
        "type": Key((str,), "scheduler", lambda v: v in SCHEDULER_TYPES, ", ".join(SCHEDULER_TYPES)),
        "params": Key((dict,), "scheduler arguments", children={
            "warmup_min_lr": Key(_NUM, "learning rate at step 0", lambda v: v >= 0, "a number >= 0"),
            "warmup_max_lr": Key(_NUM, "learning rate after warm-up", lambda v: v >= 0, "a number >= 0"),
            "warmup_num_steps": Key((int,), "warm-up steps", _nonneg_int, "an integer >= 0"),
            "warmup_type": Key((str,), "warm-up curve", lambda v: v in ("log", "linear"), "log or linear"),
            "total_num_steps": Key((int,), "steps until the schedule ends", _pos_int, "an integer >= 1"),
            "warmup_min_ratio": Key(_NUM, "WarmupCosineLR: start ratio of the optimizer's lr", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
            "cos_min_ratio": Key(_NUM, "WarmupCosineLR: final ratio of the optimizer's lr", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
            "last_batch_iteration": Key((int,), "resume position", acted_on=False),
        }),
    }),
    "bf16": Key((dict,), "bfloat16 mixed precision", children={
        "enabled": Key((bool,), "train in bfloat16 with fp32 master weights"),
    }),
    "fp16": Key((dict,), "float16 mixed precision with loss scaling", children={
        "enabled": Key((bool,), "train in float16 with fp32 master weights"),
        "loss_scale": Key(_NUM, "static loss scale; 0 for dynamic", lambda v: v >= 0, "a number >= 0"),
        "initial_scale_power": Key((int,), "dynamic scale starts at 2**this", _nonneg_int, "an integer >= 0"),
        "loss_scale_window": Key((int,), "overflow-free steps before the scale doubles", _pos_int, "an integer >= 1"),
        "hysteresis": Key((int,), "overflows tolerated before the scale halves", _pos_int, "an integer >= 1"),
        "min_loss_scale": Key(_NUM, "the dynamic scale's floor", lambda v: v > 0, "a number > 0"),
        "auto_cast": Key((bool,), "cast inputs to fp16", acted_on=False),
        "consecutive_hysteresis": Key((bool,), "refill hysteresis after a good step", acted_on=False),
    }),
    "wall_clock_breakdown": Key((bool,), "timing breakdown", acted_on=False),
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


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer to build on each rank's shard, and with what arguments."""

    type: str = "AdamW"
    params: Mapping[str, Any] = field(default_factory=lambda: {"lr": 1e-3})


@dataclass(frozen=True)
class ZeroConfig:
    """The validated config, as zerofx uses it."""

    stage: int | None
    world_size: int | None
    optimizer: OptimizerSpec
    raw: Mapping[str, Any]

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


def _type_names(types: tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", str: "string", bool: "true/false", dict: "object", list: "list", tuple: "list"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


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
            raise ConfigError(f"config key {path!r} must be a {_type_names(key.types)}, got {value!r}")
        if key.check is not None and not key.check(value):
            raise ConfigError(f"config key {path!r} got {value!r}; accepted: {key.accepted}")
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
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass a path to a JSON file or a dict")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from exc
    if isinstance(config, Mapping):
        return dict(config)
    raise ConfigError(f"config must be a dict, a path to a JSON file, or None; got {type(config).__name__}")


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
    if kind == "SGD":
        bad = sorted(set(params) & {"betas", "eps"})
    else:
        bad = sorted(set(params) & {"momentum", "nesterov", "dampening"})
    if bad:
        raise ConfigError(f"optimizer.params {bad} do not apply to optimizer type {kind!r}")
    from zerofx.offload import OffloadOptions  # offload imports the cost models; only its checks are needed here
    from zerofx.param_offload import ParamOffloadOptions

    OffloadOptions.from_config(raw)  # offload settings that contradict each other
    ParamOffloadOptions.from_config(raw)
    return ZeroConfig(
        stage=stage if stage is not None else cfg_stage,
        world_size=world_size if world_size is not None else cfg_world,
        optimizer=OptimizerSpec(type=kind, params=params),
        raw=raw,
    )


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
    if explicit is not None and implied is not None and explicit != implied:
        raise ConfigError(f"zerofx.world_size={explicit} disagrees with the batch sizes, which imply {implied}")
    return explicit if explicit is not None else implied
