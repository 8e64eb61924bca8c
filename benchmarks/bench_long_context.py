"""Longest context under a per-rank memory cap: zerofx sequence parallelism against stage 3
with sequence tiling and against FSDP2 with PyTorch's context parallelism, on the DNA LM at 2
and 4 gloo ranks; or, with ``--size`` a genomic model (Hyena, StripedHyena 2, Mamba), zerofx
at sequence-parallel sizes 1, 2 and 4 against plain single-process PyTorch.

    python -m benchmarks.bench_long_context                      # the full run: small, W=2,4, cap 4 GiB, 4k..256k
    python -m benchmarks.bench_long_context --cap 1GiB --size small --start 2048 --max-context 32768 \\
        --rounds 2 --steps 1 --max-step-s 120                    # a short look on a busy machine
    python -m benchmarks.bench_long_context --size striped-1m --world-sizes 4 --start 65536 \\
        --max-context 1048576 --rounds 2 --warmup 0 --steps 1    # genome scale: StripedHyena 2 up to 1M tokens

Contexts double from ``--start`` to ``--max-context``. At each context every system still in
the race runs ``--rounds`` times, the rounds interleaved (round r starts at the r-th system, so
a noisy minute on a shared machine hits every system alike), each run in fresh gloo processes
(``bench_offload.run_config``) so that its peak RSS is its own: every system's ranks alive at
once would not fit under the cap (NOTE [Interleaving within a memory budget] in
benchmarks/rounds.py). A run is ``--warmup`` untimed steps and ``--steps`` timed ones on one
sequence of the context per data-parallel group (batch ``--batch``). A system stops at the
first context whose peak RSS on some rank (VmHWM, NOTE [VmHWM, not ru_maxrss]) exceeds the cap,
whose step takes longer than ``--max-step-s``, that fails, or whose predicted peak (its last
peak with the activations doubled) is over 1.5x the cap or over the machine's free memory: that
context is not run, and the table says why.

Systems, per world size W:

- ``zerofx3``: ZeRO stage 3, no tiling, no sequence parallelism (sequence-parallel size 1): each
  rank trains its own sequence of the context.
- ``zerofx3_tiled``: the same with ``zerofx.tiling`` ``enabled: auto`` (activation budget
  ``--tiling-budget``, default half the cap): attention, token-wise regions and the loss in chunks.
- ``zerofx3_sp2``, ``zerofx3_sp4``: stage 3 with ``zerofx.sequence_parallel.size`` 2 or 4
  (Ulysses all-to-all): the S ranks of a group share one sequence, T/S tokens each, untiled.
- ``zerofx3_sp4_tiled``: ``zerofx3_sp4`` with ``zerofx.tiling`` as ``zerofx3_tiled`` has it,
  planned for each rank's T/4 positions (NOTE [Tiling a sequence-parallel forward] in
  zerofx/compiler/pipeline.py).
- ``zerofx3_sp2_tiled``: ``zerofx3_sp2`` with tiling (the genomic models' size 2).
- ``plain``: the model in one process (W=1), eager PyTorch and ``torch.optim.AdamW``, the peer
  of the genomic runs: its longest context under the same cap. (Evo 2's own trainer needs
  CUDA-only kernels, so it cannot run here.)
- ``fsdp2_cp``: FSDP2 (``fully_shard`` per block) inside
  ``torch.distributed.tensor.experimental.context_parallel`` over the W ranks, with the token ids
  and labels sharded along the sequence. Where it does not run on CPU with gloo, its row holds
  the error text.

Per (system, W, context): peak RSS per rank (the largest over ranks and rounds), RSS before the
first step, the median step [quartiles] over every timed step of every round (the slowest rank's
wall time), tokens per second per rank (B·T/S tokens per rank per step over that median), and
exposed communication (NOTE [Exposed communication time] in benchmarks/report.py). The summary
checks the targets: sequence-parallel size 4 reaches a context at least 3.5x longer than size 1
under the same cap, with at least 80% of its tokens per second per rank at the longest context
both fit (the median of the per-round ratios, NOTE [Ratios by round]), and some run fits at
131072 tokens or more.

Every rank runs with ``MALLOC_MMAP_THRESHOLD_`` (``--malloc-mmap-threshold``, default 256 KiB),
as ``bench_tiling``'s runs do, so freed tensors go back to the OS and the peak RSS follows the
live tensors. The price is a system call and fresh pages for every tensor above the threshold,
a per-tensor cost that weighs more where each rank holds fewer tokens.
``--malloc-mmap-threshold 0`` keeps glibc's dynamic threshold, which reuses freed memory and
holds more of it.

Writes markdown and JSON to ``--out`` (default ``benchmarks/results/long_context_<today>``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_offload import run_config  # noqa: E402
from benchmarks.report import human_bytes, machine, set_malloc_mmap_threshold, summarize  # noqa: E402

SYSTEMS = ("plain", "zerofx3", "zerofx3_tiled", "zerofx3_sp2", "zerofx3_sp2_tiled", "zerofx3_sp4", "zerofx3_sp4_tiled", "fsdp2_cp")
# Each system's sequence-parallel size (None: all W ranks, as context parallelism shards over them).
SP_SIZE = {"plain": 1, "zerofx3": 1, "zerofx3_tiled": 1, "zerofx3_sp2": 2, "zerofx3_sp2_tiled": 2, "zerofx3_sp4": 4, "zerofx3_sp4_tiled": 4,
           "fsdp2_cp": None}
# The genomic models' systems (``--model`` a Hyena, StripedHyena or Mamba size): no FSDP2 row,
# as PyTorch's context parallelism shards attention only.
GENOMIC_SYSTEMS = ("plain", "zerofx3_tiled", "zerofx3_sp2_tiled", "zerofx3_sp4_tiled")
TARGET_CONTEXT = 131072
TARGET_LENGTH_RATIO = 3.5
TARGET_THROUGHPUT_RATIO = 0.8
GIB = 2**30


def sp_size(system: str, world_size: int) -> int:
    size = SP_SIZE[system]
    return world_size if size is None else size


def _model(size: str, seq_len: int, seed: int) -> torch.nn.Module:
    """The named model (a DNA LM or a genomic size of ``zerofx.models.MODEL_SIZES``), built for
    ``seq_len`` positions, initialized as every system's is (``benchmarks.systems.build_model``)."""
    from zerofx.compiler.materialize import init_weights_
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM, model_class, model_config

    torch.manual_seed(seed)
    if size in DNA_LM_SIZES:  # its rotary tables sized for seq_len
        return init_weights_(DNADecoderLM(replace(DNA_LM_SIZES[size], max_seq_len=seq_len)), seed=seed)
    cfg = model_config(size)
    return model_class(cfg)(replace(cfg, max_seq_len=max(cfg.max_seq_len, seq_len)))


def is_genomic(size: str) -> bool:
    from zerofx.models import DNA_LM_SIZES

    return size not in DNA_LM_SIZES


class ContextParallelRunner:
    """FSDP2 over the W ranks, each step inside ``context_parallel`` with the token ids and the
    labels sharded along the sequence (dim 1). The model shifts its labels within each rank's
    shard and numbers positions from 0 on each: this row measures memory and time, not parity."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from benchmarks.systems import EagerRunner, make_optimizer

        self.mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        self.inner = EagerRunner(model, model, make_optimizer("AdamW", lr, model.parameters()))

    def step(self, ids: torch.Tensor) -> float:
        from torch.distributed.tensor.experimental import context_parallel

        ids, labels = ids.clone(), ids.clone()
        with context_parallel(self.mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1]):
            self.inner.optim.zero_grad(set_to_none=True)
            loss = self.inner.model(ids, labels=labels).loss
            loss.backward()
        self.inner.optim.step()
        return loss.item()

    def memory(self) -> dict[str, int]:
        return self.inner.memory()


def _runner(system: str, model: torch.nn.Module, example: torch.Tensor, args: dict[str, Any]) -> Any:
    if system == "fsdp2_cp":
        return ContextParallelRunner(model, args["lr"])
    from benchmarks.systems import EagerRunner, ZeroFXRunner, make_optimizer

    if system == "plain":  # the peer: the model in one process, eager PyTorch
        return EagerRunner(model, model, make_optimizer("AdamW", args["lr"], model.parameters()))
    own: dict[str, Any] = {}
    if system.endswith("_tiled"):
        own["tiling"] = {"enabled": "auto", "budget": args["tiling_budget"]}
    if SP_SIZE[system] > 1:
        # The genomic models choose each mixer's strategy by bytes; the DNA LM runs Ulysses.
        own["sequence_parallel"] = {"size": SP_SIZE[system]} if args["genomic"] else {"size": SP_SIZE[system], "attention": "ulysses"}
    return ZeroFXRunner(model, 3, "AdamW", args["lr"], example, {"zerofx": own} if own else None, init_seed=args["seed"])


def _rank(rank: int, world_size: int, port: int, args: dict[str, Any], queue: Any) -> None:
    """One rank of one run: build, ``warmup + steps`` timed steps, peak RSS (``run_config``'s target)."""
    from zerofx.common.rss import current_rss_bytes, peak_rss_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        system, seq_len = args["system"], args["seq_len"]
        group = rank // sp_size(system, world_size)  # the ranks of a sequence group share its sequence
        ids = torch.randint(0, 5, (args["batch"], seq_len), generator=torch.Generator().manual_seed(args["seed"] + 1 + group))
        model = _model(args["size"], seq_len, args["seed"])
        start = time.perf_counter()
        runner = _runner(system, model, ids, args)
        setup_s = time.perf_counter() - start
        rss_before = current_rss_bytes()
        steps = []
        for _ in range(args["warmup"] + args["steps"]):
            dist.barrier()
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            loss = runner.step(ids)
            steps.append((time.perf_counter() - wall0, time.thread_time() - cpu0, loss))
        out = {"steps": steps, "memory": runner.memory(), "peak_rss_bytes": peak_rss_bytes(), "rss_before_steps_bytes": rss_before,
               "setup_s": setup_s}
        if hasattr(runner, "compile_s"):
            out["compile_s"] = runner.compile_s()
        queue.put((rank, "ok", out))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def measure(system: str, world_size: int, seq_len: int, opts: argparse.Namespace) -> list[dict[str, Any]]:
    """Every rank's result of one run, in fresh processes."""
    args = {"system": system, "kind": f"{system} W={world_size} T={seq_len}", "seq_len": seq_len, "size": opts.size,
            "batch": opts.batch, "seed": 0, "lr": 1e-3, "warmup": opts.warmup, "steps": opts.steps,
            "tiling_budget": opts.tiling_budget, "genomic": is_genomic(opts.size)}
    return run_config(args, world_size, target=_rank, timeout_s=opts.timeout)


def row_for(system: str, world_size: int, seq_len: int, runs: list[list[dict[str, Any]]], opts: argparse.Namespace,
            num_params: int) -> dict[str, Any]:
    """One table row from the ``--rounds`` runs of (system, W, context)."""
    timed = [[rank["steps"][i] for rank in run] for run in runs for i in range(opts.warmup, len(run[0]["steps"]))]
    finish = [{"memory": runs[-1][r]["memory"], "peak_rss_bytes": max(run[r]["peak_rss_bytes"] for run in runs)}
              for r in range(world_size)]
    row = summarize(system, setup_s=max(run[0]["setup_s"] for run in runs), steps=timed, warmup=0, finish=finish,
                    num_params=num_params, world_size=world_size, optimizer="AdamW")
    tokens_per_rank = opts.batch * seq_len / sp_size(system, world_size)
    # Each round's median step (the slowest rank ends a step), for ratios between the systems'
    # runs of the same round, which ran one after the other (NOTE [Ratios by round]).
    per_round = [statistics.median(max(rank["steps"][i][0] for rank in run) for i in range(opts.warmup, len(run[0]["steps"])))
                 for run in runs]
    row.update(world_size=world_size, seq_len=seq_len, sequence_parallel=sp_size(system, world_size), round_step_s=per_round,
               rss_before_steps_bytes=max(run[r]["rss_before_steps_bytes"] for run in runs for r in range(world_size)),
               tokens_per_s_per_rank=tokens_per_rank / row["step_s"], fits=row["peak_rss_bytes"] <= opts.cap_bytes)
    for key in ("step_all_s", "model_state_breakdown", "bound_bytes", "vs_bound", "max_param_diff", "first_step_s"):
        row.pop(key, None)
    return row


def run(opts: argparse.Namespace, log: Any = print, save: Any = None) -> dict[str, Any]:
    with torch.device("meta"):
        num_params = sum(p.numel() for p in _model(opts.size, 2, 0).parameters())
    # The plain peer is one process (W=1) whatever --world-sizes says.
    entries = [(1, "plain")] if "plain" in opts.systems else []
    entries += [(w, s) for w in opts.world_sizes for s in opts.systems
                if s != "plain" and w % sp_size(s, w) == 0 and sp_size(s, w) <= w]
    rows: list[dict[str, Any]] = []
    last: dict[tuple[int, str], dict[str, Any]] = {}
    stopped: dict[tuple[int, str], str] = {}
    loads = [os.getloadavg()]

    def result() -> dict[str, Any]:
        return {"date": datetime.date.today().isoformat(), "machine": machine(), "load_average": loads,
                "options": {k: v for k, v in vars(opts).items() if k != "out"}, "num_params": num_params, "rows": rows,
                "stopped": {f"{s} W={w}": why for (w, s), why in stopped.items()},
                "targets": targets(rows, opts.world_sizes, opts.systems, {f"{s} W={w}": why for (w, s), why in stopped.items()},
                                   opts.compare, opts.target_context)}

    seq_len = opts.start
    while seq_len <= opts.max_context and len(stopped) < len(entries):
        active = []
        for entry in entries:
            if entry in stopped:
                continue
            prev = last.get(entry)
            if prev is not None:  # activations double with the context: refuse what cannot fit
                predicted = prev["peak_rss_bytes"] + max(0, prev["peak_rss_bytes"] - prev["rss_before_steps_bytes"])
                why = None
                if predicted > 1.5 * opts.cap_bytes:
                    why = f"predicted peak {human_bytes(predicted)} per rank is over 1.5x the cap"
                elif predicted * entry[0] > _available_bytes() - 2 * GIB:
                    why = f"predicted {human_bytes(predicted)} x {entry[0]} ranks is more than the machine has free"
                if why is not None:
                    stopped[entry] = why
                    rows.append({"system": entry[1], "world_size": entry[0], "seq_len": seq_len, "skipped": why})
                    log(f"skip {entry[1]} W={entry[0]} T={seq_len}: {why}")
                    continue
            active.append(entry)
        runs: dict[tuple[int, str], list[list[dict[str, Any]]]] = {e: [] for e in active}
        errors: dict[tuple[int, str], str] = {}
        for r in range(opts.rounds):
            for entry in active[r % max(1, len(active)):] + active[: r % max(1, len(active))]:
                if entry in errors:
                    continue
                w, system = entry
                start = time.perf_counter()
                try:
                    runs[entry].append(measure(system, w, seq_len, opts))
                    res = runs[entry][-1]
                    log(f"{system} W={w} T={seq_len} round {r + 1}: peak RSS {human_bytes(max(x['peak_rss_bytes'] for x in res))}, "
                        f"steps {[round(max(x['steps'][i][0] for x in res), 2) for i in range(len(res[0]['steps']))]} s "
                        f"({time.perf_counter() - start:.0f} s with setup; load {os.getloadavg()[0]:.1f})")
                except RuntimeError as exc:
                    errors[entry] = str(exc)
                    log(f"{system} W={w} T={seq_len}: error\n{exc}")
                loads.append(os.getloadavg())
        for entry in active:
            w, system = entry
            if entry in errors:
                text = errors[entry]
                rows.append({"system": system, "world_size": w, "seq_len": seq_len, "error": text[-3000:],
                             "error_line": _last_error_line(text)})
                stopped[entry] = "error: " + _last_error_line(text)
                continue
            row = row_for(system, w, seq_len, runs[entry], opts, num_params)
            rows.append(row)
            last[entry] = row
            if not row["fits"]:
                stopped[entry] = f"peak RSS {human_bytes(row['peak_rss_bytes'])} over the cap"
            elif row["step_s"] > opts.max_step_s:
                stopped[entry] = f"step {row['step_s']:.0f} s over --max-step-s {opts.max_step_s:.0f}"
        seq_len *= 2
        if save is not None:  # what is measured so far, should a later context take too long
            save(result())
    return result()


def _last_error_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else "error"


def longest(rows: list[dict[str, Any]], system: str, world_size: int) -> int:
    return max((r["seq_len"] for r in rows if r["system"] == system and r["world_size"] == world_size and r.get("fits")), default=0)


def targets(rows: list[dict[str, Any]], world_sizes: tuple[int, ...], systems: tuple[str, ...], stopped: dict[str, str],
            compare: tuple[str, str] = ("zerofx3", "zerofx3_sp4"), target_context: int = TARGET_CONTEXT) -> dict[str, Any]:
    """The spec's targets, as measured: at W=4, size 4 against size 1 (``compare``: the size-1
    system, then the size-4 one). A longest context is the cap's only where the system stopped at
    the cap (measured or predicted); else (the step-time limit, ``--max-context``, an error) the
    length target is undetermined."""
    out: dict[str, Any] = {"compare": list(compare)}
    size1, size4 = compare
    if 4 in world_sizes and {size1, size4} <= set(systems):
        one, four = longest(rows, size1, 4), longest(rows, size4, 4)
        out["longest_size1"], out["longest_size4"] = one, four
        out["length_ratio"] = four / one if one else None
        capped = {s: "cap" in stopped.get(f"{s} W=4", "") for s in compare}
        out["stopped_at_cap"] = capped
        if capped[size1] and capped[size4]:
            out["length_met"] = bool(one) and four / one >= TARGET_LENGTH_RATIO
        elif capped[size1] and four and one and four / one >= TARGET_LENGTH_RATIO:
            out["length_met"] = True  # size 4 is still going: the ratio only grows
        else:
            out["length_met"] = None
        both = min(one, four)
        if both:
            speed = {s: next(r["tokens_per_s_per_rank"] for r in rows if r["system"] == s and r["world_size"] == 4 and r["seq_len"] == both)
                     for s in compare}
            out["both_fit_at"] = both
            out["throughput_ratio"] = speed[size4] / speed[size1]
            rounds = {s: next(r.get("round_step_s") for r in rows if r["system"] == s and r["world_size"] == 4 and r["seq_len"] == both)
                      for s in compare}
            if rounds[size1] and rounds[size4] and len(rounds[size1]) == len(rounds[size4]) > 1:
                # NOTE [Ratios by round]
                # Runs of one context are interleaved, in an order that rotates each round, so
                # the two systems' runs of a round share the machine's state of that time. The
                # ratio is taken per round and reported as median [quartiles]; the ratio of the
                # two medians, which mixes rounds, is kept beside it. Size 4 runs T/4 tokens a
                # rank, size 1 T, so the ratio of tokens/s per rank is one step over four of the other.
                ratios = [one / (4 * sp) for one, sp in zip(rounds[size1], rounds[size4])]
                q1, med, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
                out["throughput_ratio_by_round"] = {"median": med, "p25": q1, "p75": q3, "rounds": ratios}
                out["throughput_met"] = med >= TARGET_THROUGHPUT_RATIO
            else:
                out["throughput_met"] = out["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO
    reached = max((r["seq_len"] for r in rows if r.get("fits")), default=0)
    out["longest_any"], out["context_target_met"] = reached, reached >= target_context
    out["target_context"] = target_context
    if "plain" in systems:
        out["longest_plain"] = longest(rows, "plain", 1)
    return out


def _malloc(options: dict[str, Any]) -> str:
    from zerofx.common.units import parse_bytes

    threshold = options.get("malloc_mmap_threshold", "256KiB")  # results written before the option had 256 KiB
    return "glibc's dynamic mmap threshold" if not parse_bytes(threshold) else f"MALLOC_MMAP_THRESHOLD_ {threshold}"


def markdown(result: dict[str, Any]) -> str:
    o = result["options"]
    load = result["load_average"]
    lines = [
        f"{'model' if is_genomic(o['size']) else 'DNA LM'} {o['size']} ({result['num_params']:,} parameters), ZeRO stage 3 / FSDP2 / "
        f"plain PyTorch, fp32 AdamW, batch {o['batch']} sequence "
        f"per data-parallel group; cap {human_bytes(o['cap_bytes'])} peak RSS per rank; {o['rounds']} interleaved round(s) of "
        f"{o['warmup']} untimed + {o['steps']} timed step(s); {result['machine']['cores']} cores, {result['machine']['cpu']}, "
        f"torch {result['machine']['torch']}; run {result['date']}; load average (1 min) from {min(x[0] for x in load):.1f} "
        f"to {max(x[0] for x in load):.1f}; malloc: {_malloc(o)}.",
        "",
        "| system | W | S | context | peak RSS / rank | RSS before steps | step s (median [p25–p75]) | tokens/s / rank | "
        "exposed comm s | fits |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in sorted(result["rows"], key=lambda r: (r["world_size"], SYSTEMS.index(r["system"]), r["seq_len"])):
        head = f"| {r['system']} | {r['world_size']} | {sp_size(r['system'], r['world_size'])} | {r['seq_len']} |"
        if "skipped" in r:
            lines.append(f"{head} — | — | — | — | — | not run: {r['skipped']} |")
        elif "error" in r:
            lines.append(f"{head} — | — | — | — | — | error: {r['error_line'].replace('|', '/')} |")
        else:
            lines.append(f"{head} {human_bytes(r['peak_rss_bytes'])} | {human_bytes(r['rss_before_steps_bytes'])} | "
                         f"{r['step_s']:.2f} [{r['step_p25_s']:.2f}–{r['step_p75_s']:.2f}] | {r['tokens_per_s_per_rank']:.0f} | "
                         f"{r['exposed_comm_s']:.2f} | {'yes' if r['fits'] else 'no'} |")
    lines += ["", "Stopped: " + "; ".join(f"{k}: {v}" for k, v in result["stopped"].items()), ""]
    t = result["targets"]
    size1, size4 = t.get("compare", ("zerofx3", "zerofx3_sp4"))
    if "longest_size1" in t:
        ratio = "—" if t["length_ratio"] is None else f"{t['length_ratio']:.2f}x"
        verdict = {True: "met", False: "not met", None: "undetermined: not both stopped at the cap"}[t["length_met"]]
        lines.append(f"- Longest context at W=4: size 1 ({size1}) {t['longest_size1']}, size 4 ({size4}) {t['longest_size4']}: "
                     f"{ratio} (target ≥ {TARGET_LENGTH_RATIO}x: {verdict}).")
        if "throughput_ratio_by_round" in t:
            by = t["throughput_ratio_by_round"]
            lines.append(f"- Tokens/s per rank at {t['both_fit_at']} (the longest both fit): size 4 / size 1 = {by['median']:.2f} "
                         f"[{by['p25']:.2f}, {by['p75']:.2f}] over {len(by['rounds'])} rounds (median [quartiles] of the per-round "
                         f"ratios; ratio of the medians {t['throughput_ratio']:.2f}) (target ≥ {TARGET_THROUGHPUT_RATIO}: "
                         f"{'met' if t['throughput_met'] else 'not met'}).")
        elif "throughput_ratio" in t:
            lines.append(f"- Tokens/s per rank at {t['both_fit_at']} (the longest both fit): size 4 / size 1 = "
                         f"{t['throughput_ratio']:.2f} (target ≥ {TARGET_THROUGHPUT_RATIO}: {'met' if t['throughput_met'] else 'not met'}).")
    lines.append(f"- Longest context any run fits: {t['longest_any']} (target ≥ {t.get('target_context', TARGET_CONTEXT)}: "
                 f"{'met' if t['context_target_met'] else 'not met'}).")
    if "longest_plain" in t:
        lines.append(f"- Longest context plain single-process PyTorch fits: {t['longest_plain']}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from zerofx.config import parse_bytes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", help="model size: a DNA LM (zerofx.models.DNA_LM_SIZES) or a genomic size such as "
                   "striped-1m or hyena-1m (zerofx.models.MODEL_SIZES; default small)")
    p.add_argument("--world-sizes", default="2,4", help="gloo ranks per run, comma-separated (default 2,4; plain runs on 1)")
    p.add_argument("--systems", default=None, help=f"comma-separated, of {', '.join(SYSTEMS)} (default: all but plain for a DNA LM; "
                   f"{', '.join(GENOMIC_SYSTEMS)} for a genomic model)")
    p.add_argument("--compare", default=None, help="the size-1 and size-4 systems the targets compare, comma-separated (default "
                   "zerofx3,zerofx3_sp4 for a DNA LM, zerofx3_tiled,zerofx3_sp4_tiled for a genomic model)")
    p.add_argument("--target-context", type=int, default=None, help="the context some run must fit (default 131072 for a DNA LM, "
                   "1048576 for a genomic model)")
    p.add_argument("--cap", default="4GiB", help="peak RSS per rank a run may reach to fit (default 4GiB)")
    p.add_argument("--tiling-budget", default=None, help="zerofx3_tiled's activation budget (default: half the cap)")
    p.add_argument("--start", type=int, default=4096, help="first context, doubled each time (default 4096)")
    p.add_argument("--max-context", type=int, default=262144, help="last context tried (default 262144)")
    p.add_argument("--batch", type=int, default=1, help="sequences per data-parallel group (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs per (system, context) (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per run (default 1; zerofx compiles in setup)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per run (default 2)")
    p.add_argument("--max-step-s", type=float, default=1800.0, help="stop a system after a context whose step is slower (default 1800)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per run (default 7200)")
    p.add_argument("--out", default=None, help="output path without extension (default benchmarks/results/long_context_<today>)")
    p.add_argument("--malloc-mmap-threshold", default="256KiB", help="glibc M_MMAP_THRESHOLD for every rank (MALLOC_MMAP_THRESHOLD_), so "
                   "freed tensors return to the OS and peak RSS follows the live tensors (default 256KiB); 0 keeps glibc's dynamic "
                   "default, which reuses freed memory without a system call and holds more of it")
    p.add_argument("--render", default=None, metavar="JSON", help="only rewrite the markdown (and targets) of a result file")
    opts = p.parse_args(argv)
    if opts.render:
        path = Path(opts.render)
        result = json.loads(path.read_text())
        o = result["options"]
        result["targets"] = targets(result["rows"], tuple(o["world_sizes"]), tuple(o["systems"]), result["stopped"],
                                    tuple(o.get("compare") or ("zerofx3", "zerofx3_sp4")), o.get("target_context") or TARGET_CONTEXT)
        path.write_text(json.dumps(result, indent=1, default=str))
        path.with_suffix(".md").write_text(markdown(result))
        print(markdown(result))
        return 0
    opts.world_sizes = tuple(int(x) for x in opts.world_sizes.split(","))
    from zerofx.models import MODEL_SIZES

    if opts.size not in MODEL_SIZES:
        p.error(f"unknown --size {opts.size!r}; accepted: {', '.join(MODEL_SIZES)}")
    genomic = is_genomic(opts.size)
    opts.systems = tuple((opts.systems or ",".join(GENOMIC_SYSTEMS if genomic else [x for x in SYSTEMS if x != "plain"])).split(","))
    unknown = set(opts.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; accepted: {', '.join(SYSTEMS)}")
    if genomic and "fsdp2_cp" in opts.systems:
        p.error("fsdp2_cp runs the DNA LM only: PyTorch's context parallelism shards attention, not convolutions or scans")
    opts.compare = tuple((opts.compare or ("zerofx3_tiled,zerofx3_sp4_tiled" if genomic else "zerofx3,zerofx3_sp4")).split(","))
    if len(opts.compare) != 2 or set(opts.compare) - set(SYSTEMS):
        p.error(f"--compare {','.join(opts.compare)}: two systems of {', '.join(SYSTEMS)}")
    opts.target_context = opts.target_context or (1 << 20 if genomic else TARGET_CONTEXT)
    opts.cap_bytes = int(parse_bytes(opts.cap))
    opts.tiling_budget = opts.tiling_budget or str(opts.cap_bytes // 2)
    opts.tiling_budget = int(parse_bytes(opts.tiling_budget))
    set_malloc_mmap_threshold(opts.malloc_mmap_threshold)
    out = Path(opts.out or ROOT / "benchmarks" / "results" / f"long_context_{datetime.date.today().isoformat()}")

    def save(result: dict[str, Any]) -> None:
        Path(f"{out}.json").write_text(json.dumps(result, indent=1, default=str))
        Path(f"{out}.md").write_text(markdown(result))

    result = run(opts, log=lambda line: print(line, flush=True), save=save)
    save(result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
