"""Rank functions for the mixed-precision and config-feature tests."""

from __future__ import annotations

import sys
import weakref

import torch

import zerofx
from tests.support.models import BUILDERS, VOCAB, batches


def train(rank: int, world_size: int, config: dict, steps: int, micro: int = 1) -> dict:
    """Train the tiny DNA LM ``steps`` optimizer steps of ``micro`` micro-batches each; rank r's
    micro-batch m of step s is ``batches(...)[s * micro + m, r]``."""
    data = batches(world_size, steps * micro, VOCAB["dna"])
    model = BUILDERS["dna"](frozen=False)
    engine = zerofx.initialize(model, config, example_inputs=(data[0, rank],), example_kwargs={"labels": data[0, rank]})
    losses, lrs, scales = [], [], []
    for step in range(steps):
        for m in range(micro):
            ids = data[step * micro + m, rank]
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
        lrs.append(engine.optimizer.param_groups[0]["lr"])
        scales.append(engine.loss_scaler.scale if engine.loss_scaler else None)
    return {
        "state": {k: v.float() for k, v in engine.full_state_dict().items()},
        "losses": losses,
        "lrs": lrs,
        "scales": scales,
        "skipped": engine.skipped_steps,
        "memory": engine.memory(),
        "planned": engine.program.memory(rank),
        "owned": sum(p.shard_numel for p in engine.placements.values() if p.requires_grad),
        "tensors": sum(1 for p in engine.placements.values() if p.requires_grad),
        "dtype": str(next(iter(engine.storage.shards.values())).dtype),
    }


def reference_clipped(world_size: int, steps: int, lr: float, max_norm: float, micro: int = 1) -> dict[str, torch.Tensor]:
    """Single process: mean of every rank's micro-batch losses, clip_grad_norm_, SGD."""
    model = BUILDERS["dna"](frozen=False)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = batches(world_size, steps * micro, VOCAB["dna"])
    for step in range(steps):
        opt.zero_grad()
        losses = [model(data[step * micro + m, r], labels=data[step * micro + m, r]).loss for m in range(micro) for r in range(world_size)]
        (sum(losses) / len(losses)).backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def saved_tensors_freed_in_backward(rank: int, world_size: int, stages: list[int]) -> dict[int, dict]:
    """Per stage, one forward and backward; counts the forward's saved tensors, and of those the
    ones freed at all by the end of the step and the ones freed while the backward graph was
    still running (NOTE [Boxed graphs] in zerofx/compiler/program.py)."""
    data = batches(world_size, 1, VOCAB["dna"])
    ids = data[0, rank]
    out = {}
    for stage in stages:
        config = {"zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine = zerofx.initialize(BUILDERS["dna"](frozen=False), config, example_inputs=(ids,), example_kwargs={"labels": ids})
        loss = engine(ids, labels=ids)
        saved = engine._pending[1]  # white-box: the forward's outputs the backward graph takes
        freed_in_graph: list[bool] = []

        def on_free(into: list[bool] = freed_in_graph) -> None:
            frame = sys._getframe()
            while frame is not None and not frame.f_code.co_filename.startswith("<eval_with_key>"):
                frame = frame.f_back
            into.append(frame is not None)

        count = len(saved)
        for t in saved:
            weakref.finalize(t, on_free)
        del saved, t
        engine.backward(loss)
        engine.step()
        out[stage] = {"saved": count, "freed": len(freed_in_graph), "freed_in_graph": sum(freed_in_graph)}
    return out


def train_run_parses(rank: int, world_size: int, config_path: str) -> dict:
    """``zerofx train``'s path on this rank, counting how often a config is parsed from a dict
    or a file (``zerofx.config._validate`` runs once per such parse): ``check_train_options``
    as the launcher runs it, then one rank's training loop of one step, as a spawned rank runs
    it with the options the launcher checked (NOTE [Options are parsed once])."""
    import zerofx.config as config_module
    from zerofx.app import training

    parses = []
    validate = config_module._validate

    def counting(raw, schema, prefix):
        if prefix == "":  # the top level: one call per parse (the sections recurse with a prefix)
            parses.append(1)
        return validate(raw, schema, prefix)

    config_module._validate = counting
    try:
        opts = training.check_train_options(training.TrainOptions(
            model="tiny", world_size=world_size, steps=1, seq_len=64, config=config_path, eval_batches=1,
            collective_timeout_s=120, schedule_steps=50))
        checked = len(parses)
        training._train_rank(rank, opts)
    finally:
        config_module._validate = validate
    return {"after_check": checked, "after_training": len(parses), "timeout": opts.engine_config.collective_timeout_s,
            "total_num_steps": opts.engine_config.scheduler.total_num_steps}
