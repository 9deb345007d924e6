"""The FastAPI app: OpenAI-compatible completions and chat, SSE streaming, health, metrics and the
playground page, and the API key check (:mod:`unmask.serve.auth`). Every request is parsed here and
handed to a :class:`~unmask.serve.call.Call`, which runs it on the
:class:`~unmask.serve.engine.Scheduler` and shapes the OpenAI response."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from unmask.decode import DECODERS, default_decoder, spec_for
from unmask.decode.choice import default_for
from unmask.decode.verify.config import default_layout
from unmask.errors import UnmaskError
from unmask.serve.auth import RequireKey, check_key
from unmask.serve.draft_sizing import (DEFAULT as DEFAULT_DRAFT_SIZES, DraftSizes, draft_sizes_option, table_for,
                                       with_server_draft)
from unmask.serve.call import Call, error_response, outcome_of
from unmask.serve.engine import DEFAULT_SUFFIX_TOKENS, Scheduler
from unmask.serve.errors import ApiError
from unmask.serve.jobs import shutting_down
from unmask.serve.limits import Limits, check_batch_memory, check_defaults
from unmask.serve.metrics import Metrics
from unmask.serve.protocol import parse, prompt_bodies
from unmask.serve.warmup import warm_up

log = logging.getLogger("unmask.serve")
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
# the page's icon (browsers ask for /favicon.ico on their own): a masked slot turning into a token
FAVICON = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" '
           'fill="#1d1d1f"/><rect x="3" y="5" width="4" height="6" fill="#bbb"/><rect x="9" y="5" width="4" '
           'height="6" fill="#5ad16b"/></svg>')
MAX_INT_DIGITS = 1000  # well below Python's int-string limit (4300) and far above any real count


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

        outcome = "error"  # unless it returns
        try:
            await self.app(scope, receive, send_status)
            outcome = outcome_of(status[0])
        finally:
            self.metrics.requests.labels(endpoint, scope.get("state", {}).get("outcome") or outcome).inc()


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to pass ``limit`` bytes: from its
    Content-Length before reading, or while reading (a chunked body has none)."""
    too_big = ApiError(413, f"the request body is larger than this server's limit of {limit} bytes; send a smaller "
                            "body, or start the server with a larger --max-body-bytes", code="request_too_large")
    if (length := request.headers.get("content-length")) is not None and length.strip().isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    return bytes(body)


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


def _parse_all(bodies: list, *args, **kwargs) -> list:
    """``parse`` of each prompt's body; an error about one prompt of several names its index."""
    reqs = []
    for i, body in enumerate(bodies):
        try:
            reqs.append(parse(body, *args, **kwargs))
        except ApiError as e:
            if len(bodies) == 1 or e.param != "prompt":
                raise
            raise ApiError(e.status, f"prompt[{i}]: {e.message}", type=e.type, param=e.param, code=e.code) from None
    return reqs


def create_app(bundle, *, model_name: str | None = None, max_batch_size: int = 8, max_queue: int = 64,
               request_timeout: float = 600.0, defaults: dict | None = None, compile: bool = False,
               draft_sizes: "str | DraftSizes | None" = DEFAULT_DRAFT_SIZES, limits: Limits | None = None,
               api_key: str | None = None, warmup: bool = False, suffix_cache_tokens: int = DEFAULT_SUFFIX_TOKENS) -> FastAPI:
    """The server app for a loaded ModelBundle. ``defaults``: the server's default decoder and knobs
    (e.g. ``{"decoder": "sbd", "gamma": 0.35}``), checked here like a request; without a decoder, that of
    :func:`unmask.decode.choice.default_for` (``ar`` for an SBD model whose lossless SBD is expected
    slower here, ``app.state.default_note`` then saying so); its ``draft``/``queries``
    become the lossless defaults, the layout AR and lossless rows join (``draft_sizing.with_server_draft``).
    The scheduler thread starts and stops with the app's lifespan (``app.state.scheduler``, ``.metrics``).
    Raises UnmaskError for a bad batch size, queue bound or default knob. ``compile``: the
    ar / lossless sbd batch on a static KV cache, compiled over row and length buckets. ``draft_sizes``:
    the load -> K table, chosen per step, of greedy lossless ``sbd`` requests that fix no block size
    (:mod:`unmask.serve.draft_sizing`; text like ``"1:8,2:4,4:1"``, or ``"off"``/None). ``limits``: the
    per-request body, prompt, query-token and cache limits (:class:`unmask.serve.limits.Limits`).
    ``api_key``: requests must send ``Authorization: Bearer api_key`` (401 otherwise; /health, /metrics
    and the playground stay open: :mod:`unmask.serve.auth`).
    ``app.state.drain()`` stops admitting (503) and ends every open request with a 503 error (a
    stream: a final error event and ``[DONE]``); the server calls it when it shuts down. ``warmup``: once
    started, one request of the default decoder runs and its step shapes compile
    (:func:`unmask.serve.warmup.warm_up`); until then ``/health`` answers 503 ``{"status": "warming up"}``.
    ``suffix_cache_tokens``: the bound of the suffix-decoding cache of recent requests (0: none;
    :class:`~unmask.serve.engine.Scheduler`)."""
    limits, name, defaults = limits or Limits(), model_name or bundle.name, dict(defaults or {})
    key = check_key(api_key)
    chosen = default_for(bundle, defaults) if defaults.get("decoder") is None else None  # README "Serving"
    if chosen is not None and chosen.decoder != default_decoder(bundle.kind):
        defaults["decoder"] = chosen.decoder  # lossless sbd expected slower than ar on this device
    bundle = with_server_draft(bundle, defaults.pop("draft", None), defaults.pop("queries", None))
    try:  # the defaults are checked like a request, then by one tiny decode (the decoder's own checks)
        probe = parse({"prompt": "x", "max_tokens": 1}, bundle, name, chat=False, default_timeout=request_timeout, defaults=defaults)
    except ApiError as e:
        raise UnmaskError(f"--{e.param.replace('_', '-')}: {e.message}" if e.param else e.message) from None  # CLI words
    spec_for(probe.decoder, bundle.kind).decode(bundle, [probe.prompt_ids], max_new_tokens=1, sampling=probe.sampling,
                                                **probe.options)
    sizes = draft_sizes_option(draft_sizes)
    table = table_for(sizes, default_layout(bundle), bundle.meta.get("decode_defaults"))  # the default layout's
    draft_k = 1
    if table is not None and bundle.kind == "sbd":  # the table's largest K must decode here: checked now
        draft_k = max(k for _, k in table.steps)  # the largest K a lossless request may get
        k = max(2, draft_k)
        try:
            spec_for("sbd", bundle.kind).decode(bundle, [probe.prompt_ids], max_new_tokens=1, sampling=probe.sampling,
                                                verify=True, block_size=k)
        except UnmaskError as e:
            raise UnmaskError(f"--draft-sizes: K = {k} cannot decode on {name} ({str(e).splitlines()[0].split(';')[0]}); "
                              "lower the table's largest K") from None
    check_defaults(bundle, limits, probe.decoder, probe.options, draft_k)  # a --draft over --max-query-tokens
    check_batch_memory(bundle, limits, max_batch_size)  # a batch that cannot fit: refused before it allocates
    scheduler = Scheduler(bundle, max_batch_size=max_batch_size, max_queue=max_queue, compile=compile, draft_sizes=sizes,
                          suffix_cache_tokens=suffix_cache_tokens)
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
    app.state.default_note = chosen and chosen.note  # one line for the server's stderr, or None
    app.add_middleware(_CountResponses, metrics=metrics)
    if key is not None:  # added last, so it runs first: a refused request reaches nothing else
        app.add_middleware(RequireKey, key=key)
    app.state.drain = lambda: scheduler.drain(shutting_down(retry_after=False))
    app.state.probe = probe  # the default decoder's request: what the warm-up decodes
    app.state.warming = warmup  # /health: "warming up" (503) until the warm-up thread is done

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        return error_response(ApiError(e.status_code, str(e.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _crash(request, e):
        return error_response(ApiError(500, "internal server error; see the server log", type="server_error"))

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(resources.files("unmask.serve").joinpath("playground.html").read_text("utf-8"))

    @app.get("/favicon.ico")
    async def favicon():
        return Response(FAVICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    @app.get("/health")
    async def health():
        if app.state.warming:
            return JSONResponse({"status": "warming up", "model": name, "pending_compiles": scheduler.pending_compiles,
                                 "compiling": scheduler.compiling}, status_code=503)
        body = {"status": "ok", "model": name, "queue_depth": scheduler.queue_depth, "active": scheduler.active,
                "pending_compiles": scheduler.pending_compiles, "compiling": scheduler.compiling}
        if (fault := scheduler.fault()) is not None:  # the watchdog: "dead" or "wedged", never "ok"
            return JSONResponse({**body, "status": fault[0], "error": fault[1]}, status_code=503)
        return body

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        decoders = [d.name for d in DECODERS.values() if bundle.kind in d.kinds]
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "unmask", "kind": bundle.kind,
                                            "decoders": decoders, "context_length": bundle.context_length,
                                            "default_decoder": defaults.get("decoder") or default_decoder(bundle.kind)}]}

    async def handle(request: Request, chat: bool):
        if scheduler.draining:
            raise shutting_down()
        try:
            raw = await _read_body(request, limits.max_body_bytes)
        except ClientDisconnect:  # gone before its body arrived: nobody to answer
            return Response(status_code=499)
        # parsing and tokenizing are CPU work: off the event loop, so /health and streams go on
        body = await asyncio.to_thread(_json, raw)
        reqs = await asyncio.to_thread(_parse_all, prompt_bodies(body, chat=chat, max_prompts=max_queue), bundle, name,
                                       chat=chat, default_timeout=request_timeout, defaults=defaults, limits=limits,
                                       draft_k=draft_k)
        if (jobs := sum(r.n for r in reqs)) > max_queue:  # each choice is a job: they could never all queue
            raise ApiError(400, f"the request asks for {jobs} choices (prompts x n), more than the {max_queue} requests "
                                "this server queues; lower n or send fewer prompts", param="n")
        return await Call(request, reqs, chat, name, bundle, scheduler, metrics).respond()

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
    try:
        warm_up(scheduler, probe)
    except Exception:  # noqa: BLE001
        log.exception("the warm-up request failed; serving without it")
    finally:
        app.state.warming = False
