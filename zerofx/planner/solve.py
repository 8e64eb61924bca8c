"""What fits: the largest sequence length or batch size whose step fits a memory budget per
rank (``zerofx plan --solve``), from the memory model in B and T (``cost_models/symbolic.py``),
confirmed by capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.nn as nn

from zerofx.cost_models.memory_timeline import TimelinePoint
from zerofx.cost_models.symbolic import B, T, fit_timeline, fit_timeline_batch_seq, longest_fitting
from zerofx.compiler import plan_cache
from zerofx.common.errors import CaptureError, ZeroFXError
from zerofx.compiler.capture import StepTracer
from zerofx.passes._compat import pytree
from zerofx.compiler.program import Program, compile, resolve


@dataclass(frozen=True)
class ModelSpec:
    """A model and the example inputs it is planned at; ``label`` names it in messages."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    label: str


def with_seq_len(value: Any, old: int, new: int) -> Any:
    """``value`` with every tensor whose dim 1 is the sequence (``old``) resized to ``new``."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == old:
        shape = list(value.shape)
        shape[1] = new
        return torch.zeros(shape, dtype=value.dtype, device=value.device)
    if isinstance(value, tuple):
        return tuple(with_seq_len(v, old, new) for v in value)
    if isinstance(value, dict):
        return {k: with_seq_len(v, old, new) for k, v in value.items()}
    return value


def with_batch_size(value: Any, old: int, new: int) -> Any:
    """``value`` with every tensor whose dim 0 is the batch (``old``) resized to ``new``."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == old:
        return torch.zeros((new, *value.shape[1:]), dtype=value.dtype, device=value.device)
    if isinstance(value, tuple):
        return tuple(with_batch_size(v, old, new) for v in value)
    if isinstance(value, dict):
        return {k: with_batch_size(v, old, new) for k, v in value.items()}
    return value


SOLVABLE = {"seq_len": T, "batch_size": B}
# How far a sample may stray from the fitted polynomial (NOTE [Why a tolerance] in cost_models/symbolic.py).
SOLVE_REL_TOL = 1e-3
PEAK_REL_TOL = 0.05


@dataclass(frozen=True)
class SolveResult:
    variable: str  # "seq_len" or "batch_size"
    value: int  # the largest that fits; 0 when even the smallest does not
    peak_expr: sympy.Expr  # bytes at the peak node, a polynomial in B and T (in T alone where only the example's batch fits)
    peak_node: str
    samples: tuple[tuple[int, int], ...]  # the (batch, seq_len) points captured
    sequence_parallel: int = 1  # the config's sequence-parallel size S: seq_len is a multiple of it, per rank T/S
    # The confirming captures (NOTE [Why a tolerance] in cost_models/symbolic.py): the measured
    # peak at the answer, and at one unit past it (None where that was not captured: an answer
    # of 0, or one at the upper bound).
    peak_at_value: int | None = None
    peak_past_value: int | None = None

    @property
    def seq_len(self) -> int:
        assert self.variable == "seq_len"
        return self.value


# NOTE [Solving for the context under sequence parallelism]
# With zerofx.sequence_parallel.size S, every capture is of the rewritten step (passes/
# sequence_parallel.py), so the timeline is one rank's: token-wise activations of T/S
# positions, and attention as the rewrite runs it (Ulysses: (B, H/S, T, D), the same bytes as
# (B, H, T/S, D)). The fit and the answer are per rank at that S; model state is ZeRO's over all
# N ranks at any S. The rewrite refuses a length S does not divide, so the samples, the bound
# and the confirming captures are multiples of S, and the answer is the largest multiple of S
# that fits.
def sequence_parallel_size(config: Any, *, world_size: int, stage: int) -> int:
    """The config's ``zerofx.sequence_parallel.size``, 1 without it."""
    spec = resolve(config, stage=stage, world_size=world_size).sequence_parallel
    return 1 if spec is None else spec.size


# NOTE [Solve samples in the plan cache]
# A solve captures, plans and lowers its model at eleven or more (batch, length) points, seconds
# each. Each sample's lowered program goes into the plan cache (docs/plan-cache.md), keyed as the
# engine keys its programs (NOTE [What a plan-cache key covers] in zerofx/compiler/plan_cache.py) and
# marked as planned without a process group, so another solve of the same model, config and
# world (another budget, the other variable, a second run of ``zerofx plan --solve``) reads the
# samples it shares instead of capturing them again. A read program's memory timeline is the
# built one's, node for node (the plan cache's tests check its schedule report). With the
# cache off (``zerofx.compiler.plan_cache: false``, ``ZEROFX_PLAN_CACHE=off``) every sample is captured.
def sample_program(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, world_size: int, stage: int, config: Any,
                   rank: int = 0) -> Program:
    """``zerofx.compile(model, ...)`` with these example inputs, lowered for ``rank``, read from
    the plan cache when a solve stored it there before (NOTE [Solve samples in the plan cache])."""
    cfg = resolve(config, stage=stage, world_size=world_size)

    def build() -> Program:
        return compile(model, world_size=world_size, stage=stage, config=config, example_inputs=args, example_kwargs=kwargs)

    if cfg.plan_cache_dir is None:
        return build()
    try:  # NOTE [The recorded forward is in the key] in zerofx/compiler/plan_cache.py
        forward = plan_cache.graph_digest(StepTracer(model, args, kwargs).record())
    except CaptureError:
        return build()
    leaves, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
    signature = (repr(tree), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("const", repr(x)) for x in leaves))
    key = plan_cache.cache_key(model=model, input_signature=signature, loss_fn=None, cfg=cfg, world_size=world_size, rank=rank,
                               backend="none", device=torch.device("cpu"), program_options={"planned by": "zerofx.compile"},
                               forward=forward)
    return plan_cache.load_or_build(cfg.plan_cache_dir, key, build, rank=rank, program_options={}, trust=cfg.plan_cache_trust,
                                    key_file=cfg.plan_cache_key_file)


def solve_memory(
    spec: ModelSpec, variable: str, *, world_size: int, stage: int, config: Any, budget_bytes: float, upper: int, rank: int = 0
) -> SolveResult:
    """The largest ``seq_len`` (at the example's batch size) or ``batch_size`` (at its sequence
    length) whose whole-step peak memory per rank fits ``budget_bytes``.

    Captures the step at four sequence lengths and two batch sizes, plus one more batch size as a
    check, fits each node's live bytes as a polynomial in B and T (``cost_models.symbolic``),
    solves against the budget, and confirms the answer by capturing at it and one past it. Where
    the partitioner saves different values at different sizes, nodes do not align across the
    samples and the step's peak is fitted instead (for ``seq_len``, first each node in T at the
    example's batch alone); the confirmation then searches from there. Under sequence
    parallelism the lengths are multiples of its size (NOTE [Solving for the context under
    sequence parallelism]).
    """
    if variable not in SOLVABLE:
        raise ZeroFXError(f"cannot solve for {variable!r}; accepted: {', '.join(SOLVABLE)}")
    example = [t for t in [*spec.args, *spec.kwargs.values()] if isinstance(t, torch.Tensor) and t.dim() >= 2]
    if not example:
        raise ZeroFXError(f"--solve {variable} needs an example input of shape (batch, seq_len, ...)")
    batch, seq = example[0].shape[0], example[0].shape[1]
    sp_size = sequence_parallel_size(config, world_size=world_size, stage=stage)
    base = -(-max(8, min(seq, 64)) // sp_size) * sp_size  # rounded up to a multiple of S
    samples = [(b, t) for b in (batch, 2 * batch) for t in (base, 2 * base, 3 * base, 4 * base)] + [(3 * batch, base)]

    def timeline(b: int, t: int) -> list[TimelinePoint]:
        args = with_batch_size(with_seq_len(spec.args, seq, t), batch, b)
        kwargs = with_batch_size(with_seq_len(dict(spec.kwargs), seq, t), batch, b)
        program = sample_program(spec.model, args, kwargs, world_size=world_size, stage=stage, config=config, rank=rank)
        return list(program.report(rank).timeline)

    timelines, names_at = {}, {}
    for b, t in samples:
        points = timeline(b, t)
        timelines[(b, t)] = [p.live_bytes for p in points]
        names_at[(b, t)] = [f"{p.graph}:{p.node}" for p in points]
    names = names_at[samples[-1]]
    exprs = None
    try:
        exprs = fit_timeline_batch_seq(timelines, rel_tol=SOLVE_REL_TOL)
    except ValueError:
        if variable == "seq_len":
            # The graphs at the example batch may differ from those at the others (at B = 1 a
            # permute can be contiguous already, so its copy is not made; Ulysses' exchange with
            # one head per rank is one): the answer needs each node in T at that batch alone.
            with contextlib.suppress(ValueError):
                exprs = fit_timeline({t: v for (b, t), v in timelines.items() if b == batch}, rel_tol=SOLVE_REL_TOL)
                names = names_at[(batch, base)]
    if exprs is None:
        # The partitioner saved different values at some sample, so nodes do not align across
        # samples: fit the step's peak itself instead (the answer is confirmed by capture below).
        peaks = {k: [max(v)] for k, v in timelines.items()}
        try:
            exprs = fit_timeline_batch_seq(peaks, rel_tol=PEAK_REL_TOL)
        except ValueError as exc:
            raise ZeroFXError(f"--solve {variable}: peak memory is not polynomial in batch and sequence length for this model ({exc})") from exc
        names = ["(the step's peak, wherever it is)"]
    unique = sorted(set(exprs), key=str)
    symbol = SOLVABLE[variable]
    fixed = {B: batch} if symbol is T else {T: seq}
    unit = sp_size if symbol is T else 1  # the answer and every capture are multiples of it
    best = longest_fitting(unique, budget_bytes, upper=upper, symbol=symbol, fixed=fixed) // unit
    top = upper // unit

    measured: dict[int, int] = {}

    def fits(x: int) -> bool:  # x in units: a sequence of x * S tokens
        b, t = (batch, x * unit) if symbol is T else (x, seq)
        measured[x] = max(p.live_bytes for p in timeline(b, t))
        return measured[x] <= budget_bytes

    # Confirm by capture (NOTE [Why a tolerance] in cost_models/symbolic.py): find lo that fits
    # and hi that does not around the estimate, galloping away from it, then bisect. When the
    # fit was right, two captures.
    lo, hi, step = best, best + 1, 1
    while lo > 0 and not fits(lo):
        hi, lo, step = lo, max(0, lo - step), step * 2
    while hi <= top and fits(hi):
        lo, hi, step = hi, min(top + 1, hi + step), step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    best = lo * unit
    at = {**fixed, symbol: max(best, 1)}
    peak_index = max(range(len(exprs)), key=lambda i: exprs[i].subs(at))
    return SolveResult(variable, best, exprs[peak_index], names[peak_index], tuple(samples), sp_size,
                       peak_at_value=measured.get(lo), peak_past_value=measured.get(hi))


def solve_seq_len(
    spec: ModelSpec, *, world_size: int, stage: int, config: Any, budget_bytes: float, max_seq_len: int, rank: int = 0
) -> SolveResult:
    """The longest sequence length that fits (``solve_memory(spec, "seq_len", ...)``)."""
    return solve_memory(spec, "seq_len", world_size=world_size, stage=stage, config=config, budget_bytes=budget_bytes,
                        upper=max_seq_len, rank=rank)
