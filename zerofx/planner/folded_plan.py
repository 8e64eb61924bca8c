"""``zerofx plan`` of a deep model from captures of it cut to 2 and 3 blocks (NOTE [Why linear
extrapolation is exact here] in zerofx/planner/folding.py): whether to fold, and the whole
model's figures with the decisions made for it on the way.

The cut models are planned as the whole model would be where their own plan would differ:
tiling pinned to the whole model's block (NOTE [One tiling for every cut]), the prefetch
distance the whole model takes from the profile (NOTE [The whole model's prefetch distance]),
and the prefetch distance lowered until the extrapolated peak fits the budget, which the cut
models' smaller peaks would not show (NOTE [Prefetch under a memory budget]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

from zerofx.common.errors import UsageError
from zerofx.common.limits import AUTO_FOLD_MIN_BLOCKS
from zerofx.common.units import format_bytes
from zerofx.compiler.program import Program, compile, prefetch_from_the_profile, resolve, whole_prefetch_distance
from zerofx.config import ZeroConfig
from zerofx.config.options import BUDGET_KEYS
from zerofx.cost_models.comm import CommSpec
from zerofx.cost_models.compute import DeviceSpec
from zerofx.cost_models.profiles import load_profile
from zerofx.passes.zero.plan_shard_groups import estimate_compute_s
from zerofx.planner.fit import lower_prefetch_distance
from zerofx.planner.folded_tiling import model_estimates, pinned_on
from zerofx.planner.folding import FOLD_BLOCKS, FoldedReport, RepeatedBlocks, extrapolate, find_repeated_blocks, plan_folded, with_num_blocks

# Options, or a config to parse once (a dict or a JSON file's path; None: the defaults).
Config = ZeroConfig | Path | Mapping[str, Any] | None


def blocks_to_fold(model: nn.Module, fold: str, *, label: str, recompute_auto: bool) -> tuple[RepeatedBlocks | None, str | None]:
    """The repeated blocks ``zerofx plan`` folds, or None to plan every block, and a line saying
    why a model that would fold is planned whole (else None). ``fold`` is ``--fold``: "auto"
    folds from ``AUTO_FOLD_MIN_BLOCKS`` identical blocks, "on" from ``FOLD_BLOCKS[1]`` (fewer is a
    ``UsageError``), "off" never. ``recompute_auto``: the config's ``zerofx.recompute`` is
    "auto", which recomputes until the whole model's peak fits the budget, and the cut models are
    planned without one (NOTE [Budgets of the cut models] in zerofx/planner/autoplan.py)."""
    blocks = find_repeated_blocks(model)
    folds = fold == "on" or (fold == "auto" and blocks is not None and blocks.count >= AUTO_FOLD_MIN_BLOCKS)
    if recompute_auto and fold == "on":
        raise UsageError("--fold on cannot plan zerofx.recompute \"auto\": it recomputes until the whole model's peak fits the "
                         "budget, and the cut models are planned without one; use --fold off or auto (or zerofx.recompute true or false)")
    note = None
    if recompute_auto and folds:
        note = (f"zerofx plan: planning all {blocks.count} blocks of {blocks.path!r}, not folded: zerofx.recompute \"auto\" "
                "recomputes until the whole model's peak fits the budget")
        folds = False
    if fold == "on" and blocks is None:
        raise UsageError(f"--fold on: {label} has no nn.ModuleList/nn.Sequential of identical blocks to fold; use --fold off")
    if fold == "on" and blocks.count < FOLD_BLOCKS[1]:
        raise UsageError(f"--fold on: {label}'s {blocks.path!r} holds {blocks.count} blocks; folding needs at least "
                         f"{FOLD_BLOCKS[1]} (it captures {FOLD_BLOCKS[0]} and {FOLD_BLOCKS[1]}); use --fold off")
    return (blocks if folds else None), note


@dataclass(frozen=True)
class FoldedPlan:
    """The whole model's figures extrapolated from the cut models (``folded``), the larger cut's
    program (its plan is the one shown), and what was decided for the whole model."""

    folded: FoldedReport
    program: Program
    decisions: tuple[str, ...]


def plan_model_folded(model: nn.Module, example_args: tuple[Any, ...], example_kwargs: Mapping[str, Any], blocks: RepeatedBlocks, *,
                      world_size: int | None, stage: int | None, config: Config, rank: int, comm: CommSpec, device: DeviceSpec,
                      budget_bytes: float | None) -> FoldedPlan:
    """Plan ``model`` from its cuts to ``FOLD_BLOCKS`` blocks (longer where a prefetch window
    spans blocks), each cut planned as ``config`` plans the whole model and reported for
    ``rank`` on ``comm`` / ``device``; with ``budget_bytes``, the prefetch distance lowered until
    the extrapolated peak fits it."""
    programs: dict[int, Program] = {}  # by the number of blocks of the cut model

    def report_for(cut: nn.Module, cut_config: ZeroConfig) -> Any:
        program = compile(cut, world_size=world_size, stage=stage, config=cut_config, example_inputs=example_args,
                          example_kwargs=example_kwargs)
        programs[len(cut.get_submodule(blocks.path))] = program
        return program.report(rank, comm=comm, device=device), program.plan

    # The cut models' peaks are smaller than the whole model's, so the planner cannot fit the
    # prefetch distance to the budget on them (NOTE [Prefetch under a memory budget]): they are
    # planned without it, and the distance is fitted here, on the extrapolated peak.
    cfg = resolve(config, stage=stage, world_size=world_size)
    cut_cfg = cfg.with_keys(drop=[f"zerofx.{key}" for key in BUDGET_KEYS])

    def fold(cut_config: ZeroConfig) -> tuple[FoldedReport, Program]:
        folded = plan_folded(model, blocks, lambda m: report_for(m, cut_config), parallel=True)
        # The 2-block capture may run in a forked child (NOTE [Planning the two captures in
        # parallel]); the larger cut always runs here, so its plan is the one shown.
        return folded, programs[folded.cuts[1]]

    def fold_at(distance: int) -> tuple[tuple[FoldedReport, Program], int, float]:
        folded, sample = fold(cut_cfg.with_keys({"zerofx.prefetch_distance": distance}))
        return (folded, sample), distance, folded.peak_bytes

    decisions: list[str] = []
    tiling = cfg.tiling
    if tiling is not None and tiling.enabled is True and tiling.block_size is None:
        # NOTE [One tiling for every cut]: each cut would take the largest block its own smaller
        # estimate fits; the whole model's block, pinned, tiles every cut as the whole model.
        estimates = model_estimates(model, blocks, example_args, example_kwargs or {}, cfg, world_size)
        if estimates is not None:
            block = pinned_on(estimates, tiling).block_size
            cut_cfg = cut_cfg.with_keys({"zerofx.tiling.block_size": block})
            decisions.append(f"tiling block size {block} tokens, the whole model's from its estimate (the cut models, planned with "
                             "this block, fold to it; NOTE [One tiling for every cut])")
    folded, sample = fold(cut_cfg)
    distance = _whole_prefetch_distance(model, example_args, example_kwargs, blocks, cut_cfg, folded, programs,
                                        world_size=world_size, stage=stage)
    if distance is not None and distance != sample.plan.prefetch_distance:
        decisions.append(f"prefetch distance {distance} bucket(s) ahead, the whole model's from the profile (the cut models' own "
                         f"was {sample.plan.prefetch_distance}; NOTE [The whole model's prefetch distance])")
        cut_cfg = cut_cfg.with_keys({"zerofx.prefetch_distance": distance})
        folded, sample = fold(cut_cfg)
    if budget_bytes is not None:
        search = lower_prefetch_distance((folded, sample), sample.plan.prefetch_distance, folded.peak_bytes, budget_bytes, fold_at)
        folded, sample = search.result
        if search.lowered:
            decisions.append(search.decision(f"extrapolated peak {format_bytes(folded.peak_bytes)}"))
    return FoldedPlan(folded, sample, tuple(decisions))


def _whole_prefetch_distance(model: nn.Module, example_args: tuple[Any, ...], example_kwargs: Mapping[str, Any], blocks: RepeatedBlocks,
                             config: ZeroConfig, folded: FoldedReport, programs: Mapping[int, Program], *, world_size: int | None,
                             stage: int | None) -> int | None:
    """Stage 3 on an explicit profile with no prefetch distance configured: the distance the
    planner takes from the profile for the whole model, from its parameters' shapes and its
    compute extrapolated from the cut models' captures (NOTE [The whole model's prefetch
    distance] in zerofx/planner/autoplan.py); None otherwise."""
    cfg = resolve(config, stage=stage, world_size=world_size)
    low, high = folded.cuts
    if low == high or not prefetch_from_the_profile(cfg):
        return None  # planned whole, or the distance is not the profile's
    device = load_profile(cfg.profile)[1]

    def compute_at(n: int) -> float:
        program = programs.get(n)
        if program is None:  # captured in the forked child (NOTE [Planning the two captures in parallel])
            program = compile(with_num_blocks(model, blocks, n), world_size=world_size, stage=stage, config=config,
                              example_inputs=example_args, example_kwargs=example_kwargs)
        return estimate_compute_s(program.captured.joint, device)

    return whole_prefetch_distance(model, cfg, world_size, extrapolate(compute_at(low), compute_at(high), blocks.count, (low, high)))
