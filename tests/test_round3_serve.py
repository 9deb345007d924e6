"""Issue 28's server items: every request's cost bounded before it is admitted (14), body and
prompt caps with parsing off the event loop (15), non-streamed requests of gone clients dropped
(16), graceful drain on SIGINT/SIGTERM (21), one metrics outcome per response (22), 404 for an
unknown model (6), booleans refused as integers and --draft-sizes refused on non-sbd models (19),
and lossless sbd keeping its speed-up beside an AR request (3)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

for _m in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_m, reason=f"the server tests need {_m}: pip install -e '.[test]'")

import unmask  # noqa: E402
from unmask.serve import create_app  # noqa: E402
from unmask.serve.limits import Limits  # noqa: E402
from unmask.serve.server import ServerThread  # noqa: E402

MODEL = "stories260K-sbd"
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def bundle():
    return unmask.load(MODEL)


@pytest.fixture(scope="module")
def dlm():
    return unmask.load("stories260K-dlm")


@pytest.fixture(scope="module")
def server(bundle):
    app = create_app(bundle, max_batch_size=4, max_queue=16)
    with ServerThread(app) as s:
        s.app = app
        yield s


def wait_until(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def post(url, body=None, raw: bytes | None = None, timeout=60):
    """(status, parsed JSON body) of a POST, errors included."""
    req = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def outcomes(url) -> dict[str, float]:
    """outcome -> count of unmask_requests_total, both endpoints summed."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'unmask_requests_total\{endpoint="\w+",outcome="(\w+)"\} (\S+)', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def raw_http(url, head: bytes, body: bytes = b"", timeout=10) -> bytes:
    """Send a hand-written request; the response bytes (until the server closes or 2 s idle)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head + body)
        sock.settimeout(2)
        data = b""
        try:
            while b"\r\n\r\n" not in data or not data.split(b"\r\n\r\n", 1)[1].rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            pass
        return data


def one_line_400(status, err, param=None, code=None, status_expected=400):
    assert status == status_expected, err
    e = err["error"]
    assert set(e) == {"message", "type", "param", "code"} and "\n" not in e["message"]
    if param is not None:
        assert e["param"] == param, e
    if code is not None:
        assert e["code"] == code, e
    return e["message"]


# --- 14: every request's cost is bounded before it runs ----------------------------------------


def test_a_quadratic_k128_lossless_request_is_refused_before_it_runs(server):
    """Found by the fault pass: this request drove the process to 22 GB and an OOM kill (K + K² =
    16,512 query tokens in each forward). It is a 400 naming the limit and the flag, and nothing
    decodes for it."""
    sched = server.app.state.scheduler
    forwards = sched.ar.forwards
    for stream in (False, True):
        status, err = post(server.url + "/v1/completions", {
            "prompt": "Once upon a time", "max_tokens": 64, "decoder": "sbd", "verify": True,
            "draft": "quadratic", "block_size": 128, "temperature": 1.0, "stream": stream})
        msg = one_line_400(status, err, param="block_size", code="request_too_large")
        assert "16512 query tokens" in msg and "2048" in msg and "--max-query-tokens" in msg
    assert sched.ar.forwards == forwards and not sched.running_batches and sched.active == 0
    status, ok = post(server.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 8, "decoder": "sbd",
                                                        "draft": "quadratic", "block_size": 4})
    assert status == 200 and ok["usage"]["completion_tokens"] == 8  # a small quadratic draft still serves


@pytest.mark.parametrize("body,param", [
    ({"decoder": "sbd", "block_size": 40}, "block_size"),  # lossless linear: 2K = 80
    ({"decoder": "sbd", "block_size": 80, "gamma": 0.3}, "block_size"),  # lossy: K = 80
    ({"decoder": "diffusion", "gen_length": 128, "block_size": 32}, "gen_length"),
    ({"decoder": "early-bird", "max_tokens": 100}, "gen_length"),
    ({"decoder": "multiblock", "slots": 9}, "slots"),  # 9 slots x block size 8 = 72
])
def test_every_decoder_s_query_tokens_are_bounded_by_the_server_flag(bundle, dlm, body, param):
    b = dlm if body["decoder"] in ("diffusion", "early-bird") else (
        unmask.load("stories260K-mbd") if body["decoder"] == "multiblock" else bundle)
    app = create_app(b, limits=Limits(max_query_tokens=64))
    with ServerThread(app) as s:
        req = {"prompt": "Once upon a time", "max_tokens": 32, **body}
        status, err = post(s.url + "/v1/completions", req)
        msg = one_line_400(status, err, param=param, code="request_too_large")
        assert "--max-query-tokens" in msg and "limit of 64" in msg
        assert app.state.scheduler.active == 0 and not app.state.scheduler.running_batches


def test_the_cache_limit_bounds_prompt_plus_completion(bundle):
    app = create_app(bundle, limits=Limits(max_cache_tokens=40))
    with ServerThread(app) as s:
        status, err = post(s.url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 64})
        msg = one_line_400(status, err, param="max_tokens", code="request_too_large")
        assert "--max-cache-tokens" in msg and "limit of 40" in msg
        status, ok = post(s.url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16})
        assert status == 200


def test_bad_limits_are_one_line_cli_errors(capsys):
    from conftest import one_line_error

    one_line_error(capsys, "serve", "--max-query-tokens", "0", match="--max-query-tokens must be an integer >= 1")
    one_line_error(capsys, "serve", "--max-body-bytes", "-5", match="--max-body-bytes must be an integer >= 1")


# --- 15: body and prompt sizes; CPU work off the event loop ------------------------------------


def test_a_body_over_the_limit_is_413_from_its_content_length_before_it_is_read(bundle):
    """Found by the fault pass: a 16 MiB body froze the server for 26 s (RSS 459 -> 840 MiB)."""
    app = create_app(bundle, limits=Limits(max_body_bytes=4096))
    with ServerThread(app) as s:
        t = time.monotonic()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 16777216\r\n\r\n")
        answer = raw_http(s.url, head, b'{"prompt": "')  # the 16 MiB never come
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert time.monotonic() - t < 2.5
        err = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert "--max-body-bytes" in err["error"]["message"] and "4096" in err["error"]["message"]
        # a chunked body has no Content-Length: refused while reading, once it passes the limit
        chunk = b'{"prompt": "' + b"a" * 5000 + b'"}'
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        answer = raw_http(s.url, head, b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk))
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        status, ok = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4})
        assert status == 200
        assert outcomes(s.url).get("bad_request") == 2  # both counted


def test_a_prompt_over_the_character_limit_is_400_before_tokenizing(bundle, monkeypatch):
    app = create_app(bundle, limits=Limits(max_prompt_chars=1000))
    calls = []
    real = type(bundle.tokenizer).__call__

    def counting(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    with ServerThread(app) as s:
        monkeypatch.setattr(type(bundle.tokenizer), "__call__", counting)
        monkeypatch.setattr(type(bundle.tokenizer), "encode", lambda self, *a, **k: calls.append(1) or [1])
        for path, body in (("/v1/completions", {"prompt": "word " * 400}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]})):
            status, err = post(s.url + path, body)
            msg = one_line_400(status, err, code="context_length_exceeded")
            assert "--max-prompt-chars" in msg and "2000 characters" in msg
        assert calls == []  # refused from its length alone
    # the default: 32 characters per token of the context window
    assert Limits().prompt_chars(bundle) == 32 * bundle.context_length


def test_parsing_and_tokenizing_run_off_the_event_loop(bundle, monkeypatch):
    """Found by the fault pass: a 5 MB prompt made /health take 4.4 s (tokenized on the loop)."""
    import unmask.serve.app as app_module

    real = app_module.parse
    started = threading.Event()

    def slow_parse(*a, **k):  # stands for a long tokenization: blocks its thread, not the loop
        started.set()
        time.sleep(1.5)
        return real(*a, **k)

    monkeypatch.setattr(app_module, "parse", slow_parse)
    app = create_app(bundle)
    with ServerThread(app) as s, ThreadPoolExecutor(1) as pool:
        f = pool.submit(post, s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4})
        assert started.wait(10)
        t = time.monotonic()
        health = json.loads(urllib.request.urlopen(s.url + "/health", timeout=10).read())
        assert health["status"] == "ok" and time.monotonic() - t < 0.7
        assert f.result()[0] == 200


# --- 16: a gone client's non-streamed request leaves at the next step --------------------------


def test_a_non_streamed_request_whose_client_left_is_dropped_and_counted_cancelled(dlm, monkeypatch):
    """Found by the fault pass: the handler checked for a disconnect only when no event came for
    0.2 s, and a running request's steps come faster: it kept its slot to the end, counted ok."""
    from unmask.decode.dllm.diffusion_batch import Diffusion

    real_step = Diffusion.step
    steps = []

    def slow_step(self):  # >= 2.4 s for the whole request, whatever this machine's speed
        steps.append(1)
        time.sleep(0.005)
        return real_step(self)

    monkeypatch.setattr(Diffusion, "step", slow_step)
    app = create_app(dlm, max_batch_size=4, max_queue=4)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 480, "decoder": "diffusion",
                           "gen_length": 480, "block_size": 32, "steps": 480}).encode()
        host, port = s.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: sched.active == 1)
        time.sleep(0.3)
        sock.close()
        wait_until(lambda: sched.active == 0, timeout=5)
        assert len(steps) < 400  # dropped mid-decode, not run to its 480 forwards
        wait_until(lambda: outcomes(s.url).get("cancelled") == 1)
        assert "ok" not in outcomes(s.url)


# --- 22: one outcome per response; deep JSON is a 400 ------------------------------------------


def test_every_response_is_counted_once_by_its_outcome(bundle, monkeypatch):
    """Found by the fault pass: a decoder's own 400 was counted as ``error`` and a 500 (100,000
    nested arrays, itself a 500 where a 400 belongs) was not counted at all."""
    import unmask.serve.app as app_module

    app = create_app(bundle, max_batch_size=2)
    with ServerThread(app) as s:
        url = s.url + "/v1/completions"
        status, err = post(url, None, raw=b"[" * 100_000 + b"]" * 100_000)
        assert one_line_400(status, err) and "nested too deeply" in err["error"]["message"]
        status, err = post(url, {"prompt": "x", "block_size": -1, "gamma": 0.3})  # the decoder's own check
        one_line_400(status, err, param="block_size")
        status, err = post(url, {"prompt": "x", "model": "nope"})
        one_line_400(status, err, status_expected=404)
        assert post(url, {"prompt": "Zoo", "max_tokens": 3})[0] == 200
        real = app_module.parse
        monkeypatch.setattr(app_module, "parse", lambda *a, **k: 1 / 0)  # a bug: 500
        status, err = post(url, {"prompt": "Zoo"})
        assert status == 500 and err["error"]["type"] == "server_error"
        monkeypatch.setattr(app_module, "parse", real)
        assert outcomes(s.url) == {"bad_request": 3.0, "ok": 1.0, "error": 1.0}


# --- 6, 19: OpenAI's 404; booleans are not integers; --draft-sizes on other kinds --------------


def test_an_unknown_model_is_404_model_not_found(server):
    for stream in (False, True):
        status, err = post(server.url + "/v1/completions", {"model": "no-such-model", "prompt": "x", "stream": stream})
        msg = one_line_400(status, err, param="model", code="model_not_found", status_expected=404)
        assert err["error"]["type"] == "invalid_request_error" and "no-such-model" in msg and MODEL in msg


@pytest.mark.parametrize("name", ["n", "best_of"])
def test_a_boolean_is_not_an_integer(server, name):
    status, err = post(server.url + "/v1/completions", {"prompt": "x", name: True})
    one_line_400(status, err, param=name)
    assert post(server.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 2, name: 1})[0] == 200


def test_draft_sizes_on_a_model_without_lossless_sbd_is_refused(capsys, monkeypatch):
    import unmask.serve.server as server_module
    from conftest import one_line_error
    from unmask.errors import UnmaskError

    def no_listening(*a, **k):  # refused before the server would listen (and serve forever)
        raise UnmaskError("the server got as far as listening; --draft-sizes was not refused")

    monkeypatch.setattr(server_module, "_bind", no_listening)

    one_line_error(capsys, "serve", "--model", "stories260K-dlm", "--draft-sizes", "1:4", "--port", "0",
                   match="--draft-sizes applies to lossless sbd")


# --- 3: lossless sbd beside AR keeps its speed-up ----------------------------------------------


def test_an_ar_and_a_lossless_sbd_request_side_by_side_keep_sbd_s_gain(bundle):
    """The playground's side-by-side: submitted together, the sbd request used to be routed into
    the AR batch (NFE 64, TPF 1.00). Below the draft-size crossover it keeps its own batch (K > 1):
    TPF > 1, text identical to AR's."""
    app = create_app(bundle, max_batch_size=8)
    prompt = "Once upon a time"
    with ServerThread(app) as s:
        sched = app.state.scheduler
        sched.pause()
        bodies = [{"prompt": prompt, "max_tokens": 64, "decoder": d} for d in ("ar", "sbd")]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(post, s.url + "/v1/completions", b) for b in bodies]
            wait_until(lambda: sched.queue_depth == 2)
            sched.resume()
            (sa, ar), (ss, sbd) = [f.result() for f in futures]
    assert sa == ss == 200
    assert sbd["choices"][0]["text"] == ar["choices"][0]["text"]
    assert sbd["choices"][0]["text"] == unmask.generate(prompt, bundle, "ar", max_new_tokens=64).texts[0]
    assert ar["usage"]["tpf"] == pytest.approx(1.0, abs=0.1)
    assert sbd["usage"]["tpf"] > 1.5 and sbd["usage"]["nfe"] < ar["usage"]["nfe"]
    K = sched.ar.cfg.block_size  # the default (auto) table at 2 rows: the served layout's own K
    assert sched.draft_log and sched.draft_log[0] == (2, K)  # one batch, sbd's row at the table's K for 2 rows


# --- 21: SIGINT / SIGTERM drain open streams ---------------------------------------------------


def _start_server(tmp_path, model="stories260K-dlm", *options, **env):
    env = {**os.environ, "PYTHONPATH": SRC, "UNMASK_THREADS": "1", **env}
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "unmask", "serve", "--model", model, "--port", "0",
                             "--max-batch-size", "4", *options], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    line = proc.stdout.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    assert m, (line, (tmp_path / "server.log").read_text())
    return proc, f"http://127.0.0.1:{m.group(1)}", log


def _log_after(proc, log) -> str:
    """The server's log once it has exited (killed if it has not)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.seek(0)
    return log.read()


def _open_stream(url):
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 480, "decoder": "diffusion", "gen_length": 480,
                       "block_size": 32, "steps": 480, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=60)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_drains_open_streams_and_exits_in_bounded_time(tmp_path, sig, code):
    """Found by the fault pass: SIGINT/SIGTERM with 32 open streams gave clients 500s and broken
    chunked streams, tracebacks in the log and 60-82 s to exit. Every open stream now ends with an
    error event and [DONE], the process exits 130/143 within seconds, one line, no traceback."""
    proc, url, log = _start_server(tmp_path)
    try:
        streams = [_open_stream(url) for _ in range(3)]
        for r in streams:
            assert r.readline().startswith(b"data: ")  # each stream is running
        t = time.monotonic()
        proc.send_signal(sig)
        for r in streams:
            lines = [ln.strip() for ln in r.read().split(b"\n") if ln.strip()]  # ends cleanly, no broken chunk
            assert lines[-1] == b"data: [DONE]"
            last = json.loads(lines[-2].removeprefix(b"data: "))
            assert "shutting down" in last["error"]["message"]
        assert proc.wait(timeout=30) == code
        assert time.monotonic() - t < 15
    finally:
        text = _log_after(proc, log)
    assert "Traceback" not in text and "Cancel" not in text, text
    assert text.rstrip().splitlines()[-1] == "interrupted"


def test_sigterm_while_a_step_shape_compiles_exits_143(tmp_path):
    """Found by the fault pass: SIGTERM while an idle --compile server was compiling a step shape
    printed 'interrupted', then 'terminate called without an active exception' and exited 134
    (interpreter shutdown under the compiler's native threads). It now exits 143, one line."""
    # a cold inductor cache: the compile takes seconds, not a cache hit
    proc, url, log = _start_server(tmp_path, "stories260K-sbd", "--compile", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "i"))
    try:
        status, _ = post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8})
        assert status == 200
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
        assert health["pending_compiles"] > 0  # shapes that ran eagerly, compiled once idle for 2 s
        time.sleep(3)  # idle: the scheduler thread is now compiling the first of them (~10-20 s)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        text = _log_after(proc, log)
    assert "terminate called" not in text and "Traceback" not in text, text
    assert "a step shape was still compiling" in text  # the signal did land during the compile
    assert text.rstrip().splitlines()[-1] == "interrupted"


def test_an_sbd_stream_started_before_an_ar_request_stays_in_its_own_batch(bundle):
    """The playground sends the sbd stream first, then AR's: the running sbd batch used to move
    into the AR batch as soon as the AR row started. Below the crossover (2 rows, default table)
    it stays: TPF > 1, text identical to AR's."""
    openai = pytest.importorskip("openai")

    app = create_app(bundle, max_batch_size=4, max_queue=8)
    prompt = "Once upon a time"
    gen = unmask.generate(prompt, bundle, "ar", max_new_tokens=200)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=200, stream=True,
                                      extra_body={"decoder": "sbd"})
        chunks = [next(iter(stream))]
        assert len(sched.ar) == 1 and sched.draft_log[-1][1] > 1
        r = c.completions.create(model=MODEL, prompt="Zoo", max_tokens=48, extra_body={"decoder": "ar"})
        chunks += list(stream)
    assert "".join(x.choices[0].text for x in chunks) == gen.texts[0]
    assert all(k > 1 for _, k in sched.draft_log)  # beside one AR row the sbd row kept drafting
    assert chunks[-1].usage.model_extra["tpf"] > 1.5
    assert r.choices[0].text == unmask.generate("Zoo", bundle, "ar", max_new_tokens=48).texts[0]


def test_stop_strings_are_bounded(server):
    """Found while checking item 15: up to 2 MiB of stop strings were accepted, and every one is
    matched against the text at every step (on the event loop for a stream)."""
    url = server.url + "/v1/completions"
    for stop in (["x%d" % i for i in range(5000)], ["y" * 10_000]):
        status, err = post(url, {"prompt": "Zoo", "max_tokens": 4, "stop": stop, "stream": True})
        msg = one_line_400(status, err, param="stop")
        assert "at most 64 strings of at most 256 characters" in msg
    assert post(url, {"prompt": "Zoo", "max_tokens": 4, "stop": ["x%d" % i for i in range(64)]})[0] == 200


# --- round 3 fault pass on the limits ---------------------------------------------------------


@pytest.mark.parametrize("cache", [None, "prefix"])
def test_early_bird_is_sized_by_its_router_s_canvas_not_by_max_tokens(dlm, cache):
    """Found by the fault pass: early-bird always decodes the LBS router's canvas (256 tokens), but
    a request asking for 8 tokens was sized as 8 and passed --max-query-tokens 64 and
    --max-cache-tokens 128."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "decoder": "early-bird",
            **({"cache": cache} if cache else {})}
    app = create_app(dlm, limits=Limits(max_query_tokens=64, max_cache_tokens=128))
    with ServerThread(app) as s:
        msg = one_line_400(*post(s.url + "/v1/completions", body), param="gen_length", code="request_too_large")
        assert "256 query tokens" in msg and "--max-query-tokens" in msg
        assert app.state.scheduler.active == 0 and not app.state.scheduler.running_batches
    app = create_app(dlm, limits=Limits(max_query_tokens=256, max_cache_tokens=128))
    with ServerThread(app) as s:  # the queries fit; the cached canvas does not
        msg = one_line_400(*post(s.url + "/v1/completions", body), param="max_tokens", code="request_too_large")
        assert "+ 256 completion" in msg and "--max-cache-tokens" in msg


def test_diffusion_is_sized_by_the_canvas_its_defaults_give(dlm):
    """A diffusion request naming no gen_length decodes max_tokens rounded up to its block size."""
    app = create_app(dlm, limits=Limits(max_query_tokens=64))
    with ServerThread(app) as s:
        msg = one_line_400(*post(s.url + "/v1/completions", {
            "prompt": "Once upon a time", "max_tokens": 8, "decoder": "diffusion", "block_size": 128}),
            param="gen_length", code="request_too_large")
        assert "canvas of 128 tokens" in msg
        status, ok = post(s.url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8,
                                                       "decoder": "diffusion", "block_size": 8})
        assert status == 200 and ok["usage"]["completion_tokens"] <= 8


def test_a_conversation_counts_its_chat_template_toward_the_prompt_limit(bundle, monkeypatch):
    """Found by the fault pass: 63,000 empty messages (1.8 MB) passed --max-prompt-chars (only the
    contents were counted) and were rendered and tokenized to 378,010 tokens before the 400."""
    calls = []
    real = type(bundle.tokenizer).__call__

    def counting(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    url = "/v1/chat/completions"
    for limits, messages, expect in (
            (Limits(), [{"role": "user", "content": ""}] * 63_000, "63000 messages and 2 characters"),
            # contents 240 + 2 x 120 pass 1000; rendered, 120 x "User: ab\n" + "Assistant:" = 1090 do not
            (Limits(max_prompt_chars=1000), [{"role": "user", "content": "ab"}] * 120,
             "1090 characters as the chat template renders its 120 messages")):
        app = create_app(bundle, limits=limits)
        with ServerThread(app) as s:
            monkeypatch.setattr(type(bundle.tokenizer), "__call__", counting)
            monkeypatch.setattr(type(bundle.tokenizer), "encode", lambda self, *a, **k: calls.append(1) or [1])
            status, err = post(s.url + url, {"messages": messages, "max_tokens": 4})
            monkeypatch.undo()
            msg = one_line_400(status, err, param="messages", code="context_length_exceeded")
            assert expect in msg and "--max-prompt-chars" in msg
            assert calls == []  # refused before tokenizing
            ok = post(s.url + url, {"messages": messages[:3], "max_tokens": 4})
            assert ok[0] == 200, ok


def test_reference_nfe_is_not_advertised_and_refused_with_the_cli_way(server):
    """Found by the fault pass: the unknown-parameter message listed reference_nfe, which every
    decoder then refused ("does not apply to decoder 'diffusion'")."""
    url = server.url + "/v1/completions"
    msg = one_line_400(*post(url, {"prompt": "Zoo", "bogus": 1}), param="bogus")
    assert "unmask fields:" in msg and "reference_nfe" not in msg
    for decoder in ("ar", "sbd"):
        msg = one_line_400(*post(url, {"prompt": "Zoo", "decoder": decoder, "reference_nfe": True}),
                           param="reference_nfe")
        assert "unmask generate --reference-nfe" in msg
    assert post(url, {"prompt": "Zoo", "max_tokens": 2, "reference_nfe": False})[0] == 200


def test_a_huge_integer_is_400_naming_the_problem_not_bad_json(server):
    """Found by the fault pass: a 5,000-digit max_tokens was "not valid JSON" (Python's int-string
    limit), and 10**400 was echoed whole in the message (next test)."""
    url = server.url + "/v1/completions"
    msg = one_line_400(*post(url, None, raw=b'{"prompt": "Zoo", "max_tokens": ' + b"9" * 5000 + b"}"))
    assert "integer of 5000 digits" in msg and "not valid JSON" not in msg


def test_an_echoed_value_is_cut_to_40_characters(server):
    url = server.url + "/v1/completions"
    msg = one_line_400(*post(url, {"prompt": "Zoo", "max_tokens": 10**400}), param="max_tokens")
    assert "1" + "0" * 39 + "..." in msg and len(msg) < 200
