"""benchmarks/gpu_forward_cost.py: the CPU smoke path (``--tiny``) and the refusal without a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_benchmark


@pytest.fixture(scope="module")
def gfc():
    return load_benchmark("gpu_forward_cost")


def test_tiny_runs_on_cpu(gfc, capsys, tmp_path):
    out = tmp_path / "cells.json"
    assert gfc.main(["--tiny", "--reps", "1", "--warmup", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured" in text and "roofline" in text
    res = json.loads(out.read_text())
    grid = gfc.TINY_GRID
    assert len(res["cells"]) == len(grid["blocks"]) * len(grid["kv"]) * len(grid["batches"])
    for c in res["cells"]:
        assert c["ms"] > 0 and c["roofline_slowdown"] >= 1.0 - 1e-9 and c["mode"] == "eager"
        if c["k"] == 1:
            assert c["measured_slowdown"] == 1.0 and c["roofline_slowdown"] == pytest.approx(1.0)


def test_static_cache_pointer_holds_kv_len(gfc):
    """The timed forward really runs over kv_len + k keys and leaves the pointer at kv_len."""
    from transformers import StaticCache

    model = gfc.build_model(gfc.TINY, device=torch.device("cpu"), dtype=torch.float32)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    cache = StaticCache(config=model.config, max_cache_len=40 + 4)
    ids = torch.randint(3, 256, (2, 4))
    model(input_ids=ids, position_ids=torch.arange(40, 44).expand(2, 4), cache=cache, use_cache=True)
    assert cache.layers[0].keys.shape == (2, 2, 44, 16)  # (B, nkv, kv_len + k, hd)


def test_without_a_gpu_it_refuses_in_one_line(gfc, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gfc.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--tiny" in err[0]
