"""Spawn real gloo process groups for tests, and collect each rank's result."""

from __future__ import annotations

import faulthandler
import io
import os
import queue as queue_mod
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    sys.path.insert(0, ROOT)
    faulthandler.enable()  # a segfault in a rank prints every thread's Python stack to the test's stderr
    import torch

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        # Serialise with torch.save: tensors shared through the queue vanish when this process exits.
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report any failure to the test process, with its traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.
    ``fn`` must be importable (module level) and return picklable values."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    timeout = 900.0
    for _ in procs:
        try:
            rank, status, value = queue.get(timeout=timeout)
        except queue_mod.Empty:  # the remaining ranks are stuck, most likely in a collective
            errors.append(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout:.0f}s")
            break
        if status == "error":
            errors.append(f"rank {rank}:\n{value}")
            timeout = 20.0  # the other ranks may now hang in a collective; don't wait long
        results[rank] = torch.load(io.BytesIO(value), weights_only=False) if status == "ok" else value
    for rank, p in enumerate(procs):
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
        elif p.exitcode is not None and p.exitcode < 0 and rank not in results:
            # A rank killed by a signal reports nothing itself; its Python stacks (faulthandler)
            # are in the captured stderr.
            errors.append(f"rank {rank} died from signal {signal.Signals(-p.exitcode).name}")
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
