"""Lossless SBD (spec/sbd_exact.md §4): group logits, equality with AR, the sampling
distribution, the exact cache, batching."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import one_line_error, tiny_bundle, tiny_llama, tiny_qwen3

import unmask
from unmask.compat import attention_mask, forward, new_cache
from unmask.decode.verify import sampled as sbd_sampled
from unmask.decode.verify import config as vconfig
from unmask.decode.verify import tree as tree_verify
from unmask.errors import UnmaskError
from unmask.masks import as_4d, sbd_inference_mask
from unmask.models.mask_token import add_mask_token
from unmask.sampling import Sampling
from unmask.decode import DECODERS
from verify_helpers import lossless

FACTORIES = {"llama": tiny_llama, "qwen3": tiny_qwen3}


def verify_bundle(arch="llama", impl="eager", vocab=8, seed=0):
    """A tiny random model with a mask row. A small vocabulary makes random drafts agree with the
    NTP argmax often enough that multi-token accepts occur (asserted where it matters); weights
    10x the default init scale keep greedy text from collapsing into one repeated token."""
    model = FACTORIES[arch](vocab=vocab, seed=seed, attn_implementation=impl, initializer_range=0.2)
    return tiny_bundle(model, kind="sbd", mask_token_id=add_mask_token(model))


def uncached(bundle, seq: list[int], n_block: int) -> torch.Tensor:
    """One uncached forward: causal prefix, bidirectional last ``n_block`` tokens. -> (len, V)."""
    mask = as_4d(sbd_inference_mask(0, len(seq) - n_block, n_block), 1)  # (1, 1, L, L)
    return forward(bundle.model, torch.tensor([seq]), position_ids=torch.arange(len(seq))[None],
                   attention_mask=attention_mask(bundle.model, mask))[0]


# --------------------------------------------------------------------------------- layout


def test_greedy_accept_takes_the_longest_confirmed_prefix():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    draft = torch.tensor([[5, 6, 7], [5, 0, 7], [0, 6, 7], [5, 6, 7]])
    a = tree_verify.greedy_accept(target, draft, torch.tensor([3, 3, 3, 0]))
    assert a.tolist() == [3, 1, 0, 0]  # a row without a draft accepts nothing


# --------------------------------------------------------------------------------- group logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("draft", vconfig.DRAFTS)
def test_group_logits_equal_separate_all_mask_forwards(arch, impl, draft):
    bundle = verify_bundle(arch, impl, vocab=64)
    K, M = 4, bundle.mask_token_id
    prompt = [1, 5, 9, 12, 7]
    seen = []
    out = lossless(bundle, [prompt], max_new_tokens=20, block_size=K, draft=draft,
                            on_forward=seen.append)
    final = prompt + out.tokens[0]
    checked = 0
    for info in seen[1:]:
        inp, p_b = info["inp"][0].tolist(), int(info["positions"][0, 0])
        assert inp[0] == final[p_b]  # b is the last committed token
        prefix = final[:p_b]
        verify = uncached(bundle, prefix + inp[:K], 0)[p_b:]  # causal NTP logits at b, s_1..s_{K-1}
        torch.testing.assert_close(info["logits"][0, :K, :-1], verify[:, :-1], atol=1e-5, rtol=1e-5)
        groups = range(K) if draft == "quadratic" else [None]
        for g, i in enumerate(groups):
            L = i + 1 if i is not None else int(info["positions"][0, K]) - p_b  # verify tokens the group sees
            want = uncached(bundle, prefix + inp[:L] + [M] * K, K)[-K:]
            got = info["logits"][0, K + g * K: K + (g + 1) * K]
            torch.testing.assert_close(got[:, :-1], want[:, :-1], atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked >= 5


# --------------------------------------------------------------------------------- greedy == AR


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("K", [2, 4, 8])
@pytest.mark.parametrize("draft", vconfig.DRAFTS)
def test_greedy_output_equals_ar_batch_1_and_ragged_batch_of_8(arch, K, draft):
    bundle = verify_bundle(arch, "sdpa", vocab=8, seed=K)
    g = torch.Generator().manual_seed(K)
    prompts = [torch.randint(3, 8, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (8,), generator=g)]
    want = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=24).tokens
    batch = lossless(bundle, prompts, max_new_tokens=24, block_size=K, draft=draft)
    assert batch.tokens == want
    accepts = batch.stats.extra["accepts"]
    assert max(accepts) >= 2, accepts  # drafts were accepted: the test exercises multi-token commits
    for i, p in enumerate(prompts):
        single = lossless(bundle, [p], max_new_tokens=24, block_size=K, draft=draft)
        assert single.tokens[0] == want[i]
        assert single.stats.nfe_per_row[0] == batch.stats.nfe_per_row[i]  # a row's steps do not depend on the batch
        assert single.stats.extra["row_extra"][0] == batch.stats.extra["row_extra"][i]


def test_stop_tokens_and_stop_strings_cut_like_ar():
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=1)
    prompts = [[1, 4, 5], [1, 6], [1, 3, 3, 7]]
    for kw in (dict(stop_token_ids=(2,)), dict(stop_strings=(" 3 5 3",)), dict(stop_token_ids=(0,), stop_strings=(" 5 5 5 5 5",))):
        want = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=30, **kw).tokens
        got = lossless(bundle, prompts, max_new_tokens=30, block_size=4, **kw).tokens
        assert got == want
        assert any(len(w) < 30 for w in want) and any(len(w) > 0 for w in want)


@pytest.mark.parametrize("K,draft", [(2, "quadratic"), (4, "quadratic"), (8, "quadratic"), (4, "linear"), (8, "linear")])
def test_shipped_sbd_model_lossless_equals_its_ar(K, draft):
    bundle = unmask.load("stories260K-sbd")
    texts = ["Once upon a time", "Tom and his dog", "The sun was hot and Lily", "Zoo"]
    prompts = [bundle.encode(t) for t in texts]
    want = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=48, stop_token_ids=bundle.stop_token_ids).tokens
    got = lossless(bundle, prompts, max_new_tokens=48, block_size=K, draft=draft,
                            stop_token_ids=bundle.stop_token_ids)
    assert got.tokens == want
    assert got.stats.nfe < 48 * 0.75  # the shipped model's drafts are accepted


# --------------------------------------------------------------------------------- exact cache


@pytest.mark.parametrize("draft", vconfig.DRAFTS)
def test_cache_holds_only_committed_causal_kv_after_every_step(draft):
    bundle = verify_bundle("llama", "eager", vocab=8, seed=1)
    prompts = [[1, 4, 5, 6], [1, 7]]
    seen = []
    out = lossless(bundle, prompts, max_new_tokens=16, block_size=4, draft=draft,
                            on_forward=lambda s: seen.append({k: s[k] for k in ("rows", "committed")} | {
                                "kv": s["key_valid"].clone(), "keys": [x.keys.clone() for x in s["cache"].layers]})
                            if "rows" in s else None)
    assert len(seen) > 3
    for info in seen:
        for i, r in enumerate(info["rows"]):
            cols = torch.nonzero(info["kv"][i]).flatten()  # (n,) the row's valid cache columns
            n_committed = int(info["committed"][i])
            # every committed token but the last (the bonus b, fed by the next step) and nothing else
            assert len(cols) == len(prompts[r]) + n_committed - 1
            seq = (prompts[r] + out.tokens[r])[: len(cols)]
            cache = new_cache(bundle.model)
            forward(bundle.model, torch.tensor([seq]), position_ids=torch.arange(len(seq))[None], cache=cache)
            for keys, fresh in zip(info["keys"], cache.layers):
                torch.testing.assert_close(keys[i][:, cols], fresh.keys[0], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------- sampling


@torch.inference_mode()
def _ar_distribution(bundle, prompt: list[int], n: int, sampling: Sampling) -> dict[tuple, float]:
    """Exact probability of every n-token continuation under NTP sampling (mask id suppressed)."""
    V = bundle.model.config.vocab_size - 1
    seqs = list(itertools.product(range(V), repeat=n))
    ids = torch.tensor([prompt + list(s) for s in seqs])  # (V^n, P+n)
    logits = forward(bundle.model, ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids))[:, len(prompt) - 1:-1]
    logits[..., bundle.mask_token_id] = float("-inf")
    probs = sbd_sampled._probs(logits, sampling)  # (V^n, n, V+1)
    picked = probs.gather(2, ids[:, len(prompt):, None])[..., 0].prod(dim=1)  # (V^n,)
    return {s: float(p) for s, p in zip(seqs, picked)}


def _chi_square_p(counts: dict, probs: dict, total: int) -> float:
    """p-value of Pearson's chi-square test; cells expecting < 5 samples are pooled."""
    stat, dof, pooled_o, pooled_e = 0.0, -1, 0.0, 0.0
    for key, p in probs.items():
        e, o = p * total, counts.get(key, 0)
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        dof += 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _sample_counts(bundle, prompt, n_samples, sampling, K):
    out = lossless(bundle, [prompt] * n_samples, max_new_tokens=3, block_size=K, sampling=sampling)
    counts: dict = {}
    for row in out.tokens:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts, out


@pytest.fixture(scope="module")
def sampling_case():
    bundle = verify_bundle("llama", "eager", vocab=6, seed=5)
    sampling = Sampling(temperature=1.0, top_k=5, seed=11)
    prompt = [1, 4, 3]
    return bundle, prompt, sampling, _ar_distribution(bundle, prompt, 3, sampling)


def test_sampled_output_has_the_ar_distribution(sampling_case):
    bundle, prompt, sampling, probs = sampling_case
    counts, out = _sample_counts(bundle, prompt, 20_000, sampling, K=3)
    assert sum(counts.values()) == 20_000
    assert out.stats.extra["accepts"].get(2, 0) + out.stats.extra["accepts"].get(3, 0) > 1000  # drafts accepted
    assert _chi_square_p(counts, probs, 20_000) > 1e-3


def test_a_wrong_acceptance_rule_fails_the_distribution_test(sampling_case, monkeypatch):
    bundle, prompt, sampling, probs = sampling_case

    def accept_then_resample_from_p(p, q, draft, draft_len, generator):
        # wrong: after a rejection, draws from p instead of normalize(max(0, p - q))
        a, _ = real(p, q, draft, draft_len, generator)
        last = sbd_sampled._multinomial(p[torch.arange(len(a)), a], generator)
        return a, last

    real = sbd_sampled.speculative_accept
    monkeypatch.setattr(sbd_sampled, "speculative_accept", accept_then_resample_from_p)
    counts, _ = _sample_counts(bundle, prompt, 20_000, sampling, K=3)
    assert _chi_square_p(counts, probs, 20_000) < 1e-3


def test_sampled_rows_do_not_depend_on_the_batch_and_copies_are_independent():
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    prompts = [[1, 4, 5], [1, 6], [1, 4, 5], [1, 3, 3, 7]]
    sampling = Sampling(temperature=1.0, seed=3)
    batch = lossless(bundle, prompts, max_new_tokens=20, block_size=4, sampling=sampling)
    assert batch.tokens[0] != batch.tokens[2]  # two copies of one prompt are two samples
    assert lossless(bundle, [prompts[3]], max_new_tokens=20, block_size=4, sampling=sampling).tokens[0] == \
        batch.tokens[3]
    again = lossless(bundle, prompts, max_new_tokens=20, block_size=4, sampling=sampling)
    assert again.tokens == batch.tokens  # seeded: reproducible


# --------------------------------------------------------------------------------- options


def test_sbd_decoder_verify_option_and_defaults():
    bundle = unmask.load("stories260K-sbd")
    prompts = [bundle.encode("Once upon a time")]
    want = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=32).tokens
    assert DECODERS["sbd"].decode(bundle, prompts, max_new_tokens=32, verify=True, block_size=4).tokens == want
    assert DECODERS["sbd"].decode(bundle, prompts, max_new_tokens=32, verify=True, draft="linear").stats.extra["draft"] == "linear"
    lossy = DECODERS["sbd"].decode(bundle, prompts, max_new_tokens=32, gamma=1.0)
    assert "verify" not in lossy.stats.extra
    with pytest.raises(UnmaskError, match="--gamma"):
        DECODERS["sbd"].decode(bundle, prompts, max_new_tokens=8, verify=True, gamma=0.3)
    with pytest.raises(UnmaskError, match="--draft applies"):
        DECODERS["sbd"].decode(bundle, prompts, max_new_tokens=8, verify=False, draft="linear")
    for bad in (1, 0):  # 0 is refused, not silently replaced by the default
        with pytest.raises(UnmaskError, match="block size >= 2"):
            DECODERS["sbd"].decode(bundle, prompts, max_new_tokens=8, verify=True, block_size=bad)
    with pytest.raises(UnmaskError, match="draft"):
        DECODERS["sbd"].decode(bundle, prompts, max_new_tokens=8, verify=True, draft="")


def test_cli_verify_errors_are_one_line(capsys):
    one_line_error(capsys, "generate", "Once", "--verify", "--gamma", "0.3", match="--gamma")
    one_line_error(capsys, "generate", "Once", "--verify", "--draft", "cubic", match="draft layout")
    one_line_error(capsys, "generate", "Once", "--model", "stories260K", "--decoder", "sbd", "--verify",
                   match="kind sbd")


def test_step_tables_are_shared_only_while_small(monkeypatch):
    """vconfig.tables keeps the last few small layouts' tables (equal to a fresh tree_window) and
    builds a larger one per call, so cached tables never hold more than CACHED_TABLES x CACHED_TABLE_BYTES."""
    monkeypatch.setattr(vconfig, "_TABLES", type(vconfig._TABLES)())
    a, b = vconfig.tables("4/0,4/5", 5), vconfig.tables("4/0,4/5", 5)
    assert a is b
    fresh = tree_verify.tree_window(vconfig.family("4/0,4/5", 5))
    assert all(torch.equal(getattr(a, f), getattr(fresh, f)) for f in ("mask", "offsets", "tok", "path", "src", "length"))
    monkeypatch.setattr(vconfig, "CACHED_TABLE_BYTES", tree_verify.table_bytes(vconfig.family("quadratic", 8)) - 1)
    assert vconfig.tables("quadratic", 8) is not vconfig.tables("quadratic", 8)
    monkeypatch.setattr(vconfig, "CACHED_TABLES", 2)
    for K in (2, 3, 4):
        vconfig.tables("linear", K)
    assert [k[:2] for k in vconfig._TABLES] == [("linear", 3), ("linear", 4)]
