"""``zerofx calibrate``: measure this machine's collectives and compute, once, and write a
profile the planner can load (``zerofx plan --profile FILE``).

Each rank times all-gathers at several message sizes and fits the ring model's alpha (per-step
latency) and bus bandwidth by least squares; it times a matrix product for FLOP/s and a large
copy for memory bandwidth. The ranks then agree on the slowest figures (a max-reduce), so
every rank plans from the same numbers: rank-local measurements make ranks plan differently
and hang.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerofx.cost_models.comm import CommSpec
from zerofx.cost_models.compute import DeviceSpec
from zerofx.cost_models.profiles import save_profile
from zerofx.passes import _compat

SIZES = (2**14, 2**16, 2**18, 2**20, 2**22)  # bytes per rank


def _time(fn, repeats: int) -> float:
    fn()  # warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(rank: int, world_size: int, repeats: int = 5) -> list[float]:
    """[alpha_s, bandwidth, matmul_flops_per_s, memory_bytes_per_s] from this rank, already
    max/min-reduced across ranks so every rank returns the same numbers."""
    xs, ys = [], []
    for nbytes in SIZES:
        shard = torch.ones(nbytes // 4)
        out = torch.empty(shard.numel() * world_size)
        dist.barrier()
        t = _time(lambda out=out, shard=shard: _compat.all_gather_flat(out, shard), repeats)
        # Ring: t = (N - 1) * alpha + (N - 1) * nbytes / bw  ->  linear in nbytes.
        xs.append((world_size - 1) * nbytes)
        ys.append(t)
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    alpha = max(intercept / max(world_size - 1, 1), 1e-6)
    bandwidth = 1.0 / max(slope, 1e-12)
    a = torch.randn(512, 512)
    flops = 2 * 512**3 / _time(lambda: a @ a, repeats)
    big = torch.empty(2**24)
    mem = 2 * big.numel() * 4 / _time(lambda: big.clone(), repeats)
    # Slowest link, slowest compute: agree on the pessimistic figures.
    worst = torch.tensor([alpha, -bandwidth, -flops, -mem], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return [worst[0].item(), -worst[1].item(), -worst[2].item(), -worst[3].item()]


def _worker(rank: int, world_size: int, port: int, out: str, repeats: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    alpha, bandwidth, flops, mem = measure(rank, world_size, repeats)
    if rank == 0:
        comm = CommSpec("calibrated-gloo", alpha, bandwidth, alpha, bandwidth, ranks_per_node=64)
        save_profile(Path(out), comm, DeviceSpec("calibrated-cpu-core", flops, mem))
    dist.destroy_process_group()


def calibrate(out: Path, world_size: int = 2, repeats: int = 5) -> tuple[CommSpec, DeviceSpec]:
    """Measure with ``world_size`` local gloo ranks and write the profile to ``out``."""
    import socket

    from zerofx.cost_models.profiles import load_profile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world_size, port, str(out), repeats), nprocs=world_size, start_method="spawn")
    return load_profile(str(out))
