"""Fixes from the round-11 new-user pass."""

from __future__ import annotations

from conftest import one_line_error

from unmask.models.registry import shipped


def test_calibrate_drafts_does_not_store_into_a_shipped_checkpoint_without_overwrite(capsys):
    config = shipped()["stories260K-sbd"] / "unmask_config.json"
    before = config.read_bytes()
    one_line_error(capsys, "calibrate-drafts", "stories260K-sbd", "-n", 4, match="shipped checkpoint")
    one_line_error(capsys, "calibrate-drafts", "stories260K", "--adapter", "sbd", "-n", 4, match="--overwrite")
    assert config.read_bytes() == before


def _parse(body, chat=False):
    import unmask
    from unmask.serve.protocol import parse

    return parse(body, unmask.load("stories260K-sbd"), "stories260K-sbd", chat=chat, default_timeout=1.0)


def test_openai_fields_the_server_cannot_honour_are_refused_with_the_fix():
    import pytest

    from unmask.serve.errors import ApiError

    assert _parse({"prompt": "Zoo", "response_format": {"type": "text"}}).prompt_ids  # the neutral value passes
    cases = [({"prompt": "Zoo", "response_format": {"type": "json_object"}, "verify": False}, False,
              "takes a grammar only where it decodes exactly"),  # JSON mode is served by ar and lossless sbd
             ({"prompt": [1, 2]}, False, "token-id prompts are not served"),  # a list of texts is served
             ({"prompt": "Zoo"}, True, "post 'prompt' to /v1/completions"),
             ({"messages": [{"role": "user", "content": "Zoo"}]}, False, "post 'messages' to /v1/chat/completions")]
    for body, chat, match in cases:
        with pytest.raises(ApiError, match=match) as e:
            _parse(body, chat)
        assert e.value.status == 400


def test_health_says_when_an_idle_time_compile_runs():
    """A request arriving during an idle-time compile waits for it; /health's "compiling" shows when."""
    import unmask
    from unmask.serve.engine import Scheduler

    sched, seen = Scheduler(unmask.load("stories260K-sbd")), []

    class Pending:  # a static batch with one shape to compile
        static = True

        def __len__(self):
            return 0

        def warm(self):
            seen.append(sched.compiling)
            return True

    sched.running_batches[("block", ())] = Pending()
    assert not sched.compiling
    sched._warm()
    assert seen == [True] and not sched.compiling


def test_a_bad_serve_default_names_its_command_line_flag(capsys):
    one_line_error(capsys, "serve", "--decoder", "diffusion", "--port", "0", match="--decoder: decoder 'diffusion' needs")
    one_line_error(capsys, "serve", "--cache", "dual", "--port", "0", match="--cache: cache does not apply")
