"""What a checkpoint reads of one rank's training run, and what a load writes back.

``zerofx.runtime.checkpoint`` saves and loads through a ``TrainState``, never through the engine:
the engine hands one out (``Engine.train_state()``) for each save and load. The view is frozen,
and what a load changes it changes in place: the tensors of the shards, full flats, masters,
buffers and optimizer states, the offload stores' records, the ``StepCounters`` and the loss
scaler's numbers. A field added here is one more thing the checkpoint format depends on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from zerofx.config import ZeroConfig
from zerofx.passes import ParamPlacement, Plan, ZeroStage
from zerofx.runtime.loss_scaling import LossScaler
from zerofx.runtime.offload import OffloadStore, ParamStore


@dataclass
class StepCounters:
    """DeepSpeed's step counters, kept in checkpoints (``metadata.json``: ``step`` and ``counters``)."""

    global_steps: int = 0  # optimizer steps taken, skipped ones included
    micro_steps: int = 0  # step() calls: micro-batches, across accumulation boundaries
    skipped_steps: int = 0  # fp16 steps skipped because a gradient overflowed
    # Sequences trained on by all ranks (DeepSpeed's global_samples): the monitors' x-axis, kept
    # in checkpoints so that a resume at another world size continues it.
    global_samples: int = 0


@dataclass(frozen=True)
class TrainState:
    """One rank's training state as checkpoints see it: the run, the rank layout, what this rank
    holds (``EngineStorage``'s tensors and stores), the optimizer and the step counters."""

    # The run.
    model: nn.Module
    cfg: ZeroConfig
    stage: ZeroStage
    compute_dtype: torch.dtype | None
    plan: Plan | None  # the most recent program's; None before the first capture
    # The rank layout (NOTE [Shard groups of consecutive ranks] in zerofx/runtime/rank_groups.py).
    rank: int
    world_size: int
    group: dist.ProcessGroup
    shard_group: dist.ProcessGroup  # the ranks that hold one slice each of every padded flat
    shard_index: int  # which slice this rank holds: its rank when sharding is flat
    num_shards: int  # slices per padded flat: the shard group size
    sequence_parallel_size: int  # 1 without sequence parallelism
    device: torch.device
    # What this rank holds (NOTE [What the engine holds] in zerofx/runtime/engine_storage.py).
    placements: Mapping[str, ParamPlacement]
    shards: Mapping[str, torch.Tensor]  # no entry for a shard in the parameter store
    full: Mapping[str, torch.Tensor]
    master: Mapping[str, torch.Tensor]  # empty without mixed precision, or with offload
    buffers: Mapping[str, torch.Tensor]
    optimizer_params: Mapping[str, torch.Tensor]  # the tensors the optimizer steps, by FQN
    param_shard: Callable[[str], torch.Tensor]  # this rank's shard, read from its tier when offloaded
    param_store: ParamStore | None
    offload_store: OffloadStore | None
    # The optimizer and its step.
    optimizer: torch.optim.Optimizer
    loss_scaler: LossScaler | None
    counters: StepCounters
