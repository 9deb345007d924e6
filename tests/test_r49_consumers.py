"""Issue 49, the registry's consumers: the server's request schema, ``unmask generate``'s decoder
flags, ``eval -O`` types, ``unmask models`` and the server's running batches all come from the
decoder registry, so a decoder registered from outside unmask gets every one of them."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import queue
import time
from pathlib import Path

import pytest
from conftest import run_cli

import unmask
from unmask.decode import DECODERS, knob, register
from unmask.decode.blocks.single import BlockOptions
from unmask.errors import UnmaskError
from unmask.sampling import Sampling

SRC = Path(unmask.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (function-local imports too)."""
    out = set()
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _file(module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    for p in (SRC / rel / "__init__.py", (SRC / rel).with_suffix(".py")):
        if p.is_file():
            return p
    return None


def test_the_server_never_imports_the_cli():
    """serve/*.py, and every unmask module they reach through imports at any depth, import nothing
    from unmask.cli (the layers: the server takes its schema from the registry, not from a CLI command)."""
    seen, todo, path_to = set(), [], {}
    for p in sorted((SRC / "serve").glob("*.py")):
        name = "unmask.serve." + p.stem if p.stem != "__init__" else "unmask.serve"
        todo.append(name)
        path_to[name] = [name]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        f = _file(name)
        if f is None:
            continue
        for m in _imports(f):
            if m.startswith("unmask") and m not in seen:
                path_to.setdefault(m, path_to[name] + [m])
                todo.append(m)
    cli = sorted(m for m in seen if m == "unmask.cli" or m.startswith("unmask.cli."))
    assert not cli, " -> ".join(path_to[cli[0]])


@dataclasses.dataclass(frozen=True)
class WobbleOptions(BlockOptions):
    """SingleBD's knobs and two of a plug-in's own."""

    wobble: int | None = knob("a plug-in's integer knob", low=0)
    shiny: bool | None = knob("a plug-in's switch")


@pytest.fixture
def plugin():
    """A decoder registered from outside: SingleBD's batch under another name, with two knobs no
    built-in decoder has (dropped by its batch: they only have to reach it)."""
    block, built = DECODERS["block"], []

    def batch(bundle, cfg, **kw):
        built.append(cfg)
        return block.batch(bundle, BlockOptions(**{k.name: getattr(cfg, k.name) for k in BlockOptions.knobs()}), **kw)

    register(dataclasses.replace(block, name="wobbly", config=WobbleOptions, batch=batch,
                                 summary="a test plug-in: SingleBD by another name"))
    try:
        yield built
    finally:
        del DECODERS["wobbly"]
        from unmask.cli import generate

        generate.with_decoder_flags(generate.generate_cmd)  # generate's flags without the plug-in's


def test_a_plugins_knobs_are_server_fields_generate_flags_and_eval_options(plugin):
    pytest.importorskip("fastapi")
    from typer.main import get_command

    from unmask.cli import app
    from unmask.cli.evaluate import _options
    from unmask.cli.generate import generate_cmd, with_decoder_flags
    from unmask.serve.protocol import decoder_knobs

    with_decoder_flags(generate_cmd)  # as `unmask` builds it once the plug-in's entry point has registered it
    assert decoder_knobs()["wobble"] == "int" and decoder_knobs()["shiny"] == "bool"
    params = inspect.signature(generate_cmd).parameters
    assert params["wobble"].annotation is int and params["shiny"].annotation is bool
    opts = {o.name: o for o in get_command(app).commands["generate"].params}
    assert opts["wobble"].opts == ["--wobble"] and opts["shiny"].opts == ["--shiny"]
    assert opts["shiny"].secondary_opts == ["--no-shiny"]
    assert opts["block_size"].opts == ["--block-size", "-k"] and opts["lps"].secondary_opts == ["--no-lps"]
    assert "wobbly: a test plug-in: SingleBD by another name" in opts["decoder"].help
    assert _options(["wobble=3", "shiny=false"]) == {"wobble": 3, "shiny": False}
    with pytest.raises(UnmaskError, match="--option wobble must be an integer"):
        _options(["wobble=abc"])


def test_generate_keeps_every_decoder_flag_name_type_and_default():
    """The flags generate had before they came from the registry (name, type, default None)."""
    from typer.main import get_command

    from unmask.cli import app
    from unmask.cli.generate import generate_cmd

    opts = {o.name: o for o in get_command(app).commands["generate"].params}
    params = inspect.signature(generate_cmd).parameters
    want = {"policy": str, "gamma": float, "preset": str, "tau": float, "factor": float, "factor_compat": bool,
            "tokens_per_step": int, "eta": float, "block_size": int, "verify": bool, "draft": str, "queries": int,
            "gen_length": int, "steps": int, "cache": str, "schedule": str, "alg": str, "slots": int,
            "tau_add": float, "tau_semi": float, "tau_m2t": float, "tau_t2t": float, "lps": bool}
    for name, kind in want.items():
        assert params[name].annotation in (kind, kind.__name__) and opts[name].default is None, name
        assert opts[name].opts[0] == "--" + name.replace("_", "-") and opts[name].is_bool_flag == (kind is bool), name
    assert opts["verify"].secondary_opts == ["--no-verify"] and opts["lps"].secondary_opts == ["--no-lps"]


def test_models_lists_the_registered_decoders_with_their_summaries(capsys):
    code, out, _ = run_cli(capsys, "models")
    assert code == 0
    for spec in DECODERS.values():
        assert f"{spec.name}: {spec.summary}" in " ".join(out.split())


def test_a_plugin_decoder_shares_a_running_batch_in_the_server(plugin):
    """The scheduler builds a plug-in's running batch from the registry (no table of decoders): its
    requests join one batch, each text as the decoder it wraps gives alone."""
    pytest.importorskip("fastapi")
    from unmask.serve.engine import Scheduler
    from unmask.serve.jobs import Job

    bundle = unmask.load("stories260K-mbd")
    prompts = [bundle.tokenizer.encode(p) for p in ("Once upon a time", "Tom had a red ball")]
    want = unmask.decode.decode(bundle, prompts, decoder="block", max_new_tokens=16).tokens
    sched = Scheduler(bundle, max_batch_size=4)
    boxes = [queue.Queue() for _ in prompts]
    jobs = [Job(prompt_ids=p, decoder="wobbly", options={"wobble": 3}, sampling=Sampling(), max_new_tokens=16,
                stop=(), deadline=time.monotonic() + 120, post=lambda kind, payload, b=b: b.put((kind, payload)))
            for p, b in zip(prompts, boxes)]
    sched.pause()
    sched.start()
    try:
        for j in jobs:
            sched.submit(j)
        assert jobs[0].running_key is not None and jobs[0].running_key == jobs[1].running_key
        sched.resume()
        done = []
        for b in boxes:
            while (event := b.get(timeout=120))[0] == "step":
                pass
            done.append(event)
    finally:
        sched.close()
    assert [e[0] for e in done] == ["done", "done"], done
    assert [e[1]["tokens"] for e in done] == want and sched.peak_running == 2
    assert plugin == [WobbleOptions(wobble=3)]  # one batch, built from the plug-in's config


def test_api_checks_options_against_the_decoders_config():
    bundle = unmask.load("stories260K")
    with pytest.raises(UnmaskError, match=r"^--gamma does not apply to decoder 'ar'; drop it or choose a decoder"):
        unmask.generate("Zoo", bundle, "ar", max_new_tokens=2, gamma=0.3)
    with pytest.raises(UnmaskError, match="--on-token does not apply to decoder 'ar'"):
        unmask.generate("Zoo", bundle, "ar", max_new_tokens=2, on_token=print)
