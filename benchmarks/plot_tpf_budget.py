"""Tokens per forward against query tokens per forward for lossless SBD (spec/sbd_exact.md §5, issue 26).

Reads the rows of ``benchmarks/sbd_lossless.py`` (``sbd_lossless.json``: linear and quadratic drafting
at several K, the model's budgeted layouts at 8-32 query tokens, and "budgeted + siblings" when such
rows appear: a row with a truthy ``siblings`` field or "sibling" in its draft text) and the
before / after points of ``benchmarks/sbd_distill.py`` (``sbd_distill*.json``: lossless TPF of linear
drafts, K = 8, before and after self-distilling the block mode, spec §5.5). Writes a plot (one line
per model and layout family, TPF against query tokens per row per forward, log scale) and a
markdown table of the same points.

The shipped checkpoints are the distilled ones where distillation was kept; the distillation points
come from that script's own prompts (its first 20 openings), so compare them with each other, not
with the lines' level.

TPF is generated tokens / per-row forwards (stop tokens excluded, the ``tpf`` field of both scripts);
greedy lossless output and forwards do not depend on the batch, so each model's smallest batch is
used. Rows this script cannot place (other decoders, unknown drafts) are skipped, not an error.

    python benchmarks/plot_tpf_budget.py
    python benchmarks/plot_tpf_budget.py --lossless /tmp/q_smoke/sbd_lossless.json --out-dir /tmp/q_plot
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from unmask.decode.verify import layout as draft_layout
from unmask.errors import UnmaskError
from unmask.fileio import atomic_savefig, atomic_write_text

RESULTS = Path(__file__).resolve().parent / "results"
FAMILIES = ("linear", "quadratic", "budgeted", "budgeted + siblings")
STYLES = {"linear": "--s", "quadratic": ":o", "budgeted": "-^", "budgeted + siblings": "-D"}
DISTILL_QUERIES = draft_layout.linear(8).queries  # sbd_distill.py's lossless rows: linear drafts, K = 8


def family(row: dict) -> str | None:
    """The layout family of an sbd_lossless.json row, or None for a row that is not lossless SBD."""
    if row.get("decoder") != "lossless":
        return None
    draft = str(row.get("draft", ""))
    if row.get("siblings") or "sibling" in draft.lower() or "+" in draft:  # D/S/G+j...: a layout with siblings
        return "budgeted + siblings"
    if draft in ("linear", "quadratic"):
        return draft
    if draft.startswith("budget") or "/" in draft:
        return "budgeted"
    return None


def queries(row: dict) -> int | None:
    """Query tokens per row per forward of a lossless row: its ``queries`` field, else from K and
    the draft (linear 2K, quadratic K + K², or the D/S/G text after "budget Q: "); None if unknown."""
    if isinstance(row.get("queries"), (int, float)):
        return int(row["queries"])
    draft, k = str(row.get("draft", "")), row.get("k")
    try:
        if draft in ("linear", "quadratic") and isinstance(k, int):
            return getattr(draft_layout, draft)(k).queries
        return draft_layout.parse(draft.split(":")[-1].split()[0]).queries
    except (UnmaskError, IndexError, ValueError):
        return None


def lossless_points(data: dict) -> list[dict]:
    """{model, family, queries, tpf, draft, predicted_tpf, stage "shipped", source, batch} per lossless
    row of the smallest batch of each model, sorted by model, family and queries."""
    rows = [r for r in data.get("rows", []) if family(r) and queries(r) and isinstance(r.get("tpf"), (int, float))]
    smallest = {}
    for r in rows:
        smallest[r["model"]] = min(smallest.get(r["model"], r["batch"]), r["batch"])
    pts = [{"model": r["model"], "family": family(r), "queries": queries(r), "tpf": float(r["tpf"]),
            "draft": str(r["draft"]), "predicted_tpf": r.get("predicted_tpf"), "stage": "shipped",
            "source": "sbd_lossless", "batch": r["batch"]}
           for r in rows if r["batch"] == smallest[r["model"]]]
    return sorted(pts, key=lambda p: (p["model"], FAMILIES.index(p["family"]), p["queries"]))


def distill_points(data: dict, source: str) -> list[dict]:
    """The before / after points of one sbd_distill*.json (``results[i].before/after.lossless.tpf``);
    the model is the pair's name before ``=``. Files without them (e.g. the λ sweep) give none."""
    pts = []
    for r in data.get("results", []) if isinstance(data.get("results"), list) else []:
        model = str(r.get("pair", "?")).partition("=")[0]
        for stage in ("before", "after"):
            lossless = (r.get(stage) or {}).get("lossless") or {}
            if isinstance(lossless.get("tpf"), (int, float)):
                pts.append({"model": model, "family": "linear", "queries": int(lossless.get("queries", DISTILL_QUERIES)),
                            "tpf": float(lossless["tpf"]), "draft": "linear K=8", "predicted_tpf": None,
                            "stage": stage, "source": source, "batch": 1})
    return pts


def table(points: list[dict]) -> str:
    """The points as a markdown table (stage: shipped model, or before / after distillation)."""
    out = ("| model | family | layout | queries/forward | TPF | replay TPF | stage | source |\n"
           "|---|---|---|---|---|---|---|---|\n")
    for p in points:
        pred = "-" if p["predicted_tpf"] is None else f"{p['predicted_tpf']:.3f}"
        out += (f"| {p['model']} | {p['family']} | {p['draft']} | {p['queries']} | {p['tpf']:.3f} | {pred} | "
                f"{p['stage']} | {p['source']} |\n")
    return out


def plot(points: list[dict], path: Path) -> Path:
    """Draw TPF vs query tokens per forward: a line per (model, family) of the shipped points, the
    distillation points as hollow (before) and filled (after) pentagons joined by an arrow, each
    (model, file) pair shifted right a little so that pairs at the same budget stay apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    models = sorted({p["model"] for p in points})
    colors = {m: f"C{i}" for i, m in enumerate(models)}
    shift = 0
    for m in models:
        for fam in FAMILIES:
            sel = [p for p in points if p["model"] == m and p["family"] == fam and p["stage"] == "shipped"]
            if sel:
                ax.plot([p["queries"] for p in sel], [p["tpf"] for p in sel], STYLES[fam], color=colors[m],
                        label=f"{m} {fam}")
        for source in sorted({p["source"] for p in points if p["model"] == m and p["stage"] != "shipped"}):
            pair = {p["stage"]: p for p in points if p["model"] == m and p["source"] == source}
            shift += 1
            x = {k: v["queries"] * 2 ** (0.04 * shift) for k, v in pair.items()}  # log axis: a fixed offset
            if "before" in pair:
                ax.plot(x["before"], pair["before"]["tpf"], "p", mfc="none", color=colors[m],
                        label=f"{m} linear K=8 before -> after distillation ({source})")
            if "before" in pair and "after" in pair:
                ax.annotate("", (x["after"], pair["after"]["tpf"]), (x["before"], pair["before"]["tpf"]),
                            arrowprops={"arrowstyle": "->", "color": colors[m]})
            if "after" in pair:
                ax.plot(x["after"], pair["after"]["tpf"], "p", color=colors[m])
    ticks = []
    for q in sorted({p["queries"] for p in points}):
        if not ticks or q > ticks[-1] * 1.15:  # neighbours such as 30 and 31 would overprint
            ticks.append(q)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set(xlabel="query tokens per row per forward", ylabel="TPF (tokens per forward)",
           title="lossless SBD: TPF vs query budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lossless", type=Path, default=RESULTS / "sbd_lossless.json")
    p.add_argument("--distill", type=Path, nargs="*", default=None,
                   help="sbd_distill*.json files (default: every one next to --lossless)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    try:
        data = json.loads(args.lossless.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: cannot read {args.lossless} ({e}); run benchmarks/sbd_lossless.py first", file=sys.stderr)
        return 2
    points = lossless_points(data)
    if not points:
        print(f"error: {args.lossless} holds no lossless rows with TPF; rerun benchmarks/sbd_lossless.py",
              file=sys.stderr)
        return 2
    distill = args.distill if args.distill is not None else sorted(args.lossless.parent.glob("sbd_distill*.json"))
    used = []  # the distillation files that gave points
    for f in distill:
        try:
            got = distill_points(json.loads(f.read_text(encoding="utf-8")), f.stem)
        except (OSError, json.JSONDecodeError) as e:
            print(f"skipping {f} ({e})", file=sys.stderr)
            continue
        points += got
        used += [f] if got else []
    points.sort(key=lambda p: (p["model"], p["stage"] != "shipped", p["source"], FAMILIES.index(p["family"]),
                               p["queries"], p["stage"] != "before"))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    md = args.out_dir / "tpf_vs_budget.md"
    atomic_write_text(md, f"# Lossless SBD: TPF vs query tokens per forward\n\nFrom `{args.lossless.name}` and "
                      f"{', '.join(f'`{f.name}`' for f in used) or 'no distillation file'} "
                      "(`benchmarks/plot_tpf_budget.py`). The before / after rows come from the distillation "
                      "script's own prompts: compare them with each other.\n\n" + table(points))
    print(table(points))
    print(f"wrote {plot(points, args.out_dir / 'tpf_vs_budget.png')} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
