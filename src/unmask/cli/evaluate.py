"""``unmask eval`` and ``unmask sweep``, and the decoder options they share (``-O KEY=VALUE``).

Thin wrappers (STYLE.md habit 12) over :func:`unmask.eval.runner.evaluate` and
:func:`unmask.eval.sweep.sweep`; ``unmask bench`` and ``unmask roofline`` are :mod:`unmask.cli.bench`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import typer

from unmask.cli.progress import stage_bar, stdout_console
from unmask.cli.root import app
from unmask.dist import env_rank
from unmask.errors import UnmaskError
from unmask.fileio import check_output_file

# Options shared by `eval` and `sweep` (typer reads each OptionInfo afresh per command).
MODEL = typer.Option(None, "--model", "-m", help="shipped model name or local HF directory (default: the default shipped model)")
DECODER = typer.Option(None, "--decoder", "-d", help="ar, sbd, ... (default: the model kind's natural decoder)")
LIMIT = typer.Option(None, "--limit", help="evaluate the first N items only")
BATCH = typer.Option(8, "--batch-size", "-b", help="prompts decoded together")
MAX_NEW = typer.Option(None, "--max-new-tokens", "-n", help="generation budget (default: the task's, clipped to the context)")
SHOTS = typer.Option(None, "--shots", help="gsm8k: k-shot from the train split (default 0); mbpp: 0 or 3 (default 3)")
DATA_DIR = typer.Option(None, "--data-dir", help="folder holding gsm8k/, humaneval/, mbpp/ (default: $UNMASK_DATA_DIR or ../shared/data)")
JUDGE = typer.Option("stories260K", "--judge", help="stories: causal model that scores continuations (reference NLL)")
TEMPERATURE = typer.Option(0.0, "--temperature", "-t", help="0 = greedy")
SEED = typer.Option(0, "--seed", help="seed of the sampling generator")
POLICY = typer.Option(None, "--policy", help="commit policy: entropy-bound, confidence-bound, threshold, factor, top-k, "
                                             "entropy-threshold")
OPTION = typer.Option(None, "--option", "-O", help="any other decoder option as KEY=VALUE, repeatable "
                                                   "(e.g. -O cache=prefix -O gen_length=256 -O slots=4 -O lps=false)")
BLOCK = typer.Option(None, "--block-size", "-k", help="block size")
ADAPTER = typer.Option(None, "--adapter", help="gated SBD adapter: a name the model ships (e.g. sbd) or a directory")
DEVICE = typer.Option("cpu", "--device", help="cpu or cuda")
DTYPE = typer.Option("float32", "--dtype", help="float32 or bfloat16")
OVERWRITE = typer.Option(False, "--overwrite", help="replace existing output files")
CHAT = typer.Option(None, "--chat/--no-chat", help="gsm8k, humaneval, mbpp: ask in chat form through the model's "
                    "chat template (default: when the model has one; stories is always raw)")
SYSTEM = typer.Option(None, "--system", help="a system turn for chat prompts")
REFERENCE_NFE = typer.Option(False, "--reference-nfe", help="dLLM decoders: decode the whole canvas as the reference "
                             "code does (no stop after the EOS block), so NFE equals theirs; text still cut at EOS")
TP = typer.Option(None, "--tp", help="under torchrun: load the model tensor-parallel over N processes "
                                     "(default: data parallel, prompts split over the processes)")


def _options(extra: list[str] | None = None, **given: Any) -> dict[str, Any]:
    """The decoder options set on the command line: the named flags that were given plus each
    ``--option KEY=VALUE`` (VALUE read as an int, a float, true/false, none, or else text; a path
    option such as ``routers`` stays text).
    Raises UnmaskError for an entry without ``=``, a key that is not a user-facing decoder option
    (see :func:`_decoder_options`), a key given twice or also set by its own flag, and a
    non-boolean value for a boolean option."""
    from unmask.decode.engine.registry import knob_types  # the value types of the decoders' knobs

    opts = {k: v for k, v in given.items() if v is not None}
    known = _decoder_options() if extra else {}
    seen: set[str] = set()
    for item in extra or ():
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise UnmaskError(f"--option needs KEY=VALUE (got {item!r}); e.g. --option cache=prefix")
        if key not in known:
            raise UnmaskError(f"--option {key}: not a decoder option; use one of {', '.join(sorted(known))} "
                              "(sampling, budget and task settings have their own flags)")
        if key in seen:
            raise UnmaskError(f"--option {key} is given twice; give it once")
        if key in opts:
            raise UnmaskError(f"decoder option {key!r} is set twice (its own flag and --option); give it once")
        value = raw.strip() if key in _PATH_OPTIONS else _option_value(raw.strip())
        if known[key] and value is not None and not isinstance(value, bool):
            raise UnmaskError(f"--option {key} must be true or false (got {raw.strip()!r})")
        want = knob_types().get(key)  # the type of the decoders' knob of that name
        if value is not None and want in ("int", "float") and (isinstance(value, bool) or not isinstance(
                value, int if want == "int" else (int, float))):
            raise UnmaskError(f"--option {key} must be {'an integer' if want == 'int' else 'a number'} "
                              f"(got {raw.strip()!r}); e.g. --option {key}={8 if want == 'int' else 0.5}")
        if isinstance(value, float) and not math.isfinite(value):  # as generate's flags and the server
            raise UnmaskError(f"--option {key} must be a finite number (got {raw.strip()}); for \"reveal everything\" "
                              "pass a large value such as 1e9")
        seen.add(key)
        opts[key] = value
    return opts


# Decoder arguments that come from the caller (or are Python objects), never --option keys.
_DECODER_ARGS = frozenset({"bundle", "prompts", "max_new_tokens", "sampling", "stop_token_ids", "stop_strings",
                           "on_step", "on_forward", "lbs_router", "lps_router"})

# Options whose VALUE is a path, kept as text (routers=5 names the directory "5", not the number 5).
_PATH_OPTIONS = frozenset({"routers"})


def _decoder_options() -> dict[str, bool]:
    """Every user-facing option of the registered decoders -> whether it is a boolean."""
    from unmask.api import RUN_OPTIONS
    from unmask.decode.engine.registry import knob_types

    known = {name: kind == "bool" for name, kind in knob_types().items() if name not in _DECODER_ARGS}
    return {**known, **{name: True for name in RUN_OPTIONS if name not in _DECODER_ARGS}}


def _option_value(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


SUMMARY_SKIP = ("type", "task", "model", "decoder", "config", "env", "notes", "quality_metric", "quality_pct")


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.table import Table

    console = stdout_console()
    t = Table(title=f"unmask eval · {summary['task']} · {summary['model']} · {summary['decoder']}")
    cfg = summary["config"]
    ref = cfg.get("agreement_reference")
    if ref and cfg.get("agreement_dtype"):  # in bfloat16 lossless SBD may part from AR at near-ties
        ref = f"{ref} in {cfg['agreement_dtype']}"
    meaning = {"nfe": "forwards per row (mean)", "forwards": "forward calls of the batches", "tpf": "tokens per row forward",
               **{k: f"vs greedy {ref}" for k in summary if (k.startswith("agreement_") or k == "identical_pct") and ref}}
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("", style="dim")
    for k, v in summary.items():
        if k not in SUMMARY_SKIP:
            t.add_row(k, _fmt(v), meaning.get(k, ""))
    console.print(t)
    opts = " ".join(f"{k}={v}" for k, v in cfg["options"].items()) or "defaults"
    console.print(f"[dim]decoder options: {opts} · max_new_tokens {cfg['max_new_tokens']} · "
                  f"batch {cfg['batch_size']} · {summary['env']['device']} {summary['env']['dtype']}[/dim]")
    for note in summary["notes"]:
        console.print(f"[yellow]note: {note}[/yellow]")


def _eval_model(model: str | None, adapter: str | None, tp: int | None, device: str, dtype: str):
    """The model argument of eval/sweep: the name itself, or a bundle when the gated SBD
    ``adapter`` is loaded on it or ``--tp`` loads it tensor-parallel (see
    :mod:`unmask.models.tensor_parallel`)."""
    if adapter is None and (tp is None or tp == 1):
        return model
    from unmask import dist
    from unmask.models import load

    if dist.launched():
        device = str(dist.setup(device))
    return load(model, device=device, dtype=dtype, tp=tp, adapter=adapter)


@app.command("eval")
def eval_cmd(
    task: str = typer.Option(..., "--task", help="stories, gsm8k, humaneval or mbpp"),
    model: str = MODEL, decoder: str = DECODER, limit: int = LIMIT, batch_size: int = BATCH,
    max_new_tokens: int = MAX_NEW, shots: int = SHOTS, data_dir: Path = DATA_DIR, judge: str = JUDGE,
    temperature: float = TEMPERATURE, seed: int = SEED, policy: str = POLICY,
    gamma: float = typer.Option(None, "--gamma", help="EB-sampler bound γ >= 0"),
    preset: str = typer.Option(None, "--preset", help="γ preset: reasoning-low, reasoning-high, chat-low, chat-high"),
    tau: float = typer.Option(None, "--tau", help="confidence threshold τ in (0, 1]"),
    factor: float = typer.Option(None, "--factor", help="Fast-dLLM factor f"),
    tokens_per_step: int = typer.Option(None, "--tokens-per-step", help="tokens committed per step (top-k)"),
    block_size: int = BLOCK, option: list[str] = OPTION, adapter: str = ADAPTER,
    compile: bool = typer.Option(False, "--compile", help="static KV cache and a compiled step (every decoder; same tokens)"),
    reference_nfe: bool = REFERENCE_NFE,
    out: Path = typer.Option(None, "--out", "-o", help="write every item row and the summary as JSON lines to FILE"),
    workers: int = typer.Option(2, "--workers", help="code tasks: programs run in parallel in the sandbox"),
    chat: bool = CHAT, system: str = SYSTEM, device: str = DEVICE, dtype: str = DTYPE, tp: int = TP,
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar"),
    overwrite: bool = OVERWRITE,
) -> None:
    """Evaluate a decoder on a task: quality plus NFE / TPF / TPS per item and overall."""
    from unmask.eval.runner import evaluate

    opts = _options(option, policy=policy, gamma=gamma, preset=preset, tau=tau, factor=factor,
                    tokens_per_step=tokens_per_step, block_size=block_size)
    if compile:
        if "compile" in opts:
            raise UnmaskError("decoder option 'compile' is set twice (its own flag and --option); give it once")
        opts["compile"] = True
    if workers < 1:
        raise UnmaskError(f"--workers must be >= 1, got {workers}; pass e.g. --workers 2")
    if out is not None:
        check_output_file(out, "--out", exists_ok=overwrite, probe=True)
    model = _eval_model(model, adapter, tp, device, dtype)
    with stage_bar(not no_progress and env_rank() == 0) as progress:
        result = evaluate(task, model, decoder, limit=limit, batch_size=batch_size, max_new_tokens=max_new_tokens,
                          shots=shots, data_dir=data_dir, judge=judge, temperature=temperature, seed=seed,
                          device=device, dtype=dtype, workers=workers, progress=progress, chat=chat,
                          system=system, reference_nfe=reference_nfe, **opts)
    if env_rank() != 0:  # under torchrun every rank holds the gathered result; rank 0 reports it
        return
    if out is not None:
        result.write(out)
    _print_summary(result.summary)
    if out is not None:
        typer.echo(f"wrote {len(result.rows)} rows and the summary to {out}")


@app.command("sweep")
def sweep_cmd(
    task: str = typer.Option(..., "--task", help="stories, gsm8k, humaneval or mbpp"),
    param: str = typer.Option(..., "--param", help="gamma, tau, factor or tokens_per_step"),
    values: str = typer.Option(..., "--values", help="comma-separated values, e.g. 0,0.1,0.35"),
    model: str = MODEL, decoder: str = DECODER, limit: int = LIMIT, batch_size: int = BATCH,
    max_new_tokens: int = MAX_NEW, shots: int = SHOTS, data_dir: Path = DATA_DIR, judge: str = JUDGE,
    temperature: float = TEMPERATURE, seed: int = SEED, policy: str = POLICY, block_size: int = BLOCK,
    option: list[str] = OPTION, adapter: str = ADAPTER,
    metric: str = typer.Option(None, "--metric", help="quality axis: stories judge_prob_pct (default) or "
                                                      "agreement_pct; gsm8k flexible_pct (default) or strict_pct"),
    y_max: float = typer.Option(None, "--y-max", help="AUP's best accuracy over all methods (default: this sweep's best)"),
    out_png: Path = typer.Option(None, "--out-png", help="write the Pareto plot (quality vs TPF and vs TPS) to FILE"),
    out: Path = typer.Option(None, "--out", "-o", help="write the points and AUP as JSON to FILE"),
    chat: bool = CHAT, system: str = SYSTEM, device: str = DEVICE, dtype: str = DTYPE, tp: int = TP,
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar"),
    overwrite: bool = OVERWRITE,
) -> None:
    """Evaluate once per value of a policy parameter; print the table, the AUP and a Pareto plot."""
    from rich.table import Table

    from unmask.eval.sweep import _num, sweep

    opts = _options(option, policy=policy, block_size=block_size)
    png = out_png if out_png is None or out_png.suffix else out_png.with_suffix(".png")  # what savefig writes
    _check_sweep_outputs(out, png, y_max)
    for path, flag in ((out, "--out"), (png, "--out-png")):
        if path is not None:
            check_output_file(path, flag, exists_ok=overwrite, probe=True)
    model = _eval_model(model, adapter, tp, device, dtype)
    with stage_bar(not no_progress and env_rank() == 0) as progress:
        res = sweep(task, model, decoder, param=param, values=values, metric=metric, y_max=y_max,
                    limit=limit, batch_size=batch_size, max_new_tokens=max_new_tokens, shots=shots,
                    data_dir=data_dir, judge=judge, temperature=temperature, seed=seed, device=device,
                    dtype=dtype, progress=progress, chat=chat, system=system, **opts)
    if env_rank() != 0:  # under torchrun rank 0 reports the gathered points
        return
    console = stdout_console()
    first = res.results[0].summary
    t = Table(title=f"sweep {param} · {task} · {first['model']} · {first['decoder']}")
    for c in (param, f"{res.metric} (%)", "TPF", "TPS", "NFE", "seconds"):
        t.add_column(c, justify="right")
    for p in res.points:
        t.add_row(f"{p['value']:g}", _fmt(p["quality"]), f"{p['tpf']:.2f}", f"{p['tps']:.0f}",
                  f"{p['nfe']:.1f}", f"{p['seconds']:.2f}")
    console.print(t)
    if res.aup_score is not None:
        console.print(f"AUP {_num(res.aup_score)} (points (TPF, {res.metric}), y_max {_num(res.y_max)}, d3LLM variant)")
        if res.aup_dropped:
            shown = ", ".join(f"({_num(r)}, {_num(y)})" for r, y in res.aup_dropped)
            console.print(f"AUP left out {len(res.aup_dropped)} point(s) more than 5 below the first: {shown}")
    else:
        console.print(f"AUP n/a: {res.aup_error.removeprefix('aup: ')}")
    if out_png is not None:
        typer.echo(f"wrote {res.plot(out_png)}")
    if out is not None:
        from unmask.fileio import atomic_write_json

        atomic_write_json(out, res.to_dict(), "--out", output=True)
        typer.echo(f"wrote {out}")


def _check_sweep_outputs(out: Path | None, png: Path | None, y_max: float | None) -> None:
    """What sweep can refuse before it evaluates anything: one file for both outputs (the JSON would
    overwrite the plot), a plot format matplotlib cannot write, a --y-max AUP cannot use."""
    if out is not None and png is not None and out.resolve() == png.resolve():
        raise UnmaskError(f"--out and --out-png are the same file ({out}); give the plot its own name, e.g. "
                          f"{png.with_suffix('.png').name if png.suffix != '.png' else png.stem + '-plot.png'}")
    if png is not None:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        if png.suffix.lower().lstrip(".") not in kinds:
            raise UnmaskError(f"--out-png {png}: matplotlib cannot write {png.suffix!r} files; use .png, .pdf or .svg")
    if y_max is not None and not (math.isfinite(y_max) and 0 < y_max <= 100):
        raise UnmaskError(f"--y-max must be an accuracy in percent, in (0, 100] (got {y_max:g}); pass the best "
                          "accuracy over all methods, or drop it to use this sweep's best")


