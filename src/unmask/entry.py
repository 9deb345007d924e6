"""The ``unmask`` console script and ``python -m unmask``.

Kept free of heavy imports: the command line imports torch and transformers, which takes
seconds, and a Ctrl-C during those imports must end like one during a command, with
``interrupted`` on one line and exit status 130, not a traceback.
"""

from __future__ import annotations

import os
import signal
import sys

_sigint_seen = False
_exit_code = 130  # 128 + the signal that stopped the command: SIGINT 130, SIGTERM 143


def _on_sigint(signum, frame) -> None:
    """Python's default SIGINT handler, remembering that it fired: an extension module that runs
    Python code during its import may swallow the KeyboardInterrupt, and the command must still
    stop rather than run on."""
    global _sigint_seen
    _sigint_seen = True
    raise KeyboardInterrupt


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (``kill``, a job scheduler, torchrun) ends a command like Ctrl-C does: the
    ``finally`` blocks remove staging directories and locks, and the status is 143."""
    global _exit_code
    _exit_code = 143
    _on_sigint(signum, frame)


def main(argv: list[str] | None = None) -> None:
    """Run the ``unmask`` command line; exit 130 with one line on Ctrl-C at any moment (143 on
    SIGTERM), leaving no partial output."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        from unmask.cli import main as cli_main

        if _sigint_seen:  # the interrupt was swallowed during the imports
            raise KeyboardInterrupt
        cli_main(argv)
        if _sigint_seen:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        try:
            print("interrupted", file=sys.stderr)
        finally:
            _exit_interrupted()
    except SystemExit as e:
        if e.code == 130:
            _exit_interrupted()
        raise


def _exit_interrupted() -> None:
    """End with status 130 now. A SIGINT that lands while an extension module runs Python code
    through ``PyRun_String`` (torch's imports do) leaves CPython's "unhandled KeyboardInterrupt"
    flag set even though the exception was caught, and the interpreter would then kill itself
    with SIGINT at exit (status -2, not 130). Every file and lock was closed by the ``finally``
    blocks the exception passed through, so only the standard streams need flushing."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_exit_code)


if __name__ == "__main__":
    main()
