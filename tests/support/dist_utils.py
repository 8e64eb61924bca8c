"""Real gloo process groups for tests, and each rank's result.

NOTE [A pool of ranks]
Starting a rank as a new Python process that imports torch and zerofx costs 3-8 s of the 2-core
CI machine, more than many tests' own work. Rank processes are therefore forked from a server
process (multiprocessing's "forkserver") that imported torch and zerofx once and has run no
torch op, so no thread pool or device state is forked; and ``run_ranks`` keeps one pool
of rank processes that stay up between calls, grown to the largest world size asked for; a call
on W ranks runs on the pool's first W processes, each told its rank. Each call still runs in a new
process group (a fresh rendezvous file, ``init_process_group`` before and ``destroy_process_group`` after),
so nothing communicates across calls; between calls a rank restores its environment variables,
thread count and default dtype. A call that fails in any way (an exception, a timeout, a rank
killed by a signal) discards its pool, so the next call starts clean processes. ``fresh=True``
runs in new processes that exit afterwards: for what a pool would distort, such as a process's
peak resident memory.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import io
import multiprocessing.connection as mp_connection
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
TIMEOUT_S = 900.0  # a call's ranks, all together
GC_FIRST_GENERATION = 2000  # allocations between young collections, here and in the test processes (tests/conftest.py)
AFTER_ERROR_S = 20.0  # once one rank failed, the others may hang in a collective


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# NOTE [Ranks meet in a file]
# Each call's ranks rendezvous through a file of their own (``file://``), not a TCP port. A
# port from ``free_port`` is free only when asked, and the suite runs two pytest workers. Twice
# a full run stalled with both ranks of a 2-rank call never finishing (900 s), in a test that
# passes when its file runs alone; two calls meeting on one port would look like that, though
# the cause is not confirmed. A path made from this process's id and a random name is never
# another call's. A call that does not finish has its ranks print their Python stacks
# (faulthandler on SIGUSR1) before it fails, so the next stall shows where it waits.
def _run_one(rank: int, world_size: int, store: str, fn: Callable[..., Any], args: tuple) -> tuple[str, bytes | str]:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    # NOTE [Every rank connected before any leaves]
    # gloo's init connects each pair of ranks, and one rank can count its side of a pair done
    # while the other is still reading the handshake. A call whose ``fn`` runs no collective
    # (an error raised before any, as the bad-input tests expect) then reached
    # ``destroy_process_group`` on the faster rank, closed the sockets, and the slower rank's
    # init failed with "Connection closed by peer": 3 times in 300 calls of a no-op ``fn`` here,
    # and the flaky failure of a bad-input test in CI. A barrier completes on no rank before every
    # rank has finished connecting, so no rank tears down a half-open mesh.
    dist.barrier()
    try:
        # Serialise with torch.save: tensors shared through a pipe vanish when this process exits.
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        return "ok", buf.getvalue()
    except BaseException:  # report any failure to the test process, with its traceback
        return "error", traceback.format_exc()
    finally:
        dist.destroy_process_group()


def _serve(conn: Any, once: bool) -> None:
    """A rank process: run each call that arrives on ``conn`` (with the rank it is to be) and
    send back its outcome."""
    sys.path.insert(0, ROOT)
    faulthandler.enable()  # a segfault in a rank prints every thread's Python stack to stderr
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # and a call that never finishes, when asked
    torch.set_num_threads(1)
    if not once:
        # What a pooled rank holds so far is what the server imported: out of the cycle
        # collector's sight, with the youngest generation collected as in the test processes
        # (tests/conftest.py), so its full collections walk only what its calls make. A rank
        # started for one call keeps Python's defaults: those tests measure its peak memory.
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_FIRST_GENERATION, *gc.get_threshold()[1:])
    environ = dict(os.environ)
    while True:
        try:
            call = conn.recv()
        except EOFError:  # the test process is gone
            return
        if call is None:
            return
        rank, world_size, store, fn, args = call
        conn.send((rank, *_run_one(rank, world_size, store, fn, args)))
        if once:
            return
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)


def rendezvous_file() -> str:
    """A path for one call's ranks to meet at (NOTE [Ranks meet in a file]); nothing is there yet."""
    return os.path.join(tempfile.gettempdir(), f"zerofx-ranks-{os.getpid()}-{uuid.uuid4().hex}")


def rank_main(rank: int, world_size: int, store: str, fn: Callable[..., Any], args: tuple) -> None:
    """One rank in a process of its own, for tests that watch the processes themselves (a rank
    that gets killed): ``fn``'s result is dropped; a failure prints its traceback and exits 1."""
    sys.path.insert(0, ROOT)
    faulthandler.enable()
    torch.set_num_threads(1)
    status, value = _run_one(rank, world_size, store, fn, args)
    if status == "error":
        print(value, file=sys.stderr)
        sys.exit(1)


def rank_context() -> Any:
    """Rank processes forked from a server process that imported torch and zerofx once: a
    process started from it runs its first line in milliseconds, not the seconds a fresh
    interpreter takes to import torch."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "zerofx", "zerofx.runtime.engine", "tests.support.dist_utils",
                                *_TRANSFORMERS_MODELS])
    return ctx


# NOTE [Transformers in the rank server]
# The Hugging Face models the ranks build (Llama, ESM, Mamba) import transformers' modeling
# modules, which takes 2.5-4 s of a CI core the first time in a process: profiled, more than a
# rank's capture of the model. The server imports them once, so every rank forked from it has
# them. Importing them runs no torch op (NOTE [A pool of ranks]); a missing transformers is
# skipped by the forkserver, and the tests that need it fail in the rank as they would without this.
_TRANSFORMERS_MODELS = ("transformers.models.llama.modeling_llama", "transformers.models.esm.modeling_esm",
                        "transformers.models.mamba.modeling_mamba")


class _Ranks:
    """Rank processes, each with a pipe to this process."""

    def __init__(self, world_size: int, *, once: bool) -> None:
        self.once = once
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.grow(world_size)

    def grow(self, world_size: int) -> None:
        """Start processes until there are ``world_size``."""
        ctx = rank_context()
        while len(self.procs) < world_size:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, self.once), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def call(self, world_size: int, fn: Callable[..., Any], args: tuple) -> tuple[dict[int, Any], list[str]]:
        """``fn`` on the first ``world_size`` processes, as ranks 0..world_size - 1."""
        store = rendezvous_file()
        try:
            return self._call(world_size, fn, args, store)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(store)

    def _call(self, world_size: int, fn: Callable[..., Any], args: tuple, store: str) -> tuple[dict[int, Any], list[str]]:
        for rank, conn in enumerate(self.conns[:world_size]):
            conn.send((rank, world_size, store, fn, args))
        results: dict[int, Any] = {}
        errors: list[str] = []
        waiting = {conn: rank for rank, conn in enumerate(self.conns[:world_size])}
        deadline = time.monotonic() + TIMEOUT_S
        while waiting:
            ready = mp_connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:  # the remaining ranks are stuck, most likely in a collective
                errors.append(f"ranks {sorted(waiting.values())} did not finish in time (their Python stacks are in the captured stderr)")
                for rank in waiting.values():
                    with contextlib.suppress(ProcessLookupError, TypeError):
                        os.kill(self.procs[rank].pid, signal.SIGUSR1)
                time.sleep(1.0)
                break
            for conn in ready:
                rank = waiting.pop(conn)
                try:
                    _, status, value = conn.recv()
                except EOFError:  # died; its Python stacks (faulthandler) are in the captured stderr
                    self.procs[rank].join(timeout=5)
                    code = self.procs[rank].exitcode
                    how = f"died from signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited ({code})"
                    errors.append(f"rank {rank} {how}")
                    deadline = min(deadline, time.monotonic() + AFTER_ERROR_S)
                    continue
                if status == "error":
                    errors.append(f"rank {rank}:\n{value}")
                    deadline = min(deadline, time.monotonic() + AFTER_ERROR_S)
                else:
                    results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        return results, errors

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


_POOL: list[_Ranks] = []  # at most one: the ranks that stay up between calls


@atexit.register
def _close_pool() -> None:
    while _POOL:
        _POOL.pop().close()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, fresh: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.
    ``fn`` must be importable (module level) and return picklable values. The ranks come from a
    pool that outlives the call (NOTE [A pool of ranks]) unless ``fresh``."""
    if fresh:
        ranks = _Ranks(world_size, once=True)
    else:
        if _POOL and not _POOL[0].alive():
            _POOL.pop().close()
        if not _POOL:
            _POOL.append(_Ranks(world_size, once=False))
        ranks = _POOL[0]
        ranks.grow(world_size)
    errors = ["interrupted"]
    try:
        results, errors = ranks.call(world_size, fn, args)
    finally:
        if fresh or errors:
            if _POOL and _POOL[0] is ranks:
                _POOL.pop()
            ranks.close()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
