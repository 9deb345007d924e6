"""``unmask calibrate-drafts``: choose lossless SBD's draft layout per query budget (spec/sbd_exact.md §5.4)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from unmask.cli.root import app
from unmask.errors import UnmaskError


@app.command("calibrate-drafts")
def calibrate_drafts_cmd(
    model: str = typer.Argument(..., help="SBD model: a shipped name or a local directory (with --adapter: the base)"),
    adapter: str = typer.Option(None, "--adapter", help="gated SBD adapter (a name the model ships or a directory): "
                                "calibrate it and store the table in its adapter.json"),
    prompts: Path = typer.Option(None, "--prompts", help="prompts, .txt one per line or .jsonl rows (default: the "
                                 "built-in story openings 101-120, apart from the benchmark's first 100)"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="greedy tokens recorded per prompt"),
    budgets: str = typer.Option("8,16,24,32", "--budgets", help="query budgets to search, comma-separated"),
    queries: int = typer.Option(16, "--queries", help="the budget lossless decoding uses by default"),
    siblings: bool = typer.Option(False, "--siblings", help="also search layouts with sibling candidates "
                                  "(D/S/G+j[cC][gG], spec/sbd_exact.md §5.3; sampled rows draw their siblings i.i.d.)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the table, store nothing"),
    overwrite: bool = typer.Option(False, "--overwrite", help="store into a shipped checkpoint, inside the installed "
                                   "package (without it, a shipped name needs --dry-run)"),
    as_json: bool = typer.Option(False, "--json", help="print the table as one JSON object"),
) -> None:
    """Record the model's greedy text and its block-mode drafts after every prefix, replay every
    layout (D, S, G) within each budget, print the best per budget (Q, layout, predicted TPF) and
    store them as the model's decode_defaults (draft=budget), so lossless SBD uses them by default."""
    from unmask.calibrate import calibrate, measured, store_measured, stored_defaults
    from unmask.decode.verify import layout as dl
    from unmask.models import load
    from unmask.models.adapter_io import resolve_adapter, set_adapter_decode_defaults
    from unmask.models.registry import CHECKPOINTS, resolve
    from unmask.train.wiring import set_decode_defaults

    try:
        wanted = sorted({int(x) for x in budgets.split(",")})
    except ValueError:
        raise UnmaskError(f"--budgets {budgets!r} is not a comma-separated list of integers; pass e.g. 8,16,24,32") from None
    if not wanted or wanted[0] < 4:
        raise UnmaskError(f"every query budget must be >= 4 (got {budgets}); pass e.g. --budgets 8,16,24,32")
    if queries < 4:
        raise UnmaskError(f"--queries must be >= 4 (got {queries}); pass e.g. --queries 16")
    if max_new_tokens < 2:
        raise UnmaskError(f"--max-new-tokens must be >= 2 (got {max_new_tokens}); pass e.g. 128")
    _, model_dir = resolve(model)
    target = resolve_adapter(model_dir, adapter)[1] if adapter else model_dir
    if not dry_run and not adapter and not (model_dir / "unmask_config.json").is_file():
        raise UnmaskError(f"{model} has no unmask_config.json to store the layouts in; pass an SBD model "
                          "directory, --adapter, or --dry-run")
    bundle = load(model, adapter=adapter)
    if bundle.kind != "sbd":
        raise UnmaskError(f"{model} is a {bundle.kind} model; calibrate-drafts picks lossless SBD's draft layouts: "
                          "pass an SBD model (e.g. stories260K-sbd) or a causal base with --adapter (stories260K "
                          "--adapter sbd)")
    if not dry_run and not overwrite and Path(target).resolve().is_relative_to(CHECKPOINTS.resolve()):
        raise UnmaskError(f"{model + (f' --adapter {adapter}' if adapter else '')} is a shipped checkpoint: storing its layouts would change the installed package "
                          "for every user of it; pass --dry-run to see the table, --overwrite to store it anyway, or "
                          "calibrate a copy of the model directory")
    if prompts is None:
        from unmask.eval.story_openings import STORY_OPENINGS

        texts = list(STORY_OPENINGS[100:])
    else:
        from unmask.cli.generate import read_prompts

        texts = read_prompts([], prompts)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise UnmaskError(f"--prompts {prompts}: needs plain text prompts (one per line, or 'prompt' rows)")
    fix = "copy the model to a writable directory and calibrate the copy, or pass --dry-run"
    if not dry_run and not os.access(target, os.W_OK):  # before minutes of decoding
        raise UnmaskError(f"cannot store the layouts in {target}: it is not writable; {fix}")
    rows = calibrate(bundle, [bundle.encode(t) for t in texts], budgets=wanted, max_new_tokens=max_new_tokens,
                     siblings=siblings)
    if not dry_run:
        defaults = stored_defaults(dict(bundle.meta.get("decode_defaults") or {}), rows, queries)
        try:
            (set_adapter_decode_defaults if adapter else set_decode_defaults)(target, **defaults)
        except UnmaskError as e:  # the writer's hint names an output path this command has no flag for
            raise UnmaskError(str(e).replace("choose a writable path", fix)) from None
        # the default layout's TPF: what chooses the default decoder (unmask.decode.choice)
        layout = dl.resolve("budget", queries, defaults)
        store_measured(Path(target) / ("adapter.json" if adapter else "unmask_config.json"),
                       measured(rows, layout, prompts=len(texts), max_new_tokens=max_new_tokens,
                                dtype=str(bundle.dtype).removeprefix("torch.")), layout)
    if as_json:
        print(json.dumps({"model": model, "adapter": adapter, "prompts": len(texts), "max_new_tokens": max_new_tokens,
                          "rows": rows, "stored": None if dry_run else str(target)}))
        return
    print(f"draft layouts of {model}{'+' + adapter if adapter else ''} ({len(texts)} prompts, {max_new_tokens} tokens, "
          "greedy replay)")
    print(f"{'budget':>6}  {'queries':>7}  {'layout':<18} predicted TPF")
    for r in rows:
        print(f"{r['budget'] or '-':>6}  {r['queries']:>7}  {r['layout']:<18} {r['tpf']:.3f}")
    if not dry_run:
        layout = dl.resolve("budget", queries, defaults)
        print(f"stored in {target}: decode_defaults draft=budget, queries={queries} (lossless SBD's default now: "
              f"{layout})")
