"""ZeRO's features with the genomic models' sequence mixers under sequence parallelism
(docs/sequence-parallel.md, "ZeRO composes with the sequence mixers"), in real gloo process groups.

Two launches (one module fixture; tests/support/sp_compose_workers.py). World 2, sequence 2,
stage 3, striped-tiny with AdamW (3 featurizer convs, the SE and MR convs by halo, the LI conv by
channel all-to-all, attention striped in): on the device, and with every offload over host memory
and NVMe, each saving after step 2; the device save resumed as data 2 without sequence
parallelism; bf16 on striped-tiny, mamba-tiny (halo and scan) and a conv + cumsum model. World
4, data 2 x sequence 2 in shard groups of 2: striped-tiny from the start, and the world-2 save
resumed in that layout. Every run is compared with plain fp32 PyTorch on the same global batches.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support import sp_compose_workers as w
from tests.support.dist_utils import run_ranks
from zerofx.runtime.checkpoint import read_metadata

TOL = 1e-5  # fp32, the parity tests' tolerance
# bf16 against fp32 plain PyTorch on the same global batch after 2 SGD steps, per parameter: the
# distance of the fp32 master from fp32's, over the norm of fp32's update. bf16 keeps 8
# significant bits, so every value the forward and backward compute is off by up to 2^-8 of
# itself; the updates of small parameters fed by many rounded products drift further. Measured
# at most 4.3% (mamba-tiny's block-0 x_proj, whose outputs feed the scan's delta, B and C; 1.6%
# on striped-tiny, 0.4% on the conv + cumsum model), where bf16 without sequence parallelism on
# the same models is 4.6%, 1.6% and 0.4% from fp32, and the two bf16 runs are at most 1.7% apart.
# A dropped halo, a state passed from the wrong rank or a filter on the wrong lags moves the
# updates it touches by tens of percent. Losses (fp32 sums of rounded logits, or bf16 where the
# model's cross-entropy runs in bf16): within one rounding, 2^-8 (measured 1.7e-3 at most).
BF16_UPDATE_TOL, BF16_LOSS_TOL = 2.0 ** -4, 2.0 ** -8
# The forward's all-to-alls at S = 2 on a group batch of 4 (dtype, shape), in graph order: the
# rank's position (int64) first and the loss's sum and count (fp32) last. striped-tiny (d = 32,
# SDH*): the halos of the featurizer convs (3 taps over 3d channels) and of the SE (7 taps) and
# MR (16) convs in bf16, (S, B, C, K - 1); the LI conv's signal, filter and output in fp32 (the
# model runs its FFTs in fp32), (S, B, C/S, T/S) and (S, C/S, T/S); attention's q, k, v and
# output in bf16. mamba-tiny (E = 64, N = 8, 4 taps) per block: the conv's halo in bf16, then
# the scan's final state and decay in fp32, (S, 2, B, E, N). The conv + cumsum model (16
# channels): the halo in bf16, the cumsum's slice totals in fp32, (S, B, d).
BF16, FP32 = "torch.bfloat16", "torch.float32"
FEATURIZER = (BF16, (2, 4, 96, 2))
BF16_EXCHANGES = {
    "striped": [("torch.int64", (2,)), FEATURIZER, (BF16, (2, 4, 32, 6)), FEATURIZER, (BF16, (2, 4, 32, 15)), FEATURIZER,
                (FP32, (2, 4, 16, 32)), (FP32, (2, 16, 32)), (FP32, (2, 4, 16, 32)), (BF16, (2, 3, 4, 2, 32, 8)), (BF16, (2, 4, 2, 32, 8)),
                (FP32, (2, 2))],
    "mamba": [("torch.int64", (2,))] + [(BF16, (2, 4, 64, 3)), (FP32, (2, 2, 4, 64, 8))] * 2 + [(FP32, (2, 2))],
    "convsum": [("torch.int64", (2,)), (BF16, (2, 4, 16, 3)), (FP32, (2, 4, 16)), (FP32, (2, 2))],
}
# The cumsum of bf16 values accumulates in fp32; each scan (twice per block: from zero, then
# from the state passed in) takes bf16 x and an fp32 state and returns bf16 y and an fp32 state.
BF16_ACCUMULATORS = {"striped": [], "mamba": [("scan", BF16, FP32, BF16, FP32)] * 4, "convsum": [("cumsum", BF16, FP32)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("sp_compose")
    world2 = run_ranks(2, w.sequence_2, str(root))
    world4 = run_ranks(4, w.world_4, str(root))  # loads world 2's save
    return root, {"world2": world2, "world4": world4, "reference": w.reference("striped", w.ADAMW, w.TOTAL_STEPS)}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b) and a
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _optim_diff(got: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]]) -> float:
    assert sorted(got) == sorted(want) and got
    return max(_max_diff(got[f], want[f]) for f in got)


def _global_losses(results: list[dict[str, Any]], size: int) -> list[float]:
    """Each step's loss over the global batch: the mean of the data groups' losses (rank g * S's)."""
    per_group = [results[g * size]["losses"] for g in range(len(results) // size)]
    for g, losses in enumerate(per_group):  # every rank of a sequence group reports its group's loss
        assert all(results[g * size + i]["losses"] == losses for i in range(size))
    return [sum(step) / len(step) for step in zip(*per_group)]


def test_sequence_2_on_striped_tiny_matches_pytorch(runs: tuple[Path, dict[str, Any]]) -> None:
    _, r = runs
    ref = r["reference"]
    device = [rank["device"] for rank in r["world2"]]
    assert _global_losses(device, 2) == pytest.approx(ref["losses"], abs=TOL)
    for res in device:
        assert _max_diff(res["saved"]["state"], ref[w.SAVED_STEPS]["state"]) < TOL
        assert _max_diff(res["final"]["state"], ref[w.TOTAL_STEPS]["state"]) < TOL
        assert _optim_diff(res["final"]["optim"], ref[w.TOTAL_STEPS]["optim"]) < TOL
    decision = next(d for d in device[0]["decisions"] if d.startswith("sequence parallelism ("))
    assert "5 short convolution(s)" in decision and "1 FFT convolution(s)" in decision and "1 attention(s)" in decision


def test_offload_to_host_memory_and_nvme_trains_bit_for_bit_like_the_device(runs: tuple[Path, dict[str, Any]]) -> None:
    """Optimizer-state records and parameter shards split between host memory and NVMe files,
    reduced gradients in host memory: the same losses, parameters and AdamW states as on the
    device, and a checkpoint whose slices equal the device run's."""
    root, r = runs
    for res in r["world2"]:
        offloaded, device = res["offload"], res["device"]
        assert offloaded["losses"] == device["losses"]
        for key in ("saved", "final"):
            assert _max_diff(offloaded[key]["state"], device[key]["state"]) == 0.0
            assert _optim_diff(offloaded[key]["optim"], device[key]["optim"]) == 0.0
        # What the device run holds, moved: records and parameter shards over both tiers, gradients to host memory.
        mem, on_device = offloaded["memory"], device["memory"]
        assert min(mem["offload_cpu_bytes"], mem["offload_nvme_bytes"], mem["offload_param_cpu_bytes"], mem["offload_param_nvme_bytes"]) > 0, mem
        assert mem["optimizer_states"] + mem["offload_cpu_bytes"] + mem["offload_nvme_bytes"] == on_device["optimizer_states"], mem
        assert mem["offload_param_cpu_bytes"] + mem["offload_param_nvme_bytes"] == on_device["params"] and mem["params"] == 0, mem
        assert mem["offload_grad_cpu_bytes"] == on_device["grads"] and mem["grads"] == 0, mem
    for rank in range(2):
        name = f"rank-{rank:05d}-of-00002.safetensors"
        saved, offloaded = load_file(root / w.SAVE_S2 / name), load_file(root / w.SAVE_S2_OFFLOAD / name)
        assert sorted(saved) == sorted(offloaded) and any(k.startswith("state/") for k in saved)
        assert all(torch.equal(saved[k], offloaded[k]) for k in saved), rank


@pytest.mark.parametrize("kind", ["striped", "mamba", "convsum"])
def test_bf16_trains_close_to_fp32_and_accumulates_in_fp32(runs: tuple[Path, dict[str, Any]], kind: str) -> None:
    _, r = runs
    fp32 = w.reference(kind, w.SGD, w.SAVED_STEPS)
    for rank, by_case in enumerate(r["world2"]):
        res = by_case[f"bf16-{kind}"]
        assert all(math.isfinite(x) for x in res["losses"]) and res["losses"] == pytest.approx(fp32["losses"], rel=BF16_LOSS_TOL), rank
        assert sorted(res["masters"]) == sorted(k for k, _ in w.model(kind).named_parameters())
        for fqn, master in res["masters"].items():
            assert master.dtype == torch.float32
            update = (fp32[w.SAVED_STEPS]["state"][fqn] - fp32["initial"][fqn]).norm()
            assert (master - fp32[w.SAVED_STEPS]["state"][fqn]).norm() <= BF16_UPDATE_TOL * update, (rank, fqn)
        assert res["exchanges"]["forward"] == BF16_EXCHANGES[kind], rank
        assert res["accumulators"] == BF16_ACCUMULATORS[kind], rank


def test_shard_groups_of_2_with_data_2_x_sequence_2(runs: tuple[Path, dict[str, Any]]) -> None:
    """World 4: ZeRO state sharded within each sequence group of 2 and replicated across the 2
    data groups, the sequence mixers' exchanges within the same groups."""
    _, r = runs
    ref = r["reference"]
    fresh = [rank["fresh"] for rank in r["world4"]]
    assert all(res["shard_group_size"] == 2 for res in fresh)
    assert _global_losses(fresh, 2) == pytest.approx(ref["losses"], abs=TOL)
    assert fresh[0]["losses"] != fresh[2]["losses"]  # the data groups train on different rows
    for res in fresh:
        assert _max_diff(res["final"]["state"], ref[w.TOTAL_STEPS]["state"]) < TOL
        assert _optim_diff(res["final"]["optim"], ref[w.TOTAL_STEPS]["optim"]) < TOL


# name: (launch, result key, sequence size of the resumed run)
RESUMES = {"world2-seq2-to-world2-data2": ("world2", "data2", 1), "world2-seq2-to-world4-data2xseq2": ("world4", "resumed", 2)}


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_in_another_layout_continues_the_run(runs: tuple[Path, dict[str, Any]], name: str) -> None:
    """The world-2 sequence-2 checkpoint (stage 3) resumed at stage 1 as data 2 without sequence
    parallelism, and at stage 3 as data 2 x sequence 2 in shard groups of 2: the state resharded
    exactly, and steps 3-4 as the uninterrupted run (plain PyTorch over all 4 steps, and the
    world-2 run that went on after its save)."""
    root, r = runs
    launch, key, size = RESUMES[name]
    meta = read_metadata(root, w.SAVE_S2)
    assert meta["layout"] == {"world_size": 2, "sequence_parallel_size": 2, "data_parallel_size": 1, "shard_group_size": 2}
    ref, saved = r["reference"], r["world2"][0]["device"]["saved"]
    results = [rank[key] for rank in r[launch]]
    for rank, res in enumerate(results):
        assert _max_diff(res["loaded"]["state"], saved["state"]) == 0.0 and _optim_diff(res["loaded"]["optim"], saved["optim"]) == 0.0
        assert res["loaded"]["counters"] == saved["counters"] == {"global_steps": 2, "global_samples": 2 * w.GLOBAL_BATCH}
        assert res["client"] == {"rank": rank % 2, "batches_consumed": w.SAVED_STEPS}
        assert res["final"]["counters"] == {"global_steps": w.TOTAL_STEPS, "global_samples": w.TOTAL_STEPS * w.GLOBAL_BATCH}
        assert _max_diff(res["final"]["state"], ref[w.TOTAL_STEPS]["state"]) < TOL
        assert _optim_diff(res["final"]["optim"], ref[w.TOTAL_STEPS]["optim"]) < TOL
    losses = _global_losses(results, size)
    assert losses == pytest.approx(ref["losses"][w.SAVED_STEPS:], abs=TOL)
    assert losses == pytest.approx(r["world2"][0]["device"]["losses"][w.SAVED_STEPS:], abs=TOL)


def test_striped_hyena_runs_in_bf16_without_sequence_parallelism() -> None:
    """Its rotary tables follow the model's dtype (computed in fp32 in the forward, they would
    make q and k fp32 beside a bf16 v, which SDPA refuses)."""
    net = w.model("striped").to(torch.bfloat16)
    ids = w.global_batch(1)
    out = net(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16 and math.isfinite(out.loss.item())
