"""Rebuild the shipped ``stories260K-bd`` checkpoint: stories260K trained as a block-diffusion LM (B = 8).

    python recipes/stories260K_bd.py                 # default budget: 60 minutes on 2 CPU cores
    python recipes/stories260K_bd.py --smoke         # ~1 min end-to-end check, writes under the work dir
    python recipes/stories260K_bd.py --resume        # continue an interrupted run (same flags)

Recipe (spec/multiblock.md §1.3; :mod:`unmask.train.block_diffusion`): the causal weights are
loaded unchanged and a mask token is added (a new embedding row, the mean of the others). Each
training row of L tokens is fed as ``[x_t ; x_0]`` (noisy copy, then clean copy, both at
positions 0..L-1) under the dual-stream block-causal mask, and the loss is the masked
cross-entropy on the noisy copy without a logit shift (position i predicts token i, as
SDAR/LLaDA2). Noise: t_k ~ U(0.001, 1.0) i.i.d. per block of B = 8; ``floor(7.x)`` rounding
would never mask a whole block of 8, which is what every block's first forward sees at inference,
so this recipe rounds stochastically (E[masks] = B·t; library default is the spec's floor).

Data. The self-sampled story corpus of ``recipes/stories260K_sbd.py`` (same file): ``--corpus``
defaults to ``runs/stories260K_sbd/corpus-s2400-g5600-t320-seed0.jsonl`` when it exists, else the
same corpus is generated here and cached under the work directory. Documents are split 95/5 by
document (seeded). Every training row starts at a story's BOS (``pack_aligned``), so blocks are
aligned to the story start exactly as the decoders align them to the prompt's first token; rows
are L = 288 tokens (a 32-token prompt plus 256 generated tokens lie inside the trained positions)
and run on into the next story, so the model also learns to end a story (BOS is a stop token).

``--minutes`` bounds the *whole* recipe, corpus included (hard cap 120); unless ``--steps`` is
given, the step count is set from a timing of the real training step so that the cosine
schedule ends inside the budget. The result is published atomically to
``src/unmask/checkpoints/stories260K-bd`` (checkpoints and the log stay in ``WORK/run``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CHECKPOINTS = REPO / "src" / "unmask" / "checkpoints"
HARD_CAP_MINUTES = 120
FINISH_MARGIN_S = 90  # final evaluation, export, publish and the sample decode
SHARED_CORPUS = REPO / "runs" / "stories260K_sbd" / "corpus-s2400-g5600-t320-seed0.jsonl"
SAMPLE_PROMPTS = ["Once upon a time, there was a little girl named Lily.", "Tom had a big red ball."]


def add_common_args(p: argparse.ArgumentParser, *, minutes: float, work_dir: Path) -> None:
    """Options shared with ``stories260K_mbd.py``."""
    p.add_argument("--minutes", type=float, default=minutes, help=f"budget of the whole recipe (max {HARD_CAP_MINUTES})")
    p.add_argument("--work-dir", type=Path, default=work_dir, help="checkpoints, log, corpus")
    p.add_argument("--out", type=Path, default=None, help="model directory (default: the shipped checkpoint "
                                                          "directory; WORK/smoke/... with --smoke)")
    p.add_argument("--corpus", type=Path, default=None,
                   help=f"story corpus JSONL; reused when it exists, else generated there (default: {SHARED_CORPUS} "
                        "when present, else WORK/corpus-....jsonl)")
    p.add_argument("--docs", type=int, default=8000, help="documents to generate when no corpus exists")
    p.add_argument("--greedy-frac", type=float, default=0.7, help="share of greedy-continuation documents")
    p.add_argument("--max-new-tokens", type=int, default=320, help="cap of a story / greedy continuation")
    p.add_argument("--gen-batch", type=int, default=128, help="rows per batched decode while generating")
    p.add_argument("--seq-len", type=int, default=288, help="L, tokens per training row (a multiple of B)")
    p.add_argument("--rounding", choices=("floor", "stochastic"), default="stochastic", help="masks per block")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = fit the budget from a timing run)")
    p.add_argument("--ckpt-every", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = time 1..cores and pick the fastest)")
    p.add_argument("--resume", action="store_true", help="continue the run in WORK/run")
    p.add_argument("--smoke", action="store_true", help="tiny corpus and 20 steps, output under WORK/smoke")


def check_common_args(p: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> argparse.Namespace:
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
        args.out = args.work_dir / name if args.smoke else CHECKPOINTS / name
    return args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common_args(p, minutes=60.0, work_dir=REPO / "runs" / "stories260K_bd")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.0)
    return check_common_args(p, p.parse_args(argv), "stories260K-bd")


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


def time_objective(model, objective, args, threads: int, n: int = 3) -> float:
    """Median seconds per optimizer step of ``objective`` on ``model`` (random BOS-led rows: the
    cost does not depend on the token values)."""
    torch.set_num_threads(threads)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(n + 1):
        chunks = torch.randint(3, 512, (args.batch_size * args.grad_accum, args.seq_len + 1), generator=g)
        chunks[:, 0] = 1
        t0 = time.perf_counter()
        for micro in chunks.split(args.batch_size):  # (B, L+1) each
            loss, _ = objective.loss(model, micro, g)
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[n // 2]  # the first step is warm-up


def pick_threads(args, timer) -> tuple[int, float]:
    """``--threads`` or the fastest of 1..cores (other jobs can make 2 threads slower than 1)."""
    cores = torch.get_num_threads()
    if args.threads:
        step_s = timer(args.threads)
        log(f"timing: {args.threads} thread(s) {step_s:.3f} s/step")
        return args.threads, step_s
    timings = {t: timer(t) for t in range(1, cores + 1)}
    threads = min(timings, key=timings.get)
    log("timing: " + ", ".join(f"{t} thread(s) {s:.3f} s/step" for t, s in timings.items()) + f" -> {threads}")
    return threads, timings[threads]


def plan_steps(args, step_s: float, t_start: float) -> int | None:
    """Steps that fit the budget left (None: no time left). A resumed run keeps its step count."""
    from unmask.train.loop import latest_checkpoint

    remaining = args.minutes * 60 - (time.monotonic() - t_start) - FINISH_MARGIN_S
    if remaining <= 30:
        log(f"no time left to train ({remaining:.0f} s); raise --minutes")
        return None
    ckpt = latest_checkpoint(args.work_dir / "run") if args.resume else None
    if ckpt is not None:
        steps = json.loads((ckpt / "unmask_config.json").read_text())["training"]["config"]["steps"]
        log(f"resuming {ckpt.name} of a {steps}-step run")
    elif args.steps:
        steps = args.steps
    else:
        evals = 1 + 2 / max(1, args.eval_every)  # a validation pass (4 forwards, no backward) costs ~2 steps
        steps = max(1, int(0.93 * remaining / (step_s * evals)))
    args.remaining_minutes = remaining / 60
    log(f"training: {steps} steps (~{step_s:.3f} s/step, {1 / step_s:.2f} steps/s), {remaining / 60:.1f} min left")
    return steps


def sample(out: Path) -> dict:
    """Two prompts through ``block`` and ``multiblock`` on the published model: a sanity check."""
    import unmask

    bundle = unmask.load(str(out))
    result = {}
    for decoder in ("block", "multiblock"):
        gen = unmask.generate(SAMPLE_PROMPTS, model=bundle, decoder=decoder, max_new_tokens=64)
        result[decoder] = {"texts": gen.texts, "tpf": gen.stats.tpf, "nfe": gen.stats.nfe}
    return result


def finish(args, result, t_start: float, threads: int, corpus: Path) -> int:
    summary = {"out": str(result.out), "step": result.step, "stopped": result.stopped,
               "train_minutes": result.seconds / 60, "total_minutes": (time.monotonic() - t_start) / 60,
               "steps_per_s": result.step / max(result.seconds, 1e-9) if not args.resume else None,
               "threads": threads, "last": result.last, "val": result.val, "corpus": str(corpus)}
    if result.out is not None:
        summary["sample"] = sample(result.out)
    (args.work_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done: {json.dumps(summary)}")
    return 130 if result.stopped == "interrupted" else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    import unmask
    from unmask.compat import quiet_transformers
    from unmask.errors import one_line_warnings
    from unmask.models.mask_token import add_mask_token
    from unmask.train.block_diffusion import TFObjective, train_block_diffusion

    quiet_transformers()
    one_line_warnings()  # "warning: ..." as the command line prints it, not Python's source echo

    def timer(threads: int) -> float:
        model = unmask.load("stories260K").model
        objective = TFObjective(add_mask_token(model), args.block_size, rounding=args.rounding)
        return time_objective(model, objective, args, threads)

    threads, step_s = pick_threads(args, timer)
    torch.set_num_threads(threads)
    corpus = build_corpus(args)
    steps = plan_steps(args, step_s, t_start)
    if steps is None:
        return 2
    result = train_block_diffusion(
        base="stories260K", block_size=args.block_size, data=[corpus], out=args.out, run_dir=args.work_dir / "run",
        seq_len=args.seq_len, rounding=args.rounding, resume=args.resume, overwrite=not args.resume, steps=steps,
        batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
        warmup=min(args.warmup, max(1, steps // 10)), weight_decay=args.weight_decay, ckpt_every=args.ckpt_every, eval_every=args.eval_every, seed=args.seed,
        max_minutes=args.remaining_minutes, progress=True,
    )
    return finish(args, result, t_start, threads, corpus)


if __name__ == "__main__":
    sys.exit(main())
