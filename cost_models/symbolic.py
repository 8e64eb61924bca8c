"""Symbolic memory: per-node live bytes as exact polynomials in the sequence length.

Every tensor size in a transformer step is a product of dimensions, so the bytes alive at a
given node are a polynomial in the sequence length T of low degree (degree 2 where an explicit
T x T score matrix exists, 1 with fused attention). Knowing the values at ``degree + 1`` sample
lengths fixes the polynomial exactly (Lagrange interpolation over the rationals, with sympy);
one more sample checks it. The peak over the step is the max over nodes of these polynomials.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sympy

T = sympy.Symbol("T", positive=True, integer=True)


def fit_exact(samples: Mapping[int, int], degree: int = 2) -> sympy.Expr:
    """The polynomial of at most ``degree`` through the first ``degree + 1`` samples; raises
    ValueError if a further sample disagrees (the sizes are not polynomial in T)."""
    points = sorted(samples.items())
    if len(points) < degree + 2:
        raise ValueError(f"need {degree + 2} samples to fit and check a degree-{degree} polynomial, got {len(points)}")
    expr = sympy.expand(sympy.interpolate([(x, sympy.Integer(y)) for x, y in points[: degree + 1]], T))
    for x, y in points[degree + 1 :]:
        if expr.subs(T, x) != y:
            raise ValueError(f"live bytes are not a degree-{degree} polynomial in T: predicted {expr.subs(T, x)} at T={x}, measured {y}")
    return expr


def fit_timeline(timelines: Mapping[int, Sequence[int]], degree: int = 2) -> list[sympy.Expr]:
    """One polynomial per node from each sample length's per-node live bytes (aligned lists)."""
    lengths = {len(v) for v in timelines.values()}
    if len(lengths) != 1:
        raise ValueError("the graphs differ between sample lengths; cannot fit node by node")
    fitted: dict[tuple[int, ...], sympy.Expr] = {}  # many nodes share their sample values
    out = []
    for i in range(lengths.pop()):
        key = tuple(values[i] for values in timelines.values())
        if key not in fitted:
            fitted[key] = fit_exact(dict(zip(timelines.keys(), key)), degree)
        out.append(fitted[key])
    return out


def longest_fitting(exprs: Sequence[sympy.Expr], budget_bytes: float, *, upper: int) -> int:
    """The largest integer T in [0, upper] with every node's live bytes within the budget."""
    lo, hi = 0, upper

    def fits(t: int) -> bool:
        return all(e.subs(T, t) <= budget_bytes for e in exprs)

    if not fits(lo):
        return 0
    # Live bytes grow with T (sizes are products of non-negative dimensions): bisect.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
