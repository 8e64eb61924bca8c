"""Planners: which tier holds each parameter's optimizer-state record, and in what order the
optimizer step swaps records in (``plan_offload``); and, at stage 3 with ``offload_param``,
which tier holds each parameter shard between uses (``plan_param_offload``).

Reads no graph: its input is the per-parameter record sizes (``cost_models.offload``, NOTE [What
an offloaded record holds]) in the order backward produces the gradients, a ``TierSpec`` per
tier and the step's compute times. It returns a frozen ``OffloadPlan`` that the runtime
(``zerofx.offload``) follows and ``zerofx plan`` prints. The same inputs give the same plan on
every rank: no measurement happens here.

NOTE [Bandwidth-centric placement]
Every record is moved twice per step (read before its update, written after), so a byte on a
tier costs ``1/read + 1/write`` seconds of that tier's bandwidth per step, and the step's I/O
time is the sum over tiers of bytes times that cost. With the budgets fixed, it is least when
the fastest tiers are as full as their budgets allow. The planner fills them first-fit
decreasing: records largest first, each on the fastest tier whose remaining budget holds it
(device, then host memory, then NVMe). Largest first leaves less of a fast tier's budget unused
than step order would: small records fill the gaps at the end.

The update order puts device and host records first, then NVMe records in backward order: the
first ``buffer_count`` NVMe reads are issued as the backward pass starts, so they have the
whole backward pass and the updates of the in-memory records to complete before they are needed.

NOTE [Placing shards by their cost per step]
Parameter shards do not all cost the same per byte, so filling the fast tier largest first is
not always best. A trainable shard is read twice per step (forward and backward gather it) and
written once (after the update); a frozen one is only read. A read can hide behind the compute
that runs between its issue and its use: with ``buffer_count`` reads ahead, bucket k of a pass
hides behind the compute of the ``min(k, buffer_count)`` buckets before it, and the first bucket
of each pass (forward's first, backward's first: the model's last) behind none. The cost of a
shard on a tier is then ``exposed reads + writes`` in seconds, from its bytes and the tier's read
and write bandwidths, and what a byte of the fast tier's budget saves is ``(cost on the slow tier
- cost on the fast tier) / bytes``. ``plan_param_offload`` builds two placements, first-fit
decreasing and this one (most saving per byte first onto the fastest tier with room, largest
first among equals), replays each with ``estimate_param_fetch_s`` and keeps the one whose
exposed I/O per step is lower; first-fit on a tie, so where every shard costs the same per byte
the plan is what first-fit gives. The plan records both predicted times. The budgets are the
user's (``max_in_cpu``, ``device``); only the choice of which shards use them is the planner's.
Optimizer-state records all move once each way per step, so their cost per byte is the same on
a tier and first-fit decreasing is already what this rule gives them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from zerofx.cost_models.offload import (
    FetchItem,
    OffloadItem,
    TierSpec,
    estimate_offload_timeline,
    estimate_param_fetch_s,
    estimate_param_write_s,
)
from zerofx.cost_models.tiers import Tier
from zerofx.passes.plan.offload import FASTEST_FIRST, OffloadPlan, ParamOffloadPlan, Placement
from zerofx.common.errors import PlanError


def plan_offload(
    records: Sequence[tuple[str, int]],
    tiers: Mapping[Tier, TierSpec],
    *,
    buffer_count: int,
    update_bytes_per_s: float,
    prefetch_lead_s: float = 0.0,
    delayed_update: bool = False,
    forward_backward_s: float = 0.0,
) -> OffloadPlan:
    """Place each ``(fqn, record_bytes)`` (in backward order) on a tier of ``tiers``; see NOTE
    [Bandwidth-centric placement]. ``Tier.DEVICE`` is always available (budget 0 if absent).
    ``ValueError`` when the records do not fit the tiers' budgets, naming the shortfall."""
    budgets = {t: (tiers[t].budget_bytes if t in tiers else 0.0) for t in FASTEST_FIRST}
    if Tier.NVME not in tiers:
        budgets[Tier.NVME] = 0.0
    left = dict(budgets)
    placed: dict[str, Tier] = {}
    position = {f: i for i, (f, _) in enumerate(records)}
    for fqn, size in sorted(records, key=lambda r: (-r[1], position[r[0]])):
        tier = next((t for t in FASTEST_FIRST if size <= left[t]), None)
        if tier is None:
            total = sum(b for _, b in records)
            raise PlanError(
                f"optimizer-state records of {total} bytes do not fit the offload budgets "
                f"({', '.join(f'{t.value} {b:g}' for t, b in budgets.items())} bytes): {fqn} ({size} bytes) has no room; "
                "raise a budget or offload to nvme"
            )
        left[tier] -= size
        placed[fqn] = tier
    order = [f for t in FASTEST_FIRST for f, _ in records if placed[f] is t]
    sizes = dict(records)
    timeline = estimate_offload_timeline(
        [OffloadItem(f, placed[f], sizes[f]) for f in order],
        tiers,
        buffer_count=buffer_count,
        update_bytes_per_s=update_bytes_per_s,
        prefetch_lead_s=prefetch_lead_s,
        delayed_update=delayed_update,
        forward_backward_s=forward_backward_s,
    )
    estimates = {
        "step_s": timeline.step_s,
        "update_s": timeline.update_s,
        "io_s": timeline.io_s,
        "exposed_io_s": timeline.exposed_io_s,
        "hidden_io_s": timeline.hidden_io_s,
    }
    assert all(math.isfinite(v) for v in estimates.values()), estimates
    return OffloadPlan(
        tiers=tuple((f, placed[f]) for f in order),
        record_bytes=tuple((f, sizes[f]) for f in order),
        buffer_count=buffer_count,
        delayed_update=delayed_update,
        estimates=estimates,
    )


def _first_fit(
    sizes: Sequence[tuple[str, int]], budgets: Mapping[Tier, float], key: Mapping[str, float] | None = None
) -> tuple[dict[str, Tier], str | None]:
    """Each ``(fqn, bytes)`` onto the fastest tier with room, in order of ``key`` (descending;
    default: bytes), largest and then earliest first among equals. Also the first fqn that had no
    room (None when all fit)."""
    left = dict(budgets)
    placed: dict[str, Tier] = {}
    position = {f: i for i, (f, _) in enumerate(sizes)}
    rank = key if key is not None else {f: 0.0 for f, _ in sizes}
    for fqn, size in sorted(sizes, key=lambda r: (-rank[r[0]], -r[1], position[r[0]])):
        tier = next((t for t in FASTEST_FIRST if size <= left[t]), None)
        if tier is None:
            return placed, fqn
        left[tier] -= size
        placed[fqn] = tier
    return placed, None


def _tier_cost_s(nbytes: int, tier: Tier, tiers: Mapping[Tier, TierSpec], *, hide_s: Sequence[float], writes: int) -> float:
    """Exposed seconds per step of a shard on ``tier``: each read (one per pass) beyond the compute
    it hides behind in that pass (``hide_s``), and its writes."""
    spec = tiers.get(tier)
    if tier is Tier.DEVICE or spec is None:
        return 0.0
    read = 0.0 if math.isinf(spec.read_bytes_per_s) else nbytes / spec.read_bytes_per_s
    write = 0.0 if math.isinf(spec.write_bytes_per_s) else writes * nbytes / spec.write_bytes_per_s
    return sum(max(read - h, 0.0) for h in hide_s) + write


def plan_param_offload(
    shards: Sequence[tuple[str, int, bool]],
    buckets: Sequence[Sequence[str]],
    tiers: Mapping[Tier, TierSpec],
    *,
    buffer_count: int,
    forward_s: float = 0.0,
    backward_s: float = 0.0,
    placement: Placement = Placement.BEST,
) -> ParamOffloadPlan:
    """Place each sharded parameter ``(fqn, shard_bytes, trainable)`` (model order) on a tier:
    by default the better of first-fit decreasing and the cost-per-step placement (NOTE [Placing
    shards by their cost per step]); ``placement`` forces one of them. ``buckets`` are the
    all-gather buckets in forward order; backward gathers them in reverse. Each bucket is assumed
    needed at an even share of the pass's compute (``forward_s``, ``backward_s``). ``ValueError``
    when the shards do not fit the budgets."""
    budgets = {t: (tiers[t].budget_bytes if t in tiers else 0.0) for t in FASTEST_FIRST}
    sizes = {f: b for f, b, _ in shards}
    trainable = {f: t for f, _, t in shards}
    first_fit, no_room = _first_fit([(f, b) for f, b, _ in shards], budgets)
    if no_room is not None:
        raise PlanError(
            f"parameter shards of {sum(b for _, b, _ in shards)} bytes do not fit the offload_param budgets "
            f"({', '.join(f'{t.value} {b:g}' for t, b in budgets.items())} bytes): {no_room} ({sizes[no_room]} bytes) has no room; "
            "raise max_in_cpu or use device nvme"
        )

    def one_pass(placed: Mapping[str, Tier], order: Sequence[Sequence[str]], pass_s: float) -> tuple[float, float]:
        items = [
            FetchItem(f, placed[f], sizes[f], pass_s * k / max(len(order), 1))
            for k, bucket in enumerate(order) for f in bucket if f in placed
        ]
        return estimate_param_fetch_s(items, tiers, buffer_count=buffer_count)

    def estimate(placed: Mapping[str, Tier]) -> dict[str, float]:
        fw_read, fw_exposed = one_pass(placed, buckets, forward_s)
        bw_read, bw_exposed = one_pass(placed, list(reversed(buckets)), backward_s)
        write = estimate_param_write_s([(placed[f], b) for f, b, t in shards if t], tiers)
        io = fw_read + bw_read + write
        exposed = fw_exposed + bw_exposed + write
        return {"read_s": fw_read + bw_read, "write_s": write, "io_s": io, "exposed_io_s": exposed,
                "hidden_io_s": max(io - exposed, 0.0)}

    # What each byte of a fast tier saves (NOTE [Placing shards by their cost per step]).
    n = max(len(buckets), 1)
    hide = {f: (0.0, 0.0) for f in sizes}  # (forward, backward) compute each read hides behind
    for k, bucket in enumerate(buckets):
        for f in bucket:
            if f in hide:  # forward gathers bucket k k-th, backward (n - 1 - k)-th
                hide[f] = (forward_s * min(k, buffer_count) / n, backward_s * min(n - 1 - k, buffer_count) / n)
    slow = next(t for t in reversed(FASTEST_FIRST) if budgets[t] > 0 or t is Tier.DEVICE)
    saving = {}
    for f, b in sizes.items():
        on_slow = _tier_cost_s(b, slow, tiers, hide_s=hide[f], writes=int(trainable[f]))
        on_fast = min(_tier_cost_s(b, t, tiers, hide_s=hide[f], writes=int(trainable[f])) for t in FASTEST_FIRST)
        saving[f] = (on_slow - on_fast) / max(b, 1)
    by_cost, no_room = _first_fit([(f, b) for f, b, _ in shards], budgets, key=saving)
    if no_room is not None:  # packing in another order left a gap: keep first-fit
        by_cost = first_fit
    first_fit_e, by_cost_e = estimate(first_fit), estimate(by_cost)
    if placement is Placement.BEST:
        better = by_cost_e["exposed_io_s"] < first_fit_e["exposed_io_s"] * (1 - 1e-9)
        placement = Placement.BANDWIDTH if better else Placement.FIRST_FIT
    placed, estimates = (by_cost, by_cost_e) if placement is Placement.BANDWIDTH else (first_fit, first_fit_e)
    estimates = {**estimates, "first_fit_exposed_io_s": first_fit_e["exposed_io_s"], "bandwidth_exposed_io_s": by_cost_e["exposed_io_s"]}
    return ParamOffloadPlan(
        tiers=tuple((f, placed[f]) for f, _, _ in shards),
        shard_bytes=tuple((f, b) for f, b, _ in shards),
        buffer_count=buffer_count,
        estimates=estimates,
        placement=placement,
    )
