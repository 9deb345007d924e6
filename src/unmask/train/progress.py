"""The training progress display of :func:`unmask.train.loop.train`."""

from __future__ import annotations

import time


class TrainProgress:
    """A rich progress bar with the loss terms and tokens/s on a terminal; plain lines when the
    console is not a terminal: every ``every`` steps (the run's ``log_every``, the steps that
    log.jsonl gets a line), or every 30 s when ``every`` is 0; validation lines via ``note``."""

    def __init__(self, console, total: int, start: int, term_names: tuple[str, ...], every: int = 0):
        self.console, self.total, self.terms, self.every = console, total, term_names, every
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
        self._last_plain = time.monotonic()

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
        elif self.console is not None and (step == self.total or (step % self.every == 0 if self.every else
                                                                  time.monotonic() - self._last_plain > 30)):
            self._last_plain = time.monotonic()
            self.console.print(f"step {step}/{self.total} {info}", highlight=False)

    def note(self, step: int, val: dict) -> None:
        if self.console is not None:
            self.console.print(f"step {step}: validation " + " ".join(f"{k} {v:.4f}" for k, v in val.items()),
                               highlight=False)
