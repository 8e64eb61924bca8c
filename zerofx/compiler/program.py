"""``zerofx.compile``: plan a model for one world size, and capture and lower it, without running it.

Planning needs no process group and no parameter memory: the sharding plan needs only the
parameters' shapes, and capture runs on fake tensors, so a model built on the meta device plans
for world size 8 or 1024 on a laptop. The graphs come from example inputs, given to ``compile``
or later (NOTE [Capture on first need]).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from zerofx.cost_models.comm import CPU_GLOO, CommSpec
from zerofx.cost_models.compute import CPU_CORE, DeviceSpec
from zerofx.cost_models.profiles import load_profile
from zerofx.passes import Plan, ZeroStage, _compat
from zerofx.passes.analysis.analyze_schedule import ScheduleReport, analyze_schedule
from zerofx.passes.plan.offload import ParamOffloadPlan
from zerofx.passes.tiling.chunk_loop import eager_loops_pass
from zerofx.passes.zero.plan_shard_groups import prefetch_from_profile
from zerofx.passes.zero.plan_sharding import plan_sharding_from_shapes
from zerofx.compiler.capture import CapturedStep, LossFn, flatten_call, traced_param_infos
from zerofx.config import ZeroConfig, parse_config
from zerofx.config.compile_options import CompileOptions, compile_options
from zerofx.config.options import GraphCompiler
from zerofx.common.errors import MissingExampleInputsError, ZeroFXError
from zerofx.common.fork import fork_is_safe, start_in_fork
from zerofx.common.limits import MAX_WORLD_SIZE
from zerofx.compiler import pipeline
from zerofx.compiler.pipeline import StepCapture, lower, plan_step, with_offloaded_grads

log = logging.getLogger("zerofx.compiler.program")

# How long a rank waits for the child that compiles its graphs first (NOTE [Inductor compiles
# first in a child]): a cold compile of a large model's graphs takes minutes on a loaded host.
INDUCTOR_CHILD_WAIT_S = 1800.0

# The group name planned graphs carry when no process group exists; the engine lowers again
# with the real group's name.
PLANNING_GROUP = "zerofx_planning_group"
# The group across shard groups that planned graphs carry (NOTE [Shard groups of consecutive ranks]).
PLANNING_REPLICATE_GROUP = "zerofx_planning_replicate"


@dataclass(frozen=True)
class Source:
    """What ``zerofx.compile`` was given, to capture from once example inputs come."""

    model: nn.Module
    cfg: ZeroConfig
    options: CompileOptions  # ``cfg``'s, for the program's world size
    loss_fn: LossFn | None


class Program:
    """A planned training step for one world size and stage, with its graphs captured and
    lowered once example inputs are known (NOTE [Capture on first need])."""

    def __init__(self, captured: CapturedStep | None, plan: Plan, *, group_name: str = PLANNING_GROUP,
                 source: Source | None = None, plan_waits_for: str | None = None,
                 replicate_group_name: str = PLANNING_REPLICATE_GROUP) -> None:
        assert captured is not None or source is not None, "a program captures, or has what to capture from"
        self._captured = captured
        self._plan = plan
        self._source = source  # what zerofx.compile was given; None for a program planned from a capture (the engine's)
        self._plan_waits_for = plan_waits_for  # why the plan itself needs the capture, when it does
        self.group_name = group_name  # the shard group's (the world's when sharding is flat)
        self.replicate_group_name = replicate_group_name  # across shard groups; unused when flat
        self._modules: dict[str, fx.GraphModule] | None = None
        self._runners: dict[tuple[int, str], Callable[[list[torch.Tensor]], Any]] = {}
        self.compiled_graphs: set[str] = set()  # names of the graphs Inductor compiled
        self.compile_s = 0.0  # seconds spent compiling this program's graphs (GraphCompiler.INDUCTOR)
        self.warmed_ranks: set[int] = set()  # ranks whose graphs a child compiled first (NOTE [Inductor compiles first in a child])
        # Seconds per setup phase, measured where each runs: "capture" and "plan" by
        # capture_and_plan, "lower" by graph_modules the first time it lowers.
        self.setup_times: dict[str, float] = {}
        self.cache_entry: Path | None = None  # the plan-cache file this program was loaded from or written to

    @classmethod
    def from_lowered(cls, captured: CapturedStep, plan: Plan, modules: Mapping[str, fx.GraphModule], **options: Any) -> Program:
        """A program whose graphs were lowered already (``zerofx.compiler.plan_cache`` loads them);
        ``options`` are ``__init__``'s keyword arguments (the group names)."""
        program = cls(captured, plan, **options)
        program._modules = dict(modules)
        return program

    @property
    def plan(self) -> Plan:
        """The sharding plan. Without a capture it is planned from the parameters' shapes (NOTE [A
        plan from shapes alone] in passes/zero/plan_sharding.py), unless the config chooses from the
        memory timeline (``zerofx.memory_budget``, ``zerofx.tiling``): then it needs the capture."""
        if self._captured is None and self._plan_waits_for is not None:
            raise MissingExampleInputsError(self._needs_inputs(f"program.plan ({self._plan_waits_for})"))
        return self._plan

    @property
    def param_offload(self) -> ParamOffloadPlan | None:
        """Stage 3 with offload_param: which shards live off the device and which graphs fetch them."""
        return self._plan.param_offload

    @property
    def offload_grads(self) -> bool:
        """Stages 2-3 with zerofx.offload_gradients: the backward hands each reduced shard off at
        its bucket's wait (NOTE [Gradients leave at their bucket's wait] in passes/memory/offload_grads.py)."""
        return self._plan.offload_grads

    @property
    def captured(self) -> CapturedStep:
        """The captured training step (joint graph, parameters, buffers, inputs)."""
        return self._require_capture("program.captured")

    @property
    def world_size(self) -> int:
        return self._plan.world_size

    @property
    def stage(self) -> ZeroStage:
        return self._plan.stage

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ZeroFXError(f"rank={rank!r} is outside this program's world size {self.world_size}; accepted: 0..{self.world_size - 1}")

    def _needs_inputs(self, what: str) -> str:
        return (f"{what} needs the captured graphs, and {self!r} was compiled without example inputs; pass example_inputs "
                "(and example_kwargs) to zerofx.compile, or to program.graph_modules(rank, example_inputs=..., example_kwargs=...)")

    def _require_capture(self, what: str) -> CapturedStep:
        if self._captured is None:
            raise MissingExampleInputsError(self._needs_inputs(what))
        return self._captured

    def _take_inputs(self, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> None:
        """Capture, plan and lower from these inputs if not done yet; else check they are the
        inputs the graphs were captured for."""
        if self._source is None:
            raise ZeroFXError("this program was planned from a captured step (the engine's); its graphs come from that capture, "
                              "so it takes no example_inputs")
        source = self._source
        if self._captured is None:
            captured = capture_and_plan(
                StepCapture(source.model, args, kwargs, loss_fn=source.loss_fn, compute_dtype=source.cfg.compute_dtype,
                            sequence_parallel=source.options.sequence_parallel),
                source.cfg, source.options, group_name=self.group_name, param_offload=self.param_offload,
                replicate_group_name=self.replicate_group_name,
            )
            self._captured, self._plan, self._modules = captured._captured, captured._plan, captured._modules
            self.setup_times = dict(captured.setup_times)
            return
        flatten_call(self._captured, source.model, args, kwargs or {}, source.loss_fn)  # InputMismatchError if not theirs

    def graph_modules(self, rank: int, *, example_inputs: Sequence[Any] | None = None,
                      example_kwargs: Mapping[str, Any] | None = None) -> dict[str, fx.GraphModule]:
        """The graph modules rank ``rank`` runs: ``forward``, ``backward`` and, at stages 1 and 2,
        ``param_sync`` (the all-gather of updated shards after the optimizer step), and at
        stage 1 ``grad_sync`` (the reduce-scatter of the accumulated gradients before it).

        A program compiled without example inputs captures from the first ones given here
        (positional arguments, and keyword arguments such as ``labels``); later ones must match.
        Every rank's shard has the same padded size, so the graphs are the same on every rank:
        which slice of each parameter a rank holds is decided by its rank in the collectives.
        """
        self._check_rank(rank)
        if example_inputs is not None or example_kwargs is not None:
            self._take_inputs(check_example_inputs(example_inputs), example_kwargs)
        if self._modules is None:
            joint = self._require_capture("program.graph_modules(rank)").joint
            start = time.perf_counter()
            self._modules = lower(joint, self._plan, group_name=self.group_name, replicate_group_name=self.replicate_group_name)
            self.setup_times["lower"] = time.perf_counter() - start
        return dict(self._modules)

    def run(self, rank: int, name: str, args_list: list[torch.Tensor], compiler: GraphCompiler) -> Any:
        """Run graph ``name`` of rank ``rank`` on ``args_list``, which it empties (NOTE [Boxed
        graphs]). With ``GraphCompiler.INDUCTOR`` the graph is compiled by Inductor for inputs
        like these on the first call and cached; ``grad_sync`` and ``param_sync`` (collectives
        and copies) never are."""
        key = (rank, name)
        if key not in self._runners:
            self._runners[key] = self._runner(rank, name, args_list, compiler)
        return self._runners[key](args_list)

    def _runner(self, rank: int, name: str, example: list[torch.Tensor], compiler: GraphCompiler) -> Callable[[list[torch.Tensor]], Any]:
        gm = self.graph_modules(rank)[name]
        if compiler is GraphCompiler.NONE or name in ("grad_sync", "param_sync"):
            gm = eager_loops_pass(gm)  # NOTE [One body per tiled region] in passes/tiling/chunk_loop.py
            boxed = _compat.boxed_graph_module(gm)
            if boxed is not None:
                return boxed
            return lambda args_list: gm(*_take(args_list))
        start = time.perf_counter()
        if rank not in self.warmed_ranks:
            self.warmed_ranks.add(rank)
            self.compile_in_child(rank)
        compiled = _compat.inductor_compile(gm, list(example))  # boxed: it empties the list
        self.compile_s += time.perf_counter() - start
        self.compiled_graphs.add(name)
        return compiled

    # NOTE [Inductor compiles first in a child]
    # What Inductor's lowering allocates partly stays in the process that compiled (CPython's
    # arenas, caches): on the 25m DNA LM's stage-2 rank graphs the rank held 86 MiB more
    # between steps than the same configuration eager (38 MiB more since). So before a rank compiles its first graph, a forked child compiles
    # the rank's forward and backward graphs from their inputs' fakes (nothing allocated for
    # them) into Inductor's on-disk cache and exits, taking the lowering's memory with it; the
    # rank's own compiles are then cache hits (NOTE [Inductor's cache needs a shape
    # environment] in passes/_compat.py). Measured by hand on that configuration (2 ranks, 25m,
    # 1x1,024 tokens, 115 recomputed, MALLOC_MMAP_THRESHOLD_ 256 KiB; fresh ranks, VmHWM reset
    # per step): the steps' peak 814-815 MiB with an empty cache and with a full one, against
    # 862-863 MiB before. Where the cache holds the graphs, the child's compiles and the rank's
    # are hits, and the compiled configuration took 4-5 s longer from launch to its last step
    # than the same configuration eager (the capped benchmark's rounds). The child runs on the first call, before the forward,
    # while the rank holds only its model state and batch: it adds its own compile's memory to
    # the host then, not to a step's peak. Where a fork is unsafe (a CUDA context, NOTE [Work in
    # a forked child]), or the child fails or runs past ``INDUCTOR_CHILD_WAIT_S``, the rank
    # compiles by itself, as before.
    def compile_in_child(self, rank: int) -> None:
        """Compile rank ``rank``'s forward and backward graphs with Inductor in a forked child, into
        Inductor's on-disk cache (NOTE [Inductor compiles first in a child]); nothing where a fork is unsafe."""
        if not _compat.inductor_cache_enabled() or not fork_is_safe(runs_kernels=False):
            return
        modules = self.graph_modules(rank)

        def compile_all() -> bytes:
            for name in ("forward", "backward"):
                if name in modules:
                    fakes = [n.meta["val"] for n in modules[name].graph.nodes if n.op == "placeholder"]
                    _compat.inductor_compile(modules[name], fakes)
            return b""

        got = start_in_fork(compile_all)(INDUCTOR_CHILD_WAIT_S)
        if got is None or got.error is not None:
            why = "it died or ran past its time" if got is None else f"{got.error[0]}: {got.error[1]}"
            log.info("rank %d: compiling its graphs in a child first failed (%s); compiling them here", rank, why)

    def with_decision(self, why: str) -> Program:
        """This program with ``why`` added to its plan's decision notes. A note changes no graph,
        so the copy keeps the graphs already lowered rather than lowering them again."""
        program = Program(self._captured, replace(self._plan, decisions=(*self._plan.decisions, why)), group_name=self.group_name,
                          source=self._source, plan_waits_for=self._plan_waits_for, replicate_group_name=self.replicate_group_name)
        program._modules = self._modules
        program.setup_times = dict(self.setup_times)
        return program

    def replan(self, config: str | Path | Mapping[str, Any] | None = None, *, world_size: int | None = None,
               stage: int | None = None) -> Program:
        """This program's captured step planned again, as ``zerofx.compile`` would plan it for
        ``world_size``, ``stage`` and ``config``, without capturing again (NOTE [Planning again
        from one capture]). What is not given stays this program's: without ``config`` its config
        (``stage=`` then replaces the config's stage), and the stage and world size where the
        config sets neither."""
        source = self._source
        if source is None:
            raise ZeroFXError("this program was planned from a captured step (the engine's); replan a program from zerofx.compile")
        captured = self._require_capture("program.replan()")
        # Without ``config``, this program's options again (at another stage when ``stage=`` is given).
        if config is None:
            chosen = source.cfg.without_stage() if stage is not None else source.cfg
        else:
            chosen = parse_config(config)
        # What the config fixes by itself (``config_stage``, ``config_world_size``); the rest stays this program's.
        cfg = resolve(chosen, stage=stage if stage is not None or chosen.config_stage is not None else int(self.stage),
                      world_size=world_size if world_size is not None or chosen.config_world_size is not None else self.world_size)
        if cfg.world_size is None:
            raise ZeroFXError("no world size given; pass world_size= (an integer >= 1) or set zerofx.world_size in the config")
        options = compile_options(cfg, cfg.world_size)
        # NOTE [Planning again from one capture]
        # The captured joint graph depends on the inputs, the compute dtype, the tiling chosen at
        # capture and the sequence-parallel rewrite (its group names carry the world size); the
        # plan (stage, world size, buckets, prefetch, shard groups, offload, profile) is read
        # from the graph without changing it. So a new plan reuses the capture only when those
        # capture-time settings are equal; otherwise replan refuses, naming the setting.
        for what, old, new in (("the compute dtype (bf16/fp16)", source.cfg.compute_dtype, cfg.compute_dtype),
                               ("zerofx.tiling", source.options.tiling_at_capture, options.tiling_at_capture),
                               ("zerofx.sequence_parallel (with the world size)", source.options.sequence_parallel, options.sequence_parallel)):
            if old != new:
                raise ZeroFXError(f"program.replan cannot change {what}: the captured graphs depend on it "
                                  f"({old} here, {new} asked); call zerofx.compile for a new capture")
        start = time.perf_counter()
        program = plan_program(captured, cfg, options, group_name=self.group_name, replicate_group_name=self.replicate_group_name)
        program._source = Source(source.model, cfg, options, source.loss_fn)
        program.setup_times = {"plan": time.perf_counter() - start}
        return program

    def report(self, rank: int, *, comm: CommSpec = CPU_GLOO, device: DeviceSpec = CPU_CORE,
               compiler: GraphCompiler | None = None, fused_optimizer: bool | None = None) -> ScheduleReport:
        """The estimated schedule of rank ``rank``: one row per collective (where it is issued and
        waited for, the compute it overlaps, its time), the memory timeline and its peak, and the
        estimated step time with the communication left exposed. ``str(format_report(...))``
        prints it. ``compiler`` and ``fused_optimizer`` say how the graphs and the update run
        (NOTE [Fused kernels under Inductor] in cost_models/compute.py); None: as this program's
        config says (``zerofx.compile``, ``zerofx.fused_optimizer``), eager for a program without one."""
        captured = self._require_capture("program.report(rank) (the schedule, step time and memory timeline)")
        cfg = self._source.cfg if self._source is not None else None
        if compiler is None:
            compiler = cfg.graph_compiler if cfg is not None else GraphCompiler.NONE
        if fused_optimizer is None:
            fused_optimizer = cfg.fused_optimizer if cfg is not None else False
        self._check_rank(rank)
        fused = compiler is GraphCompiler.INDUCTOR
        # Each capture keeps its reports by plan (NOTE [One report per plan of a capture]).
        key = (repr(replace(self.plan, decisions=())), self.group_name, self.replicate_group_name, rank, comm, device, fused,
               fused_optimizer)
        reports = _REPORTS.setdefault(captured.joint, {})
        if key not in reports:
            reports[key] = analyze_schedule(self.graph_modules(rank), self.plan, comm=comm, device=device, fused=fused,
                                            fused_update=fused_optimizer)
        return reports[key]

    def memory(self, rank: int) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer states rank ``rank`` holds between steps:
        a function of the parameters' shapes, so known before any capture."""
        self._check_rank(rank)
        return dict(self._plan.estimates)

    def __repr__(self) -> str:
        model_class = self._captured.model_class if self._captured is not None else type(self._source.model).__qualname__
        return f"Program({model_class}, stage={int(self.stage)}, world_size={self.world_size})"


# NOTE [One report per plan of a capture]
# A program's report is a function of its captured joint graph, its plan less the plan's
# decision notes (which change no graph), its group names, the rank and how it is priced (the
# profile, Inductor or eager, the fused update). The budget searches lower and report many plans
# of one capture, and the same plan again and again: recompute "auto" measures the plan with
# nothing recomputed first, which is the same candidate's plan with recompute off, already
# reported; a candidate that offloads its optimizer state plans exactly as the one that does not
# (the plan holds no optimizer placement), so its prefetch and recompute searches report the
# same plans over again. So each capture keeps the reports made of it, by plan, as long as its
# joint graph lives, and a plan reported once is neither lowered nor analysed again for a
# report: a report holds the timeline's points, not the graphs, so keeping every one costs a
# fraction of one lowering's memory. A program whose graphs are needed (to run, or print) still
# lowers them itself.
_REPORTS: weakref.WeakKeyDictionary[fx.GraphModule, dict[tuple[Any, ...], ScheduleReport]] = weakref.WeakKeyDictionary()


# NOTE [Capture on first need]
# The sharding plan and the bytes per rank are functions of the parameters, so
# ``zerofx.compile`` plans from them at once (``plan_sharding_from_shapes``) and keeps what
# it was given (``Source``). The graphs need example inputs; as ``torch.compile`` captures on
# its first call, a program captures, plans from the graph and lowers the first time example
# inputs reach it (``compile(example_inputs=...)`` or ``graph_modules(rank, example_inputs=...)``)
# and keeps the result: the captured plan replaces the shapes-only one (the same placements and
# bytes; buckets and their order from the graph). Later example inputs must match those. Before
# that, what needs the graphs (``graph_modules``, ``report``, ``captured``, and ``plan`` itself
# where ``zerofx.memory_budget`` or ``zerofx.tiling`` chooses from the memory timeline) raises
# ``MissingExampleInputsError`` naming both ways to give them.


# NOTE [Boxed graphs]
# The engine hands each graph its inputs in a list the graph empties, and the graph's Python
# drops each input right after its last use. For the backward graph the inputs are the tensors
# the forward saved: called the usual way, the caller's argument tuple kept every one of them
# alive until the whole backward returned; boxed, each is freed as soon as the backward is done
# with it, as eager autograd frees saved tensors node by node. AOTAutograd calls its compiled
# graphs the same way (make_boxed_func); FX's own boxed codegen is private, hence ours in
# passes/_compat.py. Inductor's compiled graphs are called boxed too (NOTE [Inductor's graphs
# are called boxed] in passes/_compat.py).
def _take(args_list: list[torch.Tensor]) -> list[torch.Tensor]:
    """The list's items, leaving it empty (the boxed convention, for callables that are not)."""
    items = list(args_list)
    args_list.clear()
    return items


def check_stage(stage: Any) -> ZeroStage:
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ZeroFXError(f"stage={stage!r} is not a ZeRO stage; accepted: 0, 1, 2 or 3")
    return ZeroStage(stage)


# MAX_WORLD_SIZE (zerofx.common.limits): the largest world size planned.


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


def plan_program(captured: CapturedStep, cfg: ZeroConfig, compile_opts: CompileOptions, *, group_name: str = PLANNING_GROUP,
                 param_offload: ParamOffloadPlan | None = None, replicate_group_name: str = PLANNING_REPLICATE_GROUP) -> Program:
    """The spine's plan stage for ``captured`` (``plan_step`` in zerofx/compiler/pipeline.py),
    its candidates ``Program``s for these groups. A program for real process groups (not the
    planning group) keeps the shard group size its groups were built with."""
    return plan_step(captured, cfg, compile_opts, _programs(group_name, replicate_group_name), param_offload=param_offload,
                     choose_shard_group_size=group_name == PLANNING_GROUP)


def capture_and_plan(capture: StepCapture, cfg: ZeroConfig, compile_opts: CompileOptions, *, group_name: str = PLANNING_GROUP,
                     param_offload: ParamOffloadPlan | None = None, replicate_group_name: str = PLANNING_REPLICATE_GROUP) -> Program:
    """The spine's stages capture to plan (``capture_and_plan`` in zerofx/compiler/pipeline.py), as ``Program``s."""
    return pipeline.capture_and_plan(capture, cfg, compile_opts, _programs(group_name, replicate_group_name),
                                     param_offload=param_offload, choose_shard_group_size=group_name == PLANNING_GROUP)


def _programs(group_name: str, replicate_group_name: str) -> Callable[[CapturedStep, Plan], Program]:
    def make(captured: CapturedStep, plan: Plan) -> Program:
        return Program(captured, plan, group_name=group_name, replicate_group_name=replicate_group_name)
    return make


def plan_from_shapes(model: nn.Module, cfg: ZeroConfig, compile_opts: CompileOptions) -> Plan:
    """The plan from ``model``'s parameters alone, taken as capture takes them (NOTE [A plan from
    shapes alone] in passes/zero/plan_sharding.py)."""
    infos = traced_param_infos(model, compute_dtype=cfg.compute_dtype)
    plan = plan_sharding_from_shapes([(i.fqn, i.shape, i.dtype, i.requires_grad) for i in infos], world_size=compile_opts.world_size,
                                     stage=compile_opts.stage, optimizer=compile_opts.optimizer, options=compile_opts.schedule,
                                     shard_group_size=compile_opts.shard_group_size, comm=load_profile(cfg.profile)[0])
    plan = with_offloaded_grads(plan, cfg)
    decision = compile_opts.shard_group_decision
    return plan if decision is None else replace(plan, decisions=(decision, *plan.decisions))


def prefetch_from_the_profile(cfg: ZeroConfig) -> bool:
    """Whether the planner takes the prefetch distance from the profile: stage 3, an explicit
    profile, no distance configured (``plan_step``)."""
    return cfg.stage == 3 and cfg.profile_is_explicit and cfg.schedule.prefetch_distance is None


def whole_prefetch_distance(model: nn.Module, cfg: ZeroConfig, world_size: int, compute_s: float) -> int | None:
    """The prefetch distance the planner takes from the profile for all of ``model`` (stage 3,
    an explicit profile, no distance configured), from its parameters' shapes and ``compute_s``,
    one step's compute estimate; None where the planner would not take it from the profile. Folded
    plans use it for their cut models (NOTE [The whole model's prefetch distance] in
    zerofx/planner/autoplan.py)."""
    if not prefetch_from_the_profile(cfg):
        return None
    plan = plan_from_shapes(model, cfg, compile_options(cfg, world_size))
    return prefetch_from_profile(plan, compute_s=compute_s, comm=load_profile(cfg.profile)[0])


def _plan_waits_for(compile_opts: CompileOptions, plan: Plan) -> str | None:
    """Why the config makes the plan depend on the captured graphs, or None."""
    if compile_opts.tiling_at_capture is not None:
        return "zerofx.tiling chooses what to tile from the graph"
    if compile_opts.schedule.memory_budget_bytes is not None and plan.prefetch_distance > 0:
        return "zerofx.memory_budget fits the prefetch distance to the memory timeline"
    if compile_opts.choose_shard_group_size:
        return "zerofx.shard_group_size \"auto\" chooses from the step's compute estimate"
    return None


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
    """Plan ``model``'s training step for ``world_size`` ranks at ZeRO ``stage``, and capture it.

    Nothing runs and no process group is needed. ``example_inputs`` are the positional
    arguments of one call, ``example_kwargs`` its keyword arguments (e.g. ``labels``). Without
    them the program has its plan and ``memory``, and captures its graphs from the first
    example inputs given to ``graph_modules`` (NOTE [Capture on first need]).
    """
    given = example_inputs is not None or example_kwargs is not None
    args = check_example_inputs(example_inputs) if given else None
    cfg = resolve(config, stage=stage, world_size=world_size)
    if cfg.world_size is None:
        raise ZeroFXError("no world size given; pass world_size= (an integer >= 1) or set zerofx.world_size in the config")
    options = compile_options(cfg, cfg.world_size)
    plan = plan_from_shapes(model, cfg, options)
    program = Program(None, plan, source=Source(model, cfg, options, loss_fn), plan_waits_for=_plan_waits_for(options, plan))
    if args is not None:
        program._take_inputs(args, example_kwargs)
    return program
