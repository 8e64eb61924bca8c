"""Rank functions for the gradient-offload tests (``zerofx.offload_gradients``): train the tiny DNA
LM with gradients on the device, in host memory or on NVMe, measure the reduced gradient bytes
the backward holds (run and memory model) and where it hands them off, and inject faults into the
gradient files."""

from __future__ import annotations

import os
import shutil
import weakref
from pathlib import Path

import torch
import torch.fx as fx

import zerofx
from tests.support.models import BUILDERS, VOCAB, batches
from zerofx.passes import meta
from zerofx.passes.memory.offload_grads import is_offload


def grad_config(stage: int, opt: dict, grads: dict | None = None, *, bf16: bool = False, accumulation: int = 1,
                clipping: float = 0.0, offload: dict | None = None, param: dict | None = None, delayed: bool = False) -> dict:
    zero: dict = {"stage": stage}
    if offload is not None:
        zero["offload_optimizer"] = offload
    if param is not None:
        zero["offload_param"] = param
    cfg: dict = {"zero_optimization": zero, "optimizer": opt, "gradient_accumulation_steps": accumulation}
    own: dict = {}
    if grads is not None:
        own["offload_gradients"] = grads
    if delayed:
        own["offload"] = {"delayed_update": True}
    if own:
        cfg["zerofx"] = own
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if clipping:
        cfg["gradient_clipping"] = clipping
    return cfg


def train(rank: int, world_size: int, cfg: dict, steps: int) -> dict:
    """``steps`` optimizer steps of ``gradient_accumulation_steps`` micro-steps each (rank r's
    micro-batch k is ``batches()[k, r]``): final state, losses, memory, gradient files and I/O."""
    accumulation = cfg.get("gradient_accumulation_steps", 1)
    data = batches(world_size, steps * accumulation, VOCAB["dna"])
    engine = zerofx.initialize(BUILDERS["dna"](), cfg, example_inputs=(data[0, rank],), example_kwargs={"labels": data[0, rank]})
    live = _track_reduced_grads(engine)
    losses = []
    for micro in range(steps * accumulation):
        ids = data[micro, rank]
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    state = {k: v.float() for k, v in engine.full_state_dict().items()}  # also waits for the write-backs
    grad_store = engine.storage.grad_store
    out = {
        "state": state,
        "losses": losses,
        "memory": engine.memory(),
        "device_grad_buffers": len(engine.storage.grads),
        "owned": sum(p.shard_numel for p in engine.placements.values() if p.requires_grad),
        "grad_io": grad_store.io_bytes() if grad_store is not None else (0, 0),
        "reduced_live_peak": live["peak"],
        **_backward_facts(engine, rank),
    }
    root = None
    if grad_store is not None and grad_store.files is not None:
        root = grad_store.files.root
        out["grad_files"] = sorted(p.name for p in root.iterdir() if p.suffix.startswith(".grad"))
    engine.close()
    out["left_after_close"] = sorted(str(p) for p in root.rglob("*")) if root is not None and root.exists() else []
    return out


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _track_reduced_grads(engine: zerofx.Engine) -> dict[str, int]:
    """Measure, in the real run, the bytes of the reduced gradient shards' storages the graph
    holds: with gradient offload at each hand-off (the shards handed off so far that are still
    alive, through weak references, plus this one), else the backward's outputs when it returns."""
    live = {"peak": 0}
    store = engine.storage.grad_store
    if store is None:
        accumulate = engine.storage.accumulate_grads

        def measured_accumulate(fqns, grads):  # noqa: ANN001, ANN202
            live["peak"] = max(live["peak"], _storage_bytes([g for g in grads if g is not None]))
            accumulate(fqns, grads)

        engine.storage.accumulate_grads = measured_accumulate
        return live
    handed: list[weakref.ref] = []
    add = store.add

    def measured_add(fqn: str, grad: torch.Tensor) -> None:
        alive = [t for t in (r() for r in handed) if t is not None] + [grad]
        live["peak"] = max(live["peak"], _storage_bytes(alive))
        handed.append(weakref.ref(grad))
        add(fqn, grad)

    store.add = measured_add  # the engine hands the backward graph store.add as it finds it
    return live


def _backward_facts(engine: zerofx.Engine, rank: int) -> dict:
    """What the lowered backward graph says: the hand-offs (and any node between a hand-off and
    its bucket's wait that is not that bucket's own tail), the reduced gradients it returns, the
    reduced bytes per bucket, and from the memory model the reduced-shard bytes alive at most and
    the bytes alive when the backward returns."""
    program = engine.program
    plan = program.plan
    backward = program.graph_modules(rank)["backward"]
    nodes = list(backward.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    wait_of = {f: next(u for u in c.users if meta.is_wait(u)) for c in nodes if meta.is_reduce_scatter(c)
               for f in c.meta[meta.COMM_FQNS]}
    handoffs = []
    for h in (n for n in nodes if is_offload(n)):
        wait = wait_of[h.args[1]]
        tail = {wait}
        for n in nodes[position[wait] + 1 : position[h]]:
            if any(a in tail for a in n.all_input_nodes):
                tail.add(n)
        strays = [n.name for n in nodes[position[wait] + 1 : position[h]] if n not in tail and not is_offload(n)]
        handoffs.append((h.args[1], strays))
    outputs = meta.output_node(backward.graph).args[0]
    # The reduced means (the division after each bucket's wait, or on gloo after the sum over the
    # all-to-all's chunks: NOTE [gloo's reduce-scatter as an all-to-all]) and the slices of them,
    # and when the last of them is used: the output (the end) or a hand-off.
    def reduced(n: fx.Node) -> bool:
        if meta.is_wait(n):
            return True
        return (n.op == "call_function" and n.target is torch.ops.aten.sum.dim_IntList
                and n.args[0].target is torch.ops.aten.view.default and meta.is_wait(n.args[0].args[0]))

    owner = {}
    for n in nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.div.Tensor and reduced(n.args[0]):
            owner[n] = n
        elif n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) and n.args[0] in owner and not is_offload(n):
            owner[n] = owner[n.args[0]]
    last = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a in owner:
                last[owner[a]] = max(last.get(owner[a], 0), position[n])
    alive = [0] * len(nodes)
    for mean, end in last.items():
        for i in range(position[mean], end + 1):
            alive[i] += mean.meta["val"].numel() * mean.meta["val"].element_size()
    report = program.report(rank)
    return {
        "handoffs": handoffs,
        "reduced_outputs": sum(isinstance(o, fx.Node) and meta.COMM_FQNS in o.meta for o in outputs),
        "bucket_bytes": [sum(plan.param(f).shard_numel * plan.param(f).itemsize for f in b) for b in plan.reduce_buckets],
        "reduced_model_peak": max(alive),
        "backward_end_bytes": report.timeline[-1].live_bytes - report.persistent_bytes,
        "planned_grads": program.memory(rank)["grads"],
    }


def train_many(rank: int, world_size: int, runs: dict[str, tuple[dict, int]]) -> dict[str, dict]:
    """Several ``train`` runs in one process group (spawning ranks costs more than a tiny run)."""
    return {name: train(rank, world_size, cfg, steps) for name, (cfg, steps) in runs.items()}


def _engine(rank: int, world_size: int, cfg: dict, micro_steps: int) -> tuple[zerofx.Engine, torch.Tensor]:
    data = batches(world_size, micro_steps, VOCAB["dna"])
    return zerofx.initialize(BUILDERS["dna"](), cfg, example_inputs=(data[0, rank],), example_kwargs={"labels": data[0, rank]}), data


def _micro_step(engine: zerofx.Engine, ids: torch.Tensor) -> None:
    loss = engine(ids, labels=ids)
    engine.backward(loss)
    engine.step()


def _error(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except zerofx.ZeroFXError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def grad_faults(rank: int, world_size: int, root: str) -> dict[str, str]:
    """One rank, gradients on NVMe under ``root``: a full disk (the smallest shard's file is
    /dev/full, which fails every write with ENOSPC), the rank's folder removed while training,
    and a gradient file truncated between the backward and the step."""
    out: dict[str, str] = {}
    cfg = grad_config(2, {"type": "SGD", "params": {"lr": 0.1}}, {"device": "nvme", "nvme_path": str(Path(root) / "full")}, bf16=True)
    engine, data = _engine(rank, world_size, cfg, 2)
    store = engine.storage.grad_store
    smallest = min(store.numels, key=store.numels.get)
    os.symlink("/dev/full", store.files.path(smallest))  # under 4 KiB: written through the page cache, as /dev/full needs
    out["full_disk"] = _error(lambda: _micro_step(engine, data[0, rank]))
    out["full_disk_fqn"] = smallest
    _error(engine.close)  # a failed transfer is raised again by close: the step already did

    cfg = grad_config(2, {"type": "SGD", "params": {"lr": 0.1}}, {"device": "nvme", "nvme_path": str(Path(root) / "gone")}, bf16=True)
    engine, data = _engine(rank, world_size, cfg, 2)
    _micro_step(engine, data[0, rank])
    shutil.rmtree(engine.storage.grad_store.files.root)
    out["removed_folder"] = _error(lambda: _micro_step(engine, data[1, rank]))
    out["removed_root"] = str(engine.storage.grad_store.files.root)
    _error(engine.close)  # a failed transfer is raised again by close: the step already did

    cfg = grad_config(2, {"type": "SGD", "params": {"lr": 0.1}}, {"device": "nvme", "nvme_path": str(Path(root) / "cut")}, bf16=True)
    engine, data = _engine(rank, world_size, cfg, 1)
    store = engine.storage.grad_store
    largest = max(store.numels, key=store.numels.get)
    loss = engine(data[0, rank], labels=data[0, rank])
    engine.backward(loss)
    store.drain()  # the accumulation has reached the file
    os.truncate(store.files.path(largest), 10)
    out["truncated"] = _error(engine.step)
    out["truncated_fqn"] = largest
    out["truncated_bytes"] = str(store.nbytes(largest))
    out["truncated_path"] = str(store.files.path(largest))
    _error(engine.close)  # a failed transfer is raised again by close: the step already did

    return out
