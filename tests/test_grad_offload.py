"""Gradient offload (``zerofx.offload_gradients``, ZeRO-Infinity): the config's cross-key checks;
parity, bit for bit, with the run that keeps gradients on the device, on real 2-rank gloo groups at
stages 2 and 3, with gradient accumulation and clipping, with the one-step delayed update and with
parameter offload; no device gradient buffer left; each reduced bucket handed off at its wait, so
the backward holds one reduced bucket at a time (measured in the run and in the memory model);
faults in the gradient files, and a torn write that is never read as a gradient."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from tests.support.dist_utils import run_ranks
from tests.support.grad_offload_workers import grad_config, grad_faults, train_many
from zerofx.config import parse_config
from zerofx.cost_models.tiers import Tier
from zerofx.common.errors import ConfigError
from zerofx.runtime.offload.files import TRAILER_BYTES, OffloadError
from zerofx.runtime.offload.grads import GradStore
from zerofx.config.offload_options import GradOffloadOptions

ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}
STEPS, ACCUMULATION, CLIP = 2, 2, 0.05


def nvme(path: Path, **extra: object) -> dict:
    return {"device": "nvme", "nvme_path": str(path), **extra}


def test_config_parses_and_refuses_contradictions(tmp_path: Path) -> None:
    opts = parse_config(grad_config(3, ADAMW, nvme(tmp_path, buffer_count=2))).grad_offload
    assert opts is not None and opts.device is Tier.NVME and opts.nvme_path == tmp_path and opts.buffer_count == 2
    assert parse_config(grad_config(2, ADAMW, {"device": "cpu"})).grad_offload.device is Tier.CPU
    assert parse_config(grad_config(2, ADAMW, {"device": "none"})).grad_offload is None
    assert parse_config(grad_config(2, ADAMW)).grad_offload is None
    with pytest.raises(ConfigError, match=r"zerofx\.offload_gradients\.device is cpu but zero_optimization\.stage is 1"):
        parse_config(grad_config(1, ADAMW, {"device": "cpu"}))
    with pytest.raises(ConfigError, match=r"zerofx\.offload_gradients\.device is cpu but zero_optimization\.stage is 0"):
        parse_config({"zerofx": {"offload_gradients": {"device": "cpu"}}}, stage=0)  # the stage= argument counts too
    with pytest.raises(ConfigError, match=r"zerofx\.offload_gradients\.device is nvme but zerofx\.offload_gradients\.nvme_path is missing"):
        parse_config(grad_config(2, ADAMW, {"device": "nvme"}))
    with pytest.raises(ConfigError, match=r"zerofx\.offload_gradients\.device"):
        parse_config(grad_config(2, ADAMW, {"device": "gpu"}))
    with pytest.raises(ConfigError, match=r"zerofx\.offload_gradients\.buffer_count"):
        parse_config(grad_config(2, ADAMW, {"device": "cpu", "buffer_count": 0}))


def _runs(root: Path) -> dict[str, tuple[dict, int]]:
    bf16 = {"bf16": True, "accumulation": ACCUMULATION}
    delayed = {"offload": {"device": "cpu"}, "delayed": True, **bf16}
    return {
        # Stage 2, accumulation: gradients on the device and in host memory.
        "s2": (grad_config(2, ADAMW, **bf16), STEPS),
        "s2-cpu": (grad_config(2, ADAMW, {"device": "cpu"}, **bf16), STEPS),
        # Stage 3, accumulation and clipping (the factor is applied as each gradient is read), with
        # every parameter shard and gradient on NVMe (one folder for both).
        "s3-clip": (grad_config(3, ADAMW, clipping=CLIP, **bf16), STEPS),
        "s3-clip-param-nvme": (grad_config(3, ADAMW, nvme(root / "p3"), clipping=CLIP, param=nvme(root / "p3", buffer_count=1), **bf16),
                               STEPS),
        # The one-step delayed update: the update reads one generation while the backward fills the other.
        "s3-delayed": (grad_config(3, ADAMW, **delayed), STEPS),
        "s3-delayed-nvme": (grad_config(3, ADAMW, nvme(root / "d3", buffer_count=2), **delayed), STEPS),
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    """Every 2-rank run these tests read, in one process group (spawning is the cost)."""
    return run_ranks(2, train_many, _runs(tmp_path_factory.mktemp("grads")))


PAIRS = [("s2-cpu", "s2"), ("s3-clip-param-nvme", "s3-clip"), ("s3-delayed-nvme", "s3-delayed")]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("offloaded", "on_device"), PAIRS)
def test_offloaded_gradients_train_bit_for_bit_like_device_ones(trained: list[dict[str, dict]], offloaded: str, on_device: str) -> None:
    for res in trained:
        a, b = res[offloaded], res[on_device]
        assert a["losses"] == b["losses"]
        assert all((a["state"][k] == b["state"][k]).all() for k in b["state"]), offloaded
    # The cases differ from each other: clipping and the delay change the numbers.
    base = trained[0]
    assert base["s3-clip"]["losses"][-1] != base["s3-delayed"]["losses"][-1]


@pytest.mark.multiprocess
def test_no_gradient_buffer_stays_on_the_device(trained: list[dict[str, dict]]) -> None:
    for res in trained:
        on_device = res["s2"]["memory"]["grads"]
        assert on_device == 2 * res["s2"]["owned"] > 0  # bf16 shards of every owned element
        for name in ("s2-cpu", "s3-clip-param-nvme", "s3-delayed-nvme"):
            out = res[name]
            mem = out["memory"]
            assert mem["grads"] == 0 and out["device_grad_buffers"] == 0, name
            generations = 2 if "delayed" in name else 1  # the delayed update's second generation
            tier = "nvme" if "nvme" in name else "cpu"
            # On NVMe each of the 15 files ends in its trailer (NOTE [Gradient files carry their version]).
            trailers = 15 * TRAILER_BYTES if tier == "nvme" else 0
            assert mem[f"offload_grad_{tier}_bytes"] == generations * (on_device + trailers), name
        # NVMe: each micro-step writes every shard; each second micro-step (read-add-write) and
        # each step read them; clipping reads them once more for the norm.
        nvme_run = res["s3-clip-param-nvme"]
        read, written = nvme_run["grad_io"]
        assert written == STEPS * ACCUMULATION * on_device and read == STEPS * (ACCUMULATION - 1 + 1 + 1) * on_device
        assert nvme_run["memory"]["offload_grad_window_bytes"] > 0
        # One file per trainable shard (a frozen norm has none), deleted at close.
        assert len(nvme_run["grad_files"]) == 15 and all(f.endswith(".grad") for f in nvme_run["grad_files"])
        assert sum(f.endswith(".grad1") for f in res["s3-delayed-nvme"]["grad_files"]) == 15
        for name in ("s3-clip-param-nvme", "s3-delayed-nvme"):
            assert res[name]["left_after_close"] == [], name


@pytest.mark.multiprocess
@pytest.mark.parametrize(("offloaded", "on_device"), PAIRS)
def test_reduced_gradients_leave_the_backward_at_their_bucket_wait(trained: list[dict[str, dict]], offloaded: str,
                                                                    on_device: str) -> None:
    for res in trained:
        a, b = res[offloaded], res[on_device]
        buckets = b["bucket_bytes"]
        assert len(buckets) > 1 and a["bucket_bytes"] == buckets and sum(buckets) == b["memory"]["grads"]
        # NOTE [Gradients leave at their bucket's wait]: every trainable shard is handed off, each
        # right after its bucket's wait with only that bucket's tail in between, and none is an output.
        assert len(a["handoffs"]) == 15 and all(strays == [] for _, strays in a["handoffs"]), a["handoffs"]
        assert a["reduced_outputs"] == 0 and b["reduced_outputs"] == 15 and b["handoffs"] == []
        # Measured in the run: the graph's reduced storages alive at each hand-off are one bucket's;
        # on the device every bucket is alive when the backward returns.
        assert b["reduced_live_peak"] == sum(buckets)
        assert a["reduced_live_peak"] == max(buckets) < sum(buckets)
        # The memory model counts the same, and nothing is left when the backward returns.
        assert (a["reduced_model_peak"], b["reduced_model_peak"]) == (max(buckets), sum(buckets))
        assert (a["backward_end_bytes"], b["backward_end_bytes"]) == (0, sum(buckets))
        assert (a["planned_grads"], b["planned_grads"]) == (0, sum(buckets))


@pytest.mark.multiprocess
def test_faults_in_gradient_files_name_the_file_and_operation(tmp_path: Path) -> None:
    # Both ranks meet the same fault at the same point (in the 2-rank pool the parity runs started).
    for out in run_ranks(2, grad_faults, str(tmp_path)):
        _check_fault_messages(out)


def _check_fault_messages(out: dict[str, str]) -> None:
    fqn = out["full_disk_fqn"]
    assert out["full_disk"].startswith("OffloadError: NVMe offload: writing ") and f"of {fqn}'s gradient shard to" in out["full_disk"]
    assert "failed: the disk is full" in out["full_disk"] and f"{fqn}.grad" in out["full_disk"]
    assert out["removed_folder"].startswith("OffloadError: NVMe offload: writing ") and "gradient shard" in out["removed_folder"]
    assert f"folder '{out['removed_root']}' no longer exists" in out["removed_folder"]
    assert out["truncated"].startswith(f"OffloadError: NVMe offload: short read of '{out['truncated_path']}': got ")
    assert out["truncated"].endswith(f" of {out['truncated_bytes']} bytes of {out['truncated_fqn']}'s gradient shard "
                                     "(file truncated or replaced?)")


def test_a_torn_gradient_write_is_never_read_as_a_gradient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [Gradient files carry their version], on one store: the second micro-step's
    # read-add-write stops with an I/O error after half its bytes (40 KiB: the direct blocks and
    # the tail both tear), as a fault or a killed process would leave the file.
    numel = 10_000 + 123
    options = GradOffloadOptions(device=Tier.NVME, nvme_path=tmp_path, pin_memory=False, buffer_count=2)
    store = GradStore(options, {"w": numel}, {"w": torch.float32}, order=["w"], generations=1, device=torch.device("cpu"), rank=0)
    path = store.files.path("w")
    g = torch.arange(numel, dtype=torch.float32)
    store.add("w", g)
    store.drain()
    assert path.stat().st_size == 4 * numel + TRAILER_BYTES
    real_pwrite = os.pwrite

    def torn_pwrite(fd: int, data: bytes, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == str(path):
            real_pwrite(fd, memoryview(data)[: len(data) // 2], offset)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", torn_pwrite)
    store.add("w", g)
    with pytest.raises(OffloadError, match=rf"writing {4 * numel} bytes of w's gradient shard to '{path}' failed: Input/output error"):
        store.drain()
    monkeypatch.undo()
    # The file has its full size and part new bytes; read, it is an error naming it, not a gradient.
    assert path.stat().st_size == 4 * numel + TRAILER_BYTES
    with pytest.raises(OffloadError, match=rf"'{path}' does not hold w's gradient shard: its trailer records write 1 of {4 * numel} "
                                           rf"bytes, expected write 2 of {4 * numel} bytes \(a write to it stopped part way"):
        store._read(store.gen, "w")
    # The next accumulation starts whole, and reads back exactly what it wrote.
    store.end_step()
    store.add("w", g)
    store.add("w", g)
    assert torch.equal(store._read(store.gen, "w"), 2 * g)
    # A file another store left (a killed run's, same name and size) is never taken for this one's.
    other = GradStore(options, {"w": numel}, {"w": torch.float32}, order=["w"], generations=1, device=torch.device("cpu"), rank=0)
    other._filled[0].add("w")
    other._versions[(0, "w")] = 3
    with pytest.raises(OffloadError, match=r"its trailer records another run's write"):
        other._read(0, "w")
    other.close()
    store.close()
