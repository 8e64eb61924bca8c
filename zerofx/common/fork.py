"""Work done in a child process made by fork, its result read back as bytes.

NOTE [Work in a forked child]
A child made by ``os.fork`` inherits the imported torch and every object of the parent for free
(a spawned process pays the imports again), and what it allocates leaves with it: the memory
CPython's allocator keeps after a capture (partly freed arenas) is returned to the OS when the
child exits, where in the parent it stays for the life of the process. Two callers use it:
``zerofx plan``'s folding captures one of its two cut models in a child while the parent
captures the other (NOTE [Planning the two captures in parallel] in zerofx/planner/folding.py),
and rank 0 of a job builds its program in a child and keeps only the bytes it sends the other
ranks (NOTE [One build per job] in zerofx/runtime/rank_agreement.py).

What the child says reaches the parent as if the parent had said it: its warnings are
recorded and warned again in the parent (through the parent's filters), its log records are
handled again by the parent's loggers, and text it prints where the parent's ``sys.stdout`` or
``sys.stderr`` is redirected in Python (a ``StringIO``, pytest's capture) is written there
after it ends; printed to the process's own streams, it appears as it is printed.

A fork copies only the calling thread, so it is safe only where nothing the child runs needs a
thread the parent had. Every object the child inherits is frozen out of its garbage collector
(``gc.freeze``): a gloo process group the parent dropped but has not collected yet would
otherwise be collected in the child, and its destructor waits forever for the gloo threads only
the parent has (a hang seen in the test suite). Nor may the work need a CUDA context
(``torch.cuda.is_initialized()``) or an OpenMP team that a parallel ATen kernel with more than
one thread has started (``fork_is_safe`` asks for one intra-op thread, or for work that runs no
kernel at all). The child sends what ``fn`` returns
through a pipe and leaves with ``os._exit``, running none of the parent's exit hooks; an
exception in it comes back as its class name and message, and a child that dies, or runs past
the timeout (it is then killed), gives None. Callers fall back to doing the work themselves.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import pickle
import select
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from zerofx.common import errors


@dataclass(frozen=True)
class ChildResult:
    """What the child sent: ``payload`` (the bytes ``fn`` returned), or ``error`` (its exception's
    class name and message, with the child's traceback as text)."""

    payload: bytes | None = None
    error: tuple[str, str, str] | None = None
    said: list[tuple[str, Any]] = field(default_factory=list)  # what the child warned, logged and printed, in order

    def raise_zerofx_error(self) -> None:
        """Raise the child's exception again where it was a ``ZeroFXError`` (a user's error: the
        same in the parent), as its own class with its message; anything else is the caller's to
        handle, usually by doing the work itself."""
        if self.error is None:
            return
        name, text, _ = self.error
        same = getattr(errors, name, None)
        if isinstance(same, type) and issubclass(same, errors.ZeroFXError):
            raise same(text)


class _Relay(logging.Handler):
    """In the child: every warning, log record and redirected print, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.said: list[tuple[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args = record.getMessage(), None  # arguments may not pickle
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.exc_info = None
        self.said.append(("log", record))

    def warned(self, message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: Any) -> None:
        self.said.append(("warning", (category, str(message), filename, lineno)))


class _Text(io.StringIO):
    def __init__(self, relay: _Relay, stream: str) -> None:
        super().__init__()
        self.relay, self.stream = relay, stream

    def write(self, text: str) -> int:
        self.relay.said.append((self.stream, text))
        return len(text)


@contextlib.contextmanager
def _relayed() -> Iterator[_Relay]:
    """The child's warnings, log records and prints to redirected streams, kept for the parent."""
    relay = _Relay()
    root = logging.getLogger()
    root.handlers = [relay]  # the child's copies of the parent's handlers would write where the parent cannot see
    warnings.showwarning = relay.warned
    if sys.stdout is not sys.__stdout__:
        sys.stdout = _Text(relay, "stdout")
    if sys.stderr is not sys.__stderr__:
        sys.stderr = _Text(relay, "stderr")
    yield relay


def _replay(said: list[tuple[str, Any]]) -> None:
    """In the parent: what the child said, as if said here."""
    for kind, value in said:
        if kind == "log":
            logging.getLogger(value.name).handle(value)
        elif kind == "warning":
            category, text, filename, lineno = value
            warnings.warn_explicit(text, category if isinstance(category, type) else UserWarning, filename, lineno)
        else:
            getattr(sys, kind).write(value)


def fork_is_safe(*, runs_kernels: bool = True) -> bool:
    """Whether this process can fork a child to do torch work (NOTE [Work in a forked child]):
    fork exists, no CUDA context is made, and, where the work runs ATen kernels, one intra-op
    thread (no OpenMP team to copy half-alive)."""
    if not hasattr(os, "fork") or torch.cuda.is_initialized():
        return False
    return not runs_kernels or torch.get_num_threads() == 1


def start_in_fork(fn: Callable[[], bytes]) -> Callable[[float | None], ChildResult | None]:
    """Start ``fn()`` in a forked child; the returned ``wait(timeout_s)`` gives what it sent, or
    None where it died or ran past ``timeout_s`` seconds (None: no limit), then killed."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it never returns into the parent's code
        status = 1
        try:
            # Nothing inherited is ever collected here: an unreachable process group the parent
            # has not collected yet would wait in its destructor for threads the child lacks.
            gc.freeze()
            os.close(read_fd)
            with _relayed() as relay:
                try:
                    record: tuple[str, Any, list[tuple[str, Any]]] = ("ok", fn(), relay.said)
                except BaseException as exc:  # noqa: BLE001 (sent to the parent, which decides)
                    record = ("error", (type(exc).__name__, str(exc), traceback.format_exc()), relay.said)
                data = _pickled(record)
            with os.fdopen(write_fd, "wb") as out:
                out.write(data)
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)

    def wait(timeout_s: float | None = None) -> ChildResult | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        chunks = []
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    return None
                ready, _, _ = select.select([pipe], [], [], left)
                if not ready:
                    continue
                chunk = pipe.read(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        if status != 0 or not chunks:
            return None
        kind, value, said = pickle.loads(b"".join(chunks))
        _replay(said)
        return ChildResult(payload=value, said=said) if kind == "ok" else ChildResult(error=value, said=said)

    return wait


def _pickled(record: tuple[str, Any, list[tuple[str, Any]]]) -> bytes:
    """``record``, pickled; what the child said that does not pickle (a warning category or log
    record holding objects of its own) is sent as text."""
    kind, value, said = record
    kept = []
    for item in said:
        try:
            pickle.dumps(item)
        except Exception:  # noqa: BLE001
            text = item[1].getMessage() if item[0] == "log" else str(item[1])
            item = ("stderr", f"{text}\n")
        kept.append(item)
    return pickle.dumps((kind, value, kept))

