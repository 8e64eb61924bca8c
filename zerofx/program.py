"""``zerofx.compile``: capture, plan and lower a model for one world size, without running it.

Planning needs no process group and no parameter memory: capture runs on fake tensors, so a
model built on the meta device plans for world size 8 or 1024 on a laptop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from zerofx.cost_models.comm import CPU_GLOO, CommSpec
from zerofx.cost_models.compute import CPU_CORE, DeviceSpec
from zerofx.cost_models.memory import optimizer_kind
from zerofx.passes import Plan, ZeroStage, _compat, plan_sharding
from zerofx.passes.analyze_schedule import ScheduleReport, analyze_schedule
from zerofx.passes.plan import ScheduleOptions, format_bytes
from zerofx.passes.plan_offload import ParamOffloadPlan
from zerofx.passes.plan_tiling import TilingOptions
from zerofx.capture import CapturedStep, LossFn, capture_step
from zerofx.config import GraphCompiler, ZeroConfig, parse_config
from zerofx.errors import ZeroFXError
from zerofx.pipeline import lower

# The group name planned graphs carry when no process group exists; the engine lowers again
# with the real group's name.
PLANNING_GROUP = "zerofx_planning_group"

log = logging.getLogger("zerofx.tiling")


class Program:
    """A captured, planned and lowered training step for one world size and stage."""

    def __init__(self, captured: CapturedStep, plan: Plan, *, group_name: str = PLANNING_GROUP,
                 param_offload: ParamOffloadPlan | None = None) -> None:
        self.captured = captured
        self.plan = plan
        self.group_name = group_name
        self.param_offload = param_offload  # stage 3 offload_param: which shards the graphs fetch
        self._modules: dict[str, fx.GraphModule] | None = None
        self._runners: dict[tuple[int, str], Callable[[list[torch.Tensor]], Any]] = {}
        self.compiled_graphs: set[str] = set()  # names of the graphs Inductor compiled
        self.compile_s = 0.0  # seconds spent compiling this program's graphs (GraphCompiler.INDUCTOR)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def stage(self) -> ZeroStage:
        return self.plan.stage

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ZeroFXError(f"rank={rank!r} is outside this program's world size {self.world_size}; accepted: 0..{self.world_size - 1}")

    def graph_modules(self, rank: int) -> dict[str, fx.GraphModule]:
        """The graph modules rank ``rank`` runs: ``forward``, ``backward`` and, at stages 1 and 2,
        ``param_sync`` (the all-gather of updated shards after the optimizer step).

        Every rank's shard has the same padded size, so the graphs are the same on every rank:
        which slice of each parameter a rank holds is decided by its rank in the collectives.
        """
        self._check_rank(rank)
        if self._modules is None:
            self._modules = lower(self.captured.joint, self.plan, group_name=self.group_name, param_offload=self.param_offload)
        return dict(self._modules)

    def run(self, rank: int, name: str, args_list: list[torch.Tensor], compiler: GraphCompiler) -> Any:
        """Run graph ``name`` of rank ``rank`` on ``args_list``, which it empties (NOTE [Boxed
        graphs]). With ``GraphCompiler.INDUCTOR`` the graph is compiled by Inductor for inputs
        like these on the first call and cached; ``param_sync`` (all-gathers only) never is."""
        key = (rank, name)
        if key not in self._runners:
            self._runners[key] = self._runner(rank, name, args_list, compiler)
        return self._runners[key](args_list)

    def _runner(self, rank: int, name: str, example: list[torch.Tensor], compiler: GraphCompiler) -> Callable[[list[torch.Tensor]], Any]:
        gm = self.graph_modules(rank)[name]
        if compiler is GraphCompiler.NONE or name == "param_sync":
            boxed = _compat.boxed_graph_module(gm)
            if boxed is not None:
                return boxed
            return lambda args_list: gm(*_take(args_list))
        start = time.perf_counter()
        compiled = _compat.inductor_compile(gm, list(example))
        self.compile_s += time.perf_counter() - start
        self.compiled_graphs.add(name)
        return lambda args_list: compiled(*_take(args_list))

    def with_decision(self, why: str) -> Program:
        """This program with ``why`` added to its plan's decision notes. A note changes no graph,
        so the copy keeps the graphs already lowered rather than lowering them again."""
        program = Program(self.captured, replace(self.plan, decisions=(*self.plan.decisions, why)), group_name=self.group_name,
                          param_offload=self.param_offload)
        program._modules = self._modules
        return program

    def report(self, rank: int, *, comm: CommSpec = CPU_GLOO, device: DeviceSpec = CPU_CORE) -> ScheduleReport:
        """The estimated schedule of rank ``rank``: one row per collective (where it is issued and
        waited for, the compute it overlaps, its time), the memory timeline and its peak, and the
        estimated step time with the communication left exposed. ``str(format_report(...))``
        prints it."""
        return analyze_schedule(self.graph_modules(rank), self.plan, comm=comm, device=device)

    def memory(self, rank: int) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer states rank ``rank`` holds between steps."""
        self._check_rank(rank)
        return dict(self.plan.estimates)

    def __repr__(self) -> str:
        return f"Program({self.captured.model_class}, stage={int(self.stage)}, world_size={self.world_size})"


# NOTE [Boxed graphs]
# The engine hands each graph its inputs in a list the graph empties, and the graph's Python
# drops each input right after its last use. For the backward graph the inputs are the tensors
# the forward saved: called the usual way, the caller's argument tuple kept every one of them
# alive until the whole backward returned; boxed, each is freed as soon as the backward is done
# with it, as eager autograd frees saved tensors node by node. AOTAutograd calls its compiled
# graphs the same way (make_boxed_func); FX's own boxed codegen is private, hence ours in
# passes/_compat.py. Inductor-compiled graphs are called unboxed: its entry point takes
# positional inputs, so there the caller's copy lives to the end.
def _take(args_list: list[torch.Tensor]) -> list[torch.Tensor]:
    """The list's items, leaving it empty (the boxed convention, for callables that are not)."""
    items = list(args_list)
    args_list.clear()
    return items


def check_stage(stage: Any) -> ZeroStage:
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ZeroFXError(f"stage={stage!r} is not a ZeRO stage; accepted: 0, 1, 2 or 3")
    return ZeroStage(stage)


# The largest world size planned: far beyond any cluster, small enough that per-rank sizes and
# the planner's tables stay exact.
MAX_WORLD_SIZE = 2**20


def check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ZeroFXError(f"world_size={world_size!r} is invalid; accepted: an integer in 1..{MAX_WORLD_SIZE}")
    return world_size


def check_example_inputs(example_inputs: Any) -> tuple[Any, ...]:
    if example_inputs is None:
        raise ZeroFXError(
            "example_inputs is missing; pass a tuple of the model's positional arguments, e.g. example_inputs=(input_ids,)"
        )
    if not isinstance(example_inputs, Sequence) or isinstance(example_inputs, (str, bytes)):
        raise ZeroFXError(
            f"example_inputs must be a tuple of the model's positional arguments, got {type(example_inputs).__name__}"
        )
    return tuple(example_inputs)


def resolve(config: str | Path | Mapping[str, Any] | None, *, stage: int | None, world_size: int | None) -> ZeroConfig:
    """Validate the arguments and the config together; both must be present between them."""
    if stage is not None:
        check_stage(stage)
    if world_size is not None:
        check_world_size(world_size)
    cfg = parse_config(config, stage=stage, world_size=world_size)
    if cfg.stage is None:
        raise ZeroFXError("no ZeRO stage given; pass stage= (0, 1, 2 or 3) or set zero_optimization.stage in the config")
    return cfg


def plan_program(captured: CapturedStep, cfg: ZeroConfig, world_size: int, *, group_name: str = PLANNING_GROUP,
                 param_offload: ParamOffloadPlan | None = None) -> Program:
    opt = optimizer_kind(cfg.optimizer.type, dict(cfg.optimizer.params))
    options = cfg.schedule_options()

    def plan_with(opts: ScheduleOptions) -> Program:
        plan = plan_sharding(captured.joint, world_size=world_size, stage=ZeroStage(cfg.stage), optimizer=opt, options=opts)
        if captured.tiling is not None:
            plan = replace(plan, tiling=captured.tiling)
        return Program(captured, plan, group_name=group_name, param_offload=param_offload)

    program = plan_with(options)
    budget = options.memory_budget_bytes
    if budget is None or program.plan.prefetch_distance == 0:
        return program
    # NOTE [Prefetch under a memory budget]
    # Each bucket prefetched ahead keeps one more gathered bucket alive, so the step's peak grows
    # with the distance. The planner's distance obeys stage3_max_live_parameters; here the memory
    # model (the lowered graphs' timeline) lowers it until the peak fits the budget. The plan is
    # rebuilt, never patched: the rewrites read only the Plan.
    chosen = program.plan.prefetch_distance
    peak = program.report(0).peak.live_bytes
    tried = [(chosen, peak)]
    while peak > budget and program.plan.prefetch_distance > 0:
        program = plan_with(replace(options, prefetch_distance=program.plan.prefetch_distance - 1))
        peak = program.report(0).peak.live_bytes
        tried.append((program.plan.prefetch_distance, peak))
    if len(tried) > 1:
        steps = ", ".join(f"{format_bytes(b)} at distance {d}" for d, b in tried)
        verdict = "fits" if peak <= budget else "does not fit even without prefetch"
        why = f"prefetch distance lowered from {chosen} to {program.plan.prefetch_distance} for the memory budget " \
              f"{format_bytes(budget)} (estimated peak {steps}; {verdict})"
        program = program.with_decision(why)
    return program


# NOTE [Tiling checked against the memory timeline]
# ``auto`` tiling chooses from per-op estimates that are upper bounds (NOTE [What the estimates
# mean] in passes/plan_tiling.py): a region counts every token-wise output as saved, where the
# min-cut partitioner saves far fewer, and SDPA counts a score matrix its fused kernel never
# makes. Measured on the 2-layer d256 DNA LM at 8k tokens, they put activations at 2.9 GiB
# untiled, where the lowered graphs' memory timeline gives 354 MiB and the real process
# 360 MiB. Alone, they tile far more than the budget needs, and every tiled region costs a
# recompute. So the choice is checked against the timeline of the lowered graphs (activations:
# its peak less the persistent model state): nothing is tiled when the untiled program fits;
# otherwise the estimates are held to a bound raised from the budget, doubling, while the
# timeline still fits, so the fewest and largest tiles that fit are kept. Each try is one more
# capture and lowering; the plan's decisions list them. The estimates can also fall short of
# the timeline (on small models the timeline's gradients and temporaries outweigh the saved
# activations they count): then the bound is halved, at most MAX_TIGHTENINGS times, until the
# timeline fits; if none does, the program with the least memory is kept.
MAX_TIGHTENINGS = 8


def _fit_tiling_to_timeline(first: Program, build: Callable[[TilingOptions], Program], options: TilingOptions) -> Program:
    budget = first.plan.tiling.budget_bytes
    tried: list[tuple[str, Program, int]] = []

    def attempt(what: str, program: Program) -> int:
        report = program.report(0)
        tried.append((what, program, report.peak.live_bytes - report.persistent_bytes))
        return tried[-1][2]

    def ops(program: Program) -> tuple:
        return program.plan.tiling.ops if program.plan.tiling is not None else ()

    def sequence_ops(program: Program) -> tuple:
        return tuple(op for op in ops(program) if op.kind != "weight")

    # Weight tiles follow weight_tile_bytes, not the activation budget (NOTE [Weight tiles] in
    # passes/plan_tiling.py): "untiled" here means no sequence tiling, with the weights as planned.
    weights_tiled = any(op.kind == "weight" for op in ops(first))
    untiled_options = replace(options, kinds=("weight",)) if weights_tiled else replace(options, enabled=False)
    if not sequence_ops(first):
        if attempt("untiled", first) <= budget:
            return first  # nothing tiled, and the timeline agrees: no note
        chosen, fits = first, False
    else:
        untiled = build(untiled_options)
        if attempt("untiled", untiled) <= budget:
            chosen, fits = untiled, True
        else:
            chosen = first
            fits = attempt(f"estimates held to {format_bytes(budget)}", first) <= budget
            if fits:  # loosen: fewer or larger tiles, while the timeline still fits
                bound = budget
                while (bound := bound * 2) < first.plan.tiling.estimate_untiled_bytes:
                    candidate = build(replace(options, estimate_budget_bytes=bound))
                    if ops(candidate) == ops(chosen):
                        continue
                    if attempt(f"estimates held to {format_bytes(bound)}", candidate) > budget:
                        break
                    chosen = candidate
    if not fits:  # tighten: more or smaller tiles, until the timeline fits
        bound = budget
        for _ in range(MAX_TIGHTENINGS):
            bound //= 2
            candidate = build(replace(options, estimate_budget_bytes=bound))
            if ops(candidate) == ops(chosen):
                if len(ops(candidate)) == sum(candidate.plan.tiling.num_candidates) - len(candidate.plan.tiling.skipped):
                    break  # every candidate tiled, and a tighter bound changed nothing: it is as tiled as it gets
                continue
            chosen = candidate
            if attempt(f"estimates held to {format_bytes(bound)}", candidate) <= budget:
                fits = True
                break
        if not fits:  # none fits: the least memory tried
            chosen = min(tried, key=lambda t: t[2])[1]
    steps = "; ".join(f"{what}: {len(sequence_ops(p))} tiled ops, activations {format_bytes(peak)}" for what, p, peak in tried)
    why = (f"tiling (auto) checked against the memory timeline for the budget {format_bytes(budget)} "
           f"(NOTE [Tiling checked against the memory timeline]): {steps}; kept {len(sequence_ops(chosen))} tiled ops, "
           f"which {'fit' if fits else 'do not fit'}")
    log.info(why)
    return chosen.with_decision(why)


def capture_and_plan(capture: Callable[[TilingOptions | None], CapturedStep], cfg: ZeroConfig, world_size: int, *,
                     group_name: str = PLANNING_GROUP, param_offload: ParamOffloadPlan | None = None) -> Program:
    """``capture(tiling_options)``, then plan and lower it; with ``zerofx.tiling.enabled: auto``
    the tiling is checked against the memory timeline (NOTE [Tiling checked against the memory
    timeline]), which may capture again."""
    options = cfg.tiling_options()

    def build(opts: TilingOptions | None) -> Program:
        return plan_program(capture(opts), cfg, world_size, group_name=group_name, param_offload=param_offload)

    program = build(options)
    if options is None or options.enabled != "auto" or program.plan.tiling is None:
        return program
    return _fit_tiling_to_timeline(program, build, options)


def compile(
    model: nn.Module,
    world_size: int | None = None,
    stage: int | None = None,
    *,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    config: str | Path | Mapping[str, Any] | None = None,
    loss_fn: LossFn | None = None,
) -> Program:
    """Capture ``model``'s training step and plan it for ``world_size`` ranks at ZeRO ``stage``.

    Nothing runs and no process group is needed. ``example_inputs`` are the positional
    arguments of one call, ``example_kwargs`` its keyword arguments (e.g. ``labels``).
    """
    args = check_example_inputs(example_inputs)
    cfg = resolve(config, stage=stage, world_size=world_size)
    if cfg.world_size is None:
        raise ZeroFXError("no world size given; pass world_size= (an integer >= 1) or set zerofx.world_size in the config")
    return capture_and_plan(
        lambda tiling: capture_step(model, args, example_kwargs, loss_fn=loss_fn, compute_dtype=cfg.compute_dtype, tiling=tiling),
        cfg, cfg.world_size,
    )
