"""Exposed communication per step, with and without overlap, on the DNA LM with 2 gloo ranks.

    python -m benchmarks.bench_overlap [--model 25m] [--stage 3] [--steps 6] [--seq-len 512]

Both runs train the same model on the same data. "Exposed" is the wall time the step spends
blocked in ``wait_tensor`` nodes (measured with ``zerofx.runtime.engine.WaitTimer``); with overlap the
all-gathers are prefetched one bucket ahead and gradient reductions are waited for at the end
of backward. Medians over the measured steps, after one warm-up step. Both runs go through
the same timing interpreter, so their step times compare fairly (plain runs are a little faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: mp.Queue) -> None:
    sys.path.insert(0, str(ROOT))
    import zerofx
    from zerofx.runtime.engine import WaitTimer
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 5, (args.batch_size, args.seq_len), generator=g)
    results = {}
    engines = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = DNADecoderLM(DNA_LM_SIZES[args.model])
        cfg = {"zero_optimization": {"stage": args.stage, "overlap_comm": overlap}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        engines[overlap] = zerofx.initialize(model, cfg, example_inputs=(ids,), example_kwargs={"labels": ids})
        engines[overlap].wait_timer = WaitTimer()
        results[overlap] = {"step_s": [], "exposed_s": []}
    for step in range(args.steps + 1):
        for overlap in (True, False):  # interleaved, so machine noise hits both alike
            engine = engines[overlap]
            dist.barrier()
            start = time.perf_counter()
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
            elapsed = time.perf_counter() - start
            blocked = sum(engine.wait_timer.reset().values())
            if step > 0:
                results[overlap]["step_s"].append(elapsed)
                results[overlap]["exposed_s"].append(blocked)
    plan = engines[True].program.plan
    queue.put((rank, {str(k): v for k, v in results.items()}, len(plan.gather_buckets), len(plan.reduce_buckets), plan.num_params))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="25m", help="DNA LM size (tiny, small, 25m, 100m, 150m)")
    parser.add_argument("--stage", type=int, default=3, help="ZeRO stage (default 3)")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per mode (after 1 warm-up)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.support.dist_utils import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    per_rank = dict((r, (res, nb_g, nb_r, n)) for r, res, nb_g, nb_r, n in (queue.get(timeout=1800) for _ in procs))
    for p in procs:
        p.join()
    res, n_gather, n_reduce, num_params = per_rank[0]
    summary = {
        "model": args.model, "params": num_params, "stage": args.stage, "world_size": 2,
        "seq_len": args.seq_len, "batch_per_rank": args.batch_size, "gather_buckets": n_gather, "reduce_buckets": n_reduce,
    }
    for key, label in (("True", "overlap"), ("False", "no_overlap")):
        # The slower rank sets the pace: take, per step, the max over ranks.
        steps = [max(per_rank[r][0][key]["step_s"][i] for r in per_rank) for i in range(args.steps)]
        exposed = [max(per_rank[r][0][key]["exposed_s"][i] for r in per_rank) for i in range(args.steps)]
        summary[label] = {"median_step_s": statistics.median(steps), "median_exposed_comm_s": statistics.median(exposed)}
    print(f"DNA LM {args.model} ({num_params:,} params), ZeRO stage {args.stage}, 2 gloo ranks, "
          f"{args.batch_size}x{args.seq_len} tokens per rank, {n_gather} gather / {n_reduce} reduce buckets")
    print("| mode | median step (s) | median exposed comm (s) |\n|---|---|---|")
    for label in ("overlap", "no_overlap"):
        print(f"| {label} | {summary[label]['median_step_s']:.3f} | {summary[label]['median_exposed_comm_s']:.3f} |")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
