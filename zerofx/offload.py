"""ZeRO-Offload / ZeRO-Infinity at run time: optimizer-state records on the device, in host
memory or in files on NVMe, stepped through a bounded window with the I/O overlapped. The
parameter shards of ``offload_param`` (stage 3) live in ``zerofx.param_offload``, which shares
this module's NVMe files.

The engine builds an ``OffloadStore`` (records and their tiers, per the ``OffloadPlan``) before
it lays out the parameters, writes each parameter's initial fp32 master into it one at a time,
then wraps it in an ``OffloadedOptimizer``: a ``torch.optim.Optimizer`` over the engine's
parameter shards, so learning-rate schedules, logging and checkpoints see the usual API.

NOTE [Tiers on this machine and on an accelerator]
``Tier.DEVICE`` records are tensors on the engine's device; the update runs there. ``Tier.CPU``
records are host tensors (pinned when the device is CUDA and ``pin_memory`` is set): the update
runs on the CPU, with the gradient copied to the host and the new parameter copied back, on a
side stream (NOTE [Host copies on a side stream]). ``Tier.NVME`` records
are files; the update runs on the CPU in one of ``buffer_count`` host buffers. When the device
is the CPU, the copies are skipped: the CPU tier is then host memory that the engine reports
apart from the device's, and only the NVMe tier changes what the process holds.

NOTE [NVMe I/O]
One file per record, ``<nvme_path>/rank-<r>/<fqn>.state``, holding the record's fp32 tensors
back to back (cost_models.offload NOTE [What an offloaded record holds]). Files are read and
written whole with ``os.preadv``/``os.pwrite`` in blocks of ``IO_BLOCK_BYTES`` at offsets that are
multiples of it, by a pool of ``IO_THREADS`` threads, each file opened for that one transfer: a
folder that vanishes is an error on the next transfer, not a silent write into an unlinked
file. Where the file system takes ``O_DIRECT`` (probed once per folder) and the host buffer
starts on a ``DIRECT_ALIGN`` boundary (the stores allocate theirs with ``aligned_empty``, as
torch's allocator promises only 64 bytes), a record's whole ``DIRECT_ALIGN`` blocks bypass the
page cache, as DeepSpeed's async I/O does: the drive's own bandwidth, and no second copy of
every record in the kernel's cache. The tail under ``DIRECT_ALIGN`` bytes goes through the page
cache, so files keep their exact size. Otherwise (tmpfs, an unaligned buffer) the whole record
goes through the page cache, which is not resident memory of the process either. Every short
read or failed transfer is an ``OffloadError`` naming the file and the operation.

The window: records are read in update order into free buffers, at most ``buffer_count``
ahead; a buffer is free again when its record's write-back has finished. The first
``buffer_count`` reads are issued by ``prefetch()``, which the engine calls as the backward pass
of a boundary micro-step starts.

NOTE [One-step delayed update]
With ``delayed_update`` the update computed from step t's gradients runs on a background
thread while step t+1's forward and backward run, and it is applied to the parameters when step
t+1's optimizer step begins (or when the engine's state is read: ``flush()``). So the gradients
of step t+1 are taken at parameters that lack step t's update: ZeRO-Offload's DPU. It changes
the numerics: training equals a run in which each gradient is applied one step late. The
gradients are copied before the next backward accumulates into the engine's buffers, and the
new parameters go to a staging copy of this rank's shards, which costs one shard of memory.
"""

from __future__ import annotations

import abc
import errno
import mmap
import os
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import torch
from torch.optim.adam import adam as adam_update
from torch.optim.adamw import adamw as adamw_update
from torch.optim.sgd import sgd as sgd_update

from zerofx.cost_models.compute import CPU_CORE
from zerofx.cost_models.offload import FP32_BYTES, Tier, record_numels
from zerofx.passes.plan_offload import OffloadPlan, plan_offload
from zerofx.errors import ConfigError, ZeroFXError
from zerofx.offload_options import (  # noqa: F401  (the options and their defaults, re-exported)
    DEFAULT_HOST_COPY_BYTES_PER_S,
    DEFAULT_NVME_READ_BYTES_PER_S,
    DEFAULT_NVME_WRITE_BYTES_PER_S,
    OffloadOptions,
)

if TYPE_CHECKING:
    from zerofx.param_offload import ParamStore

IO_BLOCK_BYTES = 8 << 20
IO_THREADS = 2
# O_DIRECT needs buffer addresses, file offsets and lengths in multiples of the device's logical
# block: 4 KiB covers 512-byte and 4 KiB drives.
DIRECT_ALIGN = 4096


class OffloadError(ZeroFXError):
    """Offloaded state could not be stored or read back: names the path and what failed."""


def plan_engine_offload(
    owned_numels: Mapping[str, int], options: OffloadOptions, *, optimizer: str, mixed_precision: bool, device_is_cpu: bool,
    forward_backward_s: float = 0.0, backward_s: float = 0.0,
) -> OffloadPlan:
    """The ``OffloadPlan`` for a rank's trainable parameters (``fqn -> owned elements``, in model
    order). Backward produces gradients in about the reverse order, so records are listed that way."""
    records = [
        (f, FP32_BYTES * sum(record_numels(n, optimizer=optimizer, mixed_precision=mixed_precision)))
        for f, n in reversed(list(owned_numels.items()))
    ]
    try:
        return plan_offload(
            records,
            options.tier_specs(sum(b for _, b in records), device_is_cpu=device_is_cpu),
            buffer_count=options.buffer_count,
            update_bytes_per_s=CPU_CORE.memory_bytes_per_s,
            prefetch_lead_s=backward_s,
            delayed_update=options.delayed_update,
            forward_backward_s=forward_backward_s,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# --------------------------------------------------------------------------- NVMe files
def aligned_empty(nbytes: int, *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialized uint8 host tensor of ``nbytes`` starting on a ``DIRECT_ALIGN`` boundary,
    so ``NvmeFiles`` can move it with ``O_DIRECT`` (NOTE [NVMe I/O])."""
    if pin_memory:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # page-locked pages: page-aligned
    raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % DIRECT_ALIGN
    return raw[skip : skip + nbytes]


def _takes_direct_io(folder: Path) -> bool:
    """Whether files in ``folder`` can be written with ``O_DIRECT`` (tmpfs and some network file
    systems refuse it at open or at the first transfer)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = folder / ".zerofx-direct-test"
    block = mmap.mmap(-1, DIRECT_ALIGN)  # anonymous memory: page-aligned
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            return os.pwrite(fd, block, 0) == DIRECT_ALIGN
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        block.close()
        probe.unlink(missing_ok=True)


class NvmeFiles:
    """The NVMe tier of one rank: one file per record under ``<root>/rank-<r>``, whole-file
    transfers in aligned blocks (NOTE [NVMe I/O]); counts the bytes moved."""

    def __init__(self, root: Path, rank: int, *, suffix: str = ".state", what: str = "optimizer state") -> None:
        self.suffix, self.what = suffix, what
        self.root = Path(root) / f"rank-{rank:05d}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OffloadError(
                f"NVMe offload: cannot create folder {str(self.root)!r} under nvme_path {str(root)!r}: {exc.strerror or exc}; "
                "accepted: a writable folder on a local disk"
            ) from None
        probe = self.root / ".zerofx-write-test"
        try:
            probe.write_bytes(b"\0" * 4096)
            probe.unlink()
        except OSError as exc:
            raise OffloadError(f"NVMe offload: folder {str(self.root)!r} is not writable: {exc.strerror or exc}") from None
        self.direct = _takes_direct_io(self.root)  # NOTE [NVMe I/O]; tests turn it off to compare
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self.bytes_direct = 0  # of bytes_read + bytes_written, those moved with O_DIRECT

    def path(self, fqn: str) -> Path:
        return self.root / f"{quote(fqn, safe='')}{self.suffix}"

    def remove(self) -> None:
        """Delete this tier's files (``*<suffix>`` in the rank folder), then the rank folder if
        nothing else is left in it: a clean exit leaves no offload files behind. Files of
        another kind (a user's, or the other store's suffix) stay."""
        for path in self.root.glob(f"*{self.suffix}"):
            path.unlink(missing_ok=True)
        try:
            self.root.rmdir()
        except OSError:
            pass  # not empty: the other store's files, removed by its own close

    def _fail(self, op: str, path: Path, exc: OSError) -> OffloadError:
        if exc.errno == errno.ENOENT and not path.parent.exists():
            what = f"folder {str(path.parent)!r} no longer exists (removed while training?)"
        elif exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            what = f"the disk is full ({exc.strerror})"
        else:
            what = exc.strerror or str(exc)
        return OffloadError(f"NVMe offload: {op} {str(path)!r} failed: {what}")

    def _direct_bytes(self, buf: torch.Tensor, nbytes: int) -> int:
        """How many leading bytes of a transfer of ``buf[:nbytes]`` can bypass the page cache."""
        if not self.direct or buf.data_ptr() % DIRECT_ALIGN:
            return 0
        return nbytes - nbytes % DIRECT_ALIGN

    def _transfer(self, path: Path, view: memoryview, start: int, *, write: bool, direct: bool) -> None:
        """Move ``view`` to (``write``) or from file offset ``start``, in ``IO_BLOCK_BYTES`` blocks."""
        flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o600)
        try:
            for offset in range(0, len(view), IO_BLOCK_BYTES):
                chunk = view[offset : offset + IO_BLOCK_BYTES]
                done = 0
                while done < len(chunk):
                    at = start + offset + done
                    got = os.pwrite(fd, chunk[done:], at) if write else os.preadv(fd, [chunk[done:]], at)
                    if got == 0 or (direct and got % DIRECT_ALIGN):
                        # A file cut inside the O_DIRECT blocks ends in a partial block; reading on
                        # from its unaligned end would fail with EINVAL, not say what happened.
                        raise EOFError(at + got)
                    done += got
        finally:
            os.close(fd)

    def _move(self, fqn: str, buf: torch.Tensor, nbytes: int, *, write: bool) -> None:
        path = self.path(fqn)
        view = memoryview(buf.numpy())[:nbytes]
        direct = self._direct_bytes(buf, nbytes)
        try:
            if direct:
                self._transfer(path, view[:direct], 0, write=write, direct=True)
            if direct == 0 or direct < nbytes:  # the tail; an empty record still opens (creates, or must find) its file
                self._transfer(path, view[direct:], direct, write=write, direct=False)
        except EOFError as short:
            if write:
                raise OffloadError(f"NVMe offload: writing {nbytes} bytes of {fqn}'s {self.what} to {str(path)!r} stopped at "
                                   f"byte {short.args[0]}: the disk took no more") from None
            raise OffloadError(
                f"NVMe offload: short read of {str(path)!r}: got {short.args[0]} of {nbytes} bytes of {fqn}'s "
                f"{self.what} (file truncated or replaced?)"
            ) from None
        except OSError as exc:
            op = f"writing {nbytes} bytes of {fqn}'s {self.what} to" if write else f"reading {nbytes} bytes of {fqn}'s {self.what} from"
            raise self._fail(op, path, exc) from None
        with self._lock:
            if write:
                self.bytes_written += nbytes
            else:
                self.bytes_read += nbytes
            self.bytes_direct += direct

    def write(self, fqn: str, buf: torch.Tensor, nbytes: int) -> None:
        """Write ``buf[:nbytes]`` (uint8, host) as the record of ``fqn``."""
        self._move(fqn, buf, nbytes, write=True)

    def read(self, fqn: str, buf: torch.Tensor, nbytes: int) -> None:
        """Read the record of ``fqn`` into ``buf[:nbytes]``; a short read is an error."""
        self._move(fqn, buf, nbytes, write=False)

    def stored_bytes(self, fqns: list[str]) -> int:
        """Bytes of the record files on disk now."""
        return sum(self.path(f).stat().st_size for f in fqns if self.path(f).exists())


def measure_nvme_bytes_per_s(nvme_path: Path, *, nbytes: int = 64 << 20, rank: int = 0) -> tuple[float, float]:
    """(read, write) bytes per second of whole-record transfers under ``nvme_path``, the way the
    runtime moves records: a calibration to put into ``zerofx.offload.nvme_*_bytes_per_s``.
    Measure once and give every rank the same numbers (plans must not differ across ranks).
    The buffer is aligned, so where the file system takes ``O_DIRECT`` the transfers bypass the
    page cache as the runtime's do (NOTE [NVMe I/O]); elsewhere the read may come from it."""
    import time

    files = NvmeFiles(Path(nvme_path), rank)
    buf = aligned_empty(nbytes).fill_(1)
    start = time.perf_counter()
    files.write(".calibration", buf, nbytes)
    fd = os.open(files.path(".calibration"), os.O_RDONLY)
    try:
        os.fsync(fd)  # count the time to reach the disk, not only the page cache
    finally:
        os.close(fd)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    files.read(".calibration", buf, nbytes)
    read_s = time.perf_counter() - start
    files.path(".calibration").unlink()
    return nbytes / read_s, nbytes / write_s


# --------------------------------------------------------------------------- records
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


def state_names(optimizer: str) -> tuple[str, ...]:
    return {"AdamW": ("exp_avg", "exp_avg_sq"), "Adam": ("exp_avg", "exp_avg_sq"), "SGD": (), "SGD+momentum": ("momentum_buffer",)}[optimizer]


class BackgroundIO(abc.ABC):
    """A store whose transfers run on a thread pool (``self._io``, None once closed)."""

    _io: Any

    @abc.abstractmethod
    def drain(self) -> None:
        """Wait for every transfer in flight; raise the first failure."""

    files: NvmeFiles | None

    def close(self) -> None:
        """Finish every transfer, stop the I/O threads and delete the NVMe files: the state they
        held is gone after this (save a checkpoint first to keep it)."""
        if self._io is not None:
            try:
                self.drain()
            finally:
                self._io.shutdown(wait=True)
                self._io = None
                if self.files is not None:
                    self.files.remove()


class OffloadStore(BackgroundIO):
    """The records of one rank, on the tiers the plan chose, and the window of host buffers
    that NVMe records pass through (NOTE [NVMe I/O])."""

    def __init__(
        self, plan: OffloadPlan, options: OffloadOptions, owned_numels: Mapping[str, int], *,
        optimizer: str, mixed_precision: bool, device: torch.device, rank: int,
    ) -> None:
        self.plan, self.options, self.device = plan, options, device
        self.optimizer_kind, self.mixed_precision = optimizer, mixed_precision
        names = (("master",) if mixed_precision else ()) + state_names(optimizer)
        self._pin = options.pin_memory and device.type == "cuda"
        self.records: dict[str, Record] = {}
        for fqn in plan.update_order:
            tier = plan.tier_of(fqn)
            rec = Record(fqn, tier, names, owned_numels[fqn], None, torch.tensor(0.0, dtype=torch.float32))
            if tier is not Tier.NVME:
                where = device if tier is Tier.DEVICE else torch.device("cpu")
                rec.flat = torch.zeros(rec.numel * len(names), dtype=torch.float32, device=where, pin_memory=self._pin and tier is Tier.CPU)
            self.records[fqn] = rec
        nvme = [r for r in self.records.values() if r.tier is Tier.NVME]
        self.files = NvmeFiles(options.nvme_path, rank) if nvme and options.nvme_path is not None else None
        self._buffer_bytes = max((r.nbytes for r in nvme), default=0)
        self._free: list[torch.Tensor] = [
            aligned_empty(self._buffer_bytes, pin_memory=self._pin) for _ in range(options.buffer_count if nvme else 0)
        ]
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="zerofx-offload-io") if nvme else None
        self._reads: dict[str, tuple[Future, torch.Tensor]] = {}
        self._writes: deque[tuple[Future, torch.Tensor]] = deque()
        self._last_write: dict[str, Future] = {}  # a record's newest write-back, which its next read must follow
        self._nvme_order = [r.fqn for r in nvme]
        self._next_read = 0

    # ------------------------------------------------------------- initial values, state access
    def init_record(self, fqn: str, master: torch.Tensor | None) -> None:
        """Write ``fqn``'s first record: its fp32 master (mixed precision) and zero states."""
        rec = self.records[fqn]
        if rec.tier is not Tier.NVME:
            if master is not None:
                rec.views(rec.flat)["master"].copy_(master)
            return
        buf = self._take_buffer()
        flat = self._as_fp32(buf, rec)
        flat.zero_()
        if master is not None:
            rec.views(flat)["master"].copy_(master)
        try:
            self.files.write(fqn, buf, rec.nbytes)
        finally:
            self._free.append(buf)

    def read_segments(self, fqn: str) -> dict[str, torch.Tensor]:
        """A copy of ``fqn``'s record segments (for checkpoints), on the host."""
        self.drain()
        rec = self.records[fqn]
        if rec.tier is not Tier.NVME:
            return {k: v.detach().to("cpu", copy=True) for k, v in rec.views(rec.flat).items()}
        buf = self._take_buffer()
        try:
            self.files.read(fqn, buf, rec.nbytes)
            return {k: v.clone() for k, v in rec.views(self._as_fp32(buf, rec)).items()}
        finally:
            self._free.append(buf)

    def write_segments(self, fqn: str, values: Mapping[str, torch.Tensor]) -> None:
        """Overwrite some of ``fqn``'s segments (checkpoint loading); the others are kept."""
        self.drain()
        rec = self.records[fqn]
        if rec.tier is not Tier.NVME:
            views = rec.views(rec.flat)
            for k, v in values.items():
                views[k].copy_(v)
            return
        buf = self._take_buffer()
        try:
            self.files.read(fqn, buf, rec.nbytes)
            views = rec.views(self._as_fp32(buf, rec))
            for k, v in values.items():
                views[k].copy_(v)
            self.files.write(fqn, buf, rec.nbytes)
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
        """Issue reads of the next NVMe records in update order, up to ``count`` (default: the
        whole window) ahead, into the buffers free now (with ``block``, waiting for write-backs)."""
        if self._io is None:
            return
        ahead = self.options.buffer_count if count is None else count
        while self._next_read < len(self._nvme_order) and len(self._reads) < ahead:
            buf = self._take_buffer(block=block)
            if buf is None:
                return  # the next acquire issues it, once a write-back frees a buffer
            fqn = self._nvme_order[self._next_read]
            self._reads[fqn] = (self._io.submit(self._read_after_write, fqn, buf), buf)
            self._next_read += 1

    def _read_after_write(self, fqn: str, buf: torch.Tensor) -> None:
        """On an I/O thread: read ``fqn`` once its previous step's write-back has ended. That
        write was submitted first, so it is running or done: waiting on it cannot deadlock."""
        previous = self._last_write.get(fqn)
        if previous is not None:
            previous.result()
        self.files.read(fqn, buf, self.records[fqn].nbytes)

    def acquire(self, fqn: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The record's fp32 flat, in memory; and the host buffer holding it (NVMe only)."""
        rec = self.records[fqn]
        if rec.tier is not Tier.NVME:
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
        """Write an NVMe record back, behind the next updates; with ``after``, once that event
        (a copy to the device that reads the buffer) has passed, so the buffer outlives it."""
        if buf is not None:
            future = self._io.submit(self._write_after, fqn, buf, after)
            self._last_write[fqn] = future
            self._writes.append((future, buf))

    def _write_after(self, fqn: str, buf: torch.Tensor, after: torch.cuda.Event | None) -> None:
        if after is not None:
            after.synchronize()
        self.files.write(fqn, buf, self.records[fqn].nbytes)

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
        """Bytes of optimizer state the NVMe tier holds (the record files' sizes)."""
        return self.files.stored_bytes(self._nvme_order) if self.files is not None else 0

    def window_bytes(self) -> int:
        """Host memory of the NVMe window: ``buffer_count`` buffers of the largest record."""
        return self._buffer_bytes * (self.options.buffer_count if self._nvme_order else 0)

    def io_bytes(self) -> tuple[int, int]:
        """(read, written) bytes to NVMe so far."""
        return (self.files.bytes_read, self.files.bytes_written) if self.files is not None else (0, 0)


# --------------------------------------------------------------------------- host copies
class HostCopies:
    """NOTE [Host copies on a side stream]
    On CUDA, the records stepped on the host need each gradient (and, in fp32 training where the
    record holds no master, the parameter) on the host, and send the new parameter back. These
    copies run on a side stream (``torch.cuda.Stream``, public API), not on the compute stream:
    - every device-to-host copy of the step is issued at once, in update order, into one pinned
      staging flat kept between steps (4 bytes per host-stepped element, 8 in fp32 without
      master), behind an event recorded on the compute stream when the step began; each copy
      records its own event, and the host waits for that one event only, right before it steps
      the record. So record k+1's gradient arrives while the CPU steps record k;
    - each new parameter goes back as soon as its record is stepped, on the same stream, so the
      copy runs while the CPU steps the next record. Its source stays valid: a record's own
      master until the next step (ordered behind this copy on the stream), an NVMe window buffer
      until its write-back, which waits for the copy's event first (``OffloadStore.release``),
      the staging flat until the next step's copies into it (same stream);
    - the gradients read on the side stream are ``record_stream``-ed to it, so the caching
      allocator does not hand their memory to the compute stream before the copies read them;
    - the compute stream waits for the last copy's event (``stream.wait_event``), without
      blocking the host: right after the step, or with the delayed update when ``finish()``
      applies it, so the next forward reads the new parameters. The delayed update's thread
      never synchronizes the compute stream, so the forward running meanwhile is not stalled.
    Off CUDA (or when nothing crosses devices) there is nothing to copy and this is unused."""

    def __init__(self, device: torch.device) -> None:
        assert device.type == "cuda", device
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._staging: torch.Tensor | None = None

    def staging_bytes(self) -> int:
        return self._staging.untyped_storage().nbytes() if self._staging is not None else 0

    def to_host(self, begin: torch.cuda.Event, tensors: list[tuple[str, torch.Tensor, torch.Tensor | None]],
                pin: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event]]:
        """Issue the device-to-host copies of ``(fqn, grad, device parameter or None)``: fqn -> (host grad,
        host parameter or None, event after both)."""
        need = sum(g.numel() * (2 if param is not None else 1) for _, g, param in tensors)
        if self._staging is None or self._staging.numel() < need:
            self._staging = torch.empty(need, dtype=torch.float32, pin_memory=pin)
        out: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event]] = {}
        at = 0
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(begin)
            for fqn, grad, param in tensors:
                grad.record_stream(self.stream)
                host_grad = self._staging[at : at + grad.numel()].view(grad.shape)
                at += grad.numel()
                host_grad.copy_(grad, non_blocking=True)
                host_param = None
                if param is not None:
                    param.record_stream(self.stream)
                    host_param = self._staging[at : at + param.numel()].view(param.shape)
                    at += param.numel()
                    host_param.copy_(param, non_blocking=True)
                out[fqn] = (host_grad, host_param, self.stream.record_event())
        return out

    def to_device(self, target: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event:
        """Copy ``source`` (host) into ``target`` (device) on the side stream; its event."""
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            return self.stream.record_event()


# --------------------------------------------------------------------------- the optimizer
class _TieredState(Mapping):
    """``optimizer.state`` keyed by parameter, as torch's is; values are read from the tiers."""

    def __init__(self, opt: OffloadedOptimizer) -> None:
        self._opt = opt

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        fqn = self._opt.fqn_of[id(param)]
        return self._opt.record_state(fqn)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._opt.params_by_fqn.values())

    def __len__(self) -> int:
        return len(self._opt.params_by_fqn)


class OffloadedOptimizer(torch.optim.Optimizer):
    """AdamW, Adam or SGD over the engine's parameter shards, with their state in an
    ``OffloadStore``. Each record's update calls torch's own functional optimizer
    (``torch.optim.adamw.adamw`` and its siblings, public in their modules' ``__all__``) on whole tensors, so it matches the torch class
    bit for bit. ``step(grads=...)`` takes the fp32 gradients by FQN."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], store: OffloadStore, optimizer_type: str, hyper: Mapping[str, Any],
        param_store: ParamStore | None = None,
    ) -> None:
        kw = dict(hyper)
        if "betas" in kw:
            kw["betas"] = tuple(kw["betas"])
        cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}[optimizer_type]
        # torch's defaults for every hyperparameter the config leaves out, from the class itself.
        defaults = cls([torch.zeros(1)], **kw).defaults
        super().__init__(list(params.values()), defaults)
        self.state = _TieredState(self)  # type: ignore[assignment]
        self.optimizer_type, self.store = optimizer_type, store
        self.params_by_fqn = dict(params)
        self.fqn_of = {id(t): f for f, t in params.items()}
        self.delayed = store.options.delayed_update
        # NOTE [Stepping offloaded shards]
        # With offload_param, ``params`` holds shape-only handles for the offloaded shards (no
        # storage); each update takes the shard from the parameter store in host memory, right
        # next to its record, and hands it back to be written. One shard and one record are in
        # memory per update (plus the reads ahead). In fp32 the record holds no master: the shard
        # itself is what the optimizer steps, so the weights are stored once, in the shard's file.
        self.param_store = param_store
        if param_store is not None and self.delayed:
            raise ConfigError("zerofx.offload.delayed_update is not supported with offload_param (the staging copy would hold every shard)")
        self._staged: dict[str, torch.Tensor] = {}
        self._pending: Future | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zerofx-offload-step") if self.delayed else None
        on_host = any(r.tier is not Tier.DEVICE for r in store.records.values())
        self._copies = HostCopies(store.device) if store.device.type == "cuda" and on_host else None
        self._compute_stream: Any = None  # the stream the step was called on (CUDA only)

    # ------------------------------------------------------------- stepping
    @torch.no_grad()
    def step(self, closure: Any = None, *, grads: Mapping[str, torch.Tensor] | None = None) -> None:  # type: ignore[override]
        """Update every record with ``grads`` (fp32, this rank's owned elements). With the
        delayed update the work goes to a background thread; ``finish()`` applies it."""
        if closure is not None or grads is None:
            raise ZeroFXError("OffloadedOptimizer.step takes grads={fqn: gradient}; the engine calls it, closures are not supported")
        # The hyperparameters as they are now: a schedule may change them before a delayed update ends.
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        if not self.delayed:
            self._after_copies(self._run(grads, self.params_by_fqn, hyper, self._begin()))
            return
        assert self._pending is None, "finish() the previous delayed update first"
        snapshot = {f: g.detach().clone() for f, g in grads.items()}  # the next backward reuses the buffers
        if not self._staged:
            self._staged = {f: torch.empty_like(t) for f, t in self.params_by_fqn.items()}
        for f, t in self.params_by_fqn.items():
            self._staged[f].copy_(t)
        self._pending = self._worker.submit(self._run, snapshot, self._staged, hyper, self._begin())

    def _begin(self) -> torch.cuda.Event | None:
        """CUDA: an event on the compute stream after the work that produced the gradients (the
        side stream's copies start behind it; NOTE [Host copies on a side stream])."""
        if self._copies is None:
            return None
        self._compute_stream = torch.cuda.current_stream(self.store.device)
        return self._compute_stream.record_event()

    def _after_copies(self, end: torch.cuda.Event | None) -> None:
        """The compute stream waits for the step's last copy to the device (the host does not)."""
        if end is not None:
            self._compute_stream.wait_event(end)

    def finish(self) -> bool:
        """Delayed update: wait for the update in flight and copy its parameters into the shards.
        True when parameters changed (the engine then re-gathers them where it keeps them whole)."""
        if self._pending is None:
            return False
        future, self._pending = self._pending, None
        self._after_copies(future.result())
        for f, t in self.params_by_fqn.items():
            t.copy_(self._staged[f])
        return True

    def staging_bytes(self) -> int:
        """Bytes of the delayed update's staging copy of the shards (0 until the first step),
        plus on CUDA the pinned host copy of the gradients stepped on the host."""
        copies = self._copies.staging_bytes() if self._copies is not None else 0
        return copies + sum(t.untyped_storage().nbytes() for t in self._staged.values())

    def prefetch(self) -> None:
        """Start reading the first NVMe records (the engine calls it as the last backward starts)."""
        if self._pending is None:
            self.store.prefetch()

    def _run(self, grads: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor], hyper: Mapping[str, Any],
             begin: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """Step every record; on CUDA, the event after the last copy to the device (else None)."""
        store = self.store
        shards = self.param_store
        end = None
        try:
            host_side: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event]] = {}
            if self._copies is not None:
                wanted = []
                for fqn in store.plan.update_order:
                    rec = store.records[fqn]
                    if rec.tier is Tier.DEVICE:
                        continue
                    offloaded = shards is not None and fqn in shards  # then the shard is on the host already
                    wanted.append((fqn, grads[fqn], None if "master" in rec.names or offloaded else targets[fqn]))
                host_side = self._copies.to_host(begin, wanted, pin=store._pin)
                if wanted:
                    end = host_side[wanted[-1][0]][2]
            for fqn in store.plan.update_order:
                flat, buf = store.acquire(fqn)
                offloaded = shards is not None and fqn in shards
                target = shards.acquire(fqn) if offloaded else targets[fqn]
                try:
                    sent = self._update(store.records[fqn], flat, target, grads[fqn], hyper, host_side.get(fqn))
                except BaseException:
                    if buf is not None:
                        store._free.append(buf)
                    raise
                end = sent or end
                store.release(fqn, buf, after=sent)
                if offloaded:
                    shards.release(fqn, target)
            store.end_step()
        except BaseException:
            store.drain_quietly()
            raise
        return end

    def _update(self, rec: Record, flat: torch.Tensor, target: torch.Tensor, grad: torch.Tensor, group: Mapping[str, Any],
                host: tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event] | None) -> torch.cuda.Event | None:
        """One record's update, where the record lives (NOTE [Tiers on this machine and on an
        accelerator]); the new parameter ends in ``target`` (the shard, or its staging copy).
        ``host``: the gradient (and parameter) already copied on the side stream, and the event
        to wait for; then the new parameter goes back on it too, and its event is returned."""
        seg = rec.views(flat)
        where = flat.device
        store_master = "master" in seg
        # State off the accelerator: the gradient comes to the host, and in fp32 training (no
        # master in the record) so does the parameter, unless it is an offloaded shard, already
        # on the host.
        param_crosses = where != target.device
        cuda = next((d for d in (target.device, grad.device, where) if d.type == "cuda"), None)
        if host is not None:
            grad, host_param, ready = host
            ready.synchronize()  # this record's copies only; the later ones are still in flight
            param = seg["master"] if store_master else (host_param if host_param is not None else target)
        else:
            grad_crosses = where != grad.device
            if grad_crosses:
                grad = grad.to(where, non_blocking=True)
            if store_master:
                param = seg["master"]
            else:
                param = target.to(where, non_blocking=True) if param_crosses else target
            if (grad_crosses or param_crosses) and cuda is not None:
                torch.cuda.current_stream(cuda).synchronize()  # the non_blocking copies have landed
        if self.optimizer_type in ("AdamW", "Adam"):
            fn = adamw_update if self.optimizer_type == "AdamW" else adam_update
            beta1, beta2 = group["betas"]
            fn(
                [param], [grad], [seg["exp_avg"]], [seg["exp_avg_sq"]], [], [rec.step],
                foreach=group["foreach"], capturable=group["capturable"], differentiable=False, fused=group["fused"],
                amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=group["maximize"],
            )
        else:
            buffers: list[torch.Tensor | None] = [seg["momentum_buffer"] if rec.initialized else None] if "momentum_buffer" in seg else [None]
            sgd_update(
                [param], [grad], buffers, foreach=group["foreach"], fused=group["fused"],
                weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
            )
            if "momentum_buffer" in seg and not rec.initialized:
                seg["momentum_buffer"].copy_(buffers[0])  # torch made it from the first gradient
                rec.initialized = True
        if store_master or param is not target:
            if host is not None and target.device.type == "cuda":
                assert self._copies is not None
                return self._copies.to_device(target, param)
            target.copy_(param, non_blocking=param_crosses)
            if param_crosses and cuda is not None:
                torch.cuda.current_stream(cuda).synchronize()  # the host buffer is reused (or written to NVMe) next
        return None

    # ------------------------------------------------------------- state access (checkpoints)
    def record_state(self, fqn: str) -> dict[str, Any]:
        """The optimizer state of ``fqn`` as torch keeps it: tensors shaped like the parameter
        shard, plus Adam's ``step``. Read from its tier (a copy)."""
        rec = self.store.records[fqn]
        out: dict[str, Any] = {}
        if self.optimizer_type in ("AdamW", "Adam"):
            out["step"] = rec.step.detach().clone()
        if rec.names == ("master",) or not (set(rec.names) - {"master"}):
            return out
        if self.optimizer_type.startswith("SGD") and not rec.initialized:
            return out
        segs = self.store.read_segments(fqn)
        out.update({k: v for k, v in segs.items() if k != "master"})
        return out

    def master_tensors(self) -> dict[str, torch.Tensor]:
        """FQN -> a host copy of its fp32 master (mixed precision only)."""
        if not self.store.mixed_precision:
            return {}
        return {f: self.store.read_segments(f)["master"] for f in self.store.records}

    def load_master(self, fqn: str, value: torch.Tensor) -> None:
        self.store.write_segments(fqn, {"master": value.to(torch.float32)})

    def state_dict(self) -> dict[str, Any]:
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": {index[id(p)]: self.record_state(f) for f, p in self.params_by_fqn.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore states into the tiers; the hyperparameters in ``param_groups`` are taken too."""
        self.finish()
        order = [self.fqn_of[id(p)] for g in self.param_groups for p in g["params"]]
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for index, entry in state_dict["state"].items():
            fqn = order[int(index)]
            rec = self.store.records[fqn]
            if "step" in entry:
                rec.step = torch.as_tensor(entry["step"], dtype=torch.float32).detach().clone().cpu()
            tensors = {k: v for k, v in entry.items() if k in rec.names and k != "master"}
            if tensors:
                self.store.write_segments(fqn, tensors)
                rec.initialized = True

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.store.close()
        if self.param_store is not None:
            self.param_store.close()
