"""Progress on standard error for the command line: shown on a terminal, silent when stderr is
piped or redirected, or with ``--no-progress`` (issue 15 item 2); and :func:`stdout_console`, where
the commands print their tables."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def status(message: str, *, enabled: bool = True, console=None):
    """A transient spinner with ``message`` (e.g. "loading stories260K") while the block runs;
    a no-op when disabled or when the console is not a terminal."""
    console = console if console is not None else _stderr_console()
    if not enabled or not console.is_terminal:
        return nullcontext()
    return console.status(message)


@contextmanager
def bar(description: str, *, enabled: bool = True, console=None) -> Iterator[Callable[[int, int], None] | None]:
    """A transient progress bar; yields ``update(done, total)``, or None when nothing is shown."""
    console = console if console is not None else _stderr_console()
    if not enabled or not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(description, total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)


@contextmanager
def compiling(spinner, message: str) -> Iterator[None]:
    """While the block runs, a graph being compiled (:func:`unmask.decode.engine.static.compile_progress`)
    shows on ``spinner`` (a rich Status; None: nothing is shown) as "compiling step graph 2 (rows 1,
    queries 4, cache 256)…"; ``message`` comes back when it is done."""
    if spinner is None:
        yield
        return
    from unmask.decode.engine.static import compile_progress

    def show(event: dict) -> None:
        if event["done"]:
            spinner.update(message)
        else:
            spinner.update(f"compiling step graph {event['graph']} (rows {event['rows']}, queries "
                           f"{event['queries']}, cache {event['cache']}): the first call of each shape compiles, "
                           "later calls reuse it")

    with compile_progress(show):
        yield


@contextmanager
def stage_bar(enabled: bool = True) -> Iterator[Any]:
    """A rich progress bar on stderr; yields the ``progress(done, total, stage)`` callback."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as display:
        task = display.add_task("loading", total=None)

        def update(done: int, total: int, stage: str) -> None:
            display.update(task, completed=done, total=total, description=stage)

        yield update


def stdout_console():
    """A rich console; when stdout is not a terminal (a pipe, a file, a test) tables keep
    their natural width instead of being squeezed into 80 columns."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)
