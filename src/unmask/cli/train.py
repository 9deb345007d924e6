"""``unmask train sbd``, ``unmask train diffusion``, ``unmask data stories`` and ``unmask data distill``: thin
wrappers over unmask.train."""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from unmask.cli.root import app
from unmask.errors import UnmaskError

train_app = typer.Typer(no_args_is_help=True, help="Fine-tune models for parallel decoding.")
data_app = typer.Typer(no_args_is_help=True, help="Build training corpora.")
app.add_typer(train_app, name="train")
app.add_typer(data_app, name="data")

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


@contextmanager
def _messages(enabled: bool):
    """The routers' progress messages as one updating line on a terminal; nothing when stderr is
    piped or with --no-progress (their per-epoch lines used to fill the log)."""
    from rich.console import Console

    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield lambda message: None
        return
    with console.status("starting") as line:
        yield lambda message: line.update(str(message))


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
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar (it shows only on a terminal)"),
) -> None:
    """Generate a self-sampled story corpus (sampled stories + greedy continuations) as JSONL; exact duplicates are
    kept once and empty stories dropped (the summary's dropped= counts both)."""
    from unmask.cli.progress import bar
    from unmask.compat import quiet_transformers
    from unmask.train.data import make_story_corpus

    quiet_transformers()
    with bar("documents", enabled=not no_progress) as progress:
        summary = make_story_corpus(out, model=model, n_sampled=sampled, n_greedy=greedy, seed=seed,
                                    overwrite=overwrite, progress=progress, max_new_tokens=max_new_tokens,
                                    batch_size=batch_size, val_fraction=val_fraction)
    typer.echo(" ".join(f"{k}={v}" for k, v in summary.items()))
    if summary.get("dropped"):
        typer.echo(f"dropped {summary['dropped']}: stories generated twice (kept once) or empty", err=True)


@data_app.command("distill")
def data_distill_cmd(
    model: str = typer.Option(..., "--model", "-m", help="model that answers (shipped name or local HF directory)"),
    prompts: list[str] = typer.Option(..., "--prompts", help="gsm8k (train questions), humaneval, mbpp (non-eval "
                                      "tasks) or a prompt file: .txt one per line, .jsonl prompt/messages rows "
                                      "(repeatable)"),
    out: Path = typer.Option(..., "--out", help="output JSONL corpus"),
    adapter: str = typer.Option(None, "--adapter", help="gated SBD adapter: a name the model ships or a directory"),
    system: str = typer.Option(None, "--system", help="a system turn for every prompt (models with a chat template)"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="cap of an answer"),
    batch_size: int = typer.Option(16, "--batch-size", "-b", help="prompts per batched AR decode"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
    seed: int = typer.Option(0, "--seed", help="seed of sampling and of the validation split"),
    limit: int = typer.Option(None, "--limit", help="the first N prompts of each --prompts source"),
    val_fraction: float = typer.Option(0.05, "--val-fraction", help="share of prompts held out for validation"),
    data_dir: Path = typer.Option(None, "--data-dir", help="folder holding gsm8k/, humaneval/, mbpp/ "
                                  "(default: $UNMASK_DATA_DIR or ../shared/data)"),
    resume: bool = typer.Option(False, "--resume", help="continue OUT: decode only the prompts it lacks (same "
                                "--model, --adapter, --dtype, -n, -t, --seed, --val-fraction, --system, prompts)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace OUT, once the new corpus is complete"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar (it shows only on a terminal)"),
) -> None:
    """Distillation corpus: the model's own AR answers to prompts (chat template applied when it has one) as
    JSONL rows {ids, loss_start, prompt, answer, source, index, split, settings}."""
    from unmask.cli.progress import bar
    from unmask.compat import quiet_transformers
    from unmask.train.distill import distill

    quiet_transformers()
    existed = Path(out).exists()
    try:
        with bar("prompts", enabled=not no_progress) as progress:
            summary = distill(out, model=model, prompts=prompts, adapter=adapter, system=system,
                              max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature, seed=seed,
                              limit=limit, val_fraction=val_fraction, resume=resume, overwrite=overwrite,
                              data_dir=data_dir, device=device, dtype=dtype, progress=progress)
    except KeyboardInterrupt:
        if overwrite or not Path(out).is_file() or (existed and not resume):
            raise
        print(f"interrupted; {out} keeps the answers written so far: run the same command with --resume to "
              "finish it", file=sys.stderr)
        raise SystemExit(130) from None
    typer.echo(" ".join(f"{k}={v}" for k, v in summary.items()))


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


@train_app.command("lbs")
def train_lbs_cmd(
    model: DlmModel = "stories260K-dlm", data: PromptData = None,
    out: Path = typer.Option(None, "--out", help="router directory (default MODEL_DIR/routers)"),
    prompts: int = typer.Option(1000, "--prompts", help="training prompts (one model response each)"),
    gen_length: int = typer.Option(256, "--gen-length", help="L: the router works at this generation length only"),
    block_size: int = typer.Option(32, "--block-size", help="L_B of Blockwise-Masking and of the response decode"),
    responses: str = typer.Option("top-k", "--responses", help="response decode: top-k (vanilla, 1 token/step) or threshold"),
    response_cache: str = typer.Option("none", "--response-cache", help="cache of the response decode: none, prefix, dual"),
    gen_batch: int = typer.Option(16, "--gen-batch", help="rows per response decode"),
    epochs: int = typer.Option(6, "--epochs"), batch_size: int = typer.Option(32, "--batch-size"),
    lr: float = typer.Option(5e-5, "--lr"), weight_decay: float = typer.Option(0.01, "--weight-decay"),
    loss: str = typer.Option("eq3", "--loss", help="eq3: the paper's Eq. 3; bce: BCE against its minimiser "
                                                   "1[CE < 1] (does not collapse to p = 0 on small models)"),
    d: int = typer.Option(32, "--d", help="router width (paper 128)"),
    layers: int = typer.Option(1, "--layers", help="encoder layers (paper 2)"),
    ffn: int = typer.Option(64, "--ffn", help="encoder FFN width (paper 256)"),
    max_minutes: RouterMinutes = None,
    seed: int = typer.Option(0, "--seed"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing LBS router at the output"),
    device: Device = "cpu", no_progress: NoProgress = False,
) -> None:
    """Train the Early-Bird LBS router of a masked-diffusion model (early_bird.md §3, Alg. 3)."""
    from unmask.compat import quiet_transformers
    from unmask.train.routers import LBSTrainConfig, run_lbs

    if not data:
        raise UnmaskError("no prompt corpus; pass --data FILE (.jsonl or .txt), e.g. the story corpus")
    quiet_transformers()
    with _messages(not no_progress) as note:
        summary = run_lbs(model=model, data=data, out=out, n_prompts=prompts, gen_length=gen_length, block_size=block_size,
                          response_policy=responses, response_cache=response_cache, gen_batch=gen_batch,
                          train=LBSTrainConfig(block=block_size, epochs=epochs, batch_size=batch_size, lr=lr,
                                               weight_decay=weight_decay, seed=seed, max_minutes=max_minutes,
                                               loss=loss),
                          router={"d": d, "layers": layers, "ffn": ffn}, overwrite=overwrite, device=device,
                          progress=note)
    if summary:  # under torchrun only rank 0 trains and reports
        typer.echo(" ".join(f"{k}={v}" for k, v in summary.items()))


@train_app.command("lps")
def train_lps_cmd(
    model: DlmModel = "stories260K-dlm", data: PromptData = None,
    routers: Path = typer.Option(None, "--routers", help="directory holding the LBS router (default MODEL_DIR/routers)"),
    out: Path = typer.Option(None, "--out", help="where to write lps.* (default: next to the LBS router)"),
    prompts: int = typer.Option(300, "--prompts", help="trace prompts (one decoding trace each)"),
    block_size: int = typer.Option(32, "--block-size", help="L_B served (and recorded as the decoder default)"),
    tau: float = typer.Option(0.9, "--tau", help="confidence threshold τ served"),
    l_min: int = typer.Option(8, "--l-min", help="L_min served"), g_max: int = typer.Option(5, "--g-max", help="g_max served"),
    pos_mode: str = typer.Option("literal", "--pos-mode", help="position feature: literal or rank"),
    replay: bool = typer.Option(False, "--replay", help="recompute features by oracle replay (slower; same under greedy)"),
    traces_file: Path = typer.Option(None, "--traces-file", help="cache of the traces (.pt), reused when present"),
    gen_batch: int = typer.Option(16, "--gen-batch", help="rows per trace decode"),
    max_epochs: int = typer.Option(2000, "--max-epochs"), patience: int = typer.Option(100, "--patience"),
    batch_size: int = typer.Option(512, "--batch-size", help="step records per batch"),
    lr: float = typer.Option(1e-3, "--lr"), fpr: float = typer.Option(0.01, "--fpr", help="FPR budget η for τ_ψ"),
    d: int = typer.Option(32, "--d"), layers: int = typer.Option(2, "--layers"), ffn: int = typer.Option(64, "--ffn"),
    max_minutes: RouterMinutes = None,
    seed: int = typer.Option(0, "--seed", help="seed of the prompt choice (the split seed is 42)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing LPS router at the output"),
    device: Device = "cpu", no_progress: NoProgress = False,
) -> None:
    """Collect traces with the LBS router and train the Early-Bird LPS router (early_bird.md §4, Alg. 4)."""
    from unmask.compat import quiet_transformers
    from unmask.train.routers import LPSTrainConfig, run_lps

    if not data and (traces_file is None or not traces_file.is_file()):
        raise UnmaskError("no prompt corpus; pass --data FILE (.jsonl or .txt) or an existing --traces-file")
    quiet_transformers()
    with _messages(not no_progress) as note:
        summary = run_lps(model=model, data=data or [], routers=routers, out=out, n_prompts=prompts, block_size=block_size,
                          tau=tau, l_min=l_min, g_max=g_max, pos_mode=pos_mode, replay=replay, gen_batch=gen_batch,
                          traces_file=traces_file,
                          train=LPSTrainConfig(max_epochs=max_epochs, patience=patience, batch_size=batch_size, lr=lr,
                                               fpr_budget=fpr, max_minutes=max_minutes),
                          router={"d": d, "layers": layers, "ffn": ffn}, seed=seed, overwrite=overwrite, device=device,
                          progress=note)
    if summary:  # under torchrun only rank 0 trains and reports
        typer.echo(" ".join(f"{k}={v}" for k, v in summary.items()))
