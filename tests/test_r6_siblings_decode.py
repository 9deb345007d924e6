"""Greedy siblings in the lossless decoder (spec/sbd_exact.md §5.3, issue 26 item 2): the tree
window against the spec's rules, greedy output == AR (tiny Llama / Qwen3, batch 1 and a ragged
batch, the shipped stories260K-sbd), the replay's forwards == the decoder's, the exact cache, and
sampled rows under SpecInfer's multi-candidate rule: AR's distribution, a wrong rule that fails."""

from __future__ import annotations

import pytest
import torch
from test_r5_c_calibrate import replay_case
from test_sbd_verify import _chi_square_p, sampling_case, verify_bundle  # noqa: F401 (a fixture)

import unmask
from unmask import calibrate as cal
from unmask.decode.verify import config as vconfig
from unmask.decode.verify import siblings as sl
from unmask.decode.verify import tree as tv
from unmask.sampling import Sampling
from unmask.decode import DECODERS
from verify_helpers import lossless

TREES = ["3/0,1,3/4+1", "3/0,2,3/4+1g3", "3/0/4+1c2+1", "2/0/5+1g4+2", "4/0,1,2,3,4/5+1c1g3+2", "3/1,3/4+1g2+1c1"]


def brute_tree(t: sl.TreeLayout, d: int):
    """The spec §5.1/§5.3 rules query by query for a row of layout t (Kmax = D + 1) with a d-token
    draft: (mask, offsets, pool index of each query's id)."""
    lay, Kmax, H = t.chain, t.D + 1, len(t.siblings)
    e = lay.groups_for(d)
    qs = [("v", j, None) for j in range(Kmax)]
    qs += [("g", o, g) for g, G in enumerate(lay.lengths) for o in range(G)]
    for h, s in enumerate(t.siblings):
        qs += [("s", 0, h)] + [("c", k, h) for k in range(1, s.cont + 1)] + [("sg", o, h) for o in range(s.group)]
    n = len(qs)
    mask, off, tok = torch.eye(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long), torch.full((n,), Kmax + H)
    for r, (kind, j, g) in enumerate(qs):
        s = t.siblings[g] if kind in ("s", "c", "sg") else None
        if s is not None and (s.offset > d or (kind == "c" and j > min(s.cont, d - s.offset))):
            continue  # no such node in this step: it sees itself at offset 0
        for c, (kind2, j2, g2) in enumerate(qs):
            if kind == "v":
                mask[r, c] = kind2 == "v" and j2 <= j
            elif kind == "g":
                mask[r, c] = (kind2 == "v" and j2 <= e[g]) or (kind2 == "g" and g2 == g)
            else:
                ok = (kind2 == "v" and j2 < s.offset) or (kind2 == "s" and g2 == g)
                if kind == "c":
                    ok |= kind2 == "c" and g2 == g and j2 <= j
                if kind == "sg":
                    ok |= kind2 == "sg" and g2 == g
                mask[r, c] = ok
        if kind == "v":
            off[r] = j
        elif kind == "g":
            off[r] = e[g] + 1 + j
        else:  # the sibling at its draft offset, then its continuation, its group after it
            off[r] = s.offset + {"s": 0, "c": j, "sg": 1 + j}[kind]
        if kind == "v" and j <= d:
            tok[r] = j
        elif kind == "s":
            tok[r] = Kmax + g
        elif kind == "c":
            tok[r] = s.offset + j
    return mask, off, tok


@pytest.mark.parametrize("spec", TREES)
def test_tree_window_matches_the_spec_rules_and_the_replay_rule(spec):
    t = sl.parse(spec)
    Kmax = t.D + 1
    tw = tv.tree_window(vconfig.family(spec, Kmax))
    assert tw.mask.shape[-1] == t.queries == vconfig.queries(Kmax, spec)
    assert tw.sib_offset[Kmax - 1].tolist() == [s.offset for s in t.siblings]
    assert tw.sib_rank[Kmax - 1].tolist() == list(t.ranks)
    for d in range(Kmax):
        want_m, want_o, want_t = brute_tree(t, d)
        assert torch.equal(tw.mask[Kmax - 1, d], want_m) and torch.equal(tw.offsets[Kmax - 1, d], want_o)
        assert torch.equal(tw.tok[Kmax - 1, d], want_t)
        for p in range(1 + len(t.siblings)):
            nodes = tw.path[Kmax - 1, d, p]
            L = int(tw.path_len[Kmax - 1, d, p])
            assert (tw.offsets[Kmax - 1, d, nodes[: L + 1]] == torch.arange(L + 1)).all()  # a causal chain
            lo = 0 if p == 0 else t.siblings[p - 1].offset
            for a in range(lo, L + 1):
                n = int(tw.length[Kmax - 1, d, p, a])
                q = tw.src[Kmax - 1, d, p, a, :n]
                assert (tw.offsets[Kmax - 1, d, q] == torch.arange(a + 2, a + 2 + n)).all()  # after the new bonus
                # the ids a next-draft query sees are the accepted path's (never a rejected token)
                ids = tw.tok[Kmax - 1, d] != Kmax + len(t.siblings)  # (Q,) queries that carry an id
                for row in tw.mask[Kmax - 1, d, q]:
                    assert set(torch.nonzero(row & ids).flatten().tolist()) <= set(nodes[: a + 1].tolist())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("spec", TREES)
def test_greedy_sibling_output_equals_ar_batch_1_and_ragged_batch_of_8(arch, spec):
    bundle = verify_bundle(arch, "sdpa", vocab=8, seed=len(spec))
    g = torch.Generator().manual_seed(len(spec))
    prompts = [torch.randint(3, 8, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (8,), generator=g)]
    want = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=24).tokens
    batch = lossless(bundle, prompts, max_new_tokens=24, draft=spec)
    assert batch.tokens == want and batch.stats.extra["draft"] == sl.parse(spec).spec
    for i in (0, 3, 7):
        single = lossless(bundle, [prompts[i]], max_new_tokens=24, draft=spec)
        assert single.tokens[0] == want[i]
        assert single.stats.nfe_per_row[0] == batch.stats.nfe_per_row[i]


@pytest.fixture(scope="module")
def case():
    return replay_case()


@pytest.mark.parametrize("stops", [(), (2,)])
@pytest.mark.parametrize("spec", TREES)
def test_replay_predicts_the_sibling_decoders_forwards_exactly(case, spec, stops):
    bundle, prompts, recs = case
    out = lossless(bundle, prompts, max_new_tokens=24, draft=spec, stop_token_ids=stops)
    runs = [cal.replay(r, spec, stop_ids=stops, max_new_tokens=24) for r in recs]
    assert [f for _, f in runs] == out.stats.nfe_per_row
    assert out.tokens == DECODERS["ar"].decode(bundle, prompts, max_new_tokens=24, stop_token_ids=stops).tokens


def test_siblings_change_the_steps_of_these_rows(case):
    # the equalities above are not vacuous: sibling paths win on these rows, for most layouts
    _, _, recs = case
    changed = [spec for spec in TREES if [cal.replay(r, spec)[1] for r in recs]
               != [cal.replay(r, sl.parse(spec).chain)[1] for r in recs]]
    assert len(changed) >= len(TREES) - 1, changed


SAMPLED_TREE = "2/0/5+1c1+1+2"  # two siblings at offset 1 (one with a continuation), one at offset 2


def _tree_counts(bundle, prompt, sampling, n=20_000):
    """First-3-token counts of n seeded samples of SAMPLED_TREE, and how many took a sibling path."""
    seen = []
    real = tv.sampled_tree_accept

    def spy(*args):
        out = real(*args)
        seen.append(int((out[1] > 0).sum()))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tv, "sampled_tree_accept", spy)
        out = lossless(bundle, [prompt] * n, max_new_tokens=3, draft=SAMPLED_TREE, sampling=sampling)
    counts: dict = {}
    for row in out.tokens:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts, sum(seen)


def test_sampled_siblings_keep_the_ar_distribution(sampling_case):
    # spec §5.3 tested as §4: SpecInfer's rule over i.i.d. siblings, chi-square against exact AR sampling
    bundle, prompt, sampling, probs = sampling_case
    counts, through_siblings = _tree_counts(bundle, prompt, sampling)
    assert sum(counts.values()) == 20_000
    assert through_siblings > 1000  # the siblings are used, not just carried
    assert _chi_square_p(counts, probs, 20_000) > 1e-3


def _no_residual(r, q):  # wrong: a rejected candidate leaves r unchanged
    return r


def _ranked_siblings(q, tw, K, generator):  # wrong: the proposal's 2nd / 3rd candidates, not draws from q
    at = tw.sib_offset[K - 1] - 1
    ranked = q[:, at].topk(sl.TOPK, dim=-1).indices  # (n, H, TOPK)
    return ranked.gather(2, tw.sib_rank[K - 1][None, :, None].expand(len(q), -1, 1) - 1)[..., 0]


@pytest.mark.parametrize("name, wrong", [("residual", _no_residual), ("draw_siblings", _ranked_siblings)])
def test_a_wrong_multi_candidate_rule_fails_the_distribution_test(sampling_case, monkeypatch, name, wrong):
    bundle, prompt, sampling, probs = sampling_case
    monkeypatch.setattr(tv, name, wrong)
    counts, _ = _tree_counts(bundle, prompt, sampling)
    assert _chi_square_p(counts, probs, 20_000) < 1e-3


def test_sampled_sibling_rows_do_not_depend_on_the_batch_and_the_cache():
    bundle = verify_bundle("qwen3", "sdpa", vocab=8, seed=2)
    prompts, smp = [[1, 4, 5], [1, 6, 2, 3], [1, 4, 5]], Sampling(temperature=0.9, seed=5)
    kw = dict(max_new_tokens=20, draft="3/0,1,3/4+1g3+1", sampling=smp)
    batch = lossless(bundle, prompts, **kw)
    assert batch.tokens[0] != batch.tokens[2]  # two copies of a prompt are two samples
    assert lossless(bundle, prompts[1:2], **kw).tokens[0] == batch.tokens[1]
    static = lossless(bundle, prompts, static=True, **kw)
    assert static.tokens == batch.tokens and static.stats.nfe_per_row == batch.stats.nfe_per_row


def test_shipped_model_siblings_equal_ar_and_the_replay_predicts_the_measured_tpf():
    from unmask.eval.story_openings import STORY_OPENINGS

    bundle = unmask.load("stories260K-sbd")
    prompts = [bundle.encode(t) for t in STORY_OPENINGS[100:104]]
    kw = dict(max_new_tokens=48, stop_token_ids=tuple(bundle.stop_token_ids))
    recs = cal.record(bundle, prompts, max_new_tokens=48)
    for spec in ("3/0,1,3/4+1g3", "5/0,1/4+1c1+1"):
        out = lossless(bundle, prompts, draft=spec, **kw)
        assert out.tokens == DECODERS["ar"].decode(bundle, prompts, **kw).tokens
        assert cal.predicted_tpf(recs, spec, stop_ids=kw["stop_token_ids"], max_new_tokens=48) == pytest.approx(
            out.stats.tpf)


def test_static_cache_runs_the_same_sibling_steps():
    bundle = verify_bundle("qwen3", "sdpa", vocab=8, seed=6)
    prompts = [[1, 4, 5], [1, 6], [1, 3, 3, 7, 2, 5]]
    kw = dict(max_new_tokens=20, draft="3/0,2/4+1c1g3+1")
    a, b = lossless(bundle, prompts, **kw), lossless(bundle, prompts, static=True, **kw)
    assert a.tokens == b.tokens == DECODERS["ar"].decode(bundle, prompts, max_new_tokens=20).tokens
    assert a.stats.nfe_per_row == b.stats.nfe_per_row
