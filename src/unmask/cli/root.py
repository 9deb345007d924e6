"""The root ``unmask`` typer app that every subcommand module registers on, and the click command tree
built from it: ``--threads`` on every command, each help paragraph on one line.

:mod:`unmask.cli` imports the subcommand modules (which import this one) and runs the app.
"""

from __future__ import annotations

import inspect

import typer
import typer.main

from unmask.errors import one_line_warnings


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
