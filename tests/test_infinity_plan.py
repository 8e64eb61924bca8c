"""ZeRO-Infinity's planning side: the per-tier memory model behind ``zerofx estimate`` (the 1T-on-
one-device and 32T-on-512-ranks points), its placement of model states by bandwidth, and the
shard planner's cost-per-step placement against first-fit decreasing. Pure: no process group, no
parameter memory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from zerofx.app.cli import main
from zerofx.cost_models.infinity import NodeSpec, estimate_infinity, estimate_working_set_bytes, layer_shape
from zerofx.cost_models.memory import paper_breakdown
from zerofx.cost_models.offload import TierSpec
from zerofx.cost_models.tiers import Tier
from zerofx.passes.plan.offload import ParamOffloadPlan, Placement
from zerofx.passes.memory.plan_offload import plan_param_offload

INF = math.inf
ALL_NVME = ["--offload", "nvme", "--offload-param", "nvme", "--offload-grad", "nvme"]


def estimate_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    assert main(["estimate", *argv, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


# --------------------------------------------------------------------------- the scale points
def test_one_trillion_parameters_fit_one_80gb_device_with_states_on_nvme(capsys: pytest.CaptureFixture) -> None:
    out = estimate_json(capsys, "--params", "1e12", "--world-size", "1", *ALL_NVME, "--hidden", "25600", "--ranks-per-node", "1",
                        "--device-memory", "80GB")
    # The paper's accounting leaves nothing of the model states on the device at stage 3.
    assert out["stages"]["3"]["per_device_bytes"] == 0.0
    tiers = out["tiers"]
    assert tiers["shape"]["layers"] == 127  # 1e12 / (12 * 25600^2), rounded
    h = 25600
    ws = tiers["working_set_bytes"]
    # NOTE [The Infinity working set]: the MLP's h x 4h weight gathered with one ahead, its gradient,
    # 4 fetch buffers of it (one rank: its shard is all of it), checkpoints of (1, 1024, h) per layer.
    assert ws["gathered_params"] == 2 * 4 * h * h * 2
    assert ws["gathered_grads"] == 4 * h * h * 2
    assert ws["fetch_buffers"] == 4 * 4 * h * h * 2
    assert ws["activation_checkpoints"] == 2 * 1024 * h * 127
    assert ws["activation_working"] == pytest.approx(1024 * h * (34 + 5 * 200 * 1024 / h))
    assert tiers["per_rank_bytes"]["device"] == pytest.approx(sum(ws.values()))
    assert tiers["per_rank_bytes"]["device"] < 80e9 and tiers["fits"] == {"device": True, "cpu": True, "nvme": True}
    # All 16 bytes per parameter on NVMe; host memory holds only the staging buffers.
    assert tiers["per_rank_bytes"]["nvme"] == pytest.approx(16e12)
    assert tiers["per_rank_bytes"]["cpu"] == tiers["host_buffer_bytes"] == 4 * 4 * h * h * 16
    # Without the working set the old answer was 2 TB of gradients on the device.
    assert paper_breakdown(1e12, stage=3, world_size=1, offload="nvme", offload_param="nvme")["per_device_bytes"] == 2e12


def test_thirty_two_trillion_parameters_on_512_ranks(capsys: pytest.CaptureFixture) -> None:
    # 32 DGX-2 nodes of 16 V100s (32 GB): tiles of 16 and checkpoints in host memory.
    argv = ["--params", "32e12", "--world-size", "512", *ALL_NVME, "--hidden", "65536", "--ranks-per-node", "16",
            "--tile-factor", "16", "--checkpoints", "cpu", "--device-memory", "32GB"]
    tiers = estimate_json(capsys, *argv)["tiers"]
    assert tiers["per_rank_bytes"]["device"] < 32e9 and tiers["fits"] == {"device": True, "cpu": True, "nvme": True}
    assert tiers["working_set_bytes"]["activation_checkpoints"] == 0.0
    assert tiers["checkpoint_host_bytes"] == 2 * 1024 * 65536 * tiers["shape"]["layers"]
    assert tiers["per_rank_bytes"]["nvme"] == pytest.approx(16 * 32e12 / 512)
    assert tiers["per_node_bytes"]["nvme"] == pytest.approx(16 * tiers["per_rank_bytes"]["nvme"])
    # Without tiling the gathered operator alone (2 x 4 h^2 fp16) is 69 GB: it does not fit.
    untiled = estimate_json(capsys, *argv[:-6], "--checkpoints", "cpu", "--device-memory", "32GB")["tiers"]
    assert untiled["fits"]["device"] is False
    # The table says so in words.
    assert main(["estimate", *argv[:-6], "--checkpoints", "cpu", "--device-memory", "32GB", "--stage", "3"]) == 0
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "working set: gathered parameters" in text and "per node (16 ranks)" in text


def test_estimate_without_offload_prints_no_tier_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["estimate", "--params", "7e9", "--world-size", "8"]) == 0
    assert "every tier" not in capsys.readouterr().out
    # A layer shape alone asks for it.
    assert main(["estimate", "--params", "7e9", "--world-size", "8", "--layers", "32"]) == 0
    assert "layer shape 32 layers x hidden 4224" in capsys.readouterr().out


# --------------------------------------------------------------------------- the model
def test_layer_shape_from_params() -> None:
    assert layer_shape(1e12, hidden=25600).layers == 127
    s = layer_shape(1e12, layers=128)
    assert s.hidden % 128 == 0 and abs(s.num_params / 1e12 - 1) < 0.01
    s = layer_shape(175e9)  # neither given: hidden = 128 * layers, GPT-3 175B's aspect
    assert s.layers == 96 and s.hidden == 12288 and s.heads == 96
    with pytest.raises(ValueError, match="layers=0"):
        layer_shape(1e9, layers=0)


def test_working_set_shrinks_with_tiles_and_ranks() -> None:
    shape = layer_shape(1e12, hidden=25600)
    one = estimate_working_set_bytes(shape, world_size=1)
    tiled = estimate_working_set_bytes(shape, world_size=1, tile_factor=4)
    assert tiled["gathered_params"] == one["gathered_params"] / 4 and tiled["gathered_grads"] == one["gathered_grads"] / 4
    assert estimate_working_set_bytes(shape, world_size=64)["fetch_buffers"] == pytest.approx(one["fetch_buffers"] / 64)
    assert tiled["activation_checkpoints"] == one["activation_checkpoints"]


NODE = NodeSpec(ranks_per_node=8, host_bytes=8 * 100e9, nvme_bytes=30e12, nvme_read_bytes_per_s=24e9, nvme_write_bytes_per_s=12e9,
                host_link_bytes_per_s=12e9, device_flops_per_s=50e12)


def test_auto_placement_gives_host_memory_to_parameters_first_and_keeps_explicit_choices() -> None:
    # 1e12 parameters on 64 ranks: 31.25 GB of fp16 parameters, as much of gradients, 187.5 GB of optimizer state per rank.
    shape = layer_shape(1e12, hidden=25600)
    auto = {"params": "auto", "grads": "auto", "optimizer_states": "auto"}
    e = estimate_infinity(1e12, shape, world_size=64, choices=auto, node=NODE, buffer_count=1)
    host = 100e9 - e.host_buffer_bytes
    # Parameters move 3 times per step (2 reads, 1 write), the others twice: parameters go first.
    assert e.placement["params"]["cpu"] == pytest.approx(31.25e9) and e.placement["params"]["nvme"] == 0
    assert e.placement["grads"]["cpu"] == pytest.approx(31.25e9)
    assert e.placement["optimizer_states"]["cpu"] == pytest.approx(host - 62.5e9)
    assert e.tier_bytes["cpu"] == pytest.approx(100e9)
    # An explicit choice stays where the user put it, even where "auto" would do otherwise.
    e = estimate_infinity(1e12, shape, world_size=64, choices={**auto, "params": "nvme", "optimizer_states": "cpu"}, node=NODE,
                          buffer_count=1)
    assert e.placement["params"]["nvme"] == pytest.approx(31.25e9)
    assert e.placement["optimizer_states"]["cpu"] == pytest.approx(187.5e9)
    assert e.placement["grads"]["cpu"] == 0.0  # no host memory left for the planner


def test_io_per_rank_falls_with_the_ranks() -> None:
    # Bandwidth-centric partitioning: each rank moves its own 1/N shard over its share of the node's
    # links, so with nodes added the seconds per step fall as 1/N while the compute per rank stays.
    shape = layer_shape(1e12, hidden=25600)
    nvme = {"params": "nvme", "grads": "nvme", "optimizer_states": "nvme"}
    small, large = (estimate_infinity(1e12, shape, world_size=n, choices=nvme, node=NODE) for n in (8, 256))
    assert small.io_s["nvme"] / large.io_s["nvme"] == pytest.approx(32)
    assert small.compute_s == large.compute_s == pytest.approx(8 * 1e12 * 1024 / 50e12)
    # 16 bytes per parameter, read and written once (parameters read twice): (2*2 + 2*2 + 12*2) / 8 / N per byte...
    per_rank = 1e12 / 8
    expected = 8 * per_rank * (2 * (2 / 24e9 + 1 / 12e9) + 2 * (1 / 24e9 + 1 / 12e9) + 12 * (1 / 24e9 + 1 / 12e9))
    assert small.io_s["nvme"] == pytest.approx(expected)


def test_paper_breakdown_offloads_gradients_from_stage_2() -> None:
    b = paper_breakdown(1e9, stage=2, world_size=4, offload="cpu", offload_grad="nvme")
    assert b["per_device_bytes"] == 2e9 and b["offloaded_grad_bytes"] == 0.5e9
    assert paper_breakdown(1e9, stage=1, world_size=4, offload_grad="cpu")["offloaded_grad_bytes"] == 0.0
    with pytest.raises(ValueError, match="offload_grad='disk'"):
        paper_breakdown(1e9, stage=3, world_size=4, offload_grad="disk")


# --------------------------------------------------------------------------- shard placement
def test_trainable_shards_take_host_memory_from_frozen_ones() -> None:
    # Two blocks of equal shards: the first frozen (read twice per step), the second trainable (read
    # twice and written once). Host memory holds one block. First-fit (largest, then earliest first)
    # fills it with the frozen block and writes the trainable one back to NVMe every step.
    tiers = {Tier.DEVICE: TierSpec(0, INF, INF), Tier.CPU: TierSpec(300, INF, INF), Tier.NVME: TierSpec(INF, 3000.0, 300.0)}
    shards = [(f"b0.{w}", 100, False) for w in "uvw"] + [(f"b1.{w}", 100, True) for w in "uvw"]
    buckets = [("b0.u", "b0.v", "b0.w"), ("b1.u", "b1.v", "b1.w")]
    first_fit = plan_param_offload(shards, buckets, tiers, buffer_count=2, placement=Placement.FIRST_FIT)
    assert first_fit.fqns_on(Tier.CPU) == ("b0.u", "b0.v", "b0.w")
    plan = plan_param_offload(shards, buckets, tiers, buffer_count=2)
    assert plan.placement is Placement.BANDWIDTH and plan.fqns_on(Tier.CPU) == ("b1.u", "b1.v", "b1.w")
    # Predicted: first-fit reads 300 bytes twice (0.2 s) and writes 300 (1 s); the new one only reads.
    e = plan.estimates
    assert (e["first_fit_exposed_io_s"], e["bandwidth_exposed_io_s"], e["write_s"]) == pytest.approx((1.2, 0.2, 0.0))
    assert first_fit.estimates["exposed_io_s"] == pytest.approx(1.2)
    assert ParamOffloadPlan.from_json(plan.to_json()) == plan
    assert "placement: cost per step (bandwidth-centric); predicted exposed parameter I/O 200 ms" in str(plan)
    assert "1.2e+03 ms by first-fit decreasing" in str(plan)


def test_a_shard_whose_reads_hide_yields_host_memory() -> None:
    # Three buckets of one shard; compute to hide behind in both passes. b is the largest, so
    # first-fit keeps it in host memory, but b's reads hide (it is neither forward's nor backward's
    # first): a (forward's first) or c (backward's first) gains more from the room.
    tiers = {Tier.DEVICE: TierSpec(0, INF, INF), Tier.CPU: TierSpec(110, INF, INF), Tier.NVME: TierSpec(INF, 1000.0, 1e9)}
    shards = [("a", 100, True), ("b", 110, True), ("c", 100, True)]
    plan = plan_param_offload(shards, [("a",), ("b",), ("c",)], tiers, buffer_count=1, forward_s=3.0, backward_s=3.0)
    assert plan.placement is Placement.BANDWIDTH and plan.fqns_on(Tier.CPU) == ("a",)
    assert plan.estimates["exposed_io_s"] == pytest.approx(0.1, rel=1e-3)
    assert plan.estimates["first_fit_exposed_io_s"] == pytest.approx(0.2, rel=1e-3)


def test_equal_costs_keep_first_fit() -> None:
    # Every shard costs the same per byte and nothing hides: the plan is first-fit's, as before.
    tiers = {Tier.DEVICE: TierSpec(0, INF, INF), Tier.CPU: TierSpec(250, INF, INF), Tier.NVME: TierSpec(INF, 1e3, 1e3)}
    shards = [("a", 100, True), ("b", 200, True), ("c", 50, True)]
    plan = plan_param_offload(shards, [("a", "b", "c")], tiers, buffer_count=2)
    assert plan.placement is Placement.FIRST_FIT and dict(plan.tiers) == {"a": Tier.NVME, "b": Tier.CPU, "c": Tier.CPU}
    assert plan.estimates["first_fit_exposed_io_s"] == plan.estimates["bandwidth_exposed_io_s"]
    # A plan written before the field existed reads back as first-fit.
    d = json.loads(plan.to_json())
    del d["placement"]
    assert ParamOffloadPlan.from_json(json.dumps(d)).placement is Placement.FIRST_FIT


def test_plan_tier_line_takes_offloaded_bytes_off_the_peak() -> None:
    from types import SimpleNamespace

    from zerofx.app.estimate import format_plan_tiers, plan_tier_bytes
    from zerofx.passes.plan.offload import OffloadPlan

    records = OffloadPlan(tiers=(("a", Tier.CPU), ("b", Tier.NVME)), record_bytes=(("a", 300), ("b", 500)), buffer_count=1,
                          delayed_update=False, estimates={})
    tiers = {Tier.DEVICE: TierSpec(0, INF, INF), Tier.CPU: TierSpec(100, INF, INF), Tier.NVME: TierSpec(INF, 1e3, 1e3)}
    shards = plan_param_offload([("a", 100, True), ("b", 40, True)], [("a", "b")], tiers, buffer_count=1)
    got = plan_tier_bytes(2000, SimpleNamespace(optimizer=records, params=shards))
    assert got == {"device": 2000 - 300 - 500 - 140, "cpu": 400, "nvme": 540}
    assert format_plan_tiers(got).startswith("per rank per tier: device 1.04 KiB at the peak")
    # Offloaded gradient shards join their tier; the memory model already leaves them off the device.
    with_grads = plan_tier_bytes(2000, SimpleNamespace(optimizer=records, params=shards), grad_bytes=64, grad_tier="nvme")
    assert with_grads == {**got, "nvme": 540 + 64}
    # On a CPU rank host memory is the device's: only what goes to NVMe leaves it (NOTE [Host offload on a CPU rank]).
    on_cpu = plan_tier_bytes(2000, SimpleNamespace(optimizer=records, params=shards), memory_is_host=True)
    assert on_cpu == {**got, "device": 2000 - 540}


def test_plan_budget_verdict_is_the_devices_with_offload(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``zerofx plan --budget`` with everything on NVMe judges the device's bytes (the peak less
    what the offload plans hold elsewhere), and the NVMe line counts the gradient shards."""

    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = tmp_path / "all_nvme.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                  "zero_optimization": {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme},
                                  "zerofx": {"offload_gradients": nvme}}))
    argv = ["plan", "tiny", "--world-size", "2", "--stage", "3", "--seq-len", "32", "--fold", "off", "--config", str(config)]
    assert main([*argv, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    tiers, peak = data["tiers_per_rank_bytes"], data["memory"]["peak_bytes"]
    grads = sum(p["shard_numel"] for p in data["plan"]["params"] if p["requires_grad"]) * 4
    assert tiers["nvme"] >= grads > 0 and tiers["device"] < peak
    between = int(tiers["device"] + peak) // 2  # over the device's bytes, under the peak without offload
    assert main([*argv, "--budget", f"{between}B"]) == 0
    assert "fits (device" in capsys.readouterr().out
    assert main([*argv, "--budget", f"{between}B", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["fits"] is True
