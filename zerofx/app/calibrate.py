"""``zerofx calibrate``: measure this machine's collectives and compute, once, and write a
profile the planner can load (``zerofx plan --profile FILE``).

Each rank times all-gather, reduce-scatter, all-reduce and all-to-all at several message sizes
(the fastest of a few repeats);
the ranks agree on the slowest time of each (a max-reduce), so every rank plans from the same
numbers: rank-local measurements make ranks plan differently and hang. The ring model's alpha
(per-step latency) and bus bandwidth are fitted to all of them (NOTE [Fitting the comm model to a
calibration] in cost_models/comm.py). A matrix product gives FLOP/s and a large copy memory
bandwidth, each rank timing its own while every rank runs: one core's rates with every core busy.
The profile also records the cores the ranks share (NOTE [Ranks sharing cores] in
cost_models/compute.py) and the resident memory of an idle rank once it has imported the engine
and joined the process group, the largest over ranks (NOTE [What a rank's resident memory holds]
in cost_models/memory.py).

Run on one machine, it spawns local gloo ranks. Run under torchrun across nodes
(``LOCAL_WORLD_SIZE < WORLD_SIZE``), it measures the two links apart: the ranks of each node among
themselves (intra-node), and one rank per node with the same local rank (inter-node), and fits
each link on its own measurements.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerofx.cost_models.comm import CommSpec, fit_link
from zerofx.cost_models.compute import DeviceSpec
from zerofx.cost_models.profiles import save_profile
from zerofx.passes import _compat

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# Total message bytes (the all-gather's output, the reduce-scatter's input, the all-reduce's
# buffer, one rank's all-to-all input): 16 KiB to 8 MiB, latency-bound to bandwidth-bound on gloo.
SIZES = (2**14, 2**16, 2**18, 2**20, 2**21, 2**23)
# One "node" for a calibration on a single machine: loopback has no second link.
LOCAL_RANKS_PER_NODE = 64

Measurement = tuple[str, int, float, float]  # (collective, world size, total bytes, seconds)


def _time(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, after a warm-up: what the call costs on this
    machine, without the stalls other processes on the same cores add to some samples."""
    fn()  # warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)


def _collective(name: str, total_bytes: int, group: Any, device: torch.device) -> Callable[[], None]:
    n = dist.get_world_size(group)
    numel = max(n, total_bytes // 4 // n * n)  # a multiple of the group's size, fp32
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // n, device=device)
    if name == "all_gather":
        return lambda: _compat.all_gather_flat(full, shard, group=group)
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full, group=group)
    if name == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    out = torch.empty_like(full)
    return lambda: dist.all_to_all_single(out, full, group=group)


def measure_collectives(group: Any = None, *, repeats: int = 5, sizes: Sequence[int] = SIZES,
                        device: torch.device | None = None) -> list[Measurement]:
    """Each collective at each size over ``group`` (every rank calls it), as the slowest rank saw it."""
    device = device or torch.device("cpu")
    n = dist.get_world_size(group)
    rows: list[Measurement] = []
    for name in COLLECTIVES:
        for nbytes in sizes:
            fn = _collective(name, nbytes, group, device)
            dist.barrier(group=group)
            rows.append((name, n, float(nbytes), _time(fn, repeats)))
    times = torch.tensor([t for *_, t in rows], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return [(c, w, b, t) for (c, w, b, _), t in zip(rows, times.tolist())]


# Bytes a copy moves (read + written) for the memory curve: from what stays in a core's caches
# to what comes from DRAM (NOTE [Bandwidth by working-set size] in cost_models/compute.py). The
# largest is the profile's ``memory_bytes_per_s``.
COPY_SIZES = (2**19, 2**21, 2**23, 2**25, 2**27)


def measure_memory_curve(repeats: int, device: torch.device | None = None) -> list[tuple[float, float]]:
    """(bytes moved, bytes/s) of a tensor copy (``clone``: a new output, as an op makes) at each
    of ``COPY_SIZES``; each sample copies at least 64 MiB, so small copies are timed in bulk."""
    device = device or torch.device("cpu")
    curve = []
    for moved in COPY_SIZES:
        src = torch.empty(moved // 8, device=device)  # fp32: read once, written once
        copies = max(1, 2**26 // moved)
        curve.append((float(moved), moved * copies / _time(lambda src=src, copies=copies: [src.clone() for _ in range(copies)], repeats)))
    return curve


def measure_compute(repeats: int, device: torch.device | None = None) -> tuple[float, float, list[tuple[float, float]]]:
    """(matmul FLOP/s, memory bytes/s, memory curve) of one rank, the slowest rank's of each."""
    device = device or torch.device("cpu")
    a = torch.randn(512, 512, device=device)
    flops = 2 * 512**3 / _time(lambda: a @ a, repeats)
    curve = measure_memory_curve(repeats, device)
    worst = torch.tensor([-flops] + [-rate for _, rate in curve], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    rates = (-worst).tolist()
    curve = [(size, rate) for (size, _), rate in zip(curve, rates[1:])]
    return rates[0], curve[-1][1], curve


def measure(rank: int, world_size: int, repeats: int = 5) -> list[float]:
    """[alpha_s, bandwidth, matmul_flops_per_s, memory_bytes_per_s], the same on every rank."""
    alpha, bandwidth = fit_link(measure_collectives(repeats=repeats))
    flops, mem, _ = measure_compute(repeats)
    return [alpha, bandwidth, flops, mem]


# The size of the tensor ``measure_fresh_pages`` allocates (NOTE [New tensors' pages]).
FRESH_PROBE_BYTES = 8 * 2**20


def measure_fresh_pages(repeats: int, device: torch.device | None = None) -> tuple[float, float]:
    """(extra seconds per byte of a new tensor's first write, the smallest size that pays it):
    an 8 MiB tensor allocated and filled against the same fill of one kept, the slowest rank's
    (NOTE [New tensors' pages]). On a GPU the caching allocator maps nothing per tensor: (0, 0)."""
    if device is not None and device.type != "cpu":
        return 0.0, 0.0
    numel = FRESH_PROBE_BYTES // 4
    kept = torch.empty(numel)
    extra = max(_time(lambda: torch.empty(numel).fill_(1.0), repeats) - _time(lambda: kept.fill_(1.0), repeats), 0.0) / FRESH_PROBE_BYTES
    worst = torch.tensor([extra], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return worst.item(), float(int(threshold)) if threshold.isdigit() else float(FRESH_PROBE_BYTES)


def runtime_rss_bytes(device: torch.device | None = None) -> float:
    """The resident memory of this rank before it holds any model state: the interpreter, torch,
    the engine's modules (imported here, as ``zerofx.initialize`` imports them) and the process
    group, max-reduced across ranks (NOTE [What a rank's resident memory holds])."""
    import zerofx.compiler.program  # noqa: F401  (what a rank imports to train)
    import zerofx.runtime.engine  # noqa: F401
    from zerofx.common.rss import current_rss_bytes

    worst = torch.tensor([float(current_rss_bytes())], dtype=torch.float64, device=device or torch.device("cpu"))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def host_cores() -> int:
    """The cores this process may run on (its affinity), which local ranks share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _write(out: Path, comm: CommSpec, device: DeviceSpec, measurements: dict[str, list[Measurement]]) -> None:
    save_profile(out, comm, device)
    data = json.loads(out.read_text())
    data["measurements"] = {link: [list(m) for m in rows] for link, rows in measurements.items()}
    out.write_text(json.dumps(data, indent=1))


def _worker(rank: int, world_size: int, port: int, out: str, repeats: int, sizes: Sequence[int]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    runtime = runtime_rss_bytes()  # before any measurement allocates
    rows = measure_collectives(repeats=repeats, sizes=sizes) if world_size > 1 else []
    flops, mem, curve = measure_compute(repeats)
    fresh_s, fresh_min = measure_fresh_pages(repeats)
    if rank == 0:
        alpha, bandwidth = fit_link(rows) if rows else (0.0, float("inf"))
        comm = CommSpec("calibrated-gloo", alpha, bandwidth, alpha, bandwidth, ranks_per_node=LOCAL_RANKS_PER_NODE)
        device = DeviceSpec("calibrated-cpu-core", flops, mem, memory_curve=tuple(curve), cores=host_cores(), runtime_bytes=runtime,
                            fresh_s_per_byte=fresh_s, fresh_min_bytes=fresh_min)
        _write(Path(out), comm, device, {"intra": rows})
    dist.destroy_process_group()


def calibrate(out: Path, world_size: int = 2, repeats: int = 5, sizes: Sequence[int] = SIZES) -> tuple[CommSpec, DeviceSpec]:
    """Measure with ``world_size`` local gloo ranks, each collective at each of ``sizes`` bytes,
    and write the profile to ``out``."""
    import socket

    from zerofx.cost_models.profiles import load_profile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world_size, port, str(out), repeats, tuple(sizes)), nprocs=world_size, start_method="spawn")
    return load_profile(str(out))


def is_multi_node(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether this process runs under a launcher (torchrun) with ranks on more than one node."""
    try:
        return int(env["LOCAL_WORLD_SIZE"]) < int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        return False


def node_groups(world_size: int, ranks_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the ranks of each node, the ranks with each local rank across nodes), launchers' layout:
    rank = node * ranks_per_node + local rank."""
    nodes = world_size // ranks_per_node
    intra = [list(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(nodes)]
    inter = [list(range(local, world_size, ranks_per_node)) for local in range(ranks_per_node)]
    return intra, inter


def calibrate_across_nodes(out: Path, repeats: int = 5, sizes: Sequence[int] = SIZES) -> tuple[CommSpec, DeviceSpec] | None:
    """Under torchrun across nodes (the process group is initialized here from its environment
    unless it is already): the intra- and inter-node links measured and fitted apart. Rank 0 writes
    the profile; every rank returns it (None on ranks other than 0)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if dist.get_backend() == "nccl" else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    assert world % per_node == 0, (world, per_node)
    intra_ranks, inter_ranks = node_groups(world, per_node)
    # Every rank creates every group, in the same order (torch.distributed.new_group's contract).
    intra_groups = [dist.new_group(r) for r in intra_ranks]
    inter_groups = [dist.new_group(r) for r in inter_ranks]
    mine = rank // per_node, rank % per_node
    runtime = runtime_rss_bytes(device)
    intra = measure_collectives(intra_groups[mine[0]], repeats=repeats, sizes=sizes, device=device) if per_node > 1 else []
    inter = measure_collectives(inter_groups[mine[1]], repeats=repeats, sizes=sizes, device=device)
    # Every rank's rows, slowest of each: one fit for all.
    merged = []
    for rows in (intra, inter):
        times = torch.tensor([t for *_, t in rows] or [0.0], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        merged.append([(c, n, b, t) for (c, n, b, _), t in zip(rows, times.tolist())])
    flops, mem, curve = measure_compute(repeats, device)
    fresh_s, fresh_min = measure_fresh_pages(repeats, device)
    intra_alpha, intra_bw = fit_link(merged[0]) if merged[0] else fit_link(merged[1])
    inter_alpha, inter_bw = fit_link(merged[1])
    comm = CommSpec(f"calibrated-{dist.get_backend()}", intra_alpha, intra_bw, inter_alpha, inter_bw, ranks_per_node=per_node)
    # CPU ranks share the node's cores; a GPU rank has its device (NOTE [Ranks sharing cores]).
    spec = DeviceSpec(f"calibrated-{device.type}", flops, mem, memory_curve=tuple(curve), cores=host_cores() if device.type == "cpu" else None,
                      runtime_bytes=runtime, fresh_s_per_byte=fresh_s, fresh_min_bytes=fresh_min)
    if rank == 0:
        _write(Path(out), comm, spec, {"intra": merged[0], "inter": merged[1]})
    return (comm, spec) if rank == 0 else None


def recorded(path: Path) -> dict[str, Any]:
    """A calibration record (``benchmarks/calibrate_comm.py``): its measurements as tuples."""
    data = json.loads(Path(path).read_text())
    data["measurements"] = [tuple(m) for m in data["measurements"]]
    return data


def record_json(measurements: list[Measurement], fit: CommSpec, *, machine: str, date: str, repeats: int) -> str:
    return json.dumps({"date": date, "machine": machine, "repeats": repeats, "fit": asdict(fit),
                       "measurements": [list(m) for m in measurements]}, indent=1)
