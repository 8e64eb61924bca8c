"""The whole-job search: the configuration with the most predicted tokens per second whose peak
memory per rank fits a budget (``zerofx plan --auto``, ``"zerofx": {"auto": true}``;
docs/autoplan.md).

Candidates are planned through ``zerofx.compile`` and ``Program.replan`` and measured on their
estimated schedule (``program.report``): nothing runs and no process group is needed. The search
varies the ZeRO stage, the sequence-parallel size, the shard group size, where the optimizer
state lives, tiling, activation recompute, the compiler (eager, or Inductor where the profile
measured what it keeps resident) and the micro-batch, with gradient accumulation keeping the
global batch fixed; a dimension the config sets is kept (``AutoOptions.fixed``). What a candidate
is, and the space a config leaves open: ``zerofx.planner.space``.

The objective is tokens per optimizer step over the predicted optimizer step: the micro-steps'
forward and backward with the communication they expose, the once-per-step gradient and
parameter syncs of stages 1-2, and the optimizer update (on the device, or the offload plan's
host step with the record I/O it cannot hide). The result, an ``AutoPlan``, holds the choice,
every candidate ranked with why it lost, and, when nothing fits, what would have to change; the
command line and the engine only format and apply it. Which candidates are lowered at all is
NOTE [How the whole-job search prunes]; how a deep model is searched from cuts of its blocks is
NOTE [Budgets of the cut models].
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch.nn as nn

from zerofx.common.errors import CaptureError, SequenceParallelError
from zerofx.common.units import format_bytes, format_seconds
from zerofx.planner.space import (Candidate, InputsAt, SearchSpace, candidate_config, example_shape,
                                            powers_of_two_dividing, resize_inputs, search_space, with_auto_tiling)
from zerofx.compiler.capture import LossFn
from zerofx.planner.folded_tiling import NO_FIT_TOLERANCE, PinnedTiling, fit_pinned, ladder, model_estimates, pinned_on
from zerofx.planner.folding import AUTO_FOLD_MIN_BLOCKS, FOLD_BLOCKS, RepeatedBlocks, extrapolate, find_repeated_blocks, fold, graph_seconds, with_num_blocks
from zerofx.compiler.program import Program, compile, plan_from_shapes, prefetch_from_the_profile, resolve, whole_prefetch_distance
from zerofx.config.compile_options import compile_options
from zerofx.config.options import BUDGET_KEYS, GraphCompiler
from zerofx.config import ZeroConfig, parse_config
from zerofx.cost_models.compute import CPU_CORE
from zerofx.cost_models.memory import inductor_resident_bytes
from zerofx.cost_models.hierarchy import STEP_TIE_FRACTION, estimate_step_comm_s, estimate_step_s
from zerofx.cost_models.offload import FP32_BYTES, estimate_device_freed_bytes, estimate_update_s, record_numels
from zerofx.cost_models.profiles import load_profile
from zerofx.cost_models.tiers import NO_OFFLOAD, Tier
from zerofx.passes import Plan
from zerofx.passes.plan.recompute import RecomputeMode
from zerofx.passes.analysis.analyze_schedule import ScheduleReport
from zerofx.passes.memory.plan_offload import plan_offload
from zerofx.passes.zero.plan_shard_groups import bucket_bytes, estimate_compute_s


# Told a line per candidate as the search goes (``zerofx plan --auto`` prints it to stderr).
Progress = Callable[[str], None]
# Auto-tiled winners captured again from their own config before one is kept.
MAX_RECAPTURES = 3
# The shard-group model prices each collective alone on its link, so across nodes it can predict
# more than the lowered schedule exposes (up to 14% seen, at 64 ranks on the H100 profile;
# tests/test_autoplan.py checks the floor holds): a candidate is skipped by it only with this margin.
SHARDING_MODEL_MARGIN = 0.25
# A folded step is within 5% of the whole model's where the prefetch window spans blocks (NOTE [A
# window that spans blocks] in zerofx/planner/folding.py): a folded step skips a candidate as a
# floor only with this margin.
FOLDED_STEP_MARGIN = 0.1
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
    peak_bytes: float  # on the device, per rank (the memory timeline's peak less what offloading takes off it)
    model_state_bytes: float  # on the device, per rank, between steps
    fits: bool
    lowered: bool = True
    why: str = ""  # why it lost to the chosen one; "" for the chosen one
    fingerprint: str = ""  # the plan's, for a lowered candidate
    recomputed: int = 0  # saved activations the plan recomputes in backward
    step_bound_s: float = 0.0  # ``_Search.step_floor_s``: what the step takes at least (0: none computed)
    tiling: str = ""  # folded: what its tiling pins (NOTE [One tiling for every cut]); "" otherwise

    def label(self) -> str:
        """The candidate, with what its tiling pins and how many activations its plan recomputes
        where any."""
        label = self.candidate.label()
        if self.tiling:
            label = label.replace(f"tiling {self.candidate.tiling}", f"tiling {self.candidate.tiling} ({self.tiling})", 1)
        return label + (f" ({_count(self.recomputed, 'activation')} recomputed)" if self.recomputed else "")


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
    memory_margin: float = 0.0  # the share of the config's budget held back (NOTE [The memory margin] in zerofx/config/options.py)
    # Non-empty when the chosen candidate was not captured from its own config, and why (NOTE
    # [How the whole-job search prunes]: after MAX_RECAPTURES winners did not fit as their own
    # config plans them, the next is reported as measured, with this caveat).
    unchecked: str = ""
    # Non-empty when the search stopped before trying every candidate (NOTE [A search answers
    # anytime]): why, e.g. "Ctrl-C after 37.2 s"; the result is then the best of those tried.
    stopped: str = ""

    def budget_text(self) -> str:
        """The budget the search fits, with the config's budget and margin where a margin is held back."""
        if not self.memory_margin:
            return format_bytes(self.budget_bytes)
        return (f"{format_bytes(self.budget_bytes)} ({format_bytes(self.budget_bytes / (1 - self.memory_margin))} less a "
                f"{self.memory_margin:.0%} margin)")

    def to_json(self) -> str:
        data = asdict(self)
        data["config"] = None if self.config is None else dict(self.config)
        return json.dumps(data, indent=1, default=list)

    def summary(self) -> str:
        """One line naming the choice, as the engine prints it at initialize."""
        if self.chosen is None:
            return (f"zerofx auto: nothing fits {self.budget_text()} per rank among {len(self.ranked)} candidates; "
                    + "; ".join(self.to_fit))
        c = self.chosen
        return (f"zerofx auto: chose {c.label()} (predicted {c.tokens_per_s:,.0f} tokens/s, step {format_seconds(c.step_s)}, "
                f"peak {format_bytes(c.peak_bytes)} per rank of {self.budget_text()}; {len(self.ranked)} candidates, "
                f"{_count(self.num_captures, 'capture')}, {self.search_s:.1f} s)" + (f"; {self.unchecked}" if self.unchecked else ""))


class _Search:
    """The state of one search: the captures made, what each candidate measured."""

    def __init__(self, model: nn.Module, inputs_at: InputsAt, base: ZeroConfig, *, world_size: int, seq_len: int,
                 global_batch: int, budget_bytes: float, fixed: frozenset[str], loss_fn: LossFn | None, fold: str = "auto",
                 progress: Progress | None = None, deadline_s: float | None = None, total: int | None = None) -> None:
        self.model, self.inputs_at, self.base, self.fold = model, inputs_at, base, fold
        self.progress, self.start_s = progress, time.perf_counter()
        # NOTE [A search answers anytime]: the wall-clock time (perf_counter) past which no candidate
        # is started, the most candidates the space holds, and every candidate said so far.
        self.deadline_s, self.total = deadline_s, total
        self.said: dict[Candidate, Evaluated] = {}
        self.blocks = _blocks_to_fold(model, fold)
        self.cuts: dict[int, nn.Module] = {}  # folded: the model cut to n blocks, by n
        # Folded: each capture group's first program per cut, and the config it was planned with.
        self.cut_groups: dict[tuple[int, int, str], dict[int, tuple[Program, ZeroConfig]]] = {}
        self.folded: set[Candidate] = set()  # candidates measured on the cut models
        # Folded: each capture group's tiling, pinned for the whole model (NOTE [One tiling for every cut]).
        self.pinned: dict[tuple[int, int, str], PinnedTiling | None] = {}
        # Folded, tiling "auto": each capture group's settings tried, with their folded activations.
        self.tiling_tried: dict[tuple[int, int, str], dict[PinnedTiling, float]] = {}
        self.world_size, self.seq_len, self.global_batch = world_size, seq_len, global_batch
        self.budget_bytes, self.fixed, self.loss_fn = budget_bytes, fixed, loss_fn
        self.groups: dict[tuple[int, int, str], Program] = {}  # the first program of each capture group
        self.own_capture: set[Candidate] = set()  # candidates measured on a capture of their own config
        self.num_captures = 0
        self.num_lowered = 0
        self._states: dict[Candidate, float] = {}
        self._compute_s: dict[tuple[int, int, str, bool], float] = {}  # per capture group, eager or fused
        self._configs: dict[Candidate, ZeroConfig] = {}  # ``candidate_config`` of each candidate
        self.profile, self.base_compiler = base.profile, base.graph_compiler
        self.comm, self.device = load_profile(self.profile)

    def candidate_config(self, c: Candidate) -> ZeroConfig:
        """``candidate_config`` of ``c`` on this search's base, its tiling as the candidate names it."""
        if c not in self._configs:
            self._configs[c] = candidate_config(self.base, c, world_size=self.world_size, global_batch=self.global_batch, fixed=self.fixed)
        return self._configs[c]

    def config(self, c: Candidate) -> ZeroConfig:
        """``c``'s options: its tiling pinned for the whole model (folded) or fitted to the
        activation budget (``"auto"``)."""
        config = self.candidate_config(c)
        if c.tiling in ("auto", "on") and self.blocks is not None:
            pinned = self.pinned_tiling(c, config)
            if pinned is not None:
                return config.with_keys({"zerofx.tiling": pinned.section()})
        if c.tiling == "auto":
            config = with_auto_tiling(config, self.activation_budget_bytes(c))
        return config

    def activation_budget_bytes(self, c: Candidate) -> float:
        """What ``"auto"`` tiling fits the memory timeline (peak less model state) to: the budget
        less the leanest model state."""
        return self.budget_bytes - self.model_state_bytes(replace(c, stage=3, offload=NO_OFFLOAD, shard_group_size=self.world_size))

    def pinned_tiling(self, c: Candidate, config: ZeroConfig) -> PinnedTiling | None:
        """Folded: the tiling of ``c``'s capture group, the same in every block and chosen for the
        whole model (NOTE [One tiling for every cut] in zerofx/planner/folded_tiling.py); None
        where nothing can be tiled. ``config`` is ``c``'s, its tiling aside."""
        assert self.blocks is not None
        key = c.capture_group
        if key in self.pinned:
            return self.pinned[key]
        untiled = config.with_keys(drop=["zerofx.tiling"])
        args, kwargs = self.inputs_at(c.micro_batch, self.seq_len)
        estimates = model_estimates(self.model, self.blocks, args, kwargs, resolve(untiled, stage=None, world_size=self.world_size),
                                    self.world_size, loss_fn=self.loss_fn, cuts={n: self.cut(n) for n in FOLD_BLOCKS})
        if estimates is None:
            self.pinned[key] = None
            return None
        if c.tiling == "on":
            self.pinned[key] = pinned_on(estimates)
            return self.pinned[key]
        budget = self.activation_budget_bytes(c)
        tested: dict[PinnedTiling, dict[int, tuple[Program, ZeroConfig]]] = {}

        def transient_of(rung: PinnedTiling) -> float:
            cut = self.cut_config(untiled.with_keys({"zerofx.tiling": rung.section()}))
            programs: dict[int, tuple[Program, ZeroConfig]] = {}

            def report_at(n: int) -> tuple[ScheduleReport, Plan]:
                if n >= self.blocks.count:
                    self.say_planned_whole(f"tiling auto for micro {c.micro_batch}, sp {c.sequence_parallel}: {rung.describe()}")
                model = self.model if n >= self.blocks.count else self.cut(n)
                program = compile(model, world_size=self.world_size, config=cut, example_inputs=args, example_kwargs=kwargs,
                                  loss_fn=self.loss_fn)
                self.num_captures += 1
                if n < self.blocks.count:
                    programs[n] = (program, cut)
                return program.report(0, comm=self.comm, device=self.device), program.plan

            folded = fold(self.blocks, report_at)
            self.num_lowered += 1
            tested[rung] = programs
            transient = folded.peak_bytes - folded.persistent_bytes
            if self.progress is not None:
                self.progress(f"{time.perf_counter() - self.start_s:.1f} s: tiling auto for micro {c.micro_batch}, sp "
                              f"{c.sequence_parallel}: {rung.describe()}: activations {format_bytes(transient)} (folded) against "
                              f"{format_bytes(budget)}")
            return transient

        chosen, tried = fit_pinned(ladder(estimates), transient_of, budget)
        self.tiling_tried[key] = dict(tried)
        if tested.get(chosen):  # its cut captures serve the group (``cut_capture``)
            self.cut_groups[key] = dict(tested[chosen])
        self.pinned[key] = chosen
        return chosen

    def needless_tiling(self, c: Candidate) -> str:
        """Folded: why ``c``'s tiling ``true`` need not be searched (NOTE [How the whole-job search
        prunes]), or "": ``"auto"`` at the same micro-batch and sequence-parallel size tried the
        same pinned tiling, and it needed no less memory than the one ``"auto"`` kept, which
        tiles less and so runs no slower."""
        if self.blocks is None or c.tiling != "on":
            return ""
        auto = replace(c, tiling="auto").capture_group
        tried, kept = self.tiling_tried.get(auto), self.pinned.get(auto)
        if not tried or kept is None or kept not in tried:
            return ""
        self.config(c)
        pinned = self.pinned.get(c.capture_group)
        if pinned is None or pinned == kept or pinned not in tried or tried[pinned] < tried[kept] * (1 - NO_FIT_TOLERANCE):
            return ""
        return (f"tiling on ({pinned.describe()}) was tried by tiling auto at this micro-batch and sequence-parallel size: "
                f"activations {format_bytes(tried[pinned])} (folded) where {kept.describe()}, which tiles less, needs "
                f"{format_bytes(tried[kept])}: not {NO_FIT_TOLERANCE:.0%} less; not searched")

    def cut(self, n: int) -> nn.Module:
        """Folded: the model cut to ``n`` blocks."""
        assert self.blocks is not None
        if n not in self.cuts:
            self.cuts[n] = with_num_blocks(self.model, self.blocks, n)
        return self.cuts[n]

    def model_state_bytes(self, c: Candidate) -> float:
        """The candidate's model state on the device per rank, from the parameters' shapes alone."""
        if c in self._states:
            return self._states[c]
        plan, cfg = self.shapes_plan(c)
        state = float(sum(plan.estimates.values()))
        if cfg.offload is not None:
            state -= self._device_freed_bytes(plan, cfg)
        self._states[c] = state
        return state

    def shapes_plan(self, c: Candidate) -> tuple[Plan, ZeroConfig]:
        """The candidate's plan from the parameters' shapes alone (no capture), and its config."""
        cfg = resolve(self.candidate_config(c), stage=None, world_size=self.world_size)
        return plan_from_shapes(self.model, cfg, compile_options(cfg, self.world_size)), cfg

    def compute_s(self, c: Candidate, *, fused: bool | None = None) -> float:
        """One micro-step's compute, from the compute model over the capture group's joint graph
        (its fused runs priced as Inductor runs them for an Inductor candidate, or as ``fused``
        says)."""
        group, fused = c.capture_group, self.compiles(c) if fused is None else fused
        key = (*group, fused)
        if key not in self._compute_s:
            if self.blocks is None:
                self._compute_s[key] = estimate_compute_s(self.groups[group].captured.joint, self.device, fused=fused)
            else:
                small, large = (estimate_compute_s(self.group_capture(c, n).captured.joint, self.device, fused=fused) for n in FOLD_BLOCKS)
                # Compute is a sum over nodes: exact from the first two cuts whatever the peak needed.
                self._compute_s[key] = extrapolate(small, large, self.blocks.count)
        return self._compute_s[key]

    def compiles(self, c: Candidate) -> bool:
        """Whether ``c``'s graphs are compiled by Inductor (the search's choice or the config's)."""
        return c.compiler == "inductor" or (c.compiler == "config" and self.base_compiler is GraphCompiler.INDUCTOR)

    def _sharding_comm(self, c: Candidate) -> Any:
        plan, _ = self.shapes_plan(replace(c, offload=NO_OFFLOAD, recompute="off"))
        return estimate_step_comm_s(bucket_bytes(plan), world_size=self.world_size, shard_group_size=int(c.shard_group_size), stage=c.stage,
                                    spec=self.comm)

    def step_floor_s(self, c: Candidate) -> float:
        """What ``c``'s optimizer step takes at least, before lowering it: every micro-step's
        compute (the compute model over the capture's joint graph), or the shard-group model's
        step (NOTE [Hierarchical sharding cost]: communication perfectly overlapped) less
        ``SHARDING_MODEL_MARGIN``, or the host's update of the offloaded optimizer state,
        whichever is longest. Recompute only adds to it."""
        compute = c.accumulation * self.compute_s(c)
        floor = max(compute, self._offloaded_update_s(c))
        if c.stage == 0 or not isinstance(c.shard_group_size, int):
            return floor
        comm = self._sharding_comm(c)
        return max(floor, (1 - SHARDING_MODEL_MARGIN) * (max(compute, comm.intra_s, comm.inter_s) + comm.tail_s))

    def _offloaded_update_s(self, c: Candidate) -> float:
        """The host's update of the records past the device tier, from the shapes alone: the
        offload timeline runs the updates one after another (memory-bound, twice each record's
        bytes), and with the update delayed the step still waits for all of them beyond one
        micro-step, so the step takes at least this (NOTE [The step's I/O timeline])."""
        if c.offload == NO_OFFLOAD:
            return 0.0
        plan, cfg = self.shapes_plan(c)
        return estimate_update_s(int(self._offloaded_bytes(plan, cfg)), CPU_CORE.memory_bytes_per_s)

    def sharding_order(self, c: Candidate) -> tuple[float, float, int] | None:
        """Where the shard-group model (NOTE [Hierarchical sharding cost]) puts ``c`` among the
        shard group sizes of its stage: its predicted step from the buckets and the capture's
        compute estimate, rounded to ties as ``shard_group_size: "auto"`` rounds them, then the
        inter-node seconds, then the larger K first. None when ``c``'s K is not a number."""
        if not isinstance(c.shard_group_size, int) or c.stage == 0:
            return None
        comm = self._sharding_comm(c)
        step_s = estimate_step_s(comm, self.compute_s(c))
        tie = step_s * STEP_TIE_FRACTION or 1e-12
        return round(step_s / tie) * tie, round(comm.inter_s, 9), -c.shard_group_size

    def _records(self, plan: Plan, cfg: ZeroConfig) -> list[tuple[str, int]]:
        """Each trainable parameter's optimizer-state record on this rank, in backward order, as
        the engine's offload plan lists them (zerofx/runtime/offload/plan.py)."""
        mixed = cfg.compute_dtype is not None
        return [(p.fqn, FP32_BYTES * sum(record_numels(p.padded_numel if int(plan.stage) == 0 else p.shard_numel,
                                                      optimizer=plan.optimizer, mixed_precision=mixed)))
                for p in reversed(plan.params) if p.requires_grad]

    def _offloaded_bytes(self, plan: Plan, cfg: ZeroConfig) -> float:
        """The optimizer-state record bytes past the device tier, from the shapes alone."""
        assert cfg.offload is not None
        records = self._records(plan, cfg)
        tiers = cfg.offload.tier_specs(sum(b for _, b in records), device_is_cpu=self.device.memory_is_host)
        device_budget = tiers[Tier.DEVICE].budget_bytes
        return max(sum(b for _, b in records) - device_budget, 0.0)

    def _device_freed_bytes(self, plan: Plan, cfg: ZeroConfig) -> float:
        """What those records take off the device (NOTE [Host offload on a CPU rank] in
        cost_models/offload.py): nothing on a CPU rank unless they go to NVMe, where they are
        counted as all there (the model state is then a lower bound, as the memory bound needs)."""
        assert cfg.offload is not None
        offloaded = self._offloaded_bytes(plan, cfg)
        on_nvme = cfg.offload.device is Tier.NVME
        return estimate_device_freed_bytes(0.0 if on_nvme else offloaded, offloaded if on_nvme else 0.0,
                                           memory_is_host=self.device.memory_is_host)

    def group_capture(self, c: Candidate, n: int) -> Program:
        """Folded: the first program of ``c``'s capture group on the model cut to ``n`` blocks,
        captured from ``c``'s cut config where there is none yet. That config is made only then:
        with ``zerofx.recompute`` "auto" there is none (the cuts are planned without the budget
        "auto" needs; NOTE [Budgets of the cut models]), and such a candidate's group is captured
        by the candidates planned before it."""
        group = self.cut_groups.get(c.capture_group, {})
        if n in group:
            return group[n][0]
        return self.cut_capture(c, self.cut_config(self.config(c)), n)[0]

    def cut_capture(self, c: Candidate, config: ZeroConfig, n: int) -> tuple[Program, ZeroConfig]:
        """Folded: the first program of ``c``'s capture group on the model cut to ``n`` blocks,
        capturing it with ``config`` if there is none yet, and the config it was planned with."""
        assert self.blocks is not None
        group = self.cut_groups.setdefault(c.capture_group, {})
        if n not in group:
            args, kwargs = self.inputs_at(c.micro_batch, self.seq_len)
            program = compile(self.cut(n), world_size=self.world_size, config=config, example_inputs=args, example_kwargs=kwargs,
                              loss_fn=self.loss_fn)
            self.num_captures += 1
            group[n] = (program, config)
        return group[n]

    def cut_program(self, c: Candidate, config: ZeroConfig, n: int) -> Program:
        """Folded: the candidate planned on the model cut to ``n`` blocks, from its group's capture
        of that cut (the capture itself where it was planned with ``config``)."""
        first, planned_with = self.cut_capture(c, config, n)
        return first if planned_with.to_config_dict() == config.to_config_dict() else first.replan(config)

    @staticmethod
    def cut_config(config: ZeroConfig, prefetch_distance: int | None = None) -> ZeroConfig:
        """Folded: the options the cut models are planned with: without the memory budget, at
        ``prefetch_distance`` when given (NOTE [Budgets of the cut models])."""
        keys = {} if prefetch_distance is None else {"zerofx.prefetch_distance": prefetch_distance}
        return config.with_keys(keys, drop=[f"zerofx.{key}" for key in BUDGET_KEYS])

    def program(self, c: Candidate, config: ZeroConfig, *, whole: bool = False) -> Program:
        """The candidate planned from its group's capture, capturing the group's first (folded
        unless ``whole``: the 3-block cut's, the one ``tiled_ops`` reads)."""
        if self.blocks is not None and not whole:
            return self.cut_program(c, self.cut_config(config), FOLD_BLOCKS[1])
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

    def needs_own_capture(self, c: Candidate) -> bool:
        """Whether ``c`` was measured otherwise than its own config plans it: folded, or
        ``auto``-tiled and planned again from a capture whose tiling was fitted for another one
        (its own config would fit tiling to its own timeline)."""
        return c not in self.own_capture and (c in self.folded or c.tiling == "auto")

    def evaluate_own_capture(self, c: Candidate) -> Evaluated:
        """``c`` captured from its own config, as ``zerofx plan --config`` would plan it."""
        config = self.config(c)
        args, kwargs = self.inputs_at(c.micro_batch, self.seq_len)
        program = compile(self.model, world_size=self.world_size, config=config, example_inputs=args, example_kwargs=kwargs,
                          loss_fn=self.loss_fn)
        self.num_captures += 1
        self.num_lowered += 1
        self.own_capture.add(c)
        return self.reported(self.measure(c, program, program.report(0, comm=self.comm, device=self.device),
                                          resolve(config, stage=None, world_size=self.world_size)))

    def tiled_ops(self, c: Candidate) -> tuple[Any, ...]:
        """What the capture of ``c``'s group tiles (capturing it if not done yet)."""
        tiling = self.program(c, self.config(c)).plan.tiling
        return () if tiling is None else tuple(tiling.ops)

    def evaluate(self, c: Candidate, *, best: Evaluated | None = None) -> Evaluated:
        """``c``'s figures. ``best``, the fastest that fits so far: a folded candidate that
        recomputes to the budget is not planned whole when nothing recomputed would be slower.
        Raises ``SearchStopped`` past the deadline (NOTE [A search answers anytime])."""
        if self.deadline_s is not None and time.perf_counter() >= self.deadline_s:
            raise SearchStopped(f"the time limit, after {time.perf_counter() - self.start_s:.1f} s")
        return self.reported(self._evaluate(c, best))

    def reported(self, e: Evaluated) -> Evaluated:
        """``e``, kept as said and told to ``progress`` (when given) with the time, the work so far,
        how many candidates are left at most and the best that fits so far."""
        self.said[e.candidate] = e
        if self.progress is not None:
            if e.lowered:
                what = f"{'fits' if e.fits else 'over budget'}, {format_seconds(e.step_s)} a step, peak {format_bytes(e.peak_bytes)}"
            else:
                what = e.why or "over budget by its memory bound"
            of = "" if self.total is None else f" of at most {self.total}"
            best = max((x for x in self.said.values() if x.fits), key=lambda x: x.tokens_per_s, default=None)
            lead = "none fits yet" if best is None else f"best so far {best.label()}, {best.tokens_per_s:,.0f} tokens/s"
            self.progress(f"{time.perf_counter() - self.start_s:.1f} s, candidate {len(self.said)}{of}, {self.num_lowered} lowered, "
                          f"{self.num_captures} capture{'' if self.num_captures == 1 else 's'}: {e.label()}: {what} ({lead})")
        return e

    def _evaluate(self, c: Candidate, best: Evaluated | None) -> Evaluated:
        config = self.config(c)
        if self.blocks is not None:
            if config.schedule.recompute != RecomputeMode.AUTO.value:
                return self.evaluate_folded(c, config)
            # NOTE [Budgets of the cut models]: every candidate recomputed is the most "auto" can
            # free; only where that fits is the candidate planned whole.
            most = self.evaluate_folded(c, config.with_keys({"zerofx.recompute": True}))
            if not most.fits:
                return most
            if best is not None:
                nothing = config.with_keys({"zerofx.recompute": False})
                floor_s = (1 - FOLDED_STEP_MARGIN) * self.evaluate_folded(c, nothing).step_s
                if floor_s > best.step_s:
                    return Evaluated(c, float("inf"), 0.0, most.peak_bytes, most.model_state_bytes, fits=False, lowered=False,
                                     step_bound_s=floor_s,
                                     why=f"at least {format_seconds(floor_s)} a step with nothing recomputed (folded), slower than "
                                         f"{best.label()} ({format_seconds(best.step_s)}); not planned whole")
            self.folded.discard(c)  # measured whole below, as its config plans it
        program = self.program(c, config, whole=True)
        report = program.report(0, comm=self.comm, device=self.device)
        self.num_lowered += 1
        cfg = resolve(config, stage=None, world_size=self.world_size)
        return self.measure(c, program, report, cfg)

    def evaluate_folded(self, c: Candidate, config: ZeroConfig) -> Evaluated:
        """``c`` planned on the cut models and its figures extrapolated to every block (NOTE [Why
        linear extrapolation is exact here] in zerofx/planner/folding.py), the prefetch distance
        fitted to the budget on the extrapolated peak (NOTE [Budgets of the cut models])."""
        cfg = resolve(config, stage=None, world_size=self.world_size)
        evaluated, peak, distance = self._measure_cuts(c, self.cut_config(config, self.whole_prefetch_distance(c, cfg)), cfg)
        while cfg.schedule.memory_budget_bytes is not None and peak > self.budget_bytes and distance > 0:
            evaluated, peak, distance = self._measure_cuts(c, self.cut_config(config, distance - 1), cfg)
        self.folded.add(c)
        return evaluated

    def whole_prefetch_distance(self, c: Candidate, cfg: ZeroConfig) -> int | None:
        """Folded, stage 3 with an explicit profile and no prefetch distance in the config: the
        distance the planner takes from the profile for the whole model, or None otherwise.

        NOTE [The whole model's prefetch distance]
        Without a distance in the config, stage 3 on an explicit profile gathers as many buckets
        ahead as the largest bucket's gather takes of the compute per bucket
        (``prefetch_from_profile``), and the compute per bucket is the step's over its buckets.
        The buckets outside the blocks (embedding, head) carry little compute, so that average,
        and with it the distance, changes with the number of blocks: the 1b DNA LM at 1,024
        ranks on the H100 profile gets 4 buckets ahead cut to 4 or 5 blocks and 3 whole, and the
        folded peak (3.75 GiB) was that of another plan than the whole model's (3.68 GiB). So the
        cut models are planned at the whole model's distance: from the plan of its parameters'
        shapes and its extrapolated compute estimate, as the planner takes it from its capture."""
        if self.blocks is None or not prefetch_from_the_profile(cfg):
            return None  # before the compute estimate, which captures the cuts
        return whole_prefetch_distance(self.model, cfg, self.world_size, self.compute_s(c, fused=False))

    def say_planned_whole(self, what: str) -> None:
        """Tell ``progress`` that ``what`` is planned on the whole model, the longest step of a
        folded search, before it starts."""
        if self.progress is not None and self.blocks is not None:
            self.progress(f"{time.perf_counter() - self.start_s:.1f} s: {what}: planning all {self.blocks.count} blocks, its cut "
                          f"models do not extrapolate (NOTE [A window that spans blocks], NOTE [Tiling the same in every cut])")

    def _measure_cuts(self, c: Candidate, config: ZeroConfig, cfg: ZeroConfig) -> tuple[Evaluated, float, int]:
        """The folded figures of ``c`` planned with ``config`` on the cut models (NOTE [A window
        that spans blocks] in zerofx/planner/folding.py says which), the extrapolated peak before
        anything is offloaded (the figure ``fit_prefetch`` checks), and the prefetch distance."""
        assert self.blocks is not None
        count = self.blocks.count
        programs: dict[int, Program] = {}

        def report_at(n: int) -> tuple[ScheduleReport, Plan]:
            if n >= count:
                self.say_planned_whole(c.label())
            programs[n] = self.program(c, config, whole=True) if n >= count else self.cut_program(c, config, n)
            return programs[n].report(0, comm=self.comm, device=self.device), programs[n].plan

        folded = fold(self.blocks, report_at)
        if folded.planned_whole:  # captured, if it was, from the cut config (no budget): not ``c``'s own config
            self.own_capture.discard(c)
        self.num_lowered += 1
        low, high = folded.cuts
        recomputed = [0 if programs[n].plan.recompute is None else len(programs[n].plan.recompute.activations) for n in (low, high)]
        plan, _ = self.shapes_plan(c)
        evaluated = self._figures(c, folded.graph_s, folded.peak_bytes, folded.persistent_bytes, plan, cfg, fingerprint="",
                                  recomputed=max(round(extrapolate(*recomputed, count, folded.cuts)), 0))
        return evaluated, folded.peak_bytes, programs[high].plan.prefetch_distance

    def measure(self, c: Candidate, program: Program, report: ScheduleReport, cfg: ZeroConfig) -> Evaluated:
        recomputed = 0 if program.plan.recompute is None else len(program.plan.recompute.activations)
        return self._figures(c, graph_seconds(report), report.peak.live_bytes, report.persistent_bytes, program.plan, cfg,
                             fingerprint=program.plan.fingerprint(), recomputed=recomputed)

    def _figures(self, c: Candidate, spans: Mapping[str, float], peak_bytes: float, persistent_bytes: float, plan: Plan, cfg: ZeroConfig,
                 *, fingerprint: str, recomputed: int) -> Evaluated:
        micro_s = spans.get("forward", 0.0) + spans.get("backward", 0.0)
        sync_s = spans.get("grad_sync", 0.0) + spans.get("param_sync", 0.0)
        records = self._records(plan, cfg)
        offloaded = 0.0
        if cfg.offload is not None:
            options = cfg.offload
            tiers = options.tier_specs(sum(b for _, b in records), device_is_cpu=self.device.memory_is_host)
            offload = plan_offload(records, tiers, buffer_count=options.buffer_count, update_bytes_per_s=CPU_CORE.memory_bytes_per_s,
                                   prefetch_lead_s=spans.get("backward", 0.0), delayed_update=options.delayed_update,
                                   forward_backward_s=micro_s)
            offloaded = estimate_device_freed_bytes(float(offload.bytes_on(Tier.CPU)), float(offload.bytes_on(Tier.NVME)),
                                                    memory_is_host=self.device.memory_is_host)
            update_s = float(offload.estimates["step_s"])
        else:  # the report's update, timed by the profile where it measured one (NOTE [The optimizer update's time])
            update_s = spans.get("optimizer", 0.0)
        step_s = c.accumulation * micro_s + sync_s + update_s
        # NOTE [What Inductor keeps resident]: its modules and code count against the budget.
        peak = max(peak_bytes - offloaded, 0.0) + (inductor_resident_bytes(self.device) if self.compiles(c) else 0.0)
        tokens = self.global_batch * self.seq_len
        return Evaluated(c, step_s, tokens / step_s if step_s > 0 else float("inf"), peak, persistent_bytes - offloaded,
                         fits=peak <= self.budget_bytes, fingerprint=fingerprint, recomputed=recomputed, tiling=self.tiling_detail(c))

    def tiling_detail(self, c: Candidate) -> str:
        """What ``c``'s capture group pins its tiling to (NOTE [One tiling for every cut]), or ""."""
        pinned = self.pinned.get(c.capture_group) if c.tiling in ("auto", "on") else None
        return "" if pinned is None else pinned.describe()


# NOTE [Budgets of the cut models]
# A model of ``AUTO_FOLD_MIN_BLOCKS`` or more repeated blocks is searched folded, as ``zerofx
# plan`` plans it (NOTE [Why linear extrapolation is exact here] in zerofx/planner/folding.py):
# each capture group captures the model cut to 2 and 3 blocks, and each candidate's step, peak
# and model state are extrapolated from both. What the planner fits to ``zerofx.memory_budget``
# would fit the cut models' smaller peaks, so they are planned without it and the prefetch
# distance is lowered here until the extrapolated peak fits; at a fixed distance extrapolation
# is exact, so the whole model fits at the same distance. ``zerofx.recompute: "auto"`` ranks
# activations per graph, which two cuts need not share, so a candidate that recomputes to the
# budget is first planned folded with every activation it may recompute recomputed (the same in
# every block, so exact), the most ``"auto"`` can free. Only where that fits, and the candidate
# folded with nothing recomputed (its step's floor) less ``FOLDED_STEP_MARGIN`` is not slower
# than the best that fits, is it planned whole. The winner is captured whole from its own config
# and must still fit, or the next one is (``MAX_RECAPTURES``); one still planned from another
# capture after that carries a caveat (``AutoPlan.unchecked``). Tiling ``"auto"`` and ``true``
# would tile the cuts otherwise than the whole model (NOTE [Tiling the same in every cut]), so a
# folded capture group's tiling is pinned in its config, chosen for the whole model (NOTE [One
# tiling for every cut] in zerofx/planner/folded_tiling.py).
def _blocks_to_fold(model: nn.Module, fold: str) -> RepeatedBlocks | None:
    """The repeated blocks the search folds (``fold``: "auto" from ``AUTO_FOLD_MIN_BLOCKS``
    blocks, "on" from ``FOLD_BLOCKS[1]``, "off"), or None."""
    if fold == "off":
        return None
    blocks = find_repeated_blocks(model)
    least = AUTO_FOLD_MIN_BLOCKS if fold == "auto" else FOLD_BLOCKS[1]
    return blocks if blocks is not None and blocks.count >= least else None


def _shard_group_sizes(space: SearchSpace, stage: int, world_size: int) -> tuple[int | str, ...]:
    if stage == 0:
        return (world_size,)
    if space.shard_group_sizes is not None:
        return space.shard_group_sizes
    return tuple(reversed(powers_of_two_dividing(world_size, start=2))) or (world_size,)


# NOTE [A search answers anytime]
# A search over a long context takes minutes, and a user who stops it, or gives it a time limit,
# wants the best plan found so far rather than nothing. Every candidate evaluated is kept as it
# is said (``_Search.said``); past ``time_limit_s`` no candidate is started (``SearchStopped``),
# and Ctrl-C (KeyboardInterrupt) ends the candidate under way. The result then ranks what was
# said, chooses the fastest that fits, and does no further work (no recapture of the winner, no
# lowering of what was skipped), so it returns at once; ``AutoPlan.stopped`` says why, and the
# printed result says the search was cut short. The progress lines count candidates against
# ``space_size``, the most the space holds: pruning skips many, so the search usually ends sooner.


class SearchStopped(Exception):
    """The search's time limit has passed (NOTE [A search answers anytime])."""


def space_size(space: SearchSpace, world_size: int, batch: int) -> int:
    """The most candidates ``space`` holds for ``batch`` sequences per rank: what the search would
    try with nothing pruned."""
    total = 0
    for sp in space.sequence_parallel:
        per_group = sum(len(_shard_group_sizes(space, stage, world_size)) for stage in space.stages)
        total += (len(space.tilings) * len(_micro_batches(space, batch * sp)) * per_group * len(space.offloads) * len(space.recomputes)
                  * len(space.compilers))
    return total


def _micro_batches(space: SearchSpace, per_group: int) -> tuple[tuple[int, int], ...]:
    """(micro-batch, accumulation) pairs, smallest micro-batch first."""
    if space.micro_batch is not None:
        assert space.accumulation is not None
        return ((space.micro_batch, space.accumulation),)
    micros = sorted({*powers_of_two_dividing(per_group), per_group})
    return tuple((m, per_group // m) for m in micros)


def search_config(model: nn.Module, example_args: tuple[Any, ...], example_kwargs: Mapping[str, Any], config: ZeroConfig | Mapping[str, Any],
                  *, world_size: int | None, budget_bytes: float, fold: str = "auto", progress: Progress | None = None,
                  time_limit_s: float | None = None) -> AutoPlan:
    """``search`` over what ``config`` (options with ``zerofx.auto``; a dict is parsed here)
    leaves open, at the example inputs' micro-batch and sequence length: what ``zerofx plan
    --auto`` runs. ``world_size`` None takes the config's."""
    cfg = parse_config(config, world_size=world_size)
    world_size = world_size if world_size is not None else cfg.world_size
    batch, seq_len = example_shape(example_args, example_kwargs)
    assert cfg.auto is not None
    space = search_space(cfg, cfg.auto, world_size=world_size, seq_len=seq_len, batch=batch)
    return search(model, resize_inputs(example_args, example_kwargs), cfg, world_size=world_size, seq_len=seq_len, batch=batch,
                  budget_bytes=budget_bytes, space=space, fixed=cfg.auto.fixed, fold=fold, time_limit_s=time_limit_s, progress=progress)


# NOTE [How the whole-job search prunes]
# Capture is the costly part, and it depends only on the capture group (micro-batch,
# sequence-parallel size, tiling): one capture serves every stage, shard group size and offload
# placement of its group (``Program.replan``, NOTE [Planning again from one capture]). A
# candidate is lowered only where it could win (docs/autoplan.md lists each rule with its
# reasons):
# - Memory bound: model state per rank comes from the parameters' shapes; a candidate whose model
#   state plus the smallest transient (peak less model state) measured at its stage and shard
#   group size K exceeds the budget is reported over budget by at least that much. The bound is
#   not shared across stages (stages 0-1 hold every gradient whole until the step ends, 2-3
#   reduce them as the backward goes) nor across K (the buckets in flight change with it), and a
#   candidate that recomputes is bounded only by transients measured with recompute. When every
#   candidate is over by its state alone, the leanest is lowered to say what budget it needs.
# - Order: within a stage (and offload, recompute and compiler setting) K is lowered in the
#   order of the shard-group model's step (NOTE [Hierarchical sharding cost]; ties broken as
#   ``shard_group_size: "auto"`` breaks them), and none after the first that fits.
# - Step floor: a candidate whose floor is longer than the best fitting step is not lowered. The
#   floor is the longest of every micro-step's compute, the shard-group model's step less
#   ``SHARDING_MODEL_MARGIN``, and, offloaded, the host's update of the records past the device.
# - Optimizer offload and recompute only add time, so a candidate with either is tried only for
#   a stage and K over the budget without both, and not for a K behind one that fits without. A
#   larger sequence-parallel size or a tiled capture only saves activations, so it is tried only
#   while some candidate without it is over the budget by its activations alone and, if lowered,
#   faster than the best that fits; sequence-parallel sizes stop at the first doubling that makes
#   nothing fit faster, as activations per rank shrink as 1/S. Micro-batches go smallest first and
#   stop at the first whose leanest candidate is over the budget. A sequence-parallel size whose
#   rewrite refuses the model (``SequenceParallelError``) is not a candidate; the report says why.
# - Folded, tiling ``true`` is not searched where ``"auto"`` tried the same pinned tiling and it
#   needed no less memory than the less tiled one ``"auto"`` kept (NOTE [One tiling for every cut]).
# With tiling ``"auto"`` a capture's tiles fit the candidate it was captured for, so a winner
# planned from another candidate's capture is captured again from its own config, and measured
# as that config plans it, before it is kept (at most ``MAX_RECAPTURES`` times).
def search(model: nn.Module, inputs_at: InputsAt, base_config: ZeroConfig | Mapping[str, Any], *, world_size: int, seq_len: int, batch: int,
           budget_bytes: float, space: SearchSpace, fixed: frozenset[str] = frozenset(), loss_fn: LossFn | None = None,
           fold: str = "auto", progress: Progress | None = None, time_limit_s: float | None = None) -> AutoPlan:
    """The configuration of ``space`` with the most predicted tokens/s whose device peak per rank
    fits ``budget_bytes`` (NOTE [How the whole-job search prunes]).

    ``inputs_at(micro_batch, seq_len)`` gives the model call at that shape; ``batch`` is the
    sequences per rank per optimizer step without sequence parallelism, so the global batch,
    ``batch * world_size``, is the same for every candidate (a sequence group of S ranks shares
    ``batch * S`` sequences per step, in micro-batches). ``base_config`` is the user's options (a
    dict is parsed here, once): the dimensions in ``fixed`` keep its values, and every
    candidate's options are these with the choice written in (``ZeroConfig.with_keys``); the
    chosen one is written out as JSON data (``AutoPlan.config``). ``fold`` ("auto", "on", "off")
    plans a model of repeated blocks from captures cut to 2 and 3 blocks (NOTE [Budgets of the
    cut models]); the winner is then captured whole.
    ``progress`` is given a line per candidate planned, as the search goes (it takes seconds to
    minutes). ``time_limit_s`` bounds the search's seconds, and Ctrl-C stops it too: either way
    the result is the best of the candidates tried, marked ``stopped`` (NOTE [A search answers
    anytime])."""
    start = time.perf_counter()
    global_batch = batch * world_size
    base = parse_config(base_config)
    s = _Search(model, inputs_at, base, world_size=world_size, seq_len=seq_len, global_batch=global_batch,
                budget_bytes=budget_bytes, fixed=fixed, loss_fn=loss_fn, fold=fold, progress=progress,
                deadline_s=None if time_limit_s is None else start + time_limit_s, total=space_size(space, world_size, batch))
    results: list[Evaluated] = []
    not_candidates: list[tuple[str, str]] = []
    stopped = ""
    try:
        for sp in space.sequence_parallel:
            if sp != space.sequence_parallel[0] and results and not _worth_rescuing(results, budget_bytes, global_batch * seq_len,
                                                                                    lambda e: True):
                break  # nothing over the budget that more ranks per sequence could make fit and win (NOTE [How the whole-job search prunes])
            best_before = _best_tokens_per_s(results)
            why = _search_sequence_parallel_size(s, space, sp, batch * sp, results)
            if why is not None:
                not_candidates.append((f"sequence parallelism over {sp} ranks", why))
            if sp != space.sequence_parallel[0] and best_before > 0 and _best_tokens_per_s(results) <= best_before:
                break  # this doubling made nothing fit that wins; the next frees half as much (NOTE [How the whole-job search prunes])
    except SearchStopped as exc:
        stopped = str(exc)
    except KeyboardInterrupt:
        stopped = f"Ctrl-C, after {time.perf_counter() - start:.1f} s"
    if stopped:
        # Every candidate said so far counts, those of a capture group cut short included; no
        # candidate is lowered or captured again after a stop.
        results = list({**{e.candidate: e for e in results}, **s.said}.values())
        ranked = _rank(results, budget_bytes)
        chosen = ranked[0] if ranked and ranked[0].fits else None
        unchecked = ("" if chosen is None or not s.needs_own_capture(chosen.candidate) else
                     "not captured from its own config (the search stopped first); zerofx plan --config FILE plans it as the config says")
        config = None if chosen is None else s.config(chosen.candidate).to_config_dict()
        return AutoPlan(chosen=chosen, ranked=tuple(ranked), not_candidates=tuple(not_candidates), to_fit=(), config=config,
                        budget_bytes=budget_bytes, world_size=world_size, seq_len=seq_len, global_batch=global_batch, profile=s.profile,
                        fixed=tuple(sorted(fixed)), search_s=time.perf_counter() - start, num_captures=s.num_captures,
                        num_lowered=s.num_lowered, memory_margin=base.memory_margin,
                        unchecked=unchecked, stopped=stopped)
    ranked = _rank(results, budget_bytes)
    chosen = ranked[0] if ranked and ranked[0].fits else None
    if chosen is None and results and not any(e.lowered for e in results):
        # Every candidate's model state alone is over the budget: the leanest is lowered so the
        # report can say what budget it needs.
        leanest = min(results, key=lambda e: e.peak_bytes)
        results = [s.evaluate(e.candidate) if e is leanest else e for e in results]
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
        if chosen is None or not s.needs_own_capture(chosen.candidate):
            break
        own = s.evaluate_own_capture(chosen.candidate)
        results = [own if e.candidate == chosen.candidate else e for e in results]
        ranked = _rank(results, budget_bytes)
        chosen = ranked[0] if ranked[0].fits else None
    unchecked = ""
    if chosen is not None and s.needs_own_capture(chosen.candidate):
        unchecked = (f"not captured from its own config: it was planned from another candidate's capture, whose tiling was fitted "
                     f"there; the search captures at most {MAX_RECAPTURES} winners again, and those did not fit as their own "
                     f"configs plan them; zerofx plan --config FILE plans it as the config says")
    to_fit: tuple[str, ...] = ()
    if chosen is None and any(e.lowered for e in ranked):
        to_fit = _what_would_fit(s, ranked)
    config = None if chosen is None else s.config(chosen.candidate).to_config_dict()  # the output: the chosen options as JSON data
    # Every candidate of a pinned capture group names its tiling, lowered or not.
    ranked = tuple(replace(e, tiling=s.tiling_detail(e.candidate)) for e in ranked)
    chosen = None if chosen is None else next(e for e in ranked if e.candidate == chosen.candidate)
    return AutoPlan(chosen=chosen, ranked=ranked, not_candidates=tuple(not_candidates), to_fit=to_fit, config=config,
                    budget_bytes=budget_bytes, world_size=world_size, seq_len=seq_len, global_batch=global_batch, profile=s.profile,
                    fixed=tuple(sorted(fixed)), search_s=time.perf_counter() - start, num_captures=s.num_captures,
                    num_lowered=s.num_lowered, memory_margin=base.memory_margin,
                    unchecked=unchecked)


def _search_sequence_parallel_size(s: _Search, space: SearchSpace, sp: int, per_group: int, results: list[Evaluated]) -> str | None:
    """Every capture group at sequence-parallel size ``sp``, results appended to ``results``;
    why the rewrite refuses the model at ``sp``, or None."""
    # micro-batch -> (the tiled ops of each tiling searched, whether any of its candidates fit)
    tiled: dict[int, dict[tuple[Any, ...], bool]] = {}
    for tiling in space.tilings:
        if tiling != space.tilings[0] and not _worth_rescuing(
                results, s.budget_bytes, s.global_batch * s.seq_len, lambda e: e.candidate.sequence_parallel == sp and e.candidate.tiling in ("off", "config")):
            continue  # nothing untiled over the budget that tiling could make fit and win (NOTE [How the whole-job search prunes])
        for micro, accumulation in _micro_batches(space, per_group):
            group = [Candidate(stage, sp, k, offload, tiling, micro, accumulation, recompute, compiler)
                     for stage in space.stages for k in _shard_group_sizes(space, stage, s.world_size) for offload in space.offloads
                     for recompute in space.recomputes for compiler in space.compilers]
            try:
                needless = s.needless_tiling(group[0])
                if needless:
                    if s.progress is not None:
                        s.progress(f"{time.perf_counter() - s.start_s:.1f} s: micro {micro}, sp {sp}: {needless}")
                    auto = replace(group[0], tiling="auto").capture_group
                    if not any(e.fits for e in results if e.candidate.capture_group == auto):
                        break  # as "auto" here: nothing fit, and a larger micro-batch holds more
                    continue
                ops = s.tiled_ops(group[0])
                seen = tiled.setdefault(micro, {})
                if ops in seen:  # this tiling tiles what another already did: the same candidates again
                    if not seen[ops]:
                        break
                    continue
                evaluated = _search_group(s, group, results)
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


def _best_tokens_per_s(results: Sequence[Evaluated]) -> float:
    return max((e.tokens_per_s for e in results if e.fits), default=0.0)


def _worth_rescuing(results: Sequence[Evaluated], budget_bytes: float, tokens_per_step: float, where: Callable[[Evaluated], bool]) -> bool:
    """Whether some candidate ``where`` picks is over the budget by its activations alone (its
    model state fits) and could be faster than the best that fits (lowered: predicted faster;
    not lowered: its step floor is): the only kind sequence parallelism or tiling, which
    shrink activations and add time, could turn into a winner."""
    best = _best_tokens_per_s(results)

    def could_win(e: Evaluated) -> bool:
        if e.lowered:
            return e.tokens_per_s > best
        return e.step_bound_s <= 0 or tokens_per_step / e.step_bound_s > best

    return any(where(e) and not e.fits and not e.why and e.model_state_bytes <= budget_bytes and could_win(e) for e in results)


def _saves_memory_only(c: Candidate) -> bool:
    """Whether ``c`` trades time for memory beyond its stage and shard group size: the optimizer
    state offloaded, or activations recomputed in the search's own "auto"."""
    return c.offload != NO_OFFLOAD or c.recompute == "auto"


def _search_group(s: _Search, group: Sequence[Candidate], earlier: Sequence[Evaluated] = ()) -> list[Evaluated]:
    """The candidates of one capture group: the shard group sizes of each stage in the
    shard-group model's order, lowered up to the first that fits; offload and recompute only
    where the stage and shard group size are over the budget without them and the shard-group
    model does not put them behind one that fits; those the memory bound rules out not lowered
    (NOTE [How the whole-job search prunes])."""
    plain = [c for c in group if not _saves_memory_only(c)] or list(group)
    savers = [c for c in group if c not in plain]
    out: list[Evaluated] = []
    # The peak less persistent state measured in this group, per stage, shard group size,
    # recompute setting and compiler; offloading the optimizer state leaves it as it is. Neither
    # stage nor K can be shared: stages 0 and 1 hold every gradient whole until the step ends,
    # which stages 2 and 3 reduce into shards (at 1,024 ranks a 1B model's is 4.0 GiB at stage 0
    # against 2.1 GiB at stage 2), and the buckets in flight change with K (at 64 ranks the
    # small model's stage 2 holds 3.45 MiB at K 2 and 2.86 MiB at K 64). Recompute lowers it, so
    # one measured without it bounds nothing with it; Inductor's resident memory is in an
    # Inductor candidate's peak.
    transient: dict[tuple[int, int | str, str, str], float] = {}
    # Per stage, offload, recompute and compiler: the shard-group model's place of the first K that fit.
    first_fit: dict[tuple[int, str, str, str], tuple[tuple[float, float, int], Candidate]] = {}

    def run(candidates: Sequence[Candidate]) -> None:
        states = {c: s.model_state_bytes(c) for c in candidates}
        order = {c: s.sharding_order(c) for c in candidates}
        for c in sorted(candidates, key=lambda c: (c.stage, c.offload, c.recompute, c.compiler, order[c] or (0.0, 0.0, 0), states[c])):
            ahead = [first_fit.get((c.stage, o, r, c.compiler)) for o, r in ((c.offload, c.recompute), (NO_OFFLOAD, "off"))]
            ahead_of = next((f for f in ahead if f is not None and order[c] is not None and order[c] > f[0]), None)
            if ahead_of is not None:
                out.append(Evaluated(c, float("inf"), 0.0, states[c], states[c], fits=False, lowered=False,
                                     why=f"behind {ahead_of[1].label()}, which fits, in the shard-group model's predicted step; not lowered"))
                continue
            bound_s = s.step_floor_s(c)
            best = min((e for e in (*earlier, *out) if e.fits), key=lambda e: e.step_s, default=None)
            if best is not None and bound_s > best.step_s:
                by = "its compute, its offloaded update" if c.offload != NO_OFFLOAD else "its compute"
                out.append(Evaluated(c, float("inf"), 0.0, states[c], states[c], fits=False, lowered=False, step_bound_s=bound_s,
                                     why=f"at least {format_seconds(bound_s)} a step by {by} and the shard-group model, slower than "
                                         f"{best.label()} ({format_seconds(best.step_s)}); not lowered"))
                continue
            least = transient.get((c.stage, c.shard_group_size, c.recompute, c.compiler), float("inf"))
            e = _evaluate_or_bound(s, c, states[c], least, bound_s, best)
            out.append(e if not e.lowered else replace(e, step_bound_s=bound_s))
            if e.lowered:
                transient[(c.stage, c.shard_group_size, c.recompute, c.compiler)] = min(least, e.peak_bytes - e.model_state_bytes)
                if e.fits and order[c] is not None:
                    first_fit.setdefault((c.stage, c.offload, c.recompute, c.compiler), (order[c], c))

    run(plain)
    over = {(e.candidate.stage, e.candidate.shard_group_size) for e in out if e.lowered and not e.fits or not e.lowered and not e.why}
    run([c for c in savers if (c.stage, c.shard_group_size) in over])
    return out


def _evaluate_or_bound(s: _Search, c: Candidate, state: float, transient: float, step_bound_s: float,
                       best: Evaluated | None) -> Evaluated:
    # The peak holds the model state at least, so one over the budget by its state alone is not
    # lowered even before a transient memory is measured (NOTE [How the whole-job search prunes]).
    bound = state + (transient if transient != float("inf") else 0.0)
    if bound > s.budget_bytes:
        return Evaluated(c, float("inf"), 0.0, bound, state, fits=False, lowered=False, step_bound_s=step_bound_s)
    return s.evaluate(c, best=best)


def _rank(results: Sequence[Evaluated], budget_bytes: float) -> tuple[Evaluated, ...]:
    """Those that fit by tokens/s (highest first), then the rest by peak (smallest first), each
    with why it lost to the first."""
    fits = sorted((e for e in results if e.fits), key=lambda e: (-e.tokens_per_s, e.peak_bytes))
    over = sorted((e for e in results if not e.fits), key=lambda e: (bool(e.why), e.peak_bytes, not e.lowered))
    ranked: list[Evaluated] = []
    best = fits[0] if fits else None
    for e in fits:
        if e is best:
            ranked.append(e)
            continue
        slower = 1 - e.tokens_per_s / best.tokens_per_s
        ranked.append(replace(e, why=f"{slower:.1%} slower ({e.tokens_per_s:,.0f} tokens/s)"))
    for e in over:
        if e.why:  # not lowered for another reason than memory (NOTE [How the whole-job search prunes])
            ranked.append(e)
            continue
        by = format_bytes(e.peak_bytes - budget_bytes)
        if e.lowered:
            why = f"over budget by {by} (peak {format_bytes(e.peak_bytes)})"
        elif e.peak_bytes <= e.model_state_bytes:
            why = f"over budget by at least {by} (its model state alone, {format_bytes(e.model_state_bytes)}; not lowered)"
        else:
            why = (f"over budget by at least {by} (model state {format_bytes(e.model_state_bytes)} plus the transient memory "
                   "measured at its capture, stage and shard group size; not lowered)")
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
                          budget_bytes=s.budget_bytes, fixed=s.fixed, loss_fn=s.loss_fn, fold=s.fold, progress=s.progress)
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
