"""Constrained lossless SBD is exactly constrained AR (spec/structured.md §1-3, §6), with the grammar
engine swapped for a token-level rule so the reference distribution can be enumerated on a tiny
model: greedy token-identical on every layout (siblings included), sampled distributed as
constrained AR (Pearson's chi-square over every 3-token output), forced ids accepted for free."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from test_sbd_verify import _chi_square_p, verify_bundle

from unmask.compat import forward
from unmask.decode import DECODERS
from unmask.decode.engine.running import requests_for, drain
from unmask.decode.verify import sampled as sbd_sampled
from unmask.errors import UnmaskError
from unmask.sampling import Sampling
from verify_helpers import lossless

V = 6  # the tiny model's vocabulary (its mask token is id 6)


def rule(seq) -> set[int]:
    """The ids allowed after ``seq`` (the generated ids so far): 4 forces 0; odd positions take 1, 3, 4, 5;
    even ones anything but 2."""
    if seq and seq[-1] == 4:
        return {0}
    return {1, 3, 4, 5} if len(seq) % 2 else set(range(V)) - {2}


def word(ids) -> int:
    return int(np.array(sum(1 << i for i in ids), dtype=np.uint32).view(np.int32))


class RuleMatcher:
    """unmask.grammar.Matcher's interface over :func:`rule` (its state: the ids consumed)."""

    words, error, done = 1, None, False

    def __init__(self):
        self.seq, self.forced_ids = [], 0

    def consume(self, ids):
        for t in ids:
            if t not in rule(self.seq):
                self.error = f"refused {t}"
                return False
            self.forced_ids += len(rule(self.seq)) == 1
            self.seq.append(t)
        return True

    def forced(self, limit):
        out, seq = [], list(self.seq)
        while len(out) < limit and len(a := rule(seq)) == 1:
            out.append(next(iter(a)))
            seq.append(out[-1])
        return out

    def mask(self, out):
        out[...] = word(rule(self.seq))

    def path_masks(self, draft, out):
        seq = list(self.seq)
        out[0] = word(rule(seq))
        for j, t in enumerate(draft):
            if t not in rule(seq):
                break
            seq.append(t)
            out[j + 1] = word(rule(seq))

    def draft(self, candidates, n):
        out, seq = [], list(self.seq)
        while len(out) < n:
            if len(a := rule(seq)) == 1:
                out.append(next(iter(a)))
            elif len(out) < len(candidates) and (ok := [c for c in candidates[len(out)] if c in a]):
                out.append(ok[0])
            else:
                break
            seq.append(out[-1])
        return out


class RuleGrammar:
    def matcher(self):
        return RuleMatcher()


def constrained_ar_distribution(bundle, prompt, n, sampling):
    """{ids: probability} of every n-id output of constrained AR sampling (rule-masked, then filtered)."""
    seqs = [s for s in itertools.product(range(V), repeat=n) if all(s[j] in rule(s[:j]) for j in range(n))]
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logits = forward(bundle.model, ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids))[:, len(prompt) - 1:-1]
    logits[..., bundle.mask_token_id] = float("-inf")
    for i, s in enumerate(seqs):
        for j in range(n):
            logits[i, j, [t for t in range(V) if t not in rule(s[:j])]] = float("-inf")
    probs = sbd_sampled._probs(logits, sampling)
    picked = probs.gather(2, ids[:, len(prompt):, None])[..., 0].prod(dim=1)
    return {s: float(p) for s, p in zip(seqs, picked)}


def run(bundle, prompts, max_new, sampling, decoder="ar", **opts):
    reqs = requests_for(prompts, max_new_tokens=max_new, sampling=sampling, grammar=RuleGrammar())
    spec = DECODERS[decoder]
    cfg = spec.config.of(opts)
    return drain(lambda cap: spec.batch(bundle, cfg, capacity=cap, prompts=prompts, max_new_tokens=max_new), reqs)


@pytest.fixture(scope="module")
def tiny():
    return verify_bundle("llama", "eager", vocab=V, seed=5)


@pytest.mark.parametrize("layout", ["linear", "quadratic", "3/0,2,3/4", "4/0/3+1+2"])
def test_greedy_constrained_lossless_is_constrained_ar_on_every_layout(tiny, layout):
    prompts = [[1, 4, 3], [1, 2], [1, 5, 5, 0, 3]]
    ar = run(tiny, prompts, 24, Sampling())
    opts = {"verify": True, "draft": layout} | ({"block_size": 4} if "/" not in layout else {})
    out = run(tiny, prompts, 24, Sampling(), "sbd", **opts)
    assert out.tokens == ar.tokens
    for row in ar.tokens:
        assert all(row[j] in rule(row[:j]) for j in range(len(row)))
    assert out.stats.nfe < ar.stats.nfe


def test_forced_ids_ride_in_the_draft(tiny):
    prompts = [[1, 4, 3]] * 4
    out = run(tiny, prompts, 24, Sampling(), "sbd", verify=True, block_size=4, draft="linear")
    accepts = [c for r in out.stats.extra["row_extra"] for c in r["accepts"][1:]]
    assert max(accepts) >= 2  # drafts were accepted
    for row, extra in zip(out.tokens, out.stats.extra["row_extra"]):
        assert all(row[j + 1] == 0 for j in range(len(row) - 1) if row[j] == 4)
        assert extra["forced"] == sum(row[j] == 4 for j in range(len(row) - 1)) > 0


def test_sampled_constrained_lossless_has_the_constrained_ar_distribution(tiny):
    sampling = Sampling(temperature=1.0, top_k=5, seed=11)
    prompt, total = [1, 4, 3], 12_000
    probs = constrained_ar_distribution(tiny, prompt, 3, sampling)
    out = run(tiny, [prompt] * total, 3, sampling, "sbd", verify=True, block_size=3, draft="linear")
    counts: dict = {}
    for row in out.tokens:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert set(counts) <= set(probs)  # every output obeys the rule
    assert out.stats.extra["accepts"].get(2, 0) + out.stats.extra["accepts"].get(3, 0) > 500  # drafts accepted
    assert _chi_square_p(counts, probs, total) > 1e-3
    ar = run(tiny, [prompt] * total, 3, sampling)
    ar_counts: dict = {}
    for row in ar.tokens:
        ar_counts[tuple(row)] = ar_counts.get(tuple(row), 0) + 1
    assert _chi_square_p(ar_counts, probs, total) > 1e-3  # the reference is constrained AR's


def test_masking_only_the_first_query_commits_refused_ids(tiny, monkeypatch):
    """The tests above have power: a verify that masks only query 0 (not each draft position) accepts
    draft ids the rule refuses, which the matcher then reports."""
    from unmask.decode.verify import shaped

    real = shaped.Shaping.apply

    def first_query_only(self, logits):
        if self.bits is not None:
            self.bits[:, 1:] = -1
        real(self, logits)

    monkeypatch.setattr(shaped.Shaping, "apply", first_query_only)
    sampling = Sampling(temperature=1.0, top_k=5, seed=11)
    with pytest.raises(UnmaskError, match="the grammar refused a committed token"):
        run(tiny, [[1, 4, 3]] * 2000, 3, sampling, "sbd", verify=True, block_size=3, draft="linear")
