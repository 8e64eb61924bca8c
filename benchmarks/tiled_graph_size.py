"""Graph size and setup time of a tiled model as the context grows: nodes per graph, capture,
planning and lowering seconds, and the plan-cache entry, at each context length with the same
chunk size (NOTE [One body per tiled region] in passes/tiling/chunk_loop.py).

    python -m benchmarks.tiled_graph_size                                 # striped-1m at 16k and 64k
    python -m benchmarks.tiled_graph_size --contexts 16384,65536,262144,1048576 --out benchmarks/results/tiled_graph_size_YYYY-MM-DD

Each context runs in a fresh interpreter (one thread): ``zerofx.compile`` of the model, built on
the meta device, for one rank at stage 0 with ``zerofx.tiling`` ``{"enabled": true, "block_size":
B}`` (every region, convolution, attention and the loss tiled, in T / B chunks), then the
lowering of rank 0's graphs. It reports the nodes of the joint graph and of the rank's forward and
backward graphs (their loop bodies counted too), the loops, the setup phases (capture, plan,
lower), the plan-cache payload of the lowered program (``plan_cache.program_bytes``, what an
entry holds) and the seconds to load it back, and the process's peak resident set. Writes
markdown and JSON to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def measure(size: str, context: int, block_size: int, dim: int | None) -> dict[str, Any]:
    """One context, in this process: the figures of the module docstring."""
    import dataclasses

    import torch

    import zerofx
    from zerofx.common.rss import peak_rss_bytes
    from zerofx.compiler import plan_cache
    from zerofx.models import model_class, model_config
    from zerofx.passes import _compat

    torch.set_num_threads(1)
    cfg = model_config(size) if dim is None else dataclasses.replace(model_config(size), dim=dim)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    ids = torch.randint(0, 4, (1, context))
    tiling = {"enabled": True, "block_size": block_size, "attention_block_size": block_size, "loss": False}
    start = time.perf_counter()
    program = zerofx.compile(model, world_size=1, stage=0, example_inputs=(ids,), example_kwargs={"labels": ids},
                             config={"zerofx": {"tiling": tiling}})
    graphs = program.graph_modules(0)
    setup_s = time.perf_counter() - start

    def nodes(gm: torch.fx.GraphModule) -> int:
        return sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, torch.fx.GraphModule))

    loops = {name: [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _compat.LOOP_TARGETS] for name, gm in graphs.items()}
    payload = plan_cache.program_bytes(program, 0)
    start = time.perf_counter()
    loaded = plan_cache.program_from_bytes(payload, {"group_name": program.group_name})
    for gm in loaded.graph_modules(0).values():
        gm.code  # noqa: B018  (written on first read, as the engine's plan check reads it)
    load_s = time.perf_counter() - start
    record: dict[str, Any] = {
        "context": context, "chunks": -(-context // block_size),
        "tiled_ops": [op.kind for op in program.plan.tiling.ops] if program.plan.tiling else [],
        "joint_nodes": len(program.captured.joint.graph.nodes),
        "nodes": {name: len(graphs[name].graph.nodes) for name in ("forward", "backward")},
        "nodes_with_bodies": {name: nodes(graphs[name]) for name in ("forward", "backward")},
        "loops": {name: len(loops[name]) for name in ("forward", "backward")},
        "setup_s": setup_s, "phases_s": dict(program.setup_times),
        "cache_entry_bytes": len(payload), "cache_load_s": load_s,
    }
    record["peak_rss_bytes"] = peak_rss_bytes()
    return record


def run_child(args: argparse.Namespace, context: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", "benchmarks.tiled_graph_size", "--child", str(context), "--size", args.size,
            "--block-size", str(args.block_size)] + (["--dim", str(args.dim)] if args.dim else [])
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"context {context} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(args: argparse.Namespace, records: list[dict[str, Any]], command: str) -> str:
    model = f"{args.size}" + (f" at width {args.dim}" if args.dim else "")
    lines = [
        f"# Graph size of a tiled {model} as the context grows, chunks of {args.block_size} tokens",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch "
        f"{__import__('torch').__version__}, one thread. Date: {time.strftime('%Y-%m-%d', time.gmtime())}.",
        f"Command: `{command}`",
        "",
        "| context | chunks | joint nodes | forward nodes (with bodies) | backward nodes (with bodies) | loops fw / bw | capture (s) "
        "| plan (s) | lower (s) | cache entry (KiB) | cache load (s) | peak RSS (MiB) |",
        "|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        p = r["phases_s"]
        row = (f"| {r['context']:,} | {r['chunks']} | {r['joint_nodes']:,} | {r['nodes']['forward']:,} ({r['nodes_with_bodies']['forward']:,}) "
               f"| {r['nodes']['backward']:,} ({r['nodes_with_bodies']['backward']:,}) | {r['loops']['forward']} / {r['loops']['backward']} "
               f"| {p.get('capture', 0.0):.1f} | {p.get('plan', 0.0):.1f} | {p.get('lower', 0.0):.1f} | {r['cache_entry_bytes'] / 1024:,.0f} "
               f"| {r['cache_load_s']:.2f} | {r['peak_rss_bytes'] / 2**20:,.0f} |")
        lines.append(row)
    lines += ["", f"Load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="striped-1m", help="a named model size (zerofx.models.MODEL_SIZES)")
    parser.add_argument("--dim", type=int, default=None, help="the model's width instead of the size's")
    parser.add_argument("--contexts", default="16384,65536", help="context lengths, comma-separated")
    parser.add_argument("--block-size", type=int, default=8192, help="tokens per chunk")
    parser.add_argument("--out", help="write OUT.md and OUT.json")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args.size, args.child, args.block_size, args.dim)))
        return 0
    records = []
    for context in (int(c) for c in args.contexts.split(",")):
        records.append(run_child(args, context))
        r = records[-1]
        print(f"{context}: forward {r['nodes_with_bodies']['forward']} nodes, backward {r['nodes_with_bodies']['backward']}, "
              f"setup {r['setup_s']:.1f} s", flush=True)
    command = "python -m benchmarks.tiled_graph_size " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(args, records, command)
    print(text)
    if args.out:
        Path(f"{args.out}.md").write_text(text)
        Path(f"{args.out}.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "child"}, "records": records},
                                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
