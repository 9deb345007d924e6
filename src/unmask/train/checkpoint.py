"""Atomic training checkpoints: the ``run_dir/checkpoints/step-*`` layout of :mod:`unmask.train.loop`.

A checkpoint is a loadable Hugging Face directory (``save_pretrained``) plus ``trainer_state.pt``
(optimizer, scheduler, step, RNG states). It is assembled in a hidden staging directory and
renamed into place, so a ``step-*`` directory is always complete; a crash or kill at any moment
leaves the previous one.
"""

from __future__ import annotations

import math
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.fileio import make_readable, publish_dir, staging_dir, write_errors

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


def load_state(ckpt: Path) -> dict:
    """``ckpt/trainer_state.pt`` as a dict (tensors on CPU, ``weights_only``).

    Raises:
        UnmaskError: the file is truncated, garbage or not a trainer state.
    """
    f = ckpt / STATE_FILE
    try:
        with warnings.catch_warnings():  # garbage makes torch warn about the "pickle protocol" first
            warnings.simplefilter("ignore")
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's unpickler raises anything on garbage (IndexError, EOFError, ...)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UnmaskError(f"cannot read {f} ({first[:120].rstrip('.')}); the checkpoint is truncated or corrupt, "
                          "delete it to resume from an older one or pass --overwrite to start over") from None
    need = ("step", "config", "scheduler", "sampler", "rng")  # the optimizer is in dcp/ since torchrun support
    if not isinstance(state, dict) or any(k not in state for k in need):
        raise UnmaskError(f"{f} is not an unmask trainer state; delete the checkpoint or pass --overwrite to "
                          "start over")
    return state


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: str | Path, step: int, model, trainer_state: dict,
                    save_extras: Callable[[Path, dict], None] | None = None, keep: int = 1) -> Path:
    """Write ``run_dir/checkpoints/step-{step:08d}`` atomically and prune older checkpoints.

    The model is saved with ``save_pretrained`` (a loadable HF directory), ``save_extras(dir,
    trainer_state)`` adds tokenizer/metadata files, and ``trainer_state.pt`` holds the
    optimizer, scheduler, step and RNG states. Everything goes to a staging directory first;
    only a complete directory is renamed to ``step-*`` (with a published model's permissions).
    On any error the staging directory is removed and the older checkpoints are untouched.

    Raises:
        UnmaskError: a parameter is nan or inf (see :func:`diverged`), or the checkpoint cannot
            be written (a full disk: ``torch.save`` raises RuntimeError and safetensors
            SafetensorError there, not OSError).
    """
    final = Path(run_dir) / CKPT_DIR / f"step-{step:08d}"
    for name, p in model.named_parameters():  # never save (or later publish) diverged weights
        problem = weight_problem(name, p.detach()) if p.requires_grad else None
        if problem is None and not bool(torch.isfinite(p.detach()).all()):
            problem = f"parameter {name} is not finite"
        if problem is not None:
            raise diverged(problem, step, run_dir)
    try:
        tmp = staging_dir(final)
    except OSError as e:
        raise UnmaskError(f"cannot write checkpoint {final}: {e.strerror or e}; pass a writable --run-dir") from None
    try:
        with write_errors(f"checkpoint {final}", "free disk space or pass another --run-dir"):
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


def diverged(what: str, step: int, run_dir: str | Path) -> UnmaskError:
    """The error that stops a run whose loss or weights became nan/inf: nothing is published,
    and the newest (finite) checkpoint, if any, is named."""
    last = latest_checkpoint(run_dir)
    kept = f"the checkpoint {last} is kept" if last is not None else "no checkpoint was written"
    return UnmaskError(f"training diverged: {what} at step {step}; nothing was published and {kept}; "
                       "lower --lr (or --weight-decay) or check the data")


# The largest finite float16 value. A trained weight beyond it cannot be stored in half precision
# and is orders of magnitude past any language model's weights: a run that produced one diverged
# (lr 1e30 gave |w| = 2.7e30 with a finite loss, so the nan/inf guard alone let it through).
MAX_WEIGHT = 65504.0


def weight_problem(name: str, p: torch.Tensor) -> str | None:
    """Why the trained parameter ``p`` must not be saved (not finite, or some ``|w|`` above
    MAX_WEIGHT), or None when it is fine."""
    if not bool(torch.isfinite(p).all()):
        return f"parameter {name} is not finite"
    peak = float(p.abs().max()) if p.numel() else 0.0
    if peak > MAX_WEIGHT:
        return f"parameter {name} reaches |w| = {peak:.3g}, beyond float16's range ({MAX_WEIGHT:g})"
    return None


def exploded(initial: float | None, final: float | None, vocab: int | None) -> bool:
    """Whether a run whose loss started at ``initial`` (the first step's training loss, before
    any update) and ended at ``final`` (the last held-out loss, else the last training loss) is
    too broken to publish: ``final`` is not finite, or it exceeds ``initial`` by more than
    ln V (V = ``vocab``), the loss of a uniform guess over the vocabulary. A run that ends that
    far above where it started predicts worse than the untrained model by more than knowing
    nothing at all would cost; ordinary noise and overfitting stay well inside the margin.
    Without ``initial`` or ``vocab`` only the finiteness is checked."""
    if final is None:
        return False
    if not math.isfinite(final):
        return True
    if initial is None or not math.isfinite(initial) or not vocab or vocab < 2:
        return False
    return final > initial + math.log(vocab)


def install(tmp: Path, final: Path) -> None:
    """Give the complete staging directory ``tmp`` a published model's permissions and swap it in
    as ``final`` in one step (re-saving the same step after a resume replaces it atomically)."""
    make_readable(tmp)
    publish_dir(tmp, final)


def prune(run_dir: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints; drop staging directories left by a killed run."""
    for old in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in (Path(run_dir) / CKPT_DIR).glob(".step-*"):
        shutil.rmtree(stale, ignore_errors=True)


def save_model(model, directory: Path, state_dict: dict | None = None) -> None:
    """``save_pretrained`` as one safetensors file, without transformers' progress bar (it
    would break the training progress display). ``state_dict``: the weights to write instead of
    the model's own (the gathered full state of an FSDP2-sharded model). A model carrying
    ``unmask_weights_io`` (a gated SBD adapter, unmask.models.sbd_adapter) saves only that
    object's weights."""
    from transformers.utils import logging as hf_logging

    io = getattr(model, "unmask_weights_io", None)
    if io is not None:  # a gated SBD adapter: only its tensors are trained, only they are saved
        io.save_weights(directory)
        return
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

    io = getattr(model, "unmask_weights_io", None)
    if io is not None:  # a gated SBD adapter (see save_model)
        io.load_weights(ckpt)
        return
    f = ckpt / WEIGHTS_FILE
    if not f.is_file():
        raise UnmaskError(f"{ckpt} has no {WEIGHTS_FILE}, so the checkpoint is not loadable; pass --overwrite to "
                          "start over")
    from safetensors import SafetensorError

    try:
        state = load_file(str(f))
    except (OSError, SafetensorError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UnmaskError(f"cannot read {f} ({first.rstrip('.')}); the checkpoint is truncated or corrupt, "
                          "delete it to resume from an older one or pass --overwrite to start over") from None
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
