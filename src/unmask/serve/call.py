"""One completion request in flight: its jobs, their events, and the OpenAI-shaped response.

Each choice is one job: a chat request, or a completions request with one prompt, has ``n`` (default
1); a completions request whose ``prompt`` is a list has ``n`` per prompt, run side by side in the
scheduler's batches (each equals that prompt sent alone). Choices are indexed ``prompt * n + i`` as
OpenAI does; choice i of a sampled request draws with the generator ``Sampling.row_generators([prompt] *
n)`` gives row i (reproducible with a seed, independent of the others). ``usage`` sums the choices'
(``tpf``: their committed tokens over their forwards), and a streamed answer interleaves the choices'
chunks, each carrying its ``index``. With ``echo`` a completion's text starts with its prompt (a
streamed one: the prompt is the first chunk of its index). With ``logprobs`` each choice carries them
(:mod:`unmask.serve.logprobs`). The events of every job come back through one asyncio queue as
``(index, kind, payload)``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from unmask.serve.engine import Scheduler
from unmask.serve.errors import ApiError
from unmask.serve.jobs import Job, QueueFull, ShuttingDown, shutting_down
from unmask.serve.logprobs import ChoiceLogprobs
from unmask.serve.metrics import Metrics
from unmask.serve.protocol import ServeRequest
from unmask.serve.stream import TextStream, edits_committed

POLL_S = 0.2  # how often a waiting handler checks for a client disconnect


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def outcome_of(status: int) -> str:
    """The ``unmask_requests_total`` outcome of a response with this HTTP status (README "Serving")."""
    if status < 400:
        return "ok"
    return {499: "cancelled", 408: "timeout", 429: "rejected"}.get(status, "bad_request" if status < 500 else "error")


class _Gone(Exception):
    """The client disconnected."""


class _Part:
    """One choice of a request: its job, its text stream, its logprobs and, once done, its usage."""

    def __init__(self, index: int, req: ServeRequest, bundle, t0: float, post, *, chat: bool, generator=None,
                 group=None):
        self.index, self.req = index, req
        self.stream = TextStream(bundle, req.prompt_ids, req.stop, limit=req.max_tokens,
                                 final_only=edits_committed(bundle, req.decoder, req.options))
        self.logprobs = None if req.logprobs is None else ChoiceLogprobs(bundle, req.prompt_ids, chat,
                                                                         self.stream.token_text)
        self.job = Job(prompt_ids=req.prompt_ids, decoder=req.decoder, options=req.options, sampling=req.sampling,
                       max_new_tokens=req.max_tokens, stop=req.stop, deadline=t0 + req.timeout,
                       post=lambda kind, payload: post(index, kind, payload), generator=generator,
                       logprobs=req.logprobs, logit_bias=req.logit_bias, grammar=req.grammar, group=group,
                       grammar_field=req.grammar_field)
        self.first_token_at: float | None = None
        self.usage: dict | None = None  # set when done
        self.canvas: list = []  # the last step's canvas

    def saw_step(self, event: dict) -> None:
        if self.first_token_at is None and event.get("positions"):
            self.first_token_at = time.monotonic()

    def shown(self, canvas_mode: bool) -> list:
        """The committed ids whose text a committed-mode stream may send now: with logprobs from the verify
        batch (reported as it commits, sometimes just after the step's event), those whose logprobs came,
        so every chunk carries the logprobs of its own text; otherwise the whole canvas (a canvas decoder's
        logprobs come with the last chunk)."""
        if self.logprobs is None or canvas_mode or (self.job.running_key or ("",))[0] != "verify":
            return self.canvas
        return self.canvas[: len(self.logprobs.entries)]


class Call:
    """One request in flight (see the module docstring): submits its jobs, waits for their events,
    builds the response. ``reqs``: one validated request per prompt (a chat request has one), each
    giving ``req.n`` choices."""

    def __init__(self, request: Request, reqs: list[ServeRequest], chat: bool, name: str, bundle,
                 scheduler: Scheduler, metrics: Metrics):
        self.request, self.chat, self.name, self.scheduler, self.metrics = request, chat, name, scheduler, metrics
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.t0 = time.monotonic()
        self.counted = False
        self.check_at = self.t0 + POLL_S  # next client-disconnect check (next_event)
        self.stream_mode, self.streamed = reqs[0].stream_mode, reqs[0].stream
        loop = asyncio.get_running_loop()

        def post(index, kind, payload):  # called by the scheduler thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, kind, payload))
            except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
                pass

        self.parts = []
        for p, req in enumerate(reqs):
            gens = req.sampling.row_generators([req.prompt_ids] * req.n, bundle.device) or [None] * req.n
            self.parts += [_Part(p * req.n + i, req, bundle, self.t0, post, chat=chat, generator=gen, group=self.id)
                           for i, gen in enumerate(gens)]

    def cancel(self) -> None:
        for part in self.parts:
            if not part.job.closed:
                part.job.cancel()

    async def next_event(self) -> tuple[int, str, object]:
        """The next event of any job; cancels them all and raises _Gone when the client disconnects.
        The disconnect is checked every POLL_S even while events keep coming (a non-streamed
        request's steps arrive faster than that: it would hold its slots to the end)."""
        while True:
            if time.monotonic() >= self.check_at:
                self.check_at = time.monotonic() + POLL_S
                if await self.request.is_disconnected():
                    self.cancel()
                    raise _Gone
                for part in self.parts:  # a job the scheduler thread cannot answer (ended, or held too long)
                    if (error := self.scheduler.unanswered(part.job)) is not None:
                        self.cancel()
                        return part.index, "error", error
            if not self.queue.empty():  # under load the next event is often here already: no timer, no task
                return self.queue.get_nowait()
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=POLL_S)
            except asyncio.TimeoutError:
                pass

    def failed(self, error: ApiError) -> Response:
        """Cancel every job and answer ``error`` (a job's error event or a refusal)."""
        self.cancel()
        self.outcome(outcome_of(error.status))
        return error_response(error)

    def gone(self) -> Response:
        """The client disconnected or a job was cancelled: 499, every job cancelled."""
        self.cancel()
        self.outcome("cancelled")
        return Response(status_code=499)

    def outcome(self, outcome: str) -> None:
        """Set this response's outcome (the first one set wins; the app's middleware counts it)."""
        if not self.counted:
            self.counted = True
            self.request.scope.setdefault("state", {})["outcome"] = outcome

    def record(self, part: _Part, result: dict) -> None:
        """Usage of a finished prompt (``part.usage``); updates the metrics."""
        n, nfe = len(result["tokens"]), max(1, int(result["nfe"]))
        stop = int(result.get("stop_token", 0))
        elapsed = time.monotonic() - self.t0
        m = self.metrics
        prompt = len(part.req.prompt_ids) if part.index % part.req.n == 0 else 0  # n choices: the prompt counts once
        m.prompt_tokens.inc(prompt)
        m.completion_tokens.inc(n)
        m.nfe.inc(nfe)
        m.tpf.observe((n + stop) / nfe)  # a committed stop token counts (DecodeStats' rule)
        m.tps.observe(n / elapsed if elapsed > 0 else 0.0)
        m.latency.observe(elapsed)
        if part.first_token_at is not None:
            m.ttft.observe(part.first_token_at - self.t0)
        part.usage = {"prompt_tokens": prompt, "completion_tokens": n, "nfe": nfe, "stop": stop}

    def usage(self) -> dict:
        """The request's usage: the prompts' summed (each prompt once, whatever its ``n``: OpenAI's count), the
        choices' completions summed; ``tpf`` = committed tokens (stop tokens included) over forwards."""
        parts = [p.usage for p in self.parts]
        prompt, n = sum(u["prompt_tokens"] for u in parts), sum(u["completion_tokens"] for u in parts)
        nfe = sum(u["nfe"] for u in parts)
        self.outcome("ok")
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n, "nfe": nfe,
                "tpf": (n + sum(u["stop"] for u in parts)) / nfe}

    async def respond(self):
        try:
            for i, part in enumerate(self.parts):
                self.scheduler.submit(part.job)
        except (ShuttingDown, QueueFull) as e:
            for part in self.parts[:i]:
                part.job.cancel()
            if isinstance(e, ShuttingDown):
                return error_response(shutting_down())
            self.outcome("rejected")
            return error_response(ApiError(
                429, f"the server queue is full ({self.scheduler.max_queue} requests waiting); retry shortly",
                type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}))
        try:  # a disconnect answers 499; anything else cancels every job first
            first = await self.next_event()
            if self.streamed and first[1] != "error":  # an error before any chunk: a plain error response
                return StreamingResponse(self.sse(first), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return await self.whole(first)
        except _Gone:
            return self.gone()
        except BaseException:
            self.cancel()
            raise

    async def whole(self, event):
        """A non-streamed answer: wait for every prompt's result (a disconnect raises _Gone to
        :meth:`respond`)."""
        choices: dict[int, dict] = {}
        while True:
            index, kind, payload = event
            part = self.parts[index]
            if kind == "step":
                part.saw_step(payload)
            elif kind == "done":
                text = (part.req.prompt if part.req.echo else "") + part.stream.finish(payload["tokens"])
                reason = payload["finish_reason"]
                self.record(part, payload)
                lp = part.logprobs and part.logprobs.whole(payload.get("logprobs"))
                choices[index] = ({"index": index, "message": {"role": "assistant", "content": text},
                                   "logprobs": lp, "finish_reason": reason} if self.chat else
                                  {"index": index, "text": text, "finish_reason": reason, "logprobs": lp})
                if len(choices) == len(self.parts):
                    break
            elif kind == "logprobs":
                part.logprobs.add(payload)
            elif kind == "error":
                return self.failed(payload)
            else:  # cancelled
                return self.gone()
            event = await self.next_event()
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.name, "choices": [choices[i] for i in range(len(self.parts))], "usage": self.usage()}

    def chunk(self, index: int, delta: str | None, *, reason: str | None = None, role: bool = False,
              logprobs: dict | None = None, **extra) -> str:
        if self.chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": delta or "", "finish_reason": reason, "logprobs": logprobs}
            obj = "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.name, "choices": [choice], **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def sse(self, event):
        """Server-sent events: text deltas (and canvases in canvas mode), per choice index, each with the
        logprobs of the tokens whose text it completes (:class:`ChoiceLogprobs`); the usage rides on the
        last choice's final chunk."""
        canvas, left = self.stream_mode == "canvas", len(self.parts)
        try:
            for part in self.parts:
                if self.chat:
                    yield self.chunk(part.index, None, role=True)
                if part.req.echo:
                    yield self.chunk(part.index, part.req.prompt)
            while True:
                index, kind, payload = event
                part = self.parts[index]
                if kind in ("step", "logprobs"):
                    if kind == "step":
                        part.saw_step(payload)
                        part.canvas = payload["canvas"]
                    else:
                        part.logprobs.add(payload)
                    delta = part.stream.update(part.shown(canvas))
                    if (canvas and kind == "step") or delta:
                        lp = part.logprobs and part.logprobs.upto(len(part.stream.sent))
                        yield self.chunk(index, delta, logprobs=lp,
                                         **({"unmask": part.stream.canvas(payload)} if canvas and kind == "step" else {}))
                elif kind == "done":
                    delta = part.stream.finish(payload["tokens"])
                    self.record(part, payload)
                    left -= 1
                    usage = {"usage": self.usage()} if not left else {}
                    lp = part.logprobs and part.logprobs.rest(payload.get("logprobs"))
                    yield self.chunk(index, delta, reason=payload["finish_reason"], logprobs=lp, **usage)
                    if not left:
                        yield "data: [DONE]\n\n"
                        return
                elif kind == "error":
                    self.cancel()
                    self.outcome(outcome_of(payload.status))
                    yield f"data: {json.dumps(payload.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                else:  # cancelled: answered below
                    return
                event = await self.next_event()
        except _Gone:
            pass
        finally:  # also reached when the server cancels the stream because the client went away
            self.cancel()
            self.outcome("cancelled")  # unless an outcome was set
