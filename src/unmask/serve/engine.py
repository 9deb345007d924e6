"""The scheduler: one thread owns the model and runs every request (DESIGN.md "One engine").

Each pass of its loop admits waiting requests into the running decoders with free slots, runs ONE
``step()`` of each and answers the rows that finished. A request joins at a step boundary and leaves
(its slot free at once) the step it finishes, is cancelled or times out; each row's tokens, NFE and
events equal its decoder's ``decode`` on its prompt alone, whatever else runs (README "Serving").

- Each request joins the running batch of its decoder's config (:mod:`unmask.serve.batches`: the
  registry's ``batch_key`` and ``Spec.batch``); ``ar`` and lossless ``sbd`` rows share the AR /
  lossless batch of their draft layout, whose K follows the load (``--draft-sizes``,
  :mod:`unmask.serve.draft_sizing`). ``compile=True`` runs the batches of decoders that compile
  (``Spec.compiles``) on a static cache with the compiled forward; a new step shape runs eagerly
  (same tokens) until the scheduler has been idle IDLE_COMPILE_S (README "Serving").
- Per call (a remote-code LLaDA, whose forward takes no positions): one ``decode`` over compatible
  queued requests (:mod:`unmask.serve.per_call`), the running decoders stepping after each forward.

Each job gets its events through ``job.post`` (called from this thread): ``("step", event)`` with an
:mod:`unmask.trace` step event, then ``("done", result)`` or ``("error", ApiError)``.

An exception anywhere in a pass of the loop ends only the requests it touched (500) and the loop goes
on. :meth:`Scheduler.fault` is the watchdog ``/health`` reads: the thread ended, or one pass (a step,
a compile) has held it for WEDGED_S; :meth:`Scheduler.unanswered` lets a waiting HTTP handler answer
its own request when the thread cannot (ended: 503; past its deadline: 408).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from unmask.decode.verify.host_drafts import Tally
from unmask.decode.verify.suffix import SuffixCache
from unmask.errors import UnmaskError, is_int
from unmask.serve import per_call
from unmask.serve.batches import RunningBatches
from unmask.serve.draft_sizing import DEFAULT as DEFAULT_DRAFT_SIZES, DraftSizes, LoadSizer
from unmask.serve.errors import ApiError
from unmask.serve.jobs import Job, QueueFull, ShuttingDown, finish_gone, server_error, shutting_down, timed_out

log = logging.getLogger("unmask.serve")
IDLE_COMPILE_S = 2.0  # --compile: compile a pending step shape only after this long with no request running
DEFAULT_SUFFIX_TOKENS = 1 << 16  # the suffix cache bound in token ids: ~40-60 MiB of count tables on real text (benchmarks/results/draft_replay.md)
WEDGED_S = 600.0  # /health: one pass (a step, an idle compile of one shape) holding the thread this long is a fault
DEADLINE_SLACK_S = 2.0  # a handler answers its own 408 this long after its deadline (the thread normally does at once)


class Scheduler(RunningBatches):
    """Owns the model; runs queued jobs in a background thread (see the module docstring).

    max_batch_size: rows per running batch (and per per-call batch); max_queue: jobs waiting to start
    before ``submit`` refuses with QueueFull; compile: the batches of decoders that compile on static
    caches, compiled (diffusion with the dual cache only), and the per-call ``compile=True``;
    draft_sizes: the load -> K table of sizable requests (None: they keep the checkpoint's K);
    suffix_cache_tokens: the bound, in token ids, of the suffix-decoding cache of recent suffix requests' prompts
    and outputs that ``draft_source="suffix"`` rows draft from (0: none; one cache per scheduler, so
    per model). ``draft_tally``: drafted and accepted tokens per draft source (/metrics)."""

    def __init__(self, bundle, *, max_batch_size: int = 8, max_queue: int = 64, compile: bool = False,
                 draft_sizes: "DraftSizes | str | None" = DEFAULT_DRAFT_SIZES,
                 suffix_cache_tokens: int = DEFAULT_SUFFIX_TOKENS):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise UnmaskError(f"max batch size must be an integer >= 1 (got {max_batch_size!r}); pass e.g. 8")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise UnmaskError(f"max queue must be an integer >= 1 (got {max_queue!r}); pass e.g. 64")
        if not is_int(suffix_cache_tokens) or suffix_cache_tokens < 0:
            raise UnmaskError(f"the suffix cache bound must be an integer >= 0 token ids (got {suffix_cache_tokens!r}); "
                              f"pass e.g. {DEFAULT_SUFFIX_TOKENS}, or 0 for none")
        self.suffix_cache = SuffixCache(suffix_cache_tokens) if suffix_cache_tokens else None
        self.draft_tally = Tally()
        self.bundle, self.max_batch_size, self.max_queue = bundle, max_batch_size, max_queue
        self.sizer = LoadSizer(bundle, draft_sizes, compiled=compile)  # parses a text table
        self.compile, self.draft_sizes = compile, self.sizer.table
        self.draft_log = self.sizer.log  # (rows in the batch, K) whenever sizable rows get a new K
        self.stop_ids = set(bundle.stop_token_ids)
        self.verify: dict = {}  # draft layout -> the AR / lossless running batch
        self.running_batches: dict[tuple, object] = {}  # batch key -> the other running batches
        self._waiting: deque[Job] = deque()
        self._lock = threading.Condition()
        self._stop = self._paused = self.compiling = False  # compiling: an idle-time compile runs (/health)
        self._worked = time.monotonic()  # when the loop last admitted or stepped anything (idle compiles)
        self._beat = time.monotonic()  # when the loop last began a pass, a wait or a compile (the watchdog)
        self.draining = False  # set by drain(): submit refuses, every request was ended
        self.peak_running = 0  # the most rows holding slots at once so far (tests, benchmarks)
        self.abandoned_batches = 0  # per-call batches stopped early: every request answered or gone
        self._batch: list[Job] = []  # the running per-call batch
        self.ar  # the AR batch exists from the start: the loop and readers never race to create it
        self._thread = threading.Thread(target=self._loop, name="unmask-scheduler", daemon=True)

    # -- public, any thread -------------------------------------------------------------------

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    @property
    def thread_alive(self) -> bool:  # after close(): True while a compile it started still runs
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the loop: running requests are cancelled and queued ones are answered 503."""
        with self._lock:
            self._stop = True
            for job in self._running_jobs() + list(self._batch):
                job.cancel()
            self._lock.notify_all()
        if self._thread.is_alive():  # a step ends in ms; a compile (seconds, discarded) is not waited for
            self._thread.join(timeout=0.5 if self.compiling else 10)

    def drain(self, error) -> None:
        """Shutdown, first step (any thread): refuse new jobs (``submit`` raises ShuttingDown) and end
        every queued and running request now with ``("error", error)``; their rows leave at the next
        step boundary."""
        with self._lock:
            self.draining = True
            jobs = list(self._waiting) + self._running_jobs() + list(self._batch)
            self._waiting.clear()
            self._lock.notify_all()
        for job in jobs:
            job.cancel()
            job.finish("error", error)

    def fault(self) -> tuple[str, str] | None:
        """The watchdog: None while the scheduler thread serves, else (``"dead"`` or ``"wedged"``, why in
        words): the thread ended (a bug; the log has its traceback), or one pass (a step, a compile) has
        held it for more than WEDGED_S seconds. None before ``start`` and after ``close``."""
        if self._thread.ident is None or self._stop:
            return None
        if not self._thread.is_alive():
            return "dead", ("the scheduler thread has stopped, so no request can run; see the server log and "
                            "restart the server")
        if (held := time.monotonic() - self._beat) > WEDGED_S:
            doing = "compiling a step shape" if self.compiling else "inside one step"
            return "wedged", f"the scheduler thread has been {doing} for {held:.0f} s; requests wait or time out"
        return None

    def unanswered(self, job: Job) -> ApiError | None:
        """For the HTTP handler waiting on ``job`` (any thread): the error to answer it with itself when
        this thread cannot: the thread has ended (503), or the job passed its deadline DEADLINE_SLACK_S
        ago while a step or a compile held the thread (408). None otherwise (the thread answers it)."""
        if job.closed:
            return None
        if (fault := self.fault()) is not None and fault[0] == "dead":
            return ApiError(503, fault[1], type="server_error")
        if time.monotonic() > job.deadline + DEADLINE_SLACK_S:
            return timed_out()
        return None

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Requests holding a slot: the running batches' rows and the per-call batch's."""
        return len(self._running_jobs()) + len(self._batch)

    @property
    def pending_compiles(self) -> int:  # /health: step shapes (and whole steps) run eagerly, to compile once idle
        return sum(len(b.kv.pending) + getattr(b, "pending_steps", 0) for b in self._batches() if getattr(b, "static", 0) and b.kv)

    def submit(self, job: Job) -> None:
        """Queue a job; raises QueueFull when ``max_queue`` jobs already wait, ShuttingDown after :meth:`drain`."""
        job.sizable = self.sizer.sizable(job)
        job.running_key, job.config = self._running_key(job)  # once: the loop reads it every pass
        with self._lock:
            if self.draining:
                raise ShuttingDown
            if len(self._waiting) >= self.max_queue:
                raise QueueFull
            self._waiting.append(job)
            self._lock.notify_all()

    def pause(self, paused: bool = True) -> None:
        """Stop starting queued jobs (running ones continue) until :meth:`resume`; for maintenance and tests."""
        with self._lock:
            self._paused = paused
            self._lock.notify_all()

    def resume(self) -> None:
        self.pause(False)

    # -- the loop (scheduler thread) ------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            joining, batch = {}, []
            try:
                with self._lock:
                    while not self._stop and not self._busy() and (self._paused or not self._waiting):
                        self._beat = time.monotonic()
                        if (idle := time.monotonic() - self._worked) >= IDLE_COMPILE_S and self.pending_compiles:
                            break  # idle for a while: compile a shape a batch ran eagerly, outside the lock
                        self._lock.wait(timeout=min(0.5, max(IDLE_COMPILE_S - idle, 0.01)))
                        self._reap_waiting()
                    if self._stop:
                        break
                    self._beat = time.monotonic()
                    self._reap_waiting()
                    joining = self._take_running()  # assigned at once: a failure below still answers them
                    batch = self._take_batch()
                if not (joining or batch or self._busy()):
                    self._warm()
                    continue
                self._worked = time.monotonic()
                self._advance(joining)
                if batch:
                    per_call.run_batch(self, batch)
            except Exception:  # noqa: BLE001 (a bug ends the requests of this pass; the others go on)
                log.exception("a scheduler pass failed; the requests it was starting are answered 500")
                for job in [j for jobs in joining.values() for j in jobs] + batch:
                    job.cancel()  # a row it left in a batch leaves at the next step
                    job.finish("error", server_error())
                time.sleep(0.05)  # a fault that repeats every pass does not spin
        for job in list(self._waiting) + self._running_jobs():
            job.finish("error", shutting_down(retry_after=False))

    def _warm(self) -> None:
        """Compile one shape an idle batch ran eagerly (``defer_compile``); a failed one is logged and stays eager."""
        self.compiling = True
        for batch in self._batches():
            self._beat = time.monotonic()
            try:
                if getattr(batch, "static", False) and batch.warm():
                    break
            except Exception:  # noqa: BLE001 (the shape stays eager; serving goes on)
                log.exception("compiling a step shape failed; it keeps running eagerly")
        self.compiling = False

    def _busy(self) -> bool:
        return any(len(b) for b in self._batches())

    def _reap_waiting(self) -> None:
        """Answer queued jobs that were cancelled or timed out before they started."""
        for job in [j for j in self._waiting if j.gone]:
            self._waiting.remove(job)
            finish_gone(job)

    def _take_batch(self) -> list[Job]:
        """Under the lock: the oldest waiting per-call job and the compatible ones behind it."""
        first = None if self._paused else next((j for j in self._waiting if j.running_key is None), None)
        if first is None:
            return []
        key = first.batch_key()
        batch = [j for j in self._waiting if j.running_key is None and j.batch_key() == key][: self.max_batch_size]
        for j in batch:
            self._waiting.remove(j)
        return batch
