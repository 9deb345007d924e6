"""Shared helpers of the continuous running-batch tests (issue 16; ``test_*_batch.py``): the fake
scheduler job, the single-prompt decode a row must equal, and the equality asserts (STYLE.md 14).

Imported like the conftest helpers (``from batch_helpers import job``); tests/ is on sys.path."""

from __future__ import annotations

from dataclasses import dataclass

from unmask.sampling import Sampling

GREEDY = Sampling()


@dataclass(eq=True)
class Job:
    """What a batch reads of a scheduler job. Compared by value like the ``SimpleNamespace`` it
    replaces; batches and tests key rows by ``id(job)``."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling = GREEDY
    stop: tuple[str, ...] = ()


def job(prompt, max_new_tokens, sampling=GREEDY, stop=()) -> Job:
    return Job(prompt_ids=list(prompt), max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop))


def single_decode(decode, bundle, j, options, stop_token_ids):
    """``decode`` on the job's prompt alone (a batch of one): (output, step events)."""
    events = []
    out = decode(bundle, [j.prompt_ids], max_new_tokens=j.max_new_tokens, sampling=j.sampling,
                 stop_token_ids=stop_token_ids, stop_strings=j.stop, on_step=events.append, **options)
    return out, events


def assert_row_equals_single(row, out, events, got) -> None:
    """A finished row's tokens, NFE and step events ``got`` equal the single-prompt decode's
    (``out``, ``events``)."""
    assert row.tokens == out.tokens[0]
    assert row.nfe == out.stats.nfe_per_row[0]
    assert got == events


def check_canvas_rows(run, bundle, jobs, options, decode, stop_token_ids=None) -> None:
    """Every job finished in ``run`` (a diffusion or early-bird batch run whose ``events`` map
    ``id(job)`` to its step events) exactly as ``decode`` on its prompt alone: tokens, NFE, finish,
    row_extra (with its ``n_committed``) and step events."""
    rows = {id(row.job): row for row in run.done}
    assert set(rows) == {id(j) for j in jobs}
    stops = bundle.stop_token_ids if stop_token_ids is None else stop_token_ids
    for j in jobs:
        row = rows[id(j)]
        out, events = single_decode(decode, bundle, j, options, stops)
        assert_row_equals_single(row, out, events, run.events[id(j)])
        assert row.nfe == out.stats.nfe
        assert row.finish == ("length" if len(row.tokens) >= j.max_new_tokens else "stop")
        want = dict(out.stats.extra["row_extra"][0], n_committed=out.stats.extra["n_committed"][0])
        assert row.extra == want


class RecordingRun:
    """A running batch plus everything it reported: finished rows (``done``), each job's step events
    (``events``: id(job) -> (events, job), the job kept alive so ids stay unique) and the step
    forwards run (``steps``). A subclass builds ``self.batch`` with ``on_step=self._on_step`` and
    defines ``check_cache()``, which runs after every join and step."""

    def __init__(self):
        self.events: dict[int, tuple[list[dict], object]] = {}
        self.done = []
        self.steps = 0

    def _on_step(self, row, event):
        self.events.setdefault(id(row.job), ([], row.job))[0].append(event)

    def check_cache(self):
        raise NotImplementedError

    def join(self, jobs):
        self.done += self.batch.join(jobs)
        self.check_cache()

    def step(self, n=1):
        for _ in range(n):
            self.steps += bool(len(self.batch))
            self.done += self.batch.step()
            self.check_cache()

    def drain(self):
        while len(self.batch):
            self.step()

    def staggered_with_a_drop(self, jobs) -> None:
        """Join ``jobs`` at four different steps, drop ``jobs[2]`` mid-decode, drain; every other job
        finishes."""
        self.join(jobs[:1])
        self.step(3)
        self.join(jobs[1:4])
        self.step(2)
        self.batch.drop([jobs[2].id])
        self.join(jobs[4:5])
        self.step()
        self.join(jobs[5:])
        self.drain()
        assert sorted(id(r.job) for r in self.done) == sorted(id(j) for j in jobs if j is not jobs[2])

    def churn_static(self, jobs, length: int) -> list[int]:
        """Cap the static cache at ``length`` columns, join ``jobs`` two at a time with three steps
        after each, drain, and return the cache length before every step (compactions show as drops)."""
        self.batch.length, pasts, step = length, [], self.batch.step

        def recorded():
            pasts.append(self.batch.kv.length)
            return step()

        self.batch.step = recorded
        for i in range(0, len(jobs), 2):
            self.join(jobs[i: i + 2])
            self.step(3)
        self.drain()
        assert len(self.done) == len(jobs) and max(pasts) <= length == self.batch.kv.capacity
        assert any(b < a for a, b in zip(pasts, pasts[1:]) if b)  # compacted while rows ran
        return pasts
