"""``unmask serve --warmup``: run one request of the server's default decoder through the scheduler
and wait until every step shape it ran is compiled, before ``/health`` reports ok."""

from __future__ import annotations

import math
import sys
import threading
import time

from unmask.decode.engine.static import compile_progress
from unmask.serve.jobs import Job

WARMUP_TOKENS = 16  # enough decode steps to meet the step shapes of a one-row request


def warm_up(scheduler, probe, *, max_new_tokens: int = WARMUP_TOKENS, poll_s: float = 0.05,
            log=None) -> float:
    """Decode ``max_new_tokens`` tokens of ``probe`` (a parsed request: the server's default decoder and
    knobs) as one request of ``scheduler``, then wait until the scheduler has compiled every step shape
    it ran eagerly (``--compile``: ``pending_compiles`` is 0 and nothing compiles; without ``--compile``
    there is nothing to wait for). Blocks; returns the seconds it took, or ends early when the
    scheduler stops. ``log(line)`` (default: stderr) gets one line per graph compiled and one at the end.
    The shapes of more rows or longer prompts still compile when the server is first idle after them."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    ended = threading.Event()
    job = Job(prompt_ids=probe.prompt_ids, decoder=probe.decoder, options=probe.options, sampling=probe.sampling,
              max_new_tokens=max_new_tokens, stop=(), deadline=math.inf,
              post=lambda kind, payload: ended.set() if job.closed else None)  # set after the final event

    def compiled(event: dict) -> None:
        shape = f"rows {event['rows']}, queries {event['queries']}, cache {event['cache']}"
        log(f"unmask serve: warm-up: compiled step graph {event['graph']} ({shape}) in {event['seconds']:.1f} s"
            if event["done"] else f"unmask serve: warm-up: compiling step graph {event['graph']} ({shape})…")

    with compile_progress(compiled):
        scheduler.submit(job)
        while not ended.wait(poll_s):
            if not scheduler.thread_alive or scheduler.draining:
                return time.monotonic() - t0
        while (scheduler.pending_compiles or scheduler.compiling) and scheduler.thread_alive and not scheduler.draining:
            time.sleep(poll_s)
    seconds = time.monotonic() - t0
    log(f"unmask serve: warm-up done in {seconds:.1f} s; /health reports ok")
    return seconds
