"""Siblings under sampling (spec/sbd_exact.md §5.3, issue 26 item 2): measured TPF of sampled lossless
SBD with a chain layout and with the same chain plus siblings, on the same prompts and seeds.

Sampled rows draw each sibling i.i.d. from the block mode's proposal q at its offset and accept by
SpecInfer's multi-candidate rule (:func:`unmask.decode.verify.tree.sampled_tree_accept`), so the
output keeps AR's sampling distribution (tests/test_r6_siblings_decode.py checks it by chi-square);
what siblings buy there is measured here, not replayed: the replay models greedy acceptance only.
Each (layout, seed) decodes every prompt in one batch (a row's draws do not depend on the batch).

    python benchmarks/sbd_siblings_sampled.py --layouts "4/0,4/5;4/0,4/5+1;6/0,2,6/7;6/0,2,6/7+1c2+1" --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import unmask
from unmask.decode import DECODERS
from unmask.decode.verify import siblings as sl
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_json, atomic_write_text
from unmask.sampling import Sampling


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="stories260K-sbd")
    p.add_argument("--adapter", default=None)
    p.add_argument("--layouts", default="4/0,4/5;4/0,4/5+1", help="';'-separated draft layouts (D/S/G[+siblings])")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=100, help="story openings 1..N")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench_sbd_siblings_sampled"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bundle = unmask.load(args.model, adapter=args.adapter)
    prompts = [bundle.encode(t) for t in STORY_OPENINGS[: args.prompts]]
    stops = tuple(bundle.stop_token_ids)
    rows = []
    for layout in args.layouts.split(";"):
        tpfs, t0 = [], time.perf_counter()
        for seed in range(args.seeds):
            smp = Sampling(temperature=args.temperature, top_k=args.top_k, seed=seed)
            out = DECODERS["sbd"].decode(bundle, prompts, verify=True, draft=layout, sampling=smp,
                                         max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
            tpfs.append(out.stats.tpf)
        rows.append({"layout": layout, "queries": sl.parse(layout).queries, "tpf_per_seed": tpfs, "tpf": statistics.mean(tpfs), "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
    chains = {r["layout"]: r["tpf"] for r in rows}
    head = (f"Sampled lossless SBD, {args.model}{'+' + args.adapter if args.adapter else ''}, T = {args.temperature}"
            f"{f', top-k {args.top_k}' if args.top_k else ''}, story openings 1-{args.prompts}, {args.max_new_tokens} "
            f"new tokens, seeds 0-{args.seeds - 1}, one batch per seed.\n\n")
    lines = ["| layout | queries/forward | TPF (mean over seeds) | per seed | vs its chain alone |", "|---|---|---|---|---|"]
    for r in rows:
        chain = chains.get(r["layout"].split("+")[0])  # the same layout without its siblings, when it ran
        vs = "-" if chain is None or "+" not in r["layout"] else f"{100 * (r['tpf'] / chain - 1):+.1f} %"
        lines.append(f"| {r['layout']} | {r['queries']} | {r['tpf']:.3f} | "
                     f"{' / '.join(f'{t:.3f}' for t in r['tpf_per_seed'])} | {vs} |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out_dir / "sbd_siblings_sampled.json", {"args": {k: str(v) for k, v in vars(args).items()},
                                                                    "rows": rows})
    atomic_write_text(args.out_dir / "sbd_siblings_sampled.md", head + "\n".join(lines) + "\n")
    print(head + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
