"""unmask: commit many tokens per forward pass.

    >>> import unmask
    >>> out = unmask.generate("Once upon a time", model="stories260K", decoder="ar", max_new_tokens=32)
    >>> out.texts[0], out.stats.nfe, out.stats.tpf

The public names load lazily (PEP 562): ``import unmask`` alone does not import torch, so the
command line can answer a Ctrl-C during its imports (see :mod:`unmask.entry`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {"Generation": "unmask.api", "generate": "unmask.api", "DecodeStats": "unmask.decode",
            "UnmaskError": "unmask.errors", "Grammar": "unmask.grammar", "ModelBundle": "unmask.models", "load": "unmask.models",
            "shipped": "unmask.models", "Sampling": "unmask.sampling", "set_threads": "unmask.threads"}

__all__ = ["DecodeStats", "Generation", "Grammar", "ModelBundle", "Sampling", "UnmaskError", "generate", "load", "set_threads",
           "shipped", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from unmask.api import Generation, generate
    from unmask.decode import DecodeStats
    from unmask.errors import UnmaskError
    from unmask.grammar import Grammar
    from unmask.models import ModelBundle, load, shipped
    from unmask.sampling import Sampling
    from unmask.threads import set_threads


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'unmask' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
