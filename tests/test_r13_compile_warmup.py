"""Issue 52 item 5: compiling shows which step graph is compiling (``compile_progress``, the CLI
spinner), and ``serve --warmup`` decodes one request (compiling its step shapes with --compile)
before ``/health`` reports ok."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import torch

from conftest import tiny_llama


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_compile_is_reported_with_its_shape_and_the_spinner_shows_it():
    from unmask.cli.progress import compiling
    from unmask.decode.engine import static

    class Spinner:  # a rich Status's update(), recorded
        def __init__(self):
            self.messages = []

        def update(self, message):
            self.messages.append(message)

    def body(forward, x):  # a tiny "step": compiles in about a second
        return x * 2 + 1

    model = tiny_llama(vocab=64, seed=0)
    events, spinner = [], Spinner()
    fn = static.compiled_step(model, body, ("r13", 2, 3, 256))
    with static.compile_progress(events.append), compiling(spinner, "generating 1 prompt"):
        assert torch.equal(fn(torch.ones(2, 3)), torch.full((2, 3), 3.0))
        static.compiled_step(model, body, ("r13", 2, 3, 256))(torch.ones(2, 3))  # compiled: no new event
    assert [e["done"] for e in events] == [False, True], events
    assert {k: events[0][k] for k in ("rows", "queries", "cache")} == {"rows": 2, "queries": 3, "cache": 256}
    assert events[1]["seconds"] > 0 and events[1]["graph"] == events[0]["graph"]
    assert spinner.messages[0].startswith(f"compiling step graph {events[0]['graph']} (rows 2, queries 3, cache 256)")
    assert spinner.messages[-1] == "generating 1 prompt"
    with static.compile_progress(events.append):
        pass
    assert not static._listeners  # the listener leaves with its block


def test_serve_warmup_reports_warming_up_until_its_request_ran(stories):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from unmask.serve import create_app
    from unmask.serve.server import ServerThread

    app = create_app(stories, warmup=True)
    app.state.scheduler.pause()  # the warm-up request waits in the queue: the server is not warm yet
    with ServerThread(app) as server:
        code, body = _get(server.url + "/health")
        assert code == 503 and body["status"] == "warming up", body
        app.state.scheduler.resume()
        deadline = time.monotonic() + 60
        while (code := _get(server.url + "/health")[0]) != 200:
            assert time.monotonic() < deadline, "never warm"
            time.sleep(0.05)
        code, body = _get(server.url + "/health")
        assert code == 200 and body["status"] == "ok" and body["pending_compiles"] == 0


def test_serve_without_warmup_is_ok_at_once(stories):
    pytest.importorskip("fastapi")
    from unmask.serve import create_app
    from unmask.serve.server import ServerThread

    app = create_app(stories)
    app.state.scheduler.pause()
    with ServerThread(app) as server:
        code, body = _get(server.url + "/health")
        assert code == 200 and body["status"] == "ok", body


def test_the_warmup_compiles_the_served_step_shapes(stories):
    """With --compile the warm-up waits for the scheduler's idle-time compile of what it ran."""
    pytest.importorskip("fastapi")
    from unmask.serve import create_app
    from unmask.serve.server import ServerThread
    from unmask.serve.warmup import warm_up

    app = create_app(stories, compile=True)
    lines = []
    with ServerThread(app):
        probe = app.state.probe
        warm_up(app.state.scheduler, probe, max_new_tokens=4, log=lines.append)
        assert app.state.scheduler.pending_compiles == 0
    assert lines[-1].startswith("unmask serve: warm-up done in "), lines
    # a compiled graph is reported by its line (none when this process compiled the shape already)
    assert all("compil" in line for line in lines[:-1]), lines
