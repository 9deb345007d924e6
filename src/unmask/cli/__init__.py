"""The ``unmask`` command line: thin typer wrappers over the Python API (STYLE.md habit 12).

Every user error ends in one line ``error: <problem>; <fix>`` on stderr and exit code 2.
"""

from __future__ import annotations

import sys

import typer

from unmask.errors import UnmaskError

try:  # typer >= 0.20 vendors click
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - older typer on real click
    from click import exceptions as _click_errors

# the app and its command tree; `app` is looked up here when the command runs (tests replace it)
from unmask.cli.root import THREADS_HELP, app, command, convert_app, one_line_paragraphs  # noqa: E402,F401

# Subcommand modules register themselves on `app` when imported.
from unmask.cli import generate as _generate  # noqa: E402,F401
from unmask.cli import evaluate as _evaluate  # noqa: E402,F401
from unmask.cli import bench as _bench  # noqa: E402,F401
from unmask.cli import models as _models  # noqa: E402,F401
from unmask.cli import serve as _serve  # noqa: E402,F401
from unmask.cli import train as _train  # noqa: E402,F401
from unmask.cli import train_routers as _train_routers  # noqa: E402,F401
from unmask.cli import data as _data  # noqa: E402,F401
from unmask.cli import calibrate as _calibrate  # noqa: E402,F401
from unmask.cli import chat as _chat  # noqa: E402,F401


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def interrupted() -> None:
    """Ctrl-C: one line, exit status 130 (128 + SIGINT), as a shell pipeline expects; or, when the
    command had already published its output complete (:func:`unmask.fileio.published_outputs`),
    a warning and exit 0, since the output stands (issue 28 item 20)."""
    done = _published()
    if done:
        print(f"warning: interrupted after {done} was written complete; it is kept", file=sys.stderr)
        raise SystemExit(0)
    print("interrupted", file=sys.stderr)
    raise SystemExit(130)


def _published() -> str:
    """The outputs this command published, as text ("" for none)."""
    fileio = sys.modules.get("unmask.fileio")  # not imported: nothing was published
    return ", ".join(str(p) for p in fileio.published_outputs()) if fileio is not None else ""


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (see also :mod:`unmask.entry`, which guards the imports too)."""
    try:
        _run(argv)
    finally:
        if "unmask.dist" in sys.modules:  # under torchrun: leave the process group cleanly
            sys.modules["unmask.dist"].teardown()


def _run(argv: list[str] | None) -> None:
    from unmask.fileio import forget_published

    forget_published()  # a new command (tests run several in one process)
    try:
        # standalone_mode=False: typer *returns* an exit code instead of exiting, 130 for a
        # KeyboardInterrupt it caught, so it must be turned into the process's exit status here.
        rc = app(args=argv, prog_name="unmask", standalone_mode=False)
    except UnmaskError as e:
        _fail(str(e).splitlines()[0])
    except typer.Abort:
        _fail("aborted")
    except _click_errors.NoArgsIsHelpError as e:
        e.show()
        raise SystemExit(2) from None
    except _click_errors.ClickException as e:
        msg = e.format_message().replace("\n", " ")
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        _fail(f"{msg}{hint}")
    except KeyboardInterrupt:
        interrupted()
    except UnicodeDecodeError as e:
        _fail(f"input is not valid UTF-8 ({e.reason} at byte {e.start}); convert the file to UTF-8")
    except OSError as e:  # last resort for a file system error no command anticipated
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        _fail(f"{e.strerror or e}{where}; check the path, its permissions and the free disk space")
    if rc == 130:
        interrupted()
    if isinstance(rc, int) and not isinstance(rc, bool) and rc != 0:
        raise SystemExit(rc)
