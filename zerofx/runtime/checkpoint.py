"""Sharded checkpoints: each rank saves its own slices, any world size and stage loads them.

    engine.save_checkpoint("ckpt", client_state={"batches_consumed": step})   # every rank
    client_state = engine.load_checkpoint("ckpt")       # any world size M, any stage 0-3
    zerofx.runtime.checkpoint.consolidate("ckpt", "model.safetensors")   # one file, no process group

The files are described in ``zerofx.runtime.checkpoint_format`` (NOTE [On-disk layout]): safetensors,
one file per rank holding that rank's 1/N slice of every padded flat, and a JSON metadata file.
With shard groups of K ranks (NOTE [Shard groups of consecutive ranks] in ``zerofx.runtime.rank_groups``)
every group holds the same K slices, so only group 0's ranks write rank files (``num_shards``
K in the metadata) while every rank writes its client file; loading reads them as a K-rank save.

NOTE [Why a save is atomic]
Every file is written under a temporary name, fsynced and renamed; a write that fails removes its
temporary file. Ranks write into ``.<tag>.partial`` and then report success or their error to
every rank (``all_gather_object``, not a bare barrier). Only when every rank confirmed its files
does rank 0 write the metadata and ``COMPLETE`` there, rename the directory to ``<tag>`` and
replace ``latest``; it reports that step's outcome the same way. When any rank failed, rank 0
removes the partial directory, nothing is marked complete, ``latest`` is untouched, and every
rank raises one ``CheckpointError`` naming the failed ranks and their reasons: a caller that
catches it can go on training and save again. A save killed at any point before the rename
leaves ``<tag>`` absent and ``latest`` naming the previous checkpoint; loading the interrupted
tag raises ``CheckpointError`` saying so. All ranks must see one file system.

NOTE [Loading checks before it changes anything]
A load first reads and checks, on every rank, all it will use: the metadata, each rank file's
identity and the checksum of every tensor this rank reads (NOTE [Checkpoint identity and
checksums] in ``zerofx.runtime.checkpoint_format``), and its client file. The ranks then agree on the
outcome and on the checkpoint (tag and save id) they found: one rank's damaged file is an error
on every rank, before the first collective, instead of a peer left waiting in an all-gather.

NOTE [Loading at another world size or stage]
Rank r' of M owns elements ``[r' * s', (r' + 1) * s')`` of each new padded flat (with shard
groups of K', r' is the rank's shard index r mod K', and s' the padded numel over K'). It reads only
the byte ranges of the saved slices that overlap its real elements (``safe_open().get_slice``),
so no rank reads the whole model. Where the engine keeps full flats (stages 0-2, and stage-3
parameters kept whole) they are all-gathered from the ranks' new shards. Optimizer states go in
through ``optimizer.load_state_dict`` on this rank's tensors, so after a reshard they equal the
saved ones element for element. The optimizer's hyperparameters (lr, betas, ...) stay those of
the engine's config: a resumed run may change them.

NOTE [Checkpoints across rank layouts]
Sequence parallelism does not change what a rank holds: ZeRO shards model state over all N
ranks, data groups and sequence groups alike (NOTE [Sequence groups] in zerofx/runtime/rank_groups.py),
so the shard group is the whole data x sequence grid (or, with shard groups, K consecutive ranks
of it) and a save writes the same N (or K) flat slices as a run without sequence parallelism.
Loading cuts the saved flats by the new rank's shard index alone, so a checkpoint saved in any
layout (data D x sequence S, shard groups K) loads in any other, at any world size: no
combination is refused. ``metadata.json`` records the layout (``layout``: world size, sequence
size, data groups, shard group size) and ``counters.global_samples``, the sequences trained on by
all data groups, which goes on counting in the new layout (each step adds its global batch,
D times a group's sequences). Saved rank r's client file goes to new rank r mod N, as at
another world size; ``zerofx train`` saves the same data position on every rank, and its
windows are dealt to data groups, not ranks, so it continues the uninterrupted run's data when
the number of data groups is unchanged and says so when it is not.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import secrets
import shutil
import warnings
import zlib
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import safetensors
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from zerofx._version import __version__
from zerofx.runtime.checkpoint_format import (
    COMPLETE,
    FORMAT_VERSION,
    LATEST,
    METADATA,
    TAG_RE,
    CheckpointError,
    RankFiles,
    check_rank_files,
    check_structure,
    client_file,
    complete_tags,
    describe_layout,
    latest_complete_tag,
    model_class,
    model_structure,
    rank_file,
    num_shards,
    rank_file_header,
    read_client,
    read_metadata,
    resolve_tag,
    saved_layout,
    saved_ranks,
    state_dict_keys,
    structure,
    torch_dtype,
)
from zerofx.runtime.consolidation import consolidate
from zerofx.passes import _compat
from zerofx.runtime.train_state import TrainState


__all__ = [
    "CheckpointError",
    "check_structure",
    "consolidate",
    "describe_layout",
    "latest_complete_tag",
    "load_checkpoint",
    "model_structure",
    "read_metadata",
    "save_checkpoint",
    "saved_layout",
]

# The tags save_checkpoint names by default; keep_last deletes only these.
DEFAULT_TAG_RE = re.compile(r"step-\d{8,}")


# --------------------------------------------------------------------------- writing
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 less the umask (safetensors writes 0o600)."""
    try:
        status = Path("/proc/self/status").read_text()
        mask = int(re.search(r"^Umask:\s*([0-7]+)", status, re.M).group(1), 8)  # type: ignore[union-attr]
    except (OSError, AttributeError):  # not Linux: read it by setting it
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write through ``write(tmp)``, fsync, then rename: ``path`` is whole or absent, and a
    failed write (a full disk) leaves no temporary file behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.chmod(tmp, _new_file_mode())
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc).strip() else ""
    return text if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {text}".rstrip(": ")


def _all_gather(state: TrainState, status: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``status``, by rank: the ranks' agreement on an outcome."""
    out: list[Any] = [None] * state.world_size
    dist.all_gather_object(out, status, group=state.group)
    return out


def _failures(statuses: list[dict[str, Any]]) -> str | None:
    """The ranks' errors, one line (each reason once, with the ranks that gave it); None if none failed."""
    by_reason: dict[str, list[str]] = {}
    for rank, s in enumerate(statuses):
        if s["error"] is not None:
            by_reason.setdefault(s["error"], []).append(str(rank))
    if not by_reason:
        return None
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: {reason}" for reason, ranks in by_reason.items())


def _check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not TAG_RE.fullmatch(tag):
        raise CheckpointError(f"checkpoint tag {tag!r} is invalid; accepted: letters, digits, '_', '-', '.', not starting with '.' or '-'")
    return tag


def _check_loadable(client_state: dict[str, Any]) -> None:
    """client_state is loaded with ``weights_only=True``: reject now what would fail to load at
    resume time, naming it."""
    buf = io.BytesIO()
    torch.save(client_state, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as exc:  # pickle's errors vary by type; the message names the culprit
        raise CheckpointError(
            f"client_state cannot be checkpointed ({str(exc).splitlines()[0]}); accepted: tensors, numbers, strings, "
            "bytes, None, and lists/tuples/dicts of them"
        ) from None


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _optimizer_tensors(state: TrainState) -> dict[str, torch.Tensor]:
    """FQN -> the tensor the optimizer steps: the fp32 master in mixed precision, else the
    shard (the whole flat at stage 0)."""
    return dict(state.optimizer_params or {f: state.shards[f] for f, p in state.placements.items() if p.requires_grad})


def _masters(state: TrainState) -> dict[str, torch.Tensor]:
    """FQN -> fp32 master of this rank's owned elements: the engine's, or copies read back from
    the offload tiers (``OffloadedOptimizer.master_tensors``)."""
    out = dict(state.master)
    offloaded = getattr(state.optimizer, "master_tensors", None)
    if offloaded is not None:
        out.update(offloaded())
    return out


def _param_groups(state: TrainState) -> list[list[str]]:
    """The FQNs of each optimizer param group's tensors, in order."""
    fqn_of = {id(t): f for f, t in _optimizer_tensors(state).items()}
    return [[fqn_of[id(p)] for p in g["params"]] for g in state.optimizer.param_groups]


def _my_slice(state: TrainState, fqn: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a parameter-shaped tensor, whether it holds the slice or the flat."""
    p, r = state.placements[fqn], _shard_index(state)
    if t.numel() == p.shard_numel:
        return t
    assert t.numel() == p.padded_numel, (fqn, t.shape)
    return t[r * p.shard_numel : (r + 1) * p.shard_numel]


def _shard_index(state: TrainState) -> int:
    """Which slice of each padded flat this rank holds (NOTE [Shard groups of consecutive ranks]
    in zerofx/runtime/rank_groups.py): its rank when sharding is flat."""
    return state.shard_index


def _num_shards(state: TrainState) -> int:
    """How many slices each padded flat is cut into: the world size, or the shard group size."""
    return state.num_shards


def _rank_tensors(state: TrainState) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """This rank's slice of every parameter, fp32 master and optimizer-state tensor, and the
    scalar optimizer states (Adam's ``step``)."""
    # Offloaded parameter shards (stage 3 offload_param) are read back from their tier.
    shard = state.param_shard
    tensors = {f"param/{f}": _my_slice(state, f, shard(f)) for f in state.placements}
    tensors.update({f"master/{f}": _my_slice(state, f, t) for f, t in _masters(state).items()})
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, param in _optimizer_tensors(state).items():
        # Offloaded states are read back from their tier here, one parameter at a time.
        for name, v in state.optimizer.state.get(param, {}).items():
            if isinstance(v, torch.Tensor) and v.shape == param.shape:
                tensors[f"state/{fqn}/{name}"] = _my_slice(state, fqn, v)
            elif isinstance(v, torch.Tensor) and v.dim() == 0:
                scalars.setdefault(fqn, {})[name] = {"value": v.item(), "dtype": str(v.dtype)}
            elif v is None or isinstance(v, (bool, int, float)):
                scalars.setdefault(fqn, {})[name] = {"value": v, "dtype": None}
            else:
                raise CheckpointError(f"optimizer state {name!r} of {fqn} ({type(v).__name__}) cannot be checkpointed")
    if state.rank == 0:
        tensors.update({f"buffer/{k}": state.buffers[k] for k, owner in state_dict_keys(state.model) if owner is None})
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, scalars


def train_structure(state: TrainState) -> dict[str, Any]:
    """``structure`` with the model's own dtypes (not a mixed-precision compute dtype), so fp32 and
    bf16 runs of one model load each other's checkpoints."""
    dtypes = {f: str(p.dtype) for f, p in state.model.named_parameters()}
    params = [(p.fqn, p.shape, dtypes[p.fqn], p.requires_grad) for p in state.placements.values()]
    return structure(params, state_dict_keys(state.model))


def _layout(state: TrainState) -> dict[str, int]:
    """The rank layout (NOTE [Checkpoints across rank layouts]): world size, sequence-parallel
    size, data groups and shard group size."""
    size = state.sequence_parallel_size
    return {"world_size": state.world_size, "sequence_parallel_size": size, "data_parallel_size": state.world_size // size,
            "shard_group_size": _num_shards(state)}


def _step_counters(state: TrainState) -> dict[str, Any]:
    """Step counters and the fp16 loss scaler's numbers, when there is a scaler."""
    counters = state.counters
    out = {"micro_steps": counters.micro_steps, "skipped_steps": counters.skipped_steps, "global_samples": counters.global_samples}
    scaler = state.loss_scaler
    if scaler is not None:
        out["loss_scaler"] = {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}
    return out


def _metadata(
    state: TrainState, tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, Any], tag: str, save_id: str, client_crc32: list[str]
) -> dict[str, Any]:
    groups = _param_groups(state)
    return {
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "save_id": save_id,
        "client_crc32": {str(rank): crc for rank, crc in enumerate(client_crc32)},
        "zerofx_version": __version__,
        "torch_version": torch.__version__,
        "safetensors_version": safetensors.__version__,
        "model_class": model_class(state.model),
        **train_structure(state),
        "placements": {
            p.fqn: {"numel": p.numel, "shard_numel": p.shard_numel, "padded_numel": p.padded_numel, "dtype": p.dtype}
            for p in state.placements.values()
        },
        "masters": sorted(k.removeprefix("master/") for k in tensors if k.startswith("master/")),
        "buffers": {
            k.removeprefix("buffer/"): {"shape": list(t.shape), "dtype": str(t.dtype)} for k, t in tensors.items() if k.startswith("buffer/")
        },
        "config": state.cfg.raw,
        "world_size": state.world_size,
        "num_shards": _num_shards(state),
        "layout": _layout(state),
        "stage": int(state.stage),
        "step": state.counters.global_steps,
        "counters": _step_counters(state),
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "plan_fingerprint": state.plan.fingerprint() if state.plan is not None else None,
        "optimizer": {
            "type": state.cfg.optimizer.type,
            "param_groups": groups,
            "tensor_states": {f: sorted(k.rsplit("/", 1)[1] for k in tensors if k.startswith(f"state/{f}/")) for g in groups for f in g},
            "scalar_states": scalars,
        },
    }


def _check_keep_last(keep_last: int | None) -> None:
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r} is invalid; accepted: None (keep every checkpoint) or an integer >= 1")


def _client_bytes(client: dict[str, Any], rank: int, n: int, tag: str, save_id: str) -> bytes:
    buf = io.BytesIO()
    torch.save({"client_state": client, "rng": _rng_states(), "rank": rank, "world_size": n, "tag": tag, "save_id": save_id}, buf)
    return buf.getvalue()


def _publish(root: Path, staging: Path, tag: str, meta: str) -> None:
    """Rank 0, once every rank confirmed its files: mark ``staging`` complete, rename it to
    ``tag`` and point ``latest`` at it. On an error before ``latest`` names it, a copy of ``tag``
    that was being replaced is put back."""
    _write_atomically(staging / METADATA, lambda p: p.write_text(meta))
    _write_atomically(staging / COMPLETE, lambda p: p.write_text(f"{tag}\n"))
    _fsync(staging)
    final, old = root / tag, root / f".{tag}.old"
    replaced = final.exists()
    if replaced:  # saving a tag again: move the old copy aside, then drop it
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(staging, final)
        try:
            _write_atomically(root / LATEST, lambda p: p.write_text(f"{tag}\n"))
        except BaseException:
            os.replace(final, staging)
            raise
    except BaseException:
        if replaced:
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    try:
        _fsync(root)
    except OSError as exc:  # the save is complete and ``latest`` names it; only its durability is in doubt
        warnings.warn(f"checkpoint {tag!r} is saved, but fsync of {str(root)!r} failed ({exc}): a power loss may undo it", stacklevel=3)


def _prune(root: Path, keep_last: int) -> None:
    """Rank 0, after a save: delete the oldest complete ``step-<N>`` checkpoints beyond the newest
    ``keep_last``, never the one ``latest`` names. Each is renamed out of sight first, so one
    deleted halfway never looks complete. A deletion that fails is a warning: the save stands."""
    latest = (root / LATEST).read_text().strip()
    tags = [t for t in complete_tags(root) if DEFAULT_TAG_RE.fullmatch(t)]
    for tag in tags[: max(0, len(tags) - keep_last)]:
        if tag == latest:
            continue
        doomed = root / f".{tag}.deleted"
        try:
            shutil.rmtree(doomed, ignore_errors=True)
            os.replace(root / tag, doomed)
            shutil.rmtree(doomed)
        except OSError as exc:
            warnings.warn(f"keep_last={keep_last}: could not delete old checkpoint {str(root / tag)!r}: {exc}", stacklevel=3)


def save_checkpoint(
    state: TrainState,
    save_dir: str | Path,
    tag: str | None = None,
    client_state: Mapping[str, Any] | None = None,
    *,
    keep_last: int | None = None,
) -> None:
    """Save ``state`` (``Engine.train_state()``) under ``save_dir/tag`` (default tag ``step-<global_steps>``). A collective:
    call on every rank. ``client_state`` (this rank's; tensors, numbers, strings and containers
    of them) comes back from ``load_checkpoint``. With ``keep_last`` K, rank 0 then deletes the
    oldest complete ``step-<N>`` checkpoints in ``save_dir`` beyond the newest K (other tags are
    never deleted). A failure on any rank raises ``CheckpointError`` on every rank, naming the
    rank and the reason, and leaves ``save_dir`` as it was. See NOTE [Why a save is atomic]."""
    tag = _check_tag(tag if tag is not None else f"step-{state.counters.global_steps:08d}")
    _check_keep_last(keep_last)
    client = dict(client_state or {})
    root, rank, n = Path(save_dir), state.rank, state.world_size
    staging = root / f".{tag}.partial"
    not_saved = f"checkpoint {tag!r} in {str(root)!r} was not saved"
    unchanged = f"no rank marked it {COMPLETE}; {LATEST!r} and earlier checkpoints are unchanged"

    def fail(statuses: list[dict[str, Any]], cause: BaseException | None) -> None:
        reasons = _failures(statuses)
        if reasons is None:
            return
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"{not_saved} ({reasons}); {unchanged}") from cause

    error: BaseException | None = None
    try:
        _check_loadable(client)
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # a killed save's leftovers
            staging.mkdir()
    except (CheckpointError, OSError) as exc:
        error = exc
    setup = _all_gather(state, {"error": error and _one_line(error), "tag": tag, "save_id": secrets.token_hex(8)})
    if len({s["tag"] for s in setup}) > 1:  # ranks at different steps: each would write its own directory
        setup = [{**s, "error": s["error"] or f"saving under tag {s['tag']!r}, not one tag on every rank"} for s in setup]
    fail(setup, error)
    save_id = setup[0]["save_id"]  # rank 0's

    crc = None
    try:
        tensors, scalars = _rank_tensors(state)
        shards = _num_shards(state)
        if rank < shards:  # with shard groups, group 0 holds every slice once: its ranks write them
            header = rank_file_header(rank, shards, tag, save_id, tensors)
            _write_atomically(staging / rank_file(rank, shards), lambda p: save_file(tensors, p, metadata=header))
        data = _client_bytes(client, rank, n, tag, save_id)
        _write_atomically(staging / client_file(rank, n), lambda p: p.write_bytes(data))
        crc = f"{zlib.crc32(data):08x}"
    except Exception as exc:  # a full disk, an I/O error, state that cannot be saved: tell every rank
        error = exc
    written = _all_gather(state, {"error": error and _one_line(error), "crc32": crc})
    fail(written, error)

    if rank == 0:
        try:
            meta = json.dumps(_metadata(state, tensors, scalars, tag, save_id, [s["crc32"] for s in written]), indent=1, default=str)
            _publish(root, staging, tag, meta)
        except Exception as exc:
            error = exc
        if error is None and keep_last is not None:
            _prune(root, keep_last)
    fail(_all_gather(state, {"error": error and _one_line(error)}), error)


# --------------------------------------------------------------------------- loading
def _fill(state: TrainState, fqn: str, target: torch.Tensor, mine: torch.Tensor) -> None:
    """Copy this rank's new shard into ``target``: itself when ``target`` is a shard, else the
    all-gathered padded flat (stage 0 flats, stage 0-2 full parameters)."""
    p = state.placements[fqn]
    if target.numel() == p.shard_numel:
        target.copy_(mine)
        return
    flat = torch.empty(p.padded_numel, dtype=mine.dtype, device=mine.device)
    _compat.all_gather_flat(flat, mine, group=state.shard_group)  # the slices of one group
    target.copy_(flat)


def _read_shard(state: TrainState, files: RankFiles, meta: Mapping[str, Any], key: str, fqn: str, dtype: torch.dtype) -> torch.Tensor:
    """This rank's new shard of saved flat ``key``: its real elements from the saved slices,
    then zeros for the padding."""
    p = state.placements[fqn]
    start, stop = p.owned_range(_shard_index(state))
    mine = torch.zeros(p.shard_numel, dtype=dtype, device=state.device)
    if stop > start:  # the last ranks may own only padding
        mine[: stop - start].copy_(files.read_range(key, meta["placements"][fqn]["shard_numel"], start, stop))
    return mine


def _planned_reads(state: TrainState, meta: Mapping[str, Any], load_optimizer_states: bool) -> list[tuple[int, str, int | None]]:
    """(saved rank, tensor key, saved shard_numel or None for a buffer) of every slice or buffer
    this rank's load reads, in reading order."""
    reads: list[tuple[int, str, int | None]] = []
    for fqn, p in state.placements.items():
        keys = [f"{'master' if fqn in meta['masters'] else 'param'}/{fqn}"]
        if load_optimizer_states and p.requires_grad:
            keys += [f"state/{fqn}/{name}" for name in meta["optimizer"]["tensor_states"].get(fqn, [])]
        start, stop = p.owned_range(_shard_index(state))
        shard_numel = meta["placements"][fqn]["shard_numel"]
        if stop > start:
            reads += [(k, key, shard_numel) for key in keys for k in saved_ranks(shard_numel, start, stop)]
    reads += [(0, f"buffer/{key}", None) for key, owner in state_dict_keys(state.model) if owner is None]
    return reads


def _prepare_load(
    state: TrainState, load_dir: str | Path, tag: str | None, load_optimizer_states: bool
) -> tuple[Path, dict[str, Any], RankFiles, dict[str, Any]]:
    """Everything this rank's load reads, checked: see NOTE [Loading checks before it changes anything]."""
    path = resolve_tag(load_dir, tag)
    meta = read_metadata(load_dir, path.name)
    check_structure(meta, train_structure(state), repr(str(path)))
    opt = meta["optimizer"]
    if load_optimizer_states and opt["type"] != state.cfg.optimizer.type:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds {opt['type']} states but the engine's optimizer is {state.cfg.optimizer.type}; "
            f"accepted: the same optimizer type, or load_optimizer_states=False"
        )
    if load_optimizer_states and opt["param_groups"] != _param_groups(state):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: optimizer param groups {opt['param_groups']} differ from the engine's {_param_groups(state)}"
        )
    n = meta["world_size"]
    files = RankFiles(check_rank_files(path, num_shards(meta)), meta)
    try:
        for k, key, shard_numel in _planned_reads(state, meta, load_optimizer_states):
            files.verify(k, key, shard_numel)
        client = read_client(path, meta, state.rank % n)
    except BaseException:
        files.close()
        raise
    return path, meta, files, client


def load_checkpoint(state: TrainState, load_dir: str | Path, tag: str | None = None, *, load_optimizer_states: bool = True) -> dict[str, Any]:
    """Load a checkpoint saved at any world size and stage into ``state`` (``Engine.train_state()``, changed in place); return this rank's
    ``client_state`` (saved rank ``rank % N``'s at a new world size). A collective: call on every
    rank. Restores parameters (and fp32 masters), persistent buffers, optimizer states and the
    step counters; at the saved world size also each rank's torch and Python RNG states.
    With ``tag`` None: the tag ``latest`` names, or the newest complete one when that one is
    incomplete or damaged. ``CheckpointError``, on every rank, names a missing, incomplete,
    mismatched or damaged checkpoint or file before anything is changed (NOTE [Loading checks
    before it changes anything])."""
    error: BaseException | None = None
    try:
        path, meta, files, saved = _prepare_load(state, load_dir, tag, load_optimizer_states)
    except Exception as exc:  # every rank must hear of it, or its peers wait in the first all-gather
        error = exc
    found = None if error is not None else (path.name, meta.get("save_id"))
    statuses = _all_gather(state, {"error": error and _one_line(error), "found": found})
    reasons = _failures(statuses)
    if reasons is None and len({s["found"] for s in statuses}) > 1:
        reasons = "ranks found different checkpoints (" + ", ".join(f"rank {r}: {s['found'][0]!r}" for r, s in enumerate(statuses))
        reasons += "); accepted: one checkpoint directory that every rank sees"
    if reasons is not None:
        if error is None:
            files.close()
        single = {s["error"] for s in statuses}
        # Every rank failed the same way (a wrong path, another model): that reason as it is.
        raise CheckpointError(next(iter(single)) if len(single) == 1 and None not in single else reasons) from error

    n = meta["world_size"]
    with files:
        masters = state.master
        load_offloaded_master = getattr(state.optimizer, "load_master", None) if state.offload_store is not None else None
        for fqn, p in state.placements.items():
            # The most precise saved copy: the fp32 master when the run had one.
            master = fqn in meta["masters"]
            saved_dtype = torch.float32 if master else torch_dtype(meta["placements"][fqn]["dtype"])
            value = _read_shard(state, files, meta, f"{'master' if master else 'param'}/{fqn}", fqn, saved_dtype)
            param_store = state.param_store
            if param_store is not None and fqn in param_store:
                param_store.init_shard(fqn, value.to(p.torch_dtype))  # this rank's new shard, to its tier
            else:
                _fill(state, fqn, state.shards[fqn], value.to(p.torch_dtype))
            if fqn in state.full and state.full[fqn] is not state.shards[fqn]:
                _fill(state, fqn, state.full[fqn], value.to(p.torch_dtype))
            if fqn in masters:
                _fill(state, fqn, masters[fqn], value.to(masters[fqn].dtype))
            elif load_offloaded_master is not None and p.requires_grad and state.compute_dtype is not None:
                owned = torch.empty(state.optimizer_params[fqn].numel(), dtype=torch.float32, device=state.device)
                _fill(state, fqn, owned, value)
                load_offloaded_master(fqn, owned)
        for key, owner in state_dict_keys(state.model):
            if owner is None:
                state.buffers[key].copy_(files.tensor(0, f"buffer/{key}"))
        if load_optimizer_states:
            _load_optimizer(state, files, meta)
    state.counters.global_steps = meta["step"]
    counters = meta.get("counters", {})
    for name in ("micro_steps", "skipped_steps", "global_samples"):
        if name in counters:
            setattr(state.counters, name, counters[name])
    scaler = state.loss_scaler
    for name, value in counters.get("loss_scaler", {}).items() if scaler is not None else ():
        if hasattr(scaler, name):
            setattr(scaler, name, value)
    if n == state.world_size:  # at another world size two ranks would share rank r % N's stream
        torch.set_rng_state(saved["rng"]["torch"])
        random.setstate(saved["rng"]["python"])
        if "cuda" in saved["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["rng"]["cuda"])
    dist.barrier(group=state.group)  # nobody saves over this tag while a peer still reads it
    return saved["client_state"]


def _load_optimizer(state: TrainState, files: RankFiles, meta: Mapping[str, Any]) -> None:
    """Rebuild ``optimizer.state`` on this rank's tensors through ``optimizer.load_state_dict``
    (which keys state by parameter index); the hyperparameters stay the engine's."""
    opt = meta["optimizer"]
    tensors = _optimizer_tensors(state)
    by_index: dict[int, dict[str, Any]] = {}
    for index, fqn in enumerate(f for group in _param_groups(state) for f in group):
        param = tensors[fqn]
        entry: dict[str, Any] = {}
        for name, s in opt["scalar_states"].get(fqn, {}).items():
            entry[name] = s["value"] if s["dtype"] is None else torch.tensor(s["value"], dtype=torch_dtype(s["dtype"]))
        # Offloaded states are fp32 whatever the parameters' dtype (the optimizer steps the shards).
        dtype = torch.float32 if state.offload_store is not None else param.dtype
        for name in opt["tensor_states"].get(fqn, []):
            entry[name] = torch.empty(param.shape, dtype=dtype, device=param.device)
            _fill(state, fqn, entry[name], _read_shard(state, files, meta, f"state/{fqn}/{name}", fqn, dtype))
        if entry:
            by_index[index] = entry
    state.optimizer.load_state_dict({"state": by_index, "param_groups": state.optimizer.state_dict()["param_groups"]})
