"""An SBD adapter's tensors on disk: ``adapter.safetensors`` (spec/sbd_exact.md §3), written atomically.

Apart from :mod:`unmask.models.adapter_io` (the adapter directory, its ``adapter.json`` and the base
checks) so that :class:`unmask.models.sbd_adapter.SBDAdapter` can save and load its own weights; the
functions take any module's ``state_dict``, so this module imports nothing of the adapter's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.fileio import check_output_file

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_FORMAT = "unmask-sbd-adapter"


def save_adapter_weights(adapter: torch.nn.Module, directory: str | os.PathLike) -> Path:
    """Write ``directory/adapter.safetensors`` atomically (float32 CPU copies of the tensors).

    A failed write (a full disk: safetensors raises SafetensorError there, not OSError) removes
    the temporary file and propagates as raised, so that the caller names what it was writing
    (:func:`unmask.output_checks.write_errors`; :func:`save_adapter` does)."""
    from safetensors.torch import save_file

    path = check_output_file(Path(directory) / ADAPTER_WEIGHTS, "adapter weights")
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in adapter.state_dict().items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"format": ADAPTER_FORMAT})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_adapter_weights(adapter: torch.nn.Module, directory: str | os.PathLike) -> None:
    """Load ``directory/adapter.safetensors`` into ``adapter`` (cast to its dtype and device)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise UnmaskError(f"{directory} has no {ADAPTER_WEIGHTS}; pass a directory written by "
                          "'unmask train sbd-adapter'")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise UnmaskError(f"cannot read {path} ({e}); restore the adapter or retrain it") from None
    for key, t in state.items():  # an integer tensor would be cast to float silently (values truncated)
        if not t.is_floating_point():
            raise UnmaskError(f"{path}: tensor {key} is {str(t.dtype).removeprefix('torch.')}, not a floating-point "
                              "dtype; an adapter holds float weights, restore the file or retrain the adapter")
    adapter.load_state_dict(state, where=str(path))
