"""The OpenAI-compatible server, driven by the official ``openai`` client against a server on a
free loopback port: outputs equal ``unmask.generate``, streaming in both modes, OpenAI-style
errors, 429, timeouts, cancellation on disconnect, and batch invariance under concurrency."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

for _m in ("fastapi", "uvicorn", "prometheus_client", "openai"):
    pytest.importorskip(_m, reason=f"the server tests need {_m}: pip install -e '.[test]'")

import openai  # noqa: E402

import unmask  # noqa: E402
from unmask.serve import create_app  # noqa: E402
from unmask.serve.server import ServerThread  # noqa: E402
from unmask.decode import DECODERS  # noqa: E402

MODEL = "stories260K-sbd"
PROMPTS = ["Once upon a time", "Zoo", "The cat sat on the mat and", "Lily went to the park. She saw a big dog. The",
           "A little boy", "Tom and Sue", "One day", "The sun"]


@pytest.fixture(scope="module")
def bundle():
    return unmask.load(MODEL)


@pytest.fixture(scope="module")
def server(bundle):
    with ServerThread(create_app(bundle, max_batch_size=8, max_queue=64)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_until(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def post(url, body, raw: bytes | None = None):
    """(status, headers (case-insensitive), parsed JSON body) of a POST, errors included."""
    req = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def metric(server, name: str) -> float:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


# --- plain requests -----------------------------------------------------------------------------


def test_models_health_and_metrics(server, client):
    (m,) = client.models.list().data
    assert m.id == MODEL and m.model_extra["decoders"] == ["ar", "sbd"]
    health = json.loads(urllib.request.urlopen(server.url + "/health").read())
    assert health["status"] == "ok" and health["pending_compiles"] == 0  # an eager server compiles nothing
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    for name in ("unmask_requests_total", "unmask_prompt_tokens_total", "unmask_completion_tokens_total",
                 "unmask_nfe_total", "unmask_tpf", "unmask_tps", "unmask_queue_depth", "unmask_running_batch_size",
                 "unmask_time_to_first_token_seconds"):
        assert name in text


@pytest.mark.parametrize("decoder,knobs", [("ar", {}), ("sbd", {}), ("sbd", {"block_size": 4, "gamma": 0.6}),
                                           ("sbd", {"policy": "threshold", "tau": 0.5})])
def test_completion_equals_generate(bundle, client, decoder, knobs):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, extra_body={"decoder": decoder, **knobs})
    ref = unmask.generate(PROMPTS[0], bundle, decoder, max_new_tokens=30, **knobs)
    assert r.choices[0].text == ref.texts[0]
    assert r.usage.completion_tokens == len(ref.tokens[0])
    assert r.usage.model_extra["nfe"] == ref.stats.nfe_per_row[0]
    assert r.usage.model_extra["tpf"] == pytest.approx(ref.stats.tpf)


def test_chat_uses_the_plain_template(bundle, client):
    messages = [{"role": "system", "content": "Stories."}, {"role": "user", "content": "Tell me about a cat."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    prompt = "Stories.\n\nUser: Tell me about a cat.\nAssistant:"
    assert r.choices[0].message.content == unmask.generate(prompt, bundle, "sbd", max_new_tokens=20).texts[0]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"


def test_sampled_request_reproduces_its_seed(bundle, client):
    for decoder in ("ar", "sbd"):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0.9, seed=7,
                                      extra_body={"decoder": decoder})
        ref = unmask.generate(PROMPTS[1], bundle, decoder, max_new_tokens=24, temperature=0.9, seed=7)
        assert r.choices[0].text == ref.texts[0]


# --- streaming ----------------------------------------------------------------------------------


@pytest.mark.parametrize("decoder", ["ar", "sbd"])
def test_committed_stream_concatenates_to_the_final_text_and_cuts_at_stop(bundle, client, decoder):
    full = unmask.generate(PROMPTS[0], bundle, decoder, max_new_tokens=64).texts[0]
    stop = full[120:123]  # a stop string from the middle of the text, spanning token boundaries
    ref = unmask.generate(PROMPTS[0], bundle, decoder, max_new_tokens=64, stop=[stop]).texts[0]
    assert ref == full[: full.index(stop)]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=64, stop=[stop], stream=True,
                                            extra_body={"decoder": decoder}))
    deltas = [c.choices[0].text for c in chunks]
    assert "".join(deltas) == ref
    assert sum(1 for d in deltas if d) >= 4  # really streamed, not one blob at the end
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))
    last = chunks[-1]
    assert last.choices[0].finish_reason == "stop"
    assert last.usage.model_extra["nfe"] >= 1 and last.usage.model_extra["tpf"] > 0


def test_chat_stream_role_then_content(bundle, client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=16, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    ref = unmask.generate("User: Hi\nAssistant:", bundle, "sbd", max_new_tokens=16).texts[0]
    assert text == ref and chunks[-1].usage.completion_tokens == 16


def test_canvas_stream_shows_masks_and_commits(bundle, client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, stream=True,
                                            extra_body={"decoder": "sbd", "block_size": 8, "stream_mode": "canvas"}))
    steps = [c.model_extra["unmask"] for c in chunks if c.model_extra.get("unmask")]
    ref = unmask.generate(PROMPTS[0], bundle, "sbd", max_new_tokens=24, block_size=8)
    assert len(steps) == ref.stats.nfe_per_row[0]  # one canvas per forward
    assert any(None in s["canvas"] for s in steps)  # masked slots are visible
    for s in steps:
        assert s["committed"] and all(s["canvas"][p] is not None for p in s["committed"])
        assert len(s["texts"]) == len(s["canvas"])
    assert steps[-1]["canvas"] == ref.tokens[0]
    assert "".join(c.choices[0].text for c in chunks) == ref.texts[0]


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("body,param,code", [
    # an unknown model is OpenAI's 404 model_not_found: tests/test_round3_serve.py
    ({"prompt": "x", "decoder": "diffusion"}, "decoder", None),
    ({"prompt": "x", "decoder": "nope"}, "decoder", None),
    ({"prompt": "x", "block_size": "big"}, "block_size", None),
    ({"prompt": "x", "block_size": -1}, "block_size", None),
    ({"prompt": "x", "gamma": -1}, "gamma", None),
    ({"prompt": "x", "decoder": "ar", "gamma": 0.3}, "gamma", None),
    ({"prompt": "x", "policy": "nope"}, "policy", None),
    ({"prompt": "x", "temperature": -1}, "temperature", None),
    ({"prompt": "x", "top_p": 2}, "top_p", None),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ({"prompt": "x", "max_tokens": 600}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "word " * 600, "max_tokens": 8}, "prompt", "context_length_exceeded"),
    ({"prompt": ""}, "prompt", None),
    ({"prompt": 5}, "prompt", None),
    ({"prompt": "x", "logprobs": 21}, "logprobs", None),  # logprobs and n are served (test_serve_structured)
    ({"prompt": "x", "n": 9}, "n", None),
    ({"prompt": "x", "stream_mode": "pixels"}, "stream_mode", None),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate", None),
    ({"prompt": "x", "stop": [""]}, "stop", None),
    ({"prompt": "x", "compile": True}, "compile", None),  # server-wide (unmask serve --compile), not per request
    ({"prompt": "x", "adapter": "sbd"}, "adapter", None),
])
def test_bad_requests_answer_400_openai_style(server, body, param, code):
    for stream in (False, True):
        status, _, err = post(server.url + "/v1/completions", {**body, "stream": stream})
        assert status == 400, err
        e = err["error"]
        assert set(e) == {"message", "type", "param", "code"} and e["type"] == "invalid_request_error"
        assert e["message"] and "\n" not in e["message"] and "Traceback" not in e["message"]
        assert e["param"] == param and e["code"] == code
    status, _, ok = post(server.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4})
    assert status == 200 and ok["usage"]["completion_tokens"] == 4  # still serving


def test_bad_json_and_bad_messages_answer_400(server):
    status, _, err = post(server.url + "/v1/completions", None, raw=b"{not json")
    assert status == 400 and "JSON" in err["error"]["message"]
    for messages in ([], [{"role": "robot", "content": "x"}], [{"role": "user"}], "hi"):
        status, _, err = post(server.url + "/v1/chat/completions", {"messages": messages})
        assert status == 400 and err["error"]["param"] == "messages"


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"gamma": -1})
    assert e.value.status_code == 400 and "gamma" in e.value.body["message"]


# --- batching -----------------------------------------------------------------------------------


def test_sixteen_concurrent_requests_are_batch_invariant(bundle, server, client):
    """16 greedy requests, AR and SBD, different lengths, arriving in two waves (the second joins
    the running AR batch mid-run): each equals its single-request ``unmask.generate`` output."""
    jobs = [(PROMPTS[i % 8], "ar" if i % 2 else "sbd", 20 + 3 * (i % 5)) for i in range(16)]
    refs = [unmask.generate(p, bundle, d, max_new_tokens=n).texts[0] for p, d, n in jobs]
    sched = server.app.state.scheduler
    sched.peak_running = 0

    def call(job):
        p, d, n = job
        stream = d == "ar"
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=n, stream=stream, extra_body={"decoder": d})
        return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text

    sched.pause()
    with ThreadPoolExecutor(16) as pool:
        first = [pool.submit(call, j) for j in jobs[:8]]
        wait_until(lambda: sched.queue_depth == 8)
        sched.resume()
        wait_until(lambda: len(sched.ar) > 0)
        second = [pool.submit(call, j) for j in jobs[8:]]
        got = [f.result() for f in first + second]
    assert got == refs
    assert sched.peak_running >= 4  # the requests really shared forwards
    wait_until(lambda: sched.active == 0 and sched.queue_depth == 0)


def test_ar_batch_join_and_leave_mid_run_equals_single_rows(bundle):
    from unmask.decode.verify.batch import Verify
    from unmask.decode.engine.running import Request

    lengths = [30, 12, 40, 25, 33]
    jobs = [Request(prompt_ids=bundle.encode(p), max_new_tokens=n, id=i) for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    refs = [unmask.generate(p, bundle, "ar", max_new_tokens=n).tokens[0] for p, n in zip(PROMPTS, lengths)]
    batch, done, widths = Verify(bundle, ar=True), [], []  # the server's AR rows: K = 1
    done += batch.join(jobs[:2])
    for step in range(200):
        if step in (3, 9):
            done += batch.join(jobs[2:4] if step == 3 else jobs[4:])
        done += batch.step()
        widths.append(batch.kv.length)
        if not batch.rows:
            break
    assert {id(r.job): r.tokens for r in done} == {id(j): ref for j, ref in zip(jobs, refs)}
    assert batch.kv.length == 0 and batch.slots.free == batch.slots.capacity  # every slot freed
    longest = max(len(j.prompt_ids) + n for j, n in zip(jobs, lengths))
    # columns nobody attends to are reclaimed once they are half the cache (lossless.compact)
    assert max(widths) <= 2 * longest


def test_ar_requests_advance_while_a_non_ar_batch_runs(bundle):
    """An AR request that arrives during a long (lossy) SBD request joins the AR batch at the next
    step and finishes while the SBD request is still running (and is still equal to unmask.generate)."""
    app = create_app(bundle, max_batch_size=4, max_queue=8)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        long = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400, stream=True,
                                    extra_body={"decoder": "sbd", "gamma": 0})  # one token per forward
        next(iter(long))
        r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, extra_body={"decoder": "ar"})
        assert sched.running_batches  # the SBD request has not finished
        assert r.choices[0].text == unmask.generate(PROMPTS[1], bundle, "ar", max_new_tokens=12).texts[0]
        long.close()
        wait_until(lambda: sched.active == 0)


def test_a_finished_row_is_answered_before_its_batch_ends(bundle):
    """Two SBD requests share a running batch; the one whose committed text reaches the stop string
    at once is answered while the other is still decoding (it does not wait for the slowest row)."""
    app = create_app(bundle, max_batch_size=4, max_queue=8)
    quick, slow = "Once upon a time", "The cat sat on the mat and"  # "Lily" comes early / never
    body = {"max_tokens": 160, "decoder": "sbd", "gamma": 0, "stop": ["Lily"]}
    with ServerThread(app) as s:
        sched = app.state.scheduler
        sched.pause()
        with ThreadPoolExecutor(2) as pool:
            f_slow = pool.submit(post, s.url + "/v1/completions", {**body, "prompt": slow})
            f_quick = pool.submit(post, s.url + "/v1/completions", {**body, "prompt": quick})
            wait_until(lambda: sched.queue_depth == 2)
            sched.resume()
            status, _, r = f_quick.result()
            assert status == 200 and sched.running_batches  # the batch still runs for the slow row
            assert not f_slow.done()
            assert f_slow.result()[0] == 200
    assert sched.peak_running == 2
    for prompt, res in ((quick, r), (slow, f_slow.result()[2])):
        ref = unmask.generate(prompt, bundle, "sbd", max_new_tokens=160, gamma=0, stop=["Lily"]).texts[0]
        assert res["choices"][0]["text"] == ref
    assert r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_ar_batch_on_tiny_models_equals_the_ar_decoder(family, attn):
    """Rows joining a running batch mid-run, with prompts of different lengths (so padded cache
    columns and the 4D key mask are in play), equal ``unmask.decode.verify.ar`` on each row alone, on
    both attention backends (additive mask for eager, bool for SDPA)."""

    import torch
    from conftest import tiny_bundle, tiny_llama, tiny_qwen3

    from unmask.decode.verify.batch import Verify
    from unmask.decode.engine.running import Request

    model = (tiny_llama if family == "llama" else tiny_qwen3)(attn_implementation=attn)
    b = tiny_bundle(model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (3, 17, 8, 30, 1, 12)]
    lengths = [20, 9, 25, 14, 30, 18]
    jobs = [Request(prompt_ids=p, max_new_tokens=n, id=i) for i, (p, n) in enumerate(zip(prompts, lengths))]
    batch, done = Verify(b, ar=True), []
    done += batch.join(jobs[:1])
    for step in range(100):
        if step in (2, 5, 11):
            done += batch.join({2: jobs[1:3], 5: jobs[3:5], 11: jobs[5:]}[step])
        done += batch.step()
        if not batch.rows:
            break
    got = {id(r.job): r.tokens for r in done}
    for j in jobs:
        assert got[id(j)] == DECODERS["ar"].decode(b, [j.prompt_ids], max_new_tokens=j.max_new_tokens).tokens[0]


# --- failure behaviour --------------------------------------------------------------------------


def test_queue_full_answers_429_with_retry_after(bundle):
    app = create_app(bundle, max_batch_size=1, max_queue=1)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        sched.pause()
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post, s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4})
            wait_until(lambda: sched.queue_depth == 1)
            status, headers, err = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4})
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert err["error"]["code"] == "queue_full" and err["error"]["type"] == "rate_limit_error"
            sched.resume()
            assert waiting.result()[0] == 200
        assert post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4})[0] == 200


def test_timeout_answers_408_and_frees_the_slot(bundle):
    app = create_app(bundle, max_batch_size=2, max_queue=4)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        sched.pause()
        status, _, err = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4, "timeout": 0.1})
        assert status == 408 and err["error"]["code"] == "timeout"
        sched.resume()
        # a running AR row that times out leaves the batch
        status, _, err = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 500, "decoder": "ar",
                                                          "timeout": 0.3})
        assert status == 408
        wait_until(lambda: sched.active == 0)
        assert post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4})[0] == 200


@pytest.mark.parametrize("decoder", ["ar", "sbd", "diffusion", "early-bird"])
def test_client_disconnect_cancels_the_request(bundle, decoder):
    """A client gone mid-stream frees its slot: AR, lossy sbd, diffusion and early-bird (with a
    cache too, issue 25) leave their running batches at the next step; no per-call batch runs."""
    model = bundle if decoder in ("ar", "sbd") else unmask.load("stories260K-dlm")
    app = create_app(model, max_batch_size=4, max_queue=4)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        knobs = {"ar": {}, "sbd": {"gamma": 0}, "diffusion": {"gen_length": 480, "block_size": 32, "steps": 480},
                 "early-bird": {"cache": "dual"}}  # a cached early-bird row joins a running batch too
        stream = c.completions.create(model=model.name, prompt="Once upon a time", stream=True,
                                      max_tokens=256 if decoder == "early-bird" else 480,  # its LBS router's length
                                      extra_body={"decoder": decoder, **knobs[decoder]})
        for _, _ in zip(range(3), stream):
            pass
        assert sched.active == 1
        stream.close()
        wait_until(lambda: sched.active == 0)
        forwards = sched.ar.forwards
        time.sleep(0.3)
        assert sched.ar.forwards == forwards and not sched.running_batches  # nothing decodes for the gone client
        assert sched.abandoned_batches == 0  # no per-call batch: the row left its running batch
        wait_until(lambda: metric(s, 'unmask_requests_total{endpoint="completions",outcome="cancelled"}') == 1)
        r = c.completions.create(model=model.name, prompt="Zoo", max_tokens=4, extra_body={"decoder": decoder})
        assert r.usage.completion_tokens == 4


def test_serve_cli_bad_options_one_line_errors(capsys):
    from conftest import one_line_error

    one_line_error(capsys, "serve", "--port", "99999", match="port")
    one_line_error(capsys, "serve", "--decoder", "nope", match="unknown decoder")
    one_line_error(capsys, "serve", "--gamma", "-1", match="gamma")
    one_line_error(capsys, "serve", "--max-batch-size", "0", match="batch size")


# --- other model kinds and the text stream ------------------------------------------------------


@pytest.mark.parametrize("name,decoder,knobs", [
    ("stories260K-dlm", "diffusion", {"gen_length": 64, "block_size": 16, "policy": "threshold", "tau": 0.7}),
    ("stories260K-mbd", "multiblock", {"tau_t2t": 0.9}),  # token-to-token edits: text only at the end
])
def test_diffusion_kinds_serve_and_stream_the_generate_text(name, decoder, knobs):
    b = unmask.load(name)
    ref = unmask.generate("Once upon a time", b, decoder, max_new_tokens=40, **knobs).texts[0]
    with ServerThread(create_app(b)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        body = {"decoder": decoder, **knobs}
        r = c.completions.create(model=name, prompt="Once upon a time", max_tokens=40, extra_body=body)
        assert r.choices[0].text == ref
        for mode in ("committed", "canvas"):
            chunks = list(c.completions.create(model=name, prompt="Once upon a time", max_tokens=40, stream=True,
                                               extra_body={**body, "stream_mode": mode}))
            assert "".join(x.choices[0].text for x in chunks) == ref


def test_text_stream_holds_back_a_possible_stop_string(bundle):
    from unmask.serve.stream import TextStream

    ids = bundle.encode("Once upon a time")
    full = unmask.generate("Once upon a time", bundle, "ar", max_new_tokens=30)
    text = full.texts[0]
    stop = text[10:14]
    ts = TextStream(bundle, ids, (stop,))
    sent = ""
    for i in range(1, len(full.tokens[0]) + 1):
        sent += ts.update(full.tokens[0][:i] + [None] * 3)
        assert stop not in sent and text.startswith(sent)
        # never more than what is already settled: a suffix that could start the stop string waits
        assert not any(sent.endswith(stop[:k]) for k in range(1, len(stop))) or ts.stopped
    sent += ts.finish(full.tokens[0])
    assert sent == text[: text.index(stop)]


def test_interrupted_serve_exits_non_zero(capsys, monkeypatch):
    """uvicorn shuts down cleanly on Ctrl-C; the command still ends with exit code 130 (typer
    returns that code instead of raising, which the CLI used to drop: exit 0)."""
    import unmask.serve.server as server_module
    from conftest import run_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(server_module, "serve", interrupted)
    code, _, err = run_cli(capsys, "serve")
    assert code == 130 and "interrupted" in err


def test_a_crashing_decoder_answers_500_and_the_server_keeps_serving(bundle, monkeypatch):
    from unmask.decode.verify.batch import Verify  # greedy lossless sbd runs in the AR / lossless batch

    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug")

    app = create_app(bundle, max_batch_size=2, max_queue=4)
    with ServerThread(app) as s:
        monkeypatch.setattr(Verify, "step", broken)
        status, _, err = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4, "decoder": "sbd"})
        assert status == 500 and err["error"]["type"] == "server_error" and "simulated" not in err["error"]["message"]
        monkeypatch.undo()
        status, _, ok = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 4, "decoder": "sbd"})
        assert status == 200 and ok["usage"]["completion_tokens"] == 4


def test_missing_server_packages_one_line_error(capsys, monkeypatch):
    import importlib.util

    from conftest import one_line_error

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    line = one_line_error(capsys, "serve", match="uvicorn")
    assert "unmask[serve]" in line


def test_serve_with_a_gated_adapter_serves_the_base_models_own_text(capsys, monkeypatch):
    """``serve --adapter`` loads the adapter onto the base; lossless sbd then streams stories260K's
    own greedy AR text."""
    import unmask.serve.server as server_module
    from conftest import one_line_error

    class Loaded(Exception):
        pass

    seen = {}

    def capture(b, **kw):  # stop serve() right after it loaded the model
        seen["bundle"] = b
        raise Loaded

    monkeypatch.setattr(server_module, "create_app", capture)
    with pytest.raises(Loaded):
        server_module.serve("stories260K", adapter="sbd")
    b = seen["bundle"]
    assert b.mask_token_id is not None
    ref = unmask.generate("Once upon a time", unmask.load("stories260K"), "ar", max_new_tokens=40).texts[0]
    with ServerThread(create_app(b)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = c.completions.create(model=b.name, prompt="Once upon a time", max_tokens=40,
                                 extra_body={"decoder": "sbd", "verify": True})
        assert r.choices[0].text == ref and r.usage.model_extra["nfe"] < 40
    monkeypatch.undo()
    one_line_error(capsys, "serve", "--model", "stories260K", "--adapter", "no-such-adapter", match="adapter")


def test_compiled_server_serves_lossless_and_lossy_sbd_identically(bundle):
    from unmask.decode.engine.kv import StaticKV

    ref = unmask.generate(PROMPTS[:2], bundle, "sbd", max_new_tokens=24).texts
    lossy = unmask.generate(PROMPTS[0], bundle, "sbd", max_new_tokens=24, gamma=0.35).texts[0]
    app = create_app(bundle, max_batch_size=2, compile=True)
    with ServerThread(app) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=24).choices[0].text,
                                  PROMPTS[:2]))
        assert texts == ref
        streamed = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, stream=True)
        assert "".join(x.choices[0].text for x in streamed) == ref[0]
        batch = app.state.scheduler.ar  # lossless sbd and ar rows: one batch, compiled on the static cache
        assert batch.compile and isinstance(batch.kv, StaticKV) and batch.forwards > 0
        assert list(app.state.scheduler.verify) == [batch.cfg.draft]  # the checkpoint's default layout, no other
        r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, extra_body={"gamma": 0.35})
        assert r.choices[0].text == lossy
        sched = app.state.scheduler
        (lossy_batch,) = sched.running_batches.values()  # kept while idle: its static cache and pending shapes
        assert lossy_batch.compile and isinstance(lossy_batch.kv, StaticKV) and lossy_batch.kv.pending
        wait_until(lambda: sched.pending_compiles == 0, timeout=300)  # compiled once the server is idle
        assert lossy_batch.kv.compiled
        r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, extra_body={"gamma": 0.35})
        assert r.choices[0].text == lossy and sched.running_batches[next(iter(sched.running_batches))] is lossy_batch


def test_multiblock_requests_join_and_leave_a_running_batch_mid_decode():
    """Continuous batching for the Block Buffer: a long multiblock request is decoding; requests
    that arrive meanwhile join its running batch at a step boundary and finish before it, each
    with unmask.generate's text; a cancelled stream frees its slots at once; bad options are 400."""
    b = unmask.load("stories260K-mbd")
    prompts = ["Once upon a time", "Tom had a red ball", "The sun", "Lily and Ben went to the park."]
    refs = [unmask.generate(p, b, "multiblock", max_new_tokens=n).texts[0]
            for p, n in zip(prompts, (300, 24, 24, 24))]
    app = create_app(b, max_batch_size=4)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        long = c.completions.create(model=b.name, prompt=prompts[0], max_tokens=300, stream=True,
                                    extra_body={"decoder": "multiblock"})
        chunks = [next(iter(long))]
        wait_until(lambda: sum(len(x) for x in sched.running_batches.values()) == 1)
        with ThreadPoolExecutor(3) as pool:
            short = list(pool.map(lambda p: c.completions.create(model=b.name, prompt=p, max_tokens=24,
                                                                 extra_body={"decoder": "multiblock"}), prompts[1:]))
        assert [r.choices[0].text for r in short] == refs[1:]
        assert len(sched.running_batches) == 1 and len(next(iter(sched.running_batches.values()))) == 1
        assert sched.peak_running >= 2  # they shared the long request's batch, not one batch after it
        chunks += list(long)
        assert "".join(x.choices[0].text for x in chunks) == refs[0]
        wait_until(lambda: sched.active == 0 and not sched.running_batches)

        gone = c.completions.create(model=b.name, prompt=prompts[0], max_tokens=300, stream=True,
                                    extra_body={"decoder": "multiblock"})
        next(iter(gone))
        gone.close()
        wait_until(lambda: sched.active == 0 and not sched.running_batches)
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=b.name, prompt=prompts[0], max_tokens=8,
                                 extra_body={"decoder": "multiblock", "slots": 0})
        r = c.completions.create(model=b.name, prompt=prompts[1], max_tokens=24, extra_body={"decoder": "multiblock"})
        assert r.choices[0].text == refs[1]


def test_idle_compiled_batches_are_evicted_least_recently_joined_first(bundle):
    """serve --compile keeps up to 4 idle compiled running batches (their static caches and pending
    shapes); the one joined longest ago goes first, however early it was created."""
    app = create_app(bundle, max_batch_size=2, compile=True)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def lossy(gamma):
            c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, extra_body={"gamma": gamma})

        def gammas():
            with sched._lock:  # the scheduler evicts after it answered the last row: read between its passes
                return [k[1].gamma for k in sched.running_batches]  # key: (decoder, its config)

        for g in (0.1, 0.2, 0.3, 0.4):
            lossy(g)
        assert gammas() == [0.1, 0.2, 0.3, 0.4] and all(b.static for b in sched.running_batches.values())
        lossy(0.1)  # joined again: now the most recent
        lossy(0.5)  # a fifth idle batch: 0.2, joined longest ago, is evicted
        wait_until(lambda: gammas() == [0.3, 0.4, 0.1, 0.5])  # at the end of the pass that answered it


def test_compiled_server_runs_block_and_multiblock_on_static_caches():
    """serve --compile: block and multiblock running batches decode on a static KV cache that rows
    join mid-flight (new step shapes run eagerly until the server is idle), each text as generate's."""
    from unmask.decode.engine.kv import StaticKV

    b = unmask.load("stories260K-mbd")
    prompts = ["Once upon a time", "Tom had a red ball", "The sun"]
    app = create_app(b, max_batch_size=4, compile=True)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for decoder, n in (("multiblock", 40), ("block", 24)):
            refs = [unmask.generate(p, b, decoder, max_new_tokens=n).texts[0] for p in prompts]
            with ThreadPoolExecutor(3) as pool:
                texts = list(pool.map(lambda p: c.completions.create(model=b.name, prompt=p, max_tokens=n,
                                                                     extra_body={"decoder": decoder}).choices[0].text,
                                      prompts))
            assert texts == refs
            batch = next(x for k, x in sched.running_batches.items() if k[0] == decoder)
            assert batch.compile and isinstance(batch.kv, StaticKV) and batch.forwards > 0 and not len(batch)


def test_lossless_sbd_with_a_fixed_block_size_joins_a_running_batch_mid_decode(bundle):
    """Lossless sbd requests that fix K (or sample) share the running batch of their draft layout
    (lossless.Verify): requests arriving during a long one join it at a step boundary and finish
    first, each with AR's text (greedy) or unmask.generate's (seeded); a different K joins the same
    batch with its own draft size."""
    prompts = PROMPTS[:4]
    refs = [unmask.generate(p, bundle, "ar", max_new_tokens=n).texts[0] for p, n in zip(prompts, (300, 24, 24, 24))]
    sampled = unmask.generate(prompts[1], bundle, "sbd", max_new_tokens=24, block_size=4, verify=True,
                              temperature=0.8, seed=3).texts[0]
    app = create_app(bundle, max_batch_size=4)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        knobs = {"decoder": "sbd", "verify": True, "block_size": 4}
        long = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=300, stream=True, extra_body=knobs)
        chunks = [next(iter(long))]
        linear = lambda: sched.verify.get("linear", ())  # a fixed K drafts linearly: the batch of that layout
        wait_until(lambda: len(linear()) == 1)
        bodies = [(p, knobs, 0.0) for p in prompts[1:]] + [(prompts[1], knobs, 0.8), (prompts[2], {**knobs, "block_size": 2}, 0.0)]
        with ThreadPoolExecutor(len(bodies)) as pool:
            out = list(pool.map(lambda a: c.completions.create(model=MODEL, prompt=a[0], max_tokens=24, extra_body=a[1],
                                                               temperature=a[2], seed=3).choices[0].text, bodies))
        assert out == refs[1:] + [sampled, refs[2]]
        assert sched.peak_running >= 2 and len(linear()) == 1 and not len(sched.ar) and not sched.running_batches
        chunks += list(long)
        assert "".join(x.choices[0].text for x in chunks) == refs[0]
        wait_until(lambda: sched.active == 0 and not sched.running_batches)


def test_diffusion_requests_share_running_batches_by_block_size():
    """Diffusion requests join running batches keyed by their options and effective block size (a
    short request without block_size decodes with a shorter block, so it gets a batch of its own);
    every text equals unmask.generate's."""
    b = unmask.load("stories260K-dlm")
    cases = [("Once upon a time", 40), ("Tom had a red ball", 24), ("The sun", 40), ("Lily", 24), ("A cat", 8)]
    refs = [unmask.generate(p, b, "diffusion", max_new_tokens=n).texts[0] for p, n in cases]
    app = create_app(b, max_batch_size=4)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        sched.pause()
        with ThreadPoolExecutor(len(cases)) as pool:
            futures = [pool.submit(post, s.url + "/v1/completions", {"prompt": p, "max_tokens": n, "decoder": "diffusion"})
                       for p, n in cases]
            wait_until(lambda: sched.queue_depth == len(cases))
            sched.resume()
            texts = [f.result()[2]["choices"][0]["text"] for f in futures]
        assert texts == refs and sched.peak_running == len(cases)
        wait_until(lambda: sched.active == 0 and not sched.running_batches)


def test_early_bird_requests_share_a_running_batch():
    """Early-bird requests (no cache) join one running batch; each text equals unmask.generate's."""
    b = unmask.load("stories260K-dlm")
    cases = [("Once upon a time", 40), ("Tom had a red ball", 24), ("The sun", 32)]
    refs = [unmask.generate(p, b, "early-bird", max_new_tokens=n).texts[0] for p, n in cases]
    app = create_app(b, max_batch_size=4)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        sched.pause()
        with ThreadPoolExecutor(len(cases)) as pool:
            futures = [pool.submit(post, s.url + "/v1/completions", {"prompt": p, "max_tokens": n, "decoder": "early-bird"})
                       for p, n in cases]
            wait_until(lambda: sched.queue_depth == len(cases))
            sched.resume()
            texts = [f.result()[2]["choices"][0]["text"] for f in futures]
        assert texts == refs and sched.peak_running == len(cases) and sched.abandoned_batches == 0
        wait_until(lambda: sched.active == 0 and not sched.running_batches)


def test_a_cli_switch_in_an_error_is_named_as_the_request_field(server):
    """Found by the new-user pass: the error told API users to pass 'no_verify', which is refused."""
    status, _, err = post(server.url + "/v1/completions", {"prompt": "x", "decoder": "sbd", "verify": True, "gamma": 0.3})
    assert status == 400 and '"verify": false' in err["error"]["message"] and "no_verify" not in err["error"]["message"]


def test_accepted_connections_send_without_nagle(server):
    """Every accepted connection has TCP_NODELAY. Found measuring serve_load: the listening socket had
    protocol 0, so asyncio left Nagle's algorithm on, and on a kept-alive connection each streamed chunk
    after the headers waited for the client's delayed ACK (TTFT ~50 ms where the first token took ~10)."""
    import http.client
    import socket

    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    try:
        for _ in range(2):  # the second request reuses the connection
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "Zoo", "max_tokens": 4, "stream": True}),
                         {"Content-Type": "application/json"})
            assert conn.getresponse().read().rstrip().endswith(b"data: [DONE]")
        connections = list(server.server.server_state.connections)
        assert connections
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        conn.close()
