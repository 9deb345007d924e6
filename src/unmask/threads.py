"""How many CPU threads torch uses (issue 15 item 1).

torch starts with one intra-op thread per core. For the small models unmask ships, and on a
machine that other jobs share, that is the slowest choice: measured on a 2-core machine under
load, a 260K-parameter forward took 60× longer with 2 threads than with 1, and models up to ~60M
parameters were still 3–4× slower; only at ~130M parameters did 2 threads win. So the default
("auto") is one thread below :data:`SMALL_MODEL_PARAMS` parameters and torch's own count above.

The command line applies ``--threads`` / ``UNMASK_THREADS`` (a count or "auto", default auto). The
Python API leaves torch alone unless ``UNMASK_THREADS`` is set or :func:`set_threads` is called.
"""

from __future__ import annotations

import os

import torch

from unmask.errors import UnmaskError

SMALL_MODEL_PARAMS = 100_000_000  # below this, one thread (see the module docstring)
ENV = "UNMASK_THREADS"
_DEFAULT = torch.get_num_threads()  # torch's own choice, before anyone changed it
_policy: int | str | None = None  # None: leave torch alone; "auto": size-based at model load; n: fixed


def parse(value: int | str | None) -> int | str | None:
    """A thread setting: None, "auto" or an integer >= 1 (also as text). Raises UnmaskError otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None if value is None else "auto"
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or (isinstance(value, float) and value != n):
        raise UnmaskError(f"threads must be an integer >= 1 or 'auto' (got {value!r}); use 1 for small models")
    return n


def set_threads(threads: int | str = "auto") -> None:
    """Choose torch's intra-op thread count: an integer now, or "auto" (one thread for models below
    :data:`SMALL_MODEL_PARAMS` parameters, torch's default above), applied at each model load."""
    global _policy
    _policy = parse(threads)
    if isinstance(_policy, int):
        torch.set_num_threads(_policy)


def for_model(n_params: int) -> int:
    """The "auto" thread count for a model of ``n_params`` parameters."""
    return 1 if n_params < SMALL_MODEL_PARAMS else _DEFAULT


def after_load(model: torch.nn.Module) -> None:
    """Apply the "auto" policy (or ``UNMASK_THREADS`` when nothing was chosen) once a model is loaded."""
    policy = _policy if _policy is not None else parse(os.environ.get(ENV) or None)
    if policy == "auto":
        torch.set_num_threads(for_model(sum(p.numel() for p in model.parameters())))
    elif isinstance(policy, int):
        torch.set_num_threads(policy)
