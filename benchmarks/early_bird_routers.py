"""Why Early-Bird's LBS rarely selects on stories260K-dlm, and how precise LPS's commits are (issue 29 item 3).

On the first ``--limit`` story openings (greedy, gen length 256, L_B 32, τ 0.9, L_min 8, g_max 5,
no cache, batches of 10 rows) with the routers in ``--routers`` (default MODEL_DIR/routers):

1. **LBS selections** (LBS only, the threshold rule inside the block): the share of selection
   steps whose block came from the router (path ``router``) and is longer than L_min, the
   distribution of selected lengths, and at every selection the funnel of Alg. 5: |M|, the
   router's p_φ > 0.5 set, after EOS removal, after the max-gap cut (< L_min → the fallback of
   the first L_B masked positions), plus the largest p_φ and how many of the first L_B masked
   positions the router passes.
2. **LBS labels**: on the training distribution (the model's own threshold responses, EOS-padded
   to L, Blockwise-Masking), Eq. 3's loss σ·(CE − 1) makes 1[CE < 1] the router's implicit label.
   Per sample: how many masked positions have CE < 1, how many of them are EOS padding, and how
   many the router passes.
3. **LPS commits** (LBS + LPS) at the saved τ_ψ and at stricter ones (``--tau-psi``): TPF and
   reference NLL next to threshold decoding, and the precision of the LPS-only commits (κ < τ,
   p_ψ > τ_ψ) against the model's own greedy continuation (vanilla, 1 token per step) at the same
   position and against the threshold decode; the same for the κ ≥ τ commits as a yardstick.

    python benchmarks/early_bird_routers.py [--limit 40] [--tau-psi 0.9,0.95,0.99] [--routers DIR]

Writes ``early_bird_routers.{md,json}`` under ``--out`` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn

import unmask
from unmask.decode.dllm.eb_select import PATH_NAMES, drop_eos, max_gap_cut
from unmask.eval.quality import mean, reference_nll
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_json, atomic_write_text

GEN, LB, TAU, LMIN, GMAX = 256, 32, 0.9, 8, 5


class Recording(nn.Module):
    """The LBS router, recording every call's masked set and p_φ (the decoder calls it once per
    selection step, before its on_forward hook)."""

    kind = "lbs"

    def __init__(self, router):
        super().__init__()
        self.router = router
        self.config = router.config
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, norm_entropy, token_emb, masked):
        logits = self.router(norm_entropy, token_emb, masked)  # (b, L)
        self.calls.append((masked.clone(), torch.sigmoid(logits)))
        return logits


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="stories260K-dlm")
    p.add_argument("--judge", default="stories260K")
    p.add_argument("--routers", type=Path, default=None, help="router directory (default MODEL_DIR/routers)")
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--tau-psi", default="0.9,0.95,0.99", help="stricter τ_ψ values besides the saved one")
    p.add_argument("--label-samples", type=int, default=64, help="responses of the LBS label probe")
    p.add_argument("--skip-vanilla", action="store_true", help="no vanilla decode (no precision vs greedy)")
    p.add_argument("--skip-lps", action="store_true", help="no LBS + LPS decodes (an LBS router on its own)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", default="early_bird_routers")
    return p.parse_args(argv)


def decode(bundle, prompts, decoder, hook=None, batch: int = 10, **opts) -> tuple[list[list[int]], int]:
    """Greedy decode in batches of ``batch`` rows (rows are independent: batch == rows alone, the
    decoders' batch tests); ``hook(state, offset)`` sees every forward with the batch's first row."""
    tokens, nfe = [], 0
    for s in range(0, len(prompts), batch):
        extra = {"on_forward": (lambda state, s=s: hook(state, s))} if hook else {}
        out = unmask.generate(prompts[s:s + batch], bundle, decoder, max_new_tokens=GEN, **extra, **opts)
        tokens += out.tokens
        nfe += sum(out.stats.nfe_per_row)
    return tokens, nfe


def eb_opts(routers, lps: bool, **kw) -> dict:
    return {"routers": routers, "lps": lps, "gen_length": GEN, "block_size": LB, "tau": TAU, "l_min": LMIN,
            "g_max": GMAX, "cache": "none", **kw}


def lbs_selections(bundle, prompts, routers_dir) -> dict:
    """Part 1: the Alg. 5 funnel at every selection of an LBS-only decode."""
    from unmask.routers.io import load_routers

    rec = Recording(load_routers(bundle, routers=routers_dir, lps=False).lbs)
    stops = list(bundle.stop_token_ids)
    rows = []

    def hook(state, offset):
        path = state.get("path")
        if path is None or not bool((path >= 0).any()):
            return
        masks, ps = rec.calls[-1]  # (b, L) each, the selecting rows in order
        for j, r in enumerate(torch.nonzero(path >= 0).flatten().tolist()):
            one(masks[j], ps[j], state["top1"][r], state["block"][r], int(path[r]))

    def one(masked, p, top1, block, path):  # (L,) each
        cut = masked & (p > 0.5)
        no_eos = drop_eos(cut[None], top1[None], stops)[0]
        gapped = max_gap_cut(no_eos[None], GMAX, masked=masked[None])[0]
        first = masked & (masked.long().cumsum(0) <= LB)
        rows.append({"masked": int(masked.sum()), "router": int(cut.sum()), "after_eos": int(no_eos.sum()),
                     "after_gap": int(gapped.sum()), "selected": int(block.sum()),
                     "path": PATH_NAMES[path], "max_p": float(p[masked].max()),
                     "first_LB_passed": int((first & (p > 0.5)).sum()),
                     "eos_top1_in_router_set": int((cut & ~no_eos).sum())})

    opts = eb_opts(None, False)
    opts.pop("routers")
    tokens, nfe = decode(bundle, prompts, "early-bird", hook, lbs_router=rec, **opts)
    n = len(rows)
    paths = Counter(r["path"] for r in rows)
    longer = sum(1 for r in rows if r["path"] == "router" and r["selected"] > LMIN)
    lengths = Counter(r["selected"] for r in rows)
    avg = {k: sum(r[k] for r in rows) / max(1, n) for k in ("masked", "router", "after_eos", "after_gap", "selected",
                                                             "max_p", "first_LB_passed", "eos_top1_in_router_set")}
    non_size = [r for r in rows if r["path"] != "size-fallback"]
    return {"selections": n, "paths": dict(paths), "router_longer_than_l_min": longer / max(1, n),
            "router_share": paths.get("router", 0) / max(1, n), "lengths": dict(sorted(lengths.items())),
            "mean": avg, "max_p_quantiles": _quantiles([r["max_p"] for r in non_size]),
            "router_set_ge_l_min": sum(1 for r in non_size if r["router"] >= LMIN) / max(1, len(non_size)),
            "after_eos_ge_l_min": sum(1 for r in non_size if r["after_eos"] >= LMIN) / max(1, len(non_size)),
            "nfe": nfe, "generated": sum(len(t) for t in tokens), "tokens": tokens}


def _quantiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    t = torch.tensor(xs)
    return {f"q{int(100 * q)}": float(t.quantile(q)) for q in (0.1, 0.5, 0.9)}


def lbs_labels(bundle, routers_dir, n: int) -> dict:
    """Part 2: the implicit label 1[CE < 1] of Eq. 3 on the LBS training distribution."""
    from unmask.routers.io import load_routers
    from unmask.train.routers import blockwise_mask, generate_responses, lbs_inputs, prompts_from_corpus

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
    import stories260K_bd as bd

    router = load_routers(bundle, routers=routers_dir, lps=False).lbs.eval()
    prompts = prompts_from_corpus([bd.SHARED_CORPUS], n, bos=bundle.tokenizer.bos_token_id or 1, seed=0)
    responses = torch.tensor(generate_responses(bundle, prompts, gen_length=GEN, block_size=LB, policy="threshold",
                                                tau=TAU, cache="dual", batch_size=8))  # (n, L)
    g = torch.Generator().manual_seed(0)
    masked = blockwise_mask(len(prompts), GEN, LB, g)  # (n, L)
    stats = {"label_pos": [], "label_pos_eos": [], "router_pos": [], "router_and_label": [], "masked": [],
             "label_pos_first_LB": []}
    stops = torch.tensor(list(bundle.stop_token_ids))
    with torch.no_grad():
        for s in range(0, len(prompts), 16):
            m = masked[s:s + 16]
            ent, emb, ce = lbs_inputs(bundle, prompts[s:s + 16], responses[s:s + 16], m)
            p = torch.sigmoid(router(ent, emb, m))  # (b, L)
            label = m & (ce < 1.0)
            eos = torch.isin(responses[s:s + 16], stops)
            first = m & (m.long().cumsum(1) <= LB)
            stats["masked"] += m.sum(1).tolist()
            stats["label_pos"] += label.sum(1).tolist()
            stats["label_pos_eos"] += (label & eos).sum(1).tolist()
            stats["label_pos_first_LB"] += (label & first).sum(1).tolist()
            stats["router_pos"] += (m & (p > 0.5)).sum(1).tolist()
            stats["router_and_label"] += (m & (p > 0.5) & label).sum(1).tolist()
    out = {k: sum(v) / max(1, len(v)) for k, v in stats.items()}
    nonpad = [a - b for a, b in zip(stats["label_pos"], stats["label_pos_eos"])]
    out["share_samples_nonpad_label_ge_l_min"] = sum(1 for x in nonpad if x >= LMIN) / max(1, len(nonpad))
    out["samples"] = len(prompts)
    return out


def lps_run(bundle, prompts, routers_dir, tau_psi, refs: dict) -> dict:
    """Part 3: one LBS + LPS decode; precision of its LPS-only and κ ≥ τ commits."""
    recs = []

    def hook(state, offset):
        chosen, kappa, p_lps, tokens = state["chosen"], state["kappa"], state["p_lps"], state["tokens"]  # (B, L)
        lps = chosen & (kappa < TAU) & (p_lps > eff_tau) if p_lps is not None else torch.zeros_like(chosen)
        thr = chosen & (kappa >= TAU)
        for kind, sel in (("lps", lps), ("kappa", thr)):
            for r, i in torch.nonzero(sel).tolist():
                recs.append((offset + r, kind, i, int(tokens[r, i])))

    from unmask.routers.io import load_routers

    eff_tau = tau_psi if tau_psi is not None else load_routers(bundle, routers=routers_dir).tau_psi
    done, nfe = decode(bundle, prompts, "early-bird", hook,
                       **eb_opts(routers_dir, True, **({"tau_psi": tau_psi} if tau_psi is not None else {})))
    prec = {}
    for kind in ("lps", "kappa"):
        rs = [r for r in recs if r[1] == kind]
        prec[kind] = {"commits": len(rs)}
        for ref_name, ref in (("greedy", refs.get("vanilla")), ("threshold", refs["threshold"])):
            if ref is None:
                continue
            hits = [ref[row][i] == t for row, _, i, t in rs if i < len(ref[row])]
            prec[kind][ref_name] = sum(hits) / max(1, len(hits))
    return {"tau_psi": eff_tau, "tokens": done, "nfe": nfe, "precision": prec}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    unmask.compat.quiet_transformers()
    t0 = time.time()
    bundle, judge = unmask.load(args.model), unmask.load(args.judge)
    prompts = list(STORY_OPENINGS[: args.limit])
    prompt_ids = [judge.encode(p) for p in prompts]
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}

    thr_tokens, thr_nfe = decode(bundle, prompts, "diffusion", policy="threshold", tau=TAU, block_size=LB,
                                 gen_length=GEN, cache="none")
    refs = {"threshold": thr_tokens}
    methods = {"threshold": {"tokens": thr_tokens, "nfe": thr_nfe}}
    if not args.skip_vanilla:
        v_tokens, v_nfe = decode(bundle, prompts, "diffusion", policy="top-k", tokens_per_step=1, block_size=LB,
                                 gen_length=GEN, cache="none")
        refs["vanilla"] = v_tokens
        methods["vanilla (greedy)"] = {"tokens": v_tokens, "nfe": v_nfe}
    print(f"[{time.time() - t0:.0f} s] baselines", file=sys.stderr, flush=True)
    report["lbs_selections"] = lbs_selections(bundle, prompts, args.routers)
    methods["lbs only"] = {"tokens": report["lbs_selections"].pop("tokens"), "nfe": report["lbs_selections"]["nfe"]}
    print(f"[{time.time() - t0:.0f} s] LBS selections", file=sys.stderr, flush=True)
    report["lbs_labels"] = lbs_labels(bundle, args.routers, args.label_samples)
    print(f"[{time.time() - t0:.0f} s] LBS labels", file=sys.stderr, flush=True)
    taus = [] if args.skip_lps else [None] + [float(x) for x in args.tau_psi.split(",") if x.strip()]
    lps = []
    for t in taus:
        r = lps_run(bundle, prompts, args.routers, t, refs)
        methods[f"lbs+lps τψ={r['tau_psi']:.3g}"] = {"tokens": r.pop("tokens"), "nfe": r["nfe"]}
        lps.append(r)
        print(f"[{time.time() - t0:.0f} s] LPS τψ {r['tau_psi']}", file=sys.stderr, flush=True)
    report["lps"] = lps
    th_nll = None
    table = {}
    for name, m in methods.items():
        nll = mean(reference_nll(judge, prompt_ids, m["tokens"]))
        gen = sum(len(t) for t in m["tokens"])
        table[name] = {"tpf": gen / max(1, m["nfe"]), "nll": nll, "generated": gen, "nfe": m["nfe"]}
        if name == "threshold":
            th_nll, th_tpf = nll, table[name]["tpf"]
    for row in table.values():
        row["tpf_x_threshold"] = row["tpf"] / th_tpf
        row["nll_vs_threshold"] = row["nll"] / th_nll - 1
    report["methods"] = table
    report["seconds"] = time.time() - t0
    text = markdown(report, args)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / f"{args.name}.md", text)
    atomic_write_json(args.out / f"{args.name}.json", report)
    print(text)
    return 0


def markdown(r: dict, args) -> str:
    s, lab = r["lbs_selections"], r["lbs_labels"]
    m = s["mean"]
    lines = [f"# Early-Bird routers on {args.model}: {args.limit} story openings, gen length {GEN}, L_B {LB}, "
             f"τ {TAU}, L_min {LMIN}, g_max {GMAX}, greedy, no cache, batches of 10", "",
             "## LBS: what it selects (LBS only)", "",
             f"{s['selections']} selections; paths {s['paths']}; router blocks longer than L_min: "
             f"**{100 * s['router_longer_than_l_min']:.1f} %** of selections (router path at all: "
             f"{100 * s['router_share']:.1f} %).", "",
             "Selected lengths: " + ", ".join(f"{k}: {v}" for k, v in s["lengths"].items()), "",
             "Mean funnel per selection (Alg. 5): |M| {:.1f} → p_φ > 0.5: {:.2f} → after EOS removal {:.2f} → after "
             "max-gap cut {:.2f} → selected {:.1f}; of the router set, {:.2f} positions have an EOS top-1; of the "
             "first L_B masked positions the router passes {:.2f}.".format(
                 m["masked"], m["router"], m["after_eos"], m["after_gap"], m["selected"], m["eos_top1_in_router_set"],
                 m["first_LB_passed"]), "",
             f"Largest p_φ at a selection (q10 / q50 / q90): {s['max_p_quantiles']}; selections whose router set "
             f"alone reaches L_min: {100 * s['router_set_ge_l_min']:.1f} %, after EOS removal: "
             f"{100 * s['after_eos_ge_l_min']:.1f} %.", "",
             "## LBS: its training labels (Eq. 3 ⇒ implicit label 1[CE < 1])", "",
             f"{lab['samples']} threshold responses, Blockwise-Masking: per sample {lab['masked']:.1f} masked, "
             f"{lab['label_pos']:.1f} with CE < 1, of which {lab['label_pos_eos']:.1f} are EOS padding; "
             f"{lab['label_pos_first_LB']:.1f} lie among the first L_B masked positions; the router passes "
             f"{lab['router_pos']:.1f} ({lab['router_and_label']:.1f} of them labelled). Samples with at least "
             f"L_min non-padding positive labels: {100 * lab['share_samples_nonpad_label_ge_l_min']:.1f} %.", "",
             "## Decoding: TPF and reference NLL against threshold", "",
             "| method | NFE | TPF | TPF × threshold | ref NLL | NLL vs threshold |", "|---|---:|---:|---:|---:|---:|"]
    for name, t in r["methods"].items():
        lines.append(f"| {name} | {t['nfe']} | {t['tpf']:.3f} | {t['tpf_x_threshold']:.3f}x | {t['nll']:.4f} | "
                     f"{100 * t['nll_vs_threshold']:+.1f} % |")
    lines += ["", "## LPS commit precision", "",
              "Precision = share of commits equal to the reference decode's token at the same position (positional: "
              "after a reference and this decode part ways, later positions rarely agree, for κ ≥ τ commits too).", "",
              "| τ_ψ | LPS-only commits | vs greedy | vs threshold | κ ≥ τ commits | vs greedy | vs threshold |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["lps"]:
        a, k = x["precision"]["lps"], x["precision"]["kappa"]
        lines.append(f"| {x['tau_psi']:.3g} | {a['commits']} | {_pct(a.get('greedy'))} | {_pct(a.get('threshold'))} | "
                     f"{k['commits']} | {_pct(k.get('greedy'))} | {_pct(k.get('threshold'))} |")
    lines += ["", f"({r['seconds']:.0f} s, {args.threads} thread)"]
    return "\n".join(lines) + "\n"


def _pct(x):
    return "–" if x is None else f"{100 * x:.1f} %"


if __name__ == "__main__":
    sys.exit(main())
