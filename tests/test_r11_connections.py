"""Connection-level faults a fault pass found (``unmask.serve.connection``): requests that never finish
arriving are cut at a read deadline, ambiguous framing is refused, the accept-error flood is thinned, and
an IPv6 host is written in brackets."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

for _m in ("fastapi", "uvicorn", "h11"):
    pytest.importorskip(_m, reason=f"the server tests need {_m}: pip install -e '.[test]'")

import unmask  # noqa: E402
from unmask.serve import connection, create_app  # noqa: E402
from unmask.serve.server import ServerThread, url  # noqa: E402

DEADLINE_S = 0.6


@pytest.fixture(scope="module")
def bundle():
    return unmask.load("stories260K")


@pytest.fixture
def server(bundle, monkeypatch):
    monkeypatch.setattr(connection, "REQUEST_READ_S", DEADLINE_S)
    app = create_app(bundle, max_batch_size=2)
    with ServerThread(app) as s:
        yield s, app


def _connect(s) -> socket.socket:
    sock = socket.create_connection((s.host, s.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _closed_after(sock: socket.socket, trickle: bytes = b"") -> float:
    """Seconds until the server closes ``sock`` (recv returns b""), sending ``trickle`` a byte every 0.1 s."""
    t0 = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - t0 < 10:
        if trickle:
            try:
                sock.sendall(trickle[:1])
            except OSError:  # the server closed it
                return time.monotonic() - t0
            trickle = trickle[1:] or b"x"
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - t0
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - t0
    raise AssertionError("the server kept the connection open")


def _request(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(raw)) + raw


def test_a_request_whose_headers_never_finish_is_cut_at_the_deadline(server):
    s, app = server
    assert DEADLINE_S * 0.8 < _closed_after(_connect(s)) < DEADLINE_S + 3  # sends nothing
    trickling = _connect(s)
    trickling.sendall(b"POST /v1/completions HTTP/1.1\r\n")
    assert DEADLINE_S * 0.8 < _closed_after(trickling, b"X-Slow: " + b"a" * 100) < DEADLINE_S + 3  # bytes keep coming
    ok = _connect(s)
    ok.sendall(_request({"prompt": "Zoo", "max_tokens": 4}))
    ok.settimeout(30)
    assert ok.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_request_whose_body_never_finishes_is_cut_and_submits_nothing(server):
    s, app = server
    sock = _connect(s)
    head = _request({"prompt": "Zoo", "max_tokens": 4})
    sock.sendall(head[:-5])  # all but the body's last bytes
    assert _closed_after(sock) < DEADLINE_S + 3
    sched = app.state.scheduler
    assert sched.active == 0 and sched.queue_depth == 0


def test_a_response_longer_than_the_deadline_is_not_cut(server):
    """The deadline covers reading the request; a kept-alive connection then serves a second request."""
    s, app = server
    sched = app.state.scheduler
    sock = _connect(s)
    sched.pause()
    sock.sendall(_request({"prompt": "Zoo", "max_tokens": 4, "stream": True}))
    time.sleep(DEADLINE_S * 2)  # the request waits in the queue past the deadline
    sched.resume()
    sock.settimeout(30)
    got = b""
    while not got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # the last event, then the chunked body's end
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-response"
        got += chunk
    time.sleep(DEADLINE_S / 3)
    sock.sendall(_request({"prompt": "Zoo", "max_tokens": 2}))
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")


def test_content_length_and_transfer_encoding_together_are_refused_and_close(server):
    s, _ = server
    sock = _connect(s)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(10)
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    assert got.startswith(b"HTTP/1.1 400") and b"Content-Length and Transfer-Encoding" in got
    assert got.count(b"HTTP/1.1") == 1  # the smuggled second request is never answered: the connection closed


def test_ipv6_hosts_are_written_in_brackets():
    assert url("::1", 8000) == "http://[::1]:8000" and url("127.0.0.1", 80) == "http://127.0.0.1:80"


def test_accept_errors_pass_once_per_interval():
    f = connection.AcceptErrors()

    def record(msg):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    flood = [f.filter(record("socket.accept() out of system resource\nsocket: <x>")) for _ in range(1000)]
    assert flood[0] and not any(flood[1:])
    assert f.filter(record("Task exception was never retrieved"))  # anything else passes


def test_stopping_the_server_does_not_wait_for_a_request_body_still_arriving(bundle):
    from unmask.serve.server import GRACE_S

    s = ServerThread(create_app(bundle, max_batch_size=2))
    sock = _connect(s)
    sock.sendall(_request({"prompt": "Zoo", "max_tokens": 4})[:-5])  # the body's last bytes never come
    time.sleep(0.3)
    t0 = time.monotonic()
    s.stop()
    assert time.monotonic() - t0 < GRACE_S  # it waited out the grace time for the body before
    sock.settimeout(5)
    assert sock.recv(4096) == b""  # closed
