"""Every config key, declared once (``SCHEMA``): its accepted types, its check and what it
accepts, whether zerofx acts on it yet, and whether ranks may set it differently.
``zerofx.config`` validates against it; ``schema_rows`` renders it for ``zerofx config-schema``
and docs/config.md."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofx.cost_models.memory import OPTIMIZER_TYPES
from zerofx.cost_models.tiers import NO_OFFLOAD, OFFLOAD_TIERS
from zerofx.cost_models.profiles import BUILTIN as BUILTIN_PROFILES
from zerofx.passes.plan.sequence import ATTENTION_KEY, AUTO, MIXER_KEYS, MixerKey
from zerofx.config.options import (DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_MONITOR_JOB_NAME, DEFAULT_PROGRAM_CACHE_SIZE, DEFAULT_WANDB_PROJECT,
                                   MAX_COLLECTIVE_TIMEOUT_S, MAX_INITIAL_SCALE_POWER, MAX_LOSS_SCALE, PLAN_CACHE_ENV,
                                   GraphCompiler, LossScaleOptions)
from zerofx.common.errors import ConfigError
from zerofx.config.options import NonFinite, is_finite_number
from zerofx.config.schedulers import SCHEDULER_TYPES
from zerofx.common.units import parse_bytes


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


def _strategy_key(mixer: MixerKey) -> Key:
    """The config key naming how ``mixer``'s op class shards: one of its strategies, or "auto"."""
    accepted = (*mixer.strategies, AUTO)
    return Key((str,), mixer.doc, lambda v: v in accepted, ", ".join(f'"{s}"' for s in accepted))


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

# parse_bytes ('80GiB', '1.5 TB', '123' or a number -> bytes) lives in zerofx.common.units, torch-free
# for the command line's --budget; config imports it from there (and keeps the name).


def _size(v: Any) -> bool:
    try:
        return parse_bytes(v) > 0
    except ConfigError:
        return False


# The offload ``device`` keys' spellings, from the tier enum: "none", "cpu", "nvme".
_OFFLOAD_DEVICES = (NO_OFFLOAD, *(t.value for t in OFFLOAD_TIERS))
_OFFLOAD_DEVICES_ACCEPTED = f"{', '.join(_OFFLOAD_DEVICES[:-1])} or {_OFFLOAD_DEVICES[-1]}"


def _offload_device(v: Any) -> bool:
    return v in _OFFLOAD_DEVICES


_OFFLOAD_DEVICE = Key((str,), "where the state lives", _offload_device, _OFFLOAD_DEVICES_ACCEPTED)
_OFFLOAD_OPTIMIZER = {
    "device": _OFFLOAD_DEVICE,
    "nvme_path": Key((str,), "folder for NVMe offload files (one subfolder per rank)", per_rank=True),
    "pin_memory": Key((bool,), "pin host memory for offloaded state (CUDA)", per_rank=True),
    "buffer_count": Key((int,), "host buffers NVMe records pass through: the window", _pos_int, "an integer >= 1", per_rank=True),
    "ratio": Key(_NUM, "fraction of the optimizer state to offload (the rest stays on the device)", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
}
_OFFLOAD_PARAM = {
    "device": Key((str,), "where stage-3 parameter shards live between uses", _offload_device, _OFFLOAD_DEVICES_ACCEPTED),
    "nvme_path": Key((str,), "folder for NVMe parameter files (one subfolder per rank)", per_rank=True),
    "pin_memory": Key((bool,), "pin host memory for offloaded parameters (CUDA)", per_rank=True),
    "buffer_count": Key((int,), "NVMe parameter reads in flight ahead of use: the window", _pos_int, "an integer >= 1", per_rank=True),
    "max_in_cpu": Key(_NUM, "with device nvme, parameter elements per rank kept in host memory (zerofx default 0)", lambda v: v >= 0, "a number >= 0"),
    "buffer_size": Key(_NUM, "elements per NVMe buffer (zerofx sizes each read to its shard)", lambda v: v > 0, "a number > 0", False),
}
_OFFLOAD_GRADIENTS = {
    "device": Key((str,), "where reduced gradient shards live until the optimizer step", _offload_device, _OFFLOAD_DEVICES_ACCEPTED),
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
    "scheduler": Key((dict,), "learning-rate scheduler (zerofx/config/schedulers.py says which keys each type takes and requires)", children={
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
        "memory_margin": Key((int, float), "the share of zerofx.memory_budget held back for the memory model's error: the "
                             "planner, recompute \"auto\" and the search fit the predicted peak to the budget times (1 - margin) "
                             "(default 0; docs/autoplan.md)", lambda v: not isinstance(v, bool) and 0 <= v < 1, "a number from 0 up to, not including, 1"),
        "auto": Key((bool,), "search the stage, shard group size, optimizer offload and tiling for the most predicted tokens/s "
                    "whose peak fits zerofx.memory_budget (required with it), at initialize; keys the config sets itself are kept "
                    "(docs/autoplan.md)"),
        "recompute": Key((bool, str), "activation recompute: false (the partitioner's own choice), \"auto\" (the fewest saved "
                         "activations, cheapest bytes per second first, that make the step fit zerofx.memory_budget, required with it), "
                         "or true (every saved activation that can be rebuilt) (docs/recompute.md)",
                         lambda v: v in (True, False, "auto"), "true, false or \"auto\""),
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
            "conv": Key((bool,), "may recompute convolutions (direct and FFT) in backward from their input instead of saving their "
                        "padded inputs, spectra and outputs"),
            "weight_tile_bytes": Key((int, str), "the largest weight tile: bigger weights are used in tiles of at most this size", _bytes_pos,
                                     "bytes >= 1 or a size such as \"64MiB\""),
        }),
        "compile": Key((str,), "compile each rank's forward and backward graphs: none (run them as FX code) or inductor",
                       lambda v: v in {c.value for c in GraphCompiler}, ", ".join(c.value for c in GraphCompiler)),
        "fused_optimizer": Key((bool,), "Adam/AdamW with fused=True (one kernel over all of a rank's shards)"),
        "reduce_scatter_by_all_to_all": Key((bool, str), "issue each gradient reduce-scatter as an all-to-all and a sum: \"auto\" "
                                            "(default) on a gloo process group, where a reduce-scatter runs as an all-reduce of twice "
                                            "the bytes; true or false to choose (NOTE [gloo's reduce-scatter as an all-to-all])",
                                            lambda v: v in (True, False, "auto"), "true, false or \"auto\""),
        "offload": Key((dict,), "offload planning and the delayed update (with zero_optimization.offload_optimizer)", children=_ZEROFX_OFFLOAD),
        "offload_gradients": Key((dict,), "gradient offload (stages 2-3): each reduced gradient shard goes to host memory or NVMe "
                                 "as soon as its bucket's reduction completes, and the optimizer reads it there", children=_OFFLOAD_GRADIENTS),
        "collective_timeout_s": Key(_NUM, f"seconds a collective may wait for its peers before the process group raises (default "
                                    f"{DEFAULT_COLLECTIVE_TIMEOUT_S:g}; torch's own is 1800)", lambda v: 0 < v <= MAX_COLLECTIVE_TIMEOUT_S,
                                    f"a number of seconds in (0, {MAX_COLLECTIVE_TIMEOUT_S:g}]"),
        "nonfinite": Key((str,), "a NaN or infinite loss or gradient at a step: \"error\" (default) stops the step on every rank "
                         "naming the step, rank and loss or parameter; \"skip\" skips the update, as fp16 loss scaling skips an "
                         "overflow; \"off\" does not check (NOTE [Non-finite values])", lambda v: v in {p.value for p in NonFinite},
                         ", ".join(f'"{p.value}"' for p in NonFinite)),
        "program_cache_size": Key((int,), f"compiled programs (one per input shape) kept, least recently used dropped first (default "
                                  f"{DEFAULT_PROGRAM_CACHE_SIZE})", _pos_int, "an integer >= 1"),
        "shard_group_size": Key((int, str), "ranks that share one sharded copy of the ZeRO state: groups of this many consecutive "
                                "ranks, replicated across groups (default: the world size, flat; \"auto\": the planner chooses)",
                                lambda v: v == "auto" or _pos_int(v), "an integer >= 1 that divides the world size, or \"auto\""),
        "sequence_parallel": Key((dict,), "sequence parallelism: groups of `size` consecutive ranks share each sequence, each rank "
                                 "running 1/size of it (NOTE [Sequence parallelism as a rewrite])", children={
            "size": Key((int,), "ranks per sequence group; data-parallel size = world size / size", _pos_int,
                        "an integer >= 1 that divides the world size"),
            "attention": _strategy_key(ATTENTION_KEY),
            "mixers": Key((dict,), "the strategy of each op class that mixes positions (NOTE [Sequence mixers]); "
                          "\"attention\" here is the same setting as sequence_parallel.attention", children={
                m.name: _strategy_key(m) for m in MIXER_KEYS}),
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
        "plan_cache_trust": Key((str,), "who may write the plan cache's directory and entries: \"private\" (default: owned by you and "
                                "writable by no one else, else the cache is skipped with a warning) or \"group\" (a team cache: the "
                                "directory's group may write it too, so every member runs code any member wrote there; never "
                                "world-writable). Entries are signed with plan_cache_key_file either way (docs/plan-cache.md)",
                                lambda v: v in ("private", "group"), "\"private\" or \"group\"", per_rank=True),
        "plan_cache_key_file": Key((str,), "the secret the plan cache signs and checks its entries with, made on first use with "
                                   "permissions 0600 (default: $XDG_CONFIG_HOME/zerofx/plan-cache.key, else "
                                   "~/.config/zerofx/plan-cache.key); with plan_cache_trust \"group\", a file the team shares",
                                   lambda v: v != "", "a file path", per_rank=True),
    }),
}

def schema_rows(schema: Mapping[str, Key] = SCHEMA, prefix: str = "") -> list[tuple[str, str, str, str, str]]:
    """(key, type, accepted, acted on?, meaning) for every key, depth first: the config's
    documentation, generated from ``SCHEMA`` so it is never written twice."""
    rows = []
    for name, key in schema.items():
        path = f"{prefix}{name}"
        rows.append((path, type_names(key.types), key.accepted or "-", "yes" if key.acted_on else "read, warns", key.doc))
        if key.children is not None:
            rows += schema_rows(key.children, f"{path}.")
    return rows


def type_names(types: tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", str: "string", bool: "true/false", dict: "object", list: "list", tuple: "list"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))
