"""Sequence parallelism with each rank's graphs compiled by Inductor (``"zerofx": {"compile":
"inductor"}``): one model that holds every sequence mixer (attention by Ulysses and by ring, the
halo of a short conv, the channel all-to-all of an FFT conv, the cumsum's prefix, a scan by state
passing, and a flip), trained in real gloo process groups against plain single-process PyTorch.

One model and one call of the ranks keep the compiles few: Inductor's cost on CI's two cores is
its C++ kernels, and the second configuration reuses every kernel the first compiled that it
holds too."""

from __future__ import annotations

import pytest

from tests.support import sp_inductor_workers as workers
from tests.support.dist_utils import run_ranks

STEPS = 3
# The FX graphs of this model match plain PyTorch within 1e-7 after 3 steps. Inductor fuses the
# element-wise chains and reductions between the library calls, which reorders fp32 sums:
# ulp-level differences, measured 1e-7 here too. A mixer that exchanged the wrong positions or
# channels, or a gradient reduced twice, moves the state by more than 1e-3.
TOL = 1e-5
# Forward all-to-alls: the rank's position in its group and the loss's sum and count (2), one per
# short conv (the halo), three per FFT conv (signal and filter to channels, output back), one per
# cumsum (the totals) and per scan (its state and decay), two per flip, and two per Ulysses
# attention (q, k and v to heads, the output back; ring attention exchanges inside its own op).
# Backward: the gradient of each that carries one (not the first two).
EXCHANGES = 1 + 3 + 1 + 2 * 1 + 2 * 2


@pytest.mark.inductor
def test_every_mixer_compiled_by_inductor_matches_plain_pytorch() -> None:
    """Two ranks, one sequence group: Ulysses and ring attention each at stages 0 and 3, ring at
    stage 3 with each rank's slice tiled in chunks of 8 (the token-wise regions and the loss),
    each with every other mixer; 3 SGD steps, with ignored labels. Each rank's own compiles are
    cache hits of what its child compiled first (NOTE [Inductor compiles first in a child]), the
    backward too, whose saved values' fakes and real tensors differ in the strides of dimensions of
    size 1 (NOTE [Inductor's cache needs a shape environment])."""
    cases = [(0, "ulysses", False), (3, "ring", True), (3, "ulysses", False), (0, "ring", False)]
    expected = workers.reference(STEPS)
    initial = workers.reference(0)
    assert max((expected["state"][k] - v).abs().max().item() for k, v in initial["state"].items()) > 1e-3  # training moved
    results = run_ranks(2, workers.train, cases, STEPS)
    for case in cases:
        _, attention, tiled = case
        for rank, by_case in enumerate(results):
            res = by_case[case]
            assert res["compiled"] == ["backward", "forward"], (rank, case)
            assert res["cache"] == {"fxgraph_cache_hit": 2}, (rank, case, res["cache"])
            assert res["state"].keys() == expected["state"].keys()
            diff = max((res["state"][k].double() - v.double()).abs().max().item() for k, v in expected["state"].items())
            assert diff < TOL, (rank, case, diff)
            assert res["losses"] == pytest.approx(expected["losses"], abs=TOL), (rank, case)
            exchanges = EXCHANGES + 2 * (attention == "ulysses")
            assert res["all_to_alls"] == {"forward": 2 + exchanges, "backward": exchanges}, (rank, case)
            assert res["rings"] == ({"forward": 1, "backward": 1} if attention == "ring" else {"forward": 0, "backward": 0}), (rank, case)
            assert ("loss" in res["tiled"] and "region" in res["tiled"]) if tiled else not res["tiled"], (rank, case, res["tiled"])
        decision = next(d for d in results[0][case]["decisions"] if d.startswith("sequence parallelism ("))
        assert decision.startswith(f"sequence parallelism ({attention}, halo, channels, prefix, state_passing, all_to_all) over 2 ranks")
        for mixer in ("1 attention(s)", "1 short convolution(s)", "1 FFT convolution(s)", "1 cumsum(s)",
                      "2 selective scan(s) by state passing", "2 flip(s) along the sequence"):
            assert mixer in decision, (case, decision)
