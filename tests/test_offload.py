"""ZeRO-Offload / ZeRO-Infinity: optimizer state on the device, in host memory and on NVMe (files
on the local disk), at every stage, on real gloo ranks; the placement planner under tight budgets;
the one-step delayed update against a late-update reference; faults; checkpoints; and the
estimate against what the engine holds."""

from __future__ import annotations

import json
import re
import math
import os
import warnings
from pathlib import Path

import pytest
import torch

import zerofx
from zerofx.cost_models.offload import OffloadItem, TierSpec, estimate_offload_timeline
from zerofx.cost_models.tiers import Tier
from zerofx.passes.plan.offload import OffloadPlan
from zerofx.passes.memory.plan_offload import plan_offload
from tests.support.dist_utils import run_ranks
from tests.support.models import reference
from tests.support.offload_workers import config, fault_runs, param_config, reference_late, run_many
from zerofx.app.cli import main
from zerofx.runtime.offload.files import DIRECT_ALIGN, NvmeFiles, OffloadError, aligned_empty

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


def _file_system_of(path: Path) -> str:
    """The type of the mount that holds ``path`` (the longest matching mount point)."""
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, fstype, *_ = line.split()
        if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fstype
    return kind


def test_nvme_whole_blocks_bypass_the_page_cache(tmp_path: Path) -> None:
    """NOTE [NVMe I/O]: an aligned buffer's whole 4 KiB blocks move with O_DIRECT where the file
    system takes it; the tail and unaligned buffers go through the page cache; files keep their
    exact size and either path reads what the other wrote."""
    files = NvmeFiles(tmp_path / "nvme", 0)
    if _file_system_of(tmp_path) in ("ext4", "xfs", "btrfs"):
        assert files.direct  # these take O_DIRECT; tmpfs does not
    nbytes = 3 * DIRECT_ALIGN + 123
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    aligned = aligned_empty(nbytes)
    assert aligned.data_ptr() % DIRECT_ALIGN == 0 and aligned.numel() == nbytes
    aligned.copy_(data)
    files.write("direct", aligned, nbytes)
    unaligned = aligned_empty(nbytes + 1)[1:]
    files.read("direct", unaligned, nbytes)  # written with O_DIRECT, read through the page cache
    assert torch.equal(unaligned, data) and files.path("direct").stat().st_size == nbytes
    moved_direct = 3 * DIRECT_ALIGN if files.direct else 0
    assert files.bytes_direct == moved_direct
    files.write("cached", unaligned, nbytes)
    back = aligned_empty(nbytes)
    files.read("cached", back, nbytes)  # written through the page cache, read with O_DIRECT
    assert torch.equal(back, data) and files.bytes_direct == 2 * moved_direct
    files.direct = False  # the same transfers, all through the page cache
    files.read("direct", back.zero_(), nbytes)
    assert torch.equal(back, data) and files.bytes_direct == 2 * moved_direct
    os.truncate(files.path("direct"), 2 * DIRECT_ALIGN)  # a short read inside the O_DIRECT blocks
    files.direct = moved_direct > 0
    with pytest.raises(OffloadError, match=rf"short read of '.*direct\.state': got {2 * DIRECT_ALIGN} of {nbytes} bytes"):
        files.read("direct", back, nbytes)
    os.truncate(files.path("cached"), 2 * DIRECT_ALIGN + 100)  # cut inside a block: still a short read, not EINVAL
    with pytest.raises(OffloadError, match=rf"short read of '.*cached\.state': got {2 * DIRECT_ALIGN + 100} of {nbytes} bytes"):
        files.read("cached", back, nbytes)


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
    # offload_param (stage 3): shards split between host memory (max_in_cpu elements) and NVMe,
    # with the optimizer state on NVMe too (one folder); bf16 AdamW with every shard on NVMe.
    split = nvme(root / "p3", buffer_count=2, max_in_cpu=2000)
    runs["sgd-3-param-split"] = (param_config(3, SGD, split, nvme(root / "p3", buffer_count=2)), STEPS)
    runs["adamw-3-bf16-param-nvme"] = (param_config(3, ADAMW, nvme(root / "pb", buffer_count=1), bf16=True), STEPS)
    # ZeRO-Infinity whole (benchmarks/bench_infinity_large.py's config): parameters, gradients and
    # optimizer states all on NVMe, in one folder.
    infinity = param_config(3, ADAMW, nvme(root / "inf", buffer_count=1), nvme(root / "inf", buffer_count=1), bf16=True)
    infinity["zerofx"] = {"offload_gradients": nvme(root / "inf", buffer_count=1)}
    runs["adamw-3-bf16-all-nvme"] = (infinity, STEPS)
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


def test_nvme_files_are_removed_at_close(trained: list[dict[str, dict]]) -> None:
    for res in trained:
        for name in ("sgd-3", "adamw-3-bf16-nvme", "sgd-3-delayed", "sgd-3-param-split", "adamw-3-bf16-param-nvme"):
            before, after = res[name]["nvme_files"]
            assert before > 0 and after == [], (name, before, after)


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


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The one-rank fault runs, in one process (spawning is the cost)."""
    root = tmp_path_factory.mktemp("faults")
    cfg = config(2, SGD, nvme(root / "gone"))
    param = (param_config(2, SGD, {"device": "cpu"}), param_config(3, SGD, nvme(root / "gone-param", buffer_count=1)))
    (out,) = run_ranks(1, fault_runs, cfg, 1, *param)
    return {**out, "root": root}


def test_vanishing_nvme_folder_is_an_error_not_corruption(faults: dict) -> None:
    msg = faults["records"]
    assert msg.startswith("OffloadError: NVMe offload: reading") and "no longer exists" in msg and str(faults["root"] / "gone") in msg


def test_checkpoint_holds_offloaded_state(trained: list[dict[str, dict]], tmp_path: Path) -> None:
    whole = [res["adamw-2-bf16-nvme-saved"] for res in trained]
    ckpt = Path(whole[0]["checkpoint_dir"])
    # Resume from step 2 with offload to another folder, and without offload: the same run.
    # And at stage 3 with the parameter shards on NVMe too, saving again at the end: the saved
    # parameters are read back from the shards' files.
    again = tmp_path / "ckpt-param"
    runs = {"nvme": (config(2, ADAMW, nvme(tmp_path / "n2"), bf16=True), CKPT_STEPS, str(ckpt)),
            "plain": (config(2, ADAMW, bf16=True), CKPT_STEPS, str(ckpt)),
            "param-nvme": (param_config(3, ADAMW, nvme(tmp_path / "pn"), nvme(tmp_path / "pn"), bf16=True), CKPT_STEPS, str(ckpt),
                           (str(again), CKPT_STEPS))}
    resumed = run_ranks(2, run_many, runs)
    meta = json.loads((ckpt / "step-00000002" / "metadata.json").read_text())
    assert meta["masters"] and all(v == ["exp_avg", "exp_avg_sq"] for v in meta["optimizer"]["tensor_states"].values())
    for r in range(2):
        for name in runs:
            assert max_diff(resumed[r][name]["state"], whole[r]["state"]) == 0.0, name
            assert resumed[r][name]["losses"] == whole[r]["losses"][2:], name
    assert set(resumed[0]["param-nvme"]["param"]["tiers"].values()) == {"nvme"}
    from safetensors.torch import load_file

    from zerofx.runtime.consolidation import consolidate

    saved = load_file(consolidate(again, tmp_path / "param.safetensors", dtype="bf16"))
    assert max_diff({k: v.float() for k, v in saved.items()}, resumed[0]["param-nvme"]["state"]) == 0.0


def test_plan_shows_the_placement(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "ds.json"
    # With offload_param too: its shard placement and I/O follow the records'.
    raw = param_config(3, ADAMW, nvme(tmp_path / "q", buffer_count=3, max_in_cpu=2000), nvme(tmp_path / "p", buffer_count=2), bf16=True)
    raw["zerofx"] = {"offload": {"cpu_budget_bytes": 1e4}}
    cfg.write_text(json.dumps(raw))
    assert main(["plan", "tiny", "--world-size", "4", "--config", str(cfg), "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "offload: optimizer-state records per tier, 2 NVMe buffers" in out
    records, shards = out.split("offload_param: parameter shards per tier, 3 NVMe reads ahead")
    for text in (records, shards):
        lines = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["device"], ["cpu"], ["nvme"])}
        assert lines["device"][1] == "0" and int(lines["cpu"][1]) > 0 and int(lines["nvme"][1]) > 0
    assert "exposed" in records and "hidden" in records
    assert re.search(r"parameter I/O .* ms per step .* hidden .* ms and exposed .* ms", shards)


# --------------------------------------------------------------------------- offload_param (stage 3)
def test_param_fetch_timeline_closed_form() -> None:
    from zerofx.cost_models.offload import FetchItem, estimate_param_fetch_s

    # Shards of 1000 bytes read at 1000 B/s (1 s each), needed at 0, 1, 2 s into the pass.
    tiers = {Tier.NVME: TierSpec(INF, 1000.0, 500.0), Tier.CPU: TierSpec(INF, INF, INF)}
    items = [FetchItem(f, Tier.NVME, 1000, t) for f, t in (("a", 0.0), ("b", 1.0), ("c", 2.0))]
    # Two ahead: a ready at 1 (waits 1), b at 2 (needed at 1 + 1: no wait), c at 3 (needed 3): 1 s exposed of 3.
    assert estimate_param_fetch_s(items, tiers, buffer_count=2) == pytest.approx((3.0, 1.0))
    # One ahead: b's read starts when a is taken (1 s), ready at 2 (needed at 2), c likewise.
    assert estimate_param_fetch_s(items, tiers, buffer_count=1) == pytest.approx((3.0, 1.0))
    # Host memory on the CPU moves nothing.
    assert estimate_param_fetch_s([FetchItem("a", Tier.CPU, 1000, 0.0)], tiers, buffer_count=1) == (0.0, 0.0)


def test_param_placement_and_plan_round_trip() -> None:
    from zerofx.passes.plan.offload import ParamOffloadPlan
    from zerofx.passes.memory.plan_offload import plan_param_offload

    tiers = {Tier.DEVICE: TierSpec(0, INF, INF), Tier.CPU: TierSpec(250, INF, INF), Tier.NVME: TierSpec(INF, 1e3, 1e3)}
    shards = [("a", 100, True), ("b", 200, True), ("c", 50, False)]
    plan = plan_param_offload(shards, [("a",), ("b", "c")], tiers, buffer_count=2, forward_s=1.0, backward_s=2.0)
    # Largest first: b -> cpu (50 left), a -> nvme, c -> cpu.
    assert dict(plan.tiers) == {"a": Tier.NVME, "b": Tier.CPU, "c": Tier.CPU}
    assert plan.offloaded == {"a", "b", "c"} and plan.bytes_on(Tier.NVME) == 100
    # a is read in forward (needed at 0: 0.1 s exposed) and backward (needed at 1 s: hidden), written once.
    e = plan.estimates
    assert (e["read_s"], e["write_s"], e["exposed_io_s"], e["hidden_io_s"]) == pytest.approx((0.2, 0.1, 0.2, 0.1))
    assert ParamOffloadPlan.from_json(plan.to_json()) == plan
    # device cpu: every shard in host memory, moved for free when the device is the CPU.
    from zerofx.runtime.offload import ParamOffloadOptions

    opts = ParamOffloadOptions.from_config(param_config(3, SGD, {"device": "cpu"}))
    plan = plan_param_offload(shards, [("a", "b", "c")], opts.tier_specs(4, device_is_cpu=True), buffer_count=1, forward_s=1.0)
    assert set(dict(plan.tiers).values()) == {Tier.CPU} and plan.estimates["io_s"] == 0.0


def _stage3_graphs() -> tuple[dict, object]:
    from tests.support.models import batches, dna_lm

    ids = batches(2, 1)[0, 0]
    program = zerofx.compile(dna_lm(), world_size=2, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids},
                             config={"optimizer": SGD})
    return program.graph_modules(0), program.plan


def test_fetch_params_pass_fetches_each_shard_right_before_its_gather() -> None:
    from zerofx.passes import meta
    from zerofx.passes.memory.fetch_params import FETCH_FQN, fetch_order, fetch_params_pass, is_fetch
    from zerofx.passes.plan.offload import ParamOffloadPlan

    gms, plan = _stage3_graphs()
    sharded = [p.fqn for p in plan.params if p.fqn not in plan.persistent]
    offloaded = sharded[1:]  # the first (embed.weight) stays on the device
    pplan = ParamOffloadPlan(tuple((f, Tier.DEVICE if f not in offloaded else Tier.NVME) for f in sharded),
                             tuple((f, 4) for f in sharded), 2, {})
    for name in ("forward", "backward"):
        gm = gms[name]
        before = len(list(gm.graph.nodes))
        fetch_params_pass(gm, pplan)
        nodes = list(gm.graph.nodes)
        fetches = [n for n in nodes if is_fetch(n)]
        assert len(nodes) == before + len(offloaded) and sorted(fetch_order(gm)) == sorted(offloaded), name
        gathers = [n for n in nodes if meta.is_all_gather(n)]
        pos = {n: i for i, n in enumerate(nodes)}
        for k, gather in enumerate(gathers):
            bucket = [f for f in gather.meta[meta.COMM_FQNS] if f in offloaded]
            # The bucket's fetches come right before its pack (or the gather itself), nothing between.
            start = min(pos[a] for a in [gather, *gather.all_input_nodes] if a.op != "placeholder" and not is_fetch(a))
            mine = nodes[start - len(bucket) : start]
            assert [n.meta.get(FETCH_FQN) for n in mine] == [f for f in gather.meta[meta.COMM_FQNS] if f in offloaded], (name, k)
            # ...and after the wait of bucket k - d: the prefetch distance holds for the reads too.
            if k >= plan.prefetch_distance and bucket:
                anchor = next(u for u in gathers[k - plan.prefetch_distance].users if meta.is_wait(u))
                assert pos[mine[0]] > pos[anchor], (name, k)
        # Offloaded placeholders are tokens: only fetches (and forward's output) use them.
        for ph in meta.placeholders(gm.graph, meta.Role.PARAM):
            users = {u.op if u.op == "output" else is_fetch(u) for u in ph.users}
            assert users <= ({True, "output"} if ph.meta[meta.FQN] in offloaded else {False, "output"}), (name, ph)
            if ph.meta[meta.FQN] in offloaded:
                assert tuple(ph.meta["val"].shape) == (1,) and ph.meta["val"].dtype == torch.int64
        assert all(tuple(n.meta["val"].shape) == (n.args[2],) for n in fetches)
        code = gm.code
        assert fetch_params_pass(gm, pplan).code == code  # twice: nothing changes
        gm.graph.lint()
    # Nothing more to offload: the graph is returned unchanged.
    none = ParamOffloadPlan(tuple((f, Tier.DEVICE) for f in sharded), tuple((f, 4) for f in sharded), 2, {})
    code = gms["forward"].code
    assert fetch_params_pass(gms["forward"], none) is gms["forward"] and gms["forward"].code == code


def _param_store(tmp_path: Path, numels: dict[str, int], buffer_count: int = 2):
    from zerofx.passes.plan.offload import ParamOffloadPlan
    from zerofx.runtime.offload import ParamOffloadOptions, ParamStore

    plan = ParamOffloadPlan(tuple((f, Tier.NVME) for f in numels), tuple((f, 4 * n) for f, n in numels.items()), buffer_count, {})
    options = ParamOffloadOptions(Tier.NVME, tmp_path, False, buffer_count, 0.0, 1e9, 1e9, 1e9)
    store = ParamStore(plan, options, numels, torch.float32, device=torch.device("cpu"), rank=0)
    for i, f in enumerate(numels):
        store.init_shard(f, torch.full((numels[f],), float(i)))
    return store


def test_param_store_window_is_bounded(tmp_path: Path) -> None:
    numels = {f"layer{i}.w": 1000 for i in range(12)}
    store = _param_store(tmp_path, numels, buffer_count=2)
    store.set_schedule(list(numels))
    store.reset_peak()
    for _step in range(2):
        for i, f in enumerate(numels):
            shard = torch.ops.zerofx.fetch_shard(store.token, f, 1000, torch.float32, torch.device("cpu"))
            assert torch.equal(shard, torch.full((1000,), float(i)))
            del shard  # the graph drops it after the gather's pack
    # Two reads ahead and the one being used: never the whole set.
    assert store.peak_held_shards == 3 and store.peak_held_bytes == 3 * 4000
    kept = [store.fetch(f) for f in numels]  # a caller that keeps them all does hold them all
    assert store.held_shards >= len(numels)
    del kept
    # An update writes the shard back; the next fetch sees it, even though a read was issued ahead.
    host = store.acquire("layer0.w")
    host.fill_(7.0)
    store.release("layer0.w", host)
    assert torch.equal(store.fetch("layer0.w"), torch.full((1000,), 7.0))
    store.close()


def test_param_store_faults_name_the_path(tmp_path: Path) -> None:
    from zerofx.passes.plan.offload import ParamOffloadPlan
    from zerofx.runtime.offload import ParamOffloadOptions, ParamStore

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    plan = ParamOffloadPlan((("w", Tier.NVME),), (("w", 400),), 1, {})
    options = ParamOffloadOptions(Tier.NVME, blocker, False, 1, 0.0, 1e9, 1e9, 1e9)
    with pytest.raises(OffloadError, match=f"cannot create folder '{blocker}/rank-00000'"):
        ParamStore(plan, options, {"w": 100}, torch.float32, device=torch.device("cpu"), rank=0)
    store = _param_store(tmp_path / "nvme", {"w": 100, "v": 100}, buffer_count=1)
    fetch = torch.ops.zerofx.fetch_shard
    # Short read: the file lost its tail (the error comes through the graph's op as it is).
    os.truncate(store.files.path("w"), 100)
    with pytest.raises(OffloadError, match=r"short read of '.*/rank-00000/w\.param': got 100 of 400 bytes of w's parameter shard"):
        fetch(store.token, "w", 100, torch.float32, torch.device("cpu"))
    # Full disk on write-back.
    store.files.path("v").unlink()
    os.symlink("/dev/full", store.files.path("v"))
    store.release("v", torch.zeros(100))
    with pytest.raises(OffloadError, match=r"writing 400 bytes of v's parameter shard to '.*v\.param' failed: the disk is full"):
        store.drain()
    # The folder vanishes.
    for p in store.files.root.iterdir():
        p.unlink()
    store.files.root.rmdir()
    with pytest.raises(OffloadError, match=f"reading .* '{store.files.root}/w.param' failed: folder '{store.files.root}' no longer exists"):
        fetch(store.token, "w", 100, torch.float32, torch.device("cpu"))
    store.close()


def test_offload_param_config() -> None:
    from zerofx.runtime.offload import ParamOffloadOptions

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # acted on: no warning for the section's keys
        raw = param_config(3, SGD, nvme(Path("/tmp/x"), pin_memory=True, buffer_count=3, max_in_cpu=1000))
        zerofx.parse_config(raw)
    opts = ParamOffloadOptions.from_config(raw)
    assert (opts.device, opts.buffer_count, opts.max_in_cpu, opts.pin_memory) == (Tier.NVME, 3, 1000.0, True)
    with pytest.raises(zerofx.ConfigError, match="offload_param.device is nvme but nvme_path is missing"):
        zerofx.parse_config(param_config(3, SGD, {"device": "nvme"}))
    assert ParamOffloadOptions.from_config(config(3, SGD)) is None


def _window_bound(param: dict) -> int:
    """NOTE [The parameter store]'s bound on NVMe shards in host memory at once."""
    buckets = [len([f for f in b if param["tiers"].get(f) == "nvme"]) for b in param["gather_buckets"]]
    return 2 * param["buffer_count"] + 1 + max(max(buckets), param["prefetch_distance"] + 1)


def test_offload_param_trains_like_plain_pytorch(trained: list[dict[str, dict]]) -> None:
    expected = reference("dna", 2, STEPS, SGD)
    for res in trained:
        out = res["sgd-3-param-split"]
        assert max_diff(out["state"], expected) < 1e-5
        param, mem = out["param"], out["memory"]
        assert param["resident_shards"] == []  # the engine keeps none of the shards
        on = {t: sum(b for f, b in param["shard_bytes"].items() if param["tiers"][f] == t) for t in ("cpu", "nvme")}
        # Host memory holds the largest shards that fit max_in_cpu (2000 fp32 elements), NVMe the rest.
        assert 0 < on["cpu"] <= 4 * 2000 and on["nvme"] > 0
        assert (mem["params"], mem["offload_param_cpu_bytes"], mem["offload_param_nvme_bytes"]) == (0, on["cpu"], on["nvme"])
        sizes = {f: b for f, b in param["shard_bytes"].items() if param["tiers"][f] == "nvme"}
        total, trainable = sum(sizes.values()), sum(sizes[f] for f in param["trainable"] if f in sizes)
        read, written = param["io"]
        # Initialization writes every shard; each step writes back the trainable ones. Each step
        # reads every shard in forward and backward and the trainable ones for the update (plus
        # full_state_dict's reads, and reads ahead dropped because an update rewrote the shard).
        assert written == total + STEPS * trainable
        assert STEPS * (2 * total + trainable) + total <= read <= STEPS * (3 * total + trainable) + total
        # Never more NVMe shards in host memory than NOTE [The parameter store] allows.
        assert 0 < param["peak_held_shards"] <= _window_bound(param)
        # The window: with every shard on NVMe and one read ahead, never all the shards at once
        # (the bound is 2 x 1 + 1 + the largest bucket, 7 of the 16 shards).
        whole = res["adamw-3-bf16-param-nvme"]["param"]
        assert 0 < whole["peak_held_shards"] <= _window_bound(whole) < len(whole["shard_bytes"])
        assert whole["peak_held_bytes"] < sum(whole["shard_bytes"].values())
        # Optimizer state and shards share one NVMe folder: SGD momentum is one fp32 per owned element.
        assert mem["offload_nvme_bytes"] == 4 * out["owned"]
        # bf16 AdamW with every shard on NVMe, and with every state on NVMe: the non-offloaded run exactly.
        for name in ("adamw-3-bf16-param-nvme", "adamw-3-bf16-all-nvme"):
            assert max_diff(res[name]["state"], res["adamw-3-bf16"]["state"]) == 0.0, name
            assert res[name]["losses"] == res["adamw-3-bf16"]["losses"], name
        infinity = res["adamw-3-bf16-all-nvme"]["memory"]
        # On the device: nothing but AdamW's 4-byte step per tensor.
        assert (infinity["params"], infinity["grads"], infinity["optimizer_states"]) == (0, 0, 4 * res["adamw-3-bf16-all-nvme"]["tensors"])
        assert min(infinity["offload_param_nvme_bytes"], infinity["offload_grad_nvme_bytes"], infinity["offload_nvme_bytes"]) > 0


def test_estimate_agrees_with_offloaded_params(trained: list[dict[str, dict]], capsys: pytest.CaptureFixture) -> None:
    out = trained[0]["adamw-3-bf16-param-nvme"]
    assert main(["estimate", "--params", str(out["num_params"]), "--world-size", "2", "--stage", "3",
                 "--offload-param", "nvme", "--format", "json"]) == 0
    est = json.loads(capsys.readouterr().out)["stages"]["3"]
    mem = out["memory"]
    # bf16 shards: 2 bytes per element of this rank's shards (padding included; the frozen norm too).
    assert mem["params"] == 0 and mem["offload_param_nvme_bytes"] == sum(out["param"]["shard_bytes"].values())
    assert mem["offload_param_nvme_bytes"] == pytest.approx(est["offloaded_param_bytes"], rel=1e-2)
    # What stays on the device: gradient shards and (offload_optimizer off) the AdamW records.
    assert mem["params"] + mem["grads"] + mem["optimizer_states"] == pytest.approx(est["per_device_bytes"], rel=2e-3)



def test_offload_param_faults_in_the_engine(faults: dict) -> None:
    out = faults["params"]
    assert out["stage2"].startswith("ZeroFXError: zero_optimization.offload_param applies at ZeRO stage 3")
    # The shard's read fails inside the forward graph; the error names the file and the shard.
    assert out["vanished"].startswith("OffloadError: NVMe offload: reading") and "parameter shard" in out["vanished"]
    assert f"folder '{out['root']}' no longer exists" in out["vanished"]
