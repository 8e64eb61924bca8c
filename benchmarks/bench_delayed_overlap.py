"""Does the one-step delayed update overlap compute? The DNA LM trained three ways: the optimizer
on the device (``device``: no offload), its state offloaded to host memory with the update in
the step (``cpu``), and offloaded with the delayed update (``cpu+dpu``, NOTE [One-step delayed
update]). Per step it records when the forward+backward runs and when each update runs
(``OffloadedOptimizer.update_spans``), and reports:

- the overlap fraction: the share of each delayed update's time that falls inside the next
  step's forward+backward;
- the hidden fraction: the share done before the next ``engine.step()`` starts waiting for it
  (behind the rest of the step, the barrier and the next forward+backward; 1.0: hidden
  completely), and the exposed seconds, how long that step waits;
- the step time of each run (median and quartiles over every counted step of every round), and
  ``cpu+dpu`` over ``device``, the median and quartiles of the per-round ratios (target: at most
  1.1 where the update fits behind one forward+backward);
- the median update time against the median forward+backward time.

    python -m benchmarks.bench_delayed_overlap                       # 25m, 1 rank, stage 2, 3 rounds
    python -m benchmarks.bench_delayed_overlap --world-size 2 --size small

The three runs repeat in ``--rounds`` interleaved rounds (round r starts at run r, so a noisy
minute hits every run alike), each run a fresh engine in the same process group.

One rank by default: on a CPU the update thread needs a core the compute does not use, and the
machine has two. On an accelerator the compute runs on the device and the update on the host, so
the cores are free anyway. Results go to ``benchmarks/results/delayed_overlap_<size>_w<W>_<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from benchmarks.bench_offload import run_config
from benchmarks.report import write_result

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
RUNS = ("device", "cpu", "cpu+dpu")


def _config(kind: str, stage: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if kind != "device":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zerofx"] = {"offload": {"delayed_update": kind == "cpu+dpu"}}
    return cfg


def _overlap(span: tuple[float, float], window: tuple[float, float]) -> float:
    return max(0.0, min(span[1], window[1]) - max(span[0], window[0]))


def _train(kind: str, rank: int, args: dict[str, Any]) -> dict[str, Any]:
    import zerofx
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM
    from zerofx.runtime.offload import OffloadedOptimizer

    torch.manual_seed(0)
    model = DNADecoderLM(DNA_LM_SIZES[args["size"]])
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, 5, (args["batch"], args["seq_len"]), generator=g) for _ in range(args["steps"])]
    engine = zerofx.initialize(model, _config(kind, args["stage"]), example_inputs=(batches[0],), example_kwargs={"labels": batches[0]})
    forward_backward: list[tuple[float, float]] = []
    step_calls: list[float] = []  # when each engine.step() began: with the delayed update, it waits there
    steps: list[float] = []
    for ids in batches:
        dist.barrier()
        start = time.perf_counter()
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        computed = time.perf_counter()
        engine.step()
        dist.barrier()
        forward_backward.append((start, computed))
        step_calls.append(computed)
        steps.append(time.perf_counter() - start)
    engine.flush()
    updates = list(engine.optimizer.update_spans) if isinstance(engine.optimizer, OffloadedOptimizer) else []
    engine.close()
    warm = args["warmup"]
    out: dict[str, Any] = {
        "step_s": statistics.median(steps[warm:]),
        "forward_backward_s": statistics.median(e - s for s, e in forward_backward[warm:]),
        "step_times_s": steps,
        "final_loss": loss.item(),
    }
    if updates:
        out["update_s"] = statistics.median(e - s for s, e in updates[warm:])
    if kind == "cpu+dpu":
        # Update k starts in step k's engine.step() and should run while step k + 1 computes.
        measured = range(warm, len(forward_backward) - 1)
        length = [max(updates[k][1] - updates[k][0], 1e-12) for k in range(len(updates))]
        fractions = [_overlap(updates[k], forward_backward[k + 1]) / length[k] for k in measured]
        out["overlap_fractions"] = fractions
        out["overlap_fraction"] = statistics.median(fractions)
        # Hidden: the share of update k done before step k + 1's engine.step() starts waiting for
        # it, i.e. behind whatever the rank did meanwhile (the rest of step k, the barrier, the
        # forward and backward); the rest is exposed.
        hidden = [_overlap(updates[k], (updates[k][0], step_calls[k + 1])) / length[k] for k in measured]
        out["hidden_fraction"] = statistics.median(hidden)
        out["exposed_update_s"] = statistics.median(max(0.0, updates[k][1] - step_calls[k + 1]) for k in measured)
        # When each update starts and ends, relative to the start of the next forward+backward.
        out["update_timeline_s"] = [(updates[k][0] - forward_backward[k + 1][0], updates[k][1] - forward_backward[k + 1][0],
                                     forward_backward[k + 1][1] - forward_backward[k + 1][0]) for k in range(len(forward_backward) - 1)]
    return out


def _rank(rank: int, world_size: int, port: int, args: dict[str, Any], queue: Any) -> None:
    """Every run of every round, one after the other, in one process group (a process and its
    imports per run would cost more than the runs)."""
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        out: dict[str, list[dict[str, Any]]] = {kind: [] for kind in RUNS}
        for r in range(args["rounds"]):
            for kind in RUNS[r % len(RUNS):] + RUNS[:r % len(RUNS)]:  # interleaved: round r starts at run r
                if rank == 0:
                    print(f"[bench_delayed_overlap] round {r + 1}: {kind} ...", file=sys.stderr, flush=True)
                out[kind].append(_train(kind, rank, args))
        queue.put((rank, "ok", out))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, med, q3 = statistics.quantiles(values, n=4)
    return q1, med, q3


def render(result: dict[str, Any]) -> str:
    runs = {kind: ranks[0] for kind, ranks in result["runs"].items()}  # rank 0's rounds
    warm = result["warmup"]
    rounds = len(runs["device"])
    lines = [
        f"{result['date']}: model {result['size']} ({result['num_params']:,} parameters), {result['world_size']} gloo rank(s), "
        f"ZeRO stage {result['stage']}, fp32 AdamW, batch {result['batch']} x {result['seq_len']} tokens, {rounds} interleaved "
        f"round(s) of {result['steps']} steps per run (first {warm} not counted). Machine: {result['machine']}.",
        "",
        f"Command: `python -m benchmarks.bench_delayed_overlap --size {result['size']} --world-size {result['world_size']} "
        f"--stage {result['stage']} --steps {result['steps']} --warmup {warm} --batch {result['batch']} "
        f"--seq-len {result['seq_len']} --rounds {rounds}`",
        "",
        "Step times pool every counted step of every round (median [quartiles]); \"vs device\" is the median [quartiles] of "
        "the per-round ratios of median step times; the other columns are medians over rounds.",
        "",
        "| run | step s | vs device | forward+backward s | update s | overlap with next forward+backward | "
        "hidden before the next step | exposed update s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, outs in runs.items():
        q1, med, q3 = _quartiles([t for out in outs for t in out["step_times_s"][warm:]])
        r1, rmed, r3 = _quartiles([out["step_s"] / base["step_s"] for out, base in zip(outs, runs["device"])])

        def over_rounds(key: str, outs: list[dict[str, Any]] = outs) -> float:
            return statistics.median(out[key] for out in outs)

        update = f"{over_rounds('update_s'):.3f}" if "update_s" in outs[0] else "-"
        overlap = (f"{over_rounds('overlap_fraction'):.2f} | {over_rounds('hidden_fraction'):.2f} | {over_rounds('exposed_update_s'):.3f}"
                   if "overlap_fraction" in outs[0] else "- | - | -")
        lines.append(f"| {kind} | {med:.3f} [{q1:.3f}, {q3:.3f}] | {rmed:.2f}x [{r1:.2f}, {r3:.2f}] | {over_rounds('forward_backward_s'):.3f} "
                     f"| {update} | {overlap} |")
    lines += ["", "Each delayed update of the first round (rank 0) relative to the start of the next forward+backward, seconds "
              "(update start, update end, forward+backward end): " + "; ".join(
                  f"({a:+.3f}, {b:+.3f}, {c:.3f})" for a, b, c in runs["cpu+dpu"][0]["update_timeline_s"])]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="25m", help="DNA LM size (default: 25m)")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three runs (default: 3)")
    parser.add_argument("--out", default=None, help="results file stem under benchmarks/results")
    parser.add_argument("--machine", default=f"{os.cpu_count()}-core CPU, no GPU, torch {torch.__version__}, load average "
                        f"{os.getloadavg()[0]:.1f} at the start")
    args = parser.parse_args(argv)
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM

    with torch.device("meta"):
        num_params = sum(p.numel() for p in DNADecoderLM(DNA_LM_SIZES[args.size]).parameters())
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    result: dict[str, Any] = {**vars(args), "num_params": num_params, "date": date, "runs": {}}
    spec = {k: getattr(args, k) for k in ("size", "stage", "steps", "warmup", "batch", "seq_len", "rounds")}
    by_rank = run_config(spec, args.world_size, target=_rank, timeout_s=900)
    result["runs"] = {kind: [out[kind] for out in by_rank] for kind in RUNS}
    text = render(result)
    write_result(RESULTS / (args.out or f"delayed_overlap_{args.size}_w{args.world_size}_{date}"), result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
