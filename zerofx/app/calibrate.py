"""``zerofx calibrate``: measure this machine's collectives and compute, once, and write a
profile the planner can load (``zerofx plan --profile FILE``).

Each rank times all-gather, reduce-scatter, all-reduce and all-to-all at several message sizes
(the median of a few repeats: NOTE [A collective's typical time]);
the ranks agree on the slowest time of each (a max-reduce), so every rank plans from the same
numbers: rank-local measurements make ranks plan differently and hang. The ring model's alpha
(per-step latency) and bus bandwidth are fitted to all of them (NOTE [Fitting the comm model to a
calibration] in cost_models/comm.py). A matrix product gives FLOP/s and a large copy memory
bandwidth (the fastest of a few repeats), each rank timing its own with every core busy but at
most one rank per core (NOTE [One core's rates with more ranks than cores]): one core's rates.
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

import contextlib
import dataclasses
import json
import os
import sys
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerofx.common.rank_processes import rank_start
from zerofx.cost_models.comm import CommSpec, fit_collective_scale, fit_link
from zerofx.cost_models.compute import DeviceSpec
from zerofx.cost_models.profiles import FRESH_PROBE_BYTES, save_profile
from zerofx.passes import _compat

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# Total message bytes (the all-gather's output, the reduce-scatter's input, the all-reduce's
# buffer, one rank's all-to-all input): 16 KiB to 8 MiB, latency-bound to bandwidth-bound on gloo.
SIZES = (2**14, 2**16, 2**18, 2**20, 2**21, 2**23)
# One "node" for a calibration on a single machine: loopback has no second link.
LOCAL_RANKS_PER_NODE = 64

Measurement = tuple[str, int, float, float]  # (collective, world size, total bytes, seconds)


def _time(fn: Callable[[], Any], repeats: int, *, typical: bool = False) -> float:
    """The fastest of ``repeats`` timed calls, after a warm-up: what a kernel costs on this
    machine, without the stalls other processes on the same cores add to some samples; with
    ``typical``, their median (NOTE [A collective's typical time])."""
    fn()  # warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) if typical else min(samples)


def _collective(name: str, total_bytes: int, group: Any, device: torch.device, *, value: float = 1.0) -> Callable[[], Any]:
    """One call of collective ``name`` over ``group`` on a message of ``total_bytes``, filled with
    ``value``, as zerofx's graphs issue it on that group's backend."""
    n = dist.get_world_size(group)
    numel = max(n, total_bytes // 4 // n * n)  # a multiple of the group's size, fp32
    full = torch.full((numel,), value, device=device)
    shard = torch.ones(numel // n, device=device)
    if name == "all_gather":
        return lambda: _compat.all_gather_flat(full, shard, group=group)
    if name == "reduce_scatter":
        if dist.get_backend(group) == "gloo":  # as the graphs issue it there (NOTE [gloo's reduce-scatter as an all-to-all])
            received = torch.empty_like(full)

            def by_all_to_all() -> torch.Tensor:
                dist.all_to_all_single(received, full, group=group)
                return torch.sum(received.view(n, -1), dim=0, out=shard)

            return by_all_to_all
        return lambda: (dist.reduce_scatter_tensor(shard, full, group=group), shard)[1]
    if name == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    out = torch.empty_like(full)
    return lambda: dist.all_to_all_single(out, full, group=group)


# NOTE [A collective's typical time]
# A kernel on a rank's own core is timed by its fastest repeat: the slower ones are other
# processes' stalls, which the kernels of a step on a core of its own do not meet. A collective is
# not the rank's own: each ring step waits for a peer's process to be scheduled and its gloo
# thread to run, and a training step meets that on every call. On this project's 2-core machine a
# small all-reduce between 2 ranks takes 0.12-0.2 ms at its fastest and 1.0 ms on average, and the
# model fitted to the fastest repeats predicted stage-3 steps, which wait on a collective per
# bucket, 10-20% short. So collectives are timed by the median of their repeats.
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
            rows.append((name, n, float(nbytes), _time(fn, repeats, typical=True)))
    times = torch.tensor([t for *_, t in rows], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return [(c, w, b, t) for (c, w, b, _), t in zip(rows, times.tolist())]


# NOTE [A collective between compute]
# A training step issues each collective after a stretch of compute, not back to back: the ranks
# reach it at different moments (their compute drifts apart, and where ranks fill the cores a
# peer's process may be waiting for one), and the first to arrive waits for the last. On this
# project's 2-core machine an all-reduce of 4 KiB issued after about 10 ms of matrix products
# costs 0.3-1.3 ms more than the same all-reduce back to back between 2 ranks, and 1.5-4.5 ms
# more between 4, which no message size explains: it is the collective's launch cost
# (``CommSpec.base_latency_s``, NOTE [Ring collectives]) as a step meets it. ``zerofx calibrate``
# measures it so: ``INTERLEAVED_ROUNDS`` rounds of ``INTERLEAVED_COMPUTE_S`` of matrix products
# and a small all-reduce, less the rounds' compute alone and the all-reduce's typical time back to
# back, the median of ``INTERLEAVED_REPEATS`` such differences, the slowest rank's, at least 0.
INTERLEAVED_ROUNDS = 20
INTERLEAVED_REPEATS = 5
INTERLEAVED_COMPUTE_S = 0.01


def measure_interleaved_overhead(group: Any = None, *, device: torch.device | None = None) -> float:
    """Seconds a small all-reduce over ``group`` costs after a stretch of compute beyond its time
    back to back (NOTE [A collective between compute]); every rank of ``group`` calls it."""
    device = device or torch.device("cpu")
    small = torch.ones(1024, device=device)
    a = torch.randn(256, 256, device=device)
    start = time.perf_counter()
    a @ a
    per_matmul = max(time.perf_counter() - start, 1e-6)
    matmuls = max(1, round(INTERLEAVED_COMPUTE_S / per_matmul))

    def compute() -> None:
        for _ in range(matmuls):
            a @ a

    def rounds(with_collective: bool) -> float:
        dist.barrier(group=group)
        begin = time.perf_counter()
        for _ in range(INTERLEAVED_ROUNDS):
            compute()
            if with_collective:
                dist.all_reduce(small, group=group)
        dist.barrier(group=group)
        return (time.perf_counter() - begin) / INTERLEAVED_ROUNDS

    # Compute alone and compute with the collective alternate, so a noisy second of the host
    # falls on both; the median of the differences is kept.
    extras = []
    for _ in range(INTERLEAVED_REPEATS):
        alone = rounds(False)
        back_to_back = _time(lambda: dist.all_reduce(small, group=group), 9, typical=True)
        extras.append(rounds(True) - alone - back_to_back)
    extra = torch.tensor([statistics.median(extras)], dtype=torch.float64, device=device)
    dist.all_reduce(extra, op=dist.ReduceOp.MAX, group=group)
    return max(extra.item(), 0.0)


# Bytes a copy moves (read + written) for the memory curve: from what stays in a core's caches
# to what comes from DRAM (NOTE [Bandwidth by working-set size] in cost_models/compute.py). The
# largest is the profile's ``memory_bytes_per_s``.
COPY_SIZES = (2**19, 2**21, 2**23, 2**25, 2**27)


# NOTE [The memory curve is mapped memory]
# The memory curve prices bytes moved through memory the process already has mapped; a new
# output's page faults are priced apart (``fresh_s_per_byte``, NOTE [New tensors' pages] in
# cost_models/compute.py), and every op's output of at least ``fresh_min_bytes`` pays them. So the
# curve copies into a destination allocated once. Timed with ``clone`` (a new output per copy),
# it held the faults too wherever ``MALLOC_MMAP_THRESHOLD_`` sends the copies' outputs to fresh
# mappings: calibrated with it at 256 KiB, the curve read 4.0-5.4 GB/s at every size where the
# same core copies at 16-35 GB/s in cache, the faults were priced twice, and the elementwise ops
# of the 25m DNA LM at 1024 tokens were predicted at twice their profiled time (``aten::mul``
# 0.42 s against 0.20 s per step). The source is written first too: an allocation never written
# maps the kernel's shared zero page, so reading it reads one page that stays in cache, and with
# an unwritten source the curve read 44 GB/s for a 128 MiB copy that moves 13 GB/s on this
# project's machine (480 MiB of L3 shared with the host's other tenants), and the 25m DNA LM's
# elementwise ops at 2x1024 tokens were predicted at 0.56 of their profiled time.
def measure_memory_curve(repeats: int, device: torch.device | None = None) -> list[tuple[float, float]]:
    """(bytes moved, bytes/s) of a tensor copy into a kept destination at each of
    ``COPY_SIZES`` (NOTE [The memory curve is mapped memory]); each sample copies at least
    64 MiB, so small copies are timed in bulk."""
    device = device or torch.device("cpu")
    curve = []
    for moved in COPY_SIZES:
        # Both written before the timing: a source never written reads the kernel's one zero page
        # (NOTE [The memory curve is mapped memory]).
        src = torch.full((moved // 8,), 1.0, device=device)  # fp32: read once, written once
        dst = torch.zeros_like(src)
        copies = max(1, 2**26 // moved)
        curve.append((float(moved), moved * copies / _time(lambda src=src, dst=dst, copies=copies: [dst.copy_(src) for _ in range(copies)],
                                                          repeats)))
    return curve


# NOTE [One core's rates with more ranks than cores]
# The profile's compute rates are one core's, with every core busy (NOTE [Ranks sharing cores] in
# cost_models/compute.py divides them among the ranks that share the cores). Calibrating with more
# local ranks than cores (``--world-size 4`` on 2 cores, to measure gloo as a 4-rank job runs it)
# must not time the compute with every rank busy: the OS then time-slices the kernels, a 1.7 ms
# matmul fits in one slice and times at a core's rate while a 64 MiB copy spans slices and times
# at half of it, and the planner would divide the shared rates by the ranks a second time. So
# ranks take turns: at most ``cores`` of them time their kernels at once, the others wait at a
# barrier, and the slowest of every turn is kept.
def in_turns(measure_local: Callable[[], list[float]], cores: int, device: torch.device | None = None) -> list[float]:
    """``measure_local`` run by at most ``cores`` ranks at a time (NOTE [One core's rates with more
    ranks than cores]); every rank returns the element-wise smallest of all ranks' results."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine: list[float] | None = None
    for turn in range(-(-world // max(cores, 1))):
        if rank // max(cores, 1) == turn:
            mine = measure_local()
        dist.barrier()
    assert mine is not None
    worst = torch.tensor([-v for v in mine], dtype=torch.float64, device=device or torch.device("cpu"))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return (-worst).tolist()


def measure_compute(repeats: int, device: torch.device | None = None, *, cores: int | None = None) -> tuple[float, float, list[tuple[float, float]]]:
    """(matmul FLOP/s, memory bytes/s, memory curve) of one rank, the slowest rank's of each,
    timed by at most ``cores`` ranks at once (None: every rank at once; NOTE [One core's rates
    with more ranks than cores])."""
    device = device or torch.device("cpu")

    def local() -> list[float]:
        a = torch.randn(512, 512, device=device)
        flops = 2 * 512**3 / _time(lambda: a @ a, repeats)
        return [flops] + [rate for _, rate in measure_memory_curve(repeats, device)]

    rates = in_turns(local, cores or dist.get_world_size(), device)
    curve = [(float(size), rate) for size, rate in zip(COPY_SIZES, rates[1:])]
    return rates[0], curve[-1][1], curve


def measure(rank: int, world_size: int, repeats: int = 5) -> list[float]:
    """[alpha_s, bandwidth, matmul_flops_per_s, memory_bytes_per_s], the same on every rank."""
    alpha, bandwidth = fit_link(measure_collectives(repeats=repeats))
    flops, mem, _ = measure_compute(repeats, cores=host_cores())
    return [alpha, bandwidth, flops, mem]


# The tensors ``measure_update`` steps: 32 of 256K elements, 8M in all, the size of a 25M-parameter
# model's shard on 3 ranks and of its larger weights' shards.
UPDATE_TENSORS, UPDATE_NUMEL = 32, 2**18


def measure_update(repeats: int, device: torch.device | None = None, *, cores: int | None = None) -> float:
    """Seconds per element and per pass of torch's default AdamW step (NOTE [The optimizer
    update's time]), the slowest rank's, timed by at most ``cores`` ranks at once."""
    from zerofx.cost_models.compute import OPTIMIZER_PASSES

    device = device or torch.device("cpu")

    def local() -> list[float]:
        params = [torch.zeros(UPDATE_NUMEL, device=device, requires_grad=True) for _ in range(UPDATE_TENSORS)]
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        seconds = _time(optimizer.step, repeats)
        return [-seconds / (UPDATE_TENSORS * UPDATE_NUMEL * OPTIMIZER_PASSES["AdamW"])]  # negated: keep the slowest

    return -in_turns(local, cores or dist.get_world_size(), device)[0]




def measure_fresh_pages(repeats: int, device: torch.device | None = None, *, cores: int | None = None) -> tuple[float, float]:
    """(extra seconds per byte of a new tensor's first write, the smallest size that pays it):
    an 8 MiB tensor allocated and filled against the same fill of one kept, the slowest rank's,
    timed by at most ``cores`` ranks at once (NOTE [New tensors' pages], NOTE [One core's rates
    with more ranks than cores]). On a GPU the caching allocator maps nothing per tensor: (0, 0)."""
    if device is not None and device.type != "cpu":
        return 0.0, 0.0
    numel = FRESH_PROBE_BYTES // 4

    def local() -> list[float]:
        kept = torch.empty(numel)
        extra = _time(lambda: torch.empty(numel).fill_(1.0), repeats) - _time(lambda: kept.fill_(1.0), repeats)
        return [-max(extra, 0.0) / FRESH_PROBE_BYTES]  # negated: in_turns keeps the smallest, this wants the largest

    worst = -in_turns(local, cores or dist.get_world_size())[0]
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return worst, float(int(threshold)) if threshold.isdigit() else float(FRESH_PROBE_BYTES)


def runtime_rss_bytes(device: torch.device | None = None) -> float:
    """The resident memory of this rank before it holds any model state: the interpreter, torch,
    the engine's modules (imported here, as ``zerofx.initialize`` imports them), what a capture
    imports and keeps (a tiny model captured and lowered on the meta device) and the process
    group, max-reduced across ranks (NOTE [What a rank's resident memory holds])."""
    import gc

    import zerofx.compiler.program  # (what a rank imports to train)
    import zerofx.runtime.engine  # noqa: F401
    from zerofx.common.rss import current_rss_bytes
    from zerofx.models.registry import build_model

    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")  # (B, T)
    program = zerofx.compiler.program.compile(build_model("tiny", device="meta"), world_size=dist.get_world_size(), stage=3,
                                              example_inputs=(ids,), example_kwargs={"labels": ids})
    program.graph_modules(dist.get_rank())
    del program
    gc.collect()
    worst = torch.tensor([float(current_rss_bytes())], dtype=torch.float64, device=device or torch.device("cpu"))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def inductor_rss_bytes(device: torch.device | None = None) -> float | None:
    """The resident memory Inductor adds to this rank once it has compiled the tiny model's rank
    graphs (stage 3, before any step, from their fake inputs), max-reduced across ranks (NOTE
    [What Inductor keeps resident] in cost_models/memory.py); None where Inductor cannot compile here (no C++ compiler). Run after
    every other measurement: what it imports stays."""
    import ctypes
    import gc

    import zerofx.compiler.program
    from zerofx.common.rss import current_rss_bytes
    from zerofx.models.registry import build_model

    ids = torch.zeros(1, 64, dtype=torch.long)  # on the CPU, whose code Inductor generates
    program = zerofx.compiler.program.compile(build_model("tiny"), world_size=dist.get_world_size(), stage=3,
                                              example_inputs=(ids,), example_kwargs={"labels": ids})
    _compat.register_group_name(program.group_name, dist.group.WORLD)
    modules = program.graph_modules(dist.get_rank())
    # As a rank does: a child compiles first and the compiles measured here are cache hits (NOTE
    # [Inductor compiles first in a child] in zerofx/compiler/program.py).
    program.compile_in_child(dist.get_rank())
    gc.collect()
    before = current_rss_bytes()
    compiled = []
    failed = torch.zeros(1, dtype=torch.float64, device=device or torch.device("cpu"))
    try:
        for name in ("forward", "backward"):
            fakes = [n.meta["val"] for n in modules[name].graph.nodes if n.op == "placeholder"]
            compiled.append(_compat.inductor_compile(modules[name], fakes))
    except Exception:  # noqa: BLE001  (no C++ compiler, or Inductor refusing this machine: nothing to price)
        failed += 1
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what compiling freed goes back, as it does in a long run
    added = torch.tensor([float(current_rss_bytes() - before)], dtype=torch.float64, device=failed.device)
    dist.all_reduce(failed)
    dist.all_reduce(added, op=dist.ReduceOp.MAX)
    return None if failed.item() else max(added.item(), 0.0)


def host_cores() -> int:
    """The cores this process may run on (its affinity), which local ranks share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _write(out: Path, comm: CommSpec, device: DeviceSpec, measurements: dict[str, list[Measurement]]) -> None:
    save_profile(out, comm, device)
    data = json.loads(out.read_text())
    data["measurements"] = {link: [list(m) for m in rows] for link, rows in measurements.items()}
    out.write_text(json.dumps(data, indent=1))


_PHASES = ("collectives at each size", "a collective between compute", "compute and memory bandwidth", "fresh pages",
           "the optimizer update", "Inductor's resident memory")


def _progress(rank: int, index: int, start: float) -> None:
    """Rank 0's line on stderr as each of ``_PHASES`` begins: a calibration takes minutes."""
    if rank == 0:
        print(f"calibrate: [{index + 1}/{len(_PHASES)}] {_PHASES[index]} ({time.perf_counter() - start:.0f} s so far)",
              file=sys.stderr, flush=True)


def _worker(rank: int, world_size: int, port: int, out: str, repeats: int, sizes: Sequence[int]) -> None:
    torch.set_num_threads(1)
    # Inductor compiles in this process, not in a pool of workers (the pool's semaphores outlive
    # the rank, and Python's resource tracker then warns of leaked semaphores at exit); the
    # resident memory measured is this process's either way.
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        _compat.compile_in_this_process()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    start = time.perf_counter()
    runtime = runtime_rss_bytes()  # before any measurement allocates
    _progress(rank, 0, start)
    rows = measure_collectives(repeats=repeats, sizes=sizes) if world_size > 1 else []
    _progress(rank, 1, start)
    launch_s = measure_interleaved_overhead() if world_size > 1 else 0.0
    _progress(rank, 2, start)
    flops, mem, curve = measure_compute(repeats, cores=host_cores())
    _progress(rank, 3, start)
    fresh_s, fresh_min = measure_fresh_pages(repeats, cores=host_cores())
    _progress(rank, 4, start)
    update_s = measure_update(repeats, cores=host_cores())
    _progress(rank, 5, start)
    inductor = inductor_rss_bytes()
    if rank == 0:
        alpha, bandwidth = fit_link(rows) if rows else (0.0, float("inf"))
        comm = CommSpec("calibrated-gloo", alpha, bandwidth, alpha, bandwidth, ranks_per_node=LOCAL_RANKS_PER_NODE, base_latency_s=launch_s,
                        collective_copies=True, backend="gloo")  # NOTE [gloo copies a collective's buffer]
        comm = dataclasses.replace(comm, collective_scale=fit_collective_scale(rows, comm))  # NOTE [Each collective's own factor]
        device = DeviceSpec("calibrated-cpu-core", flops, mem, memory_curve=tuple(curve), cores=host_cores(), runtime_bytes=runtime,
                            fresh_s_per_byte=fresh_s, fresh_min_bytes=fresh_min, update_s_per_element_pass=update_s,
                            inductor_bytes=inductor)
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
    start = rank_start(__name__)  # NOTE [Ranks forked from a server that imported torch] in zerofx/common/rank_processes.py
    mp.start_processes(start.target(_worker), args=(world_size, port, str(out), repeats, tuple(sizes)), nprocs=world_size,
                       start_method=start.method)
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
    cores = host_cores() if device.type == "cpu" else None  # a GPU rank times its own device
    flops, mem, curve = measure_compute(repeats, device, cores=cores)
    fresh_s, fresh_min = measure_fresh_pages(repeats, device, cores=cores)
    update_s = measure_update(repeats, device, cores=cores)
    intra_alpha, intra_bw = fit_link(merged[0]) if merged[0] else fit_link(merged[1])
    inter_alpha, inter_bw = fit_link(merged[1])
    # A GPU's kernels run asynchronously to the host, so the host cannot time a collective after
    # compute this way; NCCL's launch cost is left to the fit (NOTE [A collective between compute]).
    launch_s = measure_interleaved_overhead(device=device) if device.type == "cpu" else 0.0
    backend = str(dist.get_backend())
    comm = CommSpec(f"calibrated-{backend}", intra_alpha, intra_bw, inter_alpha, inter_bw, ranks_per_node=per_node, base_latency_s=launch_s,
                    collective_copies=backend == "gloo", backend=backend)  # NOTE [gloo copies a collective's buffer]
    # Each collective's factor, from the links the step's collectives mostly cross: within a node
    # where there is one (NOTE [Each collective's own factor]).
    comm = dataclasses.replace(comm, collective_scale=fit_collective_scale(merged[0] or merged[1], comm))
    # CPU ranks share the node's cores; a GPU rank has its device (NOTE [Ranks sharing cores]).
    spec = DeviceSpec(f"calibrated-{device.type}", flops, mem, memory_curve=tuple(curve), cores=host_cores() if device.type == "cpu" else None,
                      runtime_bytes=runtime, fresh_s_per_byte=fresh_s, fresh_min_bytes=fresh_min, update_s_per_element_pass=update_s)
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
