"""Issue 50, the server end to end with the real ``openai`` client: logprobs equal to the decoder's own
(AR's for ``ar`` and lossless ``sbd``), streamed with the text they belong to; structured output that
parses and validates; ``logit_bias``; a grammar that allows no token ends the request with an error."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

for _m in ("fastapi", "uvicorn", "prometheus_client", "openai", "jsonschema"):
    pytest.importorskip(_m, reason=f"the server tests need {_m}: pip install -e '.[test]'")

import jsonschema  # noqa: E402
import openai  # noqa: E402

import unmask  # noqa: E402
from unmask.api import encode_prompts  # noqa: E402
from unmask.decode import spec_for  # noqa: E402
from unmask.decode.verify.batch import Verify  # noqa: E402
from unmask.serve import create_app  # noqa: E402
from unmask.serve.server import ServerThread  # noqa: E402

MODEL = "stories260K-sbd"
PROMPT = "Once upon a time"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
LOSSLESS = {"decoder": "sbd", "verify": True}


@pytest.fixture(scope="module")
def bundle():
    return unmask.load(MODEL)


@pytest.fixture(scope="module")
def server(bundle):
    with ServerThread(create_app(bundle, max_batch_size=8)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def decoded(bundle, decoder, prompt=PROMPT, n=16, k=3, **options):
    """(tokens, logprobs) of ``decoder`` on ``prompt`` encoded as the server encodes it."""
    ids = encode_prompts(bundle, [prompt], n, None)[0]
    out = spec_for(decoder, bundle.kind).decode(bundle, [ids], max_new_tokens=n, logprobs=k,
                                                stop_token_ids=bundle.stop_token_ids, **options)
    return out.tokens[0], out.logprobs[0]


# --- logprobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{"decoder": "ar"}, LOSSLESS], ids=["ar", "lossless-sbd"])
def test_completion_logprobs_equal_ar_s_and_stream_with_their_text(bundle, client, extra):
    tokens, entries = decoded(bundle, "ar")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=3, extra_body=extra)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(tokens) == r.usage.completion_tokens
    assert lp.token_logprobs == pytest.approx([e.logprob for e in entries], abs=1e-5)
    for top, e in zip(lp.top_logprobs, entries):
        assert 3 <= len(top) <= 4  # the k alternatives and the chosen token
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx([v for _, v in e.top], rel=1e-5, abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(off < len(r.choices[0].text) for off in lp.text_offset)
    text, got = "", []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=3, stream=True,
                                           extra_body=extra):
        c = chunk.choices[0]
        if c.text:  # the chunk carries the logprobs of the tokens of its own text, from its first character
            assert c.logprobs.text_offset[0] == len(text), (text, c.text, c.logprobs)
        text += c.text
        if c.logprobs is not None:
            assert all(off < len(text) for off in c.logprobs.text_offset)  # no token ahead of its text
            got += c.logprobs.token_logprobs
    assert text == r.choices[0].text and got == lp.token_logprobs


def test_chat_logprobs_in_openai_s_shape_streamed_and_not(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=12, logprobs=True,
              top_logprobs=2, extra_body=LOSSLESS)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= item.top_logprobs[0].logprob + 1e-6
        assert isinstance(item.token, str) and all(0 <= b < 256 for b in item.bytes)
    streamed = [item for chunk in client.chat.completions.create(**kw, stream=True) for c in chunk.choices
                if c.logprobs is not None for item in c.logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]


def test_a_canvas_decoder_reports_commit_time_logprobs():
    dlm = unmask.load("stories260K-dlm")
    with ServerThread(create_app(dlm)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="stories260K-dlm", prompt=PROMPT, max_tokens=16, logprobs=1, extra_body={"decoder": "diffusion"})
        r = c.completions.create(**kw)
        chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True)]
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens and all(v <= 0 for v in lp.token_logprobs)
    # streamed: the text as it commits, the logprobs (reported when the row finishes) with the last chunk
    assert "".join(ch.text for ch in chunks) == r.choices[0].text
    assert [v for ch in chunks if ch.logprobs for v in ch.logprobs.token_logprobs] == lp.token_logprobs


# --- structured output -------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{"decoder": "ar"}, LOSSLESS], ids=["ar", "lossless-sbd"])
def test_json_schema_output_parses_and_validates(client, extra):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person"}],
                                          max_tokens=64, response_format=fmt, extra_body=extra)
    text = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, extra_body={**extra,
                                                                                             "response_format": fmt})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=64, stream=True, extra_body={**extra, "response_format": fmt}))
    assert streamed == done.choices[0].text
    obj = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48,
                                    extra_body={**extra, "response_format": {"type": "json_object"}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    else:
        assert obj.choices[0].text.startswith("{")


def test_structured_outputs_regex_and_choice(client):
    for extra in ({"decoder": "ar"}, LOSSLESS):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, n=2, temperature=1.0, seed=5,
                                      extra_body={**extra, "structured_outputs": {"regex": r"(yes|no), [a-z]{1,6}\."}})
        for c in r.choices:
            assert re.fullmatch(r"(yes|no), [a-z]{1,6}\.", c.text) and c.finish_reason == "stop", c.text
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A color?"}],
                                           max_tokens=8, extra_body={**extra, "structured_outputs": {
                                               "choice": ["red", "green", "blue"]}})
        assert r.choices[0].message.content in ("red", "green", "blue")


def test_a_grammar_that_cannot_finish_within_max_tokens_ends_at_the_length_limit(client):
    for extra in ({"decoder": "ar"}, LOSSLESS):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                      extra_body={**extra, "structured_outputs": {"regex": r"[a-z ]{40,60}\."}})
        c = r.choices[0]
        assert c.finish_reason == "length" and r.usage.completion_tokens == 6
        assert re.fullmatch(r"[a-z ]+", c.text), c.text  # a prefix the grammar allows


# --- logit_bias --------------------------------------------------------------------------------


def test_logit_bias_steers_ar_and_lossless_sbd_alike(bundle, client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"decoder": "ar"})
    first = decoded(bundle, "ar", n=8)[0][0]  # the greedy first id
    texts = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logit_bias={str(first): -100},
                                       extra_body=extra).choices[0].text for extra in ({"decoder": "ar"}, LOSSLESS)]
    assert texts[0] == texts[1] != plain.choices[0].text  # the same steer on both, exact under lossless
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias={"400": 100},
                                       extra_body=LOSSLESS)
    assert forced.choices[0].text.strip() == bundle.tokenizer.decode([400] * 4).strip()


# --- a grammar that allows no token --------------------------------------------------------------


def test_a_row_whose_grammar_allows_no_token_ends_with_an_error(bundle, monkeypatch):
    step = Verify.step

    def dead_end(self):  # the grammar of every constrained row allows no token at its next step
        done = step(self)
        stuck = [r for r in self.rows.values() if r.job.grammar is not None]
        for row in self.drop([r.job.id for r in stuck]):
            row.finish, row.error = "error", "no token allowed"
            done.append(row)
        return done

    monkeypatch.setattr(Verify, "step", dead_end)
    with ServerThread(create_app(bundle)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        body = dict(model=MODEL, prompt=PROMPT, max_tokens=16, extra_body={"decoder": "ar", "structured_outputs": {
            "regex": "[a-z ]+"}})
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**body)
        assert e.value.body["code"] == "grammar_dead_end" and "no token allowed" in e.value.body["message"]
        req = urllib.request.Request(s.url + "/v1/completions", data=json.dumps(
            {"prompt": PROMPT, "max_tokens": 16, "decoder": "ar", "stream": True,
             "structured_outputs": {"regex": "[a-z ]+"}}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            data = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "grammar_dead_end"
        ok = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"decoder": "ar"})
        assert ok.usage.completion_tokens == 4  # still serving
