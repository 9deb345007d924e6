"""Running the app with uvicorn: in the foreground (``unmask serve``) or in a background thread on
an already bound loopback socket (tests, ``benchmarks/serve_load.py``)."""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import threading
import time

from unmask.errors import UnmaskError
from unmask.models import load
from unmask.serve import connection, create_app, require
from unmask.serve.auth import check_key
from unmask.serve.draft_sizing import DEFAULT as DEFAULT_DRAFT_SIZES, DraftSizes, check_server_draft, draft_sizes_option
from unmask.serve.limits import Limits

GRACE_S = 5  # seconds open connections get to finish after the drain
EXIT_WATCHDOG_S = 20  # a foreground server that has not exited this long after a signal is ended hard


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket. Its protocol is IPPROTO_TCP, not 0: accepted sockets copy it, and asyncio
    sets TCP_NODELAY only on sockets that name it. Without that, Nagle's algorithm held every streamed
    chunk after the response headers until the client's delayed ACK (~40 ms a response)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UnmaskError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port or --host") from None
    sock.listen(2048)
    return sock


def _server(app, sock: socket.socket, log_level: str, watchdog: bool = False):
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server, draining the app before it closes connections: new requests get 503
        and every open request ends with a 503 error (a stream: a final SSE error event and
        ``[DONE]``), so connections finish within the grace time instead of being cut.
        ``signal``: the first SIGINT/SIGTERM received (None: stopped otherwise)."""

        signal: int | None = None

        def handle_exit(self, sig, frame):
            if self.signal is None:
                self.signal = sig
                if watchdog:  # whatever still runs (a long forward, a stuck client), exit in bounded time
                    code = 128 + int(sig)
                    t = threading.Timer(EXIT_WATCHDOG_S, lambda: (print("interrupted", file=sys.stderr, flush=True),
                                                                  os._exit(code)))
                    t.daemon = True
                    t.start()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            drain = getattr(app.state, "drain", None)
            if drain is not None:
                drain()
            await super().shutdown(sockets)

    connection.quiet_accept_errors()
    config = uvicorn.Config(connection.framed(app), http=connection.protocol_class(), log_level=log_level,
                            lifespan="on", timeout_graceful_shutdown=GRACE_S)
    return _Server(config)


def url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ServerThread:
    """A server in a background thread on ``host`` and a free port (``port=0``).

    ``url`` is ``http://host:port``; ``stop()`` shuts it down and joins the thread. Raises
    UnmaskError when the server does not start within ``start_timeout`` seconds."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 start_timeout: float = 30.0):
        require()
        self.app = app
        self.sock = _bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = url(host, self.port)
        self.server = _server(app, self.sock, log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="unmask-uvicorn")
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise UnmaskError("the server did not start; see the log above")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(model: str | None = None, *, kind: str | None = None, adapter: str | None = None, host: str = "127.0.0.1",
          port: int = 8000, max_batch_size: int = 8, max_queue: int = 64, request_timeout: float = 600.0,
          device: str = "cpu", dtype: str = "float32", log_level: str = "info", compile: bool = False,
          draft_sizes: str | None = None, limits: Limits | None = None, api_key: str | None = None,
          warmup: bool = False, suffix_cache_tokens: int | None = None, **defaults) -> None:
    """Load ``model`` (with the gated SBD ``adapter``, a name it ships or a directory, when given)
    and serve it until interrupted (``unmask serve``). ``defaults``: the default decoder and knobs of
    requests (``decoder="sbd", gamma=0.35``); ``draft_sizes`` None: the default table;
    ``suffix_cache_tokens`` None: the default; the other arguments: :func:`unmask.serve.app.create_app`.
    Raises UnmaskError for a bad model, option or address (``draft_sizes`` on a model that does not
    run lossless sbd), KeyboardInterrupt after SIGINT and SystemExit(143) after SIGTERM, once open
    requests were drained (see ``_server``)."""
    require()
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise UnmaskError(f"port must be in 0..65535 (got {port!r}); pass e.g. --port 8000")
    if not (isinstance(request_timeout, (int, float)) and 0 < request_timeout < math.inf):
        raise UnmaskError(f"request timeout must be a finite number of seconds > 0 (got {request_timeout!r}); pass "
                          "e.g. 600, or a large value such as 86400 for requests that may run long")
    sizes = DEFAULT_DRAFT_SIZES if draft_sizes is None else draft_sizes_option(draft_sizes)  # bad text fails before loading
    check_server_draft(defaults.get("draft"), defaults.get("queries"))  # so does a bad --draft / --queries
    check_key(api_key)  # and a bad --api-key
    bundle = load(model, kind=kind, device=device, dtype=dtype, adapter=adapter)
    if isinstance(sizes, DraftSizes) and bundle.kind != "sbd":  # auto / off: nothing to size, no error
        raise UnmaskError(f"--draft-sizes applies to lossless sbd, which {bundle.name} ({bundle.kind}) does not run; "
                          "drop --draft-sizes, or serve an sbd model (or a causal one with --adapter sbd)")
    app = create_app(bundle, max_batch_size=max_batch_size, max_queue=max_queue, request_timeout=float(request_timeout),
                     defaults={k: v for k, v in defaults.items() if v is not None}, compile=compile,
                     draft_sizes=sizes, limits=limits, api_key=api_key, warmup=warmup,
                     **({} if suffix_cache_tokens is None else {"suffix_cache_tokens": suffix_cache_tokens}))
    sock = _bind(host, port)
    if app.state.default_note:
        print(app.state.default_note, file=sys.stderr, flush=True)
    print(f"unmask serve: {bundle.name} ({bundle.kind}) on {url(host, sock.getsockname()[1])}  "
          f"(playground at /, API at /v1{', API key required' if api_key else ''})"
          + ("; warming up: /health reports ok when done" if warmup else ""), flush=True)
    server = _server(app, sock, log_level, watchdog=True)
    # uvicorn re-raises the signal it caught once it has shut down; SIGTERM's handler here turns
    # that into exit status 143 with one line (the default handler would kill the process).
    previous = signal.signal(signal.SIGTERM, lambda *_: _interrupted(app, 143))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # SIGINT, re-raised by uvicorn after its shutdown
        _interrupted(app, 130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started:
        raise UnmaskError("the server did not start; see the log above")
    # A started foreground server only returns after a signal (uvicorn handles it and shuts down
    # cleanly): report it as an interrupt, so the command exits non-zero (143 / 130).
    _interrupted(app, 143 if server.signal == signal.SIGTERM else 130)


def _interrupted(app, code: int):
    """End ``unmask serve`` after a signal: SystemExit(143) with the one line ``interrupted`` for
    SIGTERM, KeyboardInterrupt for SIGINT (the command line prints it). When the scheduler thread
    is still inside a compile (``--compile``; ``close`` does not wait for one), the process leaves
    at once with ``os._exit``: interpreter shutdown under the compiler's native threads aborts
    (``terminate called without an active exception``, exit 134)."""
    if app.state.scheduler.thread_alive:
        print("unmask serve: a step shape was still compiling; not waiting for it", file=sys.stderr)
        print("interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)
    if code == 130:
        raise KeyboardInterrupt
    print("interrupted", file=sys.stderr, flush=True)
    raise SystemExit(143)
