"""How SBD quality moves with fine-tuning length: checkpoints of one ``stories260K_sbd`` run.

For each checkpoint directory (``unmask.load`` opens them like a published model) this decodes
the same story openings with AR (the NTP mode of that checkpoint), SBD at γ = 0 (one token per
forward, block mode: isolates how well masked positions are predicted) and SBD at the default
preset, all greedy, and reports reference NLL under the original stories260K (the judge of
``benchmarks/sbd_vs_ar.py``), distinct-4 and TPF, next to the validation NTP and masked-token
(MAT) cross-entropy the run logged at that step. With ``--corpus`` (the run's JSONL) the NTP and MAT
cross-entropy are recomputed on the *whole* held-out split with fixed noise (runs before the
fix to ``train.loop.evaluate`` logged only the first validation rows, i.e. only the
temperature-1.0 stories of the stories260K corpus). It also reads the run's ``log.jsonl``.

    python benchmarks/sbd_training_curve.py runs/sbd_2h_snapshots/step-* src/unmask/checkpoints/stories260K-sbd
    python benchmarks/sbd_training_curve.py CKPT ... --log runs/stories260K_sbd/run/log.jsonl --limit 20

Writes ``sbd_training_curve.md`` / ``.json`` under --out-dir.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import unmask
from unmask.eval.quality import distinct_n, mean, reference_nll
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_json, atomic_write_text


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", type=Path, help="model / checkpoint directories, any order")
    p.add_argument("--base", default="stories260K", help="the judge (original causal model)")
    p.add_argument("--log", type=Path, default=None, help="the run's log.jsonl (validation curve)")
    p.add_argument("--corpus", type=Path, default=None, help="the run's corpus JSONL: rescore its whole val split")
    p.add_argument("--seq-len", type=int, default=256, help="L of the run (val rows are packed as in training)")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--gamma", type=float, default=0.35, help="the default-preset γ")
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench_sbd"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    return p.parse_args()


def score(bundle, judge, prompts, prompt_ids, decoder, n, **options) -> dict:
    """Decode one prompt at a time (greedy) -> NLL under the judge, distinct-4, TPF."""
    tokens, nfe = [], 0
    for p in prompts:
        out = unmask.generate([p], bundle, decoder, max_new_tokens=n, **options)
        tokens += out.tokens
        nfe += sum(out.stats.nfe_per_row)
    return {"nll": mean(reference_nll(judge, prompt_ids, tokens)), "distinct4": mean([distinct_n(t, 4) for t in tokens]),
            "tpf": sum(len(t) for t in tokens) / max(1, nfe)}


def full_val(bundle, corpus: Path, seq_len: int) -> dict:
    """NTP / MAT cross-entropy of ``bundle`` over every validation row of ``corpus`` (the seeded
    5 % split of training), fixed noise, block size k ~ U{2..16} as in training."""
    from unmask.train.data import pack
    from unmask.train.loop import TrainConfig, evaluate
    from unmask.train.objectives import SBDObjective
    from unmask.train.wiring import load_chunks

    vocab = bundle.model.get_input_embeddings().weight.shape[0]
    _, val = load_chunks([corpus], bundle.tokenizer, vocab, pack, seq_len, need=seq_len + 1, val_fraction=0.05,
                         seed=0)  # (M, L+1)
    cfg = TrainConfig(batch_size=8, eval_batches=-(-len(val) // 8), seed=0)
    with torch.inference_mode():
        return evaluate(bundle.model, SBDObjective(mask_token_id=bundle.mask_token_id), val, cfg, bundle.device)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    unmask.compat.quiet_transformers()
    judge = unmask.load(args.base)
    prompts = list(STORY_OPENINGS[: args.limit])
    prompt_ids = [judge.encode(p) for p in prompts]
    k, n = args.block_size, args.max_new_tokens
    rows, t0 = [], time.time()
    for path in args.checkpoints:
        bundle = unmask.load(str(path))
        training = bundle.meta.get("training", {})
        val = full_val(bundle, args.corpus, args.seq_len) if args.corpus else training.get("val")
        row = {"checkpoint": str(path), "step": training.get("step"), "val": val,
               "ar": score(bundle, judge, prompts, prompt_ids, "ar", n),
               "sbd_g0": score(bundle, judge, prompts, prompt_ids, "sbd", n, block_size=k, gamma=0.0),
               "sbd_default": score(bundle, judge, prompts, prompt_ids, "sbd", n, block_size=k, gamma=args.gamma)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.sort(key=lambda r: (r["step"] is None, r["step"] or 0))
    curve = []
    if args.log is not None and args.log.is_file():
        for line in args.log.read_text().splitlines():
            rec = json.loads(line)
            if "val_ntp" in rec:
                curve.append({"step": rec["step"], "ntp": rec["val_ntp"], "mat": rec.get("val_mat", float("nan"))})
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out_dir / "sbd_training_curve.json", {"rows": rows, "val_curve": curve, "args": {
        key: str(v) for key, v in vars(args).items()}})
    report = _markdown(rows, curve, args, time.time() - t0)
    atomic_write_text(args.out_dir / "sbd_training_curve.md", report)
    print(report)


def _markdown(rows, curve, args, elapsed) -> str:
    lines = [f"# SBD quality vs fine-tuning steps: {args.limit} story openings, {args.max_new_tokens} new tokens, "
             f"greedy, k = {args.block_size} ({elapsed:.0f} s)", "",
             "ΔNLL is against AR decoding of the same checkpoint (its NTP mode); the judge is the original "
             f"{args.base}. Validation cross-entropy: "
             + ("recomputed over the whole held-out split of " + args.corpus.name if args.corpus
                else "as logged by the run") + ".", "",
             "| checkpoint | step | val NTP CE | val MAT CE | AR NLL | γ=0 NLL | γ=0 ΔNLL | "
             f"γ={args.gamma:g} TPF | γ={args.gamma:g} NLL | γ={args.gamma:g} ΔNLL | AR d4 | γ={args.gamma:g} d4 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        val = r["val"] or {}
        ar, g0, d = r["ar"], r["sbd_g0"], r["sbd_default"]
        lines.append(f"| {Path(r['checkpoint']).name} | {r['step']} | {val.get('ntp', float('nan')):.3f} | {val.get('mat', float('nan')):.3f} | "
                     f"{ar['nll']:.3f} | {g0['nll']:.3f} | {(g0['nll'] / ar['nll'] - 1) * 100:+.1f} % | "
                     f"{d['tpf']:.2f} | {d['nll']:.3f} | {(d['nll'] / ar['nll'] - 1) * 100:+.1f} % | "
                     f"{ar['distinct4']:.3f} | {d['distinct4']:.3f} |")
    if curve:
        lines += ["", "Validation curve (log.jsonl): step: NTP / MAT cross-entropy", "",
                  ", ".join(f"{c['step']}: {c['ntp']:.3f} / {c['mat']:.3f}"
                            for c in curve)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
