"""Self-distilled block mode, before and after (spec/sbd_exact.md §5.5; issue 26 item 3).

For each (before, after) pair of SBD models:

* **masked CE by block offset** 0..K-1 (K = 8, nats) on held-out greedy text: the *teacher's*
  greedy AR continuations (128 tokens) of the hand-written story openings
  (``unmask.eval.story_openings``; the distillation prompts are sampled openings with these
  excluded), every block all-mask after its clean prefix (the lossless decoder's draft groups),
  prompt tokens never scored (:func:`unmask.train.objectives.offset_ce`);
* **lossless SBD** at the model's default (linear drafts, K = 8): TPF and the number of prompts
  whose output is identical to AR, on the first ``--tpf-prompts`` openings, greedy, 1 thread.

The teacher is the model's own NTP mode: for a full SBD model that is the model itself (its AR
output), for ``stories260K+ADAPTER`` the untouched stories260K (AR with the adapter loaded is
exactly stories260K: non-mask tokens run the frozen base).

    python benchmarks/sbd_distill.py --pair stories260K-sbd=runs/distill/sbd-out \\
        --pair stories260K+sbd=stories260K+runs/distill/adapter-out --threads 1
    python benchmarks/sbd_distill.py --sweep 0,0.5,1,2 --sweep-steps 150   # the λ measurement

``--sweep`` fine-tunes stories260K-sbd for ``--sweep-steps`` at each λ (same corpus, seed and
step count) and reports the held-out masked CE at offsets 0..7, the measurement behind
``unmask.train.sbd_distill.DEFAULT_LAMBDA``. Writes ``sbd_distill.md`` / ``.json`` (and
``sbd_distill_lambda.md`` / ``.json`` for the sweep) under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import unmask
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_json, atomic_write_text

K = 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", action="append", default=[], metavar="BEFORE=AFTER",
                   help="model specs (NAME, DIR or NAME+ADAPTER_NAME_OR_DIR); repeatable")
    p.add_argument("--limit", type=int, default=100, help="held-out openings for the masked CE")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tpf-prompts", type=int, default=20, help="openings for lossless TPF / identical-to-AR (0 = skip)")
    p.add_argument("--sweep", default="", help="comma-separated λ values to fine-tune stories260K-sbd with")
    p.add_argument("--sweep-steps", type=int, default=150, help="optimizer steps per λ")
    p.add_argument("--sweep-corpus", type=Path, default=Path("runs/distill/corpus-sbd.jsonl"))
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = leave as is)")
    return p.parse_args(argv)


def load(spec: str):
    name, _, adapter = spec.partition("+")
    return unmask.load(name, adapter=adapter) if adapter else unmask.load(name)


def heldout_rows(teacher, limit: int, max_new_tokens: int) -> list[dict]:
    """The teacher's greedy continuations of the first ``limit`` openings, as distillation rows
    (``ids``, ``loss_start``), made by the same code as the training corpora."""
    from unmask.train.distill import distill

    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "openings.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in STORY_OPENINGS[:limit]))
        out = Path(tmp) / "heldout.jsonl"
        distill(out, model=teacher, prompts=[prompts], max_new_tokens=max_new_tokens, batch_size=50,
                val_fraction=0.0)
        return [json.loads(line) for line in out.read_text().splitlines()]


def offset_table(bundle, rows: list[dict], seq_len: int = 256) -> dict[str, float]:
    """Masked CE (nats) at block offsets 0..K-1 and the NTP CE on ``rows`` packed as in training."""
    from unmask.train.data import pack_labelled, separator_id
    from unmask.train.objectives import offset_ce

    chunks, labels = pack_labelled([r["ids"] for r in rows], [r["loss_start"] for r in rows], seq_len,
                                   separator_id(bundle.tokenizer))  # (N, L+1) each
    if chunks.shape[0] == 0:
        raise SystemExit(f"the held-out text fills no row of {seq_len + 1} tokens; raise --limit or --max-new-tokens")
    return offset_ce(bundle.model.eval(), chunks, labels, int(bundle.mask_token_id), K, tuple(range(K)))


def lossless(bundle, ar_bundle, n: int, max_new_tokens: int) -> dict:
    """Lossless SBD (linear, K = 8) vs AR on the first ``n`` openings, batch 1."""
    prompts = list(STORY_OPENINGS[:n])
    ar = [unmask.generate([p], ar_bundle, "ar", max_new_tokens=max_new_tokens).tokens[0] for p in prompts]
    tokens, nfe, same = 0, 0, 0
    accepts: dict[int, int] = {}
    for p, want in zip(prompts, ar):
        out = unmask.generate([p], bundle, "sbd", max_new_tokens=max_new_tokens, verify=True, block_size=K,
                              draft="linear")
        tokens += len(out.tokens[0])
        nfe += sum(out.stats.nfe_per_row)
        same += out.tokens[0] == want
        for a, c in out.stats.extra.get("accepts", {}).items():
            accepts[int(a)] = accepts.get(int(a), 0) + c
    return {"tpf": tokens / max(1, nfe), "nfe": nfe, "tokens": tokens, "identical": same, "prompts": n,
            "accepts": dict(sorted(accepts.items()))}


def compare(pair: str, args) -> dict:
    before, _, after = pair.partition("=")
    teacher_name = before.partition("+")[0]
    teacher = unmask.load(teacher_name)  # the NTP mode both models verify against
    rows = heldout_rows(teacher, args.limit, args.max_new_tokens)
    result = {"pair": pair, "heldout_rows": len(rows), "heldout_tokens": sum(len(r["ids"]) - r["loss_start"]
                                                                            for r in rows)}
    for tag, spec in (("before", before), ("after", after)):
        bundle = load(spec)
        # a fine-tuned SBD model is its own teacher: its held-out text is its own greedy output
        own = rows if "+" in spec or spec == teacher_name else heldout_rows(bundle, args.limit, args.max_new_tokens)
        entry = {"spec": spec, "ce": offset_table(bundle, own)}
        if args.tpf_prompts:
            ar_bundle = unmask.load(spec.partition("+")[0]) if "+" in spec else bundle
            entry["lossless"] = lossless(bundle, ar_bundle, args.tpf_prompts, args.max_new_tokens)
        result[tag] = entry
        print(json.dumps({tag: entry}), flush=True)
    return result


def sweep(args) -> dict:
    """Short fine-tunes of stories260K-sbd at each λ, one corpus and step count: held-out CE per offset."""
    from unmask.train.sbd import train_sbd

    teacher = unmask.load("stories260K-sbd")
    rows = heldout_rows(teacher, args.limit, args.max_new_tokens)
    out = {"base": offset_table(teacher, rows), "runs": []}
    for lam in map(float, args.sweep.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.monotonic()
            res = train_sbd(base="stories260K-sbd", data=[args.sweep_corpus], out=Path(tmp) / "m", distill=True,
                            distill_lambda=lam, steps=args.sweep_steps, lr=3e-4, warmup=20, batch_size=8,
                            eval_every=0, ckpt_every=0, progress=False, seed=0)
            trained = unmask.load(str(Path(tmp) / "m"))
            own = heldout_rows(trained, args.limit, args.max_new_tokens)
            out["runs"].append({"lambda": lam, "steps": res.step, "seconds": time.monotonic() - t0,
                                "ce": offset_table(trained, own)})
            print(json.dumps(out["runs"][-1]), flush=True)
    return out


def ce_row(label: str, ce: dict) -> str:
    return f"| {label} | {ce['ntp']:.3f} | " + " | ".join(f"{ce[f'd{j}']:.3f}" for j in range(K)) + " |"


def markdown(results: list[dict], env: dict) -> str:
    head = "| model | NTP CE | " + " | ".join(f"d{j}" for j in range(K)) + " |\n|" + "---|" * (K + 2) + "\n"
    lines = [f"# Self-distilled block mode: masked CE by block offset (nats), before / after\n",
             f"Held-out text: the teacher's greedy continuations ({env['max_new_tokens']} tokens) of the first "
             f"{env['limit']} hand-written story openings, never in the distillation prompts; K = {K}, all-mask "
             f"blocks. Lossless: linear drafts, K = {K}, batch 1, greedy, first {env['tpf_prompts']} openings. "
             f"{env['threads']} thread(s), load average {env['load']}.\n"]
    for r in results:
        lines.append(f"\n## {r['pair']}\n\n" + head + ce_row(f"before `{r['before']['spec']}`", r["before"]["ce"]) + "\n"
                     + ce_row(f"after `{r['after']['spec']}`", r["after"]["ce"]) + "\n")
        if "lossless" in r["before"]:
            b, a = r["before"]["lossless"], r["after"]["lossless"]
            lines.append(f"\n| lossless K = 8 linear | TPF | identical to AR | accepts (tokens: count) |\n|---|---|---|---|\n"
                         f"| before | {b['tpf']:.3f} | {b['identical']}/{b['prompts']} | {b['accepts']} |\n"
                         f"| after | {a['tpf']:.3f} | {a['identical']}/{a['prompts']} | {a['accepts']} |\n")
    return "".join(lines)


def sweep_markdown(s: dict, env: dict) -> str:
    head = "| λ | steps | NTP CE | " + " | ".join(f"d{j}" for j in range(K)) + " |\n|" + "---|" * (K + 3) + "\n"
    rows = [f"| shipped | 0 | " + ce_row("", s["base"]).removeprefix("|  | ")]
    rows += [f"| {r['lambda']:g} | {r['steps']} | " + ce_row("", r["ce"]).removeprefix("|  | ") for r in s["runs"]]
    return (f"# λ of the --distill KL term: short fine-tunes of stories260K-sbd\n\nSame corpus, seed and step count "
            f"per λ; held-out masked CE (nats) as in sbd_distill.md. {env['threads']} thread(s), load average "
            f"{env['load']}.\n\n" + head + "\n".join(rows) + "\n")


def main(argv=None):
    import os

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from unmask.compat import quiet_transformers

    quiet_transformers()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = {"threads": torch.get_num_threads(), "torch": torch.__version__, "limit": args.limit,
           "max_new_tokens": args.max_new_tokens, "tpf_prompts": args.tpf_prompts}
    if args.sweep:
        s = sweep(args)
        env["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        atomic_write_json(args.out_dir / "sbd_distill_lambda.json", {"env": env, **s})
        atomic_write_text(args.out_dir / "sbd_distill_lambda.md", sweep_markdown(s, env))
        print(sweep_markdown(s, env))
    if args.pair:
        results = [compare(p, args) for p in args.pair]
        env["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        atomic_write_json(args.out_dir / "sbd_distill.json", {"env": env, "results": results})
        atomic_write_text(args.out_dir / "sbd_distill.md", markdown(results, env))
        print(markdown(results, env))


if __name__ == "__main__":
    main()
