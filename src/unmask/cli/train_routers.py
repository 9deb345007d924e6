"""``unmask train lbs`` and ``unmask train lps``: thin wrappers over :mod:`unmask.train.routers` that train
Early-Bird's routers (spec/early_bird.md §3.3–§4.4)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import typer

from unmask.cli.train import Device, DlmModel, NoProgress, PromptData, RouterMinutes, train_app
from unmask.errors import UnmaskError


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
