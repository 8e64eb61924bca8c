"""What ``zerofx plan`` prints for people (rows in module terms, one unit formatter, the profile
it estimates for, folding explained, the plot), and a command line that answers without torch."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerofx
from zerofx.app.cli import build_parser, main
from zerofx.app.commands.plan_output import plot_title, step_note
from zerofx.cost_models.profiles import load_profile
from zerofx.models import DNA_LM_SIZES, DNADecoderLM
from zerofx.passes.analysis.analyze_schedule import END, START, ScheduleReport, bucket_label, format_report, module_label
from zerofx.app.commands.plan_output import plot_report
from zerofx.common.units import binary_unit, format_bytes, format_seconds, parse_bytes
from tests.support.doc_quotes import quoted_block, quoted_mismatch

ROOT = Path(__file__).resolve().parents[1]
# FX node names as torch names them: the schedule prints none of these without --verbose.
FX_NAME = re.compile(r"\b(wait_tensor_default|new_empty_default|all_gather_into_tensor_out_default|reduce_scatter_tensor_default)\w*")


def _tiny(stage: int) -> tuple[torch.nn.Module, zerofx.Program]:
    with torch.device("meta"):
        model = DNADecoderLM(DNA_LM_SIZES["tiny"])  # 2 blocks
        ids = torch.zeros(1, 32, dtype=torch.long)  # (B, T)
    return model, zerofx.compile(model, world_size=2, stage=stage, example_inputs=(ids,), example_kwargs={"labels": ids})


@pytest.fixture(scope="module")
def stage3() -> tuple[torch.nn.Module, ScheduleReport]:
    model, program = _tiny(3)
    return model, program.report(0)


# --------------------------------------------------------------------------- rows in module terms
def test_schedule_rows_name_modules_not_fx_nodes(stage3: tuple[torch.nn.Module, ScheduleReport]) -> None:
    model, report = stage3
    modules = {name for name, _ in model.named_modules()} | {START, END}
    for row in report.rows:
        assert row.issued_after_module in modules and row.waited_at_module in modules, row
    assert report.peak_module in modules
    by_bucket = {(r.graph, r.op, r.bucket_label): r for r in report.rows}
    block_1 = f"blocks.1 ({len(list(model.blocks[1].parameters()))} tensors)"
    # Prefetch distance 1: block 1's gather is issued once block 0's has arrived, right after the
    # embedding's compute, and is waited for where block 1 starts.
    gather = by_bucket[("forward", "all_gather_into_tensor", block_1)]
    assert (gather.issued_after_module, gather.waited_at_module) == ("embed", "blocks.1")
    # Block 1's gradients are reduced once backward has produced the last of them.
    reduce = next(r for r in report.rows if r.op == "reduce_scatter_tensor" and r.bucket_label.startswith("blocks.1"))
    assert reduce.issued_after_module.startswith("blocks.1.")

    text = format_report(report)
    assert not FX_NAME.search(text), FX_NAME.search(text)
    assert block_1 in text and "issued after" in text and "waited at" in text and "--verbose" in text
    verbose = format_report(report, verbose=True)
    assert "wait_tensor_default" in verbose and "issued after node" in verbose and f"(node {report.peak.node})" in verbose


def test_stage_0_rows_name_modules_from_whole_parameters() -> None:
    model, program = _tiny(0)
    report = program.report(0)
    modules = {name for name, _ in model.named_modules()} | {START, END}
    assert report.rows and all(r.op == "all_reduce" for r in report.rows)
    for row in report.rows:
        assert row.issued_after_module in modules and row.waited_at_module in modules, row
    assert not FX_NAME.search(format_report(report))


def test_bucket_and_module_labels() -> None:
    block = ["blocks.0.norm.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.out.weight"]
    everything = ["embed.weight", *block, "norm.weight"]
    assert bucket_label(tuple(block), everything) == "blocks.0 (3 tensors)"
    assert bucket_label(tuple(block[1:]), everything) == "blocks.0.attn (2 tensors)"
    assert bucket_label(tuple(block[:2]), everything) == "blocks.0: norm.weight … attn.qkv.weight (2 tensors)"
    assert bucket_label(("embed.weight", "norm.weight"), everything) == "embed.weight … norm.weight (2 tensors)"
    assert bucket_label(("embed.weight",), everything) == "embed.weight"
    assert module_label(["blocks.3.attn.qkv.weight"]) == "blocks.3.attn.qkv"
    assert module_label(["blocks.3.attn.qkv.weight", "blocks.3.attn.out.weight"]) == "blocks.3.attn"
    assert module_label(["embed.weight", "norm.weight"]) == "embed + norm"
    assert module_label(["scale"]) == "scale"  # a root parameter names itself


# --------------------------------------------------------------------------- units
def test_format_seconds() -> None:
    """Durations as the search's progress and tables print them: never an exponent (a step of 34.2 s
    read "3.42e+04 ms")."""
    cases = {0.00042: "0.42 ms", 0.0342: "34.2 ms", 0.999: "999 ms", 1.5: "1.5 s", 34.2: "34.2 s", 750: "12.5 min"}
    assert {s: format_seconds(s) for s in cases} == cases


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1 KiB"), (1280, "1.25 KiB"), (10.5 * 1024, "10.5 KiB"),
        (395_264, "386 KiB"), (1000 * 1024, "1000 KiB"), (1_048_570, "1 MiB"), (12_654_080, "12.1 MiB"),
        (4 * 2**30, "4 GiB"), (40e9, "37.3 GiB"), (1.5 * 2**40, "1.5 TiB"), (16e15, "14.2 PiB"), (-2048, "-2 KiB"),
    ],
)
def test_format_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text
    if n >= 1024:
        assert parse_bytes(text) == pytest.approx(n, rel=5e-3)  # three significant digits


def test_binary_unit() -> None:
    assert binary_unit(27.6 * 2**20) == ("MiB", 2**20)
    assert binary_unit(3 * 2**30) == ("GiB", 2**30)
    assert binary_unit(512) == ("B", 1)


def test_estimate_prints_binary_units(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "20e9", "--world-size", "8", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    # 16 bytes per parameter over 8 ranks: 40e9 bytes = 37.3 GiB per device.
    assert out.splitlines()[-1].split()[-2:] == ["37.3", "GiB"]
    assert " GB" not in out and not re.search(r"\d{5,}", out.split("\n", 1)[1])  # no decimal units, no raw byte counts


# --------------------------------------------------------------------------- the CLI's plan text
def test_cli_plan_names_modules_and_the_profile(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "tiny", "--world-size", "2", "--stage", "3", "--seq-len", "32", "--fold", "off"]
    assert main([*argv, "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "wait_tensor_default" in out  # --verbose adds the node names
    summary = next(line for line in out.splitlines() if line.startswith("summary:"))
    assert "estimated step" in summary and "for CPU gloo" in summary
    assert "--profile h100" in summary and "zerofx calibrate" in summary
    rows = [line for line in out.splitlines() if re.match(r"(forward|backward) |\s*\d+\s+(forward|backward) ", line)]
    assert len(rows) > 4 and all(re.search(r"\d (B|KiB|MiB)\b", r) for r in rows), rows
    assert not any(re.search(r"\b\d{5,}\b", r) for r in rows), "a raw byte count in the plan's tables"


def test_step_note_names_other_profiles() -> None:
    comm, device = load_profile("h100")
    note = step_note("h100", comm, device)
    assert note == f" for profile {comm.name} / {device.name}" and "calibrate" not in note
    cpu = step_note("cpu", *load_profile("cpu"))
    assert "CPU gloo" in cpu and "--profile h100" in cpu


def test_cli_folded_plan_explains_its_parameter_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "small", "--world-size", "2", "--stage", "3", "--seq-len", "32", "--fold", "on"]) == 0
    out = capsys.readouterr().out
    whole = int(re.search(r"DNADecoderLM, ([\d,]+) parameters", out).group(1).replace(",", ""))
    line = next(line for line in out.splitlines() if line.startswith("folded:"))
    m = re.fullmatch(r"folded: 'blocks' holds (\d+) identical blocks of ([\d,]+) parameters; .*copies of the model cut to 2 and 3 "
                     r"blocks.* the 3-block copy's plus (\d+) times what one more block adds.*The plan below is the 3-block copy's:", line)
    assert m, line
    count, per_block, more = int(m.group(1)), int(m.group(2).replace(",", "")), int(m.group(3))
    planned = int(re.search(r"optimizer \w+, ([\d,]+) parameters in", out).group(1).replace(",", ""))
    assert count == 4 and more == 1
    assert planned + more * per_block == whole  # the line accounts for both counts
    assert not FX_NAME.search(out) and "x3" in out


# --------------------------------------------------------------------------- the plot
def test_plot_shares_a_time_axis_and_labels_the_peak(stage3: tuple[torch.nn.Module, ScheduleReport], tmp_path: Path) -> None:
    _, report = stage3
    title = plot_title("tiny", world_size=2, stage=3, profile="cpu-gloo / cpu-core")
    assert title == "zerofx plan tiny: ZeRO stage 3, world size 2, profile cpu-gloo / cpu-core"
    path = tmp_path / "plan.png"
    fig = plot_report(report, path, title=title, budget_bytes=2 * report.peak.live_bytes)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert fig._suptitle.get_text().startswith(title + "\n")
    memory, gantt = fig.axes[:2]
    assert memory.get_shared_x_axes().joined(memory, gantt)
    assert "ms" in gantt.get_xlabel() and binary_unit(2 * report.peak.live_bytes)[0] in memory.get_ylabel()
    labels = [t.get_text() for t in memory.texts]
    assert any(t.startswith(f"peak {format_bytes(report.peak.live_bytes)}") for t in labels), labels
    # The timeline's times run forward, inside the step.
    assert list(report.timeline_s) == sorted(report.timeline_s) and report.timeline_s[-1] <= report.step_s


# --------------------------------------------------------------------------- a command line without torch
def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_help_and_estimate_leave_torch_unimported() -> None:
    code = (
        "import contextlib, io, sys, zerofx.app.cli\n"
        "for argv in (['--help'], ['plan', '--help'], ['train', '--help'], ['estimate', '--help'], ['--version']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert zerofx.app.cli.main(argv) == 0, argv\n"
        "assert zerofx.app.cli.main(['estimate', '--params', '1e9', '--world-size', '8']) == 0\n"
        "assert zerofx.app.cli.main(['plan', 'tiny', '--world-size', '0']) == 2\n"  # a bad argument is caught before torch too
        "for argv in (['train', '--fasta', '/no/such.fa'], ['train', '--fasta', '/'], ['train', '--config', '/no/such.json'],\n"
        "             ['train', '--data', '/no/such'], ['data', 'prepare', '/no/such.fa', '--out', '/tmp/x']):\n"
        "    with contextlib.redirect_stderr(io.StringIO()):\n"  # paths too: a missing file is named before torch loads
        "        assert zerofx.app.cli.main(argv) == 2, argv\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = _run_python(code)
    assert done.returncode == 0, done.stderr
    assert "ZeRO paper" in done.stdout and "GiB" in done.stdout


def test_import_zerofx_is_light_and_every_public_name_resolves() -> None:
    code = (
        "import sys, zerofx\n"
        "assert 'torch' not in sys.modules\n"
        "names = [n for n in zerofx.__all__ if n != '__version__']\n"
        "values = [getattr(zerofx, n) for n in names]\n"
        "from zerofx import Engine, Plan, compile, initialize\n"
        "assert zerofx.compile is compile and callable(initialize) and zerofx.Plan is Plan\n"
        "assert set(zerofx.__all__) <= set(dir(zerofx))\n"
        "print(len(values))\n"
    )
    done = _run_python(code)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(zerofx.__all__) - 1
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        zerofx.nonesuch  # noqa: B018


def test_every_subcommand_help_mentions_each_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) >= {"plan", "estimate", "train", "calibrate", "consolidate", "config-schema"}
    for name, sub in subparsers.choices.items():
        assert main([name, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: zerofx {name}")
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in out, (name, flag)
    assert main(["plan", "--help"]) == 0
    assert "--verbose" in capsys.readouterr().out


# --------------------------------------------------------------------------- an anytime search
def test_plan_auto_stops_at_its_time_limit_with_the_best_so_far(capsys: pytest.CaptureFixture[str]) -> None:
    """NOTE [A search answers anytime]: past --time-limit no candidate starts, and the result says
    the search stopped early; --time-limit without --auto is refused."""
    assert main(["plan", "tiny", "--auto", "--world-size", "2", "--seq-len", "64", "--budget", "2MiB", "--time-limit", "1e-6"]) == 0
    out = capsys.readouterr().out
    assert "stopped early by the time limit" in out and "nothing tried so far fits" in out
    # docs/autoplan.md quotes the line of a search stopped after 12 candidates: by shape, it is this one's.
    quoted = quoted_block("docs/autoplan.md", "stopped early by the time limit").text.splitlines()
    assert quoted_mismatch(quoted, out.splitlines(), shape=True) is None, (quoted, out)
    assert main(["plan", "tiny", "--world-size", "2", "--stage", "3", "--time-limit", "5"]) == 2
    assert "--time-limit bounds the search of --auto" in capsys.readouterr().err


def test_ctrl_c_in_plan_auto_prints_the_best_so_far_and_exits_130() -> None:
    """Ctrl-C while the search runs: the candidates said so far are ranked and printed, and the
    progress lines counted them against the most the space holds, with the best so far."""
    import signal

    # As from a terminal: the child starts with SIGINT at its default, whatever the test process
    # inherited (a runner's worker may ignore it, and Python then never raises KeyboardInterrupt).
    proc = subprocess.Popen([sys.executable, "-m", "zerofx.app.cli", "plan", "tiny", "--auto", "--world-size", "2", "--seq-len", "512",
                             "--budget", "2MiB"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    progress = []
    while len(progress) < 3:
        line = proc.stderr.readline()
        assert line, "the search ended before three candidates"
        if "candidate" in line:
            progress.append(line)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert re.search(r"stopped early by Ctrl-C, after [\d.]+ s: the best of the \d+ candidates tried", out), out
    assert all(re.search(r"candidate \d+ of at most \d+, .*\((best so far .*tokens/s|none fits yet)\)$", p.strip()) for p in progress), progress
