"""The ``unmask`` command line: thin typer wrappers over the Python API (STYLE.md habit 12).

Every user error ends in one line ``error: <problem>; <fix>`` on stderr and exit code 2.
"""

from __future__ import annotations

import inspect
import sys

import typer
import typer.main

from unmask.errors import UnmaskError, one_line_warnings

try:  # typer >= 0.20 vendors click
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - older typer on real click
    from click import exceptions as _click_errors

class _App(typer.Typer):
    """The ``unmask`` typer app, run through :func:`command`'s tree (``--threads`` on every command)."""

    def __call__(self, *args, **kwargs):
        return command(self)(*args, **kwargs)


app = _App(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
           help="unmask: commit many tokens per forward pass (SBD, MBD, Early-Bird, dLLM baselines).")
convert_app = typer.Typer(no_args_is_help=True, help="Convert checkpoints into Hugging Face directories.")
app.add_typer(convert_app, name="convert")


@app.callback()
def _root(threads: str = typer.Option("auto", "--threads", envvar="UNMASK_THREADS", metavar="N|auto",
                                      help="CPU threads for torch (1 to 4 per core; also after the command); "
                                           "auto: 1 for models below 100M parameters (faster on small models and "
                                           "shared machines), above torch's default capped at the idle cores")):
    from unmask.threads import set_threads

    set_threads(threads)
    one_line_warnings()


# Subcommand modules register themselves on `app` when imported.
from unmask.cli import generate as _generate  # noqa: E402,F401
from unmask.cli import evaluate as _evaluate  # noqa: E402,F401
from unmask.cli import models as _models  # noqa: E402,F401
from unmask.cli import serve as _serve  # noqa: E402,F401
from unmask.cli import train as _train  # noqa: E402,F401
from unmask.cli import calibrate as _calibrate  # noqa: E402,F401
from unmask.cli import chat as _chat  # noqa: E402,F401


THREADS_HELP = "CPU threads for torch, as 'unmask --threads N' (1 to 4 per core, or auto)"


def _threads_given(ctx, param, value):
    """``COMMAND --threads N``: the same setting as ``unmask --threads N``, which the root callback
    applied before this command's options are parsed, so this one wins."""
    if value is not None:
        from unmask.threads import set_threads

        set_threads(value)
    return value


def _threads_param():
    """A ``--threads`` option as typer builds it (its click classes are typer's own), applied by
    its callback and not passed to the command function."""
    probe = typer.Typer()

    @probe.command()
    def _probe(threads: str = typer.Option(None, "--threads", metavar="N|auto", help=THREADS_HELP,
                                           callback=_threads_given)) -> None:
        pass

    param = next(p for p in typer.main.get_command(probe).params if p.name == "threads")
    param.expose_value = False
    return param


def one_line_paragraphs(text: str | None) -> str | None:
    """A command's docstring with each paragraph on one line. typer joins the source's line breaks
    in the first paragraph only and prints the later ones as written, so their sentences broke where
    the source lines did ("printed by rank" / "0 in their original order"); rich then wraps them to
    the terminal. A paragraph that starts with click's ``\\b`` keeps its lines."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(line.strip() for line in p.splitlines())
                       for p in paragraphs)


def command(typer_app: typer.Typer | None = None):
    """The click command tree of ``typer_app`` (default ``app``), with ``--threads`` added to every
    command that does not declare its own (a typer option belongs to one command, and users put it
    after the command)."""
    root = typer.main.get_command(app if typer_app is None else typer_app)
    param = _threads_param()
    root.help = one_line_paragraphs(root.help)
    todo = list(root.commands.values())
    while todo:
        cmd = todo.pop()
        cmd.help = one_line_paragraphs(cmd.help)
        if hasattr(cmd, "commands"):  # a command group (train, data, convert)
            todo.extend(cmd.commands.values())
        elif not any("--threads" in getattr(p, "opts", ()) for p in cmd.params):
            cmd.params.append(param)
    return root


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
