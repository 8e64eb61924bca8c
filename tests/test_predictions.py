"""The predictions benchmark (benchmarks/bench_predictions.py): its smoke run's report, and the
row arithmetic. The timing targets are the full run's (docs/predictions.md), not checked here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_predictions import PEAK_TARGET, SMOKE_CASES, STEP_TARGET, Case, build_parser, main, row_for


def test_every_option_has_help() -> None:
    parser = build_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} >= {"profile", "only", "warmup", "steps", "smoke", "out"}
    assert all(a.help for a in options)


def test_row_ratios_and_targets() -> None:
    case = Case("x", "tiny", 2, 3, 64)
    measured = {"step_s": 2.0, "peak_rss_bytes": 1000}
    inside = row_for(case, {"step_s": 2.0 * (1 + STEP_TARGET) * 0.999, "process_peak_bytes": 1000 * (1 - PEAK_TARGET) * 1.001}, measured)
    assert inside["step_within"] and inside["peak_within"]
    outside = row_for(case, {"step_s": 1.0, "process_peak_bytes": 1200}, measured)
    assert outside["step_ratio"] == 0.5 and outside["peak_ratio"] == 1.2
    assert not outside["step_within"] and not outside["peak_within"]


# As tests/test_capped.py's smoke: glibc's default allocator, so the ranks fork from the suite's server.
SMOKE_MALLOC = ("--malloc-mmap-threshold", "0")


@pytest.mark.multiprocess
def test_smoke_run_reports_every_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "262144")  # main sets it for its ranks; restored after the test
    out = tmp_path / "predictions"
    assert main(["--smoke", "--out", str(out), *SMOKE_MALLOC]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["name"] for r in data["rows"]] == [c.name for c in SMOKE_CASES]
    # One calibration per world size among the cases, each row predicted with its own.
    assert set(data["profiles"]) == {str(c.world_size) for c in SMOKE_CASES}
    for row in data["rows"]:
        device = data["profiles"][str(row["case"]["world_size"])]["device"]
        assert row["profile"] == data["profiles"][str(row["case"]["world_size"])]["path"]
        assert device["runtime_bytes"] > 100 * 2**20 and device["cores"] >= 1  # calibrate measured the baseline
        p, m = row["predicted"], row["measured"]
        assert p["step_s"] > 0 and p["command"].startswith("zerofx plan tiny --config ")
        assert p["process_peak_bytes"] == p["timeline_peak_bytes"] + device["runtime_bytes"]
        assert m["step_p25_s"] <= m["step_s"] <= m["step_p75_s"] and len(m["step_all_s"]) == data["steps"]
        assert m["peak_rss_bytes"] == max(m["peak_rss_per_rank_bytes"]) > m["runtime_rss_bytes"] > 0
        assert row["step_ratio"] == pytest.approx(p["step_s"] / m["step_s"])
        assert row["peak_ratio"] == pytest.approx(p["process_peak_bytes"] / m["peak_rss_bytes"])
        assert row["step_within"] == (abs(row["step_ratio"] - 1) <= STEP_TARGET)
    text = out.with_suffix(".md").read_text()
    lines = text.splitlines()
    command = f"python -m benchmarks.bench_predictions --smoke --out {out} {' '.join(SMOKE_MALLOC)}"
    assert lines[0].startswith("Machine: ") and lines[1] == f"Command: `{command}`"
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].startswith("| config | tokens/rank | predicted step s | measured step s")
    assert [line.split(" | ")[0][2:] for line in table[1:]] == [c.name for c in SMOKE_CASES]
    assert f"of {len(SMOKE_CASES)}, peak" in text
