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
_finished: int | None = None  # the exit status once the command has ended; a later signal keeps it


def _on_sigint(signum, frame) -> None:
    """Python's default SIGINT handler, remembering that it fired: an extension module that runs
    Python code during its import may swallow the KeyboardInterrupt, and the command must still
    stop rather than run on. Once the command has ended (its status decided, its output
    published or not), a signal ends the process at once with that status: no KeyboardInterrupt
    can then surface where no handler is left (interpreter shutdown kills itself with SIGINT,
    status -2, and prints no ``interrupted``)."""
    global _sigint_seen
    _sigint_seen = True
    if _finished is not None:
        _flush()
        os._exit(_finished)
    raise KeyboardInterrupt


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (``kill``, a job scheduler, torchrun) ends a command like Ctrl-C does: the
    ``finally`` blocks remove staging directories and locks, and the status is 143."""
    global _exit_code
    if _finished is None:
        _exit_code = 143
    _on_sigint(signum, frame)


def main(argv: list[str] | None = None) -> None:
    """Run the ``unmask`` command line; exit 130 with one line on Ctrl-C at any moment (143 on
    SIGTERM), leaving no partial output. A Ctrl-C that lands after the command published its
    output complete ends with exit 0 and a warning instead (:mod:`unmask.fileio`)."""
    global _finished
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        try:
            from unmask.cli import main as cli_main

            if _sigint_seen:  # the interrupt was swallowed during the imports
                raise KeyboardInterrupt
            cli_main(argv)
            if _sigint_seen:
                raise KeyboardInterrupt
            code = 0
        except SystemExit as e:  # a KeyboardInterrupt in here reaches the handler below
            code = e.code
    except KeyboardInterrupt:
        _finished = _exit_code  # first: a second signal now exits at once
        _interrupted()
    _finished = code if isinstance(code, int) else (0 if code is None else 1)
    if code == 130:  # the command line printed "interrupted"
        _exit_interrupted()
    if code not in (0, None):
        raise SystemExit(code)


def _interrupted() -> None:
    """The one ``interrupted`` line and exit 130 (143 on SIGTERM), or a warning and exit 0 when the
    command already published its output (:func:`unmask.fileio.published_outputs`)."""
    global _finished
    fileio = sys.modules.get("unmask.fileio")
    done = fileio.published_outputs() if fileio is not None else []
    try:
        if done:
            _finished = 0
            print(f"warning: interrupted after {', '.join(map(str, done))} was written complete; it is kept",
                  file=sys.stderr)
        else:
            print("interrupted", file=sys.stderr)
    finally:
        if done:
            _flush()
            os._exit(0)
        _exit_interrupted()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _exit_interrupted() -> None:
    """End with status 130 now. A SIGINT that lands while an extension module runs Python code
    through ``PyRun_String`` (torch's imports do) leaves CPython's "unhandled KeyboardInterrupt"
    flag set even though the exception was caught, and the interpreter would then kill itself
    with SIGINT at exit (status -2, not 130). Every file and lock was closed by the ``finally``
    blocks the exception passed through, so only the standard streams need flushing."""
    _flush()
    os._exit(_exit_code)


if __name__ == "__main__":
    main()
