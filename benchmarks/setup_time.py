"""Setup time per rank, cold and from the plan cache: ``zerofx.initialize`` of a bundled DNA LM
on W local gloo ranks, launched twice with the same cache directory.

    python -m benchmarks.setup_time                               # 25m, 2 ranks, 2 rounds
    python -m benchmarks.setup_time --model 25m --world-size 2 --rounds 3 --out benchmarks/results/setup_time_25m_w2_YYYY-MM-DD

Each round makes an empty cache directory and launches the same job twice, each launch a fresh
interpreter as a second ``zerofx train`` or an elastic restart is: the first captures, plans and
lowers and writes each rank's entry (cold), the second loads them (warm). Each rank reports the
wall and CPU seconds (``time.process_time``, which moves less when other jobs load the machine)
of its ``initialize`` call and of its program's setup phases (``engine.setup_times``: capture,
plan and lower when cold; cache when warm), and whether the warm losses of one step equal the
cold ones bit for bit. The table gives the median over rounds and ranks. ``initialize`` also
places this rank's shards and checks the ranks agree; the setup phases are what the cache
removes. Writes markdown and JSON to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    """One rank: build the model, time initialize, run one step, write what it measured."""
    import torch
    import torch.distributed as dist

    import zerofx
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = DNADecoderLM(DNA_LM_SIZES[args.model])
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, model.cfg.vocab_size, (args.batch_size, args.seq_len), generator=g)
        config = {"zero_optimization": {"stage": args.stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zerofx": {"plan_cache": args.cache_dir}}
        wall, cpu = time.perf_counter(), time.process_time()
        engine = zerofx.initialize(model, config, example_inputs=(ids,), example_kwargs={"labels": ids})
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        record = {"rank": rank, "initialize_wall_s": wall, "initialize_cpu_s": cpu, "phases_s": engine.setup_times,
                  "loss": loss.item(), "loss_after_step": engine(ids, labels=ids).item()}
        if "cache" in engine.setup_times:
            record["cache_cpu_s"] = _cache_load_cpu_s(engine.program.cache_entry)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def _cache_load_cpu_s(path: Path) -> float:
    """CPU seconds of the ``cache`` phase, measured again on the entry just used: read and check
    it, rebuild the graphs, and write their Python (which the engine's plan check reads)."""
    from zerofx.compiler import cache_trust, plan_cache
    from zerofx.config.options import CacheTrust

    key = json.loads(Path(path).read_bytes().split(b"\n", 2)[1])["key"]  # the header line, after the signature
    secret = cache_trust.load_secret(None, CacheTrust.PRIVATE)
    cpu = time.process_time()
    payload, why = plan_cache._read_entry(Path(path), key, secret)
    assert payload is not None, why
    program = plan_cache._program_from_payload(payload, {})
    for gm in program.graph_modules(0).values():
        gm.code  # noqa: B018  (written on first read)
    return time.process_time() - cpu


def _launch(args: argparse.Namespace) -> None:
    """The child: W ranks, each writing its record; then all records as one JSON line."""
    import torch.multiprocessing as mp

    from tests.support.dist_utils import free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(args.world_size, free_port(), args, out_dir), nprocs=args.world_size, join=True)
        records = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.world_size)]
    print(json.dumps(records))


def launch_once(args: argparse.Namespace, cache_dir: str) -> list[dict[str, Any]]:
    argv = [sys.executable, "-m", "benchmarks.setup_time", "--child", "--cache-dir", cache_dir, "--model", args.model,
            "--world-size", str(args.world_size), "--stage", str(args.stage), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"launch exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("cold", "warm"):
        records = [r for run in runs for r in run[kind]]
        phases = sorted({p for r in records for p in r["phases_s"]})
        out[kind] = {
            "initialize_wall_s": _median([r["initialize_wall_s"] for r in records]),
            "initialize_cpu_s": _median([r["initialize_cpu_s"] for r in records]),
            "setup_phases_s": _median([sum(r["phases_s"].values()) for r in records]),
            "cache_phase_cpu_s": _median([r["cache_cpu_s"] for r in records if "cache_cpu_s" in r]),
            "phases_s": {p: _median([r["phases_s"].get(p, 0.0) for r in records]) for p in phases},
        }
    out["bit_identical_losses"] = all(
        (c["loss"], c["loss_after_step"]) == (w["loss"], w["loss_after_step"]) for run in runs for c, w in zip(run["cold"], run["warm"]))
    return out


def markdown(args: argparse.Namespace, summary: dict[str, Any], command: str) -> str:
    lines = [
        f"# Setup time per rank, cold and from the plan cache: {args.model}, {args.world_size} ranks, stage {args.stage}",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch "
        f"{__import__('torch').__version__}, gloo, one thread per rank. Date: {time.strftime('%Y-%m-%d', time.gmtime())}.",
        f"Command: `{command}`",
        "",
        f"Medians over {args.rounds} rounds x {args.world_size} ranks; batch {args.batch_size}x{args.seq_len} tokens per rank.",
        "",
        "| launch | initialize wall (s) | initialize CPU (s) | setup phases, wall (s) | phases, wall (s) | cache phase CPU (s) |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for kind in ("cold", "warm"):
        s = summary[kind]
        phases = ", ".join(f"{p} {v:.2f}" for p, v in s["phases_s"].items())
        cache_cpu = "-" if s["cache_phase_cpu_s"] != s["cache_phase_cpu_s"] else f"{s['cache_phase_cpu_s']:.2f}"  # NaN when cold
        lines.append(f"| {kind} | {s['initialize_wall_s']:.2f} | {s['initialize_cpu_s']:.2f} | {s['setup_phases_s']:.2f} | {phases} | {cache_cpu} |")
    lines += ["", "The cache phase's CPU is measured again in the rank after initialize, on the entry it loaded "
              "(read, check, rebuild the graphs, write their Python).",
              "", f"Losses of the first two steps, warm against cold: {'bit-identical' if summary['bit_identical_losses'] else 'DIFFERENT'}.",
              "", f"Load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="25m")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="write OUT.md and OUT.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _launch(args)
        return 0
    runs = []
    for round_index in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="zerofx-plan-cache-") as cache_dir:
            run = {"cold": launch_once(args, cache_dir), "warm": launch_once(args, cache_dir)}
        runs.append(run)
        print(f"round {round_index + 1}: cold {[round(r['initialize_wall_s'], 2) for r in run['cold']]} s, "
              f"warm {[round(r['initialize_wall_s'], 2) for r in run['warm']]} s (initialize wall, per rank)", flush=True)
    summary = summarize(runs)
    command = "python -m benchmarks.setup_time " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(args, summary, command)
    print(text)
    if args.out:
        Path(f"{args.out}.md").write_text(text)
        Path(f"{args.out}.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("child", "cache_dir")},
                                                        "summary": summary, "runs": runs}, indent=1))
    return 0 if summary["bit_identical_losses"] and summary["warm"]["setup_phases_s"] < summary["cold"]["setup_phases_s"] else 1


if __name__ == "__main__":
    sys.exit(main())
