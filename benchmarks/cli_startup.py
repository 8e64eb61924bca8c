"""How long the ``zerofx`` command takes to answer when nothing heavy is asked of it: ``--help``,
a subcommand's ``--help``, and ``zerofx estimate --params`` (arithmetic only).

    python -m benchmarks.cli_startup                   # 15 rounds, budget 1 s
    python -m benchmarks.cli_startup --rounds 30 --budget 0.5 --out benchmarks/results/cli_startup

Each run is a fresh interpreter doing what the installed ``zerofx`` script does
(``from zerofx.app.cli import main; sys.exit(main())``), so the time includes Python's start, every
import the command makes, argument parsing and the output. The commands run interleaved, one
round of all of them after another, so load from other jobs on a shared machine slows them
alike. One untimed round first warms the file cache. Each command's wall-time median and quartiles
are reported with its median CPU time (user + system), which moves less with load; the wall
median is compared with ``--budget``: a command passes when its median is within it. The exit code is 1
when any command fails the budget or exits non-zero.

Writes markdown and JSON to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the console script `zerofx` runs (its entry point is zerofx.app.cli:main).
SCRIPT = "import sys; from zerofx.app.cli import main; sys.exit(main())"
COMMANDS: dict[str, list[str]] = {
    "zerofx --help": ["--help"],
    "zerofx plan --help": ["plan", "--help"],
    "zerofx train --help": ["train", "--help"],
    "zerofx estimate --params 1e9 --world-size 8": ["estimate", "--params", "1e9", "--world-size", "8"],
}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_once(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh ``zerofx ARGV`` process; raises if it exits non-zero.
    The CPU time (user + system, of the child alone: runs are sequential) moves less than the wall
    time when other jobs load the machine."""
    cpu_start, start = _children_cpu_s(), time.perf_counter()
    done = subprocess.run([sys.executable, "-c", SCRIPT, *argv], cwd=ROOT, capture_output=True, text=True)
    elapsed, cpu = time.perf_counter() - start, _children_cpu_s() - cpu_start
    if done.returncode != 0:
        raise RuntimeError(f"zerofx {' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return elapsed, cpu


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of at least 2 samples."""
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, median, q3


def run(rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds per command, ``rounds`` samples each."""
    for argv in COMMANDS.values():  # warm the file cache; not timed
        time_once(argv)
    wall: dict[str, list[float]] = {name: [] for name in COMMANDS}
    cpu: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(rounds):
        for name, argv in COMMANDS.items():
            wall_s, cpu_s = time_once(argv)
            wall[name].append(wall_s)
            cpu[name].append(cpu_s)
    return wall, cpu


def render(wall: dict[str, list[float]], cpu: dict[str, list[float]], budget_s: float) -> str:
    lines = [
        f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, Python {platform.python_version()}; "
        f"{len(next(iter(wall.values())))} interleaved rounds; budget {budget_s:g} s on the median wall time",
        "",
        "| command | wall median s | wall quartiles s | CPU median s | verdict |",
        "|---|---|---|---|---|",
    ]
    for name, values in wall.items():
        q1, median, q3 = quartiles(values)
        verdict = "pass" if median <= budget_s else "FAIL"
        lines.append(f"| `{name}` | {median:.3f} | {q1:.3f} – {q3:.3f} | {statistics.median(cpu[name]):.3f} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds of every command, >= 2 (default: 15)")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds a command's median may take (default: 1)")
    parser.add_argument("--out", type=Path, help="write OUT.md and OUT.json")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: accepted: an integer >= 2 (quartiles need two samples)")
    wall, cpu = run(args.rounds)
    table = render(wall, cpu, args.budget)
    print(table)
    if args.out is not None:
        args.out.with_suffix(".md").write_text(table + "\n")
        summary = {name: {**dict(zip(("q1_s", "median_s", "q3_s"), quartiles(v))), "wall_s": v, "cpu_s": cpu[name]}
                   for name, v in wall.items()}
        args.out.with_suffix(".json").write_text(json.dumps({"budget_s": args.budget, "commands": summary}, indent=1) + "\n")
    return 0 if all(quartiles(v)[1] <= args.budget for v in wall.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
