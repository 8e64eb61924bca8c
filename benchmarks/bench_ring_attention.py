"""Ring attention alone (NOTE [Ring attention] in passes/sequence/ring_attention.py) on S gloo ranks: the
bytes autograd saves for the backward, peak RSS and the forward + backward time, for the op in
this tree in contiguous slices (``op``) and in the zigzag layout (``zigzag``, NOTE [Zigzag layout
for causal rings] in passes/sequence/sequence_parallel.py), and optionally an older unrolled ring given as
a file (``unrolled``: one ``ring_shift`` per block and one ``ring_block_attention`` per step,
traced by autograd).

    python -m benchmarks.bench_ring_attention --variants op,zigzag --sizes 2
    git show b509f71:passes/sequence/ring_attention.py > /tmp/unrolled_ring.py
    python -m benchmarks.bench_ring_attention --variants op,unrolled --unrolled /tmp/unrolled_ring.py

Per sequence-parallel size S (``--sizes``), each variant runs ``--rounds`` times in fresh
processes (``run_ranks(fresh=True)``, so each peak RSS is its own), the rounds interleaved (round
r starts with the variant after round r - 1's first). A run is one untimed forward + backward and
``--reps`` timed ones of causal attention, fp32, q, k, v of shape (B, H, T/S, D) per rank. Per
run and rank: the bytes of the distinct tensors autograd saved in one forward
(``saved_tensors_hooks``), VmHWM before the first forward and after the last backward, and each
timed step (the slowest rank's). Writes markdown and JSON to ``--out`` (default
``benchmarks/results/ring_attention_memory_<today>``) with ``/proc/loadavg`` before and after.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

GROUP = "zerofx_bench_ring"


def _unrolled(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("unrolled_ring_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module.ring_attention


def run_rank(rank: int, world_size: int, variant: str, unrolled_path: str, shape: tuple[int, int, int, int], reps: int) -> dict:
    """One rank of one run: saved bytes, VmHWM before and after, seconds per timed step."""
    from zerofx.passes import _compat
    from zerofx.passes.sequence.ring_attention import ring_attention
    from zerofx.common.rss import peak_rss_bytes

    torch.set_num_threads(1)
    _compat.register_group_name(GROUP, dist.group.WORLD)
    b, h, t, d = shape
    local = t // world_size
    gen = torch.Generator().manual_seed(rank)
    q, k, v, grad = (torch.randn(b, h, local, d, generator=gen) for _ in range(4))
    if variant in ("op", "zigzag"):
        def attend(*qkv: torch.Tensor) -> torch.Tensor:
            return ring_attention(*qkv, None, is_causal=True, scale=d ** -0.5, size=world_size, group_name=GROUP, zigzag=variant == "zigzag")
    else:
        old = _unrolled(unrolled_path)

        def attend(*qkv: torch.Tensor) -> torch.Tensor:
            return old(*qkv, None, is_causal=True, scale=d ** -0.5, rank=torch.tensor(rank), size=world_size, group_name=GROUP)

    before = peak_rss_bytes()
    saved: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    seconds = []
    for rep in range(reps + 1):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        dist.barrier()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack if rep == 0 else (lambda x: x), lambda x: x):
            out = attend(*leaves)
        (out * grad).sum().backward()
        dist.barrier()
        if rep:
            seconds.append(time.perf_counter() - start)
    block = q.numel() * q.element_size()
    return {"saved_bytes": sum(saved.values()), "block_bytes": block, "rss_before": before, "rss_after": peak_rss_bytes(),
            "seconds": seconds}


def main() -> None:
    from tests.support.dist_utils import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="op,zigzag", help="comma-separated, of op, zigzag, unrolled")
    parser.add_argument("--unrolled", help="the older ring_attention.py, as a file (for the unrolled variant)")
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--shape", default="4,32,256,128", help="B,H,T,D of the whole attention")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=f"benchmarks/results/ring_attention_memory_{datetime.date.today()}")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if not set(variants) <= {"op", "zigzag", "unrolled"} or ("unrolled" in variants) != bool(args.unrolled):
        parser.error(f"--variants {args.variants!r}: accepted op, zigzag and unrolled, the last with --unrolled FILE")
    shape = tuple(int(x) for x in args.shape.split(","))
    load = [Path("/proc/loadavg").read_text().strip()]
    runs: list[dict] = []
    for size in (int(s) for s in args.sizes.split(",")):
        for r in range(args.rounds):
            for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
                ranks = run_ranks(size, run_rank, variant, args.unrolled, shape, args.reps, fresh=True)
                runs.append({"size": size, "variant": variant, "round": r, "ranks": ranks})
                print(size, variant, r, [x["saved_bytes"] for x in ranks], flush=True)
    load.append(Path("/proc/loadavg").read_text().strip())
    mib = 2.0 ** 20
    lines = [f"# Ring attention: saved bytes, peak RSS and time ({datetime.date.today()})", "",
             f"Causal fp32 attention of shape (B, H, T, D) = {shape}, one forward + backward per step, {args.reps} timed steps "
             f"per run, {args.rounds} interleaved rounds per variant, fresh gloo processes per run, one thread per rank. "
             f"`op`: the `zerofx::ring_attention` op on contiguous slices; `zigzag`: the same op in the zigzag layout; "
             f"`unrolled`: the ring unrolled into ring_shift and ring_block_attention ops. Command: "
             f"`python -m benchmarks.bench_ring_attention {' '.join(sys.argv[1:])}`. "
             f"Load average before: `{load[0]}`; after: `{load[1]}` ({os.cpu_count()} cores).", "",
             "| S | variant | saved MiB per rank (max) | k+v block pairs saved | VmHWM growth MiB (max rank, median of rounds) | "
             "step s median [q1, q3] (slowest rank) |", "|---|---|---|---|---|---|"]
    for size in sorted({run["size"] for run in runs}):
        for variant in variants:
            mine = [run for run in runs if run["size"] == size and run["variant"] == variant]
            saved = max(x["saved_bytes"] for run in mine for x in run["ranks"])
            block = mine[0]["ranks"][0]["block_bytes"]
            growth = statistics.median(max(x["rss_after"] - x["rss_before"] for x in run["ranks"]) for run in mine)
            steps = [max(step) for run in mine for step in zip(*(x["seconds"] for x in run["ranks"]))]
            q1, med, q3 = statistics.quantiles(steps, n=4) if len(steps) > 1 else (steps[0],) * 3
            lines.append(f"| {size} | {variant} | {saved / mib:.1f} | {saved / block / 2:.2f} | {growth / mib:.1f} | "
                         f"{med:.3f} [{q1:.3f}, {q3:.3f}] |")
    lines += ["", "Saved bytes count each distinct storage autograd saved once. A block (B, H, T/S, D) of q, k, v or the output "
              "has one size here, so \"k+v block pairs saved\" is the saved bytes over two blocks of that S: q, k, v and the "
              "output are 2 pairs; lse adds 1/D of a block."]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps({"shape": shape, "load": load, "runs": runs}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
