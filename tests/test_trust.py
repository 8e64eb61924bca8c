"""What zerofx loads that another process or user could have written (docs/failure-modes.md#what-zerofx-trusts).
The plan cache (NOTE [Who the plan cache trusts] in zerofx/compiler/cache_trust.py): a forged
entry is never unpickled, and a directory, entry or key file that others may write is not used.
Checkpoints: a client file whose pickle would run code is refused."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
from pathlib import Path

import pytest

import zerofx
from tests.support.plan_cache_workers import lowered_tiny_lm
from zerofx.compiler import cache_trust, plan_cache
from zerofx.config.options import CacheTrust

CONFIG = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zerofx": {"prefetch_distance": 1}}


class _Payload:
    """A pickle that creates ``marker`` when loaded: what an attacker puts in an entry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def program() -> zerofx.Program:
    return lowered_tiny_lm(CONFIG)


@pytest.fixture()
def key_file(tmp_path: Path) -> Path:
    return tmp_path / "secret" / "plan-cache.key"


def _key() -> dict:
    return {"versions": plan_cache.versions(), "model": "m", "forward": "f"}


def _load(directory: Path, program: zerofx.Program, key_file: Path, trust: CacheTrust = CacheTrust.PRIVATE) -> tuple[zerofx.Program, int]:
    builds = []

    def build() -> zerofx.Program:
        builds.append(1)
        return program

    loaded = plan_cache.load_or_build(directory, _key(), build, rank=0, program_options={"group_name": program.group_name},
                                      trust=trust, key_file=key_file)
    return loaded, len(builds)


def _forge(path: Path, marker: Path, secret: bytes) -> None:
    """An entry as the attack writes it: a payload that runs code, with the header's length and
    SHA-256 made to match, signed with ``secret`` (the attacker's own)."""
    payload = pickle.dumps(_Payload(marker))
    header = {"format": plan_cache.FORMAT, "key": _key(), "payload_bytes": len(payload),
              "payload_sha256": hashlib.sha256(payload).hexdigest()}
    head = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(cache_trust.signature(secret, head, payload).encode() + b"\n" + head + b"\n" + payload)
    path.chmod(0o600)


@pytest.mark.parametrize("format_", ["signed with another key", "unsigned, the earlier format"])
def test_a_forged_entry_is_refused_rebuilt_and_never_run(tmp_path: Path, program: zerofx.Program, key_file: Path, format_: str) -> None:
    cache, marker = tmp_path / "cache", tmp_path / "ran"
    assert _load(cache, program, key_file)[1] == 1  # writes the user's own entry and secret
    path = plan_cache.entry_path(cache, _key())
    if format_ == "signed with another key":
        _forge(path, marker, b"the attacker's key, not the user's")
    else:  # the earlier format: a header line and the payload, checksummed, not signed
        payload = pickle.dumps(_Payload(marker))
        path.write_bytes(json.dumps({"format": "zerofx-plan-cache/1", "key": _key(), "payload_bytes": len(payload),
                                     "payload_sha256": hashlib.sha256(payload).hexdigest()}).encode() + b"\n" + payload)
    with pytest.warns(plan_cache.PlanCacheWarning, match=rf"{path.name} is not used: .*(signature does not verify|not JSON|another format)"):
        loaded, builds = _load(cache, program, key_file)
    assert builds == 1 and loaded is program and not marker.exists()
    assert _load(cache, program, key_file)[1] == 0  # rewritten with the user's signature, and read


def test_a_directory_others_may_write_is_skipped_with_one_warning(tmp_path: Path, program: zerofx.Program, key_file: Path) -> None:
    for mode, who in ((0o777, "every user"), (0o770, "its group")):
        cache = tmp_path / f"cache-{mode:o}"
        cache.mkdir()
        cache.chmod(mode)
        with pytest.warns(plan_cache.PlanCacheWarning, match=rf"plan cache in .*{cache.name} is not used: .*writable by {who}") as caught:
            assert _load(cache, program, key_file)[1] == 1
        assert len(caught) == 1 and list(cache.iterdir()) == []  # nothing read, nothing written
    # A team cache takes the group-writable directory, and still refuses the world-writable one.
    assert _load(tmp_path / "cache-770", program, key_file, CacheTrust.GROUP)[1] == 1
    assert _load(tmp_path / "cache-770", program, key_file, CacheTrust.GROUP)[1] == 0
    with pytest.warns(plan_cache.PlanCacheWarning, match="writable by every user"):
        _load(tmp_path / "cache-777", program, key_file, CacheTrust.GROUP)


def test_a_directory_under_one_others_may_write_is_skipped(tmp_path: Path, program: zerofx.Program, key_file: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone may rename the cache directory inside it
    with pytest.warns(plan_cache.PlanCacheWarning, match="above .* may be written by others"):
        assert _load(shared / "mine", program, key_file)[1] == 1
    shared.chmod(0o777 | stat.S_ISVTX)  # as /tmp: only the owner may rename it
    assert _load(shared / "mine", program, key_file)[1] == 1
    assert _load(shared / "mine", program, key_file)[1] == 0


def test_a_symlinked_entry_is_not_followed(tmp_path: Path, program: zerofx.Program, key_file: Path) -> None:
    cache = tmp_path / "cache"
    assert _load(cache, program, key_file)[1] == 1
    path = plan_cache.entry_path(cache, _key())
    elsewhere = tmp_path / "elsewhere.zfxplan"
    path.rename(elsewhere)  # a whole, correctly signed entry, reached through a link
    path.symlink_to(elsewhere)
    with pytest.warns(plan_cache.PlanCacheWarning, match="may not be trusted: a symbolic link"):
        assert _load(cache, program, key_file)[1] == 1
    assert not path.is_symlink() and elsewhere.exists()  # the link is replaced by an entry; its target is left alone


@pytest.mark.parametrize("change", ["group-writable", "another owner"])
def test_an_entry_others_may_have_written_is_rebuilt(tmp_path: Path, program: zerofx.Program, key_file: Path, change: str) -> None:
    cache = tmp_path / "cache"
    assert _load(cache, program, key_file)[1] == 1
    path = plan_cache.entry_path(cache, _key())
    if change == "group-writable":
        path.chmod(0o660)
        why = "writable by its group"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, 65534, 65534)
        why = "owned by uid 65534"
    with pytest.warns(plan_cache.PlanCacheWarning, match=f"may not be trusted: {why}"):
        assert _load(cache, program, key_file)[1] == 1
    assert _load(cache, program, key_file)[1] == 0


def test_the_key_file_is_made_private_and_refused_when_others_may_read_it(tmp_path: Path, program: zerofx.Program,
                                                                          key_file: Path) -> None:
    assert _load(tmp_path / "cache", program, key_file)[1] == 1
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_bytes()) == cache_trust.SECRET_BYTES
    key_file.chmod(0o644)
    with pytest.warns(plan_cache.PlanCacheWarning, match="key file .* may be read or written by others"):
        assert _load(tmp_path / "cache", program, key_file)[1] == 1
    key_file.chmod(0o640)  # a team's key: its group may read it, and the entry it signed is read
    with pytest.warns(plan_cache.PlanCacheWarning, match="key file .* may be read or written by others"):
        _load(tmp_path / "cache", program, key_file)
    assert _load(tmp_path / "cache", program, key_file, CacheTrust.GROUP)[1] == 0


def test_the_config_names_the_trust_and_the_key_file(tmp_path: Path) -> None:
    cfg = zerofx.config.parse_config({"zerofx": {"plan_cache_trust": "group", "plan_cache_key_file": str(tmp_path / "k")}})
    assert cfg.plan_cache_trust is CacheTrust.GROUP and cfg.plan_cache_key_file == tmp_path / "k"
    assert "plan_cache_trust" not in cfg.zerofx_section  # whom the cache trusts is no part of what a program is
    with pytest.raises(zerofx.ConfigError, match="plan_cache_trust"):
        zerofx.config.parse_config({"zerofx": {"plan_cache_trust": "everyone"}})


def test_a_checkpoint_client_file_that_would_run_code_is_refused(tmp_path: Path) -> None:
    """Client files are read with ``torch.load(weights_only=True)``: a pickle naming a function is
    a ``CheckpointError``, and the function never runs. (Parameters and optimizer states are
    safetensors files, which hold no code.)"""
    import torch

    from zerofx.runtime import checkpoint_format

    marker = tmp_path / "ran"
    meta = {"world_size": 1, "format_version": 2}
    torch.save({"client_state": {"step": _Payload(marker)}, "rng": {}}, tmp_path / checkpoint_format.client_file(0, 1))
    with pytest.raises(checkpoint_format.CheckpointError, match="is not a readable torch.save file"):
        checkpoint_format.read_client(tmp_path, meta, 0)
    assert not marker.exists()
