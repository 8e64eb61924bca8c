"""The chosen plan under a per-rank memory cap: zerofx ``auto`` against a grid of hand zerofx
configurations and against FSDP2 with and without activation checkpointing, in one interleaved
run, at the same global batch.

    python -m benchmarks.bench_capped                 # 25m DNA LM, 2 ranks, 4 x 1024 tokens per step, cap below FSDP2's
    python -m benchmarks.bench_capped --cap 1GiB      # a cap given in bytes
    python -m benchmarks.bench_capped --smoke         # the tiny model, one round (CI; well under a minute)

What runs, in this order:

1. **Baseline.** An idle rank: Python, torch, zerofx and the benchmark imported, the gloo group
   joined, one all-reduce done. Its peak RSS is the runtime's, which no plan can save.
2. **The cap.** ``--cap`` in bytes, or by default ``below-fsdp2``: FSDP2 without checkpointing at
   micro-batch 1 runs first, for two steps, and the cap is its peak RSS less ``--cap-margin``, so
   that FSDP2 needs activation checkpointing to fit (NOTE [A cap where FSDP2 needs activation
   checkpointing]).
3. **The search.** ``zerofx.planner.autoplan.search``, what ``zerofx plan --auto`` runs, for a
   device budget of ``--cap`` less that baseline (NOTE [From an RSS cap to a device budget]),
   with ``"zerofx": {"recompute": "auto"}`` in the base config, so that every candidate may
   recompute activations to fit. Its choice is the ``auto`` configuration.
4. **FSDP2 probes.** ``fsdp2`` (``fully_shard`` per block and the root) and ``fsdp2_ac`` (the same
   with each block checkpointed first): micro-batches tried from 1 upwards, each in fresh ranks
   for two steps, one probe at a time; the largest whose peak RSS stays under the cap is the
   configuration that enters the rounds. A variant none of whose micro-batches fits keeps its
   probe row, marked as not fitting. With ``--compiled`` also ``fsdp2_compile`` and
   ``fsdp2_ac_compile`` (each block under ``torch.compile``, fused AdamW).
5. **Rounds.** Every configuration (``auto``, with ``--compiled`` auto's configuration compiled
   by Inductor with fused AdamW, the hand grid, the fitting FSDP2 ones) runs once
   per round, in fresh ranks, so its peak RSS is its own; round r starts at the r-th
   configuration, so a noisy minute on a shared machine hits every configuration alike.

Every configuration trains the same freshly seeded model on the same tokens: the global batch
(``--global-batch`` sequences of ``--seq-len`` tokens) is split over the ranks and then into
micro-batches, with gradient accumulation making up the rest. One thread per rank; fp32 AdamW.

A rank whose resident set passes ``--hard-limit`` is stopped at once (a watchdog thread), and
its configuration is reported as not fitting: the runs cannot exhaust the machine. Every rank
runs with ``MALLOC_MMAP_THRESHOLD_`` (``--malloc-mmap-threshold``), so freed tensors go back to
the OS and peak RSS follows the live tensors, as in ``bench_long_context``.

Writes markdown and JSON to ``--out`` (default ``benchmarks/results/capped_<today>``).

NOTE [From an RSS cap to a device budget]
The search predicts device memory: the memory timeline's peak of model state, activations and
transient buffers. A rank's RSS also holds the runtime: the interpreter, torch's and gloo's
libraries and buffers, zerofx's own modules. That part does not depend on the plan, so the
device budget given to the search is the cap less the measured peak RSS of an idle rank. What
the runtime adds later (the autograd engine's and the allocator's own state, the model built
before it is sharded) is not in the baseline, so a plan predicted to fill the budget exactly
can still pass the cap: the runs measure it, and ``fits`` is the measured peak against the cap.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue as queue_mod
import shlex
import socket
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.report import human_bytes, machine, profile_allocator_mismatch, set_malloc_mmap_threshold  # noqa: E402
from zerofx.common.rank_processes import rank_start  # noqa: E402

GIB = 2**30
MIB = 2**20
TARGET_VS_HAND = 0.95
TARGET_VS_FSDP2 = 1.3
CAP_BELOW_FSDP2 = "below-fsdp2"
FSDP2_SYSTEMS = ("fsdp2", "fsdp2_ac")
# With --compiled: FSDP2 with each block under torch.compile (Inductor) and fused AdamW, with and
# without checkpointing, beside auto's configuration run with zerofx's Inductor and fused AdamW.
COMPILED_FSDP2_SYSTEMS = ("fsdp2_compile", "fsdp2_ac_compile")
COMPILED_ZEROFX = {"zerofx": {"compile": "inductor", "fused_optimizer": True}}
AUTO_ROWS = ("auto", "auto_compiled", "auto_eager")  # auto and its configuration the other way (--compiled)
LR = 1e-3


@dataclass(frozen=True)
class RunConfig:
    """One configuration of the job: a zerofx config (``zerofx``) or an FSDP2 variant, with its
    micro-batch and accumulation steps (micro x accumulation x ranks = the global batch)."""

    name: str
    system: str  # "zerofx", or one of FSDP2_SYSTEMS and COMPILED_FSDP2_SYSTEMS
    micro_batch: int
    accumulation: int
    zerofx: dict[str, Any] = field(default_factory=dict)  # the zerofx config, without the batch keys
    label: str = ""

    def describe(self) -> str:
        return self.label or self.name

    @property
    def sequence_parallel(self) -> int:
        """The ranks that share each sequence (``zerofx.sequence_parallel.size``; 1 without)."""
        return int(self.zerofx.get("zerofx", {}).get("sequence_parallel", {}).get("size", 1))


# The hand grid: (name, stage, micro-batch per rank, extra config). Each runs at the global batch,
# with accumulation making up the rest.
HAND_GRID: tuple[tuple[str, int, int, dict[str, Any]], ...] = (
    ("z2_m1", 2, 1, {}),
    ("z3_m1", 3, 1, {}),
    ("z3_m2", 3, 2, {}),
    ("z3_m1_rc", 3, 1, {"zerofx": {"recompute": True}}),
    ("z3_m2_rc", 3, 2, {"zerofx": {"recompute": True}}),
    ("z3_m2_tile", 3, 2, {"zerofx": {"tiling": {"enabled": True}}}),
    ("z3_m1_offload", 3, 1, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
    ("z0_m2_offload", 0, 2, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
)


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _hand_label(stage: int, micro: int, accumulation: int, extra: dict[str, Any]) -> str:
    parts = [f"stage {stage}", f"micro {micro} x {accumulation}"]
    z = extra.get("zerofx", {})
    if z.get("recompute"):
        parts.append(f"recompute {z['recompute']}")
    if z.get("tiling", {}).get("enabled"):
        parts.append(f"tiling {z['tiling']['enabled']}")
    if "offload_optimizer" in extra.get("zero_optimization", {}):
        parts.append("offload cpu")
    return ", ".join(parts)


def hand_grid(per_rank: int, names: tuple[str, ...] | None = None) -> list[RunConfig]:
    """The hand configurations whose micro-batch divides the sequences each rank takes per step."""
    out = []
    for name, stage, micro, extra in HAND_GRID:
        if (names is not None and name not in names) or per_rank % micro:
            continue
        config = _merged({"zero_optimization": {"stage": stage}}, extra)
        out.append(RunConfig(name, "zerofx", micro, per_rank // micro, config, _hand_label(stage, micro, per_rank // micro, extra)))
    return out


# ---------------------------------------------------------------------------------------------
# Ranks


def _watchdog(limit_bytes: int, rank: int, queue: Any) -> None:
    """Stop this rank once its resident set passes ``limit_bytes`` (polled every 20 ms)."""
    from zerofx.common.rss import current_rss_bytes

    while True:
        rss = current_rss_bytes()
        if rss > limit_bytes:
            queue.put((rank, "over", f"resident set {human_bytes(rss)} passed the hard limit {human_bytes(limit_bytes)}"))
            queue.close()
            queue.join_thread()
            os._exit(3)
        time.sleep(0.02)


def _init(rank: int, world_size: int, port: int, args: dict[str, Any], queue: Any) -> None:
    torch.set_num_threads(1)
    threading.Thread(target=_watchdog, args=(args["hard_limit"], rank, queue), daemon=True).start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def _baseline_rank(rank: int, world_size: int, port: int, args: dict[str, Any], queue: Any) -> None:
    """An idle rank: the imports every run makes, the group joined, one all-reduce."""
    from zerofx.common.rss import current_rss_bytes, peak_rss_bytes

    _init(rank, world_size, port, args, queue)
    try:
        import zerofx  # noqa: F401
        from benchmarks import systems  # noqa: F401
        from zerofx.models import DNADecoderLM  # noqa: F401

        dist.all_reduce(torch.ones(1024))
        dist.barrier()
        queue.put((rank, "ok", {"peak_rss_bytes": peak_rss_bytes(), "rss_bytes": current_rss_bytes()}))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def batch_ids(args: dict[str, Any], rank: int, step: int, sequence_parallel: int = 1) -> torch.Tensor:
    """This rank's sequences of optimizer step ``step``, seeded random bases: (per_rank, seq_len),
    the same for every configuration. With sequence parallelism over S ranks the ranks of a
    sequence group pass the same whole batch, the S per-rank batches of its ranks joined: every
    configuration trains on the same sequences."""
    if sequence_parallel > 1:
        first = rank // sequence_parallel * sequence_parallel
        return torch.cat([batch_ids(args, r, step) for r in range(first, first + sequence_parallel)])  # (S * per_rank, T)
    per_rank = args["global_batch"] // args["world_size"]
    g = torch.Generator().manual_seed(args["seed"] * 1_000_003 + step * 1009 + rank)
    return torch.randint(0, 5, (per_rank, args["seq_len"]), generator=g)


class _FSDP2Runner:
    def __init__(self, model: torch.nn.Module, checkpoint: bool, compiled: bool = False) -> None:
        from benchmarks.systems import make_optimizer, shard_fsdp2

        self.model = shard_fsdp2(model, checkpoint=checkpoint, compiled=compiled)
        self.optim = make_optimizer("AdamW", LR, model.parameters(), **({"fused": True} if compiled else {}))

    def step(self, micro_batches: list[torch.Tensor]) -> float:
        self.optim.zero_grad(set_to_none=True)
        total = 0.0
        for ids in micro_batches:
            loss = self.model(ids, labels=ids).loss / len(micro_batches)
            loss.backward()
            total += loss.item()
        self.optim.step()
        return total


def _loss_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


class _ZeroFXRunner:
    def __init__(self, model: torch.nn.Module, config: dict[str, Any], example: torch.Tensor, seed: int) -> None:
        import zerofx

        self.engine = zerofx.initialize(model, config, example_inputs=(example,), example_kwargs={"labels": example}, init_seed=seed)

    def step(self, micro_batches: list[torch.Tensor]) -> float:
        total = 0.0
        for ids in micro_batches:
            loss = _loss_of(self.engine(ids, labels=ids))
            self.engine.backward(loss)
            self.engine.step()
            total += loss.item() / len(micro_batches)
        return total


def zerofx_config(run: RunConfig, world_size: int) -> dict[str, Any]:
    base = {"optimizer": {"type": "AdamW", "params": {"lr": LR}}, "steps_per_print": 1 << 30}
    batch = {"train_micro_batch_size_per_gpu": run.micro_batch, "gradient_accumulation_steps": run.accumulation,
             "train_batch_size": run.micro_batch * run.accumulation * (world_size // run.sequence_parallel)}
    return _merged(_merged(base, run.zerofx), batch)


def _train_rank(rank: int, world_size: int, port: int, args: dict[str, Any], queue: Any) -> None:
    """One rank of one run: build, ``warmup + steps`` optimizer steps, peak RSS (VmHWM)."""
    from zerofx.common.rss import current_rss_bytes, peak_rss_bytes

    _init(rank, world_size, port, args, queue)
    try:
        from benchmarks.systems import build_model
        from zerofx.models import DNA_LM_SIZES, DNADecoderLM

        run = RunConfig(**args["run"])
        start = time.perf_counter()
        if run.system == "zerofx":  # built on the meta device: each rank initializes its shard from the seed
            with torch.device("meta"):
                model = DNADecoderLM(DNA_LM_SIZES[args["size"]])
            example = torch.zeros(run.micro_batch, args["seq_len"], dtype=torch.long)
            runner: Any = _ZeroFXRunner(model, zerofx_config(run, world_size), example, args["seed"])
        else:
            runner = _FSDP2Runner(build_model(args["size"], args["seed"], torch.device("cpu")), checkpoint="_ac" in run.system,
                                  compiled=run.system.endswith("_compile"))
        setup_s = time.perf_counter() - start
        rss_before = current_rss_bytes()
        steps = []
        for i in range(args["warmup"] + args["steps"]):
            ids = batch_ids(args, rank, i, run.sequence_parallel)
            micro = list(ids.split(run.micro_batch))
            assert len(micro) == run.accumulation
            dist.barrier()
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            loss = runner.step(micro)
            steps.append((time.perf_counter() - wall0, time.thread_time() - cpu0, loss))
        queue.put((rank, "ok", {"steps": steps, "peak_rss_bytes": peak_rss_bytes(), "rss_before_steps_bytes": rss_before,
                                "setup_s": setup_s}))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class OverLimit(RuntimeError):
    """A rank passed the hard limit and was stopped."""


def run_ranks(target: Any, args: dict[str, Any], world_size: int, timeout_s: float) -> list[dict[str, Any]]:
    """Each rank's result of ``target`` on ``world_size`` fresh gloo processes. A rank that dies
    or passes the hard limit stops the others."""
    start = rank_start(target.__module__)  # NOTE [Ranks forked from a server that imported torch] in zerofx/common/rank_processes.py
    ctx = start.context
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=start.target(target), args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ranks did not finish in {timeout_s:.0f} s") from None
                continue
            if status == "over":
                raise OverLimit(f"rank {rank}: {value}")
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world_size else 1)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]


# ---------------------------------------------------------------------------------------------
# The driver


def _rank_args(opts: argparse.Namespace) -> dict[str, Any]:
    return {"size": opts.size, "seq_len": opts.seq_len, "global_batch": opts.global_batch, "world_size": opts.world_size,
            "seed": opts.seed, "warmup": opts.warmup, "steps": opts.steps, "hard_limit": opts.hard_limit_bytes}


def measure_baseline(opts: argparse.Namespace) -> dict[str, Any]:
    """The runtime's resident memory per rank: the calibrated profile's (``--profile``, NOTE [What
    a rank's resident memory holds] in cost_models/memory.py) when it records one, else an idle
    rank's peak RSS measured here."""
    if opts.profile is not None:
        from zerofx.cost_models.profiles import load_profile

        runtime = load_profile(opts.profile)[1].runtime_bytes
        if runtime > 0:
            return {"peak_rss_bytes": runtime, "rss_bytes": runtime, "from": f"the calibrated profile {opts.profile}"}
    res = run_ranks(_baseline_rank, _rank_args(opts), opts.world_size, opts.timeout)
    return {"peak_rss_bytes": max(r["peak_rss_bytes"] for r in res), "rss_bytes": max(r["rss_bytes"] for r in res),
            "from": "an idle rank: imports, gloo group joined"}


def measure(run: RunConfig, opts: argparse.Namespace, *, warmup: int | None = None, steps: int | None = None) -> dict[str, Any]:
    """One run of ``run`` in fresh ranks: its steps (slowest rank), peak RSS (largest rank)."""
    args = _rank_args(opts)
    args["run"] = {"name": run.name, "system": run.system, "micro_batch": run.micro_batch, "accumulation": run.accumulation,
                   "zerofx": run.zerofx, "label": run.label}
    if warmup is not None:
        args["warmup"] = warmup
    if steps is not None:
        args["steps"] = steps
    start = time.perf_counter()
    try:
        res = run_ranks(_train_rank, args, opts.world_size, opts.timeout)
    except OverLimit as exc:
        return {"over_hard_limit": str(exc), "wall_s": time.perf_counter() - start}
    except RuntimeError as exc:
        return {"error": str(exc)[-3000:], "wall_s": time.perf_counter() - start}
    timed = [max(r["steps"][i][0] for r in res) for i in range(args["warmup"], len(res[0]["steps"]))]
    return {"step_s": timed, "first_step_s": max(r["steps"][0][0] for r in res), "loss": res[0]["steps"][-1][2],
            "cpu_s": [statistics.fmean(r["steps"][i][1] for r in res) for i in range(args["warmup"], len(res[0]["steps"]))],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in res), "rss_before_steps_bytes": max(r["rss_before_steps_bytes"] for r in res),
            "setup_s": max(r["setup_s"] for r in res), "wall_s": time.perf_counter() - start}


def run_search(opts: argparse.Namespace, budget_bytes: float) -> tuple[Any, dict[str, Any]]:
    """The search ``zerofx plan --auto`` runs, for ``budget_bytes`` per rank, over the base config
    with ``zerofx.recompute: "auto"``; the result and the base config it searched from."""
    from zerofx.planner.autoplan import resize_inputs, search, search_space
    from zerofx.config import parse_config
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM

    from zerofx.config.options import planned_budget_bytes

    base: dict[str, Any] = {"optimizer": {"type": "AdamW", "params": {"lr": LR}},
                            "zerofx": {"auto": True, "memory_budget": int(budget_bytes), "recompute": "auto"}}
    if opts.memory_margin:  # NOTE [The memory margin] in zerofx/config/options.py
        base["zerofx"]["memory_margin"] = opts.memory_margin
    if opts.profile is not None:
        base["zerofx"]["profile"] = opts.profile
    if not opts.search_offload:  # NOTE [Host memory is in an RSS cap]
        base["zero_optimization"] = {"offload_optimizer": {"device": "none"}}
    with torch.device("meta"):
        model = DNADecoderLM(DNA_LM_SIZES[opts.size])
    per_rank = opts.global_batch // opts.world_size
    ids = torch.zeros(per_rank, opts.seq_len, dtype=torch.long)
    cfg = parse_config(base, world_size=opts.world_size)
    assert cfg.auto is not None
    space = search_space(cfg, cfg.auto, world_size=opts.world_size, seq_len=opts.seq_len, batch=per_rank)
    result = search(model, resize_inputs((ids,), {"labels": ids}), base, world_size=opts.world_size, seq_len=opts.seq_len,
                    batch=per_rank, budget_bytes=planned_budget_bytes(base["zerofx"]), space=space, fixed=cfg.auto.fixed)
    return result, base


# NOTE [Host memory is in an RSS cap]
# The search's peak is device memory less what offload keeps in host memory. On a CPU-only
# machine the host is the device: an optimizer state offloaded to "cpu" stays in the rank's
# resident set, so under an RSS cap offloading it saves nothing, while the search counts it as
# freed. By default the base config therefore keeps the optimizer state on the device
# (``offload_optimizer.device: "none"``, a key the search keeps as the config sets it);
# ``--search-offload`` leaves it to the search, and the hand grid measures offloaded
# configurations (``z3_m1_offload``, ``z0_m2_offload``) as they are.


def auto_run(result: Any, world_size: int) -> RunConfig:
    """The search's chosen config as a run (its batch keys become the run's micro-batch)."""
    config = json.loads(json.dumps(result.config))
    micro = int(config.pop("train_micro_batch_size_per_gpu"))
    accumulation = int(config.pop("gradient_accumulation_steps"))
    config.pop("train_batch_size", None)
    config.pop("optimizer", None)  # the run's own, the same for every configuration
    return RunConfig("auto", "zerofx", micro, accumulation, config, "auto: " + result.chosen.candidate.label())


def compiled_run(auto: RunConfig) -> RunConfig:
    """Auto's configuration with zerofx's Inductor compile and fused AdamW, measured beside an
    eager choice (the search prices Inductor only with a profile that measured its resident
    memory, and chose the eager step here)."""
    return RunConfig("auto_compiled", "zerofx", auto.micro_batch, auto.accumulation, _merged(auto.zerofx, COMPILED_ZEROFX),
                     "auto's configuration + Inductor and fused AdamW (the search chose it eager)")


def eager_run(auto: RunConfig) -> RunConfig:
    """Auto's configuration without Inductor and the fused update, measured beside a compiled choice."""
    config = json.loads(json.dumps(auto.zerofx))
    own = config.get("zerofx", {})
    for key in COMPILED_ZEROFX["zerofx"]:
        own.pop(key, None)
    return RunConfig("auto_eager", "zerofx", auto.micro_batch, auto.accumulation, config,
                     "auto's configuration without Inductor (the search chose it compiled)")


def counterpart_run(auto: RunConfig) -> RunConfig:
    """With --compiled: auto's configuration the other way, compiled where auto is eager, eager where it compiles."""
    return eager_run(auto) if auto.zerofx.get("zerofx", {}).get("compile") == "inductor" else compiled_run(auto)


def fsdp2_run(system: str, micro: int, per_rank: int) -> RunConfig:
    label = (f"{system}, micro {micro} x {per_rank // micro}" + (", each block checkpointed" if "_ac" in system else "")
             + (", each block under torch.compile, fused AdamW" if system.endswith("_compile") else ""))
    return RunConfig(f"{system}_m{micro}", system, micro, per_rank // micro, label=label)


def probe_fsdp2(system: str, opts: argparse.Namespace, log: Any,
                known: dict[str, dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], RunConfig | None]:
    """Micro-batches from 1 upwards, two steps each; the probes and the largest that fits.
    ``known``: runs already measured, by name."""
    per_rank = opts.global_batch // opts.world_size
    probes: list[dict[str, Any]] = []
    best = None
    for micro in [m for m in range(1, per_rank + 1) if per_rank % m == 0]:
        run = fsdp2_run(system, micro, per_rank)
        label = run.label
        out = (known or {}).get(run.name) or measure(run, opts, warmup=1, steps=1)
        fits = "peak_rss_bytes" in out and out["peak_rss_bytes"] <= opts.cap_bytes
        probe = {"name": run.name, "system": system, "micro_batch": micro, "accumulation": run.accumulation, "label": label,
                 "fits": fits, **out}
        if "step_s" in out:
            probe["tokens_per_s"] = opts.global_batch * opts.seq_len / statistics.median(out["step_s"])
        elif not fits:
            probe["failed"] = out.get("over_hard_limit") or out.get("error", "").strip().splitlines()[-1]
        probes.append(probe)
        why = out.get("over_hard_limit") or out.get("error", "").splitlines()[-1:] or ""
        log(f"probe {label}: " + (f"peak RSS {human_bytes(out['peak_rss_bytes'])}" if "peak_rss_bytes" in out else str(why))
            + f" -> {'fits' if fits else 'does not fit'} the cap {human_bytes(opts.cap_bytes)}")
        if not fits:
            break  # a larger micro-batch holds more activations
        best = run
    return probes, best


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def summarize_run(run: RunConfig, rounds: list[dict[str, Any]], opts: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in rounds if "step_s" in r]
    row: dict[str, Any] = {"name": run.name, "system": run.system, "label": run.describe(), "micro_batch": run.micro_batch,
                           "accumulation": run.accumulation, "config": run.zerofx, "rounds": rounds}
    failed = [r for r in rounds if "step_s" not in r]
    if failed:
        row["failed"] = failed[0].get("over_hard_limit") or failed[0].get("error", "").strip().splitlines()[-1]
    if not ok:
        row["fits"] = False
        return row
    tokens = opts.global_batch * opts.seq_len
    steps = [s for r in ok for s in r["step_s"]]
    q1, med, q3 = _quartiles(steps)
    peak = max(r["peak_rss_bytes"] for r in ok)
    row.update(step_s=med, step_p25_s=q1, step_p75_s=q3, tokens_per_s=tokens / med, tokens_per_s_p25=tokens / q3,
               tokens_per_s_p75=tokens / q1, round_step_s=[statistics.median(r["step_s"]) for r in ok] if not failed else
               [statistics.median(r["step_s"]) if "step_s" in r else None for r in rounds],
               cpu_s=statistics.median(c for r in ok for c in r["cpu_s"]), peak_rss_bytes=peak,
               rss_before_steps_bytes=max(r["rss_before_steps_bytes"] for r in ok), setup_s=statistics.median(r["setup_s"] for r in ok),
               loss=ok[-1]["loss"], fits=peak <= opts.cap_bytes and not failed)
    return row


def ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """a's tokens/s over b's: per round (NOTE [Ratios by round] in bench_long_context), median and
    quartiles, and the ratio of the two medians."""
    pairs = [(x, y) for x, y in zip(a["round_step_s"], b["round_step_s"]) if x is not None and y is not None]
    per_round = [y / x for x, y in pairs]
    q1, med, q3 = _quartiles(per_round)
    return {"median": med, "p25": q1, "p75": q3, "rounds": per_round, "of_medians": a["tokens_per_s"] / b["tokens_per_s"]}


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_name = {r["name"]: r for r in rows}
    auto = by_name.get("auto")
    out: dict[str, Any] = {"vs_hand_target": TARGET_VS_HAND, "vs_fsdp2_target": TARGET_VS_FSDP2}
    hand = [r for r in rows if r["system"] == "zerofx" and r["name"] not in AUTO_ROWS and r.get("fits")]
    fsdp = [r for r in rows if r["system"] in FSDP2_SYSTEMS and r.get("fits") and "round_step_s" in r]
    out["auto_fits"] = bool(auto and auto.get("fits"))
    if hand:
        best = max(hand, key=lambda r: r["tokens_per_s"])
        out["best_hand"] = best["name"]
    if fsdp:
        best_f = max(fsdp, key=lambda r: r["tokens_per_s"])
        out["best_fsdp2"] = best_f["name"]
    if auto is not None and "round_step_s" in auto:
        if hand:
            out["vs_hand"] = ratio(auto, best)
            out["vs_hand_met"] = out["auto_fits"] and out["vs_hand"]["median"] >= TARGET_VS_HAND
        if fsdp:
            out["vs_fsdp2"] = ratio(auto, best_f)
            out["vs_fsdp2_met"] = out["auto_fits"] and out["vs_fsdp2"]["median"] >= TARGET_VS_FSDP2
    fsdp_compiled = [r for r in rows if r["system"] in COMPILED_FSDP2_SYSTEMS and r.get("fits") and "round_step_s" in r]
    if auto is not None and "round_step_s" in auto and fsdp_compiled:
        best_c = max(fsdp_compiled, key=lambda r: r["tokens_per_s"])
        out["vs_fsdp2_compiled"] = {**ratio(auto, best_c), "against": best_c["name"]}
    compiled = by_name.get("auto_compiled")
    if compiled is not None and "round_step_s" in compiled:
        out["compiled_fits"] = bool(compiled.get("fits"))
        for key, pool in (("compiled_vs_fsdp2", fsdp), ("compiled_vs_fsdp2_compiled", fsdp_compiled)):
            if pool:
                best_c = max(pool, key=lambda r: r["tokens_per_s"])
                out[key] = {**ratio(compiled, best_c), "against": best_c["name"]}
    return out


def run(opts: argparse.Namespace, log: Any = print, save: Any = None) -> dict[str, Any]:
    started = time.perf_counter()
    loads = [os.getloadavg()]
    result: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(), "command": opts.command,
                              "options": {k: v for k, v in vars(opts).items() if k not in ("out", "command")}, "load_average": loads}
    baseline = measure_baseline(opts)
    known: dict[str, dict[str, Any]] = {}
    if opts.cap == CAP_BELOW_FSDP2:
        # NOTE [A cap where FSDP2 needs activation checkpointing]
        # FSDP2 without checkpointing at micro-batch 1 is measured first, without a cap; the cap
        # is its peak RSS less --cap-margin, so that FSDP2 needs checkpointing to fit, by
        # construction, and every other configuration is judged against that cap.
        first = fsdp2_run("fsdp2", 1, opts.global_batch // opts.world_size)
        known[first.name] = measure(first, opts, warmup=1, steps=1)
        if "peak_rss_bytes" not in known[first.name]:
            raise SystemExit(f"{first.label} did not run: {known[first.name]}")
        opts.cap_bytes = known[first.name]["peak_rss_bytes"] - opts.cap_margin_bytes
        result["options"]["cap_bytes"] = opts.cap_bytes
        log(f"cap: {first.label} peaks at {human_bytes(known[first.name]['peak_rss_bytes'])} per rank; the cap is "
            f"{human_bytes(opts.cap_margin_bytes)} less, {human_bytes(opts.cap_bytes)}")
    budget = opts.cap_bytes - baseline["peak_rss_bytes"]
    result["baseline"] = baseline
    result["budget_bytes"] = budget
    log(f"baseline: idle rank peak RSS {human_bytes(baseline['peak_rss_bytes'])}; device budget {human_bytes(budget)} "
        f"= cap {human_bytes(opts.cap_bytes)} - baseline")
    if budget <= 0:
        raise SystemExit(f"the cap {human_bytes(opts.cap_bytes)} is below the runtime's own {human_bytes(baseline['peak_rss_bytes'])}")
    if opts.probe_only:
        systems = FSDP2_SYSTEMS + (COMPILED_FSDP2_SYSTEMS if opts.compiled else ())
        result["probes"] = [p for system in systems for p in probe_fsdp2(system, opts, log, known)[0]]
        return result
    search_result, base = run_search(opts, budget)
    from zerofx.app.commands.plan_auto import format_auto_plan

    search_text = format_auto_plan(search_result, label=opts.size)
    log(search_text)
    result["search"] = {"base_config": base, "text": search_text, "result": json.loads(search_result.to_json())}
    if search_result.chosen is None:
        raise SystemExit("the search found nothing that fits the budget; raise --cap")
    auto = auto_run(search_result, opts.world_size)
    runs = [auto, *([counterpart_run(auto)] if opts.compiled else []), *hand_grid(opts.global_batch // opts.world_size, opts.grid)]
    probes: list[dict[str, Any]] = []
    for system in FSDP2_SYSTEMS + (COMPILED_FSDP2_SYSTEMS if opts.compiled else ()):
        found, best = probe_fsdp2(system, opts, log, known)
        probes += found
        if best is not None:
            runs.append(best)
    result["probes"] = probes
    raw: dict[str, list[dict[str, Any]]] = {r.name: [] for r in runs}
    for k in range(opts.rounds):
        order = runs[k % len(runs):] + runs[: k % len(runs)]
        for run_ in order:
            if raw[run_.name] and "step_s" not in raw[run_.name][-1]:
                continue  # it failed or passed the hard limit: not run again
            out = measure(run_, opts)
            raw[run_.name].append(out)
            loads.append(os.getloadavg())
            what = (f"steps {[round(s, 2) for s in out['step_s']]} s, peak RSS {human_bytes(out['peak_rss_bytes'])}"
                    if "step_s" in out else (out.get("over_hard_limit") or out.get("error", "").strip().splitlines()[-1]))
            log(f"round {k + 1}/{opts.rounds} {run_.describe()}: {what} ({out['wall_s']:.0f} s with setup; load {loads[-1][0]:.1f})")
        rows = [summarize_run(r, raw[r.name], opts) for r in runs]
        result.update(rows=rows, targets=targets(rows), rounds_done=k + 1, elapsed_s=time.perf_counter() - started)
        if save is not None:
            save(result)
    return result


# ---------------------------------------------------------------------------------------------
# The report


def _row_line(r: dict[str, Any], cap: int) -> str:
    head = f"| {r['label']} |"
    if "tokens_per_s" not in r:
        why = r.get("failed") or r.get("over_hard_limit") or r.get("error", "").strip().splitlines()[-1:] or ""
        return f"{head} — | — | — | no: {str(why).replace('|', '/')} |"
    peak = human_bytes(r["peak_rss_bytes"])
    if r["fits"]:
        fits = "yes"
    else:
        fits = "no: " + (r["failed"].replace("|", "/") if r.get("failed") else f"over the cap by {human_bytes(r['peak_rss_bytes'] - cap)}")
    if "tokens_per_s_p25" not in r:  # a probe: one timed step
        return f"{head} {r['tokens_per_s']:.0f} | {statistics.median(r['step_s']):.2f} | {peak} | {fits} |"
    return (f"{head} {r['tokens_per_s']:.0f} [{r['tokens_per_s_p25']:.0f}–{r['tokens_per_s_p75']:.0f}] | "
            f"{r['step_s']:.2f} [{r['step_p25_s']:.2f}–{r['step_p75_s']:.2f}] | {peak} | {fits} |")


def _prediction_lines(result: dict[str, Any]) -> list[str]:
    """The search's predicted step and peak for its choice against the auto row's measured ones."""
    chosen = result.get("search", {}).get("result", {}).get("chosen")
    auto = next((r for r in result.get("rows", []) if r["name"] == "auto" and "step_s" in r), None)
    if not chosen or auto is None:
        return []
    peak = chosen["peak_bytes"] + result["baseline"]["peak_rss_bytes"]
    return [f"- auto's prediction: step {chosen['step_s']:.2f} s against {auto['step_s']:.2f} s measured (median; ratio "
            f"{chosen['step_s'] / auto['step_s']:.2f}), peak {human_bytes(peak)} with the baseline against {human_bytes(auto['peak_rss_bytes'])} "
            f"measured (largest over the rounds; ratio {peak / auto['peak_rss_bytes']:.2f})."]


def markdown(result: dict[str, Any]) -> str:
    o, m = result["options"], result["machine"]
    load = result["load_average"]
    tokens = o["global_batch"] * o["seq_len"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}, gloo on CPU, one thread per rank; "
        f"run {result['date']}; load average (1 min) from {min(x[0] for x in load):.1f} to {max(x[0] for x in load):.1f}.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"DNA LM {o['size']}, {o['world_size']} ranks, global batch {o['global_batch']} sequences of {o['seq_len']} tokens "
        f"({tokens:,} tokens per optimizer step), fp32 AdamW lr {LR:g}; cap {human_bytes(o['cap_bytes'])} peak RSS (VmHWM) per rank; "
        f"{result.get('rounds_done', 0)} interleaved round(s) of {o['warmup']} untimed + {o['steps']} timed step(s), each run in "
        f"fresh ranks; MALLOC_MMAP_THRESHOLD_ {o['malloc_mmap_threshold']}.",
        "",
        f"Baseline ({result['baseline'].get('from', 'an idle rank: imports, gloo group joined')}): peak RSS "
        f"{human_bytes(result['baseline']['peak_rss_bytes'])}. "
        f"Device budget given to the search: {human_bytes(result['budget_bytes'])} = the cap less the baseline"
        + (f", of which the search fits its predicted peak to {1 - margin:.0%} (zerofx.memory_margin {margin:g})."
           if (margin := result["options"].get("memory_margin", 0)) else "."),
        "",
        "| configuration | tokens/s (median [p25–p75]) | step s (median [p25–p75]) | peak RSS / rank | fits the cap |",
        "|---|---|---|---|---|",
    ]
    lines += [_row_line(r, o["cap_bytes"]) for r in result.get("rows", [])]
    measured = {r["name"] for r in result.get("rows", [])}
    lines += [_row_line({**p, "label": p["label"] + " (probe, 2 steps)"}, o["cap_bytes"]) for p in result.get("probes", [])
              if p["name"] not in measured or not p["fits"]]
    t = result.get("targets", {})
    lines.append("")
    names = {r["name"]: r["label"] for r in result.get("rows", [])}
    for key, best, target, what in (("vs_hand", "best_hand", TARGET_VS_HAND, "the best hand configuration that fits"),
                                     ("vs_fsdp2", "best_fsdp2", TARGET_VS_FSDP2, "FSDP2's best configuration that fits")):
        if key in t:
            r = t[key]
            if t[f"{key}_met"]:
                met = "met"
            elif not t["auto_fits"] and r["median"] >= target:
                met = "not met: auto's configuration is over the cap (the ratio alone would meet it)"
            else:
                met = "not met"
            lines.append(f"- auto against {what} ({names[t[best]]}): {r['median']:.2f}× tokens/s [{r['p25']:.2f}–{r['p75']:.2f}] "
                         f"over {len(r['rounds'])} rounds (median [quartiles] of the per-round ratios; ratio of the medians "
                         f"{r['of_medians']:.2f}); target ≥ {target}: {met}.")
        else:
            ran = any(r["name"] == "auto" and "round_step_s" in r for r in result.get("rows", []))
            lines.append(f"- auto against {what}: no ratio ({'none fits the cap' if ran else 'auto did not run'}).")
    if not t.get("auto_fits", True):
        lines.append("- auto's configuration does not fit the cap as measured.")
    if "vs_fsdp2_compiled" in t:
        r = t["vs_fsdp2_compiled"]
        lines.append(f"- auto against FSDP2's best compiled configuration that fits ({names[r['against']]}): {r['median']:.2f}× tokens/s "
                     f"[{r['p25']:.2f}–{r['p75']:.2f}] (per-round ratios; not a target).")
    for key, what in (("compiled_vs_fsdp2", "FSDP2's best eager configuration that fits"),
                      ("compiled_vs_fsdp2_compiled", "FSDP2's best compiled configuration that fits")):
        if key in t:
            r = t[key]
            lines.append(f"- auto's configuration with Inductor against {what} ({names[r['against']]}): {r['median']:.2f}× tokens/s "
                         f"[{r['p25']:.2f}–{r['p75']:.2f}] (per-round ratios); it "
                         + ("fits the cap." if t["compiled_fits"] else "does not fit the cap."))
    lines += _prediction_lines(result)
    if "search" in result:
        lines += ["", "The search's output (`zerofx plan --auto` prints the same):", "", "```", result["search"]["text"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def smoke_args() -> list[str]:
    return ["--size", "tiny", "--seq-len", "128", "--global-batch", "2", "--cap", "2GiB", "--rounds", "1", "--warmup", "0",
            "--steps", "1", "--grid", "z2_m1,z3_m1_rc"]


def build_parser() -> argparse.ArgumentParser:
    from zerofx.models import DNA_LM_SIZES

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_capped", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--size", default="25m", choices=sorted(DNA_LM_SIZES), help="DNA LM size (default 25m)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--global-batch", type=int, default=4,
                   help="sequences per optimizer step over all ranks, the same for every configuration (default 4)")
    p.add_argument("--cap", default=CAP_BELOW_FSDP2,
                   help=f"peak RSS per rank a configuration may reach to fit, e.g. 1GiB; {CAP_BELOW_FSDP2} (default): FSDP2 "
                        "without checkpointing at micro-batch 1 is measured first, and the cap is its peak less --cap-margin")
    p.add_argument("--cap-margin", default="64MiB", help=f"with --cap {CAP_BELOW_FSDP2}: how far below FSDP2's peak (default 64MiB)")
    p.add_argument("--hard-limit", default=None,
                   help="resident set at which a rank is stopped, so no run exhausts the machine (default: twice the cap, at least "
                        f"cap + 1 GiB; 6 GiB with --cap {CAP_BELOW_FSDP2})")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; every configuration runs once per round (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps per run (default 1)")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per run (default 2)")
    p.add_argument("--grid", default=None, help=f"hand configurations, comma-separated, of {', '.join(n for n, *_ in HAND_GRID)} "
                   "(default: all whose micro-batch divides the sequences per rank)")
    p.add_argument("--memory-margin", type=float, default=0.1,
                   help="zerofx.memory_margin for the search: the share of the device budget held back for the memory model's "
                        "error, from 0 up to 1 (default 0.1, the accuracy docs/predictions.md holds the peak to)")
    p.add_argument("--search-offload", action="store_true",
                   help="let the search offload the optimizer state to host memory; by default it is kept on the device, since on "
                        "a CPU-only machine host memory is in the RSS cap (NOTE [Host memory is in an RSS cap])")
    p.add_argument("--profile", default=None,
                   help="a profile written by zerofx calibrate: the search plans with it, and the device budget is the cap less the "
                        "runtime baseline it records (default: the built-in cpu profile, and the baseline measured on an idle rank)")
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take before it is stopped (default 1800)")
    p.add_argument("--malloc-mmap-threshold", default="256KiB", help="glibc M_MMAP_THRESHOLD for every rank, so peak RSS follows the "
                   "live tensors (default 256KiB); 0 keeps glibc's dynamic default")
    p.add_argument("--smoke", action="store_true", help="the tiny model, 128 tokens, one round of one step, two hand configurations "
                   "(CI; well under a minute); other options given after it override it")
    p.add_argument("--out", default=None, help="output path without extension (default benchmarks/results/capped_<today>)")
    p.add_argument("--compiled", action="store_true",
                   help="also run auto's configuration with zerofx's Inductor compile and fused AdamW, and probe FSDP2 with each "
                        "block under torch.compile and fused AdamW, with and without checkpointing; reported beside the targets, "
                        "which stay auto's")
    p.add_argument("--probe-only", action="store_true", help="measure the baseline and the FSDP2 probes only (to choose a cap)")
    p.add_argument("--render", default=None, metavar="JSON", help="only rewrite the markdown of a result file")
    return p


def parse_options(argv: list[str]) -> argparse.Namespace:
    from zerofx.config import parse_bytes

    p = build_parser()
    opts = p.parse_args(argv)
    if opts.smoke:
        opts = p.parse_args(smoke_args() + argv)
    opts.cap_margin_bytes = int(parse_bytes(opts.cap_margin))
    # Until FSDP2 has been measured, a cap derived from it is unknown: a placeholder, and a 6 GiB hard limit.
    opts.cap_bytes = 8 * GIB if opts.cap == CAP_BELOW_FSDP2 else int(parse_bytes(opts.cap))
    default_limit = 6 * GIB if opts.cap == CAP_BELOW_FSDP2 else max(2 * opts.cap_bytes, opts.cap_bytes + GIB)
    opts.hard_limit_bytes = int(parse_bytes(opts.hard_limit)) if opts.hard_limit else default_limit
    if opts.global_batch % opts.world_size:
        p.error(f"--global-batch {opts.global_batch} must divide by --world-size {opts.world_size}")
    opts.grid = tuple(opts.grid.split(",")) if opts.grid else None
    unknown = set(opts.grid or ()) - {n for n, *_ in HAND_GRID}
    if unknown:
        p.error(f"unknown --grid entries {sorted(unknown)}; accepted: {', '.join(n for n, *_ in HAND_GRID)}")
    if not 0 <= opts.memory_margin < 1:
        p.error(f"--memory-margin {opts.memory_margin} is out of range; accepted: a share from 0 up to, not including, 1")
    if min(opts.rounds, opts.steps, opts.world_size) < 1 or opts.warmup < 0:
        p.error("--rounds, --steps and --world-size need integers >= 1, --warmup >= 0")
    opts.command = "python -m benchmarks.bench_capped " + shlex.join(argv)
    return opts


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse_options(argv)
    if opts.render:
        path = Path(opts.render)
        result = json.loads(path.read_text())
        result["targets"] = targets(result["rows"])
        path.with_suffix(".md").write_text(markdown(result))
        print(markdown(result))
        return 0
    threshold = set_malloc_mmap_threshold(opts.malloc_mmap_threshold)
    if opts.profile is not None and (mismatch := profile_allocator_mismatch(opts.profile, threshold)):
        print(f"bench_capped: {mismatch}", file=sys.stderr)
        return 2
    out = Path(opts.out or ROOT / "benchmarks" / "results" / f"capped_{datetime.date.today().isoformat()}")

    def save(result: dict[str, Any]) -> None:
        Path(f"{out}.json").write_text(json.dumps(result, indent=1, default=str))
        Path(f"{out}.md").write_text(markdown(result))

    result = run(opts, log=lambda line: print(line, flush=True), save=save)
    save(result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
