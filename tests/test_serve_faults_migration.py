"""Fault pass over the migration of a sized lossless sbd batch into the AR running batch
(engine ``_migrate``, ``ARBatch.join`` with ``resume``): white-box through the Scheduler, with
callbacks on the scheduler thread to place each fault at an exact step (no timing)."""

from __future__ import annotations

import threading
import time

import pytest

import unmask
from unmask.serve.draft_sizing import DraftSizes
from unmask.serve.engine import Job, QueueFull, Scheduler
from unmask.serve.protocol import parse

MODEL = "stories260K-sbd"
# Sized rows move into / route to the AR batch only past the table's crossover (K = 1); these
# tests place the crossover at 2 rows, so one AR row beside one sbd row is past it.
CROSS_AT_2 = DraftSizes.parse("1:4,2:1")


@pytest.fixture(scope="module")
def bundle():
    return unmask.load(MODEL)


class Rec:
    """A job's ``post``: records events; ``hook(kind, payload)`` runs on the scheduler thread."""

    def __init__(self, hook=None):
        self.events, self.done, self.hook = [], threading.Event(), hook

    def __call__(self, kind, payload):
        self.events.append((kind, payload))
        if self.hook is not None:
            self.hook(kind, payload)
        if kind != "step":
            self.done.set()

    @property
    def result(self):
        assert self.done.wait(60), "no answer"
        kind, payload = self.events[-1]
        assert kind == "done", self.events[-1]
        return payload

    def canvases(self):
        return [p["canvas"] for k, p in self.events if k == "step"]


def job(bundle, body, hook=None):
    req = parse(dict(body), bundle, MODEL, chat=False, default_timeout=60.0, defaults={})
    rec = Rec(hook)
    j = Job(prompt_ids=req.prompt_ids, decoder=req.decoder, options=req.options, sampling=req.sampling,
            max_new_tokens=req.max_tokens, stop=req.stop, deadline=time.monotonic() + req.timeout, post=rec)
    return j, rec


def ar_tokens(bundle, prompt, n):
    return unmask.generate(prompt, bundle, "ar", max_new_tokens=n).tokens[0]


def committed_prefix(canvas):
    out = []
    for t in canvas:
        if t is None:
            break
        out.append(t)
    return out


def test_migrated_rows_never_wait_for_an_ar_slot(bundle):
    """Found by the fault pass: a sized sbd batch of 2 rows moved into an AR batch with one free
    slot; the second row sat in the queue, making no progress, until the AR row ended (its answer
    delayed by the whole AR request, its deadline running) and, counted as waiting, turned new
    requests away with 429 (QueueFull). The batch moves only when every open row gets a slot."""
    # the batch forms at 2 rows (K = 4) and moves once the AR row makes the load 3 (K = 1)
    sched = Scheduler(bundle, max_batch_size=2, max_queue=2, draft_sizes=DraftSizes.parse("1:4,3:1")).start()
    try:
        sched.pause()
        extra, rx = job(bundle, {"prompt": "One day", "max_tokens": 3, "decoder": "ar"})
        seen = {}

        def on_ar(kind, p):  # from the AR row's 3rd token on (after the batch could have moved)
            if kind == "step" and "submit" not in seen and len(p["canvas"]) >= 3:
                seen["waiting_resumed"] = [list(j.resume) for j in sched._waiting if j.resume]
                try:
                    sched.submit(extra)
                    seen["submit"] = "ok"
                except QueueFull:
                    seen["submit"] = "429"

        a, ra = job(bundle, {"prompt": "Zoo", "max_tokens": 30, "decoder": "ar"}, on_ar)
        fired = []

        def on_s1(kind, p):  # the AR row starts right after the sbd batch's first forward
            if kind == "step" and not fired:
                fired.append(1)
                sched.submit(a)

        s1, r1 = job(bundle, {"prompt": "Once upon a time", "max_tokens": 60, "decoder": "sbd"}, on_s1)
        s2, r2 = job(bundle, {"prompt": "The sun", "max_tokens": 60, "decoder": "sbd"})
        sched.submit(s1)
        sched.submit(s2)
        sched.max_queue = 1
        sched.resume()
        assert r1.result["tokens"] == ar_tokens(bundle, "Once upon a time", 60)
        assert r2.result["tokens"] == ar_tokens(bundle, "The sun", 60)
        assert ra.result["tokens"] == ar_tokens(bundle, "Zoo", 30)
        assert seen["waiting_resumed"] == [] and seen["submit"] == "ok"
        assert rx.result["tokens"] == ar_tokens(bundle, "One day", 3)
        assert sched.active == 0 and sched.queue_depth == 0
    finally:
        sched.close()


def test_a_migrated_row_held_in_the_queue_goes_on_in_the_ar_batch_not_from_scratch(bundle):
    """Found by the fault pass: a row moved out of its sbd batch while the scheduler was paused
    (or otherwise found no AR rows when it was next taken) formed a new sbd batch and decoded from
    the prompt again: its resume tokens were ignored, the canvas stream went back to step 0 and
    committed positions became masked again, and the first batch's forwards dropped from its NFE."""
    # a table whose crossover is at 2 rows: one AR row beside the sbd one is past it
    sched = Scheduler(bundle, max_batch_size=8, max_queue=8, draft_sizes=CROSS_AT_2).start()
    try:
        paused = []

        def on_ar(kind, p):  # pause as the AR row starts: the sbd batch moves, then waits in the queue
            if kind == "step" and not paused:
                paused.append(1)
                sched.pause()

        a, ra = job(bundle, {"prompt": "Zoo", "max_tokens": 20, "decoder": "ar"}, on_ar)
        fired = []

        def on_s(kind, p):
            if kind == "step" and p["step"] == 3 and not fired:
                fired.append(1)
                sched.submit(a)

        s, rs = job(bundle, {"prompt": "Once upon a time", "max_tokens": 60, "decoder": "sbd"}, on_s)
        sched.submit(s)
        assert ra.result["tokens"] == ar_tokens(bundle, "Zoo", 20)
        assert sched.migrated_rows == 1 and sched.queue_depth == 1
        sched.resume()
        result = rs.result
        ref = ar_tokens(bundle, "Once upon a time", 60)
        assert result["tokens"] == ref
        prev = []
        for canvas in rs.canvases():  # committed positions never change, never become masked again
            now = committed_prefix(canvas)
            assert now[: len(prev)] == prev and len(now) >= len(prev)
            prev = now
        steps = [p["step"] for k, p in rs.events if k == "step"]
        assert steps == sorted(set(steps))
        assert 1 <= result["nfe"] <= len(result["tokens"]) + 1
        assert sum(k > 1 for _, k in sched.draft_log) == 1  # one sbd batch only
        assert sched.active == 0 and sched.queue_depth == 0
    finally:
        sched.close()


def test_a_sized_request_arriving_with_an_ar_request_joins_the_ar_batch_at_once(bundle):
    """Found by the fault pass: an AR request and a sized sbd request taken together on an idle
    server formed a sized sbd batch (K > 1) beside the AR rows joining in the same pass, which then
    moved into the AR batch at its first forward: that forward (and, with --compile, compiling its
    shape) was spent for nothing. Waiting AR requests count as running AR rows when routing."""
    # a table whose crossover is at 2 rows: one AR row beside the sbd one is past it
    sched = Scheduler(bundle, max_batch_size=8, max_queue=8, draft_sizes=CROSS_AT_2).start()
    try:
        sched.pause()
        a, ra = job(bundle, {"prompt": "Zoo", "max_tokens": 10, "decoder": "ar"})
        s, rs = job(bundle, {"prompt": "Once upon a time", "max_tokens": 40, "decoder": "sbd"})
        sched.submit(a)
        sched.submit(s)
        sched.resume()
        assert rs.result["tokens"] == ar_tokens(bundle, "Once upon a time", 40)
        assert ra.result["tokens"] == ar_tokens(bundle, "Zoo", 10)
        assert sched.draft_log == [(2, 1)] and sched.migrated_rows == 0
        assert sched.active == 0 and sched.queue_depth == 0
    finally:
        sched.close()


def test_rows_moved_out_of_an_sbd_batch_do_not_count_against_the_queue_bound(bundle):
    """Found by the fault pass: rows moved out of an sbd batch pass through the queue on their way
    to the AR batch (there until its next pass, or while the scheduler is paused); they counted as
    requests waiting to start, so a new request got 429 (QueueFull) because of requests already
    running. ``max_queue`` bounds requests waiting to start."""
    sched = Scheduler(bundle, max_batch_size=8, max_queue=1, draft_sizes=CROSS_AT_2).start()
    try:
        paused = []

        def on_ar(kind, p):  # pause as the AR row starts: the sbd batch moves, then waits in the queue
            if kind == "step" and not paused:
                paused.append(1)
                sched.pause()

        a, ra = job(bundle, {"prompt": "Zoo", "max_tokens": 10, "decoder": "ar"}, on_ar)
        fired = []

        def on_s(kind, p):
            if kind == "step" and p["step"] == 2 and not fired:
                fired.append(1)
                sched.submit(a)

        s, rs = job(bundle, {"prompt": "Once upon a time", "max_tokens": 60, "decoder": "sbd"}, on_s)
        sched.submit(s)
        assert ra.result["tokens"] == ar_tokens(bundle, "Zoo", 10)
        assert sched.migrated_rows == 1 and [j.resume for j in sched._waiting] == [s.resume] and s.resume
        x, rx = job(bundle, {"prompt": "One day", "max_tokens": 5, "decoder": "ar"})
        sched.submit(x)  # one request waiting to start: within max_queue = 1
        sched.resume()
        assert rs.result["tokens"] == ar_tokens(bundle, "Once upon a time", 60)
        assert rx.result["tokens"] == ar_tokens(bundle, "One day", 5)
        assert sched.active == 0 and sched.queue_depth == 0
    finally:
        sched.close()
