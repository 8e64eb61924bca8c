"""Running ``zerofx train``'s local ranks: starting them, stopping them on Ctrl-C, and naming the
stalled rank when a collective times out.

    failure = launch_ranks(worker, (opts, port), nprocs=2, on_interrupt=lambda step: f"stopped at step {step}")

``launch_ranks`` starts ``nprocs`` processes, each calling ``worker(rank, *args, channel)`` with a
``RankChannel``, and waits for them. A rank tells the launcher two things through its channel:
the last training step every rank completed (``record_step``, rank 0) and, when a collective
timed out or lost its peer, where (``report_comm_failure``). A rank calls ``install_stop_handler``
first and reads ``stop_requested`` at each step boundary.

Errors: ``TrainingInterrupted`` (exit 130) after Ctrl-C, ``RankFailedError`` when a rank fails.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch.multiprocessing as mp

from zerofx.common.errors import CollectiveTimeoutError, RankFailedError, TrainingInterrupted
from zerofx.common.rank_processes import rank_start

# NOTE [Ctrl-C stops every rank at one step]
# Ctrl-C in a terminal sends SIGINT to the launcher and to every rank (one process group); `kill
# -INT` reaches the launcher alone, which forwards it. A rank's SIGINT handler only sets a flag:
# a KeyboardInterrupt inside a graph would leave its collectives unwaited and the other ranks
# blocked in them. The flag rides on the all-reduce that every step already makes of its loss,
# so every rank sees a stop requested by any of them at the same step, finishes it (and the
# checkpoint the step saves), and returns. A rank that does not reach a step boundary within
# STOP_GRACE_S (still capturing, or blocked in a collective) is terminated: nothing it has not
# finished is a complete checkpoint, since a checkpoint is complete only once every rank's files
# and its metadata are written (NOTE [Why a save is atomic] in zerofx/runtime/checkpoint.py). A
# second Ctrl-C terminates at once.
STOP_GRACE_S = 5.0
# SIGTERM, then SIGKILL this much later: a rank stopped by SIGSTOP or stuck in C++ ignores SIGTERM.
KILL_GRACE_S = 2.0
# After a rank reports a timed-out collective, how long the launcher waits for the others to
# report theirs before it names as stalled the ranks that did not.
REPORT_GRACE_S = 2.0
# The exit code of a rank whose collective timed out or lost its peer; its report is in the channel.
COMM_FAILURE_EXIT_CODE = 3
INTERRUPT_EXIT_CODE = 130

_stop_signals = 0  # SIGINTs this process has received since install_stop_handler


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _stop_signals
    _stop_signals += 1
    if _stop_signals > 1:  # a second Ctrl-C: stop now
        raise KeyboardInterrupt


def install_stop_handler() -> None:
    """In a rank: SIGINT requests a stop at the next step boundary instead of raising
    KeyboardInterrupt (NOTE [Ctrl-C stops every rank at one step])."""
    signal.signal(signal.SIGINT, _on_sigint)


def stop_requested() -> bool:
    """Whether this rank has received SIGINT since ``install_stop_handler``."""
    return _stop_signals > 0


@dataclass(frozen=True)
class RankChannel:
    """What a rank tells the launcher: the last step every rank completed, and where a collective failed."""

    report_dir: str
    progress: Any  # a multiprocessing RawValue("q"): the last completed step, -1 before the first

    def record_step(self, step: int) -> None:
        self.progress.value = step

    def report_comm_failure(self, rank: int, exc: CollectiveTimeoutError) -> None:
        path = Path(self.report_dir) / f"rank-{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": rank, "where": exc.where, "timeout_s": exc.timeout_s, "message": str(exc)}))
        os.replace(tmp, path)  # the launcher never reads half a report

    def comm_failures(self) -> dict[int, dict[str, Any]]:
        return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in Path(self.report_dir).glob("rank-*.json")}


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``T``: stopped by a signal), or "" when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def stalled_message(failures: dict[int, dict[str, Any]], states: dict[int, str]) -> str:
    """One line naming the stalled ranks (``states``: each live rank that reported nothing, with
    its process state) and the collective the reporting ranks (``failures``) waited in."""
    waiting, stalled = sorted(failures), sorted(states)
    first = failures[waiting[0]]
    timeout = first.get("timeout_s")
    waited = f"waited {timeout:g} s" if timeout is not None else "waited"
    where = first["where"] or "a collective"
    waiters = f"rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))}"
    setting = "(the timeout is --collective-timeout, config key zerofx.collective_timeout_s)"
    if not stalled:
        return f"a collective failed on every rank: {waiters} {waited} in {where} {setting}"
    signalled = [r for r in stalled if states[r] in ("T", "t")]
    how = f" ({'stopped by a signal' if len(signalled) == len(stalled) else f'{len(signalled)} stopped by a signal'})" if signalled else ""
    who = f"rank{'s' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))}"
    return f"{who} stalled{how}: {waiters} {waited} for {'them' if len(stalled) > 1 else 'it'} in {where} {setting}"


def _kill(processes: Sequence[Any]) -> None:
    """SIGTERM every live process, then SIGKILL those alive KILL_GRACE_S later (at once those
    stopped by a signal, which act on nothing but SIGKILL until continued)."""
    for p in processes:
        if p.is_alive():
            p.kill() if _process_state(p.pid) in ("T", "t") else p.terminate()
    _join_all(processes, KILL_GRACE_S)
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def _join_all(processes: Sequence[Any], timeout_s: float, give_up: Callable[[], bool] = lambda: False) -> None:
    """Wait up to ``timeout_s`` for every process to exit, or until ``give_up()``."""
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline and not give_up():
        multiprocessing.connection.wait([p.sentinel for p in processes if p.is_alive()], timeout=0.1)


class _Interrupts:
    """Counts the launcher's SIGINTs while ranks run, instead of raising KeyboardInterrupt."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> _Interrupts:
        self._previous = _set_sigint(self._on_sigint)
        return self

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1

    def __exit__(self, *exc: object) -> None:
        _set_sigint(self._previous)


def _set_sigint(handler: Any) -> Any:
    """Set the SIGINT handler and return the one before; only the main thread may, so elsewhere
    (``train`` called from another thread) nothing changes and Ctrl-C is the caller's."""
    if threading.current_thread() is not threading.main_thread() or handler is None:
        return None
    return signal.signal(signal.SIGINT, handler)


def launch_ranks(worker: Callable[..., None], args: tuple[Any, ...], *, nprocs: int, on_interrupt: Callable[[int], str]) -> None:
    """Run ``worker(rank, *args, channel)`` in ``nprocs`` rank processes until all exit.

    Raises ``TrainingInterrupted`` with ``on_interrupt(last completed step)`` after Ctrl-C, and
    ``RankFailedError`` when a rank fails; either way no rank is left running."""
    start = rank_start(worker.__module__)  # NOTE [Ranks forked from a server that imported torch]
    ctx = start.context
    with tempfile.TemporaryDirectory(prefix="zerofx-ranks-") as report_dir, _Interrupts() as interrupts:
        channel = RankChannel(report_dir, ctx.RawValue("q", -1))  # one writer, rank 0: no lock (and no semaphore to leak)
        # SIGINT is ignored here while the ranks start, and in each rank until its own handler is in.
        handler = _set_sigint(signal.SIG_IGN)
        try:
            spawned = mp.start_processes(start.target(worker), args=(*args, channel), nprocs=nprocs, join=False,
                                         start_method=start.method)
        finally:
            _set_sigint(handler)
        processes = spawned.processes
        try:
            failed = _wait(processes, interrupts)
            if interrupts.count:
                for p in processes:  # `kill -INT` reached the launcher alone; a terminal's Ctrl-C reached every rank too
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGINT)
                _join_all(processes, STOP_GRACE_S, give_up=lambda: interrupts.count > 1)
                raise TrainingInterrupted(on_interrupt(int(channel.progress.value)))
            if failed is not None:
                raise _failure(failed, processes, spawned.error_files[failed], channel)
        finally:
            _kill(processes)


def _wait(processes: Sequence[Any], interrupts: _Interrupts) -> int | None:
    """Wait until every process exits (None), one exits non-zero (its index) or Ctrl-C (None)."""
    pending = {p.sentinel: i for i, p in enumerate(processes)}
    while pending and not interrupts.count:
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=0.2):
            index = pending.pop(sentinel)
            processes[index].join()
            if processes[index].exitcode != 0:
                return index
    return None


def _failure(index: int, processes: Sequence[Any], error_file: str, channel: RankChannel) -> RankFailedError:
    """The error for rank ``index``'s non-zero exit, printing a rank's traceback to stderr."""
    code = processes[index].exitcode
    if code == COMM_FAILURE_EXIT_CODE:  # give the other ranks' timeouts a moment to land
        deadline = time.monotonic() + REPORT_GRACE_S
        while time.monotonic() < deadline and len(channel.comm_failures()) < len(processes):
            time.sleep(0.05)
        failures = channel.comm_failures()
        states = {r: _process_state(p.pid) for r, p in enumerate(processes) if r not in failures and p.is_alive()}
        return RankFailedError(stalled_message(failures, states), exit_code=1)
    if os.access(error_file, os.R_OK):  # an unexpected exception: torch's wrapper saved its traceback
        import pickle

        with open(error_file, "rb") as fh:
            trace = str(pickle.load(fh)).strip()
        print(trace, file=sys.stderr)
        return RankFailedError(f"rank {index} failed: {trace.splitlines()[-1]}")
    if code < 0:
        return RankFailedError(f"rank {index} was killed by signal {signal.Signals(-code).name}")
    return RankFailedError(f"rank {index} exited with code {code}", exit_code=2 if code == 2 else 1)
