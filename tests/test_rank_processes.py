"""NOTE [Ranks forked from a server that imported torch]: a rank forked from the fork server runs
in the launcher's environment, working directory and standard output as they are at launch, and
a launcher whose start-up variables differ from the server's spawns instead."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from zerofx.common import rank_processes
from zerofx.common.rank_processes import rank_start


def _report(path: str) -> None:
    print(f"rank says {os.environ.get('ZEROFX_RANK_PROCESS_TEST')}", flush=True)
    Path(path).write_text(f"{os.getcwd()}\n{os.environ.get('ZEROFX_RANK_PROCESS_TEST')}")


def _run(start: rank_processes.RankStart, path: Path) -> None:
    proc = start.context.Process(target=start.target(_report), args=(str(path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0


@pytest.mark.multiprocess
def test_a_rank_takes_the_launchers_environment_and_streams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    rank_start(__name__)  # the server runs (started here or by an earlier test)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZEROFX_RANK_PROCESS_TEST", "set after the server started")
    start = rank_start(__name__)
    server = rank_processes._server_environment(rank_processes.mp.get_context("forkserver"))
    assert server is not None and "ZEROFX_RANK_PROCESS_TEST" not in server
    expected = "forkserver" if rank_processes._start_up(server) == rank_processes._start_up(os.environ) else "spawn"
    assert start.method == expected
    _run(start, tmp_path / "out.txt")
    assert (tmp_path / "out.txt").read_text() == f"{tmp_path}\nset after the server started"
    assert "rank says set after the server started" in capfd.readouterr().out
    # A variable read at start-up that the server does not have: the ranks are spawned, so they have it from their start.
    monkeypatch.setenv("MALLOC_ZEROFX_RANK_PROCESS_TEST", "1")
    assert rank_start(__name__).method == "spawn"
