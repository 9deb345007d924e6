"""``unmask data stories`` and ``unmask data distill``: thin wrappers over :mod:`unmask.train.data` and
:mod:`unmask.train.distill` that write training corpora."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from unmask.cli.root import app

data_app = typer.Typer(no_args_is_help=True, help="Build training corpora.")
app.add_typer(data_app, name="data")


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
