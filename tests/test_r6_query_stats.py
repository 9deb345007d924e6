"""Lossless SBD's query cost and accept histogram where a user looks (issue 26 item 5): DecodeStats,
``unmask generate --json`` and ``unmask bench`` (its budgeted rows)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

import unmask
from unmask.bench import side_by_side
from unmask.decode.verify import layout as dl

MODEL = "stories260K-sbd"
PROMPTS = ["Once upon a time", "Zoo"]


@pytest.fixture(scope="module")
def bundle():
    return unmask.load(MODEL)


def _stored(bundle, q: int) -> dl.DraftLayout:
    return dl.parse(dl.resolve("budget", q, bundle.meta.get("decode_defaults")))


@pytest.mark.parametrize("flags, want", [
    (["--draft", "3/0,1,3/4"], 3 + 1 + 3 * 4),
    (["--draft", "2/0/5"], 2 + 1 + 5),
    (["--draft", "linear", "-k", "8"], 2 * 8),
    (["--draft", "quadratic", "-k", "4"], 4 + 4 * 4),
])
def test_generate_json_reports_the_layouts_query_tokens_and_a_histogram_summing_to_the_forwards(capsys, flags, want):
    code, out, err = run_cli(capsys, "generate", *PROMPTS, "-m", MODEL, "--decoder", "sbd", "--verify", *flags,
                             "-n", "24", "--json", "--no-progress")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["queries_per_forward"] == want
        hist = {int(k): v for k, v in row["accept_histogram"].items()}
        assert sum(hist.values()) == row["nfe"]  # one entry per forward of this row, its prefill included
        assert hist == {c: row["accepts"].count(c) for c in set(row["accepts"])}  # the row's own commits
        assert sum(c * n for c, n in hist.items()) >= len(row["tokens"])  # committed >= kept (stop tokens cut)


def test_generate_json_budget_reports_the_stored_layouts_queries(capsys, bundle):
    code, out, err = run_cli(capsys, "generate", PROMPTS[0], "-m", MODEL, "--decoder", "sbd", "--verify",
                             "--draft", "budget", "--queries", "24", "-n", "24", "--json", "--no-progress")
    assert code == 0, err
    row = json.loads(out)
    assert row["draft"] == _stored(bundle, 24).spec
    assert row["queries_per_forward"] == _stored(bundle, 24).queries <= 24


def test_decode_stats_properties_and_to_dict(bundle):
    out = unmask.generate(PROMPTS, bundle, "sbd", max_new_tokens=32, verify=True, draft="3/0,1,3/4")
    s = out.stats
    assert s.queries_per_forward == 16
    assert sum(s.accept_histogram.values()) == sum(s.nfe_per_row)
    assert sum(s.extra["query_windows"].values()) == s.nfe - 1  # verify forwards: every call but the prefill
    d = s.to_dict()
    assert d["queries_per_forward"] == 16 and d["accept_histogram"] == s.accept_histogram
    assert [s.row(i)["accept_histogram"] for i in range(2)] != [None, None]
    ar = unmask.generate(PROMPTS, bundle, "ar", max_new_tokens=8)  # AR reports neither
    assert ar.stats.queries_per_forward is None and ar.stats.accept_histogram is None
    assert not {"queries_per_forward", "accept_histogram"} & (set(ar.rows()[0]) | set(ar.stats.to_dict()))
    lossy = unmask.generate(PROMPTS, bundle, "sbd", max_new_tokens=8, verify=False)  # its commits, no query cost
    assert lossy.stats.queries_per_forward is None and lossy.stats.accept_histogram == {
        int(k): v for k, v in lossy.stats.extra["accepts"].items()}
    assert "queries_per_forward" not in lossy.rows()[0] and "accept_histogram" in lossy.rows()[0]


def test_a_ragged_batch_pools_its_forwards_and_mean_window_is_the_mean():
    from unmask.decode.engine.stats import DecodeStats, mean_window

    assert mean_window({16: 3, "72": 1}) == (16 * 3 + 72) / 4 and mean_window({}) is None
    s = DecodeStats(nfe=3, nfe_per_row=[3], tokens_per_row=[5], seconds=1.0,
                    extra={"accepts": {1: 2, 3: 1}, "query_windows": {16: 2}, "row_extra": [{"accepts": [1, 3, 1]}]})
    assert s.row(0)["accept_histogram"] == {1: 2, 3: 1} and s.row(0)["queries_per_forward"] == 16


def test_bench_runs_the_budgeted_rows_with_their_queries_and_accepts(bundle):
    res = side_by_side.bench(limit=2, max_new_tokens=16, models=[MODEL], decoders=["sbd"])
    rows = {r["decoder"]: r for r in res.rows}
    budget = [side_by_side.BUDGET_LABEL.format(q) for q in dl.BUDGETS]
    assert list(rows) == ["sbd --verify", *budget, "sbd --no-verify"], list(rows)
    for q, label in zip(dl.BUDGETS, budget):
        r = rows[label]
        assert not r.get("error"), r
        assert r["queries_per_forward"] == _stored(bundle, q).queries
        assert r["options"]["queries"] == q and r["agreement_positional"] == 1.0  # lossless: the model's AR text
        assert sum(r["accepts"].values()) == round(r["nfe"] * r["n"])  # summary nfe is the mean per row
    default = _stored(bundle, bundle.meta["decode_defaults"]["queries"]).queries
    assert rows["sbd --verify"]["queries_per_forward"] == default
    assert rows["sbd --no-verify"]["queries_per_forward"] is None  # lossy: no verify forwards
    header = [c.header for c in res.table().columns]
    assert "queries/fwd" in header and any(h.startswith("accepts") for h in header)
    # JSON output: the same rows, histogram keys as text
    assert json.loads(json.dumps(res.to_dict()))["rows"][1]["queries_per_forward"] == rows[budget[0]]["queries_per_forward"]


def test_a_model_without_stored_layouts_gets_no_budget_rows():
    assert side_by_side.has_stored_layouts(MODEL) and not side_by_side.has_stored_layouts("stories260K")
    assert [label for label, _ in side_by_side.variants("sbd", "stories260K")] == ["sbd --verify", "sbd --no-verify"]
    assert side_by_side.has_stored_layouts("stories260K", "sbd")  # the shipped adapter's calibration
    assert side_by_side.variants("ar", MODEL) == [("ar", {})]


def test_generate_text_line_shows_the_query_tokens_for_lossless_only(capsys):
    code, out, err = run_cli(capsys, "generate", PROMPTS[0], "-m", MODEL, "--decoder", "sbd", "--verify",
                             "--draft", "3/0,1,3/4", "-n", "8", "--no-progress")
    assert code == 0 and "· 16 queries/forward ·" in out, err
    code, out, err = run_cli(capsys, "generate", PROMPTS[0], "-m", MODEL, "--decoder", "ar", "-n", "8", "--no-progress")
    assert code == 0 and "queries/forward" not in out, err
