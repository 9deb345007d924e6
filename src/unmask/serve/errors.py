"""OpenAI-style HTTP errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import re
from contextlib import contextmanager

from unmask.errors import UnmaskError

ECHO_CHARS = 40  # an echoed value (a word of the message) is cut to this many characters


class ApiError(Exception):
    """An error answered to the client. status: HTTP status (400 bad request, 408 timeout, 429
    queue full, 5xx server); type/param/code: the OpenAI error fields; headers: extra response
    headers (``Retry-After`` on 429). A word of the message longer than ``ECHO_CHARS`` + 8
    characters (an echoed value) is cut to ``ECHO_CHARS`` and ``...``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        # a request's values are echoed in messages: 10**400 as max_tokens is 401 digits
        message = re.sub(rf"\S{{{ECHO_CHARS + 8},}}", lambda m: m.group()[:ECHO_CHARS] + "...", message)
        # a lone surrogate (a JSON key or value "\ud800") cannot be encoded as UTF-8: escaped
        message, param = (None if t is None else t.encode("utf-8", "backslashreplace").decode("utf-8") for t in (message, param))
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@contextmanager
def refused_as(param: str, *, first_line: bool = False):
    """Re-raise an UnmaskError met in the block as an ApiError 400 naming ``param``, its message
    whole or (``first_line``) its first line."""
    try:
        yield
    except UnmaskError as e:
        raise ApiError(400, str(e).splitlines()[0] if first_line else str(e), param=param) from None
