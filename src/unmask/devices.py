"""Device and dtype names (``cpu``, ``cuda``, ``bfloat16``...) as torch objects, each refused in one line.

Below both the model loader (:mod:`unmask.models.bundle`) and the process-group setup (:mod:`unmask.dist`),
which each resolve a ``--device``.
"""

from __future__ import annotations

import torch

from unmask.errors import UnmaskError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` (a torch.dtype, or float32/fp32, bfloat16/bf16, float16/fp16) as a torch.dtype. Raises UnmaskError."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str) or dtype not in _DTYPES:  # a list is not even hashable
        raise UnmaskError(f"unknown dtype {dtype!r}; use float32 or bfloat16")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None, *, available: bool = True) -> torch.device:
    """``device`` as a torch.device: cpu or cuda (``available``: and CUDA present). Raises UnmaskError."""
    if device is None:
        device = "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # torch's message lists two dozen backends; ours names two
        raise UnmaskError(f"unknown device {device!r}; use cpu or cuda") from None
    if available and device.type == "cuda" and not torch.cuda.is_available():
        raise UnmaskError("CUDA is not available on this machine; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UnmaskError(f"unsupported device {device}; use cpu or cuda")
    return device
