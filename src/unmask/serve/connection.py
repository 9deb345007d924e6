"""What the server does at the connection level, beyond uvicorn's defaults (found by a fault pass).

- A read deadline: a request's headers and body must arrive within REQUEST_READ_S of its first byte
  (of the connection opening, for the first request), or the connection is closed. uvicorn times out
  only idle kept-alive connections, and any byte resets that timer, so clients sending a request a
  byte at a time (or never finishing it) held their sockets forever: 21,000 of them filled the
  process's file limit and locked every client out.
- When the server stops, a connection whose request body is still arriving is closed at once instead
  of holding the shutdown for its whole grace time.
- Requests framed by both Content-Length and Transfer-Encoding are refused with 400 and the
  connection closed (RFC 9112 §6.3: such a request is how requests are smuggled past a proxy).
- Repeats of asyncio's "socket.accept() out of system resource" error, logged with a traceback for
  every refused accept while the file limit is reached (a 92 MB log in 35 s), are kept to one every
  ACCEPT_ERROR_EVERY_S.
"""

from __future__ import annotations

import logging
import time

REQUEST_READ_S = 20.0
ACCEPT_ERROR_EVERY_S = 10.0


def protocol_class():
    """uvicorn's h11 protocol with the read deadline (see the module docstring)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _deadline = None  # the TimerHandle closing the connection, while a request is being read

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.DONE or self.transport.is_closing():
                self._disarm()  # the request is in (its response may stream for long: no deadline)
            else:
                self._arm()  # from this request's first byte; later bytes do not move it

        def shutdown(self) -> None:
            """The server stops: a request whose body is still arriving will not be answered, so its
            connection closes now (uvicorn would wait the whole grace time for the body)."""
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                self.transport.close()
            else:
                super().shutdown()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(REQUEST_READ_S, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()  # a body being read: the app sees a disconnect (the request is cancelled)

    return Protocol


def framed(app):
    """``app`` behind a check of each HTTP request's framing headers (see the module docstring)."""
    from starlette.responses import JSONResponse

    from unmask.serve.errors import ApiError

    async def asgi(scope, receive, send):
        names = {name for name, _ in scope.get("headers", ())} if scope["type"] == "http" else set()
        if b"content-length" in names and b"transfer-encoding" in names:
            error = ApiError(400, "the request has both Content-Length and Transfer-Encoding headers; send one of them")
            await JSONResponse(error.body(), status_code=400, headers={"Connection": "close"})(scope, receive, send)
            return
        await app(scope, receive, send)

    return asgi


class AcceptErrors(logging.Filter):
    """Passes one asyncio "socket.accept() out of system resource" record every ACCEPT_ERROR_EVERY_S."""

    def __init__(self):
        super().__init__()
        self.last = float("-inf")  # when the last such record passed

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("socket.accept() out of system resource"):
            return True
        now = time.monotonic()
        if now - self.last < ACCEPT_ERROR_EVERY_S:
            return False
        self.last = now
        return True


def quiet_accept_errors() -> None:
    """Install :class:`AcceptErrors` on asyncio's logger (once)."""
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, AcceptErrors) for f in log.filters):
        log.addFilter(AcceptErrors())
