"""``unmask train sbd``, ``unmask train diffusion`` and ``unmask data stories``: thin wrappers over unmask.train."""

from __future__ import annotations

from pathlib import Path

import typer

from unmask.cli import app
from unmask.errors import UnmaskError

train_app = typer.Typer(no_args_is_help=True, help="Fine-tune models for parallel decoding.")
data_app = typer.Typer(no_args_is_help=True, help="Build training corpora.")
app.add_typer(train_app, name="train")
app.add_typer(data_app, name="data")


@train_app.command("sbd")
def train_sbd_cmd(
    base: str = typer.Option("stories260K", "--base", help="shipped model name or local HF causal-LM directory"),
    data: list[Path] = typer.Option(None, "--data", help="training data, .txt (blank-line separated) or .jsonl (repeatable)"),
    out: Path = typer.Option(None, "--out", help="output model directory (checkpoints go to OUT.run/)"),
    run_dir: Path = typer.Option(None, "--run-dir", help="checkpoint/log directory (default OUT.run)"),
    steps: int = typer.Option(1000, "--steps", help="optimizer steps"),
    batch_size: int = typer.Option(8, "--batch-size", help="sequences per micro-batch"),
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per sequence L (a forward sees 2L)"),
    lr: float = typer.Option(3e-4, "--lr", help="peak learning rate"),
    warmup: int = typer.Option(100, "--warmup", help="linear warm-up steps"),
    grad_accum: int = typer.Option(1, "--grad-accum", help="micro-batches per optimizer step"),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay (matrices only)"),
    clip: float = typer.Option(1.0, "--clip", help="gradient-norm clip (0 = off)"),
    ckpt_every: int = typer.Option(500, "--ckpt-every", help="checkpoint every N steps (0 = only at the end)"),
    eval_every: int = typer.Option(500, "--eval-every", help="validation loss every N steps (0 = only at the end)"),
    max_minutes: float = typer.Option(None, "--max-minutes", help="wall-clock budget; stops cleanly and saves"),
    seed: int = typer.Option(0, "--seed", help="seed of data order, noise and validation split"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint in the run directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace OUT and discard its run directory"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
) -> None:
    """Fine-tune a causal LM for Set Block Decoding (joint NTP + masked loss, SBD Eq. 14)."""
    from unmask.compat import quiet_transformers
    from unmask.train.sbd import train_sbd

    if not data:
        raise UnmaskError("no training data; pass --data FILE (.txt or .jsonl)")
    if out is None:
        raise UnmaskError("no output directory; pass --out DIR")
    quiet_transformers()
    result = train_sbd(base=base, data=data, out=out, run_dir=run_dir, seq_len=seq_len, resume=resume,
                       overwrite=overwrite, device=device, steps=steps, batch_size=batch_size, lr=lr, warmup=warmup,
                       grad_accum=grad_accum, weight_decay=weight_decay, clip=clip, ckpt_every=ckpt_every,
                       eval_every=eval_every, max_minutes=max_minutes, seed=seed)
    if result.stopped == "interrupted":
        typer.echo(f"interrupted at step {result.step}; checkpoint {result.checkpoint}; rerun with --resume", err=True)
        raise SystemExit(130)
    terms = " ".join(f"{k} {v:.4f}" for k, v in (result.val or result.last).items() if k in ("loss", "ntp", "mat"))
    typer.echo(f"wrote {result.out} after {result.step} steps ({result.stopped}, {result.seconds / 60:.1f} min); {terms}")


@data_app.command("stories")
def data_stories_cmd(
    model: str = typer.Option("stories260K", "--model", help="model that writes the stories"),
    out: Path = typer.Option(..., "--out", help="output JSONL file"),
    sampled: int = typer.Option(1000, "--sampled", help="stories sampled at temperature 1.0 from BOS"),
    greedy: int = typer.Option(1000, "--greedy", help="sampled prefixes continued greedily"),
    seed: int = typer.Option(0, "--seed", help="seed of sampling, prefix lengths and the split"),
    max_new_tokens: int = typer.Option(320, "--max-new-tokens", help="cap of a story / a greedy continuation"),
    batch_size: int = typer.Option(128, "--batch-size", help="rows per batched decode"),
    val_fraction: float = typer.Option(0.05, "--val-fraction", help="share of documents held out for validation"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace OUT if it exists"),
) -> None:
    """Generate a self-sampled story corpus (sampled stories + greedy continuations) as JSONL."""
    from unmask.compat import quiet_transformers
    from unmask.train.data import make_story_corpus

    quiet_transformers()

    def progress(done: int, total: int) -> None:
        typer.echo(f"{done}/{total} documents", err=True)

    summary = make_story_corpus(out, model=model, n_sampled=sampled, n_greedy=greedy, seed=seed, overwrite=overwrite,
                                progress=progress, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                val_fraction=val_fraction)
    typer.echo(" ".join(f"{k}={v}" for k, v in summary.items()))


@train_app.command("diffusion")
def train_diffusion_cmd(
    base: str = typer.Option("stories260K", "--base", help="shipped model name or local HF causal-LM directory"),
    data: list[Path] = typer.Option(None, "--data", help="training data, .txt (blank-line separated) or .jsonl (repeatable)"),
    out: Path = typer.Option(None, "--out", help="output model directory (checkpoints go to OUT.run/)"),
    run_dir: Path = typer.Option(None, "--run-dir", help="checkpoint/log directory (default OUT.run)"),
    steps: int = typer.Option(1000, "--steps", help="optimizer steps"),
    batch_size: int = typer.Option(8, "--batch-size", help="sequences per micro-batch"),
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per sequence after its leading BOS"),
    prefix_prob: float = typer.Option(0.5, "--prefix-prob", help="share of sequences keeping a clean prompt prefix"),
    norm: str = typer.Option("token", "--norm", help="loss normalisation: token, sequence or batch"),
    lr: float = typer.Option(3e-4, "--lr", help="peak learning rate"),
    warmup: int = typer.Option(100, "--warmup", help="linear warm-up steps"),
    grad_accum: int = typer.Option(1, "--grad-accum", help="micro-batches per optimizer step"),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay (matrices only)"),
    clip: float = typer.Option(1.0, "--clip", help="gradient-norm clip (0 = off)"),
    ckpt_every: int = typer.Option(500, "--ckpt-every", help="checkpoint every N steps (0 = only at the end)"),
    eval_every: int = typer.Option(500, "--eval-every", help="validation loss every N steps (0 = only at the end)"),
    max_minutes: float = typer.Option(None, "--max-minutes", help="wall-clock budget; stops cleanly and saves"),
    seed: int = typer.Option(0, "--seed", help="seed of data order, noise and validation split"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint in the run directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace OUT and discard its run directory"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
) -> None:
    """Adapt a causal LM into a masked-diffusion LM (bidirectional, logit shift 1; diffusion.md §1-2)."""
    from unmask.compat import quiet_transformers
    from unmask.train.diffusion import train_diffusion

    if not data:
        raise UnmaskError("no training data; pass --data FILE (.txt or .jsonl)")
    if out is None:
        raise UnmaskError("no output directory; pass --out DIR")
    quiet_transformers()
    result = train_diffusion(base=base, data=data, out=out, run_dir=run_dir, seq_len=seq_len, prefix_prob=prefix_prob,
                             norm=norm, resume=resume, overwrite=overwrite, device=device, steps=steps,
                             batch_size=batch_size, lr=lr, warmup=warmup, grad_accum=grad_accum,
                             weight_decay=weight_decay, clip=clip, ckpt_every=ckpt_every, eval_every=eval_every,
                             max_minutes=max_minutes, seed=seed)
    if result.stopped == "interrupted":
        typer.echo(f"interrupted at step {result.step}; checkpoint {result.checkpoint}; rerun with --resume", err=True)
        raise SystemExit(130)
    terms = " ".join(f"{k} {v:.4f}" for k, v in (result.val or result.last).items() if k in ("loss", "nll"))
    typer.echo(f"wrote {result.out} after {result.step} steps ({result.stopped}, {result.seconds / 60:.1f} min); {terms}")


def _finish(result, terms=("loss", "mat", "acc")) -> None:
    if result.stopped == "interrupted":
        typer.echo(f"interrupted at step {result.step}; checkpoint {result.checkpoint}; rerun with --resume", err=True)
        raise SystemExit(130)
    shown = " ".join(f"{k} {v:.4f}" for k, v in (result.val or result.last).items() if k in terms)
    minutes = result.seconds / 60
    typer.echo(f"wrote {result.out} after {result.step} steps ({result.stopped}, {minutes:.1f} min); {shown}")


def _loop_options(steps, batch_size, lr, warmup, grad_accum, weight_decay, clip, ckpt_every, eval_every, max_minutes,
                  seed) -> dict:
    return dict(steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, grad_accum=grad_accum,
                weight_decay=weight_decay, clip=clip, ckpt_every=ckpt_every, eval_every=eval_every,
                max_minutes=max_minutes, seed=seed)


@train_app.command("block-diffusion")
def train_block_diffusion_cmd(
    base: str = typer.Option("stories260K", "--base",
                             help="causal LM (a mask token is added) or block-diffusion model"),
    block_size: int = typer.Option(None, "--block-size", help="block size B (required for a causal base)"),
    data: list[Path] = typer.Option(None, "--data", help="training data, .txt or .jsonl (repeatable)"),
    out: Path = typer.Option(None, "--out", help="output model directory (checkpoints go to OUT.run/)"),
    run_dir: Path = typer.Option(None, "--run-dir", help="checkpoint/log directory (default OUT.run)"),
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per row L, a multiple of B (a forward sees 2L)"),
    t_low: float = typer.Option(0.001, "--t-low", help="lowest per-block mask ratio"),
    t_high: float = typer.Option(1.0, "--t-high", help="highest per-block mask ratio"),
    noise: str = typer.Option("block", "--noise", help="block: one ratio per block; sequence: one per row"),
    rounding: str = typer.Option("floor", "--rounding", help="masks per block: floor(B*t) or stochastic"),
    steps: int = typer.Option(1000, "--steps"), batch_size: int = typer.Option(8, "--batch-size"),
    lr: float = typer.Option(1e-3, "--lr"), warmup: int = typer.Option(100, "--warmup"),
    grad_accum: int = typer.Option(1, "--grad-accum"), weight_decay: float = typer.Option(0.0, "--weight-decay"),
    clip: float = typer.Option(1.0, "--clip", help="gradient-norm clip (0 = off)"),
    ckpt_every: int = typer.Option(500, "--ckpt-every"), eval_every: int = typer.Option(500, "--eval-every"),
    max_minutes: float = typer.Option(None, "--max-minutes", help="wall-clock budget; stops cleanly and saves"),
    seed: int = typer.Option(0, "--seed"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint in the run directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace OUT and discard its run directory"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
) -> None:
    """Teacher-forcing training of a block-diffusion LM (dual-stream masked CE, multiblock.md §1.3)."""
    from unmask.compat import quiet_transformers
    from unmask.train.block_diffusion import train_block_diffusion

    if not data:
        raise UnmaskError("no training data; pass --data FILE (.txt or .jsonl)")
    if out is None:
        raise UnmaskError("no output directory; pass --out DIR")
    quiet_transformers()
    _finish(train_block_diffusion(
        base=base, data=data, out=out, block_size=block_size, run_dir=run_dir, seq_len=seq_len, t_low=t_low,
        t_high=t_high, noise=noise, rounding=rounding, resume=resume, overwrite=overwrite, device=device,
        **_loop_options(steps, batch_size, lr, warmup, grad_accum, weight_decay, clip, ckpt_every, eval_every,
                        max_minutes, seed)))


@train_app.command("multitf")
def train_multitf_cmd(
    base: str = typer.Option("stories260K-bd", "--base", help="block-diffusion model to post-train"),
    data: list[Path] = typer.Option(None, "--data", help="training data, .txt or .jsonl (repeatable)"),
    out: Path = typer.Option(None, "--out", help="output model directory (checkpoints go to OUT.run/)"),
    run_dir: Path = typer.Option(None, "--run-dir", help="checkpoint/log directory (default OUT.run)"),
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per row L, a multiple of B"),
    g_max: int = typer.Option(4, "--g-max", help="largest noise group (decode with --slots <= this)"),
    n_rand: int = typer.Option(2, "--n-rand", help="random layouts per row, besides the systematic ones"),
    t_low: float = typer.Option(0.001, "--t-low"), t_high: float = typer.Option(1.0, "--t-high"),
    rho: float = typer.Option(0.01, "--rho", help="t_eff = t_high - rho (t_high - t_low)"),
    rounding: str = typer.Option("floor", "--rounding", help="masks per block: floor(B*t) or stochastic"),
    layouts_per_row: int = typer.Option(0, "--layouts-per-row",
                                        help="train on a random subset of this many layouts per row (0 = all)"),
    steps: int = typer.Option(500, "--steps"), batch_size: int = typer.Option(2, "--batch-size",
                                                                             help="clean rows per micro-batch"),
    lr: float = typer.Option(3e-4, "--lr"), warmup: int = typer.Option(15, "--warmup"),
    grad_accum: int = typer.Option(1, "--grad-accum"), weight_decay: float = typer.Option(0.1, "--weight-decay"),
    clip: float = typer.Option(1.0, "--clip", help="gradient-norm clip (0 = off)"),
    ckpt_every: int = typer.Option(200, "--ckpt-every"), eval_every: int = typer.Option(200, "--eval-every"),
    max_minutes: float = typer.Option(None, "--max-minutes", help="wall-clock budget; stops cleanly and saves"),
    seed: int = typer.Option(0, "--seed"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint in the run directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace OUT and discard its run directory"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
) -> None:
    """MultiTF post-training of a block-diffusion LM (group layouts, chain-uniform noise, multiblock.md §4)."""
    from unmask.compat import quiet_transformers
    from unmask.train.multitf import train_multitf

    if not data:
        raise UnmaskError("no training data; pass --data FILE (.txt or .jsonl)")
    if out is None:
        raise UnmaskError("no output directory; pass --out DIR")
    quiet_transformers()
    _finish(train_multitf(
        base=base, data=data, out=out, run_dir=run_dir, seq_len=seq_len, g_max=g_max, n_rand=n_rand, t_low=t_low,
        t_high=t_high, rho=rho, rounding=rounding, layouts_per_row=layouts_per_row, resume=resume,
        overwrite=overwrite, device=device,
        **_loop_options(steps, batch_size, lr, warmup, grad_accum, weight_decay, clip, ckpt_every, eval_every,
                        max_minutes, seed)))
