"""``zerofx plan``'s machinery: model specs, the longest sequence that fits, plots, JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import sympy
import torch

import zerofx
from tests.support.models import dna_one_block
from zerofx.planner.folding import RepeatedBlocks, same_tiling_per_block
from zerofx.config import parse_bytes
from zerofx.passes.plan.tiling import TiledOp
from zerofx.cost_models.memory import paper_breakdown
from zerofx.cost_models.symbolic import B, T, fit_exact, fit_timeline, longest_fitting
from zerofx.planner.solve import ModelSpec
from zerofx.app.model_spec import load_model_spec
from zerofx.app.commands.plan_output import plot_report, report_json

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


@pytest.mark.slow
def test_longest_sequence_that_fits_is_checked_by_capture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``zerofx plan --solve seq_len`` (JSON, with the plot) of the tiny DNA LM with one block (a
    model spec, tests/support/models.py; a solve's dozen captures are its cost): the plan, its
    verdict at the example's length, and the longest sequence that fits, which capturing
    confirms exactly."""
    from zerofx.app.cli import main

    png, budget = tmp_path / "timeline.png", 2**20
    argv = ["plan", f"{ROOT}/tests/support/models.py:dna_one_block", "--world-size", "4", "--stage", "3", "--format", "json",
            "--budget", "1MiB", "--solve", "seq_len", "--plot", str(png)]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["world_size"] == 4 and data["plan"]["stage"] == 3
    assert {r["op"] for r in data["schedule"]} == {"all_gather_into_tensor", "reduce_scatter_tensor"}
    assert data["memory"]["fits"] is False  # the example's 512 tokens need more than 1 MiB per rank
    assert png.read_bytes()[:4] == b"\x89PNG"
    seq_len = data["solve"]["seq_len"]
    assert 64 < seq_len < 512  # the model's limit
    assert {str(s) for s in sympy.sympify(data["solve"]["peak_bytes_expr"]).free_symbols} <= {"B", "T"}
    # The solve's own captures at the answer and one token past it: the first fits, the second
    # does not (the answer is exact, not approximate).
    captured = data["solve"]["captured_peak_bytes"]
    assert captured["at"] <= budget < captured["one_past"]


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


@pytest.mark.slow
def test_profiles_builtin_file_and_calibration(tmp_path: Path) -> None:
    from zerofx.cost_models.profiles import load_profile, save_profile
    from zerofx.app.calibrate import calibrate

    comm, device = load_profile("h100")
    assert comm.ranks_per_node == 8 and device.name == "h100"
    path = tmp_path / "profile.json"
    save_profile(path, comm, device)
    assert load_profile(str(path)) == (comm, device)
    with pytest.raises(ValueError, match="neither a built-in"):
        load_profile("/no/such/profile.json")
    measured_comm, measured_device = calibrate(tmp_path / "measured.json", world_size=2, repeats=2, sizes=(2**12, 2**16))
    assert measured_comm.intra_bandwidth > 1e6 and 0 < measured_comm.intra_alpha_s < 1
    assert measured_device.matmul_flops_per_s > 1e8
    # What the predictions need of this host: its cores, an idle rank's resident memory (torch
    # and the engine imported: well over 100 MiB), and copy rates by size, the largest the DRAM rate.
    assert measured_device.cores is not None and measured_device.cores >= 1 and measured_device.runtime_bytes > 100 * 2**20
    # A new tensor's pages cost something to fault in (NOTE [New tensors' pages]), from the size the process maps them at.
    assert measured_device.fresh_s_per_byte >= 0 and measured_device.fresh_min_bytes > 0
    # The optimizer update timed (NOTE [The optimizer update's time]): torch's AdamW moves well
    # under 1 TB/s on a CPU core, so a pass over an element takes more than 4e-12 s.
    assert 4e-12 < measured_device.update_s_per_element_pass < 1e-6
    # What Inductor keeps resident once it compiled the tiny model's graphs (NOTE [What Inductor
    # keeps resident]): its modules and code, tens of MiB; priced only because it was measured.
    assert measured_device.inductor_bytes is not None and 5 * 2**20 < measured_device.inductor_bytes < 1024 * 2**20
    # A collective after compute costs its launch, measured (NOTE [A collective between compute]).
    assert 0 <= measured_comm.base_latency_s < 1
    sizes = [size for size, _ in measured_device.memory_curve]
    assert sizes == sorted(sizes) and len(sizes) >= 3 and measured_device.memory_curve[-1][1] == measured_device.memory_bytes_per_s
    assert load_profile(str(tmp_path / "measured.json"))[1] == measured_device  # the curve survives the file
    # gloo copies a collective's buffer while it runs, and the profile says so (NOTE [gloo copies a collective's buffer]).
    assert measured_comm.collective_copies and load_profile(str(tmp_path / "measured.json"))[0] == measured_comm
    # The planner takes it: a slower link means more communication time.
    program = zerofx.compile(load_model_spec("examples.model_specs:dna_small").model, world_size=2, stage=3,
                             example_inputs=(torch.zeros(1, 64, dtype=torch.long, device="meta"),),
                             example_kwargs={"labels": torch.zeros(1, 64, dtype=torch.long, device="meta")})
    slow = program.report(0, comm=measured_comm, device=measured_device)
    fast = program.report(0, comm=comm, device=device)
    assert slow.comm_s > fast.comm_s


# --------------------------------------------------------------------------- layer folding
def _dna_spec(size: str, seq_len: int) -> tuple[torch.nn.Module, tuple, dict]:
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM

    with torch.device("meta"):
        model = DNADecoderLM(DNA_LM_SIZES[size])
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


@pytest.mark.slow
def test_folded_plan_matches_the_full_capture() -> None:
    from zerofx.planner.folding import find_repeated_blocks, plan_folded, with_num_blocks

    model, args, kwargs = _dna_spec("small", 128)  # 4 identical blocks: the full capture is the test's cost
    blocks = find_repeated_blocks(model)
    assert blocks is not None and (blocks.path, blocks.count) == ("blocks", 4)
    cut = with_num_blocks(model, blocks, 2)
    assert len(cut.blocks) == 2 and len(model.blocks) == 4  # the original is left whole
    assert cut.blocks[1] is model.blocks[1] and cut.embed is model.embed  # shared, nothing allocated

    def report_for(m: torch.nn.Module):
        program = zerofx.compile(m, world_size=8, stage=3, example_inputs=args, example_kwargs=kwargs)
        return program.report(0), program.plan

    full, _ = report_for(model)
    folded = plan_folded(model, blocks, report_for, parallel=True)  # the 2-block capture in a forked child
    assert folded.persistent_bytes == full.persistent_bytes
    assert folded.bytes_moved_per_rank == full.bytes_moved_per_rank
    assert folded.num_collectives == len(full.rows)
    # Exact, not close: buckets end at block boundaries, so every extra block adds the same.
    assert folded.peak_bytes == full.peak.live_bytes
    for graph, seconds in full.compute_s.items():
        assert folded.compute_s[graph] == pytest.approx(seconds, rel=1e-9)
    for name in ("comm_s", "exposed_s", "step_s"):
        assert getattr(folded, name) == pytest.approx(getattr(full, name), rel=1e-9), name
    # Block 1's collectives stand for blocks 1..3; the others (embedding, head, block 0) once.
    assert set(folded.repeats.values()) == {3}
    assert all(f.startswith("blocks.1.") for r in folded.sample.rows if r.order in folded.repeats for f in r.bucket)


WIDE_12_BLOCKS = """
from dataclasses import replace
import torch
from zerofx.models import DNADecoderLM
from zerofx.models.sizes import DNA_LM_SIZES

def build():
    with torch.device("meta"):
        model = DNADecoderLM(replace(DNA_LM_SIZES["1b"], num_layers=12))
    ids = torch.zeros(1, 512, dtype=torch.long, device="meta")
    return model, ((ids,), {"labels": ids})
"""


@pytest.mark.slow
def test_folded_plan_takes_the_whole_models_prefetch_distance_from_the_profile(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """NOTE [The whole model's prefetch distance]: 12 blocks of the 1b's width at 1,024 ranks, K
    8, on the H100 profile: the cut models alone would gather 4 buckets ahead and the whole
    model 3, so ``zerofx plan`` folds at 3, says so, and its peak is the whole model's."""
    from zerofx.app.cli import main

    (tmp_path / "wide.py").write_text(WIDE_12_BLOCKS)
    (tmp_path / "k8.json").write_text(json.dumps({"zerofx": {"shard_group_size": 8}}))
    out = {}
    for fold in ("on", "off"):
        assert main(["plan", f"{tmp_path / 'wide.py'}:build", "--world-size", "1024", "--stage", "3", "--profile", "h100",
                     "--config", str(tmp_path / "k8.json"), "--fold", fold, "--format", "json"]) == 0
        out[fold] = json.loads(capsys.readouterr().out)
    assert out["on"]["plan"]["prefetch_distance"] == out["off"]["plan"]["prefetch_distance"] == 3
    assert any("the cut models' own was 4" in d for d in out["on"]["plan"]["decisions"])
    assert out["on"]["memory"]["peak_bytes"] == out["off"]["memory"]["peak_bytes"]


@pytest.mark.slow
def test_folded_peak_is_exact_when_the_prefetch_window_spans_blocks() -> None:
    """NOTE [A window that spans blocks]: with one gather bucket per block, a prefetch distance
    of d buckets reaches d blocks ahead. The 2- and 3-block cuts under-predict such a peak, so
    folding cuts larger (or plans the whole model) until the peak is exact."""
    from zerofx.planner.folding import find_repeated_blocks, fold_reports, plan_folded, with_num_blocks
    from zerofx.models import DNADecoderLM
    from zerofx.models.sizes import DNALMConfig
    from zerofx.passes.analysis.analyze_schedule import ScheduleReport

    with torch.device("meta"):
        model = DNADecoderLM(DNALMConfig(dim=64, num_layers=12, num_heads=4, ffn_dim=172, max_seq_len=256))
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    blocks = find_repeated_blocks(model)
    assert blocks is not None and blocks.count == 12
    one_bucket_per_block = sum(p.numel() for p in model.blocks[0].parameters()) + 1
    captures: dict[int, zerofx.Program] = {}  # by block count; each prefetch distance replans them
    # By block count and distance: folding asks again for the 2- and 3-block cuts and the whole
    # model that the checks below also read, and lowering one is the cost.
    reports: dict[tuple[int, int], tuple[ScheduleReport, zerofx.Plan]] = {}

    def report_at(m: torch.nn.Module, distance: int) -> tuple[ScheduleReport, zerofx.Plan]:
        config = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": one_bucket_per_block},
                  "zerofx": {"prefetch_distance": distance}}
        n = len(m.blocks)
        if n not in captures:
            captures[n] = zerofx.compile(m, world_size=4, stage=3, config=config, example_inputs=(ids,), example_kwargs={"labels": ids})
        if (n, distance) not in reports:
            program = captures[n].replan(config)
            reports[n, distance] = program.report(0), program.plan
        return reports[n, distance]

    # distance -> the cuts folding settles on: a window of at most one block keeps 2 and 3; from
    # 4 blocks on, the two cuts would hold more blocks than the whole model, which is planned.
    expected_cuts = {1: (2, 3), 2: (4, 5), 3: (5, 6), 4: (12, 12)}
    for distance, cuts in expected_cuts.items():
        full, plan = report_at(model, distance)
        assert plan.prefetch_distance == distance and sum(1 for b in plan.gather_buckets if b[0].startswith("blocks.1.")) == 1
        folded = plan_folded(model, blocks, lambda m, d=distance: report_at(m, d))
        assert folded.cuts == cuts, distance
        assert folded.peak_bytes == full.peak.live_bytes, distance
        assert folded.bytes_moved_per_rank == full.bytes_moved_per_rank and folded.persistent_bytes == full.persistent_bytes
        # The step's exposed communication settles about a block later than the peak: close, not equal.
        assert folded.step_s == pytest.approx(full.step_s, rel=0.05), distance
        if distance >= 2:  # what the 2- and 3-block cuts alone said: short of the whole model's peak
            small, large = (report_at(with_num_blocks(model, blocks, n), distance)[0] for n in (2, 3))
            assert fold_reports(small, large, blocks).peak_bytes < full.peak.live_bytes


def test_fold_finds_the_blocks_of_a_transformers_model() -> None:
    from zerofx.planner.folding import find_repeated_blocks, with_num_blocks

    model = load_model_spec(f"{ROOT / 'examples' / 'model_specs.py'}:hf_llama_tiny").model
    blocks = find_repeated_blocks(model)
    assert blocks is not None and (blocks.path, blocks.count) == ("model.layers", 2)
    cut = with_num_blocks(model, blocks, 1)
    assert len(cut.model.layers) == 1 and len(model.model.layers) == 2 and cut.lm_head is model.lm_head
    with pytest.raises(ValueError, match="outside 1..2"):
        with_num_blocks(model, blocks, 3)
    assert find_repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 3))) is None


def test_plan_20b_at_512_ranks_folds_in_little_memory() -> None:
    """The issue's scale case, run as a user would; its RSS is checked, its time only printed
    (timings are not asserted in tests). The RSS counted is the process's peak plus its forked
    1-block capture's, which overcounts the pages they share."""
    import subprocess
    import sys
    import time

    start = time.perf_counter()
    code = ("import sys; from zerofx.app.cli import main; rc = main(sys.argv[1:]); "
            # VmHWM, not ru_maxrss: ru_maxrss would start from this pytest process's own peak.
            "import resource; child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
            "print('maxrss_kib', child + int([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])); "
            "sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, "plan", "examples/model_specs.py:decoder_20b", "--world-size", "512",
                          "--stage", "3", "--budget", "80GiB"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    print(f"zerofx plan 20B at 512 ranks: {time.perf_counter() - start:.1f} s")
    assert "19,931,910,144 parameters" in out.stdout and "44 identical blocks" in out.stdout
    assert "budget 80 GiB: fits" in out.stdout
    maxrss_kib = int(out.stdout.rsplit("maxrss_kib", 1)[1])
    assert maxrss_kib < 2 * 2**20, f"planning used {maxrss_kib / 2**20:.2f} GiB"


@pytest.mark.slow
def test_prefetch_distance_is_lowered_to_fit_the_memory_budget() -> None:
    model, args, kwargs = _dna_spec("small", 128)
    captured = zerofx.compile(model, world_size=4, stage=3, example_inputs=args, example_kwargs=kwargs)

    def program(**own: object) -> zerofx.Program:  # planned again from the one capture
        return captured.replan({"zerofx": {"prefetch_distance": 2, **own}})

    peaks = {d: program(prefetch_distance=d).report(0).peak.live_bytes for d in (0, 1, 2)}
    assert peaks[0] < peaks[1] < peaks[2]  # each bucket prefetched ahead is one more gathered bucket alive
    roomy = program(memory_budget=peaks[2])
    assert roomy.plan.prefetch_distance == 2 and roomy.plan.decisions == ()
    tight = program(memory_budget=(peaks[1] + peaks[2]) // 2)
    assert tight.plan.prefetch_distance == 1 and tight.report(0).peak.live_bytes == peaks[1]
    assert "lowered from 2 to 1" in tight.plan.decisions[0] and "fits" in tight.plan.decisions[0]
    assert "decision: prefetch distance lowered" in str(tight.plan)
    assert zerofx.Plan.from_json(tight.plan.to_json()) == tight.plan
    hopeless = program(memory_budget="1KiB")
    assert hopeless.plan.prefetch_distance == 0 and "does not fit even without prefetch" in hopeless.plan.decisions[0]
    with pytest.raises(zerofx.ConfigError, match="zerofx.memory_budget.*accepted: bytes > 0"):
        program(memory_budget="lots")


@pytest.mark.slow
def test_memory_model_is_symbolic_in_batch_and_sequence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fit in B and T, and ``solve_memory`` for the batch size; a second solve reads every
    capture from the plan cache (NOTE [Solve samples in the plan cache]). The suite's plan cache
    holds this model's samples already when the CLI solve above ran first in this process."""
    import zerofx.compiler.program
    from zerofx.config import parse_config
    from zerofx.cost_models.symbolic import fit_timeline_batch_seq
    from zerofx.planner.solve import sample_program, solve_memory

    if parse_config(None).plan_cache_dir is None:  # the cache turned off by the caller: one of this test's own
        monkeypatch.setenv("ZEROFX_PLAN_CACHE", str(tmp_path))

    # c(T) + B * a(T), fitted from two batch sizes and checked at a third.
    truth = lambda b, t: 1000 + 7 * t + b * (3 * t * t + 5 * t)  # noqa: E731  (a one-line formula, read like the assert below)
    samples = {(b, t): [truth(b, t), 64 * b] for b in (1, 2) for t in (8, 16, 24, 32)}
    exprs = fit_timeline_batch_seq({**samples, (3, 8): [truth(3, 8), 192]})
    assert exprs == [sympy.expand(1000 + 7 * T + B * (3 * T**2 + 5 * T)), 64 * B]
    with pytest.raises(ValueError, match="not linear in B"):
        fit_timeline_batch_seq({**samples, (3, 8): [truth(3, 8) + 1, 192]})

    model, _ = dna_one_block()  # the CLI solve's model: its samples at batch 1 and 2 are this solve's
    ids = torch.zeros(1, 128, dtype=torch.long, device="meta")  # batch 1, 128 tokens
    spec = ModelSpec(model, (ids,), {"labels": ids}, "dna_one_block")

    def peak_at(b: int) -> int:  # zerofx.compile, kept in the plan cache as the solve keeps its captures
        ids = torch.zeros(b, 128, dtype=torch.long, device="meta")
        return sample_program(model, (ids,), {"labels": ids}, world_size=4, stage=3, config=None).report(0).peak.live_bytes

    budget = (peak_at(6) + peak_at(7)) // 2
    result = solve_memory(spec, "batch_size", world_size=4, stage=3, config=None, budget_bytes=budget, upper=4096)
    assert result.variable == "batch_size" and result.value == 6
    assert result.peak_expr.free_symbols <= {B, T} and B in result.peak_expr.free_symbols
    assert result.peak_at_value == peak_at(6) and result.peak_past_value == peak_at(7)

    captures = []
    monkeypatch.setattr(zerofx.compiler.program, "StepCapture", lambda *a, **k: captures.append(a) or pytest.fail("captured again"))
    assert solve_memory(spec, "batch_size", world_size=4, stage=3, config=None, budget_bytes=budget, upper=4096) == result
    assert captures == []


def test_buckets_end_at_block_boundaries() -> None:
    from zerofx.passes.zero.plan_buckets import plan_buckets, repeated_blocks_of

    shapes = {"embed.weight": (16, 8), "norm.weight": (8,)}
    for i in range(3):
        shapes |= {f"blocks.{i}.attn.weight": (8, 8), f"blocks.{i}.mlp.weight": (8, 8), f"blocks.{i}.norm.weight": (8,)}
    shapes |= {"heads.0.weight": (4, 8), "heads.1.weight": (2, 8)}  # indexed, but not identical: not blocks
    block_of = repeated_blocks_of(shapes)
    assert block_of["blocks.2.mlp.weight"] == "blocks.2" and block_of["embed.weight"] == "" and block_of["heads.1.weight"] == ""
    order = ["embed.weight"] + [f"blocks.{i}.{n}" for i in range(3) for n in ("norm.weight", "attn.weight", "mlp.weight")] + ["norm.weight"]
    nbytes = {f: 4 * int(torch.tensor(s).prod()) for f, s in shapes.items()}
    # A cap that holds 1.5 blocks: without boundaries, buckets drift across blocks.
    cap = 3 * (256 + 256 + 32) // 2
    drifting = plan_buckets(order, nbytes, cap)
    assert any(len({block_of[f] for f in b}) > 1 for b in drifting)
    aligned = plan_buckets(order, nbytes, cap, block_of=block_of)
    assert all(len({block_of[f] for f in b}) == 1 for b in aligned)
    assert aligned == (("embed.weight",), *(tuple(f"blocks.{i}.{n}" for n in ("norm.weight", "attn.weight", "mlp.weight")) for i in range(3)), ("norm.weight",))
    # A cap smaller than a block still splits inside it, the same way in every block.
    small = plan_buckets(order, nbytes, 300, block_of=block_of)
    per_block = [[tuple(f.split(".", 2)[2] for f in b) for b in small if block_of[b[0]] == f"blocks.{i}"] for i in range(3)]
    assert per_block[0] == per_block[1] == per_block[2] and len(per_block[0]) > 1


def test_cli_folded_json_agrees_with_the_full_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from zerofx.app.cli import main

    argv = ["plan", "small", "--world-size", "4", "--stage", "3", "--format", "json", "--seq-len", "128"]
    assert main([*argv, "--fold", "on"]) == 0
    folded = json.loads(capsys.readouterr().out)
    assert main([*argv, "--fold", "off"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert folded["folded"] == {"path": "blocks", "num_blocks": 4, "captured_blocks": [2, 3], "num_collectives": len(full["schedule"])}
    assert folded["memory"]["peak_bytes"] == full["memory"]["peak_bytes"]
    assert folded["summary"]["bytes_moved_per_rank"] == full["summary"]["bytes_moved_per_rank"]
    assert folded["summary"]["step_s"] == pytest.approx(full["summary"]["step_s"], rel=1e-9)
    assert {r["repeats"] for r in folded["schedule"]} == {1, 3}


def test_cli_fold_on_needs_three_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    from zerofx.app.cli import main

    assert main(["plan", "tiny", "--world-size", "2", "--stage", "3", "--seq-len", "32", "--fold", "on"]) == 2
    assert re.search(r"'blocks' holds 2 blocks; folding needs at least 3 .*use --fold off", capsys.readouterr().err)


def test_cli_recompute_auto_is_planned_whole(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Recompute "auto" fits the whole model's peak to the budget, which the cut models of a folded
    plan are planned without: folding by default plans the whole model and says so; --fold on is refused."""
    from zerofx.app import cli
    from zerofx.planner import folded_plan

    config = tmp_path / "auto.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "zerofx": {"recompute": "auto"}}))
    argv = ["plan", "small", "--world-size", "4", "--seq-len", "64", "--budget", "1GiB", "--config", str(config), "--format", "json"]
    assert cli.main([*argv, "--fold", "on"]) == 2
    assert "--fold on cannot plan zerofx.recompute \"auto\"" in capsys.readouterr().err
    monkeypatch.setattr(folded_plan, "AUTO_FOLD_MIN_BLOCKS", 3)  # the small model's 4 blocks would fold
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert "planning all 4 blocks of 'blocks', not folded" in out.err
    assert "folded" not in json.loads(out.out)


def test_cli_tiling_on_folds_at_the_whole_models_block(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """NOTE [One tiling for every cut]: with tiling ``true`` each cut would take the largest block
    its own estimate fits (here 512 tokens, where the whole model's needs 256, and both cuts alike,
    so nothing said they differ); the folded plan pins the whole model's block in its cuts and its
    figures are the whole model's."""
    from zerofx.app import cli

    config = tmp_path / "on.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "zerofx": {"tiling": {"enabled": True, "budget": "70MiB"}}}))
    argv = ["plan", "small", "--world-size", "2", "--seq-len", "1024", "--config", str(config), "--format", "json"]
    got = {}
    for fold in ("on", "off"):
        assert cli.main([*argv, "--fold", fold]) == 0
        got[fold] = json.loads(capsys.readouterr().out)
    folded, whole = got["on"], got["off"]
    assert {op["block_size"] for op in whole["plan"]["tiling"]["ops"] if op["kind"] == "region"} == {256}
    assert {op["block_size"] for op in folded["plan"]["tiling"]["ops"] if op["kind"] == "region"} == {256}
    assert any("tiling block size 256 tokens, the whole model's" in d for d in folded["plan"]["decisions"])
    assert folded["memory"]["peak_bytes"] == whole["memory"]["peak_bytes"]
    assert folded["summary"]["step_s"] == pytest.approx(whole["summary"]["step_s"], rel=1e-9)


def _tiled(*ops: tuple[str, str, int, int]) -> SimpleNamespace:
    """A plan whose tiling tiles ``ops``: (kind, what, block size, how many)."""
    return SimpleNamespace(tiling=SimpleNamespace(ops=tuple(
        TiledOp(kind, i, what, (1, 8192, 768), block, 1, 1) for kind, what, block, times in ops for i in range(times))))


def test_folding_checks_that_every_cut_tiles_its_blocks_alike() -> None:
    """NOTE [Tiling the same in every cut]: cuts that tile a block's op at another block size, or
    leave it untiled in one cut and not the other, do not extrapolate; a last block tiled apart
    (its region reaching into the head) and weights named per block do."""
    blocks = RepeatedBlocks("blocks", 14)
    attn, mlp, last = ("attention", "sdpa", 512), ("region", "mlp", 2048), ("region", "mlp and head", 2048)
    two = _tiled((*attn, 2), (*mlp, 1), (*last, 1))
    three = _tiled((*attn, 3), (*mlp, 2), (*last, 1))
    assert same_tiling_per_block(two, three, blocks, (2, 3))
    assert same_tiling_per_block(_tiled(), _tiled(), blocks, (2, 3))
    # Block 0's region untiled in the 2-block cut, tiled in two blocks of the 3-block one (the 100m at 8k).
    assert not same_tiling_per_block(_tiled((*attn, 2), (*last, 1)), three, blocks, (2, 3))
    # Another block size in one cut.
    assert not same_tiling_per_block(_tiled((*attn, 2), ("region", "mlp", 1024, 1), (*last, 1)), three, blocks, (2, 3))
    # Longer cuts: two blocks apart, a whole number of blocks' worth.
    assert same_tiling_per_block(_tiled((*attn, 4), (*mlp, 3), (*last, 1)), _tiled((*attn, 6), (*mlp, 5), (*last, 1)), blocks, (4, 6))
    assert not same_tiling_per_block(_tiled((*attn, 4), (*mlp, 3)), _tiled((*attn, 5), (*mlp, 5)), blocks, (4, 6))
    # Weight tiles are named per block.
    weights = [SimpleNamespace(tiling=SimpleNamespace(ops=tuple(
        TiledOp("weight", i, f"linear blocks.{i}.mlp.up", (3072, 768), 4, 1, 1, param=f"blocks.{i}.mlp.up.weight") for i in range(n))))
        for n in (2, 3)]
    assert same_tiling_per_block(*weights, blocks, (2, 3))
