"""benchmarks/plot_tpf_budget.py: which rows it places where, on a small file of sbd_lossless.py's
and sbd_distill.py's schemas (unknown rows skipped), and that it writes the plot and the table."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

plot_tpf = load_benchmark("plot_tpf_budget")


def _row(**kw):
    return {"model": "m", "batch": 1, "decoder": "lossless", "tpf": 2.0, **kw}


ROWS = [
    {"model": "m", "batch": 1, "decoder": "ar", "k": 1, "draft": "-", "queries": 1, "tpf": 1.0},
    _row(k=4, draft="linear", tpf=1.8),  # an old file: no queries field
    _row(k=4, draft="quadratic", queries=20, tpf=2.1),
    _row(k=4, draft="budget 16: 3/0,1,3/4", tpf=2.4),  # queries from the layout text
    _row(k=4, draft="budget 16: 3/0,1,3/4 + siblings", queries=16, tpf=2.6),
    _row(k=4, draft="budget 8: 2/0/5", siblings=2, queries=8, tpf=2.2),
    _row(k=8, draft="linear", batch=8, tpf=9.9),  # a larger batch of the same model: not used
    {"model": "m", "batch": 1, "decoder": "eb", "k": 4, "draft": "γ=0.35", "tpf": 3.0},
    _row(k=4, draft="mystery", tpf=5.0),
]
DISTILL = {"results": [{"pair": "m=runs/m-distilled", "before": {"lossless": {"tpf": 2.2}},
                        "after": {"lossless": {"tpf": 2.4}}}]}


def test_rows_are_placed_by_family_and_query_tokens():
    pts = plot_tpf.lossless_points({"rows": ROWS})
    got = [(p["family"], p["queries"], p["tpf"]) for p in pts]
    assert got == [("linear", 8, 1.8), ("quadratic", 20, 2.1), ("budgeted", 16, 2.4),
                   ("budgeted + siblings", 8, 2.2), ("budgeted + siblings", 16, 2.6)]
    d = plot_tpf.distill_points(DISTILL, "sbd_distill")
    assert [(p["model"], p["stage"], p["queries"], p["tpf"]) for p in d] == [("m", "before", 16, 2.2),
                                                                             ("m", "after", 16, 2.4)]
    assert plot_tpf.distill_points({"base": {}, "runs": []}, "sbd_distill_lambda") == []  # no TPF there


def test_main_writes_the_plot_and_the_table(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "sbd_lossless.json").write_text(json.dumps({"rows": ROWS}))
    (tmp_path / "sbd_distill.json").write_text(json.dumps(DISTILL))
    assert plot_tpf.main(["--lossless", str(tmp_path / "sbd_lossless.json"), "--out-dir", str(tmp_path / "out")]) == 0
    png = tmp_path / "out" / "tpf_vs_budget.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "out" / "tpf_vs_budget.md").read_text()
    assert "| m | budgeted | budget 16: 3/0,1,3/4 | 16 | 2.400 |" in md and "| before | sbd_distill |" in md
    assert "mystery" not in md and "9.900" not in md


def test_a_file_without_lossless_rows_is_one_error(tmp_path, capsys):
    (tmp_path / "x.json").write_text(json.dumps({"rows": ROWS[:1]}))
    assert plot_tpf.main(["--lossless", str(tmp_path / "x.json"), "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no lossless rows" in err
