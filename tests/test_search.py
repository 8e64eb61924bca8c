"""The budget searches shared by ``zerofx.compile`` and ``zerofx plan --fold`` (NOTE [Prefetch under
a memory budget], NOTE [Recompute under a memory budget]), on stub peaks: no capture."""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

from zerofx.planner.fit import fit_recompute, lower_prefetch_distance
from zerofx.passes.plan.recompute import RecomputeMode

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



def test_recompute_search_tries_fewer_when_every_one_peaks_too_high() -> None:
    """NOTE [Recompute under a memory budget]: every candidate recomputed can peak above fewer.
    When all do not fit, half is tried; if that fits, the fewest that fit below it are found;
    else the least peak tried is kept, none recomputed where recomputing only added to it."""
    n = 100

    def valley(count: int) -> float:  # falls to 50 at 40 recomputed, then climbs back past the start
        return 100.0 - 1.25 * count if count <= 40 else 50.0 + 1.5 * (count - 40)

    chosen, calls = _fit(valley, n, 66.0)  # every one: 140; half: 65
    assert calls[:2] == [n, n // 2] and chosen.count == 28  # the fewest: 100 - 1.25 * 28 = 65
    assert "kept 28, which fit" in chosen.decisions[0] and all(c < n // 2 for c in calls[2:])
    chosen, calls = _fit(valley, n, 10.0)  # nothing fits: the least peak tried (50 recomputed: 65)
    assert calls == [n, n // 2] and chosen.count == n // 2 and "do not fit" in chosen.decisions[0]
    chosen, calls = _fit(lambda count: 100.0 + count, n, 10.0)  # recompute only adds: none kept
    assert calls == [n, n // 2] and chosen.count == 0 and "kept 0, which do not fit" in chosen.decisions[0]

# NOTE [One tiling for every cut] (zerofx/planner/folded_tiling.py): stub tiling plans and
# stub folded timelines.
def _stub_tiling_plans(per_block: dict[int, dict[str, int]], outside: dict[int, dict[str, int]], seq_len: int = 1024):
    """``plan_of(n, options)`` for a model whose every block saves ``per_block[block][kind]`` and
    whose head saves ``outside[block][kind]``, with 100 untiled bytes per block and 50 outside."""
    from zerofx.passes.plan.tiling import TiledOp, TilingPlan

    def plan_of(n: int, options):
        block = options.block_size or 512
        ops = [TiledOp(kind, i, f"{kind} #{i}", (1,), block, saved, 0) for i in range(n) for kind, saved in per_block[block].items()]
        ops += [TiledOp(kind, 0, kind, (1,), block, saved, 0) for kind, saved in outside[block].items()]
        return TilingPlan(seq_len=seq_len, num_candidates=(0,) * 5, ops=tuple(ops), estimate_untiled_bytes=100 * n + 50)

    return plan_of


def test_folded_tiling_estimates_are_the_whole_models() -> None:
    from zerofx.planner.folded_tiling import ladder, pinned_on, whole_estimates
    from zerofx.passes.plan.tiling import TilingOptions

    per_block = {512: {"attention": 30, "region": 20}, 256: {"attention": 30, "region": 25}}
    outside = {512: {"loss": 10}, 256: {"loss": 12}}
    estimates = whole_estimates(_stub_tiling_plans(per_block, outside), (2, 3), 10)
    assert estimates is not None and estimates.blocks == (512, 256)  # 2 and 4 chunks of 1,024 tokens
    assert estimates.untiled_bytes == 100 * 10 + 50
    assert dict(estimates.saved[512]) == {"attention": 300, "region": 200, "loss": 10}
    assert estimates.tiled_bytes(("attention", "region", "loss"), 256) == 1050 - 300 - 250 - 12
    # "auto": kinds by what they save at the largest block, then smaller blocks.
    assert [(r.kinds, r.block_size) for r in ladder(estimates)] == [
        (("attention",), 512), (("attention", "region"), 512), (("attention", "region", "loss"), 512),
        (("attention", "region", "loss"), 256)]
    # true: every kind, the largest block whose whole-model estimate fits.
    def on(budget: int, **kw) -> object:
        return pinned_on(estimates, TilingOptions(enabled=True, budget_bytes=budget, **kw))

    assert on(540).block_size == 512 and on(539).block_size == 256
    assert on(1).block_size == 256  # none fits: the smallest
    section = on(540).section()
    assert on(540, kinds=("attention", "loss")).kinds == ("attention", "loss")
    assert section == {"enabled": True, "block_size": 512, "attention": True, "region": True, "loss": True, "conv": False}


def test_folded_tiling_bisects_for_the_least_tiled_that_fits() -> None:
    from zerofx.planner.folded_tiling import PinnedTiling, fit_pinned

    rungs = [PinnedTiling(("region",), 4096 >> i) for i in range(7)]
    transient = {r: 1000 - 100 * i for i, r in enumerate(rungs)}  # more tiled, less memory
    for budget, want in ((950, 1), (600, 4), (400, 6), (100, 6), (2000, 0)):
        calls: list[PinnedTiling] = []
        chosen, tried = fit_pinned(rungs, lambda r, calls=calls: calls.append(r) or transient[r], budget)
        assert chosen == rungs[want], budget
        assert len(calls) == len(set(calls)) <= math.ceil(math.log2(len(rungs))) + 1
        assert [t for _, t in tried] == sorted((transient[r] for r in calls), reverse=True)
    # None fits and more tiling stops freeing memory: the least tiled of those that need the least.
    # Two blocks that free nothing between them end the search before the smallest block's fold.
    flat = {r: max(1000 - 100 * i, 700) for i, r in enumerate(rungs)}
    chosen, tried = fit_pinned(rungs, flat.__getitem__, 500)
    assert chosen == rungs[3] and all(t > 500 for _, t in tried)
    assert [r for r, _ in tried] == [rungs[3], rungs[5]]
    # Only rungs of every kind end it; here the smallest block would have fitted: the price of
    # skipping the costliest fold once memory has stopped falling.
    kinds_first = [PinnedTiling(("attention",), 4096), PinnedTiling(("attention", "region"), 4096),
                   *(PinnedTiling(("attention", "region"), 2048 >> i) for i in range(3))]
    steps = dict(zip(kinds_first, (1000, 1000, 1000, 995, 400), strict=True))
    chosen, tried = fit_pinned(kinds_first, steps.__getitem__, 500)
    assert chosen == kinds_first[2] and [r for r, _ in tried] == kinds_first[2:4]
