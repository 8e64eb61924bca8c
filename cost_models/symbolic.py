"""Symbolic memory: per-node live bytes as exact polynomials in the batch size and sequence length.

Every tensor size in a transformer step is a product of dimensions, so the bytes alive at a
given node are a polynomial in the sequence length T of low degree (degree 2 where an explicit
T x T score matrix exists, 1 with fused attention). Knowing the values at ``degree + 1`` sample
lengths fixes the polynomial exactly (Lagrange interpolation over the rationals, with sympy);
one more sample checks it. The peak over the step is the max over nodes of these polynomials.

In the batch size B every activation is linear (one batch dimension per tensor; parameters and
their gradients do not have one), so a node's bytes are ``c(T) + B * a(T)``: two batch sizes
fix it, a third checks it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sympy
from zerofx.common.errors import PlanError

T = sympy.Symbol("T", positive=True, integer=True)
B = sympy.Symbol("B", positive=True, integer=True)


def fit_exact(samples: Mapping[int, int], degree: int = 2, *, rel_tol: float = 0.0) -> sympy.Expr:
    """The polynomial of at most ``degree`` through the first ``degree + 1`` samples; raises
    ValueError if a further sample disagrees by more than ``rel_tol`` (the sizes are not
    polynomial in T)."""
    points = sorted(samples.items())
    if len(points) < degree + 2:
        raise PlanError(f"need {degree + 2} samples to fit and check a degree-{degree} polynomial, got {len(points)}")
    expr = sympy.expand(sympy.interpolate([(x, sympy.Integer(y)) for x, y in points[: degree + 1]], T))
    for x, y in points[degree + 1 :]:
        if abs(expr.subs(T, x) - y) > rel_tol * abs(y):
            raise PlanError(f"live bytes are not a degree-{degree} polynomial in T: predicted {expr.subs(T, x)} at T={x}, measured {y}")
    return expr


def fit_timeline(timelines: Mapping[int, Sequence[int]], degree: int = 2, *, rel_tol: float = 0.0) -> list[sympy.Expr]:
    """One polynomial per node from each sample length's per-node live bytes (aligned lists)."""
    lengths = {len(v) for v in timelines.values()}
    if len(lengths) != 1:
        raise PlanError("the graphs differ between sample lengths; cannot fit node by node")
    fitted: dict[tuple[int, ...], sympy.Expr] = {}  # many nodes share their sample values
    out = []
    for i in range(lengths.pop()):
        key = tuple(values[i] for values in timelines.values())
        if key not in fitted:
            fitted[key] = fit_exact(dict(zip(timelines.keys(), key)), degree, rel_tol=rel_tol)
        out.append(fitted[key])
    return out


def fit_timeline_batch_seq(
    timelines: Mapping[tuple[int, int], Sequence[int]], degree: int = 2, *, rel_tol: float = 0.0
) -> list[sympy.Expr]:
    """One polynomial in B and T per node from per-node live bytes sampled at ``(batch, seq_len)``
    points: at two batch sizes, ``degree + 2`` lengths each (fit and check in T); samples at any
    further batch size check linearity in B, to within ``rel_tol``. Raises ValueError where a
    check fails.

    NOTE [Why a tolerance]
    The sizes are exact polynomials, but which values backward saves is the min-cut
    partitioner's choice, weighted by those sizes, so at another batch size it may save a
    slightly different set: the node then holds a few bytes more or less than the polynomial.
    Callers that must be exact (``zerofx.planner.solve.solve_memory``) confirm their answer by capture.
    """
    by_batch: dict[int, dict[int, Sequence[int]]] = {}
    for (b, t), values in timelines.items():
        by_batch.setdefault(b, {})[t] = values
    fitted = sorted(b for b, runs in by_batch.items() if len(runs) >= degree + 2)
    if len(fitted) < 2:
        raise PlanError(f"need {degree + 2} sequence lengths at each of two batch sizes, got {sorted(timelines)}")
    b0, b1 = fitted[:2]
    in_t = {b: fit_timeline(by_batch[b], degree, rel_tol=rel_tol) for b in (b0, b1)}
    exprs = [sympy.expand(e0 + (B - b0) * (e1 - e0) / (b1 - b0)) for e0, e1 in zip(in_t[b0], in_t[b1])]
    for (b, t), values in timelines.items():
        if b in (b0, b1):
            continue
        for i, (expr, value) in enumerate(zip(exprs, values)):
            if abs(expr.subs({B: b, T: t}) - value) > rel_tol * abs(value):
                raise PlanError(f"live bytes at node {i} are not linear in B: predicted {expr.subs({B: b, T: t})} at B={b}, T={t}, measured {value}")
    return exprs


def longest_fitting(
    exprs: Sequence[sympy.Expr], budget_bytes: float, *, upper: int, symbol: sympy.Symbol = T,
    fixed: Mapping[sympy.Symbol, int] | None = None,
) -> int:
    """The largest integer value of ``symbol`` in [0, upper] with every node's live bytes within
    the budget, the other symbols held at ``fixed``."""
    lo, hi = 0, upper
    bound = [e.subs(dict(fixed or {})) for e in exprs]

    def fits(x: int) -> bool:  # exact: sympy integers and rationals, no float rounding at the boundary
        return all(e.subs(symbol, x) <= budget_bytes for e in bound)

    if not fits(lo):
        return 0
    # Live bytes grow with B and T (sizes are products of non-negative dimensions): bisect.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
