"""Issue 50 under hostile inputs: a grammar that llguidance accepts but that has no finite output, or that
trips the engine's limits while decoding, is an error naming the grammar (API: UnmaskError; server: a
400 naming the field), never a 200 whose text does not match the grammar."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

import unmask
from unmask.errors import UnmaskError
from unmask.grammar import Grammar, compile as compile_grammar

MODEL = "stories260K-sbd"
PROMPT = "Once upon a time"
EMPTY_LANGUAGE = ['start: start "a"', "start: a\na: b\nb: a"]  # no finite string: nothing can be generated
ENGINE_LIMIT = [{"regex": "a{1000000}"},  # llguidance's lexer gives up after the first "a"
                {"json": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}]  # infinite


@pytest.fixture(scope="module")
def bundle():
    return unmask.load(MODEL)


@pytest.mark.parametrize("text", EMPTY_LANGUAGE)
def test_a_grammar_with_no_output_is_refused_when_compiled(bundle, text):
    with pytest.raises(UnmaskError, match=r"^invalid grammar: .*allows no output") as e:
        compile_grammar(bundle, Grammar.lark(text))
    assert "\n" not in str(e.value) and "<state>" not in str(e.value)


@pytest.mark.parametrize("spec", ENGINE_LIMIT)
def test_api_engine_limit_names_the_grammar(bundle, spec):
    grammar = Grammar.regex(spec["regex"]) if "regex" in spec else Grammar.json_schema(spec["json"])
    for decoder in ("ar", "sbd"):
        with pytest.raises(UnmaskError) as e:
            unmask.generate(PROMPT, bundle, decoder, max_new_tokens=8, grammar=grammar)
        msg = str(e.value)
        assert "report it" not in msg and "<state>" not in msg and "\n" not in msg
        assert "simplify the grammar" in msg


def _post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def server(bundle):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from unmask.serve import create_app
    from unmask.serve.server import ServerThread
    with ServerThread(create_app(bundle, max_batch_size=4)) as s:
        yield s


@pytest.mark.parametrize("decoder", ["ar", "sbd"])
@pytest.mark.parametrize("spec", [{"grammar": t} for t in EMPTY_LANGUAGE] + ENGINE_LIMIT)
def test_server_never_answers_200_off_the_grammar(server, decoder, spec):
    for stream in (False, True):
        status, text = _post(server.url, {"prompt": PROMPT, "max_tokens": 8, "decoder": decoder, "stream": stream,
                                          "structured_outputs": spec})
        if stream and status == 200:  # the error after the stream began: an error event, then [DONE]
            data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert data[-1] == "[DONE]", text
            err = json.loads(data[-2])["error"]
        else:
            assert status == 400, text
            err = json.loads(text)["error"]
        assert err["param"] == "structured_outputs" and "report it" not in err["message"], err
        assert "\n" not in err["message"] and "<state>" not in err["message"], err
    status, text = _post(server.url, {"prompt": PROMPT, "max_tokens": 4, "decoder": decoder})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 4  # still serving


# --- logit_bias keys and values that are numbers to Python but not token ids / biases ----------------

BAD_BIAS = [{"\u00b3": 1},  # superscript three: str.isdigit() says yes, int() raises
            {"\u2460": 1},  # circled one: the same
            {"\u0663": 1},  # Arabic-Indic three: int() reads it as 3, which names no id the client meant
            {"9" * 5000: 1},  # past Python's int-from-text digit limit
            {"3": 10 ** 400}]  # an int too large for a float


BAD_BIAS_IDS = ["superscript", "circled", "arabic", "5000-digits", "1e400"]


@pytest.mark.parametrize("bias", BAD_BIAS, ids=BAD_BIAS_IDS)
def test_api_logit_bias_odd_numbers_are_refused(bundle, bias):
    with pytest.raises(UnmaskError, match=r"^logit_bias"):
        unmask.generate(PROMPT, bundle, "ar", max_new_tokens=2, logit_bias=bias)


@pytest.mark.parametrize("bias", BAD_BIAS, ids=BAD_BIAS_IDS)
def test_server_logit_bias_odd_numbers_are_400(server, bias):
    status, text = _post(server.url, {"prompt": PROMPT, "max_tokens": 2, "logit_bias": bias})
    assert status == 400 and json.loads(text)["error"]["param"] == "logit_bias", text


# --- grammars whose compile recursed past the C stack (a segfault: the server died) or ran for minutes ---

CHAINS = {"lark-3000": "Grammar.lark('start: r0\\n' + '\\n'.join(f'r{i}: \"x\" r{i + 1} | \"y\"' for i in range(3000)) + "
                       "'\\nr3000: \"z\"')",
          "ref-3000": "Grammar.json_schema({'$ref': '#/$defs/a0', '$defs': {**{f'a{i}': {'type': 'array', 'items': "
                      "{'$ref': f'#/$defs/a{i + 1}'}} for i in range(3000)}, 'a3000': {'type': 'integer'}}})",
          "lark-50000": "Grammar.lark('start: r0\\n' + '\\n'.join(f'r{i}: \"x\" r{i + 1}' for i in range(50000)) + "
                        "'\\nr50000: \"z\"')"}


@pytest.mark.parametrize("name", CHAINS)
def test_a_deep_rule_chain_compiles_or_is_refused_without_crashing(name):
    import subprocess
    import sys
    code = ("import unmask\nfrom unmask.errors import UnmaskError\nfrom unmask.grammar import Grammar, compile\n"
            f"b = unmask.load({MODEL!r})\ntry:\n    compile(b, {CHAINS[name]})\n    print('compiled')\n"
            "except UnmaskError as e:\n    print('refused:', e)\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, (got.returncode, got.stderr[-500:])  # -11: the C stack overflowed
    assert got.stdout.startswith(("compiled", "refused: invalid")), got.stdout
    if name == "lark-50000":
        assert "rules" in got.stdout and "\n" not in got.stdout.strip()


def test_a_huge_gbnf_grammar_is_refused_before_its_slow_conversion(bundle):
    import time
    text = "root ::= r0\n" + "\n".join(f'r{i} ::= "x" r{i + 1} | "y"' for i in range(1500)) + '\nr1500 ::= "z"'
    t0 = time.perf_counter()
    with pytest.raises(UnmaskError, match=r"^invalid GBNF grammar: .*rules"):
        compile_grammar(bundle, Grammar.lark(text))
    assert time.perf_counter() - t0 < 1.0  # llguidance's converter is quadratic in the rules: 2 s here, 13 s at 4,000


def test_a_schema_nested_past_pythons_limit_is_an_unmask_error():
    schema = {"type": "integer"}
    for _ in range(2000):
        schema = {"anyOf": [schema, {"type": "null"}]}
    with pytest.raises(UnmaskError, match="JSON schema"):
        Grammar.json_schema(schema)


def test_api_numpy_and_torch_numbers_are_ids_biases_and_ks(bundle):
    """Ids from a tokenizer's numpy / torch output name the same token as a Python int (they were refused as
    ids "this model does not have", naming an id inside the vocabulary)."""
    import numpy as np
    import torch
    want = unmask.generate(PROMPT, bundle, "ar", max_new_tokens=6, logprobs=2, logit_bias={13: -100.0, 432: 5.0})
    for bias in ({np.int64(13): np.float32(-100), np.int32(432): np.float64(5)},
                 {torch.tensor(13): torch.tensor(-100.0).item(), 432: np.int64(5)}):
        got = unmask.generate(PROMPT, bundle, "ar", max_new_tokens=6, logprobs=np.int64(2), logit_bias=bias)
        assert got.tokens == want.tokens and got.logprobs == want.logprobs
