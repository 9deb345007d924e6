"""``unmask bench`` and ``unmask roofline``: thin wrappers (STYLE.md habit 12) over
:func:`unmask.bench.side_by_side.bench` and :mod:`unmask.bench.roofline`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from unmask.bench.side_by_side import REPEATS
from unmask.cli.evaluate import DEVICE, DTYPE, JUDGE, REFERENCE_NFE
from unmask.cli.progress import stage_bar, stdout_console
from unmask.cli.root import app
from unmask.errors import UnmaskError
from unmask.fileio import check_output_file


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

    with stage_bar(not no_progress and not as_json) as progress:
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
    stdout_console().print(res.table())


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
