"""Thread count (issue 15 item 1): --threads / UNMASK_THREADS, and the size-based auto default."""

from __future__ import annotations

import pytest
import torch

import unmask
from conftest import one_line_error, run_cli
from unmask import threads


@pytest.fixture(autouse=True)
def restore(monkeypatch):
    before, policy = torch.get_num_threads(), threads._policy
    monkeypatch.delenv(threads.ENV, raising=False)
    threads._policy = None  # an earlier in-process CLI run leaves "auto" behind
    yield
    threads._policy = policy
    torch.set_num_threads(before)


def test_auto_uses_one_thread_for_small_models_and_torch_default_for_large(monkeypatch):
    # an idle machine (issue 28 item 2: above the threshold auto is capped at the idle cores)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(threads, "cores", lambda: max(threads._DEFAULT, 1))
    assert threads.for_model(260_000) == 1
    assert threads.for_model(threads.SMALL_MODEL_PARAMS - 1) == 1
    assert threads.for_model(threads.SMALL_MODEL_PARAMS) == threads._DEFAULT


def test_cli_default_is_auto_and_applies_at_model_load(capsys):
    torch.set_num_threads(2)
    code, out, _ = run_cli(capsys, "generate", "Zoo", "--model", "stories260K", "--decoder", "ar", "-n", "4")
    assert code == 0 and torch.get_num_threads() == 1  # 260K parameters: one thread


def test_cli_threads_option_and_env(capsys, monkeypatch):
    code, _, _ = run_cli(capsys, "--threads", "2", "generate", "Zoo", "--model", "stories260K", "-n", "2")
    assert code == 0 and torch.get_num_threads() == 2
    monkeypatch.setenv("UNMASK_THREADS", "1")
    code, _, _ = run_cli(capsys, "generate", "Zoo", "--model", "stories260K", "-n", "2")
    assert code == 0 and torch.get_num_threads() == 1


@pytest.mark.parametrize("value", ["0", "two", "1.5"])
def test_bad_thread_counts_are_one_line_errors(capsys, value):
    one_line_error(capsys, "--threads", value, "models", match="threads must be an integer >= 1 or 'auto'")


def test_python_api_leaves_torch_alone_unless_asked(monkeypatch):
    torch.set_num_threads(2)
    unmask.load("stories260K")
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("UNMASK_THREADS", "auto")
    unmask.load("stories260K")
    assert torch.get_num_threads() == 1
    monkeypatch.delenv("UNMASK_THREADS")
    unmask.set_threads(2)
    unmask.load("stories260K")
    assert torch.get_num_threads() == 2
