"""What each spawned rank runs in the recompute tests: two Adam steps with and without
activation recompute, on the bundled DNA LM and on Hugging Face Llama."""

from __future__ import annotations

import zerofx
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
