"""Sibling candidates (spec/sbd_exact.md §5.3, issue 26 item 2): the layout text, the replay of
sibling layouts (no siblings = the chain replay = the decoder's forwards; hand-built recordings
where a 2nd / 3rd candidate is right gain exactly the forwards they should) and the tree search."""

from __future__ import annotations

import pytest
from test_r5_c_calibrate import replay_case

from unmask import calibrate as cal
from unmask.decode.verify import layout as dl
from unmask.decode.verify import siblings as sl
from unmask.errors import UnmaskError
from verify_helpers import lossless


def test_sibling_layout_text_ranks_and_queries():
    t = sl.parse("3/0,1,3/4+1g3+1+2c1")
    assert t.chain == dl.parse("3/0,1,3/4") and t.spec == "3/0,1,3/4+1g3+1+2c1"
    assert t.siblings == (sl.Sibling(1, 0, 3), sl.Sibling(1), sl.Sibling(2, 1, 0))
    assert t.ranks == (2, 3, 2) and t.queries == 16 + 4 + 1 + 2
    assert sl.parse("3/0/4") == sl.TreeLayout(dl.parse("3/0/4")) and sl.as_tree(dl.parse("3/0/4")).siblings == ()


@pytest.mark.parametrize("bad", ["3/0/4+", "3/0/4+x", "3/0/4+1g1", "3/0/4+0", "3/0/4+4", "3/0/4+2c2",
                                 "3/0/4+1+1+1", "3/0/4+1h2"])
def test_bad_sibling_text_is_one_error(bad):
    with pytest.raises(UnmaskError) as e:
        sl.parse(bad)
    assert "\n" not in str(e.value) and ";" in str(e.value)


@pytest.fixture(scope="module")
def case():
    return replay_case()


def test_recording_keeps_the_argmax_drafts_and_adds_ranked_candidates(case):
    _, _, recs = case
    for r in recs:
        assert set(r.cands) == set(r.drafts)
        for G, rows in r.cands.items():
            assert [[c[0] for c in row] for row in rows] == r.drafts[G]  # rank 1 is the draft
            assert all(len(set(c)) == sl.TOPK for row in rows for c in row)


@pytest.mark.parametrize("stops", [(), (2,)])
@pytest.mark.parametrize("spec", ["3/0,2,3/4", "3/1,3/4", "2/0/5", "7/7/8", "4/0,1,2,3,4/5"])
def test_no_siblings_is_the_chain_replay_and_the_decoders_forwards(case, spec, stops):
    bundle, prompts, recs = case
    out = lossless(bundle, prompts, max_new_tokens=24, draft=spec, stop_token_ids=stops)
    kw = dict(stop_ids=stops, max_new_tokens=24)
    tree = [cal.replay(r, sl.TreeLayout(dl.parse(spec)), **kw) for r in recs]
    assert tree == [cal.replay(r, dl.parse(spec), **kw) for r in recs]
    assert [f for _, f in tree] == out.stats.nfe_per_row


def hand_recording(text, D_lengths, wrong_at, right):
    """A recording whose group after ``text[:t]`` drafts text[t + o] at offset o, except offsets in
    ``wrong_at`` (draft 99); ``right[o]`` = the rank (2, 3) whose candidate there is the true token."""
    drafts, cands = {}, {}
    for G in D_lengths:
        drafts[G], cands[G] = [], []
        for t in range(len(text)):
            true = [text[t + o] if t + o < len(text) else 0 for o in range(G)]
            drafts[G].append([99 if o in wrong_at else true[o] for o in range(G)])
            row = []
            for o in range(G):
                c = [drafts[G][t][o], 98, 97]
                if o in wrong_at:
                    c[right[o] - 1] = true[o]
                row.append(c)
            cands[G].append(row)
    return cal.Recording(1, tuple(text), drafts, cands)


def test_a_right_second_candidate_gains_exactly_its_forwards():
    rec = hand_recording(list(range(10, 15)), (2,), wrong_at={1}, right={1: 2})
    # chain 1/0/2: every draft wrong, one token per forward: prefill + 4 steps
    assert cal.replay(rec, "1/0/2") == (5, 5)
    # +1: the sibling is right (2 tokens), no draft left after it (1 token), then right again
    assert cal.replay(rec, "1/0/2+1") == (5, 4)
    # +1g2: the sibling's own group drafts the next step, whose sibling is right again
    assert cal.replay(rec, "1/0/2+1g2") == (5, 3)
    assert cal.predicted_tpf([rec], sl.parse("1/0/2+1g2")) == 5 / 3


def test_a_right_third_candidate_with_its_continuation():
    rec = hand_recording(list(range(10, 17)), (3,), wrong_at={1}, right={1: 3})
    assert cal.replay(rec, "2/0/3") == (7, 7)
    assert cal.replay(rec, "2/0/3+1") == (7, 7)  # the rank-2 candidate is wrong
    # rank 3 and the chain's s_2 under it: 3 tokens, an empty draft (1), then 3 again
    assert cal.replay(rec, "2/0/3+1+1c1") == (7, 4)
    with pytest.raises(UnmaskError, match="candidates"):
        cal.replay(cal.Recording(1, rec.text, rec.drafts), "2/0/3+1")
    with pytest.raises(UnmaskError, match="groups of 5"):
        cal.replay(rec, "2/0/3+1g5")


def test_tree_search_without_siblings_is_the_chain_search(case):
    _, _, recs = case
    for budget in (6, 9, 14):
        chain, tpf = cal.search(recs, budget, max_d=3, max_g=4)
        tree, tpf0 = cal.search_trees(recs, budget, sets=[()], max_d=3, max_g=4)
        assert (tree.chain, tree.siblings, tpf0) == (chain, (), tpf)
        best, tpf1 = cal.search_trees(recs, budget, top=3, max_d=3, max_g=4)
        assert best.queries <= budget and tpf1 >= tpf and cal.predicted_tpf(recs, best) == tpf1
    with pytest.raises(UnmaskError, match="budget >= 4"):
        cal.search_trees(recs, 3)


def test_calibrate_with_siblings_stores_a_table_the_decoder_runs_as_predicted(case):
    bundle, prompts, _ = case
    kw = dict(budgets=(8, 16), max_new_tokens=16, max_d=3, max_g=4)
    rows, plain = cal.calibrate(bundle, prompts, siblings=True, **kw), cal.calibrate(bundle, prompts, **kw)
    assert all(r["tpf"] >= p["tpf"] and r["queries"] <= r["budget"] for r, p in zip(rows[:2], plain[:2]))
    spec = dl.resolve("budget", 16, cal.stored_defaults({}, rows))
    assert spec == rows[1]["layout"]
    stops = tuple(bundle.stop_token_ids)
    out = lossless(bundle, prompts, max_new_tokens=16, draft=spec, stop_token_ids=stops)
    assert out.stats.tpf == pytest.approx(rows[1]["tpf"])


def test_calibrate_drafts_cli_searches_siblings(tmp_path, capsys):
    import json

    from conftest import run_cli

    (tmp_path / "p.txt").write_text("Once upon a time\nThe dog ran\n")
    code, out, err = run_cli(capsys, "calibrate-drafts", "stories260K-sbd", "--prompts", tmp_path / "p.txt", "-n", "24",
                             "--budgets", "16", "--siblings", "--dry-run", "--json")
    assert code == 0, err
    row = json.loads(out)["rows"][0]
    assert sl.parse(row["layout"]).queries == row["queries"] <= 16 and json.loads(out)["stored"] is None
