"""The draft-layout replay and search (spec/sbd_exact.md §5.4, issue 26 item 2): the replay's
predicted forwards equal the decoder's measured ones, the search finds the brute-force best."""

from __future__ import annotations

import pytest
import torch
from test_sbd_verify import verify_bundle

from unmask import calibrate as cal
from unmask.decode.verify import layout as dl
from verify_helpers import lossless

SPECS = ["3/0,2,3/4", "3/1,3/4", "3/3/4", "2/0/5", "4/0,1,2,3,4/5", "7/7/8", "3/0,1,2,3/4"]


def replay_case():
    """A tiny random Llama (vocab 8), 6 ragged prompts and their replay recordings (24 tokens)."""
    bundle = verify_bundle("llama", "eager", vocab=8, seed=4)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 8, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (6,), generator=g)]
    return bundle, prompts, cal.record(bundle, prompts, max_new_tokens=24, lengths=range(2, 9))


@pytest.fixture(scope="module")
def case():
    return replay_case()


@pytest.mark.parametrize("stops", [(), (2,)])
@pytest.mark.parametrize("spec", SPECS)
def test_replay_predicts_the_decoders_forwards_exactly(case, spec, stops):
    bundle, prompts, recs = case
    out = lossless(bundle, prompts, max_new_tokens=24, draft=spec, stop_token_ids=stops)
    runs = [cal.replay(r, dl.parse(spec), stop_ids=stops, max_new_tokens=24) for r in recs]
    assert [f for _, f in runs] == out.stats.nfe_per_row
    assert [t for t, _ in runs] == [out.stats.row(i)["generated"] + out.stats.row(i)["stop_token"]
                                    for i in range(len(prompts))]
    assert cal.predicted_tpf(recs, dl.parse(spec), stop_ids=stops, max_new_tokens=24) == pytest.approx(out.stats.tpf)
    if stops:
        assert any(s for s in out.stats.stops_per_row)  # the stop token cut some row


def test_search_returns_the_brute_force_best_within_the_budget(case):
    _, _, recs = case
    for budget in (6, 9, 14):
        best, tpf = cal.search(recs, budget, max_d=3, max_g=4)
        brute = []
        for D in range(1, 4):
            for bits in range(1, 2 ** (D + 1)):
                S = tuple(i for i in range(D + 1) if bits >> i & 1)
                for G in range(2, 5):
                    if D + 1 + len(S) * G <= budget:
                        brute.append(cal.predicted_tpf(recs, dl.DraftLayout(D, S, (G,) * len(S))))
        assert best.queries <= budget and tpf == max(brute)
        assert cal.predicted_tpf(recs, best) == tpf
    with pytest.raises(Exception, match="budget >= 4"):
        cal.search(recs, 3)


def test_calibrate_drafts_stores_the_table_and_lossless_uses_it_by_default(tmp_path, capsys):
    import json
    import shutil

    import unmask
    from conftest import one_line_error, run_cli

    from unmask.models.registry import shipped

    model = tmp_path / "sbd"
    shutil.copytree(shipped()["stories260K-sbd"], model)
    before = json.loads((model / "unmask_config.json").read_text())
    (tmp_path / "p.txt").write_text("Once upon a time\nThe dog ran\n")
    code, out, err = run_cli(capsys, "calibrate-drafts", model, "--prompts", tmp_path / "p.txt", "-n", "16",
                             "--budgets", "8,16", "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [r["budget"] for r in rows[:2]] == [8, 16] and all(r["queries"] <= r["budget"] for r in rows[:2])
    meta = json.loads((model / "unmask_config.json").read_text())
    d = meta["decode_defaults"]
    assert d["draft"] == "budget" and d["queries"] == 16 and d["gamma"] == before["decode_defaults"]["gamma"]
    kept = dl.stored_layouts(before["decode_defaults"])  # the budgets not recalibrated keep their layouts
    assert d["draft_layouts"] == dl.format_layouts({**kept, 8: rows[0]["layout"], 16: rows[1]["layout"]})
    written = ("decode_defaults", "lossless_measured")  # the table, and the default layout's TPF (issue 52)
    assert {k: v for k, v in meta.items() if k not in written} == {k: v for k, v in before.items()
                                                                    if k not in written}
    assert meta["lossless_measured"]["tpf"] == round(rows[1]["tpf"], 3)
    assert meta["lossless_measured"]["queries"] == rows[1]["queries"] and meta["lossless_measured"]["prompts"] == 2
    bundle = unmask.load(str(model))
    texts = ["Once upon a time", "The dog ran"]
    got = unmask.generate(texts, bundle, "sbd", max_new_tokens=16)
    assert got.stats.extra["draft"] == rows[1]["layout"]  # the stored 16-query layout, by default
    assert got.tokens == unmask.generate(texts, bundle, "ar", max_new_tokens=16).tokens
    # the replay's prediction is the decoder's measured TPF on the calibration prompts
    assert rows[1]["tpf"] == pytest.approx(got.stats.tpf)
    assert unmask.generate(texts, bundle, "sbd", max_new_tokens=16, queries=8).stats.extra["draft"] == rows[0]["layout"]
    one_line_error(capsys, "calibrate-drafts", model, "--budgets", "8,x", match="--budgets")
    one_line_error(capsys, "calibrate-drafts", model, "--budgets", "2", match=">= 4")
    one_line_error(capsys, "calibrate-drafts", "stories260K", match="unmask_config.json")
    one_line_error(capsys, "calibrate-drafts", model, "--prompts", tmp_path / "missing.txt", match="missing.txt")
    assert json.loads((model / "unmask_config.json").read_text()) == meta  # refused runs store nothing


def test_calibrate_drafts_stores_an_adapters_table_in_its_json(tmp_path, capsys):
    import json
    import shutil

    from conftest import run_cli

    from unmask.models.registry import shipped

    adapter = tmp_path / "sbd"
    shutil.copytree(shipped()["stories260K"] / "adapters" / "sbd", adapter)
    (tmp_path / "p.txt").write_text("Once upon a time\n")
    code, out, err = run_cli(capsys, "calibrate-drafts", "stories260K", "--adapter", adapter, "--prompts",
                             tmp_path / "p.txt", "-n", "12", "--budgets", "8")
    assert code == 0, err
    assert "predicted TPF" in out
    cfg = json.loads((adapter / "adapter.json").read_text())
    d = cfg["decode_defaults"]
    assert d["draft"] == "budget" and d["draft_layouts"].startswith("8=")
    # the default 16-query layout was not recalibrated: its recorded TPF stays (issue 52)
    assert cfg["lossless_measured"]["tpf"] == 2.5 and cfg["lossless_measured"]["queries"] == 16
