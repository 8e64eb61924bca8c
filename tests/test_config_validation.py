"""Config validation at parse time (zerofx/config/__init__.py, zerofx/config/schedulers.py): numbers that are not
finite or out of range, betas, schedulers, unreadable config files, the collective timeout and
program cache keys, and the settings fingerprint ranks compare. Single process, no ranks."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from zerofx.app.cli import main
from zerofx.config import OptimizerSpec, first_config_difference, parse_config, torch_optimizer_class
from zerofx.config.compile_options import compile_options
from zerofx.cost_models.memory import OPTIMIZER_TYPES, OPTIMIZERS
from zerofx.config.options import DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_PROGRAM_CACHE_SIZE, LossScaleOptions
from zerofx.config.schema import SCHEMA, Key
from zerofx.common.errors import ConfigError
from zerofx.runtime.loss_scaling import LossScaler
from zerofx.config.schedulers import SchedulerSpec, SchedulerType, WarmupType
from zerofx.runtime.schedulers import lr_at

ROOT = Path(__file__).resolve().parents[1]


def leaves(schema: Mapping[str, Key] = SCHEMA, prefix: str = "") -> Iterator[tuple[str, Key]]:
    for name, key in schema.items():
        if key.children is None:
            yield f"{prefix}{name}", key
        else:
            yield from leaves(key.children, f"{prefix}{name}.")


def nested(path: str, value: Any) -> dict[str, Any]:
    """``"a.b.c", v`` -> ``{"a": {"b": {"c": v}}}``."""
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def with_key(base: Mapping[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    node = out
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


NUMBER_KEYS = sorted(p for p, k in leaves() if float in k.types)
INT_KEYS = sorted(p for p, k in leaves() if int in k.types and bool not in k.types)


# --------------------------------------------------------------------------- numbers (item 9)
@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
@pytest.mark.parametrize("path", NUMBER_KEYS)
def test_every_number_key_refuses_non_finite_json(tmp_path: Path, path: str, literal: str) -> None:
    """Python's json reads Infinity and NaN; every key that takes a number names the key, the
    value and what it accepts (``lr: Infinity`` trained to NaN, ``reduce_bucket_size: Infinity``
    was an OverflowError later)."""
    file = tmp_path / "ds_config.json"
    file.write_text(json.dumps(nested(path, "__VALUE__")).replace('"__VALUE__"', literal))
    with pytest.raises(ConfigError, match=rf"'{re.escape(path)}' got -?(inf|nan), which is not a finite number; accepted: "):
        parse_config(file)


@pytest.mark.parametrize("path", INT_KEYS)
def test_integers_too_large_for_a_float_are_refused(path: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{re.escape(path)}' got 1000.*characters\), which is not a finite number"):
        parse_config(nested(path, 10**400))


@pytest.mark.parametrize("path", sorted(set(NUMBER_KEYS) | set(INT_KEYS)))
def test_true_false_is_not_a_number(path: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{re.escape(path)}' must be an? .*(integer|number).*, got True"):
        parse_config(nested(path, True))


def test_schedule_options_of_a_refused_bucket_size_never_overflow() -> None:
    # What used to pass parse_config and then raise OverflowError in building the schedule options.
    with pytest.raises(ConfigError, match=r"reduce_bucket_size' got inf"):
        parse_config({"zero_optimization": {"reduce_bucket_size": math.inf}})


@pytest.mark.parametrize(
    "config, message",
    [
        ({"zero_optimization": {"reduce_bucket_size": 0.5}}, r"reduce_bucket_size' got 0.5; accepted: a number >= 1"),
        ({"zero_optimization": {"allgather_bucket_size": 0.5}}, r"allgather_bucket_size' got 0.5; accepted: a number >= 1"),
        ({"fp16": {"enabled": True, "initial_scale_power": 128}}, r"initial_scale_power' got 128; accepted: an integer in \[0, 127\]"),
        ({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -2}}}, r"last_batch_iteration' got -2; accepted: an integer >= -1"),
        ({"zerofx": {"memory_budget": "9" * 400}}, r"memory_budget' got '9999.*characters\); accepted: bytes > 0"),
        ({"zerofx": {"tiling": {"budget": "9" * 400}}}, r"tiling.budget' got '9999.*characters\); accepted: bytes >= 0"),
    ],
)
def test_numbers_out_of_range(config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(config)


# --------------------------------------------------------------------------- optimizer params
BETAS_ACCEPTED = r"; accepted: a list of two numbers in \[0, 1\)"


@pytest.mark.parametrize(
    "betas", [[False, 0.9], [0.9, True], [0.9], [0.9, 0.99, 0.999], [-0.1, 0.9], [0.9, 1.0], [math.nan, 0.9], [0.9, math.inf], ["0.9", 0.9], []]
)
def test_bad_betas_name_the_key_and_the_accepted_range(betas: list) -> None:
    with pytest.raises(ConfigError, match=r"'optimizer.params.betas' got .*" + BETAS_ACCEPTED) as info:
        parse_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": betas}}})
    assert repr(betas) in str(info.value)  # the value, as given


def test_beta1_zero_is_accepted_as_torch_accepts_it() -> None:
    assert parse_config({"optimizer": {"type": "Adam", "params": {"betas": [0, 0.99]}}}).optimizer.params["betas"] == [0, 0.99]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"lr": -1e-3}, r"'optimizer.params.lr' got -0.001; accepted: a number >= 0"),
        ({"lr": math.inf}, r"'optimizer.params.lr' got inf, which is not a finite number"),
        ({"eps": -1e-8}, r"'optimizer.params.eps' got -1e-08; accepted: a number > 0"),
        ({"eps": math.nan}, r"'optimizer.params.eps' got nan, which is not a finite number"),
        ({"weight_decay": -0.1}, r"'optimizer.params.weight_decay' got -0.1; accepted: a number >= 0"),
        ({"weight_decay": math.inf}, r"'optimizer.params.weight_decay' got inf, which is not a finite number"),
    ],
)
def test_adam_params_in_range(params: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"optimizer": {"type": "AdamW", "params": params}})


@pytest.mark.parametrize(
    "params, message",
    [
        ({"lr": 0.1, "momentum": -0.5}, r"'optimizer.params.momentum' got -0.5; accepted: a number >= 0"),
        ({"lr": 0.1, "momentum": math.inf}, r"'optimizer.params.momentum' got inf, which is not a finite number"),
        ({"lr": 0.1, "nesterov": True}, r"'optimizer.params.nesterov' is true with momentum=0 .*accepted: nesterov with momentum > 0 and dampening 0"),
        ({"lr": 0.1, "nesterov": True, "momentum": 0.9, "dampening": 0.1}, r"nesterov' is true with momentum=0.9 and dampening=0.1"),
    ],
)
def test_sgd_params_in_range(params: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"optimizer": {"type": "SGD", "params": params}})


def test_optimizer_param_lists_cover_the_schema() -> None:
    schema_params = SCHEMA["optimizer"].children["params"].children  # type: ignore[index]
    assert set().union(*(set(kind.params) for kind in OPTIMIZERS.values())) == set(schema_params)


# --------------------------------------------------------------------------- schedulers (item 10)
DECAY = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 2, "total_num_steps": 6, "warmup_type": "linear"}}


@pytest.mark.parametrize(
    "scheduler, message",
    [
        # silently lr 0 after the warm-up before
        ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
         r"WarmupDecayLR needs 'scheduler.params.total_num_steps' \(DeepSpeed requires it too\); accepted: an integer > warmup_num_steps \(10\)"),
        ({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10}}, r"WarmupCosineLR needs 'scheduler.params.total_num_steps'"),
        ({"type": "WarmupDecayLR"}, r"WarmupDecayLR needs 'scheduler.params.total_num_steps'"),
        # KeyError at the first step() before
        ({"params": {"warmup_num_steps": 10}},
         r"'scheduler.type' is missing .*accepted: WarmupLR, WarmupDecayLR, WarmupCosineLR, or no scheduler section"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, r"'scheduler.type' got 'OneCycle'; accepted: WarmupLR, WarmupDecayLR, WarmupCosineLR"),
        ({"type": "LRRangeTest"}, r"'scheduler.type' got 'LRRangeTest'; accepted: WarmupLR, WarmupDecayLR, WarmupCosineLR"),
        # keys the type does not take (DeepSpeed: TypeError, unexpected keyword argument)
        ({"type": "WarmupLR", "params": {"total_num_steps": 100}},
         r"'scheduler.params.total_num_steps' does not apply to scheduler type WarmupLR; accepted for WarmupLR: warmup_min_lr, "),
        ({"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}, r"'scheduler.params.cos_min_ratio' does not apply to scheduler type WarmupLR"),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_max_lr": 0.1}},
         r"'scheduler.params.warmup_max_lr' does not apply to scheduler type WarmupCosineLR"),
        # a decay with no steps: the default warm-up is 1000
        ({"type": "WarmupDecayLR", "params": {"total_num_steps": 500}},
         r"'scheduler.params.total_num_steps' got 500; accepted: an integer > warmup_num_steps \(1000, the default\)"),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 10}},
         r"'scheduler.params.total_num_steps' got 10; accepted: an integer > warmup_num_steps \(10\)"),
        ({"type": "WarmupLR", "params": {"warmup_max_lr": math.inf}}, r"'scheduler.params.warmup_max_lr' got inf, which is not a finite number"),
        ({"type": "WarmupLR", "params": {"warmup_min_lr": -0.1}}, r"'scheduler.params.warmup_min_lr' got -0.1; accepted: a number >= 0"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}}, r"'scheduler.params.warmup_num_steps' must be an integer, got 2.5"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": -1}}, r"'scheduler.params.warmup_num_steps' got -1; accepted: an integer >= 0"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, r"'scheduler.params.warmup_type' got 'cosine'; accepted: log or linear"),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "cos_min_ratio": 1.5}}, r"'scheduler.params.cos_min_ratio' got 1.5"),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_min_ratio": math.nan}}, r"warmup_min_ratio' got nan"),
    ],
)
def test_bad_schedulers_fail_at_parse_time(scheduler: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"scheduler": scheduler})


@pytest.mark.parametrize(
    "scheduler, message",
    [
        ({"params": {"warmup_num_steps": 10}}, r"'scheduler.type' is missing"),
        ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2}}, r"WarmupDecayLR needs 'scheduler.params.total_num_steps'"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": math.inf}}, r"'scheduler.params.warmup_num_steps' got inf; accepted: an integer >= 0"),
    ],
)
def test_lr_at_still_takes_a_dict_and_validates_it(scheduler: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        lr_at(scheduler, 3, 1.0)


def test_scheduler_is_parsed_into_a_frozen_spec() -> None:
    cfg = parse_config({"scheduler": DECAY})
    spec = cfg.scheduler
    assert spec == SchedulerSpec(SchedulerType.WARMUP_DECAY_LR, warmup_num_steps=2, warmup_type=WarmupType.LINEAR,
                                 warmup_max_lr=0.01, total_num_steps=6)
    with pytest.raises(AttributeError):
        spec.total_num_steps = 7  # type: ignore[misc,union-attr]
    assert [lr_at(spec, s, 1.0) for s in (0, 1, 2, 4, 6, 9)] == pytest.approx([0.0, 0.005, 0.01, 0.005, 0.0, 0.0])
    assert [lr_at(spec, s, 1.0) for s in range(10)] == [lr_at(DECAY, s, 1.0) for s in range(10)]
    assert spec.to_json() == {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                  "warmup_num_steps": 2, "warmup_type": "linear"}}
    assert parse_config({}).scheduler is None and parse_config({"scheduler": {}}).scheduler is None
    example = json.loads((ROOT / "examples" / "dna_lm_zero3.json").read_text())["scheduler"]
    assert parse_config({"scheduler": example}).scheduler.type is SchedulerType.WARMUP_COSINE_LR  # type: ignore[union-attr]


# --------------------------------------------------------------------------- config files
@pytest.mark.parametrize(
    "data, message",
    [
        (b"[1, 2]", r"holds a list at the top level, not an object"),  # AttributeError before
        (b'"zero"', r"holds a string at the top level, not an object"),
        (b"3", r"holds a number at the top level, not an object"),
        (b"null", r"holds null at the top level, not an object"),
        ('{"zero_optimization": {"stage": 3}}'.encode("utf-16"), r"is UTF-16 text \(it starts with a UTF-16 byte-order mark\)"),  # UnicodeDecodeError
        (b"\xfe\xff" + '{"zero_optimization": {"stage": 3}}'.encode("utf-16-be"), r"is UTF-16 text"),
        (b'{"optimizer": {"type": "\xe9"}}', r"is not UTF-8 text \(byte 24 is b'\\xe9'\)"),
        (b'{"zero_optimization": {"stage": 3}', r"is not valid JSON \(Expecting ',' delimiter at line 1, column 35\)"),
        (b"", r"is not valid JSON \(Expecting value at line 1, column 1\)"),
        (b'{"gradient_clipping": 1.0, "gradient_clipping": 0}', r"gives the key 'gradient_clipping' twice in one object"),
        (b'{"optimizer": {"params": {"lr": 1, "lr": 2}}}', r"gives the key 'lr' twice in one object"),
    ],
)
def test_unreadable_config_files_are_one_line_errors(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "ds_config.json"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"config file {str(path)!r}") and "accepted: a JSON object ({...}) in UTF-8" in text


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"zero_optimization": {"stage": 2}}')
    assert parse_config(path).stage == 2


# --------------------------------------------------------------------------- zerofx.collective_timeout_s, zerofx.program_cache_size
def test_collective_timeout_and_program_cache_keys() -> None:
    default = parse_config({})
    assert default.collective_timeout_s == DEFAULT_COLLECTIVE_TIMEOUT_S == 300.0 and isinstance(default.collective_timeout_s, float)
    assert default.program_cache_size == DEFAULT_PROGRAM_CACHE_SIZE == 8
    cfg = parse_config({"zerofx": {"collective_timeout_s": 60, "program_cache_size": 2}})
    assert cfg.collective_timeout_s == 60.0 and isinstance(cfg.collective_timeout_s, float) and cfg.program_cache_size == 2


@pytest.mark.parametrize(
    "zerofx, message",
    [
        ({"collective_timeout_s": 0}, r"'zerofx.collective_timeout_s' got 0; accepted: a number of seconds in \(0, 604800\]"),
        ({"collective_timeout_s": -5}, r"'zerofx.collective_timeout_s' got -5; accepted"),
        ({"collective_timeout_s": 1e12}, r"'zerofx.collective_timeout_s' got 1000000000000.0; accepted"),
        ({"collective_timeout_s": math.inf}, r"'zerofx.collective_timeout_s' got inf, which is not a finite number"),
        ({"collective_timeout_s": "60"}, r"'zerofx.collective_timeout_s' must be an integer or number, got '60'"),
        ({"program_cache_size": 0}, r"'zerofx.program_cache_size' got 0; accepted: an integer >= 1"),
        ({"program_cache_size": 2.0}, r"'zerofx.program_cache_size' must be an integer, got 2.0"),
        ({"program_cache_size": False}, r"'zerofx.program_cache_size' must be an integer, got False"),
    ],
)
def test_bad_timeout_and_cache_size(zerofx: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"zerofx": zerofx})


@pytest.mark.parametrize(
    "zerofx, message",
    [
        ({"memory_budget": "1GiB", "memory_margin": 1}, r"'zerofx.memory_margin' got 1; accepted: a number from 0 up to, not including, 1"),
        ({"memory_budget": "1GiB", "memory_margin": -0.1}, r"'zerofx.memory_margin' got -0.1; accepted"),
        ({"memory_budget": "1GiB", "memory_margin": True}, r"'zerofx.memory_margin' .*True"),
        ({"memory_budget": "1GiB", "memory_margin": "10%"}, r"'zerofx.memory_margin' must be an integer or number, got '10%'"),
        ({"memory_margin": 0.1}, r"'zerofx.memory_margin' is 0.1 but 'zerofx.memory_budget' is missing"),
    ],
)
def test_bad_memory_margin(zerofx: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"zerofx": zerofx})


def test_the_memory_margin_lowers_the_budget_the_planners_fit() -> None:
    # NOTE [The memory margin]: the plan carries the budget less the margin; no margin, the budget.
    assert parse_config({"zerofx": {"memory_budget": 1000}}).schedule.memory_budget_bytes == 1000
    assert parse_config({"zerofx": {"memory_budget": 1000, "memory_margin": 0.1}}).schedule.memory_budget_bytes == pytest.approx(900)
    assert parse_config({}).schedule.memory_budget_bytes is None


def test_config_schema_lists_the_new_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config-schema", "--format", "json"]) == 0
    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["zerofx.collective_timeout_s"]["accepted"] == "a number of seconds in (0, 604800]"
    assert "default 300" in rows["zerofx.collective_timeout_s"]["meaning"]
    assert rows["zerofx.program_cache_size"]["accepted"] == "an integer >= 1" and "default 8" in rows["zerofx.program_cache_size"]["meaning"]


# --------------------------------------------------------------------------- fp16 loss scaling, steps_per_print
SCALE_BOUND = re.escape("2**127")


@pytest.mark.parametrize(
    "fp16, message",
    [
        ({"loss_scale": -1}, rf"'fp16.loss_scale' got -1; accepted: a number >= 0 and <= {SCALE_BOUND} \(0: dynamic\)"),
        # a static scale past 2**127 overflowed every fp32 loss, so every step was skipped
        ({"loss_scale": 1e39}, rf"'fp16.loss_scale' got 1e\+39; accepted: a number >= 0 and <= {SCALE_BOUND}"),
        ({"loss_scale": math.inf}, r"'fp16.loss_scale' got inf, which is not a finite number; accepted: a number >= 0"),
        ({"loss_scale": "128"}, r"'fp16.loss_scale' must be an integer or number, got '128'"),
        ({"initial_scale_power": -1}, r"'fp16.initial_scale_power' got -1; accepted: an integer in \[0, 127\]"),
        ({"initial_scale_power": 16.0}, r"'fp16.initial_scale_power' must be an integer, got 16.0"),
        ({"loss_scale_window": 0}, r"'fp16.loss_scale_window' got 0; accepted: an integer >= 1"),
        ({"loss_scale_window": 10**400}, r"'fp16.loss_scale_window' got 1000.*characters\), which is not a finite number"),
        ({"hysteresis": 0}, r"'fp16.hysteresis' got 0; accepted: an integer >= 1"),
        ({"hysteresis": True}, r"'fp16.hysteresis' must be an integer, got True"),
        ({"min_loss_scale": 0}, rf"'fp16.min_loss_scale' got 0; accepted: a number > 0 and <= {SCALE_BOUND}"),
        ({"min_loss_scale": 2.0**128}, rf"'fp16.min_loss_scale' got 3.4028.*e\+38; accepted: a number > 0 and <= {SCALE_BOUND}"),
        ({"min_loss_scale": math.nan}, r"'fp16.min_loss_scale' got nan, which is not a finite number"),
        ({"consecutive_hysteresis": 1}, r"'fp16.consecutive_hysteresis' must be a true/false, got 1"),
        ({"loss_scale_windows": 10}, r"unknown config key 'fp16.loss_scale_windows'.*did you mean loss_scale_window"),
    ],
)
def test_bad_fp16_loss_scaling_names_the_key_and_what_is_accepted(fp16: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"fp16": {"enabled": True, **fp16}})


@pytest.mark.parametrize(
    "value, message",
    [
        (0, r"'steps_per_print' got 0; accepted: an integer >= 1"),
        (-10, r"'steps_per_print' got -10; accepted: an integer >= 1"),
        (2.5, r"'steps_per_print' must be an integer, got 2.5"),
        (False, r"'steps_per_print' must be an integer, got False"),
        ("10", r"'steps_per_print' must be an integer, got '10'"),
        (10**400, r"'steps_per_print' got 1000.*characters\), which is not a finite number"),
    ],
)
def test_bad_steps_per_print_names_the_key(value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"steps_per_print": value})


def test_loss_scaling_and_steps_per_print_are_parsed_into_typed_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_config({}).loss_scaling is None and parse_config({}).steps_per_print is None
    # fp16 keys are checked even with fp16 off, but only fp16 scales the loss.
    assert parse_config({"fp16": {"enabled": False, "loss_scale": 128}}).loss_scaling is None
    assert parse_config({"bf16": {"enabled": True}}).loss_scaling is None
    defaults = parse_config({"fp16": {"enabled": True}}).loss_scaling
    assert defaults == LossScaleOptions(loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1.0)
    cfg = parse_config({"fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 1,
                                 "min_loss_scale": 2}, "steps_per_print": 10})
    options = cfg.loss_scaling
    assert options == LossScaleOptions(loss_scale=128.0, initial_scale_power=12, loss_scale_window=500, hysteresis=1, min_loss_scale=2.0)
    assert isinstance(options.loss_scale, float) and isinstance(options.min_loss_scale, float) and cfg.steps_per_print == 10
    with pytest.raises(AttributeError):
        options.loss_scale = 1.0  # type: ignore[misc,union-attr]
    # What the engine's scaler starts from: a static scale, or 2**initial_scale_power.
    static = LossScaler.from_options(options)  # type: ignore[arg-type]
    assert (static.scale, static.dynamic) == (128.0, False)
    dynamic = LossScaler.from_options(LossScaleOptions(initial_scale_power=12, hysteresis=1, min_loss_scale=2048.0))
    dynamic.update(overflow=True)
    dynamic.update(overflow=True)
    assert (dynamic.scale, dynamic.dynamic) == (2048.0, True)  # halved once, then held at the floor
    # Defaults written out or left out: the same settings to every rank.
    written = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    assert parse_config({"fp16": written}).fingerprint() == parse_config({"fp16": {"enabled": True}}).fingerprint()
    # The schema documents the defaults.
    assert main(["config-schema", "--format", "json"]) == 0
    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)}
    assert "default 16" in rows["fp16.initial_scale_power"]["meaning"] and "default: no log" in rows["steps_per_print"]["meaning"]


# --------------------------------------------------------------------------- the fingerprint (items 4 and 11)
BASE: dict[str, Any] = {
    "zero_optimization": {
        "stage": 3, "overlap_comm": True, "reduce_bucket_size": 1000, "allgather_bucket_size": 1000, "stage3_prefetch_bucket_size": 1000,
        "stage3_max_live_parameters": 1e9, "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "cpu", "ratio": 1.0, "nvme_path": "/tmp/a", "pin_memory": False, "buffer_count": 4},
        "offload_param": {"device": "cpu", "max_in_cpu": 0, "nvme_path": "/tmp/a", "pin_memory": False, "buffer_count": 5},
    },
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                                                      "warmup_type": "linear", "total_num_steps": 100}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "zerofx": {
        "prefetch_distance": 1, "memory_budget": "80GiB", "compile": "none", "fused_optimizer": False,
        "tiling": {"enabled": "auto", "block_size": 64, "attention_block_size": 64, "budget": "2GiB", "attention": True, "region": True,
                   "loss": True, "weight": True, "weight_tile_bytes": "64MiB"},
        "offload": {"delayed_update": False, "device_budget_bytes": 0, "cpu_budget_bytes": 1e9, "host_copy_bytes_per_s": 1e10,
                    "nvme_read_bytes_per_s": 1e9, "nvme_write_bytes_per_s": 1e9},
        "collective_timeout_s": 300, "program_cache_size": 8,
    },
}
SGD = with_key(BASE, "optimizer", {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "nesterov": False}})
COSINE = with_key(BASE, "scheduler", {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_min_ratio": 0.0,
                                                                            "cos_min_ratio": 0.1}})
BF16 = {k: v for k, v in BASE.items() if k != "fp16"}

# Two valid values of every key that changes the collectives or the numerics.
MUST_AGREE: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "zero_optimization.stage": (2, 3, BASE),
    "zero_optimization.overlap_comm": (True, False, BASE),
    "zero_optimization.reduce_bucket_size": (1000, 2000, BASE),
    "zero_optimization.allgather_bucket_size": (1000, 2000, BASE),
    "zero_optimization.stage3_prefetch_bucket_size": (1000, 2000, BASE),
    "zero_optimization.stage3_max_live_parameters": (1e9, 1e8, BASE),
    "zero_optimization.stage3_param_persistence_threshold": (0, 100, BASE),
    "zero_optimization.offload_optimizer.device": ("cpu", "nvme", BASE),
    "zero_optimization.offload_optimizer.ratio": (1.0, 0.5, BASE),
    "zero_optimization.offload_param.device": ("cpu", "nvme", BASE),
    "zero_optimization.offload_param.max_in_cpu": (0, 1e6, BASE),
    "optimizer.type": ("AdamW", "Adam", BASE),
    "optimizer.params.lr": (1e-3, 1.0, BASE),  # issue item 11: per-rank lr
    "optimizer.params.betas": ([0.9, 0.999], [0.9, 0.95], BASE),
    "optimizer.params.eps": (1e-8, 1e-6, BASE),
    "optimizer.params.weight_decay": (0.01, 0.0, BASE),
    "optimizer.params.momentum": (0.9, 0.5, SGD),
    "optimizer.params.nesterov": (False, True, SGD),
    "optimizer.params.dampening": (0.0, 0.1, SGD),
    "train_batch_size": (8, 16, BASE),
    "train_micro_batch_size_per_gpu": (2, 4, BASE),
    "gradient_accumulation_steps": (1, 2, BASE),  # issue item 11
    "gradient_clipping": (1.0, 0.5, BASE),
    "scheduler.type": ("WarmupDecayLR", "WarmupCosineLR", with_key(BASE, "scheduler.params", {"total_num_steps": 100, "warmup_num_steps": 10})),
    "scheduler.params.warmup_min_lr": (0, 1e-5, BASE),
    "scheduler.params.warmup_max_lr": (1e-3, 1e-2, BASE),
    "scheduler.params.warmup_num_steps": (10, 20, BASE),
    "scheduler.params.warmup_type": ("linear", "log", BASE),
    "scheduler.params.total_num_steps": (100, 200, BASE),
    "scheduler.params.warmup_min_ratio": (0.0, 0.1, COSINE),
    "scheduler.params.cos_min_ratio": (0.1, 0.0, COSINE),
    "bf16.enabled": (False, True, BF16),
    "fp16.enabled": (True, False, BASE),
    "fp16.loss_scale": (0, 128, BASE),
    "fp16.initial_scale_power": (16, 12, BASE),
    "fp16.loss_scale_window": (1000, 500, BASE),
    "fp16.hysteresis": (2, 1, BASE),
    "fp16.min_loss_scale": (1, 2, BASE),
    "zerofx.world_size": (2, 4, BASE),
    "zerofx.prefetch_distance": (1, 2, BASE),
    "zerofx.memory_budget": ("80GiB", "40GiB", BASE),
    "zerofx.memory_margin": (0, 0.1, BASE),
    "zerofx.auto": (False, True, BASE),
    "zerofx.recompute": (False, True, BASE),
    "zerofx.tiling.enabled": ("auto", True, BASE),
    "zerofx.tiling.block_size": (64, 128, BASE),
    "zerofx.tiling.attention_block_size": (64, 128, BASE),
    "zerofx.tiling.budget": ("2GiB", "1GiB", BASE),
    "zerofx.tiling.attention": (True, False, BASE),
    "zerofx.tiling.region": (True, False, BASE),
    "zerofx.tiling.loss": (True, False, BASE),
    "zerofx.tiling.weight": (True, False, BASE),
    "zerofx.tiling.conv": (True, False, BASE),
    "zerofx.tiling.weight_tile_bytes": ("64MiB", "32MiB", BASE),
    "zerofx.compile": ("none", "inductor", BASE),
    "zerofx.fused_optimizer": (False, True, BASE),
    "zerofx.reduce_scatter_by_all_to_all": (False, True, BASE),  # the collective each rank issues
    "zerofx.offload.delayed_update": (False, True, BASE),
    "zerofx.offload_gradients.device": ("none", "cpu", BASE),
    "zerofx.collective_timeout_s": (300, 60, BASE),
    "zerofx.nonfinite": ("error", "off", BASE),
    "zerofx.program_cache_size": (8, 2, BASE),
    "zerofx.shard_group_size": (1, "auto", BASE),
    "zerofx.profile": ("cpu", "h100", BASE),
    "zerofx.sequence_parallel.size": (1, 2, {"zerofx": {"sequence_parallel": {"size": 2}}}),
    "zerofx.sequence_parallel.attention": ("ulysses", "auto", {"zerofx": {"sequence_parallel": {"size": 2}}}),
    "zerofx.sequence_parallel.mixers.attention": ("ulysses", "ring", {"zerofx": {"sequence_parallel": {"size": 2}}}),
    "zerofx.sequence_parallel.mixers.short_conv": ("halo", "auto", {"zerofx": {"sequence_parallel": {"size": 2}}}),
    "zerofx.sequence_parallel.mixers.long_conv": ("channels", "auto", {"zerofx": {"sequence_parallel": {"size": 2}}}),
    "zerofx.sequence_parallel.mixers.cumsum": ("prefix", "auto", {"zerofx": {"sequence_parallel": {"size": 2}}}),
    "zerofx.sequence_parallel.mixers.scan": ("state_passing", "auto", {"zerofx": {"sequence_parallel": {"size": 2}}}),
    "zerofx.sequence_parallel.mixers.flip": ("all_to_all", "auto", {"zerofx": {"sequence_parallel": {"size": 2}}}),
    "zerofx.sequence_parallel.load_balance": (True, False, {"zerofx": {"sequence_parallel": {"size": 2, "attention": "ring"}}}),
    "tensorboard.enabled": (False, True, BASE),  # a monitor on adds the gradient norm's all-reduce
    "csv_monitor.enabled": (False, True, BASE),
    "wandb.enabled": (False, True, BASE),
}
# Keys ranks may set differently: where or how fast a rank keeps its own state, and logging.
MAY_DIFFER: dict[str, tuple[Any, Any]] = {
    "zero_optimization.offload_optimizer.nvme_path": ("/tmp/a", "/mnt/b"),
    "zero_optimization.offload_optimizer.pin_memory": (False, True),
    "zero_optimization.offload_optimizer.buffer_count": (4, 8),
    "zero_optimization.offload_param.nvme_path": ("/tmp/a", "/mnt/b"),
    "zero_optimization.offload_param.pin_memory": (False, True),
    "zero_optimization.offload_param.buffer_count": (5, 2),
    "zerofx.offload_gradients.nvme_path": ("/tmp/a", "/mnt/b"),
    "zerofx.offload_gradients.pin_memory": (False, True),
    "zerofx.offload_gradients.buffer_count": (4, 2),
    "zerofx.offload.device_budget_bytes": (0, 1e6),
    "zerofx.plan_cache": ("/tmp/a", False),
    "zerofx.plan_cache_trust": ("private", "group"),
    "zerofx.plan_cache_key_file": ("/tmp/a.key", "/tmp/b.key"),
    "zerofx.offload.cpu_budget_bytes": (1e9, 1e8),
    "zerofx.offload.host_copy_bytes_per_s": (1e10, 2e10),
    "zerofx.offload.nvme_read_bytes_per_s": (1e9, 2e9),
    "zerofx.offload.nvme_write_bytes_per_s": (1e9, 2e9),
    "steps_per_print": (10, 100),
    "wall_clock_breakdown": (False, True),
    "tensorboard.output_path": ("/tmp/a", "/mnt/b"),
    "tensorboard.job_name": ("a", "b"),
    "csv_monitor.output_path": ("/tmp/a", "/mnt/b"),
    "csv_monitor.job_name": ("a", "b"),
    "wandb.project": ("a", "b"),
    "wandb.group": ("a", "b"),
    "wandb.team": ("a", "b"),
}


def test_every_acted_on_key_is_either_fingerprinted_or_marked_per_rank() -> None:
    """A new config key must be classified: a test row here, and per_rank in SCHEMA if ranks may differ."""
    acted = {p for p, k in leaves() if k.acted_on and not k.per_rank}
    assert acted == set(MUST_AGREE)
    assert {p for p, k in leaves() if k.per_rank} == set(MAY_DIFFER)


@pytest.mark.parametrize("path", sorted(MUST_AGREE))
def test_settings_that_change_collectives_or_numerics_change_the_fingerprint(path: str) -> None:
    a, b, base = MUST_AGREE[path]
    first, second = parse_config(with_key(base, path, a)), parse_config(with_key(base, path, b))
    assert first.fingerprint() != second.fingerprint()
    difference = first_config_difference([first.fingerprint_fields(), second.fingerprint_fields()])
    assert difference is not None and difference.count("rank 0 has") == 1 and "rank 1 has" in difference


@pytest.mark.filterwarnings("ignore:zerofx reads config key")
@pytest.mark.parametrize("path", sorted(MAY_DIFFER))
def test_per_rank_settings_leave_the_fingerprint_alone(path: str) -> None:
    a, b = MAY_DIFFER[path]
    first, second = parse_config(with_key(BASE, path, a)), parse_config(with_key(BASE, path, b))
    assert first.fingerprint() == second.fingerprint()
    assert first_config_difference([first.fingerprint_fields(), second.fingerprint_fields()]) is None


def test_fingerprint_is_json_and_the_same_however_equal_settings_are_written() -> None:
    fields = parse_config(BASE).fingerprint_fields()
    assert json.loads(json.dumps(fields, sort_keys=True, allow_nan=False)) == fields
    assert parse_config(json.loads(json.dumps(BASE))).fingerprint() == parse_config(BASE).fingerprint()
    reordered = {k: BASE[k] for k in reversed(list(BASE))}
    assert parse_config(reordered).fingerprint() == parse_config(BASE).fingerprint()
    # Defaults written out, ints for floats, or neither: the same settings.
    explicit = {
        "gradient_clipping": 0, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": {"overlap_comm": True, "stage3_param_persistence_threshold": 0},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"}},
        "zerofx": {"collective_timeout_s": 300, "program_cache_size": 8, "compile": "none", "fused_optimizer": False},
    }
    implicit = {"scheduler": {"type": "WarmupLR"}}
    assert parse_config(explicit).fingerprint() == parse_config(implicit).fingerprint()
    assert parse_config({"optimizer": {"params": {"lr": 1}}}).fingerprint() == parse_config({"optimizer": {"params": {"lr": 1.0}}}).fingerprint()


def test_first_config_difference_names_the_setting_and_each_rank() -> None:
    # Issue items 4 and 11: gradient clipping on one rank only; per-rank lr; accumulation 1 vs 2.
    fields = [parse_config({}).fingerprint_fields(), parse_config({"gradient_clipping": 1.0}).fingerprint_fields()]
    assert first_config_difference(fields) == "gradient_clipping: rank 0 has 0.0, rank 1 has 1.0"
    fields = [parse_config({"optimizer": {"params": {"lr": lr}}}).fingerprint_fields() for lr in (1e-3, 1e-3, 1.0)]
    assert first_config_difference(fields) == "optimizer.params.lr: rank 0 has 0.001, rank 1 has 0.001, rank 2 has 1.0"
    fields = [parse_config({"gradient_accumulation_steps": g}).fingerprint_fields() for g in (1, 2)]
    assert first_config_difference(fields) == "gradient_accumulation_steps: rank 0 has 1, rank 1 has 2"
    assert first_config_difference([parse_config(BASE).fingerprint_fields()] * 4) is None


# --------------------------------------------------------------------------- options parsed once
RICH = {
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 500, "overlap_comm": False, "offload_optimizer": {"device": "cpu", "ratio": 1}},
    "optimizer": {"type": "SGD", "params": {"lr": 1, "momentum": 0.9}}, "gradient_clipping": 1, "bf16": {"enabled": True},
    "zerofx": {"prefetch_distance": 2, "memory_budget": "1GiB", "collective_timeout_s": 10, "program_cache_size": 3, "profile": "cpu",
               "plan_cache": False, "tiling": {"enabled": "auto", "budget": "2GiB"}, "shard_group_size": 2,
               "sequence_parallel": {"size": 2, "attention": "ring"}},
}


def test_options_are_never_read_from_the_config_dict() -> None:
    # Emptying raw after parsing changes no option: every one was filled in by parse_config.
    cfg = parse_config(RICH, world_size=4)
    emptied = dataclasses.replace(cfg, raw={})
    assert emptied.fingerprint_fields() == cfg.fingerprint_fields()
    assert compile_options(emptied, 4) == compile_options(cfg, 4)
    assert (cfg.profile_is_explicit, parse_config({}).profile_is_explicit) == (True, False)
    assert cfg.zerofx_section == {k: v for k, v in RICH["zerofx"].items() if k != "plan_cache"}


def test_compile_options_resolve_and_check_the_world_size() -> None:
    cfg = parse_config(RICH)  # no world size yet: checked when one is given
    options = compile_options(cfg, 4)
    assert options.sequence_parallel is not None and options.sequence_parallel.group_name == "zerofx_sequence_2of4"
    assert cfg.sequence_parallel is not None and cfg.sequence_parallel.group_name == ""
    assert (options.shard_group_size, options.choose_shard_group_size, options.shard_group_decision) == (2, False, None)
    assert options.optimizer == "SGD+momentum" and options.schedule.reduce_bucket_numel == 500 and options.tiling_at_capture is not None
    with pytest.raises(ConfigError, match=r"'zerofx.shard_group_size' got 2, which does not divide the world size 3"):
        compile_options(cfg, 3)
    sp_only = parse_config({"zero_optimization": {"stage": 2}, "zerofx": {"sequence_parallel": {"size": 4}}})
    with pytest.raises(ConfigError, match=r"'zerofx.sequence_parallel.size' got 4, which does not divide the world size 6; accepted: "
                                          r"a divisor of 6 \(1, 2, 3, 6\)"):
        compile_options(sp_only, 6)
    auto = compile_options(parse_config({"zero_optimization": {"stage": 3}, "zerofx": {"shard_group_size": "auto"}}), 8)
    assert (auto.shard_group_size, auto.choose_shard_group_size) == (8, True) and "\"auto\" chooses" in str(auto.shard_group_decision)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_the_optimizer_table_matches_torch(kind: str) -> None:
    """Each row's class, parameters and state are torch's: the state after one step is the row's."""
    row = OPTIMIZERS[kind]
    cls = torch_optimizer_class(row.type)
    assert cls.__name__ == row.torch_class and set(row.params) <= set(inspect.signature(cls).parameters)
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = cls([param], lr=0.1, **({"momentum": 0.9} if kind == "SGD+momentum" else {}))
    param.grad = torch.ones(3)
    optimizer.step()
    state = optimizer.state[param]
    assert {k for k, v in state.items() if v is not None and k != "step"} == set(row.state) and ("step" in state) == row.step
    assert OptimizerSpec(row.type, {"lr": 0.1, **({"momentum": 0.9} if kind == "SGD+momentum" else {})}).kind == kind


def test_the_schema_accepts_the_tables_optimizer_types() -> None:
    assert SCHEMA["optimizer"].children["type"].accepted == ", ".join(OPTIMIZER_TYPES)  # type: ignore[index]
    assert OPTIMIZER_TYPES == ("AdamW", "Adam", "SGD")
