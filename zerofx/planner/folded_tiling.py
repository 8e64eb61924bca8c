"""Tiling for a folded search: one tiling for every block, chosen for the whole model and written
into the config, so that models cut short tile their blocks as the whole model does.

NOTE [One tiling for every cut]
Folding extrapolates from copies of the model cut to a few blocks (NOTE [Why linear
extrapolation is exact here] in zerofx/planner/folding.py), which holds only where each cut
plans every block alike (NOTE [Tiling the same in every cut]). Tiling ``"auto"`` and ``true``
decide from the captured model's own totals: auto tiles the biggest savings first until the
estimate, then the memory timeline, fits the budget; ``true`` takes the largest block whose
estimate fits. A cut holds fewer blocks, so it tiles less or in larger blocks than the whole
model, and two cuts tile differently from each other. On the 100m DNA LM at 8k tokens and 4
ranks, ``true`` chose 256-token blocks for the whole model (its estimate 1.04 GiB against a
1 GiB budget) and larger ones in the cuts, so every such candidate was planned whole: 4.5
minutes each.

So the whole-job search pins the tiling of a folded capture group in its config: ``enabled:
true``, the kinds that may be tiled, and ``block_size``. Every candidate of each kind is then
tiled in every cut and in the whole model alike, and the config the search prints plans what
the search measured. The choice is made for the whole model from the cuts:
- the estimates (bytes saved per kind at each block size, and the untiled total) are sums over
  the candidates, one set per block, so they are extrapolated from the 2- and 3-block cuts'
  tiling plans exactly, as a step's figures are; each plan needs only the forward record, not a
  capture;
- ``true`` takes the largest block size whose extrapolated estimate fits, as the planner does
  on the whole model;
- ``"auto"`` orders the settings from least to most tiled (kinds added in the order of what
  they save at the largest block, then every kind at smaller blocks) and bisects for the first
  whose folded memory timeline (peak less persistent state) fits the activation budget, the
  check ``fit_tiling`` makes on a whole capture (NOTE [Tiling checked against the memory
  timeline] in zerofx/planner/fit.py); when none fits, the least tiled of those tried
  that need the least memory (within ``NO_FIT_TOLERANCE``). On the 100m model above, 2,048-,
  512- and 256-token blocks all peaked at 964 MiB of activations against 646 MiB: what is left
  is not in the tiled regions, and smaller blocks would only add chunks. So two settings of
  every kind that do not fit and need the same memory end the bisection, before the smallest
  blocks, the costliest folds.
Unlike ``"auto"`` on a whole capture, a kind is tiled in every block or in none, so it can tile
more than the fewest ops that fit: the price of a plan that folds. ``zerofx plan`` folding a
config with ``true`` and no ``block_size`` pins the whole model's block in its cuts the same way
(``pinned_on``); a config with ``"auto"`` is planned whole where its cuts tile apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from zerofx.compiler.capture import LossFn
from zerofx.planner.folding import FOLD_BLOCKS, RepeatedBlocks, extrapolate, with_num_blocks
from zerofx.compiler.pipeline import StepCapture
from zerofx.config import ZeroConfig
from zerofx.config.compile_options import compile_options
from zerofx.passes.plan.tiling import DEFAULT_BUDGET_BYTES, KINDS, TilingOptions, TilingPlan
from zerofx.passes.tiling.plan_tiling import block_choices

# The kinds a folded tiling chooses among; weights are tiled by size, not by the activation
# budget (NOTE [Weight tiles] in passes/tiling/plan_tiling.py), so they stay on as "auto" leaves them.
SEQUENCE_KINDS = tuple(k for k in KINDS if k != "weight")
TILING_ON = TilingOptions(enabled=True)


@dataclass(frozen=True)
class TilingEstimates:
    """The whole model's activation estimates from the cuts: the untiled total, and the bytes each
    kind saves at each block size (block sizes largest first)."""

    untiled_bytes: float
    saved: Mapping[int, Mapping[str, float]]  # block size -> kind -> bytes saved, kinds with candidates only

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(self.saved)

    def tiled_bytes(self, kinds: Sequence[str], block: int) -> float:
        return self.untiled_bytes - sum(self.saved[block].get(k, 0.0) for k in kinds)


def whole_estimates(plan_of: Callable[[int, TilingOptions], TilingPlan | None], cuts: tuple[int, int], count: int) -> TilingEstimates | None:
    """The whole model's estimates, extrapolated to ``count`` blocks from the tiling plans
    ``plan_of(n, options)`` of the cuts of ``cuts`` blocks with every kind on; None when the
    model has no sequence axis or nothing to tile."""
    first = plan_of(cuts[1], TilingOptions(enabled=True))
    if first is None:
        return None
    saved: dict[int, dict[str, float]] = {}
    untiled = 0.0
    for block in block_choices(first.seq_len, TilingOptions()):
        per_cut = [plan_of(n, TilingOptions(enabled=True, block_size=block)) for n in cuts]
        if any(p is None for p in per_cut):
            return None
        sums = [{k: float(sum(o.bytes_untiled - o.bytes_tiled for o in p.ops if o.kind == k)) for k in SEQUENCE_KINDS} for p in per_cut]
        kinds = [k for k in SEQUENCE_KINDS if any(o.kind == k for p in per_cut for o in p.ops)]
        saved[block] = {k: extrapolate(sums[0][k], sums[1][k], count, cuts) for k in kinds}
        untiled = extrapolate(float(per_cut[0].estimate_untiled_bytes), float(per_cut[1].estimate_untiled_bytes), count, cuts)
    if not any(saved.values()):
        return None
    return TilingEstimates(untiled, saved)


def model_estimates(model: nn.Module, blocks: RepeatedBlocks, example_args: Sequence[Any], example_kwargs: Mapping[str, Any],
                    cfg: ZeroConfig, world_size: int, *, loss_fn: LossFn | None = None,
                    cuts: Mapping[int, nn.Module] | None = None) -> TilingEstimates | None:
    """``whole_estimates`` of ``model`` called with these inputs under ``cfg`` (its compute dtype
    and sequence parallelism), from the forward records of its cuts to ``FOLD_BLOCKS`` blocks
    (``cuts``, by block count, where already made)."""
    spec = compile_options(cfg, world_size).sequence_parallel
    records: dict[int, StepCapture] = {}

    def plan_of(n: int, options: TilingOptions) -> TilingPlan | None:
        if n not in records:  # the forward record alone: no autograd, no lowering
            cut = cuts[n] if cuts is not None and n in cuts else with_num_blocks(model, blocks, n)
            records[n] = StepCapture(cut, example_args, example_kwargs, loss_fn=loss_fn, compute_dtype=cfg.compute_dtype,
                                     sequence_parallel=spec)
        return records[n].tiling_plan(options)

    return whole_estimates(plan_of, FOLD_BLOCKS, blocks.count)


@dataclass(frozen=True)
class PinnedTiling:
    """A tiling every cut plans alike: these kinds, in ``block_size``-token chunks."""

    kinds: tuple[str, ...]
    block_size: int

    def section(self) -> dict[str, Any]:
        """The ``zerofx.tiling`` config section (weights stay as ``"auto"`` leaves them)."""
        return {"enabled": True, "block_size": self.block_size, **{k: k in self.kinds for k in SEQUENCE_KINDS}}

    def describe(self) -> str:
        return f"{', '.join(self.kinds)} in {self.block_size}-token blocks"


def pinned_on(estimates: TilingEstimates, options: TilingOptions = TILING_ON) -> PinnedTiling:
    """What ``enabled: true`` with ``options`` (its kinds and budget) tiles in the whole model:
    every kind it allows, at the largest block size whose estimate fits the budget, else the
    smallest (NOTE [Block size from the budget])."""
    kinds = tuple(k for k in SEQUENCE_KINDS if k in options.kinds and any(k in s for s in estimates.saved.values()))
    budget_bytes = options.budget_bytes if options.budget_bytes is not None else DEFAULT_BUDGET_BYTES
    for block in estimates.blocks:
        if estimates.tiled_bytes(kinds, block) <= budget_bytes:
            return PinnedTiling(kinds, block)
    return PinnedTiling(kinds, estimates.blocks[-1])


def ladder(estimates: TilingEstimates) -> list[PinnedTiling]:
    """The settings ``"auto"`` chooses among, least tiled first: at the largest block, the kinds
    added one by one in the order of what they save; then every kind at each smaller block."""
    largest = estimates.blocks[0]
    order = sorted(estimates.saved[largest], key=lambda k: (-estimates.saved[largest][k], SEQUENCE_KINDS.index(k)))
    rungs = [PinnedTiling(tuple(sorted(order[:i], key=SEQUENCE_KINDS.index)), largest) for i in range(1, len(order) + 1)]
    every = tuple(k for k in SEQUENCE_KINDS if any(k in s for s in estimates.saved.values()))
    rungs += [PinnedTiling(every, block) for block in estimates.blocks[1:]]
    return rungs


# When no setting fits, the least tiled one tried within this share of the least memory tried is
# kept: past the regions' share of the peak, smaller blocks only add chunks (time) for nothing.
NO_FIT_TOLERANCE = 0.01


def fit_pinned(rungs: Sequence[PinnedTiling], transient_of: Callable[[PinnedTiling], float],
               budget_bytes: float) -> tuple[PinnedTiling, list[tuple[PinnedTiling, float]]]:
    """The least tiled of ``rungs`` whose transient memory (``transient_of``, from the folded
    timeline) fits ``budget_bytes``, by bisection, assuming more tiling never needs more. When
    none fits, the least tiled tried within ``NO_FIT_TOLERANCE`` of the least memory tried. Also
    every setting tried, with its transient.

    Among the rungs that tile every kind (the same kinds as the last, in smaller and smaller
    blocks), two that do not fit and need the same memory (within ``NO_FIT_TOLERANCE``) end the
    search: what is left is outside the tiled regions, so smaller blocks would free nothing
    either, and their folds are the costliest ones (the most chunks)."""
    tried: dict[int, float] = {}
    every_kind = [i for i, r in enumerate(rungs) if r.kinds == rungs[-1].kinds]

    def fits(i: int) -> bool:
        if i not in tried:
            tried[i] = transient_of(rungs[i])
        return tried[i] <= budget_bytes

    def freed_nothing(i: int) -> bool:
        """``i`` (not fitting) freed less than the tolerance against a less tiled rung of every
        kind tried; the bisection only passes rungs that do not fit, so that one did not either."""
        return i in every_kind and any(j < i and j in every_kind and tried[i] >= tried[j] * (1 - NO_FIT_TOLERANCE) for j in tried)

    low, high = 0, len(rungs) - 1
    stopped = False
    while low < high:
        mid = (low + high) // 2
        if fits(mid):
            high = mid
        elif freed_nothing(mid):
            stopped = True
            break
        else:
            low = mid + 1
    if stopped or not fits(low):
        least = min(tried.values())
        low = min(i for i, t in tried.items() if t <= least * (1 + NO_FIT_TOLERANCE))
    return rungs[low], [(rungs[i], tried[i]) for i in sorted(tried)]
