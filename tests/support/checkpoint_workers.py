"""Functions the spawned ranks of tests/test_checkpoint.py run, and the single-process
reference they are compared with.

Data is deterministic per (step, world size): ``step_batch(step, world_size, rank)``. A run
whose world size changes between steps is reproduced by ``reference_run`` with the same list of
per-step world sizes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zerofx
import zerofx.runtime.checkpoint
from zerofx.passes import _compat
from tests.support.models import BATCH, BUILDERS, SEQ, VOCAB, loss_of, make_optimizer

SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
# The round trip: (model, optimizer) per stage. "scaled" has a persistent buffer; "dna" has
# tied embeddings and a frozen parameter.
ROUND_TRIP = {0: ("dna", ADAMW), 1: ("dna", ADAMW), 2: ("scaled", SGD), 3: ("dna", SGD)}
# fp16 with a dynamic loss scale: fp32 master shards, and loss-scaler counters to checkpoint.
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 18, "hysteresis": 1}}
SAVED_STEPS = 2  # the checkpoints hold the state after steps 1..2, at world size 2
MORE_STEPS = 2  # steps 3..4 run after a resume


def step_batch(step: int, world_size: int, rank: int, vocab: int = 5) -> torch.Tensor:
    """(BATCH, SEQ) token ids rank ``rank`` trains on at ``step`` when the world size is ``world_size``."""
    g = torch.Generator().manual_seed(10_000 * step + world_size)
    return torch.randint(0, vocab, (world_size, BATCH, SEQ), generator=g)[rank]


def reference_run(kind: str, opt: dict, world_sizes: list[int]) -> dict[str, torch.Tensor]:
    """Plain PyTorch in one process: step i+1 averages the losses of ``world_sizes[i]`` ranks'
    batches, as data parallel averages their gradients."""
    model = BUILDERS[kind]()
    optim = make_optimizer(opt, [p for p in model.parameters() if p.requires_grad])
    for step, ws in enumerate(world_sizes, start=1):
        optim.zero_grad()
        loss = sum(loss_of(model, step_batch(step, ws, r, VOCAB[kind])) for r in range(ws)) / ws
        loss.backward()
        optim.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_engine(kind: str, stage: int, opt: dict, group: dist.ProcessGroup | None = None, extra: dict | None = None) -> zerofx.Engine:
    ids = step_batch(1, dist.get_world_size(group), dist.get_rank(group), VOCAB[kind])
    return zerofx.initialize(
        BUILDERS[kind](), {"zero_optimization": {"stage": stage}, "optimizer": opt, **(extra or {})},
        example_inputs=(ids,), example_kwargs={"labels": ids}, group=group,
    )


def train(engine: zerofx.Engine, kind: str, first: int, last: int) -> None:
    for step in range(first, last + 1):
        ids = step_batch(step, engine.world_size, engine.rank, VOCAB[kind])
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()


def _gather(engine: zerofx.Engine, fqn: str, t: torch.Tensor) -> torch.Tensor:
    """A parameter-shaped tensor this rank holds as its shard or as the whole padded flat,
    all-gathered over the shard group (a collective) and unpadded."""
    p = engine.placements[fqn]
    flat = t
    if t.numel() != p.padded_numel:
        flat = torch.empty(p.padded_numel, dtype=t.dtype)
        _compat.all_gather_flat(flat, t, group=engine.shard_group)
    return flat[: p.numel].clone()


def full_optimizer_state(engine: zerofx.Engine) -> dict[str, dict[str, torch.Tensor]]:
    """Every trainable parameter's optimizer state, all-gathered and unpadded (a collective)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, param in engine.storage.optimizer_params.items():
        for name, v in engine.optimizer.state.get(param, {}).items():
            out.setdefault(fqn, {})[name] = v.clone() if v.dim() == 0 else _gather(engine, fqn, v)
    return out


def snapshot(engine: zerofx.Engine) -> dict[str, Any]:
    return {
        "state": engine.full_state_dict(),
        "optim": full_optimizer_state(engine),
        "master": {fqn: _gather(engine, fqn, t) for fqn, t in engine.storage.master.items()},
        "step": engine.global_steps,
        "counters": {"micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
                     "loss_scaler": dict(vars(engine.loss_scaler)) if engine.loss_scaler else None},
    }


def save_load_reshard(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """On 3 ranks. Ranks 0-1 (world size 2): at each stage, train 2 steps, save, load into a
    fresh engine. Then every rank (world size 3) and rank 0 alone (world size 1) load two of
    those checkpoints at other stages: SGD trains 2 more steps, AdamW only loads."""
    assert world_size == 3
    pair, solo = dist.new_group([0, 1]), dist.new_group([0])
    out: dict[str, Any] = {"round_trip": {}, "resharded": {}}
    if rank < 2:
        for stage, (kind, opt) in ROUND_TRIP.items():
            engine = make_engine(kind, stage, opt, pair)
            train(engine, kind, 1, SAVED_STEPS)
            if kind == "scaled":  # a buffer value the fresh engine can only get from the checkpoint
                engine.storage.buffers["temperature"].fill_(1.25)
            if stage == 0:
                try:  # checked before anything is written: torch.load(weights_only=True) could not read it back
                    engine.save_checkpoint(Path(root) / "bad", client_state={"sampler": object()})
                except zerofx.runtime.checkpoint.CheckpointError as exc:
                    out["bad_client_state"] = str(exc)
            engine.save_checkpoint(Path(root) / f"stage{stage}", client_state={"rank": rank, "position": 7})
            saved = snapshot(engine)
            del engine
            fresh = make_engine(kind, stage, opt, pair)
            client = fresh.load_checkpoint(Path(root) / f"stage{stage}")
            out["round_trip"][stage] = {"saved": saved, "loaded": snapshot(fresh), "client": client}
        engine = make_engine("dna", 2, ADAMW, pair, FP16)
        train(engine, "dna", 1, 5)  # the first steps overflow, skip, and halve the scale
        engine.save_checkpoint(Path(root) / "fp16")
        out["fp16"] = snapshot(engine)
        del engine
    dist.barrier()
    # The fp16 checkpoint: into fp16 at world size 3 and stage 3, into fp32 alone at stage 1.
    for ws, group, extra, stage in ((3, None, FP16, 3), (1, solo, None, 1)):
        if rank < ws:
            engine = make_engine("dna", stage, ADAMW, group, extra)
            engine.load_checkpoint(Path(root) / "fp16")
            out["resharded"][(ws, "fp16")] = {"loaded": snapshot(engine)}
    # (saved stage, load stage) per world size: a stage change on every load.
    loads = {3: {3: 2, 1: 0}, 1: {3: 1, 1: 3}}
    for ws, group in ((3, None), (1, solo)):
        if rank >= ws:
            continue
        for saved_stage, stage in loads[ws].items():
            kind, opt = ROUND_TRIP[saved_stage]
            engine = make_engine(kind, stage, opt, group)
            client = engine.load_checkpoint(Path(root) / f"stage{saved_stage}")
            loaded = snapshot(engine)
            if opt["type"] == "SGD":
                train(engine, kind, SAVED_STEPS + 1, SAVED_STEPS + MORE_STEPS)
            out["resharded"][(ws, saved_stage)] = {"loaded": loaded, "client": client, "final": engine.full_state_dict()}
    return out


def _die_halfway(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """Stands in for safetensors' save_file on one rank: the file is half written when this
    process receives SIGKILL, as a rank killed mid-write leaves it."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    os.truncate(path, os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def killed_save(rank: int, world_size: int, root: str) -> None:
    """Save after step 1, then die in the save after step 2: rank 1 is killed mid-write."""
    engine = make_engine("dna", 3, ADAMW)
    train(engine, "dna", 1, 1)
    engine.save_checkpoint(root)
    state = engine.full_state_dict()
    if rank == 0:
        torch.save(state, Path(root) / "expected-step1.pt")
    train(engine, "dna", 2, 2)
    if rank == 1:
        zerofx.runtime.checkpoint.save_file = _die_halfway  # this process only; it dies in this save
    engine.save_checkpoint(root)


def load_latest(rank: int, world_size: int, root: str, stage: int) -> dict[str, Any]:
    engine = make_engine("dna", stage, ADAMW)
    engine.load_checkpoint(root)
    return snapshot(engine)


# --------------------------------------------------------------------------- failures and damage
def _disk_full(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """Stands in for safetensors' save_file on one rank: the disk fills halfway through the file."""
    save_file(tensors, path, metadata=metadata)
    os.truncate(path, os.path.getsize(path) // 2)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _error(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except zerofx.runtime.checkpoint.CheckpointError as exc:
        return str(exc)
    return None


def overwrite_tensor_bytes(file: Path, nbytes: int = 4000) -> str:
    """Overwrite ``nbytes`` of the largest tensor's data in a safetensors file with 0xff; its key."""
    with open(file, "r+b") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        key = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0])
        start, stop = header[key]["data_offsets"]
        assert stop - start >= nbytes, (key, stop - start)
        f.seek(8 + header_len + start)
        f.write(b"\xff" * nbytes)
    return key


DAMAGED = ("swapped", "other_step", "other_run", "corrupt", "client_garbage", "client_swapped")


def _damaged_copies(root: Path) -> dict[str, Any]:
    """Rank 0: copies of run/step-00000004, each with one file swapped, replaced or damaged."""
    good, tag = root / "run" / "step-00000004", "step-00000004"
    r0, r1 = "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"
    c0, c1 = "client-00000-of-00002.pt", "client-00001-of-00002.pt"
    info: dict[str, Any] = {}
    d = {name: root / name / tag for name in DAMAGED}
    for copy in d.values():
        shutil.copytree(good, copy)
    os.replace(d["swapped"] / r0, d["swapped"] / "x")
    os.replace(d["swapped"] / r1, d["swapped"] / r0)
    os.replace(d["swapped"] / "x", d["swapped"] / r1)
    shutil.copy(root / "run" / "step-00000003" / r1, d["other_step"] / r1)
    shutil.copy(root / "twin" / tag / r1, d["other_run"] / r1)
    info["corrupt_key"] = overwrite_tensor_bytes(d["corrupt"] / r1)
    (d["client_garbage"] / c1).write_bytes(b"not a torch.save file")
    os.replace(d["client_swapped"] / c0, d["client_swapped"] / "x")
    os.replace(d["client_swapped"] / c1, d["client_swapped"] / c0)
    os.replace(d["client_swapped"] / "x", d["client_swapped"] / c1)
    # latest names a checkpoint marked COMPLETE that lacks a rank file (as a buggy save left it).
    for t in ("step-00000003", "step-00000004"):
        shutil.copytree(root / "run" / t, root / "fallback" / t)
    (root / "fallback" / tag / r1).unlink()
    (root / "fallback" / "latest").write_text(f"{tag}\n")
    return info


def failures(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """On 2 ranks, stage 3: a save whose rank-1 write fails on a full disk, loads after it, keep_last,
    and loads of checkpoints with swapped, copied or damaged files."""
    base = Path(root)
    run = base / "run"
    out: dict[str, Any] = {}
    engine = make_engine("dna", 3, ADAMW)
    train(engine, "dna", 1, 1)
    engine.save_checkpoint(run, client_state={"step": 1})
    out["step1"] = engine.full_state_dict()
    train(engine, "dna", 2, 2)
    if rank == 1:
        zerofx.runtime.checkpoint.save_file = _disk_full
    out["failed_save"] = _error(lambda: engine.save_checkpoint(run, client_state={"step": 2}))
    zerofx.runtime.checkpoint.save_file = save_file
    dist.barrier()  # a caller that catches the error and goes on
    if rank == 0:
        out["after_failure"] = {"files": sorted(os.listdir(run)), "latest": (run / "latest").read_text().strip()}

    fresh = make_engine("dna", 2, ADAMW)  # stage 2: loading all-gathers full flats, where a lone failure would hang
    out["named_failed_tag"] = _error(lambda: fresh.load_checkpoint(run, "step-00000002"))
    out["loaded_client"] = fresh.load_checkpoint(run)
    out["loaded"] = fresh.full_state_dict()

    out["bad_keep_last"] = [_error(lambda k=k: engine.save_checkpoint(run, keep_last=k)) for k in (0, True, 2.5)]
    engine.save_checkpoint(run, tag="best", keep_last=1)  # not a step-<N> tag: never deleted
    for step in (3, 4):
        train(engine, "dna", step, step)
        engine.save_checkpoint(run, keep_last=2)
        dist.barrier()
        if rank == 0:
            out[f"kept_after_step{step}"] = sorted(p for p in os.listdir(run) if not p.startswith("."))
    engine.save_checkpoint(base / "twin")  # step 4 again, in another save

    info = _damaged_copies(base) if rank == 0 else {}
    dist.barrier()
    out["damaged"] = {
        name: _error(lambda name=name: fresh.load_checkpoint(base / name, "step-00000004"))
        for name in DAMAGED
    }
    out["corrupt_key"] = info.get("corrupt_key")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["fallback_client"] = fresh.load_checkpoint(base / "fallback")
    out["fallback_warnings"] = [str(w.message) for w in caught]
    out["fallback_step"] = fresh.global_steps

    # Re-save the tag latest names when a newer step-<N> exists: keep_last=1 keeps both.
    engine.load_checkpoint(run, "step-00000003")
    engine.save_checkpoint(run, keep_last=1)
    dist.barrier()
    if rank == 0:
        out["kept_after_resave"] = sorted(p for p in os.listdir(run) if not p.startswith("."))
    return out
