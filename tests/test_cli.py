"""The command line: every bad input ends in exit code 2 and one line ``error: ...`` on stderr,
never a traceback; one real subprocess run checks the ``--json`` contract."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import NO_DATA, STORIES_DIR, one_line_error, run_cli

BIN = STORIES_DIR / "stories260K.bin"
TOK = STORIES_DIR / "tok512.bin"


# --- generate ---------------------------------------------------------------------------------


def test_unknown_model_lists_valid_names(capsys):
    line = one_line_error(capsys, "generate", "Once", "--model", "no-such-model", match="unknown model")
    assert "stories260K" in line


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt(capsys, prompt):
    one_line_error(capsys, "generate", prompt, "-m", "stories260K", match="empty")


def test_prompt_argument_not_utf8(capsys):
    # what Python makes of undecodable argv bytes (surrogateescape)
    one_line_error(capsys, "generate", "caf\udce9", "-m", "stories260K", match="UTF-8")


def test_no_prompt_at_all(capsys):
    one_line_error(capsys, "generate", "-m", "stories260K", match="no prompt")


def test_prompt_longer_than_context(capsys):
    one_line_error(capsys, "generate", "the cat sat " * 300, "-m", "stories260K", "-n", "8", match="context")


@pytest.mark.parametrize("n", ["0", "-3", "512", "600", "100000"])
def test_max_new_tokens_out_of_range(capsys, n):
    line = one_line_error(capsys, "generate", "Once", "-m", "stories260K", f"--max-new-tokens={n}")
    assert "max_new_tokens" in line or "max-new-tokens" in line


def test_max_new_tokens_plus_prompt_beyond_context(capsys):
    one_line_error(capsys, "generate", "Once upon a time", "-m", "stories260K", "-n", "508", match="context")


def test_max_new_tokens_not_a_number(capsys):
    one_line_error(capsys, "generate", "Once", "--max-new-tokens", "many", match="max-new-tokens", fix=False)


@pytest.mark.parametrize("t", ["-0.5", "-1", "nan"])
def test_negative_temperature(capsys, t):
    one_line_error(capsys, "generate", "Once", "-m", "stories260K", f"--temperature={t}", match="temperature")


@pytest.mark.parametrize("p", ["0", "-0.1", "1.5", "nan"])
def test_top_p_outside_unit_interval(capsys, p):
    one_line_error(capsys, "generate", "Once", "-m", "stories260K", "-t", "1", f"--top-p={p}", match="top-p")


def test_negative_top_k(capsys):
    one_line_error(capsys, "generate", "Once", "-m", "stories260K", "--top-k=-2", match="top-k")


def test_unknown_decoder(capsys):
    line = one_line_error(capsys, "generate", "Once", "-m", "stories260K", "--decoder", "warp", match="decoder")
    assert "'ar'" in line or " ar" in line  # names the valid choices


def test_unknown_option(capsys):
    one_line_error(capsys, "generate", "Once", "--frobnicate", "3", match="frobnicate", fix=False)


@pytest.mark.parametrize("argv,match", [(["--dtype", "int3"], "dtype"), (["--device", "tpu"], "device"), (["--device", "cuda:x"], "device"),
                                        (["--kind", "quantum"], "kind")])
def test_bad_load_options(capsys, argv, match):
    one_line_error(capsys, "generate", "Once", "-m", "stories260K", *argv, match=match)


def test_missing_prompts_file(capsys, tmp_path):
    one_line_error(capsys, "generate", "--prompts-file", str(tmp_path / "nope.txt"), "-m", "stories260K",
                          match="prompts file")


def test_prompts_file_is_a_directory(capsys, tmp_path):
    one_line_error(capsys, "generate", "--prompts-file", str(tmp_path), "-m", "stories260K", match="prompts file")


def test_non_utf8_prompts_file(capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_bytes("Once upon a time\n".encode() + "caf\xe9\n".encode("latin-1"))
    one_line_error(capsys, "generate", "--prompts-file", str(f), "-m", "stories260K", match="UTF-8")


def test_empty_prompts_file(capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("\n  \n")
    one_line_error(capsys, "generate", "--prompts-file", str(f), "-m", "stories260K", match="no prompt")


def test_prompts_file_works(capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("Zoo\n\nOnce upon a time\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "generate", "--prompts-file", str(f), "-m", "stories260K", "-n", "4", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["Zoo", "Once upon a time"]


# --- convert llama2c --------------------------------------------------------------------------


needs_data = pytest.mark.skipif(not BIN.is_file(), reason=NO_DATA)


@needs_data
def test_convert_missing_checkpoint(capsys, tmp_path):
    one_line_error(capsys, "convert", "llama2c", str(tmp_path / "nope.bin"), str(TOK), str(tmp_path / "out"),
                          match="not found")
    assert not (tmp_path / "out").exists()


@needs_data
def test_convert_missing_tokenizer(capsys, tmp_path):
    one_line_error(capsys, "convert", "llama2c", str(BIN), str(tmp_path / "tok.bin"), str(tmp_path / "out"),
                          match="not found")


@needs_data
def test_convert_truncated_checkpoint(capsys, tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes(BIN.read_bytes()[:5000])
    one_line_error(capsys, "convert", "llama2c", str(bad), str(TOK), str(tmp_path / "out"), match="bytes")
    assert not (tmp_path / "out").exists()


@needs_data
def test_convert_corrupt_known_checkpoint(capsys, tmp_path):
    raw = bytearray(BIN.read_bytes())
    raw[-1] ^= 0x80
    bad = tmp_path / "stories260K.bin"
    bad.write_bytes(bytes(raw))
    one_line_error(capsys, "convert", "llama2c", str(bad), str(TOK), str(tmp_path / "out"), match="sha256")
    code, out, err = run_cli(capsys, "convert", "llama2c", str(bad), str(TOK), str(tmp_path / "out"), "--no-verify")
    assert code == 0 and (tmp_path / "out" / "config.json").is_file(), err


@needs_data
def test_convert_existing_out_dir(capsys, tmp_path):
    (tmp_path / "out").mkdir()
    one_line_error(capsys, "convert", "llama2c", str(BIN), str(TOK), str(tmp_path / "out"), match="--overwrite")
    code, out, err = run_cli(capsys, "convert", "llama2c", str(BIN), str(TOK), str(tmp_path / "out"), "--overwrite")
    assert code == 0 and "wrote" in out, err


def test_convert_missing_arguments(capsys):
    one_line_error(capsys, "convert", "llama2c", "only-one.bin", match="missing", fix=False)


# --- one real process -------------------------------------------------------------------------


def test_real_cli_json():
    exe = shutil.which("unmask")
    cmd = [exe] if exe else [sys.executable, "-c", "from unmask.cli import main; main()"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd + ["generate", "Zoo", "Once upon a time", "-m", "stories260K", "-n", "8", "--json"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert {"prompt", "text", "tokens", "nfe", "tpf", "seconds"} <= row.keys()
        assert len(row["tokens"]) == 8 and row["nfe"] == 8 and row["tpf"] == 1.0 and row["seconds"] > 0
    assert rows[0]["prompt"] == "Zoo" and rows[0]["text"] == " was a little girl named Lily"


def test_plain_output_is_not_wrapped_when_piped(capsys):
    # rich used to hard-wrap at 80 columns off a terminal, which changed the generated text.
    args = ("generate", "Once upon a time", "--model", "stories260K", "--decoder", "ar", "-n", "64")
    code, out, _ = run_cli(capsys, *args, "--json")
    assert code == 0
    text = json.loads(out.splitlines()[0])["text"]
    assert len(text) > 100
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and out.startswith("Once upon a time" + text)


def test_gen_length_reports_the_canvas_unless_n_cuts_it(capsys):
    base = ("generate", "Once upon a time", "-m", "stories260K-dlm", "--gen-length", "32", "-k", "16", "--json")
    code, out, err = run_cli(capsys, *base)
    assert code == 0, err
    full = json.loads(out)
    assert len(full["tokens"]) == 32  # no -n: the whole canvas (this prompt hits no EOS within 32)
    code, out, err = run_cli(capsys, *base, "-n", "10")
    assert code == 0, err
    cut = json.loads(out)
    assert cut["tokens"] == full["tokens"][:10] and cut["nfe"] < full["nfe"]  # the second block is never decoded


def test_python_dash_m_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "unmask", "models"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "stories260K-sbd" in proc.stdout


def test_eta_reaches_the_entropy_threshold_policy(capsys):
    code, out, err = run_cli(capsys, "generate", "Once upon a time", "-m", "stories260K-dlm", "--policy",
                             "entropy-threshold", "--eta", "0", "-n", "8", "-k", "8", "--json")
    assert code == 0, err
    row = json.loads(out)
    assert row["policy"] == "entropy-threshold" and row["nfe"] == 8  # η = 0: one token per forward
    one_line_error(capsys, "generate", "Once upon a time", "--eta", "0.5", match="--eta does not apply to decoder 'sbd'")
