"""``offload_param`` at run time (stage 3): ``ParamStore``, this rank's parameter shards in host
memory or in files on NVMe, each tier kept by its backend (``zerofx.runtime.offload.tiers``), fetched into the graphs through
``zerofx::fetch_shard`` (``passes.memory.fetch_params``; its kernel is registered here) and streamed
through the optimizer's update. See NOTE [The parameter store].
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zerofx.cost_models.tiers import Tier
from zerofx.runtime.offload.files import IO_THREADS, NvmeFiles, OffloadError, aligned_empty
from zerofx.runtime.offload.tiers import BackgroundIO, TierBackend, TierRequest, open_tier
from zerofx.config.offload_options import ParamOffloadOptions
from zerofx.passes.memory.fetch_params import fetch_shard
from zerofx.passes.plan.offload import ParamOffloadPlan


# --------------------------------------------------------------------------- the parameter store
# NOTE [The parameter store]
# At stage 3 with ``offload_param`` the engine keeps no offloaded shard itself. ``ParamStore``
# holds them on their tiers' backends (NOTE [Tier backends]): host tensors held in place (pinned
# on CUDA with ``pin_memory``) or one file per shard, ``<nvme_path>/rank-<r>/<fqn>.param``, read
# and written whole through ``NvmeFiles`` (NOTE [NVMe I/O]); the NVMe shards are the streamed
# ones. The graphs ask for a shard with ``zerofx::fetch_shard`` (``passes.memory.fetch_params``) right
# before its bucket's all-gather; the optimizer asks for it to update it (``acquire`` /
# ``release``, which writes it back).
#
# Read-ahead: the engine gives the store the *schedule*, the order of every use in a step
# (forward fetches, backward fetches, then the updates), read from the rewritten graphs. A
# cursor follows it; after each use the store issues reads of the next NVMe shards in the
# schedule, at most ``buffer_count`` in flight, on a pool of ``IO_THREADS`` threads. A use that
# is not the next one in the schedule (another program, an evaluation forward) still works:
# the cursor jumps to it, and a shard not read ahead is read at once.
#
# Every NVMe read lands in a fresh host tensor that the fetch hands over: the graph drops it
# after the gather's pack (or the gather's wait, for a bucket of one shard). So the NVMe shards
# in host memory at any time are at most: ``buffer_count`` reads ahead, ``buffer_count``
# write-backs in flight (``release`` waits for the oldest beyond that), the shard being updated,
# and the shards between fetch and gather: one bucket being packed, or the d + 1 single-shard
# gathers the prefetch distance d keeps in flight. The store counts these buffers while they
# are alive (``held_shards``, ``peak_held_*``); the tests check the bound.
#
# Consistency: a shard's read waits for its last write-back (both go through the pool, the
# write submitted first, so the wait cannot deadlock); a write-back discards a read of the same
# shard issued before it (read ahead for the next forward while the update was pending).
_STORES: weakref.WeakValueDictionary[int, ParamStore] = weakref.WeakValueDictionary()
_STORE_IDS = itertools.count(1)


class ParamStore(BackgroundIO):
    """This rank's offloaded parameter shards, on the tiers a ``ParamOffloadPlan`` chose; see
    NOTE [The parameter store]. ``token`` is what the graphs take in place of each shard."""

    def __init__(
        self, plan: ParamOffloadPlan, options: ParamOffloadOptions, numels: Mapping[str, int], dtype: torch.dtype, *,
        device: torch.device, rank: int,
    ) -> None:
        self.plan, self.options, self.device, self.dtype = plan, options, device, dtype
        self.numels = {f: numels[f] for f, _ in plan.tiers if f in plan.offloaded}
        self.tier = {f: plan.tier_of(f) for f in self.numels}
        self._pin = options.pin_memory and device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # for fetch()
        self.tiers: dict[Tier, TierBackend] = {
            tier: open_tier(tier, TierRequest(device, options.pin_memory, options.nvme_path, rank, ".param", "parameter shard"))
            for tier in dict.fromkeys(self.tier.values())
        }
        self.backend = {f: self.tiers[t] for f, t in self.tier.items()}
        self.host = {f: self.backend[f].allocate(f, self.nbytes(f)).view(dtype) for f in self.numels if self.backend[f].in_place}
        self._streamed = [f for f in self.numels if not self.backend[f].in_place]
        self.streamed = [b for b in self.tiers.values() if not b.in_place]
        self.files: NvmeFiles | None = self.tiers.get(Tier.NVME)  # for inspection: the shard files
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="zerofx-param-io") if self._streamed else None
        self._reads: dict[str, Future] = {}  # NVMe reads issued ahead of their use
        self._last_write: dict[str, Future] = {}
        self._writes: deque[Future] = deque()  # write-backs in flight, at most buffer_count
        self._schedule: list[str] = list(self.numels)
        self._cursor = 0
        self._lock = threading.Lock()
        self.held_shards = self.held_bytes = self.peak_held_shards = self.peak_held_bytes = 0
        self.id = next(_STORE_IDS)
        _STORES[self.id] = self
        self.token = torch.tensor([self.id], dtype=torch.int64)  # (1,): names this store to fetch_shard

    def __contains__(self, fqn: object) -> bool:
        return fqn in self.numels

    def nbytes(self, fqn: str) -> int:
        return self.numels[fqn] * self.dtype.itemsize

    # ------------------------------------------------------------- schedule and read-ahead
    def set_schedule(self, order: list[str]) -> None:
        """Every use of an offloaded shard in one step, in order (see the NOTE)."""
        self._schedule = [f for f in order if f in self.numels] or list(self.numels)
        self._cursor = 0

    def _advance(self, fqn: str) -> None:
        """Move the cursor past the next use of ``fqn`` (jumping to it if out of order)."""
        n = len(self._schedule)
        for step in range(n):
            i = (self._cursor + step) % n
            if self._schedule[i] == fqn:
                self._cursor = (i + 1) % n
                return

    def _read_ahead(self) -> None:
        if self._io is None:
            return
        n = len(self._schedule)
        for step in range(n):
            if len(self._reads) >= self.options.buffer_count:
                return
            f = self._schedule[(self._cursor + step) % n]
            if not self.backend[f].in_place and f not in self._reads:
                self._reads[f] = self._io.submit(self._read, f)

    def _read(self, fqn: str) -> torch.Tensor:
        """On an I/O thread: a fresh host tensor holding ``fqn``'s shard, after its last write."""
        previous = self._last_write.get(fqn)
        if previous is not None:
            previous.result()
        backend = self.backend[fqn]
        buf = backend.allocate(fqn, self.nbytes(fqn)).view(self.dtype)  # O_DIRECT-ready (NOTE [NVMe I/O])
        self._track(buf)
        backend.read(fqn, buf.view(torch.uint8), self.nbytes(fqn))
        return buf

    def _track(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel() * buf.element_size()
        with self._lock:
            self.held_shards += 1
            self.held_bytes += nbytes
            self.peak_held_shards = max(self.peak_held_shards, self.held_shards)
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        weakref.finalize(buf, self._untrack, nbytes)

    def _untrack(self, nbytes: int) -> None:
        with self._lock:
            self.held_shards -= 1
            self.held_bytes -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_held_shards, self.peak_held_bytes = self.held_shards, self.held_bytes

    def _take(self, fqn: str) -> torch.Tensor:
        """The host tensor of ``fqn``'s shard: the one held in place, or a streamed read (read
        ahead, else issued now); the next reads go out before this one is waited for."""
        self._advance(fqn)
        if self.backend[fqn].in_place:
            self._read_ahead()
            return self.host[fqn]
        future = self._reads.pop(fqn, None)
        if future is None:
            future = self._io.submit(self._read, fqn)
        self._read_ahead()
        return future.result()

    # ------------------------------------------------------------- uses
    def fetch(self, fqn: str) -> torch.Tensor:
        """``fqn``'s shard on the compute device, owned by the caller (the graph)."""
        host = self._take(fqn)
        if self.device.type == "cpu":
            # The op's output must be a fresh tensor (torch.library's contract; Inductor may reuse
            # it): a streamed read is; a shard held in place is copied.
            return host.clone() if self.backend[fqn].in_place else host
        if self._copy_stream is None:
            return host.to(self.device, non_blocking=self._pin)
        # From pinned memory the copy is asynchronous. It runs on a side stream, so it overlaps
        # the compute already queued before it, and the compute stream waits for it (without
        # blocking the host) before the all-gather that reads it (torch.cuda.Stream, public API;
        # the pattern FSDP2 uses for its all-gather outputs). The result is allocated on the
        # side stream, so record_stream keeps its memory from that stream's reuse until the
        # compute stream's uses are done; the caching host allocator keeps the source alive.
        # The copy waits for nothing on the device: its source is final on the host (an NVMe
        # read has completed, a host-tier shard is updated by the CPU). The optimizer's host
        # update of a shard happens after an event the compute stream records behind this
        # copy's, so the copy has read the shard by then.
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            out = host.to(self.device, non_blocking=self._pin)
        compute.wait_event(self._copy_stream.record_event())
        out.record_stream(compute)
        return out

    def acquire(self, fqn: str) -> torch.Tensor:
        """``fqn``'s shard in host memory for the optimizer to update in place; ``release`` it."""
        return self._take(fqn)

    def release(self, fqn: str, host: torch.Tensor) -> None:
        """The update of ``fqn`` is done: write a streamed shard back, behind the next updates."""
        backend = self.backend[fqn]
        if backend.in_place:
            return
        stale = self._reads.pop(fqn, None)  # read before this write: drop it
        future = self._io.submit(backend.write, fqn, host.view(torch.uint8), self.nbytes(fqn))
        self._last_write[fqn] = future
        self._writes.append(future)
        while len(self._writes) > self.options.buffer_count:  # each holds its shard's host buffer
            self._writes.popleft().result()
        if stale is not None:
            self._read_ahead()

    # ------------------------------------------------------------- whole-shard access
    def init_shard(self, fqn: str, value: torch.Tensor) -> None:
        """Store ``fqn``'s shard (initialization, checkpoint loading)."""
        if self.backend[fqn].in_place:
            self.host[fqn].copy_(value)
            return
        self._wait_for(fqn)
        buf = value.detach().to("cpu", self.dtype).contiguous()
        self.backend[fqn].write(fqn, buf.view(torch.uint8), self.nbytes(fqn))

    def read_shard(self, fqn: str) -> torch.Tensor:
        """A host copy of ``fqn``'s shard (checkpoints, ``full_state_dict``)."""
        if self.backend[fqn].in_place:
            return self.host[fqn].clone()
        self._wait_for(fqn)
        buf = aligned_empty(self.nbytes(fqn)).view(self.dtype)  # the caller's copy, never pinned
        self.backend[fqn].read(fqn, buf.view(torch.uint8), self.nbytes(fqn))
        return buf

    def _wait_for(self, fqn: str) -> None:
        stale = self._reads.pop(fqn, None)
        if stale is not None:
            stale.exception()  # let it end; its buffer is dropped
        previous = self._last_write.pop(fqn, None)
        if previous is not None:
            previous.result()

    def drain(self) -> None:
        """Wait for every write-back (raising the first error) and drop the reads ahead (their
        errors are raised by the use that needs them, not here)."""
        for future in self._reads.values():
            future.exception()
        first: BaseException | None = None
        for future in self._last_write.values():
            try:
                future.result()
            except BaseException as exc:  # keep draining, then raise the first failure
                first = first or exc
        self._last_write.clear()
        self._reads.clear()
        self._writes.clear()
        if first is not None:
            raise first

    # ------------------------------------------------------------- accounting
    def cpu_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.host.values())

    def nvme_bytes(self) -> int:
        """Bytes of the streamed shards' storage (the NVMe files' sizes)."""
        return sum(backend.stored_bytes(self._streamed) for backend in self.streamed)

    def window_bytes(self) -> int:
        """The read-ahead bound: ``buffer_count`` reads of the largest streamed shard."""
        return self.options.buffer_count * max((self.nbytes(f) for f in self._streamed), default=0)

    def io_bytes(self) -> tuple[int, int]:
        moved = [backend.io_bytes() for backend in self.streamed]
        return sum(r for r, _ in moved), sum(w for _, w in moved)


@fetch_shard.register_kernel("cpu")
def _fetch_shard_kernel(token: torch.Tensor, fqn: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    store = _STORES.get(int(token[0]))
    if store is None:
        raise OffloadError(f"zerofx::fetch_shard({fqn!r}): parameter store {int(token[0])} is gone (its engine was closed?)")
    out = store.fetch(fqn)
    assert out.numel() == numel and out.dtype == dtype, (fqn, out.shape, out.dtype, numel, dtype)
    return out
