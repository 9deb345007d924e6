"""The training progress display of :func:`unmask.train.loop.train`, and :func:`say`, the one-line
progress messages of the router trainers."""

from __future__ import annotations

import time
from collections.abc import Callable

Progress = Callable[[str], None] | None  # where the router trainers report progress (None: nowhere)


def say(progress: Progress, message: str) -> None:
    """``progress(message)``, unless ``progress`` is None."""
    if progress is not None:
        progress(message)


# What each logged column is (a term's name is the key its objective reports; nats per token).
COLUMNS = {
    "loss": "the loss minimised (nats/token)",
    "ntp": "next-token cross-entropy (nats)",
    "mat": "masked-token cross-entropy (nats)",
    "draft": "masked-token cross-entropy of the draft rows (nats)",
    "kl": "KL(NTP || block mode), the self-distillation term (nats)",
    "acc": "masked-token accuracy",
    "nll": "masked-diffusion cross-entropy per masked token (nats)",
    "masked": "share of the tokens masked",
}


def column_help(name: str) -> str:
    """What the logged column ``name`` is (``d3``: the masked-token cross-entropy 3 tokens into a block)."""
    if name in COLUMNS:
        return COLUMNS[name]
    if name[:1] == "d" and name[1:].isdigit():
        return f"masked-token cross-entropy at block offset {name[1:]} (nats)"
    return name


def header(term_names: tuple[str, ...]) -> str:
    """The line naming each column of the progress lines, printed before the first one."""
    names = ("loss", *term_names)
    return "columns: step done/total · " + " · ".join(f"{n} = {column_help(n)}" for n in names) + \
        " · tok/s = training tokens per second"


class TrainProgress:
    """A rich progress bar with the loss terms and tokens/s on a terminal; when the console is not
    a terminal (a pipe, a log file), one plain unwrapped line at the first step, then at most one
    every ``interval`` seconds (README: every 30 s), and at the last step; validation lines via
    ``note``; first, a line naming each column (:func:`header`). ``log.jsonl`` keeps its own cadence
    (``log_every`` steps)."""

    INTERVAL = 30.0  # seconds between plain lines

    def __init__(self, console, total: int, start: int, term_names: tuple[str, ...], interval: float | None = None):
        self.console, self.total, self.terms = console, total, term_names
        self.interval = self.INTERVAL if interval is None else interval
        self.live = console is not None and console.is_terminal
        self.bar = None
        if self.live:
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                console=console)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
        self._last_plain: float | None = None  # no plain line yet

    def __enter__(self):
        if self.console is not None:
            self.console.print(header(self.terms), highlight=False, markup=False, soft_wrap=True)
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False

    def update(self, step: int, sums: dict, tok_s: float | None) -> None:
        info = " ".join(f"{k} {v:.3f}" for k, v in sums.items())
        if tok_s:
            info += f" · {tok_s:,.0f} tok/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif self.console is not None:
            now = time.monotonic()
            if step == self.total or self._last_plain is None or now - self._last_plain >= self.interval:
                self._last_plain = now
                # soft_wrap: a console that is not a terminal is 80 columns wide and would wrap mid-line
                self.console.print(f"step {step}/{self.total} {info}", highlight=False, markup=False, soft_wrap=True)

    def note(self, step: int, val: dict) -> None:
        if self.console is not None:
            self.console.print(f"step {step}: validation " + " ".join(f"{k} {v:.4f}" for k, v in val.items()),
                               highlight=False, markup=False, soft_wrap=True)
