"""Fixes from the round-12 fault pass and new-user pass: each test failed before its fix."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from conftest import one_line_error

import unmask
from unmask.errors import UnmaskError


def test_the_lm_eval_adapter_without_lm_eval_is_one_line_and_exit_2():
    """lm_eval hidden (``sys.modules["lm_eval"] = None``), as on a machine without the extra."""
    hide = ("import runpy, sys; sys.modules['lm_eval'] = None; "
            "runpy.run_module('unmask.eval.lm_eval_adapter', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", hide, "--model", "unmask"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "pip install -e '.[lm-eval]'" in p.stderr


@pytest.mark.parametrize("option, value", [("steps", 2**63), ("tokens_per_step", 2**63), ("block_size", 2**63),
                                           ("steps", -2**63 - 1)])
def test_an_integer_a_tensor_cannot_hold_is_refused_by_name(option, value):
    """steps / tokens_per_step >= 2**63 overflowed inside torch (a traceback; a 500 from the server), and
    early-bird's block size claimed an internal bug."""
    model = "stories260K-dlm"
    decoder = "early-bird" if option == "block_size" else "diffusion"
    opts = {option: value, **({"policy": "top-k"} if option == "tokens_per_step" else {})}
    with pytest.raises(UnmaskError, match=f"--{option.replace('_', '-')} is out of range"):
        unmask.generate("Hi", model, decoder, max_new_tokens=8, **opts)


def test_a_gen_length_past_the_context_names_gen_length(capsys):
    one_line_error(capsys, "generate", "Hi", "--model", "stories260K-dlm", "--gen-length", 512, match="lower --gen-length")
    line = one_line_error(capsys, "generate", "Hi", "--model", "stories260K-dlm", "--block-size", 1024, "-n", 8)
    assert "--block-size" in line


def test_an_empty_trace_path_is_not_called_a_directory(capsys):
    one_line_error(capsys, "generate", "Hi", "--trace", "", "-n", 4, match="--trace path is empty")


def test_a_policy_knob_names_the_policy_that_takes_it(capsys):
    one_line_error(capsys, "generate", "Hi", "--decoder", "sbd", "--tau", 0.9, "-n", 4, match="--policy threshold")


def test_kind_errors_name_the_kind_flag(capsys, tmp_path):
    one_line_error(capsys, "generate", "Hi", "--model", "stories260K", "--kind", "sbd", "-n", 4,
                   match="drop --kind, or for a causal model use --adapter sbd")
    one_line_error(capsys, "generate", "Hi", "--model", "stories260K", "--kind", "nope", "-n", 4,
                   match="unknown model kind 'nope'")


def test_an_eval_option_of_the_wrong_type_says_so(capsys):
    one_line_error(capsys, "eval", "--task", "stories", "-O", "block_size=abc", "--limit", 1, "-n", 4, "--no-progress",
                   match="--option block_size must be an integer")
    one_line_error(capsys, "eval", "--task", "stories", "--model", "stories260K-dlm", "-O", "gamma=x", "--limit", 1,
                   "-n", 4, "--no-progress", match="--option gamma must be a number")


def test_a_distill_source_that_is_prompt_text_says_so():
    from unmask.train.distill import distill

    with pytest.raises(UnmaskError, match="not prompt text"):
        distill("/nonexistent-dir/x.jsonl", model="stories260K", prompts=["Once upon a time"])


pytest.importorskip("fastapi", reason="the server tests need the serve extra: pip install -e '.[test]'")

from unmask.serve import create_app  # noqa: E402
from unmask.serve.server import ServerThread  # noqa: E402

from test_serve import MODEL, post  # noqa: E402


@pytest.fixture(scope="module")
def bundle():
    return unmask.load(MODEL)


def test_an_infinite_request_timeout_is_refused_at_start(bundle):
    """`serve --timeout inf` started, then answered every request 400 (the server default failed the request check)."""
    from unmask.serve.server import serve

    with pytest.raises(UnmaskError, match="finite number of seconds"):
        serve(MODEL, request_timeout=math.inf)
    with pytest.raises(UnmaskError, match="--timeout"):
        create_app(bundle, request_timeout=math.inf)


def test_bad_keys_and_trailing_slashes_get_json_errors(bundle):
    """A lone-surrogate key was a 500 (its param could not be encoded); /v1/completions/ was a 307 redirect."""
    import json
    import urllib.error
    import urllib.request

    app = create_app(bundle, max_batch_size=2, max_queue=4)
    with ServerThread(app) as s:
        status, _, body = post(s.url + "/v1/completions", {"prompt": "a", "\ud800": 1})
        assert status == 400 and body["error"]["param"] == "\\ud800"
        req = urllib.request.Request(s.url + "/v1/completions/", data=b'{"prompt": "a"}', method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 404 and "error" in json.loads(e.value.read())
        status, _, body = post(s.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "decoder": "sbd", "verify": False,
                                                           "policy": "top-k", "tokens_per_step": 2**63})
        assert status == 400 and "out of range" in body["error"]["message"]
        assert body["error"]["param"] == "tokens_per_step"


def test_max_completion_tokens_is_read_and_checked_beside_max_tokens(bundle):
    from unmask.serve.errors import ApiError
    from unmask.serve.protocol import parse

    def parsed(**fields):
        return parse({"prompt": "Zoo", **fields}, bundle, MODEL, chat=False, default_timeout=1.0)

    assert parsed(max_tokens=None, max_completion_tokens=5).max_tokens == 5  # a null max_tokens hid it
    assert parsed(max_tokens=5, max_completion_tokens=5).max_tokens == 5
    with pytest.raises(ApiError, match="differ") as e:
        parsed(max_tokens=5, max_completion_tokens=-5)  # the second was ignored, even when invalid
    assert e.value.status == 400 and e.value.param == "max_completion_tokens"


def test_a_query_limit_hit_by_the_draft_size_table_names_the_table():
    from unmask.serve.limits import query_tokens

    bundle = unmask.load("stories260K-sbd")
    q, why, param = query_tokens(bundle, "sbd", {"draft": "linear"}, 16, draft_k=40)
    assert q == 80 and "--draft-sizes table" in why and param == "block_size"
    q, why, _ = query_tokens(bundle, "sbd", {"draft": "linear", "block_size": 4}, 16, draft_k=40)
    assert q == 8 and "block_size 4" in why


def test_decode_stats_print_their_tpf_and_tps():
    from unmask.decode import DecodeStats

    s = DecodeStats(nfe=4, nfe_per_row=[4], tokens_per_row=[8], seconds=0.5, stops_per_row=[0])
    assert repr(s).startswith("DecodeStats(nfe=4, tpf=2.000, tps=16.0, generated=8, seconds=0.5000, ")
