"""Issue 49, tried as a hostile user and a careless plug-in author would: ``register()`` refuses a decoder the
CLI, the server or the Python API could not take (bad names, a knob named like an option of theirs, a config
shared by two decoders, ...); a plug-in that fails while decoding is one error line for ``generate`` and a 500
for the server, which goes on serving; a config that raises something other than UnmaskError is a one-line
refusal (400 over HTTP); the Python API reads numpy scalars and refuses a bad decoder name in one line."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import numpy as np
import pytest

import unmask
from conftest import run_cli
from unmask.decode import DECODERS, Config, Spec, decode, knob, register
from unmask.decode.engine import registry
from unmask.errors import UnmaskError

BUILTIN = ("ar", "sbd", "diffusion", "early-bird", "block", "multiblock")


@dataclass(frozen=True)
class Plain(Config):
    width: int | None = knob("a width")


class Echo:
    """A running batch that ends each row at once with its prompt's last token ``max_new_tokens`` times (or
    fails where ``fail`` says: ``make``, ``join`` or ``step``)."""

    fail = None

    def __init__(self, bundle, cfg, *, capacity, **unused):
        if self.fail == "make":
            raise RuntimeError("boom in make")
        self.rows, self.forwards = [], 0

    def __len__(self):
        return len(self.rows)

    def join(self, requests):
        if self.fail == "join":
            raise RuntimeError("boom in join")
        from unmask.decode.engine.running import Row

        self.rows += [Row(job=r, slot=i) for i, r in enumerate(requests)]
        return []

    def step(self):
        if self.fail == "step":
            raise RuntimeError("boom in step\nsecond line")
        self.forwards += 1
        done, self.rows = self.rows, []
        for row in done:
            row.tokens, row.nfe, row.finish = [row.job.prompt_ids[-1]] * row.job.max_new_tokens, 1, "length"
        return done

    def drop(self, ids):
        out = [r for r in self.rows if r.job.id in ids]
        self.rows = [r for r in self.rows if r.job.id not in ids]
        return out

    def stats_extra(self, rows):
        return {}


def _batch(fail):
    return type(f"Echo_{fail}", (Echo,), {"fail": fail})


@pytest.fixture
def scratch():
    """Decoders registered by a test are removed after it."""
    yield
    for name in [n for n in DECODERS if n not in BUILTIN]:
        DECODERS.pop(name)


def spec(name="plain", config=Plain, batch=Echo, kinds=("causal", "sbd"), summary="a test decoder", **kw):
    return Spec(name, config, batch=batch, kinds=kinds, summary=summary, **kw)


# -- register() refuses what the CLI / server / API could not take ------------------------------------------

@pytest.mark.parametrize("name", ["with space", "Upper", "-x", "a/b", "ar ", "--decoder", "x\ny"])
def test_register_refuses_a_decoder_name_no_flag_or_json_field_can_carry(scratch, name):
    with pytest.raises(UnmaskError, match=r"^decoder name .* lowercase letters, digits and dashes") as e:
        register(spec(name))
    assert "\n" not in str(e.value) and name not in DECODERS


def _config(field: str, hint: str = "int | None", **meta):
    ns: dict = {"meta": meta}
    exec(f"from __future__ import annotations\nfrom dataclasses import dataclass\nfrom unmask.decode import Config, knob\n"
         f"@dataclass(frozen=True)\nclass C(Config):\n    {field}: {hint} = knob('x', **meta)\n", ns)
    return ns["C"]


@pytest.mark.parametrize("field", ["model", "temperature", "stop", "max_new_tokens", "decoder", "seed", "compile",
                                   "on_step", "prompt", "messages", "n", "stream", "max_tokens", "timeout",
                                   "json", "help", "progress", "logit_bias"])
def test_register_refuses_a_knob_named_like_a_generate_option_or_a_server_field(scratch, field):
    with pytest.raises(UnmaskError, match=rf"^decoder 'plain': knob {field!r} is named like an option of "
                                          r"unmask itself .*; rename it"):
        register(spec(config=_config(field)))
    assert "plain" not in DECODERS


@pytest.mark.parametrize("field", ["Block", "no_cache", "x__y", "_x", "x_"])
def test_register_refuses_a_knob_name_the_cli_cannot_spell(scratch, field):
    with pytest.raises(UnmaskError, match=rf"^decoder 'plain': knob {field!r} "):
        register(spec(config=_config(field)))


def test_the_reserved_names_cover_generate_the_api_and_the_server():
    from unmask.api import RUN_OPTIONS, generate
    from unmask.cli.generate import generate_cmd
    from unmask.serve.protocol import FIELDS, _NEUTRAL

    own = generate_cmd.own_signature.parameters  # its own options, before the decoder flags were added
    assert {n for n, p in own.items() if p.kind is not p.VAR_KEYWORD} <= registry.RESERVED
    flags = {d.lstrip("-").replace("-", "_") for p in own.values() if p.kind is not p.VAR_KEYWORD
             for d in (getattr(p.default, "param_decls", None) or ()) if d.startswith("--")}
    assert {f.split("/")[0] for f in flags} <= registry.RESERVED  # --json, --no-progress, ...
    shorts = {d for p in own.values() for d in (getattr(p.default, "param_decls", None) or ()) if len(d) == 2}
    assert shorts <= set(registry.RESERVED_SHORT)
    assert set(inspect.signature(generate).parameters) - {"options"} <= registry.RESERVED
    assert set(RUN_OPTIONS) | {"on_token"} <= registry.RESERVED
    assert set(FIELDS) | set(_NEUTRAL) <= registry.RESERVED
    for s in DECODERS.values():  # the built-ins' knobs are all legal
        assert not {k.name for k in s.knobs()} & registry.RESERVED


def test_register_refuses_a_serve_flag_on_a_python_object_knob(scratch):
    with pytest.raises(UnmaskError, match=r"knob 'router' is a Python object.*serve=True"):
        register(spec(config=_config("router", "dict | None", serve=True)))


@pytest.mark.parametrize("short", ["-m", "-n", "k", "--k", "-kk", "-k"])
def test_register_refuses_a_short_alias_taken_or_malformed(scratch, short):
    # -k is block_size's alias: another knob cannot have it
    with pytest.raises(UnmaskError, match=rf"knob 'width': short alias {short!r}"):
        register(spec(config=_config("width", short=short)))


def test_register_refuses_one_config_class_for_two_decoders(scratch):
    register(spec("one"))
    with pytest.raises(UnmaskError, match=r"^decoder 'two': its config Plain is decoder 'one''s; give each decoder its "
                                          r"own Config subclass"):
        register(spec("two"))
    assert Plain.decoder == "one" and "two" not in DECODERS


def test_register_refuses_a_knob_that_is_python_only_in_another_decoder(scratch):
    # diffusion's reference_steps is Python-only: a plug-in serving it would open it over JSON for diffusion too
    with pytest.raises(UnmaskError, match=r"knob 'reference_steps' is taken as a command-line/server option here, but decoder "
                                          r"'diffusion' takes it from Python only"):
        register(spec(config=_config("reference_steps", "bool | None")))


@pytest.mark.parametrize("bad, match", [
    ({"kinds": "causal"}, r"kinds must be a tuple of model kinds"),
    ({"kinds": ["causal"]}, r"kinds must be a tuple of model kinds"),
    ({"kinds": ("casual",)}, r"unknown model kind 'casual'; choose from causal, sbd, masked-diffusion, "
                             r"block-diffusion"),  # a typo: no model could ever be decoded with it
    ({"batch": 3}, r"batch must be a callable"),
    ({"summary": "two\nlines"}, r"summary must be one line of text"),
    ({"summary": None}, r"summary must be one line of text"),
])
def test_register_refuses_a_spec_unmask_could_not_list_or_run(scratch, bad, match):
    with pytest.raises(UnmaskError, match=rf"^decoder 'plain': {match}"):
        register(spec(**bad))


@dataclass(frozen=True)
class Required(Config):
    extra: int  # a plain field without a default: Config.of(options) could not build the config
    width: int | None = knob("a width")


def test_register_refuses_a_config_field_without_a_default(scratch):
    with pytest.raises(UnmaskError, match=r"^decoder 'plain': config field 'extra' has no default; give it one"):
        register(spec(config=Required))


# -- a careless config: a one-line refusal, everywhere ------------------------------------------------------

@dataclass(frozen=True)
class Careless(Config):
    width: int | None = knob("a width")

    def __post_init__(self):
        if self.width is not None and self.width > 8:  # raises TypeError for a str, ValueError by hand
            raise ValueError("width too large")


def test_a_config_raising_another_error_is_a_one_line_refusal(scratch):
    register(spec("careless", config=Careless))
    for width, what in ((9, "ValueError: width too large"), ("x", "TypeError")):
        with pytest.raises(UnmaskError, match=rf"^decoder 'careless' refused its options \({what}"):
            Careless.of({"width": width})


# -- a plug-in failing while decoding -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundle():
    return unmask.load("stories260K")


@pytest.mark.parametrize("fail", ["make", "join", "step"])
def test_a_plugin_failing_while_decoding_is_a_one_line_error(scratch, bundle, fail):
    register(spec("boom", config=Plain, batch=_batch(fail)))
    with pytest.raises(UnmaskError, match=rf"^decoder 'boom' failed \(RuntimeError: boom in {fail}\); it is a "
                                          r"plug-in \(.*\): report it to its author") as e:
        decode(bundle, [bundle.encode("Zoo")], decoder="boom", max_new_tokens=3)
    assert "\n" not in str(e.value)


def test_generate_prints_one_line_for_a_failing_plugin(scratch, bundle, capsys):
    register(spec("boom", config=Plain, batch=_batch("step")))
    code, out, err = run_cli(capsys, "generate", "Zoo", "--model", "stories260K", "--decoder", "boom", "-n", "3",
                             "--no-progress", "--json")
    assert code == 2 and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert line.startswith("error: decoder 'boom' failed (RuntimeError: boom in step)")


def test_a_decoder_registered_without_a_batch_is_refused_when_it_decodes(scratch, bundle):
    register(spec("nobatch", batch=None))
    with pytest.raises(UnmaskError, match=r"^decoder 'nobatch' has no running batch \(its Spec's batch is None\)"):
        decode(bundle, [bundle.encode("Zoo")], decoder="nobatch", max_new_tokens=3)


def test_a_working_plugin_decodes(scratch, bundle):
    register(spec("echo"))
    got = decode(bundle, [bundle.encode("Zoo")], decoder="echo", max_new_tokens=3)
    assert got.tokens == [[bundle.encode("Zoo")[-1]] * 3]


# -- the Python API -----------------------------------------------------------------------------------------

def test_decode_reads_numpy_scalars_as_the_numbers_they_hold():
    sbd = unmask.load("stories260K-sbd")
    ids = [sbd.encode("Zoo")]
    want = decode(sbd, ids, decoder="sbd", max_new_tokens=6, block_size=4)
    got = decode(sbd, ids, decoder="sbd", max_new_tokens=6, block_size=np.int64(4))
    assert got.tokens == want.tokens and got.stats.nfe == want.stats.nfe


@pytest.mark.parametrize("name", [["ar"], ""])
def test_a_decoder_name_that_is_not_one_is_refused(bundle, name):
    ids = [bundle.encode("Zoo")]
    with pytest.raises(UnmaskError, match=r"decoder"):
        decode(bundle, ids, decoder=name, max_new_tokens=2)
    with pytest.raises(UnmaskError, match=r"decoder"):
        unmask.generate("Zoo", bundle, name, max_new_tokens=2)


def test_decode_refuses_an_option_or_hook_the_decoder_does_not_take(bundle):
    ids = [bundle.encode("Zoo")]
    with pytest.raises(UnmaskError, match=r"^--foo does not apply to decoder 'ar'"):
        decode(bundle, ids, decoder="ar", max_new_tokens=2, foo=1)
    try:  # a hook a decoder has not: refused in one line, or ignored (docs/writing-a-decoder.md)
        decode(bundle, ids, decoder="ar", max_new_tokens=2, on_forward=lambda *a: None)
    except UnmaskError as e:
        assert "on_forward" in str(e) and "\n" not in str(e)
    for bad in (None, -1, "4", True):  # 0 is a row that ends at once (a server job's budget may be 0)
        with pytest.raises(UnmaskError, match=r"^max_new_tokens must be an integer >= 0"):
            decode(bundle, ids, decoder="ar", max_new_tokens=bad)


# -- the server ---------------------------------------------------------------------------------------------

@pytest.fixture
def server(scratch, bundle):
    for m in ("fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(m, reason=f"the server tests need {m}: pip install -e '.[test]'")
    from unmask.serve import create_app
    from unmask.serve.server import ServerThread

    for fail in ("make", "join", "step"):
        register(spec(f"boom-{fail}", config=type(f"P{fail}", (Plain,), {"__annotations__": {}}), batch=_batch(fail)))
    register(spec("careless", config=Careless))
    with ServerThread(create_app(bundle, max_batch_size=4, max_queue=8)) as s:
        yield s


def complete(server, body: dict) -> tuple[int, dict]:
    from test_round3_serve import post

    return post(server.url + "/v1/completions", body, timeout=120)


def test_the_server_answers_a_failing_plugin_500_a_careless_config_400_and_goes_on(server):
    for fail in ("make", "join", "step"):
        status, got = complete(server, {"prompt": "Zoo", "max_tokens": 3, "decoder": f"boom-{fail}"})
        assert status == 500, (fail, got)
    status, got = complete(server, {"prompt": "Zoo", "max_tokens": 3, "decoder": "careless", "width": 9})
    assert status == 400 and "width too large" in got["error"]["message"], got
    assert got["error"]["param"] == "width"
    status, got = complete(server, {"prompt": "Zoo", "max_tokens": 3, "decoder": "ar"})
    assert status == 200, got


# -- the CLI's help with a plug-in --------------------------------------------------------------------------

@dataclass(frozen=True)
class Bracketed(Config):
    ratio: float | None = knob("a ratio in [0, 1] [/bold] (50% by default)")


@pytest.fixture
def bracketed(scratch):
    from unmask.cli.generate import generate_cmd, with_decoder_flags

    register(spec("bracketed", config=Bracketed, summary="brackets [/] and [bold]100%[/bold] in a summary"))
    with_decoder_flags(generate_cmd)  # as `unmask` builds it with the plug-in registered
    yield
    DECODERS.pop("bracketed")
    with_decoder_flags(generate_cmd)


def test_generate_help_shows_a_plugin_s_text_as_written(bracketed, capsys):
    code, out, err = run_cli(capsys, "generate", "--help")
    assert code == 0, err
    text = " ".join(out.replace("│", " ").split())
    assert "brackets [/] and [bold]100%[/bold] in a summary" in text
    assert "a ratio in [0, 1] [/bold] (50% by default)" in text


# -- a plug-in whose batch key cannot key a batch -----------------------------------------------------------

@dataclass(frozen=True)
class Unhashable(Config):
    width: int | None = knob("a width")
    seen: list = dataclasses.field(default_factory=list)  # not a knob; makes the config (the default key) unhashable


@dataclass(frozen=True)
class KeyFails(Config):
    width: int | None = knob("a width")

    def batch_key(self, bundle, max_new_tokens):
        raise RuntimeError("no key today")


@dataclass(frozen=True)
class KeyNotTuple(Config):
    width: int | None = knob("a width")

    def batch_key(self, bundle, max_new_tokens):
        return 7


@pytest.mark.parametrize("config", [Unhashable, KeyFails, KeyNotTuple])
def test_a_batch_key_that_cannot_key_a_batch_runs_the_request_alone_and_the_server_goes_on(scratch, bundle, config):
    """Before: an unhashable key failed every scheduler pass (every request, AR included, timed out); a raising
    one answered 500 from the HTTP layer. Now the request runs per call (the decoder's own decode)."""
    for m in ("fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(m, reason=f"the server tests need {m}: pip install -e '.[test]'")
    from concurrent.futures import ThreadPoolExecutor

    from unmask.serve import create_app
    from unmask.serve.server import ServerThread

    register(spec("odd", config=config))
    with ServerThread(create_app(bundle, max_batch_size=4, max_queue=8)) as s, ThreadPoolExecutor(2) as pool:
        odd = pool.submit(complete, s, {"prompt": "Zoo", "max_tokens": 3, "decoder": "odd", "timeout": 30})
        ar = pool.submit(complete, s, {"prompt": "Zoo", "max_tokens": 3, "decoder": "ar", "timeout": 30})
        assert ar.result()[0] == 200, ar.result()
        status, got = odd.result()
        assert status == 200, got
        assert got["choices"][0]["text"] == bundle.decode_continuation(bundle.encode("Zoo"), [bundle.encode("Zoo")[-1]] * 3)


# -- a plug-in importing what unmask.decode defines ---------------------------------------------------------

LATE = '''
from dataclasses import dataclass

from unmask.decode import Config, Spec, default_decoder, knob, spec_for  # defined below the built-ins' registration


@dataclass(frozen=True)
class LateOptions(Config):
    width: int | None = knob("a width")


SPEC = Spec("late", LateOptions, batch=lambda *a, **k: None, kinds=("causal",), summary="imports spec_for")
'''


def test_a_plugin_may_import_anything_unmask_decode_defines(tmp_path):
    """``import unmask.decode`` loads the plug-ins once the module is whole: before, one importing ``spec_for``
    (defined after the load) failed with "partially initialized module" and was skipped."""
    import os
    import subprocess
    import sys

    (tmp_path / "unmask_late.py").write_text(LATE)
    dist = tmp_path / "unmask_late-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: unmask-late\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{registry.ENTRY_POINTS}]\nlate = unmask_late:SPEC\n")
    src = str(registry.__file__).rsplit("unmask", 2)[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(tmp_path)])}
    run = subprocess.run([sys.executable, "-c", "import unmask.decode as d; print(sorted(d.DECODERS))"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and "'late'" in run.stdout, run.stdout + run.stderr
    assert "not loaded" not in run.stderr, run.stderr
