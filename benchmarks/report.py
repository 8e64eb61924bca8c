"""Turn the per-step measurements of one benchmark configuration into rows, tables and JSON.

NOTE [Exposed communication time]
Per step and rank: wall time minus the main thread's CPU time (``time.thread_time``). With one
compute thread per rank, the main thread runs every kernel itself; it is off the CPU only while
it waits for a collective (gloo runs them on its own threads) or while the OS runs something
else. So this is the communication the step could not hide, plus scheduling noise. ``single``
(and the optional ``local``), which never communicate, measure that noise floor on the same
machine in the same run. The median over steps of the mean over ranks is reported.

CPU per rank is the process's CPU time over the step (``time.process_time``: the main thread
and gloo's threads). Where the ranks share the cores one each, it is the shortest step a rank
can take (overlap hides waiting, not work done on the same cores), and other processes' load
moves it less than the wall time.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

# Bytes per parameter a rank holds for the optimizer's state: AdamW keeps exp_avg and exp_avg_sq.
OPTIMIZER_STATE_BYTES_PER_PARAM = {"AdamW": 8, "SGD": 0}
PARAM_AND_GRAD_BYTES_PER_PARAM = 8  # fp32 parameter + fp32 gradient
REFERENCE_SYSTEM = "fsdp2"


def bytes_per_param(optimizer: str) -> int:
    """k in the kP/N bound: 16 for fp32 AdamW (the ZeRO paper's stage-3 figure), 8 for SGD."""
    return PARAM_AND_GRAD_BYTES_PER_PARAM + OPTIMIZER_STATE_BYTES_PER_PARAM[optimizer]


def max_param_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    if state.keys() != reference.keys():
        raise AssertionError(f"state dict keys differ: {sorted(state.keys() ^ reference.keys())}")
    diff = 0.0
    for key, ref in reference.items():
        if state[key].shape != ref.shape:
            raise AssertionError(f"{key}: shape {tuple(state[key].shape)} != {tuple(ref.shape)}")
        diff = max(diff, (state[key].double() - ref.double()).abs().max().item())
    return diff


def summarize(
    system: str, *, setup_s: float, setup_rss_bytes: int | None = None, steps: list[list[tuple[float, ...]]], warmup: int,
    finish: list[dict[str, Any]],
    num_params: int, world_size: int, optimizer: str,
) -> dict[str, Any]:
    """One table row. ``steps[i][rank]`` is (wall s, main-thread CPU s, loss[, process CPU s]) of step i."""
    measured = steps[warmup:] or steps
    walls = [max(r[0] for r in ranks) for ranks in measured]  # the slowest rank ends the step
    exposed = [statistics.fmean(r[0] - r[1] for r in ranks) for ranks in measured]
    cpu = [statistics.fmean(r[1] for r in ranks) for ranks in measured]
    rank_cpu = [statistics.fmean(r[3] for r in ranks) for ranks in measured] if len(measured[0][0]) > 3 else None
    totals = [sum(r["memory"].values()) for r in finish]
    bound = bytes_per_param(optimizer) * num_params / world_size
    quartiles = statistics.quantiles(walls, n=4) if len(walls) > 1 else [walls[0]] * 3
    row: dict[str, Any] = {
        "system": system,
        "setup_s": setup_s,
        "compile_s": max(r["compile_s"] for r in finish) if "compile_s" in finish[0] else None,
        "first_step_s": max(r[0] for r in steps[0]),
        "step_s": statistics.median(walls),
        "step_p25_s": quartiles[0],
        "step_p75_s": quartiles[2],
        "step_all_s": walls,
        "exposed_comm_s": statistics.median(exposed),
        "main_cpu_s": statistics.median(cpu),
        "rank_cpu_s": None if rank_cpu is None else statistics.median(rank_cpu),
        "rank_cpu_all_s": rank_cpu,
        "model_state_bytes": max(totals),
        "model_state_breakdown": finish[totals.index(max(totals))]["memory"],
        "bound_bytes": bound,
        "vs_bound": max(totals) / bound,
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in finish),
        "setup_peak_rss_bytes": setup_rss_bytes,
        "final_loss": statistics.fmean(r[2] for r in steps[-1]),
        "max_param_diff": None,
        "optimizer": optimizer,
    }
    if "peak_device_bytes" in finish[0]:
        row["peak_device_bytes"] = max(r["peak_device_bytes"] for r in finish)
    return row


def ratios_by_round(row: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """``row``'s measured steps over ``reference``'s, round by round (bench_step's systems step one
    step each per round, NOTE [Interleaving within a memory budget]; a round's steps share the
    machine's load of that moment, NOTE [Ratios by round] in bench_long_context): the
    reference's name, the ratios, their median and quartiles, and the ratio of the two medians;
    the same for the CPU a rank spends per step, where both rows have it."""
    def by_round(mine: list[float], theirs: list[float]) -> dict[str, Any]:
        per_round = [a / b for a, b in zip(mine, theirs)]
        q1, _, q3 = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
        return {"rounds": per_round, "median": statistics.median(per_round), "p25": q1, "p75": q3}

    out = {"against": reference["system"], **by_round(row["step_all_s"], reference["step_all_s"]),
           "of_medians": row["step_s"] / reference["step_s"]}
    if row.get("rank_cpu_all_s") and reference.get("rank_cpu_all_s"):
        out["rank_cpu"] = by_round(row["rank_cpu_all_s"], reference["rank_cpu_all_s"])
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    ref = next((r["step_s"] for r in rows if r["system"] == REFERENCE_SYSTEM), None)
    for r in rows:
        r["vs_fsdp2"] = r["step_s"] / ref if ref else None


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown_table(rows: list[dict[str, Any]], *, optimizer: str, correctness_only: bool = False) -> str:
    k = bytes_per_param(optimizer)
    headers = ["system", "model state / rank", f"× {k}P/N", "final loss", "max |Δparam| vs single"]
    if not correctness_only:
        headers[1:1] = ["setup s", "compile s", "1st step s", "step s (median)", "× fsdp2", "exposed comm s", "main-thread CPU s",
                        "CPU / rank s"]
        headers[-2:-2] = ["setup peak RSS / rank", "peak RSS / rank"]
    body = []
    vs_ref = [r["vs_reference"] for r in rows if r.get("vs_reference")]
    for r in rows:
        own_k = bytes_per_param(r.get("optimizer", optimizer))
        vs_bound = f"{r['vs_bound']:.3f}" + ("" if own_k == k else f" (of {own_k}P/N)")
        line = [r["system"], human_bytes(r["model_state_bytes"]), vs_bound, f"{r['final_loss']:.4f}",
                _fmt(r["max_param_diff"], ".2e")]
        if not correctness_only:
            line[1:1] = [f"{r['setup_s']:.2f}", _fmt(r.get("compile_s"), ".1f"), f"{r['first_step_s']:.2f}",
                         f"{r['step_s']:.3f} [{r['step_p25_s']:.2f}–{r['step_p75_s']:.2f}]",
                         _fmt(r["vs_fsdp2"], ".2f"), f"{r['exposed_comm_s']:.3f}", _fmt(r.get("main_cpu_s"), ".3f"),
                         _fmt(r.get("rank_cpu_s"), ".3f")]
            setup_rss = r.get("setup_peak_rss_bytes")
            line[-2:-2] = ["—" if setup_rss is None else human_bytes(setup_rss), human_bytes(r["peak_rss_bytes"])]
        if not correctness_only and vs_ref:
            v = r.get("vs_reference")
            line.insert(6, "—" if v is None else f"{v['median']:.3f} [{v['p25']:.3f}–{v['p75']:.3f}]")
            cpu = None if v is None else v.get("rank_cpu")
            line.insert(10, "—" if cpu is None else f"{cpu['median']:.3f} [{cpu['p25']:.3f}–{cpu['p75']:.3f}]")
        body.append(line)
    if not correctness_only and vs_ref:
        headers.insert(6, f"× {vs_ref[0]['against']} by round, median [q1–q3]")
        headers.insert(10, f"CPU / rank × {vs_ref[0]['against']} by round")
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def sweep_table(configs: list[dict[str, Any]]) -> str:
    """One line per (size, world size, system): how step time and memory per rank grow."""
    body = []
    for c in configs:
        for r in c["rows"]:
            body.append([c["size"], f"{c['num_params'] / 1e6:.2f}M", c["world_size"], r["system"], f"{r['step_s']:.3f}",
                         _fmt(r["vs_fsdp2"], ".2f"), human_bytes(r["model_state_bytes"]), human_bytes(r["peak_rss_bytes"])])
    headers = ["size", "params", "W", "system", "step s", "× fsdp2", "model state / rank", "peak RSS / rank"]
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    out: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "torch": torch.__version__,
                           "python": platform.python_version(), "platform": platform.platform()}
    if torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def write_result(stem: Path, result: dict[str, Any], text: str) -> None:
    """A benchmark's raw ``result`` as ``<stem>.json`` and its rendered ``text`` as ``<stem>.md``
    (the dated files beside each other in benchmarks/results/), and the text on stdout."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(text + "\n")
    print(text)


def profile_allocator_mismatch(profile: str | Path, threshold: int) -> str | None:
    """Why a CPU profile from ``zerofx calibrate`` does not fit ranks run with glibc's
    ``MALLOC_MMAP_THRESHOLD_`` at ``threshold`` bytes (0: unset), or None where it does (NOTE [A
    profile holds for its allocator] in cost_models/profiles.py)."""
    from zerofx.cost_models.compute import DeviceSpec
    from zerofx.cost_models.profiles import allocator_mismatch

    mismatch = allocator_mismatch(DeviceSpec(**json.loads(Path(profile).read_text())["device"]), str(threshold) if threshold else None)
    if mismatch is None:
        return None
    return (f"the profile {profile} {mismatch.replace('this process runs', 'the ranks here run')} (e.g. "
            f"MALLOC_MMAP_THRESHOLD_={threshold or 0} zerofx calibrate ...), or pass the matching --malloc-mmap-threshold")


def set_malloc_mmap_threshold(value: str) -> int:
    """Set glibc's ``MALLOC_MMAP_THRESHOLD_`` for the ranks this process spawns (glibc reads it
    at process start, so they inherit it): blocks above it go back to the OS when freed, and a
    rank's peak RSS follows its live tensors. ``value`` in bytes or with a unit; 0 removes it,
    keeping glibc's dynamic default. Returns the threshold in bytes."""
    from zerofx.common.units import parse_bytes

    threshold = int(parse_bytes(value))
    if threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    return threshold
