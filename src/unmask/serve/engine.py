"""The scheduler: one thread owns the model and runs every request.

What is continuous and what is not (README "Serving"):

- ``ar`` requests share one running batch (:class:`~unmask.serve.ar_batch.ARBatch`). A request
  joins at the next step boundary and leaves the step it finishes, is cancelled or times out,
  freeing its slot and its cache rows at once.
- The other decoders' requests share continuous running batches too, one per decoder and set
  of options (``RUNNING``, :meth:`Scheduler._running_kind`): ``multiblock``
  (:class:`~unmask.decode.multiblock_engine.MultiBlockDecoder`: a joining request's prompt blocks
  are prefilled and its N_buf slots added), ``block`` and lossy ``sbd``
  (:class:`~unmask.decode.blocks.BlockDecoder`, the class their ``decode`` drains), lossless ``sbd`` that fixes its block size or samples
  (:class:`~unmask.serve.sbd_batch.VerifyBatch`, per K and draft layout) and ``diffusion``
  (:class:`~unmask.serve.diffusion_batch.DiffusionBatch`, per knobs and effective block size), and
  ``early-bird`` without a cache (:class:`~unmask.serve.early_bird_batch.EarlyBirdBatch`). A request joins at the
  next step boundary and leaves the step it finishes, is cancelled or times out, freeing its
  slots and cache rows at once; each row's tokens, NFE and events equal its decoder's ``decode``
  on its prompt alone, greedy or seeded, whatever else runs.
- Cached ``early-bird`` (a refresh serves every row), ``diffusion`` with Dream's ``schedule`` and
  greedy lossless ``sbd`` sized by the load (below) run a whole batch in one call of their ``decode`` function, so those batches are formed
  from *compatible* queued requests (same decoder, options, sampling, length and stop strings) and
  run to completion: a request cannot join one mid-block, and its slot is freed when the batch
  ends. A request whose committed tokens already fix its answer (a stop token, ``max_tokens`` or
  a stop string in the committed prefix) is answered at once, without waiting for the rest of the
  batch; a cancelled or timed-out request stops receiving events at once; and the batch stops at
  the next step when none of its requests is still waiting for an answer. Sampled (temperature
  > 0) requests of these decoders run alone, so a seed reproduces ``unmask generate``.
- While such a batch runs, the running batches still advance: after each forward of the batch
  (its ``on_step`` boundary) the scheduler admits waiting requests into the running batches and
  runs one step of each, so they never wait for a per-call batch to finish.
- Greedy lossless ``sbd`` requests whose block size neither the request nor the server fixed get
  their draft block size K from the load (:mod:`unmask.serve.draft_sizing`): the rows that would
  share forwards (the AR batch, the running batch and the waiting ones) pick K from the
  ``--draft-sizes`` table when their batch forms, and where the table says K = 1 they join the AR
  running batch instead: plain one-token steps, which lossless SBD reproduces token for token.
  Such a request also joins the AR batch while a non-AR batch decodes (rather than waiting for
  that batch to end); when the AR batch is full it waits for a slot. Beside a few AR rows (fewer
  than the table's K = 1 load) it forms its own sbd batch: the draft still pays there, so an AR
  and an sbd request side by side (the playground) show SBD's fewer forwards.
  Conversely, a sized sbd batch moves into the AR running batch at its next step once AR rows run
  beside it, the load (AR rows + its open rows) reaches the table's K = 1 and the AR batch has a
  slot for each of its open rows (each row goes on from its committed tokens, which are AR's; a
  moved row never decodes in an sbd batch again): past the crossover one forward serving every
  row beats two forwards per step.

Each job gets its events through ``job.post`` (called from this thread): ``("step", event)``
with an :mod:`unmask.trace` step event, then ``("done", result)`` or ``("error", ApiError)``.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from unmask.decode import get_decoder, sbd_verify
from unmask.decode.diffusion import DiffusionConfig
from unmask.errors import UnmaskError
from unmask.sampling import Sampling
from unmask.decode.sbd import runs_lossless
from unmask.serve.ar_batch import ARBatch, Row
from unmask.decode import block as single_bd, multiblock_engine, sbd as lossy_sbd
from unmask.serve import diffusion_batch, early_bird_batch
from unmask.serve.diffusion_batch import DiffusionBatch
from unmask.serve.early_bird_batch import EarlyBirdBatch
from unmask.serve.sbd_batch import VerifyBatch
from unmask.serve.draft_sizing import DEFAULT as DEFAULT_DRAFT_SIZES, DraftSizes
from unmask.serve.errors import ApiError
from unmask.serve.protocol import api_message, edits_committed

log = logging.getLogger("unmask.serve")
# Continuous running batches other than AR's: batch kind -> class (see Scheduler._running_kind).
RUNNING = {"multiblock": multiblock_engine.serving_batch, "sbd-lossless": VerifyBatch,
           "sbd": lossy_sbd.serving_batch, "block": single_bd.serving_batch,
           "diffusion": DiffusionBatch, "early-bird": EarlyBirdBatch}
ONE_ENGINE = ("sbd", "block", "multiblock")  # kinds whose batch is the decoder's own class: drop takes job ids, sized by slots
# The options each running batch takes; a request with others (e.g. diffusion's --schedule dream) runs per call.
RUNNING_OPTIONS = {"multiblock": multiblock_engine.OPTIONS, "sbd": lossy_sbd.BATCH_OPTIONS,
                   "block": single_bd.BATCH_OPTIONS, "diffusion": diffusion_batch.OPTIONS,
                   "early-bird": early_bird_batch.OPTIONS}
_ids = itertools.count()


def _drop(key, batch, pred) -> list:
    """Drop the rows of a running batch for which ``pred(row)`` holds; the one-engine classes take job ids."""
    if key[0] in ONE_ENGINE:
        return batch.drop([r.job.id for r in batch.rows if pred(r)])
    return batch.drop(pred)


class _Abandoned(Exception):
    """Raised from ``on_step`` to stop a batch none of whose requests is still wanted."""


class _Migrate(Exception):
    """Raised from ``on_step`` to move a sized lossless sbd batch into the AR running batch."""


@dataclass(eq=False)
class Job:
    """One request as the scheduler sees it.

    prompt_ids: the encoded prompt; options: decoder knobs passed to ``decode``; stop: stop
    strings; deadline: ``time.monotonic()`` after which the request times out. ``post(kind,
    payload)`` delivers an event to the waiting HTTP handler (thread-safe)."""

    prompt_ids: list[int]
    decoder: str
    options: dict
    sampling: Sampling
    max_new_tokens: int
    stop: tuple[str, ...]
    deadline: float
    post: object
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    closed: bool = False  # set by the scheduler after the final event
    sizable: bool = False  # set by the scheduler: greedy lossless sbd whose K follows the load
    resume: list[int] = field(default_factory=list)  # tokens committed before moving to the AR batch
    resume_nfe: int = 0  # forwards already spent on them
    running_key: tuple | None = None  # set by the scheduler: the continuous batch it joins (None: per call or AR)

    def cancel(self) -> None:
        """Ask the scheduler to drop this request at its next step boundary (thread-safe)."""
        self.cancelled.set()

    @property
    def gone(self) -> bool:
        return self.cancelled.is_set() or time.monotonic() > self.deadline

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one non-AR ``decode`` call."""
        solo = self.id if not self.sampling.greedy else None
        return (self.decoder, tuple(sorted(self.options.items())), self.sampling, self.max_new_tokens,
                self.stop, solo)

    def finish(self, kind: str, payload) -> None:
        if not self.closed:
            self.closed = True
            self.post(kind, payload)


def _bad_request(e: UnmaskError, options: dict) -> ApiError:
    """A 400 for a decoder's own validation error, ``param`` the knob the message names, if any
    (longest name first: tau_add before tau)."""
    message = api_message(str(e).splitlines()[0])
    low = message.lower()
    param = next((k for k in sorted(options, key=len, reverse=True) if k in low or k.replace("_", " ") in low), None)
    return ApiError(400, message, param=param)


class QueueFull(Exception):
    """The bounded queue is full (HTTP 429)."""


class ShuttingDown(Exception):
    """The scheduler is draining for shutdown and admits nothing (HTTP 503)."""


class Scheduler:
    """Owns the model; runs queued jobs in a background thread (see the module docstring).

    max_batch_size: rows per forward (the AR running batch and each non-AR batch);
    max_queue: jobs waiting to start before ``submit`` refuses with QueueFull.
    """

    def __init__(self, bundle, *, max_batch_size: int = 8, max_queue: int = 64, compile: bool = False,
                 draft_sizes: DraftSizes | None = DEFAULT_DRAFT_SIZES):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise UnmaskError(f"max batch size must be an integer >= 1 (got {max_batch_size!r}); pass e.g. 8")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise UnmaskError(f"max queue must be an integer >= 1 (got {max_queue!r}); pass e.g. 64")
        self.bundle, self.max_batch_size, self.max_queue = bundle, max_batch_size, max_queue
        self.compile = compile  # non-AR batches on the static, compiled path (unmask.decode.kv, .static)
        self.draft_sizes = draft_sizes  # None: every lossless sbd batch keeps its own block size
        self.draft_log: list[tuple[int, int]] = []  # (rows sharing forwards, K) of each sized batch; 1 = AR
        self.ar = ARBatch(bundle, on_token=self._ar_token)
        self.stop_ids = set(bundle.stop_token_ids)
        self._waiting: deque[Job] = deque()
        self._lock = threading.Condition()
        self._stop = False
        self._paused = False
        self.draining = False  # set by drain(): submit refuses, every request was ended
        self.peak_running = 0  # the most rows holding slots at once so far (tests, benchmarks)
        self.abandoned_batches = 0  # non-AR batches stopped early: every request answered or gone
        self.migrated_rows = 0  # sized lossless sbd rows moved mid-decode into the AR running batch
        self.batch_rows: dict[int, int] = {}  # job id -> row in the running non-AR batch
        self.running_batches: dict[tuple, object] = {}  # (decoder, options) -> continuous batch
        self._diffusion_runs = self._diffusion_batches_fit(bundle)
        self._batch: list[Job] = []  # the running non-AR batch
        self._thread = threading.Thread(target=self._loop, name="unmask-scheduler", daemon=True)

    # -- public, any thread -------------------------------------------------------------------

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the loop: running requests are cancelled (a running batch stops at its next step)
        and queued ones are answered 503."""
        with self._lock:
            self._stop = True
            for job in [r.job for r in self.ar.rows] + list(self._batch) + self._running_jobs():
                job.cancel()
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def drain(self, error) -> None:
        """Shutdown, first step (any thread): refuse new jobs (``submit`` raises ShuttingDown) and
        end every queued and running request now with ``("error", error)`` (a stream then ends
        with that error event and ``[DONE]``); their rows leave at the next step boundary."""
        with self._lock:
            self.draining = True
            jobs = list(self._waiting) + [r.job for r in self.ar.rows] + list(self._batch) + self._running_jobs()
            self._waiting.clear()
            self._lock.notify_all()
        for job in jobs:
            job.cancel()
            job.finish("error", error)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Requests holding a slot: the AR rows, the continuous multiblock rows and the running
        per-call batch."""
        return len(self.ar) + sum(len(b) for b in list(self.running_batches.values())) + len(self.batch_rows)

    def _running_jobs(self) -> list[Job]:
        return [r.job for b in list(self.running_batches.values()) for r in b.rows]

    running = active  # the running batch size reported in /metrics

    def submit(self, job: Job) -> None:
        """Queue a job; raises QueueFull when ``max_queue`` jobs already wait, ShuttingDown after
        :meth:`drain`."""
        job.sizable = self._sizable(job)
        job.running_key = self._running_kind(job)  # once: the scheduler loop reads it every iteration
        with self._lock:  # rows moved out of an sbd batch on their way to the AR batch already started
            if self.draining:
                raise ShuttingDown
            if sum(not j.resume for j in self._waiting) >= self.max_queue:
                raise QueueFull
            self._waiting.append(job)
            self._lock.notify_all()

    def pause(self) -> None:
        """Stop starting queued jobs (running ones continue); for maintenance and tests."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    # -- the loop (scheduler thread) ------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._busy() and (self._paused or not self._waiting):
                    self._lock.wait(timeout=0.5)
                    self._reap_waiting()
                if self._stop:
                    break
                self._reap_waiting()
                ar_jobs, joining, batch = self._take_ar(), self._take_running(), self._take_batch()
            try:
                self._ar_step(ar_jobs)
                self._running_step(joining)
                if batch:
                    self._run_batch(batch)
            except Exception:  # a bug must not kill the scheduler: fail those requests, keep serving
                log.exception("scheduler step failed")
                for job in ar_jobs + batch + [r.job for r in self.ar.rows]:
                    job.finish("error", ApiError(500, "internal error while decoding; see the server log",
                                                 type="server_error"))
                self.ar = ARBatch(self.bundle, on_token=self._ar_token)
        for job in list(self._waiting) + [r.job for r in self.ar.rows] + self._running_jobs():
            job.finish("error", ApiError(503, "the server is shutting down; retry later", type="server_error"))

    @staticmethod
    def _diffusion_batches_fit(bundle) -> bool:
        """Whether this model's diffusion requests can share running batches (a remote-code
        LLaDA takes no positions, so its rows cannot be padded: those run per call)."""
        if bundle.kind != "masked-diffusion":
            return False
        try:
            DiffusionBatch(bundle)
        except UnmaskError:
            return False
        return True

    def _busy(self) -> bool:
        """Whether a running batch has rows (the loop then steps without waiting for new jobs)."""
        return bool(len(self.ar)) or any(len(b) for b in self.running_batches.values())

    def _reap_waiting(self) -> None:
        """Answer queued jobs that were cancelled or timed out before they started."""
        for job in [j for j in self._waiting if j.gone]:
            self._waiting.remove(job)
            self._finish_gone(job)

    def _sizable(self, job: Job) -> bool:
        """Greedy lossless sbd with no block size fixed by the request or the server (their K
        follows the load; the output does not depend on it)."""
        return (self.draft_sizes is not None and job.decoder == "sbd" and job.sampling.greedy
                and job.options.get("block_size") is None and runs_lossless(self.bundle, job.options))

    def _load(self, joining: int) -> int:
        """Rows that would share forwards if ``joining`` more rows started now."""
        return len(self.ar) + len(self.batch_rows) + joining

    def _route_sized(self) -> bool:
        """Under the lock: whether the waiting sizable sbd jobs go to the AR running batch. They do
        when the table gives K = 1 at this load (running and waiting rows: past the draft's
        crossover one forward serving every row beats an sbd batch's forwards beside the AR
        batch's), and while a non-AR batch decodes (it cannot be joined mid-decode). Otherwise they
        form an sbd batch of their own, with K from the table, even beside a few AR rows (an AR
        and an sbd request side by side: the draft still pays there)."""
        sized = sum(j.sizable for j in self._waiting)
        if not sized:
            return False
        n_ar = sum(j.decoder == "ar" for j in self._waiting)
        # waiting AR jobs count as running AR rows: they join in the same pass as the sized ones would
        return bool(self._batch) or self.draft_sizes.size(self._load(n_ar + sized)) == 1

    def _take_ar(self) -> list[Job]:
        """Under the lock: the waiting AR jobs that fit in the AR batch now, oldest first, with the
        sizable sbd jobs when the draft-size table gives K = 1 at the current load or a non-AR
        batch is running."""
        if self._paused:
            return []
        free = self.max_batch_size - len(self.ar)
        route = self._route_sized()
        # A row moved out of an sbd batch (``resume``) goes on in the AR batch only: a new sbd batch
        # would decode it from the prompt again (its stream would go back to step 0).
        jobs = [j for j in self._waiting if j.decoder == "ar" or j.resume or (route and j.sizable)][:max(0, free)]
        for j in jobs:
            self._waiting.remove(j)
        if route and any(j.sizable for j in jobs):
            self.draft_log.append((self._load(len(jobs)), 1))
        return jobs

    def _take_batch(self) -> list[Job]:
        """Under the lock: the oldest waiting non-AR job and the compatible ones behind it."""
        first = None if self._paused else next((j for j in self._waiting if j.decoder != "ar" and not j.resume
                                                and j.running_key is None), None)
        if first is None:
            return []
        if first.sizable and self._route_sized():  # they wait for AR slots (the AR batch is full)
            first = next((j for j in self._waiting if j.decoder != "ar" and not j.sizable
                          and j.running_key is None), None)
            if first is None:
                return []
        key = first.batch_key()
        batch = [j for j in self._waiting if j.decoder != "ar" and not j.resume
                 and j.batch_key() == key][: self.max_batch_size]
        for j in batch:
            self._waiting.remove(j)
        return batch

    def _running_kind(self, job: Job) -> tuple[str, tuple] | None:
        """The continuous batch ``job`` joins: (kind, a key of ``RUNNING``; its options as sorted
        items), or None when it runs in a per-call batch (or, for AR and sized lossless sbd, in the
        AR batch). Lossless sbd with a fixed block size, or sampled, joins a :class:`VerifyBatch`
        of its block size and draft layout (the checkpoint's defaults filled in, as sbd.decode does)."""
        if job.decoder in RUNNING_OPTIONS and not set(job.options) <= set(RUNNING_OPTIONS[job.decoder]):
            return None
        if job.decoder in ("diffusion", "early-bird") and not self._diffusion_runs:
            return None
        if job.decoder == "early-bird" and str(job.options.get("cache", "none")) != "none":
            return None  # a cached early-bird refresh serves every row of a batch: per call
        if job.decoder == "diffusion" and job.options.get("block_size") is None:
            try:  # the block size this request decodes with (a short one gets a shorter block): part of the key
                block = DiffusionConfig.from_options(max_new_tokens=job.max_new_tokens, **job.options).block_size
            except (UnmaskError, TypeError):
                return None  # its decode call reports the problem
            return "diffusion", tuple(sorted({**job.options, "block_size": block}.items()))
        if job.decoder in ("multiblock", "block", "diffusion", "early-bird"):
            return job.decoder, tuple(sorted(job.options.items()))
        if job.decoder == "sbd" and not job.sizable and runs_lossless(self.bundle, job.options):
            defaults = self.bundle.meta.get("decode_defaults") or {}
            K = next(v for v in (job.options.get("block_size"), defaults.get("verify_block_size"),
                                 sbd_verify.DEFAULT_BLOCK_SIZE) if v is not None)
            draft = next(v for v in (job.options.get("draft"), defaults.get("draft"), sbd_verify.DEFAULT_DRAFT)
                         if v is not None)
            return "sbd-lossless", (("block_size", K), ("draft", draft))
        if job.decoder == "sbd" and not job.sizable:
            return "sbd", tuple(sorted(job.options.items()))
        return None

    def _take_running(self) -> dict[tuple, list[Job]]:
        """Under the lock: waiting jobs of the continuous decoders (``RUNNING``), oldest first, by
        running-batch key (decoder and options), as many as each batch has free slots."""
        if self._paused:
            return {}
        out: dict[tuple, list[Job]] = {}
        for j in list(self._waiting):
            key = None if j.resume else j.running_key
            if key is None:
                continue
            running = self.running_batches.get(key)
            if (len(running) if running is not None else 0) + len(out.get(key, ())) < self.max_batch_size:
                out.setdefault(key, []).append(j)
                self._waiting.remove(j)
        return out

    def _finish_gone(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.finish("cancelled", None)
        else:
            job.finish("error", ApiError(408, "the request timed out; raise 'timeout' or lower max_tokens",
                                         type="timeout_error", code="timeout"))

    # -- AR: continuous -------------------------------------------------------------------------

    def _ar_token(self, row: Row) -> None:
        n = len(row.tokens)
        row.job.post("step", {"step": n - 1, "row": 0, "positions": [n - 1], "tokens": [row.tokens[-1]],
                              "canvas": list(row.tokens)})

    def _ar_step(self, joining: list[Job]) -> None:
        for row in self.ar.drop(lambda r: r.job.gone):
            self._finish_gone(row.job)
        finished = self.ar.join(joining) if joining else []
        self.peak_running = max(self.peak_running, self.active)
        finished += self.ar.step()
        for row in finished:
            row.job.finish("done", {"tokens": row.tokens, "nfe": row.nfe, "finish_reason": row.finish})

    def _interleave_ar(self) -> None:
        """Between two forwards of a per-call batch: admit waiting AR and continuous-decoder jobs and
        run one step of each running batch. A failure here fails those requests only, never the
        batch around it."""
        with self._lock:
            self._reap_waiting()
            joining, running = self._take_ar(), self._take_running()
        self._running_step(running)
        if not joining and not len(self.ar):
            return
        try:
            self._ar_step(joining)
        except Exception:
            log.exception("AR step failed")
            for job in joining + [r.job for r in self.ar.rows]:
                job.finish("error", ApiError(500, "internal error while decoding; see the server log",
                                             type="server_error"))
            self.ar = ARBatch(self.bundle, on_token=self._ar_token)

    # -- multiblock: continuous -----------------------------------------------------------------

    def _running_step(self, joining: dict[tuple, list[Job]]) -> None:
        """One step of every continuous batch, after admitting ``joining`` (key -> jobs). Options the
        decoder refuses fail the joining requests (400); a failed step fails that batch's requests
        only (500)."""
        for key in list(dict.fromkeys([*self.running_batches, *joining])):
            batch = self.running_batches.get(key)
            if batch is None:
                try:
                    slots = {"capacity": self.max_batch_size} if key[0] in ONE_ENGINE else {}
                    batch = self.running_batches[key] = RUNNING[key[0]](self.bundle, dict(key[1]),
                                                                        on_step=self._running_event, **slots)
                except UnmaskError as e:  # the options failed the decoder's own validation
                    for j in joining.get(key, []):
                        j.finish("error", _bad_request(e, j.options))
                    continue
            try:
                for row in _drop(key, batch, lambda r: r.job.gone):
                    self._finish_gone(row.job)
                for job in joining.get(key, []):
                    self._join_running(batch, job)
                self.peak_running = max(self.peak_running, self.active)
                for row in batch.step():
                    row.job.finish("done", {"tokens": row.tokens, "nfe": row.nfe, "finish_reason": row.finish})
            except Exception:
                log.exception("a %s running batch failed", key[0])
                for j in [r.job for r in batch.rows]:
                    j.finish("error", ApiError(500, "internal error while decoding; see the server log",
                                               type="server_error"))
                _drop(key, batch, lambda r: True)
            if not len(batch):
                del self.running_batches[key]  # frees its cache; a new batch forms with the next request

    def _join_running(self, batch, job: Job) -> None:
        """Admit one job; a prefill that fails fails this request only."""
        try:
            for row in batch.join([job]):  # finished at its prefill (a stop token, max_tokens 1)
                row.job.finish("done", {"tokens": row.tokens, "nfe": row.nfe, "finish_reason": row.finish})
        except UnmaskError as e:
            job.finish("error", _bad_request(e, job.options))
        except Exception:
            log.exception("joining a %s running batch failed", job.decoder)
            job.finish("error", ApiError(500, "internal error while decoding; see the server log",
                                         type="server_error"))

    def _running_event(self, row, event: dict) -> None:
        if not (row.job.gone or row.job.closed):
            row.job.post("step", event)

    # -- every other decoder: one batch per decode call -----------------------------------------

    def _migrate(self, jobs: list[Job], committed: list[list[int]], steps: list[int]) -> None:
        """Move the open rows of a sized lossless sbd batch to the front of the queue, bound for the
        AR running batch, each with the tokens it committed so far (greedy lossless SBD commits
        exactly AR's tokens, so AR steps from there give the same answer). Runs when AR rows
        started beside the batch: a separate sbd batch would add its forwards to theirs, while the
        running batch serves every row with one forward. The batch's last forward is discarded
        (its events were not posted)."""
        moved = []
        for i, j in enumerate(jobs):
            if j.gone:
                self._finish_gone(j)
            elif not j.closed:
                j.resume, j.resume_nfe = committed[i], steps[i]
                moved.append(j)
        self.migrated_rows += len(moved)
        with self._lock:
            self._waiting.extendleft(reversed(moved))

    def _final(self, job: Job, canvas: list) -> tuple[list[int], str] | None:
        """(tokens, finish reason) when a row's committed canvas already fixes its answer: the
        committed prefix reaches a stop token, ``max_new_tokens`` or a stop string. Committed
        tokens are final in these decoders, and the output is that prefix (``_until_stop``)."""
        tokens = []
        for t in canvas[: job.max_new_tokens]:
            if t is None:
                return None
            if t in self.stop_ids:
                return tokens, "stop"
            tokens.append(t)
        if len(tokens) >= job.max_new_tokens:
            return tokens, "length"
        if job.stop and any(s in self.bundle.decode_continuation(job.prompt_ids, tokens) for s in job.stop):
            return tokens, "stop"
        return None

    def _run_batch(self, jobs: list[Job]) -> None:
        first = jobs[0]
        decode = get_decoder(first.decoder, self.bundle.kind)
        self.batch_rows, self._batch = {j.id: i for i, j in enumerate(jobs)}, jobs
        self.peak_running = max(self.peak_running, self.active)
        last_step = [None]
        steps = [0] * len(jobs)  # forwards in which each row had work (its step events)
        edits = edits_committed(self.bundle, first.decoder, first.options)

        committed = [[] for _ in jobs]  # each row's committed tokens after its last posted step

        def on_step(event: dict) -> None:
            if event["step"] != last_step[0]:  # a new forward of the batch: let the AR batch advance too
                last_step[0] = event["step"]
                self._interleave_ar()
                # AR rows run beside the batch, past the draft's crossover (the table gives K = 1 at
                # this load): one forward can serve every row. Only when every open row gets an AR
                # slot at once: a row left waiting in the queue would make no progress at all.
                open_rows = sum(not (j.gone or j.closed) for j in jobs)
                if (first.sizable and len(self.ar) and len(self.ar) + open_rows <= self.max_batch_size
                        and self.draft_sizes.size(len(self.ar) + open_rows) == 1):
                    raise _Migrate
            row = int(event["row"])
            job = jobs[row]
            if job.gone:
                self._finish_gone(job)
            elif not job.closed:
                job.post("step", event)
                steps[row] += 1
                committed[row] = list(itertools.takewhile(lambda t: t is not None, event["canvas"]))
                final = None if edits else self._final(job, event["canvas"])
                if final is not None:  # the answer cannot change any more: send it now
                    job.finish("done", {"tokens": final[0], "nfe": steps[row], "finish_reason": final[1]})
            if all(j.gone or j.closed for j in jobs):
                raise _Abandoned

        kwargs = dict(first.options)
        if "on_step" in inspect.signature(decode).parameters:
            kwargs["on_step"] = on_step
        if first.sizable:  # K from the load; at least 2 here (K = 1 jobs were routed to the AR batch)
            kwargs["block_size"] = max(2, self.draft_sizes.size(self._load(0)))
            self.draft_log.append((self._load(0), kwargs["block_size"]))
        if self.compile and "compile" in inspect.signature(decode).parameters:
            kwargs["compile"] = True  # static KV cache + compiled step; the AR running batch stays eager
        try:
            out = decode(self.bundle, [j.prompt_ids for j in jobs], max_new_tokens=first.max_new_tokens,
                         sampling=first.sampling, stop_token_ids=self.bundle.stop_token_ids,
                         stop_strings=first.stop, **kwargs)
        except _Abandoned:
            self.abandoned_batches += 1
            for j in jobs:
                self._finish_gone(j)
            return
        except _Migrate:
            self._migrate(jobs, committed, steps)
            return
        except UnmaskError as e:  # the decoder's own validation (block size, policy, ...): a bad request
            for j in jobs:
                j.finish("error", _bad_request(e, first.options))
            return
        except Exception:  # a bug fails this batch only; the AR batch and the queue keep going
            log.exception("decoding a %s batch failed", first.decoder)
            for j in jobs:
                j.finish("error", ApiError(500, "internal error while decoding; see the server log",
                                           type="server_error"))
            return
        finally:
            self.batch_rows, self._batch = {}, []
        for i, j in enumerate(jobs):
            if j.gone:
                self._finish_gone(j)
                continue
            toks = out.tokens[i]
            reason = "length" if len(toks) >= j.max_new_tokens else "stop"
            j.finish("done", {"tokens": toks, "nfe": int(out.stats.nfe_per_row[i]), "finish_reason": reason})
