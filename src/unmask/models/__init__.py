"""Model I/O: shipped checkpoints, local Hugging Face directories, llama2.c conversion."""

from __future__ import annotations

import os
import threading

from unmask.errors import UnmaskError
from unmask.models.bundle import KINDS, ModelBundle, load_dir
from unmask.models.registry import default_model, resolve, shipped

# One load at a time per process: transformers resolves its classes by lazy imports that are not
# thread-safe (two threads loading at once saw "transformers has no attribute AutoModelForCausalLM").
# Re-entrant, since a load may load its base. Loading is I/O and a one-off; decoding is not serialized.
_LOAD_LOCK = threading.RLock()


def load(name_or_path: str | None = None, *, kind: str | None = None, device: str = "cpu",
         dtype: str = "float32", mask_token_id: int | None = None, logit_shift: int | None = None,
         trust_remote_code: bool = False, tp: int | None = None, force_mask_id: bool = False,
         adapter: str | os.PathLike | None = None) -> ModelBundle:
    """Load a shipped checkpoint by name (``unmask.load("stories260K")``) or a local Hugging
    Face directory by path. ``None`` loads the default shipped model. No network is used.

    ``mask_token_id`` and ``logit_shift`` (0 LLaDA-style, 1 Dream-style) override what the
    directory says. Published LLaDA, Dream, SDAR and LLaDA2.0 directories load into unmask's
    native classes with no remote code (:mod:`unmask.models.families`); ``trust_remote_code`` is
    needed only for other checkpoints that ship their own model code. ``tp`` > 1:
    tensor-parallel over the processes of a torchrun launch (docs/scaling.md). A
    ``mask_token_id`` that is a special or ordinary vocabulary token (EOS, ``<unk>``) is refused
    unless ``force_mask_id=True``. See :func:`unmask.models.bundle.load_dir`.

    ``adapter``: a gated SBD adapter to load onto the model (spec/sbd_exact.md §3), by bare
    name from ``<model dir>/adapters/`` (``adapter="sbd"``) or by directory; the bundle is then
    of kind ``sbd`` (see :func:`unmask.models.adapter_io.apply_adapter`).

    Safe to call from several threads: loads run one at a time.

    Raises UnmaskError for an unknown name, a bad directory, an unavailable device, or an
    adapter that is unknown or was trained on other weights.
    """
    with _LOAD_LOCK:
        return _load(name_or_path, kind=kind, device=device, dtype=dtype, mask_token_id=mask_token_id,
                     logit_shift=logit_shift, trust_remote_code=trust_remote_code, tp=tp, force_mask_id=force_mask_id,
                     adapter=adapter)


def _load(name_or_path, *, kind, device, dtype, mask_token_id, logit_shift, trust_remote_code, tp, force_mask_id,
          adapter) -> ModelBundle:
    if name_or_path is not None and not isinstance(name_or_path, (str, os.PathLike)):
        raise UnmaskError(f"model must be a shipped name or a directory path (got {type(name_or_path).__name__}); "
                          "pass e.g. \"stories260K\"")
    if isinstance(name_or_path, str) and not name_or_path.strip():
        raise UnmaskError("the model name is empty; pass a shipped name or a directory, or leave it out for the default")
    name, path = resolve(os.fspath(name_or_path) if name_or_path is not None else default_model())
    bundle = load_dir(path, name=name, kind=kind, device=device, dtype=dtype, mask_token_id=mask_token_id,
                      logit_shift=logit_shift, trust_remote_code=trust_remote_code, tp=tp,
                      force_mask_id=force_mask_id)
    if adapter is not None:
        from unmask.models.adapter_io import apply_adapter

        bundle = apply_adapter(bundle, adapter)
    return bundle


__all__ = ["KINDS", "ModelBundle", "default_model", "load", "shipped"]
