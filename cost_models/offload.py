"""Offload cost: bytes per optimizer-state record and seconds of I/O per step, per tier.

Pure: a function of per-tensor sizes and a frozen ``TierSpec`` per tier. It is what
``plan_offload`` places tensors with and what ``zerofx plan`` prints as hidden and exposed I/O.

NOTE [What an offloaded record holds]
For each trainable parameter, the optimizer steps this rank's owned elements (the whole padded
flat at stage 0, the shard otherwise). Its *record* is what the non-offloaded optimizer would keep
for them, all fp32: the master copy in mixed precision, plus the optimizer's state tensors
(AdamW/Adam: exp_avg and exp_avg_sq; SGD with momentum: the momentum buffer). It is what
``estimate_model_state_bytes`` counts as ``optimizer_states`` less the scalar ``step``, which
stays in memory (4 bytes per tensor). In fp32 training the parameter itself stays on the device:
the optimizer reads and writes it in place, so it is not part of the record.

NOTE [The step's I/O timeline]
``estimate_offload_timeline`` replays what the runtime does (``zerofx.offload``): records on the
NVMe tier are read into one of ``buffer_count`` host buffers, updated, and written back; a
buffer is free again when its write-back ends. Reads and writes share the disk, first come first
served. The first ``buffer_count`` reads are issued when the backward pass of the boundary
micro-step starts (``prefetch_lead_s`` before the step), later ones as buffers free. Updates run
one at a time in the planned order, each when its record is in memory. The time the updates
wait for a read is *exposed*, and so is the part of the last write-backs that outlasts the next
forward and backward (``forward_backward_s``; the step does not wait for them, the next
prefetch does). The rest of the I/O is *hidden* behind the backward pass and the updates of
other records. With the one-step delayed update the whole optimizer step runs in the
background during the next forward and backward, so only what exceeds them is exposed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from zerofx.common.errors import PlanError
from zerofx.cost_models.memory import OPTIMIZERS
from zerofx.cost_models.tiers import Tier

FP32_BYTES = 4


@dataclass(frozen=True)
class TierSpec:
    """One tier: how many record bytes it may hold per rank, and how fast records move between
    it and the memory the update runs in (host memory). ``math.inf`` budget: unbounded; ``math.inf``
    bandwidth: no copy at all (the CPU tier when the device is the CPU)."""

    budget_bytes: float
    read_bytes_per_s: float
    write_bytes_per_s: float


@dataclass(frozen=True)
class OffloadItem:
    """One record in the timeline: its parameter, tier and size."""

    fqn: str
    tier: Tier
    record_bytes: int


@dataclass(frozen=True)
class OffloadTimeline:
    """The estimated step. Times in seconds from the start of the optimizer step; ``ready_s``
    and ``start_s`` per FQN say when each record is in memory and when its update starts."""

    ready_s: Mapping[str, float]
    start_s: Mapping[str, float]
    step_s: float
    update_s: float
    io_s: float
    exposed_io_s: float

    @property
    def hidden_io_s(self) -> float:
        return max(self.io_s - self.exposed_io_s, 0.0)


def record_numels(owned_numel: int, *, optimizer: str, mixed_precision: bool) -> tuple[int, ...]:
    """Element counts of a record's fp32 tensors, in file order (see NOTE [What an offloaded
    record holds]): (master,)? + one per optimizer state tensor."""

    if optimizer not in OPTIMIZERS:
        raise PlanError(f"optimizer={optimizer!r}; accepted: {', '.join(OPTIMIZERS)}")
    count = len(OPTIMIZERS[optimizer].state) + (1 if mixed_precision else 0)
    return (owned_numel,) * count


# NOTE [Host offload on a CPU rank]
# Offloading moves records and shards off the device: to host memory, or to NVMe through host
# buffers. On a CPU rank the device is host memory, so a record offloaded there stays in the
# rank's memory: the memory timeline's peak, which counts it in the model state, is what the
# rank holds, and only what goes to NVMe leaves. So the device figure of ``zerofx plan`` and the
# whole-job search take off only the NVMe bytes there, and the search offers no optimizer-state
# offload to host memory on a CPU profile (it frees nothing and only changes how the update runs).
def estimate_device_freed_bytes(host_bytes: float, nvme_bytes: float, *, memory_is_host: bool) -> float:
    """The bytes offloading takes off a rank's device memory: what goes to NVMe, and what goes to
    host memory unless the device's memory is host memory (NOTE [Host offload on a CPU rank])."""
    return nvme_bytes + (0.0 if memory_is_host else host_bytes)


def estimate_update_s(record_bytes: int, update_bytes_per_s: float) -> float:
    """One record's optimizer update: memory-bound, it reads and writes the record and the
    gradient once (about 2x the record's bytes)."""
    return 2 * record_bytes / update_bytes_per_s


def estimate_offload_timeline(
    items: Sequence[OffloadItem],
    tiers: Mapping[Tier, TierSpec],
    *,
    buffer_count: int,
    update_bytes_per_s: float,
    prefetch_lead_s: float = 0.0,
    delayed_update: bool = False,
    forward_backward_s: float = 0.0,
) -> OffloadTimeline:
    """Replay one optimizer step over ``items`` in update order; see NOTE [The step's I/O timeline]."""
    if buffer_count < 1:
        raise PlanError(f"buffer_count={buffer_count}; accepted: an integer >= 1")
    ready: dict[str, float] = {}
    start: dict[str, float] = {}
    nvme = [i for i in items if i.tier is Tier.NVME]
    spec = tiers.get(Tier.NVME)
    disk_free = -prefetch_lead_s
    buffer_free = [-prefetch_lead_s] * buffer_count  # when each host buffer is free again
    slot_of: dict[str, int] = {}
    read_end: dict[str, float] = {}
    next_read = 0
    clock, io_s, update_s, waited = 0.0, 0.0, 0.0, 0.0

    def issue_reads(until: int) -> None:
        # Reads go out in order, each into the buffer that frees first (the runtime's window).
        nonlocal next_read, disk_free, io_s
        while next_read < min(until + 1, len(nvme)):
            assert spec is not None
            slot = min(range(buffer_count), key=buffer_free.__getitem__)
            item = nvme[next_read]
            duration = item.record_bytes / spec.read_bytes_per_s
            disk_free = max(disk_free, buffer_free[slot]) + duration
            io_s += duration
            read_end[item.fqn] = disk_free
            buffer_free[slot] = math.inf  # held until this record's write-back ends
            slot_of[item.fqn] = slot
            next_read += 1

    issue_reads(buffer_count - 1)  # the prefetch issued as the backward starts
    for item in items:
        if item.tier is Tier.NVME:
            issue_reads(nvme.index(item) + buffer_count - 1)
            at = read_end[item.fqn]
        elif item.tier is Tier.CPU and math.isfinite(tiers[Tier.CPU].read_bytes_per_s):
            # Host tier on an accelerator: the copy in, then the copy out after the update.
            copy = item.record_bytes / tiers[Tier.CPU].read_bytes_per_s
            io_s += 2 * copy
            at = clock + copy
        else:
            at = clock
        ready[item.fqn] = at
        begin = max(clock, at)
        waited += begin - clock
        start[item.fqn] = begin
        duration = estimate_update_s(item.record_bytes, update_bytes_per_s)
        update_s += duration
        clock = begin + duration
        if item.tier is Tier.NVME:
            assert spec is not None
            write = item.record_bytes / spec.write_bytes_per_s
            disk_free = max(disk_free, clock) + write
            io_s += write
            buffer_free[slot_of.pop(item.fqn)] = disk_free
    # The last write-backs go on during the next forward and backward; what they outlast of it
    # delays the next step's prefetch, so it counts as exposed.
    trailing = max(disk_free - clock - forward_backward_s, 0.0)
    exposed = waited + trailing
    step_s = clock + trailing
    if delayed_update:
        # The whole step runs in the background during the next forward and backward.
        exposed = max(max(clock, disk_free) - forward_backward_s, 0.0)
        step_s = exposed
    return OffloadTimeline(ready, start, step_s, update_s, io_s, min(exposed, io_s))


# --------------------------------------------------------------------------- parameter shards (stage 3)
# NOTE [The parameter fetch timeline]
# With ``offload_param`` each offloaded shard is read into the graph right before its bucket's
# all-gather, once in forward and once in backward (stage 3 gathers again there), and written
# once per step after the optimizer updates it. ``estimate_param_fetch_timeline`` replays one
# pass (forward or backward): shards are fetched in order, fetch i is needed at ``need_s[i]``
# seconds into the pass (plus the delay of earlier waits), and NVMe reads run ahead at most
# ``buffer_count`` shards: read i is issued once fetch i - buffer_count has taken its shard.
# Reads share the disk in order. Host-memory shards cost nothing when the device is the CPU, and
# a host copy otherwise (through the same window). The time the pass waits is *exposed*; the
# rest of the read time is hidden behind compute. Write-backs after the optimizer step are
# counted as exposed: the next forward's first reads wait for them (an upper bound).


@dataclass(frozen=True)
class FetchItem:
    """One fetch of a parameter shard: its tier, size and when the pass needs it (seconds in)."""

    fqn: str
    tier: Tier
    shard_bytes: int
    need_s: float


def estimate_param_fetch_s(items: Sequence[FetchItem], tiers: Mapping[Tier, TierSpec], *, buffer_count: int) -> tuple[float, float]:
    """(read seconds, exposed seconds) of one pass's fetches; see NOTE [The parameter fetch timeline]."""
    if buffer_count < 1:
        raise PlanError(f"buffer_count={buffer_count}; accepted: an integer >= 1")

    def read_s(item: FetchItem) -> float:
        spec = tiers.get(item.tier)
        if item.tier is Tier.DEVICE or spec is None or math.isinf(spec.read_bytes_per_s):
            return 0.0
        return item.shard_bytes / spec.read_bytes_per_s

    moved = [i for i in items if read_s(i) > 0]
    taken: list[float] = []  # when fetch j (of ``moved``) took its shard
    link_free, delay, io_s = 0.0, 0.0, 0.0
    ready: dict[int, float] = {}
    for j, item in enumerate(moved):
        issue = taken[j - buffer_count] if j >= buffer_count else 0.0
        link_free = max(link_free, issue) + read_s(item)
        io_s += read_s(item)
        ready[j] = link_free
        need = item.need_s + delay
        if ready[j] > need:
            delay += ready[j] - need
            need = ready[j]
        taken.append(need)
    return io_s, delay


def estimate_param_write_s(items: Sequence[tuple[Tier, int]], tiers: Mapping[Tier, TierSpec]) -> float:
    """Seconds to write updated shards back to their tiers (host tier on the CPU: none)."""
    total = 0.0
    for tier, nbytes in items:
        spec = tiers.get(tier)
        if tier is Tier.DEVICE or spec is None or math.isinf(spec.write_bytes_per_s):
            continue
        total += nbytes / spec.write_bytes_per_s
    return total
