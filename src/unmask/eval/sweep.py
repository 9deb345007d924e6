"""Quality–parallelism sweeps: one evaluation per value of a commit-policy parameter, the
Pareto plot and the AUP score (diffusion spec §10).

Every point is a full :func:`unmask.eval.runner.evaluate` run on the same model, prompts and
judge (loaded once). The quality axis is a summary metric in percent (the task's default,
:data:`unmask.eval.tasks.TASKS`): ``flexible_pct`` for gsm8k, ``pass_at_1_pct`` for code and,
for stories, ``judge_prob_pct`` = 100·exp(−NLL) under the judge, or ``agreement_pct`` with
the AR output. AUP takes the points (TPF, quality) with ``y_max`` = the best quality of this
sweep unless given (d3LLM takes it over all methods on the task; pass it to compare methods).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from unmask.decode.engine.registry import knob_types
from unmask.errors import UnmaskError
from unmask.threads import scoped
from unmask.eval import tasks as T
from unmask.eval.aup import aup_report
from unmask.fileio import atomic_savefig
from unmask.eval.runner import EvalResult, Progress, References, _load, evaluate

SWEEP_PARAMS = {"gamma": "entropy-bound", "tau": "threshold", "factor": "factor", "tokens_per_step": "top-k"}


def parse_values(param: str, values: str | Sequence[float]) -> list[float | int]:
    """``"0,0.1,0.35"`` → ``[0.0, 0.1, 0.35]`` (integers for ``tokens_per_step``).

    Raises :class:`UnmaskError` for an unknown parameter, an empty list, a non-number or a
    repeated value."""
    if param not in SWEEP_PARAMS:
        raise UnmaskError(f"unknown sweep parameter {param!r}; choose one of: {', '.join(SWEEP_PARAMS)}")
    raw = [v.strip() for v in values.split(",") if v.strip()] if isinstance(values, str) else list(values)
    if not raw:
        raise UnmaskError("--values is empty; give comma-separated numbers, e.g. --values 0,0.1,0.35")
    cast = int if knob_types()[param] == "int" else float  # the knob's own type
    try:
        out = [cast(v) for v in raw]
    except (TypeError, ValueError):
        raise UnmaskError(f"--values for {param} must be {'integers' if cast is int else 'numbers'}, "
                          f"got {','.join(map(str, raw))}; pass e.g. --values 0,0.1,0.35") from None
    if len(set(out)) != len(out):
        raise UnmaskError(f"--values repeats a value: {','.join(map(str, raw))}; list each value once")
    return out


@dataclass
class SweepResult:
    """The runs of a sweep, in the order of ``values``, and their AUP.

    ``aup_score`` is ``None`` when AUP is undefined for these points (d3LLM refuses a curve
    whose last point lost more than 5 points of quality), with the reason in ``aup_error``.
    ``aup_dropped`` lists the (TPF, quality) points AUP's filter left out (more than 5 points
    below the quality at the smallest TPF).
    """

    task: str
    param: str
    metric: str
    values: list[float | int]
    results: list[EvalResult]
    y_max: float
    aup_score: float | None
    aup_error: str | None = None
    points: list[dict[str, Any]] = field(default_factory=list)
    aup_dropped: list[tuple[float, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "param": self.param, "metric": self.metric, "y_max": self.y_max,
                "aup": self.aup_score, "aup_error": self.aup_error, "aup_dropped": self.aup_dropped,
                "points": self.points}

    def plot(self, path: str | os.PathLike) -> Path:
        """PNG: quality against TPF and against TPS, each point labelled with its value, the
        Pareto front (no other point has both more parallelism and more quality) dashed.
        Needs matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise UnmaskError("the sweep plot needs matplotlib; pip install 'unmask[plot]'") from None
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, x_key, label in ((axes[0], "tpf", "tokens per forward (TPF)"),
                                 (axes[1], "tps", "tokens per second (TPS)")):
            pts = [(p[x_key], p["quality"], p["value"]) for p in self.points if p["quality"] is not None]
            ax.scatter([x for x, _, _ in pts], [y for _, y, _ in pts], zorder=3)
            for x, y, v in pts:
                ax.annotate(f"{self.param}={v:g}", (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize="x-small")
            front = pareto_front([(x, y) for x, y, _ in pts])
            if len(front) > 1:
                ax.plot(*zip(*front), linestyle="--", color="grey", zorder=2, label="Pareto front")
                ax.legend(fontsize="small")
            ax.set(xlabel=label, title=f"{self.task}: {self.metric} vs {x_key.upper()}")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel(f"{self.metric} (%)")
        aup_text = f"AUP {_num(self.aup_score)}" if self.aup_score is not None else "AUP n/a"
        fig.suptitle(f"sweep over {self.param} · {aup_text} (y_max {_num(self.y_max)})")
        fig.tight_layout()
        try:
            return atomic_savefig(fig, path, dpi=120)
        finally:
            plt.close(fig)


def _num(x: float) -> str:
    """Two decimals, or three significant digits below 1 (a garbage model's 0.0256 %)."""
    return f"{x:.2f}" if abs(x) >= 1 else f"{x:.3g}"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points (x, y) that no other point beats on both axes (>= on both, > on one),
    sorted by x. Higher is better on both axes."""
    keep = [p for p in points
            if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(keep))


@scoped
def sweep(task: str, model=None, decoder: str | None = None, *, param: str,
          values: str | Sequence[float], metric: str | None = None, y_max: float | None = None,
          device: str = "cpu", dtype: str = "float32", progress: Progress | None = None,
          **eval_kwargs) -> SweepResult:
    """Evaluate once per value of ``param`` and score the curve with AUP (diffusion spec §10).

    Args:
        param: ``gamma``, ``tau``, ``factor`` or ``tokens_per_step``; the decoder option of that
            name takes each value. Without a ``policy`` in ``eval_kwargs`` the policy named
            after the parameter is used (entropy-bound, threshold, factor, top-k).
        values: comma-separated string or numbers.
        metric: summary key in percent for the quality axis (default: the task's first
            quality metric; see :data:`unmask.eval.tasks.TASKS`).
        y_max: AUP's best accuracy; default the best quality among these points.
        eval_kwargs: everything :func:`unmask.eval.runner.evaluate` takes.

    Raises:
        UnmaskError: a bad parameter, value list or metric, or any evaluation error.
    """
    spec = T.get_task(task)
    vals = parse_values(param, values)
    metric = metric or spec.quality_metrics[0]
    if metric not in spec.quality_metrics:
        raise UnmaskError(f"metric {metric!r} is not a quality of task {task!r}; use one of: "
                          f"{', '.join(spec.quality_metrics)}")
    if param in eval_kwargs:
        raise UnmaskError(f"--{param.replace('_', '-')} is what the sweep varies; drop it")
    eval_kwargs.setdefault("policy", SWEEP_PARAMS[param])
    from unmask import dist

    device = str(dist.setup(device))  # under torchrun every point is decoded data-parallel
    bundle = _load(model, device=device, dtype=dtype)
    refs = eval_kwargs.pop("references", None) or References()
    results = []
    for i, v in enumerate(vals):
        stage_progress = None
        if progress is not None:
            stage_progress = lambda d, t, s, i=i, v=v: progress(d, t, f"{param}={v:g} ({i + 1}/{len(vals)}) {s}")  # noqa: E731
        results.append(evaluate(task, bundle, decoder, device=device, dtype=dtype, references=refs,
                                progress=stage_progress, **{param: v}, **eval_kwargs))
    points = [{"value": v, "quality": r.summary.get(metric), "tpf": r.summary["tpf"], "tps": r.summary["tps"],
               "nfe": r.summary["nfe"], "seconds": r.summary["seconds"]} for v, r in zip(vals, results)]
    usable = [(p["tpf"], p["quality"]) for p in points if p["quality"] is not None and p["tpf"] > 0]
    best = max((q for _, q in usable), default=0.0)
    y_max = best if y_max is None else y_max
    score, error, dropped = None, None, []
    if not usable:
        error = f"no point has a {metric}"
    elif y_max <= 0:
        error = f"every point has {metric} = 0, so AUP's weight is undefined"
    else:
        try:
            score, dropped = aup_report(usable, y_max, unit="percent")  # quality metrics are percent
        except UnmaskError as e:
            error = str(e)
    return SweepResult(task, param, metric, vals, results, y_max, score, error, points, dropped)
