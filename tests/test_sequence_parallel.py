"""Sequence parallelism (``zerofx.sequence_parallel``): parity with plain single-process PyTorch
on the same global batch in real gloo process groups, the config's checks, and the ops the
rewrite refuses by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zerofx
from tests.support import sequence_parallel_workers as workers
from tests.support.dist_utils import run_ranks
from zerofx.errors import CaptureError, ConfigError
from zerofx.training import TrainOptions, _cycle_batches, check_train_options, data_layout

STEPS = 3
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "dna_lm_sp.json"


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def check(results: list[dict], case: tuple[str, int, int], world_size: int) -> None:
    kind, stage, size = case
    expected = workers.reference(world_size // size, STEPS, kind)
    for rank, by_case in enumerate(results):
        res = by_case[case]
        assert max_diff(res["state"], expected["state"]) < 1e-5, (rank, case)
        group_losses = [step[rank // size] for step in expected["losses"]]
        assert res["losses"] == pytest.approx(group_losses, abs=1e-5), (rank, case)
        # Per layer, q, k and v go to head sharding in one all-to-all (k and v apart from q under
        # grouped-query attention) and come back in one; the forward adds the rank's position in
        # its group and the loss's sum and count.
        layers, exchanges = 2, 3 if kind == "llama" else 2
        assert res["all_to_alls"] == {"forward": exchanges * layers + 2, "backward": exchanges * layers}, (rank, case)


@pytest.mark.multiprocess
def test_parity_sequence_2_stages_0_and_3_dna_and_llama(tmp_path: Path) -> None:
    """World 2, sequence-parallel size 2: the DNA LM at stages 0 and 3, Hugging Face Llama at stage
    3; the stage-3 engine's checkpoint saves and loads, and refuses ranks of a group passing different batches."""
    cases = [("dna", 3, 2), ("dna", 0, 2), ("llama", 3, 2)]
    results = run_ranks(2, workers.train, cases, STEPS, str(tmp_path))
    for case in cases:
        check(results, case, 2)
    assert any("(ulysses)" in d for d in results[0][("dna", 3, 2)]["decisions"])
    assert all(r["checkpoint"] == {"moved": True, "restored": True} for r in results)
    for r in results:
        assert r["mismatch"] is not None and "passed different batches" in r["mismatch"]


@pytest.mark.multiprocess
def test_parity_data_2_x_sequence_2_and_sequence_4() -> None:
    cases = [("dna", 3, 2), ("dna", 3, 4)]
    results = run_ranks(4, workers.train, cases, STEPS)
    for case in cases:
        check(results, case, 4)


@pytest.mark.parametrize("section, words", [
    ({"size": 3}, ["'zerofx.sequence_parallel.size'", "does not divide the world size 4", "1, 2, 4"]),
    ({"size": 2, "attention": "sideways"}, ["'zerofx.sequence_parallel.attention'", "'sideways'", '"ulysses"']),
    ({"attention": "auto"}, ["'zerofx.sequence_parallel.size' is missing"]),
    ({"size": 2, "attention": "ring"}, ["not implemented yet", '"ulysses" or "auto"']),
])
def test_config_errors_name_the_key(section: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        zerofx.compile(workers.model(), world_size=4, stage=3, config={"zerofx": {"sequence_parallel": section}})
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("extra, key", [
    ({"bf16": {"enabled": True}}, "bf16.enabled"),
    ({"zerofx": {"tiling": {"enabled": True}}}, "zerofx.tiling"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, "zero_optimization.offload_optimizer"),
])
def test_unsupported_combinations_are_refused(extra: dict, key: str) -> None:
    config = {"zero_optimization": {"stage": 3}, **extra}
    config["zerofx"] = {**config.get("zerofx", {}), "sequence_parallel": {"size": 2}}
    with pytest.raises(ConfigError, match=f"not supported together with '{key}'"):
        zerofx.compile(workers.model(), world_size=2, config=config)


@pytest.mark.parametrize("model, op, module", [
    (workers.CumsumLM, "aten.cumsum", "'mix'"),
    (workers.LongConvLM, "aten.conv1d", "'filter'"),
])
def test_ops_mixing_positions_are_refused_by_name(model: type, op: str, module: str) -> None:
    ids = torch.randint(0, workers.CONFIG.vocab_size, (2, 16))
    with pytest.raises(CaptureError) as err:
        zerofx.compile(model(), world_size=2, stage=3, example_inputs=(ids, ids), config={"zerofx": {"sequence_parallel": {"size": 2}}})
    text = str(err.value)
    assert op in text and f"in module {module}" in text and "Supported are" in text and "scaled_dot_product_attention" in text


def test_sequence_length_must_divide() -> None:
    ids = torch.randint(0, workers.CONFIG.vocab_size, (2, 15))
    with pytest.raises(CaptureError, match="sequence length 15 is not divisible by sequence_parallel.size=2"):
        zerofx.compile(workers.model(), world_size=2, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids},
                       config={"zerofx": {"sequence_parallel": {"size": 2}}})


def test_planned_without_a_process_group() -> None:
    """zerofx.compile shows the all-to-alls in the schedule and the choice in the decisions."""
    ids = torch.randint(0, workers.CONFIG.vocab_size, (2, 16))
    program = zerofx.compile(workers.model(), world_size=4, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids},
                             config={"zerofx": {"sequence_parallel": {"size": 4, "attention": "auto"}}})
    assert any(d.startswith("sequence parallelism: ulysses") and "4 query heads over 4 ranks" in d for d in program.plan.decisions)
    ops = [row.op for row in program.report(0).rows]
    assert ops.count("all_to_all_single") == 4 * workers.CONFIG.num_layers + 2


def test_train_hands_a_sequence_group_the_same_windows() -> None:
    """zerofx train's data path: ranks r // S share windows, different groups get different ones."""
    opts = check_train_options(TrainOptions(config=EXAMPLE, world_size=4, seq_len=64))
    assert [data_layout(opts, rank) for rank in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    first = [next(_cycle_batches(opts, rank)) for rank in range(4)]
    for a, b in ((0, 1), (2, 3)):
        assert torch.equal(first[a][0], first[b][0]) and torch.equal(first[a][1], first[b][1])
    assert not torch.equal(first[0][0], first[2][0])
    assert first[0][0].shape == (2, 64)  # the config's micro-batch per group, whole sequences
