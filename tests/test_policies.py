"""Commit policies (SBD §5, diffusion.md §3, §4, §6, §7): hand-computed cases and invariants."""

import dataclasses
import math

import pytest
import torch

from unmask.errors import UnmaskError
from unmask.policies import (
    GAMMA_PRESETS,
    POLICY_NAMES,
    EntropyBound,
    EntropyThreshold,
    Factor,
    Threshold,
    TopK,
    commit,
    gumbel_argmax,
    make_policy,
    suppress,
    token_stats,
)

# One row per distribution over V = 4; logits = log p, so q at T = 0 is exactly these (up to rounding).
HALF = [0.5, 0.5, 0.0, 0.0]      # H = ln 2 = 0.6931, κ = 0.5, Δ = 0
SKEW = [0.7, 0.1, 0.1, 0.1]      # H = 0.9404, κ = 0.7, Δ = 0.6
SIXTY = [0.6, 0.4, 0.0, 0.0]     # H = 0.6730, κ = 0.6, Δ = 0.2
SURE = [1.0, 0.0, 0.0, 0.0]      # H = 0 exactly, κ = 1, Δ = 1
FLAT = [0.25, 0.25, 0.25, 0.25]  # H = ln 4 = 1.3863, κ = 0.25, Δ = 0

ALL_POLICIES = [
    EntropyBound(0.35, "entropy"), EntropyBound(0.2, "confidence"), EntropyBound(0.5, "margin"),
    Threshold(0.3), Factor(1.0), Factor(1.0, compat=True), TopK(2), EntropyThreshold(0.9),
]


def logits_of(*rows):
    """(1, N, V) logits whose softmax is the given probability rows."""
    return torch.tensor(rows, dtype=torch.float64).log().float()[None]


def mask_of(*bits):
    return torch.tensor([bits], dtype=torch.bool)


def committed(out):
    return out[0][0].nonzero().flatten().tolist()


def random_batch(seed, B=6, N=12, V=9):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(B, 1, 1, generator=g) * 4 + 0.3  # rows with very different entropies
    logits = torch.randn(B, N, V, generator=g) * scale
    masked = torch.rand(B, N, generator=g) < 0.6
    masked[0] = False            # a row with nothing to commit
    masked[1] = False
    masked[1, 5] = True          # a row with one masked position
    masked[2] = True             # a fully masked row
    return logits, masked


# ---------------------------------------------------------------- token_stats

def test_token_stats_hand_values():
    s = token_stats(logits_of(SKEW, HALF, SURE))
    assert s.top1[0].tolist() == [0, 0, 0]  # HALF ties go to the first token
    torch.testing.assert_close(s.confidence[0], torch.tensor([0.7, 0.5, 1.0]))
    torch.testing.assert_close(s.margin[0], torch.tensor([0.6, 0.0, 1.0]))
    expected_h = [-(0.7 * math.log(0.7) + 0.3 * math.log(0.1)), math.log(2), 0.0]
    torch.testing.assert_close(s.entropy[0], torch.tensor(expected_h))
    assert s.entropy[0, 2] == 0 and not s.entropy.isnan().any()  # -inf logits give 0, not nan


def test_temperature_zero_uses_unscaled_softmax():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0)) * 3
    q = logits.softmax(-1)
    h0 = token_stats(logits, temperature=0.0).entropy
    torch.testing.assert_close(h0, -(q * q.log()).sum(-1))
    assert (h0 > 0.01).all()  # the T → 0 limit would be ~0 everywhere
    q2 = (logits / 0.5).softmax(-1)
    torch.testing.assert_close(token_stats(logits, temperature=0.5).entropy, -(q2 * q2.log()).sum(-1))
    # Consequence for EB: a small γ at T = 0 commits one token, not the whole block.
    out = commit(logits, torch.ones(2, 5, dtype=torch.bool), EntropyBound(0.001))
    assert out[0].sum(1).tolist() == [1, 1]


# ---------------------------------------------------------------- EB sampler

ROWS = (HALF, SKEW, SIXTY, SURE, FLAT)


@pytest.mark.parametrize("proxy,gamma,expected", [
    # entropy order SURE, SIXTY, HALF, SKEW, FLAT; Σ-before = 0, 0, .673, 1.366, 2.306
    ("entropy", 0.0, [2, 3]),  # H(SURE) is exactly 0, so γ = 0 takes two
    ("entropy", 0.5, [2, 3]),
    ("entropy", 0.68, [0, 2, 3]),
    ("entropy", 1.4, [0, 1, 2, 3]),
    ("entropy", 3.0, [0, 1, 2, 3, 4]),
    # confidence order SURE, SKEW, SIXTY, HALF, FLAT; Σ − max = 0, 0, .673, 1.366, 2.306
    ("confidence", 0.0, [1, 3]),
    ("confidence", 0.68, [1, 2, 3]),  # a different set from the entropy proxy at the same γ
    ("confidence", 1.4, [0, 1, 2, 3]),
    # margin order SURE 1, SKEW .6, SIXTY .2, HALF 0, FLAT 0 (tie: lower position first)
    ("margin", 0.68, [1, 2, 3]),
    ("margin", 1.4, [0, 1, 2, 3]),
])
def test_eb_hand_cases(proxy, gamma, expected):
    assert committed(commit(logits_of(*ROWS), mask_of(1, 1, 1, 1, 1), EntropyBound(gamma, proxy))) == expected


def test_eb_excludes_non_masked_positions():
    # SURE and SIXTY are revealed already; the best masked ones by entropy are HALF then SKEW.
    out = commit(logits_of(*ROWS), mask_of(1, 1, 0, 0, 1), EntropyBound(0.7, "entropy"))
    assert committed(out) == [0, 1]
    out = commit(logits_of(*ROWS), mask_of(0, 0, 0, 0, 1), EntropyBound(math.inf))
    assert committed(out) == [4]


@pytest.mark.parametrize("proxy", ["entropy", "confidence", "margin"])
def test_eb_ties_go_to_lower_position(proxy):
    out = commit(logits_of(HALF, HALF, HALF, HALF), mask_of(0, 1, 1, 1), EntropyBound(0.0, proxy))
    assert committed(out) == [1]
    out = commit(logits_of(HALF, HALF, HALF, HALF), mask_of(1, 1, 1, 1), EntropyBound(0.7, proxy))
    assert committed(out) == [0, 1]


def test_eb_proxy_orders_before_entropy_breaks_ties():
    wide = [0.5, 1 / 6, 1 / 6, 1 / 6]  # κ = 0.5 like HALF, but H = 1.24 > ln 2
    logits = logits_of(wide, HALF)
    assert committed(commit(logits, mask_of(1, 1), EntropyBound(0.0, "confidence"))) == [0]  # κ tie -> lower
    assert committed(commit(logits, mask_of(1, 1), EntropyBound(0.0, "entropy"))) == [1]


@pytest.mark.parametrize("proxy", ["entropy", "confidence", "margin"])
@pytest.mark.parametrize("gamma", [0.0, 1e-9, 0.05, 0.3, 1.0, 5.0, math.inf])
def test_eb_commits_between_one_and_r(proxy, gamma):
    logits, masked = random_batch(1)
    c, _ = commit(logits, masked, EntropyBound(gamma, proxy))
    r = masked.sum(1)
    assert not (c & ~masked).any()
    assert ((c.sum(1) >= 1) | (r == 0)).all() and (c.sum(1) <= r).all()
    if gamma == 0.0:
        assert c.sum(1).tolist() == (r > 0).long().tolist()  # continuous logits: exactly one per row
    if gamma == math.inf:
        assert torch.equal(c, masked)


def _eb_reference(h, score, masked_row, gamma):
    """Loop form of SBD §5.1: sort by score (desc, stable), largest s with Σ_{j≤s} H − max H ≤ γ."""
    cand = sorted((i for i in range(len(h)) if masked_row[i]), key=lambda i: (-score[i], i))
    s = 1
    for n in range(1, len(cand) + 1):
        hs = [h[i] for i in cand[:n]]
        if sum(hs) - max(hs) <= gamma:
            s = n
    return sorted(cand[:s])


@pytest.mark.parametrize("seed", range(5))
def test_eb_entropy_proxy_equals_eq8(seed):
    logits, masked = random_batch(seed, B=8, N=16)
    g = torch.Generator().manual_seed(100 + seed)
    for gamma in (torch.rand(6, generator=g) * 4).tolist():
        c, _ = commit(logits, masked, EntropyBound(gamma, "entropy"))
        h = token_stats(logits).entropy.double()
        for b in range(logits.shape[0]):
            cand = sorted((i for i in range(16) if masked[b, i]), key=lambda i: (h[b, i].item(), i))
            # Eq. 8: the largest s with Σ_{j<s} H_{π_j} ≤ γ.
            s = max((n for n in range(1, len(cand) + 1) if h[b, cand[: n - 1]].sum() <= gamma), default=0)
            assert c[b].nonzero().flatten().tolist() == sorted(cand[:s])


@pytest.mark.parametrize("proxy", ["confidence", "margin"])
def test_eb_other_proxies_match_loop_reference(proxy):
    logits, masked = random_batch(7, B=8, N=16)
    stats = token_stats(logits)
    score = stats.confidence if proxy == "confidence" else stats.margin
    for gamma in (0.0, 0.2, 0.9, 2.5):
        c, _ = commit(logits, masked, EntropyBound(gamma, proxy))
        for b in range(logits.shape[0]):
            if masked[b].any():
                want = _eb_reference(stats.entropy[b].double().tolist(), score[b].tolist(), masked[b].tolist(), gamma)
                assert c[b].nonzero().flatten().tolist() == want


# ---------------------------------------------------------------- batch == single rows

@pytest.mark.parametrize("policy", ALL_POLICIES, ids=lambda p: repr(p))
def test_batch_equals_single_rows(policy):
    logits, masked = random_batch(3)
    c, tok = commit(logits, masked, policy)
    for b in range(logits.shape[0]):
        c1, tok1 = commit(logits[b : b + 1], masked[b : b + 1], policy)
        assert torch.equal(c[b], c1[0]) and torch.equal(tok[b], tok1[0])
    r = masked.sum(1)
    assert not (c & ~masked).any() and ((c.sum(1) >= 1) | (r == 0)).all() and (c.sum(1) <= r).all()
    assert c[0].sum() == 0 and c[1].tolist() == masked[1].tolist()
    assert torch.equal(tok, logits.argmax(-1))  # greedy candidates everywhere


# ---------------------------------------------------------------- Threshold

def test_threshold_is_inclusive_at_tau():
    logits = logits_of(SIXTY, SKEW, HALF, SURE)
    kappa = token_stats(logits).confidence[0]
    tau = kappa[0].item()  # exactly κ of SIXTY, as the policy computes it
    assert committed(commit(logits, mask_of(1, 1, 1, 0), Threshold(tau))) == [0, 1]
    assert committed(commit(logits, mask_of(1, 1, 1, 0), Threshold(torch.nextafter(kappa[0], torch.tensor(1.0)).item()))) == [1]


def test_threshold_always_commits_top1():
    logits = logits_of(HALF, SIXTY, FLAT, SIXTY)
    assert committed(commit(logits, mask_of(1, 1, 1, 1), Threshold(0.99))) == [1]  # κ tie 1 vs 3 -> lower
    assert committed(commit(logits, mask_of(1, 0, 1, 1), Threshold(0.99))) == [3]
    assert committed(commit(logits, mask_of(1, 1, 1, 1), Threshold(0.5))) == [0, 1, 3]


def test_untempered_confidence_ignores_temperature():
    logits = torch.tensor([[[3.0, 0, 0, 0], [3.0, 0, 0, 0]]])  # κ = 0.87 at T = 1, 0.60 at T = 2
    masked = mask_of(1, 1)
    kw = dict(temperature=2.0, top_k=1)  # top_k = 1 keeps the sampled token at the argmax
    assert committed(commit(logits, masked, Threshold(0.8), confidence="tempered", **kw)) == [0]  # Dream's
    assert committed(commit(logits, masked, Threshold(0.8), confidence="untempered", **kw)) == [0, 1]
    assert committed(commit(logits, masked, Threshold(0.8), **kw)) == [0, 1]  # the default is untempered


# ---------------------------------------------------------------- Factor

def kappa_logits(*kappas):
    """Rows with top-1 probability κ (≥ 0.25) and the rest spread over 3 other tokens."""
    return logits_of(*[[k] + [(1 - k) / 3] * 3 for k in kappas])


@pytest.mark.parametrize("kappas,masked,clean,compat", [
    # f = 1 thresholds for ranks 2..5: 0.667, 0.75, 0.8, 0.833
    ([0.81, 0.9, 0.5, 0.82, 0.85], (1, 1, 1, 1, 1), [0, 1, 3, 4], [0, 1, 2, 3, 4]),  # fails on the last rank
    ([0.9, 0.7, 0.74, 0.3], (1, 1, 1, 1), [0, 2], [0, 2]),        # fails on rank 3 of 4: no quirk
    ([0.5, 0.9], (1, 1), [1], [0, 1]),                            # r = 2, rank 2 fails: quirk takes both
    ([0.3, 0.28, 0.99], (1, 1, 0), [0], [0, 1]),                  # rank 1 is committed even below 1 − f/2
    ([0.3, 0.99, 0.95], (1, 0, 0), [0], [0]),                     # r = 1
    ([0.99, 0.95, 0.9, 0.86], (1, 1, 1, 1), [0, 1, 2, 3], [0, 1, 2, 3]),  # all pass
])
def test_factor_hand_cases(kappas, masked, clean, compat):
    logits = kappa_logits(*kappas)
    assert committed(commit(logits, mask_of(*masked), Factor(1.0))) == clean
    assert committed(commit(logits, mask_of(*masked), Factor(1.0, compat=True))) == compat


def _fastdllm_factor_reference(kappa_row, masked_row, f):
    """Loop form of Fast-dLLM's get_transfer_index_dynamic for one row (diffusion.md §6), in float64."""
    r = int(masked_row.sum())
    if r == 0:
        return []
    conf = sorted((kappa_row[i].item() for i in range(len(kappa_row)) if masked_row[i]), reverse=True)
    needs = [-1.0] + [1 - f / (n + 1) for n in range(2, r + 1)]
    # The reference walks the ranks, stops at the first failure, then adds one when it stopped on the
    # first or the last rank (or never failed).
    fail = next((i for i in range(r) if conf[i] < needs[i]), None)
    n = r - 1 if fail is None else fail
    if n in (0, r - 1):
        n += 1
    order = sorted((j for j in range(len(kappa_row)) if masked_row[j]), key=lambda j: (-kappa_row[j].item(), j))
    return sorted(order[:n])


@pytest.mark.parametrize("f", [0.3, 1.0, 2.0])
def test_factor_compat_matches_reference_loop(f):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(40, 6, 5, generator=g) * (torch.rand(40, 1, 1, generator=g) * 8)
    masked = torch.rand(40, 6, generator=g) < 0.7
    c, tok = commit(logits, masked, Factor(f, compat=True))
    kappa = logits.double().softmax(-1).gather(-1, tok[..., None])[..., 0]
    quirk_rows = 0
    for b in range(40):
        want = _fastdllm_factor_reference(kappa[b], masked[b], f)
        assert c[b].nonzero().flatten().tolist() == want
        clean = commit(logits[b : b + 1], masked[b : b + 1], Factor(f))[0][0]
        quirk_rows += int(clean.sum() != c[b].sum())
    assert quirk_rows > 0  # the sample exercises the last-rank quirk


# ---------------------------------------------------------------- TopK

def test_topk_and_quota():
    logits = kappa_logits(0.4, 0.9, 0.6, 0.8, 0.3).expand(3, -1, -1)
    masked = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    c, _ = commit(logits, masked, TopK(2))
    assert [row.nonzero().flatten().tolist() for row in c] == [[1, 3], [2, 3], [0, 1]]
    c, _ = commit(logits, masked, TopK(2), quota=torch.tensor([3, 0, 5]))
    assert [row.nonzero().flatten().tolist() for row in c] == [[1, 2, 3], [], [0, 1]]
    c, _ = commit(logits, masked, TopK(9))
    assert torch.equal(c, masked)


def test_topk_ties_go_to_lower_position():
    assert committed(commit(logits_of(HALF, HALF, HALF, HALF), mask_of(0, 1, 1, 1), TopK(2))) == [1, 2]


# ---------------------------------------------------------------- EntropyThreshold

def test_entropy_threshold_hand_cases():
    logits = logits_of(SIXTY, SKEW, SURE, FLAT)  # H = .673, .940, 0, 1.386
    assert committed(commit(logits, mask_of(1, 1, 1, 1), EntropyThreshold(0.7))) == [0, 2]
    assert committed(commit(logits, mask_of(1, 1, 1, 1), EntropyThreshold(0.0))) == [2]  # H = 0 ≤ 0
    assert committed(commit(logits, mask_of(0, 1, 0, 1), EntropyThreshold(0.4))) == [1]  # none: argmin H
    assert committed(commit(logits, mask_of(1, 1, 1, 1), EntropyThreshold(2.0))) == [0, 1, 2, 3]


# ---------------------------------------------------------------- sampling

@pytest.mark.parametrize("sampling", ["categorical", "gumbel"])
def test_sampling_reproducible_with_generator(sampling):
    logits, masked = random_batch(5, B=4, N=16, V=50)
    kw = dict(temperature=0.8, sampling=sampling)
    a = commit(logits, masked, EntropyBound(0.5), generator=torch.Generator().manual_seed(1), **kw)
    b = commit(logits, masked, EntropyBound(0.5), generator=torch.Generator().manual_seed(1), **kw)
    c = commit(logits, masked, EntropyBound(0.5), generator=torch.Generator().manual_seed(2), **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])
    assert not torch.equal(a[1], logits.argmax(-1))


@pytest.mark.parametrize("sampling", ["categorical", "gumbel"])
def test_sampling_follows_tempered_softmax(sampling):
    row = torch.tensor([2.0, 1.0, 0.0, -1.0])
    logits = row.expand(1, 20000, 4)
    _, tok = commit(logits, torch.ones(1, 20000, dtype=torch.bool), TopK(1), temperature=1.5,
                    sampling=sampling, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(tok.flatten(), minlength=4).float() / 20000
    torch.testing.assert_close(freq, (row / 1.5).softmax(-1), atol=0.015, rtol=0)


@pytest.mark.parametrize("sampling", ["categorical", "gumbel"])
def test_top_k_and_top_p_filter_samples(sampling):
    logits = torch.randn(2, 30, 20, generator=torch.Generator().manual_seed(4))
    masked = torch.ones(2, 30, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        _, tok = commit(logits, masked, TopK(1), temperature=1.0, sampling=sampling, generator=g, **kw)
        assert torch.equal(tok, logits.argmax(-1))
    _, tok = commit(logits, masked, TopK(1), temperature=1.0, top_k=3, sampling=sampling, generator=g)
    assert (tok[..., None] == logits.topk(3, -1).indices).any(-1).all()


def test_gumbel_argmax_is_llada_formula_in_float64():
    logits = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = gumbel_argmax(logits, 0.7, torch.Generator().manual_seed(3))
    u = torch.rand(3, 7, 11, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.equal(got, (logits.double().exp() / (-u.log()) ** 0.7).argmax(-1))
    assert torch.equal(gumbel_argmax(logits, 0.0), logits.argmax(-1))


# ---------------------------------------------------------------- suppress

def test_suppress_returns_new_tensor():
    logits = torch.zeros(1, 2, 5)
    out = suppress(logits, [1, 4])
    assert (logits == 0).all()
    assert out[..., [1, 4]].eq(-math.inf).all() and out[..., [0, 2, 3]].eq(0).all()
    assert suppress(logits, 2)[0, 0].tolist() == [0, 0, -math.inf, 0, 0]
    with pytest.raises(UnmaskError, match="suppress ids"):
        suppress(logits, [5])


# ---------------------------------------------------------------- configs and factory

@pytest.mark.parametrize("build", [
    lambda: EntropyBound(-1), lambda: EntropyBound(math.nan), lambda: EntropyBound(0.1, "kl"),
    lambda: Threshold(0), lambda: Threshold(1.5), lambda: Factor(-1), lambda: Factor(1.0, compat="yes"),
    lambda: TopK(0), lambda: TopK(1.5), lambda: TopK(True), lambda: EntropyThreshold(-0.1),
    lambda: make_policy("nope"), lambda: make_policy("threshold", gamma=0.1),
    lambda: make_policy("confidence-bound", proxy="entropy"), lambda: make_policy("entropy-bound", gamma="chat"),
    lambda: EntropyBound.preset("chat-medium"),
])
def test_invalid_configs_raise(build):
    with pytest.raises(UnmaskError):
        build()


def test_error_messages_name_the_fix():
    with pytest.raises(UnmaskError, match=r"gamma must be >= 0 \(got -1\)"):
        EntropyBound(-1)
    with pytest.raises(UnmaskError) as err:
        make_policy("nope")
    assert all(name in str(err.value) for name in POLICY_NAMES)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1), dict(confidence="raw"), dict(sampling="beam"),
    dict(quota=torch.tensor([1])),  # quota with a policy other than TopK
])
def test_invalid_commit_options_raise(kwargs):
    with pytest.raises(UnmaskError):
        commit(torch.zeros(1, 2, 3), torch.ones(1, 2, dtype=torch.bool), Threshold(), **kwargs)


def test_invalid_commit_inputs_raise():
    with pytest.raises(UnmaskError, match="masked"):
        commit(torch.zeros(1, 2, 3), torch.ones(1, 2), Threshold())
    with pytest.raises(UnmaskError, match="quota"):
        commit(torch.zeros(1, 2, 3), torch.ones(1, 2, dtype=torch.bool), TopK(), quota=torch.tensor([-1]))
    with pytest.raises(UnmaskError, match="logits"):
        token_stats(torch.zeros(2, 3))


def test_make_policy_and_presets():
    assert make_policy("threshold", tau=None, gamma=None) == Threshold()
    assert make_policy("Top_K", k=4) == TopK(4)
    assert make_policy("entropy-bound", gamma="chat-high") == EntropyBound(0.6)
    assert make_policy("confidence-bound", gamma=0.1) == EntropyBound(0.1, "confidence")
    assert make_policy("factor", f=2.0, compat=True) == Factor(2.0, True)
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    assert EntropyBound.preset("chat-low") == EntropyBound(0.35)
    assert EntropyBound.gamma_low("reasoning").gamma == 0.1 and EntropyBound.gamma_high("chat").gamma == 0.6
    assert GAMMA_PRESETS == {"reasoning-low": 0.1, "reasoning-high": 0.35, "chat-low": 0.35, "chat-high": 0.6}
    with pytest.raises(dataclasses.FrozenInstanceError):
        Threshold().tau = 0.5


def test_strict_threshold_leaves_exact_ties_uncommitted():
    logits = torch.zeros(1, 3, 2)  # κ = 0.5 exactly at every position
    masked = torch.ones(1, 3, dtype=torch.bool)
    assert commit(logits, masked, Threshold(0.5))[0].tolist() == [[True, True, True]]
    assert commit(logits, masked, Threshold(0.5, strict=True))[0].tolist() == [[True, False, False]]
