"""Issue 49 item 3: a decoder outside the package. docs/writing-a-decoder.md's example, built from that page's
code blocks as a package in a temp dir (its module plus a ``*.dist-info`` holding the pyproject's entry point),
is a decoder like the built-in ones: the CLI, the Python API and the server decode with it, with its knob; it
gives greedy ``ar``'s tokens; a broken plug-in is skipped with one warning line; ``register()`` refuses
clashes."""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import unmask
from conftest import run_cli
from unmask.decode import DECODERS, Config, Spec, decode, knob, register
from unmask.decode.engine import registry
from unmask.errors import UnmaskError
from unmask.sampling import Sampling

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-a-decoder.md"
PROMPTS = ["Once upon a time", "Zoo", "The little dog ran to the park and"]


def doc_files() -> dict[str, str]:
    """The page's code blocks that name a file (```python unmask_nocache.py): file name -> text."""
    text = DOC.read_text(encoding="utf-8")
    return {m.group(1): m.group(2) for m in re.finditer(r"^```\w+ (\S+)\n(.*?)^```", text, re.S | re.M)}


def build(root: Path, files: dict[str, str]) -> tuple[str, str]:
    """Write the page's module into ``root`` with the dist-info ``pip install`` would make of its pyproject
    (METADATA and entry_points.txt), so ``entry_points(group="unmask.decoders")`` finds it once ``root`` is on
    sys.path. Returns (decoder name, module name)."""
    project = tomllib.loads(files["pyproject.toml"])["project"]
    group = project["entry-points"][registry.ENTRY_POINTS]
    [(name, target)] = group.items()
    module = target.split(":")[0]
    (root / f"{module}.py").write_text(files[f"{module}.py"], encoding="utf-8")
    dist = root / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (dist / "entry_points.txt").write_text(f"[{registry.ENTRY_POINTS}]\n{name} = {target}\n")
    return name, module


def broken(root: Path) -> str:
    """A plug-in whose module raises on import (two lines of message: the warning must keep one)."""
    (root / "unmask_broken.py").write_text('raise RuntimeError("this plug-in is broken\\nsecond line")\n')
    dist = root / "unmask_broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: unmask-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{registry.ENTRY_POINTS}]\nbroken = unmask_broken:SPEC\n")
    return "broken"


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin")
    name, module = build(root, doc_files())
    return root, name, module


@pytest.fixture
def plugin(plugin_dir):
    """The doc's plug-in loaded in this process through its entry point (``load_plugins``), removed after."""
    root, name, module = plugin_dir
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        assert name in [ep.name for ep in entry_points(group=registry.ENTRY_POINTS)]
        assert name in registry.load_plugins()
        yield name
    finally:
        sys.path.remove(str(root))
        DECODERS.pop(name, None)
        sys.modules.pop(module, None)


@pytest.fixture(scope="module")
def bundle():
    return unmask.load("stories260K")


def ids(bundle, prompts=PROMPTS):
    return [bundle.encode(p) for p in prompts]


def cli(*argv, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(pythonpath)])}
    return subprocess.run([sys.executable, "-m", "unmask.entry", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


# -- the page and its package --------------------------------------------------------------------------------

def test_the_page_holds_a_module_and_its_pyproject_with_the_entry_point():
    files = doc_files()
    assert set(files) == {"unmask_nocache.py", "pyproject.toml"}  # a new decoder is two files
    project = tomllib.loads(files["pyproject.toml"])["project"]
    assert project["entry-points"][registry.ENTRY_POINTS] == {"nocache": "unmask_nocache:SPEC"}


def test_the_entry_point_registers_the_decoder_with_its_knob(plugin):
    spec = DECODERS[plugin]
    assert [(k.name, k.type_name, k.cli, k.serve) for k in spec.knobs()] == [("window", "int", True, True)]
    assert spec.config.decoder == plugin and spec.kinds == ("causal",)


# -- (d) it gives greedy ar's tokens; batch == alone; its knob and its checks work ---------------------------

def test_the_plugin_decodes_as_greedy_ar(plugin, bundle):
    prompts = ids(bundle)
    ar = decode(bundle, prompts, decoder="ar", max_new_tokens=40, stop_token_ids=bundle.stop_token_ids)
    got = decode(bundle, prompts, decoder=plugin, max_new_tokens=40, stop_token_ids=bundle.stop_token_ids)
    assert got.tokens == ar.tokens
    assert got.stats.nfe == ar.stats.nfe and got.stats.nfe_per_row == ar.stats.nfe_per_row
    assert got.stats.stops_per_row == ar.stats.stops_per_row and got.stats.extra == {"window": None}
    wide = decode(bundle, prompts, decoder=plugin, max_new_tokens=40, stop_token_ids=bundle.stop_token_ids, window=64)
    assert wide.tokens == ar.tokens  # a window that holds every token is no window
    narrow = decode(bundle, prompts, decoder=plugin, max_new_tokens=40, window=4)
    assert narrow.tokens != ar.tokens and narrow.stats.extra == {"window": 4}


def test_the_plugin_stops_like_ar_and_a_row_is_the_same_alone(plugin, bundle):
    prompts = ids(bundle, ["Zoo", "Once upon a time", "The end"])
    stop_id = decode(bundle, prompts[:1], decoder="ar", max_new_tokens=6).tokens[0][5]  # row 0's 6th token
    for stop, row0 in (({"stop_token_ids": (*bundle.stop_token_ids, stop_id)}, 1),  # ends on a stop id
                       ({"stop_token_ids": bundle.stop_token_ids, "stop_strings": ("Lily",)}, 0)):  # on a string
        ar, got = (decode(bundle, prompts, decoder=d, max_new_tokens=40, **stop) for d in ("ar", plugin))
        assert got.tokens == ar.tokens and got.stats.nfe_per_row == ar.stats.nfe_per_row
        assert got.stats.stops_per_row == ar.stats.stops_per_row and got.stats.stops_per_row[0] == row0
        assert len(got.tokens[0]) < 40 and len(got.tokens[2]) == 40  # row 0 stopped, row 2 ran to the length
    hot = Sampling(temperature=1.0, seed=5)
    both = decode(bundle, prompts, decoder=plugin, max_new_tokens=12, sampling=hot)
    alone = [decode(bundle, [p], decoder=plugin, max_new_tokens=12, sampling=hot).tokens[0] for p in prompts]
    assert alone == both.tokens  # a sampled row draws from its own generator


def test_a_bad_window_is_a_one_line_error(plugin, bundle):
    with pytest.raises(UnmaskError, match=r"^--window must be an integer >= 1 \(got 0\); pass") as e:
        decode(bundle, ids(bundle, ["Zoo"]), decoder=plugin, max_new_tokens=4, window=0)
    assert "\n" not in str(e.value)
    with pytest.raises(UnmaskError, match=r"^decoder 'nocache' has no compiled path; drop --compile$"):
        decode(bundle, ids(bundle, ["Zoo"]), decoder=plugin, max_new_tokens=4, compile=True)


# -- (b) the Python API --------------------------------------------------------------------------------------

def test_the_python_api_decodes_with_the_plugin(plugin, bundle):
    got = unmask.generate(PROMPTS, bundle, plugin, max_new_tokens=24)
    assert got.decoder == plugin and got.texts == unmask.generate(PROMPTS, bundle, "ar", max_new_tokens=24).texts


def test_the_python_api_takes_the_plugin_s_knob(plugin, bundle):
    got = unmask.generate(PROMPTS, bundle, plugin, max_new_tokens=24, window=64)
    assert got.texts == unmask.generate(PROMPTS, bundle, "ar", max_new_tokens=24).texts


# -- (a) the command line, the plug-in found through its installed metadata ----------------------------------

@pytest.mark.parametrize("knob", [[], ["--window", "64"]], ids=["plain", "window"])
def test_unmask_generate_decodes_with_the_plugin(plugin_dir, bundle, knob):
    root, name, _ = plugin_dir
    run = cli("generate", "Once upon a time", "--model", "stories260K", "--decoder", name, *knob, "-n", "24",
              "--json", pythonpath=root)
    assert run.returncode == 0, run.stderr
    row = json.loads(run.stdout.splitlines()[0])
    assert row["decoder"] == name
    assert row["tokens"] == unmask.generate("Once upon a time", bundle, "ar", max_new_tokens=24).tokens[0]


@pytest.mark.parametrize("knob", [[], ["-O", "window=64"]], ids=["plain", "window"])
def test_unmask_eval_runs_the_plugin(plugin, capsys, tmp_path, data_dir, knob):
    out = tmp_path / "gsm8k.jsonl"
    code, _, err = run_cli(capsys, "eval", "--task", "gsm8k", "--model", "stories260K", "--decoder", plugin, *knob,
                           "--limit", "1", "--max-new-tokens", "8", "--data-dir", str(data_dir), "--out", str(out),
                           "--no-progress")
    assert code == 0, err
    item = json.loads(out.read_text().splitlines()[0])
    assert item["config"]["decoder"] == plugin and item["n_tokens"] <= 8


# -- (c) the server ------------------------------------------------------------------------------------------

@pytest.fixture
def server(plugin, bundle):
    for m in ("fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(m, reason=f"the server tests need {m}: pip install -e '.[test]'")
    from unmask.serve import create_app
    from unmask.serve.server import ServerThread

    with ServerThread(create_app(bundle, max_batch_size=4, max_queue=8)) as s:
        yield s


def complete(server, body: dict) -> tuple[int, dict]:
    from test_round3_serve import post

    return post(server.url + "/v1/completions", body, timeout=120)


def test_the_server_answers_a_request_for_the_plugin(plugin, server, bundle):
    status, got = complete(server, {"prompt": "Once upon a time", "max_tokens": 24, "decoder": plugin})
    assert status == 200, got
    assert got["choices"][0]["text"] == unmask.generate("Once upon a time", bundle, "ar", max_new_tokens=24).texts[0]


def test_the_server_takes_the_plugin_s_knob(plugin, server, bundle):
    status, got = complete(server, {"prompt": "Once upon a time", "max_tokens": 24, "decoder": plugin, "window": 64})
    assert status == 200, got
    assert got["choices"][0]["text"] == unmask.generate("Once upon a time", bundle, "ar", max_new_tokens=24).texts[0]


# -- (e) a broken plug-in is skipped with one warning line ---------------------------------------------------

def test_a_broken_plugin_is_skipped_with_a_one_line_warning(tmp_path, caplog, bundle):
    name = broken(tmp_path)
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        with caplog.at_level(logging.WARNING, logger="unmask.decode"):
            assert name not in registry.load_plugins()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("unmask_broken", None)
    [warning] = [r.getMessage() for r in caplog.records if "unmask_broken" in r.getMessage()]
    assert "\n" not in warning and name in warning and "this plug-in is broken" in warning
    assert name not in DECODERS
    assert decode(bundle, ids(bundle, ["Zoo"]), decoder="ar", max_new_tokens=4).tokens[0]


def test_the_cli_runs_beside_a_broken_plugin_and_warns_once(tmp_path):
    broken(tmp_path)
    run = cli("generate", "Zoo", "--model", "stories260K", "--decoder", "ar", "-n", "4", "--json", pythonpath=tmp_path)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[0])["decoder"] == "ar"
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "broken" in lines[0] and "Traceback" not in run.stderr, run.stderr


# -- (f) register() refuses a taken name and a knob whose type clashes ---------------------------------------

@dataclass(frozen=True)
class _Clash(Config):
    block_size: str | None = knob("a block size given as text")  # every built-in takes block_size as an int


@dataclass(frozen=True)
class _Fine(Config):
    block_size: int | None = knob("block size")


def test_register_refuses_a_taken_name_and_a_clashing_knob_type():
    ar = DECODERS["ar"]
    with pytest.raises(UnmaskError, match=r"decoder 'ar' is already registered; choose another name"):
        register(Spec("ar", _Fine, batch=None, kinds=("causal",), summary="x"))
    assert DECODERS["ar"] is ar
    with pytest.raises(UnmaskError, match=r"knob 'block_size' is str, but other decoders take it as int"):
        register(Spec("clash", _Clash, batch=None, kinds=("causal",), summary="x"))
    assert "clash" not in DECODERS
    try:
        register(Spec("fine", _Fine, batch=None, kinds=("causal",), summary="x"))  # the same type is fine
        assert "fine" in DECODERS
    finally:
        DECODERS.pop("fine", None)
