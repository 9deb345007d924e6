"""Early-Bird decoding vs vanilla and Fast-dLLM on stories260K-dlm, in one run (arXiv 2609.16450 §6).

On the first ``--limit`` (100) story openings, greedy, gen length 256, batch 1 (latency TPS), this
decodes stories260K-dlm with

  * vanilla: semi-AR top-k, 1 token per step, blocks of 32 (spec reading #11),
  * threshold: Fast-dLLM τ = 0.9, blocks of 32,
  * LBS only: Early-Bird with the LBS router and the threshold rule inside the selected blocks,
  * LBS + LPS: full Early-Bird (κ ≥ τ or p_ψ > τ_ψ),

each without a cache and with the prefix cache (``--caches``), and reports TPF, TPS, the speed-ups
over vanilla and over threshold (same cache), the reference NLL of the continuation under
stories260K (the judge; lower is better), distinct-4, the mean selected block size and the router
overhead (router time / step time). It then prints the issue's target checks for LBS + LPS vs
threshold: ≥ 1.5× TPF, ≥ 1.3× TPS, NLL at most 2 % worse, routers ≤ 10 % of step time.

    python benchmarks/early_bird.py                 # full run
    python benchmarks/early_bird.py --limit 10      # quick look

The routers come from MODEL_DIR/routers (recipes/stories260K_dlm_routers.py) or ``--routers``.
Writes ``early_bird.md`` and ``early_bird.json`` under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import unmask
from unmask.eval.quality import distinct_n, mean, reference_nll
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_json, atomic_write_text

METHODS = ("vanilla", "threshold", "lbs", "lbs+lps")
TARGETS = {"tpf": 1.5, "tps": 1.3, "nll": 0.02, "router": 0.10}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="stories260K-dlm")
    p.add_argument("--judge", default="stories260K", help="causal model that scores the continuations")
    p.add_argument("--routers", type=Path, default=None, help="router directory (default MODEL_DIR/routers)")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--tau", type=float, default=0.9)
    p.add_argument("--l-min", type=int, default=8)
    p.add_argument("--g-max", type=int, default=5)
    p.add_argument("--caches", default="none,prefix")
    p.add_argument("--batch-size", type=int, default=1, help="rows per decode call (1 = latency TPS)")
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench_early_bird"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    return p.parse_args(argv)


def options(method: str, args, cache: str) -> tuple[str, dict]:
    """(decoder, options) of one method."""
    common = {"cache": cache}
    if method == "vanilla":
        return "diffusion", {**common, "policy": "top-k", "tokens_per_step": 1, "block_size": args.block_size,
                             "gen_length": args.gen_length}
    if method == "threshold":
        return "diffusion", {**common, "policy": "threshold", "tau": args.tau, "block_size": args.block_size,
                             "gen_length": args.gen_length}
    # Both Early-Bird runs with the same serving settings (L_B, τ, L_min, g_max).
    return "early-bird", {**common, "routers": args.routers, "lps": method == "lbs+lps", "gen_length": args.gen_length,
                          "block_size": args.block_size, "tau": args.tau, "l_min": args.l_min, "g_max": args.g_max}


def run(bundle, prompts, decoder, batch_size, max_new_tokens, **opts) -> dict:
    """Decode every prompt; tokens per row, summed NFE / tokens / seconds and router time."""
    tokens, nfe_rows, seconds, router, steps, blocks, block_sum, lps_only = [], [], 0.0, 0.0, 0.0, 0, 0.0, 0
    for s in range(0, len(prompts), batch_size):
        out = unmask.generate(prompts[s:s + batch_size], bundle, decoder, max_new_tokens=max_new_tokens, **opts)
        tokens += out.tokens
        nfe_rows += out.stats.nfe_per_row
        seconds += out.stats.seconds
        x = out.stats.extra
        router += x.get("router_seconds", 0.0)
        steps += x.get("step_seconds", 0.0)
        blocks += x.get("blocks", 0)
        block_sum += x.get("mean_block", 0.0) * x.get("blocks", 0)
        lps_only += x.get("lps_only", 0)
    generated = sum(len(t) for t in tokens)
    return {"tokens": tokens, "nfe": sum(nfe_rows), "generated": generated, "seconds": seconds,
            "tpf": generated / max(1, sum(nfe_rows)), "tps": generated / seconds if seconds else 0.0,
            "router_share": router / steps if steps else None, "mean_block": block_sum / blocks if blocks else None,
            "lps_share": lps_only / generated if generated and "lps" in opts and opts["lps"] else None}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    unmask.compat.quiet_transformers()
    bundle, judge = unmask.load(args.model), unmask.load(args.judge)
    prompts = list(STORY_OPENINGS[: args.limit])
    prompt_ids = [judge.encode(p) for p in prompts]
    caches = [c for c in args.caches.split(",") if c]
    n = args.gen_length
    for method in METHODS:  # warm-up, and a missing router fails here rather than after the baselines
        decoder, opts = options(method, args, caches[0])
        run(bundle, prompts[:1], decoder, 1, n, **opts)

    t0 = time.time()
    rows = []
    for cache in caches:
        base = {}
        for method in METHODS:
            decoder, opts = options(method, args, cache)
            res = run(bundle, prompts, decoder, args.batch_size, n, **opts)
            nll = reference_nll(judge, prompt_ids, res["tokens"])
            row = {"method": method, "cache": cache, "decoder": decoder, "nfe": res["nfe"],
                   "generated": res["generated"], "seconds": res["seconds"], "tpf": res["tpf"], "tps": res["tps"],
                   "nll": mean(nll), "distinct4": mean([distinct_n(t, 4) for t in res["tokens"]]),
                   "router_share": res["router_share"], "mean_block": res["mean_block"],
                   "lps_share": res["lps_share"]}
            base[method] = row
            for ref in ("vanilla", "threshold"):
                if ref in base:
                    row[f"tpf_x_{ref}"] = row["tpf"] / base[ref]["tpf"]
                    row[f"tps_x_{ref}"] = row["tps"] / base[ref]["tps"]
            rows.append(row)
            print(_line(row), flush=True)
    elapsed = time.time() - t0
    checks = _checks(rows, caches)
    report = _markdown(rows, checks, args, elapsed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out_dir / "early_bird.md", report)
    atomic_write_json(args.out_dir / "early_bird.json", {"rows": rows, "checks": checks,
                                                         "args": {k: str(v) for k, v in vars(args).items()}})
    print(report)


def _checks(rows, caches) -> list[dict]:
    """The issue's targets for LBS + LPS against threshold decoding with the same cache."""
    out = []
    for cache in caches:
        eb = next(r for r in rows if r["cache"] == cache and r["method"] == "lbs+lps")
        th = next(r for r in rows if r["cache"] == cache and r["method"] == "threshold")
        worse = eb["nll"] / th["nll"] - 1
        out += [
            {"cache": cache, "check": f"TPF ≥ {TARGETS['tpf']}× threshold", "value": eb["tpf_x_threshold"],
             "ok": eb["tpf_x_threshold"] >= TARGETS["tpf"]},
            {"cache": cache, "check": f"TPS ≥ {TARGETS['tps']}× threshold", "value": eb["tps_x_threshold"],
             "ok": eb["tps_x_threshold"] >= TARGETS["tps"]},
            {"cache": cache, "check": f"NLL ≤ {TARGETS['nll']:.0%} worse than threshold", "value": worse,
             "ok": worse <= TARGETS["nll"]},
            {"cache": cache, "check": f"router time ≤ {TARGETS['router']:.0%} of step time",
             "value": eb["router_share"], "ok": eb["router_share"] <= TARGETS["router"]},
        ]
    return out


def _fmt(x, spec):
    return "–" if x is None else format(x, spec)


def _line(r: dict) -> str:
    return (f"{r['method']:<9} cache={r['cache']:<6} NFE={r['nfe']:<6} TPF={r['tpf']:.2f} TPS={r['tps']:.0f} "
            f"×vanilla TPF {r['tpf_x_vanilla']:.2f} TPS {r['tps_x_vanilla']:.2f} "
            f"NLL={r['nll']:.3f} d4={r['distinct4']:.3f} router={_fmt(r['router_share'], '.1%')} "
            f"block={_fmt(r['mean_block'], '.1f')}")


def _markdown(rows, checks, args, elapsed) -> str:
    lines = [f"# Early-Bird on {args.model}: {args.limit} story openings, gen length {args.gen_length}, greedy, "
             f"batch {args.batch_size} ({elapsed:.0f} s)", "",
             "| method | cache | NFE | TPF | TPS | TPF × vanilla | TPS × vanilla | TPF × threshold | TPS × threshold | "
             "ref NLL | distinct-4 | router % of step | mean block | LPS-only commits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['cache']} | {r['nfe']} | {r['tpf']:.2f} | {r['tps']:.0f} | "
                     f"{r['tpf_x_vanilla']:.2f}x | {r['tps_x_vanilla']:.2f}x | {_fmt(r.get('tpf_x_threshold'), '.2f')}x | "
                     f"{_fmt(r.get('tps_x_threshold'), '.2f')}x | {r['nll']:.3f} | {r['distinct4']:.3f} | "
                     f"{_fmt(r['router_share'], '.1%')} | {_fmt(r['mean_block'], '.1f')} | {_fmt(r['lps_share'], '.1%')} |")
    lines += ["", "## Targets (LBS + LPS vs threshold, same cache)", "", "| cache | check | value | result |",
              "|---|---|---|---|"]
    for c in checks:
        value = f"{c['value']:+.1%}" if "NLL" in c["check"] else (
            f"{c['value']:.1%}" if "router" in c["check"] else f"{c['value']:.2f}x")
        lines.append(f"| {c['cache']} | {c['check']} | {value} | {'PASS' if c['ok'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
