"""SBD vs AR on stories260K-sbd: forwards, speed and quality in one run (issue: Set Block Decoding).

On the same story openings (greedy, 128 new tokens) this decodes with
  * AR on the original stories260K,
  * AR (NTP mode, SBD Eq. 9a) on stories260K-sbd,
  * SBD at γ ∈ {0, 0.1, 0.35, 0.6, 1.0, 1.5} × k ∈ {4, 8, 16} (EB sampler, entropy proxy),
and reports NFE, TPF, TPS, the wall-clock ratio vs AR of the same model, the reference NLL of
the continuation under the original stories260K (the judge; lower is better), token agreement
with the AR output of the same model and the distinct-4-gram ratio (a repetition check).

It also measures where the quality gap comes from, on the model's own AR text: the
cross-entropy of each position of an all-mask block (position 0 = the first block position,
conditioned on exactly the NTP context) against NTP cross-entropy, and the matched-prefix length
of an all-mask block's argmax (how many leading tokens one forward gets right).

Writes a markdown table, a JSON file and a PNG (quality vs TPF) under --out-dir.

    python benchmarks/sbd_vs_ar.py                 # full run, batch 1 (latency TPS)
    python benchmarks/sbd_vs_ar.py --limit 10      # quick look
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import unmask
from unmask.compat import attention_mask, forward
from unmask.decode.engine.batching import left_pad
from unmask.eval.quality import agreement, distinct_n, mean, reference_nll
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_json, atomic_write_text
from unmask.masks import as_4d, sbd_inference_mask, with_key_padding

GAMMAS = (0.0, 0.1, 0.35, 0.6, 1.0, 1.5)
BLOCKS = (4, 8, 16)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="stories260K-sbd")
    p.add_argument("--base", default="stories260K", help="original causal model: AR baseline and judge")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1, help="rows per decode call (1 = latency TPS)")
    p.add_argument("--gammas", default=",".join(map(str, GAMMAS)))
    p.add_argument("--blocks", default=",".join(map(str, BLOCKS)))
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench_sbd"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    return p.parse_args()


def run(bundle, prompts, decoder, batch_size, max_new_tokens, **options) -> dict:
    """Decode every prompt; returns tokens per row, summed NFE/tokens/seconds."""
    tokens, nfe_rows, seconds = [], [], 0.0
    for s in range(0, len(prompts), batch_size):
        out = unmask.generate(prompts[s:s + batch_size], bundle, decoder, max_new_tokens=max_new_tokens, **options)
        tokens += out.tokens
        nfe_rows += out.stats.nfe_per_row
        seconds += out.stats.seconds
    generated = sum(len(t) for t in tokens)
    return {"tokens": tokens, "nfe": sum(nfe_rows), "generated": generated, "seconds": seconds,
            "tpf": generated / max(1, sum(nfe_rows)), "tps": generated / seconds}


def quality(judge, prompt_ids, tokens, reference) -> dict:
    nll = reference_nll(judge, prompt_ids, tokens)
    return {"nll": mean(nll), "distinct4": mean([distinct_n(t, 4) for t in tokens]),
            "agree_prefix": mean([agreement(t, r)["prefix"] for t, r in zip(tokens, reference)]),
            "agree_pos": mean([agreement(t, r)["positional"] for t, r in zip(tokens, reference)])}


@torch.inference_mode()
def block_diagnostics(bundle, prompt_ids, ar_tokens, k: int, offsets=range(0, 112, 16)) -> dict:
    """Cross-entropy per block position of an all-mask block vs NTP, and the matched-prefix
    length of the block's argmax, on the model's own AR text (left-padded batches per offset)."""
    model, mask_id = bundle.model, bundle.mask_token_id
    ce_block = torch.zeros(k, dtype=torch.float64)
    counts = torch.zeros(k, dtype=torch.float64)
    ce_ntp, n_ntp, matched = 0.0, 0, []
    for r in offsets:
        rows = [(p, t) for p, t in zip(prompt_ids, ar_tokens) if len(t) >= r + k]
        if not rows:
            continue
        contexts = [list(p) + list(t[:r]) for p, t in rows]
        targets = torch.tensor([t[r:r + k] for _, t in rows])  # (B, k)
        ids, valid, pos = left_pad([c + [mask_id] * k for c in contexts], bundle.pad_token_id, bundle.device)
        B, T = ids.shape
        c_len = T - k
        m = with_key_padding(as_4d(sbd_inference_mask(0, c_len, k), B), valid)  # (B, 1, T, T)
        logits = forward(model, ids, position_ids=pos, attention_mask=attention_mask(model, m))  # (B, T, V)
        logits[..., list(bundle.suppress_ids)] = float("-inf")
        logp = torch.log_softmax(logits, dim=-1)
        block_logp = logp[:, c_len:].gather(-1, targets[..., None]).squeeze(-1)  # (B, k)
        ce_block += -block_logp.double().sum(dim=0)
        counts += B
        ntp_logp = logp[:, c_len - 1].gather(-1, targets[:, :1]).squeeze(-1)  # NTP logit of the first block token
        ce_ntp += float(-ntp_logp.double().sum())
        n_ntp += B
        hit = logits[:, c_len:].argmax(-1) == targets  # (B, k)
        matched += (hit.long().cumprod(dim=1).sum(dim=1)).tolist()
    per_pos = (ce_block / counts.clamp(min=1)).tolist()
    return {"k": k, "ce_ntp": ce_ntp / max(1, n_ntp), "ce_block": per_pos,
            "matched_prefix": sum(matched) / max(1, len(matched))}


def plot(rows, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; skipping the plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in sorted({r["block_size"] for r in rows if r["decoder"] == "sbd"}):
        pts = sorted((r["tpf"], r["nll"], r["gamma"]) for r in rows if r["decoder"] == "sbd" and r["block_size"] == k)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"SBD k={k}")
        for x, y, g in pts:
            ax.annotate(f"γ={g:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for r in rows:
        if r["decoder"] == "ar":
            ax.scatter([r["tpf"]], [r["nll"]], marker="*", s=120, label=f"AR ({r['model']})")
    ax.set_xlabel("tokens per forward (TPF)")
    ax.set_ylabel("reference NLL under stories260K (nats/token, lower is better)")
    ax.set_title("stories260K-sbd: quality vs parallelism")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    unmask.compat.quiet_transformers()
    sbd_model, base = unmask.load(args.model), unmask.load(args.base)
    prompts = list(STORY_OPENINGS[: args.limit])
    prompt_ids = [base.encode(p) for p in prompts]
    gammas = [float(g) for g in args.gammas.split(",")]
    blocks = [int(k) for k in args.blocks.split(",")]
    bs, n = args.batch_size, args.max_new_tokens
    run(sbd_model, prompts[:2], "sbd", bs, 16)  # warm-up
    run(base, prompts[:2], "ar", bs, 16)

    t0 = time.time()
    ar_base = run(base, prompts, "ar", bs, n)
    ar_sbd = run(sbd_model, prompts, "ar", bs, n)
    rows = []
    for model_name, res in ((args.base, ar_base), (args.model, ar_sbd)):
        rows.append({"model": model_name, "decoder": "ar", "block_size": 1, "gamma": None, **_numbers(res),
                     "speedup_nfe": 1.0, "speedup_time": 1.0,
                     **quality(base, prompt_ids, res["tokens"], ar_sbd["tokens"] if model_name == args.model else ar_base["tokens"])})
        print(_line(rows[-1]), flush=True)
    def sbd_row(k: int, g: float) -> None:
        res = run(sbd_model, prompts, "sbd", bs, n, block_size=k, gamma=g)
        rows.append({"model": args.model, "decoder": "sbd", "block_size": k, "gamma": g, **_numbers(res),
                     "speedup_nfe": ar_sbd["nfe"] / res["nfe"] * res["generated"] / ar_sbd["generated"],
                     "speedup_time": res["tps"] / ar_sbd["tps"],
                     **quality(base, prompt_ids, res["tokens"], ar_sbd["tokens"])})
        print(_line(rows[-1]), flush=True)

    for k in blocks:
        for g in gammas:
            sbd_row(k, g)
    # The targets are checked at the model's default preset and at γ = 0 with its block size.
    default = dict(sbd_model.meta.get("decode_defaults") or {})
    default_k = int(default.get("block_size", 16))
    default_g = float(default.get("gamma", 0.35))
    for g in (default_g, 0.0):
        if not any(r["decoder"] == "sbd" and r["block_size"] == default_k and r["gamma"] == g for r in rows):
            sbd_row(default_k, g)
    targets = check_targets(rows, args.model, default_k, default_g)
    diag = [block_diagnostics(sbd_model, prompt_ids, ar_sbd["tokens"], k) for k in blocks]
    elapsed = time.time() - t0

    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = _markdown(rows, diag, args, elapsed, targets)
    atomic_write_text(args.out_dir / "sbd_vs_ar.md", report)
    atomic_write_json(args.out_dir / "sbd_vs_ar.json", {"rows": rows, "diagnostics": diag, "targets": targets,
                                                        "args": {k: str(v) for k, v in vars(args).items()}})
    plot(rows, args.out_dir / "sbd_vs_ar.png")
    print(report)


def check_targets(rows: list[dict], model: str, k: int, gamma: float) -> dict:
    """The issue's targets at the default preset (block size ``k``, ``gamma``) against AR on the
    same model, plus the fastest grid row that keeps the quality targets (a candidate default)."""
    ar = next(r for r in rows if r["decoder"] == "ar" and r["model"] == model)
    sbd = [r for r in rows if r["decoder"] == "sbd"]
    at = next(r for r in sbd if r["block_size"] == k and r["gamma"] == gamma)
    g0 = next(r for r in sbd if r["block_size"] == k and r["gamma"] == 0.0)

    def dnll(r):
        return r["nll"] / ar["nll"] - 1

    def dd4(r):
        return r["distinct4"] / ar["distinct4"] - 1

    checks = [
        ("forwards: ≥ 2x fewer than AR", at["speedup_nfe"], ">= 2.0", at["speedup_nfe"] >= 2.0),
        ("TPS: ≥ 1.8x AR", at["speedup_time"], ">= 1.8", at["speedup_time"] >= 1.8),
        ("reference NLL ≤ 10 % worse than AR", dnll(at), "<= +10 %", dnll(at) <= 0.10),
        ("distinct-4 within 5 % of AR", dd4(at), "within ±5 %", abs(dd4(at)) <= 0.05),
        (f"γ = 0 (k = {k}): reference NLL ≤ 5 % worse than AR", dnll(g0), "<= +5 %", dnll(g0) <= 0.05),
    ]
    keeping = [r for r in sbd if dnll(r) <= 0.10 and abs(dd4(r)) <= 0.05]
    best = max(keeping, key=lambda r: r["tpf"], default=None)
    return {"block_size": k, "gamma": gamma,
            "checks": [{"target": t, "measured": v, "need": need, "met": bool(ok)} for t, v, need, ok in checks],
            "best_within_quality": None if best is None else {key: best[key] for key in (
                "block_size", "gamma", "tpf", "speedup_time", "nll", "distinct4")}}


def _numbers(res: dict) -> dict:
    return {"nfe": res["nfe"], "generated": res["generated"], "tpf": res["tpf"], "tps": res["tps"],
            "seconds": res["seconds"]}


def _line(r: dict) -> str:
    g = "-" if r["gamma"] is None else f"{r['gamma']:g}"
    return (f"{r['model']:<16} {r['decoder']:<4} k={r['block_size']:<3} γ={g:<5} NFE={r['nfe']:<6} TPF={r['tpf']:.2f} "
            f"TPS={r['tps']:.0f} ×time={r['speedup_time']:.2f} NLL={r['nll']:.3f} d4={r['distinct4']:.3f} "
            f"agree={r['agree_prefix']:.2f}")


def _markdown(rows, diag, args, elapsed, targets) -> str:
    ar = next(r for r in rows if r["decoder"] == "ar" and r["model"] == args.model)
    lines = [f"# SBD vs AR: {args.model}, {args.limit} story openings, {args.max_new_tokens} new tokens, greedy, "
             f"batch {args.batch_size} ({elapsed:.0f} s)", "",
             "| model | decoder | k | γ | NFE | TPF | TPS | NFE ratio vs AR | time ratio vs AR | ref NLL | ΔNLL vs AR | distinct-4 | Δd4 | agree (prefix) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dn = (r["nll"] / ar["nll"] - 1) * 100
        dd = (r["distinct4"] / ar["distinct4"] - 1) * 100
        g = "–" if r["gamma"] is None else f"{r['gamma']:g}"
        lines.append(f"| {r['model']} | {r['decoder']} | {r['block_size']} | {g} | {r['nfe']} | {r['tpf']:.2f} | "
                     f"{r['tps']:.0f} | {r['speedup_nfe']:.2f}x | {r['speedup_time']:.2f}x | {r['nll']:.3f} | "
                     f"{dn:+.1f}% | {r['distinct4']:.3f} | {dd:+.1f}% | {r['agree_prefix']:.2f} |")
    lines += ["", f"## Targets at the default preset (k = {targets['block_size']}, γ = {targets['gamma']:g})", "",
              "| target | measured | needed | met |", "|---|---|---|---|"]
    for c in targets["checks"]:
        v = c["measured"]
        shown = f"{v:.2f}x" if "x" in c["need"] or ">=" in c["need"] else f"{v * 100:+.1f} %"
        lines.append(f"| {c['target']} | {shown} | {c['need']} | {'yes' if c['met'] else '**no**'} |")
    best = targets["best_within_quality"]
    lines += ["", "Fastest grid row within the quality targets (ΔNLL ≤ 10 %, |Δd4| ≤ 5 %): " + (
        "none" if best is None else f"k = {best['block_size']}, γ = {best['gamma']:g}: TPF {best['tpf']:.2f}, "
        f"{best['speedup_time']:.2f}x AR time, NLL {best['nll']:.3f}, distinct-4 {best['distinct4']:.3f}")]
    lines += ["", "## Where the gap comes from (all-mask block on the model's own AR text)", "",
              "| k | NTP CE (first token) | block CE at pos 0 | pos 1 | pos 3 | last pos | matched-prefix length |",
              "|---|---|---|---|---|---|---|"]
    for d in diag:
        ce = d["ce_block"]
        lines.append(f"| {d['k']} | {d['ce_ntp']:.3f} | {ce[0]:.3f} | {ce[1]:.3f} | {ce[min(3, len(ce) - 1)]:.3f} | "
                     f"{ce[-1]:.3f} | {d['matched_prefix']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
