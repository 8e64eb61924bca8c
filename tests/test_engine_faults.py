"""The engine under divergent ranks, a stalled peer and calls out of order: each is a clear error
on every rank within a bounded time, never a crash or a hang (NOTE [Ranks agree before any
collective], NOTE [The engine's call order] in zerofx/runtime/engine.py)."""

from __future__ import annotations

import pytest

from tests.support import fault_workers
from tests.support.dist_utils import run_ranks


@pytest.fixture(scope="module")
def divergence() -> list[dict]:
    return run_ranks(2, fault_workers.divergence_cases)


def test_uneven_input_shapes_are_an_error_on_every_rank_not_a_crash(divergence: list[dict]) -> None:
    for rank, out in enumerate(divergence):
        case = out["uneven"]
        assert case["error"] == "RankDivergenceError", (rank, case)
        assert "rank 0: [2, 16] int64" in case["message"] and "rank 1: [2, 9] int64" in case["message"], case["message"]
        assert out["together"]["error"] is None, out["together"]
        assert out["after"]["error"] is None, out["after"]


def test_program_cache_is_bounded(divergence: list[dict]) -> None:
    assert [out["cache_size"] for out in divergence] == [2, 2]


@pytest.mark.parametrize("case,key", [("clipping", "gradient_clipping"), ("lr", "lr"), ("accumulation", "gradient_accumulation_steps")])
def test_divergent_settings_are_refused_at_initialize(divergence: list[dict], case: str, key: str) -> None:
    for out in divergence:
        assert out[case]["error"] == "RankDivergenceError", out[case]
        assert key in out[case]["message"], out[case]["message"]


def test_other_models_or_graphs_with_the_same_parameters_are_refused(divergence: list[dict]) -> None:
    for out in divergence:
        assert out["heads"]["error"] == "RankDivergenceError", out["heads"]
        assert "different models" in out["heads"]["message"] and "rope_cos" in out["heads"]["message"], out["heads"]
        assert out["graphs"]["error"] == "RankDivergenceError", out["graphs"]
        assert "graph fingerprints" in out["graphs"]["message"], out["graphs"]["message"]


def test_a_stalled_peer_is_an_error_within_the_collective_timeout() -> None:
    first, second = run_ranks(2, fault_workers.stalled_peer, 2.0, 6.0, fresh=True)
    assert second == {"stalled": True}
    assert first["error"] == "CollectiveTimeoutError", first
    assert first["elapsed_s"] < 10.0, first
    message = first["message"]
    assert "rank 0" in message and "backward graph" in message and "_c10d_functional" in message, message
    assert "zerofx.collective_timeout_s" in message, message


def test_calls_out_of_order_are_refused_and_change_nothing() -> None:
    for out in run_ranks(2, fault_workers.call_order):
        assert out["step_first"]["error"] == "EngineStateError", out["step_first"]
        assert "without engine.backward()" in out["step_first"]["message"]
        assert out["unchanged"] and out["global_steps"] == 0
        assert out["forward_step"]["error"] == "EngineStateError", out["forward_step"]
        assert out["backward_twice"]["error"] == "EngineStateError", out["backward_twice"]
        assert "twice" in out["backward_twice"]["message"]
        assert out["recovers"]["error"] is None, out["recovers"]
        # A model with nothing to train is named, not a StopIteration or torch's empty-list error.
        assert out["no_params"]["error"] == "ZeroFXError" and "has no parameters" in out["no_params"]["message"]
        assert out["all_frozen"]["error"] == "ZeroFXError" and "frozen" in out["all_frozen"]["message"]


# gloo's op types, by the c10d op that issues them, whose names fit in a std::string's 15-character
# inline buffer (NOTE [gloo's completion race] in passes/zero/gather_into_buffers.py). Not allowed:
# allgather_into_tensor_coalesced_ (ALLGATHER_COALESCED), allreduce_coalesced_
# (ALLREDUCE_COALESCED), _reduce_scatter_base_ (_REDUCE_SCATTER_BASE).
SHORT_NAMED_GLOO_OPS = {
    "c10d::_allgather_base_",  # _ALLGATHER_BASE
    "c10d::allreduce_",  # ALLREDUCE
    "c10d::reduce_scatter_tensor_coalesced_",  # gloo runs it as an ALLREDUCE of a copy
    "c10d::alltoall_base_",  # ALLTOALL_BASE: a reduce-scatter on gloo (passes/zero/reduce_scatter_all_to_all.py)
    "c10d::broadcast_", "c10d::allgather_", "c10d::barrier",
}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_step_issues_only_short_named_gloo_ops(stage: int) -> None:
    for ops in run_ranks(2, fault_workers.gloo_ops_of_a_step, stage):
        assert "c10d::_allgather_base_" in ops and "c10d::allreduce_" in ops, ops
        # gloo's reduce-scatters go out as all-to-alls (NOTE [gloo's reduce-scatter as an all-to-all])
        assert "c10d::alltoall_base_" in ops and "c10d::reduce_scatter_tensor_coalesced_" not in ops, ops
        assert set(ops) <= SHORT_NAMED_GLOO_OPS, sorted(set(ops) - SHORT_NAMED_GLOO_OPS)


@pytest.mark.multiprocess
def test_a_nonfinite_step_names_its_step_rank_and_parameter_or_is_skipped() -> None:
    """World 2, SGD. Step 3 on rank 1 gives w's last gradient element a NaN (sqrt's gradient at 0
    times 0) with a finite loss, or (``loss``) a NaN loss. By default (stage 3) every rank raises
    ``NonFiniteError`` naming optimizer step 3, rank 1 (at stage 3 it holds w's last two elements)
    and ``'w'``, or rank 1's loss; the parameters stay as they were and the next clean step trains
    on. With ``zerofx.nonfinite`` "skip" (stage 0) the step is skipped on every rank instead;
    "off" updates with the NaN, as an unchecked step would (NOTE [Non-finite values])."""
    import torch

    cases = {"grad": (3, None, "grad"), "loss": (1, "error", "loss"), "skip": (0, "skip", "grad"), "off": (2, "off", "grad")}
    results = {name: run_ranks(2, fault_workers.nonfinite_steps, *args) for name, args in cases.items()}
    for rank, out in enumerate(results["grad"]):
        assert out["error"] == "NonFiniteError", (rank, out)
        assert "optimizer step 3: non-finite values, rank 1: the gradient of 'w' holds 1 nan of its 2 element(s) here" in out["message"]
        assert "rank 0" not in out["message"], out["message"]  # its shard of w (elements 0 and 1) is finite
    for rank, out in enumerate(results["loss"]):
        assert out["error"] == "NonFiniteError", (rank, out)
        # Column 3's NaN reaches only w[3] and v[3], in rank 1's shard (stage 1): rank 0 has nothing to report.
        assert "optimizer step 3: non-finite values, rank 1: the loss of micro-batch 0 is nan. " in out["message"], out["message"]
    for name in ("grad", "loss", "skip"):
        for rank, out in enumerate(results[name]):
            assert all(torch.equal(out["before"][k], out["after"][k]) for k in out["before"]), (name, rank)
            assert all(torch.isfinite(t).all() and not torch.equal(t, out["after"][k]) for k, t in out["final"].items()), (name, rank)
    assert [(out["error"], out["skipped"], out["global_steps"]) for out in results["skip"]] == [(None, 1, 4)] * 2
    assert [(out["skipped"], out["global_steps"]) for out in results["grad"]] == [(0, 3)] * 2  # the failed step is not counted
    for out in results["off"]:
        assert out["error"] is None and not torch.isfinite(out["after"]["w"]).all()
