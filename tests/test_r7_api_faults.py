"""Found by the round-7 second fault pass: convert --overwrite never deletes a folder that is not a
model directory or holds the inputs, an unnamed OUT_DIR is one line, and the Python API / bench
answer bad values with one UnmaskError line."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import one_line_error, run_cli

import unmask
from unmask.errors import UnmaskError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyllamas-stories260K"


@pytest.fixture()
def inputs(tmp_path):
    import os
    import shutil

    root = Path(os.environ.get("UNMASK_DATA_DIR", DATA.parent)) / "tinyllamas-stories260K"
    if not (root / "stories260K.bin").is_file():
        pytest.skip(f"the llama2.c checkpoint is not at {root}")
    for name in ("stories260K.bin", "tok512.bin"):
        shutil.copy(root / name, tmp_path / name)
    return tmp_path / "stories260K.bin", tmp_path / "tok512.bin"


def test_convert_overwrite_keeps_a_folder_that_is_not_a_model(tmp_path, inputs, capsys):
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "notes.txt").write_text("mine")
    one_line_error(capsys, "convert", "llama2c", *map(str, inputs), str(proj), "--overwrite",
                   match="not a model directory (no config.json), which --overwrite would delete")
    assert (proj / "notes.txt").read_text() == "mine" and (proj / "src").is_dir()


def test_convert_refuses_an_out_dir_holding_its_inputs_or_without_a_name(tmp_path, inputs, capsys, monkeypatch):
    ckpt, tok = inputs
    one_line_error(capsys, "convert", "llama2c", str(ckpt), str(tok), str(tmp_path), "--overwrite",
                   match="holds the input file")
    assert ckpt.is_file() and tok.is_file()
    monkeypatch.chdir(tmp_path)
    for out in (".", ""):
        one_line_error(capsys, "convert", "llama2c", str(ckpt), str(tok), out, match="names no new directory")


def test_convert_overwrite_replaces_a_converted_model(tmp_path, inputs, capsys):
    out = tmp_path / "hf"
    assert run_cli(capsys, "convert", "llama2c", *map(str, inputs), str(out))[0] == 0
    assert run_cli(capsys, "convert", "llama2c", *map(str, inputs), str(out), "--overwrite")[0] == 0
    assert (out / "config.json").is_file()


def test_the_api_answers_bad_values_in_one_line():
    b = unmask.load("stories260K-sbd")
    for kw, match in [({"stop": 5}, "stop must be text or a list"), ({"on_forward": 5}, "on_forward must be a function"),
                      ({"on_step": "x"}, "on_step must be a function")]:
        with pytest.raises(UnmaskError, match=match):
            unmask.generate("Once upon a time", b, "sbd", max_new_tokens=4, **kw)
    with pytest.raises(UnmaskError, match="no shipped name and no usable path"):
        unmask.load("a" * 5000)


def test_bench_with_every_pair_failing_exits_non_zero(capsys, tmp_path):
    # a judge directory that is no model fails every pair (an unknown judge name is now refused up front)
    one_line_error(capsys, "bench", "--judge", tmp_path, "--limit", "1", "-n", "4", "-m", "stories260K-sbd",
                   "--no-progress", match="every bench pair failed")
