"""Accuracy Under Parallelism (AUP), diffusion spec §10 (d3LLM, arXiv 2601.07568).

AUP is the area under the accuracy-vs-parallelism curve, where parallelism ρ is tokens per
forward (TPF) and accuracy y is in percent. The d3LLM variant weights each trapezoid's
heights by W(y) = min(exp(−α·(1 − y/y_max)), 1), so accuracy lost to parallelism costs more
than linearly, and prefixes an unweighted rectangle ρ_1·y_1.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

from unmask.errors import UnmaskError


def aup_weight(y: float, *, y_max: float, alpha: float = 3.0) -> float:
    """W(y) = min(exp(−α·(1 − y / y_max)), 1) (diffusion spec §10, step 3)."""
    return min(math.exp(-alpha * (1.0 - y / y_max)), 1.0)


def aup(points: Sequence[tuple[float, float]], y_max: float, alpha: float = 3.0,
        y_min_offset: float = 5.0,
        variant: Literal["d3llm", "trapezoid"] = "d3llm") -> float:
    """Accuracy Under Parallelism of one method on one task (diffusion spec §10).

    Args:
        points: (ρ, y) pairs: ρ = TPF (tokens per forward, > 0), y = accuracy in percent.
            Sorted ascending by ρ with a stable sort, so ties keep their input order.
        y_max: the best accuracy over *all* methods' points on this task (percent, > 0).
        alpha: weight steepness α of W(y).
        y_min_offset: points with y < y_1 − offset are dropped (y_1: accuracy at the
            smallest ρ).
        variant: ``"d3llm"`` (default) is
            ρ_1·y_1 + Σ_{i≥2} ½·(ρ_i − ρ_{i−1})·(y_i·W(y_i) + y_{i−1}·W(y_{i−1}));
            ``"trapezoid"`` is the plain Σ ½·(ρ_{i+1} − ρ_i)·(y_i + y_{i+1}) of
            arXiv 2606.29215 eq. 4.1 (no rectangle, no weight, no filter, so one point
            scores 0; ``y_max``, ``alpha`` and ``y_min_offset`` are unused).

    Returns:
        AUP in units of TPF × percent. A single point (1, y) scores y in the d3llm variant.

    Raises:
        UnmaskError: no points, ρ ≤ 0, y_max ≤ 0, an unknown variant, or (d3llm) accuracy at
            the largest ρ more than ``y_min_offset`` below y_1, which d3LLM asserts against.
    """
    if not points:
        raise UnmaskError("aup needs at least one (tpf, accuracy) point")
    pts = sorted(((float(r), float(y)) for r, y in points), key=lambda p: p[0])
    if pts[0][0] <= 0:
        raise UnmaskError(f"aup: TPF must be > 0, got {pts[0][0]}")
    if variant == "trapezoid":
        return sum(0.5 * (r1 - r0) * (y0 + y1) for (r0, y0), (r1, y1) in zip(pts, pts[1:]))
    if variant != "d3llm":
        raise UnmaskError(f"aup: unknown variant {variant!r}; use 'd3llm' or 'trapezoid'")
    if y_max <= 0:
        raise UnmaskError(f"aup: y_max must be > 0 (percent), got {y_max}")
    y_first, y_last = pts[0][1], pts[-1][1]
    if y_first - y_last > y_min_offset:
        raise UnmaskError(f"aup: accuracy at the largest TPF ({y_last:g}) is more than "
                          f"{y_min_offset:g} points below the first ({y_first:g})")
    pts = [p for p in pts if p[1] >= y_first - y_min_offset]
    wy = [y * aup_weight(y, y_max=y_max, alpha=alpha) for _, y in pts]
    total = pts[0][0] * pts[0][1]  # the leading rectangle is unweighted
    for i in range(1, len(pts)):
        total += 0.5 * (pts[i][0] - pts[i - 1][0]) * (wy[i] + wy[i - 1])
    return total
