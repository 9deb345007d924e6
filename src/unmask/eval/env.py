"""Environment fingerprint recorded with every evaluation and benchmark row.

Throughput numbers mean nothing without the machine and the software that produced them, so
each result row carries :func:`fingerprint`: unmask version and git commit (when the package
runs from a checkout), Python, torch, transformers, CPU model, GPU model, device, dtype,
batch size and torch's intra-op thread count.
"""

from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def git_revision() -> dict[str, object] | None:
    """``{"sha": ..., "dirty": bool}`` of the checkout holding this package, or ``None`` when
    it is not a git checkout (an installed wheel) or git is unavailable."""
    root = Path(__file__).resolve().parents[3]  # src/unmask/eval/env.py -> repository root
    if not (root / ".git").exists():
        return None
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"sha": sha, "dirty": bool(status.strip())}


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_model(device: str | None) -> str | None:
    """``torch.cuda.get_device_name`` for a CUDA device, else ``None``."""
    import torch

    if device is None or not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.device(device))


def fingerprint(*, device: str | None = "cpu", dtype: str | None = None,
                batch_size: int | None = None) -> dict[str, object]:
    """JSON-ready description of the software and hardware a result was measured on.

    ``device``/``dtype`` are those of the model under test (e.g. ``"cpu"``, ``"float32"``);
    ``batch_size`` the rows decoded together.
    """
    import torch
    import transformers

    import unmask

    git = git_revision()
    return {
        "unmask": unmask.__version__,
        "git_sha": git["sha"] if git else None,
        "git_dirty": git["dirty"] if git else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu": gpu_model(device),
        "device": str(device) if device is not None else None,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
        "batch_size": batch_size,
    }
