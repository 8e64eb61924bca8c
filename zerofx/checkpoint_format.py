"""The sharded checkpoint format, and reading it without an engine or a process group.

``zerofx.checkpoint`` writes and loads checkpoints through an engine; ``zerofx.consolidation``
turns one into a single file. Both find checkpoints, read metadata and read slices here.

NOTE [On-disk layout]
    CKPT_DIR/latest                        the newest complete tag; replaced atomically by rank 0
    CKPT_DIR/<tag>/metadata.json           rank 0: versions, model structure, config, world size,
                                           stage, step, plan fingerprint, optimizer type and scalars
    CKPT_DIR/<tag>/rank-00001-of-00002.safetensors
                                           rank r: slice r of every padded flat (see below)
    CKPT_DIR/<tag>/client-00001-of-00002.pt
                                           rank r: its client_state and RNG states (torch.save)
    CKPT_DIR/<tag>/COMPLETE                written last, before the directory is renamed in place
    CKPT_DIR/.<tag>.partial/               a save in progress, or one that was killed
Rank r's safetensors file holds, for each parameter of ``ParamPlacement`` p at the saving world
size N, elements ``[r * p.shard_numel, (r + 1) * p.shard_numel)`` of its zero-padded flat
(``param/<fqn>``), of its fp32 master in mixed precision (``master/<fqn>``) and of each
optimizer-state tensor (``state/<fqn>/<name>``, e.g. ``exp_avg``). Stage 0, where every rank
holds everything, writes the same 1/N slices, so one format serves every stage. Rank 0's file
also holds the persistent buffers, whole (``buffer/<key>``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from zerofx.errors import ZeroFXError

FORMAT_VERSION = 1
METADATA = "metadata.json"
COMPLETE = "COMPLETE"
LATEST = "latest"
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


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


# --------------------------------------------------------------------------- finding checkpoints
def _complete_tags(root: Path) -> list[str]:
    tags = [d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and (d / COMPLETE).is_file()]
    return sorted(tags, key=lambda t: (read_metadata_file(root / t).get("step", -1), (root / t / COMPLETE).stat().st_mtime))


def latest_complete_tag(ckpt_dir: str | Path) -> str | None:
    """The tag ``latest`` names if it is complete, else the complete tag with the highest step;
    None when ``ckpt_dir`` holds no complete checkpoint (or does not exist)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    latest = root / LATEST
    if latest.is_file():
        tag = latest.read_text().strip()
        if (root / tag / COMPLETE).is_file():
            return tag
    tags = _complete_tags(root)
    return tags[-1] if tags else None


def resolve_tag(ckpt_dir: str | Path, tag: str | None) -> Path:
    """The directory of a complete checkpoint; ``CheckpointError`` naming what is missing."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    if tag is None:
        tag = latest_complete_tag(root)
        if tag is None:
            raise CheckpointError(
                f"{str(root)!r} holds no complete checkpoint (no {LATEST!r} file and no tag directory with a {COMPLETE} marker)"
            )
    path = root / tag
    if not path.is_dir():
        available = ", ".join(_complete_tags(root)) or "none"
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
        return json.loads((path / METADATA).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} has no readable {METADATA}: {exc}") from exc


def read_metadata(ckpt_dir: str | Path, tag: str | None = None) -> dict[str, Any]:
    """The metadata of a complete checkpoint (the newest one when ``tag`` is None)."""
    path = resolve_tag(ckpt_dir, tag)
    meta = read_metadata_file(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format_version {meta.get('format_version')!r}; accepted: {FORMAT_VERSION}")
    return meta


def check_rank_files(path: Path, world_size: int) -> list[Path]:
    files = [path / rank_file(r, world_size) for r in range(world_size)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} saved at world size {world_size} is missing rank files: {', '.join(missing)}")
    return files


class RankFiles:
    """The saved ranks' safetensors files, opened lazily: a rank opens only those it reads."""

    def __init__(self, files: list[Path]) -> None:
        self._paths = files
        self._open: dict[int, Any] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RankFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def opened(self) -> list[int]:
        """The saved ranks whose files this reader has opened so far."""
        return sorted(self._open)

    def get(self, rank: int) -> Any:
        if rank not in self._open:
            try:
                self._open[rank] = self._stack.enter_context(safe_open(str(self._paths[rank]), framework="pt"))
            except SafetensorError as exc:
                raise CheckpointError(f"rank file {str(self._paths[rank])!r} is not a readable safetensors file: {exc}") from exc
        return self._open[rank]

    def read_range(self, key: str, shard_numel: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the saved padded flat ``key``, read only from the slices that
        overlap them (saved rank k holds [k * shard_numel, (k + 1) * shard_numel))."""
        assert 0 <= start < stop, (key, start, stop)
        parts = []
        for k in range(start // shard_numel, -(-stop // shard_numel)):
            lo, hi = max(start, k * shard_numel), min(stop, (k + 1) * shard_numel)
            parts.append(self.get(k).get_slice(key)[lo - k * shard_numel : hi - k * shard_numel])
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def torch_dtype(name: str) -> torch.dtype:
    """``torch.float32`` from its string form ("torch.float32")."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype
