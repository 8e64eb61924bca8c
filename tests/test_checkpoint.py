"""Sharded checkpoints (zerofx/checkpoint.py, checkpoint_format.py, consolidation.py).

Real gloo ranks save and load; one 3-rank run (module fixture) covers the round trip at every
stage at world size 2, and loads those checkpoints at world sizes 3 and 1 at other stages. A
save is killed with SIGKILL mid-write, and torchelastic really loses a node.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests import checkpoint_workers as cw
from tests.dist_utils import ROOT, _worker, free_port, run_ranks
from tests.models import BUILDERS, TINY
from zerofx.checkpoint import CheckpointError, check_structure, consolidate, latest_complete_tag, model_structure, read_metadata
from zerofx.checkpoint_format import RankFiles, check_rank_files, resolve_tag
from zerofx.cli import main
from zerofx.models import DNADecoderLM

SGD_TOL = 1e-5  # fp32, the same tolerance as the parity tests


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


def test_each_rank_reads_only_the_slices_it_needs(runs: tuple[Path, list]) -> None:
    root, _ = runs
    path = resolve_tag(root / "stage3", None)
    meta = read_metadata(path.parent)
    fqn = "blocks.1.mlp.down.weight"
    shard = meta["placements"][fqn]["shard_numel"]
    full = load_file(str(consolidate(path.parent, path.parent / "full.safetensors")))[fqn].reshape(-1)
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


# --------------------------------------------------------------------------- a killed save
def test_save_killed_mid_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """Rank 1 gets SIGKILL halfway through writing its rank file of the second save."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, cw.killed_save, (str(tmp_path),), queue)) for r in range(2)]
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
            # The host agent keeps the rendezvous store, so the other is the one to lose.
            f"--rdzv-conf=last_call_timeout=3,is_host={str(is_host).lower()}", "--monitor-interval=0.5",
            os.path.join(ROOT, "tests", "elastic_train.py"), str(tmp_path), "--steps", str(steps), "--step-sleep", "0.5",
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


# --------------------------------------------------------------------------- zerofx train
def test_train_resumes_from_its_output_dir(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """2 steps on 2 ranks, saving every step; then --steps 3 on 1 rank trains only step 3."""
    out = tmp_path / "run"
    common = ["train", "--model", "tiny", "--stage", "3", "--seq-len", "32", "--output-dir", str(out)]
    assert main([*common, "--world-size", "2", "--steps", "2", "--save-every", "1"]) == 0
    first = capfd.readouterr().out
    assert "resuming" not in first and "saved checkpoint" in first and "step 2/2" in first
    assert latest_complete_tag(out) == "step-00000002"
    assert main([*common, "--world-size", "1", "--steps", "3"]) == 0
    second = capfd.readouterr().out
    assert f"resuming from checkpoint {out / 'step-00000002'}: step 2, saved at world size 2" in second
    assert "step 1/3" not in second and "step 3/3" in second
    assert read_metadata(out)["step"] == 3 and read_metadata(out)["world_size"] == 1
