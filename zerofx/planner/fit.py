"""Budget searches: plan again until the step fits a memory budget.

Each search builds candidates through a callback (a capture, plan and lowering, or a folded
plan) and measures them on the lowered graphs' memory timeline. A plan is rebuilt, never
patched: the rewrites read only the Plan. The candidates are ``Program``s, seen here through
``Planned`` (their plan, their report, ``with_decision``), so this module imports no compiler:
it is the planner's layer below ``zerofx.compiler``, whose spine calls it (NOTE [Layers] in
pyproject.toml), as the folded plan does (``zerofx.planner.folded_plan``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from zerofx.passes.analysis.analyze_schedule import ScheduleReport
from zerofx.common.units import format_bytes
from zerofx.passes.plan import Plan
from zerofx.passes.plan.recompute import RecomputeMode
from zerofx.passes.plan.tiling import TilingOptions

log = logging.getLogger("zerofx.tiling")

T = TypeVar("T")
P = TypeVar("P", bound="Planned")


class Planned(Protocol):
    """What a search reads of a candidate (``zerofx.Program``)."""

    setup_times: dict[str, float]  # seconds per setup phase ("capture", "plan", "lower")

    @property
    def plan(self) -> Plan: ...

    def report(self, rank: int) -> ScheduleReport: ...

    def with_decision(self: P, why: str) -> P: ...


# NOTE [Prefetch under a memory budget]
# Each bucket prefetched ahead keeps one more gathered bucket alive, so the step's peak grows
# with the distance. The planner's distance obeys stage3_max_live_parameters; the search lowers
# it, one at a time, until the memory model's peak (the lowered graphs' timeline, or folding's
# extrapolation of it) fits the budget, or no prefetch is left. Each distance is planned anew.
@dataclass(frozen=True)
class PrefetchSearch(Generic[T]):
    """What ``lower_prefetch_distance`` kept, and each (distance, peak bytes) it tried, in order."""

    result: T
    tried: tuple[tuple[int, float], ...]
    budget_bytes: float

    @property
    def lowered(self) -> bool:
        return len(self.tried) > 1

    @property
    def fits(self) -> bool:
        return self.tried[-1][1] <= self.budget_bytes

    def decision(self, peaks: str) -> str:
        """The plan's note for a lowered distance, ``peaks`` saying what was measured."""
        return (f"prefetch distance lowered from {self.tried[0][0]} to {self.tried[-1][0]} for the memory budget "
                f"{format_bytes(self.budget_bytes)} ({peaks})")


def lower_prefetch_distance(first: T, distance: int, peak_bytes: float, budget_bytes: float,
                            replan: Callable[[int], tuple[T, int, float]]) -> PrefetchSearch[T]:
    """From ``first``, planned at ``distance`` with ``peak_bytes``, ``replan(distance - 1)`` ->
    (candidate, its distance, its peak bytes) while the peak exceeds the budget and a distance
    is left (NOTE [Prefetch under a memory budget])."""
    result, tried = first, [(distance, peak_bytes)]
    while peak_bytes > budget_bytes and distance > 0:
        result, distance, peak_bytes = replan(distance - 1)
        tried.append((distance, peak_bytes))
    return PrefetchSearch(result, tuple(tried), budget_bytes)


def fit_prefetch(first: P, replan: Callable[[int], P], budget_bytes: float | None) -> P:
    """``first``, or the program ``replan(distance)`` at the largest lower distance whose
    estimated peak on rank 0 fits the budget, with a decision that lists each peak tried."""
    if budget_bytes is None or first.plan.prefetch_distance == 0:
        return first

    def measured(program: P) -> tuple[P, int, int]:
        return program, program.plan.prefetch_distance, program.report(0).peak.live_bytes

    search = lower_prefetch_distance(*measured(first), budget_bytes, lambda d: measured(replan(d)))
    if not search.lowered:
        return search.result
    steps = ", ".join(f"{format_bytes(b)} at distance {d}" for d, b in search.tried)
    verdict = "fits" if search.fits else "does not fit even without prefetch"
    return search.result.with_decision(search.decision(f"estimated peak {steps}; {verdict}"))


# NOTE [Tiling checked against the memory timeline]
# ``auto`` tiling chooses from per-op estimates that are upper bounds (NOTE [What the estimates
# mean] in passes/tiling/plan_tiling.py): a region counts every token-wise output as saved, where the
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


def fit_tiling(first: P, build: Callable[[TilingOptions], P], options: TilingOptions | None) -> P:
    """``first``, captured with ``options``, or what ``build`` captures with other tiling options
    that fits the budget better, when tiling is ``auto`` (NOTE [Tiling checked against the
    memory timeline])."""
    if options is None or options.enabled != "auto" or first.plan.tiling is None:
        return first
    budget = first.plan.tiling.budget_bytes
    tried: list[tuple[str, P, int]] = []

    def attempt(what: str, program: P) -> int:
        report = program.report(0)
        tried.append((what, program, report.peak.live_bytes - report.persistent_bytes))
        return tried[-1][2]

    def ops(program: P) -> tuple:
        return program.plan.tiling.ops if program.plan.tiling is not None else ()

    def sequence_ops(program: P) -> tuple:
        return tuple(op for op in ops(program) if op.kind != "weight")

    # Weight tiles follow weight_tile_bytes, not the activation budget (NOTE [Weight tiles] in
    # passes/tiling/plan_tiling.py): "untiled" here means no sequence tiling, with the weights as planned.
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
           f"(NOTE [Tiling checked against the memory timeline]): the estimates alone tile {len(sequence_ops(first))} ops; "
           f"{steps}; kept {len(sequence_ops(chosen))} tiled ops, "
           f"which {'fit' if fits else 'do not fit'}")
    log.info(why)
    return chosen.with_decision(why)


# NOTE [Recompute under a memory budget]
# The candidates of ``recompute_candidates`` come ranked by bytes freed per second of recompute,
# round after round (NOTE [Selective activation recompute], NOTE [Recompute in rounds] in
# passes/memory/plan_recompute.py); taking more frees more.
# Under "auto" the search keeps the plan as it is when its lowered graphs' peak fits the budget;
# otherwise it lowers every candidate recomputed, and when that fits, searches for the fewest
# best-ranked candidates that fit, each count planned and lowered anew. The search keeps a
# bracket (a count over the budget, a count that fits) and tries the count where the peak
# would cross the budget if it fell in proportion to the bytes the candidates free
# (``freed_bytes``); a try that did not halve the bracket is followed by one at its middle, so
# it never takes more than about twice bisection's log2 of the candidates. Each try lowers the
# whole step, seconds to a minute on a long context. On the 25m DNA LM at 2,048 tokens, 4
# ranks, stage 3, a 600 MiB budget: 7 lowerings where bisection took 9, the same 21 of 208
# candidates kept, the plan 13.8 s against 17.4 s. Where the peak falls as the freed bytes do,
# the interpolation lands beside the boundary in two or three tries. Either way the bracket
# closes on neighbouring counts, the fit of the larger kept, as bisection's would.
# The peak need not fall all the way: every candidate recomputed can peak above fewer (the 1b
# DNA LM at stage 3, K 2: 2,358.8 MiB with every one recomputed, 2,320.5 MiB with none). So
# when every candidate does not fit, half of them is tried too; if that fits the bracket search
# runs below it, else the least peak tried is kept (none recomputed where recomputing only added
# to it), and the plan says it does not fit. "all" takes every candidate without a budget.
def _interpolated_count(cumulative: Sequence[float], low: tuple[int, float], high: tuple[int, float], budget_bytes: float) -> int | None:
    """The count strictly inside the bracket ``low``..``high`` ((count, peak) pairs) at which
    the peak would reach ``budget_bytes`` if it fell in proportion to ``cumulative`` (the
    bytes the first n candidates free, by n); None when the bytes say nothing there."""
    (n_low, peak_low), (n_high, peak_high) = low, high
    span = cumulative[n_high] - cumulative[n_low]
    if span <= 0 or peak_low <= peak_high:
        return None
    share = (peak_low - budget_bytes) / (peak_low - peak_high)
    target = cumulative[n_low] + share * span
    count = bisect.bisect_left(cumulative, target, lo=n_low, hi=n_high + 1)
    return min(max(count, n_low + 1), n_high - 1)


def fit_recompute(first: P, replan: Callable[[int], P], num_candidates: int, *, mode: RecomputeMode,
                  budget_bytes: float | None, freed_bytes: Sequence[float] = ()) -> P:
    """``first`` (no recompute), or ``replan(count)`` with the first ``count`` candidates
    recomputed (NOTE [Recompute under a memory budget]); ``freed_bytes``, each candidate's bytes
    in rank order, guides the search (without it, it bisects)."""
    if mode is RecomputeMode.OFF or num_candidates == 0:
        return first
    if mode is RecomputeMode.ALL:
        return replan(num_candidates)

    def peak(program: P) -> int:
        return program.report(0).peak.live_bytes

    assert budget_bytes is not None, "zerofx.recompute \"auto\" needs zerofx.memory_budget (the config checks it)"
    first_peak = peak(first)
    if first_peak <= budget_bytes:
        return first
    tried = [(0, first_peak)]
    every = replan(num_candidates)
    tried.append((num_candidates, peak(every)))
    chosen, fits = every, tried[-1][1] <= budget_bytes
    high = tried[-1]
    if not fits and num_candidates > 1:  # the peak need not fall with the count: try half of them too
        half = replan(num_candidates // 2)
        tried.append((num_candidates // 2, peak(half)))
        fits = tried[-1][1] <= budget_bytes
        if fits or tried[-1][1] < tried[1][1]:
            chosen, high = half, tried[-1]
    if not fits and first_peak <= min(b for _, b in tried[1:]):
        chosen = first  # recomputing added to the peak: none kept
    if fits:
        cumulative = [0.0, *itertools.accumulate(freed_bytes)] if len(freed_bytes) == num_candidates else []
        low = (0, first_peak)  # (count, peak): low does not fit, high does
        bisect_next = False  # an interpolated try that did not halve the bracket is followed by a bisection
        while high[0] - low[0] > 1:
            width = high[0] - low[0]
            guess = None if bisect_next or not cumulative else _interpolated_count(cumulative, low, high, budget_bytes)
            count = (low[0] + high[0]) // 2 if guess is None else guess
            program = replan(count)
            tried.append((count, peak(program)))
            if tried[-1][1] <= budget_bytes:
                high, chosen = tried[-1], program
            else:
                low = tried[-1]
            bisect_next = guess is not None and high[0] - low[0] > width / 2
    count = len(chosen.plan.recompute.activations) if chosen.plan.recompute is not None else 0
    steps = ", ".join(f"{format_bytes(b)} with {n}" for n, b in sorted(tried))
    why = (f"recompute (auto) for the memory budget {format_bytes(budget_bytes)}: estimated peak {steps} of {num_candidates} "
           f"saved activations recomputed; kept {count}, which {'fit' if fits else 'do not fit'}")
    log.info(why)
    return chosen.with_decision(why)
