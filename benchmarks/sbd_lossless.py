"""Lossless SBD vs AR vs the lossy EB default, in one run (issue: Lossless Set Block Decoding).

On the same story openings (greedy, 128 new tokens, 1 thread) and for each model:
  * AR (the baseline; run first and last, its TPS is the mean of both runs; for NAME+ADAPTER it
    runs on the plain NAME, the model the user had before the adapter),
  * lossless SBD (spec/sbd_exact.md) at k in {2, 4, 8, 16}, quadratic and linear drafting, and the
    model's budgeted layouts (spec §5) for 8, 16, 24 and 32 query tokens per row per forward, with the
    replay's predicted TPF (unmask.calibrate, recorded on the same prompts) beside the measured one,
  * the lossy EB sampler (γ = 0.35) at k in {4, 8, 16}, the shipped lossy default included,
at batch 1 and batch 8. Columns: NFE (summed per-row forwards), TPF, TPS, the TPS ratio vs AR,
the number of prompts whose tokens are identical to AR, the acceptance histogram (tokens
committed per row per forward), and ms per forward call relative to an AR forward call.

Models: ``stories260K-sbd`` (fully fine-tuned SBD: lossless output = its own AR) and
``stories260K+sbd`` (the original stories260K with its shipped gated SBD adapter: lossless
output = the original model's AR).

Writes sbd_lossless.md, .json and .png (TPF and TPS ratio vs k) under --out-dir and checks issue
26's targets at batch 1 (:func:`check_targets`): the default identical to AR on every prompt, its
TPF (stories260K-sbd >= 2.6, the adapter >= 2.5, at <= 16 query tokens), stories260K-sbd >= 2.9 at
<= 32, TPS >= 1.5x AR, the replay within 3 %. ``--layouts`` adds rows, e.g. a sibling layout
beside the chain of the same budget (spec §5.3).

    python benchmarks/sbd_lossless.py --threads 1                      # full run
    python benchmarks/sbd_lossless.py --limit 5 --blocks 4 --batch-sizes 1   # smoke
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import unmask
from unmask.decode.verify import layout as draft_layout
from unmask.decode.verify import siblings as sibling_layout
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_json, atomic_write_text

BLOCKS = (2, 4, 8, 16)
EB_BLOCKS = (4, 8, 16)
EB_GAMMA = 0.35


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="stories260K-sbd,stories260K+sbd",
                   help="comma-separated; NAME+ADAPTER loads NAME with that adapter")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--blocks", default=",".join(map(str, BLOCKS)))
    p.add_argument("--drafts", default="quadratic,linear")
    p.add_argument("--budgets", default="8,16,24,32", help="query budgets of the budgeted rows ('' for none)")
    p.add_argument("--layouts", default="", help="more layouts to run, ';'-separated D/S/G texts, siblings "
                   "included (e.g. '3/0,1,3/4;4/0,3/5+2'): a chain and a sibling layout side by side")
    p.add_argument("--compile", action="store_true", help="also compiled AR and the compiled default layout "
                   "(static cache + torch.compile; an untimed warm-up decode compiles first), TPS vs compiled AR")
    p.add_argument("--no-replay", action="store_true", help="skip the replay's predicted TPF of the lossless rows")
    p.add_argument("--eb-blocks", default=",".join(map(str, EB_BLOCKS)))
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench_sbd_lossless"))
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = leave as is)")
    return p.parse_args()


def load(spec: str):
    name, _, adapter = spec.partition("+")
    return unmask.load(name, adapter=adapter) if adapter else unmask.load(name)


def run(bundle, prompts, decoder, batch_size, max_new_tokens, **options) -> dict:
    """Decode every prompt in batches; sums of per-row forwards, forward calls, tokens, seconds."""
    tokens, nfe_rows, calls, seconds, accepts, stops = [], 0, 0, 0.0, {}, 0
    for s in range(0, len(prompts), batch_size):
        out = unmask.generate(prompts[s:s + batch_size], bundle, decoder, max_new_tokens=max_new_tokens, **options)
        tokens += out.tokens
        nfe_rows += sum(out.stats.nfe_per_row)
        calls += out.stats.nfe
        seconds += out.stats.seconds
        stops += sum(out.stats.stops_per_row)
        for k, v in out.stats.extra.get("accepts", {}).items():
            accepts[int(k)] = accepts.get(int(k), 0) + v
    generated = sum(len(t) for t in tokens)
    return {"tokens": tokens, "nfe": nfe_rows, "calls": calls, "generated": generated, "seconds": seconds,
            "tpf": generated / max(1, nfe_rows), "tpf_stats": (generated + stops) / max(1, nfe_rows),
            "tps": generated / seconds, "ms_per_call": 1000 * seconds / calls,
            "accepts": dict(sorted(accepts.items()))}


def bench_model(spec: str, prompts: list[str], args) -> list[dict]:
    bundle = load(spec)
    # the baseline a user has: AR on the plain base model (for NAME+ADAPTER, NAME without the adapter)
    ar_bundle = unmask.load(spec.partition("+")[0]) if "+" in spec else bundle
    defaults = bundle.meta.get("decode_defaults") or {}
    rows = []
    predicted = _replay(bundle, prompts, args)
    for bs in map(int, args.batch_sizes.split(",")):
        ar_first = run(ar_bundle, prompts, "ar", bs, args.max_new_tokens)
        configs = [("lossless", k, d, dict(verify=True, block_size=k, draft=d))
                   for k in map(int, filter(None, args.blocks.split(","))) for d in filter(None, args.drafts.split(","))]
        for q in map(int, filter(None, args.budgets.split(","))):  # the model's stored layout for q queries
            lay = _parse(draft_layout.resolve("budget", q, defaults))
            configs.append(("lossless", lay.D + 1, f"budget {q}: {lay.spec}", dict(verify=True, draft=lay.spec)))
        for text in filter(None, (t.strip() for t in args.layouts.split(";"))):
            lay = _parse(text)
            configs.append(("lossless", lay.D + 1, lay.spec, dict(verify=True, draft=lay.spec)))
        configs += [("eb", k, f"γ={EB_GAMMA}", dict(verify=False, block_size=k, gamma=EB_GAMMA))
                    for k in map(int, filter(None, args.eb_blocks.split(",")))]  # --eb-blocks "": none
        results = [(name, k, d, run(bundle, prompts, "sbd", bs, args.max_new_tokens, **opts))
                   for name, k, d, opts in configs]
        ar_last = run(ar_bundle, prompts, "ar", bs, args.max_new_tokens)
        assert ar_first["tokens"] == ar_last["tokens"]
        ar_tps = (ar_first["tps"] + ar_last["tps"]) / 2
        ar_ms = (ar_first["ms_per_call"] + ar_last["ms_per_call"]) / 2
        base = {"model": spec, "batch": bs}
        rows.append({**base, "decoder": "ar", "k": 1, "draft": "-", "queries": 1, **_cols(ar_first, ar_first, ar_tps, ar_ms),
                     "tps": ar_tps, "tps_ratio": 1.0, "ms_per_call": ar_ms, "ms_ratio": 1.0,
                     "ar_tps_first_last": [ar_first["tps"], ar_last["tps"]]})
        for (name, k, d, opts), (_, _, _, r) in zip(configs, results):
            lay = _layout(k, opts.get("draft")) if name == "lossless" else None
            if defaults.get("draft") == "budget":
                default = lay is not None and lay.spec == draft_layout.resolve("budget", None, defaults)
            else:
                default = (name == "lossless" and k == defaults.get("verify_block_size") and d == defaults.get("draft"))
            extra = {} if lay is None else {"queries": lay.queries, "predicted_tpf": predicted(lay)}
            rows.append({**base, "decoder": name, "k": k, "draft": d, "default": bool(default and defaults.get("verify")),
                         **_cols(r, ar_first, ar_tps, ar_ms), **extra})
        if args.compile:
            rows += compiled_rows(bundle, ar_bundle, prompts, bs, args, defaults, base)
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "accepts"}), flush=True)
    return rows


def compiled_rows(bundle, ar_bundle, prompts, bs, args, defaults, base) -> list[dict]:
    """Compiled AR (first and last, mean TPS) and the compiled default lossless layout, each after
    an untimed warm-up decode of the same prompts (compiles every shape), TPS vs compiled AR."""
    lay = _parse(draft_layout.resolve("budget", None, defaults)) if defaults.get("draft") == "budget" else None
    opts = dict(verify=True, compile=True, **({"draft": lay.spec} if lay else {}))
    run(ar_bundle, prompts, "ar", bs, args.max_new_tokens, compile=True)
    run(bundle, prompts, "sbd", bs, args.max_new_tokens, **opts)
    ar_first = run(ar_bundle, prompts, "ar", bs, args.max_new_tokens, compile=True)
    r = run(bundle, prompts, "sbd", bs, args.max_new_tokens, **opts)
    ar_last = run(ar_bundle, prompts, "ar", bs, args.max_new_tokens, compile=True)
    ar_tps = (ar_first["tps"] + ar_last["tps"]) / 2
    ar_ms = (ar_first["ms_per_call"] + ar_last["ms_per_call"]) / 2
    k = lay.D + 1 if lay else defaults.get("verify_block_size", "-")
    return [{**base, "decoder": "ar --compile", "k": 1, "draft": "-", "queries": 1, "compiled": True,
             **_cols(ar_first, ar_first, ar_tps, ar_ms), "tps": ar_tps, "tps_ratio": 1.0, "ms_ratio": 1.0},
            {**base, "decoder": "lossless --compile", "k": k, "draft": lay.spec if lay else defaults.get("draft", "-"),
             "queries": lay.queries if lay else "-", "compiled": True, **_cols(r, ar_first, ar_tps, ar_ms)}]


def _parse(text: str):
    """A budgeted layout's text as a DraftLayout, or a TreeLayout when it has siblings (spec §5.3)."""
    return sibling_layout.parse(text) if "+" in text else draft_layout.parse(text)


def _layout(k: int, draft: str):
    """The layout a lossless row runs (linear / quadratic of draft size k, or budgeted text)."""
    return {"linear": draft_layout.linear, "quadratic": draft_layout.quadratic}[draft](k) if draft in (
        "linear", "quadratic") else _parse(draft)


def _longest(lay) -> int:
    """The longest group the replay needs for ``lay`` (chain groups, sibling groups, D + 1)."""
    tree = sibling_layout.as_tree(lay)
    return max(*tree.chain.lengths, tree.D + 1, *(s.group for s in tree.siblings))


def _replay(bundle, prompts: list[str], args):
    """layout -> the replay's predicted TPF (stop tokens counted, as DecodeStats.tpf) on these prompts,
    recorded once per model (spec §5.4); None for layouts with groups longer than 8 or --no-replay."""
    if args.no_replay:
        return lambda lay: None
    from unmask import calibrate

    recs = calibrate.record(bundle, [bundle.encode(p) for p in prompts], max_new_tokens=args.max_new_tokens)
    kw = dict(stop_ids=tuple(bundle.stop_token_ids), max_new_tokens=args.max_new_tokens)
    return lambda lay: (calibrate.predicted_tpf(recs, lay, **kw) if _longest(lay) <= 8 else None)


def _cols(r: dict, ar: dict, ar_tps: float, ar_ms: float) -> dict:
    same = sum(a == b for a, b in zip(r["tokens"], ar["tokens"]))
    return {"nfe": r["nfe"], "tpf": r["tpf"], "tpf_stats": r["tpf_stats"], "tps": r["tps"], "tps_ratio": r["tps"] / ar_tps,
            "identical": same, "prompts": len(ar["tokens"]), "accepts": r["accepts"],
            "ms_per_call": r["ms_per_call"], "ms_ratio": r["ms_per_call"] / ar_ms}


def markdown(rows: list[dict], targets: list[dict]) -> str:
    head = ("| model | batch | decoder | k | draft | queries/forward | NFE | TPF | TPF incl. stop (replay) | TPS | "
            "TPS vs AR | identical to AR | ms/forward vs AR | accepts (tokens: count) |\n|" + "---|" * 14 + "\n")
    lines = []
    for r in rows:
        name = f"**{r['decoder']} (default)**" if r.get("default") else r["decoder"]
        acc = " ".join(f"{k}:{v}" for k, v in r["accepts"].items()) or "-"
        pred = "" if r.get("predicted_tpf") is None else f" ({r['predicted_tpf']:.3f})"
        lines.append(f"| {r['model']} | {r['batch']} | {name} | {r['k']} | {r['draft']} | {r.get('queries', '-')} | "
                     f"{r['nfe']} | {r['tpf']:.2f} | {r['tpf_stats']:.3f}{pred} | {r['tps']:.0f} | {r['tps_ratio']:.2f}x | {r['identical']}/{r['prompts']} | "
                     f"{r['ms_ratio']:.2f}x | {acc} |")
    out = head + "\n".join(lines) + "\n"
    if targets:
        out += "\n## Targets at each model's default lossless setting (batch 1)\n\n| model | target | measured | met |\n|---|---|---|---|\n"
        for t in targets:
            out += f"| {t['model']} | {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |\n"
    return out


# Issue 26's TPF targets per model: (TPF at the default of <= 16 query tokens, best TPF at <= 32 or None)
TPF_TARGETS = {"stories260K-sbd": (2.6, 2.9), "stories260K+sbd": (2.5, None)}


def check_targets(rows: list[dict]) -> list[dict]:
    """Issue 26's targets at batch 1: the default identical to AR everywhere, its TPF (<= 16 query
    tokens), the best stored or listed layout's TPF at <= 32, eager TPS >= 1.5x AR, with --compile
    compiled TPS >= 1.3x compiled AR (and identical), and every
    lossless row's replay prediction within 3 % of its measured TPF."""
    out = []
    for r in rows:
        if not (r.get("default") and r["batch"] == 1):
            continue
        m = r["model"]
        at16, at32 = TPF_TARGETS.get(m, (2.5, None))
        out += [{"model": m, "target": "identical to AR on every prompt", "measured": f"{r['identical']}/{r['prompts']}",
                 "met": r["identical"] == r["prompts"]},
                {"model": m, "target": f"default TPF >= {at16} at <= 16 query tokens",
                 "measured": f"{r['tpf']:.2f} at {r['queries']}", "met": r["tpf"] >= at16 and r["queries"] <= 16},
                {"model": m, "target": "TPS >= 1.5x AR (eager)", "measured": f"{r['tps_ratio']:.2f}x",
                 "met": r["tps_ratio"] >= 1.5}]
        comp = [x for x in rows if x["model"] == m and x["batch"] == 1 and x["decoder"] == "lossless --compile"]
        out += [{"model": m, "target": "compiled TPS >= 1.3x compiled AR", "measured": f"{x['tps_ratio']:.2f}x",
                 "met": x["tps_ratio"] >= 1.3 and x["identical"] == x["prompts"]} for x in comp]
        mine = [x for x in rows if x["model"] == m and x["batch"] == 1 and x["decoder"] == "lossless"]
        if at32 is not None:
            best = max((x for x in mine if x["queries"] <= 32), key=lambda x: x["tpf"])
            out.append({"model": m, "target": f"TPF >= {at32} at <= 32 query tokens",
                        "measured": f"{best['tpf']:.2f} ({best['draft']})", "met": best["tpf"] >= at32})
        errs = [abs(x["tpf_stats"] / x["predicted_tpf"] - 1) for x in mine if x.get("predicted_tpf")]
        if errs:
            out.append({"model": m, "target": "replay within 3 % of measured TPF", "measured": f"max {max(errs):.1%}",
                        "met": max(errs) <= 0.03})
    return out


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the plot (pip install -e '.[plot]')")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (model, batch) in sorted({(r["model"], r["batch"]) for r in rows}):
        for decoder, draft, style in (("lossless", "quadratic", "-o"), ("lossless", "linear", "--s"), ("eb", None, ":^")):
            sel = [r for r in rows if r["model"] == model and r["batch"] == batch and r["decoder"] == decoder
                   and (draft is None or r["draft"] == draft)]
            if not sel:
                continue
            label = f"{model} b{batch} {decoder}{'' if draft is None else ' ' + draft}"
            axes[0].plot([r["k"] for r in sel], [r["tpf"] for r in sel], style, label=label)
            axes[1].plot([r["k"] for r in sel], [r["tps_ratio"] for r in sel], style, label=label)
    axes[0].set(xlabel="k", ylabel="TPF", xscale="log", title="tokens per forward")
    axes[1].set(xlabel="k", ylabel="TPS / AR TPS", xscale="log", title="speed vs AR (same run)")
    axes[1].axhline(1.0, color="gray", lw=0.5)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = STORY_OPENINGS[: args.limit]
    rows = []
    for spec in args.models.split(","):
        try:
            rows += bench_model(spec, prompts, args)
        except unmask.UnmaskError as e:
            print(f"skipping {spec}: {e}")
    targets = check_targets(rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = {"threads": torch.get_num_threads(), "torch": torch.__version__, "prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens}
    atomic_write_json(args.out_dir / "sbd_lossless.json", {"env": env, "rows": rows, "targets": targets})
    atomic_write_text(args.out_dir / "sbd_lossless.md", markdown(rows, targets))
    plot(rows, args.out_dir / "sbd_lossless.png")
    print(markdown(rows, targets))


if __name__ == "__main__":
    main()
