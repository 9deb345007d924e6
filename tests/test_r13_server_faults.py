"""Server faults of round four (issue 48): requests sent with ``Connection: close`` outlive the read
deadline, a refused oversized body reaches urllib as its 413, an exception in the scheduler thread
ends only its own requests (and ``/health`` reports a dead or wedged scheduler), one request's bad
token ids fail only itself, and batch sizes are checked against memory at start."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

for _m in ("fastapi", "uvicorn", "h11", "prometheus_client"):
    pytest.importorskip(_m, reason=f"the server tests need {_m}: pip install -e '.[test]'")

import unmask  # noqa: E402
from unmask.decode import DECODERS  # noqa: E402
from unmask.serve import connection, create_app, engine  # noqa: E402
from unmask.serve.limits import Limits  # noqa: E402
from unmask.serve.server import ServerThread  # noqa: E402
from test_round3_serve import post  # noqa: E402  (urllib: it sends Connection: close)

DEADLINE_S = 0.6


@pytest.fixture(scope="module")
def bundle():
    return unmask.load("stories260K")




def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# -- item 2: Connection: close requests and the read deadline ----------------------------------------


def test_a_connection_close_request_longer_than_the_read_deadline_is_answered(bundle, monkeypatch):
    monkeypatch.setattr(connection, "REQUEST_READ_S", DEADLINE_S)
    app = create_app(bundle, max_batch_size=2)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        sched.pause()  # the request waits in the queue past the deadline
        threading.Timer(DEADLINE_S * 3, sched.resume).start()
        t0 = time.monotonic()
        status, body = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4})
        assert status == 200 and body["choices"][0]["text"], body
        assert time.monotonic() - t0 > DEADLINE_S * 2
        assert sched.queue_depth == 0 and sched.active == 0


def test_connection_close_requests_arriving_during_an_idle_compile_are_answered(bundle, monkeypatch):
    """An idle-time compile holds the scheduler thread for seconds (here: 5 deadlines); the requests
    that arrive meanwhile wait for it and are answered, none is cut at the read deadline."""
    monkeypatch.setattr(connection, "REQUEST_READ_S", DEADLINE_S)
    monkeypatch.setattr(engine, "IDLE_COMPILE_S", 0.05)
    pending, started = [1], threading.Event()

    def slow_warm(self):  # a compile of the one pending shape: the thread is busy, /health says compiling
        self.compiling = True
        started.set()
        time.sleep(DEADLINE_S * 5)
        pending.clear()
        self.compiling = False

    monkeypatch.setattr(engine.Scheduler, "pending_compiles", property(lambda self: len(pending)))
    monkeypatch.setattr(engine.Scheduler, "_warm", slow_warm)
    app = create_app(bundle, max_batch_size=2)
    with ServerThread(app) as s:
        assert started.wait(10)
        results = []
        threads = [threading.Thread(target=lambda: results.append(post(s.url + "/v1/completions",
                                                                      {"prompt": "Zoo", "max_tokens": 4})))
                   for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(DEADLINE_S)
        assert health(s.url)[1]["compiling"]
        for t in threads:
            t.join(60)
        assert [r[0] for r in results] == [200] * 3, results
        assert app.state.scheduler.queue_depth == 0


# -- item 3: the 413 of an oversized body reaches every client --------------------------------------


def test_urllib_reads_the_413_of_a_body_over_the_limit(bundle):
    """urllib sends the whole body before it reads a response: the server must read (and drop) it."""
    app = create_app(bundle, max_batch_size=2, limits=Limits(max_body_bytes=2**20))
    with ServerThread(app) as s:
        raw = b'{"prompt": "' + b"a" * (24 * 2**20) + b'"}'
        status, body = post(s.url + "/v1/completions", raw=raw)
        assert status == 413 and body["error"]["code"] == "request_too_large", body
        status, body = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 2})
        assert status == 200


def test_a_body_past_the_lingering_bound_is_cut(bundle, monkeypatch):
    """The rest of a refused body is read (beyond what socket buffers hold), but only up to LINGER_BYTES."""
    import socket

    monkeypatch.setattr(connection, "LINGER_BYTES", 16 * 2**20)
    app = create_app(bundle, max_batch_size=2, limits=Limits(max_body_bytes=1000))
    with ServerThread(app) as s:
        sock = socket.create_connection((s.host, s.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (2**30))
        t0, sent = time.monotonic(), 0
        with pytest.raises(OSError):  # reset or broken pipe once the server stops reading
            while time.monotonic() - t0 < 20:
                sock.sendall(b"a" * 65536)
                sent += 65536
        assert 16 * 2**20 <= sent < 64 * 2**20  # read past the 413, cut near the bound, not after a gigabyte
        sock.close()


# -- item 8: the scheduler thread survives any exception; /health watches it -------------------------


@pytest.fixture(scope="module")
def bd():
    return unmask.load("stories260K-bd")


def _fail_first(fn, exc: BaseException):
    """``fn`` that raises ``exc`` on its first call as the server's running-batch factory (``prompts``
    None; the app's start-up probe decodes through the same factory first)."""
    calls = []

    def wrapped(*a, **kw):
        if not calls and kw.get("prompts") is None:
            calls.append(1)
            raise exc
        return fn(*a, **kw)

    return wrapped


def test_a_running_batch_whose_constructor_raises_fails_only_its_request(bd, monkeypatch):
    spec = DECODERS["block"]  # its batch factory raises once
    monkeypatch.setitem(DECODERS, "block", dataclasses.replace(spec, batch=_fail_first(spec.batch, MemoryError("injected"))))
    app = create_app(bd, max_batch_size=2)
    with ServerThread(app) as s:
        status, err = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 8, "decoder": "block"}, timeout=20)
        assert status == 500 and "\n" not in err["error"]["message"], err
        want = unmask.generate("Once upon a time", bd, "block", max_new_tokens=8).texts[0]
        status, ok = post(s.url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "decoder": "block"},
                          timeout=20)
        assert status == 200 and ok["choices"][0]["text"] == want
        status, body = health(s.url)
        assert status == 200 and body["status"] == "ok", body


def test_an_exception_anywhere_in_a_pass_fails_its_requests_and_the_loop_goes_on(bundle, monkeypatch):
    monkeypatch.setattr(engine.Scheduler, "_advance", _fail_first(engine.Scheduler._advance, RuntimeError("injected")))
    app = create_app(bundle, max_batch_size=2)
    with ServerThread(app) as s:
        status, err = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4}, timeout=20)
        assert status == 500, err
        status, ok = post(s.url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4}, timeout=20)
        assert status == 200 and ok["choices"][0]["text"] == unmask.generate("Once upon a time", bundle, "ar",
                                                                             max_new_tokens=4).texts[0]
        assert app.state.scheduler.thread_alive and health(s.url)[0] == 200


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_reports_a_dead_scheduler_and_waiting_requests_are_answered(bundle, monkeypatch):
    """Whatever ends the thread (here a SystemExit, which no ``except Exception`` stops), /health says
    so with 503 and a waiting request gets a 503 instead of hanging."""
    monkeypatch.setattr(engine.Scheduler, "_advance", _fail_first(engine.Scheduler._advance, SystemExit(1)))
    app = create_app(bundle, max_batch_size=2)
    with ServerThread(app) as s:
        status, err = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4}, timeout=20)
        assert status == 503 and "scheduler thread has stopped" in err["error"]["message"], err
        status, body = health(s.url)
        assert status == 503 and body["status"] == "dead", body


def test_health_reports_a_wedged_scheduler_and_requests_still_time_out(bundle, monkeypatch):
    monkeypatch.setattr(engine, "WEDGED_S", 0.5)
    monkeypatch.setattr(engine, "DEADLINE_SLACK_S", 0.2)
    held, release = threading.Event(), threading.Event()
    advance = engine.Scheduler._advance

    def stuck(self, joining):  # a step that never returns (until the test releases it)
        if joining and not held.is_set():
            held.set()
            release.wait(30)
        return advance(self, joining)

    monkeypatch.setattr(engine.Scheduler, "_advance", stuck)
    app = create_app(bundle, max_batch_size=2)
    with ServerThread(app) as s:
        try:
            t0 = time.monotonic()
            status, err = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4, "timeout": 1}, timeout=20)
            assert status == 408 and time.monotonic() - t0 < 15, err  # not held until the step ends (30 s)
            status, body = health(s.url)
            assert status == 503 and body["status"] == "wedged", body
        finally:
            release.set()
        deadline = time.monotonic() + 10
        while (status := health(s.url))[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status[1]["status"] == "ok", status
        assert post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4}, timeout=20)[0] == 200


# -- item 9: one request's failure stays its own -------------------------------------------------------


def _with_extra_token(tmp_path):
    """stories260K (512 embedding rows) whose tokenizer.json adds ``<extra>`` as id 512."""
    import shutil
    from pathlib import Path

    src = Path(unmask.__file__).parent / "checkpoints" / "stories260K"
    out = tmp_path / "extra"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("adapters"))
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 512, "content": "<extra>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": False})
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


def test_a_tokenizer_with_ids_past_the_embedding_is_refused_at_load(tmp_path, capsys):
    from conftest import one_line_error

    from unmask.errors import UnmaskError

    path = _with_extra_token(tmp_path)
    with pytest.raises(UnmaskError, match=r"1 token id\(s\) past the model's 512 embedding rows \(512 '<extra>'\)"):
        unmask.load(str(path))
    one_line_error(capsys, "generate", "Once <extra>", "--model", str(path), "-n", 4, match="512 '<extra>'")


def test_a_join_that_fails_on_one_request_fails_only_that_one(bundle):
    """Five requests join the AR batch in one prefill; the forward fails on one prompt's token (as an
    embedding lookup past its rows would): that request gets 500, the four others their own text."""
    prompts = ["Once upon a time", "The cat", "Lily went to", "Zoo", "A big dog"]
    bad = bundle.tokenizer.encode("Zoo")[-1]
    assert all(bad not in bundle.tokenizer.encode(p) for p in prompts if p != "Zoo")
    want = {p: unmask.generate(p, bundle, "ar", max_new_tokens=6).texts[0] for p in prompts}
    inner = bundle.model.forward

    def forward(*a, **kw):
        ids = kw.get("input_ids", a[0] if a else None)
        if ids is not None and bool((ids == bad).any()):
            raise IndexError("index out of range in self")
        return inner(*a, **kw)

    app = create_app(bundle, max_batch_size=8)
    bundle.model.forward = forward
    try:
        with ServerThread(app) as s:
            sched = app.state.scheduler
            sched.pause()
            results = {}
            threads = [threading.Thread(target=lambda p=p: results.update({p: post(
                s.url + "/v1/completions", {"prompt": p, "max_tokens": 6, "decoder": "ar"}, timeout=60)}))
                for p in prompts]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 10
            while sched.queue_depth < len(prompts) and time.monotonic() < deadline:
                time.sleep(0.02)
            sched.resume()
            for t in threads:
                t.join(60)
    finally:
        bundle.model.forward = inner
    assert results["Zoo"][0] == 500
    assert {p: (r[0], r[1]["choices"][0]["text"]) for p, r in results.items() if p != "Zoo"} == \
        {p: (200, want[p]) for p in prompts if p != "Zoo"}


# -- item 13: batch sizes are checked against memory at start -------------------------------------------


def test_free_memory_is_read_from_the_machine():
    from unmask import memory

    free = memory.free_bytes("cpu")
    assert free is not None and 2**20 < free < 2**50


def test_a_server_batch_that_cannot_fit_is_refused_at_start(bundle, monkeypatch, capsys):
    """stories260K: 512 cache tokens x 1,280 KV bytes + slot tensors = 0.6 MiB a row."""
    from conftest import one_line_error

    from unmask import memory
    from unmask.errors import UnmaskError

    monkeypatch.setattr(memory, "free_bytes", lambda device: 2**30)
    with pytest.raises(UnmaskError, match=r"--max-batch-size 10000 needs at least 6\.\d GiB .* more than the 1\.0 GiB "
                                          r"free on this machine; pass --max-batch-size 1\d{3} or less"):
        create_app(bundle, max_batch_size=10_000)
    create_app(bundle, max_batch_size=1000)  # 0.6 GiB: fits
    monkeypatch.setattr(memory, "free_bytes", lambda device: 2**19)  # 0.5 MiB: less than one row
    with pytest.raises(UnmaskError, match="not even one row fits"):
        create_app(bundle, max_batch_size=8)
    one_line_error(capsys, "serve", "--model", "stories260K", "--max-batch-size", 100_000_000,
                   match="--max-batch-size 100000000 needs at least")


def test_a_training_batch_that_cannot_fit_is_refused_at_start(monkeypatch, capsys, tmp_path):
    from conftest import ids_file, one_line_error

    from unmask import memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 4 * 2**30)
    data = ids_file(tmp_path / "ids.jsonl")
    line = one_line_error(capsys, "train", "sbd", "--base", "stories260K", "--data", str(data), "--out",
                          str(tmp_path / "out"), "--steps", 1, "--seq-len", 32, "--batch-size", 65536,
                          match="--batch-size 65536 needs at least")
    assert "more than the 4.0 GiB free on this machine" in line and "--grad-accum" in line
