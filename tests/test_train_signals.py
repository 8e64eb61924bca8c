"""``zerofx train`` stopped by Ctrl-C or by a stalled rank, and the checks it makes before any
rank starts (zerofx/app/launch.py, zerofx/app/training.py, zerofx/app/cli.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from zerofx.app.cli import main
from zerofx.app.launch import _Interrupts, stalled_message
from zerofx.app.training import TrainOptions, _JsonlLog, check_train_options
from zerofx.common.errors import UsageError
from zerofx.data.genome import GenomeError
from zerofx.runtime.checkpoint import latest_complete_tag, read_metadata

MAX_SEED = 2**64 - 1


def _start(cmd: list[str], out: Path, err: Path) -> subprocess.Popen:
    with out.open("w") as o, err.open("w") as e:
        return subprocess.Popen(cmd, stdout=o, stderr=e, cwd=out.parent)


def _wait_for(path: Path, pattern: str, proc: subprocess.Popen, timeout_s: float = 240) -> re.Match[str]:
    """The first match of ``pattern`` in the file ``path`` that ``proc`` writes, failing if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text())
        if found:
            return found
        assert proc.poll() is None, f"exited {proc.returncode} before {pattern!r}: {path.read_text()[-2000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout_s} s")


def _signal_when(proc: subprocess.Popen, out: Path, pattern: str, sig: int, to: Callable[[int], int] = lambda pid: pid) -> tuple[int, float]:
    """Once ``pattern`` is in ``out``, send ``sig`` to ``to(launcher pid)``; return the launcher's
    exit code and the seconds it took to exit after the signal."""
    try:
        _wait_for(out, pattern, proc)
        os.kill(to(proc.pid), sig)
        sent = time.monotonic()
        code = proc.wait(timeout=60)
        return code, time.monotonic() - sent
    finally:
        proc.kill()


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _ranks(launcher: int) -> list[int]:
    """The launcher's ranks, in start order: the children of its fork server (NOTE [Ranks forked
    from a server that imported torch] in zerofx/app/launch.py)."""
    server = next(c for c in _children(launcher) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes())
    return sorted(_children(server))


def _steps(log: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, log.read_text().splitlines()) if "step" in r]


def test_ctrl_c_stops_every_rank_then_a_stalled_rank_is_named(tmp_path: Path) -> None:
    # One command, run twice (its 8 s collective timeout leaves a loaded machine room to start the ranks):
    # --seed 2**64-1 (the bundled model is built materialized, its init from torch.manual_seed of it),
    # Ctrl-C to the launcher alone (as `kill -INT`), then a resume whose rank is stopped by SIGSTOP.
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "zerofx.app.cli", "train", "--steps", "100000", "--seq-len", "16", "--seed", str(MAX_SEED),
           "--output-dir", str(run), "--save-every", "5", "--collective-timeout", "8"]
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    code, took = _signal_when(_start(cmd, out, err), out, r"saved checkpoint \S+step-00000010", signal.SIGINT)
    assert code == 130
    stderr = err.read_text()
    assert "Traceback" not in stderr and "Warning" not in stderr, stderr
    assert stderr.count("\n") == 1, stderr
    stopped = re.fullmatch(r"zerofx: stopped at step (\d+) of 100000 by Ctrl-C; the newest complete checkpoint is (\S+): "
                           r"run the same command again to resume from it\n", stderr)
    assert stopped, stderr
    step, newest = int(stopped[1]), Path(stopped[2])
    # Every rank finished the step it was in, and nothing after it: the last step printed is the one named.
    assert re.findall(r"^step (\d+)/", out.read_text(), re.M)[-1] == str(step)
    assert took < 30, f"{took:.1f} s to stop"
    tag = latest_complete_tag(run)
    assert tag is not None and newest == run / tag and int(read_metadata(run, tag)["step"]) == step - step % 5
    assert _steps(run / "train_log.jsonl") == list(range(1, step + 1))

    code, took = _signal_when(_start(cmd, out, err), out, rf"step {step - step % 5 + 8}/", signal.SIGSTOP, to=lambda pid: _ranks(pid)[1])
    assert code == 1
    text = out.read_text()
    assert f"resuming from checkpoint {newest}: step {step - step % 5}" in text
    stderr = err.read_text()
    assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr
    assert re.match(r"zerofx: error: rank 1 stalled \(stopped by a signal\): rank 0 waited 8 s for it in (the \w+ graph, at `.+`|"
                    r"the all-reduce of step \d+'s loss|a collective in \w+)", stderr), stderr
    assert took < 8 + 20, f"{took:.1f} s after the stall"
    # The resume dropped the steps the stopped run logged past its checkpoint: each step once.
    steps = _steps(run / "train_log.jsonl")
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= step - step % 5 + 8


def test_train_log_keeps_each_step_once_across_a_resume(tmp_path: Path) -> None:
    log = _JsonlLog(tmp_path / "train_log.jsonl")
    for step in range(1, 8):
        log.write(step=step, loss=1.0)
    with (tmp_path / "train_log.jsonl").open("a") as f:
        f.write('{"step": 8, "lo')  # a line a crash cut short
    log.drop_after(5)
    assert _steps(tmp_path / "train_log.jsonl") == [1, 2, 3, 4, 5]
    log.write(step=6, loss=1.0)
    assert _steps(tmp_path / "train_log.jsonl") == [1, 2, 3, 4, 5, 6]
    log.drop_after(0)
    assert (tmp_path / "train_log.jsonl").read_text() == ""


def test_stalled_message_names_ranks_and_collective() -> None:
    where = "the forward graph, at `wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_gather)`"
    assert stalled_message({0: {"where": where, "timeout_s": 20.0}}, {1: "T"}) == (
        f"rank 1 stalled (stopped by a signal): rank 0 waited 20 s for it in {where} "
        "(the timeout is --collective-timeout, config key zerofx.collective_timeout_s)")
    assert stalled_message({0: {"where": "w", "timeout_s": 2.5}, 3: {"where": "w", "timeout_s": 2.5}}, {1: "S", 2: "T"}).startswith(
        "ranks 1, 2 stalled (1 stopped by a signal): ranks 0, 3 waited 2.5 s for them in w")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--fasta", "."], "genome file '.' is a folder"),
        (["train", "--output-dir", "/proc/zerofx-run"], "--output-dir '/proc/zerofx-run' cannot be created or written"),
        (["plan", "tiny", "--world-size", "2", "--stage", "3", "--budget", "-5GiB"], "'-5GiB' is out of range; accepted: a finite size above 0"),
        (["estimate", "--params", "1e9", "--world-size", "2", "--device-memory", "-.5GB"], "'-.5GB' is out of range"),
        (["train", "--lr", "-1e-3"], "argument --lr: -1e-3 is out of range; accepted: a finite number >= 0"),
    ],
)
def test_bad_train_and_plan_flags_are_one_line_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerofx: error: ") and message in err and err.count("\n") == 1, err


def test_a_folder_as_the_genome_is_named_as_a_folder() -> None:
    with pytest.raises(GenomeError, match="genome file '.' is a folder; pass a FASTA file"):
        check_train_options(TrainOptions(fasta=Path(".")))


def test_output_dir_under_a_file_is_refused_before_ranks_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("")
    assert main(["train", "--output-dir", str(tmp_path / "a-file" / "run")]) == 2
    err = capsys.readouterr().err
    assert "cannot be created or written (Not a directory" in err and err.count("\n") == 1, err


def test_budget_takes_a_space_before_its_unit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "tiny", "--world-size", "2", "--stage", "3", "--seq-len", "16", "--budget", "10 GiB"]) == 0
    assert "budget 10 GiB: fits" in capsys.readouterr().out


def test_sequence_length_the_sequence_parallel_size_does_not_divide_is_refused_first(tmp_path: Path) -> None:
    cfg = tmp_path / "sp.json"
    cfg.write_text('{"zero_optimization": {"stage": 3}, "zerofx": {"world_size": 2, "sequence_parallel": {"size": 2}}}')
    with pytest.raises(UsageError, match=r"--seq-len 63 is not divisible by the config's zerofx.sequence_parallel.size=2 .*"
                                         r"accepted: a multiple of 2, e.g. 62"):
        check_train_options(TrainOptions(model="striped-tiny", config=cfg, seq_len=63, world_size=2))
    assert check_train_options(TrainOptions(model="striped-tiny", config=cfg, seq_len=64, world_size=2)).seq_len == 64


def test_ranks_launched_from_another_thread_leave_ctrl_c_to_the_caller() -> None:
    # signal.signal raises ValueError outside the main thread: train() called from a worker
    # thread launches its ranks without taking SIGINT over.
    before = signal.getsignal(signal.SIGINT)
    errors: list[BaseException] = []

    def enter_and_leave() -> None:
        try:
            with _Interrupts() as interrupts:
                assert interrupts.count == 0
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    worker = threading.Thread(target=enter_and_leave)
    worker.start()
    worker.join()
    assert errors == [] and signal.getsignal(signal.SIGINT) is before
