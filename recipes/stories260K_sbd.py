"""Rebuild the shipped ``stories260K-sbd`` checkpoint: stories260K fine-tuned for Set Block Decoding.

    python recipes/stories260K_sbd.py                 # default budget: 100 minutes on 2 CPU cores
    python recipes/stories260K_sbd.py --smoke         # ~30 s end-to-end check, writes under the work dir
    python recipes/stories260K_sbd.py --resume        # continue an interrupted run (same flags)
    python recipes/stories260K_sbd.py --distill --threads 1 --minutes 25 --eval-every 100 --ckpt-every 100
        # stage 2, the shipped run: self-distillation fine-tune (175 steps on a machine at load ~6)

Data provenance. No TinyStories text is available offline, so the corpus is written by the base
model itself (``unmask.train.data.generate_stories``):

- ``sampled``: stories drawn at temperature 1.0 from BOS, i.e. the model's own distribution;
- ``greedy``: a prefix of 4–40 tokens sampled at T = 1.0, then the model's *greedy*
  continuation. This is the distribution SBD is decoded under (greedy decoding of the same
  weights), the way speculative-decoding drafters are trained on their target's outputs; in a
  prototype it roughly doubled tokens per forward. Greedy continuations of a 260K model are
  often repetitive, which is exactly the regime its parallel decoding runs in.

Documents are de-duplicated, 5 % are held out by document (seeded), and the corpus is cached as
JSONL under the work directory, so a rerun or ``--resume`` skips generation.

Training: the joint NTP + masked-token loss of SBD Eq. 14 (spec/sbd.md §3), k ~ U{2..16} per
step, L = 256 tokens per sequence (so a prompt plus 128 generated tokens sits inside the trained
positions), AdamW with linear warm-up and cosine decay. ``--minutes`` bounds the *whole* recipe,
corpus included (hard cap 120); unless ``--steps`` is given, the step count is set from a short
timing of the real training step so that the cosine schedule ends inside the budget. The result
is published atomically to ``src/unmask/checkpoints/stories260K-sbd`` (checkpoints and the log
stay in ``WORK/run``) with ``decode_defaults`` (block size 8, γ = 0.35 unless
``--default-block-size`` / ``--default-gamma`` say otherwise), the preset ``unmask generate``
uses; ``benchmarks/sbd_vs_ar.py`` checks the targets at it.

Stage 2, ``--distill`` (spec/sbd_exact.md §5.5, issue 26): a short fine-tune of stage 1's model
(``--init``, default the checkpoint stage 1 publishes) on *its own* greedy text, the text lossless
decoding verifies against: ``--distill-prompts`` story openings sampled from it (4–40 tokens, the
benchmark's hand-written openings excluded) continued greedily for 192 tokens
(``unmask.train.sbd_distill.make_story_distill_corpus``, cached in WORK/distill/), then
``train_sbd(base=INIT, distill=True)``: CE to the greedy tokens + λ · KL(NTP ‖ block) with the
same forward's NTP mode as the teacher, lr 3e-4, warm-up 50, cosine, the step count fitted to
``--minutes`` (whole stage, corpus included). It writes WORK/distill/stories260K-sbd; that model
replaces the shipped one only when ``benchmarks/sbd_distill.py`` shows lower held-out masked CE
at the first offsets, identical lossless/AR output and a higher lossless TPF (then copy it over
``src/unmask/checkpoints/stories260K-sbd``, or pass ``--out`` there). Its ``unmask_config.json``
keeps stage 1's training record under ``init``. The shipped checkpoint is that run (λ = 1,
175 steps of batch 8, 17.9 minutes of training at 1 thread, nice 19, load average ~6): held-out
masked CE 0.466 -> 0.371 nats at offset 0, 1.027 -> 0.868 at offset 1, lower at every offset;
lossless TPF (linear, K = 8, 20 openings) 2.23 -> 2.37, 20/20 identical to AR
(benchmarks/results/sbd_distill.md). The checkpoint shipped now is a second stage-2 run from that
one, ``--distill --threads 1 --minutes 55 --distill-prompts 8000`` (5,939 steps, 50 minutes of
training at 1 thread on a quiet machine): masked CE 0.371 -> 0.286 at offset 0, 0.868 -> 0.523 at
offset 1, linear TPF 2.37 -> 3.02, 20/20 identical to AR (sbd_distill_round2.md); its draft
layouts are then recalibrated with ``unmask calibrate-drafts stories260K-sbd --overwrite``.
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
FINISH_MARGIN_S = 90  # final evaluation, export and publish


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=100.0, help=f"budget of the whole recipe (max {HARD_CAP_MINUTES})")
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "stories260K_sbd", help="corpus cache, checkpoints, log")
    p.add_argument("--out", type=Path, default=None,
                   help="model directory (default: src/unmask/checkpoints/stories260K-sbd; WORK/smoke/... with --smoke)")
    p.add_argument("--docs", type=int, default=8000, help="documents to generate (before de-duplication)")
    p.add_argument("--greedy-frac", type=float, default=0.7, help="share of greedy-continuation documents")
    p.add_argument("--max-new-tokens", type=int, default=320, help="cap of a story / greedy continuation")
    p.add_argument("--gen-batch", type=int, default=128, help="rows per batched decode while generating")
    p.add_argument("--seq-len", type=int, default=256, help="L, tokens per training sequence")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = fit the budget from a timing run)")
    p.add_argument("--ckpt-every", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--default-block-size", type=int, default=8,
                   help="decode_defaults written into the published model (picked with benchmarks/sbd_vs_ar.py)")
    p.add_argument("--default-gamma", type=float, default=0.35, help="decode_defaults γ (the chat-low preset)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = time 1..cores and pick the fastest)")
    p.add_argument("--resume", action="store_true", help="continue the run in WORK/run")
    p.add_argument("--smoke", action="store_true", help="tiny corpus and 20 steps (~30 s), output under WORK/smoke")
    p.add_argument("--distill", action="store_true", help="stage 2: self-distillation fine-tune of --init")
    p.add_argument("--init", default=None,
                   help="stage 2's starting model (default: stories260K-sbd, the checkpoint stage 1 publishes)")
    p.add_argument("--distill-lambda", type=float, default=None, help="λ of the KL term (default: the library's)")
    p.add_argument("--distill-prompts", type=int, default=2000, help="story openings to sample for stage 2")
    p.add_argument("--distill-lr", type=float, default=3e-4)
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
    if args.distill:
        args.init = args.init or "stories260K-sbd"  # the shipped name: what the corpus and the record name
        args.out = args.out or args.work_dir / "distill" / "stories260K-sbd"
        if args.smoke:
            args.distill_prompts = 24
    if args.out is None:
        args.out = args.work_dir / "stories260K-sbd" if args.smoke else REPO / "src" / "unmask" / "checkpoints" / "stories260K-sbd"
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_corpus(args) -> Path:
    from unmask.train.data import make_story_corpus

    n_greedy = round(args.docs * args.greedy_frac)
    n_sampled = args.docs - n_greedy
    path = args.work_dir / f"corpus-s{n_sampled}-g{n_greedy}-t{args.max_new_tokens}-seed{args.seed}.jsonl"
    if path.is_file():
        log(f"corpus: reusing {path}")
        return path
    t0 = time.monotonic()
    log(f"corpus: generating {n_sampled} sampled + {n_greedy} greedy documents with stories260K")

    def progress(done: int, total: int) -> None:
        log(f"corpus: {done}/{total} documents ({time.monotonic() - t0:.0f} s)")

    summary = make_story_corpus(path, model="stories260K", n_sampled=n_sampled, n_greedy=n_greedy, seed=args.seed,
                                overwrite=True, progress=progress, max_new_tokens=args.max_new_tokens,
                                batch_size=args.gen_batch)
    log(f"corpus: {summary} in {time.monotonic() - t0:.0f} s")
    return path


def time_steps(args, threads: int, n: int = 3) -> float:
    """Median seconds per training step of the real configuration (random tokens: the cost does
    not depend on their values)."""
    import unmask
    from unmask.models.mask_token import add_mask_token
    from unmask.train.objectives import SBDObjective
    from unmask.train.sbd_distill import DEFAULT_LAMBDA

    torch.set_num_threads(threads)
    bundle = unmask.load("stories260K")
    model = bundle.model.train()
    lam = (DEFAULT_LAMBDA if args.distill_lambda is None else args.distill_lambda) if args.distill else None
    objective = SBDObjective(add_mask_token(model), distill_lambda=lam)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(n + 1):
        chunks = torch.randint(3, 512, (args.batch_size * args.grad_accum, args.seq_len + 1), generator=g)
        t0 = time.perf_counter()
        for micro in chunks.split(args.batch_size):  # (B, L+1) each
            loss, _ = objective.loss(model, micro, g, k=9)  # mid-range block size
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[n // 2]  # the first step is warm-up


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    budget_s = args.minutes * 60
    args.work_dir.mkdir(parents=True, exist_ok=True)
    from unmask.compat import quiet_transformers
    from unmask.errors import one_line_warnings
    from unmask.train.loop import latest_checkpoint
    from unmask.train.sbd import train_sbd
    from unmask.train.wiring import set_decode_defaults

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
    if args.distill:
        return distill_stage(args, t_start, step_s, threads)
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
        evals = 1 + 3 / max(1, args.eval_every)  # a validation pass costs about 3 steps
        steps = max(1, int(0.93 * remaining / (step_s * evals)))
    log(f"training: {steps} steps (~{step_s:.3f} s/step, {1 / step_s:.2f} steps/s), {remaining / 60:.1f} min left")
    result = train_sbd(
        base="stories260K", data=[corpus], out=args.out, run_dir=run_dir, seq_len=args.seq_len,
        resume=args.resume, overwrite=not args.resume, steps=steps, batch_size=args.batch_size,
        grad_accum=args.grad_accum, lr=args.lr, warmup=min(args.warmup, max(1, steps // 10)),
        weight_decay=args.weight_decay, ckpt_every=args.ckpt_every, eval_every=args.eval_every, seed=args.seed,
        max_minutes=remaining / 60, progress=True,
    )
    if result.out is not None:
        set_decode_defaults(result.out, block_size=args.default_block_size, gamma=args.default_gamma)
    summary = {"out": str(result.out), "step": result.step, "stopped": result.stopped,
               "train_minutes": result.seconds / 60, "total_minutes": (time.monotonic() - t_start) / 60,
               "steps_per_s": result.step / max(result.seconds, 1e-9) if not args.resume else None,
               "threads": threads, "last": result.last, "val": result.val, "corpus": str(corpus)}
    (args.work_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done: {json.dumps(summary)}")
    return 130 if result.stopped == "interrupted" else 0


def distill_stage(args, t_start: float, step_s: float, threads: int) -> int:
    """Stage 2 (module docstring): the init model's greedy corpus, then a --distill fine-tune."""
    from unmask.train.loop import latest_checkpoint
    from unmask.train.sbd import train_sbd
    from unmask.train.sbd_distill import make_story_distill_corpus

    work = args.work_dir / "distill"
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"corpus-p{args.distill_prompts}-seed{args.seed}.jsonl"
    t0 = time.monotonic()
    summary = make_story_distill_corpus(corpus, model=args.init, n_prompts=args.distill_prompts, seed=args.seed,
                                        max_new_tokens=48 if args.smoke else 192, batch_size=args.gen_batch)
    log(f"distill corpus: {summary} in {time.monotonic() - t0:.0f} s")
    run_dir = work / "run"
    remaining = args.minutes * 60 - (time.monotonic() - t_start) - FINISH_MARGIN_S
    if remaining <= 30:
        log(f"no time left to train ({remaining:.0f} s); raise --minutes")
        return 2
    ckpt = latest_checkpoint(run_dir) if args.resume else None
    if ckpt is not None:
        steps = json.loads((ckpt / "unmask_config.json").read_text())["training"]["config"]["steps"]
    else:
        steps = args.steps or max(1, int(0.93 * remaining / (step_s * (1 + 3 / max(1, args.eval_every)))))
    log(f"distill training: {steps} steps from {args.init}, {remaining / 60:.1f} min left")
    result = train_sbd(
        base=args.init, data=[corpus], out=args.out, run_dir=run_dir, seq_len=args.seq_len, resume=args.resume,
        overwrite=not args.resume, steps=steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
        lr=args.distill_lr, warmup=min(50, max(1, steps // 10)), weight_decay=args.weight_decay,
        ckpt_every=args.ckpt_every, eval_every=args.eval_every, seed=args.seed, max_minutes=remaining / 60,
        progress=True, distill=True, distill_lambda=args.distill_lambda,
    )
    summary = {"out": str(result.out), "step": result.step, "stopped": result.stopped,
               "train_minutes": result.seconds / 60, "total_minutes": (time.monotonic() - t_start) / 60,
               "threads": threads, "last": result.last, "val": result.val, "corpus": str(corpus)}
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done: {json.dumps(summary)}")
    return 130 if result.stopped == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
