"""Rebuild the shipped ``stories260K-dlm`` checkpoint: stories260K adapted into a masked-diffusion LM.

    python recipes/stories260K_dlm.py                 # default budget: 100 minutes on 2 CPU cores
    python recipes/stories260K_dlm.py --smoke         # ~1 min end-to-end check, writes under the work dir
    python recipes/stories260K_dlm.py --resume        # continue an interrupted run (same flags)

Recipe (spec/diffusion.md §1–2, Dream-style AR-to-diffusion; :mod:`unmask.train.diffusion`):
the causal weights are loaded unchanged, a mask token is added (a new embedding row, the mean
of the others), attention becomes bidirectional, and the one-position logit shift is kept
(position i is predicted from the logits at i − 1, so the AR head's alignment is reused; every
canvas starts with BOS). Loss: t ~ U[1e-3, 1) per sequence, each token masked with
probability t, 1/t-weighted cross-entropy on the masked tokens, normalised by the maskable
tokens. Prompt conditioning: half the sequences keep a clean prefix of uniform length (no loss
there), so the model rehearses continuing a clean prompt; the rest are noised everywhere but BOS.

Data. The self-sampled story corpus of ``recipes/stories260K_sbd.py`` (same code, same file):
``--corpus`` defaults to ``runs/stories260K_sbd/corpus-s2400-g5600-t320-seed0.jsonl`` when it
exists (8000 documents before de-duplication, 70 % greedy continuations of sampled prefixes,
30 % stories sampled at T = 1.0), else the same corpus is generated here and cached under the
work directory. Documents are split 95/5 by document (seeded), packed into BOS-led chunks of
L = 256 tokens (so a prompt plus 128 generated tokens lies inside the trained positions).

``--minutes`` bounds the *whole* recipe, corpus included (hard cap 120); unless ``--steps`` is
given, the step count is set from a timing of the real training step so that the cosine
schedule ends inside the budget. The result is published atomically to
``src/unmask/checkpoints/stories260K-dlm`` (checkpoints and the log stay in ``WORK/run``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
HARD_CAP_MINUTES = 120
FINISH_MARGIN_S = 90  # final evaluation, export, publish and the sample decode
SHARED_CORPUS = REPO / "runs" / "stories260K_sbd" / "corpus-s2400-g5600-t320-seed0.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=100.0, help=f"budget of the whole recipe (max {HARD_CAP_MINUTES})")
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "stories260K_dlm", help="checkpoints, log, corpus")
    p.add_argument("--out", type=Path, default=None,
                   help="model directory (default: src/unmask/checkpoints/stories260K-dlm; WORK/smoke/... with --smoke)")
    p.add_argument("--corpus", type=Path, default=None,
                   help=f"story corpus JSONL; reused when it exists, else generated there (default: {SHARED_CORPUS} "
                        "when present, else WORK/corpus-....jsonl)")
    p.add_argument("--docs", type=int, default=8000, help="documents to generate when no corpus exists")
    p.add_argument("--greedy-frac", type=float, default=0.7, help="share of greedy-continuation documents")
    p.add_argument("--max-new-tokens", type=int, default=320, help="cap of a story / greedy continuation")
    p.add_argument("--gen-batch", type=int, default=128, help="rows per batched decode while generating")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence after its BOS")
    p.add_argument("--prefix-prob", type=float, default=0.5, help="share of sequences keeping a clean prefix")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = fit the budget from a timing run)")
    p.add_argument("--ckpt-every", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = time 1..cores and pick the fastest)")
    p.add_argument("--resume", action="store_true", help="continue the run in WORK/run")
    p.add_argument("--smoke", action="store_true", help="tiny corpus and 20 steps (~1 min), output under WORK/smoke")
    args = p.parse_args(argv)
    if not 0 < args.minutes <= HARD_CAP_MINUTES:
        p.error(f"--minutes must be in (0, {HARD_CAP_MINUTES}]")
    if not 0 <= args.greedy_frac <= 1:
        p.error("--greedy-frac must be in [0, 1]")
    if args.smoke:
        args.work_dir = args.work_dir / "smoke"
        args.docs, args.max_new_tokens, args.gen_batch = 24, 48, 24
        args.seq_len, args.batch_size, args.warmup = 64, 4, 5
        args.steps, args.ckpt_every, args.eval_every = args.steps or 20, 10, 10
        args.minutes = min(args.minutes, 5)
    if args.out is None:
        shipped = REPO / "src" / "unmask" / "checkpoints" / "stories260K-dlm"
        args.out = args.work_dir / "stories260K-dlm" if args.smoke else shipped
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def corpus_path(args) -> Path:
    """--corpus, else the SBD recipe's corpus when it exists (not in --smoke), else one here."""
    if args.corpus is not None:
        return args.corpus
    if not args.smoke and SHARED_CORPUS.is_file():
        return SHARED_CORPUS
    n_greedy = round(args.docs * args.greedy_frac)
    return args.work_dir / f"corpus-s{args.docs - n_greedy}-g{n_greedy}-t{args.max_new_tokens}-seed{args.seed}.jsonl"


def build_corpus(args) -> Path:
    from unmask.train.data import make_story_corpus

    path = corpus_path(args)
    if path.is_file():
        log(f"corpus: reusing {path}")
        return path
    n_greedy = round(args.docs * args.greedy_frac)
    n_sampled = args.docs - n_greedy
    t0 = time.monotonic()
    log(f"corpus: generating {n_sampled} sampled + {n_greedy} greedy documents with stories260K into {path}")

    def progress(done: int, total: int) -> None:
        log(f"corpus: {done}/{total} documents ({time.monotonic() - t0:.0f} s)")

    summary = make_story_corpus(path, model="stories260K", n_sampled=n_sampled, n_greedy=n_greedy, seed=args.seed,
                                overwrite=True, progress=progress, max_new_tokens=args.max_new_tokens,
                                batch_size=args.gen_batch)
    log(f"corpus: {summary} in {time.monotonic() - t0:.0f} s")
    return path


def time_steps(args, threads: int, n: int = 3) -> float:
    """Median seconds per optimizer step of the real configuration (random tokens: the cost does
    not depend on their values, only on the masked share, which t ~ U draws anew each step)."""
    import unmask
    from unmask.models.mask_token import add_mask_token
    from unmask.train.diffusion import MaskedDiffusionObjective

    torch.set_num_threads(threads)
    bundle = unmask.load("stories260K")
    model = bundle.model.train()
    objective = MaskedDiffusionObjective(add_mask_token(model), prefix_prob=args.prefix_prob)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(n + 1):
        chunks = torch.randint(3, 512, (args.batch_size * args.grad_accum, args.seq_len + 1), generator=g)
        chunks[:, 0] = 1  # BOS-led
        t0 = time.perf_counter()
        for micro in chunks.split(args.batch_size):  # (B, L+1) each
            loss, _ = objective.loss(model, micro, g)
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[n // 2]  # the first step is warm-up


def sample(out: Path) -> dict:
    """A two-prompt decode of the published model (threshold 0.9, block 32): a sanity check."""
    import unmask

    gen = unmask.generate(["Once upon a time, there was a little girl named Lily.", "Tom had a big red ball."],
                          model=str(out), decoder="diffusion", max_new_tokens=64, block_size=32, cache="prefix")
    return {"texts": gen.texts, "tpf": gen.stats.tpf, "nfe": gen.stats.nfe}


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    budget_s = args.minutes * 60
    args.work_dir.mkdir(parents=True, exist_ok=True)
    from unmask.compat import quiet_transformers
    from unmask.errors import one_line_warnings
    from unmask.train.diffusion import train_diffusion
    from unmask.train.loop import latest_checkpoint

    quiet_transformers()
    one_line_warnings()  # "warning: ..." as the command line prints it, not Python's source echo
    cores = torch.get_num_threads()
    if args.threads:
        threads = args.threads
        step_s = time_steps(args, threads)
        log(f"timing: {threads} thread(s) {step_s:.3f} s/step")
    else:  # other jobs on the machine can make 2 threads far slower than 1: measure
        timings = {t: time_steps(args, t) for t in range(1, cores + 1)}
        threads = min(timings, key=timings.get)
        step_s = timings[threads]
        log("timing: " + ", ".join(f"{t} thread(s) {s:.3f} s/step" for t, s in timings.items()) + f" -> {threads}")
    torch.set_num_threads(threads)
    corpus = build_corpus(args)
    run_dir = args.work_dir / "run"
    ckpt = latest_checkpoint(run_dir) if args.resume else None
    remaining = budget_s - (time.monotonic() - t_start) - FINISH_MARGIN_S
    if remaining <= 30:
        log(f"no time left to train ({remaining:.0f} s); raise --minutes")
        return 2
    if ckpt is not None:
        steps = json.loads((ckpt / "unmask_config.json").read_text())["training"]["config"]["steps"]
        log(f"resuming {ckpt.name} of a {steps}-step run")
    elif args.steps:
        steps = args.steps
    else:
        evals = 1 + 2 / max(1, args.eval_every)  # a validation pass (4 forwards, no backward) costs ~2 steps
        steps = max(1, int(0.85 * remaining / (step_s * evals)))  # margin: a shared machine runs slower than timed
    log(f"training: {steps} steps (~{step_s:.3f} s/step, {1 / step_s:.2f} steps/s), {remaining / 60:.1f} min left")
    result = train_diffusion(
        base="stories260K", data=[corpus], out=args.out, run_dir=run_dir, seq_len=args.seq_len,
        prefix_prob=args.prefix_prob, resume=args.resume, overwrite=not args.resume, steps=steps,
        batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr, warmup=min(args.warmup, max(1, steps // 10)),
        weight_decay=args.weight_decay, ckpt_every=args.ckpt_every, eval_every=args.eval_every, seed=args.seed,
        max_minutes=remaining / 60, progress=True,
    )
    summary = {"out": str(result.out), "step": result.step, "stopped": result.stopped,
               "train_minutes": result.seconds / 60, "total_minutes": (time.monotonic() - t_start) / 60,
               "steps_per_s": result.step / max(result.seconds, 1e-9) if not args.resume else None,
               "threads": threads, "last": result.last, "val": result.val, "corpus": str(corpus)}
    if result.out is not None:
        summary["sample"] = sample(result.out)
    (args.work_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done: {json.dumps(summary)}")
    return 130 if result.stopped == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
