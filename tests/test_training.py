"""DeepSpeed config features on real gloo ranks: mixed precision (bf16, fp16 with loss scaling),
gradient accumulation, gradient clipping, learning-rate schedulers; and reading real DeepSpeed
config shapes."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import zerofx
from tests.support.dist_utils import run_ranks
from tests.support.train_workers import reduced_grads_kept, reference_clipped, saved_tensors_freed_in_backward, train
from zerofx.runtime.schedulers import lr_at

ADAMW = {"type": "AdamW", "params": {"lr": 3e-3}}


def cfg(stage: int, **extra: object) -> dict:
    return {"zero_optimization": {"stage": stage}, "optimizer": ADAMW, **extra}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def test_bf16_tracks_fp32_with_paper_memory() -> None:
    steps = 8
    fp32 = run_ranks(2, train, cfg(3), steps)
    bf16 = run_ranks(2, train, cfg(3, bf16={"enabled": True}), steps)
    for r in range(2):
        assert bf16[r]["dtype"] == "torch.bfloat16"
        # bf16 rounds activations and weights to 8 bits of mantissa; the loss trajectory stays
        # within 0.03 nats of fp32 over these steps (the loss itself is ~1.6).
        assert max(abs(a - b) for a, b in zip(bf16[r]["losses"], fp32[r]["losses"])) < 0.03
        assert bf16[r]["losses"][-1] < bf16[r]["losses"][0]
        # Per rank: 2 (bf16 shard) + 2 (bf16 grad shard) + 12 (fp32 master, exp_avg, exp_avg_sq)
        # bytes per owned element, plus Adam's 4-byte step per tensor.
        mem, owned, tensors = bf16[r]["memory"], bf16[r]["owned"], bf16[r]["tensors"]
        assert mem == bf16[r]["planned"]
        assert mem["grads"] == 2 * owned and mem["optimizer_states"] == 12 * owned + 4 * tensors
        assert sum(mem.values()) - 4 * tensors == pytest.approx(16 * owned, rel=0.01)


def test_fp16_dynamic_loss_scale_skips_overflow_and_trains() -> None:
    # 2**24 overflows fp16 gradients: the first steps are skipped and the scale halves each time
    # (hysteresis 1) until the gradients fit; then training proceeds.
    fp16 = {"enabled": True, "initial_scale_power": 24, "hysteresis": 1, "loss_scale_window": 1000}
    res = run_ranks(2, train, cfg(2, fp16=fp16), 12)
    for r in res:
        assert r["dtype"] == "torch.float16"
        assert 0 < r["skipped"] < 12
        assert r["scales"][-1] == 2.0 ** (24 - r["skipped"])
        # The data are uniform random tokens, so the loss sits near ln(5) from the start and
        # cannot fall much: the check is that the updates after the skipped steps keep it and the
        # weights finite (an unscaled fp16 update would blow them up), not that it drops.
        after = r["losses"][r["skipped"]:]
        assert all(math.isfinite(x) for x in after) and max(after) < math.log(5) + 0.2, after
        assert all(torch.isfinite(v).all() for v in r["state"].values())


def test_gradient_accumulation_and_clipping_match_single_process() -> None:
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    config = {"zero_optimization": {"stage": 3}, "optimizer": sgd, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05}
    expected = reference_clipped(2, 3, lr=0.1, max_norm=0.05, micro=2)
    unclipped = reference_clipped(2, 3, lr=0.1, max_norm=0.0, micro=2)
    assert max_diff(unclipped, expected) > 1e-3  # clipping really bites at this norm
    for r in run_ranks(2, train, config, 3, 2):
        assert max_diff(r["state"], expected) < 1e-5


def test_backward_frees_saved_tensors_as_it_goes() -> None:
    """The backward graph is called boxed: each tensor the forward saved is freed by the graph
    itself after its last use, not when the whole backward returns. The ones never freed are
    held by the engine anyway (the batch, and at stage 3 the parameter shards)."""
    (res,) = run_ranks(1, saved_tensors_freed_in_backward, [0, 3])
    for stage, r in res.items():
        assert r["freed_in_graph"] == r["freed"] >= r["saved"] * 2 // 3, (stage, r)


def test_reduced_gradients_become_the_buffers() -> None:
    """NOTE [Reduced gradients become the buffers]: at stage 3 (as at 0 and 2) the gradients the
    backward graph returns are kept as the engine's buffers and the optimizer's ``.grad``, with
    no zeroing or adding over them, and the next step leaves them as they were; stage 1 adds
    into buffers it keeps. An output that shares memory with another or with a shard is copied,
    a parameter without a gradient gets zeros, and the buffers hold what they held before."""
    res = run_ranks(2, reduced_grads_kept, [1, 3])
    for r in res:
        for stage, s in r.items():
            assert s["kept"] == ([False, False] if stage == 1 else [True, True]), (stage, s)
            assert s["linked"] and s["first_untouched"] != (stage == 1), (stage, s)
            assert s["shared_apart"] and s["shard_copied"] and s["zeros_elsewhere"], (stage, s)
            assert s["memory_grads"] >= s["owned_grad_bytes"], (stage, s)


def test_scheduler_drives_the_learning_rate() -> None:
    spec = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}}
    assert [lr_at(spec, s, 1.0) for s in range(6)] == pytest.approx([0, 0.0025, 0.005, 0.0075, 0.01, 0.01])
    log = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10}}
    assert lr_at(log, 4, 1.0) == pytest.approx(0.01 * math.log(5) / math.log(10))
    decay = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 2, "total_num_steps": 6, "warmup_type": "linear"}}
    assert [lr_at(decay, s, 1.0) for s in (2, 4, 6)] == pytest.approx([0.01, 0.005, 0.0])
    cosine = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 0, "total_num_steps": 10, "cos_min_ratio": 0.0}}
    assert lr_at(cosine, 5, 2.0) == pytest.approx(1.0) and lr_at(cosine, 10, 2.0) == pytest.approx(0.0)
    res = run_ranks(2, train, cfg(1, scheduler=spec), 5)
    assert res[0]["lrs"] == pytest.approx([0, 0.0025, 0.005, 0.0075, 0.01])


DEEPSPEED_DOC_CONFIGS = {
    "stage2_cpu_offload": {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
                              "allgather_bucket_size": 2e8, "reduce_scatter": True, "reduce_bucket_size": 2e8, "overlap_comm": True,
                              "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    },
    "stage3_nvme": {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4},
                              "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5},
                              "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 5e8,
                              "stage3_param_persistence_threshold": 1e6, "sub_group_size": 1e12,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": True},
    },
    "fp16_warmup": {
        "train_batch_size": 32, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
        "zero_optimization": {"stage": 1},
    },
}


@pytest.mark.parametrize("name", sorted(DEEPSPEED_DOC_CONFIGS))
def test_reads_deepspeed_documentation_configs(name: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parsed = zerofx.parse_config(DEEPSPEED_DOC_CONFIGS[name])
    assert parsed.stage == DEEPSPEED_DOC_CONFIGS[name]["zero_optimization"]["stage"]
    if name == "stage3_nvme":
        assert parsed.compute_dtype is torch.bfloat16 and parsed.schedule.persistence_threshold == 10**6
        # offload_param is acted on now (no warning); stage3_max_reuse_distance is read and warns, once.
        assert not any("offload_param.device" in str(w.message) for w in caught)
        assert any("stage3_max_reuse_distance" in str(w.message) for w in caught)
    if name == "fp16_warmup":
        assert parsed.compute_dtype is torch.float16 and parsed.gradient_accumulation_steps == 2


@pytest.mark.parametrize(
    "config, message",
    [
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "enable at most one"),
        ({"bf16": {"enable": True}}, "did you mean enabled"),
        ({"scheduler": {"type": "OneCycle"}}, "WarmupLR, WarmupDecayLR, WarmupCosineLR"),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "min_loss_scale.*a number > 0"),
        ({"gradient_clipping": -1}, "gradient_clipping.*-1"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps.*integer >= 1"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "disk"}}}, "none, cpu or nvme"),
    ],
)
def test_bad_configs_name_the_key(config: dict, message: str) -> None:
    with pytest.raises(zerofx.ConfigError, match=message):
        zerofx.parse_config(config)
