"""A new user's pass over README.md (round 13): each test pins a finding that was fixed."""
from __future__ import annotations

import pytest

from unmask.serve.errors import ApiError


def _parse(body, chat=False):
    import unmask
    from unmask.serve.protocol import parse

    return parse(body, unmask.load("stories260K-sbd"), "stories260K-sbd", chat=chat, default_timeout=1.0)


def test_openai_tool_fields_pass_at_their_neutral_value_and_are_refused_by_name_otherwise():
    """OpenAI's own tool-calling fields are not "unknown parameters": an empty tool list (what some
    client wrappers send by default) is served, real tools get a 400 saying tools are not supported."""
    chat = [{"role": "user", "content": "Zoo"}]
    assert _parse({"messages": chat, "tools": [], "tool_choice": "none"}, chat=True).prompt_ids
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for field, value in (("tools", tools), ("tool_choice", "auto"), ("functions", tools), ("function_call", "auto")):
        with pytest.raises(ApiError, match=f"{field} is not supported; drop '{field}'") as e:
            _parse({"messages": chat, field: value}, chat=True)
        assert e.value.status == 400 and e.value.param == field


def test_a_bad_api_key_from_the_environment_names_the_variable(capsys, monkeypatch):
    """A user who set UNMASK_API_KEY and never typed --api-key is told which setting is wrong."""
    from conftest import one_line_error

    monkeypatch.setenv("UNMASK_API_KEY", "has space")
    one_line_error(capsys, "serve", "--model", "stories260K", "--port", "0", match="UNMASK_API_KEY")


def test_a_completion_without_a_prompt_says_the_prompt_is_required():
    """``{}`` (or ``"prompt": null``) is a missing prompt, not a prompt of the wrong type ("got null")."""
    for body in ({}, {"prompt": None}):
        with pytest.raises(ApiError, match="prompt is required") as e:
            _parse(body)
        assert e.value.status == 400 and e.value.param == "prompt"
