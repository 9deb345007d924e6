"""Sweeps: value parsing, the Pareto front, and ``unmask sweep`` writing its plot and AUP."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from unmask.errors import UnmaskError
from unmask.eval.sweep import SWEEP_PARAMS, pareto_front, parse_values


def test_parse_values():
    assert parse_values("gamma", "0,0.1, 0.35") == [0.0, 0.1, 0.35]
    assert parse_values("tokens_per_step", "1,2,4") == [1, 2, 4]
    assert parse_values("tau", [0.9, 0.5]) == [0.9, 0.5]
    for param, values, match in (("beta", "1", "unknown sweep parameter"), ("gamma", " , ", "empty"),
                                 ("gamma", "0,x", "numbers"), ("tokens_per_step", "1.5", "integers"),
                                 ("gamma", "0.1,0.1", "repeats")):
        with pytest.raises(UnmaskError, match=match):
            parse_values(param, values)
    assert set(SWEEP_PARAMS) == {"gamma", "tau", "factor", "tokens_per_step"}


def test_pareto_front():
    pts = [(1.0, 50.0), (2.0, 48.0), (1.5, 40.0), (3.0, 48.0), (0.5, 50.0)]
    assert pareto_front(pts) == [(1.0, 50.0), (3.0, 48.0)]


@pytest.fixture(scope="module")
def fake_sbd_dir(tmp_path_factory, stories):
    """stories260K saved as an 'sbd' model (an untrained mask token id): the SBD decoder runs on
    it, so the sweep pipeline is tested without the trained stories260K-sbd checkpoint."""
    path = tmp_path_factory.mktemp("fake-sbd")
    stories.model.save_pretrained(path)
    stories.tokenizer.save_pretrained(path)
    (path / "unmask_config.json").write_text(json.dumps({"kind": "sbd", "mask_token_id": 511}))
    return path


def test_sweep_writes_png_and_aup(capsys, tmp_path, fake_sbd_dir):
    png, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    code, stdout, err = run_cli(capsys, "sweep", "--task", "stories", "--model", str(fake_sbd_dir),
                                "--decoder", "sbd", "--param", "tokens_per_step", "--values", "1,2",
                                "--block-size", "4", "--limit", "2", "--max-new-tokens", "16", "--batch-size", "2",
                                "--out-png", str(png), "--out", str(out), "--no-progress")
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "AUP" in stdout and "judge_prob_pct" in stdout
    res = json.loads(out.read_text())
    assert [p["value"] for p in res["points"]] == [1, 2]
    tpf = [p["tpf"] for p in res["points"]]
    assert tpf[0] == pytest.approx(1.0) and tpf[1] == pytest.approx(2.0)  # top-k commits exactly k per step
    assert res["aup"] is not None and res["aup"] > 0 and res["aup_error"] is None
    assert res["y_max"] == max(p["quality"] for p in res["points"])


def test_sweep_agreement_metric_and_a_varied_option_is_refused(stories):
    import dataclasses

    from unmask.eval.sweep import sweep

    fake = dataclasses.replace(stories, kind="sbd", mask_token_id=511, name="fake-sbd")
    kw = dict(param="tokens_per_step", values=[1], limit=1, batch_size=1, max_new_tokens=8, block_size=4,
              judge=stories)
    res = sweep("stories", fake, "sbd", metric="agreement_pct", **kw)
    assert res.metric == "agreement_pct"
    assert res.points[0]["quality"] == res.results[0].summary["agreement_pct"]
    res = sweep("stories", fake, "sbd", **kw)
    assert res.metric == "judge_prob_pct"
    assert res.aup_score == pytest.approx(res.points[0]["quality"])  # one point (1, y) scores y
    with pytest.raises(UnmaskError, match="not a quality"):
        sweep("stories", fake, "sbd", param="gamma", values="0", metric="pass_at_1_pct", judge=stories)
    with pytest.raises(UnmaskError, match="what the sweep varies"):
        sweep("stories", fake, "sbd", param="gamma", values="0", gamma=0.1, judge=stories)
