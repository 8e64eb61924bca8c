"""The options planning and lowering read for one world size, resolved once.

``compile_options(cfg, world_size)`` checks what depends on the world size (the shard group
size divides it, the sequence-parallel size divides it) and resolves it: the shard group size
K, the sequence-parallel spec with its group's name, and beside them the stage, the optimizer
kind, the schedule and tiling options the planners take. ``zerofx.compile``, ``Program.replan``
and the engine each build one per world size; the compiler (zerofx/compiler/program.py) and the
runtime's process groups (zerofx/runtime/rank_groups.py) read it instead of the config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zerofx.passes.plan import ScheduleOptions, ZeroStage
from zerofx.passes.plan.tiling import TilingOptions
from zerofx.passes.plan.sequence import SequenceParallelSpec
from zerofx.config import ZeroConfig, check_sequence_parallel_size, check_shard_group_size


def sequence_group_name(size: int, world_size: int) -> str:
    """The name every rank registers its own sequence group under (NOTE [Sequence groups] in
    zerofx/runtime/rank_groups.py), and planned graphs' all-to-alls carry."""
    return f"zerofx_sequence_{size}of{world_size}"


@dataclass(frozen=True)
class CompileOptions:
    """What the planners and the capture take from the config for ``world_size`` ranks."""

    world_size: int
    stage: ZeroStage
    optimizer: str  # the optimizer's kind, a key of OPTIMIZERS (cost_models/memory.py)
    schedule: ScheduleOptions
    tiling: TilingOptions | None  # the zerofx.tiling section; None when it is absent
    sequence_parallel: SequenceParallelSpec | None  # with its group named; None without sequence parallelism
    # K: the world size when sharding is flat, and while "auto" waits for the captured step.
    shard_group_size: int
    choose_shard_group_size: bool  # zerofx.shard_group_size "auto": the planner chooses K from the captured step
    shard_group_decision: str | None  # the plan's decision line for a K the config left to the planner

    @property
    def tiling_at_capture(self) -> TilingOptions | None:
        """The tiling options capture uses; None when nothing is tiled."""
        return None if self.tiling is None or self.tiling.enabled is False else self.tiling


def compile_options(cfg: ZeroConfig, world_size: int, *, backend: str | None = None) -> CompileOptions:
    """``cfg``'s options for ``world_size`` ranks, checked against it. ``cfg.stage`` must be set
    (``zerofx.compiler.program.resolve`` and ``initialize`` see to it). ``backend``: the
    process-group backend the graphs run on, where there is a group (the engine's); it decides
    how reduce-scatters are issued (NOTE [gloo's reduce-scatter as an all-to-all] in
    passes/zero/reduce_scatter_all_to_all.py), which a plan without a group takes from its comm profile."""
    assert cfg.stage is not None, "the stage is resolved before the compile options"
    value = cfg.shard_group_size
    decision = None
    if value is None:
        shard_group_size = world_size
    elif value == "auto":
        # The captured step's planner chooses K (``plan_program``); planned from shapes alone there
        # is no compute estimate to choose from, so sharding stays flat and the plan says so.
        shard_group_size = world_size
        decision = f"shard group size {world_size} (flat): zerofx.shard_group_size \"auto\" chooses from the captured step"
    else:
        check_shard_group_size(value, stage=cfg.stage, world_size=world_size)
        shard_group_size = int(value)
    spec = cfg.sequence_parallel
    if spec is not None:
        check_sequence_parallel_size(spec.size, world_size=world_size)
        spec = replace(spec, group_name=sequence_group_name(spec.size, world_size))
    schedule = cfg.schedule
    if backend is not None and schedule.reduce_scatter_by_all_to_all is None:
        schedule = replace(schedule, reduce_scatter_by_all_to_all=backend == "gloo")
    return CompileOptions(world_size=world_size, stage=ZeroStage(cfg.stage), optimizer=cfg.optimizer.kind, schedule=schedule,
                          tiling=cfg.tiling, sequence_parallel=spec, shard_group_size=shard_group_size,
                          choose_shard_group_size=value == "auto", shard_group_decision=decision)
