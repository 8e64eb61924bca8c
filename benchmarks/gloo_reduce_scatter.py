"""gloo's own reduce-scatter against the all-to-all and sum zerofx's graphs issue on gloo (NOTE
[gloo's reduce-scatter as an all-to-all] in passes/zero/reduce_scatter_all_to_all.py), without zerofx.

    python benchmarks/gloo_reduce_scatter.py [--world-size 2] [--sizes 12e6,100e6] [--calls 10] [--trials 3]

For each message size (bytes of fp32 input per rank), W gloo ranks alternate trials of the two
forms, ``--calls`` back-to-back calls per trial on reused buffers, and check the result (each
rank's input is rank + 1 everywhere, so every reduced element is W(W+1)/2). Rank 0 prints, per
form, each trial's wall time and its process CPU time per call (main and gloo threads), and,
measured first on fresh memory, the peak resident growth of one call on a 64 MiB input: its
output shard, the all-to-all's receive buffer, and whatever the backend holds beside them. Run
it with ``MALLOC_MMAP_THRESHOLD_=262144`` for growth figures that freed buffers do not hide.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FORMS = ("reduce_scatter", "all_to_all_sum")


def _reduce(form: str, full: torch.Tensor, shard: torch.Tensor, received: torch.Tensor, world_size: int) -> None:
    if form == "reduce_scatter":
        dist.reduce_scatter_tensor(shard, full)
    else:
        dist.all_to_all_single(received, full)
        torch.sum(received.view(world_size, -1), dim=0, out=shard)


def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rank(rank: int, world_size: int, port: int, sizes: list[int], calls: int, trials: int, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    growth = {}
    for form in FORMS:  # first, on fresh memory: one call's resident growth beyond its input
        numel = 16 * 2**20 // world_size * world_size
        full = torch.full((numel,), float(rank + 1))
        dist.barrier()
        _reset_peak()
        before = _peak_kib()
        shard = torch.empty(numel // world_size)
        received = torch.empty(numel) if form == "all_to_all_sum" else shard
        _reduce(form, full, shard, received, world_size)
        growth[form] = (_peak_kib() - before) / 1024
        del full, shard, received
    expected = world_size * (world_size + 1) / 2
    rows = []
    for nbytes in sizes:
        numel = nbytes // 4 // world_size * world_size
        full = torch.full((numel,), float(rank + 1))
        shard, received = torch.empty(numel // world_size), torch.empty(numel)
        for trial in range(trials):
            for form in FORMS:
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    _reduce(form, full, shard, received, world_size)
                rows.append((nbytes, form, trial, (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls))
                if not bool((shard == expected).all()):
                    raise AssertionError(f"{form} reduced to {shard[:4].tolist()}, expected {expected}")
    if rank == 0:
        queue.put((rows, growth))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--sizes", default="12e6,100e6", help="input bytes per rank, comma-separated (default 12e6,100e6)")
    p.add_argument("--calls", type=int, default=10, help="back-to-back calls per trial (default 10)")
    p.add_argument("--trials", type=int, default=3, help="trials of each form, alternating (default 3)")
    args = p.parse_args(argv)
    try:
        sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes {args.sizes!r}: accepted: comma-separated byte counts such as 12e6,100e6")
    if args.world_size < 2 or args.calls < 1 or args.trials < 1 or not sizes or min(sizes) < 4 * args.world_size:
        p.error("--world-size >= 2, --calls >= 1, --trials >= 1, and each size at least 4 bytes per rank")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, sizes, args.calls, args.trials, queue)) for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    rows, growth = queue.get(timeout=3600)
    for proc in procs:
        proc.join(timeout=60)
    print(f"{args.world_size} gloo ranks, torch {torch.__version__}, {os.cpu_count()} CPUs; per call, trials in order")
    for nbytes in sizes:
        for form in FORMS:
            mine = [r for r in rows if r[0] == nbytes and r[1] == form]
            print(f"{nbytes / 1e6:g} MB {form:15s} wall ms {[round(r[3] * 1e3, 2) for r in mine]}  process CPU ms {[round(r[4] * 1e3, 2) for r in mine]}")
    for form, mib in growth.items():
        print(f"64 MiB {form:15s} peak RSS +{mib:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
