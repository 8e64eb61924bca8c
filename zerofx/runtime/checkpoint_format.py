"""The sharded checkpoint format, and reading it without an engine or a process group.

``zerofx.runtime.checkpoint`` writes and loads checkpoints through an engine; ``zerofx.runtime.consolidation``
turns one into a single file. Both find checkpoints, read and check metadata, check each file's
identity and checksums, and read slices here.

NOTE [On-disk layout]
    CKPT_DIR/latest                        the newest complete tag; replaced atomically by rank 0
    CKPT_DIR/<tag>/metadata.json           rank 0: versions, model structure, config, world size,
                                           rank layout (data x sequence groups, shard groups),
                                           stage, step, tag, save id, plan fingerprint, optimizer
                                           type and scalars, each client file's CRC-32
    CKPT_DIR/<tag>/rank-00001-of-00002.safetensors
                                           rank r: slice r of every padded flat (see below)
    CKPT_DIR/<tag>/client-00001-of-00002.pt
                                           rank r: its client_state and RNG states (torch.save)
    CKPT_DIR/<tag>/COMPLETE                written last, once every rank confirmed its files
    CKPT_DIR/.<tag>.partial/               a save in progress, or one that was killed
Rank r's safetensors file holds, for each parameter of ``ParamPlacement`` p at the saving world
size N, elements ``[r * p.shard_numel, (r + 1) * p.shard_numel)`` of its zero-padded flat
(``param/<fqn>``), of its fp32 master in mixed precision (``master/<fqn>``) and of each
optimizer-state tensor (``state/<fqn>/<name>``, e.g. ``exp_avg``). Stage 0, where every rank
holds everything, writes the same 1/N slices, so one format serves every stage. Rank 0's file
also holds the persistent buffers, whole (``buffer/<key>``).

NOTE [Checkpoint identity and checksums]
A save draws a random save id on rank 0 and hands it to every rank. Each rank file's safetensors
header names its rank, the world size, the tag and the save id (``zerofx_rank``,
``zerofx_world_size``, ``zerofx_tag``, ``zerofx_save_id``), and the CRC-32 of every tensor's bytes
(``zerofx_crc32``, JSON); each client file holds the same identity, and metadata.json holds the
tag, the save id and each client file's CRC-32. ``RankFiles`` checks a file's identity against
metadata.json when it opens it, and a tensor's CRC-32, read in chunks, before the first read from
it. So a file swapped between ranks, copied from another step or another run, or with damaged
bytes, is a ``CheckpointError`` naming the file and what differs, never a silent mix. Format 1
checkpoints (no save id, no checksums) still load, with the rank and world size checked.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import re
import warnings
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from zerofx.common.errors import ZeroFXError
from zerofx.config import recorded_sequence_parallel_size

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no save id, no checksums
METADATA = "metadata.json"
COMPLETE = "COMPLETE"
LATEST = "latest"
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
# Rank files' safetensors header keys (NOTE [Checkpoint identity and checksums]).
CRC32_KEY = "zerofx_crc32"
_IDENTITY_KEYS = {"rank": "zerofx_rank", "world_size": "zerofx_world_size", "tag": "zerofx_tag", "save_id": "zerofx_save_id"}
DEFAULT_CHUNK_BYTES = 2**20
_MAX_ITEMSIZE = 8  # float64 and int64: a chunk of chunk_bytes // 8 elements is at most chunk_bytes


class CheckpointError(ZeroFXError):
    """A checkpoint is missing, incomplete, or does not match the model it is loaded into."""


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def client_file(rank: int, world_size: int) -> str:
    return f"client-{rank:05d}-of-{world_size:05d}.pt"


# --------------------------------------------------------------------------- structure
def model_class(model: nn.Module) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def state_dict_keys(model: nn.Module) -> list[tuple[str, str | None]]:
    """``model.state_dict()``'s keys in order, each with the parameter FQN it aliases (tied
    weights appear under every name) or None for a persistent buffer."""
    owner = {id(p): fqn for fqn, p in model.named_parameters()}
    alias = {name: owner[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    return [(key, alias.get(key)) for key in model.state_dict().keys()]


def structure(params: Iterable[tuple[str, Sequence[int], str, bool]], keys: Sequence[tuple[str, str | None]]) -> dict[str, Any]:
    """The model structure a checkpoint must match: parameters (fqn, shape, dtype,
    requires_grad) and state-dict keys, with a hash over both."""
    body = {"params": [[f, list(s), d, bool(g)] for f, s, d, g in params], "state_dict_keys": [list(k) for k in keys]}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return {**body, "structure_hash": digest}


def model_structure(model: nn.Module) -> dict[str, Any]:
    """``structure`` of a model, materialized or on the meta device, to check it against a checkpoint."""
    params = [(f, tuple(p.shape), str(p.dtype), p.requires_grad) for f, p in model.named_parameters()]
    return structure(params, state_dict_keys(model))


def _describe(param: Sequence[Any] | None) -> str:
    if param is None:
        return "absent"
    fqn, shape, dtype, requires_grad = param
    return f"{fqn} {tuple(shape)} {dtype}" + ("" if requires_grad else " (frozen)")


def check_structure(meta: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
    """Raise ``CheckpointError`` naming the first parameter or key where they differ."""
    if meta["structure_hash"] == current["structure_hash"]:
        return
    saved, mine = meta["params"], current["params"]
    for i in range(max(len(saved), len(mine))):
        a = saved[i] if i < len(saved) else None
        b = mine[i] if i < len(mine) else None
        if a != b:
            raise CheckpointError(
                f"checkpoint {where} does not match this model ({meta['model_class']} saved): parameter #{i} is "
                f"{_describe(a)} in the checkpoint and {_describe(b)} in the model"
            )
    a_keys, b_keys = [k[0] for k in meta["state_dict_keys"]], [k[0] for k in current["state_dict_keys"]]
    diff = sorted(set(a_keys) ^ set(b_keys)) or a_keys
    raise CheckpointError(f"checkpoint {where} does not match this model: state_dict keys differ at {diff[:3]}")


# --------------------------------------------------------------------------- identity and checksums
def crc32_hex(t: torch.Tensor) -> str:
    """The CRC-32 of a CPU tensor's bytes, as safetensors stores them (little-endian), in hex."""
    return f"{zlib.crc32(_bytes(t)):08x}"


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def rank_file_header(rank: int, world_size: int, tag: str, save_id: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The safetensors header metadata of rank ``rank``'s file: its identity and every tensor's CRC-32."""
    identity = {"rank": rank, "world_size": world_size, "tag": tag, "save_id": save_id}
    header = {_IDENTITY_KEYS[k]: str(v) for k, v in identity.items()}
    header[CRC32_KEY] = json.dumps({k: crc32_hex(t) for k, t in tensors.items()}, separators=(",", ":"))
    return header


def saved_layout(meta: Mapping[str, Any]) -> dict[str, int]:
    """The rank layout a checkpoint was saved in: world size N, sequence-parallel size S, data
    groups D = N / S and shard group size K (NOTE [Checkpoints across rank layouts] in
    zerofx/runtime/checkpoint.py). Checkpoints from before ``layout`` was recorded give S from their
    config."""
    layout = meta.get("layout")
    if isinstance(layout, Mapping):
        return dict(layout)
    world, size = meta["world_size"], recorded_sequence_parallel_size(meta.get("config") or {})
    return {"world_size": world, "sequence_parallel_size": size, "data_parallel_size": world // size,
            "shard_group_size": num_shards(meta)}


def describe_layout(layout: Mapping[str, int]) -> str:
    """``world size 4 (data 2 x sequence 2)``, ``world size 2 (data 2)``; shard groups when not flat."""
    world, size, data = layout["world_size"], layout["sequence_parallel_size"], layout["data_parallel_size"]
    shape = f"data {data} x sequence {size}" if size > 1 else f"data {data}"
    groups = f", shard groups of {layout['shard_group_size']}" if layout["shard_group_size"] != world else ""
    return f"world size {world} ({shape}{groups})"


def num_shards(meta: Mapping[str, Any]) -> int:
    """How many slices each saved padded flat is cut into, one rank file each: the world size,
    or with shard groups the group size (NOTE [Shard groups of consecutive ranks] in
    zerofx/runtime/engine.py; checkpoints from before shard groups record none)."""
    return meta.get("num_shards", meta["world_size"])


def _identity_mismatch(found: Mapping[str, Any], rank: int, meta: Mapping[str, Any], world_size: int | None = None) -> str | None:
    """What in a file's identity (rank, world size, tag, save id) differs from rank ``rank`` of
    the checkpoint ``meta`` describes (of ``world_size`` files, default the world size); None
    when it matches. Format 1 records no tag or save id."""
    n = meta["world_size"] if world_size is None else world_size
    if str(found.get("rank")) != str(rank):
        return f"it holds rank {found.get('rank')}'s data, not rank {rank}'s (files swapped or renamed?)"
    if str(found.get("world_size")) != str(n):
        return f"it was saved at world size {found.get('world_size')}, not {n}"
    if meta["format_version"] < 2:
        return None
    if found.get("tag") != meta["tag"]:
        return f"it was saved under tag {found.get('tag')!r}, not {meta['tag']!r} (copied from another step?)"
    if found.get("save_id") != meta["save_id"]:
        return f"it comes from another save (save id {found.get('save_id')}, not {meta['save_id']}; copied from another run?)"
    return None


# --------------------------------------------------------------------------- finding checkpoints
def _step_of(path: Path) -> int:
    try:
        return int(read_metadata_file(path).get("step", -1))
    except (CheckpointError, TypeError, ValueError):  # unreadable: oldest; resolve_tag says why
        return -1


def complete_tags(root: Path) -> list[str]:
    """Tags with a COMPLETE marker, oldest first (by saved step, then by when they completed)."""
    tags = [d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and (d / COMPLETE).is_file()]
    return sorted(tags, key=lambda t: (_step_of(root / t), (root / t / COMPLETE).stat().st_mtime))


def _candidates(root: Path) -> list[str]:
    """Complete tags, the one ``latest`` names first, then newest first."""
    tags = complete_tags(root)[::-1]
    latest = root / LATEST
    named = latest.read_text().strip() if latest.is_file() else None
    return sorted(tags, key=lambda t: t != named)  # stable: the rest stay newest first


def missing_files(path: Path) -> str | None:
    """Why complete-marked checkpoint ``path`` cannot load (unreadable metadata, missing rank or
    client files), or None."""
    try:
        saved = read_metadata_file(path)
        n = saved["world_size"]
        check_rank_files(path, num_shards(saved))
    except (CheckpointError, KeyError, TypeError) as exc:
        return str(exc) if isinstance(exc, CheckpointError) else f"checkpoint {str(path)!r} has a malformed {METADATA}"
    missing = [client_file(r, n) for r in range(n) if not (path / client_file(r, n)).is_file()]
    if missing:
        return f"checkpoint {str(path)!r} saved at world size {n} is missing client files: {', '.join(missing)}"
    return None


def latest_complete_tag(ckpt_dir: str | Path) -> str | None:
    """The tag ``resolve_tag(ckpt_dir, None)`` picks: the one ``latest`` names if it is complete
    and has all its files, else the newest such tag. None when ``ckpt_dir`` holds no complete
    tag (or does not exist); when complete tags exist but none has all its files, the one
    ``latest`` names (or the newest), so that loading it says what is missing."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    candidates = _candidates(root)
    return next((t for t in candidates if missing_files(root / t) is None), candidates[0] if candidates else None)


def resolve_tag(ckpt_dir: str | Path, tag: str | None) -> Path:
    """The directory of a complete checkpoint; ``CheckpointError`` naming what is missing. With
    ``tag`` None: the tag ``latest`` names, or the newest complete one with all its files when
    ``latest`` names an incomplete or damaged one (a warning names what was skipped)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    if tag is None:
        candidates = _candidates(root)
        if not candidates:
            raise CheckpointError(
                f"{str(root)!r} holds no complete checkpoint (no {LATEST!r} file and no tag directory with a {COMPLETE} marker)"
            )
        skipped = []
        for t in candidates:
            reason = missing_files(root / t)
            if reason is None:
                if skipped:
                    warnings.warn(f"using checkpoint {t!r} in {str(root)!r}, skipping ones that cannot load: {'; '.join(skipped)}",
                                  stacklevel=2)
                return root / t
            skipped.append(reason)
        raise CheckpointError(f"{skipped[0]}; {str(root)!r} holds no other complete checkpoint")
    path = root / tag
    if not path.is_dir():
        available = ", ".join(complete_tags(root)) or "none"
        if (root / f".{tag}.partial").is_dir():
            raise CheckpointError(
                f"checkpoint {tag!r} in {str(root)!r} is incomplete: its save was interrupted (only .{tag}.partial exists); "
                f"complete checkpoints: {available}"
            )
        raise CheckpointError(f"no checkpoint tag {tag!r} in {str(root)!r}; complete checkpoints: {available}")
    if not (path / COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: it has no {COMPLETE} marker (a save did not finish)")
    return path


def read_metadata_file(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / METADATA).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} has no readable {METADATA}: {exc}") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {METADATA} holds a {type(meta).__name__}; accepted: the JSON object a save writes")
    return meta


def read_metadata(ckpt_dir: str | Path, tag: str | None = None) -> dict[str, Any]:
    """The metadata of a complete checkpoint (the newest one when ``tag`` is None), checked for
    the consistency that reading its slices relies on."""
    path = resolve_tag(ckpt_dir, tag)
    meta = read_metadata_file(path)
    if meta.get("format_version") not in READABLE_VERSIONS:
        accepted = ", ".join(map(str, READABLE_VERSIONS))
        raise CheckpointError(f"checkpoint {str(path)!r} has format_version {meta.get('format_version')!r}; accepted: {accepted}")
    try:
        _check_metadata(meta, path)
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {METADATA} is malformed ({type(exc).__name__}: {exc}); accepted: the file the save wrote"
        ) from exc
    return meta


def _check_metadata(meta: Mapping[str, Any], path: Path) -> None:
    """The slice layout in ``meta`` is self-consistent: every placement has numel = the product of
    its shape and padded_numel = shard_numel * world_size >= numel."""
    where = f"checkpoint {str(path)!r}: {METADATA}"
    world = meta["world_size"]
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointError(f"{where} gives world_size {world!r}; accepted: an integer >= 1")
    n = num_shards(meta)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or world % n:
        raise CheckpointError(f"{where} gives num_shards {n!r}; accepted: an integer >= 1 that divides world_size {world}")
    shapes = {fqn: shape for fqn, shape, _, _ in meta["params"]}
    for fqn, p in meta["placements"].items():
        numel, shard, padded = p["numel"], p["shard_numel"], p["padded_numel"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (numel, shard, padded)) or (
            numel != math.prod(shapes[fqn]) or shard * n != padded or not 0 <= numel <= padded
        ):
            raise CheckpointError(
                f"{where} gives {fqn} (shape {tuple(shapes[fqn])}) numel {numel!r}, shard_numel {shard!r} and padded_numel "
                f"{padded!r} at world size {n}; accepted: numel = the shape's product <= padded_numel = shard_numel * world_size, "
                "as the save wrote them"
            )
    layout = meta.get("layout")
    if layout is not None:
        ints = [layout.get(k) for k in ("world_size", "sequence_parallel_size", "data_parallel_size", "shard_group_size")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in ints) or ints[0] != world or (
            ints[1] * ints[2] != world or ints[3] != n
        ):
            raise CheckpointError(
                f"{where} gives layout {layout!r}; accepted: world_size {world} = sequence_parallel_size x data_parallel_size, "
                f"shard_group_size {n} (num_shards), as the save wrote them"
            )
    if meta["format_version"] >= 2 and not (isinstance(meta["tag"], str) and isinstance(meta["save_id"], str)):
        raise CheckpointError(f"{where} has no tag or save id; accepted: the file the save wrote")


def check_rank_files(path: Path, world_size: int) -> list[Path]:
    files = [path / rank_file(r, world_size) for r in range(world_size)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} saved at world size {world_size} is missing rank files: {', '.join(missing)}")
    return files


def read_client(path: Path, meta: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """Saved rank ``rank``'s client file: ``{"client_state": ..., "rng": ...}``, its identity
    and checksum checked (NOTE [Checkpoint identity and checksums])."""
    file = path / client_file(rank, meta["world_size"])
    where = f"client file {str(file)!r}"
    accepted = f"accepted: the file rank {rank} wrote in this save (torch.save of its client_state and RNG states)"
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{where} is not readable ({exc.strerror or exc}); {accepted}") from exc
    try:
        saved = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # torch.load's errors vary with how the bytes are damaged; the cause is chained
        raise CheckpointError(f"{where} is not a readable torch.save file ({type(exc).__name__}); {accepted}") from exc
    if not isinstance(saved, dict) or not {"client_state", "rng"} <= saved.keys():
        raise CheckpointError(f"{where} holds no client_state and RNG states; {accepted}")
    mismatch = _identity_mismatch(saved, rank, meta) if meta["format_version"] >= 2 else None  # format 1 recorded none
    if mismatch is not None:
        raise CheckpointError(f"{where} does not belong to checkpoint {str(path)!r}: {mismatch}; {accepted}")
    want = meta.get("client_crc32", {}).get(str(rank))
    got = f"{zlib.crc32(data):08x}"
    if want is not None and got != want:
        raise CheckpointError(f"{where} fails its checksum (CRC-32 {got}, saved {want}): the file is damaged; {accepted}")
    return saved


def saved_ranks(shard_numel: int, start: int, stop: int) -> range:
    """The saved ranks whose slices hold elements [start, stop) of a padded flat."""
    return range(start // shard_numel, -(-stop // shard_numel))


class RankFiles:
    """The saved ranks' safetensors files, opened lazily: a rank opens only those it reads.

    Given the checkpoint's ``meta``, a file's identity is checked when it is opened, and a
    tensor's CRC-32 before its first read (NOTE [Checkpoint identity and checksums]); ``verified``
    shares what was checked between readers of one checkpoint."""

    def __init__(
        self,
        files: list[Path],
        meta: Mapping[str, Any] | None = None,
        *,
        verified: set[tuple[int, str]] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self._paths = files
        self._meta = meta
        self._verified = verified if verified is not None else set()
        self._chunk_numel = max(1, chunk_bytes // _MAX_ITEMSIZE)
        self._open: dict[int, Any] = {}
        self._crc32: dict[int, dict[str, str]] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RankFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    @property
    def opened(self) -> list[int]:
        """The saved ranks whose files this reader has opened so far."""
        return sorted(self._open)

    def _where(self, rank: int) -> str:
        return f"rank file {str(self._paths[rank])!r}"

    def get(self, rank: int) -> Any:
        if rank not in self._open:
            try:
                handle = self._stack.enter_context(safe_open(str(self._paths[rank]), framework="pt"))
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{self._where(rank)} is not a readable safetensors file: {exc}") from exc
            if self._meta is not None:
                self._crc32[rank] = self._check_header(rank, handle.metadata() or {})
            self._open[rank] = handle
        return self._open[rank]

    def _check_header(self, rank: int, header: Mapping[str, str]) -> dict[str, str]:
        meta = self._meta
        assert meta is not None
        found = {k: header.get(key) for k, key in _IDENTITY_KEYS.items()}
        mismatch = _identity_mismatch(found, rank, meta, num_shards(meta))
        if mismatch is not None:
            raise CheckpointError(
                f"{self._where(rank)} does not belong to checkpoint {str(self._paths[rank].parent)!r}: {mismatch}; "
                f"accepted: the file rank {rank} wrote in this save"
            )
        if meta["format_version"] < 2:
            return {}
        try:
            crc32 = json.loads(header[CRC32_KEY])
        except (KeyError, json.JSONDecodeError):
            crc32 = None
        if not isinstance(crc32, dict):
            raise CheckpointError(f"{self._where(rank)} has no readable tensor checksums ({CRC32_KEY}): its header is damaged")
        return crc32

    def _slice(self, rank: int, key: str) -> Any:
        try:
            return self.get(rank).get_slice(key)
        except SafetensorError as exc:
            raise CheckpointError(f"{self._where(rank)} has no tensor {key!r} ({exc})") from exc

    def verify(self, rank: int, key: str, shard_numel: int | None = None) -> None:
        """Check saved rank ``rank``'s tensor ``key``, once per reader set: a slice of a flat holds
        ``shard_numel`` elements, and (given format-2 ``meta``) its bytes match their CRC-32, read
        in chunks."""
        if (rank, key) in self._verified:
            return
        sl = self._slice(rank, key)
        if shard_numel is not None and sl.get_shape() != [shard_numel]:
            raise CheckpointError(
                f"{self._where(rank)}: tensor {key!r} has shape {sl.get_shape()}, but {METADATA} gives shard_numel {shard_numel}; "
                "accepted: the metadata the save wrote"
            )
        if self._meta is not None and self._meta["format_version"] >= 2:
            want = self._crc32[rank].get(key)
            if want is None:
                raise CheckpointError(f"{self._where(rank)} has no checksum for tensor {key!r}: its header is damaged")
            if shard_numel is not None:  # a slice of a flat: streamed
                crc = 0
                for start in range(0, shard_numel, self._chunk_numel):
                    crc = zlib.crc32(_bytes(sl[start : start + self._chunk_numel]), crc)
            else:  # a buffer, whole
                crc = zlib.crc32(_bytes(self.get(rank).get_tensor(key)))
            if f"{crc:08x}" != want:
                raise CheckpointError(
                    f"{self._where(rank)}: tensor {key!r} fails its checksum (CRC-32 {crc:08x}, saved {want}): the file is damaged; "
                    f"accepted: the bytes the save wrote"
                )
        self._verified.add((rank, key))

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        """Saved rank ``rank``'s whole tensor ``key`` (a buffer), checked."""
        self.verify(rank, key)
        return self.get(rank).get_tensor(key)

    def read_range(self, key: str, shard_numel: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the saved padded flat ``key``, read only from the slices that
        overlap them (saved rank k holds [k * shard_numel, (k + 1) * shard_numel)), each checked."""
        assert 0 <= start < stop, (key, start, stop)
        parts = []
        for k in saved_ranks(shard_numel, start, stop):
            assert k < len(self._paths), (key, shard_numel, stop)  # read_metadata checked padded_numel = shard_numel * N
            self.verify(k, key, shard_numel)
            lo, hi = max(start, k * shard_numel), min(stop, (k + 1) * shard_numel)
            parts.append(self._slice(k, key)[lo - k * shard_numel : hi - k * shard_numel])
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def torch_dtype(name: str) -> torch.dtype:
    """``torch.float32`` from its string form ("torch.float32")."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype
