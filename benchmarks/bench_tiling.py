"""Longest context under a memory cap: zerofx sequence tiling against plain PyTorch with its own
``scaled_dot_product_attention`` (the strongest untiled baseline: on CPU its fused kernel is
already linear in memory), on the bundled DNA decoder LM. ``zerofx_untiled`` (the same engine
with tiling off) separates zerofx's own overhead from tiling's.

    python -m benchmarks.bench_tiling                          # 2 layers, d256, cap 1 GiB
    python -m benchmarks.bench_tiling --cap 768MiB --lengths 1024,2048,4096,8192,16384

Each (system, context length) runs in a fresh subprocess: build the model, (zerofx) initialize a
one-rank engine with tiling forced on (or off), run ``--steps`` AdamW training steps at batch 1, and report
the process's peak resident set size (``ru_maxrss``, the real process, everything included:
Python, torch, the model, Adam states, activations), the resident size before the first step,
and the mean wall and CPU time (``process_time``, all threads) of the steps after the first (the
first also compiles, for zerofx). On a shared machine the CPU time is the steadier measure of
compute cost; wall time also counts waiting for the cores. A run fits when its peak RSS is at most the cap.
A system stops at its first length that does not fit. Writes markdown and JSON to
``benchmarks/results/tiling_*``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("pytorch_sdpa", "zerofx_untiled", "zerofx_tiled")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run_one(system: str, seq_len: int, dim: int, layers: int, steps: int, block: int, attention_block: int) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    import torch

    from zerofx.models import DNADecoderLM, DNALMConfig

    torch.manual_seed(0)
    cfg = DNALMConfig(dim=dim, num_layers=layers, num_heads=max(1, dim // 64), ffn_dim=int(8 * dim / 3) // 8 * 8,
                      max_seq_len=seq_len, tie_embeddings=True)
    model = DNADecoderLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len))
    if system == "pytorch_sdpa":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> float:
            opt.zero_grad(set_to_none=True)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            return loss.item()
    else:
        import torch.distributed as dist

        import zerofx

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        config = {"zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                  "zerofx": {"tiling": {"enabled": system == "zerofx_tiled", "block_size": block, "attention_block_size": attention_block}}}
        engine = zerofx.initialize(model, config, example_inputs=(ids,), example_kwargs={"labels": ids})

        def step() -> float:
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
            return loss.item()

    rss_before = _rss_bytes()
    times, cpu_times, losses = [], [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    timed, cpu_timed = times[1:] or times, cpu_times[1:] or cpu_times
    return {"system": system, "seq_len": seq_len, "peak_rss_bytes": peak, "rss_before_steps_bytes": rss_before,
            "step_s": sum(timed) / len(timed), "step_cpu_s": sum(cpu_timed) / len(cpu_timed), "first_step_s": times[0],
            "loss": losses[-1]}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_size(text: str) -> int:
    from passes.plan_tiling import parse_bytes

    return parse_bytes(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap", default="1GiB", help="peak RSS a run may reach to fit (default 1GiB)")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="context lengths, ascending")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="steps per run; the first is left out of the time")
    p.add_argument("--block", type=int, default=1024, help="tokens per chunk (regions and loss)")
    p.add_argument("--attention-block", type=int, default=512)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tiling"))
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: system:seq_len, run in this process
    args = p.parse_args(argv)
    if args.one:
        system, seq = args.one.split(":")
        res = run_one(system, int(seq), args.dim, args.layers, args.steps, args.block, args.attention_block)
        print("RESULT " + json.dumps(res))
        return 0
    cap = parse_size(args.cap)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows: list[dict[str, Any]] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    for system in args.systems.split(","):
        for seq in lengths:
            cmd = [sys.executable, "-m", "benchmarks.bench_tiling", "--one", f"{system}:{seq}", "--dim", str(args.dim),
                   "--layers", str(args.layers), "--steps", str(args.steps), "--block", str(args.block),
                   "--attention-block", str(args.attention_block)]
            try:
                done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
                line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                res = json.loads(line[7:]) if line else {"system": system, "seq_len": seq, "error": done.stderr[-400:]}
            except subprocess.TimeoutExpired:
                res = {"system": system, "seq_len": seq, "error": f"timed out after {args.timeout:.0f}s"}
            res["fits"] = "error" not in res and res["peak_rss_bytes"] <= cap
            rows.append(res)
            print(json.dumps(res), flush=True)
            if not res["fits"]:
                break
    summary = {"cap_bytes": cap, "dim": args.dim, "layers": args.layers, "block": args.block,
               "attention_block": args.attention_block, "machine": f"{os.cpu_count()}-core CPU", "rows": rows}
    longest = {s: max([r["seq_len"] for r in rows if r["system"] == s and r["fits"]], default=0) for s in args.systems.split(",")}
    summary["longest_fitting"] = longest
    Path(args.out + ".json").write_text(json.dumps(summary, indent=1))
    Path(args.out + ".md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


def markdown(summary: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        f"DNA LM, {summary['layers']} layers, d{summary['dim']}, batch 1, AdamW, {summary['machine']}; "
        f"cap {summary['cap_bytes'] / mib:.0f} MiB peak RSS; tiled blocks {summary['block']} tokens, attention {summary['attention_block']}",
        "",
        "| system | context | peak RSS (MiB) | RSS before steps (MiB) | step wall (s) | step CPU (s) | fits |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in summary["rows"]:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['seq_len']} | - | - | - | - | no: {r['error'].splitlines()[-1] if r['error'] else 'error'} |")
        else:
            lines.append(f"| {r['system']} | {r['seq_len']} | {r['peak_rss_bytes'] / mib:.0f} | {r['rss_before_steps_bytes'] / mib:.0f} "
                         f"| {r['step_s']:.2f} | {r['step_cpu_s']:.2f} | {'yes' if r['fits'] else 'no'} |")
    lines.append("")
    lines.append("Longest context that fits: " + ", ".join(f"{k} {v}" for k, v in summary["longest_fitting"].items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
