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


def reduced_grads_kept(rank: int, world_size: int, stages: list[int]) -> dict[int, dict]:
    """Per stage, two SGD steps on the tiny DNA LM, recording the gradients the backward graph
    returns (NOTE [Reduced gradients become the buffers] in zerofx/runtime/engine_storage.py):
    whether the engine's buffers and the optimizer's ``.grad`` are those outputs, whether the
    second step left the first step's buffers as they were (nothing zeroed them), and what
    ``accumulate_grads`` keeps when outputs share memory with each other or with a shard."""
    data = batches(world_size, 2, VOCAB["dna"])
    out = {}
    for stage in stages:
        config = {"zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine = zerofx.initialize(BUILDERS["dna"](frozen=False), config, example_inputs=(data[0, rank],),
                                   example_kwargs={"labels": data[0, rank]})
        fqns = [info.fqn for info in engine.program.captured.params]
        returned: list[list[torch.Tensor | None]] = []
        run = engine._run

        def recording(program, name, args_list, run=run, returned=returned):  # white-box: the graph's own outputs
            result = run(program, name, args_list)
            if name == "backward":
                returned.append(list(result))
            return result

        engine._run = recording
        kept, first = [], None
        for step in range(2):
            ids = data[step, rank]
            engine.backward(engine(ids, labels=ids))
            kept.append(all(engine.storage.grads[f] is g for f, g in zip(fqns, returned[-1]) if g is not None))
            engine.step()
            if step == 0:
                first = {f: (g, g.clone()) for f, g in engine.storage.grads.items()}
        assert first is not None
        storage = engine.storage
        grad_of = {id(t): t.grad for t in engine.optimizer.param_groups[0]["params"]}
        linked = all(grad_of[id(storage.optimizer_params[f])].data_ptr() == storage._grad_shard(f).data_ptr()
                     for f in storage.optimizer_params)
        # Once the step has ended: one tensor returned for two parameters of one size, and a
        # parameter's own shard returned as a gradient.
        by_numel: dict[int, list[str]] = {}
        for f in fqns:
            by_numel.setdefault(storage.grads[f].numel(), []).append(f)
        a, b = next(fs for fs in by_numel.values() if len(fs) > 1)[:2]
        shared = torch.ones_like(storage.grads[a])
        sharded = next((f for f in fqns if f in storage.shards and storage.shards[f].numel() == storage.grads[f].numel()), None)
        outputs = [shared if f in (a, b) else None for f in fqns]
        if sharded is not None and sharded not in (a, b):
            outputs[fqns.index(sharded)] = storage.shards[sharded]
        storage.accumulate_grads(fqns, outputs)
        out[stage] = {
            "kept": kept,
            "linked": linked,
            "first_untouched": all(torch.equal(g, copy) for g, copy in first.values()),
            "shared_apart": storage.grads[a].data_ptr() != storage.grads[b].data_ptr() and bool((storage.grads[b] == 1).all()),
            "shard_copied": sharded is None or (storage.grads[sharded].data_ptr() != storage.shards[sharded].data_ptr()
                                                and torch.equal(storage.grads[sharded], storage.shards[sharded])),
            "zeros_elsewhere": all(not storage.grads[f].any() for f in fqns if f not in (a, b, sharded) and f in storage.grads),
            "memory_grads": engine.memory()["grads"],
            "owned_grad_bytes": sum((p.padded_numel if stage <= 1 else p.shard_numel) * 4
                                    for p in storage.placements.values() if p.requires_grad),
        }
    return out
