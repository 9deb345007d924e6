"""Checkpoint files that lie, and loading from threads (issue 48 items 7, 10, 14).

Each damaged file is a copy of a shipped checkpoint with one field changed; the CLI must answer
with one ``error:`` line naming the file and the field, never a traceback or a garbage decode.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import unmask
from conftest import one_line_error
from unmask.errors import UnmaskError
from unmask.models.registry import CHECKPOINTS

DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's json parser recurses


def _copy(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(CHECKPOINTS / name, out, ignore=shutil.ignore_patterns("adapters"))
    return out


def _edit(path: Path, **fields) -> None:
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))


def _generate_error(capsys, model: Path, match: str, *extra) -> str:
    return one_line_error(capsys, "generate", "Once upon a time", "--model", model, "-n", "4", *extra, match=match)


# ---- deeply nested JSON (a RecursionError traceback before) -------------------------------------

@pytest.mark.parametrize("name, file", [("stories260K", "config.json"), ("stories260K-sbd", "unmask_config.json")])
def test_deeply_nested_model_json_is_one_line(tmp_path, capsys, name, file):
    model = _copy(tmp_path, name)
    (model / file).write_text(DEEP)
    _generate_error(capsys, model, f"{model / file} is not valid JSON (nested too deeply to read)")


def test_deeply_nested_router_json_is_one_line(tmp_path):
    from unmask.routers.io import load_router

    routers = tmp_path / "routers"
    shutil.copytree(CHECKPOINTS / "stories260K-dlm" / "routers", routers)
    (routers / "lbs.json").write_text(DEEP)
    with pytest.raises(UnmaskError, match=r"lbs.json is not valid JSON \(nested too deeply to read\); retrain"):
        load_router(routers, "lbs")


def test_deeply_nested_adapter_json_is_one_line(tmp_path, capsys):
    adapter = tmp_path / "ad"
    shutil.copytree(CHECKPOINTS / "stories260K" / "adapters" / "sbd", adapter)
    (adapter / "adapter.json").write_text(DEEP)
    one_line_error(capsys, "generate", "Once upon a time", "--model", "stories260K", "--adapter", adapter, "-n", "4",
                   match=f"{adapter / 'adapter.json'} is not valid JSON (nested too deeply to read)")


# ---- decode_defaults (ValueError / TypeError tracebacks, or lossless silently turned lossy) -----

@pytest.mark.parametrize("value, match", [
    ("fast", "'decode_defaults' must be a JSON object of decoder options (got str 'fast')"),
    ({"foo": 1}, "unknown decode_defaults key 'foo'"),
    (None, "'decode_defaults' must be a JSON object of decoder options (got NoneType None)"),
    ({"verify": "yes"}, "verify must be true or false"),
])
def test_a_models_decode_defaults_are_checked_at_load(tmp_path, capsys, value, match):
    model = _copy(tmp_path, "stories260K-sbd")
    _edit(model / "unmask_config.json", decode_defaults=value)
    line = _generate_error(capsys, model, match)
    assert f"{model / 'unmask_config.json'}:" in line


def test_an_adapters_null_decode_defaults_is_refused_not_read_as_lossy(tmp_path, capsys):
    adapter = tmp_path / "ad"
    shutil.copytree(CHECKPOINTS / "stories260K" / "adapters" / "sbd", adapter)
    _edit(adapter / "adapter.json", decode_defaults=None)
    one_line_error(capsys, "generate", "Once upon a time", "--model", "stories260K", "--adapter", adapter, "-n", "4",
                   match=f"{adapter / 'adapter.json'}: 'decode_defaults' must be a JSON object")


# ---- fields accepted without checks ---------------------------------------------------------------

def test_integer_weights_without_a_quantization_config_are_refused(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    model = _copy(tmp_path, "stories260K")
    weights = load_file(model / "model.safetensors")
    save_file({k: (v * 10).to(torch.int8) for k, v in weights.items()}, model / "model.safetensors")
    _generate_error(capsys, model, f"{model / 'model.safetensors'}: model.embed_tokens.weight is stored as I8, and "
                    "config.json has no quantization_config")


def test_an_eos_beyond_the_vocabulary_is_refused(tmp_path, capsys):
    model = _copy(tmp_path, "stories260K")
    _edit(model / "generation_config.json", eos_token_id=100_000)
    _generate_error(capsys, model, "eos_token_id in generation_config.json holds 100000, outside the model's "
                    "vocabulary of 512")
    model = _copy(tmp_path / "b", "stories260K-sbd")
    _edit(model / "unmask_config.json", stop_token_ids=[2, 513])
    _generate_error(capsys, model, "stop_token_ids in unmask_config.json holds 513")


def test_a_mask_token_equal_to_eos_is_refused(tmp_path, capsys):
    model = _copy(tmp_path, "stories260K-dlm")
    _edit(model / "unmask_config.json", mask_token_id=2)
    _generate_error(capsys, model, "the mask token 2 (mask_token_id in unmask_config.json) is also a stop token "
                    "(stop_token_ids in unmask_config.json)", "--decoder", "diffusion")


@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("max_position_embeddings", 0),
                                          ("hidden_size", -4), ("vocab_size", 0), ("num_key_value_heads", 0)])
def test_config_sizes_below_one_are_refused_naming_the_field(tmp_path, capsys, field, value):
    model = _copy(tmp_path, "stories260K")
    _edit(model / "config.json", **{field: value})
    _generate_error(capsys, model, f"{model / 'config.json'}: {field} must be an integer >= 1 (got {value!r})")


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package: pip install -e '.[test]'")
def test_a_gguf_with_context_length_0_is_refused(tmp_path, capsys):
    from test_round3_models import write_gguf

    src = write_gguf(tmp_path / "m.gguf", context=0)
    out = tmp_path / "out"
    one_line_error(capsys, "convert", "gguf", src, out, match=f"{src}: llama.context_length is 0, and a model needs a "
                   "context of at least 1 token")
    assert not out.exists()


# ---- loading from threads (item 10) ---------------------------------------------------------------

def test_loads_from_threads_all_succeed_in_a_fresh_process():
    """transformers' lazy imports race when two threads load first: serialized, all 8 succeed."""
    script = """
import threading, unmask
names = ["stories260K", "stories260K-sbd", "stories260K-dlm", "stories260K-bd"] * 2
errors, start = [], threading.Barrier(len(names))
def go(name):
    start.wait()
    try:
        unmask.load(name)
    except Exception as e:
        errors.append(f"{name}: {type(e).__name__}: {e}")
threads = [threading.Thread(target=go, args=(n,)) for n in names]
[t.start() for t in threads]
[t.join() for t in threads]
print("\\n".join(errors) or "all loaded")
"""
    env = {**os.environ, "PYTHONPATH": str(Path(unmask.__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "all loaded", run.stdout[-2000:]


def test_an_import_failure_is_not_blamed_on_the_files(monkeypatch):
    import transformers

    def broken(*args, **kwargs):
        raise ImportError("cannot import name 'LlamaForCausalLM' from partially initialized module")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", broken)
    with pytest.raises(UnmaskError) as info:
        unmask.load("stories260K")
    assert "a Python import failed (cannot import name 'LlamaForCausalLM'" in str(info.value)
    assert "corrupt" not in str(info.value) and "restore" not in str(info.value)


# ---- --block-size longer than --gen-length (item 7) -----------------------------------------------

def test_train_lbs_block_longer_than_gen_length_asks_for_a_smaller_block(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"ids": [1, 5, 9]}\n')
    line = one_line_error(capsys, "train", "lbs", "--model", "stories260K-dlm", "--data", corpus, "--prompts", "2",
                          "--gen-length", "64", "--block-size", "1000", "--out", tmp_path / "r",
                          match="--block-size 1000 is longer than --gen-length 64; pass a --block-size that divides 64")
    assert "1000" not in line.split(";")[1]
