"""The budget searches shared by ``zerofx.compile`` and ``zerofx plan --fold`` (NOTE [Prefetch under
a memory budget], NOTE [Recompute under a memory budget]), on stub peaks: no capture."""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

from zerofx.compiler.search import fit_recompute, lower_prefetch_distance
from zerofx.passes.plan_recompute import RecomputeMode

PEAKS = {3: 40.0, 2: 30.0, 1: 20.0, 0: 15.0}  # bytes at each prefetch distance


def _search(budget: float):
    calls: list[int] = []

    def replan(distance: int) -> tuple[str, int, float]:
        calls.append(distance)
        return f"plan at {distance}", distance, PEAKS[distance]

    return lower_prefetch_distance("plan at 3", 3, PEAKS[3], budget, replan), calls


def test_lowers_one_distance_at_a_time_to_the_first_that_fits() -> None:
    search, calls = _search(25.0)
    assert calls == [2, 1] and search.result == "plan at 1"
    assert search.tried == ((3, 40.0), (2, 30.0), (1, 20.0)) and search.lowered and search.fits
    assert search.decision("x") == "prefetch distance lowered from 3 to 1 for the memory budget 25 B (x)"


def test_keeps_the_first_plan_when_it_fits_and_stops_at_zero_when_none_does() -> None:
    roomy, calls = _search(40.0)
    assert calls == [] and roomy.result == "plan at 3" and not roomy.lowered and roomy.fits
    hopeless, calls = _search(1.0)
    assert calls == [2, 1, 0] and hopeless.result == "plan at 0" and not hopeless.fits


class _Stub:
    """What ``fit_recompute`` reads of a program: its peak, its recompute plan, its decisions."""

    def __init__(self, count: int, peak: float) -> None:
        self.count, self.peak, self.decisions = count, peak, []
        self.plan = SimpleNamespace(recompute=SimpleNamespace(activations=range(count)) if count else None)

    def report(self, rank: int):
        return SimpleNamespace(peak=SimpleNamespace(live_bytes=self.peak))

    def with_decision(self, why: str) -> _Stub:
        self.decisions.append(why)
        return self


def _fit(peak_of, n: int, budget: float, freed: list[float] | None = None):
    calls: list[int] = []

    def replan(count: int) -> _Stub:
        calls.append(count)
        return _Stub(count, peak_of(count))

    chosen = fit_recompute(_Stub(0, peak_of(0)), replan, n, mode=RecomputeMode.AUTO, budget_bytes=budget, freed_bytes=freed or ())
    return chosen, calls


def test_recompute_search_finds_the_fewest_that_fit_in_few_lowerings() -> None:
    """NOTE [Recompute under a memory budget]: where the peak falls as the freed bytes do, the
    interpolated search lands beside the boundary; it finds what bisection finds."""
    rng = random.Random(0)
    n = 370
    freed = [rng.uniform(1, 100) for _ in range(n)]
    cumulative = [0.0, *itertools.accumulate(freed)]
    for budget_share in (0.1, 0.37, 0.5, 0.83, 0.99):
        budget = 10_000 - budget_share * cumulative[-1] * 0.9

        def peak(count: int) -> float:  # each candidate frees 90% of its bytes at the peak
            return 10_000 - 0.9 * cumulative[count]  # noqa: B023 (called only within this iteration)

        fewest = next(c for c in range(n + 1) if peak(c) <= budget)
        guided, guided_calls = _fit(peak, n, budget, freed)
        bisected, bisected_calls = _fit(peak, n, budget)
        assert guided.count == bisected.count == fewest
        assert fewest - 1 in (0, *guided_calls)  # the count below was tried: it does not fit
        assert len(guided_calls) <= 4 < len(bisected_calls), (budget_share, guided_calls, bisected_calls)


def test_recompute_search_stays_within_twice_bisection_when_the_bytes_mislead() -> None:
    """A peak that falls in steps the freed bytes do not predict: the search still closes on the
    boundary, in at most about twice bisection's tries."""
    n = 370
    freed = [1000.0] + [1.0] * (n - 1)  # the bytes say the first candidate frees almost everything
    for boundary in (2, 50, 185, 300, 369):
        def peak(count: int, boundary: int = boundary) -> float:
            return 100.0 if count < boundary else 10.0

        chosen, calls = _fit(peak, n, 50.0, freed)
        assert chosen.count == boundary
        assert len(calls) <= 2 * math.ceil(math.log2(n)) + 1, (boundary, calls)
