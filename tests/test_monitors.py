"""DeepSpeed's monitors (zerofx/runtime/monitors.py): the tensorboard, csv_monitor and wandb sections,
read back from what they wrote and checked against what the engine returned. Single-process
tests run the engine on a one-rank gloo group in this process; one test runs two gloo ranks, and
one runs ``zerofx train``."""

from __future__ import annotations

import csv
import gc
import json
import math
import struct
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerofx
from tests.support import monitor_workers
from tests.support.dist_utils import run_ranks
from tests.support.models import BATCH, SEQ, batches, dna_lm, loss_of
from zerofx.compiler.capture import TensorInfo
from zerofx.config import first_config_difference, parse_config
from zerofx.config.options import LogDirOptions, MonitorOptions, WandbOptions
from zerofx.config.schema import schema_rows
from zerofx.common.errors import ConfigError
from zerofx.runtime.monitors import (
    GRAD_NORM,
    LOSS_SCALE,
    LR,
    MODEL_STATE_BYTES,
    TOKENS_PER_S,
    TRAIN_LOSS,
    Monitor,
    check_monitor_packages,
    samples_and_tokens,
)
from zerofx.runtime.schedulers import lr_at

IDS_INFO = TensorInfo("ids", (BATCH, SEQ), torch.int64)
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "linear"}}


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo group in this process: the engine without spawning ranks."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def read_csv(log_dir: Path, name: str) -> tuple[list[str], list[tuple[int, float]]]:
    """The header and the (x, value) rows of one metric's CSV file, DeepSpeed's layout."""
    with (log_dir / f"{name.replace('/', '_')}.csv").open(newline="") as f:
        header, *rows = list(csv.reader(f))
    return header, [(int(x), float(v)) for x, v in rows]


def train(engine: zerofx.Engine, data: torch.Tensor, micro: int) -> dict[str, list]:
    """Train on ``data[i, 0]``, ``micro`` micro-batches per optimizer step; return what a user
    sees: each loss, the times around each optimizer step, and the engine's state after it."""
    out: dict[str, list] = {"losses": [], "before": [], "after": [], "memory": [], "scale": [], "skipped": []}
    for i in range(data.shape[0]):
        ids = data[i, 0]
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        out["before"].append(time.perf_counter())
        engine.step()
        out["after"].append(time.perf_counter())
        out["losses"].append(loss.detach().clone())
        if boundary:
            out["memory"].append(sum(engine.memory().values()))
            out["scale"].append(engine.loss_scaler.scale if engine.loss_scaler else None)
            out["skipped"].append(engine.skipped_steps)
    # Keep the times of the optimizer steps only.
    out["before"], out["after"] = out["before"][micro - 1::micro], out["after"][micro - 1::micro]
    return out


def initialize(config: dict[str, Any], data: torch.Tensor) -> zerofx.Engine:
    """The tiny DNA LM on this process's one rank, at stage 1 unless ``config`` says otherwise."""
    config = {"zero_optimization": {"stage": 1}} | config
    return zerofx.initialize(dna_lm(), config, example_inputs=(data[0, 0],), example_kwargs={"labels": data[0, 0]})


# --------------------------------------------------------------------------- the engine, one rank


def test_csv_and_tensorboard_hold_what_the_engine_returned(tmp_path: Path, one_rank: None) -> None:
    """Stage 2, two micro-batches per step, a warm-up schedule, no clipping (the monitor asks for
    the gradient norm itself). Every metric, in both files, is checked against the engine."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    micro, steps = 2, 3
    config = {
        "zero_optimization": {"stage": 2}, "gradient_accumulation_steps": micro, "scheduler": WARMUP,
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "csv_job"},
        "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb_job"},
    }
    data = batches(1, steps * micro)
    engine = initialize(config, data)
    seen = train(engine, data, micro)
    engine.close()
    log_dir = tmp_path / "csv_job"
    assert sorted(p.name for p in log_dir.iterdir()) == sorted(f"{n.replace('/', '_')}.csv" for n in
                                                               (TRAIN_LOSS, LR, GRAD_NORM, TOKENS_PER_S, MODEL_STATE_BYTES))
    samples_per_step = BATCH * micro  # one rank
    xs = [samples_per_step * (k + 1) for k in range(steps)]

    header, loss_rows = read_csv(log_dir, TRAIN_LOSS)
    assert header == ["step", "train_loss"]  # DeepSpeed's header: the x column is called step
    assert [x for x, _ in loss_rows] == xs
    losses = seen["losses"]
    assert [v for _, v in loss_rows] == [((losses[micro * k] + losses[micro * k + 1]) / micro).item() for k in range(steps)]

    lrs = [v for _, v in read_csv(log_dir, LR)[1]]
    assert lrs == pytest.approx([lr_at(engine.cfg.scheduler, k, 1e-3) for k in range(steps)], rel=1e-12)
    assert lrs[0] < lrs[1] < lrs[2]  # the warm-up really moves it

    # The first step's norm against eager PyTorch on the same two micro-batches.
    reference = dna_lm()
    (sum(loss_of(reference, data[i, 0]) for i in range(micro)) / micro).backward()
    eager_norm = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in reference.parameters() if p.grad is not None))
    norms = [v for _, v in read_csv(log_dir, GRAD_NORM)[1]]
    assert len(norms) == steps and norms[0] == pytest.approx(eager_norm, rel=1e-4)

    assert [v for _, v in read_csv(log_dir, MODEL_STATE_BYTES)[1]] == seen["memory"]

    # Tokens over the time between the ends of two steps, which lies between the gaps the test
    # measured around them (the first step's interval starts inside initialize).
    tokens = BATCH * SEQ * micro
    rates = [v for _, v in read_csv(log_dir, TOKENS_PER_S)[1]]
    before, after = seen["before"], seen["after"]
    for k in range(1, steps):
        assert tokens / (after[k] - before[k - 1]) <= rates[k] <= tokens / (before[k] - after[k - 1])

    # The same values in the TensorBoard event file (float32 there), at the same samples.
    events = EventAccumulator(str(tmp_path / "tb_job"), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == {TRAIN_LOSS, LR, GRAD_NORM, TOKENS_PER_S, MODEL_STATE_BYTES}
    for name in (TRAIN_LOSS, LR, GRAD_NORM, TOKENS_PER_S, MODEL_STATE_BYTES):
        scalars = events.Scalars(name)
        assert [s.step for s in scalars] == xs
        assert [s.value for s in scalars] == pytest.approx([v for _, v in read_csv(log_dir, name)[1]], rel=1e-6, abs=1e-12)


def test_fp16_writes_the_loss_scale_and_no_norm_for_a_skipped_step(tmp_path: Path, one_rank: None) -> None:
    """2**20 overflows fp16 gradients: the first steps are skipped (hysteresis 1 halves the scale
    each time). Every step has a loss scale row, equal to the scaler's after the step; a skipped
    step has no gradient norm."""
    steps = 4
    config = {
        "zero_optimization": {"stage": 1},
        "fp16": {"enabled": True, "initial_scale_power": 20, "hysteresis": 1},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path)},
    }
    data = batches(1, steps)
    engine = initialize(config, data)
    seen = train(engine, data, 1)
    engine.close()
    log_dir = tmp_path / "DeepSpeedJobName"  # DeepSpeed's default job_name
    header, scale_rows = read_csv(log_dir, LOSS_SCALE)
    assert header == ["step", "loss_scale"]
    assert [v for _, v in scale_rows] == seen["scale"]
    assert seen["scale"][0] == 2.0**19  # halved after the first, overflowing step
    skipped_at = [k for k in range(steps) if seen["skipped"][k] > (seen["skipped"][k - 1] if k else 0)]
    assert skipped_at and skipped_at[0] == 0
    norm_xs = [x for x, _ in read_csv(log_dir, GRAD_NORM)[1]]
    assert norm_xs == [BATCH * (k + 1) for k in range(steps) if k not in skipped_at]
    assert [v for _, v in read_csv(log_dir, TRAIN_LOSS)[1]] == [loss.item() for loss in seen["losses"]]


def _wandb_records(run_dir: Path) -> list[Any]:
    """The records of an offline run's ``.wandb`` file: a 7-byte header, then leveldb-log records
    in 32 KiB blocks (7-byte header each: checksum, length, type 1 full, 2 first, 3 middle,
    4 last), each a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    block, pos, chunks, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # the block's zero padding
            pos += left
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def test_wandb_offline_run_holds_the_metrics(tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb  # in the test extra, so this runs in CI

    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(name, value)
    steps = 2
    config = {"wandb": {"enabled": True, "project": "proj", "group": "grp", "team": "my_team"}, "scheduler": WARMUP}
    data = batches(1, steps)
    engine = initialize(config, data)
    seen = train(engine, data, 1)
    engine.close()
    wandb.teardown()  # the run's file is written by wandb's service process: wait for it
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    records = _wandb_records(run_dir)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.run_group, run.entity) == ("proj", "grp", "my_team")
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [BATCH * (k + 1) for k in range(steps)]
    assert [h[TRAIN_LOSS] for h in history] == [loss.item() for loss in seen["losses"]]
    assert [h[LR] for h in history] == pytest.approx([lr_at(engine.cfg.scheduler, k, 1e-3) for k in range(steps)], rel=1e-12)
    assert all(h[GRAD_NORM] > 0 and h[MODEL_STATE_BYTES] == seen["memory"][0] for h in history)


@pytest.mark.parametrize("section", ["wandb", "tensorboard"])
def test_an_enabled_monitor_without_its_package_is_a_config_error(section: str, tmp_path: Path, one_rank: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The package's absence is simulated: ``sys.modules[name] = None`` makes every import of it fail."""
    monkeypatch.setitem(sys.modules, section, None)
    data = batches(1, 1)
    config = {section: {"enabled": True, "output_path": str(tmp_path)} if section == "tensorboard" else {"enabled": True}}
    with pytest.raises(ConfigError, match=rf"'{section}\.enabled' is true but the {section} package is not installed; install it with "
                                          rf'pip install "zerofx\[{section}\]" \(or pip install {section}\)'):
        initialize(config, data)
    assert not any(tmp_path.iterdir())  # nothing written
    check_monitor_packages(parse_config({section: {"enabled": False}}).monitors)  # off: no package needed


def test_two_ranks_only_rank_0_writes(tmp_path: Path) -> None:
    """Stage 3, two gloo ranks, each naming its own folder: only rank 0's exists. The loss is rank
    0's; the norm (the one clipping computes) is over both ranks' gradients."""
    steps = 2
    results = run_ranks(2, monitor_workers.train_with_csv_monitor, str(tmp_path), steps)
    assert [r["has_monitor"] for r in results] == [True, False]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0"]
    log_dir = tmp_path / "rank0" / "job"
    loss_rows = read_csv(log_dir, TRAIN_LOSS)[1]
    assert loss_rows == [(2 * BATCH * (k + 1), results[0]["losses"][k]) for k in range(steps)]
    assert results[0]["losses"] != results[1]["losses"]
    data = batches(2, steps)
    reference = dna_lm()
    (sum(loss_of(reference, data[0, r]) for r in range(2)) / 2).backward()
    eager_norm = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in reference.parameters() if p.grad is not None))
    assert read_csv(log_dir, GRAD_NORM)[1][0][1] == pytest.approx(eager_norm, rel=1e-4)


# --------------------------------------------------------------------------- the Monitor alone


def _csv_monitor(tmp_path: Path, flush_interval_s: float, world_size: int = 2) -> Monitor:
    return Monitor(MonitorOptions(csv_monitor=LogDirOptions(str(tmp_path), "job")), world_size=world_size, flush_interval_s=flush_interval_s)


def _step(monitor: Monitor, step: int, loss: float = 2.0) -> None:
    monitor.record_micro_batch(torch.tensor(loss), [IDS_INFO])
    monitor.record_step(samples=step * BATCH * monitor.world_size, lr=0.5, loss_scale=None,
                        grad_norm=torch.tensor([3.0], dtype=torch.float64), model_state_bytes=123)


def test_records_wait_for_the_flush_interval_then_reach_the_files(tmp_path: Path) -> None:
    waiting = _csv_monitor(tmp_path / "a", flush_interval_s=3600)
    _step(waiting, 1)
    _step(waiting, 2)
    assert not list((tmp_path / "a" / "job").iterdir()) and len(waiting.pending) == 2
    waiting.close()
    assert read_csv(tmp_path / "a" / "job", TRAIN_LOSS)[1] == [(2 * BATCH, 2.0), (4 * BATCH, 2.0)]
    eager = _csv_monitor(tmp_path / "b", flush_interval_s=0)
    _step(eager, 1)
    assert read_csv(tmp_path / "b" / "job", GRAD_NORM)[1] == [(2 * BATCH, 3.0)] and not eager.pending
    eager.close()
    # A monitor collected without close still writes what it held.
    dropped = _csv_monitor(tmp_path / "c", flush_interval_s=3600)
    _step(dropped, 1)
    del dropped
    gc.collect()
    assert read_csv(tmp_path / "c" / "job", MODEL_STATE_BYTES)[1] == [(2 * BATCH, 123)]


def test_a_resumed_run_continues_the_axis_and_the_files(tmp_path: Path) -> None:
    first = _csv_monitor(tmp_path, flush_interval_s=0, world_size=1)
    _step(first, 1, loss=1.0)
    first.close()
    resumed = _csv_monitor(tmp_path, flush_interval_s=0, world_size=1)
    _step(resumed, 5, loss=4.0)  # a checkpoint saved after step 4
    resumed.close()
    header, rows = read_csv(tmp_path / "job", TRAIN_LOSS)
    assert header == ["step", "train_loss"] and rows == [(BATCH, 1.0), (5 * BATCH, 4.0)]
    assert not (tmp_path / "job" / f"{LOSS_SCALE.replace('/', '_')}.csv").exists()  # no fp16, no loss scale


def test_samples_and_tokens_from_the_input_shapes() -> None:
    floats = TensorInfo("x", (8, 32), torch.float32)
    assert samples_and_tokens([IDS_INFO]) == (BATCH, BATCH * SEQ)
    assert samples_and_tokens([floats]) == (8, 8)  # no token ids: a token per sample
    assert samples_and_tokens([floats, IDS_INFO]) == (8, BATCH * SEQ)  # the first integer input counts the tokens
    assert samples_and_tokens([TensorInfo("mask", (4, 5), torch.bool)]) == (4, 4)
    assert samples_and_tokens([TensorInfo("s", (), torch.float32)]) == (1, 1)


# --------------------------------------------------------------------------- config


def test_config_sections_parse_with_deepspeeds_keys_and_defaults() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # acted on: no "does not act on it yet" warning
        cfg = parse_config({
            "tensorboard": {"enabled": True, "output_path": "out/ds_logs/", "job_name": "train_bert"},
            "csv_monitor": {"enabled": True},
            "wandb": {"enabled": True, "team": "my_team", "group": "my_group", "project": "my_project"},
        })
    assert cfg.monitors == MonitorOptions(
        tensorboard=LogDirOptions("out/ds_logs/", "train_bert"), csv_monitor=LogDirOptions("", "DeepSpeedJobName"),
        wandb=WandbOptions(project="my_project", group="my_group", team="my_team"),
    )
    assert cfg.monitors.tensorboard is not None and cfg.monitors.tensorboard.log_dir == Path("out/ds_logs/train_bert")
    off = parse_config({"tensorboard": {"enabled": False, "job_name": "x"}, "wandb": {"project": "p"}}).monitors
    assert off == MonitorOptions() and not off.enabled
    assert parse_config({"wandb": {"enabled": True}}).monitors.wandb == WandbOptions(project="deepspeed")
    rows = {r[0]: r for r in schema_rows()}
    for key in ("tensorboard.enabled", "tensorboard.output_path", "tensorboard.job_name", "csv_monitor.enabled", "csv_monitor.output_path",
                "csv_monitor.job_name", "wandb.enabled", "wandb.project", "wandb.group", "wandb.team"):
        assert rows[key][3] == "yes", key


@pytest.mark.parametrize(("section", "message"), [
    ({"tensorboard": {"enabled": "yes"}}, r"'tensorboard\.enabled' must be a true/false, got 'yes'"),
    ({"csv_monitor": {"enabled": True, "job_name": ""}}, r"'csv_monitor\.job_name' got ''; accepted: a non-empty string"),
    ({"csv_monitor": {"output_dir": "x"}}, r"unknown config key 'csv_monitor\.output_dir'.*output_path"),
    ({"wandb": {"entity": "t"}}, r"unknown config key 'wandb\.entity'.*team"),
])
def test_bad_monitor_keys_are_config_errors(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(section)


def test_ranks_must_agree_on_which_monitors_are_on_but_not_on_paths() -> None:
    """A monitor on adds the norm's all-reduce on every rank, so ``enabled`` is fingerprinted;
    paths and names are each rank's own."""
    on, off = parse_config({"csv_monitor": {"enabled": True}}), parse_config({})
    assert first_config_difference([on.fingerprint_fields(), off.fingerprint_fields()]) == \
        "monitors.csv_monitor: rank 0 has true, rank 1 has false"
    here = parse_config({"csv_monitor": {"enabled": True, "output_path": "/a", "job_name": "j"}, "wandb": {"enabled": True, "project": "p"}})
    there = parse_config({"csv_monitor": {"enabled": True, "output_path": "/b"}, "wandb": {"enabled": True, "team": "t", "group": "g"}})
    assert here.fingerprint() == there.fingerprint()
