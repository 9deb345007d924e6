"""Rebuild the shipped ``stories260K-mbd`` checkpoint: stories260K-bd post-trained with MultiTF.

    python recipes/stories260K_mbd.py                 # the shipped run: 60 steps (~5 min on an idle core)
    python recipes/stories260K_mbd.py --smoke         # ~1 min check on the bd recipe's smoke model
    python recipes/stories260K_mbd.py --resume        # continue an interrupted run (same flags)

Needs ``src/unmask/checkpoints/stories260K-bd`` (``recipes/stories260K_bd.py``), or ``--base``.

Recipe (spec/multiblock.md §4; :mod:`unmask.train.multitf`): the official MultiTF recipe in the
LLaDA2 setting (Table 5: G_max 2, N_rand 0, decoded with N_buf = 2 slots), which won the issue-29
control runs (benchmarks/multitf_controls.py, benchmarks/results/multitf_controls.md):

- layouts: G_max = 2 (``--preset llada2``), both systematic shifted layouts of every clean row
  (``--layouts-per-row 0``, |Λ| = 2), 11 clean rows (22 training rows) per step;
- noise: chain-uniform, t_low 0.001, t_high 1.0, ρ 0.01 (t_eff ≈ 0.99), **floor** rounding (the
  released rule: a block is never fully masked; the bd recipe's stochastic rounding is
  ``--rounding stochastic``);
- loss: masked CE on the noisy copy, averaged over the masked positions (eq. 3.4); ``--loss ipw``
  is the SDAR code's self-normalised 1/t-weighted CE;
- optimisation: 60 steps, AdamW, weight decay 0.1 (Table 5), 3 % warm-up and cosine decay, peak
  lr 5e-4 (the paper's 1e-5 is for 8B-parameter models; 1e-4 did worse here).

The earlier recipe (SDAR-b4 scaling: G_max 4, N_rand 2, one sampled layout per row, stochastic
rounding, 829 steps of 16 rows) is ``--g-max 4 --n-rand 2 --layouts-per-row 1 --rounding
stochastic --batch-size 16 --steps 0`` (steps fitted to ``--minutes``).

Data: the same story corpus and BOS-aligned rows of L = 288 tokens as ``stories260K_bd.py``.
``--minutes`` bounds the whole recipe (hard cap 120). The result is published atomically to
``src/unmask/checkpoints/stories260K-mbd``; its ``unmask_config.json`` records ``train_g_max``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stories260K_bd as bd  # noqa: E402  (shared recipe helpers: corpus, timing, budget, summary)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bd.add_common_args(p, minutes=40.0, work_dir=bd.REPO / "runs" / "stories260K_mbd")
    p.add_argument("--base", type=str, default=None,
                   help="block-diffusion model to post-train (default: the shipped stories260K-bd; with --smoke the "
                        "bd recipe's smoke model, built first if missing)")
    p.add_argument("--g-max", type=int, default=2, help="largest noise group; decode with --slots <= this")
    p.add_argument("--n-rand", type=int, default=0, help="random layouts per row besides the systematic ones")
    p.add_argument("--layouts-per-row", type=int, default=0, help="layouts kept per clean row (0 = all |Λ|)")
    p.add_argument("--preset", choices=("llada2", "sdar-b4"), default=None,
                   help="released G_max / N_rand instead of --g-max / --n-rand: llada2 = 2 / 0 (decode --slots 2), "
                        "sdar-b4 = 4 / 2 (--slots 4)")
    p.add_argument("--loss", choices=("ce", "ipw"), default="ce",
                   help="ce: mean masked CE (eq. 3.4); ipw: the SDAR code's self-normalised 1/t-weighted CE")
    p.add_argument("--rho", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=11, help="clean rows per micro-batch")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=0, help="warm-up steps (0 = 3 %% of the steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.set_defaults(rounding="floor", steps=None)  # the bd recipe's defaults are stochastic and fitted steps
    args = bd.check_common_args(p, p.parse_args(argv), "stories260K-mbd")  # --smoke: 20 steps
    if args.steps is None:
        args.steps = 60  # the shipped run; --steps 0 fits the steps to --minutes

    if args.preset is not None:
        from unmask.train.multitf import PRESETS

        args.g_max, args.n_rand = PRESETS[args.preset]
    if args.smoke:
        args.batch_size = 2
    return args


def resolve_base(args) -> str:
    if args.base is not None:
        return args.base
    if not args.smoke:
        return "stories260K-bd"  # the shipped name, recorded as "base" in unmask_config.json
    base = bd.REPO / "runs" / "stories260K_bd" / "smoke" / "stories260K-bd"
    if not (base / "config.json").is_file():
        bd.log(f"smoke: building the bd smoke model first ({base})")
        if bd.main(["--smoke", "--threads", str(args.threads or 1)]) != 0:
            raise SystemExit("the bd smoke run failed")
    return str(base)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    import unmask
    from unmask.compat import quiet_transformers
    from unmask.errors import one_line_warnings
    from unmask.models.registry import shipped
    from unmask.train.multitf import ChainUniform, MultiTFObjective, train_multitf

    quiet_transformers()
    one_line_warnings()  # "warning: ..." as the command line prints it, not Python's source echo
    base = resolve_base(args)
    if not (Path(base) / "config.json").is_file() and base not in shipped():
        bd.log(f"no base model at {base}; run recipes/stories260K_bd.py first or pass --base")
        return 2

    def timer(threads: int) -> float:
        bundle = unmask.load(base)
        objective = MultiTFObjective(bundle.mask_token_id, bundle.block_size, g_max=args.g_max, n_rand=args.n_rand,
                                     scheduler=ChainUniform(rho=args.rho), rounding=args.rounding,
                                     layouts_per_row=args.layouts_per_row, loss_type=args.loss)
        return bd.time_objective(bundle.model, objective, args, threads)

    threads, step_s = bd.pick_threads(args, timer)
    torch.set_num_threads(threads)
    corpus = bd.build_corpus(args)
    steps = bd.plan_steps(args, step_s, t_start)
    if steps is None:
        return 2
    warmup = args.warmup or max(1, round(0.03 * steps))
    result = train_multitf(
        base=base, data=[corpus], out=args.out, run_dir=args.work_dir / "run", seq_len=args.seq_len,
        g_max=args.g_max, n_rand=args.n_rand, rho=args.rho, rounding=args.rounding,
        layouts_per_row=args.layouts_per_row, loss=args.loss, resume=args.resume, overwrite=not args.resume, steps=steps,
        batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr, warmup=min(warmup, max(1, steps // 10)),
        weight_decay=args.weight_decay, ckpt_every=args.ckpt_every, eval_every=args.eval_every, seed=args.seed,
        max_minutes=args.remaining_minutes, progress=True,
    )
    return bd.finish(args, result, t_start, threads, corpus)


if __name__ == "__main__":
    sys.exit(main())
