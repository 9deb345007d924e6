"""Running the app with uvicorn: in the foreground (``unmask serve``) or in a background thread on
an already bound loopback socket (tests, ``benchmarks/serve_load.py``)."""

from __future__ import annotations

import socket
import threading
import time

from unmask.errors import UnmaskError
from unmask.serve import create_app, require
from unmask.serve.draft_sizing import DEFAULT as DEFAULT_DRAFT_SIZES, draft_sizes_option


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UnmaskError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port or --host") from None
    sock.listen(2048)
    return sock


def _server(app, sock: socket.socket, log_level: str):
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


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
        self.url = f"http://{host}:{self.port}"
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
          port: int = 8000,
          max_batch_size: int = 8, max_queue: int = 64, request_timeout: float = 600.0, device: str = "cpu",
          dtype: str = "float32", log_level: str = "info", compile: bool = False, draft_sizes: str | None = None,
          **defaults) -> None:
    """Load ``model`` (with the gated SBD ``adapter``, a name it ships or a directory, when given)
    and serve it until interrupted (``unmask serve``). ``defaults``: the default
    decoder and knobs of requests (``decoder="sbd", gamma=0.35``); ``draft_sizes``: the running-batch
    -> K table of lossless sbd (``"1:8,2:4,4:1"``, ``"off"``; None: the default table). Raises UnmaskError for a bad
    model, option or address, and KeyboardInterrupt after a signal stopped the server."""
    require()
    from unmask.models import load

    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise UnmaskError(f"port must be in 0..65535 (got {port!r}); pass e.g. --port 8000")
    if not (isinstance(request_timeout, (int, float)) and request_timeout > 0):
        raise UnmaskError(f"request timeout must be > 0 seconds (got {request_timeout!r}); pass e.g. 600")
    sizes = DEFAULT_DRAFT_SIZES if draft_sizes is None else draft_sizes_option(draft_sizes)  # bad text fails before loading
    bundle = load(model, kind=kind, device=device, dtype=dtype, adapter=adapter)
    app = create_app(bundle, max_batch_size=max_batch_size, max_queue=max_queue, request_timeout=float(request_timeout),
                     defaults={k: v for k, v in defaults.items() if v is not None}, compile=compile,
                     draft_sizes=sizes)
    sock = _bind(host, port)
    print(f"unmask serve: {bundle.name} ({bundle.kind}) on http://{host}:{sock.getsockname()[1]}  "
          f"(playground at /, API at /v1)", flush=True)
    server = _server(app, sock, log_level)
    server.run(sockets=[sock])
    if not server.started:
        raise UnmaskError("the server did not start; see the log above")
    # A started foreground server only returns after SIGINT/SIGTERM (uvicorn handles them and shuts
    # down cleanly): report it as an interrupt, so the command exits non-zero.
    raise KeyboardInterrupt
