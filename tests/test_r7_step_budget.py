"""A per-step choice among draft layouts, replayed (issue 26 item 4): with one layout always
chosen :func:`unmask.calibrate.replay_policy` is :func:`unmask.calibrate.replay`; a switch takes
the next draft from the rule of the layout that ran, cut to the next one's D."""

from __future__ import annotations

import json

import pytest
from test_r5_c_calibrate import SPECS, replay_case

from unmask import calibrate as cal
from unmask.decode.verify import layout as dl
from unmask.errors import UnmaskError
from unmask.models.registry import shipped


def stored_specs():
    meta = json.loads((shipped()["stories260K-sbd"] / "unmask_config.json").read_text())
    return sorted({*dl.PRESETS.values(), *dl.stored_layouts(meta["decode_defaults"]).values(), *SPECS})


@pytest.fixture(scope="module")
def case():
    return replay_case()


def test_record_keeps_the_block_modes_confidence_in_each_draft_token(case):
    bundle, prompts, recs = case
    for rec in recs:
        assert set(rec.probs) == set(rec.drafts)
        for G, rows in rec.probs.items():
            assert len(rows) == len(rec.text) and all(len(r) == G for r in rows)
            assert all(1 / 8 - 1e-4 <= p <= 1 for r in rows for p in r)  # top-1 of a vocab of 8


@pytest.mark.parametrize("stops", [(), (2,)])
def test_one_layout_always_chosen_is_the_replay(case, stops):
    _, _, recs = case
    specs = stored_specs()
    lays = [dl.parse(s) for s in specs]
    for i, lay in enumerate(lays):
        for rec in recs:
            want = cal.replay(rec, lay, stop_ids=stops, max_new_tokens=24)
            got = cal.replay_policy(rec, lays, lambda conf, d, i=i: i, stop_ids=stops, max_new_tokens=24, first=i)
            assert got == (*want, want[1] * lay.queries), specs[i]
            assert cal.replay_policy(rec, [lay.spec], lambda conf, d: 0, stop_ids=stops, max_new_tokens=24) == got


def perfect_recording(n=10, lengths=(2, 4)):
    """Every group drafts the greedy text exactly; offset o's probability is 1 / (o + 1)."""
    text = list(range(10, 10 + n))
    drafts = {G: [[text[t + o] if t + o < n else 0 for o in range(G)] for t in range(n)] for G in lengths}
    probs = {G: [[round(1 / (o + 1), 4) for o in range(G)] for _ in range(n)] for G in lengths}
    return cal.Recording(1, tuple(text), drafts, None, probs)


def test_a_switch_uses_the_rule_of_the_layout_that_ran_cut_to_the_next_ones_draft():
    rec = perfect_recording()
    small, big = "1/0/2", "3/3/4"  # 4 and 8 query tokens
    assert cal.replay(rec, small) == (10, 7) and cal.replay(rec, big) == (10, 4)
    # the prefill with 1/0/2 drafts one token; 3/3/4 runs on it (its group moves to prefix 1 and
    # drafts 3), then on full drafts: 1 + 2 + 4 + 3 tokens in 4 forwards
    seen = []
    got = cal.replay_policy(rec, [small, big], lambda conf, d: seen.append((conf, d)) or 1)
    assert got == (10, 4, 4 + 3 * 8)
    assert seen[0] == ((0.5,), 1) and seen[1] == ((0.5, 0.3333, 0.25), 3)
    # 3/3/4's draft of 3 cut to 1/0/2's one token; accepting it leaves 1/0/2 no draft (its group
    # after b has no offset past 2), so 3/3/4 runs on an empty draft (its group moves to prefix 0)
    alt = cal.replay_policy(rec, [small, big], lambda conf, d: 0 if d == 3 else 1, first=1)
    assert alt == (10, 7, 8 + 3 * 4 + 3 * 8)


def test_replay_policy_refuses_a_recording_without_what_it_needs(case):
    _, _, recs = case
    with pytest.raises(UnmaskError, match="probabilities"):
        cal.replay_policy(cal.Recording(1, recs[0].text, recs[0].drafts), ["3/3/4"], lambda c, d: 0)
    with pytest.raises(UnmaskError, match="groups of 9"):
        cal.replay_policy(recs[0], ["3/3/4", "8/0/9"], lambda c, d: 0)
