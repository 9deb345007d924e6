"""The scheduler: one thread owns the model and runs every request (DESIGN.md "One engine").

Each pass of its loop admits waiting requests into the running decoders with free slots, runs ONE
``step()`` of each and answers the rows that finished. A request joins at a step boundary and leaves
(its slot free at once) the step it finishes, is cancelled or times out; each row's tokens, NFE and
events equal its decoder's ``decode`` on its prompt alone, whatever else runs (README "Serving").

- ``ar`` and lossless ``sbd`` requests share one running batch per draft layout
  (:class:`unmask.decode.verify.batch.Verify`): an AR row steps with draft size K = 1, a lossless row
  with its own K. Greedy lossless requests that fix no block size (``sizable``) take K from the
  ``--draft-sizes`` table (:mod:`unmask.serve.draft_sizing`) at the batch's load, chosen again before
  every step (output does not depend on K; no row moves between batches). At most MAX_LAYOUTS such
  batches at once. ``compile=True`` runs them on the static cache with the compiled forward (one graph
  per row bucket, query length and length bucket); a new shape runs eagerly (same tokens) until the
  scheduler has been idle IDLE_COMPILE_S (README "Serving"). So do the ``COMPILED`` batches below.
- ``multiblock``, ``block``, lossy ``sbd``, ``diffusion`` (any cache; Dream's ``schedule`` in a
  :class:`~unmask.decode.dllm.dream.DreamSchedule`) and ``early-bird`` (any cache, a row's refresh its
  own) share the continuous batches of ``RUNNING``, one per decoder and options
  (:meth:`Scheduler._running_kind`).
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

from unmask.decode.verify import layout as draft_layout
from unmask.decode.verify import steps as sbd_verify
from unmask.decode.verify.batch import Verify
from unmask.decode.blocks.sbd import runs_lossless
from unmask.errors import UnmaskError
from unmask.decode.dllm import diffusion_batch, early_bird_batch
from unmask.decode.engine.registry import DECODERS, Config
from unmask.decode.blocks import single as single_bd
from unmask.decode.multiblock import batch as multiblock_engine
from unmask.decode.blocks import sbd as lossy_sbd
from unmask.serve import per_call
from unmask.serve.draft_sizing import DEFAULT as DEFAULT_DRAFT_SIZES, DraftSizes, LoadSizer
from unmask.serve.errors import ApiError
from unmask.serve.jobs import Job, QueueFull, ShuttingDown, bad_request, finish_gone, server_error, timed_out
from unmask.trace import TokenStep

log = logging.getLogger("unmask.serve")
IDLE_COMPILE_S = 2.0  # --compile: compile a pending step shape only after this long with no request running
MAX_LAYOUTS = 4  # AR / lossless batches (one per draft layout) at once: each holds its layout's step tables
WEDGED_S = 600.0  # /health: one pass (a step, an idle compile of one shape) holding the thread this long is a fault
DEADLINE_SLACK_S = 2.0  # a handler answers its own 408 this long after its deadline (the thread normally does at once)


def _rows(batch) -> list:
    return list(batch.rows.values()) if isinstance(batch.rows, dict) else list(batch.rows)


def _done(row, bundle) -> None:
    reason = row.finish
    if reason == "length" and per_call.stopped(bundle, row.job, row.tokens):  # a canvas that filled at once
        reason = "stop"  # the text is cut at the stop string, so the answer ended there, not at the length
    row.job.finish("done", {"tokens": row.tokens, "nfe": row.nfe, "finish_reason": reason,
                            "stop_token": row.stop_token})


# Continuous running batches of the other decoders: batch kind -> class (see Scheduler._running_kind).
RUNNING = {"multiblock": multiblock_engine.serving_batch, "sbd": lossy_sbd.serving_batch, "block": single_bd.serving_batch,
           "diffusion": diffusion_batch.batch, "dream": diffusion_batch.batch, "early-bird": early_bird_batch.batch}
COMPILED = ("sbd", "block", "multiblock", "diffusion")  # --compile: these on a static cache (diffusion: its dual cache)
# The options each running batch takes; a request with others (e.g. diffusion's --schedule dream) runs per call.
RUNNING_OPTIONS = {"multiblock": multiblock_engine.OPTIONS, "sbd": lossy_sbd.BATCH_OPTIONS,
                   "block": single_bd.BATCH_OPTIONS}


class Scheduler:
    """Owns the model; runs queued jobs in a background thread (see the module docstring).

    max_batch_size: rows per running batch (and per per-call batch); max_queue: jobs waiting to start
    before ``submit`` refuses with QueueFull; compile: the AR / lossless and ``COMPILED`` batches on
    static caches, compiled (diffusion with the dual cache only; early-bird stays eager), and the per-call ``compile=True``;
    draft_sizes: the load -> K table of sizable requests (None: they keep the checkpoint's K)."""

    def __init__(self, bundle, *, max_batch_size: int = 8, max_queue: int = 64, compile: bool = False,
                 draft_sizes: "DraftSizes | str | None" = DEFAULT_DRAFT_SIZES):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise UnmaskError(f"max batch size must be an integer >= 1 (got {max_batch_size!r}); pass e.g. 8")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise UnmaskError(f"max queue must be an integer >= 1 (got {max_queue!r}); pass e.g. 64")
        self.bundle, self.max_batch_size, self.max_queue = bundle, max_batch_size, max_queue
        self.sizer = LoadSizer(bundle, draft_sizes, compiled=compile)  # parses a text table
        self.compile, self.draft_sizes = compile, self.sizer.table
        self.draft_log = self.sizer.log  # (rows in the batch, K) whenever sizable rows get a new K
        self.stop_ids = set(bundle.stop_token_ids)
        self.defaults = bundle.meta.get("decode_defaults") or {}
        self.verify: dict[str, Verify] = {}  # draft layout -> the AR / lossless running batch
        self.running_batches: dict[tuple, object] = {}  # (decoder, options) -> the other running batches
        self._waiting: deque[Job] = deque()
        self._lock = threading.Condition()
        self._stop = self._paused = self.compiling = False  # compiling: an idle-time compile runs (/health)
        self._worked = time.monotonic()  # when the loop last admitted or stepped anything (idle compiles)
        self._beat = time.monotonic()  # when the loop last began a pass, a wait or a compile (the watchdog)
        self.draining = False  # set by drain(): submit refuses, every request was ended
        self.peak_running = 0  # the most rows holding slots at once so far (tests, benchmarks)
        self.abandoned_batches = 0  # per-call batches stopped early: every request answered or gone
        self.batch_rows: dict[int, int] = {}  # job id -> row in the running per-call batch
        self._batch: list[Job] = []  # the running per-call batch
        self.ar  # the AR batch exists from the start: the loop and readers never race to create it
        self._thread = threading.Thread(target=self._loop, name="unmask-scheduler", daemon=True)

    @property
    def ar(self) -> Verify:
        """The running batch AR requests join (the checkpoint's default draft layout)."""
        return self._verify_batch(draft_layout.resolve(self.defaults.get("draft") or sbd_verify.DEFAULT_DRAFT,
                                                       None, self.defaults))

    def _verify_batch(self, draft: str, fresh: bool = False) -> Verify:
        if fresh or draft not in self.verify:  # fresh: replaced in one assignment (readers never see none)
            K = self.defaults.get("verify_block_size") or sbd_verify.DEFAULT_BLOCK_SIZE
            cfg = sbd_verify.VerifyConfig(block_size=K, draft=draft, smaller=self.sizer.smaller(draft))
            self.verify[draft] = Verify(self.bundle, cfg, compile=self.compile, capacity=self.max_batch_size,
                                        on_step=self._event, on_token=self._ar_token,
                                        ar=self.bundle.mask_token_id is None, defer_compile=True)
        return self.verify[draft]

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
        return len(self._running_jobs()) + len(self.batch_rows)

    @property
    def pending_compiles(self) -> int:  # /health: step shapes (and whole steps) run eagerly, to compile once idle
        return sum(len(b.kv.pending) + getattr(b, "pending_steps", 0) for b in self._batches() if getattr(b, "static", 0) and b.kv)

    def _batches(self) -> list:
        return list(self.verify.values()) + list(self.running_batches.values())

    def _running_jobs(self) -> list[Job]:
        return [r.job for b in self._batches() for r in _rows(b)]

    def submit(self, job: Job) -> None:
        """Queue a job; raises QueueFull when ``max_queue`` jobs already wait, ShuttingDown after :meth:`drain`."""
        job.sizable = self.sizer.sizable(job)
        job.running_key = self._running_kind(job)  # once: the loop reads it every pass
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
            job.finish("error", ApiError(503, "the server is shutting down; retry later", type="server_error"))

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

    def _running_kind(self, job: Job) -> tuple | None:
        """The running batch ``job`` joins: ("verify", draft layout) for ar and lossless sbd, else
        (kind, its options as sorted items) of ``RUNNING``, or None when it runs per call."""
        if job.decoder == "ar":
            return "verify", self.ar.cfg.draft
        try:
            lossless = job.decoder == "sbd" and runs_lossless(self.bundle, job.options)
        except UnmaskError:
            return None  # its decode call reports the contradiction
        if lossless:  # a budgeted draft as its D/S/G text: one running batch per layout
            try:
                draft = draft_layout.option(job.options.get("draft"), job.options.get("block_size"), self.defaults,
                                            sbd_verify.DEFAULT_DRAFT)
                return "verify", draft_layout.resolve(draft, job.options.get("queries"), self.defaults)
            except UnmaskError:
                return None  # its decode call reports the bad budget
        if job.decoder in ("diffusion", "early-bird"):  # the decoder's own key: (kind, its config) or None
            try:
                return DECODERS[job.decoder].config.of(job.options).batch_key(self.bundle, job.max_new_tokens)
            except (UnmaskError, TypeError):
                return None  # its decode call reports the bad option
        if job.decoder in RUNNING_OPTIONS and not set(job.options) <= set(RUNNING_OPTIONS[job.decoder]):
            return None
        if job.decoder in RUNNING:
            return job.decoder, tuple(sorted(job.options.items()))
        return None

    def _take_running(self) -> dict[tuple, list[Job]]:
        """Under the lock: waiting jobs of the running decoders, oldest first, by running-batch key,
        as many as each batch has free slots."""
        out: dict[tuple, list[Job]] = {}
        for j in [] if self._paused else [j for j in self._waiting if j.running_key is not None]:
            key = j.running_key
            batch = self.verify.get(key[1]) if key[0] == "verify" else self.running_batches.get(key)
            if key[0] == "verify" and batch is None and key not in out and not self._layout_room(out):
                continue  # waits until an idle layout's batch can go
            if (len(batch) if batch is not None else 0) + len(out.get(key, ())) < self.max_batch_size:
                out.setdefault(key, []).append(j)
                self._waiting.remove(j)
        return out

    def _layout_room(self, out: dict) -> bool:
        """Under the lock: whether one more layout's batch may form beside the others and those ``out`` forms
        (at most MAX_LAYOUTS, each holding its step tables), dropping the oldest idle ones but the default's."""
        new = sum(k[0] == "verify" and k[1] not in self.verify for k in out)
        idle = [d for d, b in self.verify.items() if not len(b) and d != self.ar.cfg.draft and ("verify", d) not in out]
        while idle and len(self.verify) + new >= MAX_LAYOUTS:
            del self.verify[idle.pop(0)]
        return len(self.verify) + new < MAX_LAYOUTS

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

    # -- the running decoders: admit, one step each, answer -------------------------------------

    def _advance(self, joining: dict[tuple, list[Job]]) -> None:
        """Admit ``joining`` (key -> jobs) and run one step of every running decoder. Options the
        decoder refuses fail the joining requests (400); a failed step fails that batch's rows (500)."""
        self._beat = time.monotonic()  # also reached between a per-call batch's forwards
        keys = [("verify", d) for d in self.verify] + list(self.running_batches)
        for key in dict.fromkeys([*keys, *joining]):
            jobs = joining.get(key, [])
            try:
                batch = self._verify_batch(key[1]) if key[0] == "verify" else self.running_batches.get(key)
                if batch is None:
                    fast = {"compile": True} if self.compile and key[0] in COMPILED else {}
                    cfg = key[1] if isinstance(key[1], Config) else dict(key[1])  # a registry key carries its config
                    batch = self.running_batches[key] = RUNNING[key[0]](self.bundle, cfg, on_step=self._event,
                                                                        capacity=self.max_batch_size, **fast)
            except UnmaskError as e:  # the options failed the decoder's own validation
                for j in jobs:
                    j.finish("error", bad_request(e, j.options))
                continue
            except Exception:  # e.g. MemoryError allocating its cache: these requests fail, the others go on
                log.exception("starting a %s running batch failed", key[0])
                for j in jobs:
                    j.finish("error", server_error())
                continue
            try:
                if key[0] == "verify":
                    self._step_verify(batch, key[1], jobs)
                else:
                    for row in batch.drop([r.job.id for r in _rows(batch) if r.job.gone]):
                        finish_gone(row.job)
                    for job in jobs:
                        self._join(batch, [job])
                    if jobs:  # the most recently joined last: idle compiled batches are evicted oldest first
                        self.running_batches[key] = self.running_batches.pop(key)
                    self.peak_running = max(self.peak_running, self.active)
                    for row in batch.step():
                        _done(row, self.bundle)
            except Exception:
                log.exception("a %s running batch failed", key[0])
                self._fail(key, batch)
                continue
            if key[0] != "verify" and not len(batch) and not getattr(batch, "static", False):
                del self.running_batches[key]  # frees its cache; a new batch forms with the next request
        for key in [k for k, b in self.running_batches.items() if not len(b)][:-MAX_LAYOUTS]:
            del self.running_batches[key]  # idle compiled batches: the last MAX_LAYOUTS joined keep their caches

    def _step_verify(self, batch: Verify, draft: str, jobs: list[Job]) -> None:
        """Drop gone rows, admit ``jobs`` (grouped by draft size: one prefill each), give sizable rows
        the table's K at the new load, run one step and answer the finished rows."""
        for row in batch.drop([r.job.id for r in _rows(batch) if r.job.gone]):
            finish_gone(row.job)
        # sized before the prefill, so the log's entry precedes the joining rows' events
        sized = self.sizer.size(draft, len(batch) + len(jobs), any(j.sizable for j in jobs), batch)
        by_k: dict[int, list[Job]] = {}
        for job in jobs:
            try:
                by_k.setdefault(self.sizer.block_size(job, sized), []).append(job)
            except UnmaskError as e:
                job.finish("error", bad_request(e, job.options))
        for K, group in by_k.items():
            self._join(batch, group, block_size=K)
        self.peak_running = max(self.peak_running, self.active)
        self.sizer.resize(batch, draft)
        for row in batch.step():
            _done(row, self.bundle)

    def _join(self, batch, jobs: list[Job], **kw) -> None:
        """Admit jobs together; when that raises (a prefill refusing one, or failing on one), each alone,
        so only the request that fails alone fails: 400 for the decoder's own refusal, else 500."""
        try:
            for row in batch.join(jobs, **kw):  # finished at its prefill (a stop token, max_tokens 1)
                _done(row, self.bundle)
        except Exception as e:  # noqa: BLE001 (any failure: retried alone, then answered)
            if not isinstance(e, UnmaskError):  # rows placed before the failure leave (drop raising: _fail)
                batch.drop([job.id for job in jobs])
            if len(jobs) > 1:
                log.warning("joining %d %s requests together failed (%s); each joins alone", len(jobs),
                            jobs[0].decoder, str(e).splitlines()[0] if str(e) else type(e).__name__)
                for job in jobs:
                    self._join(batch, [job], **kw)
            elif isinstance(e, UnmaskError):
                jobs[0].finish("error", bad_request(e, jobs[0].options))
            else:
                log.exception("joining a %s running batch failed", jobs[0].decoder)
                jobs[0].finish("error", server_error())

    def _fail(self, key: tuple, batch) -> None:
        """A step (or a join's clean-up) raised: every row of ``batch`` gets a 500, and the batch, whose
        state may be half-stepped, is replaced by a fresh one (AR / lossless) or removed."""
        for row in _rows(batch):
            row.job.finish("error", server_error())
        if key[0] == "verify":
            self._verify_batch(key[1], fresh=True)
        else:
            self.running_batches.pop(key, None)

    def _event(self, row, event: dict) -> None:
        if not (row.job.gone or row.job.closed) and row.job.events:
            row.job.post("step", event)

    def _ar_token(self, row) -> None:
        if not (row.job.events or row.job.gone or row.job.closed):  # O(1): the reader copies the canvas
            row.job.post("step", TokenStep(row.tokens, len(row.tokens)))
