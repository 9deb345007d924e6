"""Progress display (issue 15 item 2): on a terminal only, silent when piped or with --no-progress."""

from __future__ import annotations

import io

from conftest import run_cli
from rich.console import Console

from unmask.cli.progress import bar, status


def _terminal():
    return Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)


def test_status_and_bar_show_on_a_terminal_only():
    term = _terminal()
    with status("loading stories260K", console=term):
        pass
    with bar("documents", console=term) as update:
        update(3, 10)
    assert update is not None and "loading stories260K" in term.file.getvalue()
    piped = Console(file=io.StringIO(), width=100)
    with status("loading", console=piped), bar("documents", console=piped) as update:
        assert update is None
    with bar("documents", enabled=False, console=_terminal()) as update:
        assert update is None
    assert piped.file.getvalue() == ""


def test_piped_generate_and_data_print_no_progress(capsys, tmp_path):
    code, out, err = run_cli(capsys, "generate", "Zoo", "--model", "stories260K", "-n", "4")
    assert code == 0 and out.strip() and err == ""
    code, out, err = run_cli(capsys, "data", "stories", "--model", "stories260K", "--out", tmp_path / "c.jsonl",
                             "--sampled", "2", "--greedy", "2", "--max-new-tokens", "16")
    assert code == 0 and "documents=" in out and err == ""  # the old code printed "n/N documents" lines


def test_router_trainers_messages_are_silent_when_piped(capsys):
    from unmask.cli.train_routers import _messages

    for enabled in (True, False):
        with _messages(enabled) as note:
            note("LPS epoch 1: loss 0.7")  # the old command echoed every epoch to stderr
    assert capsys.readouterr().err == ""


def test_model_trainers_take_no_progress(capsys, tmp_path, monkeypatch):
    import unmask.train.sbd as sbd

    seen = {}

    def fake(**kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(sbd, "train_sbd", fake)
    corpus = tmp_path / "c.txt"
    corpus.write_text("Once upon a time.\n\nZoo.\n")
    code, _, _ = run_cli(capsys, "train", "sbd", "--data", corpus, "--out", tmp_path / "m", "--no-progress")
    assert code == 0 and seen["progress"] is False
    for command in ("diffusion", "block-diffusion", "multitf", "lbs", "lps"):
        assert "--no-progress" in run_cli(capsys, "train", command, "--help")[1]
