"""Record one calibration of this machine's collectives, and the comm model's fit to it.

    python -m benchmarks.calibrate_comm [--world-sizes 2,4] [--repeats 5]

Runs ``zerofx calibrate``'s measurements (all-gather, reduce-scatter, all-reduce and all-to-all
at 16 KiB to 8 MiB) on 2 and then 4 local gloo ranks, fits the ring model's alpha and bus
bandwidth to all of them at once (NOTE [Fitting the comm model to a calibration]), and writes
``benchmarks/results/comm_calibration_<date>.json`` (every measurement and the fit) and a ``.md``
table of measured against predicted times. tests/test_comm_model.py holds the fit to the
recorded file; docs/comm-model.md shows the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
from pathlib import Path

from zerofx.app.calibrate import LOCAL_RANKS_PER_NODE, calibrate, record_json
from zerofx.cost_models.comm import CommSpec, fit_link, predict_s

RESULTS = Path(__file__).resolve().parent / "results"


def fitted(measurements: list[tuple[str, int, float, float]]) -> CommSpec:
    alpha, bandwidth = fit_link(measurements)
    return CommSpec("calibrated-gloo", alpha, bandwidth, alpha, bandwidth, ranks_per_node=LOCAL_RANKS_PER_NODE)


def fit_table(measurements: list[tuple[str, int, float, float]], spec: CommSpec) -> str:
    """Markdown: each measurement, the model's prediction and the relative error."""
    lines = ["| collective | ranks | bytes | measured ms | predicted ms | error |", "|---|---|---|---|---|---|"]
    for c, n, b, t in measurements:
        p = predict_s(c, b, n, spec)
        lines.append(f"| {c} | {n} | {int(b):,} | {t * 1e3:.3f} | {p * 1e3:.3f} | {(p - t) / t:+.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows: list[tuple[str, int, float, float]] = []
    for n in (int(x) for x in args.world_sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "profile.json"
            calibrate(path, world_size=n, repeats=args.repeats)
            rows += [tuple(m) for m in json.loads(path.read_text())["measurements"]["intra"]]
    spec = fitted(rows)
    date = datetime.date.today().isoformat()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; gloo over loopback, one thread per rank"
    out = args.out or RESULTS / f"comm_calibration_{date}.json"
    out.write_text(record_json(rows, spec, machine=machine, date=date, repeats=args.repeats))
    command = f"python -m benchmarks.calibrate_comm --world-sizes {args.world_sizes} --repeats {args.repeats}"
    out.with_suffix(".md").write_text(
        f"# Comm model fit, {date}\n\n{machine}. Command: `{command}`.\n\n"
        f"Fitted: alpha {spec.intra_alpha_s * 1e6:.0f} us per ring step, bus bandwidth {spec.intra_bandwidth / 1e9:.3g} GB/s.\n\n"
        + fit_table(rows, spec) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}: alpha {spec.intra_alpha_s * 1e6:.0f} us, bandwidth {spec.intra_bandwidth / 1e9:.3g} GB/s")
    print(fit_table(rows, spec))


if __name__ == "__main__":
    main()
