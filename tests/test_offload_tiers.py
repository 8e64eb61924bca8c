"""The tier backends the offload stores keep their records through (NOTE [Tier backends]): each
backend round-trips bytes, the NVMe one on files whose faults name the file and the operation."""

from __future__ import annotations

import os

import pytest
import torch

import zerofx
from zerofx.app.cli import build_parser
from zerofx.cost_models.infinity import TIERS
from zerofx.cost_models.memory import paper_breakdown
from zerofx.cost_models.tiers import NO_OFFLOAD, OFFLOAD_TIERS, PLACEMENT_CHOICES, Tier
from zerofx.runtime.offload.files import DIRECT_ALIGN, NvmeFiles, OffloadError
from zerofx.runtime.offload.tiers import MemoryTier, TierBackend, TierRequest, open_tier

CPU = torch.device("cpu")


def _open(tier: Tier, tmp_path, **kwargs) -> TierBackend:
    return open_tier(tier, TierRequest(CPU, True, tmp_path / "nvme", 3, **kwargs))


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tier, kind, in_place", [(Tier.DEVICE, MemoryTier, True), (Tier.CPU, MemoryTier, True), (Tier.NVME, NvmeFiles, False)])
def test_every_tier_opens_its_backend(tmp_path, tier, kind, in_place):
    backend = _open(tier, tmp_path)
    assert type(backend) is kind and backend.in_place is in_place
    assert not getattr(backend, "pin_memory", False)  # pinning only where the device is CUDA


@pytest.mark.parametrize("tier", list(Tier))
def test_each_backend_round_trips_bytes(tmp_path, tier):
    backend = _open(tier, tmp_path)
    nbytes = DIRECT_ALIGN + 13  # whole O_DIRECT blocks and a tail
    held = backend.allocate("layer.w", nbytes)
    assert held.dtype == torch.uint8 and held.numel() == nbytes and held.device == CPU
    if backend.in_place:
        assert not held.any()  # the record itself, zeroed
    value = _pattern(nbytes, 0)
    backend.write("layer.w", value, nbytes)
    back = backend.allocate("other", nbytes) if not backend.in_place else torch.empty(nbytes, dtype=torch.uint8)
    backend.read("layer.w", back, nbytes)
    assert torch.equal(back, value)
    assert backend.io_bytes() == (nbytes, nbytes)
    assert backend.stored_bytes(["layer.w", "never-stored"]) == nbytes
    backend.close()
    assert backend.stored_bytes(["layer.w"]) == 0


def test_memory_tier_holds_the_record_in_place():
    tier = MemoryTier(CPU)
    record = tier.allocate("w", 8)
    record.view(torch.float32).fill_(1.5)  # the store updates the record where it is
    out = torch.empty(8, dtype=torch.uint8)
    tier.read("w", out, 8)
    assert torch.equal(out.view(torch.float32), torch.full((2,), 1.5))


def test_memory_tier_names_a_record_it_does_not_hold():
    tier = MemoryTier(CPU)
    tier.allocate("w", 4)
    with pytest.raises(OffloadError, match=r"cpu memory offload: reading 4 bytes of 'v' failed: the tier holds no record"):
        tier.read("v", torch.empty(4, dtype=torch.uint8), 4)
    with pytest.raises(OffloadError, match=r"writing 8 bytes of 'w' failed: the tier holds a record of 4 bytes"):
        tier.write("w", torch.empty(8, dtype=torch.uint8), 8)


def test_nvme_buffers_are_aligned_and_the_files_are_the_records(tmp_path):
    files = _open(Tier.NVME, tmp_path, suffix=".param", what="parameter shard")
    buf = files.allocate("w", 3 * DIRECT_ALIGN)
    assert buf.data_ptr() % DIRECT_ALIGN == 0  # O_DIRECT-ready (NOTE [NVMe I/O])
    files.write("w", _pattern(3 * DIRECT_ALIGN, 1), 3 * DIRECT_ALIGN)
    assert files.path("w") == tmp_path / "nvme" / "rank-00003" / "w.param"
    assert files.path("w").stat().st_size == 3 * DIRECT_ALIGN
    files.close()
    assert not (tmp_path / "nvme" / "rank-00003").exists()  # a clean close leaves no folder behind


def test_nvme_faults_name_the_file_and_the_operation(tmp_path):
    files = _open(Tier.NVME, tmp_path)
    buf = files.allocate("w", 256)
    files.write("w", _pattern(256, 2), 256)
    path = files.path("w")
    os.truncate(path, 100)
    with pytest.raises(OffloadError, match=f"short read of '{path}': got 100 of 256 bytes of w's optimizer state"):
        files.read("w", buf, 256)
    for p in files.root.iterdir():
        p.unlink()
    files.root.rmdir()
    with pytest.raises(OffloadError, match=f"writing 256 bytes of w's optimizer state to '{path}' failed: folder '{files.root}' no longer exists"):
        files.write("w", buf, 256)


def test_versioned_nvme_reads_only_the_write_it_expects(tmp_path):
    files = _open(Tier.NVME, tmp_path, suffix=".grad", what="gradient shard", versioned=True)
    value = _pattern(64, 3)
    files.write("w", value, 64, version=1)
    back = files.allocate("w", 64)
    files.read("w", back, 64, version=1)
    assert torch.equal(back, value)
    with pytest.raises(OffloadError, match=f"'{files.path('w')}' does not hold w's gradient shard: its trailer records write 1 of 64 bytes, "
                                           "expected write 2"):
        files.read("w", back, 64, version=2)


_DEVICE_KEYS = {
    "zero_optimization.offload_optimizer": lambda device: {"zero_optimization": {"stage": 3, "offload_optimizer": device}},
    "zero_optimization.offload_param": lambda device: {"zero_optimization": {"stage": 3, "offload_param": device}},
    "zerofx.offload_gradients": lambda device: {"zero_optimization": {"stage": 2}, "zerofx": {"offload_gradients": device}},
}


@pytest.mark.parametrize("key", list(_DEVICE_KEYS))
def test_config_device_keys_spell_the_offload_tiers(key, tmp_path):
    """Every ``device`` key accepts "none" and the name of each tier but the device itself, and
    lists them the way its message always has."""
    assert [t.value for t in OFFLOAD_TIERS] == ["cpu", "nvme"]
    for name in [NO_OFFLOAD, *(t.value for t in OFFLOAD_TIERS)]:
        zerofx.parse_config(_DEVICE_KEYS[key]({"device": name, "nvme_path": str(tmp_path)}))
    for name in ("device", "disk", "CPU"):
        with pytest.raises(zerofx.ConfigError, match=rf"{key}.device.*accepted: none, cpu or nvme"):
            zerofx.parse_config(_DEVICE_KEYS[key]({"device": name}))


def test_every_list_of_tier_names_comes_from_the_enum():
    """The placement table's columns, the placements a state may be asked for (cost models and
    the CLI's --offload flags) are the ``Tier`` members' spellings, so a new member reaches them."""
    assert TIERS == tuple(t.value for t in Tier) == ("device", "cpu", "nvme")
    assert PLACEMENT_CHOICES == (NO_OFFLOAD, *(t.value for t in OFFLOAD_TIERS), "auto")
    flags = {a.dest: a.choices for p in build_parser()._subparsers._group_actions[0].choices.values() for a in p._actions}
    assert tuple(flags["offload"]) == tuple(flags["offload_param"]) == tuple(flags["offload_grad"]) == PLACEMENT_CHOICES
    with pytest.raises(zerofx.ZeroFXError, match="accepted: none, cpu, nvme, auto"):
        paper_breakdown(1e9, stage=3, world_size=8, offload="disk")
