"""The runtime: runs one rank's rewritten graphs inside a real process group.

``zerofx.initialize`` returns an ``Engine`` with DeepSpeed's API: ``engine(...)`` runs the
forward graph and returns the loss, ``engine.backward(loss)`` runs the backward graph,
``engine.step()`` runs the optimizer on this rank's shard. The same code runs gloo on CPU and
NCCL on CUDA: the device is the model's.

Who does what: ``EngineStorage`` in ``zerofx.runtime.engine_storage`` (NOTE [What the engine
holds]) holds this rank's parameters, buffers, gradients and masters; the engine runs the graphs
and the collectives between them over it. ``OptimizerStep`` in ``zerofx.runtime.optimizer_step``
does a step's arithmetic (accumulation, loss scale, overflow check, clipping, schedule, the
optimizer update). The programs, one per input signature, are kept by ``ProgramCache`` in
``zerofx.runtime.program_cache``. The checks that ranks agree before their first collective, and
the one build per job rank 0 sends the others, are ``zerofx.runtime.rank_agreement``; fp16 loss
scaling is ``zerofx.runtime.loss_scaling``. Checkpoints read and restore the run through the
``TrainState`` the engine hands them (``zerofx.runtime.train_state``), never the engine itself.

NOTE [Who owns a collective's buffers]
Every buffer handed to another thread, or to a collective that completes later, has one owner
until a named point, and nothing writes into it or frees it before then:
- A graph's collective (``_c10d_functional``) takes its input and returns its output: a fresh
  tensor, or for an all-gather the ``new_empty`` buffer allocated right before it, which
  nothing else uses. The backend's work object holds both (gloo's reduce-scatter even clones
  the input when it is issued, on the calling thread) until ``wait_tensor``; the graph reads
  the output only after that wait, and the graphs hold no other in-place or ``out=`` op
  (``tests/test_core_passes.py`` checks the lowered graphs), so nothing the graph frees or
  reuses can be a buffer in flight.
- The engine's own flats (shards, gradient buffers, masters) are written only between graphs:
  ``backward`` adds the graph's outputs once the graph has returned (every wait done), the
  optimizer steps after it, and ``param_sync`` copies each gathered bucket after its wait;
  ``grad_sync`` (stage 1) copies each reduced shard into the gradient buffer that fed its
  reduce-scatter, after that collective's waits.
- Offload: an NVMe transfer's host buffer belongs to the store's I/O thread from ``submit``
  until its future is taken (``acquire``, ``drain``); the delayed update's snapshot belongs to
  the update thread until ``finish`` (NOTE [One-step delayed update] in zerofx.runtime.offload); a
  parameter shard read ahead belongs to the store until ``fetch`` hands the graph a copy;
  an offloaded gradient shard belongs to the gradient store once the backward graph's hand-off
  op has passed it (the store copies what it keeps, so the graph may reuse that memory), and
  with the delayed update the generation being read belongs to the update thread until
  ``finish`` (NOTE [Offloaded gradients] in zerofx.runtime.offload.grads).
- Inside torch, gloo's two worker threads share one unguarded string (the name of the last
  completed collective); NOTE [gloo's completion race] in passes/zero/gather_into_buffers.py says
  why every collective zerofx issues has a name short enough to keep that string off the heap.
"""

from __future__ import annotations

import sys
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from zerofx.passes import ParamPlacement, ZeroStage, _compat
from zerofx.passes.meta import is_wait
from zerofx.passes.memory.fetch_params import fetch_order
from zerofx.passes.memory.offload_grads import grad_sink
from zerofx.passes.zero.plan_sharding import place_param
from zerofx.compiler.capture import CapturedStep, LossFn, TensorInfo, cast_info, flatten_call
from zerofx.compiler.pipeline import capture_step
from zerofx.planner.autoplan import example_shape, resize_inputs, search_space
from zerofx.planner.autoplan import search as autoplan_search
from zerofx.config import ZeroConfig, parse_config
from zerofx.config.compile_options import compile_options
from zerofx.common.errors import (
    CollectiveTimeoutError,
    ConfigError,
    EngineStateError,
    MissingLossError,
    ZeroFXError,
)
from zerofx.runtime.checkpoint import load_checkpoint, save_checkpoint
from zerofx.runtime.engine_storage import EngineStorage
from zerofx.runtime.loss_scaling import LossScaler
from zerofx.compiler.materialize import InitFn, check_all_meta_or_none
from zerofx.runtime.monitors import Monitor, check_monitor_packages, samples_and_tokens
from zerofx.runtime.offload import OffloadedOptimizer
from zerofx.runtime import rank_agreement
from zerofx.runtime.optimizer_step import OptimizerStep
from zerofx.runtime.program_cache import ProgramCache, misplaced_input
from zerofx.runtime.rank_groups import sequence_group, shard_group_names, shard_groups
from zerofx.compiler.program import (
    PLANNING_REPLICATE_GROUP,
    Program,
    check_example_inputs,
    plan_program,
    resolve,
)
from zerofx.runtime.schedulers import lr_at
from zerofx.runtime.train_state import StepCounters, TrainState


class WaitTimer:
    """Runs graph modules through ``torch.fx.Interpreter`` and adds up the wall time spent in
    ``wait_tensor`` nodes: communication the step was blocked on (exposed), per graph.

    It costs some Python overhead per node, so compare runs that both use it.
    """

    def __init__(self) -> None:
        self.blocked_s: dict[str, float] = {}

    def run(self, name: str, gm: fx.GraphModule, args_list: list[torch.Tensor]) -> Any:
        timer = self

        class _Timed(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                if not is_wait(n):
                    return super().run_node(n)
                start = time.perf_counter()
                out = super().run_node(n)
                timer.blocked_s[name] = timer.blocked_s.get(name, 0.0) + time.perf_counter() - start
                return out

        return _Timed(gm).boxed_run(args_list)  # empties args_list, as the engine's graphs do

    def reset(self) -> dict[str, float]:
        out, self.blocked_s = self.blocked_s, {}
        return out


class ScheduleEndWarning(UserWarning):
    """Training went past the learning-rate scheduler's ``total_num_steps``."""


def _counter(name: str, doc: str) -> property:
    """A DeepSpeed-shaped engine attribute kept in the engine's ``StepCounters``."""
    return property(lambda self: getattr(self.counters, name), lambda self, value: setattr(self.counters, name, value), doc=doc)


class Engine:
    """One rank's view of a ZeRO-sharded training run. Build it with ``zerofx.initialize``.

    It sequences each call and hands the work to its parts: a ``ProgramCache`` compiles one
    program per input signature, ``storage`` (an ``EngineStorage``) holds this rank's parameters,
    buffers and gradients, an ``OptimizerStep`` does a step's arithmetic and owns the optimizer,
    and checkpoints read a ``TrainState`` (``train_state()``)."""

    global_steps = _counter("global_steps", "Optimizer steps taken, skipped ones included.")
    micro_steps = _counter("micro_steps", "step() calls so far: micro-batches, across accumulation boundaries.")
    skipped_steps = _counter("skipped_steps", "fp16 steps skipped because a gradient overflowed.")
    global_samples = _counter("global_samples", "Sequences trained on by all ranks (DeepSpeed's global_samples).")

    def __init__(
        self,
        model: nn.Module,
        cfg: ZeroConfig,
        example_args: tuple[Any, ...],
        example_kwargs: Mapping[str, Any] | None,
        *,
        loss_fn: LossFn | None = None,
        group: dist.ProcessGroup | None = None,
        init_fn: InitFn | None = None,
        init_seed: int = 0,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ZeroFXError(
                "zerofx.initialize needs an initialized torch.distributed process group (torchrun, or "
                "dist.init_process_group in each spawned process); to plan without one, use zerofx.compile"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if cfg.world_size is not None and cfg.world_size != self.world_size:
            raise ZeroFXError(
                f"world_size={cfg.world_size} differs from the process group's world size {self.world_size}; "
                f"accepted: {self.world_size} or leave it out"
            )
        # A model built on the meta device is initialized by the storage, shard by shard: NOTE
        # [Meta-device models] in zerofx/runtime/engine_storage.py.
        self._from_meta = check_all_meta_or_none(model)
        if not self._from_meta and (init_fn is not None or init_seed != 0):
            raise ZeroFXError(
                "init_fn= and init_seed= apply to a model built on the meta device; this model is materialized "
                "(initialize it yourself, e.g. zerofx.init_weights_(model, seed=...))"
            )
        self.model = model
        self.cfg = cfg
        self.stage = ZeroStage(cfg.stage)
        self.loss_fn = loss_fn
        self.group_name = self.group.group_name
        # On every rank and before any collective, so a missing package fails every rank alike
        # (NOTE [Monitors: rank 0 writes, every rank joins the norm] in zerofx/runtime/monitors.py).
        check_monitor_packages(cfg.monitors)
        # Every setting that changes the collective sequence or the numerics must agree across
        # ranks before anything else runs (NOTE [Ranks agree before any collective]).
        rank_agreement.check_same_config(cfg, model, self.group, self.world_size)
        self.collective_timeout_s = cfg.collective_timeout_s
        _compat.set_group_timeout(self.group, timedelta(seconds=self.collective_timeout_s))
        # The config's options for this world size, checked against it (zerofx.config.compile_options).
        self.compile_options = compile_options(cfg, self.world_size, backend=dist.get_backend(self.group))
        # NOTE [Sequence groups] (``zerofx.runtime.rank_groups``): the name its all-to-alls run over.
        self.sequence_parallel = self.compile_options.sequence_parallel
        self._sequence_group = sequence_group(self.compile_options, self.group, timedelta(seconds=self.collective_timeout_s))
        _check_has_trainable_params(model)
        self.device = _meta_init_device(self.group) if self._from_meta else next(model.parameters()).device
        self.compute_dtype = cfg.compute_dtype
        infos = [TensorInfo(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()]
        if self.compute_dtype is not None:
            infos = [cast_info(i, self.compute_dtype) for i in infos]
        self.param_infos = tuple(infos)
        # NOTE [Shard groups of consecutive ranks] (``zerofx.runtime.rank_groups``): the shard group's name
        # goes into the graphs' gathers and reduce-scatters, the replicate group's into the
        # all-reduces across groups. Flat: the shard group is the engine's group.
        self.shard_group_size, self.shard_group_decision = self._choose_shard_group_size(cfg, example_args, example_kwargs)
        if cfg.shard_group_size == "auto":  # the storage is laid out for this K: every later plan keeps it
            cfg = self.cfg = replace(cfg, shard_group_size=self.shard_group_size)
            self.compile_options = compile_options(cfg, self.world_size, backend=dist.get_backend(self.group))
        self.shard_group, self.replicate_group = shard_groups(self.group, self.world_size, self.shard_group_size,
                                                               timedelta(seconds=self.collective_timeout_s))
        k, n = self.shard_group_size, self.world_size
        if k == n:
            self.group_name, self.replicate_group_name = self.group.group_name, PLANNING_REPLICATE_GROUP
        else:
            self.group_name, self.replicate_group_name = shard_group_names(k, n)
        self.shard_index = self.rank % self.shard_group_size
        self.placements: dict[str, ParamPlacement] = {
            i.fqn: place_param(i.fqn, i.shape, i.dtype, i.requires_grad, self.world_size, self.shard_group_size) for i in self.param_infos
        }
        owner_of = {id(p): fqn for fqn, p in model.named_parameters()}
        param_aliases = {name: owner_of[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
        self._state_keys = [
            (key, param_aliases.get(key)) for key in model.state_dict().keys()
        ]
        self.storage = EngineStorage(model, cfg, self.placements, group=self.group, device=self.device, from_meta=self._from_meta,
                                     init_fn=init_fn, init_seed=init_seed, shard_index=self.shard_index)
        self._scheduled: Program | None = None  # the program whose fetch order the store reads ahead along
        self.counters = StepCounters()
        self._optimizer_step = OptimizerStep(cfg, self.storage, self.counters, group=self.group,
                                             num_shard_groups=self.world_size // self.shard_group_size)
        # NOTE [Offload files live as long as the engine]
        # The NVMe files of offloaded state are scratch space, not a checkpoint: ``close()``, or the
        # engine's collection, or a clean interpreter exit, waits for the transfers in flight and
        # deletes them (``NvmeFiles.remove``). A killed process leaves them; the next run with the
        # same nvme_path overwrites them.
        self._closer = weakref.finalize(self, self.optimizer.close) if isinstance(self.optimizer, OffloadedOptimizer) else None
        self._last_loss: torch.Tensor | None = None
        self._programs = ProgramCache(model, cfg, loss_fn=loss_fn, param_infos=self.param_infos, device=self.device,
                                      compute_dtype=self.compute_dtype, compile_options=self.compile_options, group=self.group,
                                      rank=self.rank, world_size=self.world_size, timeout_s=self.collective_timeout_s,
                                      group_name=self.group_name, replicate_group_name=self.replicate_group_name,
                                      param_offload=self.storage.param_offload_plan, on_comm_failure=self._comm_failure)
        self._pending: tuple[Program, list[torch.Tensor], torch.Tensor] | None = None
        # NOTE [The engine's call order]
        # step() needs a backward() since the last step, and a second backward() needs a step()
        # in between (step runs every micro-step; it updates the parameters only at the
        # gradient-accumulation boundary). Out of order is an EngineStateError that changes nothing.
        self._backward_since_step = False
        self._step_samples = 0  # this step's sequences on this rank, added to global_samples at its end
        # Set to a WaitTimer to measure exposed communication (time blocked in waits).
        self.wait_timer: WaitTimer | None = None
        try:
            self._program_for(example_args, dict(example_kwargs or {}))
        except MissingLossError:
            pass  # the example may omit what the loss needs (e.g. labels); capture waits for the first call
        # DeepSpeed's tensorboard / csv_monitor / wandb: rank 0 writes each optimizer step's
        # metrics; built last, so a failed initialize leaves no files or wandb run behind.
        self.monitor: Monitor | None = Monitor(cfg.monitors, world_size=self.world_size) if cfg.monitors.enabled and self.rank == 0 else None

    def _choose_shard_group_size(self, cfg: ZeroConfig, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> tuple[int, str | None]:
        """K, and with ``"auto"`` the planner's decision line. The storage and the groups are laid
        out before the first program, so ``"auto"`` captures the example step once here and lets
        the planner choose from it; every rank captures the same step and chooses the same K."""
        if not self.compile_options.choose_shard_group_size:
            return self.compile_options.shard_group_size, self.compile_options.shard_group_decision
        try:
            captured = capture_step(self.model, args, dict(kwargs or {}), loss_fn=self.loss_fn, param_infos=self.param_infos,
                                    device=self.device, compute_dtype=self.compute_dtype, sequence_parallel=self.sequence_parallel)
        except MissingLossError:
            return self.world_size, (f"shard group size {self.world_size} (flat): zerofx.shard_group_size \"auto\" chooses from the "
                                     "captured step, and the example inputs give no loss")
        plan = plan_program(captured, cfg, self.compile_options).plan
        decision = next((d for d in plan.decisions if "shard group" in d), None)
        if decision is not None and self.rank == 0:
            print(f"[zerofx] decision: {decision}", flush=True)
        return plan.shard_group_size, decision

    # ----------------------------------------------------------------- the optimizer (zerofx.runtime.optimizer_step)
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over this rank's shards (an ``OffloadedOptimizer`` with offload)."""
        return self._optimizer_step.optimizer

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The fp16 loss scaler; None in fp32 and bf16."""
        return self._optimizer_step.loss_scaler

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._optimizer_step.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._optimizer_step.is_boundary()

    # ----------------------------------------------------------------- programs (zerofx.runtime.program_cache)
    def _program_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, misplaced: str | None = None) -> Program:
        """The cache's program for this call, with the parameter store reading ahead along it."""
        program = self._programs.program_for(args, kwargs, misplaced=misplaced)
        param_store, offload_plan = self.storage.param_store, self.storage.offload_plan
        if param_store is not None and program is not self._scheduled:
            # Every use of an offloaded shard in one step, in order: the store reads ahead along it.
            gms = program.graph_modules(self.rank)
            updates = [f for f in offload_plan.update_order if f in param_store] if offload_plan else []
            param_store.set_schedule(fetch_order(gms["forward"]) + fetch_order(gms["backward"]) + updates)
            self._scheduled = program
        return program

    @property
    def program(self) -> Program | None:
        """The most recently compiled program."""
        return self._programs.latest

    def graph_modules(self) -> dict[str, fx.GraphModule]:
        if self.program is None:
            raise ZeroFXError("nothing compiled yet: call the engine once first")
        return self.program.graph_modules(self.rank)

    # ----------------------------------------------------------------- training
    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run the forward graph on this rank's batch; return the loss (a scalar tensor). Every
        tensor argument must be on the engine's device (``ZeroFXError`` naming the one that is not)."""
        program = self._program_for(args, kwargs, misplaced=misplaced_input(args, kwargs, self.device))
        self._warn_past_schedule()
        captured: CapturedStep = program.captured
        inputs = flatten_call(captured, self.model, args, kwargs, self.loss_fn)
        if self._sequence_group is not None:
            rank_agreement.check_same_batch_in_group(inputs, rank=self.rank, sequence_group=self._sequence_group,
                                                     size=self.sequence_parallel.size, device=self.device)
        primals = [self.storage.param_input(p.fqn) for p in captured.params]
        primals += [self.storage.buffers[b.fqn] for b in captured.buffers]
        primals += inputs
        outputs = self._run(program, "forward", primals)
        loss = outputs[0]
        self._pending = (program, list(outputs[1:]), loss)
        self._last_loss = loss
        return loss

    forward = __call__

    _schedule_end_warned = False  # set on the instance by its first warning

    def _warn_past_schedule(self) -> None:
        """Warn once when the coming optimizer step is past the scheduler's ``total_num_steps``:
        from there on the learning rate stays at its final value."""
        schedule = self.cfg.scheduler
        total = None if schedule is None else schedule.total_num_steps
        if schedule is None or total is None or self.global_steps < total or self._schedule_end_warned:
            return
        self._schedule_end_warned = True
        final = lr_at(schedule, total, self._optimizer_step.base_lrs[0])
        warnings.warn(ScheduleEndWarning(
            f"optimizer step {self.global_steps + 1} is past the scheduler's total_num_steps {total}: lr stays at its final "
            f"value {final:.3g} from here on; raise scheduler.params.total_num_steps to decay over more steps"), stacklevel=3)

    def _run(self, program: Program, name: str, args_list: list[torch.Tensor]) -> Any:
        """Run graph ``name`` of ``program`` on ``args_list``, which it empties, freeing each input
        after its last use (NOTE [Boxed graphs] in zerofx/compiler/program.py): compiled per
        ``zerofx.compile``, or op by op under the WaitTimer when one is set (it times the FX
        graph's own wait nodes)."""
        try:
            if self.wait_timer is not None:
                return self.wait_timer.run(name, program.graph_modules(self.rank)[name], args_list)
            return program.run(self.rank, name, args_list, self.cfg.graph_compiler)
        except RuntimeError as exc:
            if isinstance(exc, ZeroFXError) or not rank_agreement.is_comm_failure(exc):
                raise
            raise self._comm_failure(f"the {name} graph, at {rank_agreement.failing_collective(exc)}", exc) from exc

    def _comm_failure(self, where: str, exc: BaseException) -> CollectiveTimeoutError:
        return rank_agreement.comm_failure(self.rank, self.collective_timeout_s, where, exc)

    @property
    def setup_times(self) -> dict[str, float]:
        """Seconds the most recent program took to set up, by phase: ``capture`` (the joint graph
        on fake tensors), ``plan`` (sharding, buckets, and any budget search) and ``lower`` (the
        rewrite passes and the split into this rank's graphs); or, when the plan cache had them,
        ``cache`` alone (reading and rebuilding the lowered graphs); on ranks other than 0,
        ``from rank 0`` alone (rebuilding the graphs rank 0 sent, NOTE [One build per job]). Empty
        before the first capture."""
        program = self.program
        phases = ("capture", "plan", "lower", "cache", "from rank 0")
        return {} if program is None else {k: program.setup_times[k] for k in phases if k in program.setup_times}

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling graphs with Inductor so far (0 unless ``zerofx.compile`` is set)."""
        return sum(p.compile_s for p in self._programs)

    def backward(self, loss: torch.Tensor) -> None:
        """Run the backward graph for the last forward; accumulate this rank's gradients."""
        if self._pending is None or loss is not self._pending[2]:
            raise EngineStateError("engine.backward(loss) needs the loss returned by the engine's most recent forward call")
        if self._backward_since_step:
            raise EngineStateError(
                "engine.backward() was called twice without engine.step() in between; call step() after every "
                "backward (it updates the parameters only at the gradient-accumulation boundary)"
            )
        # The saved tensors' only references go into the list the backward graph empties, so
        # each is freed once the backward has used it (NOTE [Boxed graphs]).
        program, args_list, _ = self._pending
        self._pending = None
        if self.storage.offload_store is not None and self.is_gradient_accumulation_boundary():
            self.optimizer.prefetch()  # the first NVMe records load while backward runs
        args_list.append(torch.full_like(loss, self._optimizer_step.grad_seed()))
        # With gradient offload the graph hands each reduced shard to the store at its bucket's
        # wait and returns None for it (NOTE [Gradients leave at their bucket's wait]).
        grad_store = self.storage.grad_store
        with grad_sink(grad_store.add if grad_store is not None else None):
            grads = self._run(program, "backward", args_list)
        self._backward_since_step = True
        self._optimizer_step.record_loss(loss)  # for the step's check (NOTE [Non-finite values] in zerofx/runtime/optimizer_step.py)
        self.storage.accumulate_grads([info.fqn for info in program.captured.params], grads)
        self._step_samples += samples_and_tokens(program.captured.inputs)[0]
        if self.monitor is not None:
            self.monitor.record_micro_batch(loss, program.captured.inputs)

    def step(self) -> None:
        """Call after every ``backward``. At each gradient-accumulation boundary: clip, update this
        rank's shard with the optimizer, and bring back full parameters where the stage keeps them."""
        if not self._backward_since_step:
            raise EngineStateError(
                "engine.step() was called without engine.backward() since the last step; the order is "
                "loss = engine(...); engine.backward(loss); engine.step()"
            )
        self._backward_since_step = False
        if not self._optimizer_step.advance_micro_step():
            return
        self._sync_grads()
        outcome = self._optimizer_step.run()
        self._after_step(updated=outcome.updated, grad_norm=outcome.grad_norm)

    def _after_step(self, *, updated: bool, grad_norm: float | torch.Tensor | None = None) -> None:
        self.storage.end_step(updated=updated)
        self.global_steps += 1
        # Ranks agree on input shapes; the ranks of a sequence group share their sequences.
        self.global_samples += self._step_samples * self.world_size // (self.sequence_parallel.size if self.sequence_parallel else 1)
        self._step_samples = 0
        every = self.cfg.steps_per_print
        if every and self.global_steps % every == 0 and self.rank == 0:
            loss = f"{self._last_loss.item():.4f}" if self._last_loss is not None else "n/a"
            scale = f", loss scale {self.loss_scaler.scale:g}" if self.loss_scaler else ""
            print(f"[zerofx] step {self.global_steps}: loss {loss}, lr {self.optimizer.param_groups[0]['lr']:.3g}{scale}", flush=True)
        if updated:
            self._sync_params()
        if self.monitor is not None:
            self.monitor.record_step(samples=self.global_samples, lr=self.optimizer.param_groups[0]["lr"],
                                     loss_scale=self.loss_scaler.scale if self.loss_scaler else None, grad_norm=grad_norm,
                                     model_state_bytes=sum(self.memory().values()))

    def _sync_grads(self) -> None:
        """Stage 1, at the accumulation boundary: reduce-scatter the accumulated local gradients
        into this rank's shard of each buffer (a collective; NOTE [Stages 1 and 2 move 2 Psi] in
        passes/zero/grad_sync.py)."""
        program = self.program
        if program is not None and "grad_sync" in program.graph_modules(self.rank):
            order = [f for bucket in program.plan.reduce_buckets for f in bucket]
            self._run(program, "grad_sync", [self.storage.grads[f] for f in order] + [self.storage.grad_shard(f) for f in order])

    def _sync_params(self) -> None:
        """Where the stage keeps parameters whole, all-gather the updated shards (a collective)."""
        program = self.program
        if program is not None and "param_sync" in program.graph_modules(self.rank):
            order = [f for bucket in program.plan.sync_buckets for f in bucket]
            # The graph writes each gathered bucket into the full flats in place (passes/zero/param_sync.py).
            self._run(program, "param_sync", [self.storage.shards[f] for f in order] + [self.storage.full[f] for f in order])

    # ----------------------------------------------------------------- state
    def flush(self) -> None:
        """With the one-step delayed update, apply the update still in flight (a collective at
        stages 1-2, which re-gather the parameters), wait for offloaded state's write-backs, and
        write the monitors' waiting records. Reading state and saving a checkpoint call it first."""
        if self.monitor is not None:
            self.monitor.flush()  # the curves on disk reach at least the last checkpoint
        if isinstance(self.optimizer, OffloadedOptimizer):
            if self.optimizer.finish():
                self._sync_params()
            self.optimizer.store.drain()  # the write-backs still going on; raises their errors
            if self.storage.param_store is not None:
                self.storage.param_store.drain()
            if self.storage.grad_store is not None:
                self.storage.grad_store.drain()

    def close(self) -> None:
        """Write the monitors' last records and close their files and wandb run; finish offloaded
        transfers and delete the offload files (NOTE [Offload files live as long as the engine]).
        The engine cannot train after this. Not a collective."""
        if self.monitor is not None:
            self.monitor.close()
        if self._closer is not None:
            self._closer()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict (same keys and shapes as ``model.state_dict()``) on every rank.
        At stage 3 this all-gathers every parameter: a collective, so call it on all ranks."""
        self.flush()
        return self.storage.state_dict(self._state_keys, self.shard_group)

    def memory(self) -> dict[str, int]:
        """Bytes this rank really holds: parameter, gradient and optimizer-state tensors. With
        offload, ``optimizer_states`` is what stays on the device, and ``offload_cpu_bytes`` /
        ``offload_nvme_bytes`` what host memory and the NVMe files hold (``offload_window_bytes``:
        the host buffers NVMe records pass through; ``offload_staging_bytes``: the delayed
        update's copy of the shards). With ``offload_param``, ``params`` counts only what stays
        on the device; ``offload_param_cpu_bytes`` / ``offload_param_nvme_bytes`` the shards on
        the other tiers and ``offload_param_window_bytes`` the NVMe read-ahead bound."""
        return {**self.storage.memory(), **self._optimizer_step.memory()}

    # ----------------------------------------------------------------- checkpoints
    def train_state(self) -> TrainState:
        """This rank's run as checkpoints read it and a load writes it back: a view of the
        engine's storage, optimizer and counters (``zerofx.runtime.train_state``)."""
        storage, program = self.storage, self.program
        return TrainState(
            model=self.model, cfg=self.cfg, stage=self.stage, compute_dtype=self.compute_dtype,
            plan=program.plan if program is not None else None,
            rank=self.rank, world_size=self.world_size, group=self.group, shard_group=self.shard_group, shard_index=self.shard_index,
            num_shards=self.shard_group_size, sequence_parallel_size=self.sequence_parallel.size if self.sequence_parallel else 1,
            device=self.device, placements=self.placements, shards=storage.shards, full=storage.full, master=storage.master,
            buffers=storage.buffers, optimizer_params=storage.optimizer_params, param_shard=storage.param_shard,
            param_store=storage.param_store, offload_store=storage.offload_store,
            optimizer=self.optimizer, loss_scaler=self.loss_scaler, counters=self.counters,
        )

    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None, client_state: Mapping[str, Any] | None = None, *,
                        keep_last: int | None = None) -> None:
        """Save this rank's shards under ``save_dir/tag`` (default ``step-<global_steps>``),
        atomically; a collective, call on every rank. With ``keep_last=K``, then delete the
        oldest ``step-<N>`` checkpoints beyond the newest K. See ``zerofx.runtime.checkpoint``."""
        self.flush()
        save_checkpoint(self.train_state(), save_dir, tag=tag, client_state=client_state, keep_last=keep_last)

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None, *, load_optimizer_states: bool = True) -> dict[str, Any]:
        """Load a checkpoint saved at any world size and stage (default: the newest complete one);
        return this rank's ``client_state``. A collective, call on every rank. See ``zerofx.runtime.checkpoint``."""
        self.flush()  # an update in flight must not land on the loaded parameters
        return load_checkpoint(self.train_state(), load_dir, tag=tag, load_optimizer_states=load_optimizer_states)


def _check_has_trainable_params(model: nn.Module) -> None:
    params = list(model.parameters())
    if not params:
        raise ZeroFXError(f"{type(model).__name__} has no parameters; zerofx shards a model's parameters, so it has nothing to train")
    if not any(p.requires_grad for p in params):
        raise ZeroFXError(
            f"every parameter of {type(model).__name__} is frozen (requires_grad=False); unfreeze the ones to train "
            "(zerofx trains with an optimizer over them)"
        )


def _meta_init_device(group: dist.ProcessGroup) -> torch.device:
    """Where a meta-built model's shards live: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def auto_config(model: nn.Module, cfg: ZeroConfig, example_args: tuple[Any, ...],
                example_kwargs: Mapping[str, Any] | None, *, stage: int | None, world_size: int | None, loss_fn: LossFn | None,
                group: dist.ProcessGroup | None) -> ZeroConfig:
    """``zerofx.auto``: the config with the search's choice written in (zerofx/compiler/autoplan.py).

    The data each rank is fed is fixed before ``initialize``, so the search keeps the config's
    sequence parallelism and batch (micro-batch: the example inputs'; accumulation: the
    config's) and varies the stage, shard group size, optimizer offload and tiling, each only
    where the config (or ``stage=``) leaves it open. Rank 0 searches, on fake tensors and in a
    forked child where that is safe (NOTE [Rank 0 searches in a child]), and sends the chosen
    config to the others, so every rank applies the same; it prints the choice once.
    With nothing fitting the budget every rank raises ``ConfigError`` saying what would fit."""
    group = group if group is not None else dist.group.WORLD
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if stage is not None:  # stage= fixes the stage, as the config's would
        cfg = cfg.with_keys({"zero_optimization.stage": stage})
    message: list[Any] = [None]
    failed: ZeroFXError | None = None
    if rank == 0:
        try:
            message = [rank_agreement.search_on_rank_0(lambda: _search_on_rank_zero(  # NOTE [Rank 0 searches in a child]
                model, cfg, example_args, example_kwargs, world_size=world_size, n=n, loss_fn=loss_fn))]
        except ZeroFXError as exc:  # every rank fails alike, rather than the others waiting in the broadcast
            failed, message = exc, [f"the search failed on rank 0: {exc}"]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
    if failed is not None:
        raise failed
    if not isinstance(message[0], Mapping):
        raise ConfigError(f"config key 'zerofx.auto': {message[0]}")
    return parse_config(dict(message[0]), stage=stage, world_size=world_size)


def _search_on_rank_zero(model: nn.Module, cfg: ZeroConfig, example_args: tuple[Any, ...],
                         example_kwargs: Mapping[str, Any] | None, *, world_size: int | None, n: int,
                         loss_fn: LossFn | None) -> Mapping[str, Any] | str:
    """The chosen config as JSON data (what rank 0 sends the others), or the search's line saying
    that nothing fits; prints the line once."""
    cfg = parse_config(cfg, world_size=world_size if world_size is not None else n)
    assert cfg.auto is not None and cfg.schedule.memory_budget_bytes is not None  # parse_config requires the budget
    kwargs = dict(example_kwargs or {})
    batch, seq_len = example_shape(example_args, kwargs)
    fixed = cfg.auto.fixed | {"sequence_parallel", "batch"}
    space = search_space(cfg, replace(cfg.auto, fixed=fixed), world_size=n, seq_len=seq_len, batch=batch)
    result = autoplan_search(model, resize_inputs(example_args, kwargs), cfg, world_size=n, seq_len=seq_len, batch=batch,
                             budget_bytes=cfg.schedule.memory_budget_bytes, space=space, fixed=fixed, loss_fn=loss_fn,
                             progress=lambda line: print(f"zerofx auto: {line}", file=sys.stderr, flush=True))
    print(result.summary(), flush=True)
    return result.config if result.config is not None else result.summary()


def initialize(
    model: nn.Module,
    config: str | Path | Mapping[str, Any] | None = None,
    *,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    stage: int | None = None,
    world_size: int | None = None,
    loss_fn: LossFn | None = None,
    group: dist.ProcessGroup | None = None,
    init_fn: InitFn | None = None,
    init_seed: int = 0,
) -> Engine:
    """Shard ``model`` across the process group and return this rank's training engine.

    Call it on every rank, inside an initialized ``torch.distributed`` process group.

    ``model`` may be built on the meta device (``with torch.device("meta"): model = ...``).
    Each rank then computes its own shards, module by module, from ``init_seed`` and the
    modules' init functions (``init_fn(module)``, else the model's ``_init_weights(module)``,
    else each module's ``reset_parameters()``): NOTE [The init scheme] in
    ``zerofx.compiler.materialize``. No rank ever holds more than one module's full tensors beyond what
    its stage keeps, and the values are the same at every world size.
    """
    args = check_example_inputs(example_inputs)
    # NOTE [Options are parsed once] (zerofx/config/__init__.py): a dict or a path is parsed here,
    # once; a ZeroConfig (zerofx train's) is only reconciled with stage= and world_size=.
    cfg = parse_config(config, stage=stage, world_size=world_size)
    if cfg.auto is not None and dist.is_available() and dist.is_initialized():
        cfg = auto_config(model, cfg, args, example_kwargs, stage=stage, world_size=world_size, loss_fn=loss_fn, group=group)
    cfg = resolve(cfg, stage=stage, world_size=world_size)
    return Engine(model, cfg, args, example_kwargs, loss_fn=loss_fn, group=group, init_fn=init_fn, init_seed=init_seed)
