"""Budgeted draft layouts of lossless SBD (spec/sbd_exact.md §5.1–5.2, issue 26 item 1): the
layout type and next-draft rule, the window masks against the spec's rules, greedy == AR for many
layouts / batches / draft sizes, the exact cache, group logits, the sampling distribution, compiled ==
eager, and the options of the API and the CLI."""

from __future__ import annotations

import pytest
import torch
from conftest import one_line_error, run_cli
from test_sbd_verify import _ar_distribution, _chi_square_p, uncached, verify_bundle

import unmask
from unmask.compat import forward, new_cache
from unmask.decode.verify import config as vconfig
from unmask.decode.verify import layout as dl
from unmask.decode.verify import siblings as sl
from unmask.decode.verify.batch import Verify
from unmask.decode.engine.running import requests_for
from unmask.errors import UnmaskError
from unmask.sampling import Sampling
from unmask.decode import DECODERS
from verify_helpers import chain_tables, lossless


# S without 0, S = {D}, per-group lengths, one group after the bonus, the 16-query preset
LAYOUTS = ["3/0,2,3/4", "3/1,3/4", "3/3/4", "3/0,2/3,5", "2/0/5", "4/0,1,2,3,4/5", "5/0,1,3/6"]


# --------------------------------------------------------------------------------- the layout type


def test_layout_text_queries_and_special_cases():
    lay = dl.parse("3/0,2,3/4")
    assert (lay.D, lay.prefixes, lay.lengths, lay.queries) == (3, (0, 2, 3), (4, 4, 4), 16)
    assert dl.parse("3/0,2/3,5").lengths == (3, 5) and dl.parse("3/0,2/3,5").spec == "3/0,2/3,5"
    assert dl.linear(8) == dl.parse("7/7/8") and dl.linear(8).queries == 16
    assert dl.quadratic(8) == dl.parse("7/0,1,2,3,4,5,6,7/8") and dl.quadratic(8).queries == 72
    for q, spec in dl.PRESETS.items():
        assert dl.parse(spec).queries <= q


@pytest.mark.parametrize("bad", ["3/0,2,3", "x/0/4", "3/4/4", "3/2,0/4", "3/0,0/4", "3/0/1", "0/0/4", "3/0,2/3,4,5"])
def test_bad_layout_text_is_one_error(bad):
    with pytest.raises(UnmaskError) as e:
        dl.parse(bad)
    assert "\n" not in str(e.value) and ";" in str(e.value)


def test_next_draft_rule_of_spec_5_2():
    lay = dl.parse("3/0,2,3/4")
    # full draft (d = 3): the latest group at a prefix <= a, its offsets a - i + 1 .. G - 1, cut to D
    assert lay.next_draft(3, 0) == (0, 1, 3)
    assert lay.next_draft(3, 1) == (0, 2, 2)  # group 0 again: offsets 2..3, from the shorter prefix
    assert lay.next_draft(3, 2) == (1, 1, 3)
    assert lay.next_draft(3, 3) == (2, 1, 3)
    no_zero = dl.parse("3/1,3/4")
    assert no_zero.next_draft(3, 0) == (-1, 0, 0)  # no group at a prefix <= 0: an empty draft
    # with an empty draft no group sits at prefix 0: the first group moves there and supplies the draft
    assert no_zero.groups_for(0) == [0, 3] and no_zero.next_draft(0, 0) == (0, 1, 3)
    assert dl.parse("3/0/4").next_draft(3, 3) == (0, 4, 0)  # offsets past the group: nothing left
    # linear: a usable draft only after a full accept; quadratic: every group stays where it is
    lin = dl.linear(4)
    assert [lin.next_draft(3, a)[2] for a in range(4)] == [0, 0, 0, 3] and lin.next_draft(0, 0) == (0, 1, 3)
    quad = dl.quadratic(4)
    assert all(quad.groups_for(d) == [0, 1, 2, 3] for d in range(4))


def brute_window(lay, Kmax: int, d: int):
    """The spec §5.1 rules query by query for a row of layout ``lay`` with a d-token draft, inside a
    window of Kmax verify queries followed by the layout's groups back to back: (mask, offsets)."""
    e = list(lay.prefixes)
    if d not in e and any(i > d for i in e):
        e[next(g for g, i in enumerate(e) if i > d)] = d
    qs = [("v", j, None) for j in range(lay.D + 1)] + [("pad", 0, None)] * (Kmax - lay.D - 1)
    qs += [("g", o, g) for g, G in enumerate(lay.lengths) for o in range(G)]
    mask = torch.zeros(len(qs), len(qs), dtype=torch.bool)
    offsets = []
    for r, (kind, j, g) in enumerate(qs):
        offsets.append(j if kind == "v" else e[g] + 1 + j if kind == "g" else 0)
        for c, (kind2, j2, g2) in enumerate(qs):
            if kind == "v":
                mask[r, c] = kind2 == "v" and j2 <= j
            elif kind == "g":
                mask[r, c] = (kind2 == "v" and j2 <= e[g]) or (kind2 == "g" and g2 == g)
            else:
                mask[r, c] = r == c
    return mask, torch.tensor(offsets)


@pytest.mark.parametrize("spec", LAYOUTS)
def test_window_layout_matches_the_spec_rules_and_the_next_draft_table(spec):
    lay = dl.parse(spec)
    Kmax = lay.D + 1
    mask, offsets, src, length = chain_tables(vconfig.family(spec, Kmax))
    assert mask.shape[-1] == lay.queries == vconfig.queries(Kmax, spec)  # the window costs the layout's Q
    for d in range(lay.D + 1):
        want_m, want_o = brute_window(lay, Kmax, d)
        assert torch.equal(mask[Kmax - 1, d], want_m) and torch.equal(offsets[Kmax - 1, d], want_o)
        for a in range(d + 1):
            g, first, n = lay.next_draft(d, a)
            assert int(length[Kmax - 1, d, a]) == n
            if n:  # the next draft's queries are its group's offsets first.., at positions after the new bonus
                q = src[Kmax - 1, d, a, :n]
                assert (offsets[Kmax - 1, d, q] == torch.arange(a + 2, a + 2 + n)).all()


# --------------------------------------------------------------------------------- greedy == AR


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("spec", LAYOUTS)
def test_greedy_budgeted_output_equals_ar_batch_1_and_ragged_batch_of_8(arch, spec):
    bundle = verify_bundle(arch, "sdpa", vocab=8, seed=len(spec))
    g = torch.Generator().manual_seed(len(spec))
    prompts = [torch.randint(3, 8, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (8,), generator=g)]
    want = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=24).tokens
    batch = lossless(bundle, prompts, max_new_tokens=24, draft=spec)
    assert batch.tokens == want
    assert max(batch.stats.extra["accepts"]) >= 2, batch.stats.extra["accepts"]  # drafts were accepted
    assert batch.stats.extra["draft"] == dl.parse(spec).spec
    for i in (0, 3, 7):
        single = lossless(bundle, [prompts[i]], max_new_tokens=24, draft=spec)
        assert single.tokens[0] == want[i]
        assert single.stats.nfe_per_row[0] == batch.stats.nfe_per_row[i]  # a row's steps do not depend on the batch


@pytest.mark.parametrize("K", [2, 4, 8])
@pytest.mark.parametrize("named", ["linear", "quadratic"])
def test_named_layouts_are_their_d_s_g_special_cases(named, K):
    # the D/S/G text of linear(K) / quadratic(K) runs the same steps as the named layout: same tokens,
    # same NFE per row, same accepts
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=K)
    prompts = [[1, 4, 5], [1, 6], [1, 3, 3, 7, 2, 5]]
    text = (dl.linear if named == "linear" else dl.quadratic)(K).spec
    a = lossless(bundle, prompts, max_new_tokens=20, block_size=K, draft=named)
    b = lossless(bundle, prompts, max_new_tokens=20, draft=text)
    assert a.tokens == b.tokens and a.stats.nfe_per_row == b.stats.nfe_per_row
    assert [r["accepts"] for r in a.stats.extra["row_extra"]] == [r["accepts"] for r in b.stats.extra["row_extra"]]


def test_mixed_draft_sizes_and_ar_rows_in_one_budgeted_batch_equal_ar():
    # rows of K = 1 (AR), 2, 3 and the layout's own K = 4 in one running batch; a resize mid-run too
    bundle = verify_bundle("qwen3", "sdpa", vocab=8, seed=3)
    prompts = [[1, 4, 5], [1, 6], [1, 3, 3, 7], [1, 2, 6, 6, 4], [1, 7]]
    want = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=20).tokens
    batch = Verify(bundle, vconfig.VerifyConfig.of(draft="3/0,2,3/4"), capacity=8)
    reqs = requests_for(prompts, max_new_tokens=20, sampling=Sampling(), stop_strings=(), device=bundle.device)
    for req, K in zip(reqs, (1, 2, 3, 4, 9)):  # 9: cut to the layout's D + 1 = 4
        batch.join([req], block_size=K)
    assert sorted(r.K for r in batch.rows.values()) == [1, 2, 3, 4, 4]
    done, steps = {}, 0
    while batch.rows:
        if steps == 3:
            batch.resize(2, ids=[reqs[3].id])
        for row in batch.step():
            done[row.job.id] = row.tokens
        steps += 1
    assert [done[r.id] for r in reqs] == want


def test_smaller_layouts_pick_the_fewest_draft_tokens_that_cover_k():
    # K runs the smaller layout with the fewest draft tokens >= K - 1, cut to K; the draft itself from its D + 1
    fam = vconfig.family("5/0,2,5/6", 6, ("2/0/5", "3/3/4"))
    assert [None if x is None else x.spec for x in fam] == [None, "1/0/5", "2/0/5", "3/3/4", "4/0,2,4/6", "5/0,2,5/6"]
    assert vconfig.family("4/0,4/5", 5) == vconfig.family("4/0,4/5", 5, ())  # none: the draft cut to K
    assert vconfig.queries(4, "4/0,4/5", ("3/3/4",)) == 8 < vconfig.queries(4, "4/0,4/5")
    assert vconfig.queries(5, "4/0,4/5", ("3/3/4",)) == vconfig.queries(5, "4/0,4/5") == 15
    with_sib = vconfig.family("4/0,4/5+1", 5, ("3/3/4",))
    assert with_sib[3].spec == "3/3/4" and with_sib[4].siblings  # mixed with a sibling layout: trees
    for draft, bad in [("4/0,4/5", "4/0,4/5"), ("4/0,4/5", "5/0/4"), ("linear", "3/3/4")]:
        with pytest.raises(UnmaskError, match="need a budgeted draft .* and fewer than its"):
            vconfig.VerifyConfig.of(draft=draft, smaller=(bad,))
    for bad in ("3/3/4", None, 3):  # found by the fault pass: a bare text was read letter by letter
        with pytest.raises(UnmaskError, match="a tuple of D/S/G texts"):
            vconfig.VerifyConfig.of(draft="4/0,4/5", smaller=bad)
    assert vconfig.VerifyConfig.of(draft="4/0,4/5", smaller=("3/3/4", "3/3/4")).smaller == ("3/3/4",)


@pytest.mark.parametrize("arch, static", [("llama", False), ("qwen3", False), ("llama", True)])
def test_a_row_resized_to_a_smaller_layout_runs_that_layout_exactly(arch, static):
    # a batch of layout 4/0,4/5 with the smaller 3/3/4: rows at K = 4 take the same steps (accepts,
    # NFE) as decode with 3/3/4 itself, rows at K = 5 as decode with 4/0,4/5; the tokens are AR's
    bundle = verify_bundle(arch, "sdpa", vocab=8, seed=5)
    prompts = [[1, 4, 5], [1, 6], [1, 3, 3, 7], [1, 2, 6, 6, 4]]
    want = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=24).tokens
    alone = {d: lossless(bundle, prompts, max_new_tokens=24, draft=d) for d in ("3/3/4", "4/0,4/5")}
    batch = Verify(bundle, vconfig.VerifyConfig.of(draft="4/0,4/5", smaller=("3/3/4",)), capacity=8, static=static)
    reqs = requests_for(prompts, max_new_tokens=24, sampling=Sampling(), stop_strings=(), device=bundle.device)
    for req, K in zip(reqs, (4, 5, 4, 5)):
        batch.join([req], block_size=K)
    done, widths = {}, []
    while batch.rows:
        widths.append(vconfig.queries(max(r.K for r in batch.rows.values()), "4/0,4/5", ("3/3/4",)))
        for row in batch.step():
            done[row.job.id] = row
    assert [done[r.id].tokens for r in reqs] == want
    for i, d in enumerate(("3/3/4", "4/0,4/5", "3/3/4", "4/0,4/5")):
        assert done[reqs[i].id].accepts == alone[d].stats.extra["row_extra"][i]["accepts"]
    assert set(widths) <= {8, 15} and 8 in widths  # only K = 4 rows left: the 8-query window of 3/3/4


@pytest.mark.parametrize("draft", ["3/1,3/4", "3/0,2/4+1c1g3+1"])  # a chain layout; one with siblings (spec §5.3)
def test_cache_holds_only_committed_causal_kv_after_every_budgeted_step(draft):
    bundle = verify_bundle("llama", "eager", vocab=8, seed=1)
    prompts = [[1, 4, 5, 6], [1, 7]]
    seen = []
    out = lossless(bundle, prompts, max_new_tokens=16, draft=draft,
                            on_forward=lambda s: seen.append({k: s[k] for k in ("rows", "committed")} | {
                                "kv": s["key_valid"].clone(), "keys": [x.keys.clone() for x in s["cache"].layers]})
                            if "rows" in s else None)
    assert len(seen) > 3
    for info in seen:
        for i, r in enumerate(info["rows"]):
            cols = torch.nonzero(info["kv"][i]).flatten()  # (n,) the row's valid cache columns
            assert len(cols) == len(prompts[r]) + int(info["committed"][i]) - 1
            seq = (prompts[r] + out.tokens[r])[: len(cols)]
            cache = new_cache(bundle.model)
            forward(bundle.model, torch.tensor([seq]), position_ids=torch.arange(len(seq))[None], cache=cache)
            for keys, fresh in zip(info["keys"], cache.layers):
                torch.testing.assert_close(keys[i][:, cols], fresh.keys[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_budgeted_group_logits_equal_separate_all_mask_forwards(arch):
    bundle = verify_bundle(arch, "eager", vocab=64)
    spec, M = "3/0,2/3,5", bundle.mask_token_id
    lay = dl.parse(spec)
    prompt = [1, 5, 9, 12, 7]
    seen = []
    out = lossless(bundle, [prompt], max_new_tokens=20, draft=spec, on_forward=seen.append)
    final = prompt + out.tokens[0]
    checked = 0
    for info in seen[1:]:
        inp, pos = info["inp"][0].tolist(), info["positions"][0]
        p_b = int(pos[0])
        V = lay.D + 1
        start = V
        for G in lay.lengths:
            L = int(pos[start]) - p_b  # verify tokens the group sees
            want = uncached(bundle, final[:p_b] + inp[:L] + [M] * G, G)[-G:]
            torch.testing.assert_close(info["logits"][0, start: start + G, :-1], want[:, :-1], atol=1e-5, rtol=1e-5)
            start += G
            checked += 1
    assert checked >= 6


# --------------------------------------------------------------------------------- sampling


def test_sampled_budgeted_output_has_the_ar_distribution():
    bundle = verify_bundle("llama", "eager", vocab=6, seed=5)
    sampling = Sampling(temperature=1.0, top_k=5, seed=11)
    prompt = [1, 4, 3]
    probs = _ar_distribution(bundle, prompt, 3, sampling)
    out = lossless(bundle, [prompt] * 20_000, max_new_tokens=3, draft="2/0,2/3,2", sampling=sampling)
    counts: dict = {}
    for row in out.tokens:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    accepts = out.stats.extra["accepts"]
    assert accepts.get(2, 0) + accepts.get(3, 0) > 1000  # drafts accepted, from both groups
    assert _chi_square_p(counts, probs, 20_000) > 1e-3


# --------------------------------------------------------------------------------- compiled == eager


def test_budgeted_static_and_compiled_equal_eager():
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    prompts = [[1, 4, 5], [1, 6, 2, 2]]
    kw = dict(max_new_tokens=16, draft="3/0,2,3/4")
    eager = lossless(bundle, prompts, **kw)
    assert eager.tokens == DECODERS["ar"].decode(bundle, prompts, max_new_tokens=16).tokens
    for mode in ({"static": True}, {"compile": True}):
        other = lossless(bundle, prompts, **kw, **mode)
        assert other.tokens == eager.tokens and other.stats.nfe_per_row == eager.stats.nfe_per_row


# --------------------------------------------------------------------------------- options


def test_budget_resolves_to_the_stored_layout_for_the_budget():
    assert dl.resolve("budget") == dl.PRESETS[16]
    assert dl.resolve("budget", 24) == dl.PRESETS[24] and dl.resolve("budget:31") == dl.PRESETS[24]
    assert dl.resolve("budget", 6) == "1/0/4"  # below every stored budget: one group after the bonus
    stored = {"draft_layouts": "8=2/0/6 16=3/0,1/6", "queries": 8}
    assert dl.resolve("budget", None, stored) == "2/0/6" and dl.resolve("budget", 20, stored) == "3/0,1/6"
    assert dl.resolve("linear") == "linear" and dl.resolve(dl.parse("3/3/4").spec) == "3/3/4"
    cfg = vconfig.VerifyConfig.of(draft=dl.parse("3/0,2,3/4"))
    assert (cfg.draft, cfg.block_size, cfg.row_size(8), cfg.row_size(2)) == ("3/0,2,3/4", 4, 4, 2)
    for bad, match in (((("budget", 3)), "budget"), (("linear", 16), "--queries applies"),
                       (("budget:x", None), "budget:Q")):
        with pytest.raises(UnmaskError, match=match):
            dl.resolve(*bad)
    with pytest.raises(UnmaskError, match="draft_layouts"):
        dl.resolve("budget", None, {"draft_layouts": "16:3/0/4"})


def test_api_budget_with_queries_and_a_layout_object_equal_ar():
    bundle = unmask.load("stories260K-sbd")
    texts = ["Once upon a time", "Tom and his dog"]
    want = unmask.generate(texts, bundle, "ar", max_new_tokens=32).tokens
    got = unmask.generate(texts, bundle, "sbd", max_new_tokens=32, verify=True, draft="budget", queries=16)
    assert got.tokens == want and got.stats.extra["draft"] == _stored(bundle)[16]  # the model's calibrated layout
    obj = unmask.generate(texts, bundle, "sbd", max_new_tokens=32, verify=True, draft=dl.parse("2/0/5"))
    assert obj.tokens == want and obj.stats.extra["draft"] == "2/0/5"
    assert got.stats.nfe < 2 * 32 * 0.75  # the shipped model's drafts are accepted


def _stored(bundle) -> dict[int, str]:
    return dl.stored_layouts(bundle.meta.get("decode_defaults"))


def test_cli_budget_runs_and_bad_budgets_are_one_line(capsys):
    code, out, err = run_cli(capsys, "generate", "Once upon a time", "--model", "stories260K-sbd", "--verify",
                             "--draft", "budget", "--queries", "16", "-n", "16", "--json", "--no-progress")
    assert code == 0, err
    assert _stored(unmask.load("stories260K-sbd"))[16] in out
    one_line_error(capsys, "generate", "Once", "--model", "stories260K-sbd", "--verify", "--draft", "budget",
                   "--queries", "2", match="query budget")
    one_line_error(capsys, "generate", "Once", "--model", "stories260K-sbd", "--verify", "--draft", "3/0,5/4",
                   match="draft layout")
    one_line_error(capsys, "generate", "Once", "--model", "stories260K-sbd", "--verify", "--draft", "linear",
                   "--queries", "16", match="--queries")


def test_server_budgeted_requests_run_in_their_layouts_batch_and_equal_ar():
    pytest.importorskip("fastapi")
    from test_serve import post

    from unmask.serve import create_app
    from unmask.serve.server import ServerThread

    bundle = unmask.load("stories260K-sbd")
    prompts = ["Once upon a time", "Tom and his dog"]
    refs = [unmask.generate(p, bundle, "ar", max_new_tokens=24).texts[0] for p in prompts]
    app = create_app(bundle, max_batch_size=4)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        bodies = [{"prompt": prompts[0], "max_tokens": 24, "decoder": "sbd", "verify": True, "draft": "budget",
                   "queries": 16},
                  {"prompt": prompts[1], "max_tokens": 24, "decoder": "sbd", "verify": True, "draft": "3/1,3/4"}]
        texts = [post(s.url + "/v1/completions", b)[2]["choices"][0]["text"] for b in bodies]
        assert texts == refs
        assert {_stored(bundle)[16], "3/1,3/4"} <= set(sched.verify)  # one running batch per layout
        status, _, err = post(s.url + "/v1/completions", {**bodies[0], "queries": 2})
        assert status == 400 and "query budget" in err["error"]["message"]


def test_an_explicit_block_size_under_a_budgeted_default_runs_that_k_linear():
    budget = {"draft": "budget", "queries": 16}
    assert dl.option(None, None, budget) == "budget" and dl.option(None, 4, budget) == "linear"
    assert dl.option("quadratic", 4, budget) == "quadratic" and dl.option(None, 4, {"draft": "quadratic"}) == "quadratic"
    assert dl.option(None, None, {}) == "linear"


@pytest.mark.parametrize("name,adapter", [("stories260K-sbd", None), ("stories260K", "sbd")])
def test_shipped_models_budget_uses_their_calibrated_layouts(name, adapter):
    bundle = unmask.load(name, adapter=adapter)
    d = bundle.meta["decode_defaults"]
    assert d["queries"] == 16 and d["verify"] is True
    stored = dl.stored_layouts(d)
    # a stored layout may carry siblings (calibrate-drafts --siblings, the adapter's table): their queries count too
    assert set(stored) == set(dl.BUDGETS) and all(sl.parse(s).queries <= q for q, s in stored.items())
    texts = ["Once upon a time", "Tom and his dog", "The sun was hot and Lily"]
    want = unmask.generate(texts, unmask.load(name), "ar", max_new_tokens=48).tokens  # for the adapter: the base's AR
    out = unmask.generate(texts, bundle, "sbd", max_new_tokens=48, draft="budget")
    assert out.stats.extra["draft"] == stored[16] and out.tokens == want
    assert out.stats.tpf > 1.5  # the shipped drafts are accepted
    q32 = unmask.generate(texts, bundle, "sbd", max_new_tokens=48, draft="budget", queries=32)
    assert q32.stats.extra["draft"] == stored[32] and q32.tokens == want
