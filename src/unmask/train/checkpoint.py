"""Atomic training checkpoints: the ``run_dir/checkpoints/step-*`` layout of :mod:`unmask.train.loop`.

A checkpoint is a loadable Hugging Face directory (``save_pretrained``) plus ``trainer_state.pt``
(optimizer, scheduler, step, RNG states). It is assembled in a hidden staging directory and
renamed into place, so a ``step-*`` directory is always complete; a crash or kill at any moment
leaves the previous one.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.fileio import staging_dir

CKPT_DIR = "checkpoints"
STATE_FILE = "trainer_state.pt"
WEIGHTS_FILE = "model.safetensors"


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``run_dir``, oldest first (staging directories are ignored)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: str | Path, step: int, model, trainer_state: dict,
                    save_extras: Callable[[Path, dict], None] | None = None, keep: int = 1) -> Path:
    """Write ``run_dir/checkpoints/step-{step:08d}`` atomically and prune older checkpoints.

    The model is saved with ``save_pretrained`` (a loadable HF directory), ``save_extras(dir,
    trainer_state)`` adds tokenizer/metadata files, and ``trainer_state.pt`` holds the
    optimizer, scheduler, step and RNG states. Everything goes to a staging directory first;
    only a complete directory is renamed to ``step-*``. On any error the staging directory is
    removed and the older checkpoints are untouched.
    """
    final = Path(run_dir) / CKPT_DIR / f"step-{step:08d}"
    tmp = staging_dir(final)
    try:
        save_model(model, tmp)
        if save_extras is not None:
            save_extras(tmp, trainer_state)
        torch.save(trainer_state, tmp / STATE_FILE)
        install(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(run_dir, keep)
    return final


def install(tmp: Path, final: Path) -> None:
    """Rename the complete staging directory ``tmp`` to ``final`` (replacing a checkpoint of the
    same step, e.g. re-saved after a resume)."""
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def prune(run_dir: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints; drop staging directories left by a killed run."""
    for old in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in (Path(run_dir) / CKPT_DIR).glob(".step-*"):
        shutil.rmtree(stale, ignore_errors=True)


def save_model(model, directory: Path, state_dict: dict | None = None) -> None:
    """``save_pretrained`` as one safetensors file, without transformers' progress bar (it
    would break the training progress display). ``state_dict``: the weights to write instead of
    the model's own (the gathered full state of an FSDP2-sharded model)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory, max_shard_size="1000GB", state_dict=state_dict)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_weights(model, ckpt: Path) -> None:
    """Load ``ckpt/model.safetensors`` into ``model`` in place. Keys missing from the file are
    allowed only for parameters tied to a loaded one (``save_pretrained`` drops tied copies).

    Raises:
        UnmaskError: no weights file, or keys that do not match the model.
    """
    from safetensors.torch import load_file

    f = ckpt / WEIGHTS_FILE
    if not f.is_file():
        raise UnmaskError(f"{ckpt} has no {WEIGHTS_FILE}, so the checkpoint is not loadable; pass --overwrite to "
                          "start over")
    state = load_file(str(f))
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatch
        first = str(e).strip().splitlines()[-1].strip()
        raise UnmaskError(f"checkpoint {ckpt} does not match the model ({first}); resume with the same --base, "
                          "or pass --overwrite") from None
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in state if k in params}
    untied = [k for k in missing if k not in params or params[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise UnmaskError(f"checkpoint {ckpt} does not match the model (missing {untied[:3]}, unexpected "
                          f"{unexpected[:3]}); resume with the same --base, or pass --overwrite")
