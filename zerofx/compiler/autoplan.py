"""One plan for the whole job: search the configuration for the most predicted tokens per second
whose peak memory per rank fits a budget (``zerofx plan --auto``, ``"zerofx": {"auto": true}``).

The search plans candidates through ``zerofx.compile`` and ``Program.replan`` and reads each
one's estimated schedule (``program.report``): nothing runs and no process group is needed. It
varies the ZeRO stage, the sequence-parallel size, the shard group size, where the optimizer
state lives, tiling, activation recompute, and the micro-batch with gradient accumulation keeping the global batch
fixed; a dimension the config sets itself is kept (``AutoOptions.fixed``). The result is an
``AutoPlan``: the chosen candidate, every candidate ranked with why it lost, and, when nothing
fits, what would have to change. The command line and the engine only format and apply it.
What a candidate is and how it is written into a config: ``zerofx.compiler.autoplan_space``.

NOTE [How the whole-job search prunes]
Capture is the costly part (seconds for a small model; lowering and the report a fraction of
that), and it depends only on the micro-batch, the sequence-parallel size and tiling, the
capture group. Within a group one capture serves every stage, shard group size and offload
placement (``Program.replan``, NOTE [Planning again from one capture]). The search skips what
cannot win:
- Within a group, candidates are lowered in order of their model state per rank (known from the
  parameters' shapes, without lowering). A candidate whose model state plus the smallest
  transient memory (peak less persistent state) measured in the group exceeds the budget is
  not lowered: it is reported over budget by at least that much. Recompute lowers the transient
  memory, so candidates that recompute are bounded only by those measured with it.
- Offloading the optimizer state only adds time (its updates run on the host, its records
  cross the host link), and so does recomputing activations (their ops run again in backward),
  so a candidate with either is tried only for a stage and shard group size that is over the
  budget without both. Under ``"auto"`` the planner recomputes the fewest activations that fit
  the budget, none when it already fits (NOTE [Recompute under a memory budget]).
- Micro-batches are tried smallest first within a sequence-parallel size and tiling: a larger
  one holds more activations, so once the group's leanest candidate is over the budget no
  larger micro-batch is tried.
- Sequence parallelism adds exchanges and, at a fixed global batch, leaves each rank the same
  tokens per step, so a larger sequence-parallel size is tried only when some candidate of the
  smaller ones is over the budget.
- Tiling only trades time for memory, so tiled captures are tried for a micro-batch and
  sequence-parallel size only when some candidate of its untiled capture is over the budget.
- A sequence-parallel size whose rewrite refuses the model (``SequenceParallelError``) is not a
  candidate, and the report says why.
With tiling ``auto``, the capture's tiling is fitted to the timeline of the candidate it was
captured for; a winner planned again from another candidate's capture is captured once more
from its own config, and measured as that config plans it, before it is kept.
The objective is tokens per optimizer step over the predicted optimizer step: the micro-steps'
forward and backward (with the exposed communication), the once-per-step gradient and
parameter syncs of stages 1-2, and the optimizer update (memory-bound on the device, or the
offload plan's host step with the record I/O it cannot hide).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch.nn as nn

from zerofx.common.errors import CaptureError, SequenceParallelError
from zerofx.common.units import format_bytes
from zerofx.compiler.autoplan_space import (Candidate, InputsAt, SearchSpace, candidate_config, example_shape,
                                            powers_of_two_dividing, resize_inputs, search_space, with_auto_tiling)
from zerofx.compiler.capture import LossFn
from zerofx.compiler.program import Program, compile, plan_from_shapes, resolve
from zerofx.config.compile_options import compile_options
from zerofx.config import ZeroConfig, parse_config
from zerofx.cost_models.compute import CPU_CORE
from zerofx.cost_models.offload import FP32_BYTES, estimate_update_s, record_numels
from zerofx.cost_models.profiles import load_profile
from zerofx.cost_models.tiers import NO_OFFLOAD, Tier
from zerofx.passes import Plan
from zerofx.passes.analyze_schedule import ScheduleReport
from zerofx.passes.plan_offload import plan_offload


# Auto-tiled winners captured again from their own config before one is kept.
MAX_RECAPTURES = 3
# Halvings of the sequence tried to say how short a sequence the leanest candidate fits.
MAX_SEQUENCE_HALVINGS = 5


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


@dataclass(frozen=True)
class Evaluated:
    """A candidate and what the cost models predict for it. ``lowered`` is False for one skipped
    by the memory bound: its ``peak_bytes`` is then a lower bound."""

    candidate: Candidate
    step_s: float  # one optimizer step: every micro-step, the syncs, the update
    tokens_per_s: float
    peak_bytes: float  # on the device, per rank (the memory timeline's peak less what is offloaded)
    model_state_bytes: float  # on the device, per rank, between steps
    fits: bool
    lowered: bool = True
    why: str = ""  # why it lost to the chosen one; "" for the chosen one
    fingerprint: str = ""  # the plan's, for a lowered candidate
    recomputed: int = 0  # saved activations the plan recomputes in backward

    def label(self) -> str:
        """The candidate, with how many activations its plan recomputes where any."""
        return self.candidate.label() + (f" ({_count(self.recomputed, 'activation')} recomputed)" if self.recomputed else "")


@dataclass(frozen=True)
class AutoPlan:
    """The search's result: ``chosen`` (None when nothing fits), every candidate ``ranked`` (those
    that fit by predicted tokens/s, then those over the budget by their peak), the sequence-parallel
    sizes that are no candidates and why, and when nothing fits what would have to change."""

    chosen: Evaluated | None
    ranked: tuple[Evaluated, ...]
    not_candidates: tuple[tuple[str, str], ...]  # (what, why)
    to_fit: tuple[str, ...]
    config: Mapping[str, Any] | None  # the chosen candidate as a config (the user's, with the choice written in)
    budget_bytes: float
    world_size: int
    seq_len: int
    global_batch: int  # sequences per optimizer step, over all data-parallel groups
    profile: str
    fixed: tuple[str, ...]  # dimensions the config set itself
    search_s: float
    num_captures: int
    num_lowered: int

    def to_json(self) -> str:
        data = asdict(self)
        data["config"] = None if self.config is None else dict(self.config)
        return json.dumps(data, indent=1, default=list)

    def summary(self) -> str:
        """One line naming the choice, as the engine prints it at initialize."""
        if self.chosen is None:
            return (f"zerofx auto: nothing fits {format_bytes(self.budget_bytes)} per rank among {len(self.ranked)} candidates; "
                    + "; ".join(self.to_fit))
        c = self.chosen
        return (f"zerofx auto: chose {c.label()} (predicted {c.tokens_per_s:,.0f} tokens/s, step {c.step_s * 1e3:.3g} ms, "
                f"peak {format_bytes(c.peak_bytes)} per rank of {format_bytes(self.budget_bytes)}; {len(self.ranked)} candidates, "
                f"{_count(self.num_captures, 'capture')}, {self.search_s:.1f} s)")


class _Search:
    """The state of one search: the captures made, what each candidate measured."""

    def __init__(self, model: nn.Module, inputs_at: InputsAt, base: Mapping[str, Any], *, world_size: int, seq_len: int,
                 global_batch: int, budget_bytes: float, fixed: frozenset[str], loss_fn: LossFn | None) -> None:
        self.model, self.inputs_at, self.base = model, inputs_at, base
        self.world_size, self.seq_len, self.global_batch = world_size, seq_len, global_batch
        self.budget_bytes, self.fixed, self.loss_fn = budget_bytes, fixed, loss_fn
        self.groups: dict[tuple[int, int, str], Program] = {}  # the first program of each capture group
        self.own_capture: set[Candidate] = set()  # candidates measured on a capture of their own config
        self.num_captures = 0
        self.num_lowered = 0
        self._states: dict[Candidate, float] = {}
        self.profile = parse_config(base).profile
        self.comm, self.device = load_profile(self.profile)

    def config(self, c: Candidate) -> dict[str, Any]:
        config = candidate_config(self.base, c, world_size=self.world_size, global_batch=self.global_batch, fixed=self.fixed)
        if c.tiling == "auto":
            lean = self.model_state_bytes(replace(c, stage=3, offload=NO_OFFLOAD, shard_group_size=self.world_size))
            config = with_auto_tiling(config, self.budget_bytes - lean)
        return config

    def model_state_bytes(self, c: Candidate) -> float:
        """The candidate's model state on the device per rank, from the parameters' shapes alone."""
        if c in self._states:
            return self._states[c]
        config = candidate_config(self.base, c, world_size=self.world_size, global_batch=self.global_batch, fixed=self.fixed)
        cfg = resolve(config, stage=None, world_size=self.world_size)
        plan = plan_from_shapes(self.model, cfg, compile_options(cfg, self.world_size))
        state = float(sum(plan.estimates.values()))
        if cfg.offload is not None:
            state -= self._offloaded_bytes(plan, cfg)
        self._states[c] = state
        return state

    def _records(self, plan: Plan, cfg: ZeroConfig) -> list[tuple[str, int]]:
        """Each trainable parameter's optimizer-state record on this rank, in backward order, as
        the engine's offload plan lists them (zerofx/runtime/offload/plan.py)."""
        mixed = cfg.compute_dtype is not None
        return [(p.fqn, FP32_BYTES * sum(record_numels(p.padded_numel if int(plan.stage) == 0 else p.shard_numel,
                                                      optimizer=plan.optimizer, mixed_precision=mixed)))
                for p in reversed(plan.params) if p.requires_grad]

    def _offloaded_bytes(self, plan: Plan, cfg: ZeroConfig) -> float:
        assert cfg.offload is not None
        records = self._records(plan, cfg)
        tiers = cfg.offload.tier_specs(sum(b for _, b in records), device_is_cpu=self.device.name.startswith("cpu"))
        device_budget = tiers[Tier.DEVICE].budget_bytes
        return max(sum(b for _, b in records) - device_budget, 0.0)

    def program(self, c: Candidate, config: dict[str, Any]) -> Program:
        """The candidate planned from its group's capture, capturing the group's first."""
        key = c.capture_group
        first = self.groups.get(key)
        if first is None:
            args, kwargs = self.inputs_at(c.micro_batch, self.seq_len)
            first = compile(self.model, world_size=self.world_size, config=config, example_inputs=args, example_kwargs=kwargs,
                            loss_fn=self.loss_fn)
            self.num_captures += 1
            self.groups[key] = first
            self.own_capture.add(c)
            return first
        return first.replan(config)

    def replanned_tiling(self, c: Candidate) -> bool:
        """Whether ``c`` is an ``auto``-tiled candidate planned again from a capture whose tiling
        was fitted for another one: its own config would fit tiling to its own timeline."""
        return c.tiling == "auto" and c not in self.own_capture

    def evaluate_own_capture(self, c: Candidate) -> Evaluated:
        """``c`` captured from its own config, as ``zerofx plan --config`` would plan it."""
        config = self.config(c)
        args, kwargs = self.inputs_at(c.micro_batch, self.seq_len)
        program = compile(self.model, world_size=self.world_size, config=config, example_inputs=args, example_kwargs=kwargs,
                          loss_fn=self.loss_fn)
        self.num_captures += 1
        self.num_lowered += 1
        self.own_capture.add(c)
        return self.measure(c, program, program.report(0, comm=self.comm, device=self.device),
                            resolve(config, stage=None, world_size=self.world_size))

    def tiled_ops(self, c: Candidate) -> tuple[Any, ...]:
        """What the capture of ``c``'s group tiles (capturing it if not done yet)."""
        tiling = self.program(c, self.config(c)).plan.tiling
        return () if tiling is None else tuple(tiling.ops)

    def evaluate(self, c: Candidate) -> Evaluated:
        config = self.config(c)
        program = self.program(c, config)
        report = program.report(0, comm=self.comm, device=self.device)
        self.num_lowered += 1
        cfg = resolve(config, stage=None, world_size=self.world_size)
        return self.measure(c, program, report, cfg)

    def measure(self, c: Candidate, program: Program, report: ScheduleReport, cfg: ZeroConfig) -> Evaluated:
        spans: dict[str, float] = {}
        for span in report.spans:
            spans[span.graph] = spans.get(span.graph, 0.0) + span.end_s - span.start_s
        micro_s = spans.get("forward", 0.0) + spans.get("backward", 0.0)
        sync_s = spans.get("grad_sync", 0.0) + spans.get("param_sync", 0.0)
        records = self._records(program.plan, cfg)
        offloaded = 0.0
        if cfg.offload is not None:
            options = cfg.offload
            tiers = options.tier_specs(sum(b for _, b in records), device_is_cpu=self.device.name.startswith("cpu"))
            offload = plan_offload(records, tiers, buffer_count=options.buffer_count, update_bytes_per_s=CPU_CORE.memory_bytes_per_s,
                                   prefetch_lead_s=spans.get("backward", 0.0), delayed_update=options.delayed_update,
                                   forward_backward_s=micro_s)
            offloaded = float(offload.bytes_on(Tier.CPU) + offload.bytes_on(Tier.NVME))
            update_s = float(offload.estimates["step_s"])
        else:
            update_s = sum(estimate_update_s(b, self.device.memory_bytes_per_s) for _, b in records)
        step_s = c.accumulation * micro_s + sync_s + update_s
        peak = max(report.peak.live_bytes - offloaded, 0.0)
        tokens = self.global_batch * self.seq_len
        return Evaluated(c, step_s, tokens / step_s if step_s > 0 else float("inf"), peak, report.persistent_bytes - offloaded,
                         fits=peak <= self.budget_bytes, fingerprint=program.plan.fingerprint(),
                         recomputed=0 if program.plan.recompute is None else len(program.plan.recompute.activations))


def _shard_group_sizes(space: SearchSpace, stage: int, world_size: int) -> tuple[int | str, ...]:
    if stage == 0:
        return (world_size,)
    if space.shard_group_sizes is not None:
        return space.shard_group_sizes
    return tuple(reversed(powers_of_two_dividing(world_size, start=2))) or (world_size,)


def _micro_batches(space: SearchSpace, per_group: int) -> tuple[tuple[int, int], ...]:
    """(micro-batch, accumulation) pairs, smallest micro-batch first."""
    if space.micro_batch is not None:
        assert space.accumulation is not None
        return ((space.micro_batch, space.accumulation),)
    micros = sorted({*powers_of_two_dividing(per_group), per_group})
    return tuple((m, per_group // m) for m in micros)


def search(model: nn.Module, inputs_at: InputsAt, base_config: Mapping[str, Any], *, world_size: int, seq_len: int, batch: int,
           budget_bytes: float, space: SearchSpace, fixed: frozenset[str] = frozenset(), loss_fn: LossFn | None = None) -> AutoPlan:
    """The configuration of ``space`` with the most predicted tokens/s whose device peak per rank
    fits ``budget_bytes`` (NOTE [How the whole-job search prunes]).

    ``inputs_at(micro_batch, seq_len)`` gives the model call at that shape; ``batch`` is the
    sequences per rank per optimizer step without sequence parallelism, so the global batch,
    ``batch * world_size``, is the same for every candidate (a sequence group of S ranks shares
    ``batch * S`` sequences per step, in micro-batches). ``base_config`` is the user's config: the
    dimensions in ``fixed`` keep its values, and every candidate's config is it with the choice
    written in."""
    start = time.perf_counter()
    global_batch = batch * world_size
    s = _Search(model, inputs_at, base_config, world_size=world_size, seq_len=seq_len, global_batch=global_batch,
                budget_bytes=budget_bytes, fixed=fixed, loss_fn=loss_fn)
    results: list[Evaluated] = []
    not_candidates: list[tuple[str, str]] = []
    for sp in space.sequence_parallel:
        if sp != space.sequence_parallel[0] and results and all(e.fits for e in results):
            break  # everything fits with fewer ranks per sequence: more cannot win (NOTE [How the whole-job search prunes])
        why = _search_sequence_parallel_size(s, space, sp, batch * sp, results)
        if why is not None:
            not_candidates.append((f"sequence parallelism over {sp} ranks", why))
    ranked = _rank(results, budget_bytes)
    chosen = ranked[0] if ranked and ranked[0].fits else None
    if chosen is None and any(e.lowered for e in results):
        # What would fit is the leanest candidate's peak: one the memory bound skipped may need
        # less than every one lowered, so those are lowered now.
        lean = min(e.peak_bytes for e in results if e.lowered)
        results = [s.evaluate(e.candidate) if not e.lowered and e.peak_bytes < lean else e for e in results]
        ranked = _rank(results, budget_bytes)
        chosen = ranked[0] if ranked[0].fits else None  # the bound is a heuristic: one lowered now may fit
    # NOTE [How the whole-job search prunes]: an auto-tiled winner planned from another stage's
    # capture is captured again from its own config, so the config printed plans what it says.
    for _ in range(MAX_RECAPTURES):
        if chosen is None or not s.replanned_tiling(chosen.candidate):
            break
        own = s.evaluate_own_capture(chosen.candidate)
        results = [own if e.candidate == chosen.candidate else e for e in results]
        ranked = _rank(results, budget_bytes)
        chosen = ranked[0] if ranked[0].fits else None
    to_fit: tuple[str, ...] = ()
    if chosen is None and any(e.lowered for e in ranked):
        to_fit = _what_would_fit(s, ranked)
    config = None if chosen is None else s.config(chosen.candidate)
    return AutoPlan(chosen=chosen, ranked=ranked, not_candidates=tuple(not_candidates), to_fit=to_fit, config=config,
                    budget_bytes=budget_bytes, world_size=world_size, seq_len=seq_len, global_batch=global_batch, profile=s.profile,
                    fixed=tuple(sorted(fixed)), search_s=time.perf_counter() - start, num_captures=s.num_captures,
                    num_lowered=s.num_lowered)


def _search_sequence_parallel_size(s: _Search, space: SearchSpace, sp: int, per_group: int, results: list[Evaluated]) -> str | None:
    """Every capture group at sequence-parallel size ``sp``, results appended to ``results``;
    why the rewrite refuses the model at ``sp``, or None."""
    # micro-batch -> (the tiled ops of each tiling searched, whether any of its candidates fit)
    tiled: dict[int, dict[tuple[Any, ...], bool]] = {}
    for tiling in space.tilings:
        if tiling != space.tilings[0] and not _untiled_over(results, sp):
            continue  # everything fits untiled: tiling cannot win (NOTE [How the whole-job search prunes])
        for micro, accumulation in _micro_batches(space, per_group):
            group = [Candidate(stage, sp, k, offload, tiling, micro, accumulation, recompute)
                     for stage in space.stages for k in _shard_group_sizes(space, stage, s.world_size) for offload in space.offloads
                     for recompute in space.recomputes]
            try:
                ops = s.tiled_ops(group[0])
                seen = tiled.setdefault(micro, {})
                if ops in seen:  # this tiling tiles what another already did: the same candidates again
                    if not seen[ops]:
                        break
                    continue
                evaluated = _search_group(s, group)
            except CaptureError as exc:
                if sp == 1 or not (isinstance(exc, SequenceParallelError) or isinstance(exc.__cause__, SequenceParallelError)):
                    raise
                return str(exc)
            results += evaluated
            lowered = [e for e in evaluated if e.lowered]
            seen[ops] = any(e.fits for e in lowered)
            if lowered and not seen[ops]:
                break  # a larger micro-batch holds more: none of its candidates would fit
    return None


def _untiled_over(results: Sequence[Evaluated], sp: int) -> bool:
    return any(not e.fits for e in results if e.candidate.sequence_parallel == sp and e.candidate.tiling in ("off", "config"))


def _saves_memory_only(c: Candidate) -> bool:
    """Whether ``c`` trades time for memory beyond its stage and shard group size: the optimizer
    state offloaded, or activations recomputed in the search's own "auto"."""
    return c.offload != NO_OFFLOAD or c.recompute == "auto"


def _search_group(s: _Search, group: Sequence[Candidate]) -> list[Evaluated]:
    """The candidates of one capture group, leanest model state first; offload and recompute
    only where the stage and shard group size are over the budget without them, and those the
    memory bound rules out not lowered."""
    plain = [c for c in group if not _saves_memory_only(c)] or list(group)
    savers = [c for c in group if c not in plain]
    out: list[Evaluated] = []
    # The smallest peak less persistent state measured in this group, per recompute setting:
    # recompute lowers the transient memory, so one measured without it bounds nothing with it.
    transient: dict[str, float] = {}

    def run(candidates: Sequence[Candidate]) -> None:
        states = {c: s.model_state_bytes(c) for c in candidates}
        for c in sorted(candidates, key=lambda c: (states[c], c.recompute == "auto", -c.stage)):
            least = transient.get(c.recompute, float("inf"))
            out.append(_evaluate_or_bound(s, c, states[c], least))
            if out[-1].lowered:
                transient[c.recompute] = min(least, out[-1].peak_bytes - out[-1].model_state_bytes)

    run(plain)
    over = {(e.candidate.stage, e.candidate.shard_group_size) for e in out if not e.fits}
    run([c for c in savers if (c.stage, c.shard_group_size) in over])
    return out


def _evaluate_or_bound(s: _Search, c: Candidate, state: float, transient: float) -> Evaluated:
    bound = state + (transient if transient != float("inf") else 0.0)
    if bound > s.budget_bytes and transient != float("inf"):
        return Evaluated(c, float("inf"), 0.0, bound, state, fits=False, lowered=False)
    return s.evaluate(c)


def _rank(results: Sequence[Evaluated], budget_bytes: float) -> tuple[Evaluated, ...]:
    """Those that fit by tokens/s (highest first), then the rest by peak (smallest first), each
    with why it lost to the first."""
    fits = sorted((e for e in results if e.fits), key=lambda e: (-e.tokens_per_s, e.peak_bytes))
    over = sorted((e for e in results if not e.fits), key=lambda e: (e.peak_bytes, not e.lowered))
    ranked: list[Evaluated] = []
    best = fits[0] if fits else None
    for e in fits:
        if e is best:
            ranked.append(e)
            continue
        slower = 1 - e.tokens_per_s / best.tokens_per_s
        ranked.append(replace(e, why=f"{slower:.1%} slower ({e.tokens_per_s:,.0f} tokens/s)"))
    for e in over:
        by = format_bytes(e.peak_bytes - budget_bytes)
        why = (f"over budget by {by} (peak {format_bytes(e.peak_bytes)})" if e.lowered else
               f"over budget by at least {by} (model state {format_bytes(e.model_state_bytes)} plus the least transient memory "
               "measured at its capture; not lowered)")
        ranked.append(replace(e, why=why))
    return tuple(ranked)


def _what_would_fit(s: _Search, ranked: Sequence[Evaluated]) -> tuple[str, ...]:
    """When nothing fits: the smallest budget any candidate needs, and the longest sequence the
    leanest candidate fits at, halving the sequence and capturing each length."""
    lean = min((e for e in ranked if e.lowered), key=lambda e: e.peak_bytes)
    out = [f"a budget of at least {format_bytes(lean.peak_bytes)} per rank ({lean.candidate.label()}, the leanest candidate)"]
    c, seq = lean.candidate, s.seq_len
    step = 2 * c.sequence_parallel
    for _ in range(MAX_SEQUENCE_HALVINGS):
        seq = seq // 2 // step * step
        if seq < max(step, 2):
            break
        shorter = _Search(s.model, s.inputs_at, s.base, world_size=s.world_size, seq_len=seq, global_batch=s.global_batch,
                          budget_bytes=s.budget_bytes, fixed=s.fixed, loss_fn=s.loss_fn)
        e = shorter.evaluate(c)
        s.num_captures += 1
        if e.fits:
            out.append(f"or a sequence of {seq} tokens (captured: peak {format_bytes(e.peak_bytes)} with {c.label()}); "
                       f"the longest that fits is between {seq} and {2 * seq}")
            break
    else:
        out.append(f"no sequence down to {seq} tokens fits with {c.label()}")
    return tuple(out)


__all__ = ["AutoPlan", "Candidate", "Evaluated", "SearchSpace", "candidate_config", "example_shape", "resize_inputs", "search",
           "search_space"]
