"""benchmarks/gpu_decode.py: the CPU smoke path (``--tiny``, compile included) and the refusal without a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_benchmark

COLUMNS = {"decoder", "mode", "Q", "nfe", "tpf", "ms_per_step", "tps", "tps_ratio", "roofline_ms", "roofline_ratio",
           "same_as_ar", "seconds", "error", "baseline"}


@pytest.fixture(scope="module")
def gd():
    return load_benchmark("gpu_decode")


def test_tiny_runs_every_decoder_eager_and_compiled(gd, capsys, tmp_path):
    out = tmp_path / "decode.json"
    assert gd.main(["--tiny", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "vs ar compiled" in text and "roofline ms" in text
    res = json.loads(out.read_text())
    rows = {(r["decoder"], r["mode"]): r for r in res["rows"]}
    assert list(rows) == [("ar", "compiled"), ("ar", "eager"), ("sbd", "compiled"), ("sbd", "eager"),
                          ("multiblock", "compiled"), ("multiblock", "eager")]
    assert not res["skipped"] and res["setup"]["shape"] == "tiny" and "env" in res
    n = res["setup"]["batch"] * res["setup"]["max_new_tokens"]
    K, mb = res["setup"]["block_size"], res["setup"]["mb_slots"] * res["setup"]["mb_block_size"]
    for (name, mode), r in rows.items():
        assert set(r) == COLUMNS and r["error"] is None and r["baseline"] == "ar compiled"
        assert r["Q"] == {"ar": 1, "sbd": 2 * K, "multiblock": mb}[name]
        assert r["nfe"] >= 1 and r["ms_per_step"] > 0 and r["roofline_ms"] > 0 and r["roofline_ratio"] > 0
        assert r["tps"] == pytest.approx(n / r["seconds"]) and r["tpf"] > 0
        assert r["ms_per_step"] == pytest.approx(1e3 * r["seconds"] / r["nfe"])
        assert r["tps_ratio"] == pytest.approx(r["tps"] / rows["ar", "compiled"]["tps"])
        assert f"{name:<10} {mode:<8}" in text
    # equality is the test of the speed-up: compiled AR reproduces eager AR token for token
    assert rows["ar", "compiled"]["same_as_ar"] is True and rows["ar", "eager"]["same_as_ar"] is True
    assert rows["ar", "compiled"]["nfe"] == rows["ar", "eager"]["nfe"] == res["setup"]["max_new_tokens"]
    assert rows["sbd", "compiled"]["nfe"] == rows["sbd", "eager"]["nfe"]
    assert rows["multiblock", "compiled"]["nfe"] == rows["multiblock", "eager"]["nfe"]
    assert rows["ar", "compiled"]["tps_ratio"] == 1.0 and rows["ar", "compiled"]["roofline_ratio"] == 1.0


def test_budget_skips_the_remaining_runs(gd, capsys):
    assert gd.main(["--tiny", "--budget-s", "0"]) == 0
    text = capsys.readouterr().out
    assert "skipped" in text and "multiblock eager" in text


def test_without_a_gpu_it_refuses_in_one_line(gd, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gd.main([]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--tiny" in err[0] and not captured.out
