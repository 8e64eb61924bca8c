"""Predictions checked against measurements: the planner's step time and peak memory per rank,
from a profile ``zerofx calibrate`` measured on this machine, against real gloo ranks.

    python -m benchmarks.bench_predictions                       # calibrate, then every configuration
    python -m benchmarks.bench_predictions --profile prof.json   # reuse a calibration
    python -m benchmarks.bench_predictions --smoke               # tiny model, two configurations (CI)

For each configuration (a model size, a world size and a DeepSpeed-style config: ZeRO stage,
``zerofx.sequence_parallel``, ``offload_optimizer``, ``zerofx.tiling``) it writes the config to a
file and

- predicts: runs ``zerofx plan SIZE --config FILE --profile PROFILE --seq-len T --format json``
  in this process (the CLI's own ``main``), and reads the estimated step (``summary.step_s``) and
  the predicted peak resident memory of a rank (``memory.process_peak_bytes``: the memory
  timeline's peak plus the profile's runtime baseline; NOTE [What a rank's resident memory
  holds] in ``cost_models/memory.py``);
- measures: starts the config's ranks (one process and one thread each, gloo over loopback),
  builds the model on the meta device, ``zerofx.initialize`` with the same config, runs
  ``--warmup`` steps and then ``--steps`` timed steps (a barrier before each; the slowest rank's
  wall time), and reads each rank's peak resident set size (``VmHWM``) after the last step.

It reports the median step with its quartiles, the largest rank's peak, both ratios (predicted
over measured) and whether each is within its target (step 15%, peak 10%). One configuration
runs at a time, so its ranks have the machine's cores to themselves.

Every process (the calibration's ranks too) runs with ``MALLOC_MMAP_THRESHOLD_``
(``--malloc-mmap-threshold``, default 256 KiB), as the other memory benchmarks here do: with
glibc's dynamic default, freed tensors under 32 MiB stay in a fragmented heap, and a rank's
resident set grows from step to step by what the allocator keeps rather than what the step holds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from zerofx.common.rank_processes import rank_start
from benchmarks.report import human_bytes, machine, profile_allocator_mismatch, set_malloc_mmap_threshold

STEP_TARGET = 0.15  # |predicted / measured - 1| at most this for the step time
PEAK_TARGET = 0.10  # and this for the peak resident memory
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Case:
    """One configuration: ``name`` labels the row; ``zerofx`` and ``zero`` are merged into the
    config's ``zerofx`` and ``zero_optimization`` sections."""

    name: str
    size: str
    world_size: int
    stage: int
    seq_len: int
    batch: int = 1
    accumulation: int = 1
    zero: dict[str, Any] = field(default_factory=dict)
    zerofx: dict[str, Any] = field(default_factory=dict)

    def config(self, profile: str) -> dict[str, Any]:
        """The DeepSpeed-style config that both ``zerofx plan`` and the ranks read."""
        return {"train_micro_batch_size_per_gpu": self.batch, "gradient_accumulation_steps": self.accumulation,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": self.stage, **self.zero},
                "zerofx": {"world_size": self.world_size, "profile": profile, **self.zerofx}}


SP2 = {"sequence_parallel": {"size": 2, "attention": "ulysses"}}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
TILING = {"tiling": {"enabled": True}}
# Compiled by Inductor, with the fused update (NOTE [Fused kernels under Inductor] in cost_models/compute.py).
INDUCTOR = {"compile": "inductor", "fused_optimizer": True}
CASES = (
    Case("25m W2 stage 2", "25m", 2, 2, 256),
    Case("25m W2 stage 3", "25m", 2, 3, 256),
    Case("25m W2 stage 3 offload", "25m", 2, 3, 256, zero=OFFLOAD),
    Case("25m W2 stage 3 tiling", "25m", 2, 3, 256, zerofx=TILING),
    Case("25m W4 stage 3", "25m", 4, 3, 256),
    Case("25m W4 stage 3 SP2", "25m", 4, 3, 256, zerofx=SP2),
    Case("25m W2 stage 2 T1024 accum 2", "25m", 2, 2, 1024, accumulation=2),
    Case("25m W2 stage 2 T1024 B2 tiling", "25m", 2, 2, 1024, batch=2, zerofx=TILING),
    Case("25m W2 stage 3 T1024 B2 recompute", "25m", 2, 3, 1024, batch=2, zerofx={"recompute": True}),
    Case("100m W2 stage 3", "100m", 2, 3, 128),
    Case("100m W2 stage 2 offload", "100m", 2, 2, 128, zero=OFFLOAD),
    Case("100m W4 stage 3", "100m", 4, 3, 128),
    Case("100m W4 stage 3 SP2 tiling", "100m", 4, 3, 128, zerofx={**SP2, **TILING}),
    Case("25m W2 stage 3 inductor", "25m", 2, 3, 256, zerofx=INDUCTOR),
    Case("25m W2 stage 2 T1024 accum 2 inductor", "25m", 2, 2, 1024, accumulation=2, zerofx=INDUCTOR),
)
SMOKE_CASES = (
    Case("tiny W2 stage 3", "tiny", 2, 3, 64),
    Case("tiny W2 stage 2 SP2 offload", "tiny", 2, 2, 64, zero=OFFLOAD, zerofx=SP2),
)


# --------------------------------------------------------------------------- prediction
def predict(case: Case, config_path: Path, profile: str) -> dict[str, Any]:
    """What ``zerofx plan --config FILE --profile PROFILE --format json`` says for ``case``."""
    from zerofx.app.cli import main as zerofx_main

    argv = ["plan", case.size, "--config", str(config_path), "--profile", profile, "--seq-len", str(case.seq_len),
            "--format", "json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = zerofx_main(argv)
    if code != 0:
        raise RuntimeError(f"zerofx {shlex.join(argv)} exited with {code}")
    data = json.loads(out.getvalue())
    # With accumulation, the optimizer step's (NOTE [An optimizer step of several micro-batches]).
    return {"command": "zerofx " + shlex.join(argv), "step_s": data["summary"]["optimizer_step_s"],
            "compute_s": data["summary"]["compute_s"], "exposed_comm_s": data["summary"]["exposed_comm_s"],
            "optimizer_s": data["summary"].get("optimizer_s"), "timeline_peak_bytes": data["memory"]["peak_bytes"],
            "process_peak_bytes": data["memory"]["process_peak_bytes"]}


# --------------------------------------------------------------------------- measurement
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, case: Case, config: dict[str, Any], port: int, warmup: int, steps: int, out_dir: str) -> None:
    """One rank: build on meta, initialize, step; write its step times and peak RSS."""
    import faulthandler
    import gc

    import torch
    import torch.distributed as dist

    import zerofx
    from zerofx.common.rss import current_rss_bytes, peak_rss_bytes
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM

    faulthandler.enable(all_threads=True)  # a native crash prints every thread's Python stack
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=case.world_size)
    runtime_rss = current_rss_bytes()
    sp = config["zerofx"].get("sequence_parallel", {}).get("size", 1)
    # The ranks of a sequence group pass the same batch; groups differ.
    gen = torch.Generator().manual_seed(1000 + rank // sp)
    # One list of micro-batches per optimizer step.
    batches = [[torch.randint(0, 5, (case.batch, case.seq_len), generator=gen) for _ in range(case.accumulation)]
               for _ in range(warmup + steps)]  # (B, T) each
    with torch.device("meta"):
        model = DNADecoderLM(DNA_LM_SIZES[case.size])
    first = batches[0][0]
    engine = zerofx.initialize(model, config, example_inputs=(first,), example_kwargs={"labels": first}, init_seed=0)
    setup_peak = peak_rss_bytes()
    times = []
    for micro_batches in batches:
        dist.barrier()
        start = time.perf_counter()
        for ids in micro_batches:
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
        loss.item()
        times.append(time.perf_counter() - start)
    result = {"rank": rank, "step_s": times, "peak_rss_bytes": peak_rss_bytes(), "setup_peak_rss_bytes": setup_peak,
              "runtime_rss_bytes": runtime_rss}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # The engine and its groups go while the interpreter is whole: gloo work still referenced at
    # interpreter exit is destroyed during finalization, which can abort a rank (SIGABRT,
    # "terminate called without an active exception", seen once in CI on this benchmark's smoke run).
    engine.close()
    del engine, loss
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def measure(case: Case, config: dict[str, Any], *, warmup: int, steps: int) -> dict[str, Any]:
    """Run ``case`` on its ranks; the slowest rank's time per step and the largest peak."""
    with tempfile.TemporaryDirectory() as out_dir:
        start = rank_start(__name__)  # NOTE [Ranks forked from a server that imported torch] in zerofx/common/rank_processes.py
        mp.start_processes(start.target(_rank), args=(case, config, _free_port(), warmup, steps, out_dir), nprocs=case.world_size,
                           start_method=start.method)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(case.world_size)]
    walls = [max(r["step_s"][i] for r in ranks) for i in range(warmup + steps)][warmup:]
    q1, median, q3 = statistics.quantiles(walls, n=4) if len(walls) > 1 else [walls[0]] * 3
    return {"step_s": statistics.median(walls), "step_p25_s": q1, "step_p75_s": q3, "step_all_s": walls,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "peak_rss_per_rank_bytes": [r["peak_rss_bytes"] for r in ranks],
            "setup_peak_rss_bytes": max(r["setup_peak_rss_bytes"] for r in ranks),
            "runtime_rss_bytes": max(r["runtime_rss_bytes"] for r in ranks)}


# --------------------------------------------------------------------------- the run
def row_for(case: Case, predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    step_ratio = predicted["step_s"] / measured["step_s"]
    peak_ratio = predicted["process_peak_bytes"] / measured["peak_rss_bytes"]
    return {"case": asdict(case), "name": case.name, "predicted": predicted, "measured": measured,
            "step_ratio": step_ratio, "peak_ratio": peak_ratio,
            "step_within": abs(step_ratio - 1) <= STEP_TARGET, "peak_within": abs(peak_ratio - 1) <= PEAK_TARGET}


def calibrate_profile(out: Path, log: Any, *, world_size: int = 2, smoke: bool = False) -> Path:
    """``zerofx calibrate --world-size N --out OUT``; for the smoke run, fewer repeats and message
    sizes. Each world size gets its own profile: gloo's collectives among 4 ranks on 2 cores take
    3 times the per-step latency of 2 ranks' (NOTE [One core's rates with more ranks than cores] in
    zerofx/app/calibrate.py keeps the compute rates one core's either way)."""
    if smoke:
        from zerofx.app.calibrate import calibrate

        calibrate(out, world_size=world_size, repeats=2, sizes=(2**12, 2**16, 2**20))
        return out
    from zerofx.app.cli import main as zerofx_main

    log(f"zerofx calibrate --world-size {world_size} --out {out}")
    with contextlib.redirect_stdout(sys.stderr):
        code = zerofx_main(["calibrate", "--world-size", str(world_size), "--out", str(out)])
    if code != 0:
        raise RuntimeError(f"zerofx calibrate exited with {code}")
    return out


def run(cases: Sequence[Case], profiles: dict[int, Path], *, warmup: int, steps: int, work_dir: Path, log: Any) -> list[dict[str, Any]]:
    """Each case predicted with the profile calibrated at its world size, then measured."""
    rows = []
    for case in cases:
        profile = profiles[case.world_size]
        config = case.config(str(profile))
        config_path = work_dir / (case.name.replace(" ", "_") + ".json")
        config_path.write_text(json.dumps(config, indent=1))
        start = time.perf_counter()
        predicted = predict(case, config_path, str(profile))
        measured = measure(case, config, warmup=warmup, steps=steps)
        row = {**row_for(case, predicted, measured), "profile": str(profile)}
        rows.append(row)
        log(f"{case.name}: step predicted {predicted['step_s']:.3f} s, measured {measured['step_s']:.3f} s "
            f"(x{row['step_ratio']:.2f}); peak predicted {human_bytes(predicted['process_peak_bytes'])}, measured "
            f"{human_bytes(measured['peak_rss_bytes'])} (x{row['peak_ratio']:.2f}); {time.perf_counter() - start:.0f} s")
    return rows


def _profile_record(path: Path) -> dict[str, Any]:
    prof = json.loads(path.read_text())
    return {"path": str(path), "comm": prof["comm"], "device": prof["device"]}


def _tokens_per_rank(case: dict[str, Any]) -> str:
    """A row's tokens per rank per optimizer step: micro-batch x sequence, x accumulation steps."""
    accumulation = case.get("accumulation", 1)
    return f"{case['batch']}×{case['seq_len']}" + (f" ×{accumulation} micro" if accumulation > 1 else "")


def render(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}, gloo on CPU, one thread per rank.",
             f"Command: `{result['command']}`", ""]
    for world_size, prof in sorted(result["profiles"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"Profile for {world_size} ranks `{prof['path']}`: {prof['device']['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s matmul, "
                     f"{prof['device']['memory_bytes_per_s'] / 1e9:.2f} GB/s memory per core, {prof['device'].get('cores')} cores, "
                     f"runtime baseline {human_bytes(prof['device'].get('runtime_bytes') or 0)} per rank; "
                     f"gloo ring step {prof['comm']['intra_alpha_s'] * 1e6:.0f} us, {prof['comm']['intra_bandwidth'] / 1e9:.2f} GB/s.")
    lines += [f"{result['warmup']} warm-up steps, then {result['steps']} measured; "
             + (f"MALLOC_MMAP_THRESHOLD_={result['malloc_mmap_threshold']}" if result.get("malloc_mmap_threshold") else "glibc malloc defaults")
             + f"; load average at the end {result['load_average'][0]:.1f}; targets: step within "
             f"{STEP_TARGET:.0%}, peak within {PEAK_TARGET:.0%}.", "",
             "| config | tokens/rank | predicted step s | measured step s [q1–q3] | ratio | predicted peak | measured peak RSS | ratio | within |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c, p, ms = r["case"], r["predicted"], r["measured"]
        within = "yes" if r["step_within"] and r["peak_within"] else (
            "step: no" if not r["step_within"] and r["peak_within"] else "peak: no" if r["step_within"] else "no")
        lines.append(f"| {r['name']} | {_tokens_per_rank(c)} | {p['step_s']:.3f} | {ms['step_s']:.3f} "
                     f"[{ms['step_p25_s']:.3f}–{ms['step_p75_s']:.3f}] | {r['step_ratio']:.2f} | {human_bytes(p['process_peak_bytes'])} "
                     f"| {human_bytes(ms['peak_rss_bytes'])} | {r['peak_ratio']:.2f} | {within} |")
    n = len(result["rows"])
    lines += ["", f"Within target: step {sum(r['step_within'] for r in result['rows'])} of {n}, "
                  f"peak {sum(r['peak_within'] for r in result['rows'])} of {n}."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_predictions", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, default=None,
                   help="a profile from zerofx calibrate to reuse for every configuration (default: run zerofx calibrate "
                        "first at each configuration's world size, into the output folder as <out>_profile_w<N>.json)")
    p.add_argument("--only", default=None, help="comma-separated substrings: run only the configurations whose name holds one")
    p.add_argument("--warmup", type=int, default=None, help="steps run first and left out of the timing (default 2; 1 with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per configuration (default 5; 2 with --smoke)")
    p.add_argument("--smoke", action="store_true", help="the tiny model, two configurations, a few steps: the report's shape, in seconds")
    p.add_argument("--malloc-mmap-threshold", default="256KiB",
                   help="glibc M_MMAP_THRESHOLD for every process (MALLOC_MMAP_THRESHOLD_), so freed tensors return to the "
                        "OS instead of fragmenting the heap; 0 keeps glibc's dynamic default (default 256KiB)")
    p.add_argument("--out", type=Path, default=None,
                   help="output path without extension: writes .md and .json (default benchmarks/results/predictions_<date>; "
                        "with --smoke, a temporary folder)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    cases = SMOKE_CASES if args.smoke else CASES
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        cases = tuple(c for c in cases if any(k in c.name for k in keys))
        if not cases:
            raise SystemExit(f"--only {args.only!r} matches no configuration")
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    steps = args.steps if args.steps is not None else (2 if args.smoke else 5)
    if warmup < 0 or steps < 1:
        raise SystemExit("--warmup needs an integer >= 0 and --steps >= 1")
    threshold = set_malloc_mmap_threshold(args.malloc_mmap_threshold)
    if args.profile and (mismatch := profile_allocator_mismatch(args.profile, threshold)):
        raise SystemExit(f"bench_predictions: {mismatch}")
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        out = args.out or (work / "predictions" if args.smoke else RESULTS / f"predictions_{time.strftime('%Y-%m-%d')}")
        sizes = sorted({c.world_size for c in cases})
        profiles = {n: args.profile or calibrate_profile(out.with_name(f"{out.name}_profile_w{n}.json"), log, world_size=n, smoke=args.smoke)
                    for n in sizes}
        rows = run(cases, profiles, warmup=warmup, steps=steps, work_dir=work, log=log)
        command = "python -m benchmarks.bench_predictions " + shlex.join(sys.argv[1:] if argv is None else list(argv))
        result = {"machine": machine(), "command": command.strip(), "load_average": os.getloadavg(), "warmup": warmup, "steps": steps,
                  "malloc_mmap_threshold": threshold or None,
                  "profiles": {str(n): _profile_record(path) for n, path in profiles.items()}, "rows": rows}
        text = render(result)
        out.with_suffix(".md").write_text(text)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
