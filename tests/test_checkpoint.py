"""Sharded checkpoints (zerofx/runtime/checkpoint.py, checkpoint_format.py, consolidation.py).

Real gloo ranks save and load; one 3-rank run (module fixture) covers the round trip at every
stage at world size 2, and loads those checkpoints at world sizes 3 and 1 at other stages. One
2-rank run (module fixture) covers a save that fails on one rank, keep_last, and loads of
checkpoints with swapped, copied or damaged files. A save is killed with SIGKILL mid-write, and
torchelastic really loses a node.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support import checkpoint_workers as cw
from tests.support.dist_utils import ROOT, free_port, rank_context, rank_main, rendezvous_file, run_ranks
from tests.support.models import BUILDERS, TINY
from zerofx.runtime.checkpoint import CheckpointError, check_structure, consolidate, latest_complete_tag, model_structure, read_metadata
from zerofx.runtime.checkpoint_format import RankFiles, check_rank_files, read_client, resolve_tag
from zerofx.app.cli import main
from zerofx.models import DNADecoderLM

SGD_TOL = 1e-5  # fp32, the same tolerance as the parity tests


@pytest.fixture(scope="module")
def failed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("failures")
    return root, run_ranks(2, cw.failures, str(root))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ckpt")
    return root, run_ranks(3, cw.save_load_reshard, str(root))


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _assert_optim_equal(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    assert sorted(a) == sorted(b) and a
    for fqn in a:
        _assert_equal(dict(sorted(a[fqn].items())), dict(sorted(b[fqn].items())))


# --------------------------------------------------------------------------- round trip, reshard
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_round_trip_every_stage(runs: tuple[Path, list], stage: int) -> None:
    root, results = runs
    kind, opt = cw.ROUND_TRIP[stage]
    for rank in (0, 1):
        r = results[rank]["round_trip"][stage]
        _assert_equal(r["saved"]["state"], r["loaded"]["state"])
        _assert_optim_equal(r["saved"]["optim"], r["loaded"]["optim"])
        assert r["loaded"]["step"] == r["saved"]["step"] == cw.SAVED_STEPS
        assert r["client"] == {"rank": rank, "position": 7}
    saved = results[0]["round_trip"][stage]["saved"]
    state_names = {"AdamW": {"step", "exp_avg", "exp_avg_sq"}, "SGD": {"momentum_buffer"}}[opt["type"]]
    assert all(set(s) == state_names for s in saved["optim"].values())
    if kind == "dna":  # the frozen norm weight is saved, and has no optimizer state
        assert "blocks.0.attn_norm.weight" in saved["state"] and "blocks.0.attn_norm.weight" not in saved["optim"]
    else:  # a persistent buffer changed after init reaches the fresh engine only through the checkpoint
        assert saved["state"]["temperature"].item() == 1.25
    meta = read_metadata(root / f"stage{stage}")
    assert (meta["world_size"], meta["stage"], meta["step"], meta["optimizer"]["type"]) == (2, stage, 2, opt["type"])
    assert meta["model_class"].endswith(type(BUILDERS[kind]()).__name__)
    assert meta["structure_hash"] == model_structure(BUILDERS[kind]())["structure_hash"]
    assert meta["config"]["zero_optimization"] == {"stage": stage} and len(meta["plan_fingerprint"]) == 16
    assert meta["torch_version"] == torch.__version__ and meta["zerofx_version"]
    files = sorted(p.name for p in (root / f"stage{stage}" / "step-00000002").iterdir())
    assert files == ["COMPLETE", "client-00000-of-00002.pt", "client-00001-of-00002.pt", "metadata.json",
                     "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]


@pytest.mark.parametrize("world_size", [1, 3])
def test_sgd_resume_at_new_world_size_matches_uninterrupted_run(runs: tuple[Path, list], world_size: int) -> None:
    """Saved at world size 2, stage 3, after 2 steps; loaded at world size 3 (stage 2) or 1
    (stage 1); 2 more steps. Reference: plain PyTorch with per-step world sizes [2, 2, M, M]."""
    _, results = runs
    kind, opt = cw.ROUND_TRIP[3]
    got = results[0]["resharded"][(world_size, 3)]
    _assert_equal(results[0]["round_trip"][3]["saved"]["state"], got["loaded"]["state"])
    expected = cw.reference_run(kind, opt, [2] * cw.SAVED_STEPS + [world_size] * cw.MORE_STEPS)
    for key, value in expected.items():
        torch.testing.assert_close(got["final"][key], value, rtol=0, atol=SGD_TOL, msg=key)
    # The per-step world sizes matter: had the resumed steps kept world size 2, the result differs.
    stayed = cw.reference_run(kind, opt, [2] * (cw.SAVED_STEPS + cw.MORE_STEPS))
    assert max((stayed[k] - got["final"][k]).abs().max().item() for k in stayed) > 100 * SGD_TOL
    if world_size == 3:  # the ranks beyond the saved world size get saved rank (r % 2)'s client_state
        assert [results[r]["resharded"][(3, 3)]["client"]["rank"] for r in range(3)] == [0, 1, 0]
        for r in (1, 2):
            _assert_equal(results[r]["resharded"][(3, 3)]["final"], got["final"])


@pytest.mark.parametrize("world_size", [1, 3])
def test_adamw_states_equal_after_reshard(runs: tuple[Path, list], world_size: int) -> None:
    """Saved at world size 2, stage 1; loaded at world size 3 (stage 0) or 1 (stage 3)."""
    _, results = runs
    saved = results[0]["round_trip"][1]["saved"]
    for rank in range(world_size):
        got = results[rank]["resharded"][(world_size, 1)]["loaded"]
        _assert_optim_equal(saved["optim"], got["optim"])
        _assert_equal(saved["state"], got["state"])
        assert got["step"] == cw.SAVED_STEPS


def test_mixed_precision_masters_states_and_loss_scale_survive_a_reshard(runs: tuple[Path, list], tmp_path: Path) -> None:
    """fp16 at world size 2, stage 2, with fp32 masters and a dynamic loss scale that skipped
    the first steps; loaded in fp16 at world size 3 and stage 3, and in fp32 alone at stage 1."""
    root, results = runs
    saved = results[0]["fp16"]
    assert saved["counters"]["skipped_steps"] > 0 and saved["optim"] and saved["master"]
    for rank in range(3):
        got = results[rank]["resharded"][(3, "fp16")]["loaded"]
        _assert_equal(saved["master"], got["master"])
        _assert_optim_equal(saved["optim"], got["optim"])
        _assert_equal(saved["state"], got["state"])
        assert got["counters"] == saved["counters"] and got["step"] == saved["step"]
    # In fp32 the parameters take the fp32 masters, not the fp16 copies (which differ from them).
    fp32 = results[0]["resharded"][(1, "fp16")]["loaded"]
    _assert_optim_equal(saved["optim"], fp32["optim"])
    consolidated = load_file(str(consolidate(root / "fp16", tmp_path / "fp16.safetensors")))
    for key, value in fp32["state"].items():
        fqn = "embed.weight" if key == "head.weight" else key  # tied
        expected = saved["master"][fqn].view(value.shape) if fqn in saved["master"] else saved["state"][key].float()
        assert torch.equal(value, expected) and torch.equal(consolidated[key], expected), key
    assert not torch.equal(saved["state"]["embed.weight"].float(), fp32["state"]["embed.weight"])


def test_each_rank_reads_only_the_slices_it_needs(runs: tuple[Path, list], tmp_path: Path) -> None:
    root, _ = runs
    path = resolve_tag(root / "stage3", None)
    meta = read_metadata(path.parent)
    fqn = "blocks.1.mlp.down.weight"
    shard = meta["placements"][fqn]["shard_numel"]
    full = load_file(str(consolidate(path.parent, tmp_path / "full.safetensors")))[fqn].reshape(-1)
    with RankFiles(check_rank_files(path, 2)) as files:
        assert torch.equal(files.read_range(f"param/{fqn}", shard, shard + 3, shard + 40), full[shard + 3 : shard + 40])
        assert files.opened == [1]
    with RankFiles(check_rank_files(path, 2)) as files:  # a range across the boundary reads both slices
        assert torch.equal(files.read_range(f"param/{fqn}", shard, shard - 5, shard + 5), full[shard - 5 : shard + 5])
        assert files.opened == [0, 1]


# --------------------------------------------------------------------------- consolidation
@pytest.mark.parametrize("stage", [2, 3])
def test_consolidate_loads_strictly_into_a_fresh_model(runs: tuple[Path, list], tmp_path: Path, stage: int) -> None:
    """Stage 3: the DNA LM with tied embeddings and a frozen weight; stage 2: a persistent buffer."""
    root, results = runs
    kind = cw.ROUND_TRIP[stage][0]
    expected = results[0]["round_trip"][stage]["saved"]["state"]
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out = consolidate(root / f"stage{stage}", tmp_path / f"{dtype}.safetensors", dtype=dtype)
        loaded = load_file(str(out))
        model = BUILDERS[kind]()
        assert list(loaded) == list(model.state_dict())
        model.load_state_dict(loaded, strict=True)
        _assert_equal(loaded, {k: v.to(torch_dtype) for k, v in expected.items()})
    # Chunks far smaller than a slice, straddling slice boundaries, give the same bytes.
    small = consolidate(root / f"stage{stage}", tmp_path / "small.safetensors", chunk_bytes=36)
    assert small.read_bytes() == (tmp_path / "fp32.safetensors").read_bytes()


def test_consolidate_cli(runs: tuple[Path, list], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root, results = runs
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(root / "stage0"), str(out), "--dtype", "bf16", "--tag", "step-00000002"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    model = BUILDERS["dna"]()
    model.load_state_dict(load_file(str(out)), strict=True)
    saved = results[0]["round_trip"][0]["saved"]["state"]["embed.weight"]
    assert torch.equal(model.state_dict()["embed.weight"], saved.bfloat16().float())
    assert main(["consolidate", str(root / "stage0"), str(out), "--dtype", "fp16"]) == 2
    assert "fp16" in capsys.readouterr().err


# --------------------------------------------------------------------------- errors
def test_errors_name_what_is_wrong(runs: tuple[Path, list], tmp_path: Path) -> None:
    root, results = runs
    src = root / "stage3"
    with pytest.raises(CheckpointError, match="does not exist"):
        read_metadata(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no checkpoint tag 'step-9'.*complete checkpoints: step-00000002"):
        read_metadata(src, "step-9")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        read_metadata(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "step-00000002" / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="incomplete: it has no COMPLETE marker"):
        read_metadata(broken, "step-00000002")
    assert latest_complete_tag(broken) is None
    (broken / "step-00000002" / "COMPLETE").write_text("")
    (broken / "step-00000002" / "rank-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing rank files: rank-00001-of-00002.safetensors"):
        consolidate(broken, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(CheckpointError, match="dtype='fp16'.*accepted: fp32, bf16"):
        consolidate(src, tmp_path / "x.safetensors", dtype="fp16")
    # A model whose ffn is wider: the first differing parameter is named with both shapes.
    wider = DNADecoderLM(dataclasses.replace(TINY, ffn_dim=72))
    wider.blocks[0].attn_norm.weight.requires_grad_(False)
    with pytest.raises(CheckpointError, match=r"blocks\.0\.mlp\.gate\.weight \(70, 30\) torch.float32 in the checkpoint and "
                                              r"blocks\.0\.mlp\.gate\.weight \(72, 30\) torch.float32 in the model"):
        check_structure(read_metadata(src), model_structure(wider), str(src))
    check_structure(read_metadata(src), model_structure(BUILDERS["dna"]()), str(src))  # the same model passes
    assert "client_state" in results[0]["bad_client_state"] and "accepted" in results[0]["bad_client_state"]


# --------------------------------------------------------------------------- failed saves, damaged files
def test_a_save_that_fails_on_one_rank_is_never_marked_complete(failed: tuple[Path, list]) -> None:
    """Rank 1's disk fills while it writes its rank file; both ranks catch the error and go on."""
    root, results = failed
    for rank in (0, 1):
        msg = results[rank]["failed_save"]
        assert msg is not None and "\n" not in msg
        assert re.search(r"checkpoint 'step-00000002' .* was not saved \(rank 1: OSError: \[Errno 28\] No space left on device", msg), msg
        assert "rank 0" not in msg
        # Named, the failed tag is an error; unnamed, the previous checkpoint loads.
        assert "no checkpoint tag 'step-00000002'" in results[rank]["named_failed_tag"]
        assert results[rank]["loaded_client"] == {"step": 1}
        _assert_equal(results[0]["step1"], results[rank]["loaded"])
    # Nothing of the failed save is left, and latest still names step 1.
    assert results[0]["after_failure"] == {"files": ["latest", "step-00000001"], "latest": "step-00000001"}


def test_load_skips_a_complete_marked_checkpoint_with_missing_files(failed: tuple[Path, list], tmp_path: Path) -> None:
    """latest names step 4, marked COMPLETE but without rank 1's file: tag=None loads step 3."""
    root, results = failed
    for rank in (0, 1):
        assert results[rank]["fallback_step"] == 3
        (warning,) = results[rank]["fallback_warnings"]
        assert warning.startswith("using checkpoint 'step-00000003'")
        assert "skipping ones that cannot load: checkpoint '" in warning
        assert "step-00000004' saved at world size 2 is missing rank files" in warning
    assert latest_complete_tag(root / "fallback") == "step-00000003"
    with pytest.raises(CheckpointError, match="missing rank files: rank-00001-of-00002.safetensors"):  # named, it is an error
        consolidate(root / "fallback", tmp_path / "out.safetensors", tag="step-00000004")


def test_keep_last_deletes_the_oldest_step_checkpoints(failed: tuple[Path, list]) -> None:
    root, results = failed
    r = results[0]
    for rank in (0, 1):
        assert results[rank]["bad_keep_last"] == [
            f"keep_last={k} is invalid; accepted: None (keep every checkpoint) or an integer >= 1" for k in ("0", "True", "2.5")
        ]
    assert r["kept_after_step3"] == ["best", "latest", "step-00000001", "step-00000003"]
    assert r["kept_after_step4"] == ["best", "latest", "step-00000003", "step-00000004"]  # "best" is not a step-<N> tag
    # keep_last=1 re-saving step 3, which latest then names, while step 4 exists: both stay.
    assert r["kept_after_resave"] == ["best", "latest", "step-00000003", "step-00000004"]
    assert latest_complete_tag(root / "run") == "step-00000003"


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("swapped", r"rank 0: rank file '[^']*/swapped/step-00000004/rank-00000-of-00002\.safetensors' does not belong to checkpoint "
                    r".*: it holds rank 1's data, not rank 0's .*; rank 1: .*rank-00001-of-00002\.safetensors.*it holds rank 0's data"),
        ("other_step", r"^rank 1: rank file '[^']*/other_step/step-00000004/rank-00001-of-00002\.safetensors' does not belong .*: "
                       r"it was saved under tag 'step-00000003', not 'step-00000004'"),
        ("other_run", r"^rank 1: rank file '[^']*/other_run/step-00000004/rank-00001-of-00002\.safetensors' does not belong .*: "
                      r"it comes from another save \(save id [0-9a-f]{16}, not [0-9a-f]{16}"),
        ("client_swapped", r"rank 0: client file '[^']*/client-00000-of-00002\.pt' does not belong .*: it holds rank 1's data"),
    ],
)
def test_swapped_or_copied_files_are_refused(failed: tuple[Path, list], tmp_path: Path, name: str, pattern: str) -> None:
    root, results = failed
    for rank in (0, 1):  # one rank found it; both raise, and neither hangs
        msg = results[rank]["damaged"][name]
        assert msg is not None and "\n" not in msg and re.search(pattern, msg), msg
    if name != "client_swapped":  # consolidate reads no client files
        rank_file_pattern = pattern.split("; rank 1")[0].removeprefix("^").removeprefix("rank 0: ").removeprefix("rank 1: ")
        with pytest.raises(CheckpointError, match=rank_file_pattern):
            consolidate(root / name, tmp_path / "out.safetensors")
        assert list(tmp_path.iterdir()) == []


def test_damaged_tensor_bytes_fail_load_and_consolidate(failed: tuple[Path, list], tmp_path: Path) -> None:
    """4,000 bytes of rank 1's largest tensor overwritten with 0xff."""
    root, results = failed
    key = results[0]["corrupt_key"]
    pattern = (rf"rank file '[^']*/corrupt/step-00000004/rank-00001-of-00002\.safetensors': tensor '{re.escape(key)}' "
               r"fails its checksum \(CRC-32 [0-9a-f]{8}, saved [0-9a-f]{8}\): the file is damaged")
    for rank in (0, 1):
        assert re.search("^rank 1: " + pattern, results[rank]["damaged"]["corrupt"]), results[rank]["damaged"]["corrupt"]
    with pytest.raises(CheckpointError, match=pattern):
        consolidate(root / "corrupt", tmp_path / "out.safetensors")
    assert list(tmp_path.iterdir()) == []
    # The same bytes damaged after the header's checksums were checked: a streamed read in small chunks still finds it.
    copy = tmp_path / "copy"
    shutil.copytree(root / "run" / "step-00000004", copy / "step-00000004")
    cw.overwrite_tensor_bytes(copy / "step-00000004" / "rank-00000-of-00002.safetensors", 4000)
    with pytest.raises(CheckpointError, match=r"rank-00000-of-00002\.safetensors': tensor '.*' fails its checksum"):
        consolidate(copy, tmp_path / "out.safetensors", chunk_bytes=64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]


def test_missing_or_garbage_client_file_is_named(failed: tuple[Path, list], tmp_path: Path) -> None:
    root, results = failed
    for rank in (0, 1):
        msg = results[rank]["damaged"]["client_garbage"]
        assert re.fullmatch(r"rank 1: client file '[^']*/client_garbage/step-00000004/client-00001-of-00002\.pt' is not a readable "
                            r"torch\.save file \(\w+\); accepted: the file rank 1 wrote in this save .*", msg), msg
    copy = tmp_path / "ckpt"
    shutil.copytree(root / "run" / "step-00000004", copy / "step-00000004")
    (copy / "step-00000004" / "client-00001-of-00002.pt").unlink()
    with pytest.raises(CheckpointError, match=r"missing client files: client-00001-of-00002\.pt; .* holds no other complete checkpoint"):
        resolve_tag(copy, None)
    meta = json.loads((copy / "step-00000004" / "metadata.json").read_text())
    with pytest.raises(CheckpointError, match=r"client file '.*client-00001-of-00002\.pt' is not readable \(No such file"):
        read_client(copy / "step-00000004", meta, 1)
    assert read_client(copy / "step-00000004", meta, 0)["rank"] == 0


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        ({"shard_numel": 1}, r"gives blocks\.0\.mlp\.gate\.weight \(shape \(70, 30\)\) numel 2100, shard_numel 1 and padded_numel 2100 "
                             r"at world size 2; accepted: numel = the shape's product <= padded_numel = shard_numel \* world_size"),
        ({"shard_numel": 2000, "padded_numel": 4000},
         r"rank file '.*rank-00000-of-00002\.safetensors': tensor 'param/blocks\.0\.mlp\.gate\.weight' has shape \[1050\], "
         r"but metadata\.json gives shard_numel 2000"),
        ({"shard_numel": "1050"}, r"shard_numel '1050'"),
    ],
)
def test_edited_shard_numel_is_named(failed: tuple[Path, list], tmp_path: Path, edit: dict, pattern: str) -> None:
    root, _ = failed
    copy = tmp_path / "ckpt"
    shutil.copytree(root / "run" / "step-00000004", copy / "step-00000004")
    path = copy / "step-00000004" / "metadata.json"
    meta = json.loads(path.read_text())
    meta["placements"]["blocks.0.mlp.gate.weight"].update(edit)
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=pattern):
        consolidate(copy, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    del meta["placements"]
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"metadata\.json is malformed \(KeyError: 'placements'\)"):
        read_metadata(copy)


def test_format_1_checkpoints_still_consolidate(failed: tuple[Path, list], tmp_path: Path) -> None:
    """Format 1 recorded no tag, save id or checksums: the rank and world size are still checked."""
    root, _ = failed
    copy = tmp_path / "v1"
    shutil.copytree(root / "run" / "step-00000004", copy / "step-00000004")
    path = copy / "step-00000004" / "metadata.json"
    meta = json.loads(path.read_text())
    for key in ("tag", "save_id", "client_crc32"):
        del meta[key]
    path.write_text(json.dumps({**meta, "format_version": 1}))
    v1 = load_file(str(consolidate(copy, tmp_path / "v1.safetensors")))
    _assert_equal(v1, load_file(str(consolidate(root / "run", tmp_path / "v2.safetensors", tag="step-00000004"))))
    r0, r1 = (copy / "step-00000004" / f"rank-0000{r}-of-00002.safetensors" for r in (0, 1))
    os.replace(r0, tmp_path / "x")
    os.replace(r1, r0)
    os.replace(tmp_path / "x", r1)
    with pytest.raises(CheckpointError, match=r"rank-00000-of-00002\.safetensors' does not belong .*: it holds rank 1's data"):
        consolidate(copy, tmp_path / "v1.safetensors")


def test_rank_files_have_the_mode_of_the_other_files(failed: tuple[Path, list]) -> None:
    root, _ = failed
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (root / "run" / "step-00000004").iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes


# --------------------------------------------------------------------------- consolidate's output
def test_consolidate_refuses_an_output_in_the_checkpoint(failed: tuple[Path, list], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    root, _ = failed
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "run" / "step-00000004", ckpt / "step-00000004")
    rank0 = ckpt / "step-00000004" / "rank-00000-of-00002.safetensors"
    before = rank0.read_bytes()
    elsewhere = tmp_path / "out"
    elsewhere.mkdir()
    (elsewhere / "link.safetensors").symlink_to(rank0)  # a symlink to an input, outside the checkpoint
    (tmp_path / "ckpt-link").symlink_to(ckpt)  # the checkpoint through a symlink
    os.link(rank0, elsewhere / "hard.safetensors")
    for out in (rank0, ckpt / "model.safetensors", ckpt / "step-00000004" / "new.safetensors", tmp_path / "ckpt-link" / "m.safetensors"):
        with pytest.raises(CheckpointError, match=rf"cannot write '{re.escape(str(out))}': it is inside the checkpoint directory .*; "
                                                  r"accepted: a file path outside the checkpoint directory"):
            consolidate(ckpt, out)
    for out in (elsewhere / "link.safetensors", elsewhere / "hard.safetensors"):
        with pytest.raises(CheckpointError, match=r"it is (inside the checkpoint directory|the checkpoint's own file)"):
            consolidate(ckpt, out)
    assert main(["consolidate", str(ckpt), str(rank0)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write '{rank0}'" in err and "accepted: a file path outside" in err
    assert rank0.read_bytes() == before and sorted(p.name for p in rank0.parent.iterdir()) == [
        "COMPLETE", "client-00000-of-00002.pt", "client-00001-of-00002.pt", "metadata.json",
        "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    read_metadata(ckpt)  # still loads


def test_consolidate_output_folder_errors_come_before_any_work(failed: tuple[Path, list], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    root, _ = failed
    opened: list[str] = []
    monkeypatch.setattr(RankFiles, "get", lambda self, rank: opened.append(rank))  # any read would be recorded
    missing = tmp_path / "nowhere" / "m.safetensors"
    with pytest.raises(CheckpointError, match=rf"cannot write '{re.escape(str(missing))}': folder '.*nowhere' does not exist; accepted"):
        consolidate(root / "run", missing)
    assert main(["consolidate", str(root / "run"), str(missing)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.access(read_only, os.W_OK):  # root ignores permissions; /sys is read-only to it
        read_only = Path("/sys")
    with pytest.raises(CheckpointError, match=rf"cannot write '.*m\.safetensors': folder '{read_only}' is not writable \(.*\); accepted"):
        consolidate(root / "run", read_only / "m.safetensors")
    assert opened == []


def test_consolidate_that_fails_midway_removes_its_temp_file_and_keeps_the_old_output(
    failed: tuple[Path, list], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The disk fills after two tensors; the previous output stays whole."""
    root, _ = failed
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"the previous output")
    import zerofx.runtime.consolidation

    real_write, calls = zerofx.runtime.consolidation._write, []

    def write(f: Any, t: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(f, t)

    monkeypatch.setattr(zerofx.runtime.consolidation, "_write", write)
    with pytest.raises(CheckpointError, match=rf"could not write '{re.escape(str(out))}' \(No space left on device\); "
                                              r"the partial file was removed and the output is unchanged"):
        consolidate(root / "run", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"] and out.read_bytes() == b"the previous output"
    assert main(["consolidate", str(root / "run"), str(out)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    monkeypatch.setattr(zerofx.runtime.consolidation, "_write", real_write)
    assert main(["consolidate", str(root / "run"), str(out)]) == 0  # a whole file replaces it
    assert list(load_file(str(out))) == list(BUILDERS["dna"]().state_dict())
    assert out.stat().st_mode & 0o777 == (root / "run" / "latest").stat().st_mode & 0o777


# --------------------------------------------------------------------------- a killed save
def test_save_killed_mid_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """Rank 1 gets SIGKILL halfway through writing its rank file of the second save."""
    ctx = rank_context()  # processes of their own, forked from a server that imported torch once
    store = rendezvous_file()
    procs = [ctx.Process(target=rank_main, args=(r, 2, store, cw.killed_save, (str(tmp_path),))) for r in range(2)]
    for p in procs:
        p.start()
    procs[1].join(timeout=300)
    assert procs[1].exitcode == -signal.SIGKILL
    procs[0].join(timeout=60)  # rank 0 fails in the save's barrier; a launcher would kill it anyway
    if procs[0].is_alive():
        procs[0].kill()
        procs[0].join()

    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    assert not (tmp_path / "step-00000002").exists()
    partial = tmp_path / ".step-00000002.partial"
    assert (partial / "rank-00001-of-00002.safetensors.tmp").is_file()  # really killed mid-write
    assert not (partial / "rank-00001-of-00002.safetensors").exists() and not (partial / "COMPLETE").exists()
    with pytest.raises(CheckpointError, match="'step-00000002'.*incomplete: its save was interrupted"):
        read_metadata(tmp_path, "step-00000002")
    assert latest_complete_tag(tmp_path) == "step-00000001"
    # The previous checkpoint loads into an engine, at another world size and stage.
    loaded = run_ranks(1, cw.load_latest, str(tmp_path), 1)[0]
    _assert_equal(torch.load(tmp_path / "expected-step1.pt"), loaded["state"])
    assert loaded["step"] == 1


# --------------------------------------------------------------------------- torchelastic
def _events(out: Path) -> list[dict[str, Any]]:
    log = out / "log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _per_step_world_sizes(events: list[dict[str, Any]], steps: int) -> list[int]:
    """The world size each step of the final checkpoint chain ran at, from rank 0's log: a
    restart that resumed from step k discards what ran after k."""
    sizes: dict[int, int] = {}
    current = 0
    for e in sorted((e for e in events if e["rank"] == 0), key=lambda e: e["time"]):
        if e["event"] == "start":
            sizes = {s: w for s, w in sizes.items() if s <= e["resumed_from"]}
            for s in range(1, e["resumed_from"] + 1):  # saved, but killed before its log line
                sizes.setdefault(s, current)
            current = e["world_size"]
        elif e["event"] == "step":
            sizes[e["step"]] = current
    return [sizes[s] for s in range(1, steps + 1)]


def test_torchelastic_resumes_with_fewer_workers_after_one_is_killed(tmp_path: Path) -> None:
    """Two torchrun agents on this machine form one elastic job (--nnodes=1:2, one worker each).
    After both trained two steps at world size 2, one agent and its worker get SIGKILL. The
    surviving agent restarts its worker (--max-restarts=1) at world size 1, which resumes from
    the last complete checkpoint and finishes; its parameters match plain PyTorch run with the
    same per-step world sizes."""
    steps, port = 6, free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

    def agent(is_host: bool, name: str) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=zerofx-{port}",
            # The host agent keeps the rendezvous store, so the other is the one to lose. A node
            # missing 2 heartbeats 1 s apart is dead (the default, 3 of 5 s, waits 15 s for it).
            f"--rdzv-conf=last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2,is_host={str(is_host).lower()}",
            "--monitor-interval=0.5",
            os.path.join(ROOT, "tests", "support", "elastic_train.py"), str(tmp_path), "--steps", str(steps), "--step-sleep", "0.5",
        ]
        return subprocess.Popen(cmd, env=env, stdout=open(tmp_path / f"{name}.txt", "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    survivor, victim = agent(True, "agent-a"), agent(False, "agent-b")
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            trained = {e["rank"] for e in _events(tmp_path) if e["event"] == "step" and e["world_size"] == 2 and e["step"] >= 2}
            if trained == {0, 1}:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the 2-worker job did not train 2 steps: {(tmp_path / 'agent-a.txt').read_text()[-3000:]}")
        worker = next(e["pid"] for e in _events(tmp_path) if e["agent_pid"] == victim.pid)
        os.kill(victim.pid, signal.SIGKILL)
        os.kill(worker, signal.SIGKILL)
        assert survivor.wait(timeout=240) == 0, (tmp_path / "agent-a.txt").read_text()[-3000:]
    finally:
        for proc in (survivor, victim):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    events = _events(tmp_path)
    restarted = [e for e in events if e["event"] == "start" and e["restart"] == 1]
    assert len(restarted) == 1 and restarted[0]["world_size"] == 1, events
    resumed = restarted[0]["resumed_from"]
    saved_before = max(e["step"] for e in events if e["event"] == "step" and e["restart"] == 0 and e["rank"] == 0)
    assert resumed in (saved_before, saved_before + 1) and resumed >= 2  # the last complete checkpoint
    after = [e["step"] for e in events if e["event"] == "step" and e["restart"] == 1]
    assert after == list(range(resumed + 1, steps + 1))
    assert any(e["event"] == "done" for e in events) and read_metadata(tmp_path / "ckpt")["world_size"] == 1
    world_sizes = _per_step_world_sizes(events, steps)  # [2, 2, 1, 1, 1, 1] unless the first rendezvous was slow
    assert world_sizes[resumed - 1] == 2 and world_sizes[resumed:] == [1] * (steps - resumed)
    expected = cw.reference_run("dna", cw.SGD, world_sizes)
    final = torch.load(tmp_path / "final.pt")
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=SGD_TOL, msg=key)
