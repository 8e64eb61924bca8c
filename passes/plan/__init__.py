"""The Plan: the one hand-off from planning to rewriting.

A frozen dataclass, the same on every rank. Rewrites read it and never re-run a cost model.
``fingerprint()`` is compared across ranks before any rewrite, so ranks that planned
differently fail fast instead of hanging in a collective.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from zerofx.common.units import format_bytes
from zerofx.passes.plan.offload import ParamOffloadPlan
from zerofx.passes.plan.recompute import RecomputePlan
from zerofx.passes.plan.tiling import TilingPlan
from zerofx.passes.plan.sequence import SequenceParallelPlan


class ZeroStage(enum.IntEnum):
    ZERO = 0  # plain data parallel: gradients all-reduced
    ONE = 1  # optimizer states sharded
    TWO = 2  # gradients reduce-scattered too
    THREE = 3  # parameters sharded too: gathered before use, freed after


class CommKind(str, enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)}


@dataclass(frozen=True)
class ParamPlacement:
    """How one parameter is laid out across ranks.

    The flat parameter is padded to ``padded_numel`` (a multiple of the shard group size K, the
    world size when flat) and the rank at shard index i (``Plan.shard_index(rank)``, ``rank % K``)
    owns ``[i * shard_numel, (i + 1) * shard_numel)`` of it.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    numel: int
    shard_numel: int
    padded_numel: int

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype].itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def is_sharded(self, stage: int, persistent: tuple[str, ...] | frozenset[str] = ()) -> bool:
        """Whether ranks hold only their shard of this parameter between steps."""
        return stage >= 3 and self.fqn not in persistent

    def owned_range(self, shard_index: int) -> tuple[int, int]:
        """[start, stop) of the real (unpadded) elements the rank at ``shard_index`` owns (its rank
        when sharding is flat)."""
        start = min(shard_index * self.shard_numel, self.numel)
        return start, min(start + self.shard_numel, self.numel)


# The process groups a collective runs over: ``SHARD``, the rank's shard group (every rank when
# sharding is flat); ``REPLICATE``, the ranks holding the same shard index in every shard group.
SHARD = "shard"
REPLICATE = "replicate"


@dataclass(frozen=True)
class Collective:
    """One collective in the schedule: the bucket of parameters it moves, the graph that issues
    it, how many bytes each rank sends in, and the group it runs over."""

    kind: CommKind
    fqns: tuple[str, ...]
    graph: str  # "forward", "backward", "grad_sync" or "param_sync"
    bytes_per_rank: int
    group: str = SHARD


@dataclass(frozen=True)
class ScheduleOptions:
    """Limits the planner honours; None means the cost model decides. Bucket sizes count the
    elements of the gathered (all-gather) or reduced (reduce-scatter, all-reduce) message, as
    DeepSpeed's ``stage3_prefetch_bucket_size``, ``reduce_bucket_size`` and
    ``allgather_bucket_size`` do."""

    gather_bucket_numel: int | None = None
    reduce_bucket_numel: int | None = None
    sync_bucket_numel: int | None = None
    prefetch_distance: int | None = None  # buckets ahead; 0 turns prefetch off
    max_live_numel: float = float("inf")  # gathered parameter elements alive at once (stage 3)
    persistence_threshold: int = 0  # stage 3: parameters with fewer elements stay unsharded
    overlap: bool = True  # issue collectives early and wait late
    memory_budget_bytes: float | None = None  # per rank, for the whole step's peak
    # zerofx.recompute: "off", "auto" (what the budget needs) or "all" (NOTE [Selective activation recompute])
    recompute: str = "off"
    # Reduce-scatters issued as an all-to-all and a sum (NOTE [gloo's reduce-scatter as an
    # all-to-all]); None: where the comm profile's backend is gloo. The engine sets it from its group.
    reduce_scatter_by_all_to_all: bool | None = None


@dataclass(frozen=True)
class Plan:
    world_size: int
    stage: ZeroStage
    optimizer: str
    params: tuple[ParamPlacement, ...]
    # Parameters in order of first use in forward (all-gather order at stage 3).
    gather_order: tuple[str, ...]
    # Trainable parameters in the order backward produces their gradients.
    reduce_order: tuple[str, ...]
    # Buckets: stage-3 all-gathers (first-use order), gradient reductions (production order),
    # and the stage 1-2 all-gather of updated shards.
    gather_buckets: tuple[tuple[str, ...], ...]
    reduce_buckets: tuple[tuple[str, ...], ...]
    sync_buckets: tuple[tuple[str, ...], ...]
    prefetch_distance: int
    overlap: bool
    # Stage 3: parameters kept whole on every rank (below the persistence threshold). Their
    # gradients are reduce-scattered and their updated shards all-gathered, as at stage 2.
    persistent: tuple[str, ...]
    schedule: tuple[Collective, ...]
    estimates: Mapping[str, int] = field(default_factory=dict)
    # Why a choice differs from its default, with the estimate behind it (e.g. a prefetch
    # distance lowered to fit the memory budget).
    decisions: tuple[str, ...] = ()
    # Sequence tiling of the forward before autograd (attention, token-wise regions, the loss).
    tiling: TilingPlan | None = None
    # Stage 3: weights gathered, used and reduced one tile at a time inside their linear
    # (``tile_weights_pass``), as (fqn, tiles); they are in no gather or reduce bucket.
    tile_gathered: tuple[tuple[str, int], ...] = ()
    # Ranks that share one copy of the ZeRO state: groups of K consecutive ranks, each holding a
    # full sharded copy, replicated across the world_size // K groups (NOTE [Shard groups of
    # consecutive ranks]). 0 when built means flat: one group of all ranks.
    shard_group_size: int = 0
    # The rest of what the rewrites read, so that this plan is their one input (NOTE [The compile
    # spine]): the sequence-parallel rewrite the forward had before autograd, which stage-3 shards
    # live off the device and which graphs fetch them (offload_param), and whether the backward
    # hands each reduced gradient shard off at its bucket's wait (zerofx.offload_gradients).
    sequence_parallel: SequenceParallelPlan | None = None
    param_offload: ParamOffloadPlan | None = None
    offload_grads: bool = False
    # Saved activations recomputed in backward instead (NOTE [Selective activation recompute]).
    recompute: RecomputePlan | None = None
    # Each reduce-scatter lowered to an all-to-all and a sum (NOTE [gloo's reduce-scatter as an
    # all-to-all] in passes/zero/reduce_scatter_all_to_all.py).
    reduce_scatter_by_all_to_all: bool = False

    def __post_init__(self) -> None:
        if self.shard_group_size == 0:
            object.__setattr__(self, "shard_group_size", self.world_size)
        assert self.shard_group_size >= 1 and self.world_size % self.shard_group_size == 0, (self.world_size, self.shard_group_size)

    @property
    def num_shard_groups(self) -> int:
        """How many replicas of the sharded state there are (1 when sharding is flat)."""
        return self.world_size // self.shard_group_size

    def shard_index(self, rank: int) -> int:
        """Which shard of every parameter rank ``rank`` owns: its place within its shard group."""
        return rank % self.shard_group_size

    def param(self, fqn: str) -> ParamPlacement:
        for p in self.params:
            if p.fqn == fqn:
                return p
        raise KeyError(fqn)

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    def to_json(self) -> str:
        # The sharding plan's JSON: the placements, buckets and schedule every rank must agree on
        # (``fingerprint``). The sequence-parallel and offload plans are checked where they are made.
        d = asdict(replace(self, sequence_parallel=None, param_offload=None, offload_grads=False))
        for key in ("sequence_parallel", "param_offload", "offload_grads"):
            del d[key]
        d["stage"] = int(self.stage)
        d["estimates"] = dict(self.estimates)
        for c in d["schedule"]:
            c["kind"] = c["kind"].value
        if self.tiling is None:  # untiled plans keep the JSON (and fingerprint) they had before tiling existed
            del d["tiling"]
        if not self.tile_gathered:
            del d["tile_gathered"]
        if self.recompute is None:  # plans without recompute keep the JSON (and fingerprint) they had before it
            del d["recompute"]
        if not self.reduce_scatter_by_all_to_all:  # as for recompute: plans issuing reduce-scatters keep their JSON
            del d["reduce_scatter_by_all_to_all"]
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d: dict[str, Any] = json.loads(text)
        return cls(
            world_size=d["world_size"],
            stage=ZeroStage(d["stage"]),
            optimizer=d["optimizer"],
            params=tuple(ParamPlacement(**{**p, "shape": tuple(p["shape"])}) for p in d["params"]),
            gather_order=tuple(d["gather_order"]),
            reduce_order=tuple(d["reduce_order"]),
            gather_buckets=tuple(tuple(b) for b in d["gather_buckets"]),
            reduce_buckets=tuple(tuple(b) for b in d["reduce_buckets"]),
            sync_buckets=tuple(tuple(b) for b in d["sync_buckets"]),
            prefetch_distance=d["prefetch_distance"],
            overlap=d["overlap"],
            persistent=tuple(d["persistent"]),
            schedule=tuple(Collective(CommKind(c["kind"]), tuple(c["fqns"]), c["graph"], c["bytes_per_rank"], c.get("group", SHARD))
                           for c in d["schedule"]),
            estimates=d["estimates"],
            decisions=tuple(d.get("decisions", ())),
            tiling=TilingPlan.from_dict(d["tiling"]) if d.get("tiling") is not None else None,
            tile_gathered=tuple((f, t) for f, t in d.get("tile_gathered", ())),
            shard_group_size=d.get("shard_group_size", d["world_size"]),
            recompute=RecomputePlan.from_dict(d["recompute"]) if d.get("recompute") is not None else None,
            reduce_scatter_by_all_to_all=bool(d.get("reduce_scatter_by_all_to_all", False)),
        )

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def __str__(self) -> str:
        from tabulate import tabulate

        lines = [
            f"zerofx plan: ZeRO stage {int(self.stage)}, world size {self.world_size}, optimizer {self.optimizer}, "
            f"{self.num_params:,} parameters in {len(self.params)} tensors (fingerprint {self.fingerprint()})",
            "model state per rank: "
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.estimates.items())
            + f" (total {format_bytes(sum(self.estimates.values()))})",
        ]
        counts: dict[tuple[str, str], list[int]] = {}
        for c in self.schedule:
            counts.setdefault((c.graph, c.kind.value), []).append(c.bytes_per_rank)
        rows = [(g, k, len(v), format_bytes(sum(v))) for (g, k), v in counts.items()]
        lines.append(tabulate(rows, headers=["graph", "collective", "count", "sent in per rank"], tablefmt="simple",
                              colalign=("left", "left", "right", "right")))
        if self.shard_group_size < self.world_size:
            lines.append(f"shard groups: {self.num_shard_groups} groups of {self.shard_group_size} consecutive ranks, "
                         "state sharded within a group and replicated across groups")
        if self.stage is ZeroStage.THREE:
            lines.append(f"prefetch distance {self.prefetch_distance} bucket(s) ahead")
        if self.reduce_scatter_by_all_to_all and any(c.kind is CommKind.REDUCE_SCATTER for c in self.schedule):
            lines.append("reduce-scatters issued as all-to-alls and a sum (gloo runs its own as an all-reduce, twice the bytes)")
        lines += [f"decision: {d}" for d in self.decisions]
        lines += [f"weight tiles: {f} in {t} tiles of at most {format_bytes(-(-self.param(f).padded_numel // t) * self.param(f).itemsize)}, "
                  "each gathered, used and reduced in turn" for f, t in self.tile_gathered]
        if self.tiling is not None:
            lines.append(self.tiling.table())
        if self.recompute is not None:
            lines.append(self.recompute.table())
        return "\n".join(lines)
