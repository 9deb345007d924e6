"""Faults found by the round-13 fault pass (hostile or careless input to what round 13 added)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

import unmask
from unmask.errors import UnmaskError

SHIPPED = Path(unmask.__file__).parent / "checkpoints"


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_number_in_config_json_is_refused_at_load(tmp_path, value):
    """rms_norm_eps: NaN (json.loads reads it) loaded, and every decode wrote token 0 without an error."""
    d = tmp_path / "ckpt"
    shutil.copytree(SHIPPED / "stories260K", d)
    cfg = d / "config.json"
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-05', f'"rms_norm_eps": {value}'))
    why = rf"(?i)config\.json: rms_norm_eps is -?{value.lstrip('-')[:3]}.*not a finite number"
    with pytest.raises(UnmaskError, match=why):
        unmask.load(str(d))


def test_a_nested_non_finite_number_in_config_json_is_named_by_its_path(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(SHIPPED / "stories260K", d)
    cfg = d / "config.json"
    cfg.write_text(cfg.read_text().replace('"rope_theta": 10000.0', '"rope_theta": Infinity'))
    with pytest.raises(UnmaskError, match=r"rope_parameters\.rope_theta is inf"):
        unmask.load(str(d))


def test_the_batch_memory_check_counts_no_more_cache_than_the_context_window(monkeypatch):
    """--max-cache-tokens past the context window cannot be reached (a request's prompt + completion
    must fit the window), so it must not be counted: 2**40 tokens on stories260K (512) fits a small batch."""
    from unmask import memory
    from unmask.serve import create_app
    from unmask.serve.limits import Limits

    monkeypatch.setattr(memory, "free_bytes", lambda device: 2**30)
    bundle = unmask.load("stories260K")
    create_app(bundle, max_batch_size=8, limits=Limits(max_cache_tokens=2**40))
    with pytest.raises(UnmaskError, match=r"a row's 512-token KV cache"):
        create_app(bundle, max_batch_size=10_000, limits=Limits(max_cache_tokens=2**40))


FORKS = """
import os, time
made = 0
try:
    for _ in range({n}):
        if os.fork() == 0:
            time.sleep(60)  # the supervisor kills every descendant when the program ends
            os._exit(0)
        made += 1
except OSError as e:
    print("refused", made, type(e).__name__)
else:
    print("made", made)
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or not sys.platform.startswith("linux"),
                    reason="the process bound rides on the per-run uid the sandbox drops to as root")
@pytest.mark.parametrize("split", [False, True])
def test_a_fork_bomb_is_bounded_by_a_process_count_not_only_the_clock(split):
    """Before, nothing bounded the processes a program starts before its timeout (pid_max for the
    whole machine); the per-run uid now holds at most sandbox.MAX_PROCESSES tasks."""
    from unmask.eval import sandbox

    n = sandbox.MAX_PROCESSES + 40
    program = FORKS.format(n=n)
    r = sandbox.run_program(program, tests="pass" if split else None, timeout_s=30)
    assert r.unprivileged, r
    out = r.stdout_tail.split()
    assert out[0] == "refused" and int(out[1]) < sandbox.MAX_PROCESSES and out[2] == "BlockingIOError", r


STOP_TESTS = """
def check(candidate):
    assert all(map(lambda x: candidate(x) == x * x, [2, 3, 4]))
check(f)
"""


def test_a_solution_that_raises_stopiteration_does_not_end_the_tests_iteration():
    """A call that raised StopIteration ended the tests' map() early, so all(map(...)) over a
    solution that answers nothing passed. The tests now see it as a RuntimeError (as PEP 479 does
    for a generator); a solution's own iterator still ends normally."""
    from unmask.eval import sandbox

    forged = sandbox.run_program("def f(x):\n    raise StopIteration\n", tests=STOP_TESTS, timeout_s=20)
    assert forged.status == "failed" and "RuntimeError" in forged.stderr_tail, forged
    assert sandbox.run_program("def f(x):\n    return x * x\n", tests=STOP_TESTS, timeout_s=20).passed
    gen = sandbox.run_program("def f(n):\n    yield from range(n)\n", tests="assert list(f(3)) == [0, 1, 2]\n"
                              "it = iter(f(1))\nnext(it)\nassert next(it, 'end') == 'end'\n", timeout_s=20)
    assert gen.passed, gen


@pytest.mark.parametrize("name, body, want", [
    ("p.txt", "Once upon\nThe dog\n", ["Once upon", "The dog"]),
    ("p.jsonl", '{"prompt": "Once upon"}\n', ["Once upon"]),
])
def test_a_prompts_file_saved_with_a_utf8_bom_reads_like_one_without(tmp_path, name, body, want):
    """Editors on Windows save UTF-8 with a BOM: it became the first prompt's first character (.txt)
    or made line 1 invalid JSON (.jsonl)."""
    from unmask.prompts import read_prompts_file

    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert read_prompts_file(path) == want


def test_a_config_size_that_does_not_fit_the_weights_names_the_tensor_and_both_shapes(tmp_path):
    """A hand-edited size (or a duplicate key, whose last value wins) answered transformers' 'For details
    look at the above report!', and the report itself is not shown: nothing named the field."""
    d = tmp_path / "ckpt"
    shutil.copytree(SHIPPED / "stories260K", d)
    cfg = d / "config.json"
    cfg.write_text(cfg.read_text().replace('"intermediate_size": 172',
                                           '"intermediate_size": 172, "intermediate_size": 180'))
    with pytest.raises(UnmaskError, match=r"do not fit its config\.json: .*model\.layers\.0\.mlp\.down_proj\.weight is "
                                          r"\(64, 172\) in the checkpoint but \(64, 180\) by config\.json"):
        unmask.load(str(d))


@pytest.mark.parametrize("header, why", [
    (None, "no API key was given"),
    (b"", "no API key was given"),
    (b"Basic c2VjcmV0", "the Authorization header uses the scheme 'Basic', not Bearer"),
    (b"Token secret", "the Authorization header uses the scheme 'Token', not Bearer"),
    (b"Bearer nope", "the API key is not this server's"),
    (b"sk-0123456789abcdef0123456789", "the Authorization header holds no scheme before the key (a bare key?)"),
    (b"X-Very-Long-Custom-Scheme-Name secret", "the Authorization header uses another scheme, not Bearer"),
])
def test_a_refused_key_says_what_was_wrong_with_the_header(header, why):
    """'Authorization: Basic ...' (curl -u, a proxy) was answered 'no API key was given'."""
    import asyncio
    import json

    pytest.importorskip("fastapi")
    from unmask.serve import auth

    async def app(scope, receive, send):
        raise AssertionError("a refused request reached the app")

    sent = []

    async def send(message):
        sent.append(message)

    headers = [] if header is None else [(b"authorization", header)]
    scope = {"type": "http", "path": "/v1/completions", "headers": headers}
    asyncio.run(auth.RequireKey(app, b"secret")(scope, None, send))
    assert sent[0]["status"] == 401
    assert json.loads(sent[1]["body"])["error"]["message"].startswith(why + ";")


@pytest.mark.parametrize("key, value, why", [
    ("gamma", "Infinity", r"decode_defaults gamma=inf is not a finite number"),
    ("verify_block_size", "100000000", r"decode_defaults verify_block_size 100000000 is larger than the context "
                                       r"window of 512"),
    ("block_size", "1" + "0" * 400, r"decode_defaults block_size 1000000000\d*\.\.\. is larger than the context"),
])
def test_a_checkpoint_decode_default_past_any_use_is_refused_at_load(tmp_path, key, value, why):
    """gamma Infinity loaded (the CLI refuses --gamma inf); a verify_block_size of 10**8 loaded and the
    server then refused to start blaming --max-batch-size and --max-cache-tokens (191 GiB a row)."""
    import re

    d = tmp_path / "ckpt"
    shutil.copytree(SHIPPED / "stories260K-sbd", d)
    cfg = d / "unmask_config.json"
    cfg.write_text(re.sub(rf'"{key}": [^,\n]+', f'"{key}": {value}', cfg.read_text(), count=1))
    with pytest.raises(UnmaskError, match=why):
        unmask.load(str(d))


def test_a_diffusion_answer_cut_at_a_stop_string_finishes_with_stop():
    """A masked-diffusion canvas commits all its max_tokens at once, and the finish check tested the
    length before the stop strings: the text was cut at '.', but finish_reason said 'length'."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from unmask.serve import create_app
    from unmask.serve.server import ServerThread

    from test_round3_serve import post

    app = create_app(unmask.load("stories260K-dlm"), max_batch_size=2)
    with ServerThread(app) as s:
        for stream_free in ({"prompt": "Once"}, {"prompt": ["Once", "The dog"]}):
            status, body = post(s.url + "/v1/completions", {**stream_free, "max_tokens": 32, "stop": ["."]})
            assert status == 200, body
            for choice in body["choices"]:
                assert "." not in choice["text"] and choice["finish_reason"] == "stop", body
        status, body = post(s.url + "/v1/completions", {"prompt": "Once", "max_tokens": 8})
        assert body["choices"][0]["finish_reason"] == "length", body  # no stop string: the length still ends it
