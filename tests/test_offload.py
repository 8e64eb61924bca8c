"""ZeRO-Offload / ZeRO-Infinity: optimizer state on the device, in host memory and on NVMe (files
on the local disk), at every stage, on real gloo ranks; the placement planner under tight budgets;
the one-step delayed update against a late-update reference; faults; checkpoints; and the
estimate against what the engine holds."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch

import zerofx
from cost_models.offload import OffloadItem, Tier, TierSpec, estimate_offload_timeline
from passes.plan_offload import OffloadPlan, plan_offload
from tests.dist_utils import run_ranks
from tests.models import reference
from tests.offload_workers import config, nvme_folder_vanishes, reference_late, run_many
from zerofx.cli import main
from zerofx.offload import NvmeFiles, OffloadError

SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}
INF = math.inf


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def nvme(path: Path, **extra: object) -> dict:
    return {"device": "nvme", "nvme_path": str(path), **extra}


# --------------------------------------------------------------------------- planner (pure)
def test_placement_fills_fast_tiers_first_fit_decreasing() -> None:
    records = [("a", 400), ("b", 300), ("c", 200), ("d", 100)]
    tiers = {Tier.DEVICE: TierSpec(500, INF, INF), Tier.CPU: TierSpec(300, INF, INF), Tier.NVME: TierSpec(INF, 1e3, 1e3)}
    plan = plan_offload(records, tiers, buffer_count=2, update_bytes_per_s=1e6)
    # Largest first: a -> device (100 left), b -> cpu (0 left), c -> nvme, d -> device (0 left).
    assert dict(plan.tiers) == {"a": Tier.DEVICE, "b": Tier.CPU, "c": Tier.NVME, "d": Tier.DEVICE}
    # Device and host records update first, in backward order, then the NVMe ones.
    assert plan.update_order == ("a", "d", "b", "c")
    assert (plan.bytes_on(Tier.DEVICE), plan.bytes_on(Tier.CPU), plan.bytes_on(Tier.NVME)) == (500, 300, 200)
    assert OffloadPlan.from_json(plan.to_json()) == plan


def test_placement_without_room_names_the_shortfall() -> None:
    tiers = {Tier.DEVICE: TierSpec(100, INF, INF), Tier.CPU: TierSpec(150, INF, INF)}
    with pytest.raises(ValueError, match=r"300 bytes do not fit.*device 100, cpu 150, nvme 0 bytes.*b \(200 bytes\) has no room"):
        plan_offload([("a", 100), ("b", 200)], tiers, buffer_count=1, update_bytes_per_s=1e6)


def test_io_timeline_closed_form() -> None:
    # Records of 1000 bytes: read 1 s, write 2 s, update 2 * 1000 / 4000 = 0.5 s.
    tiers = {Tier.NVME: TierSpec(INF, 1000.0, 500.0)}
    one = [OffloadItem("a", Tier.NVME, 1000)]
    t = estimate_offload_timeline(one, tiers, buffer_count=1, update_bytes_per_s=4000.0)
    # read [0, 1], update [1, 1.5], write [1.5, 3.5]: the step waits 1 s, the write outlasts it by 2.
    assert (t.step_s, t.io_s, t.exposed_io_s, t.hidden_io_s) == pytest.approx((3.5, 3.0, 3.0, 0.0))
    t = estimate_offload_timeline(one, tiers, buffer_count=1, update_bytes_per_s=4000.0, prefetch_lead_s=1.0, forward_backward_s=10.0)
    assert (t.exposed_io_s, t.hidden_io_s, t.ready_s["a"]) == pytest.approx((0.0, 3.0, 0.0))
    two = [OffloadItem("a", Tier.NVME, 1000), OffloadItem("b", Tier.NVME, 1000)]
    # One buffer: b's read waits for a's write (ends 3.5), b is ready at 4.5. Two: b is ready at 2.
    t1 = estimate_offload_timeline(two, tiers, buffer_count=1, update_bytes_per_s=4000.0, forward_backward_s=100.0)
    t2 = estimate_offload_timeline(two, tiers, buffer_count=2, update_bytes_per_s=4000.0, forward_backward_s=100.0)
    assert (t1.ready_s["b"], t1.exposed_io_s) == pytest.approx((4.5, 4.0))
    assert (t2.ready_s["b"], t2.exposed_io_s) == pytest.approx((2.0, 1.5))
    dpu = estimate_offload_timeline(two, tiers, buffer_count=2, update_bytes_per_s=4000.0, delayed_update=True, forward_backward_s=5.0)
    assert dpu.exposed_io_s == pytest.approx(1.0)  # the step ends at 6 s, 1 s after the next forward/backward


# --------------------------------------------------------------------------- NVMe files (in process)
def test_nvme_faults_name_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(OffloadError, match=f"cannot create folder '{blocker}/rank-00000'.*Not a directory"):
        NvmeFiles(blocker, 0)
    files = NvmeFiles(tmp_path / "nvme", 0)
    buf = torch.arange(64, dtype=torch.float32).view(torch.uint8)
    files.write("layer.w", buf, 256)
    back = torch.zeros(256, dtype=torch.uint8)
    files.read("layer.w", back, 256)
    assert torch.equal(back, buf) and (files.bytes_read, files.bytes_written) == (256, 256)
    # Short read: the file lost its tail.
    os.truncate(files.path("layer.w"), 100)
    with pytest.raises(OffloadError, match=r"short read of '.*layer\.w\.state': got 100 of 256 bytes"):
        files.read("layer.w", back, 256)
    # Full disk: /dev/full fails every write with ENOSPC.
    os.symlink("/dev/full", files.path("full"))
    with pytest.raises(OffloadError, match=r"writing 256 bytes of full's optimizer state to '.*full\.state' failed: the disk is full"):
        files.write("full", buf, 256)
    # The folder vanishes.
    for p in files.root.iterdir():
        p.unlink()
    files.root.rmdir()
    with pytest.raises(OffloadError, match=f"reading .* '{files.root}/layer.w.state' failed: folder '{files.root}' no longer exists"):
        files.read("layer.w", back, 256)


def test_offload_config_is_acted_on_and_checked() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # acted on now: no "does not act on it yet" warning
        zerofx.parse_config(config(2, ADAMW, nvme(Path("/tmp/x"), pin_memory=True, buffer_count=2, ratio=0.5), zerofx_offload={"delayed_update": True}))
    with pytest.raises(zerofx.ConfigError, match="nvme_path is missing"):
        zerofx.parse_config(config(2, ADAMW, {"device": "nvme"}))
    with pytest.raises(zerofx.ConfigError, match=r"ratio.*1\.5.*\[0, 1\]"):
        zerofx.parse_config(config(2, ADAMW, {"device": "cpu", "ratio": 1.5}))
    with pytest.raises(zerofx.ConfigError, match="offload_optimizer.device is not"):
        zerofx.parse_config(config(2, ADAMW, zerofx_offload={"delayed_update": True}))


# --------------------------------------------------------------------------- training on gloo ranks
# Budgets that split the tiny model's records over all three tiers at stages 1-3 (fp32 SGD with
# momentum: 4 bytes per owned element, 1.8-4.2 KB per matrix at 2 ranks).
THREE_TIERS = {"device_budget_bytes": 2000, "cpu_budget_bytes": 3000}


STEPS, DPU_STEPS, CKPT_STEPS = 3, 4, 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    """Every 2-rank training run these tests read, in one process group (spawning is the cost)."""
    root = tmp_path_factory.mktemp("nvme")
    runs: dict[str, tuple[dict, int]] = {
        f"sgd-{stage}": (config(stage, SGD, nvme(root / f"s{stage}", buffer_count=2), zerofx_offload=THREE_TIERS), STEPS)
        for stage in (1, 2, 3)
    }
    runs["adamw-3-bf16"] = (config(3, ADAMW, bf16=True), STEPS)
    runs["adamw-3-bf16-nvme"] = (config(3, ADAMW, nvme(root / "adambf16", buffer_count=1), bf16=True), STEPS)
    runs["adamw-1-bf16-cpu"] = (config(1, ADAMW, {"device": "cpu"}, bf16=True), 1)
    dpu = config(3, SGD, nvme(root / "dpu", buffer_count=1), zerofx_offload={**THREE_TIERS, "delayed_update": True})
    runs["sgd-3-delayed"] = (dpu, DPU_STEPS)
    # Saves a checkpoint after step 2 (test_checkpoint_holds_offloaded_state resumes from it).
    runs["adamw-2-bf16-nvme-saved"] = (config(2, ADAMW, nvme(root / "n1"), bf16=True), CKPT_STEPS, None, (str(root / "ckpt"), 2))
    return run_ranks(2, run_many, runs)


def test_every_tier_at_every_stage(trained: list[dict[str, dict]]) -> None:
    expected = reference("dna", 2, STEPS, SGD)
    for res in trained:
        for stage in (1, 2, 3):
            out = res[f"sgd-{stage}"]
            assert max_diff(out["state"], expected) < 1e-5, stage
            assert set(out["tiers"].values()) == {"device", "cpu", "nvme"}
            mem = out["memory"]
            assert 0 < mem["optimizer_states"] <= 2000 and 0 < mem["offload_cpu_bytes"] <= 3000
            # What is not on the device or in host memory is on NVMe: SGD's momentum is 4 bytes per owned element.
            assert mem["optimizer_states"] + mem["offload_cpu_bytes"] + mem["offload_nvme_bytes"] == 4 * out["owned"]
            assert 0 < mem["offload_window_bytes"] < mem["offload_nvme_bytes"]
            read, written = out["io"]
            # Every step reads and writes each NVMe record once; initialization writes them once more.
            assert (read, written) == (STEPS * mem["offload_nvme_bytes"], (STEPS + 1) * mem["offload_nvme_bytes"])
        # torch's own functional AdamW over the fp32 masters on NVMe: the non-offloaded run exactly.
        assert max_diff(res["adamw-3-bf16-nvme"]["state"], res["adamw-3-bf16"]["state"]) == 0.0
        assert res["adamw-3-bf16-nvme"]["losses"] == res["adamw-3-bf16"]["losses"]


def test_estimate_agrees_with_what_the_engine_holds(trained: list[dict[str, dict]], capsys: pytest.CaptureFixture) -> None:
    for name, stage, device in (("adamw-1-bf16-cpu", 1, "cpu"), ("adamw-3-bf16-nvme", 3, "nvme")):
        out = trained[1][name]
        assert main(["estimate", "--params", str(out["num_params"]), "--world-size", "2", "--stage", str(stage),
                     "--offload", device, "--format", "json"]) == 0
        est = json.loads(capsys.readouterr().out)["stages"][str(stage)]
        mem = out["memory"]
        # The paper's 12 bytes per parameter over N, against 12 per owned element (padding included).
        assert mem[f"offload_{device}_bytes"] == 12 * out["owned"]
        assert mem[f"offload_{device}_bytes"] == pytest.approx(est["offloaded_bytes"], rel=2e-3)
        # On the device: bf16 parameters and gradients, and Adam's 4-byte step per tensor.
        assert mem["optimizer_states"] == 4 * out["tensors"]
        assert mem["params"] + mem["grads"] == pytest.approx(est["per_device_bytes"], rel=2e-3)


def test_delayed_update_equals_late_update_reference(trained: list[dict[str, dict]]) -> None:
    late, on_time = reference_late(2, DPU_STEPS, SGD), reference("dna", 2, DPU_STEPS, SGD)
    assert max_diff(late, on_time) > 1e-3  # the delay really changes the numerics
    for res in trained:
        out = res["sgd-3-delayed"]
        assert max_diff(out["state"], late) < 1e-5
        assert set(out["tiers"].values()) == {"device", "cpu", "nvme"}
        assert out["memory"]["offload_staging_bytes"] > 0


def test_vanishing_nvme_folder_is_an_error_not_corruption(tmp_path: Path) -> None:
    (msg,) = run_ranks(1, nvme_folder_vanishes, config(2, SGD, nvme(tmp_path / "gone")), 1)
    assert msg.startswith("OffloadError: NVMe offload: reading") and "no longer exists" in msg and str(tmp_path / "gone") in msg


def test_checkpoint_holds_offloaded_state(trained: list[dict[str, dict]], tmp_path: Path) -> None:
    whole = [res["adamw-2-bf16-nvme-saved"] for res in trained]
    ckpt = Path(whole[0]["checkpoint_dir"])
    # Resume from step 2 with offload to another folder, and without offload: the same run.
    runs = {"nvme": (config(2, ADAMW, nvme(tmp_path / "n2"), bf16=True), CKPT_STEPS, str(ckpt)),
            "plain": (config(2, ADAMW, bf16=True), CKPT_STEPS, str(ckpt))}
    resumed = run_ranks(2, run_many, runs)
    meta = json.loads((ckpt / "step-00000002" / "metadata.json").read_text())
    assert meta["masters"] and all(v == ["exp_avg", "exp_avg_sq"] for v in meta["optimizer"]["tensor_states"].values())
    for r in range(2):
        for name in runs:
            assert max_diff(resumed[r][name]["state"], whole[r]["state"]) == 0.0, name
            assert resumed[r][name]["losses"] == whole[r]["losses"][2:], name


def test_plan_shows_the_placement(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(config(3, ADAMW, nvme(tmp_path / "p", buffer_count=2), zerofx_offload={"cpu_budget_bytes": 1e4}, bf16=True)))
    assert main(["plan", "tiny", "--world-size", "4", "--config", str(cfg), "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "offload: optimizer-state records per tier, 2 NVMe buffers" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["device"], ["cpu"], ["nvme"])}
    assert lines["device"][1] == "0" and int(lines["cpu"][1]) > 0 and int(lines["nvme"][1]) > 0
    assert "exposed" in out and "hidden" in out
