"""What each spawned rank runs in the recompute tests: two Adam steps with and without
activation recompute, on the bundled DNA LM and on Hugging Face Llama."""

from __future__ import annotations

import zerofx
from tests.support import sp_compose_workers as sp
from tests.support.models import BUILDERS, VOCAB, batches
from tests.support.workers import train_steps

OPT = {"type": "Adam", "params": {"lr": 1e-2}}


def with_and_without(rank: int, world_size: int, kind: str, stage: int, variants: dict[str, dict]) -> dict:
    """Per variant (its ``zerofx`` section): the losses, the full state after two steps, and what
    the plan recomputed."""
    data = batches(world_size, 2, VOCAB[kind])
    out = {}
    for name, own in variants.items():
        model = BUILDERS[kind]()
        example = data[0, rank]
        engine = zerofx.initialize(model, {"zero_optimization": {"stage": stage}, "optimizer": OPT, "zerofx": own},
                                   example_inputs=(example,), example_kwargs={"labels": example})
        losses = train_steps(engine, data, rank, 2)
        plan = engine.program.plan
        out[name] = {
            "losses": losses,
            "state": engine.full_state_dict(),
            "recomputed": [] if plan.recompute is None else [a.name for a in plan.recompute.activations],
            "decisions": list(plan.decisions),
            "peak": engine.program.report(0).peak.live_bytes,
        }
    return out


def striped_sequence_parallel(rank: int, world_size: int, variants: dict[str, dict]) -> dict:
    """StripedHyena at sequence-parallel size ``world_size``, stage 3: per variant the losses, the
    full state after two AdamW steps and what was recomputed (its all-to-alls and halo exchanges
    stay as they are)."""
    out = {}
    for name, own in variants.items():
        net = sp.model("striped")
        ids = sp.group_rows(1, rank, world_size, world_size)
        cfg = {"zero_optimization": {"stage": 3}, "optimizer": sp.ADAMW,
               "zerofx": {"sequence_parallel": {"size": world_size}, **own}}
        engine = zerofx.initialize(net, cfg, example_inputs=(ids,), example_kwargs={"labels": ids})
        losses = []
        for step in (1, 2):
            batch = sp.group_rows(step, rank, world_size, world_size)
            loss = engine(batch, labels=batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        plan = engine.program.plan
        out[name] = {"losses": losses, "state": engine.full_state_dict(),
                     "recomputed": [] if plan.recompute is None else [a.name for a in plan.recompute.activations]}
    return out
