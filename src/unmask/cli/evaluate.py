"""``unmask eval``, ``unmask sweep``, ``unmask bench`` and ``unmask roofline``.

Thin wrappers (STYLE.md habit 12) over :func:`unmask.eval.runner.evaluate`,
:func:`unmask.eval.sweep.sweep`, :func:`unmask.bench.side_by_side.bench` and
:mod:`unmask.bench.roofline`.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import typer

from unmask.bench.side_by_side import REPEATS
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
    from unmask.serve.protocol import decoder_knobs  # the value types of generate's decoder flags

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
        want = decoder_knobs().get(key)  # the type of generate's own flag for it, where it has one
        if value is not None and want in ("int", "float") and (isinstance(value, bool) or not isinstance(
                value, int if want == "int" else (int, float))):
            raise UnmaskError(f"--option {key} must be {'an integer' if want == 'int' else 'a number'} "
                              f"(got {raw.strip()!r}); e.g. --option {key}={8 if want == 'int' else 0.5}")
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
    import inspect

    from unmask.decode import DECODERS, get_decoder

    known: dict[str, bool] = {}
    for info in DECODERS.values():
        for name, param in inspect.signature(get_decoder(info.name, info.kinds[0])).parameters.items():
            if name not in _DECODER_ARGS and param.kind is inspect.Parameter.KEYWORD_ONLY:
                known[name] = known.get(name, False) or "bool" in str(param.annotation)
    return known


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


@contextmanager
def _progress(enabled: bool = True) -> Iterator[Any]:
    """A rich progress bar on stderr; yields the ``progress(done, total, stage)`` callback."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("loading", total=None)

        def update(done: int, total: int, stage: str) -> None:
            bar.update(task, completed=done, total=total, description=stage)

        yield update


def _console():
    """A rich console; when stdout is not a terminal (a pipe, a file, a test) tables keep
    their natural width instead of being squeezed into 80 columns."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


SUMMARY_SKIP = ("type", "task", "model", "decoder", "config", "env", "notes", "quality_metric", "quality_pct")


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.table import Table

    console = _console()
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
    with _progress(not no_progress and env_rank() == 0) as progress:
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
    with _progress(not no_progress and env_rank() == 0) as progress:
        res = sweep(task, model, decoder, param=param, values=values, metric=metric, y_max=y_max,
                    limit=limit, batch_size=batch_size, max_new_tokens=max_new_tokens, shots=shots,
                    data_dir=data_dir, judge=judge, temperature=temperature, seed=seed, device=device,
                    dtype=dtype, progress=progress, chat=chat, system=system, **opts)
    if env_rank() != 0:  # under torchrun rank 0 reports the gathered points
        return
    console = _console()
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


@app.command("bench")
def bench_cmd(
    limit: int = typer.Option(16, "--limit", help="story openings per pair"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="tokens to generate per opening"),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="openings decoded together (1 = model TPS)"),
    repeats: int = typer.Option(REPEATS, "--repeats", help="timed passes per row: TPS is their median, printed with "
                                "its min-max spread"),
    include_all: bool = typer.Option(False, "--all", help="also run decoders on compatible non-native kinds (ar on an SBD model)"),
    decoder: list[str] = typer.Option(None, "--decoder", "-d", help="only this decoder (repeatable)"),
    model: list[str] = typer.Option(None, "--model", "-m", help="only this shipped model (repeatable)"),
    adapter: list[str] = typer.Option(None, "--adapter", help="also bench the models that ship this gated SBD "
                                                               "adapter, with it loaded (repeatable)"),
    judge: str = JUDGE,
    compile: bool = typer.Option(False, "--compile", help="also run every decoder compiled (after an untimed "
                                 "warm-up that compiles)"),
    as_json: bool = typer.Option(False, "--json", help="print the rows as one JSON object"),
    reference_nfe: bool = REFERENCE_NFE,
    device: str = DEVICE, dtype: str = DTYPE,
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar"),
) -> None:
    """Every decoder on every shipped model made for it, same prompts, one run: NFE, TPF, TPS, ratios to AR, quality."""
    from unmask.bench.side_by_side import bench

    with _progress(not no_progress and not as_json) as progress:
        res = bench(limit=limit, max_new_tokens=max_new_tokens, batch_size=batch_size, repeats=repeats,
                    include_all=include_all,
                    decoders=decoder or None, models=model or None, adapters=adapter or None, judge=judge,
                    compile=compile, device=device, dtype=dtype, progress=progress, reference_nfe=reference_nfe)
    failed = [r for r in res.rows if r.get("error")]
    if res.rows and len(failed) == len(res.rows):  # nothing measured: the settings are wrong, not one pair
        raise UnmaskError(f"every bench pair failed; the first: {failed[0]['decoder']} on {failed[0]['model']}: "
                          f"{str(failed[0]['error']).splitlines()[0]}")
    if as_json:
        typer.echo(json.dumps(res.to_dict(), ensure_ascii=False))
        return
    _console().print(res.table())


GPU_ALIASES = {"h100": "h100-sxm", "h200": "h200", "a100": "a100"}


def _gpu(name: str, peak_flops: float | None, attn_flops: float | None, bandwidth: float | None):
    from unmask.bench.roofline import GPUSpec

    if name == "custom":
        if None in (peak_flops, attn_flops, bandwidth):
            raise UnmaskError("--gpu custom needs --peak-flops, --attn-flops and --bandwidth; "
                              "give all three (FLOP/s, FLOP/s, bytes/s)")
        return GPUSpec("custom", peak_flops, attn_flops, bandwidth, "given on the command line")
    if any(v is not None for v in (peak_flops, attn_flops, bandwidth)):
        raise UnmaskError("--peak-flops, --attn-flops and --bandwidth go with --gpu custom; "
                          "add --gpu custom or drop them")
    return GPUSpec.preset(GPU_ALIASES.get(name, name))


def _shape(config: str):
    """A ModelShape from a config.json path, a model directory, a shipped model or a preset."""
    from unmask.bench.roofline import ModelShape
    from unmask.models.registry import shipped

    path = Path(config).expanduser()
    if config in shipped():
        path = shipped()[config]
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UnmaskError(f"cannot read {path} as JSON ({e}); pass an HF config.json") from None
        return ModelShape.from_config(cfg, name=path.parent.name if path.name == "config.json" else path.stem)
    from unmask.bench.roofline import MODEL_PRESETS

    if config not in MODEL_PRESETS:
        raise UnmaskError(f"--config {config!r} is no config.json, model directory, shipped model or preset; "
                          f"presets: {', '.join(MODEL_PRESETS)}")
    return ModelShape.preset(config)


def _numbers(text: str, what: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UnmaskError(f"{what} takes comma-separated numbers, got {text!r}; pass e.g. 2,4,8") from None
    if not vals:
        raise UnmaskError(f"{what} is empty; give comma-separated numbers, e.g. 2,4,8")
    return vals


@app.command("roofline")
def roofline_cmd(
    preset: str = typer.Option(None, "--preset", help="sbd-paper: SBD Tables 3 and 4 as printed (Fig. 11 cost model)"),
    config: str = typer.Option("llama-3.1-8b", "--config", help="HF config.json, model directory, shipped model or preset (llama-3.1-8b)"),
    gpu: str = typer.Option("h100", "--gpu", help="h100, h200, a100, h100-sxm-paper or custom"),
    peak_flops: float = typer.Option(None, "--peak-flops", help="custom GPU: linear-layer peak, FLOP/s"),
    attn_flops: float = typer.Option(None, "--attn-flops", help="custom GPU: attention peak, FLOP/s"),
    bandwidth: float = typer.Option(None, "--bandwidth", help="custom GPU: memory bandwidth, bytes/s"),
    weight_bytes: float = typer.Option(1.0, "--weight-bytes", help="corrected mode: bytes per weight (1 = FP8)"),
    kv_bytes: float = typer.Option(1.0, "--kv-bytes", help="corrected mode: bytes per KV-cache element"),
    act_bytes: float = typer.Option(2.0, "--act-bytes", help="corrected mode: bytes per activation"),
    nfe_speedup: str = typer.Option(None, "--nfe-speedup", help="also print the wall-clock speed-up table (Table 4) at these NFE speed-ups, e.g. 2,4,8"),
    as_json: bool = typer.Option(False, "--json", help="print the tables as JSON"),
    png: Path = typer.Option(None, "--png", help="plot the slowdown table to FILE (and the speed-up table to FILE-speedup.png)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace existing --png files"),
) -> None:
    """Roofline cost of k-token forwards (SBD §4): Table 3 slowdown and Table 4 wall-clock speed-up."""
    from unmask.bench.roofline import TABLE4_NFE, Precision, slowdown_table, speedup_table

    if preset not in (None, "sbd-paper"):
        raise UnmaskError(f"unknown roofline preset {preset!r}; the only preset is sbd-paper")
    nfe = _numbers(nfe_speedup, "--nfe-speedup") if nfe_speedup else None
    if preset == "sbd-paper":
        kw: dict[str, Any] = {"mode": "paper"}
        if gpu != "h100" or peak_flops or attn_flops or bandwidth:
            kw["gpu"] = _gpu(gpu, peak_flops, attn_flops, bandwidth)
        nfe = nfe or TABLE4_NFE
        titles = ("SBD Table 3 (as printed, Fig. 11 cost model)", "SBD Table 4 (as printed, Fig. 11 cost model)")
    else:
        kw = {"mode": "corrected", "shape": _shape(config), "gpu": _gpu(gpu, peak_flops, attn_flops, bandwidth),
              "precision": Precision(weight_bytes, kv_bytes, act_bytes)}
        titles = ("Table 3 layout, corrected cost model", "Table 4 layout, corrected cost model")
    tables = [slowdown_table(**kw)]
    if nfe:
        tables.append(speedup_table(**kw, nfe_speedups=nfe))
    if as_json:
        typer.echo(json.dumps({"tables": [t.to_dict() for t in tables]}))
    else:
        for title, t in zip(titles, tables):
            typer.echo(title)
            typer.echo(t.format())
            typer.echo()
    if png is not None:
        paths = [png, png.with_name(f"{png.stem}-speedup{png.suffix or '.png'}")]
        for path in paths[:len(tables)]:
            check_output_file(path if path.suffix else path.with_suffix(".png"), "--png", exists_ok=overwrite,
                              probe=True)
        for path, t in zip(paths, tables):
            written = t.plot(str(path))
            if not as_json:
                typer.echo(f"wrote {written}")
