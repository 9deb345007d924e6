"""Round 13: one TPF rule across the CLI, the Python API and the server; request fields that must be
refused with 400 (not 500) and CLI inputs the server refuses; numpy scalars in the Python API; the
server's API key, prompt lists and ``echo`` with the real ``openai`` client; the playground's
favicon and special tokens."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from conftest import one_line_error, run_cli

for _m in ("fastapi", "uvicorn", "prometheus_client", "openai"):
    pytest.importorskip(_m, reason=f"the server tests need {_m}: pip install -e '.[test]'")

import openai  # noqa: E402

import unmask  # noqa: E402
from unmask.serve import create_app  # noqa: E402
from unmask.serve.errors import ApiError  # noqa: E402
from unmask.serve.server import ServerThread  # noqa: E402

# stories260K ends this prompt's greedy AR continuation with EOS after 140 tokens
EOS_PROMPT, EOS_AT = "The cat sat on the mat and", 140
# stories260K-dlm's diffusion ends this one with EOS after 48 tokens
DLM_PROMPT, DLM_EOS_AT = "Lily went to the park. She saw a big dog. The", 48


@pytest.fixture(scope="module")
def ar_bundle():
    return unmask.load("stories260K")


@pytest.fixture(scope="module")
def ar_server(ar_bundle):
    with ServerThread(create_app(ar_bundle)) as s:
        yield s


def post(url, body, headers=None):
    """(status, parsed JSON body) of a POST, errors included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url, headers=None):
    """(status, headers, body bytes) of a GET, errors included."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


# --- one TPF rule (issue 48.4, 52.3) ----------------------------------------------------------------


def test_the_same_request_has_the_same_tpf_in_the_cli_the_api_and_the_server(capsys, ar_bundle, ar_server):
    n = EOS_AT + 10
    api = unmask.generate(EOS_PROMPT, ar_bundle, "ar", max_new_tokens=n)
    assert api.stats.tokens_per_row == [EOS_AT] and api.stats.stops_per_row == [1]
    assert api.stats.row(0)["tpf"] == 1.0  # AR committing EOS: one token per forward
    code, out, err = run_cli(capsys, "generate", EOS_PROMPT, "--model", "stories260K", "--decoder", "ar", "-n", n,
                             "--json", "--no-progress")
    assert code == 0, err
    (row,) = [json.loads(line) for line in out.splitlines()]
    status, body = post(ar_server.url + "/v1/completions", {"prompt": EOS_PROMPT, "max_tokens": n, "decoder": "ar"})
    assert status == 200, body
    usage = body["usage"]
    assert usage["completion_tokens"] == EOS_AT and body["choices"][0]["finish_reason"] == "stop"
    assert row["tpf"] == api.stats.row(0)["tpf"] == usage["tpf"] == 1.0  # before: the server said 140/141
    assert row["nfe"] == api.stats.row(0)["nfe"] == usage["nfe"]
    c = openai.OpenAI(base_url=ar_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    last = list(c.completions.create(model="stories260K", prompt=EOS_PROMPT, max_tokens=n, stream=True,
                                     extra_body={"decoder": "ar"}))[-1]
    assert last.usage.model_extra["tpf"] == 1.0  # the stream's usage too


def test_reference_nfe_counts_the_committed_stop_token(capsys):
    dlm = unmask.load("stories260K-dlm")
    out = unmask.generate(DLM_PROMPT, dlm, "diffusion", max_new_tokens=128, reference_nfe=True)
    s = out.stats
    assert s.tokens_per_row == [DLM_EOS_AT] and s.stops_per_row == [1]
    assert s.tpf == pytest.approx((DLM_EOS_AT + 1) / s.nfe_per_row[0])  # before: 48/nfe
    code, text, err = run_cli(capsys, "generate", DLM_PROMPT, "--model", "stories260K-dlm", "--decoder", "diffusion",
                              "-n", 128, "--reference-nfe", "--json", "--no-progress")
    assert code == 0, err
    assert json.loads(text)["tpf"] == pytest.approx(s.tpf)
    # a stop token past max_new_tokens is not committed output: no stop counted
    short = unmask.generate(DLM_PROMPT, dlm, "diffusion", max_new_tokens=DLM_EOS_AT, gen_length=128,
                            reference_nfe=True)
    assert short.stats.stops_per_row == [0]


# --- request fields (issue 48.15) -------------------------------------------------------------------


def _parse(body, bundle, chat=False):
    from unmask.serve.protocol import parse

    return parse(body, bundle, bundle.name, chat=chat, default_timeout=1.0)


@pytest.mark.parametrize("field", ["timeout", "gamma", "temperature", "top_p", "tau", "block_size", "steps", "slots"])
def test_a_huge_integer_in_a_numeric_field_is_a_400(ar_server, field):
    huge = "9" * 400  # a JSON integer no float holds
    raw = ('{"prompt": "Zoo", "max_tokens": 2, "%s": %s}' % (field, huge)).encode()
    req = urllib.request.Request(ar_server.url + "/v1/completions", data=raw,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    body = json.loads(e.value.read())
    assert e.value.code == 400, body  # before: 500 (OverflowError)
    assert field in body["error"]["message"] and body["error"]["param"] == field


@pytest.mark.parametrize("value", [0, 1, "", "yes", [], {}])
def test_stream_must_be_a_boolean(ar_bundle, value):
    with pytest.raises(ApiError, match="stream must be true or false") as e:
        _parse({"prompt": "Zoo", "stream": value}, ar_bundle)
    assert e.value.status == 400 and e.value.param == "stream"
    assert _parse({"prompt": "Zoo", "stream": None}, ar_bundle).stream is False  # null: the default


def test_the_cli_refuses_what_the_server_refuses(capsys):
    one_line_error(capsys, "generate", "Zoo", "--model", "stories260K-sbd", "--decoder", "sbd", "--gamma", "inf",
                   "--no-progress", match="--gamma must be a finite number")
    one_line_error(capsys, "generate", "Zoo", "--model", "stories260K", "--stop", "ab\udcff", "--no-progress",
                   match="not valid Unicode")


def test_a_prompts_file_is_read_within_bounds(capsys, tmp_path, monkeypatch):
    from unmask import prompts as P

    one_line_error(capsys, "generate", "--prompts-file", "/dev/zero", "--model", "stories260K", "--no-progress",
                   match=f"larger than {P.MAX_FILE_BYTES // 2**20} MiB")  # before: MemoryError, reading it whole
    monkeypatch.setattr(P, "MAX_LINE_CHARS", 100)
    f = tmp_path / "p.txt"
    f.write_text("Zoo\n" + "a" * 101 + "\n")
    with pytest.raises(unmask.UnmaskError, match=r"p.txt line 2: .*101 characters.*100"):
        P.read_prompts_file(f)
    monkeypatch.setattr(P, "MAX_FILE_BYTES", 10)
    with pytest.raises(unmask.UnmaskError, match=r"p.txt is larger than 10 bytes"):
        P.read_prompts_file(f)


# --- options the README documents; numpy scalars (issue 48.17) ------------------------------------


def test_the_server_takes_the_tempered_confidence_of_diffusion():
    dlm = unmask.load("stories260K-dlm")
    req = _parse({"prompt": "Zoo", "decoder": "diffusion", "confidence": "tempered", "max_tokens": 8}, dlm)
    assert req.options["confidence"] == "tempered"  # before: unknown parameter 'confidence'
    with pytest.raises(ApiError, match="confidence") as e:
        _parse({"prompt": "Zoo", "decoder": "diffusion", "confidence": 3, "max_tokens": 8}, dlm)
    assert e.value.param == "confidence"
    with ServerThread(create_app(dlm)) as s:
        body = {"prompt": "Zoo", "decoder": "diffusion", "confidence": "tempered", "temperature": 0.5, "seed": 1,
                "max_tokens": 16, "gen_length": 16, "block_size": 8}
        status, out = post(s.url + "/v1/completions", body)
        assert status == 200, out
        api = unmask.generate("Zoo", dlm, "diffusion", confidence="tempered", temperature=0.5, seed=1,
                              max_new_tokens=16, gen_length=16, block_size=8)
        assert out["choices"][0]["text"] == api.texts[0]


def test_numpy_scalars_are_taken_as_numbers(ar_bundle):
    np = pytest.importorskip("numpy")
    sbd = unmask.load("stories260K-sbd")
    plain = unmask.generate("Zoo", sbd, "sbd", max_new_tokens=8, block_size=4, temperature=0.5, top_k=5, top_p=0.9,
                            seed=3, gamma=0.3)
    numpy = unmask.generate("Zoo", sbd, "sbd", max_new_tokens=np.int64(8), block_size=np.int32(4),
                            temperature=np.float32(0.5), top_k=np.int64(5), top_p=np.float64(0.9), seed=np.int64(3),
                            gamma=np.float64(0.3))  # before: "max_new_tokens must be an integer > 0 (got np.int64(8))"
    assert numpy.tokens == plain.tokens
    with pytest.raises(unmask.UnmaskError, match="max_new_tokens"):
        unmask.generate("Zoo", sbd, max_new_tokens=np.float64(8.5))


# --- the API key (issue 52.6) -----------------------------------------------------------------------

KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed(ar_bundle):
    with ServerThread(create_app(ar_bundle, api_key=KEY)) as s:
        yield s


def test_the_api_key_admits_the_right_key_only(keyed):
    def client(key):
        return openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0, timeout=60)

    r = client(KEY).completions.create(model="stories260K", prompt="Zoo", max_tokens=4)
    assert r.choices[0].text and r.usage.completion_tokens == 4
    assert client(KEY).models.list().data[0].id == "stories260K"
    chat = client(KEY).chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2)
    assert chat.usage.completion_tokens == 2
    for wrong in ("sk-wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            client(wrong).completions.create(model="stories260K", prompt="Zoo", max_tokens=4)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert "Authorization: Bearer" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        client("sk-wrong").models.list()
    # no Authorization header at all, and another scheme
    for headers in ({}, {"Authorization": "Basic " + KEY}, {"Authorization": KEY}):
        status, body = post(keyed.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 2}, headers)
        assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
    status, body = post(keyed.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 2},
                        {"Authorization": "bearer  " + KEY})  # the scheme is case-insensitive
    assert status == 200, body


def test_health_metrics_and_the_playground_stay_open(keyed):
    for path in ("/health", "/metrics", "/", "/favicon.ico"):
        status, _, _ = get(keyed.url + path)
        assert status == 200, path
    assert get(keyed.url + "/v1/models")[0] == 401


def test_the_api_key_is_compared_in_constant_time(monkeypatch):
    import asyncio
    import hmac

    from unmask.serve import auth

    seen, real = [], hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))

    async def app(scope, receive, send):
        seen.append("app")

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "headers": [(b"authorization", b"Bearer nope")]}
    asyncio.run(auth.RequireKey(app, b"secret")(scope, None, send))
    assert seen == [(b"nope", b"secret")] and sent[0]["status"] == 401


@pytest.mark.parametrize("key", ["", "two words", "caf\u00e9", "tab\tkey"])
def test_a_bad_api_key_is_refused_before_loading(capsys, key):
    one_line_error(capsys, "serve", "--model", "no-such-model", "--api-key", key, match="--api-key")


def test_the_api_key_comes_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("UNMASK_API_KEY", "two words")
    one_line_error(capsys, "serve", "--model", "no-such-model", match="--api-key")


# --- completions the OpenAI way: a list of prompts, echo (issue 52.7) --------------------------------

PROMPTS = ["Once upon a time", "Zoo", EOS_PROMPT]


@pytest.fixture(scope="module")
def client(ar_server):
    return openai.OpenAI(base_url=ar_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_list_of_prompts_gets_one_choice_per_prompt(ar_bundle, client):
    n = EOS_AT + 4
    alone = [unmask.generate(p, ar_bundle, "ar", max_new_tokens=n) for p in PROMPTS]
    r = client.completions.create(model="stories260K", prompt=PROMPTS, max_tokens=n)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [g.texts[0] for g in alone]
    assert [c.finish_reason for c in r.choices] == ["length", "length", "stop"]
    u = r.usage
    assert u.prompt_tokens == sum(len(g.prompt_tokens[0]) for g in alone)
    assert u.completion_tokens == sum(g.stats.generated for g in alone) == 2 * n + EOS_AT
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    nfe = sum(g.stats.nfe_per_row[0] for g in alone)
    assert u.model_extra["nfe"] == nfe and u.model_extra["tpf"] == pytest.approx((2 * n + EOS_AT + 1) / nfe)


def test_a_list_of_prompts_streams_with_each_chunk_indexed(ar_bundle, client):
    alone = [unmask.generate(p, ar_bundle, "ar", max_new_tokens=12).texts[0] for p in PROMPTS[:2]]
    chunks = list(client.completions.create(model="stories260K", prompt=PROMPTS[:2], max_tokens=12, stream=True))
    texts, reasons = {0: "", 1: ""}, {}
    for c in chunks:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert [texts[0], texts[1]] == alone and reasons == {0: "length", 1: "length"}
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)  # the summed usage comes last, once
    assert chunks[-1].usage.completion_tokens == 24


def test_echo_puts_the_prompt_before_the_completion(ar_bundle, client):
    plain = unmask.generate(PROMPTS[:2], ar_bundle, "ar", max_new_tokens=8).texts
    r = client.completions.create(model="stories260K", prompt=PROMPTS[:2], max_tokens=8, echo=True)
    assert [c.text for c in r.choices] == [p + t for p, t in zip(PROMPTS, plain)]
    assert r.usage.completion_tokens == 16  # the echoed prompt is not completion
    chunks = list(client.completions.create(model="stories260K", prompt="Zoo", max_tokens=8, echo=True, stream=True))
    assert chunks[0].choices[0].text == "Zoo"
    assert "".join(c.choices[0].text for c in chunks) == "Zoo" + unmask.generate("Zoo", ar_bundle, "ar",
                                                                                  max_new_tokens=8).texts[0]
    assert client.completions.create(model="stories260K", prompt="Zoo", max_tokens=8, echo=False).choices[0].text \
        == plain[1]


def test_prompt_lists_and_echo_are_checked(ar_server):
    url = ar_server.url + "/v1/completions"
    cases = [({"prompt": ["Zoo", ""]}, "prompt[1]"), ({"prompt": []}, "an empty list"),
             ({"prompt": [[1, 2], [3]]}, "token-id prompts are not served"), ({"prompt": "Zoo", "echo": 1}, "echo"),
             ({"prompt": ["Zoo"] * 65}, "--max-queue")]
    for body, match in cases:
        status, err = post(url, body)
        assert status == 400 and match in err["error"]["message"], (body, err)
    status, err = post(ar_server.url + "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Hi"}], "echo": True})
    assert status == 400 and err["error"]["param"] == "echo"  # chat completions have no echo


# --- the playground (issue 52.9) --------------------------------------------------------------------


def test_the_server_serves_a_favicon_and_the_page_shows_each_prompt(ar_server):
    status, headers, body = get(ar_server.url + "/favicon.ico")
    assert status == 200 and headers["Content-Type"].startswith("image/svg+xml") and body.startswith(b"<svg")
    status, _, page = get(ar_server.url + "/")
    page = page.decode()
    assert status == 200 and 'rel="icon" href="/favicon.ico"' in page
    for pane in ("main", "ar"):  # each card shows the prompt it continues
        assert f'id="prompt-{pane}"' in page and f'$("prompt-" + suffix).textContent = $("prompt").value' in page


def test_the_canvas_marks_special_tokens_instead_of_printing_them():
    dlm = unmask.load("stories260K-dlm")
    specials = set(dlm.tokenizer.all_special_ids) | set(dlm.stop_token_ids)
    body = {"prompt": DLM_PROMPT, "decoder": "diffusion", "max_tokens": 128, "stream": True, "stream_mode": "canvas"}
    with ServerThread(create_app(dlm)) as s:
        req = urllib.request.Request(s.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.read().decode().split("\n\n")
                      if line.startswith("data: {")]
    steps = [e["unmask"] for e in events if "unmask" in e]
    assert steps
    marked = 0
    for step in steps:
        for i, (t, text) in enumerate(zip(step["canvas"], step["texts"])):
            if t in specials:
                assert text == "" and i in step["special"]
                marked += 1
            else:
                assert i not in step["special"]
            assert text is None or ("<s>" not in text and "</s>" not in text)
    assert marked  # the canvas held the EOS at DLM_EOS_AT: shown as a mark, not as "</s>"
    # the same TPF rule for a diffusion row: its usage equals unmask.generate's row
    api = unmask.generate(DLM_PROMPT, dlm, "diffusion", max_new_tokens=128).stats.row(0)
    assert api["stop_token"] == 1 and events[-1]["usage"]["tpf"] == pytest.approx(api["tpf"])
