"""Consolidation: one safetensors file from a sharded checkpoint, streamed tensor by tensor.

    zerofx.runtime.checkpoint.consolidate("ckpt", "model.safetensors", dtype="bf16")
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"), strict=True)

The file holds exactly ``model.state_dict()``'s keys: every parameter under each of its names
(a tied weight is written once per name, as ``state_dict`` lists it) and the persistent buffers.
No process group is needed.

NOTE [Why consolidation never holds the model]
A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and ``data_offsets`` into the byte buffer that follows), then the raw bytes in
header order. Every header entry follows from the checkpoint's metadata, so the header is
written first. Each tensor is then assembled from the rank files' slices (see
``zerofx.runtime.checkpoint_format``) in chunks of at most ``chunk_bytes``, converted, and appended. Peak
memory is one chunk and its conversion, not the model (DeepSpeed's ``zero_to_fp32`` builds the
whole state dict in RAM first). Each saved slice is checked against its CRC-32 before its first
read, in chunks of the same size (NOTE [Checkpoint identity and checksums]).

NOTE [Consolidation never harms its input]
The output may not lie inside the checkpoint directory or be one of its files (symlinks and hard
links resolved). It is written to a temporary file in its own folder, created before any tensor
is read (so a missing or read-only folder fails at once), fsynced and renamed over the output:
an existing file is replaced only by a complete one. Any failure (a full disk, a damaged rank
file) removes the temporary file.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from zerofx.runtime.checkpoint_format import (
    DEFAULT_CHUNK_BYTES,
    METADATA,
    CheckpointError,
    RankFiles,
    check_rank_files,
    num_shards,
    read_metadata,
    resolve_tag,
    torch_dtype,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# safetensors' dtype codes.
_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def _out_dtype(saved: torch.dtype, dtype: str) -> torch.dtype:
    """Floating-point tensors take the requested dtype; integer and bool buffers keep theirs."""
    return DTYPES[dtype] if saved.is_floating_point else saved


@dataclass(frozen=True)
class _Entry:
    """One state-dict key of the output: where its elements come from and how they are written."""

    key: str
    shape: tuple[int, ...]
    source: str  # the key in the rank files
    shard_numel: int | None  # a parameter's slice size at the saving world size; None: a whole buffer
    dtype: torch.dtype  # in the output

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _entries(meta: Mapping[str, Any], dtype: str) -> list[_Entry]:
    """One entry per ``model.state_dict()`` key, in its order; tied weights once per name."""
    shapes = {fqn: tuple(shape) for fqn, shape, _, _ in meta["params"]}
    out = []
    for key, owner in meta["state_dict_keys"]:
        if owner is None:
            buf = meta["buffers"][key]
            out.append(_Entry(key, tuple(buf["shape"]), f"buffer/{key}", None, _out_dtype(torch_dtype(buf["dtype"]), dtype)))
            continue
        placement = meta["placements"][owner]
        # The most precise copy: the fp32 master when the run trained in mixed precision.
        source, saved = (f"master/{owner}", "torch.float32") if owner in meta["masters"] else (f"param/{owner}", placement["dtype"])
        out.append(_Entry(key, shapes[owner], source, placement["shard_numel"], _out_dtype(torch_dtype(saved), dtype)))
    return out


def _header(entries: list[_Entry], extra: Mapping[str, str]) -> bytes:
    """The 8-byte header length and the JSON header, padded so the data starts 8-byte aligned."""
    header: dict[str, Any] = {"__metadata__": dict(extra)}
    offset = 0
    for e in entries:
        nbytes = e.numel * e.dtype.itemsize
        header[e.key] = {"dtype": _CODES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write(f: BinaryIO, t: torch.Tensor) -> None:
    f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def _stream_entry(f: BinaryIO, files: RankFiles, e: _Entry, chunk_bytes: int) -> None:
    """Append ``e``'s bytes: a parameter in chunks of at most ``chunk_bytes``, each read from
    the one or two saved slices it overlaps; a buffer (small, whole in rank 0's file) at once."""
    if e.shard_numel is None:
        _write(f, files.tensor(0, e.source).to(e.dtype))
        return
    step = max(1, chunk_bytes // e.dtype.itemsize)
    for start in range(0, e.numel, step):
        stop = min(e.numel, start + step)
        _write(f, files.read_range(e.source, e.shard_numel, start, stop).to(e.dtype))


def _check_output(out: Path, root: Path, inputs: list[Path]) -> None:
    """``CheckpointError`` unless ``out`` is a file path in an existing folder, outside the
    checkpoint directory ``root`` and none of its ``inputs`` (NOTE [Consolidation never harms its input])."""
    accepted = f"accepted: a file path outside the checkpoint directory {str(root)!r}, in an existing writable folder"
    if not out.parent.is_dir():
        raise CheckpointError(f"cannot write {str(out)!r}: folder {str(out.parent)!r} does not exist; {accepted}")
    if out.is_dir():
        raise CheckpointError(f"cannot write {str(out)!r}: it is a folder; {accepted}")
    target = out.resolve()
    for folder in {root.resolve(), *(p.parent.resolve() for p in inputs)}:
        if target == folder or folder in target.parents:
            raise CheckpointError(f"cannot write {str(out)!r}: it is inside the checkpoint directory {str(folder)!r}; {accepted}")
    for p in inputs:
        if target == p.resolve() or (out.exists() and os.path.samefile(out, p)):
            raise CheckpointError(f"cannot write {str(out)!r}: it is the checkpoint's own file {str(p)!r}; {accepted}")


def _create_temp(out: Path) -> tuple[BinaryIO, Path]:
    """A new file next to ``out`` (mode 0o666 less the umask), opened for writing."""
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise CheckpointError(
            f"cannot write {str(out)!r}: folder {str(out.parent)!r} is not writable ({exc.strerror}); "
            "accepted: a file path in an existing writable folder"
        ) from exc
    return os.fdopen(fd, "wb"), tmp


def consolidate(
    ckpt_dir: str | Path,
    out_path: str | Path,
    *,
    tag: str | None = None,
    dtype: str = "fp32",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Path:
    """Write checkpoint ``tag`` (default: the newest complete one) of ``ckpt_dir`` as one
    safetensors file at ``out_path``, floating-point tensors in ``dtype`` ("fp32" or "bf16").
    The file appears whole or not at all; an existing file there is replaced only by a whole
    one. Returns ``out_path``. ``CheckpointError`` names a missing, incomplete, mismatched or
    damaged checkpoint or rank file, a bad ``dtype``, or an output that is not accepted (NOTE
    [Consolidation never harms its input])."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype={dtype!r} is not supported for consolidation; accepted: {', '.join(DTYPES)}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise CheckpointError(f"chunk_bytes={chunk_bytes!r} is invalid; accepted: an integer >= 1")
    assert sys.byteorder == "little", "safetensors stores little-endian bytes"
    path = resolve_tag(ckpt_dir, tag)
    meta = read_metadata(ckpt_dir, path.name)
    paths = check_rank_files(path, num_shards(meta))
    out = Path(out_path)
    _check_output(out, Path(ckpt_dir), [path / METADATA, *paths])
    entries = _entries(meta, dtype)
    extra = {"format": "pt", "zerofx_checkpoint": str(path), "step": str(meta["step"]), "model_class": meta["model_class"],
             "structure_hash": meta["structure_hash"], "dtype": dtype}
    verified: set[tuple[int, str]] = set()  # each saved slice is checked once, even when tied keys share it
    f, tmp = _create_temp(out)
    try:
        with f:
            f.write(_header(entries, extra))
            for e in entries:
                # Fresh readers per tensor: safetensors maps the files, and pages read through a
                # mapping stay resident until it is closed. Reopening costs one header parse per file.
                with RankFiles(paths, meta, verified=verified, chunk_bytes=chunk_bytes) as files:
                    _stream_entry(f, files, e, chunk_bytes)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CheckpointError(
                f"could not write {str(out)!r} ({exc.strerror or exc}); the partial file was removed and the output is unchanged"
            ) from exc
        raise
    return out
