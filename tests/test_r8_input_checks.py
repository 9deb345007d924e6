"""Found by the round-8 fault pass: early-bird's router options, device/dtype beside a loaded
bundle, knob types (a bool as a size, a string as a flag, nan/inf), error messages that name the
field the user set, `unmask models` paths, and `unmask generate --help`'s paragraphs."""

from __future__ import annotations

import re

import pytest
from conftest import one_line_error

import unmask
from unmask.errors import UnmaskError


@pytest.fixture(scope="module")
def dlm():
    return unmask.load("stories260K-dlm")


# -- 1. early-bird router options -------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"routers": 5}, "routers must be a directory path (got 5)"),
    ({"lbs_router": "x"}, "lbs_router must be an LBSRouter (got str)"),
    ({"lps_router": "x", "tau_psi": 0.5}, "lps_router must be an LPSRouter (got str)"),
])
def test_early_bird_router_options_of_the_wrong_type_are_one_line(dlm, kw, match):
    with pytest.raises(UnmaskError, match=match.replace("(", r"\(").replace(")", r"\)")):
        unmask.generate("Once upon a time", dlm, "early-bird", max_new_tokens=4, **kw)


def test_eval_routers_option_is_a_path(capsys):
    one_line_error(capsys, "eval", "--task", "stories", "-m", "stories260K-dlm", "--limit", "1", "-n", "8",
                   "--no-progress", "-d", "early-bird", "-O", "routers=5", match="no Early-Bird routers for "
                   "'stories260K-dlm' in 5")


# -- 2. device / dtype beside a loaded bundle ----------------------------------------------------------

def test_device_and_dtype_that_differ_from_a_loaded_bundle_are_refused():
    import torch

    b = unmask.load("stories260K")  # cpu, float32
    with pytest.raises(UnmaskError, match=r"already loaded on cpu, so device='cuda' would be ignored; load it with "
                                          r"unmask.load\(\.\.\., device='cuda'\)"):
        unmask.generate("Once upon a time", b, max_new_tokens=2, device="cuda")
    with pytest.raises(UnmaskError, match=r"already loaded in float32, so dtype='bfloat16' would be ignored"):
        unmask.generate("Once upon a time", b, max_new_tokens=2, dtype="bfloat16")
    with pytest.raises(UnmaskError, match=r"unknown dtype \['x'\]"):
        unmask.generate("Once upon a time", b, max_new_tokens=2, dtype=["x"])
    same = unmask.generate("Once upon a time", b, max_new_tokens=2, device="cpu", dtype=torch.float32)
    assert same.tokens == unmask.generate("Once upon a time", b, max_new_tokens=2).tokens


# -- 3. knob types: a bool is no size, a string no flag, nan no number --------------------------------

@pytest.fixture(scope="module")
def sbd():
    return unmask.load("stories260K-sbd")


@pytest.mark.parametrize("model, decoder, kw, match", [
    ("sbd", "sbd", {"static": "x"}, r"static must be True or False \(got 'x'\)"),  # the lossless default path
    ("sbd", "sbd", {"compile": "x", "verify": True}, r"compile must be True or False \(got 'x'\)"),
    ("sbd", "sbd", {"block_size": True, "verify": False}, r"block size must be an integer >= 1 \(got True\)"),
    ("dlm", "diffusion", {"block_size": True}, r"block size must be an integer >= 1 \(got True\)"),
    ("dlm", "diffusion", {"gen_length": True}, r"gen length must be an integer >= 1 \(got True\)"),
    ("dlm", "diffusion", {"policy": "top-k", "steps": True}, r"steps must be a positive multiple .* got True"),
    ("dlm", "diffusion", {"refresh_every": True}, r"refresh_every must be an integer >= 1 \(got True\)"),
    ("dlm", "diffusion", {"reference_steps": "x"}, r"reference_steps must be true or false \(got 'x'\)"),
    ("dlm", "diffusion", {"schedule": "dream", "alg_temp": float("nan")}, r"alg_temp must be a finite number"),
    ("dlm", "diffusion", {"schedule": "dream", "alg_temp": float("inf")}, r"alg_temp must be a finite number"),
    ("dlm", "diffusion", {"gamma": float("nan")}, r"gamma must be >= 0 \(got nan\)"),
    ("dlm", "diffusion", {"eta": float("nan")}, r"eta must be >= 0 \(got nan\)"),
    ("dlm", "diffusion", {"policy": "factor", "factor": float("nan")}, r"must be >= 0 \(got nan\)"),
    ("dlm", "early-bird", {"gap_metric": ""}, r"unknown gap metric ''"),
    ("dlm", "early-bird", {"sampler": ""}, r"unknown sampler ''"),
])
def test_bools_strings_and_nan_are_refused_where_a_knob_is_validated(sbd, dlm, model, decoder, kw, match):
    with pytest.raises(UnmaskError, match=match):
        unmask.generate("Once upon a time", {"sbd": sbd, "dlm": dlm}[model], decoder, max_new_tokens=8, **kw)


def test_shared_type_predicates():
    from unmask.errors import is_int, is_number

    assert is_int(3) and not is_int(True) and not is_int(3.0) and not is_int("3")
    assert is_number(0.5) and is_number(2) and not is_number(True) and not is_number("0.5")
    assert not is_number(float("nan")) and not is_number(float("inf"))
    # ∞ stays a legal bound where the spec gives it a meaning (γ = ∞ reveals all, SBD §5.1); nan never is
    assert is_number(float("inf"), finite=False) and not is_number(float("nan"), finite=False)


# -- 4. messages name the field the user set --------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["--no-verify", "--queries", "3"], "--queries applies to lossless SBD only; add --verify or drop --queries"),
    (["--no-verify", "--draft", "linear", "--queries", "3"], "--draft and --queries apply to lossless SBD only"),
    (["--gamma", "-1"], "use 0 for one token per step, or --preset with one of chat-high, chat-low"),
    (["--preset", "bogus"], "unknown --preset 'bogus'; use one of chat-high, chat-low, reasoning-high, "
                            "reasoning-low, or --gamma for a number"),
    (["--policy", "top-k", "--tokens-per-step", "0"], "tokens per step k must be an integer >= 1"),
    (["--policy", "factor", "--factor", "-1"], "factor f must be >= 0"),
    (["--policy", "threshold", "--tokens-per-step", "2"], "policy 'threshold' does not take --tokens-per-step; "
                                                          "it takes --tau"),
])
def test_cli_messages_name_the_flag_that_was_set(capsys, argv, match):
    one_line_error(capsys, "generate", "Once upon a time", "-m", "stories260K-sbd", "-n", "4", "--no-progress", *argv,
                   match=match)


def test_named_param_is_the_subject_of_the_message():
    from unmask.serve.protocol import named_param

    opts = {"steps": 0, "gen_length": 32}
    assert named_param("steps must be a positive multiple of the 1 blocks (gen length 32 / block size 32)", opts) \
        == "steps"
    assert named_param("tau_add must be a number in [0, 1]", {"tau": 0.9, "tau_add": 2}) == "tau_add"
    assert named_param("block size must be an integer >= 1", {"gamma": 0.3, "block_size": -1}) == "block_size"
    assert named_param("slots does not apply to decoder 'block'", {"block_size": 8, "slots": 2}) == "slots"
    assert named_param("the prompt is empty", {"steps": 3}) is None


def test_the_server_names_the_field_that_was_set(dlm):
    pytest.importorskip("unmask.serve", reason="the server tests need the serve extra")
    for m in ("fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(m, reason=f"the server tests need {m}: pip install -e '.[test]'")
    import json
    import urllib.error
    import urllib.request

    from unmask.serve import create_app
    from unmask.serve.server import ServerThread

    def post(body):
        req = urllib.request.Request(s.url + "/v1/completions", json.dumps({"prompt": "Once upon a time",
                                     "max_tokens": 8, **body}).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]

    with ServerThread(create_app(dlm)) as s:
        for body, param, match in [
            ({"steps": 0, "gen_length": 32}, "steps", "steps must be a positive multiple"),  # named gen_length
            ({"gamma": -1}, "gamma", "or preset with one of chat-high"),
            ({"preset": "bogus"}, "preset", "unknown preset 'bogus'; use one of chat-high"),
            ({"tokens_per_step": 0}, "tokens_per_step", "tokens per step k must be an integer >= 1"),
            ({"policy": "factor", "factor": -1}, "factor", "factor f must be >= 0"),
        ]:
            status, err = post(body)
            assert status == 400 and err["param"] == param and match in err["message"], (body, err)


# -- 5. `unmask models` shows paths whole ---------------------------------------------------------------

def test_models_prints_long_paths_whole_when_piped(capsys, monkeypatch):
    from conftest import run_cli

    from unmask.models import smollm2

    long = "/a/very/long/cache/directory/" + "x" * 90 + "/smollm2-135m"
    monkeypatch.setattr(smollm2, "status", lambda: f"converted in {long}")
    monkeypatch.setenv("COLUMNS", "80")  # what a pipe or a narrow terminal reports
    code, out, err = run_cli(capsys, "models")
    assert code == 0, err
    assert "…" not in out and any(long in line for line in out.splitlines())  # whole, on one line
    row = [line for line in out.splitlines() if "stories260K-dlm" in line][0]
    assert "decoders: diffusion, early-bird." in row and "routers: lbs, lps" in row


def test_models_table_folds_instead_of_cutting_on_a_narrow_terminal(monkeypatch):
    from rich.console import Console

    import unmask.cli.models as models_cli
    from unmask.models import smollm2

    long = "/a/very/long/cache/directory/" + "y" * 60 + "/smollm2-135m"
    monkeypatch.setattr(smollm2, "status", lambda: f"converted in {long}")
    console = Console(force_terminal=True, width=60, color_system=None, record=True)
    monkeypatch.setattr("rich.console.Console", lambda *a, **k: console)
    models_cli.models_cmd()
    text = console.export_text()
    assert "…" not in text
    cells = "".join(line.split("│")[3].strip() for line in text.splitlines() if line.count("│") == 4)
    assert long in cells  # folded over several lines, every character kept


# -- 6. help paragraphs are reflowed, not broken where the source lines were -------------------------------

def test_generate_help_keeps_its_sentences_whole(capsys, monkeypatch):
    from conftest import run_cli

    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run_cli(capsys, "generate", "--help")
    assert code == 0, err
    lines = [line.strip() for line in out.splitlines()]
    assert any(line.startswith("Under torchrun the prompts are split over the processes (data parallel) and printed "
                               "by rank 0 in their original order; with --tp N every process") for line in lines), out
    assert "printed by rank" not in lines and "``" not in out


def test_one_line_paragraphs():
    from unmask.cli import one_line_paragraphs

    assert one_line_paragraphs("First line\n    goes on.\n\n    Second para\n    goes on.\n\n    \bkeep\n    these") \
        == "First line goes on.\n\nSecond para goes on.\n\n\bkeep\nthese"
    assert one_line_paragraphs(None) is None


def test_lone_surrogates_in_chat_messages_and_system_are_one_line():
    """A lone surrogate (JSON "\\udfff", or bytes read with surrogateescape) in a chat message or a
    system prompt: tokenizers raise TypeError on it (the server answered 500); now an UnmaskError
    naming the message, and a 400 with param messages."""
    from unmask.serve.errors import ApiError
    from unmask.serve.protocol import parse

    bundle = unmask.load("stories260K")
    for prompt, where in (([{"role": "user", "content": "\ud800"}], "prompt 1[0].content"),
                          ([{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}], "prompt 1[0].content")):
        with pytest.raises(UnmaskError, match=re.escape(where) + " is not valid Unicode"):
            unmask.generate([prompt], bundle, max_new_tokens=2)
    with pytest.raises(UnmaskError, match="the system prompt is not valid Unicode"):
        unmask.generate(["hi"], bundle, max_new_tokens=2, chat=True, system="\udcfe")
    for messages in ([{"role": "user", "content": "\udfff"}], [{"role": "system", "content": "x\ud800"},
                                                               {"role": "user", "content": "hi"}]):
        with pytest.raises(ApiError) as e:
            parse({"messages": messages}, bundle, "stories260K", chat=True, default_timeout=60.0)
        assert e.value.status == 400 and e.value.param == "messages" and "not valid Unicode" in str(e.value.body())


@pytest.mark.parametrize("patch, says", [
    ({"hidden_size": 63}, "is not a valid llama config: The hidden size (63) is not a multiple"),
    ({"hidden_size": "abc"}, "is not a valid llama config: Field 'hidden_size' expected int"),
    ({"rms_norm_eps": "x"}, "Field 'rms_norm_eps' expected float"),
    ({"num_hidden_layers": 0}, "has num_hidden_layers 0; a model needs at least one layer"),
    ({"model_type": "gpt2"}, "do not fit its config.json (model_type 'gpt2'): 65 parameters missing"),
])
def test_a_config_json_that_does_not_describe_the_weights_is_one_line(tmp_path, patch, says):
    """Field errors of transformers' config classes were tracebacks, 0 layers failed at the first forward,
    and another model_type loaded randomly initialised weights that wrote noise."""
    import json
    import shutil
    from pathlib import Path

    src = Path(unmask.__file__).parent / "checkpoints" / "stories260K"
    d = tmp_path / "m"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("adapters"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **patch}))
    with pytest.raises(UnmaskError) as e:
        unmask.load(str(d))
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("cmd", [["train", "sbd", "--base", "stories260K"], ["train", "sbd-adapter", "--base", "stories260K"],
                                 ["train", "diffusion", "--base", "stories260K"], ["train", "lbs", "--model", "stories260K-dlm"]])
@pytest.mark.parametrize("device, says", [("tpu", "unknown device 'tpu'"), ("mps", "unsupported device mps"),
                                          ("", "unknown device ''")])
def test_train_commands_refuse_a_bad_device_in_one_line(capsys, tmp_path, cmd, device, says):
    data = tmp_path / "d.txt"
    data.write_text("Once upon a time there was a cat.\n")
    one_line_error(capsys, *cmd, "--data", data, "--out", tmp_path / "out", "--device", device, match=says)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, says", [
    ({"decoder": ""}, "decoder must be a decoder name"), ({"decoder": 0}, "decoder must be a decoder name"),
    ({"decoder": False}, "decoder must be a decoder name"), ({"decoder": []}, "decoder must be a decoder name"),
    ({"policy": ""}, "policy must not be empty"), ({"stop": 0}, "stop must be a non-empty string"),
    ({"stop": {}}, "stop must be a non-empty string"), ({"gamma": float("inf")}, "JSON has no infinity"),
])
def test_the_server_never_reads_a_falsy_field_as_its_default(field, says):
    """decoder "" / 0 / false / [] and policy "" fell back to the server's default, stop 0 / {} was dropped."""
    from unmask.serve.errors import ApiError
    from unmask.serve.protocol import parse

    with pytest.raises(ApiError) as e:
        parse({"prompt": "hi", **field}, unmask.load("stories260K-sbd"), "m", chat=False, default_timeout=60.0)
    assert e.value.status == 400 and e.value.param == next(iter(field)) and says in e.value.body()["error"]["message"]


@pytest.mark.parametrize("args, says", [
    (["--out", "{d}/p.png", "--out-png", "{d}/p.png"], "--out and --out-png are the same file"),
    (["--out-png", "{d}/x.txt"], "matplotlib cannot write '.txt' files"),
    (["--y-max", "nan"], "--y-max must be an accuracy in percent"),
    (["--y-max", "-1"], "--y-max must be an accuracy in percent"),
])
def test_sweep_refuses_bad_outputs_and_y_max_before_it_evaluates(capsys, tmp_path, monkeypatch, args, says):
    import unmask.eval.sweep as sweep_mod

    monkeypatch.setattr(sweep_mod, "sweep", lambda *a, **k: pytest.fail("evaluated before refusing"))
    one_line_error(capsys, "sweep", "--task", "stories", "--param", "gamma", "--values", "0.1,0.3", "--limit", "2",
                   *[a.format(d=tmp_path) for a in args], match=says)
    assert not list(tmp_path.iterdir())


def test_bench_refuses_an_unknown_judge_before_any_pair_runs(capsys, monkeypatch):
    import unmask.eval.runner as runner

    monkeypatch.setattr(runner, "evaluate", lambda *a, **k: pytest.fail("a pair ran before the judge was checked"))
    one_line_error(capsys, "bench", "--judge", "nope", "--limit", "1", "-d", "ar", match="--judge: unknown model 'nope'")


def test_eval_names_the_asked_max_new_tokens_when_a_prompt_does_not_fit(capsys):
    """The warm-up decode's own budget (2) was named, with a fix that could not work."""
    line = one_line_error(capsys, "eval", "--task", "mbpp", "--limit", "1", "-n", "4", "--no-progress",
                          match="with --max-new-tokens 4 it exceeds")
    assert "use fewer --shots" in line and "lower --max-new-tokens" not in line  # 1409 tokens: no -n fits


@pytest.mark.parametrize("router", ["lbs", "lps"])
@pytest.mark.parametrize("minutes", ["nan", "inf", "0", "-1"])
def test_router_training_refuses_a_max_minutes_that_never_stops(capsys, tmp_path, router, minutes):
    one_line_error(capsys, "train", router, "--model", "stories260K-dlm", "--data", tmp_path / "d.txt",
                   "--max-minutes", minutes, match="--max-minutes must be a finite number > 0")


def test_an_interrupted_distill_says_how_to_finish_it(capsys, tmp_path, monkeypatch):
    """The rows written before Ctrl-C stay (by design, for --resume); the line now says so."""
    import unmask.api as api
    from conftest import run_cli

    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\nTom had a ball\nThe sun\nA cat\n")
    out = tmp_path / "d.jsonl"
    args = ["data", "distill", "--model", "stories260K", "--prompts", prompts, "--out", out, "-n", "4",
            "--batch-size", "2", "--val-fraction", "0", "--no-progress"]
    real, calls = api.generate, []

    def second_batch_interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(api, "generate", second_batch_interrupted)
    code, _, err = run_cli(capsys, *args)
    assert code == 130 and "keeps the answers written so far" in err and "--resume" in err
    assert len(out.read_text().splitlines()) == 2
    monkeypatch.setattr(api, "generate", real)
    code, _, err = run_cli(capsys, *args, "--resume")
    assert code == 0, err
    assert len(out.read_text().splitlines()) == 4


def test_a_lone_surrogate_stop_string_is_a_400_and_the_eval_budget_says_how_far_over():
    from unmask.serve.errors import ApiError
    from unmask.serve.protocol import parse

    with pytest.raises(ApiError) as e:
        parse({"prompt": "Once", "stop": ["ok", "\udfff"]}, unmask.load("stories260K-sbd"), "m", chat=False,
              default_timeout=60.0)
    assert e.value.status == 400 and e.value.param == "stop" and "stop[1] is not valid Unicode" in str(e.value.body())
    from unmask.eval import tasks
    from unmask.eval.runner import _budget

    bundle = unmask.load("stories260K")
    with pytest.raises(UnmaskError, match=r"is 1552 tokens, 1040 over stories260K's 512-token context; use fewer --shots or"):
        _budget(bundle, [[1] * 1552], None, tasks.TASKS["mbpp"])


def test_train_lps_refuses_too_few_prompts_before_collecting_traces(capsys, tmp_path, monkeypatch):
    import unmask.train.routers as routers  # where `unmask train lps` calls collect_lps_traces

    monkeypatch.setattr(routers, "collect_lps_traces", lambda *a, **k: pytest.fail("collected before refusing"))
    data = tmp_path / "d.txt"
    data.write_text("Once upon a time there was a cat.\n\nTom had a ball.\n")
    one_line_error(capsys, "train", "lps", "--model", "stories260K-dlm", "--data", data, "--out", tmp_path / "r",
                   "--prompts", "2", match="needs at least 3 traces for its 80/10/10 split (got --prompts 2)")


def test_router_out_at_the_model_directory_names_the_model(capsys, tmp_path, monkeypatch):
    import shutil
    from pathlib import Path

    model = tmp_path / "dlm"
    shutil.copytree(Path(unmask.__file__).parent / "checkpoints" / "stories260K-dlm", model)
    before = sorted(p.name for p in model.rglob("*"))
    data = tmp_path / "d.txt"
    data.write_text("Once upon a time there was a cat.\n")
    for router in ("lbs", "lps"):
        one_line_error(capsys, "train", router, "--model", model, "--data", data, "--out", model,
                       match="is the --model directory")
    assert sorted(p.name for p in model.rglob("*")) == before
