"""The server's API key (``unmask serve --api-key KEY`` or ``UNMASK_API_KEY``).

Every request but those to :data:`OPEN_PATHS` must carry ``Authorization: Bearer KEY``, as OpenAI's
clients send it (``OpenAI(api_key=KEY)``); others are answered 401 in OpenAI's error shape
(``code: invalid_api_key``) before the app sees them. ``/health`` and ``/metrics`` stay open for load
balancers and Prometheus (they show counts, never prompts or text), and so do the playground page and
its icon (static files; the page asks for the key and sends it with its requests). Keys are compared
in constant time (:func:`hmac.compare_digest`), so the time of a refusal does not tell how much of a
guess was right.
"""

from __future__ import annotations

import hmac
import json

from unmask.errors import UnmaskError
from unmask.serve.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/metrics", "/", "/favicon.ico"})


def check_key(key: str | None) -> bytes | None:
    """The key as bytes, None for no key. Raises UnmaskError for an empty key or one a header
    cannot carry (white space, control or non-ASCII characters)."""
    if key is None:
        return None
    if not isinstance(key, str) or not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise UnmaskError("--api-key (or UNMASK_API_KEY) must be non-empty printable ASCII without spaces (it "
                          "travels in an HTTP header); pass e.g. --api-key $(openssl rand -hex 16)")
    return key.encode("ascii")


def _bearer(scope) -> tuple[bytes, bytes]:
    """(the request's Authorization header, its bearer token): b"" for a missing header, and a token
    b"" for another scheme."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return value, token.strip() if scheme.lower() == b"bearer" else b""
    return b"", b""


def _why(header: bytes, given: bytes) -> str:
    """Why the request's key is refused, in words for the 401."""
    if given:
        return "the API key is not this server's"
    scheme, space, _ = header.strip().partition(b" ")
    if not scheme or scheme.lower() == b"bearer":
        return "no API key was given"
    if not space:  # 'Authorization: KEY', the key without its scheme
        return "the Authorization header holds no scheme before the key (a bare key?)"
    name = scheme.decode("ascii", "replace")  # curl -u or a proxy's Basic: a key sent the wrong way
    name = f"the scheme {name!r}" if len(name) <= 20 and name.isalnum() else "another scheme"
    return f"the Authorization header uses {name}, not Bearer"


class RequireKey:
    """ASGI middleware: answers 401 to an HTTP request outside :data:`OPEN_PATHS` whose bearer
    token is not ``key`` (see the module docstring)."""

    def __init__(self, app, key: bytes):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        header, given = _bearer(scope)
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or hmac.compare_digest(given, self.key):
            return await self.app(scope, receive, send)
        error = ApiError(401, f"{_why(header, given)}; send the header 'Authorization: Bearer KEY' with the server's "
                              "--api-key (openai clients: OpenAI(api_key=KEY))", code="invalid_api_key")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
