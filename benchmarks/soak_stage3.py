"""Soak: many stage-3 steps with overlap on, torch's default thread count and output piped, on 2
gloo ranks; reports each rank's resident memory over the run and exits non-zero on any crash.

    python -m benchmarks.soak_stage3 --steps 20000 2>&1 | cat

This is the shape that once aborted ranks with ``malloc(): unaligned tcache chunk detected``, a
race inside torch's gloo backend that zerofx's graphs now avoid (NOTE [gloo's completion race] in
passes/zero/gather_into_buffers.py). Each rank runs faulthandler, so an abort
prints every thread's Python stack. Every ``--every`` steps rank 0 prints one line: the step, the
loss, and both ranks' VmRSS. At the end it prints the RSS change from the first report to the
last; ``--max-growth-mib`` (default 8) makes a larger growth an error. Too long for CI: a run of
20,000 steps takes about 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    faulthandler.enable()
    import zerofx
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM
    from zerofx.common.rss import current_rss_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DNADecoderLM(DNA_LM_SIZES[args.model])
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, 5, (64, args.batch_size, args.seq_len), generator=g)
    config = {"zero_optimization": {"stage": 3, "overlap_comm": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine = zerofx.initialize(model, config, example_inputs=(data[0],), example_kwargs={"labels": data[0]})
    first_rss: list[int] | None = None
    rss = torch.zeros(world_size, dtype=torch.int64)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids = data[step % len(data)]
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        if step % args.every == 0 or step == args.steps:
            rss.zero_()
            rss[rank] = current_rss_bytes()
            dist.all_reduce(rss)
            first_rss = first_rss or rss.tolist()
            if rank == 0:
                mib = ", ".join(f"rank {r} {v / 2**20:.1f} MiB" for r, v in enumerate(rss.tolist()))
                print(f"step {step}/{args.steps} loss {loss.item():.4f} rss {mib} ({time.perf_counter() - start:.0f} s)", flush=True)
    if rank == 0 and first_rss is not None:
        growth = [(b - a) / 2**20 for a, b in zip(first_rss, rss.tolist())]
        print("rss growth from the first report: " + ", ".join(f"rank {r} {d:+.1f} MiB" for r, d in enumerate(growth)), flush=True)
        if max(growth) > args.max_growth_mib:
            raise SystemExit(f"resident memory grew by {max(growth):.1f} MiB > {args.max_growth_mib} MiB")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="DNA LM size (default: tiny)")
    parser.add_argument("--steps", type=int, default=20000, help="training steps (default: 20000)")
    parser.add_argument("--every", type=int, default=500, help="report every K steps (default: 500)")
    parser.add_argument("--batch-size", type=int, default=2, help="windows per rank (default: 2)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per window (default: 128)")
    parser.add_argument("--max-growth-mib", type=float, default=8.0, help="RSS growth that fails the run (default: 8)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, args), nprocs=2, join=True)
    print("soak finished: no rank crashed", flush=True)


if __name__ == "__main__":
    main()
