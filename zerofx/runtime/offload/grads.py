"""Gradient offload at run time (stages 2-3, ``zerofx.offload_gradients``): ``GradStore``, this
rank's reduced gradient shards in host memory or in files on NVMe, kept by one tier backend per
generation (``zerofx.runtime.offload.tiers``), and
``OffloadedGrads``, the read-only mapping through which the step (clipping, the norm, the fp16
overflow check) and the optimizer read them there. See NOTE [Offloaded gradients].
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zerofx.runtime.offload.files import IO_THREADS, NvmeFiles
from zerofx.runtime.offload.tiers import BackgroundIO, TierBackend, TierRequest, open_tier
from zerofx.config.offload_options import GradOffloadOptions

# NOTE [Offloaded gradients]
# With ``zerofx.offload_gradients`` the engine keeps no gradient buffer (``engine.storage.grads`` stays
# empty, ``memory()["grads"]`` is 0). Each reduced gradient shard goes to ``GradStore.add`` from
# inside the backward graph, as soon as its bucket's reduction is waited for: the graph's
# ``zerofx::offload_grad`` op hands it over and the graph returns None for it (NOTE [Gradients
# leave at their bucket's wait] in passes/memory/offload_grads.py), so the device holds a bounded
# number of reduced buckets, not the whole gradient at the end of the backward. ``add`` puts it
# into a host tensor (pinned on CUDA with ``pin_memory``), or copies it to the host and writes
# it to its file ``<nvme_path>/rank-<r>/<fqn>.grad`` on an I/O thread (NOTE [NVMe I/O]: aligned
# whole-file transfers, ``OffloadError`` naming file and operation; NOTE [Gradient files carry
# their version]: a file that a failed write left torn or stale is an error, not a gradient).
# Either way nothing of the graph's tensor is kept after ``add`` returns, so the graph may free
# or reuse it at once. A shard the graph does return (a program lowered without the hand-off)
# is added the same way when the graph returns.
#
# Accumulation: the first micro-step of an accumulation writes zeros + g, the later ones read the
# stored value, add g and write it back (read-add-write), in the gradient's own dtype. That is the
# same sequence of additions, in the same dtype, as the engine's persistent buffers (zeroed, then
# ``add_`` per micro-step), so the result is bit for bit the same. An NVMe file's next
# accumulation waits for its previous write (submitted first, so the wait cannot deadlock); at
# most ``buffer_count`` accumulations are in flight, each holding two shards of host memory (the
# copy of the graph's shard and the aligned buffer it is added into).
#
# Reading: at the boundary the engine hands the step an ``OffloadedGrads`` view, which yields
# each gradient in the optimizer's update order, transformed as ``optimizer_grads`` transforms the
# device buffers (to fp32, times 1 / loss scale, times the clipping factor), so the optimizer sees
# the same numbers. NVMe gradients are read ahead along that order, at most ``buffer_count`` at a
# time, each into a fresh aligned buffer that the update drops. Clipping, the gradient norm
# (monitors) and the fp16 overflow check read every gradient once more before the update: on NVMe
# that is one more read of every gradient file per step.
#
# The one-step delayed update reads step t's gradients on its thread while step t+1's backward
# accumulates: the store then keeps two generations (two host tensors, or ``.grad`` and
# ``.grad1`` files per shard) and ``end_step`` switches the generation that ``add`` writes. The
# view is bound to its generation, so no snapshot copy of the gradients is made.


class GradStore(BackgroundIO):
    """This rank's reduced gradient shards on the host or on NVMe (NOTE [Offloaded gradients])."""

    def __init__(
        self, options: GradOffloadOptions, numels: Mapping[str, int], dtypes: Mapping[str, torch.dtype], *,
        order: list[str], generations: int, device: torch.device, rank: int,
    ) -> None:
        assert generations in (1, 2), generations
        self.options, self.device = options, device
        self.numels, self.dtypes = dict(numels), dict(dtypes)
        self.order = [f for f in order if f in self.numels]  # the update order: reads ahead follow it
        self.tier = options.device
        self._generations = generations
        self.gen = 0  # the generation ``add`` writes
        self._filled: list[set[str]] = [set() for _ in range(generations)]  # shards holding a value this accumulation
        self.host: list[dict[str, torch.Tensor]] = [{} for _ in range(generations)]  # allocated by the first add
        # One backend per generation: a streamed tier's ``.grad`` and ``.grad1`` files.
        self.backends: list[TierBackend] = [
            open_tier(self.tier, TierRequest(device, options.pin_memory, options.nvme_path, rank,
                                             suffix=".grad" if g == 0 else f".grad{g}", what="gradient shard", versioned=True))
            for g in range(generations)
        ]
        self.in_place = self.backends[0].in_place
        # Closed last generation first: the rank folder goes once every generation's files are gone.
        self.streamed = [] if self.in_place else self.backends[::-1]
        self.files: NvmeFiles | None = None if self.in_place else self.backends[0]  # for inspection: generation 0's files
        self._io = None if self.in_place else ThreadPoolExecutor(IO_THREADS, thread_name_prefix="zerofx-grad-io")
        self._lock = threading.Lock()
        self._last_write: dict[tuple[int, str], Future] = {}  # a file's newest accumulation, which its next use must follow
        self._versions: dict[tuple[int, str], int] = {}  # a file's writes so far (NOTE [Gradient files carry their version])
        self._writes: deque[Future] = deque()  # accumulations in flight, at most buffer_count

    def __contains__(self, fqn: object) -> bool:
        return fqn in self.numels

    def nbytes(self, fqn: str) -> int:
        return self.numels[fqn] * self.dtypes[fqn].itemsize

    # ------------------------------------------------------------- writing
    def add(self, fqn: str, grad: torch.Tensor) -> None:
        """Accumulate the backward's reduced gradient shard of ``fqn`` (NOTE [Offloaded gradients])."""
        gen = self.gen
        first = fqn not in self._filled[gen]
        self._filled[gen].add(fqn)
        if self.in_place:
            if grad.device.type != "cpu":
                grad = grad.to("cpu")  # host memory is where the value lives from here on
            buf = self.host[gen].get(fqn)
            if buf is None:
                buf = self.host[gen][fqn] = self.backends[gen].allocate(fqn, self.nbytes(fqn)).view(self.dtypes[fqn])
            if first:
                buf.zero_()
            buf.add_(grad)
            return
        assert self._io is not None
        # The I/O thread reads the shard after this returns: it gets a host copy of its own, as
        # the graph may reuse the shard's memory right after the hand-off (NOTE [Offloaded gradients]).
        grad = grad.detach().to("cpu", copy=True)
        with self._lock:
            previous = self._last_write.get((gen, fqn))
            version = self._versions[(gen, fqn)] = self._versions.get((gen, fqn), 0) + 1
            future = self._io.submit(self._accumulate, gen, fqn, grad, first, previous, version)
            self._last_write[(gen, fqn)] = future
        self._writes.append(future)
        while len(self._writes) > self.options.buffer_count:  # each holds a shard of host memory
            self._writes.popleft().result()

    def _accumulate(self, gen: int, fqn: str, grad: torch.Tensor, first: bool, previous: Future | None, version: int) -> None:
        """On an I/O thread: zeros + ``grad`` (first micro-step) or stored + ``grad``, written back
        as write ``version`` of the file (the stored value is write ``version - 1``)."""
        if previous is not None:
            previous.result()
        backend = self.backends[gen]
        nbytes = self.nbytes(fqn)
        raw = backend.allocate(fqn, nbytes)
        buf = raw.view(self.dtypes[fqn])
        if first:
            buf.zero_()
        else:
            backend.read(fqn, raw, nbytes, version=version - 1)
        buf.add_(grad)
        backend.write(fqn, raw, nbytes, version=version)

    def end_step(self) -> None:
        """The step has read this accumulation: the next ``add`` starts a new one, in the other
        generation when the delayed update may still be reading this one."""
        self.gen = (self.gen + 1) % self._generations
        self._filled[self.gen].clear()

    # ------------------------------------------------------------- reading
    def view(self, *, to_fp32: bool, inv_scale: float) -> OffloadedGrads:
        """The gradients of this accumulation as the optimizer takes them."""
        return OffloadedGrads(self, self.gen, to_fp32=to_fp32, inv_scale=inv_scale)

    def _read(self, gen: int, fqn: str) -> torch.Tensor:
        """``fqn``'s stored gradient of generation ``gen`` (zeros when no backward produced one)."""
        if fqn not in self._filled[gen]:
            return torch.zeros(self.numels[fqn], dtype=self.dtypes[fqn])
        if self.in_place:
            return self.host[gen][fqn]
        with self._lock:
            previous = self._last_write.get((gen, fqn))
            version = self._versions[(gen, fqn)]
        if previous is not None:
            previous.result()  # raises the accumulation's own OffloadError
        nbytes = self.nbytes(fqn)
        raw = self.backends[gen].allocate(fqn, nbytes)
        self.backends[gen].read(fqn, raw, nbytes, version=version)
        return raw.view(self.dtypes[fqn])

    # ------------------------------------------------------------- lifecycle and accounting
    def drain(self) -> None:
        """Wait for every accumulation in flight; raise the first failure."""
        first: BaseException | None = None
        with self._lock:
            pending = list(self._last_write.values())
            self._last_write.clear()
        for future in pending:
            try:
                future.result()
            except BaseException as exc:  # keep draining, then raise the first failure
                first = first or exc
        self._writes.clear()
        if first is not None:
            raise first

    def cpu_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for gen in self.host for t in gen.values())

    def nvme_bytes(self) -> int:
        return sum(backend.stored_bytes(list(self.numels)) for backend in self.streamed)

    def window_bytes(self) -> int:
        """Host memory of the streamed (NVMe) path at most: ``buffer_count`` reads ahead, one shard
        of the largest gradient each, and as many accumulations in flight, two shards each (the
        copy of the graph's shard and the buffer it is added into)."""
        if self.in_place:
            return 0
        return 3 * self.options.buffer_count * max((self.nbytes(f) for f in self.numels), default=0)

    def io_bytes(self) -> tuple[int, int]:
        """(read, written) bytes of gradient files so far."""
        moved = [backend.io_bytes() for backend in self.streamed]
        return sum(r for r, _ in moved), sum(w for _, w in moved)


class OffloadedGrads(Mapping):
    """One accumulation's gradients, read from a ``GradStore`` as the optimizer takes them: fp32
    times ``inv_scale`` in mixed precision, times the clipping factor once ``scale_`` is called
    (NOTE [Offloaded gradients]). Iterates in the update order; NVMe gradients are read ahead."""

    def __init__(self, store: GradStore, gen: int, *, to_fp32: bool, inv_scale: float) -> None:
        self.store, self.gen = store, gen
        self.to_fp32, self.inv_scale = to_fp32, inv_scale
        self.coef: float | None = None
        self._index = {f: i for i, f in enumerate(store.order)}
        self._reads: dict[str, Future] = {}

    def scale_(self, coef: float) -> None:
        """Gradient clipping: every gradient read from now on is multiplied by ``coef``, as the
        engine multiplies its gradient buffers in place."""
        self.coef = coef

    def __iter__(self) -> Iterator[str]:
        return iter(self.store.order)

    def __len__(self) -> int:
        return len(self.store.order)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._index

    def __getitem__(self, fqn: str) -> torch.Tensor:
        store = self.store
        if fqn not in self._index:
            raise KeyError(fqn)
        if store._io is None:
            stored = store._read(self.gen, fqn)
        else:
            future = self._reads.pop(fqn, None)
            if future is None:
                future = store._io.submit(store._read, self.gen, fqn)
            order = store.order
            for nxt in order[self._index[fqn] + 1:]:
                if len(self._reads) >= store.options.buffer_count:
                    break
                if nxt not in self._reads:
                    self._reads[nxt] = store._io.submit(store._read, self.gen, nxt)
            stored = future.result()
        # The same operations, in the same order, as EngineStorage.optimizer_grads and the
        # engine's clipping apply to the device buffers.
        out = stored.to(torch.float32, copy=True).mul_(self.inv_scale) if self.to_fp32 else stored
        if self.coef is not None:
            out = out.mul_(self.coef) if out is not stored else out.mul(self.coef)
        return out  # on the host: the optimizer moves it where the record is (NOTE [Tiers on this machine and on an accelerator])
