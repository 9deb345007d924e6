"""The training progress display of :func:`unmask.train.loop.train`."""

from __future__ import annotations

import time


class TrainProgress:
    """A rich progress bar with the loss terms and tokens/s on a terminal; when the console is not
    a terminal (a pipe, a log file), one plain unwrapped line at the first step, then at most one
    every ``interval`` seconds (README: every 30 s), and at the last step; validation lines via
    ``note``. ``log.jsonl`` keeps its own cadence (``log_every`` steps)."""

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
