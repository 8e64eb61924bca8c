"""Offload benchmark: the DNA LM trained with its optimizer state in memory, and on NVMe (files on
the local disk), with and without the one-step delayed update, and (stage 3) with the parameter
shards on NVMe as well (``param-nvme``: offload_param and offload_optimizer). Per rank: peak RSS,
RSS after training, median step time, and NVMe bytes read and written per step.

    python -m benchmarks.bench_offload                          # 25m, 2 ranks, stage 2, fp32 AdamW
    python -m benchmarks.bench_offload --size small --steps 4   # a quick look
    python -m benchmarks.bench_offload --stage 3 --runs memory,nvme,param-nvme   # parameter offload
    python -m benchmarks.bench_offload --placement   # shard placement: first-fit vs cost per step

``--placement`` (preset: the 25m model, stage 3, its first half of blocks frozen, ``offload_param``
on NVMe with ``max_in_cpu`` room for the other half's shards, optimizer state in memory) runs
``param-first-fit`` and ``param-bandwidth``: the same config with the shards placed by first-fit
decreasing and by the planner's cost per step (NOTE [Placing shards by their cost per step] in
``passes/memory/plan_offload.py``), and reports each placement's predicted exposed I/O and measured step.

Peak RSS is ``VmHWM`` from ``/proc/self/status``: ``ru_maxrss`` would carry the spawning
process's peak over into a spawned rank.

Each configuration runs in fresh processes, one after the other, so peak RSS is that
configuration's own. glibc's malloc keeps freed blocks resident and raises its mmap threshold as
large blocks are freed, so by default a tensor allocated after the backward (torch's Adam state at
the first step) partly reuses activation memory that is already resident, and peak RSS
understates what the state costs. ``MALLOC_MMAP_THRESHOLD_=131072`` fixes the threshold: blocks
above 128 KiB are mapped and unmapped, and RSS follows the live tensors. The README gives both.
The first ``--warmup`` steps are left out of the step time. Results go to
``benchmarks/results/offload_<size>_w<W>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_mod
import shutil
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.report import write_result

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


PLACEMENT_RUNS = ("param-first-fit", "param-bandwidth")


def _config(kind: str, stage: int, nvme_path: Path, buffer_count: int, bandwidth: tuple[float, float],
            max_in_cpu: int = 0) -> dict[str, Any]:
    cfg: dict[str, Any] = {"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if kind in PLACEMENT_RUNS:  # shards only; the optimizer state stays in memory
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(nvme_path), "buffer_count": buffer_count,
                                                     "max_in_cpu": max_in_cpu}
        cfg["zerofx"] = {"offload": {"nvme_read_bytes_per_s": bandwidth[0], "nvme_write_bytes_per_s": bandwidth[1]}}
        return cfg
    if kind != "memory":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme_path), "buffer_count": buffer_count}
    if kind == "param-nvme":
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(nvme_path), "buffer_count": buffer_count}
        # The disk's measured bandwidth, so the engine's plan estimates this machine's I/O.
        cfg["zerofx"] = {"offload": {"nvme_read_bytes_per_s": bandwidth[0], "nvme_write_bytes_per_s": bandwidth[1],
                                     "delayed_update": kind == "nvme+dpu"}}
    return cfg


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """``VmHWM``: this process's own peak resident set (``ru_maxrss`` starts from the parent's)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def _io_bytes(engine: Any) -> tuple[int, int]:
    """NVMe bytes (read, written) so far: optimizer records and parameter shards."""
    stores = [s for s in (engine.storage.offload_store, engine.storage.param_store) if s is not None]
    return (sum(s.io_bytes()[0] for s in stores), sum(s.io_bytes()[1] for s in stores))


_STORE_WAIT_S = [0.0]


def _time_store_waits() -> None:
    """Count the seconds the step spends in the parameter store's blocking calls (taking a shard,
    whose NVMe read may not be done; handing one back, which waits for the oldest write-back
    beyond ``buffer_count``; draining): the shard I/O the step waited for, as measured."""
    from zerofx.runtime.offload.params import ParamStore

    def timed(fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                _STORE_WAIT_S[0] += time.perf_counter() - start
        return wrapper

    for name in ("_take", "release", "drain"):
        setattr(ParamStore, name, timed(getattr(ParamStore, name)))


def _rank(rank: int, world_size: int, port: int, args: dict[str, Any], queue: Any) -> None:
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        import zerofx
        from zerofx.models import DNA_LM_SIZES, DNADecoderLM

        torch.manual_seed(0)
        model = DNADecoderLM(DNA_LM_SIZES[args["size"]])
        for block in model.blocks[: args.get("freeze_blocks", 0)]:
            block.requires_grad_(False)
        if args["kind"] in PLACEMENT_RUNS:
            # The config has no key for the placement rule: the planner picks the faster of the two
            # by its own prediction. Here each run forces one, to measure both.
            import functools

            import zerofx.runtime.offload.plan as offload_plan
            from zerofx.passes.plan.offload import Placement
            from zerofx.passes.memory.plan_offload import plan_param_offload

            rule = Placement.FIRST_FIT if args["kind"] == "param-first-fit" else Placement.BANDWIDTH
            offload_plan.plan_param_offload = functools.partial(plan_param_offload, placement=rule)  # type: ignore[assignment]
            _time_store_waits()
        g = torch.Generator().manual_seed(1 + rank)
        batches = [torch.randint(0, 5, (args["batch"], args["seq_len"]), generator=g) for _ in range(args["steps"])]
        cfg = _config(args["kind"], args["stage"], Path(args["nvme_path"]), args["buffer_count"], args["bandwidth"],
                      args.get("max_in_cpu", 0))
        engine = zerofx.initialize(model, cfg, example_inputs=(batches[0],), example_kwargs={"labels": batches[0]})
        times, reads, writes, waits = [], [], [], []
        for ids in batches:
            before = _io_bytes(engine)
            dist.barrier()
            waited = _STORE_WAIT_S[0]
            start = time.perf_counter()
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
            dist.barrier()
            times.append(time.perf_counter() - start)
            waits.append(_STORE_WAIT_S[0] - waited)
            after = _io_bytes(engine)
            reads.append(after[0] - before[0])
            writes.append(after[1] - before[1])
        engine.flush()
        mem = engine.memory()
        warm = args["warmup"]
        out = {
            "peak_rss_bytes": _peak_rss_bytes(),
            "end_rss_bytes": _rss_bytes(),
            "step_s": statistics.median(times[warm:]),
            "read_bytes_per_step": statistics.median(reads[warm:]),
            "written_bytes_per_step": statistics.median(writes[warm:]),
            "memory": mem,
            "final_loss": loss.item(),
            "plan_estimates": dict(engine.storage.offload_plan.estimates) if engine.storage.offload_store is not None else None,
            "param_plan_estimates": dict(engine.storage.param_offload_plan.estimates) if engine.storage.param_store is not None else None,
            "param_peak_held_bytes": engine.storage.param_store.peak_held_bytes if engine.storage.param_store is not None else 0,
            "param_placement": engine.storage.param_offload_plan.placement.value if engine.storage.param_store is not None else None,
            "step_times_s": times,
            "store_wait_s": statistics.median(waits[warm:]),
            "load_average": os.getloadavg(),
        }
        queue.put((rank, "ok", out))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_config(args: dict[str, Any], world_size: int, *, target: Callable[..., None] | None = None,
               timeout_s: float = 3600) -> list[dict[str, Any]]:
    """Each rank's result of ``target(rank, world_size, port, args, queue)`` (this module's
    ``_rank`` by default) on ``world_size`` fresh gloo processes."""
    target = _rank if target is None else target
    label = args.get("kind", "run")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "error":
                raise RuntimeError(f"{label} rank {rank} failed:\n{value}")
            results[rank] = value
    except queue_mod.Empty:
        raise RuntimeError(f"{label}: ranks did not finish") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return [results[r] for r in range(world_size)]


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def render(result: dict[str, Any]) -> str:
    base = result["runs"].get("memory") or next(iter(result["runs"].values()))
    lines = [
        f"Model {result['size']} ({result['num_params']:,} parameters), {result['world_size']} gloo ranks, ZeRO stage "
        f"{result['stage']}, fp32 AdamW, batch {result['batch']} x {result['seq_len']} tokens per rank, "
        f"{result['steps']} steps (first {result['warmup']} not timed), NVMe tier: {result['nvme_path']} "
        f"(buffer_count {result['buffer_count']}; measured {result['nvme_read_bytes_per_s'] / 1e9:.2f} GB/s read, "
        f"{result['nvme_write_bytes_per_s'] / 1e9:.2f} GB/s write with fsync). Machine: {result['machine']}."
        + (f" Run {result['date']}." if "date" in result else ""),
        "",
        "| run | rank | optimizer state in memory MiB | on NVMe MiB | NVMe window MiB | params in memory MiB | "
        "params on NVMe MiB | param shards in host memory at peak MiB | peak RSS MiB | RSS after MiB | "
        "peak RSS saved, % of what left memory | step s | step time vs memory | read MiB/step | written MiB/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, ranks in result["runs"].items():
        for r, out in enumerate(ranks):
            mem, held = out["memory"], base[r]["memory"]
            left = held["optimizer_states"] + held["params"] - mem["optimizer_states"] - mem["params"]
            saved = "-" if kind == "memory" or left <= 0 else f"{(base[r]['peak_rss_bytes'] - out['peak_rss_bytes']) / left * 100:.0f}"
            slower = "-" if out is base[r] else f"{(out['step_s'] / base[r]['step_s'] - 1) * 100:+.0f}%"
            lines.append(
                f"| {kind} | {r} | {_mib(mem['optimizer_states'])} | {_mib(mem.get('offload_nvme_bytes', 0))} | "
                f"{_mib(mem.get('offload_window_bytes', 0))} | {_mib(mem['params'])} | {_mib(mem.get('offload_param_nvme_bytes', 0))} | "
                f"{_mib(out.get('param_peak_held_bytes', 0))} | {_mib(out['peak_rss_bytes'])} | {_mib(out['end_rss_bytes'])} | "
                f"{saved} | {out['step_s']:.2f} | {slower} | "
                f"{_mib(out['read_bytes_per_step'])} | {_mib(out['written_bytes_per_step'])} |"
            )
    lines.append("")
    lines.append("The engine's offload plan per step (rank 0), from the measured bandwidths; the engine plans before it has "
                 "timed a forward or backward, so nothing is counted as hiding behind them: " + "; ".join(
        f"{kind}: record I/O {e['io_s'] * 1e3:.0f} ms, hidden {e['hidden_io_s'] * 1e3:.0f} ms, exposed {e['exposed_io_s'] * 1e3:.0f} ms"
        for kind, ranks in result["runs"].items() if (e := ranks[0].get("plan_estimates"))))
    params = [(kind, e) for kind, ranks in result["runs"].items() if (e := ranks[0].get("param_plan_estimates"))]
    if params:
        lines.append("")
        lines.append("The engine's parameter-shard plan per step (rank 0), likewise without compute times: " + "; ".join(
            f"{kind}: shard I/O {e['io_s'] * 1e3:.0f} ms (reads {e['read_s'] * 1e3:.0f} ms, write-backs {e['write_s'] * 1e3:.0f} ms), "
            f"hidden {e['hidden_io_s'] * 1e3:.0f} ms, exposed {e['exposed_io_s'] * 1e3:.0f} ms" for kind, e in params))
    placed = [(kind, ranks[0]) for kind, ranks in result["runs"].items() if kind in PLACEMENT_RUNS]
    if placed:
        e = placed[0][1]["param_plan_estimates"]
        lines += ["", f"Shard placement ({result.get('freeze_blocks', 0)} frozen block(s), max_in_cpu {result.get('max_in_cpu', 0):,} "
                  "elements per rank): predicted exposed shard I/O per step, rank 0, "
                  f"first-fit decreasing {e['first_fit_exposed_io_s'] * 1e3:.0f} ms, cost per step {e['bandwidth_exposed_io_s'] * 1e3:.0f} ms; "
                  "measured median step " + ", ".join(f"{kind} ({out['param_placement']}) {out['step_s']:.2f} s, of which waiting in "
                                                       f"the shard store {out['store_wait_s'] * 1e3:.0f} ms (load average at the end "
                                                       f"{out['load_average'][0]:.1f})" for kind, out in placed)
                  + ". Step times per run (rank 0): " + "; ".join(
                      f"{kind}: {', '.join(f'{t:.2f}' for t in out['step_times_s'])}" for kind, out in placed)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="25m", help="DNA LM size (default: 25m)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--buffer-count", type=int, default=4)
    parser.add_argument("--nvme-path", type=Path, default=Path("/tmp/zerofx_bench_nvme"))
    parser.add_argument("--runs", default="memory,nvme,nvme+dpu", help="comma-separated: memory, nvme, nvme+dpu, param-nvme (stage 3)")
    parser.add_argument("--out", default=None, help="results file stem under benchmarks/results (default offload_<size>_w<W>)")
    parser.add_argument("--freeze-blocks", type=int, default=0, help="freeze the model's first N blocks (no gradient, no update)")
    parser.add_argument("--placement", action="store_true",
                        help="preset: compare shard placements (--size, default 25m; stage 3, first half of the blocks frozen, max_in_cpu = the "
                             "other half's shards, runs param-first-fit,param-bandwidth, batch 1 x 32 tokens, out "
                             "placement_<size>_w<W>)")
    malloc = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    parser.add_argument("--machine", default=f"{os.cpu_count()}-core CPU, no GPU, torch {torch.__version__}, "
                        + (f"MALLOC_MMAP_THRESHOLD_={malloc}" if malloc else "glibc malloc defaults"))
    args = parser.parse_args(argv)
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM

    if args.placement:
        args.stage, args.runs = 3, ",".join(PLACEMENT_RUNS)
        args.freeze_blocks = DNA_LM_SIZES[args.size].num_layers // 2
        args.batch, args.seq_len = 1, 32
        args.out = args.out or f"placement_{args.size}_w{args.world_size}"
    with torch.device("meta"):
        meta_model = DNADecoderLM(DNA_LM_SIZES[args.size])
        num_params = sum(p.numel() for p in meta_model.parameters())
        # Room in host memory for the shards of the blocks left trainable (elements per rank, padding
        # included): as many as the frozen blocks hold, so first-fit (largest, then earliest first)
        # fills it with frozen shards.
        args.max_in_cpu = sum(-(-p.numel() // args.world_size) for p in meta_model.blocks[args.freeze_blocks:].parameters())
    from zerofx.runtime.offload import measure_nvme_bytes_per_s

    bandwidth = measure_nvme_bytes_per_s(args.nvme_path)
    stem_name = args.out or f"offload_{args.size}_w{args.world_size}"
    result: dict[str, Any] = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "num_params": num_params,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "nvme_read_bytes_per_s": bandwidth[0], "nvme_write_bytes_per_s": bandwidth[1], "runs": {}}
    for kind in args.runs.split(","):
        shutil.rmtree(args.nvme_path, ignore_errors=True)
        spec = {"kind": kind, "size": args.size, "stage": args.stage, "steps": args.steps, "warmup": args.warmup,
                "batch": args.batch, "seq_len": args.seq_len, "buffer_count": args.buffer_count, "nvme_path": str(args.nvme_path),
                "bandwidth": bandwidth, "freeze_blocks": args.freeze_blocks, "max_in_cpu": args.max_in_cpu}
        print(f"[bench_offload] {kind} ...", file=sys.stderr, flush=True)
        result["runs"][kind] = run_config(spec, args.world_size)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{stem_name}.json").write_text(json.dumps(result, indent=1))  # partial, so far
    shutil.rmtree(args.nvme_path, ignore_errors=True)
    text = render(result)
    write_result(RESULTS / stem_name, result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
