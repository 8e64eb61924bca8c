"""zerofx.common.fork: work in a forked child, its bytes read back (NOTE [Work in a forked child])."""

from __future__ import annotations

import os
import time

import pytest
import torch

from zerofx.common.errors import CaptureError
from zerofx.common.fork import fork_is_safe, start_in_fork

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")


def test_the_childs_bytes_come_back() -> None:
    parent = os.getpid()
    got = start_in_fork(lambda: f"{os.getpid()} {parent}".encode())(30.0)
    assert got is not None and got.error is None
    child, seen_parent = got.payload.decode().split()
    assert int(child) != parent and int(seen_parent) == parent  # it ran in another process, with the parent's objects


def test_an_exception_in_the_child_comes_back_as_its_class_and_message() -> None:
    def fails() -> bytes:
        raise CaptureError("the model branches on a tensor's value")

    got = start_in_fork(fails)(30.0)
    assert got is not None and got.payload is None
    name, text, child_traceback = got.error
    assert (name, text) == ("CaptureError", "the model branches on a tensor's value") and "fails" in child_traceback
    with pytest.raises(CaptureError, match="the model branches on a tensor's value"):  # a user's error, raised as itself
        got.raise_zerofx_error()

    def breaks() -> bytes:
        raise RuntimeError("a bug")

    other = start_in_fork(breaks)(30.0)
    assert other is not None and other.error is not None and other.error[0] == "RuntimeError"
    other.raise_zerofx_error()  # not a zerofx error: the caller's to handle


def test_a_child_that_dies_or_overruns_gives_none() -> None:
    assert start_in_fork(lambda: os._exit(3))(30.0) is None
    start = time.monotonic()
    assert start_in_fork(lambda: time.sleep(60) or b"late")(0.5) is None  # killed at the timeout
    assert time.monotonic() - start < 10


def test_fork_is_safe_only_without_a_thread_team_the_child_would_need() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not fork_is_safe() and fork_is_safe(runs_kernels=False) == (not torch.cuda.is_initialized())
        torch.set_num_threads(1)
        assert fork_is_safe() == (not torch.cuda.is_initialized())
    finally:
        torch.set_num_threads(threads)


def test_what_the_child_says_reaches_the_parent(caplog: pytest.LogCaptureFixture) -> None:
    # Its warnings through the parent's filters, its log records through the parent's handlers,
    # its prints into the parent's redirected stdout.
    import contextlib
    import io
    import logging
    import warnings

    def talks() -> bytes:
        warnings.warn("a capture warning", UserWarning, stacklevel=1)
        logging.getLogger("zerofx.test_fork").warning("logged %d", 3)
        print("printed")
        return b"done"

    out = io.StringIO()
    with caplog.at_level(logging.WARNING, logger="zerofx.test_fork"), contextlib.redirect_stdout(out), \
            pytest.warns(UserWarning, match="a capture warning"):
        got = start_in_fork(talks)(30.0)
    assert got is not None and got.payload == b"done"
    assert "logged 3" in caplog.text and out.getvalue() == "printed\n"
