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
