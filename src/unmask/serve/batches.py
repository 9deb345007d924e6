"""The scheduler's running batches: which one a request joins, building them from the registry,
admitting rows and stepping each batch once per pass (DESIGN.md "One engine").

A request's running batch is keyed by its decoder's config (:meth:`Config.batch_key`): requests with
equal keys share one batch, built by the decoder's :attr:`Spec.batch` from the first one's config;
None runs it per call (:mod:`unmask.serve.per_call`). The key ``("verify", draft layout)`` is the AR /
lossless SBD batch of that layout (:class:`~unmask.decode.verify.batch.Verify`), which stays special:
its rows take their draft size K from the load (:mod:`unmask.serve.draft_sizing`), at most
MAX_LAYOUTS such batches at once. Idle batches on a static cache (``compile``) are kept, the last
MAX_LAYOUTS joined; others are freed once empty.
"""

from __future__ import annotations

import logging
import time

from unmask.decode import DECODERS, Config
from unmask.decode.verify.batch import Verify
from unmask.decode.verify.serving import for_layout
from unmask.decode.verify.config import default_layout
from unmask.errors import UnmaskError
from unmask.serve import per_call
from unmask.serve.errors import ApiError
from unmask.serve.jobs import Job, bad_request, finish_gone, server_error
from unmask.trace import TokenStep

log = logging.getLogger("unmask.serve")
MAX_LAYOUTS = 4  # AR / lossless batches (one per draft layout) at once: each holds its layout's step tables


def _rows(batch) -> list:
    return list(batch.rows.values()) if isinstance(batch.rows, dict) else list(batch.rows)


def _done(row, bundle) -> None:
    """Answer a finished row: ``("done", result)``, or for ``finish == "error"`` (its grammar allowed no
    token) a 400 ``grammar_dead_end`` (README "Serving")."""
    reason = row.finish
    if reason == "error" or getattr(row, "error", None):  # a failed grammar row may have ended on EOS: no answer
        row.job.finish("error", grammar_dead_end(row))
        return
    if reason == "length" and per_call.stopped(bundle, row.job, row.tokens):  # a canvas that filled at once
        reason = "stop"  # the text is cut at the stop string, so the answer ended there, not at the length
    asked = {} if row.job.logprobs is None else {"logprobs": row.logprobs}
    row.job.finish("done", {"tokens": row.tokens, "nfe": row.nfe, "finish_reason": reason,
                            "stop_token": row.stop_token, **asked})


def grammar_dead_end(row) -> ApiError:
    """The 400 of a row whose grammar allowed no next token (``row.error`` says why)."""
    return ApiError(400, row.error or f"the grammar allows no token after {len(row.tokens)} generated tokens; check "
                                      "the grammar", code="grammar_dead_end",
                    param=row.job.grammar_field)


def _post_logprobs(row) -> None:
    """Send the logprobs its row recorded since the last ones (a streamed answer carries them beside the text)."""
    job, got = row.job, row.logprobs or ()
    n = min(len(got), len(row.tokens))  # a prefix aligned with row.tokens (Row's contract)
    if job.logprobs is not None and n > job.logprobs_posted:
        job.post("logprobs", list(got[job.logprobs_posted:n]))
        job.logprobs_posted = n


class RunningBatches:
    """The :class:`~unmask.serve.engine.Scheduler`'s running batches (a base class: it reads the
    scheduler's ``bundle``, ``compile``, ``max_batch_size``, ``sizer``, ``_waiting`` and
    ``_paused``). ``verify``: draft layout -> the AR / lossless batch; ``running_batches``: key -> the
    other decoders' batches."""

    @property
    def ar(self) -> Verify:
        """The running batch AR requests join (the checkpoint's default draft layout)."""
        return self._verify_batch(default_layout(self.bundle))

    def _verify_batch(self, draft: str, fresh: bool = False) -> Verify:
        if fresh or draft not in self.verify:  # fresh: replaced in one assignment (readers never see none)
            self.verify[draft] = for_layout(self.bundle, draft, capacity=self.max_batch_size, compile=self.compile,
                                            smaller=self.sizer.smaller(draft), on_step=self._event,
                                            on_token=self._ar_token, suffix_cache=self.suffix_cache,
                                            tally=self.draft_tally)
        return self.verify[draft]

    def _batches(self) -> list:
        return list(self.verify.values()) + list(self.running_batches.values())

    def _running_jobs(self) -> list[Job]:
        return [r.job for b in self._batches() for r in _rows(b)]

    def _running_key(self, job: Job) -> tuple[tuple | None, Config | None]:
        """(the key of the running batch ``job`` joins, the config that batch is built from), or
        (None, None) when it runs per call (also for options its decoder refuses: its decode call
        reports them)."""
        spec = DECODERS.get(job.decoder)
        if spec is None:
            return None, None  # its decode call reports the unknown name
        try:
            cfg = spec.config.of(job.options, spec.name)
            key = cfg.batch_key(self.bundle, job.max_new_tokens)
            if key is not None and not (isinstance(key, tuple) and key):
                raise TypeError(f"batch_key returned {type(key).__name__}, not a tuple or None")
            hash(key)  # the loop keys its batches by it: an unhashable key would fail every pass
            return key, cfg
        except UnmaskError:
            return None, None
        except Exception as e:  # noqa: BLE001 (a plug-in's batch_key: its request runs per call, the others go on)
            log.warning("decoder %r: its config's batch_key failed (%s: %s); the request runs on its own", spec.name,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None, None

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

    def _new_batch(self, key: tuple, job: Job):
        """The running batch of ``key``, built by ``job``'s decoder from its config."""
        spec = DECODERS[job.decoder]
        return spec.batch(self.bundle, job.config, capacity=self.max_batch_size,
                          compile=spec.compiles and self.compile, on_step=self._event, on_token=self._ar_token,
                          stop_token_ids=tuple(self.bundle.stop_token_ids))

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
                    batch = self.running_batches[key] = self._new_batch(key, jobs[0])
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
                for row in batch.drop([r.job.id for r in _rows(batch) if r.job.gone]):
                    finish_gone(row.job)
                if key[0] == "verify":
                    self._join_verify(batch, key[1], jobs)
                else:
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

    def _join_verify(self, batch: Verify, draft: str, jobs: list[Job]) -> None:
        """Admit ``jobs`` (grouped by draft size and model-free draft source: one prefill each) and give
        sizable rows the table's K at the new load."""
        # sized before the prefill, so the log's entry precedes the joining rows' events
        sized = self.sizer.size(draft, len(batch) + len(jobs), any(j.sizable for j in jobs), batch)
        by_k: dict[tuple, list[Job]] = {}
        for job in jobs:
            try:
                K = self.sizer.block_size(job, sized)
                drafts = job.config.host_drafts(self.bundle.device, K) if hasattr(job.config, "host_drafts") else None
                by_k.setdefault((K, drafts), []).append(job)
            except UnmaskError as e:
                job.finish("error", bad_request(e, job.options))
        for (K, drafts), group in by_k.items():
            self._join(batch, group, block_size=K, drafts=drafts)
        self.sizer.resize(batch, draft)

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
            _post_logprobs(row)
            row.job.post("step", event)

    def _ar_token(self, row) -> None:
        if not (row.job.events or row.job.gone or row.job.closed):  # O(1): the reader copies the canvas
            _post_logprobs(row)
            row.job.post("step", TokenStep(row.tokens, len(row.tokens)))


