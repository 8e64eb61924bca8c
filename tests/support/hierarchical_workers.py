"""Workers for tests/test_hierarchical.py: shard groups (``zerofx.shard_group_size``) in real
gloo process groups, every stage in one spawn."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerofx
from tests.support.models import BUILDERS, VOCAB, loss_of, make_optimizer
from zerofx.passes import meta


def micro_batches(world_size: int, num_micro: int, vocab: int, seed: int = 1) -> torch.Tensor:
    """(num_micro, world_size, 2, 16) token ids; rank r trains micro-step i on [i, r]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num_micro, world_size, 2, 16), generator=g)


def reference(world_size: int, steps: int, accumulation: int, opt: dict) -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch: each step averages the losses of its ``accumulation``
    micro-batches on every rank, then steps the optimizer."""
    model = BUILDERS["dna"]()
    optim = make_optimizer(opt, [p for p in model.parameters() if p.requires_grad])
    data = micro_batches(world_size, steps * accumulation, VOCAB["dna"])
    for step in range(steps):
        optim.zero_grad()
        micro = range(step * accumulation, (step + 1) * accumulation)
        loss = sum(loss_of(model, data[i, r]) for i in micro for r in range(world_size)) / (world_size * accumulation)
        loss.backward()
        optim.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def collective_groups(engine: zerofx.Engine) -> list[tuple[str, str, str, int]]:
    """(graph, collective, group name, bytes this rank sends in) of every collective the engine's
    graphs issue in one step."""
    out = []
    for name, gm in engine.graph_modules().items():
        for n in gm.graph.nodes:
            if meta.is_collective(n):
                inp = n.args[0].meta["val"]
                out.append((name, meta.collective_name(n), str(n.args[-1]), inp.numel() * inp.element_size()))
    return out


def _engine(rank: int, data: torch.Tensor, stage: int, opt: dict, zero: dict, accumulation: int,
            shard_group_size: int | str | None) -> zerofx.Engine:
    example = data[0, rank]
    config = {"zero_optimization": {"stage": stage, **zero}, "optimizer": opt, "gradient_accumulation_steps": accumulation}
    if shard_group_size is not None:
        config["zerofx"] = {"shard_group_size": shard_group_size}
    return zerofx.initialize(BUILDERS["dna"](), config, example_inputs=(example,), example_kwargs={"labels": example})


def train_grouped(rank: int, world_size: int, runs: list[tuple[int, int]], shard_group_size: int, steps: int, opt: dict,
                  zero: dict, checkpoint_dir: str) -> dict:
    """Train the DNA LM at each (stage, gradient accumulation steps) of ``runs`` with shard groups
    of ``shard_group_size``; per run the full state dict, the engine's memory and the plan's, the
    collectives with their groups, and which ranks share this rank's shard group. The last run
    is saved to ``checkpoint_dir`` and loaded back at a flat layout and at the same one: under
    ``"loaded"``, each layout's full state dict; under ``"auto"``, the K an ``"auto"`` engine
    laid its storage out for, its plan's K and the decision line."""
    out: dict = {}
    for stage, accumulation in runs:
        data = micro_batches(world_size, steps * accumulation, VOCAB["dna"])
        engine = _engine(rank, data, stage, opt, zero, accumulation, shard_group_size)
        for i in range(steps * accumulation):
            ids = data[i, rank]
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
        out[(stage, accumulation)] = {
            "state": engine.full_state_dict(),
            "memory": engine.memory(),
            "planned": engine.program.memory(rank),
            "plan": engine.program.plan.to_json(),
            "collectives": collective_groups(engine),
            "shard_ranks": dist.get_process_group_ranks(engine.shard_group),
            "replicate_ranks": dist.get_process_group_ranks(engine.replicate_group) if engine.replicate_group is not None else None,
        }
    engine.save_checkpoint(checkpoint_dir, tag="grouped")
    out["loaded"] = {}
    for layout in (None, shard_group_size):  # flat, then the layout it was saved at
        resumed = _engine(rank, data, stage, opt, zero, 1, layout)
        resumed.load_checkpoint(checkpoint_dir, tag="grouped")
        out["loaded"][layout] = resumed.full_state_dict()
    # "auto": the planner chooses K from the captured example step, before the storage is laid out.
    chosen = _engine(rank, data, stage, opt, zero, 1, "auto")
    out["auto"] = (chosen.shard_group_size, chosen.program.plan.shard_group_size, chosen.shard_group_decision)
    return out
