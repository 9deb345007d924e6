"""What the server does at the connection level, beyond uvicorn's defaults.

- A read deadline: a request's headers and body must arrive within REQUEST_READ_S of its first byte
  (of the connection opening, for the first request), or the connection is closed. Once the request
  is in (its response may take long: a queue, a compile, a long decode) no deadline applies. uvicorn
  times out only idle kept-alive connections, and any byte resets that timer, so clients sending a
  request a byte at a time (or never finishing it) would hold their sockets until the process's file
  limit locks every client out.
- A response sent before its request's body has arrived (a 413 from Content-Length) does not close
  the connection under the client's feet: closing a socket with unread data sends a reset, and a
  client that sends the whole body before it reads (Python's urllib) then gets "connection reset"
  instead of the 413. As nginx's lingering close does, the server half-closes, reads and drops the
  rest of the body, at most LINGER_BYTES for at most LINGER_S, then closes.
- When the server stops, a connection whose request body is still arriving is closed at once instead
  of holding the shutdown for its whole grace time.
- Requests framed by both Content-Length and Transfer-Encoding are refused with 400 and the
  connection closed (RFC 9112 §6.3: such a request is how requests are smuggled past a proxy).
- Repeats of asyncio's "socket.accept() out of system resource" error, logged with a traceback for
  every refused accept while the file limit is reached, are kept to one every ACCEPT_ERROR_EVERY_S.
"""

from __future__ import annotations

import logging
import time

from unmask.serve.errors import ApiError

REQUEST_READ_S = 20.0
LINGER_S = 10.0  # the rest of a refused body: read and dropped for at most this long ...
LINGER_BYTES = 64 * 2**20  # ... and at most this many bytes
ACCEPT_ERROR_EVERY_S = 10.0


def protocol_class():
    """uvicorn's h11 protocol with the read deadline (see the module docstring)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _deadline = None  # the TimerHandle closing the connection, while a request is being read
        _linger = None  # the TimerHandle ending a lingering close, while one runs
        _dropped = 0  # bytes dropped by the lingering close

        def connection_made(self, transport) -> None:
            self._raw = transport
            super().connection_made(_Transport(transport, self))
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._linger is not None:  # the rest of a body already answered: dropped
                self._dropped += len(data)
                if self._dropped > LINGER_BYTES:
                    self._raw.close()
                return
            super().data_received(data)
            # DONE, or MUST_CLOSE for a request sent with "Connection: close" (or HTTP/1.0)
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE) or self.transport.is_closing():
                self._disarm()  # the request is in (its response may take long: no deadline)
            else:
                self._arm()  # from this request's first byte; later bytes do not move it

        def shutdown(self) -> None:
            """The server stops: a request whose body is still arriving will not be answered, so its
            connection closes now (uvicorn would wait the whole grace time for the body)."""
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                self._raw.close()
            else:
                super().shutdown()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._linger is not None:
                self._linger.cancel()
            super().connection_lost(exc)

        def lingers(self) -> bool:
            """Whether closing now would drop a request body still arriving after its whole response."""
            return (self.cycle is not None and self.cycle.response_complete and self.conn.their_state is h11.SEND_BODY
                    and not self._raw.is_closing())

        def linger(self) -> None:
            """Half-close (the response is out), then drop what still arrives until the client closes,
            LINGER_BYTES arrived or LINGER_S passed."""
            self._disarm()
            self._linger = self.loop.call_later(LINGER_S, self._raw.close)
            if self._raw.can_write_eof():
                self._raw.write_eof()
            self._raw.resume_reading()  # uvicorn pauses reading while a body the app does not read piles up

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(REQUEST_READ_S, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self._raw.is_closing():
                self._raw.close()  # a body being read: the app sees a disconnect (the request is cancelled)

    return Protocol


class _Transport:
    """A connection's transport as uvicorn sees it: ``close()`` starts a lingering close when the
    response is out but the request's body is still arriving (see the module docstring)."""

    def __init__(self, raw, protocol):
        self._raw, self._protocol = raw, protocol

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def is_closing(self) -> bool:
        return self._protocol._linger is not None or self._raw.is_closing()

    def close(self) -> None:
        if self._protocol._linger is not None:
            return
        if self._protocol.lingers():
            self._protocol.linger()
        else:
            self._raw.close()


def framed(app):
    """``app`` behind a check of each HTTP request's framing headers (see the module docstring)."""
    from starlette.responses import JSONResponse

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
