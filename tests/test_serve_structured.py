"""Issue 50, the server: the request fields it used to refuse (``n``, ``logprobs`` / ``top_logprobs``,
``logit_bias``, ``response_format``, ``structured_outputs``), validated with one-line 400s naming the field,
and ``n`` choices run as their own rows (indexed as OpenAI does, reproducible with a seed, independent),
in response shapes the ``openai`` client's own models validate."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

for _m in ("fastapi", "uvicorn", "prometheus_client", "openai"):
    pytest.importorskip(_m, reason=f"the server tests need {_m}: pip install -e '.[test]'")

import openai  # noqa: E402
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

import unmask  # noqa: E402
from conftest import one_line_error  # noqa: E402
from unmask.serve import create_app  # noqa: E402
from unmask.serve.errors import ApiError  # noqa: E402
from unmask.serve.limits import Limits  # noqa: E402
from unmask.serve.protocol import parse  # noqa: E402
from unmask.serve.server import ServerThread  # noqa: E402

MODEL = "stories260K-sbd"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}


@pytest.fixture(scope="module")
def bundle():
    return unmask.load(MODEL)


@pytest.fixture(scope="module")
def server(bundle):
    with ServerThread(create_app(bundle, max_batch_size=8, max_queue=16, limits=Limits(max_n=4))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(url, body):
    """(status, parsed JSON body) of a POST, errors included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sse(url, body) -> list[dict]:
    """The data objects of a streamed answer, [DONE] excluded."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = r.read().decode().splitlines()
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def refused(bundle, body, param, match, chat=False, limits=None):
    with pytest.raises(ApiError) as e:
        parse(body, bundle, MODEL, chat=chat, default_timeout=5.0, limits=limits)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    assert "\n" not in e.value.message and match in e.value.message, e.value.message
    return e.value.message


# --- validation --------------------------------------------------------------------------------


def test_the_fields_parse_into_the_request(bundle):
    req = parse({"prompt": "Zoo", "logprobs": 3, "n": 2, "logit_bias": {"5": -100, 7: 2.5},
                 "structured_outputs": {"regex": "[a-z]+"}, "decoder": "ar"}, bundle, MODEL, chat=False,
                default_timeout=5.0)
    assert (req.logprobs, req.n, req.logit_bias) == (3, 2, {5: -100.0, 7: 2.5})
    assert req.grammar is not None and req.grammar.grammar.kind == "regex"
    chat = parse({"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 4,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
                 bundle, MODEL, chat=True, default_timeout=5.0)
    assert chat.logprobs == 4 and chat.grammar.grammar.kind == "json_schema" and chat.n == 1
    plain = parse({"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}, bundle, MODEL, chat=True,
                  default_timeout=5.0)
    assert plain.logprobs == 0 and plain.grammar is None  # the chosen token's logprob, no alternatives
    for neutral in ({"logprobs": False}, {"logprobs": None}, {"top_logprobs": 0}, {"response_format": {"type": "text"}},
                    {"best_of": 1}, {"n": 1}, {"logit_bias": {}}):
        req = parse({"prompt": "Zoo", **neutral}, bundle, MODEL, chat=False, default_timeout=5.0)
        assert req.logprobs is None and req.grammar is None and req.logit_bias is None and req.n == 1


def test_bad_fields_answer_400_naming_the_field(bundle):
    msg = refused(bundle, {"prompt": "Zoo", "logit_bias": {"5": 1, "99999": 1, "x": 2}}, "logit_bias", "99999")
    assert "x" in msg and "5," not in msg  # the unknown ids, not the known one
    refused(bundle, {"prompt": "Zoo", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]")
    refused(bundle, {"prompt": "Zoo", "n": 9}, "n", "--max-n")
    refused(bundle, {"prompt": "Zoo", "n": 3}, "n", "[1, 2]", limits=Limits(max_n=2))
    refused(bundle, {"prompt": "Zoo", "n": 0}, "n", "[1, 8]")
    refused(bundle, {"prompt": "Zoo", "n": 2, "best_of": 3}, "best_of", "equal to n")
    refused(bundle, {"prompt": "Zoo", "logprobs": 21}, "logprobs", "[0, 20]")
    refused(bundle, {"prompt": "Zoo", "logprobs": True}, "logprobs", "integer")
    refused(bundle, {"prompt": "Zoo", "logprobs": 2, "echo": True}, "echo", "echo")
    refused(bundle, {"prompt": "Zoo", "top_logprobs": 2}, "top_logprobs", "chat field")
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    refused(bundle, {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]", chat=True)
    refused(bundle, {**chat, "top_logprobs": 3}, "top_logprobs", '"logprobs": true', chat=True)
    refused(bundle, {**chat, "logprobs": 3}, "logprobs", "true or false", chat=True)
    refused(bundle, {"prompt": "Zoo", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "invalid json schema")
    refused(bundle, {"prompt": "Zoo", "response_format": {"type": "yaml"}}, "response_format", "json_schema")
    refused(bundle, {"prompt": "Zoo", "structured_outputs": {"regex": "("}}, "structured_outputs", "invalid regex")
    refused(bundle, {"prompt": "Zoo", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
            "exactly one")
    refused(bundle, {"prompt": "Zoo", "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs", "not both")


def test_structured_outputs_names_an_unknown_key_and_counts_only_set_ones(bundle):
    # vLLM clients send options beside the grammar (disable_any_whitespace, backend): name the one not served
    msg = refused(bundle, {"prompt": "Zoo", "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
                  "structured_outputs", "disable_any_whitespace")
    assert "unknown key" in msg, msg
    # json_object false asks for nothing: not reported as the one key given
    msg = refused(bundle, {"prompt": "Zoo", "structured_outputs": {"json_object": False}}, "structured_outputs",
                  "exactly one")
    assert "got none" in msg, msg
    msg = refused(bundle, {"prompt": "Zoo", "structured_outputs": {"regex": "a", "choice": ["b"], "json": None}},
                  "structured_outputs", "exactly one")
    assert "(got choice, regex)" in msg, msg


def test_a_grammar_on_a_decoder_that_takes_none_names_those_that_do(bundle):
    msg = refused(bundle, {"prompt": "Zoo", "decoder": "sbd", "verify": False,
                           "response_format": {"type": "json_object"}}, "response_format", "lossy")
    assert "ar, sbd (lossless)" in msg
    dlm = unmask.load("stories260K-dlm")
    for decoder in ("diffusion", "early-bird"):
        with pytest.raises(ApiError) as e:
            parse({"prompt": "Zoo", "decoder": decoder, "structured_outputs": {"choice": ["a", "b"]}}, dlm, "dlm",
                  chat=False, default_timeout=5.0)
        assert e.value.status == 400 and e.value.param == "structured_outputs"
        assert f"decoder {decoder!r} does not take a grammar" in e.value.message
    # logprobs and logit_bias are served by every decoder
    req = parse({"prompt": "Zoo", "decoder": "diffusion", "logprobs": 2, "logit_bias": {"3": 1}}, dlm, "dlm",
                chat=False, default_timeout=5.0)
    assert req.logprobs == 2 and req.logit_bias == {3: 1.0}


def test_a_grammar_on_a_model_whose_decoders_take_none_says_so(bundle):
    # no decoder of a masked-diffusion model takes a grammar: the fix is another model, not "choose one"
    dlm = unmask.load("stories260K-dlm")
    with pytest.raises(ApiError) as e:
        parse({"prompt": "Zoo", "response_format": {"type": "json_object"}}, dlm, "dlm", chat=False,
              default_timeout=5.0)
    msg = e.value.message
    assert e.value.status == 400 and e.value.param == "response_format" and "\n" not in msg, msg
    assert "choose one" not in msg and "nor does any decoder of this model" in msg and "ar and lossless sbd" in msg, msg
    assert "drop 'response_format'" in msg, msg


def test_bad_fields_through_the_server_and_the_openai_client(server, client):
    for body, param in (({"prompt": "x", "n": 5}, "n"), ({"prompt": "x", "logit_bias": {"70000": 1}}, "logit_bias"),
                        ({"prompt": "x", "logprobs": 30}, "logprobs"),
                        ({"prompt": "x", "decoder": "sbd", "verify": False, "structured_outputs": {"regex": "a+"}},
                         "structured_outputs")):
        for stream in (False, True):
            status, err = post(server.url + "/v1/completions", {**body, "stream": stream})
            assert status == 400 and err["error"]["param"] == param, err
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                       top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"
    status, err = post(server.url + "/v1/completions", {"prompt": ["a", "b", "c", "d", "e"], "n": 4})
    assert status == 400 and err["error"]["param"] == "n" and "16" in err["error"]["message"]  # 20 jobs > --max-queue


def test_text_offsets_and_chunks_count_a_character_split_over_byte_tokens_once(bundle):
    # '☃' is three byte-fallback tokens: they all start at offset 0 and belong to the chunk holding '☃'
    from unmask.decode.engine.shaping import TokenLogprob
    from unmask.serve.logprobs import ChoiceLogprobs

    tok = bundle.tokenizer
    prompt = tok.encode("Hi", add_special_tokens=True)
    ids = tok.encode("Hi☃é ok", add_special_tokens=True)[len(prompt):]
    assert tok.decode(ids) == "☃é ok" and len(ids) == 6  # <0xE2> <0x98> <0x83> é ▁o k

    def choice():
        c = ChoiceLogprobs(bundle, prompt, chat=False)
        c.add([TokenLogprob(token=i, logprob=-1.0, top=()) for i in ids])
        return c

    assert choice().whole(None)["text_offset"] == [0, 0, 0, 1, 2, 4]
    streamed = choice()
    assert len(streamed.upto(1)["tokens"]) == 3  # the chunk '☃'
    assert len(streamed.upto(2)["tokens"]) == 1  # 'é'
    assert streamed.rest(None)["text_offset"] == [2, 4]


def test_max_n_is_a_serve_option(capsys):
    one_line_error(capsys, "serve", "--max-n", "0", "--port", "0", match="--max-n")


# --- n -----------------------------------------------------------------------------------------


def test_n_sampled_choices_are_reproducible_independent_and_indexed(bundle, client):
    kw = dict(model=MODEL, prompt="Zoo", max_tokens=12, temperature=1.0, seed=7, n=3,
              extra_body={"decoder": "ar"})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]  # a seeded request reproduces every choice
    assert len(set(texts)) == 3  # and its choices are independent samples, not copies
    one = client.completions.create(**{**kw, "n": 1})
    assert one.choices[0].text == texts[0]  # choice 0 draws with the generator of the prompt alone
    # choice i is what unmask.generate gives row i of the prompt repeated n times (the same generators)
    gen = unmask.generate(["Zoo"] * 3, bundle, "ar", max_new_tokens=12, temperature=1.0, seed=7)
    assert gen.texts == texts
    assert a.usage.completion_tokens == sum(map(len, gen.tokens))  # usage counts every choice
    assert a.usage.prompt_tokens == one.usage.prompt_tokens == len(gen.prompt_tokens[0])  # and the prompt once


def test_n_with_a_prompt_list_indexes_prompt_times_n_plus_i(client):
    r = client.completions.create(model=MODEL, prompt=["Once upon a time", "Zoo"], max_tokens=6, n=2,
                                  temperature=0.8, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model=MODEL, prompt="Zoo", max_tokens=6, n=2, temperature=0.8, seed=3)
    assert [c.text for c in r.choices[2:]] == [c.text for c in alone.choices]
    one = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert r.usage.prompt_tokens == alone.usage.prompt_tokens + one.usage.prompt_tokens  # each prompt once


def test_n_streams_every_choice_by_index(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell a story"}], max_tokens=10, n=2,
              temperature=1.0, seed=11)
    whole = client.chat.completions.create(**kw)
    texts, roles = {0: "", 1: ""}, set()
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            roles |= {c.index} if c.delta.role else set()
            texts[c.index] += c.delta.content or ""
    assert roles == {0, 1} and texts == {c.index: c.message.content for c in whole.choices}
    assert texts[0] != texts[1]


def test_response_shapes_validate_against_the_openai_models(server):
    """The raw answers with logprobs, n and a grammar validate strictly against the openai client's models."""
    base = {"max_tokens": 8, "decoder": "ar", "n": 2, "temperature": 0.7, "seed": 1}
    status, body = post(server.url + "/v1/completions", {**base, "prompt": "Zoo", "logprobs": 2})
    assert status == 200, body
    Completion.model_validate(body, strict=True)
    status, body = post(server.url + "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "Hi"}],
                                                              "logprobs": True, "top_logprobs": 2})
    assert status == 200, body
    ChatCompletion.model_validate(body, strict=True)
    for chunk in sse(server.url + "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "Hi"}],
                                                           "logprobs": True, "top_logprobs": 2}):
        ChatCompletionChunk.model_validate(chunk, strict=True)
