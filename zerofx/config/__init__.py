"""The DeepSpeed-shaped config: parsing and validation.

A config is a dict or a path to a JSON file, in DeepSpeed's shape, so a team keeps its
``ds_config.json``. zerofx's own additions live in a ``"zerofx"`` section, which DeepSpeed
ignores.

Every key is declared once in ``SCHEMA`` (``zerofx.config.schema``), with its type, its accepted values and whether
zerofx acts on it yet. An unknown key, a wrong type or a bad value raises ``ConfigError``
naming the key, the value and what is accepted; so does a number that is not finite (JSON as
Python reads it allows ``Infinity`` and ``NaN``) or a ``true``/``false`` where a number belongs. A
known key that zerofx does not act on yet is reported once, by name, as a warning.

``parse_config`` returns a frozen ``ZeroConfig`` whose fields are every option, typed and with
its default filled in (NOTE [Options are parsed once]; the defaults in ``zerofx.config.options``),
and ``fingerprint_fields()``, the settings every rank must share (NOTE [What ranks must agree on]).
What also needs the world size is resolved by ``zerofx.config.compile_options``.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from zerofx.cost_models.memory import OPTIMIZERS, optimizer_kind
from zerofx.passes.plan import ScheduleOptions
from zerofx.passes.plan.tiling import TilingOptions
from zerofx.passes.plan.sequence import SequenceParallelSpec
from zerofx.config.options import AutoOptions, NonFinite
from zerofx.config.options import (DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_GRADIENT_ACCUMULATION_STEPS, DEFAULT_GRADIENT_CLIPPING, DEFAULT_LR,
                                   DEFAULT_OPTIMIZER_TYPE, DEFAULT_PROFILE, DEFAULT_PROGRAM_CACHE_SIZE, CacheTrust, GraphCompiler,
                                   LossScaleOptions, MonitorOptions, plan_cache_dir, plan_cache_key_file, schedule_options,
                                   sequence_parallel_spec, tiling_options)
from zerofx.config.schema import SCHEMA, Key, type_names
from zerofx.common.errors import ConfigError, did_you_mean
from zerofx.config.offload_options import GradOffloadOptions, OffloadOptions, ParamOffloadOptions, check_grad_offload_stage
from zerofx.config.options import is_finite_number
from zerofx.config.schedulers import SchedulerSpec
from zerofx.common.units import parse_bytes as parse_bytes  # the byte sizes config values take, as ``zerofx.config.parse_bytes``

_WARNED: set[str] = set()
# Where the plan cache is and whom it trusts, not what a program is: left out of the plan-cache key.
PLAN_CACHE_KEYS = frozenset({"plan_cache", "plan_cache_trust", "plan_cache_key_file"})


def torch_optimizer_class(optimizer_type: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class of an optimizer type (NOTE [One optimizer table] in cost_models/memory.py)."""
    return getattr(torch.optim, OPTIMIZERS[optimizer_type].torch_class)


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer to build on each rank's shard, and with what arguments."""

    type: str = DEFAULT_OPTIMIZER_TYPE
    params: Mapping[str, Any] = field(default_factory=lambda: {"lr": DEFAULT_LR})

    @property
    def kind(self) -> str:
        """The row of ``OPTIMIZERS`` (cost_models/memory.py) the planner and the offload store account with."""
        return optimizer_kind(self.type, self.params)

    def resolved_params(self) -> dict[str, Any]:
        """Every argument the config may set for this type, with torch's default where it is
        silent: what each rank's optimizer runs with. Numbers as floats, betas as a list."""
        defaults = inspect.signature(torch_optimizer_class(self.type)).parameters
        out: dict[str, Any] = {}
        for key in OPTIMIZERS[self.type].params:
            v = self.params.get(key, defaults[key].default)
            out[key] = bool(v) if key == "nesterov" else [float(b) for b in v] if key == "betas" else float(v)
        return out


# NOTE [Options are parsed once]
# ``parse_config`` validates the config against ``SCHEMA`` and fills every field of
# ``ZeroConfig`` from it, defaults included (the constants and option classes of
# ``zerofx.config.options``); nothing reads an option from the config dict afterwards. ``raw``
# is kept only as what a checkpoint stores. The edges (the CLI's subcommands, ``zerofx train``,
# ``initialize`` and ``zerofx.compile`` given a dict or a path) parse once and pass the
# ``ZeroConfig`` on; ``parse_config`` given a ``ZeroConfig`` parses nothing and only reconciles it
# with a stage and world size (``ZeroConfig.for_run``), which is how a run's stage, the auto-plan's
# candidates and ``Program.replan`` vary it: typed, never through the dict. Options that also need
# the world size (the sequence group's name, the shard group size, checked against it) are
# resolved once per world size by ``compile_options`` (zerofx/config/compile_options.py), which the
# compiler and the runtime read.


@dataclass(frozen=True)
class ZeroConfig:
    """The validated config, as zerofx uses it: every field filled by ``parse_config``."""

    stage: int | None
    world_size: int | None
    optimizer: OptimizerSpec
    raw: Mapping[str, Any]  # the config as given: stored in checkpoint metadata, never read for an option
    train_batch_size: int | None  # the global batch (``train_batch_size``); None when left out
    train_micro_batch_size_per_gpu: int | None  # the batch per rank per micro-step; None when left out
    gradient_accumulation_steps: int
    gradient_clipping: float  # the largest global gradient norm; 0: no clipping
    compute_dtype: torch.dtype | None  # bfloat16 or float16 when mixed precision is on; None: the model's dtype
    graph_compiler: GraphCompiler  # ``zerofx.compile``
    fused_optimizer: bool  # ``zerofx.fused_optimizer``
    # Seconds a collective waits for its peers before the process group raises
    # (``zerofx.collective_timeout_s``; NOTE [The collective timeout]).
    collective_timeout_s: float
    # Compiled programs (one per input signature) kept at once, least recently used dropped first.
    program_cache_size: int
    # The hardware profile the planner plans for (``zerofx.profile``): a built-in name or a file
    # from ``zerofx calibrate``; ``profile_is_explicit`` when the config names it (then stage 3
    # sizes its prefetch distance from it).
    profile: str
    profile_is_explicit: bool
    plan_cache_dir: Path | None  # where the plan cache keeps its entries; None when it is off
    plan_cache_trust: CacheTrust  # who may write that directory and its entries
    plan_cache_key_file: Path  # the secret its entries are signed with
    schedule: ScheduleOptions  # the communication-schedule limits (DeepSpeed's keys, in elements)
    tiling: TilingOptions | None  # the ``zerofx.tiling`` section; None when it is absent
    # ``zerofx.sequence_parallel`` without its group (``compile_options`` names it); None when
    # the section is absent or its size is 1.
    sequence_parallel: SequenceParallelSpec | None
    # The offload and sequence-parallel sections as ranks must share them (``_canonical``,
    # NOTE [What ranks must agree on]).
    shared_sections: Mapping[str, Any]
    # The ``zerofx`` section as given, less ``PLAN_CACHE_KEYS`` (where the cache is and whom it
    # trusts, not what a program is): part of the plan-cache key (NOTE [What a plan-cache key covers] in zerofx/compiler/plan_cache.py).
    zerofx_section: Mapping[str, Any]
    scheduler: SchedulerSpec | None = None  # the ``scheduler`` section; None without one
    offload: OffloadOptions | None = None  # ``offload_optimizer`` with ``zerofx.offload``; None when off
    param_offload: ParamOffloadOptions | None = None  # ``offload_param``; None when off
    grad_offload: GradOffloadOptions | None = None  # ``zerofx.offload_gradients``; None when off
    loss_scaling: LossScaleOptions | None = None  # the ``fp16`` section's loss scaling; None unless fp16 is enabled
    steps_per_print: int | None = None  # rank 0 logs every this many optimizer steps; None: never
    monitors: MonitorOptions = MonitorOptions()  # tensorboard, csv_monitor, wandb; all None when off
    nonfinite: NonFinite = NonFinite.ERROR  # ``zerofx.nonfinite``: a non-finite loss or gradient stops the step
    # ``zerofx.shard_group_size``: an int dividing the world size, "auto" (the planner chooses),
    # or None (flat: one group of all ranks). NOTE [Shard groups of consecutive ranks].
    shard_group_size: int | str | None = None
    # ``zerofx.auto``: search the configuration at initialize (zerofx/compiler/autoplan.py); None when off.
    auto: AutoOptions | None = None
    # The stage and world size the config itself states (``zero_optimization.stage``;
    # ``zerofx.world_size`` or DeepSpeed's batch rule), None where it leaves them open: a stage or
    # world size given as an argument must agree with these (``for_run``), not with ``stage`` and
    # ``world_size``, which an earlier argument may have filled in.
    config_stage: int | None = None
    config_world_size: int | None = None
    # ``zerofx.memory_margin``: the share of ``zerofx.memory_budget`` the planners hold back, already
    # taken off ``schedule.memory_budget_bytes`` (NOTE [The memory margin] in zerofx/config/options.py); 0 without one.
    memory_margin: float = 0.0
    # Whether the config sets ``zerofx.fused_optimizer`` itself: where it does not, the auto-plan
    # turns it on with Inductor (zerofx/planner/space.py).
    fused_optimizer_is_explicit: bool = False

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
        tiling, shared = self.tiling, self.shared_sections
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
            "communication": asdict(self.schedule),
            "offload": {"optimizer": shared["offload_optimizer"], "param": shared["offload_param"], "gradients": shared["offload_gradients"],
                        "zerofx": shared["offload"]},
            "tiling": None if tiling is None else asdict(tiling),
            "compile": self.graph_compiler.value,
            "program_cache_size": self.program_cache_size,
            "collective_timeout_s": self.collective_timeout_s,
            "nonfinite": self.nonfinite.value,  # "off" issues no check, the others one all-reduce per step
            "shard_group_size": self.shard_group_size,
            "profile": self.profile,  # sizes buckets and prefetch: the collectives every rank issues
            "auto": self.auto is not None,  # the search chooses the stage, offload, tiling: every rank must run it
            "sequence_parallel": shared["sequence_parallel"],
            # A monitor on adds the gradient norm's all-reduce to every step (zerofx.runtime.monitors).
            "monitors": {"tensorboard": self.monitors.tensorboard is not None, "csv_monitor": self.monitors.csv_monitor is not None,
                         "wandb": self.monitors.wandb is not None},
        }
        return _jsonable(fields)

    def for_run(self, *, stage: int | None = None, world_size: int | None = None) -> ZeroConfig:
        """These options for a run at ``stage`` and ``world_size`` (None: as they are): each must
        agree with what the config states (``ConfigError`` naming both otherwise), and what
        depends on them is checked again. Parses nothing (NOTE [Options are parsed once])."""
        _check_agreement(stage, self.config_stage, world_size, self.config_world_size)
        resolved_stage = stage if stage is not None else self.stage
        resolved_world = world_size if world_size is not None else self.world_size
        if resolved_stage == self.stage and resolved_world == self.world_size:
            return self
        check_shard_group_size(self.shard_group_size, stage=resolved_stage, world_size=resolved_world)
        if self.sequence_parallel is not None and resolved_world is not None:
            check_sequence_parallel_size(self.sequence_parallel.size, world_size=resolved_world)
        if self.grad_offload is not None:
            check_grad_offload_stage(self.grad_offload.device.value, resolved_stage)
        return replace(self, stage=resolved_stage, world_size=resolved_world)

    def with_keys(self, keys: Mapping[str, Any] | None = None, *, drop: Iterable[str] = ()) -> ZeroConfig:
        """These options with config keys set (``keys``, by dotted path: ``"zerofx.memory_budget"``)
        or removed (``drop``), validated as the config's own keys are: how a flag overrides the
        config and how the planner builds a candidate, without anything outside this layer
        editing a config dict (NOTE [Options are parsed once]). A stage or world size an argument
        gave stays, unless the keys now state one."""
        cfg = parse_config(edited_config(self.raw, keys or {}, drop))
        given_stage = self.stage if self.config_stage is None else None
        given_world = self.world_size if self.config_world_size is None else None
        return cfg.for_run(stage=given_stage if cfg.config_stage is None else None,
                           world_size=given_world if cfg.config_world_size is None else None)

    def to_config_dict(self) -> dict[str, Any]:
        """The config these options were parsed from, as JSON-ready data: what the auto-plan
        writes out for its choice and what a checkpoint records."""
        return copy.deepcopy(dict(self.raw))

    def without_stage(self) -> ZeroConfig:
        """These options with the stage left open, as if the config set none: for planning the
        same config at another stage (``Program.replan``, the auto-plan's candidates)."""
        return replace(self, stage=None, config_stage=None)

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
            raise ConfigError(f"config key {path!r} must be {_a(type_names(key.types))}, got {_show(value)}")
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
    config: ZeroConfig | str | Path | Mapping[str, Any] | None,
    *,
    stage: int | None = None,
    world_size: int | None = None,
    keys: Mapping[str, Any] | None = None,
    drop: Iterable[str] = (),
) -> ZeroConfig:
    """Validate ``config`` and reconcile it with the ``stage=``/``world_size=`` arguments.

    A value given both ways must agree; otherwise that is an error naming both. A ``ZeroConfig``
    is not parsed again: it is only reconciled (``ZeroConfig.for_run``). ``keys`` and ``drop``
    (dotted paths) set and remove keys before the one parse: the CLI's flags that override the
    config's keys, checked as the file's own would be.
    """
    if isinstance(config, ZeroConfig):
        if keys or drop:
            config = config.with_keys(keys, drop=drop)
        return config.for_run(stage=stage, world_size=world_size)
    raw = load_config(config)
    if keys or drop:
        raw = edited_config(raw, keys or {}, drop)
    _validate(raw, SCHEMA, "")
    if raw.get("bf16", {}).get("enabled") and raw.get("fp16", {}).get("enabled"):
        raise ConfigError("bf16.enabled and fp16.enabled are both true; enable at most one")
    zero = raw.get("zero_optimization", {})
    cfg_stage = zero.get("stage")
    cfg_world = _config_world_size(raw)
    _check_agreement(stage, cfg_stage, world_size, cfg_world)
    opt = raw.get("optimizer", {})
    params = dict(opt.get("params", {"lr": DEFAULT_LR}))
    params.setdefault("lr", DEFAULT_LR)
    kind = opt.get("type", DEFAULT_OPTIMIZER_TYPE)
    bad = sorted(set(params) - set(OPTIMIZERS[kind].params))
    if bad:
        raise ConfigError(f"optimizer.params {bad} do not apply to optimizer type {kind!r}")
    if params.get("nesterov") and (params.get("momentum", 0) <= 0 or params.get("dampening", 0) != 0):
        # torch.optim.SGD refuses this when the engine builds it; say so at parse time.
        raise ConfigError(f"config key 'optimizer.params.nesterov' is true with momentum={params.get('momentum', 0)!r} and "
                          f"dampening={params.get('dampening', 0)!r}; accepted: nesterov with momentum > 0 and dampening 0")
    scheduler = SchedulerSpec.from_config(raw["scheduler"]) if raw.get("scheduler") else None
    offload, param_offload = OffloadOptions.from_config(raw), ParamOffloadOptions.from_config(raw)
    own = raw.get("zerofx", {})
    if param_offload is not None and offload is None and own.get("offload", {}).get("delayed_update"):
        raise ConfigError("zerofx.offload.delayed_update needs zero_optimization.offload_optimizer; "
                          "it is not supported with offload_param alone")
    resolved_stage = stage if stage is not None else cfg_stage
    resolved_world = world_size if world_size is not None else cfg_world
    shard_group_size = own.get("shard_group_size")
    check_shard_group_size(shard_group_size, stage=resolved_stage, world_size=resolved_world)
    check_sequence_parallel(own, world_size=resolved_world)
    bf16, fp16 = raw.get("bf16", {}).get("enabled", False), raw.get("fp16", {}).get("enabled", False)
    auto = AutoOptions.from_config(raw)
    if auto is not None and "memory_budget" not in own:
        raise ConfigError("config key 'zerofx.auto' is true but 'zerofx.memory_budget' is missing: the search keeps the configurations "
                          "whose peak fits the budget; accepted: zerofx.memory_budget as bytes or a size such as \"80GiB\" "
                          "(or leave out zerofx.auto)")
    if "memory_margin" in own and "memory_budget" not in own:
        raise ConfigError(f"config key 'zerofx.memory_margin' is {own['memory_margin']!r} but 'zerofx.memory_budget' is missing: the "
                          "margin is a share of the budget; accepted: zerofx.memory_budget as bytes or a size such as \"80GiB\" "
                          "(or leave out zerofx.memory_margin)")
    if own.get("recompute") == "auto" and "memory_budget" not in own:
        raise ConfigError("config key 'zerofx.recompute' is \"auto\" but 'zerofx.memory_budget' is missing: \"auto\" recomputes "
                          "the fewest activations that make the step fit the budget; accepted: zerofx.memory_budget as bytes or a "
                          "size such as \"80GiB\", or zerofx.recompute true (every activation that can be rebuilt) or false")
    return ZeroConfig(
        auto=auto,
        stage=resolved_stage,
        world_size=resolved_world,
        shard_group_size=shard_group_size,
        optimizer=OptimizerSpec(type=kind, params=params),
        raw=raw,
        train_batch_size=raw.get("train_batch_size"),
        train_micro_batch_size_per_gpu=raw.get("train_micro_batch_size_per_gpu"),
        gradient_accumulation_steps=int(raw.get("gradient_accumulation_steps", DEFAULT_GRADIENT_ACCUMULATION_STEPS)),
        gradient_clipping=float(raw.get("gradient_clipping", DEFAULT_GRADIENT_CLIPPING)),
        compute_dtype=torch.bfloat16 if bf16 else torch.float16 if fp16 else None,
        graph_compiler=GraphCompiler(own.get("compile", GraphCompiler.NONE.value)),
        fused_optimizer=bool(own.get("fused_optimizer", False)),
        collective_timeout_s=float(own.get("collective_timeout_s", DEFAULT_COLLECTIVE_TIMEOUT_S)),
        program_cache_size=int(own.get("program_cache_size", DEFAULT_PROGRAM_CACHE_SIZE)),
        profile=str(own.get("profile", DEFAULT_PROFILE)),
        profile_is_explicit="profile" in own,
        plan_cache_dir=plan_cache_dir(own.get("plan_cache")),
        plan_cache_trust=CacheTrust(own.get("plan_cache_trust", CacheTrust.PRIVATE.value)),
        plan_cache_key_file=plan_cache_key_file(own.get("plan_cache_key_file")),
        schedule=schedule_options(zero, own),
        tiling=None if own.get("tiling") is None else tiling_options(own["tiling"]),
        sequence_parallel=sequence_parallel_spec(own.get("sequence_parallel")),
        shared_sections=_shared_sections(zero, own),
        zerofx_section=copy.deepcopy({k: v for k, v in own.items() if k not in PLAN_CACHE_KEYS}),
        scheduler=scheduler,
        offload=offload,
        param_offload=param_offload,
        grad_offload=GradOffloadOptions.from_config(raw, stage=stage if stage is not None else cfg_stage),
        loss_scaling=LossScaleOptions.from_config(raw["fp16"]) if fp16 else None,
        steps_per_print=raw.get("steps_per_print"),
        monitors=MonitorOptions.from_config(raw),
        nonfinite=NonFinite(own.get("nonfinite", NonFinite.ERROR.value)),
        config_stage=cfg_stage,
        config_world_size=cfg_world,
        memory_margin=float(own.get("memory_margin", 0)),
        fused_optimizer_is_explicit="fused_optimizer" in own,
    )


def edited_config(raw: Mapping[str, Any], keys: Mapping[str, Any], drop: Iterable[str]) -> dict[str, Any]:
    """A copy of ``raw`` with each dotted key in ``keys`` set (its sections made as needed) and
    each in ``drop`` removed, with the sections it leaves empty."""
    out = copy.deepcopy(dict(raw))
    for path in drop:
        *parents, leaf = path.split(".")
        chain, section = [], out
        for name in parents:
            if not isinstance(section.get(name), dict):
                break
            chain.append((section, name))
            section = section[name]
        else:
            section.pop(leaf, None)
            for parent, name in reversed(chain):  # the sections left empty go too
                if not parent[name]:
                    parent.pop(name)
    for path, value in keys.items():
        *parents, leaf = path.split(".")
        section = out
        for name in parents:
            section[name] = dict(section.get(name) or {})
            section = section[name]
        section[leaf] = copy.deepcopy(value)
    return out


def recorded_sequence_parallel_size(record: Mapping[str, Any]) -> int:
    """The sequence-parallel size of a config as a checkpoint recorded it (``ZeroConfig.raw``),
    read as written: a record is history, and an older one need not validate today."""
    section = record.get("zerofx", {}).get("sequence_parallel") or {}
    return int(section.get("size", 1))


def _check_agreement(stage: int | None, cfg_stage: int | None, world_size: int | None, cfg_world: int | None) -> None:
    """A stage or world size given as an argument against the one the config states."""
    if stage is not None and cfg_stage is not None and stage != cfg_stage:
        raise ConfigError(f"stage={stage} disagrees with the config's zero_optimization.stage={cfg_stage}; give one or make them equal")
    if world_size is not None and cfg_world is not None and world_size != cfg_world:
        raise ConfigError(f"world_size={world_size} disagrees with the config, which implies world size {cfg_world}; give one or make them equal")


def _shared_sections(zero: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """The sections the fingerprint compares as written (``_canonical``): the offload sections and
    ``zerofx.sequence_parallel``, each {} when absent."""
    zero_keys, own_keys = SCHEMA["zero_optimization"].children, SCHEMA["zerofx"].children
    assert zero_keys is not None and own_keys is not None
    return {
        "offload_optimizer": _canonical(zero.get("offload_optimizer", {}), zero_keys["offload_optimizer"].children),
        "offload_param": _canonical(zero.get("offload_param", {}), zero_keys["offload_param"].children),
        "offload_gradients": _canonical(own.get("offload_gradients", {}), own_keys["offload_gradients"].children),
        "offload": _canonical(own.get("offload", {}), own_keys["offload"].children),
        "sequence_parallel": _canonical(_one_spelling(own.get("sequence_parallel", {})), own_keys["sequence_parallel"].children),
    }


def _one_spelling(section: Mapping[str, Any]) -> dict[str, Any]:
    """``zerofx.sequence_parallel`` with ``attention`` written as ``mixers.attention``: the two are
    one setting (``check_sequence_parallel`` refuses them differing), so ranks that spell it
    differently agree."""
    out = {k: v for k, v in section.items() if k != "attention"}
    if "attention" in section:
        out["mixers"] = {**section.get("mixers", {}), "attention": section["attention"]}
    return out


def check_shard_group_size(value: int | str | None, *, stage: int | None, world_size: int | None) -> None:
    """``zerofx.shard_group_size`` against what is known of the stage and world size: K must
    divide the world size, and stage 0 (nothing sharded) takes no K below the world size. Called
    at parse time and again by ``compile_options``, for the world size planned or run."""
    if value is None or value == "auto":
        return
    if world_size is not None and world_size % value:
        raise ConfigError(f"config key 'zerofx.shard_group_size' got {value}, which does not divide the world size {world_size}; "
                          f"accepted: a divisor of {world_size} ({', '.join(str(k) for k in range(1, world_size + 1) if world_size % k == 0)}) "
                          "or \"auto\"")
    if stage == 0 and (world_size is None or value < world_size):
        raise ConfigError(f"config key 'zerofx.shard_group_size' got {value} at ZeRO stage 0, which shards nothing; accepted at "
                          "stage 0: leave it out (or the world size); shard groups apply at stages 1-3")


def check_sequence_parallel(own: Mapping[str, Any], *, world_size: int | None) -> None:
    """The schema-checked ``zerofx`` section's ``sequence_parallel``: its size against the world
    size when known (the world size known only at initialize is checked by ``compile_options``),
    and its attention strategy given once or twice alike. Every other feature composes with it:
    offload (optimizer, parameters, gradients), bf16, fp16, shard groups, tiling and Inductor. The
    rewrite acts on the forward before autograd and its exchanges run over the sequence group;
    offload acts on the optimizer step, the stage-3 fetch of shards and the backward's reduced
    shards; shard groups only change how gradients are averaged over all ranks; the loss's sum and
    token count are exchanged in fp32 at least; tiling plans each rank's slice (NOTE [Tiling a
    sequence-parallel forward] in zerofx/compiler/pipeline.py); Inductor compiles the rewritten
    graphs, functional all-to-alls and custom ops included (docs/sequence-parallel.md, "What
    composes with sequence parallelism")."""
    section = own.get("sequence_parallel")
    if section is None:
        return
    if "size" not in section:
        raise ConfigError("config key 'zerofx.sequence_parallel.size' is missing; accepted: an integer >= 1 that divides the world size")
    size = section["size"]
    if world_size is not None:
        check_sequence_parallel_size(size, world_size=world_size)
    both = section.get("mixers", {}).get("attention")
    if "attention" in section and both is not None and both != section["attention"]:
        raise ConfigError(f"config keys 'zerofx.sequence_parallel.attention' ({section['attention']!r}) and "
                          f"'zerofx.sequence_parallel.mixers.attention' ({both!r}) are one setting and disagree; accepted: one of them, "
                          "or both the same")


def check_sequence_parallel_size(size: int, *, world_size: int) -> None:
    """``zerofx.sequence_parallel.size`` must divide the world size: at parse time when the
    config or the arguments give it, else by ``compile_options`` at initialize."""
    if world_size % size:
        raise ConfigError(f"config key 'zerofx.sequence_parallel.size' got {size}, which does not divide the world size {world_size}; "
                          f"accepted: a divisor of {world_size} ({', '.join(str(k) for k in range(1, world_size + 1) if world_size % k == 0)})")


def _config_world_size(raw: Mapping[str, Any]) -> int | None:
    """The world size a config states (``zerofx.world_size``) or implies (DeepSpeed's batch rule)."""
    explicit = raw.get("zerofx", {}).get("world_size")
    tbs, micro = raw.get("train_batch_size"), raw.get("train_micro_batch_size_per_gpu")
    gas = raw.get("gradient_accumulation_steps", DEFAULT_GRADIENT_ACCUMULATION_STEPS)
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
