"""What each rank runs in tests/test_sp_zero_compose.py, and the single-process reference: ZeRO's
features (offload to host memory and NVMe, bf16, shard groups, checkpoints resumed in another
layout) with the genomic models' sequence mixers (short convs by halo, the FFT conv by channel
all-to-all, the scan by state passing, a cumsum by prefix).

Every layout trains on the same global batch per step, ``global_batch(step)``: GLOBAL_BATCH
sequences that the D = N / S data groups split evenly, every rank of a sequence group passing
its group's rows whole. Labels are the ids, so every row predicts the same number of tokens and
the mean of the data groups' losses is the loss of the whole global batch: plain PyTorch on it is
the uninterrupted run, in any layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zerofx
from tests.support.checkpoint_workers import full_optimizer_state
from tests.support.sequence_parallel_workers import full_masters
from tests.support.sp_conv_workers import ConvCumsumLM
from zerofx.compiler.materialize import init_weights_
from zerofx.models import build_model
from zerofx.passes.meta import is_all_to_all
from zerofx.passes.sequence.mixer_scan import is_selective_scan

SEQ, VOCAB = 64, 4  # 32 positions a rank at S = 2: striped-tiny's MR filter needs a halo of 15
GLOBAL_BATCH = 4  # sequences per step, split over the data groups
SAVED_STEPS, TOTAL_STEPS = 2, 4  # the checkpoint holds the state after step 2; a resumed run trains steps 3-4
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}
SGD = {"type": "SGD", "params": {"lr": 0.1}}
MODELS = {"striped": "striped-tiny", "hyena": "hyena-tiny", "mamba": "mamba-tiny"}
SAVE_S2, SAVE_S2_OFFLOAD = "s2", "s2-offload"  # world 2, sequence 2, stage 3: on the device, and offloaded


def model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "convsum":
        return ConvCumsumLM()
    return init_weights_(build_model(MODELS[kind]), seed=0)


def loss_of(net: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = net(ids, labels=ids)
    return out if isinstance(out, torch.Tensor) else out.loss


def global_batch(step: int) -> torch.Tensor:
    """(GLOBAL_BATCH, SEQ) token ids of step ``step`` (from 1), the same in every layout."""
    g = torch.Generator().manual_seed(1_000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def group_rows(step: int, rank: int, world_size: int, size: int) -> torch.Tensor:
    """The rows of ``global_batch(step)`` that rank ``rank``'s data group (rank // size) trains on."""
    rows = GLOBAL_BATCH // (world_size // size)
    g = rank // size
    return global_batch(step)[g * rows : (g + 1) * rows]


def offload(root: str) -> dict[str, Any]:
    """Every offload at once, over both tiers: optimizer-state records in host memory up to
    ``cpu_budget_bytes`` and the rest in files, parameter shards in files except ``max_in_cpu``
    elements of them in host memory, reduced gradient shards in host memory."""
    nvme = {"device": "nvme", "nvme_path": str(Path(root) / "nvme")}
    return {"zero_optimization": {"offload_optimizer": nvme, "offload_param": {**nvme, "max_in_cpu": 4096}},
            "zerofx": {"offload": {"cpu_budget_bytes": 100_000}, "offload_gradients": {"device": "cpu"}}}


def config(stage: int, size: int, opt: dict, extra: dict | None = None, shard_group_size: int | None = None) -> dict[str, Any]:
    extra = extra or {}
    own: dict[str, Any] = dict(extra.get("zerofx", {}))
    if size > 1:
        own["sequence_parallel"] = {"size": size}
    if shard_group_size is not None:
        own["shard_group_size"] = shard_group_size
    return {**extra, "zero_optimization": {"stage": stage, **extra.get("zero_optimization", {})}, "optimizer": opt, "zerofx": own}


def make_engine(kind: str, cfg: dict[str, Any], size: int, group: dist.ProcessGroup | None = None) -> zerofx.Engine:
    ids = group_rows(1, dist.get_rank(group), dist.get_world_size(group), size)
    return zerofx.initialize(model(kind), cfg, example_inputs=(ids,), example_kwargs={"labels": ids}, group=group)


def train(engine: zerofx.Engine, size: int, first: int, last: int) -> list[float]:
    """Steps ``first..last``; this rank's losses (its data group's)."""
    losses = []
    for step in range(first, last + 1):
        ids = group_rows(step, engine.rank, engine.world_size, size)
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def snapshot(engine: zerofx.Engine) -> dict[str, Any]:
    """Full parameters and optimizer states (gathered: a collective) and the counters."""
    return {"state": engine.full_state_dict(), "optim": full_optimizer_state(engine),
            "counters": {"global_steps": engine.global_steps, "global_samples": engine.global_samples}}


def exchange_dtypes(engine: zerofx.Engine) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Per graph, each all-to-all's dtype and shape, in graph order."""
    return {name: [(str(n.meta["val"].dtype), tuple(n.meta["val"].shape)) for n in gm.graph.nodes if is_all_to_all(n)]
            for name, gm in engine.graph_modules().items()}


def accumulator_dtypes(engine: zerofx.Engine) -> list[tuple[str, ...]]:
    """In the forward graph, in order: each ``cumsum``'s input and output dtype, and each
    selective scan's input x, initial state and (y, final state) dtypes."""
    out = []
    for n in engine.graph_modules()["forward"].graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.cumsum.default:
            out.append(("cumsum", str(n.args[0].meta["val"].dtype), str(n.meta["val"].dtype)))
        elif is_selective_scan(n):
            x, h0, (y, h_last) = n.args[0].meta["val"], n.args[6].meta["val"], n.meta["val"]
            out.append(("scan", *(str(v.dtype) for v in (x, h0, y, h_last))))
    return out


def resume(root: str, tag: str, kind: str, stage: int, size: int, shard_group_size: int | None = None) -> dict[str, Any]:
    """A fresh engine in this layout loads ``tag``, then trains steps SAVED_STEPS+1..TOTAL_STEPS."""
    engine = make_engine(kind, config(stage, size, ADAMW, shard_group_size=shard_group_size), size)
    client = engine.load_checkpoint(root, tag)
    loaded = snapshot(engine)
    losses = train(engine, size, SAVED_STEPS + 1, TOTAL_STEPS)
    out = {"client": client, "loaded": loaded, "losses": losses, "final": snapshot(engine)}
    engine.close()
    return out


def sequence_2(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """World 2, sequence 2, stage 3, on striped-tiny (3 short convs, the SE and MR convs, one FFT
    conv, causal ring attention by "auto" on contiguous slices):

    - AdamW on the device: 2 steps, a save (SAVE_S2), 2 more (the uninterrupted run);
    - the same with every offload over host memory and NVMe, saving SAVE_S2_OFFLOAD;
    - SAVE_S2 resumed as data 2 without sequence parallelism at stage 1;
    - SGD in bf16 on striped-tiny, mamba-tiny (halo and scan) and the conv + cumsum model: the
      losses, the fp32 masters and the all-to-alls' dtypes.
    """
    assert world_size == 2
    out: dict[str, Any] = {}
    for name, extra, tag in (("device", {}, SAVE_S2), ("offload", offload(root), SAVE_S2_OFFLOAD)):
        engine = make_engine("striped", config(3, 2, ADAMW, extra), 2)
        losses = train(engine, 2, 1, SAVED_STEPS)
        saved = snapshot(engine)
        engine.save_checkpoint(root, tag, client_state={"rank": rank, "batches_consumed": SAVED_STEPS})
        losses += train(engine, 2, SAVED_STEPS + 1, TOTAL_STEPS)
        out[name] = {"saved": saved, "losses": losses, "final": snapshot(engine), "memory": engine.memory(),
                     "decisions": engine.program.plan.decisions}
        engine.close()
    out["data2"] = resume(root, SAVE_S2, "striped", 1, 1)
    for kind in ("striped", "mamba", "convsum"):
        engine = make_engine(kind, config(3, 2, SGD, {"bf16": {"enabled": True}}), 2)
        losses = train(engine, 2, 1, SAVED_STEPS)
        out[f"bf16-{kind}"] = {"losses": losses, "masters": full_masters(engine), "exchanges": exchange_dtypes(engine),
                                "accumulators": accumulator_dtypes(engine)}
        engine.close()
    return out


def world_4(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """World 4, data 2 x sequence 2 in shard groups of 2 (each a sequence group), stage 3, on
    striped-tiny with AdamW: trained from the start for TOTAL_STEPS, and SAVE_S2 (world 2,
    sequence 2) resumed in this layout."""
    assert world_size == 4
    engine = make_engine("striped", config(3, 2, ADAMW, shard_group_size=2), 2)
    losses = train(engine, 2, 1, TOTAL_STEPS)
    out = {"fresh": {"losses": losses, "final": snapshot(engine), "shard_group_size": engine.program.plan.shard_group_size}}
    engine.close()
    out["resumed"] = resume(root, SAVE_S2, "striped", 3, 2, shard_group_size=2)
    return out


def reference(kind: str, opt: dict, steps: int) -> dict[str, Any]:
    """Plain PyTorch in one process on every step's whole global batch, fp32: the losses, and
    the state and optimizer states after step SAVED_STEPS and after the last."""
    net = model(kind)
    params = {n: p for n, p in net.named_parameters() if p.requires_grad}
    optim = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}[opt["type"]](list(params.values()), **opt["params"])
    out: dict[str, Any] = {"losses": [], "initial": {k: v.detach().clone() for k, v in net.state_dict().items()}}
    for step in range(1, steps + 1):
        loss = loss_of(net, global_batch(step))
        optim.zero_grad()
        loss.backward()
        optim.step()
        out["losses"].append(loss.item())
        if step in (SAVED_STEPS, steps):
            out[step] = {"state": {k: v.detach().clone() for k, v in net.state_dict().items()},
                         "optim": {n: {k: v.detach().clone().reshape(-1) if v.dim() else v.clone() for k, v in optim.state[p].items()}
                                   for n, p in params.items()}}
    return out
