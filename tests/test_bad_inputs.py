"""Hostile-but-realistic inputs: each ends in one line ``error: <problem>; <fix>`` with exit code 2
(CLI) or an :class:`unmask.UnmaskError` (Python API), never a traceback, and leaves no
half-written file behind. Regression tests for bugs found by trying to break unmask."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import STORIES_DIR, one_line_error, run_cli

import unmask
from unmask.models.registry import shipped

SHIPPED = shipped()["stories260K"]
BIN = STORIES_DIR / "stories260K.bin"
TOK = STORIES_DIR / "tok512.bin"


def model_copy(root, name: str, unmask_config: dict | list | None = None):
    """A copy of the shipped stories260K directory, optionally with an unmask_config.json."""
    d = root / name
    shutil.copytree(SHIPPED, d)
    if unmask_config is not None:
        (d / "unmask_config.json").write_text(json.dumps(unmask_config))
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Local stand-ins of every model kind (the stories260K weights with a mask token)."""
    root = tmp_path_factory.mktemp("models")
    return {kind: model_copy(root, kind, {"kind": kind, "mask_token_id": 511, "block_size": 8})
            for kind in ("sbd", "masked-diffusion", "block-diffusion")}


# --- sampling and generation options -------------------------------------------------------------


@pytest.mark.parametrize("t", ["inf", "-inf"])
def test_infinite_temperature_rejected_by_every_decoder(capsys, t):
    one_line_error(capsys, "generate", "Once", "-m", "stories260K", "-n", "2", f"--temperature={t}",
                   match="temperature must be a finite number")


def test_max_new_tokens_zero_names_the_fix(capsys):
    one_line_error(capsys, "generate", "Once", "-m", "stories260K", "-n", "0", match="max_new_tokens")


def test_empty_stop_string_rejected(capsys):
    one_line_error(capsys, "generate", "Once", "-m", "stories260K", "-n", "2", "--stop", "", match="stop")


def test_multiblock_slots_beyond_the_context_is_an_error_not_an_oom(capsys, models):
    line = one_line_error(capsys, "generate", "Once", "-m", str(models["block-diffusion"]), "-d", "multiblock",
                          "-n", "4", "--slots", "100000", match="--slots")
    assert "context window of 512" in line and "--slots 64" in line


def test_diffusion_block_size_zero_blames_the_block_size(capsys, models):
    one_line_error(capsys, "generate", "Once", "-m", str(models["masked-diffusion"]), "-n", "4",
                   "--block-size", "0", match="block size must be")


def test_trace_to_a_directory_fails_before_decoding(capsys, models, tmp_path):
    one_line_error(capsys, "generate", "Once", "-m", str(models["sbd"]), "-n", "2", "--trace", str(tmp_path),
                   match="is a directory")
    assert list(tmp_path.iterdir()) == []


# --- model directories ---------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_is_one_line(capsys, tmp_path, damage):
    d = model_copy(tmp_path, "m")
    weights = d / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:500_000])
    else:
        weights.write_bytes(b"\xff" * 4096)
    one_line_error(capsys, "generate", "Once", "-m", str(d), "-n", "2", match="cannot load the checkpoint")


@pytest.mark.parametrize("file", ["config.json", "unmask_config.json"])
def test_config_that_is_json_but_not_an_object(capsys, tmp_path, file):
    d = model_copy(tmp_path, "m")
    (d / file).write_text("[1, 2]")
    one_line_error(capsys, "generate", "Once", "-m", str(d), "-n", "2", match="not an object")


@pytest.mark.parametrize("meta, match", [
    ({"kind": "sbd", "mask_token_id": "abc"}, "mask_token_id"),
    ({"kind": "causal", "mask_token_id": 1.5}, "mask_token_id"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"logit_shift": "one"}, "logit_shift"),
])
def test_unmask_config_with_wrong_types(capsys, tmp_path, meta, match):
    d = model_copy(tmp_path, "m", meta)
    one_line_error(capsys, "generate", "Once", "-m", str(d), "-n", "2", match=match)


def test_empty_model_name_is_not_the_default_model(capsys):
    one_line_error(capsys, "generate", "Once", "-m", "", "-n", "2", match="model name is empty")


def test_dir_without_config_names_the_fix(capsys, tmp_path):
    one_line_error(capsys, "generate", "Once", "-m", str(tmp_path), "-n", "2", match="no config.json")


# --- convert llama2c -----------------------------------------------------------------------------


def test_convert_out_dir_below_a_file(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    one_line_error(capsys, "convert", "llama2c", str(BIN), str(TOK), str(f / "out"), match="is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_convert_overwrite_refuses_a_file(capsys, tmp_path):
    f = tmp_path / "out"
    f.write_text("mine")
    one_line_error(capsys, "convert", "llama2c", str(BIN), str(TOK), str(f), "--overwrite", match="is a file")
    assert f.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .out.old-* or staging left


def test_convert_swapped_arguments_says_which_goes_first(capsys, tmp_path):
    one_line_error(capsys, "convert", "llama2c", str(TOK), str(BIN), str(tmp_path / "out"),
                   match="checkpoint first and the tokenizer second")
    assert list(tmp_path.iterdir()) == []


def test_convert_unwritable_location_is_one_line(capsys, tmp_path, monkeypatch):
    import unmask.models.llama2c as llama2c

    def no_space(final):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(llama2c, "staging_dir", no_space)
    one_line_error(capsys, "convert", "llama2c", str(BIN), str(TOK), str(tmp_path / "out"),
                   match="No space left on device")
    assert list(tmp_path.iterdir()) == []


# --- output files of eval / sweep / roofline -----------------------------------------------------


def test_eval_out_directory_fails_before_evaluating(capsys, tmp_path):
    one_line_error(capsys, "eval", "--task", "stories", "--limit", "1", "-n", "2", "--no-progress",
                   "--out", str(tmp_path), match="is a directory")
    assert list(tmp_path.iterdir()) == []


def test_sweep_out_directory_fails_before_sweeping(capsys, tmp_path, models):
    one_line_error(capsys, "sweep", "--task", "stories", "--param", "gamma", "--values", "0.1", "--limit", "1",
                   "-n", "2", "-m", str(models["sbd"]), "--no-progress", "--out", str(tmp_path),
                   match="is a directory")


def test_atomic_write_to_a_directory_leaves_no_temp_file(tmp_path):
    from unmask.fileio import atomic_write_text

    (tmp_path / "d").mkdir()
    with pytest.raises(unmask.UnmaskError, match="is a directory"):
        atomic_write_text(tmp_path / "d", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_roofline_png_without_suffix_reports_the_file_it_wrote(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    code, out, err = run_cli(capsys, "roofline", "--png", str(tmp_path / "plot"))
    assert code == 0, err
    assert f"wrote {tmp_path / 'plot.png'}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


def test_roofline_png_unknown_format(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    one_line_error(capsys, "roofline", "--png", str(tmp_path / "plot.xyz"), match="unknown image format")
    assert list(tmp_path.iterdir()) == []


def test_roofline_config_not_an_object(capsys, tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    one_line_error(capsys, "roofline", "--config", str(tmp_path), match="JSON object")


@pytest.mark.parametrize("argv", [
    ["--kv-bytes", "nan"], ["--weight-bytes", "inf"],
    ["--gpu", "custom", "--peak-flops", "inf", "--attn-flops", "1e15", "--bandwidth", "1e12"],
    ["--gpu", "custom", "--peak-flops", "1e15", "--attn-flops", "1e15", "--bandwidth", "nan"],
])
def test_roofline_non_finite_numbers(capsys, argv):
    one_line_error(capsys, "roofline", *argv, match="finite")


@pytest.mark.parametrize("argv, match", [
    (["--limit", "0"], "--limit"), (["-n", "0"], "--max-new-tokens"), (["--batch-size", "0"], "--batch-size"),
])
def test_bench_rejects_bad_sizes_up_front(capsys, argv, match):
    one_line_error(capsys, "bench", "--no-progress", *argv, match=match)


def test_cli_last_resort_for_os_errors(capsys, monkeypatch):
    import unmask.api

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/some/file")

    monkeypatch.setattr(unmask.api, "generate", denied)
    line = one_line_error(capsys, "generate", "Once", "-m", "stories260K", "-n", "2", match="Permission denied")
    assert "/some/file" in line


# --- Python API misuse ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts="x", model=123), "model must be"),
    (dict(prompts=None), "prompts must be"),
    (dict(prompts=123), "prompts must be"),
    (dict(prompts=b"x"), "prompts must be"),
    (dict(prompts={"a": 1}), "prompts must be"),
    (dict(prompts=[1, 2]), "prompt 1 is not text"),
    (dict(prompts=["ok", None]), "prompt 2 is not text"),
    (dict(prompts="x", max_new_tokens="4"), "max_new_tokens"),
    (dict(prompts="x", max_new_tokens=2.5), "max_new_tokens"),
    (dict(prompts="x", max_new_tokens=True), "max_new_tokens"),
    (dict(prompts="x", temperature="hot"), "temperature"),
    (dict(prompts="x", temperature=None), "temperature"),
    (dict(prompts="x", temperature=1.0, top_k=2.5), "top-k"),
    (dict(prompts="x", temperature=1.0, top_p="0.5"), "top-p"),
    (dict(prompts="x", temperature=1.0, seed="a"), "seed"),
    (dict(prompts="x", temperature=1.0, seed=2**70), "seed"),
    (dict(prompts="x", stop=[1]), "stop"),
    (dict(prompts="x", stop=[""]), "stop"),
])
def test_api_misuse_raises_unmask_error(stories, kwargs, match):
    kwargs = {"model": stories, "max_new_tokens": 2, **kwargs}
    with pytest.raises(unmask.UnmaskError, match=match) as e:
        unmask.generate(**kwargs)
    assert "\n" not in str(e.value) and ";" in str(e.value)


def test_api_load_wrong_type():
    with pytest.raises(unmask.UnmaskError, match="model must be"):
        unmask.load(123)


def test_api_stop_given_as_one_string_is_one_stop_string(stories):
    """``stop="e l"`` must mean the string "e l", not the characters e, space and l."""
    as_str = unmask.generate("Once upon a time", stories, max_new_tokens=24, stop="e l")
    as_list = unmask.generate("Once upon a time", stories, max_new_tokens=24, stop=["e l"])
    assert as_str.texts == as_list.texts
    assert as_str.texts[0].strip()  # not cut at the first space or 'e'


def test_tiny_top_p_keeps_the_most_likely_token(capsys):
    """top_p = 1e-300 rounds to 0 in float32; it must still keep one token, not crash sampling."""
    code, out, err = run_cli(capsys, "generate", "Once", "-m", "stories260K", "-n", "3", "-t", "1",
                             "--top-p", "1e-300", "--json")
    assert code == 0, err
    greedy = unmask.generate("Once", "stories260K", max_new_tokens=3)
    assert json.loads(out)["tokens"] == greedy.tokens[0]


# --- eval data files -----------------------------------------------------------------------------


@pytest.mark.parametrize("content, match", [
    (b"not json\n", "line 1 cannot be read"),
    (b'{"question": "q", "answer": "#### 1"}\n[1, 2]\n', "line 2 cannot be read"),
    (b'{"question": "q"}\n', "lacks the field 'answer'"),
    (b'{"question": 5, "answer": "#### 1"}\n', "line 1: field 'question' must be text (got int)"),
    (b'{"question": "q", "answer": null}\n', "field 'answer' must be text (got NoneType)"),
    (b"\xff\xfe\n", "cannot be read"),
])
def test_eval_corrupt_gsm8k_file(capsys, tmp_path, content, match):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_bytes(content)
    one_line_error(capsys, "eval", "--task", "gsm8k", "--data-dir", str(tmp_path), "--limit", "1", "-n", "2",
                   "--no-progress", match=match)


def test_eval_humaneval_file_that_is_not_gzip(capsys, tmp_path):
    (tmp_path / "humaneval").mkdir()
    (tmp_path / "humaneval" / "HumanEval.jsonl.gz").write_bytes(b"plain text, not gzip\n")
    one_line_error(capsys, "eval", "--task", "humaneval", "--data-dir", str(tmp_path), "--limit", "1", "-n", "2",
                   "--no-progress", match="cannot be read")


def test_convert_interrupted_while_saving_leaves_nothing(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    import unmask.models.llama2c as llama2c

    def ctrl_c(self, *args, **kwargs):  # the model files are already in the staging directory
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        llama2c.convert_llama2c(BIN, TOK, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_model_path_that_is_a_file(capsys):
    one_line_error(capsys, "generate", "Once", "-m", str(SHIPPED / "config.json"), "-n", "2",
                   match="is a file, not a directory")


@pytest.mark.parametrize("argv", [
    ["eval", "--task", "stories", "--limit", "0", "-n", "2", "--no-progress"],
    ["eval", "--task", "stories", "--limit", "1", "-n", "2", "--batch-size", "0", "--no-progress"],
    ["eval", "--task", "mbpp", "--limit", "1", "-n", "2", "--shots", "2", "--no-progress"],
    ["eval", "--task", "gsm8k", "--limit", "1", "-n", "2", "--shots", "100000", "--no-progress"],
    ["sweep", "--task", "stories", "--param", "gamma", "--values", "0.1,0.1", "--limit", "1", "-n", "2"],
    ["sweep", "--task", "stories", "--param", "gamma", "--values", "abc", "--limit", "1", "-n", "2"],
    ["roofline", "--gpu", "custom"],
    ["roofline", "--peak-flops", "1e15"],
    ["roofline", "--nfe-speedup", "2,x"],
    ["roofline", "--preset", "sbd-paper", "--nfe-speedup", "16"],
    ["generate", "Once", "-m", "stories260K", "-n", "2", "--prompts-file", "/no/such/file"],
])
def test_user_errors_name_a_fix(capsys, argv):
    one_line_error(capsys, *argv)


@pytest.mark.parametrize("kind, extra", [
    ("sbd", ["--gamma", "0.3", "--preset", "chat-low"]),
    ("masked-diffusion", ["--gamma", "0.3", "--preset", "chat-low"]),
    ("masked-diffusion", ["--policy", "top-k", "--steps", "4", "--tokens-per-step", "2"]),
    ("block-diffusion", ["--block-size", "0"]),
    ("block-diffusion", ["-d", "multiblock", "--block-size", "0"]),
])
def test_decoder_option_conflicts_name_a_fix(capsys, models, kind, extra):
    one_line_error(capsys, "generate", "Once", "-m", str(models[kind]), "-n", "4", *extra)


def test_output_paths_that_are_links_or_devices_are_refused(tmp_path):
    # The atomic write renames a temporary file over the path: it must not replace a symlink
    # (or a device such as /dev/null, or a pipe) with a plain file.
    import os

    from unmask.errors import UnmaskError
    from unmask.fileio import atomic_write_text

    target = tmp_path / "target.txt"
    target.write_text("keep")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (link, fifo):
        with pytest.raises(UnmaskError, match="not a regular file"):
            atomic_write_text(path, "{}", what="trace file")
    assert link.is_symlink() and target.read_text() == "keep"
    assert fifo.exists() and not fifo.is_file()


def test_trace_to_a_symlink_is_one_line_error(capsys, tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("keep")
    link = tmp_path / "trace.json"
    link.symlink_to(target)
    one_line_error(capsys, "generate", "Once upon a time", "--model", "stories260K-sbd", "--decoder", "sbd", "-n", "4",
                   "--trace", str(link), match="not a regular file")
    assert link.is_symlink() and target.read_text() == "keep"


def test_context_check_uses_gen_length_when_given():
    # 434 + 32 fits a 512-token window although the default max_new_tokens (128) would not.
    bundle = unmask.load("stories260K-dlm")
    prompt = "Once upon a time there was a little girl. " * 36
    n = len(bundle.encode(prompt))
    assert n + 32 <= bundle.context_length < n + 128
    out = unmask.generate([prompt], bundle, "diffusion", gen_length=32, block_size=32)
    assert len(out.tokens[0]) <= 32
    with pytest.raises(unmask.UnmaskError, match="--gen-length 128"):
        unmask.generate([prompt], bundle, "diffusion", gen_length=128, block_size=32)
