"""Faults found by the round-13 fault pass (hostile or careless input to what round 13 added)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import unmask
from unmask.errors import UnmaskError

SHIPPED = Path(unmask.__file__).parent / "checkpoints"


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_number_in_config_json_is_refused_at_load(tmp_path, value):
    """rms_norm_eps: NaN (json.loads reads it) loaded, and every decode wrote token 0 without an error."""
    d = tmp_path / "ckpt"
    shutil.copytree(SHIPPED / "stories260K", d)
    cfg = d / "config.json"
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-05', f'"rms_norm_eps": {value}'))
    with pytest.raises(UnmaskError, match=rf"(?i)config\.json: rms_norm_eps is -?{value.lstrip('-')[:3]}.*not a finite number"):
        unmask.load(str(d))


def test_a_nested_non_finite_number_in_config_json_is_named_by_its_path(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(SHIPPED / "stories260K", d)
    cfg = d / "config.json"
    cfg.write_text(cfg.read_text().replace('"rope_theta": 10000.0', '"rope_theta": Infinity'))
    with pytest.raises(UnmaskError, match=r"rope_parameters\.rope_theta is inf"):
        unmask.load(str(d))


def test_the_batch_memory_check_counts_no_more_cache_than_the_context_window(monkeypatch):
    """--max-cache-tokens past the context window cannot be reached (a request's prompt + completion
    must fit the window), so it must not be counted: 2**40 tokens on stories260K (512) fits a small batch."""
    from unmask import memory
    from unmask.serve import create_app
    from unmask.serve.limits import Limits

    monkeypatch.setattr(memory, "free_bytes", lambda device: 2**30)
    bundle = unmask.load("stories260K")
    create_app(bundle, max_batch_size=8, limits=Limits(max_cache_tokens=2**40))
    with pytest.raises(UnmaskError, match=r"a row's 512-token KV cache"):
        create_app(bundle, max_batch_size=10_000, limits=Limits(max_cache_tokens=2**40))
