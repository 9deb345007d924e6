"""The FastAPI app: OpenAI-compatible completions and chat, SSE streaming, health, metrics and the
playground page. Every request is handed to the :class:`~unmask.serve.engine.Scheduler`; its
events come back through an asyncio queue."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from unmask.decode import DECODERS, default_decoder, get_decoder
from unmask.errors import UnmaskError
from unmask.serve.draft_sizing import DEFAULT as DEFAULT_DRAFT_SIZES, DraftSizes, draft_sizes_option, served_table, with_server_draft
from unmask.serve.engine import Job, QueueFull, Scheduler, ShuttingDown
from unmask.serve.errors import ApiError
from unmask.serve.limits import Limits, check_defaults
from unmask.serve.metrics import Metrics
from unmask.serve.protocol import ServeRequest, edits_committed, parse
from unmask.serve.stream import TextStream

log = logging.getLogger("unmask.serve")
POLL_S = 0.2  # how often a waiting handler checks for a client disconnect
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
SHUTTING_DOWN = "the server is shutting down; retry later"


def _shutting_down(retry_after: bool = True) -> "ApiError":
    """The 503 of a draining server: new requests get Retry-After; the requests it ends do not."""
    return ApiError(503, SHUTTING_DOWN, type="server_error", headers={"Retry-After": "1"} if retry_after else None)
MAX_INT_DIGITS = 1000  # well below Python's int-string limit (4300) and far above any real count


class _Gone(Exception):
    """The client disconnected."""


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def outcome_of(status: int) -> str:
    """The ``unmask_requests_total`` outcome of a response with this HTTP status (README "Serving")."""
    if status < 400:
        return "ok"
    return {499: "cancelled", 408: "timeout", 429: "rejected"}.get(status, "bad_request" if status < 500 else "error")


class _CountResponses:
    """ASGI middleware: counts every response of the completion endpoints once, by the outcome the
    handler set in ``scope["state"]["outcome"]`` (a stream decides it at its end) or else by its
    status; a request that raised with no outcome set counts as ``error`` (the app answers it 500)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        endpoint = ENDPOINTS.get(scope.get("path")) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, send_status)
        except BaseException:
            failed = True
            raise
        finally:
            outcome = scope.get("state", {}).get("outcome") or ("error" if failed else outcome_of(status[0]))
            self.metrics.requests.labels(endpoint, outcome).inc()


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to pass ``limit`` bytes: from its
    Content-Length before reading, or while reading (a chunked body has none)."""
    too_big = ApiError(413, f"the request body is larger than this server's limit of {limit} bytes; send a smaller "
                            "body, or start the server with a larger --max-body-bytes", code="request_too_large")
    if (length := request.headers.get("content-length")) is not None and length.strip().isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:  # int() refuses it (Python's int-string limit): not a JSON error
        raise ApiError(400, f"the request body holds an integer of {len(text)} digits; numbers take at most "
                            f"{MAX_INT_DIGITS} digits")
    return int(text)


def _json(raw: bytes):
    try:
        return json.loads(raw, parse_int=_int)
    except RecursionError:  # e.g. 100,000 nested arrays: the parser's recursion limit
        raise ApiError(400, "the request body is nested too deeply; send a flat JSON object") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None


def create_app(bundle, *, model_name: str | None = None, max_batch_size: int = 8, max_queue: int = 64,
               request_timeout: float = 600.0, defaults: dict | None = None, compile: bool = False,
               draft_sizes: "str | DraftSizes | None" = DEFAULT_DRAFT_SIZES, limits: Limits | None = None,
               warmup: bool = False) -> FastAPI:
    """The server app for a loaded ModelBundle. ``defaults``: the server's default decoder and knobs
    (e.g. ``{"decoder": "sbd", "gamma": 0.35}``), checked here like a request; its ``draft``/``queries``
    become the lossless defaults, the layout AR and lossless rows join (``draft_sizing.with_server_draft``).
    The scheduler thread starts and stops with the app's lifespan (``app.state.scheduler``, ``.metrics``).
    Raises UnmaskError for a bad batch size, queue bound or default knob. ``compile``: the
    ar / lossless sbd batch on a static KV cache, compiled over row and length buckets. ``draft_sizes``:
    the load -> K table, chosen per step, of greedy lossless ``sbd`` requests that fix no block size
    (:mod:`unmask.serve.draft_sizing`; text like ``"1:8,2:4,4:1"``, or ``"off"``/None). ``limits``: the
    per-request body, prompt, query-token and cache limits (:class:`unmask.serve.limits.Limits`).
    ``app.state.drain()`` stops admitting (503) and ends every open request with a 503 error (a
    stream: a final error event and ``[DONE]``); the server calls it when it shuts down. ``warmup``: once
    started, one request of the default decoder runs and its step shapes compile
    (:func:`unmask.serve.warmup.warm_up`); until then ``/health`` answers 503 ``{"status": "warming up"}``."""
    limits, name, defaults = limits or Limits(), model_name or bundle.name, dict(defaults or {})
    bundle = with_server_draft(bundle, defaults.pop("draft", None), defaults.pop("queries", None))
    try:  # the defaults are checked like a request, then by one tiny decode (the decoder's own checks)
        probe = parse({"prompt": "x", "max_tokens": 1}, bundle, name, chat=False, default_timeout=request_timeout, defaults=defaults)
    except ApiError as e:
        raise UnmaskError(f"--{e.param.replace('_', '-')}: {e.message}" if e.param else e.message) from None  # CLI words
    get_decoder(probe.decoder, bundle.kind)(bundle, [probe.prompt_ids], max_new_tokens=1, sampling=probe.sampling,
                                            **probe.options)
    table = served_table(sizes := draft_sizes_option(draft_sizes), bundle)  # the served layout's rows -> K
    if table is not None and bundle.kind == "sbd":  # the table's largest K must decode here: checked now
        k = max(2, max(k for _, k in table.steps))
        try:
            get_decoder("sbd", bundle.kind)(bundle, [probe.prompt_ids], max_new_tokens=1, sampling=probe.sampling,
                                            verify=True, block_size=k)
        except UnmaskError as e:
            raise UnmaskError(f"--draft-sizes: K = {k} cannot decode on {name} ({str(e).splitlines()[0].split(';')[0]}); "
                              "lower the table's largest K") from None
    draft_k = max(k for _, k in table.steps) if table is not None and bundle.kind == "sbd" else 1
    check_defaults(bundle, limits, probe.decoder, probe.options, draft_k)  # a --draft over --max-query-tokens
    scheduler = Scheduler(bundle, max_batch_size=max_batch_size, max_queue=max_queue, compile=compile, draft_sizes=sizes)
    metrics = Metrics(scheduler)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        if warmup:
            threading.Thread(target=_warm_up, args=(app, scheduler, probe), name="unmask-warmup", daemon=True).start()
        try:
            yield
        finally:
            scheduler.close()

    app = FastAPI(title="unmask", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)  # /v1/completions/ is a 404 JSON error, not a redirect
    app.state.scheduler, app.state.metrics, app.state.bundle, app.state.limits = scheduler, metrics, bundle, limits
    app.add_middleware(_CountResponses, metrics=metrics)
    app.state.drain = lambda: scheduler.drain(_shutting_down(retry_after=False))
    app.state.probe = probe  # the default decoder's request: what the warm-up decodes
    app.state.warming = warmup  # /health: "warming up" (503) until the warm-up thread is done

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        return _error_response(ApiError(e.status_code, str(e.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _crash(request, e):
        return _error_response(ApiError(500, "internal server error; see the server log", type="server_error"))

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(resources.files("unmask.serve").joinpath("playground.html").read_text("utf-8"))

    @app.get("/health")
    async def health():
        if app.state.warming:
            return JSONResponse({"status": "warming up", "model": name, "pending_compiles": scheduler.pending_compiles,
                                 "compiling": scheduler.compiling}, status_code=503)
        return {"status": "ok", "model": name, "queue_depth": scheduler.queue_depth, "active": scheduler.active,
                "pending_compiles": scheduler.pending_compiles, "compiling": scheduler.compiling}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        decoders = [d.name for d in DECODERS.values() if bundle.kind in d.kinds]
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "unmask", "kind": bundle.kind,
                                            "decoders": decoders, "context_length": bundle.context_length,
                                            "default_decoder": defaults.get("decoder") or default_decoder(bundle.kind)}]}

    async def handle(request: Request, chat: bool):
        if scheduler.draining:
            raise _shutting_down()
        try:
            raw = await _read_body(request, limits.max_body_bytes)
        except ClientDisconnect:  # gone before its body arrived: nobody to answer
            return Response(status_code=499)
        # parsing and tokenizing are CPU work: off the event loop, so /health and streams go on
        body = await asyncio.to_thread(_json, raw)
        req = await asyncio.to_thread(parse, body, bundle, name, chat=chat, default_timeout=request_timeout,
                                      defaults=defaults, limits=limits, draft_k=draft_k)
        call = _Call(request, req, chat, name, bundle, scheduler, metrics, endpoint="chat" if chat else "completions")
        return await call.respond()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _warm_up(app, scheduler: Scheduler, probe) -> None:
    """The ``--warmup`` thread: :func:`unmask.serve.warmup.warm_up`, then ``/health`` reports ok (also
    after a failed warm-up, which is logged: the server still serves, compiling shapes when idle)."""
    from unmask.serve.warmup import warm_up

    try:
        warm_up(scheduler, probe)
    except Exception:  # noqa: BLE001
        log.exception("the warm-up request failed; serving without it")
    finally:
        app.state.warming = False


class _Call:
    """One request in flight: submits the job, waits for its events, builds the response."""

    def __init__(self, request: Request, req: ServeRequest, chat: bool, name: str, bundle, scheduler: Scheduler,
                 metrics: Metrics, endpoint: str):
        self.request, self.req, self.chat, self.name, self.scheduler = request, req, chat, name, scheduler
        self.metrics, self.endpoint = metrics, endpoint
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.stream = TextStream(bundle, req.prompt_ids, req.stop, limit=req.max_tokens,
                                 final_only=edits_committed(bundle, req.decoder, req.options))
        self.queue: asyncio.Queue = asyncio.Queue()
        self.t0 = time.monotonic()
        self.first_token_at: float | None = None
        self.counted = False
        self.check_at = self.t0 + POLL_S  # next client-disconnect check (next_event)
        loop = asyncio.get_running_loop()

        def post(kind, payload):  # called by the scheduler thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
            except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
                pass

        self.job = Job(prompt_ids=req.prompt_ids, decoder=req.decoder, options=req.options, sampling=req.sampling,
                       max_new_tokens=req.max_tokens, stop=req.stop, deadline=self.t0 + req.timeout, post=post)

    async def next_event(self) -> tuple[str, object]:
        """The job's next event; cancels the job and raises _Gone when the client disconnects.
        The disconnect is checked every POLL_S even while events keep coming (a non-streamed
        request's steps arrive faster than that: it would hold its slot to the end)."""
        while True:
            if time.monotonic() >= self.check_at:
                self.check_at = time.monotonic() + POLL_S
                if await self.request.is_disconnected():
                    self.job.cancel()
                    raise _Gone
            if not self.queue.empty():  # under load the next event is often here already: no timer, no task
                return self.queue.get_nowait()
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=POLL_S)
            except asyncio.TimeoutError:
                pass

    def outcome(self, outcome: str) -> None:
        """Set this response's outcome (the first one set wins; _CountResponses counts it)."""
        if not self.counted:
            self.counted = True
            self.request.scope.setdefault("state", {})["outcome"] = outcome

    def record(self, result: dict) -> dict:
        """Usage of a finished request; updates the metrics."""
        n, nfe = len(result["tokens"]), max(1, int(result["nfe"]))
        elapsed = time.monotonic() - self.t0
        m = self.metrics
        m.prompt_tokens.inc(len(self.req.prompt_ids))
        m.completion_tokens.inc(n)
        m.nfe.inc(nfe)
        m.tpf.observe(n / nfe)
        m.tps.observe(n / elapsed if elapsed > 0 else 0.0)
        m.latency.observe(elapsed)
        if self.first_token_at is not None:
            m.ttft.observe(self.first_token_at - self.t0)
        self.outcome("ok")
        return {"prompt_tokens": len(self.req.prompt_ids), "completion_tokens": n,
                "total_tokens": len(self.req.prompt_ids) + n, "nfe": nfe, "tpf": n / nfe}

    def saw_step(self, event: dict) -> None:
        if self.first_token_at is None and event.get("positions"):
            self.first_token_at = time.monotonic()

    async def respond(self):
        try:
            self.scheduler.submit(self.job)
        except ShuttingDown:
            return _error_response(_shutting_down())
        except QueueFull:
            self.outcome("rejected")
            return _error_response(ApiError(
                429, f"the server queue is full ({self.scheduler.max_queue} requests waiting); retry shortly",
                type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}))
        try:
            first = await self.next_event()
        except _Gone:
            self.outcome("cancelled")
            return Response(status_code=499)
        except BaseException:
            self.job.cancel()
            raise
        if first[0] == "error":
            self.outcome(outcome_of(first[1].status))
            return _error_response(first[1])
        if self.req.stream:
            return StreamingResponse(self.sse(first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self.whole(first)

    async def whole(self, event):
        """A non-streamed answer: wait for the result."""
        try:
            while event[0] == "step":
                self.saw_step(event[1])
                event = await self.next_event()
        except _Gone:
            self.outcome("cancelled")
            return Response(status_code=499)
        except BaseException:
            self.job.cancel()
            raise
        kind, payload = event
        if kind == "error":
            self.outcome(outcome_of(payload.status))
            return _error_response(payload)
        if kind == "cancelled":
            self.outcome("cancelled")
            return Response(status_code=499)
        text = self.stream.finish(payload["tokens"])
        usage = self.record(payload)
        reason = payload["finish_reason"]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.name,
                    "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.name,
                "choices": [choice], "usage": usage}

    def chunk(self, delta: str | None, *, reason: str | None = None, role: bool = False, **extra) -> str:
        if self.chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            obj = "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.name, "choices": [choice], **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def sse(self, event):
        """Server-sent events: text deltas (and canvases in canvas mode), usage in the last chunk."""
        canvas = self.req.stream_mode == "canvas"
        try:
            if self.chat:
                yield self.chunk(None, role=True)
            while True:
                kind, payload = event
                if kind == "step":
                    self.saw_step(payload)
                    delta = self.stream.update(payload["canvas"])
                    if canvas:
                        yield self.chunk(delta, unmask=self.stream.canvas(payload))
                    elif delta:
                        yield self.chunk(delta)
                elif kind == "done":
                    delta = self.stream.finish(payload["tokens"])
                    usage = self.record(payload)
                    yield self.chunk(delta, reason=payload["finish_reason"], usage=usage)
                    yield "data: [DONE]\n\n"
                    return
                elif kind == "error":
                    self.outcome(outcome_of(payload.status))
                    yield f"data: {json.dumps(payload.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                else:  # cancelled
                    self.outcome("cancelled")
                    return
                event = await self.next_event()
        except _Gone:
            self.outcome("cancelled")
        finally:  # also reached when the server cancels the stream because the client went away
            if not self.job.closed:
                self.job.cancel()
            if not self.counted:
                self.outcome("cancelled")
