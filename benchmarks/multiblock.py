"""Multi-Block Diffusion on stories260K: SingleBD vs Block Buffer, TF vs MultiTF (MBD-LMs Table 1 in miniature).

In one run, greedy, the same story openings (the first ``--limit`` of ``unmask.eval``'s 120, default
100), ``--max-new-tokens`` (default 256) each, batch 1 as MBD's Table 3:

    stories260K-bd   + block        SingleBD, separate store (the TF baseline)
    stories260K-bd   + multiblock   training-free MultiBD (Block Buffer, N_buf = --slots)
    stories260K-mbd  + block        SingleBD on the MultiTF model
    stories260K-mbd  + multiblock   MBD: MultiTF model on the Block Buffer

Reported per configuration (a markdown table):

- TPF: generated tokens / forwards, pooled over prompts (NFE counts every step forward, store
  forwards included; prefill excluded);
- TPS: generated tokens / decode seconds; step latency: decode seconds / forwards (ms);
- |R_s|: the mean running-set size over row-steps (1 for SingleBD);
- reference NLL: mean per-token NLL (nats) of the continuation under the original causal
  stories260K with the prompt as context (lower = more fluent; degenerate repetition also
  scores low, so read it next to distinct-4), and 100·exp(-NLL);
- distinct-4: distinct / all 4-grams per continuation, averaged.

Target checks printed at the end: MBD (mbd + multiblock) reaches ≥ 1.5× the TPF of the TF
baseline (bd + block) at ≤ 2 % worse reference NLL, and MultiTF improves multiblock quality over
the training-free run (lower NLL on the same prompts and decoder settings).

Block Buffer thresholds (multiblock.md §3.5): τ_M2T 0.95 (also SingleBD's τ), τ_add 0.1, N_buf 4
(the G_max of the pre-issue-29 stories260K-mbd; today's is trained for G_max 2: pass --slots 2
for it, as benchmarks/multitf_controls.py does), τ_semi 0.9, the Diffulex default. With B = 8 that
means a later block gets its forced top-1 commit only once its predecessor is complete; later
blocks still commit every token above τ_M2T. SDAR-b4's 0.75 (``--tau-semi 0.75``) forces a
low-confidence commit in up to N_buf blocks per step: on stories260K-bd it raised TPF to 1.74 but
the reference NLL by 45 % (benchmarks/results/multiblock.md). All are flags.

    python benchmarks/multiblock.py [--limit 100] [--max-new-tokens 256] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

import unmask
from unmask.errors import UnmaskError
from unmask.eval.env import fingerprint
from unmask.eval.quality import distinct_n, judge_prob_pct, mean, reference_nll
from unmask.eval.story_openings import STORY_OPENINGS

CONFIGS = (("bd", "block"), ("bd", "multiblock"), ("mbd", "block"), ("mbd", "multiblock"))
TPF_TARGET, NLL_SLACK = 1.5, 0.02


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--limit", type=int, default=100, help="story openings to decode (the first N)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--bd", default="stories260K-bd", help="TF block-diffusion model (name or directory)")
    p.add_argument("--mbd", default="stories260K-mbd", help="MultiTF model (name or directory)")
    p.add_argument("--judge", default="stories260K", help="causal model that scores the continuations")
    p.add_argument("--slots", type=int, default=4, help="N_buf of the Block Buffer")
    p.add_argument("--tau", type=float, default=0.95, help="τ_M2T (multiblock) and the SingleBD threshold (block)")
    p.add_argument("--tau-add", type=float, default=0.1)
    p.add_argument("--tau-semi", type=float, default=0.9)
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", default=None, help="also write the rows and checks to this JSON file")
    args = p.parse_args(argv)
    if not 1 <= args.limit <= len(STORY_OPENINGS):
        p.error(f"--limit must be in 1..{len(STORY_OPENINGS)}")
    if args.batch_size < 1 or args.max_new_tokens < 1:
        p.error("--batch-size and --max-new-tokens must be >= 1")
    return args


def decoder_options(decoder: str, args) -> dict:
    if decoder == "block":
        return {"policy": "threshold", "tau": args.tau}
    return {"slots": args.slots, "tau_m2t": args.tau, "tau_add": args.tau_add, "tau_semi": args.tau_semi}


def run_config(bundle, decoder: str, prompts: list[str], args) -> dict:
    """Decode every prompt; returns pooled statistics and the continuations (ids)."""
    options = decoder_options(decoder, args)
    tokens, prompt_ids = [], []
    nfe_rows = seconds = nfe_batches = 0
    rs_sum = rs_n = 0.0
    for s in range(0, len(prompts), args.batch_size):
        gen = unmask.generate(prompts[s : s + args.batch_size], bundle, decoder, max_new_tokens=args.max_new_tokens,
                              **options)
        st = gen.stats
        tokens += gen.tokens
        prompt_ids += gen.prompt_tokens
        nfe_rows += sum(st.nfe_per_row)
        nfe_batches += st.nfe
        seconds += st.seconds
        for r, extra in enumerate(st.extra.get("row_extra", [])):
            sizes = extra.get("running_set")
            if sizes is not None:  # Block Buffer: |R_s| at each of the row's steps
                rs_sum, rs_n = rs_sum + sum(sizes), rs_n + len(sizes)
            else:  # SingleBD: one block in flight
                rs_sum, rs_n = rs_sum + st.nfe_per_row[r], rs_n + st.nfe_per_row[r]
    generated = sum(len(t) for t in tokens)
    return {"tokens": tokens, "prompt_ids": prompt_ids, "generated": generated, "tpf": generated / max(1, nfe_rows),
            "tps": generated / seconds if seconds > 0 else 0.0, "step_ms": 1000 * seconds / max(1, nfe_batches),
            "running_set": rs_sum / max(1.0, rs_n), "seconds": seconds, "nfe": nfe_rows,
            "options": options}


def score(row: dict, judge) -> None:
    nll = reference_nll(judge, row["prompt_ids"], row["tokens"])
    row["nll"] = mean(nll)
    row["judge_pct"] = judge_prob_pct(row["nll"]) if row["nll"] is not None else None
    row["distinct4"] = mean([distinct_n(t, 4) for t in row["tokens"]])
    row["tokens_per_row"] = row["generated"] / max(1, len(row["tokens"]))


def fmt(x, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows: dict) -> str:
    head = ("| model | decoder | TPF | TPS | step ms | mean R_s | ref NLL | judge p % | distinct-4 | tokens/row |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for (model, decoder), r in rows.items():
        lines.append(f"| stories260K-{model} | {decoder} | {r['tpf']:.2f} | {r['tps']:.0f} | {r['step_ms']:.2f} | "
                     f"{r['running_set']:.2f} | {fmt(r['nll'], '.4f')} | {fmt(r['judge_pct'], '.2f')} | "
                     f"{fmt(r['distinct4'], '.3f')} | {r['tokens_per_row']:.1f} |")
    return "\n".join(lines)


def checks(rows: dict) -> list[dict]:
    base, mbd, free = rows[("bd", "block")], rows[("mbd", "multiblock")], rows[("bd", "multiblock")]
    ratio = mbd["tpf"] / base["tpf"] if base["tpf"] else math.nan
    worse = (mbd["nll"] - base["nll"]) / base["nll"] if base["nll"] else math.nan
    out = [
        {"check": f"MBD TPF >= {TPF_TARGET}x TF SingleBD", "value": f"{ratio:.3f}x", "pass": ratio >= TPF_TARGET},
        {"check": f"MBD ref NLL <= {100 * NLL_SLACK:.0f} % worse than TF SingleBD", "value": f"{100 * worse:+.2f} %",
         "pass": worse <= NLL_SLACK},
        {"check": "MultiTF improves multiblock NLL over training-free",
         "value": f"{mbd['nll']:.4f} vs {free['nll']:.4f}", "pass": mbd["nll"] < free["nll"]},
        {"check": "(info) MultiTF multiblock distinct-4 vs training-free",
         "value": f"{fmt(mbd['distinct4'], '.3f')} vs {fmt(free['distinct4'], '.3f')}", "pass": None},
    ]
    return out


def first_forward_profile(bundle, prompts: list[str], args, batch: int = 20) -> dict:
    """Where the parallelism goes: at the first forward of every fully masked block of a SingleBD
    decode (threshold τ, the clean prefix is the prompt plus the decode so far), per block position
    the mean top-1 probability, the share at or above τ (what one forward may commit) and how
    often that first guess is the token finally committed there (overall and among ≥ τ)."""
    from unmask.api import encode_prompts
    from unmask.decode import DECODERS

    decode = DECODERS["block"].decode

    mask_id, B = bundle.mask_token_id, None
    conf, hit, where = [], [], []
    for s in range(0, len(prompts), batch):
        ids = encode_prompts(bundle, prompts[s:s + batch], args.max_new_tokens)
        seen = []

        def hook(state, seen=seen):
            logits = state["logits"]  # (R, B, V): the block being denoised
            width = logits.shape[1]
            if bool((state["inp"][:, -width:] == mask_id).all()):
                top = torch.softmax(logits.float(), dim=-1).max(dim=-1)  # (R, B) each
                seen.append((top.values, top.indices, state["positions"][:, -width:].clone()))

        out = decode(bundle, ids, max_new_tokens=args.max_new_tokens, policy="threshold", tau=args.tau,
                     on_forward=hook)
        for values, indices, positions in seen:
            B = values.shape[1]
            for r, row in enumerate(out.tokens):
                rel = positions[r] - len(ids[r])  # (B,) generated indices
                keep = (rel >= 0) & (rel < len(row))
                if bool(keep.any()):
                    final = torch.tensor(row)[rel[keep]]
                    conf.append(values[r][keep])
                    hit.append(indices[r][keep] == final)
                    where.append(torch.arange(B)[keep])
    conf_t, hit_t, pos_t = torch.cat(conf), torch.cat(hit), torch.cat(where)
    sure = conf_t >= args.tau
    per_pos = [{"pos": j, "mean_conf": float(conf_t[pos_t == j].mean()),
                "share_ge_tau": float(sure[pos_t == j].float().mean()), "acc": float(hit_t[pos_t == j].float().mean()),
                "acc_ge_tau": float(hit_t[(pos_t == j) & sure].float().mean()) if bool(((pos_t == j) & sure).any())
                else None} for j in range(B or 0) if bool((pos_t == j).any())]
    blocks = max(1, int((pos_t == 0).sum()))
    return {"tau": args.tau, "per_position": per_pos, "ge_tau_per_block": float(sure.sum()) / blocks,
            "acc_ge_tau": float(hit_t[sure].float().mean()) if bool(sure.any()) else None}


def profile_table(name: str, p: dict) -> str:
    lines = [f"{name}: {p['ge_tau_per_block']:.2f} positions ≥ τ = {p['tau']} at a block's first forward; "
             f"their first guess is final {fmt(None if p['acc_ge_tau'] is None else 100 * p['acc_ge_tau'], '.1f')} % "
             "of the time.", "",
             "| block position | mean top-1 prob | share ≥ τ | first guess = final | same, among ≥ τ |",
             "|---:|---:|---:|---:|---:|"]
    for r in p["per_position"]:
        lines.append(f"| {r['pos']} | {r['mean_conf']:.3f} | {r['share_ge_tau']:.3f} | {r['acc']:.3f} | "
                     f"{fmt(r['acc_ge_tau'], '.3f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from unmask.compat import quiet_transformers

    quiet_transformers()
    try:
        models = {"bd": unmask.load(args.bd), "mbd": unmask.load(args.mbd)}
        judge = unmask.load(args.judge)
    except UnmaskError as e:
        print(f"error: {e}\n(build the models with recipes/stories260K_bd.py and recipes/stories260K_mbd.py)",
              file=sys.stderr)
        return 2
    prompts = list(STORY_OPENINGS[: args.limit])
    for bundle in models.values():  # warm-up: first-call overheads stay out of the timings
        unmask.generate(prompts[:1], bundle, "multiblock", max_new_tokens=16, slots=args.slots)
    rows = {}
    t0 = time.monotonic()
    for model, decoder in CONFIGS:
        rows[(model, decoder)] = run_config(models[model], decoder, prompts, args)
        print(f"[{time.monotonic() - t0:.0f} s] {model} + {decoder}: TPF {rows[(model, decoder)]['tpf']:.2f}",
              file=sys.stderr, flush=True)
    for row in rows.values():
        score(row, judge)
    print(f"## Multi-Block Diffusion on stories260K ({len(prompts)} story openings, {args.max_new_tokens} new tokens, "
          f"greedy, batch {args.batch_size})\n")
    print(table(rows) + "\n")
    results = checks(rows)
    print("| target check | value | pass |\n|---|---|---|")
    for c in results:
        print(f"| {c['check']} | {c['value']} | {'—' if c['pass'] is None else ('yes' if c['pass'] else 'NO')} |")
    profiles = {name: first_forward_profile(models[name], prompts, args) for name in ("bd", "mbd")}
    print("\n### Where the gap comes from: a SingleBD block's first forward\n")
    for name, prof in profiles.items():
        print(profile_table(f"stories260K-{name}", prof) + "\n")
    settings = decoder_options("multiblock", args)
    print(f"\nBlock Buffer: {settings}; SingleBD: threshold τ = {args.tau}, store separate. "
          f"Judge: {args.judge}. {torch.get_num_threads()} thread(s).")
    if args.json:
        env = fingerprint(device="cpu", dtype="float32", batch_size=args.batch_size)
        dump = {"args": vars(args), "env": env, "checks": results, "first_forward_profile": profiles,
                "rows": [{"model": m, "decoder": d, **{k: v for k, v in r.items() if k not in ("tokens", "prompt_ids")}}
                         for (m, d), r in rows.items()]}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dump, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
