"""Rank functions for the offload tests: train with optimizer state on each tier, fault
injection, checkpoints, and single-process references (including the one-step late update)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

import zerofx
from tests.support.models import BUILDERS, VOCAB, batches, loss_of, make_optimizer


def config(stage: int, opt: dict, offload: dict | None = None, *, zerofx_offload: dict | None = None, bf16: bool = False) -> dict:
    zero: dict = {"stage": stage}
    if offload is not None:
        zero["offload_optimizer"] = offload
    cfg: dict = {"zero_optimization": zero, "optimizer": opt}
    if zerofx_offload:
        cfg["zerofx"] = {"offload": zerofx_offload}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def run(rank: int, world_size: int, cfg: dict, steps: int, save: tuple[str, int] | None = None, load: str | None = None) -> dict:
    """Train the tiny DNA LM ``steps`` steps (rank r's batch of step s is ``batches()[s, r]``);
    ``save=(dir, k)`` checkpoints after step k, ``load=dir`` resumes from it first."""
    data = batches(world_size, steps, VOCAB["dna"])
    model = BUILDERS["dna"]()
    engine = zerofx.initialize(model, cfg, example_inputs=(data[0, rank],), example_kwargs={"labels": data[0, rank]})
    start = 0
    if load is not None:
        engine.load_checkpoint(load)
        start = engine.global_steps
    losses = []
    for step in range(start, steps):
        ids = data[step, rank]
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        if save is not None and step + 1 == save[1]:
            engine.save_checkpoint(save[0])
    state = {k: v.float() for k, v in engine.full_state_dict().items()}  # also waits for the write-backs
    plan = engine.storage.offload_plan
    store = engine.storage.param_store
    out = {
        "state": state,
        "losses": losses,
        "memory": engine.memory(),
        "tiers": {f: t.value for f, t in plan.tiers} if plan is not None else {},
        "io": engine.storage.offload_store.io_bytes() if engine.storage.offload_store is not None else (0, 0),
        "owned": sum(p.shard_numel for p in engine.placements.values() if p.requires_grad),
        "tensors": sum(1 for p in engine.placements.values() if p.requires_grad),
        "num_params": sum(p.numel for p in engine.placements.values() if p.requires_grad),
        "checkpoint_dir": save[0] if save is not None else None,
    }
    if store is not None:  # offload_param: what the parameter store holds and moved
        out["param"] = {
            "tiers": {f: t.value for f, t in engine.storage.param_offload_plan.tiers},
            "io": store.io_bytes(),
            "peak_held_shards": store.peak_held_shards,
            "peak_held_bytes": store.peak_held_bytes,
            "shard_bytes": {f: store.nbytes(f) for f in store.numels},
            "trainable": [f for f in store.numels if engine.placements[f].requires_grad],
            "resident_shards": sorted(engine.storage.shards),
            "gather_buckets": engine.program.plan.gather_buckets,
            "prefetch_distance": engine.program.plan.prefetch_distance,
            "buffer_count": store.options.buffer_count,
        }
    # The NVMe files exist while the engine lives and are gone after close (NOTE [Offload files
    # live as long as the engine]).
    zero = cfg["zero_optimization"]
    sections = (zero.get("offload_optimizer", {}), zero.get("offload_param", {}))
    roots = {Path(s["nvme_path"]) / f"rank-{rank:05d}" for s in sections if s.get("nvme_path")}  # this rank's own folder
    files_before = [p for r in roots for p in r.rglob("*") if p.is_file()]
    engine.close()
    out["nvme_files"] = (len(files_before), sorted(str(p) for r in roots for p in r.rglob("*")))
    return out


def run_many(rank: int, world_size: int, runs: dict[str, tuple]) -> dict[str, dict]:
    """Several ``run``s in one process group (spawning ranks costs more than a tiny run): each
    value is ``(config, steps)``, ``(config, steps, checkpoint_to_load)`` or ``(config, steps, None,
    (checkpoint_dir, save_after_step))``."""
    return {name: run(rank, world_size, spec[0], spec[1], *spec[3:4], load=spec[2] if len(spec) > 2 else None) for name, spec in runs.items()}


def nvme_folder_vanishes(rank: int, world_size: int, cfg: dict, steps_before: int) -> str:
    """Train a few steps, remove this rank's NVMe folder, step again: the error message."""
    data = batches(world_size, steps_before + 1, VOCAB["dna"])
    engine = zerofx.initialize(BUILDERS["dna"](), cfg, example_inputs=(data[0, rank],), example_kwargs={"labels": data[0, rank]})
    for step in range(steps_before + 1):
        if step == steps_before:
            shutil.rmtree(engine.storage.offload_store.files.root)
        ids = data[step, rank]
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        try:
            engine.step()
        except zerofx.ZeroFXError as exc:
            return f"{type(exc).__name__}: {exc}"
    return "no error"


def record_files(rank: int, world_size: int, cfg: dict) -> dict[str, int]:
    """The NVMe record files one rank writes at initialization, and their sizes."""
    data = batches(world_size, 1, VOCAB["dna"])
    engine = zerofx.initialize(BUILDERS["dna"](), cfg, example_inputs=(data[0, rank],), example_kwargs={"labels": data[0, rank]})
    root = engine.storage.offload_store.files.root
    return {p.name: p.stat().st_size for p in Path(root).iterdir() if os.path.isfile(p)}


def reference_late(world_size: int, steps: int, opt: dict) -> dict[str, torch.Tensor]:
    """Single process, each step's averaged gradient applied one step late (ZeRO-Offload's DPU):
    the gradient of step t is taken at parameters holding the updates of steps < t - 1, and
    the last update is applied at the end."""
    model = BUILDERS["dna"]()
    params = [p for p in model.parameters() if p.requires_grad]
    optim = make_optimizer(opt, params)
    data = batches(world_size, steps, VOCAB["dna"])
    pending: list[torch.Tensor] | None = None
    for step in range(steps):
        loss = sum(loss_of(model, data[step, r]) for r in range(world_size)) / world_size
        grads = torch.autograd.grad(loss, params)
        if pending is not None:
            for p, g in zip(params, pending):
                p.grad = g
            optim.step()
        pending = [g.detach().clone() for g in grads]
    for p, g in zip(params, pending):
        p.grad = g
    optim.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def param_config(stage: int, opt: dict, param: dict, offload: dict | None = None, *, bf16: bool = False, **zero: object) -> dict:
    """``config`` with ``zero_optimization.offload_param`` (and extra ``zero_optimization`` keys)."""
    cfg = config(stage, opt, offload, bf16=bf16)
    cfg["zero_optimization"].update({"offload_param": param, **zero})
    return cfg


def param_faults(rank: int, world_size: int, stage2_cfg: dict, cfg: dict) -> dict[str, str]:
    """offload_param below stage 3 (the error), then a stage-3 run whose NVMe folder is removed
    before a forward: the error the fetch inside the graph raises."""
    data = batches(world_size, 2, VOCAB["dna"])
    out = {}
    try:
        zerofx.initialize(BUILDERS["dna"](), stage2_cfg, example_inputs=(data[0, rank],), example_kwargs={"labels": data[0, rank]})
        out["stage2"] = "no error"
    except zerofx.ZeroFXError as exc:
        out["stage2"] = f"{type(exc).__name__}: {exc}"
    engine = zerofx.initialize(BUILDERS["dna"](), cfg, example_inputs=(data[0, rank],), example_kwargs={"labels": data[0, rank]})
    out["root"] = str(engine.storage.param_store.files.root)
    ids = data[0, rank]
    engine.backward(engine(ids, labels=ids))
    engine.step()
    engine.flush()
    shutil.rmtree(engine.storage.param_store.files.root)
    try:
        engine(data[1, rank], labels=data[1, rank])
        out["vanished"] = "no error"
    except zerofx.ZeroFXError as exc:
        out["vanished"] = f"{type(exc).__name__}: {exc}"
    return out


def fault_runs(rank: int, world_size: int, cfg: dict, steps_before: int, stage2_cfg: dict, param_cfg: dict) -> dict:
    """``nvme_folder_vanishes`` and ``param_faults`` in one process."""
    return {"records": nvme_folder_vanishes(rank, world_size, cfg, steps_before),
            "params": param_faults(rank, world_size, stage2_cfg, param_cfg)}
