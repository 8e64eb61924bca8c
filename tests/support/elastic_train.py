"""A training script for torchrun (torchelastic), run by tests/test_checkpoint.py.

    python -m torch.distributed.run --nnodes=1:2 --nproc-per-node=1 --max-restarts=1 \\
        --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT tests/support/elastic_train.py OUT --steps 6

Each worker resumes from the newest complete checkpoint in OUT/ckpt, whatever world size saved
it, trains the tests' "dna" model with SGD at ZeRO stage 3 on data that depends only on
(step, world size), and saves after every step. It appends one JSON line per event to
OUT/log.jsonl; rank 0 writes the final full state dict to OUT/final.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

import torch
import torch.distributed as dist

from tests.support.checkpoint_workers import SGD, make_engine, train
from zerofx.runtime.checkpoint import latest_complete_tag


def log(out: Path, **event: Any) -> None:
    event.update(time=time.time(), pid=os.getpid(), agent_pid=os.getppid(),
                 restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    with open(out / "log.jsonl", "a") as f:  # one short append per line: lines do not interleave
        f.write(json.dumps(event) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait after each step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ckpt = args.out / "ckpt"
    engine = make_engine("dna", 3, SGD)
    start = 0
    if latest_complete_tag(ckpt) is not None:
        engine.load_checkpoint(ckpt)
        start = engine.global_steps
    log(args.out, event="start", rank=rank, world_size=world_size, resumed_from=start)
    for step in range(start + 1, args.steps + 1):
        train(engine, "dna", step, step)
        engine.save_checkpoint(ckpt, client_state={"step": step})
        log(args.out, event="step", rank=rank, world_size=world_size, step=step)
        time.sleep(args.step_sleep)
    state = engine.full_state_dict()
    if rank == 0:
        torch.save(state, args.out / "final.pt")
        log(args.out, event="done", rank=rank, world_size=world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
