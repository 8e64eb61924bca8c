"""The NVMe tier's files: one file per record or shard, moved whole with ``O_DIRECT`` where the
file system takes it, by a pool of I/O threads. Owns ``NvmeFiles``, the aligned host buffers
they move (``aligned_empty``), the drive calibration (``measure_nvme_bytes_per_s``),
and ``OffloadError``. ``NvmeFiles`` is the NVMe ``TierBackend`` (``zerofx.runtime.offload.tiers``).

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

NOTE [Gradient files carry their version]
A gradient file is rewritten every micro-step (read-add-write, NOTE [Offloaded gradients]) in
place, so a write that stops part way (a full disk, an I/O error, a killed process) leaves a
file of the right size holding part new and part old bytes, and one that fails before its first
byte leaves the previous value: either would read as a gradient. So each gradient file
(``NvmeFiles(versioned=True)``) ends, after the record, in a ``TRAILER_BYTES`` trailer (a magic
word, a random number naming the store that owns the files, the write's version and the record's
length), written through the page cache only once every byte of the record is written. The store
counts the writes of each file and reads it with the version it expects: a trailer that is
missing, short, or holds another version or length is an ``OffloadError`` naming the file (a
torn or stale file), never a gradient. The record itself moves as before (aligned ``O_DIRECT``
blocks, overwritten in place), so a write costs one more small ``pwrite`` and a read one more
small ``pread``; writing each record to a new file and renaming it over the old one would also
be atomic, but every write then allocates new blocks, which measured 3 to 9 times slower per
write on ext4 with ``O_DIRECT``. The optimizer-state and parameter files, written once per step
from a value still in memory, carry no trailer.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import struct
import threading
import time
from pathlib import Path
from urllib.parse import quote

import torch

from zerofx.common.errors import ZeroFXError

IO_BLOCK_BYTES = 8 << 20
IO_THREADS = 2
# O_DIRECT needs buffer addresses, file offsets and lengths in multiples of the device's logical
# block: 4 KiB covers 512-byte and 4 KiB drives.
DIRECT_ALIGN = 4096
# After the record in a versioned file: magic, the files' owner, version, record length (NOTE
# [Gradient files carry their version]).
_TRAILER = struct.Struct("<4s4xQQQ")
TRAILER_BYTES = _TRAILER.size
_MAGIC = b"ZFXG"


class OffloadError(ZeroFXError):
    """Offloaded state could not be stored or read back: names the path and what failed."""


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
    transfers in aligned blocks (NOTE [NVMe I/O]); counts the bytes moved. A ``TierBackend``
    (``zerofx.runtime.offload.tiers``, NOTE [Tier backends]) that holds no record in place: its
    host buffers come from ``allocate``, pinned with ``pin_memory``."""

    in_place = False

    def __init__(
        self, root: Path, rank: int, *, suffix: str = ".state", what: str = "optimizer state", versioned: bool = False,
        pin_memory: bool = False,
    ) -> None:
        self.suffix, self.what = suffix, what
        self.pin_memory = pin_memory
        self.versioned = versioned  # NOTE [Gradient files carry their version]
        self._owner = secrets.randbits(64)  # in every trailer: a file another store (or process) left never matches
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

    def allocate(self, key: str, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` for ``key``'s record, aligned for ``O_DIRECT``; the record
        itself stays in its file."""
        return aligned_empty(nbytes, pin_memory=self.pin_memory)

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

    def _move(self, fqn: str, buf: torch.Tensor, nbytes: int, *, write: bool, version: int | None) -> None:
        path = self.path(fqn)
        assert (version is not None) == self.versioned, f"{path}: a versioned file is moved with its version, another without"
        view = memoryview(buf.numpy())[:nbytes]
        direct = self._direct_bytes(buf, nbytes)
        try:
            if direct:
                self._transfer(path, view[:direct], 0, write=write, direct=True)
            if direct == 0 or direct < nbytes:  # the tail; an empty record still opens (creates, or must find) its file
                self._transfer(path, view[direct:], direct, write=write, direct=False)
            if version is not None:  # NOTE [Gradient files carry their version]: after every byte of the record
                self._trailer(fqn, path, nbytes, version, write=write)
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

    def _trailer(self, fqn: str, path: Path, nbytes: int, version: int, *, write: bool) -> None:
        """Write the trailer of ``version`` after the record, or read it and raise unless it is
        that version's (NOTE [Gradient files carry their version])."""
        if write:
            self._transfer(path, memoryview(_TRAILER.pack(_MAGIC, self._owner, version, nbytes)), nbytes, write=True, direct=False)
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            trailer = os.pread(fd, TRAILER_BYTES, nbytes)
        finally:
            os.close(fd)
        magic, owner, found, length = _TRAILER.unpack(trailer) if len(trailer) == TRAILER_BYTES else (b"", 0, 0, 0)
        if magic != _MAGIC or owner != self._owner or found != version or length != nbytes:
            got = ("no complete write" if magic != _MAGIC else "another run's write" if owner != self._owner else
                   f"write {found} of {length} bytes")
            raise OffloadError(
                f"NVMe offload: {str(path)!r} does not hold {fqn}'s {self.what}: its trailer records {got}, expected write "
                f"{version} of {nbytes} bytes (a write to it stopped part way, or the file was replaced); it is not read"
            )

    def write(self, fqn: str, buf: torch.Tensor, nbytes: int, *, version: int | None = None) -> None:
        """Write ``buf[:nbytes]`` (uint8, host) as the record of ``fqn``; a versioned file takes
        the number of this write (NOTE [Gradient files carry their version])."""
        self._move(fqn, buf, nbytes, write=True, version=version)

    def read(self, fqn: str, buf: torch.Tensor, nbytes: int, *, version: int | None = None) -> None:
        """Read the record of ``fqn`` into ``buf[:nbytes]``; a short read, or in a versioned file
        a trailer of another ``version``, is an error."""
        self._move(fqn, buf, nbytes, write=False, version=version)

    def stored_bytes(self, fqns: list[str]) -> int:
        """Bytes of the record files on disk now."""
        return sum(self.path(f).stat().st_size for f in fqns if self.path(f).exists())

    def io_bytes(self) -> tuple[int, int]:
        return self.bytes_read, self.bytes_written

    def close(self) -> None:
        """The ``TierBackend`` close: delete this tier's files (``remove``)."""
        self.remove()


def measure_nvme_bytes_per_s(nvme_path: Path, *, nbytes: int = 64 << 20, rank: int = 0) -> tuple[float, float]:
    """(read, write) bytes per second of whole-record transfers under ``nvme_path``, the way the
    runtime moves records: a calibration to put into ``zerofx.offload.nvme_*_bytes_per_s``.
    Measure once and give every rank the same numbers (plans must not differ across ranks).
    The buffer is aligned, so where the file system takes ``O_DIRECT`` the transfers bypass the
    page cache as the runtime's do (NOTE [NVMe I/O]); elsewhere the read may come from it."""
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
