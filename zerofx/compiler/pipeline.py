"""The compile spine: every stage of a compile, in order, each through one runner.

NOTE [The compile spine]
A training step becomes the graph modules one rank runs in eight stages. Each runs through
``run_stage`` (its time logged, a failure that is not already a ``ZeroFXError`` raised as
``CompileStageError`` naming the stage and those that ran), and each rewrite within a stage
through ``run_passes`` (the same, per pass, plus a lint of the graph it returns and a
``disabled`` switch by pass name):

    stage          what it does                                         plan it reads
    capture        the step recorded before autograd (make_fx,          -
                   pre-dispatch: linear, SDPA, cross_entropy whole)
    pre_autograd   canonicalize_attention_pass,                         SequenceParallelPlan, TilingPlan
                   canonicalize_fft_conv_pass (both planners read
                   their forward), plan_sequence_parallel, then
                   sequence_parallel_pass; plan_tiling, then
                   tile_forward_pass
    autograd       AOTAutograd's joint graph of the rewritten forward   -
    plan           plan_step: shard group size, prefetch from the       (makes the Plan)
                   profile, plan_sharding (the SP, tiling and offload
                   plans joined in), fit_prefetch under a budget,
                   fit_recompute (zerofx.recompute);
                   capture_and_plan wraps stages 1-4 in fit_tiling
    joint          recompute_activations_pass, tile_weights_pass,       Plan
                   shard_params_pass, reduce_grads_pass
    partition      partition_joint: forward and backward                -
    graph          prefetch_gathers_pass, sink_reduce_waits_pass,       Plan (its param_offload, offload_grads)
                   fetch_params_pass, offload_grads_pass,
                   collective_passes (last: gather_into_buffers_pass,
                   NOTE [gloo's completion race]; on gloo
                   reduce_scatter_by_all_to_all_pass)
    sync           grad_sync (stage 1), param_sync (stages 1-2),        Plan
                   each through collective_passes

The first three are ``StepCapture`` (a ``CapturedStep``); ``plan_step`` is stage four, and its
``Plan`` is the one input of the last four (``lower``). The searches of the plan stage
(``fit_prefetch``, ``fit_tiling`` in zerofx/planner/fit.py) lower candidates to measure
them, so a candidate is built by a callback (``MakeCandidate``: zerofx/compiler/program.py
binds it to ``Program``). A step with neither sequence parallelism nor tiling skips the
pre_autograd rewrites: AOTAutograd traces the model's call itself. Reading this file top to
bottom gives the order; a new rewrite is a line in one of the pass lists below, a new planner a
step of ``plan_step``.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch
import torch.fx as fx
import torch.nn as nn

from zerofx.common.errors import CaptureError, CompileStageError, SequenceParallelError, ZeroFXError
from zerofx.compiler.capture import CapturedStep, LossFn, StepTracer, TensorInfo
from zerofx.planner.fit import Planned, fit_prefetch, fit_recompute, fit_tiling
from zerofx.config import ZeroConfig
from zerofx.common.units import format_bytes
from zerofx.config.compile_options import CompileOptions
from zerofx.config.options import GraphCompiler
from zerofx.cost_models.compute import DeviceSpec
from zerofx.cost_models.memory import device_model_state_bytes, inductor_resident_bytes
from zerofx.cost_models.profiles import load_profile
from zerofx.passes import Plan, ZeroStage, _compat, build_param_sync, meta, partition_joint, plan_sharding, reduce_grads_pass, shard_params_pass
from zerofx.passes.memory.fetch_params import fetch_params_pass
from zerofx.passes.zero.gather_into_buffers import gather_into_buffers_pass
from zerofx.passes.zero.grad_sync import build_grad_sync
from zerofx.passes.memory.offload_grads import offload_grads_pass
from zerofx.passes.plan import ScheduleOptions
from zerofx.passes.memory import plan_recompute as recompute_module
from zerofx.passes.plan.offload import ParamOffloadPlan
from zerofx.passes.plan.recompute import RecomputedActivation, RecomputeMode, RecomputePlan
from zerofx.passes.memory.plan_recompute import plan_recompute, recompute_activations_pass, recompute_candidates
from zerofx.passes.zero.plan_shard_groups import estimate_compute_s, plan_auto_shard_group_size, prefetch_from_profile
from zerofx.passes.plan.tiling import TilingOptions, TilingPlan
from zerofx.passes.tiling.plan_tiling import plan_tiling
from zerofx.passes.zero.reduce_scatter_all_to_all import reduce_scatter_by_all_to_all_pass
from zerofx.passes.zero.schedule_overlap import prefetch_gathers_pass, sink_reduce_waits_pass
from zerofx.passes.sequence.canonical_attention import canonicalize_attention_pass
from zerofx.passes.sequence.canonical_fft import canonicalize_fft_conv_pass
from zerofx.passes.plan.sequence import SequenceParallelPlan, SequenceParallelSpec
from zerofx.passes.sequence.sequence_parallel import plan_sequence_parallel, sequence_parallel_pass
from zerofx.passes.tiling.tile_forward import tile_forward_pass
from zerofx.passes.zero.tile_weights import tile_weights_pass

log = logging.getLogger("zerofx.compiler.pipeline")

STAGES = ("capture", "pre_autograd", "autograd", "plan", "joint", "partition", "graph", "sync")

Pass = Callable[[fx.GraphModule], fx.GraphModule]
Result = TypeVar("Result")
Candidate = TypeVar("Candidate", bound=Planned)
# A candidate of the plan stage's searches from a captured step and a plan (``zerofx.Program``,
# bound to its group names by zerofx/compiler/program.py).
MakeCandidate = Callable[[CapturedStep, Plan], Candidate]


# ----------------------------------------------------------------------------- the runner
def run_stage(stage: str, fn: Callable[..., Result], *args: Any, done: Sequence[str] = (), **kwargs: Any) -> Result:
    """Run stage ``stage`` of the spine: ``fn(*args, **kwargs)``, timed. A ``ZeroFXError`` (bad
    input, named already) passes through; any other failure becomes ``CompileStageError``
    naming the stage and the stages ``done`` before it."""
    assert stage in STAGES, f"{stage!r} is not a stage of the spine {STAGES}"
    start = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except ZeroFXError:
        raise
    except Exception as exc:
        raise CompileStageError(f"compile stage {stage} failed (after {list(done) or 'no stages'}): {type(exc).__name__}: {exc}") from exc
    log.debug("stage %s: %.3fs", stage, time.perf_counter() - start)
    return result


def run_passes(gm: fx.GraphModule, passes: Sequence[tuple[str, Pass]], *, disabled: Sequence[str] = ()) -> fx.GraphModule:
    """Apply ``passes`` in order: check each returns a linted GraphModule, log its time and the
    change in op count. A ``ZeroFXError`` passes through; any other failure becomes
    ``CompileStageError`` naming the pass and the passes that already ran."""
    done: list[str] = []
    for name, fn in passes:
        if name in disabled:
            continue
        before = len(gm.graph.nodes)
        start = time.perf_counter()
        try:
            result = fn(gm)
        except ZeroFXError:
            raise
        except Exception as exc:
            raise CompileStageError(f"pass {name} failed (after {done or 'no passes'}): {exc}") from exc
        assert isinstance(result, fx.GraphModule), f"pass {name} returned {type(result).__name__}, not a GraphModule"
        result.graph.lint()
        log.debug("%s: %.3fs, %+d nodes", name, time.perf_counter() - start, len(result.graph.nodes) - before)
        gm = result
        done.append(name)
    return gm


# ----------------------------------------------------------------------------- the pass lists
def canonical_passes() -> list[tuple[str, Pass]]:
    """Pre-autograd, first, with sequence parallelism or tiling: one form for each computation the
    sequence-parallel planner and tiling's planner recognize (NOTE [Attention written out is SDPA]
    in passes/sequence/canonical_attention.py, NOTE [FFT convolutions up to scaling] in
    passes/sequence/canonical_fft.py). Both planners read the canonical forward, so a model
    whose attention is written out is sharded and tiled alike (``zerofx plan --solve seq_len``
    answers for what tiling applies to), and a tiled step runs its attention as one SDPA even
    where nothing is tiled."""
    return [("canonicalize_attention_pass", canonicalize_attention_pass), ("canonicalize_fft_conv_pass", canonicalize_fft_conv_pass)]


def sequence_passes(plan: SequenceParallelPlan) -> list[tuple[str, Pass]]:
    """Pre-autograd, first: the forward rewritten to run this rank's slice of the sequence
    (NOTE [Sequence parallelism as a rewrite] in passes/sequence/sequence_parallel.py)."""
    return [("sequence_parallel_pass", functools.partial(sequence_parallel_pass, plan=plan))]


def tiling_passes(plan: TilingPlan) -> list[tuple[str, Pass]]:
    """Pre-autograd, second: the forward tiled along the sequence (NOTE [Tiling before autograd])."""
    return [("tile_forward_pass", functools.partial(tile_forward_pass, plan=plan))]


def joint_passes(plan: Plan, *, group_name: str, replicate_group_name: str | None = None) -> list[tuple[str, Pass]]:
    """The rewrites applied to the captured joint graph, in order. ``group_name`` is the shard
    group's (the world's when sharding is flat), ``replicate_group_name`` the group across shard
    groups (NOTE [Shard groups of consecutive ranks])."""
    return [
        ("recompute_activations_pass", functools.partial(recompute_activations_pass, plan=plan.recompute)),
        ("tile_weights_pass", functools.partial(tile_weights_pass, plan=plan, group_name=group_name)),
        ("shard_params_pass", functools.partial(shard_params_pass, plan=plan, group_name=group_name)),
        ("reduce_grads_pass", functools.partial(reduce_grads_pass, plan=plan, group_name=group_name,
                                                replicate_group_name=replicate_group_name)),
    ]


def graph_passes(plan: Plan, *, backward: bool = False) -> list[tuple[str, Pass]]:
    """The rewrites applied to each partitioned forward and backward graph, in order. The
    fetches of offloaded shards go in last: they follow the gathers wherever prefetch put them.
    With ``plan.offload_grads`` the backward hands each reduced shard off right after its
    bucket's wait, wherever ``sink_reduce_waits_pass`` put it."""
    passes: list[tuple[str, Pass]] = [
        ("prefetch_gathers_pass", functools.partial(prefetch_gathers_pass, plan=plan)),
        ("sink_reduce_waits_pass", functools.partial(sink_reduce_waits_pass, plan=plan)),
    ]
    if plan.param_offload is not None:
        passes.append(("fetch_params_pass", functools.partial(fetch_params_pass, plan=plan.param_offload)))
    if backward and plan.offload_grads:
        passes.append(("offload_grads_pass", functools.partial(offload_grads_pass, plan=plan)))
    return passes + collective_passes(plan)


def collective_passes(plan: Plan) -> list[tuple[str, Pass]]:
    """The rewrites of how collectives are issued, last on every lowered graph: all-gathers into
    buffers (NOTE [gloo's completion race]) and, where the plan says, reduce-scatters as
    all-to-alls (NOTE [gloo's reduce-scatter as an all-to-all])."""
    passes: list[tuple[str, Pass]] = [("gather_into_buffers_pass", gather_into_buffers_pass)]
    if plan.reduce_scatter_by_all_to_all:
        passes.append(("reduce_scatter_by_all_to_all_pass", reduce_scatter_by_all_to_all_pass))
    return passes


# ----------------------------------------------------------------------------- stages 1-3
class StepCapture:
    """Stages capture, pre_autograd and autograd for one model call, repeatable with other
    tiling options: ``capture(tiling)`` is the ``CapturedStep``.

    NOTE [One forward record per capture search]
    ``zerofx.tiling.enabled: "auto"`` captures the step with several tiling options (NOTE
    [Tiling checked against the memory timeline] in zerofx/planner/fit.py). What comes before tiling
    is the same for all of them: the fake inputs, the forward recorded before autograd, its
    sequence-parallel rewrite. It is made once, on the first call that needs it, and each call
    tiles a copy (``tile_forward_pass`` rewrites in place). The tiling plan is a function of that
    forward and the options alone, so ``tiling_plan(options)`` answers without a capture, and
    callers can skip options whose plan they have already captured.
    """

    def __init__(self, model: nn.Module, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None = None, *,
                 loss_fn: LossFn | None = None, param_infos: Sequence[TensorInfo] | None = None,
                 device: torch.device | str | None = None, compute_dtype: torch.dtype | None = None,
                 sequence_parallel: SequenceParallelSpec | None = None, disabled: Sequence[str] = ()) -> None:
        self.sequence_parallel = sequence_parallel if sequence_parallel is not None and sequence_parallel.size > 1 else None
        self.tracer = StepTracer(model, example_args, example_kwargs, loss_fn=loss_fn, param_infos=param_infos, device=device,
                                 compute_dtype=compute_dtype, adapt_scans=self.sequence_parallel is not None)
        self.disabled = tuple(disabled)
        self._record: fx.GraphModule | None = None
        self._forward: tuple[fx.GraphModule, SequenceParallelPlan | None] | None = None

    def forward_record(self) -> fx.GraphModule:
        """Stage capture: the step recorded before autograd, as the model spells it; made once.
        Read it before ``sequence_forward``, whose rewrite takes this graph and changes it."""
        if self._record is None:
            self._record = run_stage("capture", self.tracer.record)
        return self._record

    def sequence_forward(self) -> tuple[fx.GraphModule, SequenceParallelPlan | None]:
        """Stage capture and the first rewrites of pre_autograd: the recorded forward in its
        canonical forms (``canonical_passes``), rewritten for sequence parallelism when asked, and
        its plan; made once. Autograd derives the
        backward of the rewritten forward, the exchanges included.

        NOTE [Tiling a sequence-parallel forward]
        With ``tiling`` too, the tiling planner reads the sequence-parallel forward, not the whole
        one: each rank's activations are those of its T/S positions, so the plan is made for that
        length (``plan_tiling(..., seq_len=T/S)``) and tiles the rank's own slice. The rewrite cuts
        every source of the axis with one ``index_select`` by the rank's positions; the sequence
        analysis takes such a cut of T/S positions as a source and a gather by token-wise positions
        as token-wise (NOTE [Sequence dimension propagation] in passes/sequence/seq_regions.py), so regions
        start at the cut inputs. The all-to-alls and the ring op read positions across the slice and
        are barriers, as attention is. The rewrite marks each attention's output, the rank's slice
        again (``meta.SEQUENCE_DIM`` through ``_compat.annotate``), and the analysis starts the
        next region there, as it does after an SDPA. Ulysses' attention (the whole sequence for H/S
        heads) is tiled like any SDPA, the ring op is already blockwise, and in fp32 the loss is one
        summed ``cross_entropy`` of the rank's positions, which tiling chunks as it does without
        sequence parallelism (in bf16 and fp16 it is per-token losses summed in fp32, left whole).
        """
        if self._forward is None:
            # One form of each computation for both planners (canonical_passes).
            forward = run_stage("pre_autograd", run_passes, self.forward_record(), canonical_passes(), disabled=self.disabled,
                                done=("capture",))
            sp_plan = None
            if self.sequence_parallel is not None:
                try:
                    sp_plan = plan_sequence_parallel(forward, self.sequence_parallel)
                except SequenceParallelError as exc:
                    raise CaptureError(f"cannot run {self.tracer.model_name} sequence-parallel: {exc}") from exc
                forward = run_stage("pre_autograd", run_passes, forward, sequence_passes(sp_plan), disabled=self.disabled,
                                    done=("capture",))
            self._forward = forward, sp_plan
        return self._forward

    def tiling_plan(self, tiling: TilingOptions | None) -> TilingPlan | None:
        """The tiling plan a capture with ``tiling`` would use, without capturing."""
        if tiling is None or tiling.enabled is False:
            return None
        forward, sp_plan = self.sequence_forward()
        return plan_tiling(forward, tiling, seq_len=None if sp_plan is None else sp_plan.local_len)

    def __call__(self, tiling: TilingOptions | None = None) -> CapturedStep:
        """The joint graph, with the forward tiled by ``tiling`` (None: not tiled).

        NOTE [Tiling before autograd]
        The step is recorded before autograd (``make_fx(pre_dispatch=True)``, where
        ``aten.linear``, SDPA and ``cross_entropy_loss`` are still whole), ``plan_tiling``
        decides and ``tile_forward_pass`` rewrites it. AOTAutograd then traces the rewritten
        graph through an ``fx.Interpreter`` under ``preserve_node_meta``, so the backward is
        derived by autograd, not written by hand, and the per-chunk ``recompute`` tags reach
        the joint graph."""
        tiling_plan = self.tiling_plan(tiling)
        if self.sequence_parallel is None and tiling_plan is None:
            return run_stage("autograd", self.tracer.differentiate)
        forward, sp_plan = self.sequence_forward()
        if tiling_plan is not None and tiling_plan.ops:
            forward = run_stage("pre_autograd", run_passes, meta.clone_graph_module(forward), tiling_passes(tiling_plan),
                                disabled=self.disabled, done=("capture",))
        captured = run_stage("autograd", self.tracer.differentiate, forward, done=("capture", "pre_autograd"))
        return replace(captured, tiling=tiling_plan, sequence_parallel=sp_plan)


def capture_step(model: nn.Module, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None = None, *,
                 tiling: TilingOptions | None = None, **options: Any) -> CapturedStep:
    """Trace ``model``'s forward, loss and backward on fake tensors into one joint graph (stages
    capture to autograd of NOTE [The compile spine]).

    The parameters' shapes, dtypes and ``requires_grad`` come from ``param_infos`` when given
    (the engine passes them once it has taken the parameters' memory), else from the model.
    With ``compute_dtype`` (mixed precision), floating parameters and buffers are traced in it.
    Fake tensors live on ``device`` (default: the parameters' device, CPU for meta).
    With ``tiling`` (see NOTE [Tiling before autograd]), the forward is first recorded before
    autograd, planned and tiled along the sequence, and the joint graph is traced from that.
    With ``sequence_parallel`` (size > 1) the forward is recorded before autograd the same way
    and rewritten to run this rank's slice of the sequence (NOTE [Sequence parallelism as a
    rewrite] in passes/sequence/sequence_parallel.py).

    ``options`` are ``StepCapture``'s: ``loss_fn``, ``param_infos``, ``device``,
    ``compute_dtype``, ``sequence_parallel``.
    """
    return StepCapture(model, example_args, example_kwargs, **options)(tiling)


# ----------------------------------------------------------------------------- stage 4: plan
def plan_step(captured: CapturedStep, cfg: ZeroConfig, compile_opts: CompileOptions, make: MakeCandidate[Candidate], *,
              param_offload: ParamOffloadPlan | None = None, choose_shard_group_size: bool = True) -> Candidate:
    """Stage plan: the planners in order, for ``compile_opts.world_size`` ranks, each reading the
    captured joint graph and changing nothing:

    1. ``plan_auto_shard_group_size`` (``zerofx.shard_group_size: "auto"``, when
       ``choose_shard_group_size``: a program for real process groups keeps the K its groups were
       built with; NOTE [Hierarchical sharding cost]);
    2. ``prefetch_from_profile`` (an explicit ``zerofx.profile`` at stage 3 and no prefetch distance given);
    3. ``plan_sharding``: placement, buckets, prefetch, estimates; the captured step's tiling and
       sequence-parallel plans and the offload plans joined into the one ``Plan``;
    4. ``fit_prefetch`` (``zerofx.memory_budget``): the prefetch distance lowered until the
       lowered graphs' peak fits (NOTE [Prefetch under a memory budget] in zerofx/planner/fit.py);
    5. ``fit_recompute`` (``zerofx.recompute``): the saved activations recomputed in backward, the
       fewest that fit the budget under "auto" (NOTE [Selective activation recompute] in
       passes/memory/plan_recompute.py).
    """
    return run_stage("plan", _plan_step, captured, cfg, compile_opts, make, param_offload=param_offload,
                     choose_shard_group_size=choose_shard_group_size, done=("capture", "pre_autograd", "autograd"))


def _plan_step(captured: CapturedStep, cfg: ZeroConfig, compile_opts: CompileOptions, make: MakeCandidate[Candidate], *,
               param_offload: ParamOffloadPlan | None, choose_shard_group_size: bool) -> Candidate:
    world_size, stage, optimizer, options = compile_opts.world_size, compile_opts.stage, compile_opts.optimizer, compile_opts.schedule
    comm, device = load_profile(cfg.profile)  # zerofx.profile: buckets, prefetch and K are sized for it
    shard_group_size, decision = compile_opts.shard_group_size, compile_opts.shard_group_decision
    options, compiled_note = _budget_beside_inductor(cfg, options, device)
    if compile_opts.choose_shard_group_size and choose_shard_group_size:
        shard_group_size, decision = plan_auto_shard_group_size(captured.joint, world_size=world_size, stage=stage, optimizer=optimizer,
                                                                options=options, comm=comm, device=device)
    if cfg.profile_is_explicit and options.prefetch_distance is None and stage is ZeroStage.THREE:
        planned = plan_sharding(captured.joint, world_size=world_size, stage=stage, optimizer=optimizer, options=options, comm=comm,
                                shard_group_size=shard_group_size)
        options = replace(options, prefetch_distance=prefetch_from_profile(planned, compute_s=estimate_compute_s(captured.joint, device),
                                                                           comm=comm))

    def plan_with(opts: ScheduleOptions, recompute: RecomputePlan | None = None) -> Candidate:
        plan = plan_sharding(captured.joint, world_size=world_size, stage=stage, optimizer=optimizer, options=opts,
                             shard_group_size=shard_group_size, comm=comm)
        if decision is not None:
            plan = replace(plan, decisions=(decision, *plan.decisions))
        if compiled_note is not None:
            plan = replace(plan, decisions=(*plan.decisions, compiled_note))
        if captured.tiling is not None:
            plan = replace(plan, tiling=captured.tiling)
        if captured.sequence_parallel is not None:
            plan = replace(plan, decisions=(*plan.decisions, *captured.sequence_parallel.decisions),
                           sequence_parallel=captured.sequence_parallel)
        plan = replace(with_offloaded_grads(plan, cfg), param_offload=param_offload, recompute=recompute)
        return make(captured, plan)

    chosen = fit_prefetch(plan_with(options), lambda d: plan_with(replace(options, prefetch_distance=d)), options.memory_budget_bytes)
    mode = RecomputeMode(options.recompute)
    if mode is RecomputeMode.OFF:
        return chosen
    # Recompute is planned at the prefetch distance the budget left (NOTE [Selective activation recompute]).
    fitted = replace(options, prefetch_distance=chosen.plan.prefetch_distance)
    candidates, saved_bytes = recompute_candidates_of(captured, device, fused=cfg.graph_compiler is GraphCompiler.INDUCTOR)
    return fit_recompute(chosen, lambda count: plan_with(fitted, plan_recompute(candidates, count, mode=mode, saved_bytes=saved_bytes)),
                         len(candidates), mode=mode, budget_bytes=options.memory_budget_bytes, freed_bytes=[c.bytes for c in candidates])


# NOTE [Recompute candidates once per capture]
# The recompute candidates are a function of the captured joint graph, the device profile and
# whether Inductor runs the graphs; finding them partitions the joint graph once per round
# (NOTE [Recompute in rounds] in passes/memory/plan_recompute.py). A plan never changes the captured
# joint (NOTE [Planning again from one capture] in zerofx/compiler/program.py), so every plan of one capture with recompute
# "auto" or on (``Program.replan``, and the whole-job search's candidates of one capture group)
# shares them. On the 100m DNA LM at 8k tokens, 4 ranks, tiled, partitioning took about three
# quarters of the samples of a recomputing candidate's planning (py-spy), finding the candidates
# over half, and one capture group of the search plans up to a dozen such candidates.
_RECOMPUTE_CANDIDATES: weakref.WeakKeyDictionary[fx.GraphModule, dict[tuple[DeviceSpec, bool, int], tuple[tuple[RecomputedActivation, ...], int]]] = \
    weakref.WeakKeyDictionary()


def recompute_candidates_of(captured: CapturedStep, device: DeviceSpec, *, fused: bool) -> tuple[list[RecomputedActivation], int]:
    """``recompute_candidates`` of ``captured``'s joint graph, found once per capture, device
    profile, ``fused`` and number of rounds (NOTE [Recompute candidates once per capture])."""
    found = _RECOMPUTE_CANDIDATES.setdefault(captured.joint, {})
    rounds = recompute_module.RECOMPUTE_ROUNDS  # read at the call, as recompute_candidates does
    key = (device, fused, rounds)
    if key not in found:
        candidates, saved_bytes = recompute_candidates(captured.joint, device, fused=fused, rounds=rounds)
        found[key] = (tuple(candidates), saved_bytes)
    candidates, saved_bytes = found[key]
    return list(candidates), saved_bytes


def _budget_beside_inductor(cfg: ZeroConfig, options: ScheduleOptions, device: DeviceSpec) -> tuple[ScheduleOptions, str | None]:
    """``options`` with the memory budget less what Inductor keeps resident, where the graphs are
    compiled by Inductor and the profile measured it (NOTE [What Inductor keeps resident] in
    cost_models/memory.py); and the plan's note saying so, or None."""
    resident = inductor_resident_bytes(device) if cfg.graph_compiler is GraphCompiler.INDUCTOR else 0.0
    if not resident or options.memory_budget_bytes is None:
        return options, None
    budget = options.memory_budget_bytes - resident
    note = (f"memory budget {format_bytes(budget)} for the step: {format_bytes(options.memory_budget_bytes)} less "
            f"{format_bytes(resident)} Inductor keeps resident (zerofx.compile \"inductor\", profile {device.name})")
    return replace(options, memory_budget_bytes=budget), note


def with_offloaded_grads(plan: Plan, cfg: ZeroConfig) -> Plan:
    """``plan`` with its gradient estimate taken off the device when ``zerofx.offload_gradients``
    is on (NOTE [What each stage holds, fp32 training, Adam] in cost_models/memory.py): no
    gradient buffer; the reduced buckets in flight are in the memory timeline."""
    if cfg.grad_offload is None:
        return plan
    plan = replace(plan, offload_grads=True)
    if plan.stage < ZeroStage.TWO:
        return plan
    return replace(plan, estimates=device_model_state_bytes(plan.estimates, stage=int(plan.stage), grads_offloaded=True))


def capture_and_plan(capture: StepCapture, cfg: ZeroConfig, compile_opts: CompileOptions, make: MakeCandidate[Candidate], *,
                     param_offload: ParamOffloadPlan | None = None, choose_shard_group_size: bool = True) -> Candidate:
    """Stages capture to plan: ``capture(tiling_options)``, then ``plan_step``; with
    ``zerofx.tiling.enabled: auto`` the tiling is checked against the memory timeline (NOTE
    [Tiling checked against the memory timeline] in zerofx/planner/fit.py), which may
    capture again: once per tiling plan, the options whose plan is one already built getting that
    candidate (NOTE [One forward record per capture search])."""
    options = compile_opts.tiling
    capture_s = 0.0
    built: dict[TilingPlan | None, Candidate] = {}

    def build(opts: TilingOptions | None) -> Candidate:
        nonlocal capture_s
        start = time.perf_counter()
        tiling_plan = capture.tiling_plan(opts)
        if tiling_plan not in built:
            captured = capture(opts)
            capture_s += time.perf_counter() - start
            built[tiling_plan] = plan_step(captured, cfg, compile_opts, make, param_offload=param_offload,
                                           choose_shard_group_size=choose_shard_group_size)
        else:
            capture_s += time.perf_counter() - start
        return built[tiling_plan]

    start = time.perf_counter()
    chosen = fit_tiling(build(options), build, options)
    # Planning is everything else, the searches included (they may lower candidates); the chosen
    # candidate's own lowering, when a search did it, stays under "lower".
    total_s = time.perf_counter() - start
    chosen.setup_times.update(capture=capture_s, plan=total_s - capture_s - chosen.setup_times.get("lower", 0.0))
    return chosen


# ----------------------------------------------------------------------------- stages 5-8
def lower(joint: fx.GraphModule, plan: Plan, *, group_name: str, disabled: Sequence[str] = (),
          replicate_group_name: str | None = None) -> dict[str, fx.GraphModule]:
    """Stages joint, partition, graph and sync: rewrite a copy of the captured joint graph for
    ``plan`` (its shard placement, offload and gradient hand-off included) and split it into
    the graph modules one rank runs. ``joint`` itself is left alone."""
    rewritten = run_stage("joint", run_passes, meta.clone_graph_module(joint),
                          joint_passes(plan, group_name=group_name, replicate_group_name=replicate_group_name), disabled=disabled)
    with _compat.lazy_graph_modules():  # NOTE [Code written on first use] in passes/_compat.py
        forward, backward = run_stage("partition", partition_joint, rewritten, done=("joint",))
    done = ("joint", "partition")
    modules = {
        "forward": run_stage("graph", run_passes, forward, graph_passes(plan), disabled=disabled, done=done),
        "backward": run_stage("graph", run_passes, backward, graph_passes(plan, backward=True), disabled=disabled, done=done),
    }
    modules.update(run_stage("sync", sync_graphs, plan, group_name=group_name, replicate_group_name=replicate_group_name,
                             disabled=disabled, done=(*done, "graph")))
    return modules


def sync_graphs(plan: Plan, *, group_name: str, replicate_group_name: str | None = None,
                disabled: Sequence[str] = ()) -> dict[str, fx.GraphModule]:
    """The graphs built from the plan alone: ``grad_sync`` (stage 1: NOTE [Stages 1 and 2 move 2
    Psi]) and ``param_sync`` (stages 1 and 2), where the stage has them."""
    modules = {}
    grad_sync = build_grad_sync(plan, group_name=group_name, replicate_group_name=replicate_group_name)
    if grad_sync is not None:
        modules["grad_sync"] = run_passes(grad_sync, collective_passes(plan), disabled=disabled)
    param_sync = build_param_sync(plan, group_name=group_name)
    if param_sync is not None:
        modules["param_sync"] = run_passes(param_sync, collective_passes(plan), disabled=disabled)
    return modules
