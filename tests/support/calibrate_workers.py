"""Rank functions for tests/test_comm_model.py: ``zerofx calibrate``'s across-nodes path on one
machine, the ranks split into "nodes" by ``LOCAL_WORLD_SIZE`` as torchrun sets it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def calibrate_two_nodes(rank: int, world_size: int, out: str, ranks_per_node: int) -> dict[str, Any]:
    """Run ``calibrate_across_nodes`` with ``ranks_per_node`` ranks per pretend node; return the
    spec rank 0 wrote (None elsewhere) and the profile file's measurements as rank 0 saw them."""
    import json

    from zerofx.app.calibrate import calibrate_across_nodes

    os.environ.update(LOCAL_WORLD_SIZE=str(ranks_per_node), LOCAL_RANK=str(rank % ranks_per_node))
    result = calibrate_across_nodes(Path(out), repeats=1, sizes=(2**12, 2**16))
    data = json.loads(Path(out).read_text()) if rank == 0 else None
    return {"spec": None if result is None else result[0], "file": data}


def windows_in_turns(rank: int, world_size: int, cores: int) -> dict[str, Any]:
    """``in_turns`` with a measurement that records when it ran (wall clock) and returns the rank:
    the window of this rank, and the combined result every rank gets."""
    import time

    from zerofx.app.calibrate import in_turns

    window: list[float] = []

    def local() -> list[float]:
        window.append(time.time())
        time.sleep(0.05)
        window.append(time.time())
        return [float(rank), -float(rank)]

    return {"window": window, "combined": in_turns(local, cores)}


def reduce_scatter_as_calibrated(rank: int, world_size: int) -> dict[str, Any]:
    """The c10d ops ``zerofx calibrate``'s reduce-scatter issues on gloo, and the shard it leaves
    when every rank's input is its rank + 1 (NOTE [gloo's reduce-scatter as an all-to-all])."""
    import torch
    import torch.distributed as dist
    from torch.profiler import profile

    from zerofx.app.calibrate import _collective

    run = _collective("reduce_scatter", 2**12, None, torch.device("cpu"), value=rank + 1)
    with profile() as prof:
        shard = run()
    return {"ops": sorted({e.name for e in prof.events() if e.name.startswith("c10d::")}), "shard": shard.unique().tolist(),
            "numel": shard.numel(), "backend": str(dist.get_backend())}
