"""Where a system's training step goes: the torch profiler on W gloo ranks, summarised.

    python -m benchmarks.profile_step --systems zerofx3,fsdp2 --size 25m --world-size 2
    python -m benchmarks.profile_step --systems zerofx3 --compile   # also: where zerofx.compile spends its time

Each system runs alone (not interleaved: this explains a step, it does not rank systems), with
the same model, data, seed and optimizer as ``bench_step``. After ``--warmup`` steps, ``--steps``
steps run under ``torch.profiler``; each rank summarises its own main thread:

- the phases (``bench::forward``, ``bench::backward``, ``bench::optimizer``, recorded by the
  runners in ``benchmarks/systems.py``) and, inside each, the time in no recorded op at all:
  Python and dispatch glue between ops (``glue``);
- collectives issued and waited on by the main thread (``c10d::*``, ``_c10d_functional::*``),
  counted once at their outermost frame, and the transfers gloo ran on its own threads;
- the ops with the most self time.

The profiler adds a few microseconds per op, so profiled steps run slower than ``bench_step``'s;
compare systems with each other here, and take step times from ``bench_step``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.pool import BenchSpec, _free_port, rank_batches
from benchmarks.systems import DEFAULT_LR, ZEROFX_VARIANTS, build_runner, needs_group, split_system
from zerofx.models import DNA_LM_SIZES, DNADecoderLM

PHASES = ("bench::forward", "bench::backward", "bench::optimizer")
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
WAIT_OPS = frozenset({"_c10d_functional::wait_tensor", "c10d::wait"})


def is_collective(name: str) -> bool:
    return name.startswith(("c10d::", "_c10d_functional::", "FSDP::all_gather"))


def summarize_profile(events: Any, num_steps: int, top: int, shapes: bool = False) -> dict[str, Any]:
    """Per-step averages of one rank's profile (``events``: ``prof.events()``); with ``shapes``
    (a profile taken with ``record_shapes``), also the main thread's matrix products by input shape."""
    steps = [e for e in events if e.name == "bench::step"]
    assert steps, "no bench::step events recorded"
    main = steps[0].thread
    per = 1.0 / num_steps
    phases: dict[str, dict[str, float]] = {p: {"s": 0.0, "glue_s": 0.0} for p in PHASES}
    for step in steps:
        for phase in step.cpu_children:
            if phase.name in phases:
                dur = phase.cpu_time_total / 1e6
                phases[phase.name]["s"] += dur * per
                phases[phase.name]["glue_s"] += (dur - sum(c.cpu_time_total for c in phase.cpu_children) / 1e6) * per
    issue: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    wait = [0, 0.0]
    self_time: dict[str, float] = defaultdict(float)
    by_shape: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    background: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.thread != main:
            if e.name.startswith("gloo:"):
                background[e.name][0] += per
                background[e.name][1] += e.cpu_time_total / 1e6 * per
            continue
        if e.name.startswith("bench::"):
            continue
        self_time[e.name] += e.self_cpu_time_total / 1e6 * per
        if shapes and e.name in MATMUL_OPS:
            key = f"{e.name} {e.input_shapes}"
            by_shape[key][0] += per
            by_shape[key][1] += e.self_cpu_time_total / 1e6 * per
        parent, outermost = e.cpu_parent, True
        while parent is not None:
            if is_collective(parent.name) or parent.name in WAIT_OPS:
                outermost = False
                break
            parent = parent.cpu_parent
        if not outermost:
            continue
        if e.name in WAIT_OPS:
            wait[0] += per
            wait[1] += e.cpu_time_total / 1e6 * per
        elif is_collective(e.name):
            issue[e.name][0] += per
            issue[e.name][1] += e.cpu_time_total / 1e6 * per
    return {
        "step_s": sum(s.cpu_time_total for s in steps) / 1e6 * per,
        "phases": phases,
        "collectives": {k: {"count": c, "s": t} for k, (c, t) in sorted(issue.items())},
        "waits": {"count": wait[0], "s": wait[1]},
        "gloo_threads": {k: {"count": c, "s": t} for k, (c, t) in sorted(background.items())},
        "top_ops": sorted(self_time.items(), key=lambda kv: -kv[1])[:top],
        "matmul_shapes": sorted(((k, c, t) for k, (c, t) in by_shape.items()), key=lambda kct: -kct[2])[:top],
    }


def _worker(system: str, rank: int, spec: BenchSpec, port: int, warmup: int, steps: int, top: int,
            trace_dir: str | None, shapes: bool, conn: Connection) -> None:
    torch.set_num_threads(1)
    try:
        if needs_group(system):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=spec.world_size)
        batches = rank_batches(spec, rank)
        runner, setup_s, _ = build_runner(system, size=spec.size, seed=spec.seed, device=torch.device("cpu"),
                                          optim_kind=spec.optimizer, lr=spec.lr, example=batches[0], micro_batch=spec.batch_per_rank,
                                          zerofx_config=spec.zerofx_config)
        first_s = 0.0
        for i in range(warmup):
            start = time.perf_counter()
            runner.step(batches[i])
            first_s = first_s or time.perf_counter() - start
        if needs_group(system):
            dist.barrier()
        walls, blocked, others = [], [], []
        with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
            for i in range(warmup, warmup + steps):
                wall0, cpu0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
                with record_function("bench::step"):
                    runner.step(batches[i])
                walls.append(time.perf_counter() - wall0)
                main_cpu = time.thread_time() - cpu0
                blocked.append(walls[-1] - main_cpu)
                others.append(time.process_time() - proc0 - main_cpu)  # gloo's threads, mostly
        if trace_dir and rank == 0:
            prof.export_chrome_trace(str(Path(trace_dir) / f"{system}_rank{rank}.json"))
        summary = summarize_profile(prof.events(), steps, top, shapes)
        summary.update(setup_s=setup_s, first_step_s=first_s, wall_s=walls, blocked_s=blocked, other_threads_cpu_s=others)
        conn.send(("ok", summary))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def profile_system(system: str, spec: BenchSpec, *, warmup: int, steps: int, top: int, trace_dir: str | None,
                   shapes: bool = False) -> list[dict[str, Any]]:
    """Each rank's summary of ``steps`` profiled steps of ``system``."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    num_ranks = spec.world_size if needs_group(system) else 1
    conns, procs = [], []
    for rank in range(num_ranks):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(system, rank, spec, port, warmup, steps, top, trace_dir, shapes, child), daemon=True)
        proc.start()
        child.close()
        conns.append(parent)
        procs.append(proc)
    out = []
    try:
        for rank, conn in enumerate(conns):
            status, value = conn.recv()
            if status == "error":
                raise RuntimeError(f"{system} rank {rank} failed:\n{value}")
            out.append(value)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
    return out


def compile_profile(size: str, stage: int, spec: BenchSpec, top: int) -> str:
    """cProfile of ``zerofx.compile`` (capture, plan, rewrite; on the meta device) at ``stage``."""
    import zerofx

    with torch.device("meta"):
        model = DNADecoderLM(DNA_LM_SIZES[size])
    ids = torch.zeros(spec.batch_per_rank, spec.seq_len, dtype=torch.long, device="meta")
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    zerofx.compile(model, world_size=spec.world_size, stage=stage, example_inputs=(ids,), example_kwargs={"labels": ids})
    prof.disable()
    total = time.perf_counter() - start
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    return f"zerofx.compile stage {stage}: {total:.2f} s\n" + buf.getvalue()


def report(system: str, ranks: list[dict[str, Any]]) -> str:
    r0 = ranks[0]

    def median(key: str) -> float:
        return sorted(r0[key])[len(r0[key]) // 2]

    head = (f"## {system}: setup {r0['setup_s']:.2f} s, first step {r0['first_step_s']:.2f} s, profiled step "
            f"{median('wall_s'):.3f} s: main thread on CPU {median('wall_s') - median('blocked_s'):.3f} s, off CPU "
            f"{median('blocked_s'):.3f} s; other threads' CPU {median('other_threads_cpu_s'):.3f} s (rank 0, medians)")
    # With one core per rank, a rank's CPU time (its main thread and gloo's threads) is the
    # shortest step it can take: overlap hides waiting, not work done on the same cores.
    cpu = median('wall_s') - median('blocked_s') + median('other_threads_cpu_s')
    head += (f"\nCPU per rank (main thread and other threads): {cpu:.3f} s, {cpu / median('wall_s'):.0%} of the step: the "
             "step's floor where the ranks share the cores one each")
    lines = [head]
    rows = [[p, f"{v['s']:.3f}", f"{v['glue_s']:.3f}"] for p, v in r0["phases"].items()]
    lines += ["", tabulate(rows, headers=["phase", "s/step", "glue s/step (outside any op)"], tablefmt="github")]
    coll = [[k, f"{v['count']:.0f}", f"{v['s']:.3f}"] for k, v in r0["collectives"].items()]
    coll.append(["waits (" + ", ".join(sorted(WAIT_OPS)) + ")", f"{r0['waits']['count']:.0f}", f"{r0['waits']['s']:.3f}"])
    coll += [[f"{k} (gloo thread)", f"{v['count']:.0f}", f"{v['s']:.3f}"] for k, v in r0["gloo_threads"].items()]
    lines += ["", tabulate(coll, headers=["collective (main thread unless noted)", "per step", "s/step"], tablefmt="github")]
    lines += ["", tabulate([[k, f"{v:.4f}"] for k, v in r0["top_ops"]], headers=["op", "self s/step"], tablefmt="github")]
    if r0["matmul_shapes"]:
        rows = [[k, f"{c:.0f}", f"{t:.4f}"] for k, c, t in r0["matmul_shapes"]]
        lines += ["", tabulate(rows, headers=["matrix product (input shapes)", "per step", "self s/step"], tablefmt="github")]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="zerofx3,fsdp2")
    p.add_argument("--size", default="25m", choices=list(DNA_LM_SIZES))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-per-rank", type=int, default=2)
    p.add_argument("--optimizer", default="AdamW", choices=sorted(DEFAULT_LR))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--shapes", action="store_true", help="record input shapes and list the matrix products by shape")
    p.add_argument("--trace-dir", help="write rank 0's chrome trace per system here")
    p.add_argument("--zerofx-config", help='JSON merged into the zerofx config, e.g. \'{"zero_optimization": {"reduce_bucket_size": 4e6}}\'')
    p.add_argument("--compile", action="store_true", help="also cProfile zerofx.compile for each zerofx system")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        split_system(s)
    spec = BenchSpec(size=args.size, world_size=args.world_size, seq_len=args.seq_len, batch_per_rank=args.batch_per_rank,
                     num_steps=args.warmup + args.steps, optimizer=args.optimizer, lr=DEFAULT_LR[args.optimizer],
                     zerofx_config=args.zerofx_config)
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    for system in systems:
        ranks = profile_system(system, spec, warmup=args.warmup, steps=args.steps, top=args.top, trace_dir=args.trace_dir,
                               shapes=args.shapes)
        print(report(system, ranks), "\n", flush=True)
        base, _ = split_system(system)
        if args.compile and base.startswith("zerofx"):
            print(compile_profile(args.size, ZEROFX_VARIANTS[base][0], spec, args.top), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
