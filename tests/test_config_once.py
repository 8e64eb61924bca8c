"""NOTE [Options are parsed once]: the edges parse a config once into a ``ZeroConfig`` and pass it
on; below them nothing reads an option from the config dict."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from tests.support import train_workers
from tests.support.dist_utils import run_ranks
from zerofx.common.errors import ConfigError
from zerofx.config import ZeroConfig, parse_config

ROOT = Path(__file__).resolve().parents[1]
# Where code may hold the config as given: the config layer, and the checkpoint, which stores it
# as the run's record (never reads an option from it).
RAW_ALLOWED = {Path("zerofx/config"), Path("zerofx/runtime/checkpoint.py")}


def _library_files() -> list[Path]:
    files = []
    for top in ("zerofx", "passes", "cost_models"):
        files += sorted((ROOT / top).rglob("*.py"))
    return [f for f in files if not any(f.relative_to(ROOT).is_relative_to(a) for a in RAW_ALLOWED)]


def test_nothing_outside_the_config_layer_reads_the_raw_config() -> None:
    """No library module outside ``zerofx/config/`` (and the checkpoint's record) loads a config
    dict (``load_config``) or reads ``ZeroConfig.raw``: options come from the typed fields."""
    offenders = []
    for path in _library_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "raw" and isinstance(node.ctx, ast.Load):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: .raw")
            elif isinstance(node, (ast.Name, ast.alias)) and (node.id if isinstance(node, ast.Name) else node.name) == "load_config":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: load_config")
    assert not offenders, "\n".join(offenders)


# The config's top-level sections: a string literal of one used as a key into a dict (a subscript,
# or .get/.setdefault/.pop with a default) is a read or an edit of a config dict.
SECTIONS = frozenset({"zerofx", "zero_optimization", "scheduler", "fp16", "bf16", "train_batch_size",
                      "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"})


def test_nothing_outside_the_config_layer_edits_a_config_dict() -> None:
    """No library module outside ``zerofx/config/`` keys into a config section: the CLI's flags
    and the auto-plan's candidates vary options through ``parse_config(keys=)`` and
    ``ZeroConfig.with_keys``, and a checkpoint's record is read by ``recorded_sequence_parallel_size``."""
    offenders = []
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            key = None
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                key = node.slice.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "setdefault", "pop")
                  and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)):
                key = node.args[0].value
            if isinstance(key, str) and key in SECTIONS:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {key!r}")
    assert not offenders, "\n".join(offenders)


def test_a_parsed_config_is_reconciled_not_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config({"zero_optimization": {"stage": 2}, "zerofx": {"offload_gradients": {"device": "cpu"}}})
    sp = parse_config({"zerofx": {"sequence_parallel": {"size": 4}}})
    import zerofx.config as config_module

    monkeypatch.setattr(config_module, "_validate", lambda *a: pytest.fail("a ZeroConfig was parsed again"))
    assert parse_config(cfg) is cfg
    run = parse_config(cfg, world_size=4)
    assert (run.stage, run.world_size, run.config_stage, run.config_world_size) == (2, 4, 2, None)
    assert parse_config(run, world_size=8).world_size == 8  # an argument, not the config, gave 4
    with pytest.raises(ConfigError, match="stage=3 disagrees with the config's zero_optimization.stage=2"):
        parse_config(cfg, stage=3)
    # What depends on the stage is checked again: gradient offload needs stage 2 or 3.
    open_stage = cfg.without_stage()
    assert open_stage.for_run(stage=3).stage == 3
    with pytest.raises(ConfigError, match="offload_gradients.device is cpu but zero_optimization.stage is 1"):
        open_stage.for_run(stage=1)
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        sp.for_run(world_size=6)


def test_a_config_stated_world_size_binds_every_reconciliation() -> None:
    cfg = parse_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})  # implies world size 4
    assert (cfg.world_size, cfg.config_world_size) == (4, 4)
    with pytest.raises(ConfigError, match="world_size=8 disagrees with the config, which implies world size 4"):
        cfg.for_run(world_size=8)
    assert dataclasses.replace(cfg, gradient_clipping=1.0).for_run(world_size=4).gradient_clipping == 1.0


@pytest.mark.multiprocess
def test_zerofx_train_parses_its_config_once() -> None:
    """The launcher's checks parse the --config file once, with --collective-timeout and
    --schedule-steps applied to the typed options; a rank's whole loop (initialize included)
    parses nothing more."""
    for out in run_ranks(2, train_workers.train_run_parses, str(ROOT / "examples" / "dna_lm_zero3.json")):
        assert out == {"after_check": 1, "after_training": 1, "timeout": 120.0, "total_num_steps": 50}, out
    assert isinstance(parse_config(str(ROOT / "examples" / "dna_lm_zero3.json")), ZeroConfig)
