"""A per-step query budget, predicted by replay (issue 26 item 4; spec/sbd_exact.md §5.2, §5.4).

Each step, choose the next step's layout among a few chain layouts from the block mode's confidence
in the draft it will verify (its softmax probability of draft token 1, ``p1``, or of tokens 1 and 2,
``p12``): a threshold policy runs the smaller layout below the threshold and the bigger one above
(a triple: two thresholds). :func:`unmask.calibrate.replay_policy` replays it on the recorded greedy
text (exact for one layout, tested against :func:`unmask.calibrate.replay`); every forward, the
prefill included, spends the queries of the layout it runs (the prefill: the smallest of the
policy's layouts), so a fixed layout's mean is its query count.

For each shipped lossless model (``stories260K-sbd``; ``stories260K`` with its gated ``sbd``
adapter) and mean budget B (16, 24, 32): the best fixed layout of at most B queries
(:func:`unmask.calibrate.search`) against the best threshold policy whose mean queries per forward
is at most B, both chosen on the calibration prompts (story openings 101-120, what ``unmask
calibrate-drafts`` uses) and then replayed on the test prompts (openings 1-100), 128 new tokens,
greedy. The candidate layouts: the best layout of each exact query count 4..48 on the calibration
prompts, the model's stored layouts and quadratic K = 8 (pairs); the TPF-vs-queries front of those
(triples). A control replaces the winning policy's confidence by a seeded coin with the same
shares of steps per layout (does the confidence matter, or only the mix?).

    python benchmarks/sbd_step_budget.py --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import pickle
import random
import time
from pathlib import Path

import torch

import unmask
from unmask import calibrate as cal
from unmask.decode.verify import layout as dl
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_json, atomic_write_text

MODELS = (("stories260K-sbd", None), ("stories260K", "sbd"))
BUDGETS = (16, 24, 32)
TAUS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9,
        0.95, 0.97, 0.99)
TAUS3 = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
FEATURES = {
    "p1": lambda conf: conf[0] if conf else 0.0,
    "p12": lambda conf: conf[0] * conf[1] if len(conf) > 1 else (conf[0] if conf else 0.0),
}


def threshold(feature: str, taus):
    """choose(conf, d): layout index = how many of the ascending ``taus`` the feature reaches."""
    f = FEATURES[feature]
    return lambda conf, d: bisect.bisect_right(taus, f(conf))


def run(recs, lays, choose, kw) -> dict:
    """Replay a policy over the recordings: TPF and mean queries per forward (all rows pooled)."""
    tok = fwd = q = 0
    for r in recs:
        t, f, s = cal.replay_policy(r, lays, choose, **kw)
        tok, fwd, q = tok + t, fwd + f, q + s
    return {"tpf": tok / fwd, "mean_queries": q / fwd}


def counted(choose, n):
    """``choose`` that also counts its choices (the shares of steps per layout)."""
    counts = [0] * n

    def f(conf, d):
        i = choose(conf, d)
        counts[i] += 1
        return i
    return f, counts


def coin(shares, seed=0):
    """A control policy: layout i with probability shares[i], ignoring the confidence."""
    rng, cum = random.Random(seed), list(itertools.accumulate(shares))
    return lambda conf, d: min(bisect.bisect_right(cum, rng.random() * cum[-1]), len(shares) - 1)


def load_recs(name, adapter, args):
    path = args.cache / f"{name}{'+' + adapter if adapter else ''}_{args.max_new_tokens}.pkl"
    bundle = unmask.load(name, adapter=adapter)
    if path.exists() and not args.fresh:
        with open(path, "rb") as fh:
            cal_recs, test_recs = pickle.load(fh)
    else:
        enc = [bundle.encode(t) for t in STORY_OPENINGS]
        cal_recs = cal.record(bundle, enc[100:], max_new_tokens=args.max_new_tokens)
        test_recs = cal.record(bundle, enc[:100], max_new_tokens=args.max_new_tokens)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as fh:
            pickle.dump((cal_recs, test_recs), fh)
    return bundle, cal_recs, test_recs


def study(name, adapter, args) -> list[dict]:
    t0 = time.perf_counter()
    bundle, cal_recs, test_recs = load_recs(name, adapter, args)
    kw = dict(stop_ids=tuple(bundle.stop_token_ids), max_new_tokens=args.max_new_tokens)
    t_rec = time.perf_counter() - t0
    # every chain layout up to 48 queries on the calibration prompts, once
    scored = [(cal.predicted_tpf(cal_recs, lay, **kw), lay) for lay in cal.layouts(48)]
    best_at = {}  # exact query count -> (tpf, layout), the first found on ties (search's order)
    for tpf, lay in scored:
        if lay.queries not in best_at or tpf > best_at[lay.queries][0]:
            best_at[lay.queries] = (tpf, lay)
    stored = [dl.parse(s) for s in dl.stored_layouts(bundle.meta.get("decode_defaults")).values() if "+" not in s]
    pool = sorted({*(lay for _, lay in best_at.values()), *stored, dl.quadratic(8)}, key=lambda l: (l.queries, l.spec))
    front, top = [], 0.0  # the TPF-vs-queries front: layouts better than every smaller one
    for q in sorted(best_at):
        if best_at[q][0] > top:
            front.append(best_at[q][1])
            top = best_at[q][0]
    fixed = {}
    for B in BUDGETS:
        lay, tpf = max(((t, l) for t, l in scored if l.queries <= B), key=lambda x: (x[0], -x[1].queries))[::-1]
        fixed[B] = {"layout": lay.spec, "queries": lay.queries, "cal_tpf": tpf,
                    "test_tpf": cal.predicted_tpf(test_recs, lay, **kw)}
    # policies on the calibration prompts: (tpf, mean q, spec) for every pair / triple and thresholds
    cands = []
    for feat in FEATURES:
        for a, b in itertools.combinations(pool, 2):
            if a.queries >= b.queries or a.queries > max(BUDGETS):
                continue
            for tau in TAUS:
                r = run(cal_recs, [a, b], threshold(feat, (tau,)), kw)
                cands.append((r["tpf"], r["mean_queries"], ((a, b), (tau,), feat)))
        for a, b, c in itertools.combinations(front, 3):
            if not a.queries < b.queries < c.queries or a.queries > max(BUDGETS):
                continue
            for taus in itertools.combinations(TAUS3, 2):
                r = run(cal_recs, [a, b, c], threshold(feat, taus), kw)
                cands.append((r["tpf"], r["mean_queries"], ((a, b, c), taus, feat)))
    rows = []
    model = name + (f"+{adapter}" if adapter else "")
    for B in BUDGETS:
        row = {"model": model, "budget": B, "fixed": fixed[B]}
        for kind, n in (("pair", 2), ("triple", 3)):
            ok = [c for c in cands if c[1] <= B and len(c[2][0]) == n]
            tpf, mq, (lays, taus, feat) = max(ok, key=lambda c: (c[0], -c[1]))
            choose, counts = counted(threshold(feat, taus), len(lays))
            run(cal_recs, list(lays), choose, kw)
            shares = [x / sum(counts) for x in counts]
            test = run(test_recs, list(lays), threshold(feat, taus), kw)
            ctrl_cal = run(cal_recs, list(lays), coin(shares), kw)
            ctrl_test = run(test_recs, list(lays), coin(shares), kw)
            grid = [(x,) for x in TAUS] if n == 2 else list(itertools.combinations(TAUS3, 2))
            tuned = [(t, run(test_recs, list(lays), threshold(feat, t), kw)) for t in grid]  # the ceiling
            tuned = max([x for x in tuned if x[1]["mean_queries"] <= B] or [(None, {"tpf": None})],
                        key=lambda x: x[1]["tpf"] or 0)
            row[kind] = {"layouts": [l.spec for l in lays], "layout_queries": [l.queries for l in lays],
                         "feature": feat, "taus": list(taus), "cal_tpf": tpf, "cal_mean_queries": mq,
                         "cal_shares": shares, "test_tpf": test["tpf"], "test_mean_queries": test["mean_queries"],
                         "coin_cal_tpf": ctrl_cal["tpf"], "coin_cal_mean_queries": ctrl_cal["mean_queries"],
                         "coin_test_tpf": ctrl_test["tpf"], "coin_test_mean_queries": ctrl_test["mean_queries"],
                         "test_tuned_taus": tuned[0] and list(tuned[0]), "test_tuned_tpf": tuned[1]["tpf"]}
        row["selected"] = max(("pair", "triple"), key=lambda k: row[k]["cal_tpf"])  # on calibration only
        row["record_s"] = round(t_rec, 1)
        row["search_s"] = round(time.perf_counter() - t0 - t_rec, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    """The tables: per model and mean budget, the best fixed layout and the best pair / triple
    policy (TPF, mean queries; calibration and test prompts), and the coin control."""
    out = ["Per-step budget (issue 26 item 4), replayed: calibration = story openings 101-120 (layouts "
           "and thresholds chosen there), test = openings 1-100; 128 new tokens, greedy. A policy "
           "runs layout i when the block mode's confidence (p1: top-1 probability of draft token 1; "
           "p12: of tokens 1 and 2 multiplied) reaches the i-th threshold; mean q = query tokens per "
           "forward (prefill included). coin = the same layouts in the same shares, chosen at random. "
           "τ tuned on test = the same layouts and feature with the thresholds chosen on the test prompts "
           "(mean q <= B there): the in-sample ceiling of the policy. * = the policy the calibration "
           "prompts select (pair or triple).", "",
           "| model | B | fixed layout (q) | TPF cal / test | best policy | TPF cal / test | mean q cal / test "
           "| gain test | coin TPF test (mean q) | τ tuned on test: TPF (τ) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["fixed"]
        for kind in ("pair", "triple"):
            p = r[kind]
            lays = " / ".join(f"{s} ({q})" for s, q in zip(p["layouts"], p["layout_queries"]))
            taus = ", ".join(f"{t:g}" for t in p["taus"])
            tt = p["test_tuned_taus"]
            tuned = f"{p['test_tuned_tpf']:.3f} ({', '.join(f'{t:g}' for t in tt)})" if tt else "none fits"
            star = "*" if r["selected"] == kind else ""
            out.append(f"| {r['model']} | {r['budget']} | {f['layout']} ({f['queries']}) | {f['cal_tpf']:.3f} / "
                       f"{f['test_tpf']:.3f} | {kind}{star}: {lays}, {p['feature']} τ = {taus} | {p['cal_tpf']:.3f} / "
                       f"{p['test_tpf']:.3f} | {p['cal_mean_queries']:.1f} / {p['test_mean_queries']:.1f} | "
                       f"{100 * (p['test_tpf'] / f['test_tpf'] - 1):+.1f} % | {p['coin_test_tpf']:.3f} "
                       f"({p['coin_test_mean_queries']:.1f}) | {tuned} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", type=Path, default=Path("runs/bench_sbd_step_budget"),
                   help="recordings are kept here and reused (--fresh records again)")
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench_sbd_step_budget"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r for name, adapter in MODELS for r in study(name, adapter, args)]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out_dir / "sbd_step_budget.json", {
        "calibration": "STORY_OPENINGS[100:120]", "test": "STORY_OPENINGS[:100]",
        "max_new_tokens": args.max_new_tokens, "taus": list(TAUS), "taus_triples": list(TAUS3), "rows": rows})
    atomic_write_text(args.out_dir / "sbd_step_budget.md", markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
