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
