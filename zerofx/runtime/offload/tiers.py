"""The offload tiers as the stores see them: ``TierBackend``, the one interface through which the
optimizer-state, parameter and gradient stores (``store``, ``params``, ``grads``) keep their
records; ``open_tier``, which opens the backend registered for a ``Tier``; and ``BackgroundIO``,
the drain-and-close lifecycle the three stores share over their I/O threads. Two
implementations: ``MemoryTier`` here (the device's memory, or host memory, pinned on CUDA with
``pin_memory``) and ``NvmeFiles`` (``zerofx.runtime.offload.files``: one file per record,
aligned host buffers, ``O_DIRECT``).

NOTE [Tier backends]
A store never asks which tier a record is on; it asks the record's backend whether it holds the
record in place (``in_place``), and moves every record through the backend's methods:

- ``allocate(key, nbytes)``: in place, the record itself, zeroed, kept by the backend, which
  the store reads and updates where it is. Otherwise a host buffer (uint8) that ``read`` fills
  and whose bytes ``write`` stores: the fastest buffer the backend moves (NVMe: on a
  ``DIRECT_ALIGN`` boundary, NOTE [NVMe I/O]; pinned on CUDA with ``pin_memory``). A store may
  reuse one buffer for several records (the optimizer-state window allocates one for its
  largest record and moves each in turn through it).
- ``write(key, buf, nbytes)`` stores ``buf[:nbytes]`` whole and returns once a later ``read``
  from any thread sees it: the stores wait on their own futures (``drain``), never on the
  backend, so a backend that buffers writes must finish them before returning.
  ``read(key, buf, nbytes)`` fills ``buf[:nbytes]`` with the stored record. Both take any host
  uint8 buffer of at least ``nbytes`` bytes, and are called from several I/O threads at once,
  for different keys.
- ``version`` is the write count of a versioned store's record (NOTE [Gradient files carry
  their version]): only such a store passes one, and a backend whose writes cannot stop part way
  (memory) has nothing to check it against. A read of another version is an error.
- Every failed transfer is an ``OffloadError`` naming the record, the place it is stored (the
  file) and the operation.
- ``stored_bytes`` and ``io_bytes`` are the accounting ``engine.memory()`` reports; ``close``
  releases what the backend holds (NVMe: deletes the store's files).

The backend owns the layout and the transfer (alignment, whole-record blocks, ``O_DIRECT``, the
version trailer, the fault messages). The store owns the order and the bounds: its I/O threads,
a read waiting for the record's last write-back, and its bounded window of host buffers
(``buffer_count``: the module docstring of ``store``, NOTE [The parameter store], NOTE
[Offloaded gradients]), so every backend runs under the same bounds.

A new tier (say, a remote store) touches:

- ``cost_models/tiers.py``: a ``Tier`` member; the config's ``device`` keys, the CLI's
  ``--offload`` flags and the cost models' placement table accept it at once (``OFFLOAD_TIERS``
  and ``PLACEMENT_CHOICES``, from which they derive their spellings and messages);
- ``zerofx/config/offload_options.py``: its budget and bandwidths in the ``tier_specs``;
- ``passes/memory/plan_offload.py``: its place in ``_FASTEST_FIRST``;
- a new module here implementing ``TierBackend``, and its opener in ``_OPENERS`` below.

The stores stay as they are.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from zerofx.cost_models.tiers import Tier
from zerofx.runtime.offload.files import NvmeFiles, OffloadError


class TierBackend(Protocol):
    """Where one store keeps the records of one tier (NOTE [Tier backends])."""

    in_place: bool  # allocate() returns the record itself, updated where it is

    def allocate(self, key: str, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes (uint8) for ``key``'s record: the record itself (zeroed) in place, else a
        host buffer for ``read`` and ``write``."""
        ...

    def write(self, key: str, buf: torch.Tensor, nbytes: int, *, version: int | None = None) -> None:
        """Store ``buf[:nbytes]`` (uint8, host) as ``key``'s record."""
        ...

    def read(self, key: str, buf: torch.Tensor, nbytes: int, *, version: int | None = None) -> None:
        """Fill ``buf[:nbytes]`` (uint8, host) with ``key``'s stored record."""
        ...

    def stored_bytes(self, keys: list[str]) -> int:
        """Bytes the tier holds now for the records of ``keys``."""
        ...

    def io_bytes(self) -> tuple[int, int]:
        """(read, written) bytes moved by ``read`` and ``write`` so far."""
        ...

    def close(self) -> None:
        """Release what the tier holds for this store; its records are gone after this."""
        ...


class MemoryTier:
    """Records as tensors in the memory of ``device`` (host memory: pinned with ``pin_memory``),
    held in place (NOTE [Tier backends])."""

    in_place = True

    def __init__(self, device: torch.device, *, pin_memory: bool = False) -> None:
        self.device = device
        self.pin_memory = pin_memory and device.type == "cpu"
        self.records: dict[str, torch.Tensor] = {}
        self.bytes_read = 0
        self.bytes_written = 0

    def allocate(self, key: str, nbytes: int) -> torch.Tensor:
        record = self.records[key] = torch.zeros(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory)
        return record

    def _record(self, key: str, nbytes: int, op: str) -> torch.Tensor:
        record = self.records.get(key)
        if record is None or record.numel() < nbytes:
            held = "no record" if record is None else f"a record of {record.numel()} bytes"
            raise OffloadError(f"{self.device} memory offload: {op} {nbytes} bytes of {key!r} failed: the tier holds {held}")
        return record[:nbytes]

    def write(self, key: str, buf: torch.Tensor, nbytes: int, *, version: int | None = None) -> None:
        self._record(key, nbytes, "writing").copy_(buf[:nbytes])
        self.bytes_written += nbytes

    def read(self, key: str, buf: torch.Tensor, nbytes: int, *, version: int | None = None) -> None:
        buf[:nbytes].copy_(self._record(key, nbytes, "reading"))
        self.bytes_read += nbytes

    def stored_bytes(self, keys: list[str]) -> int:
        return sum(self.records[k].untyped_storage().nbytes() for k in keys if k in self.records)

    def io_bytes(self) -> tuple[int, int]:
        return self.bytes_read, self.bytes_written

    def close(self) -> None:
        self.records.clear()


@dataclasses.dataclass(frozen=True)
class TierRequest:
    """What one store asks of a tier: the compute device, whether to pin host memory (on CUDA
    only), and how the store's files are named (``suffix``, ``what``; ``versioned``: NOTE
    [Gradient files carry their version])."""

    device: torch.device
    pin_memory: bool
    nvme_path: Path | None
    rank: int
    suffix: str = ".state"
    what: str = "optimizer state"
    versioned: bool = False


def _open_device(request: TierRequest) -> TierBackend:
    return MemoryTier(request.device)


def _open_host(request: TierRequest) -> TierBackend:
    return MemoryTier(torch.device("cpu"), pin_memory=request.pin_memory)


def _open_nvme(request: TierRequest) -> TierBackend:
    assert request.nvme_path is not None, "the options require nvme_path with device nvme"
    return NvmeFiles(request.nvme_path, request.rank, suffix=request.suffix, what=request.what, versioned=request.versioned,
                     pin_memory=request.pin_memory)


# One opener per tier: the registration a new tier adds (NOTE [Tier backends]).
_OPENERS: Mapping[Tier, Callable[[TierRequest], TierBackend]] = {Tier.DEVICE: _open_device, Tier.CPU: _open_host, Tier.NVME: _open_nvme}
assert set(_OPENERS) == set(Tier), f"tiers without a backend: {set(Tier) - set(_OPENERS)}"


def open_tier(tier: Tier, request: TierRequest) -> TierBackend:
    """The backend of ``tier`` for the store that makes ``request``."""
    return _OPENERS[tier](dataclasses.replace(request, pin_memory=request.pin_memory and request.device.type == "cuda"))


# --------------------------------------------------------------------------- the stores' I/O lifecycle
class BackgroundIO(abc.ABC):
    """A store whose transfers run on a thread pool (``self._io``, None once closed), to and from
    the backends in ``self.streamed``."""

    _io: Any
    streamed: list[TierBackend]  # the backends the I/O threads move records to, closed in this order

    @abc.abstractmethod
    def drain(self) -> None:
        """Wait for every transfer in flight; raise the first failure."""

    def close(self) -> None:
        """Finish every transfer, stop the I/O threads and close the streamed backends (deleting
        the NVMe files): the state they held is gone after this (save a checkpoint first to keep it)."""
        if self._io is not None:
            try:
                self.drain()
            finally:
                self._io.shutdown(wait=True)
                self._io = None
                for backend in self.streamed:
                    backend.close()
