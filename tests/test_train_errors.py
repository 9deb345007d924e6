"""Regression tests for the training commands' user errors: every one ends in a single
``error: <problem>; <fix>`` line with exit code 2 naming CLI flags, router options are checked
before any response is generated, text corpora work for ``train lbs``, ``train multitf`` refuses
a --g-max above the blocks per row, and ``--resume`` without a checkpoint says so.

All in-process through ``unmask.cli.main``; models are stories260K (shipped, 260K parameters)
re-labelled on disk, and the only optimisation runs are a step or an epoch on a few rows."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import replace
from pathlib import Path

import conftest
import pytest
from conftest import run_cli

import unmask.train.routers as tr
from unmask.models.registry import shipped

SRC = Path(__file__).resolve().parents[1] / "src" / "unmask"


def one_line_error(capsys, *argv, match: str) -> str:
    """:func:`conftest.one_line_error` with ``"; "`` between problem and fix, ``match`` compared
    case-sensitively, and no Python-style option name (``batch_size``) in the line."""
    line = conftest.one_line_error(capsys, *argv, match=match)
    assert "; " in line, f"no fix after the problem: {line}"
    assert match in line, line
    for name in ("batch_size", "seq_len", "prefix_prob", "grad_accum", "max_minutes", "g_max", "n_rand",
                 "gen_length", "block_size", "max_new_tokens", "val_fraction"):
        assert name not in line, line
    return line


def ids_file(path: Path, n_docs: int = 12, length: int = 40) -> Path:
    rows = [[3 + (7 * d + 13 * i) % 500 for i in range(length)] for d in range(n_docs)]
    path.write_text("".join(json.dumps({"ids": r}) + "\n" for r in rows))
    return path


STORY = "Once upon a time there was a little dog. He liked to play in the park with his red ball."


def relabelled(tmp_path: Path, name: str, meta: dict) -> Path:
    """stories260K with a mask row (id 512), saved as a model of another kind."""
    import unmask
    from unmask.models.mask_token import add_mask_token

    bundle = unmask.load("stories260K")
    assert add_mask_token(bundle.model) == 512
    d = tmp_path / name
    bundle.model.save_pretrained(d)
    bundle.tokenizer.save_pretrained(d)
    (d / "unmask_config.json").write_text(json.dumps({"mask_token_id": 512, **meta}))
    return d


@pytest.fixture
def dlm(tmp_path):
    return relabelled(tmp_path, "dlm", {"kind": "masked-diffusion", "logit_shift": 1, "stop_token_ids": [2]})


@pytest.fixture
def no_generation(monkeypatch):
    """Fail the test if any response would be generated."""
    def boom(*args, **kwargs):
        raise AssertionError("responses were generated before the options were checked")

    monkeypatch.setattr(tr, "generate_responses", boom)


# -- 1. train lbs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["txt", "text-jsonl"])
def test_lbs_reads_a_text_corpus_with_the_model_tokenizer(tmp_path, capsys, dlm, kind):
    if kind == "txt":
        corpus = tmp_path / "docs.txt"
        corpus.write_text("\n\n".join(f"{STORY} Day {i}." for i in range(6)) + "\n")
    else:
        corpus = tmp_path / "docs.jsonl"
        corpus.write_text("".join(json.dumps({"text": f"{STORY} Day {i}."}) + "\n" for i in range(6)))
    code, out, err = run_cli(capsys, "train", "lbs", "--model", dlm, "--data", corpus, "--prompts", "4",
                             "--gen-length", "8", "--block-size", "4", "--responses", "threshold", "--epochs", "1",
                             "--gen-batch", "4", "--out", tmp_path / "routers")
    assert code == 0, err
    assert "no tokenizer" not in err and "params=" in out
    assert (tmp_path / "routers" / "lbs.json").is_file()


def test_prompts_from_a_text_corpus_are_the_tokenizer_ids(tmp_path, stories):
    corpus = tmp_path / "docs.txt"
    corpus.write_text(f"{STORY}\n\n{STORY} Again.\n")
    prompts = tr.prompts_from_corpus([corpus], 2, bos=1, tokenizer=stories.tokenizer, vocab_size=512)
    ids = list(stories.tokenizer(STORY, add_special_tokens=False)["input_ids"])
    assert all(p[0] == 1 and p[1:] == ids[: len(p) - 1] for p in prompts)


def test_lbs_zero_prompts_is_refused_up_front(tmp_path, capsys, dlm, no_generation):
    line = one_line_error(capsys, "train", "lbs", "--model", dlm, "--data", ids_file(tmp_path / "c.jsonl"),
                          "--prompts", "0", match="--prompts")
    assert "responses" not in line


@pytest.mark.parametrize("argv,match", [
    (["--d", "3"], "--d 3"),
    (["--d", "30"], "--d 30"),  # even but not divisible by the 4 heads
    (["--d", "0"], "--d"),
    (["--layers", "0"], "--layers"),
    (["--ffn", "-1"], "--ffn"),
])
def test_lbs_router_sizes_are_checked_before_any_generation(tmp_path, capsys, dlm, no_generation, argv, match):
    one_line_error(capsys, "train", "lbs", "--model", dlm, "--data", ids_file(tmp_path / "c.jsonl"), "--prompts", "4",
                   "--gen-length", "8", "--block-size", "4", *argv, match=match)


@pytest.mark.parametrize("argv,match", [
    (["--gen-length", "100000"], "--gen-length"),
    (["--gen-length", "10", "--block-size", "4"], "--block-size 4"),
    (["--gen-length", "0"], "--gen-length"),
    (["--block-size", "0"], "--block-size"),
    (["--gen-batch", "0"], "--gen-batch"),
    (["--batch-size", "0"], "--batch-size"),
    (["--epochs", "0"], "--epochs"),
    (["--lr", "0"], "--lr"),
    (["--responses", "greedy"], "--responses"),
    (["--response-cache", "full"], "--response-cache"),
])
def test_lbs_options_are_checked_before_any_generation(tmp_path, capsys, dlm, no_generation, argv, match):
    line = one_line_error(capsys, "train", "lbs", "--model", dlm, "--data", ids_file(tmp_path / "c.jsonl"),
                          "--prompts", "4", *argv, match=match)
    assert "--max-new-tokens" not in line


def test_lbs_gen_length_beyond_the_context_names_only_gen_length(tmp_path, capsys, dlm, no_generation):
    line = one_line_error(capsys, "train", "lbs", "--model", dlm, "--data", ids_file(tmp_path / "c.jsonl"),
                          "--prompts", "4", "--gen-length", "100000", match="context window")
    assert "--max-new-tokens" not in line and re.search(r"--gen-length \d+ or less", line), line


def test_lbs_too_few_documents_names_prompts(tmp_path, capsys, dlm, no_generation):
    one_line_error(capsys, "train", "lbs", "--model", dlm, "--data", ids_file(tmp_path / "c.jsonl", n_docs=3),
                   "--prompts", "5", "--gen-length", "8", "--block-size", "4", match="--prompts")


def test_lps_router_sizes_are_checked_before_loading(tmp_path, capsys, dlm):
    one_line_error(capsys, "train", "lps", "--model", dlm, "--data", ids_file(tmp_path / "c.jsonl"), "--d", "30",
                   match="--d 30")
    one_line_error(capsys, "train", "lps", "--model", dlm, "--data", ids_file(tmp_path / "c.jsonl"), "--fpr", "2",
                   match="--fpr")
    one_line_error(capsys, "train", "lps", "--model", dlm, "--data", ids_file(tmp_path / "c.jsonl"), "--patience",
                   "0", match="--patience")
    one_line_error(capsys, "train", "lps", "--model", dlm, "--data", ids_file(tmp_path / "c.jsonl"), "--pos-mode",
                   "absolute", match="--pos-mode")


def test_router_commands_refuse_a_model_of_another_kind(tmp_path, capsys):
    one_line_error(capsys, "train", "lbs", "--model", "stories260K", "--data", ids_file(tmp_path / "c.jsonl"),
                   "--prompts", "4", "--gen-length", "8", "--block-size", "4", match="--model")


# -- 2. train multitf --------------------------------------------------------------------------------


@pytest.fixture
def bd(tmp_path):
    return relabelled(tmp_path, "bd", {"kind": "block-diffusion", "block_size": 4, "stop_token_ids": [2]})


MULTITF = ["--batch-size", "1", "--warmup", "1", "--eval-every", "0", "--ckpt-every", "0", "--n-rand", "0"]


def test_multitf_refuses_g_max_above_the_blocks_per_row(tmp_path, capsys, bd):
    out = tmp_path / "m"
    line = one_line_error(capsys, "train", "multitf", "--base", bd, "--data", ids_file(tmp_path / "d.jsonl"),
                          "--out", out, "--seq-len", "16", "--g-max", "100", "--steps", "1", *MULTITF,
                          match="--g-max 100")
    assert "4 blocks per row" in line and "--seq-len" in line
    assert not out.exists() and not Path(f"{out}.run").exists()
    one_line_error(capsys, "train", "multitf", "--base", bd, "--data", ids_file(tmp_path / "d.jsonl"), "--out", out,
                   "--seq-len", "4", "--g-max", "2", "--steps", "1", *MULTITF, match="1 blocks per row")


def test_multitf_accepts_g_max_equal_to_the_blocks_per_row(tmp_path, capsys, bd):
    code, out, err = run_cli(capsys, "train", "multitf", "--base", bd, "--data", ids_file(tmp_path / "d.jsonl"),
                             "--out", tmp_path / "m", "--seq-len", "16", "--g-max", "4", "--steps", "1", *MULTITF)
    assert code == 0, err
    assert "after 1 steps" in out


@pytest.mark.parametrize("argv,match", [
    (["--rho", "2"], "--rho"),
    (["--n-rand", "-1"], "--n-rand"),
    (["--layouts-per-row", "99"], "--layouts-per-row"),
    (["--rounding", "up"], "--rounding"),
    (["--g-max", "1"], "--g-max"),
    (["--t-low", "0.9", "--t-high", "0.1"], "--t-low"),
])
def test_multitf_option_errors_name_flags(tmp_path, capsys, bd, argv, match):
    one_line_error(capsys, "train", "multitf", "--base", bd, "--data", ids_file(tmp_path / "d.jsonl"),
                   "--out", tmp_path / "m", "--seq-len", "16", "--steps", "1", *argv, match=match)


# -- 3. --resume without a checkpoint -----------------------------------------------------------------


@pytest.mark.parametrize("command", ["sbd", "diffusion"])
def test_resume_without_a_checkpoint_says_it_starts_from_scratch(tmp_path, capsys, command):
    run_dir = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", command, "--data", ids_file(tmp_path / "d.jsonl"), "--out",
                             tmp_path / "m", "--run-dir", run_dir, "--seq-len", "16", "--batch-size", "2",
                             "--steps", "1", "--warmup", "0", "--eval-every", "0", "--resume")
    assert code == 0, err
    notes = [line for line in err.splitlines() if "no checkpoint" in line]
    assert len(notes) == 1 and str(run_dir) in notes[0] and "from scratch" in notes[0], err
    assert "after 1 steps" in out


def test_resume_note_goes_to_stderr_without_a_console(tmp_path, capsys):
    import torch
    from conftest import tiny_llama

    from unmask.train.loop import TrainConfig, train
    from unmask.train.objectives import SBDObjective

    model = tiny_llama(vocab=64)
    chunks = torch.randint(3, 63, (4, 9))
    cfg = TrainConfig(steps=1, batch_size=2, warmup=0, eval_every=0, ckpt_every=0)
    result = train(model, SBDObjective(63), chunks, None, cfg, tmp_path / "r", resume=True)
    err = capsys.readouterr().err
    assert result.step == 1 and err.count("\n") == 1 and "from scratch" in err
    train(tiny_llama(vocab=64), SBDObjective(63), chunks, None, replace(cfg, steps=2), tmp_path / "r", resume=True)
    assert "no checkpoint" not in capsys.readouterr().err  # a checkpoint now exists: a real resume


# -- 4. messages: problem; fix, with flags --------------------------------------------------------------


@pytest.mark.parametrize("command,argv,match", [
    ("sbd", ["--steps", "0"], "--steps must be >= 1"),
    ("sbd", ["--batch-size", "0"], "--batch-size must be >= 1"),
    ("sbd", ["--lr", "0"], "--lr"),
    ("sbd", ["--grad-accum", "0"], "--grad-accum"),
    ("sbd", ["--warmup", "-1"], "--warmup"),
    ("sbd", ["--weight-decay", "-1"], "--weight-decay"),
    ("sbd", ["--clip", "-1"], "--clip"),
    ("sbd", ["--ckpt-every", "-1"], "--ckpt-every"),
    ("sbd", ["--eval-every", "-1"], "--eval-every"),
    ("sbd", ["--max-minutes", "0"], "--max-minutes"),
    ("sbd", ["--seq-len", "0"], "--seq-len"),
    ("diffusion", ["--prefix-prob", "2"], "--prefix-prob"),
    ("diffusion", ["--norm", "word"], "--norm"),
    ("diffusion", ["--seq-len", "100000"], "--seq-len"),
    ("diffusion", ["--batch-size", "0"], "--batch-size"),
    ("block-diffusion", ["--block-size", "4", "--noise", "token"], "--noise"),
    ("block-diffusion", ["--block-size", "4", "--rounding", "up"], "--rounding"),
    ("block-diffusion", ["--block-size", "4", "--seq-len", "10"], "--seq-len 10 must be a multiple"),
    ("block-diffusion", ["--block-size", "4", "--t-low", "2"], "--t-low"),
    ("block-diffusion", ["--block-size", "0"], "--block-size"),
    ("block-diffusion", [], "--block-size"),
])
def test_training_errors_are_one_line_with_a_fix_and_flags(tmp_path, capsys, command, argv, match):
    one_line_error(capsys, "train", command, "--data", ids_file(tmp_path / "d.jsonl"), "--out", tmp_path / "m",
                   "--seq-len", "16", "--steps", "1", *argv, match=match)


@pytest.mark.parametrize("command", ["sbd", "diffusion", "block-diffusion", "multitf"])
def test_missing_data_file_says_how_to_fix_it(tmp_path, capsys, command):
    line = one_line_error(capsys, "train", command, "--data", tmp_path / "docs.txt", "--out", tmp_path / "m",
                          match="data file not found")
    assert "--data" in line.split("; ", 1)[1]


def test_story_corpus_options_name_flags(tmp_path, capsys):
    for argv, match in ((["--batch-size", "0"], "--batch-size"), (["--max-new-tokens", "0"], "--max-new-tokens"),
                        (["--val-fraction", "1"], "--val-fraction"), (["--sampled", "0", "--greedy", "0"], "--sampled")):
        one_line_error(capsys, "data", "stories", "--out", tmp_path / "c.jsonl", *argv, match=match)


def _messages(path: Path):
    """(line, literal text) of every ``UnmaskError(...)`` raised with a literal message in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "UnmaskError" and node.args:
            arg = node.args[0]
            if isinstance(arg, (ast.Constant, ast.JoinedStr)):
                parts = arg.values if isinstance(arg, ast.JoinedStr) else [arg]
                yield node.lineno, "".join(p.value if isinstance(p, ast.Constant) else "{}" for p in parts)


def test_every_training_error_message_has_a_fix():
    files = sorted((SRC / "train").glob("*.py")) + [SRC / "cli" / "train.py"]
    found = 0
    for f in files:
        for line, text in _messages(f):
            found += 1
            assert "; " in text and "\n" not in text, f"{f.name}:{line}: {text}"
    assert found > 80


@pytest.mark.parametrize("router", ["lbs", "lps"])
def test_router_training_does_not_replace_the_shipped_routers(capsys, tmp_path, router):
    # Default output: MODEL_DIR/routers, i.e. inside the installed package for a shipped model.
    data = tmp_path / "prompts.txt"
    data.write_text("Once upon a time\nTom had a ball\n")
    shipped_files = {p.name: p.read_bytes() for p in (shipped()["stories260K-dlm"] / "routers").iterdir()}
    one_line_error(capsys, "train", router, "--data", str(data), match="--overwrite")
    assert {p.name: p.read_bytes() for p in (shipped()["stories260K-dlm"] / "routers").iterdir()} == shipped_files
