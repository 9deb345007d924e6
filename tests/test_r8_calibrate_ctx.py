"""``calibrate-drafts`` refuses -n past the context window up front, with generate's one-line
error, instead of decoding positions the model has no place for (stories260K-sbd: 512)."""

from __future__ import annotations

import pytest
from conftest import one_line_error

import unmask
from unmask import calibrate as cal
from unmask.decode import Spec
from unmask.errors import UnmaskError


@pytest.fixture
def no_decoding(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("decoded before the context check")

    monkeypatch.setattr(Spec, "decode", refuse)  # the ar decoder calibration runs first


@pytest.mark.parametrize("n, match", [(1000, "max_new_tokens 1000 exceeds the context window of 512"),
                                      (510, "prompt 1 is 5 tokens; with --max-new-tokens 510 it exceeds the context "
                                            "window of 512")])
def test_calibrate_drafts_refuses_n_past_the_context_before_decoding(tmp_path, capsys, no_decoding, n, match):
    (tmp_path / "one.txt").write_text("Once upon a time\n")
    one_line_error(capsys, "calibrate-drafts", "stories260K-sbd", "-n", n, "--dry-run", "--prompts",
                   tmp_path / "one.txt", match=match)


def test_record_checks_the_context_like_generate(no_decoding):
    bundle = unmask.load("stories260K-sbd")
    prompt = bundle.encode("Once upon a time")  # 5 ids
    for n in (512, 508):
        with pytest.raises(UnmaskError) as got:
            cal.record(bundle, [prompt], max_new_tokens=n)
        with pytest.raises(UnmaskError) as want:
            unmask.generate(["Once upon a time"], bundle, "sbd", max_new_tokens=n)
        assert str(got.value) == str(want.value)
