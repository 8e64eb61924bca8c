"""Layer folding: plan a deep model from shallow copies of it.

A decoder is a prologue (embeddings), N identical blocks and an epilogue (norm, head, loss).
Capturing and lowering cost time proportional to N: a 20B decoder with 44 blocks takes minutes.
Folding captures the model with its block list cut to 2 and to 3 blocks (on the meta device:
the cut copies share the original's modules and allocate nothing), plans each exactly, and
extrapolates the whole-model figures.

NOTE [Why linear extrapolation is exact here]
Every figure the planner reports is a sum over the step's nodes or collectives (bytes moved,
compute, communication and exposed time, model-state bytes), or a peak of live bytes. Buckets
end at block boundaries (NOTE [Buckets end at block boundaries] in ``passes/zero/plan_buckets.py``),
so each extra block adds the same nodes and the same collectives, and a sum over the model with
N blocks is ``f(2) + (N - 2) * (f(3) - f(2))``. Peaks are taken per graph. The first and the
last block are special (the embedding's gradient meets the first; the head's small reduction
is in flight during the last); every block between them behaves alike: its backward runs with
the previous block's gradient reduction in flight (NOTE [A reduction holds its input until its
wait] in ``passes/zero/schedule_overlap.py``) and with every earlier block's saved activations
alive. So the backward of a 3-block model is the first one with a middle block, and from 3
blocks on each extra block adds what one block keeps alive to every point, which the two
captures show where their nodes align (the end of forward, the start of backward). Captures
of 1 and 2 blocks, which this used before the reductions' inputs were counted until their
waits, have no middle block and under-estimated the 25m model's peak by 6%.
``tests/test_planning.py`` checks every figure against a full capture (equal, not close).
What the rows cannot show is per-collective issue and wait node names for blocks 2..N-1;
``--fold off`` plans the whole model when those matter more than time.

Only ``nn.ModuleList`` / ``nn.Sequential`` containers whose children have the same type and the
same parameter and buffer shapes and dtypes count as repeated blocks; the model's forward must
iterate over the container (``for block in self.blocks``), as decoders do.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch.nn as nn

from zerofx.passes.plan import Plan
from zerofx.passes.analysis.analyze_schedule import CollectiveRow, ScheduleReport, format_summary, schedule_table, summary_json
from zerofx.common.limits import AUTO_FOLD_MIN_BLOCKS  # noqa: F401  (re-exported: zerofx.planner.folding names it)
from zerofx.common.units import format_bytes
from zerofx.common.fork import fork_is_safe, start_in_fork
from zerofx.common.errors import PlanError

log = logging.getLogger("zerofx.planner.folding")

# AUTO_FOLD_MIN_BLOCKS (zerofx.common.limits, where the command line's help reads it without torch):
# ``zerofx plan --fold auto`` folds models with at least that many repeated blocks.


@dataclass(frozen=True)
class RepeatedBlocks:
    """A container of identical blocks inside a model: its module path and length."""

    path: str
    count: int


def _block_signature(block: nn.Module) -> tuple:
    return (
        type(block),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()),
    )


def find_repeated_blocks(model: nn.Module, *, min_count: int = 2) -> RepeatedBlocks | None:
    """The container of identical blocks holding the most parameters, or None."""
    best: tuple[int, RepeatedBlocks] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < min_count:
            continue
        children = list(module)
        if len({_block_signature(c) for c in children}) != 1:
            continue
        numel = sum(p.numel() for p in module.parameters())
        if numel > 0 and (best is None or numel > best[0]):
            best = (numel, RepeatedBlocks(path, len(children)))
    return None if best is None else best[1]


def with_num_blocks(model: nn.Module, blocks: RepeatedBlocks, keep: int) -> nn.Module:
    """A shallow copy of ``model`` whose block container holds only its first ``keep`` blocks.

    The copy shares every parameter and submodule with ``model`` (nothing is allocated, and on
    the meta device nothing could be); only the modules on the path to the container are copied,
    so ``model`` itself is left unchanged.
    """
    if not 1 <= keep <= blocks.count:
        raise PlanError(f"keep={keep} blocks is outside 1..{blocks.count}")
    root = copy.copy(model)
    root._modules = dict(model._modules)  # copy.copy shares the child dict; detach it
    parent, original = root, model
    *parents, leaf = blocks.path.split(".")
    for name in parents:
        child = copy.copy(original._modules[name])
        child._modules = dict(original._modules[name]._modules)
        parent._modules[name] = child
        parent, original = child, original._modules[name]
    container = original._modules[leaf]
    parent._modules[leaf] = type(container)(*list(container)[:keep]) if isinstance(container, nn.Sequential) else nn.ModuleList(list(container)[:keep])
    return root


# The block counts of the two captures folding starts from (see NOTE [Why linear
# extrapolation is exact here]); NOTE [A window that spans blocks] says when it needs larger ones.
FOLD_BLOCKS = (2, 3)


def extrapolate(first: float, second: float, count: int, cuts: tuple[int, int] = FOLD_BLOCKS) -> float:
    """The value at ``count`` blocks of a quantity that is ``first`` and ``second`` at the block
    counts ``cuts``; ``second`` itself where the second cut is the whole model."""
    low, high = cuts
    if high >= count:
        return second
    return first + (count - low) * (second - first) / (high - low)


# Why a folded plan planned the whole model (``FoldedReport.whole_because``).
WINDOW_SPANS = "the prefetch window spans too many of them for copies cut short to show the whole model's peak"
TILED_APART = "copies cut to different lengths tile their blocks differently, so they do not extrapolate"


@dataclass(frozen=True)
class FoldedReport:
    """Whole-model figures extrapolated from two captures of the model cut short (``cuts`` blocks;
    the whole model's own where ``cuts[1]`` is its block count), and the 2-block capture's report,
    whose rows ``zerofx plan`` prints."""

    blocks: RepeatedBlocks
    sample: ScheduleReport  # the 2-block capture
    persistent_bytes: float
    peak_bytes: float
    bytes_moved_per_rank: float
    compute_s: Mapping[str, float]
    comm_s: float
    exposed_s: float
    step_s: float
    num_collectives: int
    micro_batch_s: float = 0.0  # NOTE [An optimizer step of several micro-batches] in passes/analysis/analyze_schedule.py
    repeats: Mapping[int, int] = field(default_factory=dict)  # row order -> times it repeats in the whole model
    peak_graph: str = ""
    cuts: tuple[int, int] = FOLD_BLOCKS  # the block counts the figures are extrapolated from
    whole_because: str = WINDOW_SPANS  # planned whole (``cuts`` at the block count): why
    graph_s: Mapping[str, float] = field(default_factory=dict)  # seconds per graph on the simulated timeline

    @property
    def peak_at(self) -> str:
        return f"the {self.peak_graph} graph"

    @property
    def planned_whole(self) -> bool:
        return self.cuts[1] >= self.blocks.count


def _is_block_one(row: CollectiveRow, blocks: RepeatedBlocks) -> bool:
    prefix = f"{blocks.path}.1." if blocks.path else "1."
    return bool(row.bucket) and all(f.startswith(prefix) for f in row.bucket)


def _graph_points(report: ScheduleReport, graph: str) -> list[int]:
    return [p.live_bytes for p in report.timeline if p.graph == graph]


def _per_block(p1: list[int], p2: list[int]) -> int:
    """What one more block keeps alive through a graph: read at its ends, where the nodes of
    two captures one block apart align."""
    return max(p2[0] - p1[0], p2[-1] - p1[-1], 0)


def _graph_peak(small: ScheduleReport, large: ScheduleReport, graph: str, count: int, high: int) -> float:
    """A graph's peak live bytes at ``count`` blocks: the larger capture's peak (``high`` blocks),
    grown by what each further block keeps alive."""
    p1, p2 = _graph_points(small, graph), _graph_points(large, graph)
    if not p2:
        return 0.0
    if not p1 or high >= count:
        return float(max(p2))
    return max(p2) + (count - high) * _per_block(p1, p2)


def unsteady_graphs(small: ScheduleReport, large: ScheduleReport) -> list[str]:
    """The graphs whose peak grew from ``small`` to ``large`` (captures one block apart) by other
    than what one block keeps alive: a window still filling (NOTE [A window that spans blocks])."""
    unsteady = []
    for graph in sorted({p.graph for p in large.timeline}):
        p1, p2 = _graph_points(small, graph), _graph_points(large, graph)
        if p1 and p2 and max(p2) - max(p1) != _per_block(p1, p2):
            unsteady.append(graph)
    return unsteady


def window_blocks(plan: Plan, blocks: RepeatedBlocks) -> int:
    """How many blocks ahead a stage-3 gather is issued: the prefetch distance in buckets, over
    the gather buckets of one block (block 1's), rounded up; 0 without prefetch."""
    prefix = f"{blocks.path}.1." if blocks.path else "1."
    per_block = sum(1 for b in plan.gather_buckets if b and all(f.startswith(prefix) for f in b))
    if plan.prefetch_distance <= 0 or per_block == 0:
        return 0
    return -(-plan.prefetch_distance // per_block)


def fold_reports(small: ScheduleReport, large: ScheduleReport, blocks: RepeatedBlocks, *,
                 cuts: tuple[int, int] = FOLD_BLOCKS, sample: ScheduleReport | None = None) -> FoldedReport:
    """Fold the reports of the captures with ``cuts`` blocks into the whole model's; ``sample``
    (default ``small``) is the 2-block capture whose rows are printed."""
    n = blocks.count

    def ex(a: float, b: float) -> float:
        return extrapolate(a, b, n, cuts)

    sample = small if sample is None else sample
    small_s, large_s = graph_seconds(small), graph_seconds(large)
    graphs = sorted(set(small.compute_s) | set(large.compute_s))
    peaks = {g: _graph_peak(small, large, g, n, cuts[1]) for g in {p.graph for p in large.timeline}}
    return FoldedReport(
        blocks=blocks,
        sample=sample,
        persistent_bytes=ex(small.persistent_bytes, large.persistent_bytes),
        # Per graph: a decoder's forward and backward peaks grow at different rates per block.
        peak_bytes=max(peaks.values()),
        bytes_moved_per_rank=ex(small.bytes_moved_per_rank, large.bytes_moved_per_rank),
        compute_s={g: ex(small.compute_s.get(g, 0.0), large.compute_s.get(g, 0.0)) for g in graphs},
        comm_s=ex(small.comm_s, large.comm_s),
        exposed_s=ex(small.exposed_s, large.exposed_s),
        step_s=ex(small.step_s, large.step_s),
        micro_batch_s=ex(small.micro_batch_s, large.micro_batch_s),
        graph_s={g: ex(small_s.get(g, 0.0), large_s.get(g, 0.0)) for g in {*small_s, *large_s}},
        num_collectives=round(ex(len(small.rows), len(large.rows))),
        peak_graph=max(peaks, key=peaks.__getitem__),
        repeats={r.order: n - 1 for r in sample.rows if _is_block_one(r, blocks)},
        cuts=cuts,
    )


def graph_seconds(report: ScheduleReport) -> dict[str, float]:
    """Seconds per graph of the report's simulated schedule."""
    seconds: dict[str, float] = {}
    for span in report.spans:
        seconds[span.graph] = seconds.get(span.graph, 0.0) + span.end_s - span.start_s
    return seconds


# NOTE [A window that spans blocks]
# A figure the captures grow linearly in is exact from any two cuts, but a peak is exact only
# once the larger cut holds a middle block whose collectives behave as in the whole model. A
# stage-3 gather prefetched d buckets ahead, with b gather buckets per block, is issued
# ceil(d / b) blocks before its block: in a cut shorter than that window plus the two end
# blocks, the buckets ahead run out before the window fills, the cut holds fewer gathered
# buckets than the whole model does at the same point, and each extra block grows the peak by
# more than it keeps alive, until the window fits. On the 100m DNA LM (14 blocks, one bucket
# per block, prefetch 4) the 3-block cut predicted 640 MiB for a backward the whole capture
# peaks at 804 MiB; the backward's peak grows by what a block keeps alive only from 6 blocks
# on, the forward's only from 7. Measured for windows w of 1 to 4 blocks (one and two buckets
# per block, prefetch 1 to 6), every graph's peak grew by what a block keeps alive from
# ``3 + w`` blocks on at the latest, sometimes from ``2 + w``; no rule in d and b alone says
# which. So folding keeps the first two cuts where the window is at most one block (there the
# 3-block cut's peaks were the whole model's in every case measured, though the 2-block cut's
# were not always, so checking the pair would cost captures for nothing). Otherwise it cuts at
# ``3 + w`` and ``4 + w`` blocks and checks, per graph, that the peak grew from the one to the
# other by exactly what a block keeps alive at the graph's ends (``unsteady_graphs``), growing
# both cuts by one while a graph's peak did not. Two cuts cost what
# the blocks they hold cost: where they would hold more than the whole model, the whole model
# is planned instead (the 100m above: 15 blocks in the cuts, 14 whole). ``tests/test_planning.py``
# checks the folded figures against full captures with prefetch windows of 1 to 4 blocks.
# NOTE [Tiling the same in every cut]
# Extrapolating from two cuts assumes each block of each cut is planned alike. Tiling "auto"
# fits each capture's tiles to that capture's own memory timeline (NOTE [Tiling checked against
# the memory timeline] in zerofx/planner/fit.py), so cuts of different lengths can tile their
# blocks differently. On the 100m DNA LM at 8k tokens, 4 ranks, stage 3, the 2-block cut left
# block 0's MLP region untiled where the 3-block cut tiled it in two blocks; the fold
# extrapolated an 856 MiB peak where the whole model, captured with the same config, peaks at
# 1.3 GiB. So the cuts' tiled ops are compared, counted by kind, op, shape and block size (a
# weight's name without its block index): what the larger cut tiles beyond the smaller must be
# a whole number of blocks' worth, and the smaller cut must tile all but its last block that
# way (the last block may differ: its region can reach into the head). Where not, the whole
# model is planned, and the report says why.
def same_tiling_per_block(small: Plan, large: Plan, blocks: RepeatedBlocks, cuts: tuple[int, int]) -> bool:
    """Whether the cuts of ``cuts`` blocks (plans ``small`` and ``large``) tile every block alike
    (NOTE [Tiling the same in every cut])."""
    pattern = re.compile(rf"(^|\b){re.escape(blocks.path)}\.\d+\." if blocks.path else r"^\d+\.")

    def counted(plan: Plan) -> Counter[tuple[Any, ...]]:
        ops = plan.tiling.ops if plan.tiling is not None else ()
        return Counter((o.kind, pattern.sub(f"{blocks.path}.*.", o.what), o.shape, o.block_size) for o in ops)

    low, high = cuts
    in_small, in_large = counted(small), counted(large)
    per_block: dict[tuple[Any, ...], int] = {}
    for key in in_small.keys() | in_large.keys():
        more = in_large[key] - in_small[key]
        if more < 0 or more % (high - low):
            return False
        per_block[key] = more // (high - low)
    return all(in_small[key] - (low - 1) * per_block[key] >= 0 for key in per_block)


def fold(blocks: RepeatedBlocks, report_at: Callable[[int], tuple[ScheduleReport, Plan]]) -> FoldedReport:
    """Fold the captures ``report_at(n)`` makes of the model cut to ``n`` blocks (the whole model
    at ``n == blocks.count``) into the whole model's figures (NOTE [A window that spans blocks],
    NOTE [Tiling the same in every cut])."""
    count = blocks.count
    if count < FOLD_BLOCKS[1]:
        raise PlanError(f"folding needs at least {FOLD_BLOCKS[1]} repeated blocks, {blocks.path!r} has {blocks.count}")
    got: dict[int, tuple[ScheduleReport, Plan]] = {}

    def at(n: int) -> tuple[ScheduleReport, Plan]:
        if n not in got:
            got[n] = report_at(n)
        return got[n]

    low, high = FOLD_BLOCKS
    (sample, small_plan), (large, plan) = at(low), at(high)
    if not same_tiling_per_block(small_plan, plan, blocks, (low, high)):
        log.info("folding: the cuts of %d and %d blocks tile their blocks differently; planning all %d", low, high, count)
        whole = at(count)[0]
        return replace(fold_reports(whole, whole, blocks, cuts=(count, count), sample=sample), whole_because=TILED_APART)
    window = window_blocks(plan, blocks)
    if window <= 1:
        return fold_reports(sample, large, blocks, cuts=FOLD_BLOCKS, sample=sample)
    # Measured, every peak settles by 3 + window blocks, often by 2 + window (see the NOTE). Two
    # cuts cost about what the blocks they hold cost: past the whole model's count, the whole
    # model is cheaper.
    high = max(3 + window, 4)
    while (high - 1) + high <= count:
        large, plan = at(high)
        small = at(high - 1)[0]
        unsteady = unsteady_graphs(small, large)
        if not unsteady and 2 + window_blocks(plan, blocks) <= high:
            return fold_reports(small, large, blocks, cuts=(high - 1, high), sample=sample)
        log.info("folding: the %s peak grows by more than a block keeps alive from %d to %d blocks",
                 "/".join(unsteady) or "prefetch window's", high - 1, high)
        high += 1
    whole = at(count)[0]
    return fold_reports(whole, whole, blocks, cuts=(count, count), sample=sample)


def plan_folded(
    model: nn.Module, blocks: RepeatedBlocks, report_for: Callable[[nn.Module], tuple[ScheduleReport, Plan]], *, parallel: bool = False
) -> FoldedReport:
    """Plan ``model`` by folding: ``report_for`` captures, plans and reports a (cut) model, and
    returns its report and plan.

    With ``parallel``, the 2-block capture runs in a forked child while this process plans the
    3-block one (NOTE [Planning the two captures in parallel])."""
    low, high = FOLD_BLOCKS
    if blocks.count < high:
        raise PlanError(f"folding needs at least {high} repeated blocks, {blocks.path!r} has {blocks.count}")
    small_cut = with_num_blocks(model, blocks, low)
    # Fork only a meta model: one with real weights may have run OpenMP kernels, whose thread
    # pool does not survive a fork.
    on_meta = all(p.is_meta for p in model.parameters())
    pending_small = _in_forked_child(report_for, small_cut) if parallel and on_meta else None
    first_large = report_for(with_num_blocks(model, blocks, high))

    def report_at(n: int) -> tuple[ScheduleReport, Plan]:
        if n == low:
            return pending_small() if pending_small is not None else report_for(small_cut)
        if n == high:
            return first_large
        return report_for(model if n >= blocks.count else with_num_blocks(model, blocks, n))

    return fold(blocks, report_at)


# NOTE [Planning the two captures in parallel]
# The two captures are independent and each is single-threaded Python (tracing, partitioning),
# so on a machine with two cores or more ``zerofx plan`` runs the 2-block one in a child
# process made by fork (NOTE [Work in a forked child] in zerofx/common/fork.py): it inherits the
# imported torch and the meta model for free, where a spawned process would pay the 6 s import
# again. The child pickles its ScheduleReport and Plan (plain dataclasses) through a pipe. Only a model
# on the meta device is forked: nothing has run a parallel ATen kernel then, so no OpenMP pool
# is copied half-alive. If the child fails or dies, the parent plans the 2-block model itself:
# the answer never depends on the fork.
def _in_forked_child(fn: Callable[[nn.Module], tuple[ScheduleReport, Plan]], arg: nn.Module) -> Callable[[], tuple[ScheduleReport, Plan]]:
    if (os.cpu_count() or 1) < 2 or not fork_is_safe(runs_kernels=False):  # a meta model: no kernel runs
        return lambda: fn(arg)
    wait = start_in_fork(lambda: pickle.dumps(fn(arg)))  # NOTE [Work in a forked child]

    def result() -> tuple[ScheduleReport, Plan]:
        got = wait(None)
        if got is None or got.payload is None:
            why = "it died" if got is None else f"{got.error[0]}: {got.error[1]}"
            log.info("the forked 2-block capture failed (%s); planning it in this process", why)
            return fn(arg)
        return pickle.loads(got.payload)

    return result


def format_folded(report: FoldedReport, *, budget_bytes: float | None = None, verbose: bool = False, step_note: str = "",
                  micro_batches: int = 1) -> str:
    """The 2-block capture's schedule, with how often each row repeats in the whole model, then
    the whole model's memory and summary (extrapolated); as ``format_report``, with the same
    ``verbose`` and ``step_note``."""
    b = report.blocks
    how = "planned whole" if report.planned_whole else "extrapolated"
    lines = [
        f"communication schedule of the 2-block copy (one row per collective, in issue order; sizes per rank, times in ms, "
        f"estimated{'' if verbose else '; --verbose adds the FX node names'}). Rows marked x{b.count - 1} are block 1's: "
        f"blocks 1..{b.count - 1} each issue them; the whole model issues {report.num_collectives} collectives.",
        schedule_table(report.sample.rows, verbose=verbose, repeats=report.repeats),
        "",
        f"memory per rank ({b.count} blocks, {how}): persistent model state {format_bytes(report.persistent_bytes)}, "
        f"peak {format_bytes(report.peak_bytes)} in {report.peak_at}",
    ]
    if budget_bytes is not None:
        verdict = "fits" if report.peak_bytes <= budget_bytes else "does NOT fit"
        lines.append(f"budget {format_bytes(budget_bytes)}: {verdict}")
    lines.append(format_summary(report, f"summary ({b.count} blocks, {how})", step_note=step_note, micro_batches=micro_batches))
    return "\n".join(lines)


def folded_json(report: FoldedReport, plan_json: Mapping, budget_bytes: float | None, *, micro_batches: int = 1) -> dict:
    """The same keys as an unfolded ``zerofx plan --format json``, plus ``folded``."""
    b = report.blocks
    return {
        "folded": {"path": b.path, "num_blocks": b.count, "captured_blocks": list(dict.fromkeys(report.cuts)), "num_collectives": report.num_collectives},
        "plan": plan_json,  # of the 3-block capture (zerofx plan prints that one)
        "schedule": [{**r.__dict__, "repeats": report.repeats.get(r.order, 1)} for r in report.sample.rows],
        "memory": {
            "persistent_bytes": report.persistent_bytes,
            "peak_bytes": report.peak_bytes,
            "peak_at": report.peak_at,
            "budget_bytes": budget_bytes,
            "fits": None if budget_bytes is None else report.peak_bytes <= budget_bytes,
        },
        "summary": summary_json(report, micro_batches=micro_batches),
    }
