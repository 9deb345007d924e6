"""``unmask bench``: pair discovery from the registries, one run, ratios to AR, broken pairs."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import run_cli

import unmask
from unmask.bench import side_by_side
from unmask.decode import DECODERS
from unmask.errors import UnmaskError


def test_bench_cli_lists_ar(capsys):
    code, out, err = run_cli(capsys, "bench", "--limit", "2", "--max-new-tokens", "16", "--no-progress")
    assert code == 0, err
    assert "ar" in out and "stories260K" in out and "TPS/AR" in out and "distinct-4" in out
    code, out, err = run_cli(capsys, "bench", "--limit", "2", "--max-new-tokens", "16", "--json",
                             "--decoder", "ar")
    assert code == 0, err
    res = json.loads(out)
    ar = next(r for r in res["rows"] if (r["decoder"], r["model"]) == ("ar", "stories260K"))
    assert ar["tps_vs_ar"] == 1.0 and ar["nfe_vs_ar"] == 1.0 and ar["agreement_positional"] == 1.0
    assert ar["n"] == 2 and ar["nfe"] == 16 and ar["tpf"] == 1.0 and ar["nll"] > 0 and 0 < ar["distinct_4"] <= 1
    assert res["settings"]["reference"] == "ar@stories260K" and "git_sha" in ar["env"]


@pytest.fixture
def fake_registry(monkeypatch, tmp_path):
    """Two extra shipped models and one extra decoder, to see discovery pick them up."""
    import unmask.models.registry as registry

    real = registry.shipped()
    dirs = {}
    for name, kind in (("toy-sbd", "sbd"), ("toy-dlm", "masked-diffusion")):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "unmask_config.json").write_text(json.dumps({"kind": kind}))
        dirs[name] = d
    monkeypatch.setattr(registry, "shipped", lambda: {**real, **dirs})
    toy = dataclasses.replace(DECODERS["ar"], name="toy-diffusion", kinds=("masked-diffusion",), summary="test only")
    monkeypatch.setitem(DECODERS, "toy-diffusion", toy)


def test_pairs_are_discovered_from_the_registries(fake_registry):
    got = side_by_side.pairs()
    assert ("ar", "stories260K") in got and ("sbd", "toy-sbd") in got and ("toy-diffusion", "toy-dlm") in got
    assert ("ar", "toy-sbd") not in got  # ar's native kind is causal
    assert ("ar", "toy-sbd") in side_by_side.pairs(include_all=True)
    sbd_pairs = side_by_side.pairs(decoders=["sbd"])
    assert ("sbd", "toy-sbd") in sbd_pairs and all(d == "sbd" for d, _ in sbd_pairs)
    with pytest.raises(UnmaskError, match="unknown decoder"):
        side_by_side.pairs(decoders=["nope"])


def test_a_failing_pair_is_reported_and_the_others_run(fake_registry):
    res = side_by_side.bench(limit=1, max_new_tokens=4, models=["stories260K", "toy-sbd"])
    rows = {(r["decoder"], r["model"]): r for r in res.rows}
    assert rows[("sbd --verify", "toy-sbd")]["error"]  # an empty config.json does not load
    assert rows[("sbd --no-verify", "toy-sbd")]["error"]
    assert rows[("ar", "stories260K")]["tps_vs_ar"] == 1.0
    table = res.table()
    assert table.row_count == 3


def test_sbd_runs_lossless_and_lossy_side_by_side():
    res = side_by_side.bench(limit=2, max_new_tokens=24, models=["stories260K-sbd"], include_all=True)
    rows = {r["decoder"]: r for r in res.rows}
    budget = {side_by_side.BUDGET_LABEL.format(q) for q in (8, 16, 24, 32)}  # its calibrated layouts
    assert set(rows) == {"ar", "sbd --verify", "sbd --no-verify", *budget}
    assert rows["sbd --verify"]["agreement_positional"] == 1.0  # lossless: the model's own AR text
    assert rows["sbd --verify"]["nfe"] < rows["ar"]["nfe"]


def test_fast_path_profile_times_every_model_call_of_any_decoder():
    """benchmarks/fast_path.py's per-decoder profile: forward hooks see every model call (AR: the
    prefill plus one call per further token), and inside + outside add up to the total."""
    from conftest import load_benchmark

    rows = load_benchmark("fast_path").profile_every(["ar", "diffusion"], ["Once upon a time"], 6)
    by = {r["decoder"]: r for r in rows}
    assert set(by) == {"ar", "diffusion"}
    ar = by["ar"]
    assert ar["tpf"] == pytest.approx(6 / 6)  # 6 tokens: a prefill and 5 one-token calls (the last unneeded)
    assert ar["queries_per_forward"] == pytest.approx((len(unmask.load("stories260K").encode("Once upon a time")) + 5) / 6)
    for r in rows:
        assert 0 < r["forward_ms"] <= r["ms_per_forward"]
        assert r["forward_ms"] + r["outside_ms"] == pytest.approx(r["ms_per_forward"])
    assert by["diffusion"]["queries_per_forward"] > ar["queries_per_forward"]  # a whole canvas per call


def test_a_compiled_row_is_compared_with_compiled_ar():
    """Found by the new-user pass: `bench --compile` divided compiled rows by the eager AR row, so
    `sbd --verify --compile` showed 6.9x where compiled AR runs 1.55x slower than it."""
    rows = [{"decoder": "ar", "model": "stories260K", "tps": 500.0, "nfe": 64},
            {"decoder": "ar --compile", "model": "stories260K", "tps": 1500.0, "nfe": 64},
            {"decoder": "sbd --verify", "model": "stories260K-sbd", "tps": 1000.0, "nfe": 20},
            {"decoder": "sbd --verify --compile", "model": "stories260K-sbd", "tps": 2400.0, "nfe": 20}]
    ref, ref_c = side_by_side.compare_with_ar(rows)
    assert (ref["decoder"], ref_c["decoder"]) == ("ar", "ar --compile")
    assert [r["tps_vs_ar"] for r in rows] == [1.0, 1.0, 2.0, 1.6]
    assert [r["nfe_vs_ar"] for r in rows] == [1.0, 1.0, 3.2, 3.2]
    eager_only = [dict(r) for r in rows if "--compile" not in r["decoder"] or r["decoder"].startswith("sbd")]
    side_by_side.compare_with_ar(eager_only)  # no compiled AR ran: eager AR is the baseline of every row
    assert [r["tps_vs_ar"] for r in eager_only] == [1.0, 2.0, 4.8]
