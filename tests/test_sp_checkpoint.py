"""Sequence-parallel checkpoints resumed in another rank layout (NOTE [Checkpoints across rank
layouts] in zerofx/runtime/checkpoint.py; docs/checkpoints.md).

Two launches of real gloo ranks (one module fixture). World 4: data 2 x sequence 2 at stage 3,
in shard groups of 2 (each a sequence group), saves after 2 AdamW steps and trains on to step 4 (the uninterrupted run); sequence 4 at stage 1
resumes from that save. World 2: sequence 2 at stage 2 saves after 2 steps; that checkpoint
resumes as data 2 without sequence parallelism (stage 1) and at world 1 (stage 0), and the
world-4 checkpoint resumes as sequence 2 at stage 3. Every resumed run trains steps 3-4 and is
compared with plain PyTorch training all 4 steps on the same global batches.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import sp_checkpoint_workers as w
from tests.support.dist_utils import run_ranks
from zerofx.runtime.checkpoint import CheckpointError, describe_layout, read_metadata, saved_layout
from zerofx.app.training import TrainOptions, _cycle_batches, check_train_options, data_layout, data_order_note

TOL = 1e-5  # fp32, the parity tests' tolerance
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "dna_lm_sp.json"  # world 4, sequence 2
# name: (launch, result key, sequence size S of the resumed run, its world size, the tag it loads)
RESUMES = {
    "world4-data2xseq2-to-world4-seq4": ("world4", "seq4", 4, 4, w.SAVE_D2_X_S2),
    "world4-data2xseq2-to-world2-seq2": ("world2", "seq2_from_world4", 2, 2, w.SAVE_D2_X_S2),
    "world2-seq2-to-world2-data2": ("world2", "data2", 1, 2, w.SAVE_S2),
    "world2-seq2-to-world1": ("world2", "world1", 1, 1, w.SAVE_S2),
}
SAVED_WORLD = {w.SAVE_D2_X_S2: 4, w.SAVE_S2: 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("sp_ckpt")
    world4 = run_ranks(4, w.save_data2_x_seq2_resume_seq4, str(root))
    world2 = run_ranks(2, w.save_seq2_resume_elsewhere, str(root))  # loads the world-4 save too
    return root, {"world4": world4, "world2": world2, "reference": w.reference()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b) and a
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _optim_diff(got: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]]) -> float:
    assert sorted(got) == sorted(want) and got
    return max(_max_diff(got[f], want[f]) for f in got)


def _global_losses(results: list[dict[str, Any]], size: int) -> list[float]:
    """Each step's loss over the global batch: the mean of the data groups' losses (rank g * S's)."""
    per_group = [results[g * size]["losses"] for g in range(len(results) // size)]
    for g, losses in enumerate(per_group):  # every rank of a sequence group reports its group's loss
        assert all(results[g * size + i]["losses"] == losses for i in range(size))
    return [sum(step) / len(step) for step in zip(*per_group)]


def _saved(runs: dict[str, Any], tag: str) -> dict[str, Any]:
    return (runs["world4"] if tag == w.SAVE_D2_X_S2 else runs["world2"])[0]["saved"]


def test_metadata_records_the_layout_and_the_samples(runs: tuple[Path, dict[str, Any]]) -> None:
    root, _ = runs
    for tag, layout, text in (
        (w.SAVE_D2_X_S2, {"world_size": 4, "sequence_parallel_size": 2, "data_parallel_size": 2, "shard_group_size": 2},
         "world size 4 (data 2 x sequence 2, shard groups of 2)"),
        (w.SAVE_S2, {"world_size": 2, "sequence_parallel_size": 2, "data_parallel_size": 1, "shard_group_size": 2},
         "world size 2 (data 1 x sequence 2)"),
    ):
        meta = read_metadata(root, tag)
        assert meta["layout"] == saved_layout(meta) == layout and describe_layout(layout) == text
        # One rank file per slice of the flats, sharded over the shard group (data x sequence, or
        # with shard groups one sequence group here); one client file per rank.
        assert meta["num_shards"] == layout["shard_group_size"] == len(list((root / tag).glob("rank-*.safetensors")))
        assert len(list((root / tag).glob("client-*.pt"))) == meta["world_size"]
        # Sequences trained on by all data groups: the global batch per step, whatever the layout.
        assert meta["counters"]["global_samples"] == w.SAVED_STEPS * w.GLOBAL_BATCH and meta["step"] == w.SAVED_STEPS


def test_layout_is_checked_and_derived_for_older_checkpoints(runs: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, _ = runs
    shutil.copytree(root / w.SAVE_D2_X_S2, tmp_path / w.SAVE_D2_X_S2)
    path = tmp_path / w.SAVE_D2_X_S2 / "metadata.json"
    meta = json.loads(path.read_text())
    recorded = meta.pop("layout")
    path.write_text(json.dumps(meta))  # as saved before the layout was recorded: S from the config
    assert saved_layout(read_metadata(tmp_path, w.SAVE_D2_X_S2)) == recorded
    path.write_text(json.dumps({**meta, "layout": {**recorded, "sequence_parallel_size": 4}}))
    with pytest.raises(CheckpointError, match=r"gives layout .*accepted: world_size 4 = sequence_parallel_size x data_parallel_size"):
        read_metadata(tmp_path, w.SAVE_D2_X_S2)


def test_uninterrupted_data2_x_seq2_run_matches_pytorch(runs: tuple[Path, dict[str, Any]]) -> None:
    _, r = runs
    ref = r["reference"]
    saved = _saved(r, w.SAVE_D2_X_S2)
    assert _max_diff(saved["state"], ref[w.SAVED_STEPS]["state"]) < TOL
    assert _optim_diff(saved["optim"], ref[w.SAVED_STEPS]["optim"]) < TOL
    assert _global_losses(r["world4"], 2) == pytest.approx(ref["losses"], abs=TOL)
    assert _max_diff(r["world4"][0]["final"]["state"], ref[w.TOTAL_STEPS]["state"]) < TOL


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_in_another_layout_continues_the_run(runs: tuple[Path, dict[str, Any]], name: str) -> None:
    _, r = runs
    launch, key, size, world, tag = RESUMES[name]
    results = [rank[key] for rank in r[launch][:world]]
    ref, saved = r["reference"], _saved(r, tag)
    for rank, res in enumerate(results):
        loaded = res["loaded"]
        # Resharded element for element: parameters and AdamW states equal the saved ones exactly.
        assert _max_diff(loaded["state"], saved["state"]) == 0.0 and _optim_diff(loaded["optim"], saved["optim"]) == 0.0
        assert loaded["counters"] == saved["counters"] == {"global_steps": 2, "global_samples": 8, "micro_steps": 2}
        assert res["client"] == {"rank": rank % SAVED_WORLD[tag], "batches_consumed": w.SAVED_STEPS}
        final = res["final"]
        assert final["counters"] == {"global_steps": w.TOTAL_STEPS, "global_samples": w.TOTAL_STEPS * w.GLOBAL_BATCH, "micro_steps": 4}
    # Steps 3-4 go on as the uninterrupted run: plain PyTorch over all 4 steps.
    assert _global_losses(results, size) == pytest.approx(ref["losses"][w.SAVED_STEPS:], abs=TOL)
    assert _max_diff(results[0]["final"]["state"], ref[w.TOTAL_STEPS]["state"]) < TOL
    assert _optim_diff(results[0]["final"]["optim"], ref[w.TOTAL_STEPS]["optim"]) < TOL


def _train_options(tmp_path: Path, world_size: int, size: int) -> TrainOptions:
    """``zerofx train``'s options with the example's config at another world size and sequence size."""
    raw = json.loads(EXAMPLE.read_text())
    del raw["zerofx"]["world_size"]
    if size == 1:
        del raw["zerofx"]["sequence_parallel"]
    else:
        raw["zerofx"]["sequence_parallel"]["size"] = size
    path = tmp_path / f"world{world_size}-seq{size}.json"
    path.write_text(json.dumps(raw))
    return check_train_options(TrainOptions(config=path, world_size=world_size, seq_len=64))


def test_train_resumes_each_data_group_at_its_window(runs: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """``zerofx train`` deals windows to data groups: a resume with as many data groups takes up
    each group's stream where the checkpoint left it, and any other layout is named in a note."""
    root, r = runs
    meta4, meta2 = read_metadata(root, w.SAVE_D2_X_S2), read_metadata(root, w.SAVE_S2)
    saved4, data2 = _train_options(tmp_path, 4, 2), _train_options(tmp_path, 2, 1)
    consumed = r["world2"][0]["data2"]["client"]["batches_consumed"]  # the position the save handed rank 0
    uninterrupted = {data_layout(saved4, rank)[0]: list(itertools.islice(_cycle_batches(saved4, rank), consumed + 1))
                     for rank in (0, 2)}
    assert data_order_note(meta4, data2) is None  # world 4 as data 2 x sequence 2, then world 2 as data 2
    for rank in range(2):
        group = data_layout(data2, rank)[0]
        inputs, labels = next(itertools.islice(_cycle_batches(data2, rank), consumed, None))
        want = uninterrupted[group][consumed]
        assert torch.equal(inputs, want[0]) and torch.equal(labels, want[1])
    assert not torch.equal(uninterrupted[0][consumed][0], uninterrupted[1][consumed][0])
    # World 2 as sequence 2 and world 1: one data group both; world 2 as data 2 has two, at the same world size.
    assert data_order_note(meta2, _train_options(tmp_path, 1, 1)) is None
    note = data_order_note(meta2, data2)
    assert note is not None and "split over 2 data-parallel groups (world size 2)" in note and "world size 2 (data 1 x sequence 2)" in note
    note = data_order_note(meta4, _train_options(tmp_path, 4, 4))
    assert note is not None and "split over 1 data-parallel group (world size 4)" in note and "world size 4 (data 2 x sequence 2" in note
