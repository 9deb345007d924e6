"""Mistakes a new user made following the README (round 6): each is a one-line error that names the
fix, and nothing is written; a recalibration of one budget keeps the others."""

import subprocess
from pathlib import Path

import pytest

from conftest import one_line_error
from unmask import calibrate as cal
from unmask.decode.verify import layout as dl
from unmask.errors import UnmaskError
from unmask.models.registry import shipped

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model,match", [("stories260K-dlm", "calibrate-drafts picks lossless SBD"),
                                         ("stories260K", "no unmask_config.json")])
def test_calibrate_drafts_refuses_a_model_without_lossless_sbd_and_writes_nothing(capsys, model, match):
    config = shipped()[model] / "unmask_config.json"
    before = config.read_bytes() if config.is_file() else None
    one_line_error(capsys, "calibrate-drafts", model, "-n", 4, match=match)
    assert (config.read_bytes() if config.is_file() else None) == before
    one_line_error(capsys, "calibrate-drafts", model, "-n", 4, "--dry-run", match="calibrate-drafts picks lossless SBD")


def test_recalibrating_one_budget_keeps_the_other_stored_layouts():
    old = {"verify": True, "draft": "budget", "queries": 16, "draft_layouts": "8=3/3/4 16=3/0,1,3/4 32=5/0,1,2,3,4/5"}
    new = cal.stored_defaults(old, [{"budget": 8, "layout": "2/0/5", "queries": 8, "tpf": 2.0},
                                    {"budget": None, "layout": "linear", "queries": 16, "tpf": 2.1}])
    assert dl.stored_layouts(new) == {8: "2/0/5", 16: "3/0,1,3/4", 32: "5/0,1,2,3,4/5"}
    assert dl.resolve("budget", None, new) == "3/0,1,3/4"
    fresh = cal.stored_defaults({}, [{"budget": 16, "layout": "7/0/8", "queries": 16, "tpf": 2.0}])
    assert dl.stored_layouts(fresh) == {16: "7/0/8"}  # nothing stored before: only the new table


@pytest.mark.parametrize("draft", ["budget", "budget:24", "3/0,1,3/4"])
def test_an_explicit_budgeted_draft_with_a_block_size_is_refused(draft):
    with pytest.raises(UnmaskError, match="drop --block-size"):
        dl.option(draft, 8, {"draft": "budget"})
    assert dl.option(draft, None, {}) == draft
    assert dl.option("linear", 8, {"draft": "budget"}) == "linear"
    assert dl.option(None, 8, {"draft": "budget"}) == "linear"  # a block size under a budgeted default: linear K


def test_generate_with_draft_budget_and_block_size_is_a_one_line_error(capsys):
    one_line_error(capsys, "generate", "Once", "-m", "stories260K-sbd", "--draft", "budget", "--block-size", 8,
                   "-n", 4, "--no-progress", match="drop --block-size")


def test_an_adapter_on_a_model_that_ships_none_says_drop_it_and_where_adapters_ship(capsys):
    line = one_line_error(capsys, "generate", "Once", "-m", "stories260K-sbd", "--adapter", "sbd", "-n", 4,
                          "--no-progress", match="drop --adapter")
    assert "stories260K" in line.split("come with", 1)[1]


def test_the_test_script_refuses_a_test_path_that_does_not_exist():
    run = subprocess.run(["bash", "scripts/test.sh", "tests/test_no_such_file.py", "-x"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "no such test path: tests/test_no_such_file.py" in run.stderr
    assert "passed" not in run.stdout  # it did not fall through to the whole suite


def test_the_story_corpus_counts_the_documents_it_dropped(tmp_path, monkeypatch):
    """`unmask data stories --sampled 3 --greedy 3` wrote fewer documents than asked for without a word; the
    summary now says how many were dropped (duplicates kept once)."""
    import types

    from unmask.decode import Spec
    from unmask.train.data import make_story_corpus

    same = lambda spec, bundle, prompts, **kw: types.SimpleNamespace(tokens=[[5, 6, 7] for _ in prompts])  # noqa: E731
    monkeypatch.setattr(Spec, "decode", same)  # every story the same: 3 sampled -> 1, 3 greedy -> 1
    summary = make_story_corpus(tmp_path / "c.jsonl", n_sampled=3, n_greedy=3, max_new_tokens=4)
    assert summary["documents"] == 2 and summary["dropped"] == 4
    assert len((tmp_path / "c.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("draft, match", [
    ("999999999/0/4", "at most 63"),  # found by the fault pass: built a table per draft size first (a hang)
    ("200/0/4", "at most 63"),  # fits the context by D, but its step tables would take 13 GB
    ("3/0/99999999999999999999", "context window"),  # a traceback (torch.eye overflow)
    ("3/0/5000", "context window"),  # ran, at 5004 queries per forward against a 512-token context
])
def test_a_lossless_layout_too_large_for_the_engine_is_one_line(capsys, draft, match):
    one_line_error(capsys, "generate", "Hi", "-m", "stories260K-sbd", "-n", "4", "--verify", "--draft", draft,
                   match=match)
