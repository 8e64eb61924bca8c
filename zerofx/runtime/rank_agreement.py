"""Ranks agree before any collective: the checks the engine runs so that ranks given different
configs, models, inputs, batches or programs raise an error instead of hanging in (or training
through) a mismatched collective, plus the one build per job that rank 0 sends the others.

Each function takes the process group and what it compares; none keeps state. The engine calls
them (``zerofx.runtime.engine``): ``check_same_config`` at initialize, ``agree_on_inputs`` on every call,
``build_once`` and ``check_same_plan`` when a new program is built, ``check_same_batch_in_group``
on every call under sequence parallelism.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from zerofx.common import errors
from zerofx.common.fork import fork_is_safe, start_in_fork
from zerofx.compiler import plan_cache
from zerofx.config import ZeroConfig, first_config_difference
from zerofx.common.errors import CollectiveTimeoutError, RankDivergenceError, ZeroFXError
from zerofx.passes import _compat
from zerofx.passes.analysis.check_collectives import collective_sequence, first_divergence
from zerofx.compiler.program import Program

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long ranks wait for rank 0 to build the program (NOTE [One build per job]).
BUILD_WAIT_S = 3600.0

# Text in the errors a backend raises when a collective's peer is gone or too slow.
_COMM_FAILURE_MARKERS = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe",
                         "received data size", "socket", "peer")


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a backend's error for a dead, stalled or mismatched peer."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(m in text for m in _COMM_FAILURE_MARKERS)


def failing_collective(exc: BaseException) -> str:
    """The graph line that raised (its collective or wait), from the traceback: FX registers each
    graph's generated source, so the frame's line is the node's Python."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.startswith("<eval_with_key>") and frame.line:
            return f"`{frame.line.split(';')[0].strip()}`"  # the node's statement, without the frees after it
    return "a collective"


def comm_failure(rank: int, timeout_s: float, where: str, exc: BaseException) -> CollectiveTimeoutError:
    """The error a rank raises for a collective that failed in ``where``."""
    return CollectiveTimeoutError(
        f"rank {rank}: a collective failed in {where} (timeout {timeout_s:g} s, config key "
        f"zerofx.collective_timeout_s): a peer is dead, stalled or issuing a different collective. "
        f"{str(exc).strip().splitlines()[0]}",
        where=where, timeout_s=timeout_s,
    )


def _model_layout(model: nn.Module) -> list[str]:
    """Each parameter's and buffer's name, shape, dtype (and whether it trains), in order."""
    params = [f"parameter {n} {list(p.shape)} {p.dtype} requires_grad={p.requires_grad}" for n, p in model.named_parameters()]
    return params + [f"buffer {n} {list(b.shape)} {b.dtype}" for n, b in model.named_buffers()]


def check_same_config(cfg: ZeroConfig, model: nn.Module, group: dist.ProcessGroup, world_size: int) -> None:
    """Raise ``RankDivergenceError`` on every rank when ranks were given settings that change the
    collectives or the numerics, or models of other layouts (NOTE [Ranks agree before any
    collective]); the message names the keys or the first tensor that differs. One
    ``all_gather_object`` at initialize."""
    layout = _model_layout(model)
    mine = (cfg.fingerprint_fields(), hashlib.sha256("\n".join(layout).encode()).hexdigest())
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    if len({digest for _, digest in everyone}) > 1:
        layouts: list[Any] = [None] * world_size
        dist.all_gather_object(layouts, layout, group=group)
        first = next(i for i in range(max(map(len, layouts))) if len({tuple(x[i:i + 1]) for x in layouts}) > 1)
        shown = ", ".join(f"rank {r} {x[first] if first < len(x) else 'nothing'}" for r, x in enumerate(layouts))
        raise RankDivergenceError(f"ranks built different models: entry #{first} is {shown}; build the model the same way on every rank")
    difference = first_config_difference([fields for fields, _ in everyone])
    if difference is not None:
        raise RankDivergenceError(f"ranks were given different settings ({difference}); every rank must use the same config")


def describe_signature(sig: Any) -> str:
    """A rank's input signature as a short text: each tensor's shape and dtype, in call order."""
    _, leaves = sig
    return ", ".join(f"{list(x[0])} {str(x[1]).removeprefix('torch.')}" if x[0] != "const" else f"{x[1]}" for x in leaves) or "no tensors"


def agree_on_inputs(sig: Any, misplaced: str | None, *, group: dist.ProcessGroup, world_size: int, device: torch.device,
                    on_comm_failure: Callable[[str, BaseException], BaseException]) -> None:
    """Check, with one small all-reduce, that every rank calls with the same input signature
    (shapes, dtypes, structure, and the same misplaced input if any), before any other
    collective of this call.

    NOTE [Ranks agree before any collective]
    A rank that captures a new program runs collectives (the plan check below) that peers
    reusing a cached program never join, and graphs captured for other shapes can issue
    other collectives: gloo then aborts the process ("Received data size doesn't match
    expected size") and NCCL hangs. So each call first all-reduces the max of (h, -h) of a
    hash h of its signature: one 16-byte collective, with every rank taking part. Equal
    signatures mean every rank finds the same program in its cache (the caches see the same
    sequence of signatures) or captures together. Otherwise every rank raises
    ``RankDivergenceError`` naming each rank's shapes, before the first collective of the
    graphs. At initialize, ``check_same_config`` does the same for the config. An input
    on the wrong device (meta, or not the engine's) enters the hash too: when every rank
    passes the same one, each raises ``ZeroFXError`` naming it; when only some do, every
    rank raises ``RankDivergenceError``. No rank is left waiting in a graph's collective.
    """
    digest = int.from_bytes(hashlib.blake2b(repr((sig, misplaced)).encode(), digest_size=7).digest(), "little")  # < 2**56
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    try:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as exc:
        if not is_comm_failure(exc):
            raise
        raise on_comm_failure("the all-reduce that checks every rank's input shapes, before the forward graph", exc) from exc
    high, neg_low = both.tolist()
    if high == digest and neg_low == -digest:
        return
    everyone: list[Any] = [None] * world_size
    mine = describe_signature(sig) + (f" ({misplaced})" if misplaced is not None else "")
    dist.all_gather_object(everyone, mine, group=group)
    by_rank = "; ".join(f"rank {r}: {d}" for r, d in enumerate(everyone))
    raise RankDivergenceError(
        f"ranks called the engine with different inputs ({by_rank}); every rank must pass the same shapes "
        "in the same step (pad the batch, or drop an uneven last batch on every rank)"
    )


def check_same_plan(program: Program, rank: int, group: dist.ProcessGroup, world_size: int) -> None:
    """Before running, check every rank issues the same collectives in the same order with
    the same sizes, planned the same and lowered the same graphs (a model built with other
    hyperparameters but the same parameter shapes, e.g. another number of heads, lowers other
    graphs): a mismatch would otherwise hang in a collective or train on a mix."""
    gms = program.graph_modules(rank)
    graphs = hashlib.sha256("".join(gms[name].code for name in sorted(gms)).encode()).hexdigest()[:16]
    mine = (f"{program.plan.fingerprint()}/{graphs}", collective_sequence(gms))
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    divergence = first_divergence([seq for _, seq in everyone])
    if divergence is not None:
        raise RankDivergenceError(f"ranks would issue different collectives; {divergence}")
    fingerprints = [fp for fp, _ in everyone]
    if len(set(fingerprints)) != 1:
        raise RankDivergenceError(
            f"ranks planned or lowered different programs (plan/graph fingerprints by rank: {fingerprints}); the "
            "model must be built the same way on every rank"
        )


def check_same_batch_in_group(inputs: list[torch.Tensor], *, rank: int, sequence_group: dist.ProcessGroup, size: int,
                              device: torch.device) -> None:
    """The ranks of a sequence group must pass the same batch (each takes its own slice of
    it): a checksum of the inputs, compared with one small all-reduce over the group."""
    sums = []
    for t in inputs:
        flat = t.detach().flatten().double()
        sums += [flat.sum(), (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)).sum()]
    both = torch.stack(sums + [-x for x in sums]) if sums else torch.zeros(2, dtype=torch.float64, device=device)
    mine = both.clone()
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=sequence_group)
    if not torch.equal(both, mine):
        raise RankDivergenceError(
            f"rank {rank}: the ranks of its sequence group (zerofx.sequence_parallel.size {size}: "
            "ranks r with the same r // size) passed different batches; every rank of a group must pass the same whole "
            "batch, and zerofx takes each rank's slice of the sequence itself")


def build_once(build: Callable[[], Program], *, key: dict[str, Any], rank: int, group: dist.ProcessGroup, world_size: int,
               timeout_s: float, program_options: dict[str, Any], in_child: bool = False) -> Program:
    """``build()`` on rank 0, its program sent to every other rank; ``key`` is this rank's
    plan-cache key for it, as rank 0 would compute it. With ``in_child`` rank 0 builds in a
    forked child where that is safe (NOTE [Rank 0 builds in a child]).

    NOTE [One build per job]
    Every rank's program is the same (the graphs name groups, not ranks: NOTE [Shard groups
    of consecutive ranks]), so capturing and lowering it on every rank repeats the same
    seconds N times, on host cores the ranks of a node share. Rank 0 builds it and
    broadcasts its bytes (the plan cache's format); the others rebuild the graphs from them.
    Only when every rank's plan-cache key (model structure and attributes, inputs, loss,
    config, world, code) is the same, and the loss function captures only plain data: ranks
    whose models differ each build their own, and ``check_same_plan`` names the difference. A
    build that fails on rank 0 fails on every rank rather than leaving the others waiting: a
    zerofx error as itself (a ``MissingLossError`` still defers capture to the first call),
    anything else as a ``ZeroFXError`` quoting it.
    """
    if world_size == 1:
        return build()
    keys: list[Any] = [None] * world_size
    dist.all_gather_object(keys, plan_cache.key_digest(key), group=group)
    if len(set(keys)) > 1 or plan_cache.UNKEYED in str(key["loss_fn"]):
        return build()
    message: list[Any] = [None]
    program: Program | None = None
    error: BaseException | None = None
    if rank == 0:
        try:
            program, payload = _build_on_rank_0(build, rank, program_options, in_child=in_child)
            message = [("program", payload)]
        except BaseException as exc:
            message, error = [("error", (type(exc).__name__, str(exc)))], exc
    # The other ranks wait for rank 0's build, not for a stalled peer: the collective timeout
    # (seconds) would cut a build of minutes short. A rank 0 that dies closes its connections.
    _compat.set_group_timeout(group, timedelta(seconds=max(BUILD_WAIT_S, timeout_s)))
    try:
        dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
    finally:
        _compat.set_group_timeout(group, timedelta(seconds=timeout_s))
    if error is not None:
        raise error
    kind, value = message[0]
    if program is not None:
        return program
    if kind == "error":
        name, text = value
        same = getattr(errors, name, None)
        if isinstance(same, type) and issubclass(same, ZeroFXError):  # the error every rank would have raised
            raise same(text)
        raise ZeroFXError(f"rank 0 could not build the program, so no rank runs: {name}: {text}")
    start = time.perf_counter()
    program = plan_cache.program_from_bytes(value, program_options)
    program.setup_times = {"from rank 0": time.perf_counter() - start}
    return program


# NOTE [Rank 0 builds in a child]
# Capturing and lowering a step leaves CPython's allocator holding partly freed arenas: on this
# project's machine rank 0 of the 25m DNA LM at 2 gloo ranks (stage 3, 1,024 tokens) held 425 MiB
# after ``zerofx.initialize`` against rank 1's 396 MiB, the same live bytes in more arenas;
# clearing torch's fake-tensor, dynamo, sympy and line caches, or glibc's ``malloc_trim``, frees
# none of it. The other ranks never hold it: they rebuild the graphs from the bytes rank 0 sends
# (NOTE [One build per job]). So on a CPU device rank 0 builds in a forked child (NOTE [Work in a
# forked child] in zerofx/common/fork.py) and, like the others, keeps only the program read back
# from the child's bytes; what the build allocated leaves with the child. Measured the same way:
# 397-398 MiB after ``zerofx.initialize`` and a peak of 877-879 MiB over two steps, against
# 905-906 MiB building in its own process, for 0.3 s more setup. On a GPU the residue is host memory, not the device's, and a
# CUDA context forbids the fork: rank 0 builds in its own process, as it does wherever the fork is
# not safe. A zerofx error in the child is raised again as itself (a ``MissingLossError`` still
# defers capture to the first call); any other failure, or a child that dies, makes rank 0 build
# in its own process, where the traceback is the user's.
# NOTE [Rank 0 searches in a child]
# ``zerofx.auto`` runs the whole-job search on rank 0 alone, and its captures and lowerings leave
# rank 0's process holding what a build leaves (NOTE [Rank 0 builds in a child]), times the
# candidates it plans, while the other ranks never search. So where a fork is safe rank 0
# searches in a forked child (NOTE [Work in a forked child] in zerofx/common/fork.py) and keeps
# only what the search returns, the chosen config or the line saying nothing fits; the child's
# progress and its line reach rank 0's streams as they would have from rank 0. A zerofx error in
# the child is raised again as itself; any other failure, or a child that dies, makes rank 0
# search in its own process, where the traceback is the user's.
def search_on_rank_0(search: Callable[[], T]) -> T:
    """What ``search()`` returns (it must pickle), computed in a forked child where that is safe
    (NOTE [Rank 0 searches in a child])."""
    if fork_is_safe():
        got = start_in_fork(lambda: pickle.dumps(search()))(None)
        if got is not None and got.payload is not None:
            return pickle.loads(got.payload)
        if got is not None and got.error is not None:
            got.raise_zerofx_error()
            log.info("rank 0's search in a child failed (%s: %s); searching in this process:\n%s", *got.error)
        else:
            log.info("rank 0's search in a child died; searching in this process")
    return search()


def _build_on_rank_0(build: Callable[[], Program], rank: int, program_options: dict[str, Any], *,
                     in_child: bool) -> tuple[Program, bytes]:
    """Rank 0's program and the bytes it sends the other ranks (NOTE [Rank 0 builds in a child])."""
    if in_child and fork_is_safe():
        def built() -> bytes:
            program = build()
            return pickle.dumps((plan_cache.program_bytes(program, rank), dict(program.setup_times), program.cache_entry))

        start = time.perf_counter()
        got = start_in_fork(built)(BUILD_WAIT_S)
        if got is not None and got.payload is not None:
            payload, setup_times, cache_entry = pickle.loads(got.payload)
            read_start = time.perf_counter()
            program = plan_cache.program_from_bytes(payload, program_options)
            program.setup_times = {**setup_times, "read back from the build process": time.perf_counter() - read_start}
            program.cache_entry = cache_entry
            log.debug("rank 0 built its program in a child in %.1f s", time.perf_counter() - start)
            return program, payload
        if got is not None and got.error is not None:
            got.raise_zerofx_error()
            name, text, child_traceback = got.error
            log.info("rank 0's build in a child failed (%s: %s); building in this process:\n%s", name, text, child_traceback)
        else:
            log.info("rank 0's build in a child died or timed out; building in this process")
    program = build()
    return program, plan_cache.program_bytes(program, rank)

