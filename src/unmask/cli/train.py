"""``unmask train sbd``, ``sbd-adapter``, ``diffusion``, ``block-diffusion`` and ``multitf``: thin wrappers
over unmask.train, and the options every ``unmask train`` command shares (the router trainers are
:mod:`unmask.cli.train_routers`; ``unmask data`` is :mod:`unmask.cli.data`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from unmask.cli.root import app
from unmask.errors import UnmaskError

train_app = typer.Typer(no_args_is_help=True, help="Fine-tune models for parallel decoding.")
app.add_typer(train_app, name="train")

# Options declared alike by several commands. Defaults stay at each parameter, where they differ
# between commands; options without help text are plain defaults (typer names them --snake-case).
CausalBase = Annotated[str, typer.Option("--base", help="shipped model name or local HF causal-LM directory")]
TextData = Annotated[list[Path], typer.Option(
    "--data", help="training data, .txt (blank-line separated) or .jsonl (repeatable)")]
Data = Annotated[list[Path], typer.Option("--data", help="training data, .txt or .jsonl (repeatable)")]
Out = Annotated[Path, typer.Option("--out", help="output model directory (checkpoints go to OUT.run/)")]
RunDir = Annotated[Path, typer.Option("--run-dir", help="checkpoint/log directory (default OUT.run)")]
Steps = Annotated[int, typer.Option("--steps", help="optimizer steps")]
BatchSize = Annotated[int, typer.Option("--batch-size", help="sequences per micro-batch (per process under torchrun)")]
Lr = Annotated[float, typer.Option("--lr", help="peak learning rate")]
Warmup = Annotated[int, typer.Option("--warmup", help="linear warm-up steps")]
GradAccum = Annotated[int, typer.Option("--grad-accum", help="micro-batches per optimizer step (per process)")]
WeightDecay = Annotated[float, typer.Option("--weight-decay", help="AdamW weight decay (matrices only)")]
Clip = Annotated[float, typer.Option("--clip", help="gradient-norm clip (0 = off)")]
CkptEvery = Annotated[int, typer.Option("--ckpt-every", help="checkpoint every N steps (0 = only at the end)")]
EvalEvery = Annotated[int, typer.Option("--eval-every", help="validation loss every N steps (0 = only at the end)")]
MaxMinutes = Annotated[float, typer.Option("--max-minutes", help="wall-clock budget; stops cleanly and saves")]
Seed = Annotated[int, typer.Option("--seed", help="seed of data order, noise and validation split")]
Resume = Annotated[bool, typer.Option("--resume", help="continue from the newest checkpoint in the run directory")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="replace OUT (an earlier model or an empty folder) and "
                                                        "discard its run directory")]
def _device(value: str) -> str:
    """--device's name checked when parsed (an unknown one was a traceback); whether CUDA is there is
    the training loop's check (:func:`unmask.dist.setup`), so a command line parses on any machine."""
    from unmask.devices import resolve_device

    resolve_device(value, available=False)
    return value


Device = Annotated[str, typer.Option("--device", help="cpu or cuda", callback=_device)]


def _minutes(value: float | None) -> float | None:
    """The routers' --max-minutes checked when parsed (nan was accepted and never stopped the loop)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UnmaskError(f"--max-minutes must be a finite number > 0 (got {value:g}); pass e.g. 30, or drop it")
    return value


RouterMinutes = Annotated[float, typer.Option("--max-minutes", help="budget of the training loop", callback=_minutes)]
Fsdp = Annotated[bool, typer.Option("--fsdp", help="under torchrun: shard with FSDP2 instead of DDP (docs/scaling.md)")]
DlmModel = Annotated[str, typer.Option("--model", help="masked-diffusion model (shipped name or directory)")]
PromptData = Annotated[list[Path], typer.Option(
    "--data", help="corpus (.txt or .jsonl) whose document openings become prompts (repeatable)")]
NoProgress = Annotated[bool, typer.Option("--no-progress", help="no progress display (it shows only on a terminal)")]
# Options of the SBD trainers (sbd, sbd-adapter).
Threads = Annotated[str, typer.Option("--threads", metavar="N|auto",
                                      help="CPU threads for torch (this command's alias of 'unmask --threads')")]
TrainDtype = Annotated[str, typer.Option("--dtype", help="float32 or bfloat16: dtype the model is trained in")]
BlockRange = Annotated[str, typer.Option("--block-range", metavar="LOW:HIGH",
                                         help="training block sizes k ~ U{LOW..HIGH} (alias of --min-block/--max-block)")]
LogEvery = Annotated[int, typer.Option("--log-every", help="a log.jsonl line every N steps (0 = only at the end)")]
KeepCheckpoints = Annotated[int, typer.Option("--keep-checkpoints", help="keep the newest N checkpoints in the run dir")]
Distill = Annotated[bool, typer.Option("--distill", help="self-distilled block mode: --data is a greedy 'unmask data "
                                      "distill' corpus of --base, loss CE + λ·KL(NTP ‖ block) (sbd_exact.md §5.5)")]
DistillLambda = Annotated[float, typer.Option("--distill-lambda", help="λ of the --distill KL term (default 1.0)",
                                              show_default=False)]
AnswerOnly = Annotated[bool, typer.Option("--answer-only/--no-answer-only",
                                          help="loss on answer tokens only (records' loss_start); default: on when "
                                               "the corpus has loss_start", show_default=False)]


def _start(data, out) -> None:
    """Refuse a fine-tuning run without data or output directory, then quiet transformers' logging."""
    from unmask.compat import quiet_transformers

    if not data:
        raise UnmaskError("no training data; pass --data FILE (.txt or .jsonl)")
    if out is None:
        raise UnmaskError("no output directory; pass --out DIR")
    quiet_transformers()


def _finish(result, terms=("loss", "mat", "acc")) -> None:
    from unmask import dist

    code = 128 + (result.signal or 2)  # 130 for SIGINT, 143 for SIGTERM, as every command
    if not dist.is_main():  # under torchrun rank 0 reports; the others end quietly
        if result.stopped == "interrupted":
            raise SystemExit(code)
        return
    if result.stopped == "interrupted":
        typer.echo(f"interrupted at step {result.step}; checkpoint {result.checkpoint}; rerun with --resume", err=True)
        raise SystemExit(code)
    shown = " ".join(f"{k} {v:.4f}" for k, v in (result.val or result.last).items() if k in terms)
    minutes = result.seconds / 60
    typer.echo(f"wrote {result.out} after {result.step} steps ({result.stopped}, {minutes:.1f} min); {shown}")


def _loop_options(steps, batch_size, lr, warmup, grad_accum, weight_decay, clip, ckpt_every, eval_every, max_minutes,
                  seed, fsdp: bool = False, **more) -> dict:
    return dict(steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, grad_accum=grad_accum,
                weight_decay=weight_decay, clip=clip, ckpt_every=ckpt_every, eval_every=eval_every,
                max_minutes=max_minutes, seed=seed, fsdp=fsdp, **more)


def _sbd_options(threads: str | None, dtype: str, block_range: str | None, min_block: int | None = None,
                 max_block: int | None = None) -> tuple[int, int]:
    """Apply ``--threads``, check ``--dtype`` and resolve the training block range from
    ``--block-range LOW:HIGH`` or ``--min-block``/``--max-block`` (default 2:16). Raises UnmaskError."""
    if threads is not None:
        from unmask.threads import set_threads

        set_threads(threads)
    if dtype not in ("float32", "bfloat16"):
        raise UnmaskError(f"--dtype must be float32 or bfloat16, got {dtype!r}; pass --dtype float32 or bfloat16")
    if block_range is None:
        return (2 if min_block is None else min_block, 16 if max_block is None else max_block)
    if min_block is not None or max_block is not None:
        raise UnmaskError("--block-range and --min-block/--max-block both set the block range; pass only one of them")
    low, sep, high = block_range.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise UnmaskError(f"--block-range must be LOW:HIGH with two integers, got {block_range!r}; pass e.g. "
                          "--block-range 2:16") from None


@train_app.command("sbd")
def train_sbd_cmd(
    base: CausalBase = "stories260K", data: TextData = None, out: Out = None, run_dir: RunDir = None,
    steps: Steps = 1000, batch_size: BatchSize = 8,
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per sequence L (a forward sees 2L)"),
    lr: Lr = 3e-4, warmup: Warmup = 100, grad_accum: GradAccum = 1, weight_decay: WeightDecay = 0.0, clip: Clip = 1.0,
    ckpt_every: CkptEvery = 500, eval_every: EvalEvery = 500, max_minutes: MaxMinutes = None, seed: Seed = 0,
    resume: Resume = False, overwrite: Overwrite = False, device: Device = "cpu", fsdp: Fsdp = False,
    no_progress: NoProgress = False, block_range: BlockRange = None,
    block_size: int = typer.Option(8, "--block-size", help="block size of the validation's masked CE per offset"),
    answer_only: AnswerOnly = None, dtype: TrainDtype = "float32", log_every: LogEvery = 10,
    keep_checkpoints: KeepCheckpoints = 1, threads: Threads = None, distill: Distill = False,
    distill_lambda: DistillLambda = None,
) -> None:
    """Fine-tune a causal LM for Set Block Decoding (joint NTP + masked loss, SBD Eq. 14); --base an SBD
    model continues it (e.g. a --distill stage)."""
    from unmask.train.sbd import train_sbd

    _start(data, out)
    low_high = _sbd_options(threads, dtype, block_range)
    _finish(train_sbd(
        base=base, data=data, out=out, run_dir=run_dir, seq_len=seq_len, block_range=low_high,
        eval_block_size=block_size, answer_only=answer_only, resume=resume, overwrite=overwrite, device=device,
        dtype=dtype, progress=not no_progress, distill=distill, distill_lambda=distill_lambda,
        **_loop_options(steps, batch_size, lr, warmup, grad_accum, weight_decay, clip, ckpt_every,
                        eval_every, max_minutes, seed, fsdp, log_every=log_every, keep_checkpoints=keep_checkpoints)),
        terms=("loss", "ntp", "mat", "kl", "d0", "d1", "d7"))


@train_app.command("sbd-adapter")
def train_sbd_adapter_cmd(
    base: CausalBase = "stories260K", data: TextData = None,
    out: Path = typer.Option(None, "--out", help="adapter directory (checkpoints go to OUT.run/)"),
    run_dir: RunDir = None,
    rank: int = typer.Option(16, "--rank", help="rank r of the low-rank delta B A"),
    full_rank: bool = typer.Option(False, "--full-rank", help="train a full-rank delta instead (tiny models)"),
    targets: str = typer.Option(None, "--targets", help="comma-separated nn.Linear names to adapt "
                                                        "(default q,k,v,o and MLP projections)"),
    steps: Steps = 1000, batch_size: BatchSize = 8,
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per sequence L (a forward sees 2L)"),
    block_size: int = typer.Option(8, "--block-size", help="validation block size, recorded in decode_defaults"),
    min_block: int = typer.Option(None, "--min-block", help="smallest training block size k (default 2)"),
    max_block: int = typer.Option(None, "--max-block", help="largest training block size k (default 16)"),
    block_range: BlockRange = None,
    draft_fraction: float = typer.Option(0.5, "--draft-fraction", help="share of rows with all-mask blocks (η = 1)"),
    lr: Lr = 1e-3, warmup: Warmup = 100, grad_accum: GradAccum = 1, weight_decay: WeightDecay = 0.0, clip: Clip = 1.0,
    ckpt_every: CkptEvery = 500, eval_every: EvalEvery = 500,
    max_minutes: MaxMinutes = None,
    seed: Seed = 0, resume: Resume = False, overwrite: Overwrite = False, device: Device = "cpu", fsdp: Fsdp = False,
    no_progress: NoProgress = False, answer_only: AnswerOnly = None, dtype: TrainDtype = "float32",
    log_every: LogEvery = 10, keep_checkpoints: KeepCheckpoints = 1, threads: Threads = None,
    init: str = typer.Option(None, "--init", help="start from this adapter of --base (a shipped name such as sbd, "
                             "or a directory): its rank, targets and weights"),
    distill: Distill = False, distill_lambda: DistillLambda = None,
) -> None:
    """Train a gated SBD adapter on a frozen causal LM (masked term of Eq. 14; spec sbd_exact.md §3).
    CPU threads: --threads N here or the global unmask --threads N."""
    from unmask.train.sbd_adapter import train_sbd_adapter

    _start(data, out)
    low_high = _sbd_options(threads, dtype, block_range, min_block, max_block)
    names = [t.strip() for t in targets.split(",")] if targets is not None else None  # "" entries are refused
    _finish(train_sbd_adapter(
        base=base, data=data, out=out, run_dir=run_dir, rank=rank, full_rank=full_rank, targets=names,
        seq_len=seq_len, block_range=low_high, draft_fraction=draft_fraction, block_size=block_size,
        answer_only=answer_only, resume=resume, overwrite=overwrite, device=device, dtype=dtype,
        progress=not no_progress, init=init, distill=distill, distill_lambda=distill_lambda,
        **_loop_options(steps, batch_size, lr, warmup, grad_accum, weight_decay, clip, ckpt_every, eval_every,
                        max_minutes, seed, fsdp, log_every=log_every, keep_checkpoints=keep_checkpoints)),
        terms=("loss", "draft", "ntp", "kl", "d0", "d1", "d7"))


@train_app.command("diffusion")
def train_diffusion_cmd(
    base: CausalBase = "stories260K", data: TextData = None, out: Out = None, run_dir: RunDir = None,
    steps: Steps = 1000, batch_size: BatchSize = 8,
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per sequence after its leading BOS"),
    prefix_prob: float = typer.Option(0.5, "--prefix-prob", help="share of sequences keeping a clean prompt prefix"),
    norm: str = typer.Option("token", "--norm", help="loss normalisation: token, sequence or batch"),
    lr: Lr = 3e-4, warmup: Warmup = 100, grad_accum: GradAccum = 1, weight_decay: WeightDecay = 0.0, clip: Clip = 1.0,
    ckpt_every: CkptEvery = 500, eval_every: EvalEvery = 500, max_minutes: MaxMinutes = None, seed: Seed = 0,
    resume: Resume = False, overwrite: Overwrite = False, device: Device = "cpu", fsdp: Fsdp = False,
    no_progress: NoProgress = False,
) -> None:
    """Adapt a causal LM into a masked-diffusion LM (bidirectional, logit shift 1; diffusion.md §1-2)."""
    from unmask.train.diffusion import train_diffusion

    _start(data, out)
    _finish(train_diffusion(
        base=base, data=data, out=out, run_dir=run_dir, seq_len=seq_len, prefix_prob=prefix_prob, norm=norm,
        resume=resume, overwrite=overwrite, device=device, progress=not no_progress,
        **_loop_options(steps, batch_size, lr, warmup, grad_accum, weight_decay, clip, ckpt_every, eval_every,
                        max_minutes, seed, fsdp)), terms=("loss", "nll"))


@train_app.command("block-diffusion")
def train_block_diffusion_cmd(
    base: str = typer.Option("stories260K", "--base",
                             help="causal LM (a mask token is added) or block-diffusion model"),
    block_size: int = typer.Option(None, "--block-size", help="block size B (required for a causal base)"),
    data: Data = None, out: Out = None, run_dir: RunDir = None,
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per row L, a multiple of B (a forward sees 2L)"),
    t_low: float = typer.Option(0.001, "--t-low", help="lowest per-block mask ratio"),
    t_high: float = typer.Option(1.0, "--t-high", help="highest per-block mask ratio"),
    noise: str = typer.Option("block", "--noise", help="block: one ratio per block; sequence: one per row"),
    rounding: str = typer.Option("floor", "--rounding", help="masks per block: floor(B*t) or stochastic"),
    steps: int = 1000, batch_size: int = 8, lr: float = 1e-3, warmup: int = 100, grad_accum: int = 1,
    weight_decay: float = 0.0, clip: Clip = 1.0, ckpt_every: int = 500, eval_every: int = 500,
    max_minutes: MaxMinutes = None, seed: int = 0,
    resume: Resume = False, overwrite: Overwrite = False, device: Device = "cpu", fsdp: Fsdp = False,
    no_progress: NoProgress = False,
) -> None:
    """Teacher-forcing training of a block-diffusion LM (dual-stream masked CE, multiblock.md §1.3)."""
    from unmask.train.block_diffusion import train_block_diffusion

    _start(data, out)
    _finish(train_block_diffusion(
        base=base, data=data, out=out, block_size=block_size, run_dir=run_dir, seq_len=seq_len, t_low=t_low,
        t_high=t_high, noise=noise, rounding=rounding, resume=resume, overwrite=overwrite, device=device,
        progress=not no_progress,
        **_loop_options(steps, batch_size, lr, warmup, grad_accum, weight_decay, clip, ckpt_every, eval_every,
                        max_minutes, seed, fsdp)))


@train_app.command("multitf")
def train_multitf_cmd(
    base: str = typer.Option("stories260K-bd", "--base", help="block-diffusion model to post-train"),
    data: Data = None, out: Out = None, run_dir: RunDir = None,
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per row L, a multiple of B"),
    g_max: int = typer.Option(4, "--g-max", help="largest noise group (decode with --slots <= this)"),
    n_rand: int = typer.Option(2, "--n-rand", help="random layouts per row, besides the systematic ones"),
    t_low: float = 0.001, t_high: float = 1.0,
    rho: float = typer.Option(0.01, "--rho", help="t_eff = t_high - rho (t_high - t_low)"),
    rounding: str = typer.Option("floor", "--rounding", help="masks per block: floor(B*t) or stochastic"),
    layouts_per_row: int = typer.Option(0, "--layouts-per-row",
                                        help="train on a random subset of this many layouts per row (0 = all)"),
    loss: str = typer.Option("ce", "--loss", help="ce: mean masked CE (eq. 3.4); ipw: the SDAR code's "
                                                  "self-normalised 1/t-weighted CE"),
    preset: str = typer.Option(None, "--preset", help="released G_max / N_rand, overriding --g-max and --n-rand: "
                                                      "llada2 (2 / 0, decode --slots 2), llada2-dmax-code (2 / 2), "
                                                      "sdar-b32 (4 / 3), sdar-b4 (4 / 2, --slots 4)"),
    steps: int = 500, batch_size: int = typer.Option(2, "--batch-size", help="clean rows per micro-batch"),
    lr: float = 3e-4, warmup: int = 15, grad_accum: int = 1, weight_decay: float = 0.1, clip: Clip = 1.0,
    ckpt_every: int = 200, eval_every: int = 200, max_minutes: MaxMinutes = None, seed: int = 0,
    resume: Resume = False, overwrite: Overwrite = False, device: Device = "cpu", fsdp: Fsdp = False,
    no_progress: NoProgress = False,
) -> None:
    """MultiTF post-training of a block-diffusion LM (group layouts, chain-uniform noise, multiblock.md §4)."""
    from unmask.train.multitf import train_multitf

    _start(data, out)
    _finish(train_multitf(
        base=base, data=data, out=out, run_dir=run_dir, seq_len=seq_len, g_max=g_max, n_rand=n_rand, t_low=t_low,
        t_high=t_high, rho=rho, rounding=rounding, layouts_per_row=layouts_per_row, loss=loss, preset=preset,
        resume=resume,
        overwrite=overwrite, device=device, progress=not no_progress,
        **_loop_options(steps, batch_size, lr, warmup, grad_accum, weight_decay, clip, ckpt_every, eval_every,
                        max_minutes, seed, fsdp)))


