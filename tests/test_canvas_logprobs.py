"""Commit-time logprobs on the canvas and block decoders (issue 50; structured.md §4): diffusion, Dream's
schedule, early-bird, block (SingleBD), lossy sbd and multiblock report, for every output token, the
log-softmax of the raw logits of the forward that committed it and their top-k, in position order; the
same in a batch as alone; no logprob work when no row asks; a grammar refused before any forward."""

from __future__ import annotations

import pytest
import torch
from test_block_decode import bd_bundle
from test_sbd_decode import sbd_bundle

import unmask
from unmask.decode import DECODERS
from unmask.decode.multiblock import buffer as bb
from unmask.errors import UnmaskError
from unmask.grammar import Grammar
from unmask.sampling import Sampling

SAMPLED = Sampling(temperature=0.8, seed=3)
BLOCK_PROMPTS = [[1, 3, 5, 7, 9], [1, 3], [1] + list(range(3, 14))]


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


@pytest.fixture(scope="module")
def bundles():
    dlm = unmask.load("stories260K-dlm")
    texts = [dlm.encode(t) for t in ("Once upon a time", "Tom", "Lily wanted to play with her big red ball")]
    bd = bd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    sbd = sbd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    return {"dlm": (dlm, texts), "bd": (bd, BLOCK_PROMPTS), "sbd": (sbd, BLOCK_PROMPTS)}


# (decoder, bundle, options); each decodes 12 tokens
CASES = {
    "diffusion": ("diffusion", "dlm", dict(block_size=8, policy="threshold", tau=0.7)),
    "diffusion-dual": ("diffusion", "dlm", dict(block_size=4, cache="dual", policy="entropy-bound", gamma=0.3)),
    "dream": ("diffusion", "dlm", dict(schedule="dream", steps=8)),
    "early-bird": ("early-bird", "dlm", dict(cache="none")),
    "block": ("block", "bd", dict(tau=0.6)),
    "sbd": ("sbd", "sbd", dict(block_size=4, gamma=0.5)),
    "multiblock": ("multiblock", "bd", dict(slots=2, tau_m2t=0.6, tau_add=0.3)),
}


def case(name, bundles):
    decoder, key, options = CASES[name]
    bundle, prompts = bundles[key]
    return DECODERS[decoder], bundle, prompts, options


def forward_view(name, bundle, prompt, state):
    """What one forward shows of row 0: (generated position of each scored column (Q,), was it masked
    before the commit (Q,) bool, the raw logits (Q, V)), or None for a forward that scores no block."""
    mask = bundle.mask_token_id
    if name.startswith("diffusion"):
        Q = state["logits"].shape[1]
        return torch.arange(Q) + state["start"], state["masked"][0], state["logits"][0]
    if name == "dream":
        Q = state["logits"].shape[1]
        return torch.arange(Q), state["masked"][0], state["logits"][0]
    if name == "early-bird":
        lo, hi = state["window"]
        return torch.arange(lo, hi), state["masked"][0, lo:hi], state["logits"][0]
    if name in ("block", "sbd"):
        if state["block"].shape[1] == 0:  # a store-only forward
            return None
        block, logits = state["block"][0], state["logits"][0, -state["block"].shape[1]:].clone()
        logits[:, list(bundle.suppress_ids)] = float("-inf")  # the decoder suppresses after the hook
        return torch.arange(len(block)) + state["start"], block == mask, logits
    w = state["window"]  # multiblock: the window after activation, before the commits
    pos = state["positions"][0] - len(prompt)
    masked = (state["inp"][0] == mask) & (w.state[0] == bb.ACTIVE).repeat_interleave(w.block_size)
    return pos, masked, state["logits"][0]


def committing_logprobs(name, bundle, prompt, states) -> dict[int, torch.Tensor]:
    """Generated position -> log_softmax (V,) of the last forward in which it was still masked (the
    forward that committed it)."""
    out = {}
    for state in states:
        view = forward_view(name, bundle, prompt, state)
        if view is None:
            continue
        pos, masked, logits = view
        for j in torch.nonzero(masked).flatten().tolist():
            out[int(pos[j])] = torch.log_softmax(logits[j].float(), dim=-1)
    return out


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(CASES))
def test_each_token_has_the_logprob_of_the_forward_that_committed_it(bundles, name, sampling):
    spec, bundle, prompts, options = case(name, bundles)
    states = []
    out = spec.decode(bundle, prompts[:1], max_new_tokens=12, sampling=sampling, logprobs=3,
                      on_forward=lambda s: states.append(s), **options)
    tokens, lps = out.tokens[0], out.logprobs[0]
    assert tokens and [e.token for e in lps] == tokens
    want = committing_logprobs(name, bundle, prompts[0], states)
    for i, (t, e) in enumerate(zip(tokens, lps)):
        lp = want[i]
        assert e.logprob == pytest.approx(float(lp[t]), abs=1e-6)
        vals, ids = lp.topk(3)
        assert [v for _, v in e.top] == pytest.approx(vals.tolist(), abs=1e-6)
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
        assert {i for i, _ in e.top} == set(ids.tolist()) or len(set(vals.tolist())) < 3  # ties aside
        if sampling.greedy:  # the committed token is the argmax: the first alternative, by value
            assert e.logprob == pytest.approx(e.top[0][1], abs=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_logprobs_leave_the_tokens_alone_and_a_batch_reports_each_row_as_alone(bundles, name):
    spec, bundle, prompts, options = case(name, bundles)
    plain = spec.decode(bundle, prompts, max_new_tokens=12, **options)
    assert plain.logprobs is None
    both = spec.decode(bundle, prompts, max_new_tokens=12, logprobs=2, **options)
    assert both.tokens == plain.tokens and both.stats.nfe == plain.stats.nfe
    for i, p in enumerate(prompts):
        alone = spec.decode(bundle, [p], max_new_tokens=12, logprobs=2, **options)
        assert alone.tokens[0] == both.tokens[i]
        assert [e.token for e in both.logprobs[i]] == both.tokens[i]
        for a, b in zip(alone.logprobs[0], both.logprobs[i]):  # the forwards agree up to float rounding
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_zero_alternatives_and_no_logprob_work_when_no_row_asks(bundles, name, monkeypatch):
    spec, bundle, prompts, options = case(name, bundles)
    none = spec.decode(bundle, prompts[:1], max_new_tokens=8, logprobs=0, **options)
    assert none.logprobs[0] and all(e.top == () for e in none.logprobs[0])

    def refuse(*a, **kw):
        raise AssertionError("logprob columns computed with no row asking")

    monkeypatch.setattr("unmask.decode.blocks.commit_shaping.columns", refuse)
    monkeypatch.setattr("unmask.decode.engine.shaping.bias_rows", lambda *a, **kw: None)
    out = spec.decode(bundle, prompts[:1], max_new_tokens=8, **options)
    assert out.tokens[0] == none.tokens[0] and out.logprobs is None


@pytest.mark.parametrize("name", list(CASES))
def test_a_grammar_is_refused_before_any_forward(bundles, name):
    spec, bundle, prompts, options = case(name, bundles)
    forwards = []
    with pytest.raises(UnmaskError, match=r"does not take a grammar.*\bar\b") as err:
        spec.decode(bundle, prompts[:1], max_new_tokens=8, grammar=Grammar.regex("[a-z]+"),
                    on_forward=forwards.append, **options)
    assert "\n" not in str(err.value) and forwards == []
    assert "runs on ar and lossless sbd" in str(err.value)  # named whatever this model's kind


def test_a_dropped_row_keeps_no_logprobs(bundles):
    spec, bundle, prompts, options = case("diffusion", bundles)
    from unmask.decode.engine.running import requests_for

    dec = spec.batch(bundle, spec.config.of(options), capacity=4)
    reqs = requests_for(prompts[:2], max_new_tokens=12, sampling=Sampling(), logprobs=2)
    dec.join(reqs)
    dec.step()
    dropped = dec.drop([reqs[0].id])
    assert dropped and dropped[0].logprobs is None and not dec.shaping._marks.get(dropped[0])
    done = []
    while len(dec):
        done += dec.step()
    assert [e.token for e in done[0].logprobs] == done[0].tokens
    assert dec.shaping._marks == {}


@pytest.mark.parametrize("name", ["diffusion-dual", "early-bird", "block", "sbd", "multiblock"])
def test_the_static_cache_reports_the_eager_logprobs_and_bias(bundles, name):
    spec, bundle, prompts, options = case(name, bundles)
    asks = dict(logprobs=2, logit_bias={7: 3.0, 9: -2.0})
    eager = spec.decode(bundle, prompts, max_new_tokens=12, **asks, **options)
    static = spec.decode(bundle, prompts, max_new_tokens=12, static=True, **asks, **options)
    assert static.tokens == eager.tokens
    for a, b in zip(sum(static.logprobs, []), sum(eager.logprobs, [])):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_a_t2t_edit_reports_the_logprob_of_the_forward_that_edited_the_token(bundles):
    """multiblock with T2T: a token's value comes from the last forward whose input at its position
    differed from it (the forward that committed it, or the last that edited it)."""
    spec, bundle, prompts, _ = case("multiblock", bundles)
    states = []
    out = spec.decode(bundle, prompts[:1], max_new_tokens=12, logprobs=2, slots=2, tau_m2t=0.6, tau_add=0.3,
                      tau_t2t=0.3, on_forward=states.append)
    tokens, P = out.tokens[0], len(prompts[0])
    assert out.stats.extra["edits"] > 0
    want = {}
    for s in states:
        active = (s["window"].state[0] == bb.ACTIVE).repeat_interleave(s["window"].block_size)
        for j, (p, t) in enumerate(zip((s["positions"][0] - P).tolist(), s["inp"][0].tolist())):
            if active[j] and 0 <= p < len(tokens) and t != tokens[p]:
                want[p] = torch.log_softmax(s["logits"][0, j].float(), dim=-1)
    assert [e.token for e in out.logprobs[0]] == tokens
    for p, e in enumerate(out.logprobs[0]):
        assert e.logprob == pytest.approx(float(want[p][tokens[p]]), abs=1e-6)
