"""Side-by-side benchmark: every decoder on every shipped model it is made for, same prompts,
one run (STYLE.md habit 5: ratios measured in one run).

The pairs are discovered at run time from :data:`unmask.decode.DECODERS` and
:func:`unmask.models.registry.shipped`, so a new decoder or checkpoint shows up without a
change here. A decoder runs on each shipped model whose kind is the decoder's *native* kind,
the first of its ``kinds`` (``ar`` on ``stories260K``, ``sbd`` on ``stories260K-sbd``, ...);
``include_all`` adds the other compatible pairs (e.g. ``ar`` on ``stories260K-sbd``, the SBD
model in its next-token mode).

Every pair decodes the first ``limit`` story openings (the ``stories`` task) with greedy
sampling and the decoder's defaults, after a warm-up, and reports NFE (mean per prompt),
TPF, TPS, the ratios to the AR row (TPS / TPS_AR and NFE_AR / NFE: both > 1 mean faster than
AR), and quality: the reference NLL under ``stories260K``, distinct-4, the positional
agreement with the greedy AR output of the same model and the prompts whose tokens equal it, in the
dtype the run used (``same as AR (dtype)``: lossless SBD is exact in float32, in bfloat16 up to
near-ties).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from unmask.errors import UnmaskError
from unmask.threads import scoped

AR_REFERENCE = ("ar", "stories260K")
REPEATS = 3  # timed passes per row: TPS is their median, shown with its min-max spread
# Decoders benchmarked in several modes: (row label, decoder options). SBD runs lossless
# (spec/sbd_exact.md, output = AR) and lossy (the EB sampler) side by side.
VARIANTS = {"sbd": (("sbd --verify", {"verify": True}), ("sbd --no-verify", {"verify": False}))}
# A model with calibrated draft layouts (decode_defaults "draft_layouts", `unmask calibrate-drafts`)
# also runs lossless SBD at each query budget (spec/sbd_exact.md §5), right after "sbd --verify".
BUDGET_LABEL = "sbd --verify --queries {}"
# With ``compile``: every row is also run compiled (static KV cache + compiled step), labelled
# "<row> --compile", right after its eager row.


def pairs(*, include_all: bool = False, decoders: list[str] | None = None,
          models: list[str] | None = None) -> list[tuple[str, str]]:
    """(decoder, model) pairs to benchmark, in registry order then model name order.

    ``decoders`` / ``models`` keep only those names (an unknown name raises
    :class:`UnmaskError`)."""
    from unmask.decode import DECODERS
    from unmask.models.bundle import read_unmask_config
    from unmask.models.registry import shipped

    ships = shipped()
    for name, known, what in ((decoders, DECODERS, "decoder"), (models, ships, "shipped model")):
        unknown = sorted(set(name or ()) - set(known))
        if unknown:
            raise UnmaskError(f"unknown {what} {', '.join(unknown)}; choose from: {', '.join(known)}")
    kinds = {m: read_unmask_config(p).get("kind", "causal") for m, p in ships.items()}
    out = []
    for d, info in DECODERS.items():
        if decoders and d not in decoders:
            continue
        for m, kind in kinds.items():
            if models and m not in models:
                continue
            if kind == info.kinds[0] or (include_all and kind in info.kinds):
                out.append((d, m))
    return out


@dataclass
class BenchResult:
    """One row per (decoder, model) pair; a failed pair has ``error`` set and no numbers."""

    rows: list[dict[str, Any]]
    settings: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "rows": self.rows}

    def table(self):
        """A :class:`rich.table.Table` of the rows."""
        from rich.table import Table

        s = self.settings
        t = Table(title=f"side by side: {s['limit']} story openings, {s['max_new_tokens']} new tokens, "
                        f"batch {s['batch_size']}, greedy, {s['device']}; TPS: median of {s['repeats']} runs")
        cols = [("decoder", "left"), ("model", "left"), ("NFE", "right"), ("TPF", "right"), ("TPS", "right"),
                ("TPS min–max", "right"), ("TPS/AR", "right"), ("AR NFE/NFE", "right"), ("NLL", "right"),
                ("distinct-4", "right"), ("agree AR", "right"), (f"same as AR ({s['dtype']})", "right")]
        lossless = any(r.get("queries_per_forward") for r in self.rows)  # lossless SBD: query cost and accepts
        if lossless:
            cols += [("queries/fwd", "right"), ("accepts (tokens:forwards)", "left")]
        for c, j in cols:
            t.add_column(c, justify=j)
        fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
        for r in self.rows:
            if r.get("error"):
                t.add_row(r["decoder"], r["model"], f"[red]failed: {r['error']}[/red]", *[""] * (len(cols) - 3))
                continue
            cells = [fmt(r["nfe"], ".1f"), fmt(r["tpf"], ".2f"), fmt(r["tps"], ".0f"),
                     f"{r['tps_min']:.0f}–{r['tps_max']:.0f}", fmt(r["tps_vs_ar"], ".2f"),
                     fmt(r["nfe_vs_ar"], ".2f"), fmt(r["nll"], ".3f"), fmt(r["distinct_4"], ".3f"),
                     fmt(r["agreement_positional"], ".3f"),
                     "–" if r.get("identical_to_ar") is None else f"{r['identical_to_ar']}/{r['n']}"]
            if lossless:
                acc = r.get("accepts")
                cells += [fmt(r.get("queries_per_forward"), ".1f"),
                          " ".join(f"{k}:{v}" for k, v in acc.items()) if acc else "–"]
            t.add_row(r["decoder"], r["model"], *cells)
        return t


def has_stored_layouts(model: str, adapter: str | None = None) -> bool:
    """Whether the shipped ``model`` (with its shipped ``adapter``) stores calibrated draft layouts
    (decode_defaults ``draft_layouts``); read from its config files, nothing is loaded."""
    from unmask.models.adapter_io import list_adapters, read_adapter_config
    from unmask.models.bundle import read_unmask_config
    from unmask.models.registry import shipped

    path = shipped().get(model)
    if path is None:
        return False
    try:
        cfg = read_unmask_config(path) if adapter is None else read_adapter_config(list_adapters(path)[adapter])
    except (UnmaskError, KeyError, OSError):  # a broken checkpoint: its own rows report the error
        return False
    return bool((cfg.get("decode_defaults") or {}).get("draft_layouts"))


def compare_with_ar(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """Set every row's ``tps_vs_ar`` and ``nfe_vs_ar`` against the AR reference row (AR_REFERENCE, else
    any ``ar`` row); a compiled row (``... --compile``) against that reference's compiled twin when it
    ran, so its ratio is the decoder's speed-up, not the compiler's. Returns (reference, compiled one)."""
    ref = next((r for r in rows if (r["decoder"], r["model"]) == AR_REFERENCE), None) or \
        next((r for r in rows if r["decoder"] == "ar"), None)
    ref_c = ref and next((r for r in rows if (r["decoder"], r["model"]) == (f"{ref['decoder']} --compile", ref["model"])),
                         None)
    for r in rows:
        base = ref_c if ref_c and r["decoder"].endswith(" --compile") else ref
        r["tps_vs_ar"] = r["tps"] / base["tps"] if base and base["tps"] else None
        r["nfe_vs_ar"] = base["nfe"] / r["nfe"] if base and r["nfe"] else None
    return ref, ref_c


def variants(decoder: str, model: str, adapter: str | None = None) -> list[tuple[str, dict]]:
    """The (row label, decoder options) rows of one pair: :data:`VARIANTS`, plus for lossless SBD on a
    model with stored layouts one row per query budget of :data:`unmask.decode.verify.layout.BUDGETS`
    (``draft="budget", queries=Q``)."""
    from unmask.decode.verify.layout import BUDGETS

    rows = list(VARIANTS.get(decoder, ((decoder, {}),)))
    if decoder == "sbd" and has_stored_layouts(model, adapter):
        at = next(i for i, (_, o) in enumerate(rows) if o.get("verify")) + 1
        rows[at:at] = [(BUDGET_LABEL.format(q), {"verify": True, "draft": "budget", "queries": q}) for q in BUDGETS]
    return rows


def adapter_pairs(adapters: list[str] | None, *, decoders: list[str] | None = None,
                  models: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(decoder, shipped model, adapter) triples for gated SBD adapters: every decoder whose
    native kind is ``sbd`` on every shipped model (in ``models``, if given) that ships an adapter
    of that name in ``<checkpoint>/adapters/``. Raises UnmaskError for an adapter no model ships."""
    from unmask.decode import DECODERS
    from unmask.models.adapter_io import list_adapters
    from unmask.models.registry import shipped

    out = []
    for a in adapters or ():
        found = [m for m, p in shipped().items() if a in list_adapters(p) and (not models or m in models)]
        if not found:
            raise UnmaskError(f"no shipped model ships an adapter named {a!r}; see 'unmask models'")
        out += [(d, m, a) for d, info in DECODERS.items() if info.kinds[0] == "sbd" and (not decoders or d in decoders)
                for m in found]
    return out


@scoped
def bench(*, limit: int = 16, max_new_tokens: int = 64, batch_size: int = 1, repeats: int = REPEATS,
          include_all: bool = False,
          decoders: list[str] | None = None, models: list[str] | None = None, adapters: list[str] | None = None,
          judge: str = "stories260K", compile: bool = False,
          device: str = "cpu", dtype: str = "float32",
          progress: Callable[[int, int, str], None] | None = None, reference_nfe: bool = False) -> BenchResult:
    """Run every pair of :func:`pairs` on the same prompts and collect the comparison.

    Batch size 1 by default, the setting in which TPS is "model TPS" (diffusion spec §10). Every
    row's timed pass runs ``repeats`` times: ``tps`` is their median, ``tps_min`` / ``tps_max`` their
    spread (tokens per second on a shared CPU vary by tens of percent between identical runs, so two
    rows differ only where their spreads do not overlap); the other figures are the first pass's.
    Ratios are to the ``ar`` on ``stories260K`` row (else the first ``ar`` row; ``None``
    without one). A pair that raises is reported with its error and the others still run.
    ``adapters``: also run the :func:`adapter_pairs` rows, model shown as ``<model>+<adapter>``.
    Lossless SBD on a model with calibrated layouts also runs ``sbd --verify --queries Q`` rows for
    Q = 8, 16, 24, 32 (:func:`variants`). Rows carry ``queries_per_forward`` (lossless SBD, else None)
    and ``accepts``, the pooled accept histogram where the decoder keeps one
    (:class:`~unmask.decode.engine.stats.DecodeStats`).
    ``compile``: also run every row with ``compile=True``, each after an untimed warm-up pass over
    the same prompts that compiles every shape (its seconds, compiles included, are reported as
    ``compile_s``; they are not in the row's TPS).
    ``reference_nfe``: the dLLM rows decode whole canvases, as the reference code does
    (:func:`unmask.api.generate`); ``ar`` and ``sbd`` rows stop at EOS as their references do.
    Raises :class:`UnmaskError` when no pair is found.
    """
    from unmask.eval.runner import References, evaluate

    # Options shared by every pair are checked once, up front: otherwise each row would just fail.
    for flag, value in (("--limit", limit), ("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size),
                        ("--repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UnmaskError(f"{flag} must be an integer >= 1 (got {value!r}); pass e.g. {flag} 8")
    if isinstance(judge, str):  # an unknown judge failed every pair, one after the other
        from unmask.models.registry import resolve

        try:
            resolve(judge)
        except UnmaskError as e:
            raise UnmaskError(f"--judge: {e}") from None
    todo = [(d, m, None) for d, m in pairs(include_all=include_all, decoders=decoders, models=models)]
    todo += adapter_pairs(adapters, decoders=decoders, models=models)
    if not todo:
        raise UnmaskError("no decoder has a shipped model of a kind it works on; check 'unmask models'")
    refs = References()
    rows = []
    todo = [(d, m, a, label, opts) for d, m, a in todo for label, opts in variants(d, m, a)]
    if reference_nfe:
        from unmask.api import REFERENCE_NFE_DECODERS

        todo = [(d, m, a, label, {**opts, "reference_nfe": True} if d in REFERENCE_NFE_DECODERS else opts)
                for d, m, a, label, opts in todo]
    if compile:
        todo = [t for row in todo for t in (row, (*row[:3], f"{row[3]} --compile", {**row[4], "compile": True}))]
    for i, (d, m, a, label, opts) in enumerate(todo):
        shown = m if a is None else f"{m}+{a}"
        stage = None
        if progress is not None:
            stage = lambda done, total, s, i=i, d=label, m=shown: progress(  # noqa: E731
                done, total, f"{d} on {m} ({i + 1}/{len(todo)}) {s}")
        try:
            model = m
            if a is not None:
                from unmask.models import load

                model = load(m, device=device, dtype=dtype, adapter=a)
            compile_s = None
            if opts.get("compile"):
                if a is None:  # one bundle for the warm-up and the run: compiled steps belong to a model object
                    from unmask.models import load

                    model = load(m, device=device, dtype=dtype)
                # an untimed pass over the same prompts compiles every shape the timed pass meets (prompt
                # lengths set the canvas and cache buckets of some decoders)
                t0 = time.perf_counter()
                evaluate("stories", model, d, limit=limit, batch_size=batch_size, max_new_tokens=max_new_tokens,
                         judge=judge, device=device, dtype=dtype, references=refs, **opts)
                compile_s = time.perf_counter() - t0
            res = evaluate("stories", model, d, limit=limit, batch_size=batch_size, max_new_tokens=max_new_tokens,
                           judge=judge, device=device, dtype=dtype, references=refs, progress=stage, **opts)
            tps = [res.summary["tps"]] + [
                evaluate("stories", model, d, limit=limit, batch_size=batch_size, max_new_tokens=max_new_tokens,
                         judge=judge, device=device, dtype=dtype, references=refs, **opts).summary["tps"]
                for _ in range(repeats - 1)]
        except Exception as e:  # noqa: BLE001 - one broken pair must not hide the others
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            rows.append({"decoder": label, "model": shown, "error": msg if isinstance(e, UnmaskError)
                         else f"{type(e).__name__}: {msg}"})
            continue
        s = res.summary
        rows.append({"decoder": label, "model": shown, "kind": s["config"]["kind"], "n": s["n"],
                     "generated": s["generated"], "nfe": s["nfe"], "tpf": s["tpf"], "tps": statistics.median(tps),
                     "tps_min": min(tps), "tps_max": max(tps), "repeats": repeats,
                     "seconds": s["seconds"], "forwards": s.get("forwards"), "nll": s["nll"], "distinct_4": s["distinct_4"],
                     "agreement_positional": s["agreement_positional"],
                     "agreement_prefix": s["agreement_prefix"],
                     "agreement_reference": s["config"]["agreement_reference"],
                     "agreement_dtype": s["config"].get("agreement_dtype"),  # lossless = AR only in float32
                     "identical_to_ar": (None if s["agreement_positional"] is None else
                                         sum(item.get("agreement_positional") == 1.0 for item in res.rows)),
                     "queries_per_forward": s.get("queries_per_forward"), "accepts": s.get("accept_histogram"),
                     "options": s["config"]["options"], "env": s["env"], "compile_s": compile_s,
                     "_outputs": [(item["text"], item["nfe"]) for item in res.rows]})
    ok = [r for r in rows if not r.get("error")]
    outputs = {(r["decoder"], r["model"]): r.pop("_outputs") for r in ok}
    for r in ok:  # compiled rows: the share of prompts whose text and NFE equal the eager row's
        eager = outputs.get((r["decoder"].removesuffix(" --compile"), r["model"]))
        r["same_as_eager"] = (sum(a == b for a, b in zip(outputs[r["decoder"], r["model"]], eager)) / len(eager)
                              if r["decoder"].endswith(" --compile") and eager else None)
    ref, ref_c = compare_with_ar(ok)
    settings = {"limit": limit, "max_new_tokens": max_new_tokens, "batch_size": batch_size, "repeats": repeats,
                "judge": judge,
                "device": device, "dtype": dtype, "include_all": include_all, "compile": compile,
                "reference_nfe": reference_nfe,
                "reference": f"{ref['decoder']}@{ref['model']}" if ref else None,
                "compiled_reference": f"{ref_c['decoder']}@{ref_c['model']}" if ref_c else None}
    return BenchResult(rows, settings)
