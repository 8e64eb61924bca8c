"""DeepSpeed's monitors: each optimizer step's training metrics, written by rank 0 to a TensorBoard
event file (``tensorboard``), CSV files (``csv_monitor``) and a Weights & Biases run (``wandb``).

The config sections are DeepSpeed's, parsed into ``MonitorOptions`` by ``zerofx.config``. The
engine feeds a ``Monitor``: ``record_micro_batch`` from ``engine.backward(loss)`` (DeepSpeed logs
the loss there too) and ``record_step`` at the end of each optimizer step. Per step it writes:

| name | value |
|---|---|
| ``Train/Samples/train_loss`` | rank 0's loss, averaged over the step's micro-batches (DeepSpeed's) |
| ``Train/Samples/lr`` | the learning rate this step's update used (param group 0) |
| ``Train/Samples/loss_scale`` | the fp16 loss scale after the step; only with fp16 (DeepSpeed's) |
| ``Train/Samples/grad_norm`` | the global L2 gradient norm before clipping; not on a skipped fp16 step |
| ``Train/Samples/tokens_per_s`` | tokens of every rank over the step's wall time |
| ``Train/Samples/model_state_bytes`` | ``sum(engine.memory().values())`` on rank 0 after the step |

The x-axis is samples, as DeepSpeed's ``Train/Samples/`` names say: every metric of a step is
written at the samples of all ranks trained on through that step (``engine.global_samples``,
kept in checkpoints, so a run resumed at another world size continues the axis). A step's
samples are the first input's batch dimension summed over the micro-batches, times the world
size; its tokens
count the first integer input (token ids, ``(B, T)``) the same way, or one token per sample
when no input is integer. The wall time runs from the end of the previous step (the first: from
the end of ``initialize``) to the end of this one, so it includes loading the batch.

Records are kept in memory, tensors unconverted (no device sync per step), and written out when
``FLUSH_INTERVAL_S`` has passed since the last write, on ``flush()``/``close()``, and when the
monitor is collected or the interpreter exits.
"""

from __future__ import annotations

import atexit
import csv
import importlib.util
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import torch

from zerofx.config.options import LogDirOptions, MonitorOptions, WandbOptions
from zerofx.common.errors import ConfigError

if TYPE_CHECKING:
    from zerofx.compiler.capture import TensorInfo

TRAIN_LOSS = "Train/Samples/train_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"
GRAD_NORM = "Train/Samples/grad_norm"
TOKENS_PER_S = "Train/Samples/tokens_per_s"
MODEL_STATE_BYTES = "Train/Samples/model_state_bytes"
METRICS = (TRAIN_LOSS, LR, LOSS_SCALE, GRAD_NORM, TOKENS_PER_S, MODEL_STATE_BYTES)

# Records wait in memory at most this long before they are written: a crash loses at most this
# much of the curves, and the writes (about 0.1 ms per step on a CPU) happen once per interval.
FLUSH_INTERVAL_S = 5.0

# NOTE [Monitors: rank 0 writes, every rank joins the norm]
# Only rank 0 builds a ``Monitor`` and writes, as DeepSpeed's monitors do: the ranks' losses
# differ, but every other metric is the same on each rank, and one writer keeps one file per
# metric. The gradient norm, though, is a sum over every rank's shard: with a monitor on, every
# rank computes it each optimizer step and joins its 8-byte all-reduce (with gradient clipping on,
# the engine computes it anyway and the monitor takes that value). So whether each monitor is on
# is part of the config fingerprint ranks compare (NOTE [What ranks must agree on]), and every
# rank checks that the monitors' packages import, before the first collective, so a missing
# package fails every rank at once rather than leaving its peers waiting in a collective.

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # config section -> the package it needs


def _importable(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None  # None: imports of it are blocked
    return importlib.util.find_spec(name) is not None


def check_monitor_packages(options: MonitorOptions) -> None:
    """``ConfigError`` when an enabled monitor's package is not installed, naming the key and the
    install command. Call it on every rank (NOTE [Monitors: rank 0 writes, every rank joins the norm])."""
    enabled = {"tensorboard": options.tensorboard is not None, "wandb": options.wandb is not None}
    for section, package in _PACKAGES.items():
        if enabled[section] and not _importable(package):
            raise ConfigError(
                f"config key '{section}.enabled' is true but the {package} package is not installed; install it with "
                f'pip install "zerofx[{section}]" (or pip install {package}), or set {section}.enabled to false'
            )


def samples_and_tokens(inputs: Sequence[TensorInfo]) -> tuple[int, int]:
    """One rank's samples and tokens in a micro-batch, from its input tensors: the batch dimension
    of the first input, and the element count of the first integer input (token ids), else one
    token per sample."""
    samples = inputs[0].shape[0] if inputs and inputs[0].shape else 1
    for info in inputs:
        if not info.dtype.is_floating_point and not info.dtype.is_complex and info.dtype != torch.bool:
            return samples, info.numel
    return samples, samples


@dataclass
class StepRecord:
    """One optimizer step's metrics, at ``samples`` on the x-axis. Values may be 0-d tensors until
    written (converted then, all at once)."""

    samples: int
    wall_time: float  # time.time() at the end of the step
    values: dict[str, float | int | torch.Tensor]


class _Backend(Protocol):
    def write(self, records: Sequence[tuple[int, float, dict[str, float | int]]]) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    """``torch.utils.tensorboard.SummaryWriter`` in ``output_path/job_name``."""

    def __init__(self, options: LogDirOptions) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(_make_dir(options, "tensorboard")))

    def write(self, records: Sequence[tuple[int, float, dict[str, float | int]]]) -> None:
        for samples, wall_time, values in records:
            for name, value in values.items():
                self.writer.add_scalar(name, value, global_step=samples, walltime=wall_time)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Csv:
    """DeepSpeed's CSV layout: one file per metric in ``output_path/job_name``, named after it
    with ``/`` as ``_`` (``Train_Samples_train_loss.csv``), with the header ``step,<last part of
    the name>`` and one ``<samples>,<value>`` row per step. A file that already has rows (a
    resumed run) is appended to without a second header."""

    def __init__(self, options: LogDirOptions) -> None:
        self.log_dir = _make_dir(options, "csv_monitor")
        self.files: dict[str, tuple[IO[str], Any]] = {}

    def _writer(self, name: str) -> Any:
        if name not in self.files:
            path = self.log_dir / f"{name.replace('/', '_').replace(' ', '_')}.csv"
            f = path.open("a", newline="")
            writer = csv.writer(f)
            if f.tell() == 0:
                writer.writerow(["step", name.rsplit("/", 1)[-1]])
            self.files[name] = (f, writer)
        return self.files[name][1]

    def write(self, records: Sequence[tuple[int, float, dict[str, float | int]]]) -> None:
        for samples, _, values in records:
            for name, value in values.items():
                self._writer(name).writerow([samples, repr(value)])  # repr: every digit of the float
        for f, _ in self.files.values():
            f.flush()

    def close(self) -> None:
        for f, _ in self.files.values():
            f.close()
        self.files.clear()


class _Wandb:
    """A wandb run: ``wandb.init(project=, group=, entity=team)``, one ``wandb.log`` per step at
    ``step=samples``. A run the program already started is logged to and left open."""

    def __init__(self, options: WandbOptions) -> None:
        import wandb

        self.wandb = wandb
        self.owned = wandb.run is None
        self.run = wandb.init(project=options.project, group=options.group, entity=options.team) if self.owned else wandb.run

    def write(self, records: Sequence[tuple[int, float, dict[str, float | int]]]) -> None:
        for samples, _, values in records:
            self.run.log(values, step=samples)

    def close(self) -> None:
        if self.owned:
            self.run.finish()


def _make_dir(options: LogDirOptions, section: str) -> Path:
    log_dir = options.log_dir
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"config keys '{section}.output_path'/'{section}.job_name' name the folder {str(log_dir)!r}, which cannot be "
                          f"created ({exc.strerror or exc}); accepted: a folder this process may write") from None
    return log_dir


class _Sink:
    """The backends and the records not yet written to them. Separate from ``Monitor`` so a
    finalizer can hold it: records still waiting are written when the monitor is collected or the
    interpreter exits, not lost."""

    def __init__(self, backends: list[_Backend]) -> None:
        self.backends = backends
        self.pending: list[StepRecord] = []
        self.closed = False

    def flush(self) -> None:
        if not self.pending:
            return
        records, self.pending = self.pending, []
        tensors = [v for r in records for v in r.values.values() if isinstance(v, torch.Tensor)]
        # One device sync for every tensor waiting, not one per value.
        floats = iter(torch.stack([t.detach().reshape(()).double().cpu() for t in tensors]).tolist()) if tensors else iter(())
        plain = [(r.samples, r.wall_time, {k: next(floats) if isinstance(v, torch.Tensor) else v for k, v in r.values.items()})
                 for r in records]
        for backend in self.backends:
            backend.write(plain)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.flush()
        finally:
            for backend in self.backends:
                backend.close()


class Monitor:
    """Rank 0's monitors (NOTE [Monitors: rank 0 writes, every rank joins the norm]). Build it after
    ``check_monitor_packages``; feed it ``record_micro_batch`` per backward and ``record_step`` per
    optimizer step."""

    def __init__(self, options: MonitorOptions, *, world_size: int, flush_interval_s: float | None = None) -> None:
        assert options.enabled, "build a Monitor only with a monitor enabled"
        self.options = options
        self.world_size = world_size
        self.flush_interval_s = FLUSH_INTERVAL_S if flush_interval_s is None else flush_interval_s
        backends: list[_Backend] = []
        try:
            if options.tensorboard is not None:
                backends.append(_TensorBoard(options.tensorboard))
            if options.csv_monitor is not None:
                backends.append(_Csv(options.csv_monitor))
            if options.wandb is not None:
                backends.append(_Wandb(options.wandb))
        except BaseException:
            for backend in backends:
                backend.close()
            raise
        self._sink = _Sink(backends)
        self._finalizer = weakref.finalize(self, self._sink.close)
        # Exit hooks run last registered first: this one runs before the exit hook wandb.init
        # just registered, which would finish the run with records still waiting here.
        atexit.register(self._finalizer)
        self._loss_sum: torch.Tensor | None = None
        self._micro_batches = 0
        self._step_samples = 0
        self._step_tokens = 0
        self._samples: int | None = None  # the x-axis; set at the first step
        self._last_step_end = self._last_flush = time.perf_counter()

    @property
    def pending(self) -> list[StepRecord]:
        """The records not yet written."""
        return self._sink.pending

    def record_micro_batch(self, loss: torch.Tensor, inputs: Sequence[TensorInfo]) -> None:
        """One backward's loss (rank 0's) and its inputs' shapes."""
        loss = loss.detach().float()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._micro_batches += 1
        samples, tokens = samples_and_tokens(inputs)
        self._step_samples += samples
        self._step_tokens += tokens

    def record_step(self, *, samples: int, lr: float, loss_scale: float | None, grad_norm: float | torch.Tensor | None,
                    model_state_bytes: int) -> None:
        """The end of an optimizer step, at ``samples`` (``engine.global_samples``: all ranks'
        sequences through this step, restored from a checkpoint on resume)."""
        now = time.perf_counter()
        self._samples = samples
        values: dict[str, float | int | torch.Tensor] = {}
        if self._loss_sum is not None:
            values[TRAIN_LOSS] = self._loss_sum / self._micro_batches
        values[LR] = float(lr)
        if loss_scale is not None:
            values[LOSS_SCALE] = float(loss_scale)
        if grad_norm is not None:
            values[GRAD_NORM] = grad_norm
        values[TOKENS_PER_S] = self._step_tokens * self.world_size / max(now - self._last_step_end, 1e-9)
        values[MODEL_STATE_BYTES] = int(model_state_bytes)
        self._sink.pending.append(StepRecord(self._samples, time.time(), values))
        self._loss_sum, self._micro_batches, self._step_samples, self._step_tokens = None, 0, 0, 0
        self._last_step_end = now
        if now - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        """Write every record still waiting, and flush the files."""
        self._sink.flush()
        self._last_flush = time.perf_counter()

    def close(self) -> None:
        """Write what is waiting and close the files and the wandb run this monitor started."""
        atexit.unregister(self._finalizer)
        self._finalizer()
