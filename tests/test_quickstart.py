"""The newcomer's path: the README's first command and its Python, examples/quickstart.py under
torchrun, what ``zerofx train`` prints and how it resumes, the errors for inputs on the wrong
device, stepping past the scheduler, and a checkout folder that shadows the installed package."""

from __future__ import annotations

import csv
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.dist_utils import run_ranks
from tests.support.quickstart_workers import misplaced_inputs_and_schedule_end
from zerofx.runtime.checkpoint import read_metadata
from zerofx.app.cli import build_parser, main
from zerofx.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
QUICKSTART = ROOT / "examples" / "quickstart.py"


def _blocks(language: str) -> list[str]:
    """The README's fenced code blocks in ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", README, flags=re.S | re.M)


# --------------------------------------------------------------------------- the README
def test_readme_first_command_parses_and_fits_its_config() -> None:
    """The first command installs, then trains with flags the CLI takes, a config that exists,
    and a scheduler that spans every step (else the run would warn)."""
    first = _blocks("bash")[0].strip()
    assert "\n" not in first and first.startswith(
        'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[test]" && ')
    train = shlex.split(first.split("&&")[-1])
    assert train[:2] == ["zerofx", "train"] and "--print-graph" not in train
    args = build_parser().parse_args(train[1:])
    config = parse_config(ROOT / args.config)
    assert config.scheduler is not None and args.steps <= config.scheduler.total_num_steps
    assert args.model == "small" and args.output_dir is not None


def test_ci_runs_the_readme_commands_in_a_fresh_venv() -> None:
    """``.ci/run`` makes a venv of its own and activates it before installing, installs with the
    README's first command's steps, in order, and ends with the README's test command exactly: a
    step the README lacks fails CI as it would fail a new user."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    first, tests = (b.strip() for b in _blocks("bash")[:2])
    installs = [step.strip() for step in first.split("&&") if step.strip().startswith("pip install")]
    venv = next(i for i, line in enumerate(ci) if line.startswith("python3 -m venv "))
    activate = next(i for i, line in enumerate(ci) if line.startswith(". ") and line.endswith("/bin/activate\""))
    found = [next(i for i, line in enumerate(ci) if line.split(" -q")[0] + line.split(" -q", 1)[-1] == step) for step in installs]
    assert venv < activate < found[0] and found == sorted(found) and len(installs) == 2
    assert ci[-1] == tests == "python -m pytest -q -n 2 --dist loadfile tests"


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(tmp_path: Path) -> None:
    """Each python block of the README runs in a fresh interpreter, except the quick start's
    text, which must be examples/quickstart.py's exactly (test_quickstart_under_torchrun runs it)."""
    blocks = _blocks("python")
    assert blocks.count(QUICKSTART.read_text()) == 1
    others = [b for b in blocks if b != QUICKSTART.read_text()]
    assert others and any("zerofx.compile(model, world_size=1024, stage=3)" in b for b in others)
    for block in others:
        done = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]


def test_quickstart_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(QUICKSTART), str(out)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)  # not the repo: the file finds its config
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", done.stdout, flags=re.M)]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert f"checkpoint {out}: step 10, 17 tensors restored exactly: True" in done.stdout
    held = re.search(r"rank 0 of 2 holds \{'params': '([\d.]+) KiB', 'grads': '([\d.]+) KiB', 'optimizer_states': '([\d.]+) KiB'\}", done.stdout)
    assert held is not None, done.stdout
    params, grads, states = map(float, held.groups())
    # The tiny model's 25,408 fp32 parameters are 99.2 KiB; each of 2 ranks holds about half, and
    # AdamW's two states twice that.
    assert 45 < grads <= params < 55 and states == pytest.approx(2 * grads, rel=0.02)
    assert (out / "step-00000010").is_dir() and len(QUICKSTART.read_text().splitlines()) <= 60


# --------------------------------------------------------------------------- zerofx train
def test_train_prints_its_setup_resumes_and_warns_past_the_schedule(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 1, "total_num_steps": 2}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "logs"), "job_name": "dna"},
        "zerofx": {"plan_cache": False},  # the first run's setup lines are a cold build's
    }))
    out = tmp_path / "run"
    common = ["train", "--config", str(config), "--seq-len", "32", "--output-dir", str(out)]

    assert main([*common, "--steps", "2", "--print-graph"]) == 0
    first = capfd.readouterr()
    for phase in ("capture", "plan", "lower"):  # each phase before the first step, with its time
        assert re.search(rf"^{phase} +\d+\.\d\d s  ", first.out, flags=re.M), first.out
    assert first.out.index("lower ") < first.out.index("step 1/2")
    assert f"log         {out / 'train_log.jsonl'}" in first.out and f"checkpoints {out}/step-NNNNNNNN, after step 2" in first.out
    # The short graph dump: collectives per graph, no code. Stage 3 gathers in both graphs and
    # reduce-scatters in backward; each collective has its wait.
    counts = dict(re.findall(r"^  (forward|backward) +\d+ nodes: (.*)$", first.out, flags=re.M))
    gathers, scatters, reduces, waits = map(int, re.findall(r"\d+", counts["forward"]))
    assert gathers > 0 and scatters == reduces == 0 and waits == gathers
    gathers, scatters, reduces, waits = map(int, re.findall(r"\d+", counts["backward"]))
    assert gathers > 0 and scatters > 0 and reduces == 0 and waits == gathers + scatters
    assert "def forward" not in first.out and "perplexity" in first.out and "past the scheduler" not in first.out

    # The same command again: one line saying what to change, no rank started, exit 0.
    assert main([*common, "--steps", "2"]) == 0
    again = capfd.readouterr()
    # The schedule ends at step 2, so the hint stretches it over the longer run (else the lr would stay at its final value).
    assert again.out.splitlines()[-1] == (f"{out} is at step 2 = --steps 2: nothing to train. Pass --steps 4 --schedule-steps 4 to "
                                          "train 2 more with the scheduler's decay stretched over all 4 steps (the learning rate rises "
                                          "from its final value to the one the longer schedule has at step 3), or a new --output-dir "
                                          "to start over")
    assert again.out.strip().count("\n") == 0 and again.err == ""

    # Past the scheduler's total_num_steps: one warning naming both numbers, then step 3 only,
    # resumed at another world size (the checkpoint was saved by 2 ranks, 1 rank loads it).
    assert main([*common, "--steps", "3", "--world-size", "1", "--print-graph-code"]) == 0
    third = capfd.readouterr()
    warning = ("warning: --steps 3 is past the scheduler's total_num_steps 2: lr stays at its final value 3e-07 after step 2")
    assert third.out.count(warning) == 1 and "past the scheduler" not in third.err, third.err[-2000:]
    for graph in ("forward", "backward"):  # each graph's code, under a header naming it
        assert re.search(rf"^# rank 0 ZeRO stage 3 {graph} graph\ndef forward\(", third.out, flags=re.M), third.out[:3000]
    assert "step 3/3 loss" in third.out and "step 2/3" not in third.out
    assert f"resuming from checkpoint {out / 'step-00000002'}: step 2, saved at world size 2" in third.out
    assert read_metadata(out)["step"] == 3 and read_metadata(out)["world_size"] == 1
    lrs = [r["lr"] for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if "lr" in r]
    assert lrs[-1] == pytest.approx(3e-7) and len(lrs) == 3
    # The csv_monitor section: the training loop's engine wrote one row per step, on the samples
    # axis (2 sequences x 2 ranks per step, then 2 x 1), and the resumed run appended to it.
    with (tmp_path / "logs" / "dna" / "Train_Samples_train_loss.csv").open(newline="") as f:
        header, *rows = list(csv.reader(f))
    assert header == ["step", "train_loss"] and [int(x) for x, _ in rows] == [4, 8, 10]
    assert all(math.isfinite(float(v)) for _, v in rows)
    with (tmp_path / "logs" / "dna" / "Train_Samples_lr.csv").open(newline="") as f:
        assert [float(v) for _, v in list(csv.reader(f))[1:]] == pytest.approx(lrs)

    # The hint's way on: --schedule-steps stretches the decay, so step 4 learns at a rate above the old final one.
    assert main([*common, "--steps", "4", "--schedule-steps", "5", "--world-size", "1"]) == 0
    fourth = capfd.readouterr()
    assert "past the scheduler" not in fourth.out + fourth.err and "step 4/4 loss" in fourth.out
    lrs = [r["lr"] for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if "lr" in r]
    assert len(lrs) == 4 and lrs[-1] > 100 * lrs[-2]


# --------------------------------------------------------------------------- the engine
def test_inputs_on_the_wrong_device_are_named_before_any_graph_runs() -> None:
    results = run_ranks(2, misplaced_inputs_and_schedule_end)
    for rank, r in enumerate(results):
        # Rank 0 builds the program and rank 1 rebuilds it from rank 0's bytes (NOTE [One build per job]).
        phases = {"capture", "plan", "lower"} if rank == 0 else {"from rank 0"}
        assert set(r["setup_times"]) == phases and all(t > 0 for t in r["setup_times"].values())
        assert r["positional"][0] == "ZeroFXError" and r["positional"][1].startswith("positional argument 0 is on device meta")
        assert "the engine runs on cpu" in r["positional"][1]
        assert r["keyword"][0] == "ZeroFXError" and r["keyword"][1].startswith("keyword argument 'labels' is on device meta")
        # Only rank 1's input was on meta: both ranks raise, and rank 1's reason is named.
        assert r["one_rank"][0] == "RankDivergenceError" and "rank 1: [2, 16] int64, [2, 16] int64 (positional argument 0" in r["one_rank"][1]
        # The engine was left untouched: it trains on.
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["lrs"] == pytest.approx([1e-2, 1e-2, 1e-3, 1e-3])  # a 1-step warm-up, the decay over step 2, then its floor
        # Stepping past total_num_steps 2 warns once, at the user's call.
        assert len(r["schedule_warnings"]) == 1, (rank, r["schedule_warnings"])
        message, filename = r["schedule_warnings"][0]
        assert message.startswith("optimizer step 3 is past the scheduler's total_num_steps 2: lr stays at its final value 0.001")
        assert filename.endswith("quickstart_workers.py")


# --------------------------------------------------------------------------- a checkout that shadows the package
def _checkout(at: Path) -> Path:
    """A copy of this checkout's sources at ``at`` (pyproject.toml, zerofx/, passes/, cost_models/)."""
    at.mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", at)
    for folder in ("zerofx", "passes", "cost_models"):
        shutil.copytree(ROOT / folder, at / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return at


def _python(code: str, cwd: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.multiprocess  # _python runs subprocesses
def test_a_checkout_that_is_not_installed_is_refused_from_its_folder(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path / "other")
    # -S: no site-packages, so no installed zerofx; the check runs before torch would be imported.
    done = _python("import zerofx", checkout, "-S")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last == (
        f"ImportError: the folder {checkout / 'zerofx'} shadows the installed zerofx: Python imported it because {checkout} is on "
        f"sys.path (the working directory or the script's folder), and zerofx.passes is missing (this checkout is not installed). "
        f"Run Python from another folder, or install this checkout: pip install -e {checkout}")


def _installed_zerofx(cwd: Path) -> Path:
    done = _python("import zerofx; print(zerofx.__file__)", cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    return Path(done.stdout.strip()).parent


@pytest.mark.multiprocess  # _python and _installed_zerofx run subprocesses
def test_a_second_checkout_is_refused_beside_an_editable_install(tmp_path: Path) -> None:
    installed = _installed_zerofx(tmp_path)
    checkout = _checkout(tmp_path / "other")
    done = _python("import zerofx", checkout)
    passes = (installed / "passes") if (installed / "passes").is_dir() else (installed.parent / "passes")
    assert done.returncode == 1
    assert f"the folder {checkout / 'zerofx'} shadows the installed zerofx" in done.stderr
    assert f"zerofx.passes comes from {passes.resolve()}, another copy" in done.stderr
    # From any other folder, including the checkout of the install itself, zerofx imports.
    assert _installed_zerofx(installed.parent) == installed


@pytest.mark.multiprocess  # _python and _installed_zerofx run subprocesses
def test_the_folder_above_a_clone_named_zerofx(tmp_path: Path) -> None:
    installed = _installed_zerofx(tmp_path)
    if installed != ROOT / "zerofx":
        pytest.skip("needs an editable install of this checkout: a regular install is found before a namespace package")
    clone = _checkout(tmp_path / "zerofx")
    # A bare `import zerofx` finds the clone as an empty namespace package, and none of zerofx's
    # code runs (NOTE [A checkout that shadows the package]); the first module imported through it
    # raises.
    bare = _python("import zerofx; print(zerofx.__file__, list(zerofx.__path__))", tmp_path)
    assert bare.stdout.strip() == f"None ['{clone}']"
    for code in ("import zerofx.app.cli", "from zerofx.runtime.engine import initialize"):  # python -m zerofx.app.cli, and the API
        done = _python(code, tmp_path)
        assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
            f"ImportError: the folder {clone} shadows the installed zerofx ({installed}): it has no __init__.py, so Python "
            f"imported it as an empty namespace package because {tmp_path} is on sys.path (the working directory or the "
            "script's folder). Run Python from another folder"), (code, done.stderr[-2000:])
