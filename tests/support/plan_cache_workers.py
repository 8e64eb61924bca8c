"""What each rank runs in tests/test_plan_cache.py: the same training built from the model, then
loaded from the plan cache."""

from __future__ import annotations

from typing import Any

import torch

import zerofx
from tests.support.models import batches, dna_lm


def lowered_tiny_lm(config: dict[str, Any]) -> zerofx.Program:
    """The tiny DNA LM compiled for 2 ranks at stage 3 and lowered for rank 0: a program to store."""
    ids = batches(2, 1)[0, 0]
    compiled = zerofx.compile(dna_lm(), world_size=2, stage=3, config=config, example_inputs=(ids,), example_kwargs={"labels": ids})
    compiled.graph_modules(0)
    return compiled


def _train(rank: int, world_size: int, config: dict[str, Any], steps: int) -> dict[str, Any]:
    """``steps`` steps of the tiny DNA LM on ``data[step, rank]``: each step's loss and gradient
    shards, the final full state, and how the program was set up."""
    data = batches(world_size, steps)
    engine = zerofx.initialize(dna_lm(), config, example_inputs=(data[0, rank],), example_kwargs={"labels": data[0, rank]})
    losses, grads = [], []
    for step in range(steps):
        ids = data[step, rank]
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        grads.append({fqn: g.clone() for fqn, g in engine.storage.grads.items()})
        engine.step()
        losses.append(loss.detach().clone())
    return {"phases": sorted(engine.setup_times), "losses": losses, "grads": grads, "state": engine.full_state_dict(),
            "entry": str(engine.program.cache_entry)}


def cold_and_cached(rank: int, world_size: int, cache_dir: str, stages: list[int], steps: int, opt: dict) -> dict:
    """Per stage: a cold run that writes the cache, then the same run again (a hit)."""
    out: dict[Any, Any] = {}
    for stage in stages:
        config = {"zero_optimization": {"stage": stage}, "optimizer": opt, "zerofx": {"plan_cache": cache_dir}}
        out[stage] = {"cold": _train(rank, world_size, config, steps), "cached": _train(rank, world_size, config, steps)}
    return out


class _BranchOnValue(torch.nn.Module):
    """A model capture refuses: Python branches on a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y.sum() if bool(y.sum() > 0) else -y.sum()


def _broken_loss(output: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the loss function is broken")


def build_fails(rank: int, world_size: int) -> dict[str, str]:
    """Each rank's error, as ``"Class: message"``, when the program cannot be built: capture
    refuses the model (a zerofx error), or the loss function raises (any other error)."""
    x = torch.ones(2, 4)
    out = {}
    for case, model, loss_fn in (("capture", _BranchOnValue(), None), ("loss", torch.nn.Linear(4, 4), _broken_loss)):
        try:
            zerofx.initialize(model, {"zero_optimization": {"stage": 3}}, example_inputs=(x,), loss_fn=loss_fn)
        except Exception as exc:
            out[case] = f"{type(exc).__name__}: {exc}"
        else:
            out[case] = "no error"
    return out


def built_in_child(rank: int, world_size: int, threads: int) -> dict[str, Any]:
    """One step of the tiny DNA LM with rank 0 at ``threads`` intra-op threads, the plan cache
    off: the program's setup phases and the loss (NOTE [Rank 0 builds in a child])."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads if rank == 0 else 1)
    try:  # the rank's process may serve other tests next (NOTE [A pool of ranks])
        data = batches(world_size, 1)
        config = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zerofx": {"plan_cache": False}}
        engine = zerofx.initialize(dna_lm(), config, example_inputs=(data[0, rank],), example_kwargs={"labels": data[0, rank]})
        loss = engine(data[0, rank], labels=data[0, rank])
        engine.backward(loss)
        engine.step()
        return {"phases": sorted(engine.program.setup_times), "loss": loss.detach().clone(), "state": engine.full_state_dict(),
                "code": {name: gm.code for name, gm in engine.graph_modules().items()}}
    finally:
        torch.set_num_threads(before)


def fork_with_an_uncollected_group(rank: int, world_size: int) -> bool:
    """A gloo group dropped into a reference cycle, not yet collected, then a child that collects
    garbage: whether the child finishes (NOTE [Work in a forked child])."""
    import gc

    import torch.distributed as dist

    from zerofx.common.fork import start_in_fork

    class Holder:
        pass

    holder = Holder()
    holder.group, holder.me = dist.new_group(list(range(world_size)), backend="gloo"), holder  # a cycle: only gc frees it
    dist.destroy_process_group(holder.group)  # out of torch's registries; the cycle still holds it
    del holder
    got = start_in_fork(lambda: (gc.collect(), b"collected")[1])(60.0)
    dist.barrier()
    return got is not None and got.payload == b"collected"
