"""Rank functions for tests/test_monitors.py: training with DeepSpeed's monitors on."""

from __future__ import annotations

import zerofx
from tests.support.models import batches, dna_lm
from tests.support.workers import train_steps


def train_with_csv_monitor(rank: int, world_size: int, out: str, steps: int) -> dict:
    """Stage 3 with clipping: the monitor takes the norm the clipping computed. Each rank names its
    own output folder (``output_path`` may differ between ranks), so the test sees which ranks wrote."""
    config = {
        "zero_optimization": {"stage": 3},
        "gradient_clipping": 1.0,
        "csv_monitor": {"enabled": True, "output_path": f"{out}/rank{rank}", "job_name": "job"},
    }
    data = batches(world_size, steps)
    engine = zerofx.initialize(dna_lm(), config, example_inputs=(data[0, rank],), example_kwargs={"labels": data[0, rank]})
    losses = train_steps(engine, data, rank, steps)
    engine.close()
    return {"losses": losses, "has_monitor": engine.monitor is not None}
