"""The optimizer-state records of one rank (ZeRO-Offload / ZeRO-Infinity): each parameter's
fp32 master (mixed precision) and optimizer states as one flat ``Record``, on the tier the
``OffloadPlan`` chose, in an ``OffloadStore`` that hands records to the update and takes them
back. Each tier's records are kept by its backend (``zerofx.runtime.offload.tiers``, NOTE [Tier
backends]): device and host records are tensors held in place; NVMe records are files
(``zerofx.runtime.offload.files``, NOTE [NVMe I/O]) that pass through a window of host buffers.

The window: records are read in update order into free buffers, at most ``buffer_count``
ahead; a buffer is free again when its record's write-back has finished. The first
``buffer_count`` reads are issued by ``prefetch()``, which the engine calls as the backward pass
of a boundary micro-step starts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from zerofx.cost_models.memory import OPTIMIZERS
from zerofx.cost_models.offload import FP32_BYTES
from zerofx.cost_models.tiers import Tier
from zerofx.runtime.offload.files import IO_THREADS, NvmeFiles
from zerofx.runtime.offload.tiers import BackgroundIO, TierBackend, TierRequest, open_tier
from zerofx.config.offload_options import OffloadOptions
from zerofx.passes.plan.offload import OffloadPlan


@dataclass
class Record:
    """One parameter's optimizer-state record: named fp32 segments of one flat, and where it lives."""

    fqn: str
    tier: Tier
    names: tuple[str, ...]  # "master"? then the optimizer's state tensors
    numel: int  # elements per segment (this rank's owned elements)
    flat: torch.Tensor | None  # resident tiers only
    step: torch.Tensor  # Adam's step count, kept in memory as torch does (a float32 scalar)
    initialized: bool = False  # SGD's momentum buffer exists (torch creates it at the first step)

    @property
    def nbytes(self) -> int:
        return FP32_BYTES * self.numel * len(self.names)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[i * self.numel : (i + 1) * self.numel] for i, name in enumerate(self.names)}


class OffloadStore(BackgroundIO):
    """The records of one rank, on the tiers the plan chose, and the window of host buffers
    that the records of the tiers not held in place pass through (the window, in the module docstring)."""

    def __init__(
        self, plan: OffloadPlan, options: OffloadOptions, owned_numels: Mapping[str, int], *,
        optimizer: str, mixed_precision: bool, device: torch.device, rank: int,
    ) -> None:
        self.plan, self.options, self.device = plan, options, device
        self.optimizer_kind, self.mixed_precision = optimizer, mixed_precision
        names = (("master",) if mixed_precision else ()) + OPTIMIZERS[optimizer].state
        self._pin = options.pin_memory and device.type == "cuda"
        self.records: dict[str, Record] = {}
        self.tiers: dict[Tier, TierBackend] = {}
        request = TierRequest(device, options.pin_memory, options.nvme_path, rank)
        for fqn in plan.update_order:
            tier = plan.tier_of(fqn)
            if tier not in self.tiers:
                self.tiers[tier] = open_tier(tier, request)
            rec = Record(fqn, tier, names, owned_numels[fqn], None, torch.tensor(0.0, dtype=torch.float32))
            if self.tiers[tier].in_place:
                rec.flat = self.tiers[tier].allocate(fqn, rec.nbytes).view(torch.float32)
            self.records[fqn] = rec
        streamed = [r for r in self.records.values() if not self.tiers[r.tier].in_place]
        self.streamed = [b for b in self.tiers.values() if not b.in_place]
        self.files: NvmeFiles | None = self.tiers.get(Tier.NVME)  # for inspection: the record files
        self._buffer_bytes = max((r.nbytes for r in streamed), default=0)
        # The window: buffer_count buffers for the largest record, each moving every record in turn
        # (any host buffer of at least nbytes is one a backend reads into: NOTE [Tier backends]).
        largest = max(streamed, key=lambda r: r.nbytes, default=None)
        self._free: list[torch.Tensor] = [
            self.tiers[largest.tier].allocate(largest.fqn, largest.nbytes) for _ in range(options.buffer_count if largest else 0)
        ]
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="zerofx-offload-io") if streamed else None
        self._reads: dict[str, tuple[Future, torch.Tensor]] = {}
        self._writes: deque[tuple[Future, torch.Tensor]] = deque()
        self._last_write: dict[str, Future] = {}  # a record's newest write-back, which its next read must follow
        self._streamed_order = [r.fqn for r in streamed]
        self._next_read = 0

    # ------------------------------------------------------------- initial values, state access
    def init_record(self, fqn: str, master: torch.Tensor | None) -> None:
        """Write ``fqn``'s first record: its fp32 master (mixed precision) and zero states."""
        rec = self.records[fqn]
        if self.tiers[rec.tier].in_place:
            if master is not None:
                rec.views(rec.flat)["master"].copy_(master)
            return
        buf = self._take_buffer()
        flat = self._as_fp32(buf, rec)
        flat.zero_()
        if master is not None:
            rec.views(flat)["master"].copy_(master)
        try:
            self.tiers[rec.tier].write(fqn, buf, rec.nbytes)
        finally:
            self._free.append(buf)

    def read_segments(self, fqn: str) -> dict[str, torch.Tensor]:
        """A copy of ``fqn``'s record segments (for checkpoints), on the host."""
        self.drain()
        rec = self.records[fqn]
        if self.tiers[rec.tier].in_place:
            return {k: v.detach().to("cpu", copy=True) for k, v in rec.views(rec.flat).items()}
        buf = self._take_buffer()
        try:
            self.tiers[rec.tier].read(fqn, buf, rec.nbytes)
            return {k: v.clone() for k, v in rec.views(self._as_fp32(buf, rec)).items()}
        finally:
            self._free.append(buf)

    def write_segments(self, fqn: str, values: Mapping[str, torch.Tensor]) -> None:
        """Overwrite some of ``fqn``'s segments (checkpoint loading); the others are kept."""
        self.drain()
        rec = self.records[fqn]
        backend = self.tiers[rec.tier]
        if backend.in_place:
            views = rec.views(rec.flat)
            for k, v in values.items():
                views[k].copy_(v)
            return
        buf = self._take_buffer()
        try:
            backend.read(fqn, buf, rec.nbytes)
            views = rec.views(self._as_fp32(buf, rec))
            for k, v in values.items():
                views[k].copy_(v)
            backend.write(fqn, buf, rec.nbytes)
        finally:
            self._free.append(buf)

    def _as_fp32(self, buf: torch.Tensor, rec: Record) -> torch.Tensor:
        return buf[: rec.nbytes].view(torch.float32)

    # ------------------------------------------------------------- the window
    def _take_buffer(self, *, block: bool = True) -> torch.Tensor | None:
        """A free host buffer. Reclaims those whose write-back has ended; with ``block``, waits
        for the oldest write-back when none has, else returns None."""
        while self._writes and (not self._free or self._writes[0][0].done()):
            if not block and not self._writes[0][0].done():
                break
            future, buf = self._writes.popleft()
            try:
                future.result()
            finally:
                self._free.append(buf)
        if self._free:
            return self._free.pop()
        assert not block, "every buffer is held by a read or an update: the window is larger than buffer_count"
        return None

    def prefetch(self, count: int | None = None, *, block: bool = False) -> None:
        """Issue reads of the next streamed records in update order, up to ``count`` (default: the
        whole window) ahead, into the buffers free now (with ``block``, waiting for write-backs)."""
        if self._io is None:
            return
        ahead = self.options.buffer_count if count is None else count
        while self._next_read < len(self._streamed_order) and len(self._reads) < ahead:
            buf = self._take_buffer(block=block)
            if buf is None:
                return  # the next acquire issues it, once a write-back frees a buffer
            fqn = self._streamed_order[self._next_read]
            self._reads[fqn] = (self._io.submit(self._read_after_write, fqn, buf), buf)
            self._next_read += 1

    def _read_after_write(self, fqn: str, buf: torch.Tensor) -> None:
        """On an I/O thread: read ``fqn`` once its previous step's write-back has ended. That
        write was submitted first, so it is running or done: waiting on it cannot deadlock."""
        previous = self._last_write.get(fqn)
        if previous is not None:
            previous.result()
        rec = self.records[fqn]
        self.tiers[rec.tier].read(fqn, buf, rec.nbytes)

    def acquire(self, fqn: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The record's fp32 flat, in memory; and the host buffer holding it (streamed records only)."""
        rec = self.records[fqn]
        if self.tiers[rec.tier].in_place:
            return rec.flat, None
        if fqn not in self._reads:
            self.prefetch(count=len(self._reads) + 1, block=True)
        future, buf = self._reads.pop(fqn)
        try:
            future.result()
        except BaseException:
            self._free.append(buf)
            raise
        self.prefetch()  # the next read goes out while this record is updated
        return self._as_fp32(buf, rec), buf

    def release(self, fqn: str, buf: torch.Tensor | None, *, after: torch.cuda.Event | None = None) -> None:
        """Write a streamed record back, behind the next updates; with ``after``, once that event
        (a copy to the device that reads the buffer) has passed, so the buffer outlives it."""
        if buf is not None:
            future = self._io.submit(self._write_after, fqn, buf, after)
            self._last_write[fqn] = future
            self._writes.append((future, buf))

    def _write_after(self, fqn: str, buf: torch.Tensor, after: torch.cuda.Event | None) -> None:
        if after is not None:
            after.synchronize()
        rec = self.records[fqn]
        self.tiers[rec.tier].write(fqn, buf, rec.nbytes)

    def end_step(self) -> None:
        """The step's records are all updated: the next step reads from the first again."""
        assert not self._reads, f"records read but not updated: {sorted(self._reads)}"
        self._next_read = 0

    def drain(self) -> None:
        """Wait for every write-back (raising its error, if any); cancel nothing."""
        first: BaseException | None = None
        for future, buf in list(self._reads.values()):
            try:
                future.result()
            except BaseException as exc:  # keep draining, then raise the first failure
                first = first or exc
            self._free.append(buf)
        self._reads.clear()
        self._next_read = 0
        while self._writes:
            future, buf = self._writes.popleft()
            try:
                future.result()
            except BaseException as exc:
                first = first or exc
            self._free.append(buf)
        if first is not None:
            raise first

    def drain_quietly(self) -> None:
        """``drain`` after a failed step: the step's own error is the one to raise, so failures of
        the transfers still in flight are dropped here."""
        try:
            self.drain()
        except BaseException:
            pass

    # ------------------------------------------------------------- accounting
    def resident_bytes(self, tier: Tier) -> int:
        return sum(r.flat.untyped_storage().nbytes() for r in self.records.values() if r.tier is tier and r.flat is not None)

    def nvme_bytes(self) -> int:
        """Bytes of optimizer state the streamed tiers hold (the NVMe record files' sizes)."""
        return sum(backend.stored_bytes(self._streamed_order) for backend in self.streamed)

    def window_bytes(self) -> int:
        """Host memory of the window: ``buffer_count`` buffers of the largest streamed record."""
        return self._buffer_bytes * (self.options.buffer_count if self._streamed_order else 0)

    def io_bytes(self) -> tuple[int, int]:
        """(read, written) bytes to the streamed tiers (NVMe) so far."""
        moved = [backend.io_bytes() for backend in self.streamed]
        return sum(r for r, _ in moved), sum(w for _, w in moved)

