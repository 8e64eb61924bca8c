"""Rank functions for tests/test_quickstart.py: inputs on the wrong device, and stepping past the scheduler."""

from __future__ import annotations

import warnings

import zerofx
from tests.support.models import batches, dna_lm
from zerofx.runtime.engine import ScheduleEndWarning

# Warm-up for 1 step, cosine decay to cos_min_ratio at step 2: steps 3 and 4 run past it.
SCHEDULED = {
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 1, "total_num_steps": 2, "cos_min_ratio": 0.1}},
    "zerofx": {"plan_cache": False},  # the test reads a cold build's setup phases
}


def _error(call: object) -> tuple[str, str] | None:
    """The type and message of what ``call()`` raises (None when it returns)."""
    try:
        call()  # type: ignore[operator]
    except zerofx.ZeroFXError as exc:
        return type(exc).__name__, str(exc)
    return None


def misplaced_inputs_and_schedule_end(rank: int, world_size: int) -> dict:
    data = batches(world_size, 4)
    ids = data[0, rank]
    engine = zerofx.initialize(dna_lm(frozen=False), SCHEDULED, example_inputs=(ids,), example_kwargs={"labels": ids})
    meta = ids.to("meta")
    out = {
        "setup_times": engine.setup_times,
        # Every rank passes the same misplaced input: each names it.
        "positional": _error(lambda: engine(meta, labels=ids)),
        "keyword": _error(lambda: engine(ids, labels=meta)),
        # Only rank 1 does: every rank fails together instead of waiting in a collective.
        "one_rank": _error(lambda: engine(meta if rank == 1 else ids, labels=ids)),
    }
    # Nothing ran: the engine trains on, and warns once when it steps past total_num_steps.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, lrs = [], []
        for step in range(4):
            ids = data[step, rank]
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            lrs.append(engine.optimizer.param_groups[0]["lr"])
    out["losses"], out["lrs"] = losses, lrs
    out["schedule_warnings"] = [(str(w.message), w.filename) for w in caught if issubclass(w.category, ScheduleEndWarning)]
    return out
