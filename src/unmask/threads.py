"""How many CPU threads torch uses (issue 15 item 1, issue 28 items 1, 2 and 25).

torch starts with one intra-op thread per core. For the small models unmask ships, and on a
machine that other jobs share, that is the slowest choice: measured on a 2-core machine under
load, a 260K-parameter forward took 60× longer with 2 threads than with 1, and models up to ~60M
parameters were still 3–4× slower. Above :data:`SMALL_MODEL_PARAMS` more threads can win, but
only on cores that are idle: SmolLM2-135M on a busy 2-core machine ran ~5× slower with torch's 2
threads than with 1. So the default ("auto") is one thread below :data:`SMALL_MODEL_PARAMS`
parameters and, above, torch's own count capped at the idle cores (:func:`idle_cores`: the
usable cores minus the 1-minute load average, at least 1).

Who decides, first match wins:

1. :func:`set_threads` (the command line's ``--threads``, default auto), applied at each model
   load and kept;
2. ``UNMASK_THREADS`` (a count or "auto"), applied at each model load and kept;
3. the user's own choice of torch threads: ``torch.set_num_threads`` (torch's count differs from
   its count when unmask was imported) or ``OMP_NUM_THREADS``, left alone;
4. otherwise unmask's public calls (``unmask.generate``, the decoders of
   :meth:`unmask.decode.Spec.decode`, ``evaluate``, ``sweep``, ``bench``) run with the auto count
   of their model for the duration of the call (:func:`call_scope`, :func:`use_for`) and restore
   torch's count when they return.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from unmask.errors import UnmaskError

SMALL_MODEL_PARAMS = 100_000_000  # below this, one thread (see the module docstring)
ENV = "UNMASK_THREADS"
_DEFAULT = torch.get_num_threads()  # torch's own choice, before anyone changed it
_policy: int | str | None = None  # None: not chosen; "auto": size-based at model load; n: fixed

_lock = threading.Lock()
_depth = 0  # open call scopes (nested calls: generate -> decode)
_free = False  # the outermost scope found no user choice: the calls inside may set the count
_before = _DEFAULT  # torch's count when the outermost scope opened, restored when it closes


def cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_threads() -> int:
    """The largest accepted thread count: 4 threads per usable core. More only oversubscribes
    the cores, and counts in the tens of thousands crash torch's thread pool (SIGSEGV)."""
    return 4 * cores()


def parse(value: int | str | None) -> int | str | None:
    """A thread setting: None, "auto" or an integer in 1..:func:`max_threads` (also as text).
    Raises UnmaskError otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None if value is None else "auto"
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):
        n = 0
    if isinstance(value, bool) or n < 1 or (isinstance(value, float) and value != n):
        raise UnmaskError(f"threads must be an integer >= 1 or 'auto' (got {value!r}); use 1 for small models")
    if n > max_threads():
        raise UnmaskError(f"threads must be at most {max_threads()} (4 per CPU core; this machine has {cores()}), "
                          f"got {value!r}; use 'auto' or a count up to {max_threads()}")
    return n


def set_threads(threads: int | str = "auto") -> None:
    """Choose torch's intra-op thread count: an integer now, or "auto" (one thread for models below
    :data:`SMALL_MODEL_PARAMS` parameters, torch's default capped at the idle cores above),
    applied at each model load. Either way unmask's calls stop choosing per call.
    Raises UnmaskError for anything but "auto" or an integer in 1..:func:`max_threads`."""
    global _policy
    _policy = parse(threads)
    if isinstance(_policy, int):
        torch.set_num_threads(_policy)


def idle_cores() -> int:
    """Cores not busy with other work: the usable cores minus the 1-minute load average,
    rounded, at least 1 (all cores where the load average is unavailable)."""
    n = cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return n
    return max(1, min(n, round(n - load)))


def for_model(n_params: int) -> int:
    """The "auto" thread count for a model of ``n_params`` parameters: 1 below
    :data:`SMALL_MODEL_PARAMS`, else torch's default count capped at :func:`idle_cores`."""
    return 1 if n_params < SMALL_MODEL_PARAMS else max(1, min(_DEFAULT, idle_cores()))


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def after_load(model: torch.nn.Module) -> None:
    """Apply the "auto" policy (or ``UNMASK_THREADS`` when nothing was chosen) once a model is loaded."""
    policy = _policy if _policy is not None else parse(os.environ.get(ENV) or None)
    if policy == "auto":
        torch.set_num_threads(for_model(_params(model)))
    elif isinstance(policy, int):
        torch.set_num_threads(policy)


def user_chose() -> bool:
    """Whether a thread count was chosen by anyone but unmask's per-call policy: :func:`set_threads`,
    ``UNMASK_THREADS``, ``OMP_NUM_THREADS`` or ``torch.set_num_threads`` since unmask's import."""
    return (_policy is not None or bool(os.environ.get(ENV)) or bool(os.environ.get("OMP_NUM_THREADS"))
            or torch.get_num_threads() != _DEFAULT)


@contextmanager
def call_scope() -> Iterator[None]:
    """The extent of one public call: inside it :func:`use_for` may set torch's thread count (when
    the user chose none, see the module docstring); torch's count from before the outermost scope
    is restored when it closes, also on an exception."""
    global _depth, _free, _before
    with _lock:
        if _depth == 0:
            _before, _free = torch.get_num_threads(), not user_chose()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _free:
                _free = False
                if torch.get_num_threads() != _before:
                    torch.set_num_threads(_before)


def use_for(model: torch.nn.Module | None) -> None:
    """Inside a :func:`call_scope` whose user chose no thread count: run with the "auto" count of
    ``model`` (a no-op elsewhere, and for None)."""
    if model is None or not (_depth and _free):
        return
    n = for_model(_params(model))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def scoped(fn):
    """Decorate a public function with :func:`call_scope`; when its first argument is a
    ModelBundle (the decoders' ``decode(bundle, prompts, ...)``), also :func:`use_for` its model."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with call_scope():
            model = getattr(args[0], "model", None) if args else None
            use_for(model if isinstance(model, torch.nn.Module) else None)
            return fn(*args, **kwargs)

    return wrapper
