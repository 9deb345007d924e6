"""Accuracy Under Parallelism (AUP), diffusion spec §10 (d3LLM, arXiv 2601.07568).

AUP is the area under the accuracy-vs-parallelism curve, where parallelism ρ is tokens per
forward (TPF) and accuracy y is in percent. The d3LLM variant weights each trapezoid's
heights by W(y) = min(exp(−α·(1 − y/y_max)), 1), so accuracy lost to parallelism costs more
than linearly, and prefixes an unweighted rectangle ρ_1·y_1.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal, NamedTuple, Sequence

from unmask.errors import UnmaskError


def _is_number(value) -> bool:
    """A real number: int or float, not bool (True would score as 1 %), not a string."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _point(p) -> tuple[float, float]:
    """One (ρ, y) point as floats; UnmaskError for anything but a pair of real numbers."""
    if not (isinstance(p, (tuple, list)) and len(p) == 2 and all(_is_number(v) for v in p)):
        raise UnmaskError(f"aup: each point must be a (tpf, accuracy) pair of numbers, got {p!r}; "
                          "pass [(tpf, accuracy_percent), ...]")
    return float(p[0]), float(p[1])


def aup_weight(y: float, *, y_max: float, alpha: float = 3.0) -> float:
    """W(y) = min(exp(−α·(1 − y / y_max)), 1) (diffusion spec §10, step 3)."""
    return min(math.exp(-alpha * (1.0 - y / y_max)), 1.0)


class AUPReport(NamedTuple):
    """An AUP value and the points d3LLM's filter dropped (y < y_1 − y_min_offset), as (ρ, y)."""

    value: float
    dropped: list[tuple[float, float]]


Unit = Literal["auto", "percent", "fraction"]
UNITS = ("auto", "percent", "fraction")


def aup(points: Sequence[tuple[float, float]], y_max: float, alpha: float = 3.0,
        y_min_offset: float = 5.0,
        variant: Literal["d3llm", "trapezoid"] = "d3llm", unit: Unit = "auto") -> float:
    """Accuracy Under Parallelism of one method on one task (diffusion spec §10).

    The value of :func:`aup_report`; dropped points are reported with a one-line warning.

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
        unit: how the accuracies (and ``y_max``) are given. ``"percent"``: as they are.
            ``"fraction"``: in [0, 1], multiplied by 100 first. ``"auto"`` (default): percent,
            but when every accuracy and ``y_max`` lie in [0, 1] the input is ambiguous (0.72 is
            far more often a fraction than 0.72 %) and is refused; pass the unit to settle it.

    Returns:
        AUP in units of TPF × percent. A single point (1, y) scores y in the d3llm variant.

    Raises:
        UnmaskError: no points, a point that is not a pair of numbers (strings and bools are
            refused), ρ ≤ 0 or not finite, y outside [0, 100] (percent, not a fraction), every y
            and y_max in [0, 1] with ``unit="auto"``, accuracies in (0, 1) next to ones above 1
            with ``unit="auto"`` (fractions mixed with percent), alpha or y_min_offset negative or
            not finite, y outside [0, 1] with
            ``unit="fraction"``, an unknown unit,
            y_max outside (0, 100] or below the best y of the points, an unknown variant, or
            (d3llm) accuracy at the largest ρ more than ``y_min_offset`` below y_1, which d3LLM
            asserts against.
    """
    report = aup_report(points, y_max, alpha=alpha, y_min_offset=y_min_offset, variant=variant, unit=unit)
    if report.dropped:
        shown = ", ".join(f"({r:g}, {y:g})" for r, y in report.dropped)
        warnings.warn(f"aup: dropped {len(report.dropped)} point(s) more than {y_min_offset:g} below the accuracy "
                      f"at the smallest TPF: {shown}", stacklevel=2)
    return report.value


def aup_report(points: Sequence[tuple[float, float]], y_max: float, *, alpha: float = 3.0,
               y_min_offset: float = 5.0, variant: Literal["d3llm", "trapezoid"] = "d3llm",
               unit: Unit = "auto") -> AUPReport:
    """:func:`aup` with the dropped points returned instead of warned about (same arguments, same errors).

    With ``unit="fraction"`` the points in the report (``dropped``) are in percent too."""
    if not points:
        raise UnmaskError("aup needs at least one (tpf, accuracy) point")
    if unit not in UNITS:
        raise UnmaskError(f"aup: unknown unit {unit!r}; use one of {', '.join(UNITS)}")
    if not _is_number(y_max):
        raise UnmaskError(f"aup: y_max must be a number (percent), got {y_max!r}; pass the best accuracy over "
                          "all methods on the task")
    pts = sorted((_point(p) for p in points), key=lambda p: p[0])
    for name, value in (("alpha", alpha), ("y_min_offset", y_min_offset)):
        if not (_is_number(value) and math.isfinite(value) and value >= 0):
            raise UnmaskError(f"aup: {name} must be a finite number >= 0, got {value!r}; "
                              f"use the default ({3.0 if name == 'alpha' else 5.0:g})")
    if unit == "fraction":
        for _, y in pts:
            if not (math.isfinite(y) and 0 <= y <= 1):
                raise UnmaskError(f"aup: with unit 'fraction' accuracy must be in [0, 1], got {y}; "
                                  "pass unit='percent' for percentages")
        pts = [(r, 100.0 * y) for r, y in pts]
        y_max = 100.0 * float(y_max) if isinstance(y_max, (int, float)) and math.isfinite(y_max) else y_max
    elif unit == "auto" and all(0 <= y <= 1 for _, y in pts) and (variant == "trapezoid" or 0 <= y_max <= 1):
        raise UnmaskError("aup: every accuracy is in [0, 1], which looks like fractions, but AUP takes percent; "
                          "multiply by 100, or pass unit='fraction' (or unit='percent' if they are percent)")
    elif unit == "auto" and any(0 < y < 1 for _, y in pts) and any(y > 1 for _, y in pts):
        raise UnmaskError("aup: some accuracies are in (0, 1) and others above 1, which looks like fractions mixed "
                          "with percent; give every accuracy in percent (or pass unit='percent' if they are)")
    for r, y in pts:
        if not (math.isfinite(r) and r > 0):
            raise UnmaskError(f"aup: TPF must be a finite number > 0, got {r}; drop that point")
        if not (math.isfinite(y) and 0 <= y <= 100):
            raise UnmaskError(f"aup: accuracy must be in percent, in [0, 100], got {y}; multiply fractions by 100")
    if variant == "trapezoid":
        return AUPReport(sum(0.5 * (r1 - r0) * (y0 + y1) for (r0, y0), (r1, y1) in zip(pts, pts[1:])), [])
    if variant != "d3llm":
        raise UnmaskError(f"aup: unknown variant {variant!r}; use 'd3llm' or 'trapezoid'")
    if not (math.isfinite(y_max) and 0 < y_max <= 100):
        raise UnmaskError(f"aup: y_max must be in percent, in (0, 100], got {y_max}; multiply fractions by 100")
    best = max(y for _, y in pts)
    if y_max < best:
        raise UnmaskError(f"aup: y_max {y_max:g} is below the best accuracy of the points ({best:g}); pass the "
                          "best accuracy over all methods on the task")
    y_first, y_last = pts[0][1], pts[-1][1]
    if y_first - y_last > y_min_offset:
        raise UnmaskError(f"aup: accuracy at the largest TPF ({y_last:.2f}) is more than "
                          f"{y_min_offset:g} points below the first ({y_first:.2f})")
    dropped = [p for p in pts if p[1] < y_first - y_min_offset]
    pts = [p for p in pts if p[1] >= y_first - y_min_offset]
    wy = [y * aup_weight(y, y_max=y_max, alpha=alpha) for _, y in pts]
    total = pts[0][0] * pts[0][1]  # the leading rectangle is unweighted
    for i in range(1, len(pts)):
        total += 0.5 * (pts[i][0] - pts[i - 1][0]) * (wy[i] + wy[i - 1])
    return AUPReport(total, dropped)
