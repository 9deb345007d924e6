"""Sibling candidates, predicted by replay (spec/sbd_exact.md §5.3–5.4, issue 26 item 2).

For each shipped lossless model (``stories260K-sbd``; ``stories260K`` with its gated ``sbd``
adapter) and query budget: the best chain layout ``D/S/G`` (:func:`unmask.calibrate.search`) and
the best chain + siblings layout (:func:`unmask.calibrate.search_trees`) of the same budget, with
the replay's predicted TPF of each and the gain, on the prompts ``unmask calibrate-drafts`` uses
(story openings 101-120, greedy, 128 new tokens). The replay is exact (tested against the decoder);
``--measure`` also decodes every prompt with both layouts (lossless SBD, one batch) and reports the
measured TPF beside the prediction, and whether the output equals AR.

    python benchmarks/sbd_siblings.py --budgets 16,32 --measure --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import unmask
from unmask import calibrate as cal
from unmask.decode import DECODERS
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_json, atomic_write_text

MODELS = (("stories260K-sbd", None), ("stories260K", "sbd"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="16,32")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=10, help="best chains each sibling set is tried on")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--measure", action="store_true", help="also decode with both layouts and measure TPF")
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench_sbd_siblings"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    budgets = [int(x) for x in args.budgets.split(",")]
    rows = []
    for name, adapter in MODELS:
        bundle = unmask.load(name, adapter=adapter)
        prompts = [bundle.encode(t) for t in STORY_OPENINGS[100:]]
        recs = cal.record(bundle, prompts, max_new_tokens=args.max_new_tokens)
        kw = dict(stop_ids=tuple(bundle.stop_token_ids), max_new_tokens=args.max_new_tokens)
        for Q in budgets:
            t0 = time.perf_counter()
            chain, tpf = cal.search(recs, Q, **kw)
            tree, tpf_tree = cal.search_trees(recs, Q, top=args.top, **kw)
            rows.append({"model": name + (f"+{adapter}" if adapter else ""), "budget": Q, "chain": chain.spec,
                         "chain_queries": chain.queries, "chain_tpf": tpf, "tree": tree.spec,
                         "tree_queries": tree.queries, "tree_tpf": tpf_tree, "gain": tpf_tree / tpf - 1,
                         "search_s": round(time.perf_counter() - t0, 1)})
            if args.measure:
                want = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=args.max_new_tokens,
                                 stop_token_ids=kw["stop_ids"]).tokens
                for key, lay in (("chain", chain), ("tree", tree)):
                    out = DECODERS["sbd"].decode(bundle, prompts, verify=True, draft=lay.spec,
                                                 max_new_tokens=args.max_new_tokens, stop_token_ids=kw["stop_ids"])
                    rows[-1][f"{key}_measured_tpf"] = out.stats.tpf
                    rows[-1][f"{key}_equals_ar"] = out.tokens == want
            print(json.dumps(rows[-1]), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out_dir / "sbd_siblings.json", {"prompts": "STORY_OPENINGS[100:120]",
                                                            "max_new_tokens": args.max_new_tokens, "rows": rows})
    atomic_write_text(args.out_dir / "sbd_siblings.md", markdown(rows))
    print(markdown(rows))


def markdown(rows: list[dict]) -> str:
    """The table: per model and budget, the best chain and chain + siblings layouts, predicted TPF,
    the gain, and (with --measure) the measured TPF and whether the output equals AR."""
    measured = all("tree_measured_tpf" in r for r in rows)
    head = "| model | Q | chain | TPF | chain + siblings | TPF | gain |" + (" measured TPF chain / tree | = AR |" if measured else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['model']} | {r['budget']} | {r['chain']} ({r['chain_queries']} q) | {r['chain_tpf']:.3f} | "
                f"{r['tree']} ({r['tree_queries']} q) | {r['tree_tpf']:.3f} | {100 * r['gain']:+.1f} % |")
        if measured:
            line += (f" {r['chain_measured_tpf']:.3f} / {r['tree_measured_tpf']:.3f} | "
                     f"{'yes' if r['chain_equals_ar'] and r['tree_equals_ar'] else 'NO'} |")
        lines.append(line)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
