"""``zerofx plan``'s machinery: model specs, the longest sequence that fits, plots, JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sympy
import torch

import zerofx
from cost_models.memory import paper_breakdown
from cost_models.symbolic import T, fit_exact, fit_timeline, longest_fitting
from zerofx.planning import ModelSpec, load_model_spec, parse_bytes, plot_report, report_json, solve_seq_len

ROOT = Path(__file__).resolve().parents[1]


def test_paper_accounting_and_offload() -> None:
    gb = [paper_breakdown(7.5e9, stage=s, world_size=64)["per_device_bytes"] / 1e9 for s in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]  # ZeRO paper, Figure 1
    assert paper_breakdown(20e9, stage=3, world_size=8)["per_device_bytes"] == pytest.approx(40e9)
    cpu = paper_breakdown(7.5e9, stage=3, world_size=64, offload="cpu")
    assert cpu["per_device_bytes"] == pytest.approx(4 * 7.5e9 / 64) and cpu["offloaded_bytes"] == pytest.approx(12 * 7.5e9 / 64)
    with pytest.raises(ValueError, match="accepted: none, cpu, nvme"):
        paper_breakdown(1, stage=3, world_size=1, offload="disk")


def test_exact_polynomial_fit_and_solve() -> None:
    quad = {t: 3 * t * t + 5 * t + 7 for t in (8, 16, 24, 32)}
    assert fit_exact(quad) == 3 * T**2 + 5 * T + 7
    with pytest.raises(ValueError, match="not a degree-2 polynomial"):
        fit_exact({8: 1, 16: 2, 24: 3, 32: 100})
    exprs = fit_timeline({8: [80, 8], 16: [160, 16], 24: [240, 24], 32: [320, 32]})
    assert exprs == [10 * T, T]
    assert longest_fitting(exprs, 1000, upper=10**6) == 100
    assert longest_fitting([3 * T**2 + 5 * T + 7], 3 * 100**2 + 5 * 100 + 7, upper=10**6) == 100
    assert longest_fitting([T + 10], 5, upper=100) == 0


def test_longest_sequence_that_fits_is_checked_by_capture() -> None:
    spec = load_model_spec(f"{ROOT}/examples/model_specs.py:dna_small")
    budget = 24 * 2**20
    result = solve_seq_len(spec, world_size=4, stage=3, config=None, budget_bytes=budget, max_seq_len=1024)  # the model's limit
    assert 64 < result.seq_len < 1024
    assert isinstance(result.peak_expr, sympy.Expr) and result.peak_expr.free_symbols == {T}
    # Capturing at the answer fits; 64 tokens more does not.
    def peak_at(t: int) -> int:
        ids = torch.zeros(1, t, dtype=torch.long, device="meta")
        program = zerofx.compile(spec.model, world_size=4, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids})
        return program.report(0).peak.live_bytes

    assert peak_at(result.seq_len) <= budget < peak_at(result.seq_len + 64)


def test_model_spec_forms_and_errors(tmp_path: Path) -> None:
    spec = load_model_spec(f"{ROOT}/examples/model_specs.py:hf_llama_tiny")
    assert spec.args == () and set(spec.kwargs) == {"input_ids", "labels"}
    spec = load_model_spec("examples.model_specs:dna_small")
    assert len(spec.args) == 1 and "labels" in spec.kwargs
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return 3\n")
    with pytest.raises(zerofx.ZeroFXError, match="must return \\(model, example_inputs\\)"):
        load_model_spec(f"{bad}:f")
    with pytest.raises(zerofx.ZeroFXError, match="has no callable 'g'"):
        load_model_spec(f"{bad}:g")
    with pytest.raises(zerofx.ZeroFXError, match="does not exist"):
        load_model_spec("/no/such.py:f")
    with pytest.raises(zerofx.ZeroFXError, match="FILE.py:CALLABLE"):
        load_model_spec("just_a_name")
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5 GB") == 1.5e9
    with pytest.raises(zerofx.ZeroFXError, match="accepted"):
        parse_bytes("lots")


def test_plot_and_json(tmp_path: Path) -> None:
    spec = load_model_spec(f"{ROOT}/examples/model_specs.py:hf_llama_tiny")
    program = zerofx.compile(spec.model, world_size=8, stage=3, example_inputs=spec.args, example_kwargs=spec.kwargs)
    report = program.report(0)
    out = tmp_path / "timeline.png"
    plot_report(report, out, title="llama", budget_bytes=2**30)
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(report_json(program, report, 2**30))
    assert data["memory"]["fits"] is True and data["plan"]["world_size"] == 8
    assert len(data["schedule"]) == len(report.rows) > 0


def test_profiles_builtin_file_and_calibration(tmp_path: Path) -> None:
    from cost_models.profiles import load_profile, save_profile
    from zerofx.calibrate import calibrate

    comm, device = load_profile("h100")
    assert comm.ranks_per_node == 8 and device.name == "h100"
    path = tmp_path / "profile.json"
    save_profile(path, comm, device)
    assert load_profile(str(path)) == (comm, device)
    with pytest.raises(ValueError, match="neither a built-in"):
        load_profile("/no/such/profile.json")
    measured_comm, measured_device = calibrate(tmp_path / "measured.json", world_size=2, repeats=2)
    assert measured_comm.intra_bandwidth > 1e6 and 0 < measured_comm.intra_alpha_s < 1
    assert measured_device.matmul_flops_per_s > 1e8
    # The planner takes it: a slower link means more communication time.
    program = zerofx.compile(load_model_spec("examples.model_specs:dna_small").model, world_size=2, stage=3,
                             example_inputs=(torch.zeros(1, 64, dtype=torch.long, device="meta"),),
                             example_kwargs={"labels": torch.zeros(1, 64, dtype=torch.long, device="meta")})
    slow = program.report(0, comm=measured_comm, device=measured_device)
    fast = program.report(0, comm=comm, device=device)
    assert slow.comm_s > fast.comm_s
