"""The budget search shared by ``zerofx.compile`` and ``zerofx plan --fold`` (NOTE [Prefetch under
a memory budget]), on stub peaks: no capture."""

from __future__ import annotations

from zerofx.compiler.search import lower_prefetch_distance

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
