"""Data-parallel SBD training on stories260K: 1 process against 2 gloo processes (docs/scaling.md).

The same run twice, on the same global batch: ``unmask train sbd`` in one process with
``--grad-accum 2``, then under ``torchrun --nproc-per-node 2`` with ``--grad-accum 1`` (DDP over
gloo on CPU). Both consume the same micro-batches with the same noise, so the published weights
must agree to float rounding (target <= 1e-5). Reported: training tokens/s of each run (the
loop's log windows: the optimizer steps alone, model loading, the final validation, the
checkpoint and publishing excluded), tokens/s per process, the speed-up, the parallel
efficiency (speed-up / 2) and the max parameter difference.

    python benchmarks/scaling.py                      # 200 steps (the measured run)
    python benchmarks/scaling.py --steps 10 --smoke   # a quick check of the plumbing

Writes ``scaling.md`` / ``scaling.json`` under --out-dir. Each process gets --threads intra-op
threads (default 1): on a 2-core machine the 2-process run then uses both cores, and the figure
measures data parallelism, not thread contention.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8, help="rows per micro-batch and process")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--corpus", type=Path, default=None, help="training JSONL (default: a story corpus built once)")
    p.add_argument("--docs", type=int, default=400, help="documents of the corpus built when --corpus is not given")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "scaling")
    p.add_argument("--out-dir", type=Path, default=None, help="where scaling.md/.json go (default: --work-dir)")
    p.add_argument("--smoke", action="store_true", help="write under WORK/smoke and do not check the target")
    return p.parse_args()


def log(msg: str) -> None:
    print(f"[scaling {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def corpus(args) -> Path:
    if args.corpus is not None:
        return args.corpus
    path = args.work_dir / f"corpus-{args.docs}.jsonl"
    if not path.exists():
        from unmask.train.data import make_story_corpus

        log(f"building a {args.docs}-document story corpus with stories260K (once) -> {path}")
        make_story_corpus(path, model="stories260K", n_sampled=args.docs // 2, n_greedy=args.docs - args.docs // 2,
                          seed=0, max_new_tokens=256)
    return path


def run(args, data: Path, world: int, out: Path) -> dict:
    """One training run; returns its throughput from the loop's log."""
    cli = ["-m", "unmask", "train", "sbd", "--base", "stories260K", "--data", str(data), "--out", str(out),
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--grad-accum", str(2 // world), "--ckpt-every", "0", "--eval-every", "0", "--overwrite"]
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
                                 if world > 1 else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO / "src")}
    log(f"{world} process(es): {' '.join(launch[1:] + cli)}")
    t0 = time.monotonic()
    subprocess.run(launch + cli, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    records = [json.loads(line) for line in (out.with_name(out.name + ".run") / "log.jsonl").read_text().splitlines()]
    seconds = next(r["seconds"] for r in records if "stopped" in r)
    per_step = 2 * args.batch_size * args.seq_len  # tokens of the global batch: 2 micro-batches per step
    # The log windows time the optimizer steps alone (the final validation and checkpoint excluded).
    windows, last = [], 0
    for r in records:
        if "steps_s" in r:
            windows.append((r["step"] - last, (r["step"] - last) / r["steps_s"]))
            last = r["step"]
    step_seconds = sum(t for _, t in windows)
    tok_s = sum(n for n, _ in windows) * per_step / step_seconds
    return {"world": world, "loop_seconds": seconds, "step_seconds": step_seconds, "wall_seconds": wall,
            "tokens": args.steps * per_step, "tok_s": tok_s, "tok_s_per_process": tok_s / world}


def max_param_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys(), (x.keys() ^ y.keys())
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def main() -> None:
    args = parse_args()
    work = args.work_dir / "smoke" if args.smoke else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    out_dir = args.out_dir or work
    data = corpus(args)
    one = run(args, data, 1, work / "one")
    two = run(args, data, 2, work / "two")
    diff = max_param_diff(work / "one", work / "two")
    speedup = two["tok_s"] / one["tok_s"]
    result = {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "threads": args.threads,
              "cpus": os.cpu_count(), "one": one, "two": two, "speedup": speedup, "efficiency": speedup / 2,
              "max_param_diff": diff, "target_param_diff": 1e-5, "corpus": str(data)}
    out_dir.mkdir(parents=True, exist_ok=True)
    from unmask.fileio import atomic_write_json, atomic_write_text

    atomic_write_json(out_dir / "scaling.json", result)
    md = [f"# SBD training on stories260K: 1 vs 2 gloo processes ({args.steps} steps)", "",
          f"Global batch {2 * args.batch_size} rows x {args.seq_len} tokens per step; {args.threads} thread(s) per "
          f"process; {os.cpu_count()} CPUs.", "",
          "| processes | grad-accum | step s | tokens/s | tokens/s per process |", "|---|---|---|---|---|",
          *[f"| {r['world']} | {2 // r['world']} | {r['step_seconds']:.1f} | {r['tok_s']:,.0f} | "
            f"{r['tok_s_per_process']:,.0f} |" for r in (one, two)], "",
          f"Speed-up {speedup:.2f}x, efficiency {speedup / 2:.0%}; max |param difference| {diff:.2e} "
          f"(target <= 1e-5).", ""]
    atomic_write_text(out_dir / "scaling.md", "\n".join(md))
    print("\n".join(md))
    if not args.smoke and diff > 1e-5:
        raise SystemExit(f"parameters differ by {diff:.2e} > 1e-5")


if __name__ == "__main__":
    main()
