"""User-facing errors, and the type predicates the config validators share.

Every problem a user can cause (bad option, missing file, wrong model kind) raises
:class:`UnmaskError` with a one-line message that names the problem and the fix. The CLI
prints the message and exits with code 2, never a traceback.
"""

from __future__ import annotations

import math
import sys
import warnings


class UnmaskError(ValueError):
    """A one-line, user-facing error: what is wrong and how to fix it."""


def is_int(value) -> bool:
    """An int that is not a bool: True == 1 in Python, but a flag is no size, count or step."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value, *, finite: bool = True) -> bool:
    """A real number: int or float, not a bool, never nan; ``finite=False`` lets ±inf through, for
    the bounds where ∞ means "commit everything" (γ, η, the factor f: SBD §5.1, diffusion.md §7)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return math.isfinite(value) if finite else not math.isnan(value)



def check_int(value, low: int, what: str, hint: str) -> None:
    """Raise the one-line UnmaskError unless ``value`` is an integer >= ``low`` (``hint``: the fix)."""
    if not is_int(value) or value < low:
        raise UnmaskError(f"{what} must be an integer >= {low} (got {value!r}); {hint}")


def check_choice(what: str, value, choices) -> None:
    """Raise the one-line UnmaskError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise UnmaskError(f"unknown {what} {value!r}; choose one of: {', '.join(choices)}")


def warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` that prints ``warning: <message>`` on one line, not Python's two-line
    source echo (``loop.py:459: UserWarning: ...`` and the ``warnings.warn(...)`` line)."""
    text = " ".join(str(message).split())
    print(f"warning: {text}", file=sys.stderr if file is None else file)


def one_line_warnings() -> None:
    """Print every later warning with :func:`warning_line` (the command line and the recipes)."""
    warnings.showwarning = warning_line
