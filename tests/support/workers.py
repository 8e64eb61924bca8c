"""Functions each spawned rank runs in the multi-process tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerofx
from tests.support.models import BUILDERS, VOCAB, batches, loss_of, make_optimizer


def train_steps(engine: zerofx.Engine, data: torch.Tensor, rank: int, steps: int) -> list[float]:
    """``steps`` optimizer steps on ``data[step, rank]`` (next-token labels: the ids); the losses."""
    losses = []
    for step in range(steps):
        ids = data[step, rank]
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_zerofx(rank: int, world_size: int, kind: str, stages: list[int], steps: int, opt: dict, zero: dict | None = None,
                 own: dict | None = None) -> dict:
    """Train ``kind`` with zerofx at each of ``stages`` (extra ``zero_optimization`` keys from
    ``zero``, ``zerofx`` keys from ``own``); return per stage the full state dict, the memory the
    engine really holds, what the program predicted, and how its graphs reduce gradients."""
    from zerofx.passes import meta
    data = batches(world_size, steps, VOCAB[kind])
    out = {}
    for stage in stages:
        model = BUILDERS[kind]()
        example = data[0, rank]
        engine = zerofx.initialize(
            model, {"zero_optimization": {"stage": stage, **(zero or {})}, "optimizer": opt, "zerofx": own or {}},
            example_inputs=(example,), example_kwargs={"labels": example},
        )
        losses = train_steps(engine, data, rank, steps)
        out[stage] = {
            "state": engine.full_state_dict(),
            "memory": engine.memory(),
            "planned": engine.program.memory(rank),
            "num_params": sum(p.numel for p in engine.placements.values() if p.requires_grad),
            "num_tensors": sum(1 for p in engine.placements.values() if p.requires_grad),
            "losses": losses,
            "num_buckets": (len(engine.program.plan.gather_buckets), len(engine.program.plan.reduce_buckets)),
            # (functional reduce-scatters, reduce-scatters issued as all-to-alls) over the rank's graphs
            "reductions": tuple(sum(1 for gm in engine.graph_modules().values() for n in gm.graph.nodes if is_kind(n)) for is_kind in
                                (lambda n: meta.is_reduce_scatter(n) and not meta.is_reduce_scatter_by_all_to_all(n),
                                 meta.is_reduce_scatter_by_all_to_all)),
        }
    return out


def train_ddp(rank: int, world_size: int, kind: str, steps: int, opt: dict) -> dict[str, torch.Tensor]:
    """The same run under torch DDP, for the AdamW drift baseline."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = BUILDERS[kind]()
    ddp = DDP(model)
    optim = make_optimizer(opt, [p for p in ddp.parameters() if p.requires_grad])
    data = batches(world_size, steps, VOCAB[kind])
    for step in range(steps):
        optim.zero_grad()
        loss_of(ddp, data[step, rank]).backward()
        optim.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def zerofx_and_ddp(rank: int, world_size: int, kind: str, stages: list[int], steps: int, opt: dict) -> dict:
    return {"zerofx": train_zerofx(rank, world_size, kind, stages, steps, opt), "ddp": train_ddp(rank, world_size, kind, steps, opt)}


def wrong_world_size(rank: int, world_size: int) -> str:
    model = BUILDERS["dna"]()
    ids = batches(world_size, 1)[0, rank]
    try:
        zerofx.initialize(model, {"zero_optimization": {"stage": 3}}, world_size=world_size + 1, example_inputs=(ids,))
    except zerofx.ZeroFXError as exc:
        return str(exc)
    return "no error"


def backward_without_forward(rank: int, world_size: int) -> str:
    model = BUILDERS["dna"]()
    ids = batches(world_size, 1)[0, rank]
    engine = zerofx.initialize(model, {"zero_optimization": {"stage": 2}}, example_inputs=(ids,), example_kwargs={"labels": ids})
    try:
        engine.backward(torch.tensor(1.0))
    except zerofx.ZeroFXError as exc:
        dist.barrier()
        return str(exc)
    return "no error"


def diverging_plans(rank: int, world_size: int) -> str:
    """Rank 1 plans with other bucket sizes than rank 0: a mismatch that would hang."""
    model = BUILDERS["dna"]()
    ids = batches(world_size, 1)[0, rank]
    zero = {"stage": 3, "stage3_prefetch_bucket_size": 3000 if rank == 0 else 1000}
    try:
        zerofx.initialize(model, {"zero_optimization": zero}, example_inputs=(ids,), example_kwargs={"labels": ids})
    except zerofx.RankDivergenceError as exc:
        return str(exc)
    return "no error"
