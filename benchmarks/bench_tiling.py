"""Longest context under a memory cap, and step time where both fit: zerofx sequence tiling against
plain PyTorch with its own ``scaled_dot_product_attention`` (the strongest untiled baseline: on
CPU its fused kernel is already linear in memory), on the bundled DNA decoder LM or a
transformers ``LlamaForCausalLM`` (SDPA attention).

    python -m benchmarks.bench_tiling                                  # memory: 2 layers, d256, cap 1 GiB
    python -m benchmarks.bench_tiling --model llama --lengths 4096,8192,16384,32768
    python -m benchmarks.bench_tiling --time --lengths 4096,8192       # step time, interleaved

Memory: each (system, context length) runs in a fresh subprocess: build the model, (zerofx)
initialize a one-rank stage-0 engine, run ``--steps`` AdamW training steps at batch 1, and report
the process's peak resident set size (``VmHWM`` from ``/proc/self/status``: the real process,
everything included: Python, torch, the model, Adam states, the graphs, activations; not
``ru_maxrss``, which carries the spawning process's peak across fork/exec), the resident size
before the first step, and the median wall and CPU time (``process_time``, all threads) of the
steps after the first. A run fits when its peak is at most the cap; a system stops at its first
length that does not fit.

Systems: ``pytorch_sdpa`` (eager PyTorch), ``zerofx_untiled`` (tiling off), ``zerofx_tiled``
(``enabled: auto``: the planner tiles only what the activation ``--budget`` needs and picks the
block size; NOTE [Block size from the budget] in ``passes/tiling/plan_tiling.py``) and
``zerofx_tiled_all`` (``enabled: true``: every candidate tiled, block from the budget).

``--time``: one process per length holds all systems and runs their steps interleaved
(``--steps`` rounds after one warm-up round), so a noisy shared machine slows them alike; it
reports medians and each system's ratio to ``pytorch_sdpa``.

Every run gets ``MALLOC_MMAP_THRESHOLD_`` (``--malloc-mmap-threshold``, default 256 KiB): with
glibc's dynamic default, freed tensors under 32 MiB stay in a fragmented heap and the peak RSS
measures the allocator more than the program. ``--malloc-mmap-threshold 0`` keeps the default.

Writes markdown and JSON to ``--out`` (default ``benchmarks/results/tiling[_time]_<model>``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("pytorch_sdpa", "zerofx_untiled", "zerofx_tiled", "zerofx_tiled_all")
MODELS = ("dna", "llama")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def build_model(model: str, seq_len: int, dim: int, layers: int) -> tuple[Any, int]:
    """The model (seeded) and its vocabulary size."""
    import torch

    torch.manual_seed(0)
    if model == "dna":
        from zerofx.models import DNADecoderLM, DNALMConfig

        cfg = DNALMConfig(dim=dim, num_layers=layers, num_heads=max(1, dim // 64), ffn_dim=int(8 * dim / 3) // 8 * 8,
                          max_seq_len=seq_len, tie_embeddings=True)
        return DNADecoderLM(cfg), cfg.vocab_size
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=16, hidden_size=dim, intermediate_size=int(8 * dim / 3) // 8 * 8, num_hidden_layers=layers,
                      num_attention_heads=max(1, dim // 64), num_key_value_heads=max(1, dim // 64), max_position_embeddings=seq_len,
                      attn_implementation="sdpa", tie_word_embeddings=True)
    return LlamaForCausalLM(cfg), cfg.vocab_size


def make_step(system: str, model: Any, ids: Any, budget: str) -> Callable[[], float]:
    """One AdamW training step of ``system`` on ``ids``, as a function returning the loss."""
    import torch

    if system == "pytorch_sdpa":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> float:
            opt.zero_grad(set_to_none=True)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            return loss.item()

        return step
    import torch.distributed as dist

    import zerofx

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    enabled = {"zerofx_untiled": False, "zerofx_tiled": "auto", "zerofx_tiled_all": True}[system]
    config = {"zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zerofx": {"tiling": {"enabled": enabled, "budget": budget}}}
    engine = zerofx.initialize(model, config, example_inputs=(ids,), example_kwargs={"labels": ids})

    def step() -> float:
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        return loss.item()

    step.engine = engine  # type: ignore[attr-defined]
    return step


def _tiled_ops(step: Callable[[], float]) -> list[str]:
    engine = getattr(step, "engine", None)
    tiling = engine.program.plan.tiling if engine is not None and engine.program is not None else None
    return [f"{op.kind}:{op.block_size}" for op in tiling.ops] if tiling else []


def run_one(system: str, model_name: str, seq_len: int, dim: int, layers: int, steps: int, budget: str) -> dict[str, Any]:
    """One memory measurement, in this (fresh) process."""
    import torch

    model, vocab = build_model(model_name, seq_len, dim, layers)
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(1))
    step = make_step(system, model, ids, budget)
    rss_before = _status_bytes("VmRSS")
    times, cpu_times, losses = [], [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    timed, cpu_timed = times[1:] or times, cpu_times[1:] or cpu_times
    return {"system": system, "seq_len": seq_len, "peak_rss_bytes": _status_bytes("VmHWM"), "rss_before_steps_bytes": rss_before,
            "step_s": statistics.median(timed), "step_cpu_s": statistics.median(cpu_timed), "first_step_s": times[0],
            "loss": losses[-1], "tiled_ops": _tiled_ops(step)}


def time_one(systems: list[str], model_name: str, seq_len: int, dim: int, layers: int, rounds: int, budget: str) -> list[dict[str, Any]]:
    """Step times of ``systems`` at one length, interleaved in this process: one warm-up round,
    then ``rounds`` rounds; medians and ratios to the first system."""
    import torch

    ids = None
    step_fns = {}
    for system in systems:
        model, vocab = build_model(model_name, seq_len, dim, layers)
        ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(1)) if ids is None else ids
        step_fns[system] = make_step(system, model, ids, budget)
    losses = {s: f() for s, f in step_fns.items()}  # warm-up (zerofx compiles here)
    wall: dict[str, list[float]] = {s: [] for s in systems}
    cpu: dict[str, list[float]] = {s: [] for s in systems}
    for _ in range(rounds):
        for s, f in step_fns.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            f()
            wall[s].append(time.perf_counter() - start)
            cpu[s].append(time.process_time() - cpu_start)
    base = systems[0]
    rows = []
    for s in systems:
        rows.append({"system": s, "seq_len": seq_len, "step_s": statistics.median(wall[s]), "step_cpu_s": statistics.median(cpu[s]),
                     "wall_ratio": statistics.median(wall[s]) / statistics.median(wall[base]),
                     "cpu_ratio": statistics.median(cpu[s]) / statistics.median(cpu[base]),
                     "per_round_cpu_ratio": [c / b for c, b in zip(cpu[s], cpu[base])],
                     "loss": losses[s], "tiled_ops": _tiled_ops(step_fns[s])})
    return rows


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dna", choices=MODELS)
    p.add_argument("--cap", default="1GiB", help="peak RSS a run may reach to fit (default 1GiB)")
    p.add_argument("--budget", default="512MiB", help="activation budget for the tiling planner (default 512MiB: the cap "
                   "less the ~0.4 GiB the process holds before its first step)")
    p.add_argument("--lengths", default="2048,4096,8192,16384,32768", help="context lengths, ascending")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first is left out of the time); with --time, rounds")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--time", action="store_true", help="interleaved step times instead of memory")
    p.add_argument("--malloc-mmap-threshold", default="256KiB", help="glibc M_MMAP_THRESHOLD for every run (MALLOC_MMAP_THRESHOLD_), "
                   "so freed tensors return to the OS instead of fragmenting the heap; 0 keeps glibc's dynamic default")
    p.add_argument("--out", default=None)
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: system:seq_len, run in this process
    args = p.parse_args(argv)
    systems = args.systems.split(",")
    if args.one:
        system, seq = args.one.split(":")
        if args.time:
            res: Any = time_one(system.split("+"), args.model, int(seq), args.dim, args.layers, args.steps, args.budget)
        else:
            res = run_one(system, args.model, int(seq), args.dim, args.layers, args.steps, args.budget)
        print("RESULT " + json.dumps(res))
        return 0
    from zerofx.config import parse_bytes

    cap = int(parse_bytes(args.cap))
    lengths = [int(x) for x in args.lengths.split(",")]
    rows: list[dict[str, Any]] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    threshold = int(parse_bytes(args.malloc_mmap_threshold))
    if threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    common = ["--model", args.model, "--dim", str(args.dim), "--layers", str(args.layers), "--steps", str(args.steps), "--budget", args.budget]
    jobs = [("+".join(systems), seq) for seq in lengths] if args.time else [(s, seq) for s in systems for seq in lengths]
    stopped: set[str] = set()
    for system, seq in jobs:
        if system in stopped:
            continue
        cmd = [sys.executable, "-m", "benchmarks.bench_tiling", "--one", f"{system}:{seq}", *common] + (["--time"] if args.time else [])
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            res = json.loads(line[7:]) if line else {"system": system, "seq_len": seq, "error": done.stderr[-400:]}
        except subprocess.TimeoutExpired:
            res = {"system": system, "seq_len": seq, "error": f"timed out after {args.timeout:.0f}s"}
        new = res if isinstance(res, list) else [res]
        for r in new:
            if not args.time:
                r["fits"] = "error" not in r and r["peak_rss_bytes"] <= cap
                if not r["fits"]:
                    stopped.add(system)
            print(json.dumps(r), flush=True)
        rows += new
    summary = {"model": args.model, "cap_bytes": cap, "budget": args.budget, "malloc_mmap_threshold": threshold, "dim": args.dim, "layers": args.layers,
               "machine": f"{os.cpu_count()}-core CPU", "rows": rows}
    if not args.time:
        summary["longest_fitting"] = {s: max([r["seq_len"] for r in rows if r["system"] == s and r["fits"]], default=0) for s in systems}
    out = args.out or str(ROOT / "benchmarks" / "results" / f"tiling{'_time' if args.time else ''}_{args.model}")
    Path(out + ".json").write_text(json.dumps(summary, indent=1))
    Path(out + ".md").write_text(markdown(summary, timing=args.time))
    print(markdown(summary, timing=args.time))
    return 0


def markdown(summary: dict[str, Any], *, timing: bool = False) -> str:
    mib = 1 << 20
    head = (f"{summary['model']} LM, {summary['layers']} layers, d{summary['dim']}, batch 1, AdamW, {summary['machine']}; "
            f"tiling budget {summary['budget']}; glibc mmap threshold "
            f"{str(summary['malloc_mmap_threshold']) + ' bytes' if summary['malloc_mmap_threshold'] else 'dynamic (default)'}")
    if timing:
        lines = [head + "; steps interleaved, medians", "",
                 "| system | context | step wall (s) | step CPU (s) | wall / sdpa | CPU / sdpa | tiled ops |", "|---|---:|---:|---:|---:|---:|---|"]
        for r in summary["rows"]:
            if "error" in r:
                lines.append(f"| {r['system']} | {r['seq_len']} | - | - | - | - | error: {r['error'].splitlines()[-1] if r['error'] else ''} |")
                continue
            lines.append(f"| {r['system']} | {r['seq_len']} | {r['step_s']:.2f} | {r['step_cpu_s']:.2f} | {r['wall_ratio']:.2f} "
                         f"| {r['cpu_ratio']:.2f} | {_ops_text(r['tiled_ops'])} |")
        return "\n".join(lines) + "\n"
    lines = [
        head + f"; cap {summary['cap_bytes'] / mib:.0f} MiB peak RSS (VmHWM)", "",
        "| system | context | peak RSS (MiB) | RSS before steps (MiB) | step wall (s) | step CPU (s) | fits | tiled ops |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in summary["rows"]:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['seq_len']} | - | - | - | - | no: {r['error'].splitlines()[-1] if r['error'] else 'error'} | |")
        else:
            lines.append(f"| {r['system']} | {r['seq_len']} | {r['peak_rss_bytes'] / mib:.0f} | {r['rss_before_steps_bytes'] / mib:.0f} "
                         f"| {r['step_s']:.2f} | {r['step_cpu_s']:.2f} | {'yes' if r['fits'] else 'no'} | {_ops_text(r['tiled_ops'])} |")
    lines.append("")
    lines.append("Longest context that fits: " + ", ".join(f"{k} {v}" for k, v in summary["longest_fitting"].items()))
    return "\n".join(lines) + "\n"


def _ops_text(ops: list[str]) -> str:
    counts: dict[str, int] = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    return ", ".join(f"{n}x {op}" for op, n in counts.items()) or "none"


if __name__ == "__main__":
    raise SystemExit(main())
