"""The tiling plan's types: what ``zerofx.tiling`` asks for (``TilingOptions``) and what
``plan_tiling`` (passes/tiling/plan_tiling.py) decided (``TilingPlan``: the ops it tiles, those it
leaves and why, and the estimates behind each, NOTE [What the estimates mean]). A ``TilingPlan``
is part of the ``Plan`` (``Plan.tiling``), so it is fingerprinted and compared across ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerofx.common.errors import ConfigError
from zerofx.common.units import format_bytes

DEFAULT_BUDGET_BYTES = 1 << 30
DEFAULT_WEIGHT_TILE_BYTES = 256 << 20  # a gathered weight bigger than this is used in tiles (NOTE [Weight tiles])
KINDS = ("attention", "region", "loss", "weight", "conv")


def _check_block(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"tiling {name}={value!r} is not a block size; accepted: a positive integer (tokens)")
    return value


@dataclass(frozen=True)
class TilingOptions:
    """What the config's ``zerofx.tiling`` section asks for."""

    enabled: bool | str = "auto"  # "auto", True or False
    block_size: int | None = None  # tokens per region / loss chunk
    attention_block_size: int | None = None  # query and key block
    budget_bytes: int | None = None
    kinds: tuple[str, ...] = KINDS  # which kinds of op may be tiled
    weight_tile_bytes: int | None = None  # the largest gathered weight tile (NOTE [Weight tiles])
    # What ``auto`` holds the per-op estimates (upper bounds) to when it chooses; None: the
    # budget. Not a config key: zerofx.compile raises it while the lowered graphs' memory
    # timeline still fits the budget (NOTE [Tiling checked against the memory timeline]).
    estimate_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.enabled not in (True, False, "auto"):
            raise ConfigError(f"tiling enabled={self.enabled!r}; accepted: true, false or \"auto\"")
        _check_block("block_size", self.block_size)
        _check_block("attention_block_size", self.attention_block_size)
        if self.budget_bytes is not None and (isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, int) or self.budget_bytes < 0):
            raise ConfigError(f"tiling budget={self.budget_bytes!r}; accepted: a number of bytes >= 0")
        if self.estimate_budget_bytes is not None and (isinstance(self.estimate_budget_bytes, bool) or not isinstance(self.estimate_budget_bytes, int)
                                                       or self.estimate_budget_bytes < 0):
            raise ConfigError(f"tiling estimate_budget_bytes={self.estimate_budget_bytes!r}; accepted: a number of bytes >= 0")
        if self.weight_tile_bytes is not None and (isinstance(self.weight_tile_bytes, bool) or not isinstance(self.weight_tile_bytes, int)
                                                   or self.weight_tile_bytes < 1):
            raise ConfigError(f"tiling weight_tile_bytes={self.weight_tile_bytes!r}; accepted: a number of bytes >= 1")
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise ConfigError(f"tiling kinds {bad} are unknown; accepted: {', '.join(KINDS)}")


@dataclass(frozen=True)
class TiledOp:
    """One tiled op: its kind, its index among candidates of that kind (graph order), what it is.
    For a weight, ``block_size`` is the number of tiles, the bytes are the gathered weight's and
    ``param`` is the parameter's FQN."""

    kind: str
    index: int
    what: str
    shape: tuple[int, ...]
    block_size: int
    bytes_untiled: int
    bytes_tiled: int
    param: str = ""


@dataclass(frozen=True)
class SkippedOp:
    kind: str
    index: int
    what: str
    reason: str


@dataclass(frozen=True)
class TilingPlan:
    seq_len: int
    num_candidates: tuple[int, int, int, int, int]  # attention, regions, losses, weights, conv spans found in the graph
    ops: tuple[TiledOp, ...] = ()
    skipped: tuple[SkippedOp, ...] = ()
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    estimate_untiled_bytes: int = 0
    estimate_tiled_bytes: int = 0
    weight_tile_bytes: int = DEFAULT_WEIGHT_TILE_BYTES

    def chosen(self, kind: str) -> dict[int, TiledOp]:
        return {op.index: op for op in self.ops if op.kind == kind}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TilingPlan:
        return cls(
            seq_len=d["seq_len"],
            num_candidates=tuple(d["num_candidates"]) + (0,) * (len(KINDS) - len(d["num_candidates"])),
            ops=tuple(TiledOp(**{**o, "shape": tuple(o["shape"])}) for o in d["ops"]),
            skipped=tuple(SkippedOp(**s) for s in d["skipped"]),
            budget_bytes=d["budget_bytes"],
            estimate_untiled_bytes=d["estimate_untiled_bytes"],
            estimate_tiled_bytes=d["estimate_tiled_bytes"],
            weight_tile_bytes=d.get("weight_tile_bytes", DEFAULT_WEIGHT_TILE_BYTES),
        )

    def table(self) -> str:
        from tabulate import tabulate


        rows = [(o.kind, o.what, "x".join(map(str, o.shape)),
                 f"{o.block_size} tiles" if o.kind == "weight" else "recompute" if o.kind == "conv" else o.block_size,
                 format_bytes(o.bytes_untiled - o.bytes_tiled)) for o in self.ops]
        head = (f"tiling: sequence length {self.seq_len}, activations {format_bytes(self.estimate_untiled_bytes)} untiled -> "
                f"{format_bytes(self.estimate_tiled_bytes)} tiled (budget {format_bytes(self.budget_bytes)}), {len(self.ops)} tiled ops")
        lines = [head]
        if any(o.kind == "weight" for o in self.ops):
            lines.append(f"weights over {format_bytes(self.weight_tile_bytes)} are used in tiles of output features; at stage 3 "
                         "each is gathered one tile at a time (bytes saved: of the gathered weight)")
        if rows:
            lines.append(tabulate(rows, headers=["tiled op", "what", "shape", "block", "bytes saved"], tablefmt="simple"))
        lines += [f"not tiled: {s.kind} #{s.index} ({s.what}): {s.reason}" for s in self.skipped]
        return "\n".join(lines)
