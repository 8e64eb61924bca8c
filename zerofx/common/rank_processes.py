"""Where local rank processes start from: forked from a server that imported torch once.

    start = rank_start("zerofx.app.training")
    start.context.Process(target=start.target(worker), args=(...)).start()
    mp.start_processes(start.target(worker), args=(...), nprocs=n, start_method=start.method)

NOTE [Ranks forked from a server that imported torch]
A spawned rank is a fresh interpreter that imports torch and zerofx before its first line of
work: 5-6 CPU-seconds per rank, measured on this project's machine, paid by every rank at every
launch, all at once where ranks outnumber cores. Ranks are started by multiprocessing's fork
server instead: one process that imports torch and the named modules once (the preload) and
forks a rank per request. A rank receives what a spawned one would: the launcher's working
directory, sys.path and main module (multiprocessing sends them with every request); its
environment as it is at launch, which ``_in_launch_environment`` installs before the work runs
(the server's own is the one it started with); and its standard output and error as they are at
launch, passed as file descriptors, so a rank prints where a spawned one would (into a file or a
capture the launcher set up after the server started).

What a forked rank cannot take from the launcher is what the C runtime or a library reads once
at start-up or import: glibc's MALLOC_* and GLIBC_TUNABLES, OpenMP's and MKL's, PYTHON*, torch's
TORCH* read at import. Those are the server's, so before each launch a probe forked from the
server reads the server's start-up environment (``/proc/self/environ``: a fork keeps its
parent's), and where any of those variables differ from the launcher's now (a benchmark that
set its allocator threshold after the server started), or where the probe cannot tell, the ranks
are spawned, with the old cost and exact semantics. The server starts no thread and no CUDA
context (importing torch makes neither), so forking it is safe; it stays up, idle, until the
launcher exits, and later launches reuse it. The preload is the first launch's: the server
ignores a later list, and a rank imports what it lacks.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.context import BaseContext
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ("torch", "torch.distributed")
# Read once at start-up or import, so they cannot follow a forked rank's launcher.
START_UP_PREFIXES = ("MALLOC_", "GLIBC_TUNABLES", "LD_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "PYTHON", "TORCH")
PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RankStart:
    """How to start ranks: ``context``'s processes, by ``method``, each running ``target(fn)``."""

    context: BaseContext
    method: str  # "forkserver" or "spawn"

    def target(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as a rank runs it: in the launcher's environment and streams as they are now."""
        if self.method == "spawn":
            return fn
        streams = tuple(_LaunchersFd(fd) if _is_open(fd) else None for fd in (1, 2))
        return functools.partial(_in_launch_environment, dict(os.environ), streams, fn)


def rank_start(*preload: str) -> RankStart:
    """The fork server (NOTE [Ranks forked from a server that imported torch]), preloading torch
    and ``preload``; spawn where the server's start-up environment is not the launcher's."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *preload])  # ignored once the server runs
    server = _server_environment(ctx)
    if server is None or _start_up(server) != _start_up(os.environ):
        return RankStart(mp.get_context("spawn"), "spawn")
    return RankStart(ctx, "forkserver")


def _start_up(environment: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environment.items() if k.startswith(START_UP_PREFIXES)}


def _server_environment(ctx: BaseContext) -> dict[str, str] | None:
    """The fork server's start-up environment, read by a process forked from it; None if unknown."""
    receive, send = ctx.Pipe(duplex=False)
    try:
        probe = ctx.Process(target=_send_start_up_environment, args=(send,), daemon=True)
        probe.start()
        send.close()
        found = receive.recv() if receive.poll(PROBE_TIMEOUT_S) else None
        probe.join(PROBE_TIMEOUT_S)
        return found
    except (OSError, EOFError):
        return None
    finally:
        receive.close()


def _send_start_up_environment(send: Any) -> None:
    try:
        with open("/proc/self/environ", "rb") as f:
            entries = f.read().split(b"\0")
        send.send(dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e))
    except OSError:
        send.send(None)


class _LaunchersFd:
    """One of the launcher's file descriptors, given to a rank as a duplicate of its own."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)  # DupFd hands the descriptor to the fork server


def _detach(dup: Any) -> int:
    return dup.detach()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _in_launch_environment(environment: dict[str, str], streams: tuple[int | None, ...], fn: Callable[..., Any],
                           *args: Any) -> Any:
    """``fn(*args)`` with the launcher's environment and standard output and error, and SIGINT
    ignored until ``fn`` installs a handler of its own, as a spawned rank starts while its launcher
    ignores it (NOTE [Ranks forked from a server that imported torch])."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(environment)
    for fd, launchers in zip((1, 2), streams):
        if launchers is not None:  # else the server's
            os.dup2(launchers, fd)
            os.close(launchers)
    return fn(*args)
