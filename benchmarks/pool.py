"""Processes that host the systems, kept alive and driven step by step from the parent.

By default each system has its own processes (its own process group), so peak RSS is its own.
The parent starts every system's ranks (one process each, one thread each), one system at a
time so that setup is timed without contention. Then it asks the systems for one step each, in
rotating order, round after round: every system sees the same machine load, and no system's
steps all land in a noisy minute. Idle ranks block on their pipe and use no CPU.

Each rank times its own steps: a barrier, then wall clock and the main thread's CPU time around
``runner.step``. The parent takes, per step, the slowest rank's wall time (a data-parallel step
ends when its last rank does).
"""

from __future__ import annotations

import io
import os
import socket
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.systems import build_runner, needs_group, split_system, synchronize
from zerofx.common.rank_processes import rank_start
from zerofx.common.rss import peak_rss_bytes

READY_TIMEOUT_S = 900.0
STEP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class BenchSpec:
    """What every system shares: model, data, batch and optimizer."""

    size: str
    world_size: int
    seq_len: int
    batch_per_rank: int
    num_steps: int  # warm-up included
    optimizer: str  # "AdamW" or "SGD"
    lr: float
    seed: int = 0
    data: str = "genome"  # "genome" (the bundled lambda phage) or "random" tokens
    zerofx_config: str | None = None  # JSON merged into the zerofx systems' config (bucket sizes, ...)


class BenchError(RuntimeError):
    """A rank failed or stopped answering; the message holds its traceback."""


def rank_batches(spec: BenchSpec, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s micro-batches (B, T), one per step; the genome's are reused cyclically."""
    if spec.data == "random":
        g = torch.Generator().manual_seed(spec.seed)
        ids = torch.randint(0, 5, (spec.num_steps, spec.world_size, spec.batch_per_rank, spec.seq_len), generator=g)
        return [ids[s, rank] for s in range(spec.num_steps)]
    from zerofx.data.genome import bundled_genome, genome_windows

    batches = list(genome_windows(bundled_genome(), spec.seq_len, rank=rank, world_size=spec.world_size,
                                  batch_size=spec.batch_per_rank, seed=spec.seed))
    return [batches[s % len(batches)] for s in range(spec.num_steps)]


def global_batches(spec: BenchSpec) -> list[torch.Tensor]:
    """What the single process trains on: every rank's micro-batch, stacked (W*B, T). Its mean
    loss over W*B equal-length sequences is the mean of the W per-rank losses."""
    per_rank = [rank_batches(spec, r) for r in range(spec.world_size)]
    return [torch.cat([per_rank[r][s] for r in range(spec.world_size)]) for s in range(spec.num_steps)]


def _device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _peak_memory_bytes(device: torch.device) -> dict[str, int]:
    out = {"peak_rss_bytes": peak_rss_bytes()}  # NOTE [VmHWM, not ru_maxrss]
    if device.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def _hosted(systems: tuple[str, ...], rank: int) -> tuple[str, ...]:
    """The systems rank ``rank`` runs: ``single`` lives on rank 0 only."""
    return tuple(s for s in systems if rank == 0 or needs_group(s))


def _worker(systems: tuple[str, ...], rank: int, num_ranks: int, spec: BenchSpec, port: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    device = _device(rank)
    grouped = any(needs_group(s) for s in systems)
    try:
        if any(split_system(s)[0].startswith("deepspeed") for s in systems):
            # What DeepSpeed's launcher would set; it refuses to start without LOCAL_RANK.
            os.environ.setdefault("DS_ACCELERATOR", device.type)
            os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(num_ranks),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if grouped:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
            if device.type == "cuda":
                torch.cuda.set_device(device)
        runners: dict[str, Any] = {}
        batches: dict[str, list[torch.Tensor]] = {}
        ready: dict[str, dict[str, Any]] = {}
        for system in _hosted(systems, rank):  # the same order on every rank: setup may hold collectives
            batches[system] = global_batches(spec) if not needs_group(system) else rank_batches(spec, rank)
            runners[system], setup_s, num_params = build_runner(
                system, size=spec.size, seed=spec.seed, device=device, optim_kind=spec.optimizer, lr=spec.lr,
                example=batches[system][0].to(device), micro_batch=spec.batch_per_rank, zerofx_config=spec.zerofx_config,
            )
            # Peak RSS once built and sharded, before any step: what building the model cost. In a
            # pool of one system it is that system's alone.
            ready[system] = {"setup_s": setup_s, "num_params": num_params,
                             "setup_peak_rss_bytes": _peak_memory_bytes(device)["peak_rss_bytes"]}
        sync = synchronize(device)
        conn.send(("ok", ready))
        while True:
            cmd, system, arg = conn.recv()
            if cmd == "step":
                ids = batches[system][arg].to(device)
                if needs_group(system):
                    dist.barrier()
                sync()
                wall0, cpu0, process0 = time.perf_counter(), time.thread_time(), time.process_time()
                loss = runners[system].step(ids)
                sync()
                conn.send(("ok", (time.perf_counter() - wall0, time.thread_time() - cpu0, loss, time.process_time() - process0)))
            elif cmd == "finish":
                runner = runners.pop(system)
                # The peak of training, taken before the parity check gathers the full model on
                # every rank (4P bytes, which would otherwise set every sharded system's peak).
                result: dict[str, Any] = {"memory": runner.memory(), **_peak_memory_bytes(device)}
                state = runner.full_state()
                if hasattr(runner, "compile_s"):  # graph compilation inside the first step (zerofx.compile)
                    result["compile_s"] = runner.compile_s()
                if rank == 0 and arg:
                    buf = io.BytesIO()
                    torch.save(state, buf)  # bytes, not shared-memory tensors that die with this process
                    result["state"] = buf.getvalue()
                del state, runner
                conn.send(("ok", result))
            elif cmd == "quit":
                break
    except BaseException:  # report any failure to the parent, with its traceback
        conn.send(("error", traceback.format_exc()))
    finally:
        if grouped and dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankPool:
    """Processes that host one or more systems: started by ``__init__``, driven by ``step``,
    ended by ``close``. A pool of ``single`` alone has one process and no process group; any
    other pool has ``spec.world_size`` ranks, and ``single``, if it is among its systems, runs
    on rank 0 only. Peak RSS is per process, so it belongs to a system only in a pool of one."""

    def __init__(self, systems: tuple[str, ...], spec: BenchSpec) -> None:
        start = rank_start(__name__)  # NOTE [Ranks forked from a server that imported torch] in zerofx/common/rank_processes.py
        ctx = start.context
        self.labels = systems
        self.label = ",".join(systems)
        num_ranks = spec.world_size if any(needs_group(s) for s in systems) else 1
        port = _free_port()
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(num_ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=start.target(_worker), args=(systems, rank, num_ranks, spec, port, child), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        ready = self._gather(range(num_ranks), READY_TIMEOUT_S)
        self.setup_s = {s: max(r[s]["setup_s"] for r in ready if s in r) for s in systems}
        self.setup_rss_bytes = {s: max(r[s]["setup_peak_rss_bytes"] for r in ready if s in r) for s in systems}
        self.num_params = ready[0][systems[0]]["num_params"]

    def _ranks_of(self, system: str) -> range:
        return range(len(self.conns)) if needs_group(system) else range(1)

    def _gather(self, ranks: range, timeout_s: float) -> list[Any]:
        """Every rank's answer, in rank order. The first failure raises ``BenchError`` naming the
        system and rank at once: its peers may be stuck in a collective that will never finish."""
        answers: dict[int, Any] = {}
        pending = {self.conns[rank]: rank for rank in ranks}
        deadline = time.monotonic() + timeout_s
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise BenchError(f"{self.label}: ranks {sorted(pending.values())} did not answer in {timeout_s:.0f} s")
            for conn in ready:
                rank = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    status, value = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    raise BenchError(f"{self.label}: rank {rank} exited (code {self.procs[rank].exitcode})") from None
                if status == "error":
                    raise BenchError(f"{self.label}: rank {rank} failed:\n{value}")
                answers[rank] = value
        return [answers[r] for r in ranks]

    def _ask(self, cmd: str, system: str, arg: Any = None, timeout_s: float = STEP_TIMEOUT_S) -> list[Any]:
        ranks = self._ranks_of(system)
        for rank in ranks:
            self.conns[rank].send((cmd, system, arg))
        return self._gather(ranks, timeout_s)

    def step(self, system: str, index: int) -> list[tuple[float, float, float, float]]:
        """``system``'s step ``index`` on every rank: (wall s, main-thread CPU s, loss, the
        process's CPU s: the main thread's and gloo's threads') by rank."""
        return self._ask("step", system, index)

    def finish(self, system: str, want_state: bool) -> list[dict[str, Any]]:
        """``system``'s memory and peak RSS on every rank, and rank 0's full state dict (as
        bytes) if asked. The system's runner is dropped afterwards."""
        return self._ask("finish", system, want_state)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("quit", None, None))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
