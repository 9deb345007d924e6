"""The fast path: the static cache (unmask.decode.engine.kv.StaticKV), eager and compiled, gives the eager
decoders' tokens, NFE and accept histograms (STYLE.md 14: compiled against eager). AR and lossless
SBD run it through their one running batch (unmask.decode.verify.batch.Verify, issue 25)."""

from __future__ import annotations

import pytest
import torch
from conftest import one_line_error, prompts_around_a_block, tiny_bundle, tiny_llama, tiny_qwen3

import unmask
from unmask.decode.verify import batch as verify_batch
from unmask.decode.verify import config as vconfig
from unmask.decode.engine import static
from unmask.decode.engine.running import drain, requests_for
from unmask.models.mask_token import add_mask_token
from unmask.sampling import Sampling
from unmask.decode import DECODERS
from verify_helpers import chain_tables, lossless


TEXTS = ["Once upon a time", "The cat sat on the", "Lily and Ben went to the park", "One day",
         "Tom had a red ball and", "She", "The sun was hot and the", "A little bird"]
SAMPLINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=0.9, top_k=20, seed=5)}


@pytest.fixture(scope="module")
def sbd_model():
    return unmask.load("stories260K-sbd")


def _prompts(bundle, batch):
    return [bundle.encode(t) for t in TEXTS[:batch]]


def static_ar(bundle, prompts, *, max_new_tokens, sampling=Sampling(), stop_token_ids=(), stop_strings=()):
    """AR on the static cache, eagerly: the one batch with static=True (ar.decode's compile=True path uncompiled)."""
    reqs = requests_for(prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=stop_strings)
    P = max(len(p) for p in prompts)
    return drain(lambda cap: verify_batch.Verify(bundle, static=True, capacity=cap, ar=True, stop_token_ids=stop_token_ids,
                                             length=P + max_new_tokens + 1), reqs)


def _same(a, b):
    assert a.tokens == b.tokens
    assert a.stats.nfe == b.stats.nfe
    assert a.stats.nfe_per_row == b.stats.nfe_per_row
    assert a.stats.tokens_per_row == b.stats.tokens_per_row


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("batch", [1, 8])
def test_static_ar_equals_eager_ar(sbd_model, sampling, batch):
    kw = dict(max_new_tokens=96, sampling=SAMPLINGS[sampling], stop_token_ids=sbd_model.stop_token_ids)
    eager = DECODERS["ar"].decode(sbd_model, _prompts(sbd_model, batch), **kw)
    _same(eager, static_ar(sbd_model, _prompts(sbd_model, batch), **kw))


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("K,draft", [(8, "linear"), (4, "quadratic")])
def test_static_lossless_sbd_equals_eager(sbd_model, sampling, batch, K, draft):
    kw = dict(max_new_tokens=96, sampling=SAMPLINGS[sampling], stop_token_ids=sbd_model.stop_token_ids,
              block_size=K, draft=draft)
    eager = lossless(sbd_model, _prompts(sbd_model, batch), **kw)
    fast = lossless(sbd_model, _prompts(sbd_model, batch), static=True, **kw)
    _same(eager, fast)
    assert eager.stats.extra["accepts"] == fast.stats.extra["accepts"]
    if sampling == "greedy":  # and both are AR's text
        assert fast.tokens == DECODERS["ar"].decode(sbd_model, _prompts(sbd_model, batch), max_new_tokens=96,
                                        stop_token_ids=sbd_model.stop_token_ids).tokens


@pytest.mark.parametrize("stop", [(), ("park",)])
def test_full_static_cache_is_compacted_in_place_without_changing_tokens(sbd_model, monkeypatch, stop):
    # A batch's shared pointer moves by the largest acceptance, so rejected drafts leave holes:
    # 200 tokens in a 256-slot cache force a compaction.
    calls = []
    compact = verify_batch.compact
    monkeypatch.setattr(verify_batch, "compact", lambda *a: (calls.append(1), compact(*a))[1])
    kw = dict(max_new_tokens=200, stop_token_ids=sbd_model.stop_token_ids, stop_strings=stop, block_size=8,
              draft="linear")
    prompts = _prompts(sbd_model, 8)
    fast = lossless(sbd_model, prompts, static=True, **kw)
    assert calls, "the cache never filled: the compaction path went untested"
    _same(lossless(sbd_model, prompts, **kw), fast)
    assert fast.tokens == DECODERS["ar"].decode(sbd_model, prompts, max_new_tokens=200, stop_token_ids=sbd_model.stop_token_ids,
                                    stop_strings=stop).tokens


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen3])
def test_static_paths_on_tiny_random_models_with_eager_attention(factory):
    model = factory(vocab=8, seed=1, attn_implementation="eager", initializer_range=0.2)
    bundle = tiny_bundle(model, kind="sbd", mask_token_id=add_mask_token(model))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8, (n,), generator=gen).tolist() for n in (3, 7, 1, 5)]
    _same(DECODERS["ar"].decode(bundle, prompts, max_new_tokens=30), static_ar(bundle, prompts, max_new_tokens=30))
    for draft in ("linear", "quadratic"):
        kw = dict(max_new_tokens=30, block_size=3, draft=draft)
        _same(lossless(bundle, prompts, **kw), lossless(bundle, prompts, static=True, **kw))
    for sampling in SAMPLINGS.values():  # lossy SBD: the additive float mask padded to the static cache
        kw = dict(max_new_tokens=30, block_size=4, verify=False, gamma=0.5, sampling=sampling)
        _same(DECODERS["sbd"].decode(bundle, prompts, **kw), DECODERS["sbd"].decode(bundle, prompts, static=True, **kw))


@pytest.mark.parametrize("batch", [1, 8])
def test_compiled_equals_eager_for_ar_and_lossless_sbd(sbd_model, batch):
    # the long prompts, then prompts of 1, K + 1, 2, K - 1, K and K + 1 tokens (K = 8, the model's
    # draft block), in turn on the same compiled graphs (issue 48 item 1)
    kw = dict(max_new_tokens=48, stop_token_ids=sbd_model.stop_token_ids)
    for prompts in [_prompts(sbd_model, batch)] + prompts_around_a_block(sbd_model, 8, batch):
        eager_ar = DECODERS["ar"].decode(sbd_model, prompts, **kw)
        compiled_ar = DECODERS["ar"].decode(sbd_model, prompts, compile=True, **kw)
        _same(eager_ar, compiled_ar)
        assert compiled_ar.stats.extra["compiled"] is True
        eager = lossless(sbd_model, prompts, **kw)
        compiled = lossless(sbd_model, prompts, compile=True, **kw)
        _same(eager, compiled)
        assert compiled.tokens == eager_ar.tokens and compiled.stats.extra["compiled"] is True
    prompts = _prompts(sbd_model, batch)
    if batch == 1:  # sampling: the forward compiled, the acceptance eager (per-row generators)
        kw["sampling"] = SAMPLINGS["sampled"]
        _same(lossless(sbd_model, prompts, **kw), lossless(sbd_model, prompts, compile=True, **kw))


def brute_layout(K: int, draft: str, L: int):
    """The spec §1 rules query by query: (mask (Q, Q), offsets (Q,)) of a draft size K step whose
    linear group follows L verify tokens (quadratic: K groups, L unused)."""
    groups = list(range(K)) if draft == "quadratic" else [None]
    queries = [("v", j, None) for j in range(K)] + [("g", o, i) for i in range(len(groups)) for o in range(K)]
    mask = torch.zeros(len(queries), len(queries), dtype=torch.bool)
    offsets = []
    for r, (kind, j, i) in enumerate(queries):
        after = (i + 1 if draft == "quadratic" else L) if kind == "g" else None
        offsets.append(j if kind == "v" else after + j)
        for c, (kind2, j2, i2) in enumerate(queries):
            if kind == "v":
                mask[r, c] = kind2 == "v" and j2 <= j
            else:
                mask[r, c] = (kind2 == "v" and j2 < after) or (kind2 == "g" and i2 == i)
    return mask, torch.tensor(offsets)


@pytest.mark.parametrize("draft", ["linear", "quadratic"])
def test_embedded_layouts_are_each_draft_sizes_own_layout_with_padding_seeing_only_itself(draft):
    # a row of draft size K inside a step of the largest size Kmax: its queries carry its own
    # layout (the spec's rules, brute_layout(K)), every other query of the window sees only itself at offset 0
    Kmax = 4
    mask, offsets, _, _ = chain_tables(vconfig.family(draft, Kmax))
    Q = vconfig.queries(Kmax, draft)
    assert mask.shape == (Kmax, Kmax, Q, Q) and offsets.shape == (Kmax, Kmax, Q)
    for K in range(1, Kmax + 1):
        if K > 1:
            assert vconfig.queries(K, draft) == (K + K * K if draft == "quadratic" else 2 * K)
        for L in range(1, K + 1):
            if K == 1:
                at = [0]
                want_m, want_o = torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long)
            else:
                want_m, want_o = brute_layout(K, draft, L if draft == "linear" else K)
                at = [j if j < K else Kmax + (j - K) // K * Kmax + (j - K) % K for j in range(len(want_o))]
            m, o = mask[K - 1, L - 1], offsets[K - 1, L - 1]
            assert torch.equal(m[at][:, at], want_m) and torch.equal(o[at], want_o)
            pad = [j for j in range(Q) if j not in at]
            assert torch.equal(m[pad], torch.eye(Q, dtype=torch.bool)[pad]) and not m[at][:, pad].any()
            assert not o[pad].any()


def test_compile_errors_are_one_line(capsys):
    # (its earlier case, --compile --trace on ar, works since AR emits step events: issue 52 item 2)
    one_line_error(capsys, "generate", "Once", "-m", "stories260K-dlm", "--schedule", "dream", "--compile", "-n", "4",
                   match="--schedule dream")


LOSSY = {"default": {}, "chat-high": {"preset": "chat-high"}, "k4-gamma0.1": {"block_size": 4, "gamma": 0.1}}


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("options", LOSSY)
def test_static_lossy_sbd_equals_eager(sbd_model, sampling, batch, options):
    # 90 tokens: a short last block too (90 = 5·16 + 10, 22·4 + 2), so every query shape is exercised
    kw = dict(max_new_tokens=90, sampling=SAMPLINGS[sampling], stop_token_ids=sbd_model.stop_token_ids,
              verify=False, **LOSSY[options])
    prompts = _prompts(sbd_model, batch)
    eager = DECODERS["sbd"].decode(sbd_model, prompts, **kw)
    fast = DECODERS["sbd"].decode(sbd_model, prompts, static=True, **kw)
    _same(eager, fast)
    assert eager.stats.extra["accepts"] == fast.stats.extra["accepts"]
    assert fast.stats.extra["static_cache"] % static.LENGTH_BUCKET == 0 and eager.stats.extra["static_cache"] is None


@pytest.mark.parametrize("stop", [("park",), ("the", "Lily")])
def test_static_lossy_sbd_stop_strings_and_events(sbd_model, stop):
    # finished rows ride along masked on the static cache; step events and forward hooks match too
    kw = dict(max_new_tokens=64, stop_token_ids=sbd_model.stop_token_ids, stop_strings=stop, verify=False,
              block_size=8)
    prompts = _prompts(sbd_model, 8)
    eager_steps, fast_steps, eager_fwd, fast_fwd = [], [], [], []
    eager = DECODERS["sbd"].decode(sbd_model, prompts, on_step=eager_steps.append, on_forward=eager_fwd.append, **kw)
    fast = DECODERS["sbd"].decode(sbd_model, prompts, static=True, on_step=fast_steps.append, on_forward=fast_fwd.append, **kw)
    _same(eager, fast)
    assert fast_steps == eager_steps
    assert [f["inp"].tolist() for f in fast_fwd] == [f["inp"].tolist() for f in eager_fwd]
    for e, f in zip(eager_fwd, fast_fwd):  # the static cache holds the same committed causal K/V
        assert all(torch.allclose(ek, fk, atol=1e-5) for (ek, _), (fk, _) in zip(e["cache"], f["cache"]))
    assert min(fast.stats.tokens_per_row) < 64  # some row stopped early


def test_compiled_lossy_sbd_equals_eager(sbd_model):
    # the one lossy compile test: two query shapes (k and the fused 2k re-feed), about 15 s on a CPU core;
    # prompts of 1, k + 1, 2, k - 1, k and k + 1 tokens (k = 8, the model's block), then the long ones,
    # in turn on the same compiled graphs (issue 48 item 1)
    kw = dict(max_new_tokens=32, stop_token_ids=sbd_model.stop_token_ids, verify=False)
    for prompts in prompts_around_a_block(sbd_model, 8, 2) + [_prompts(sbd_model, 2)]:
        eager = DECODERS["sbd"].decode(sbd_model, prompts, **kw)
        compiled = DECODERS["sbd"].decode(sbd_model, prompts, compile=True, **kw)
        _same(eager, compiled)
        assert compiled.stats.extra["compiled"] is True and eager.stats.extra["compiled"] is False


def test_static_option_values(sbd_model):
    with pytest.raises(unmask.UnmaskError, match="static must be True or False"):
        DECODERS["sbd"].decode(sbd_model, [[1, 2]], max_new_tokens=2, verify=False, static="yes")
    # static=True reaches the lossless path too (its static loop, eagerly)
    prompts = _prompts(sbd_model, 2)
    lossless = DECODERS["sbd"].decode(sbd_model, prompts, max_new_tokens=24, verify=True, static=True)
    assert lossless.stats.extra["static_cache"] and lossless.stats.extra["compiled"] is False
    _same(DECODERS["sbd"].decode(sbd_model, prompts, max_new_tokens=24, verify=True), lossless)


def test_static_lossless_sbd_emits_the_eager_step_events(sbd_model):
    kw = dict(max_new_tokens=40, stop_token_ids=sbd_model.stop_token_ids, block_size=4, draft="quadratic")
    prompts = _prompts(sbd_model, 3)
    eager, fast = [], []
    lossless(sbd_model, prompts, on_step=eager.append, **kw)
    lossless(sbd_model, prompts, static=True, on_step=fast.append, **kw)
    assert fast == eager and len(eager) > 3


def test_compile_option_values(capsys):
    with pytest.raises(unmask.UnmaskError, match="compile must be True or False"):
        unmask.generate("Once", max_new_tokens=2, compile="false")
    off = unmask.generate("Once", model="stories260K-dlm", max_new_tokens=8, compile=False)  # "off" is a no-op
    assert off.tokens == unmask.generate("Once", model="stories260K-dlm", max_new_tokens=8).tokens
    one_line_error(capsys, "eval", "--task", "stories", "--limit", "1", "-O", "compile=false", "--compile",
                   match="set twice")


def test_compiled_graph_reused_by_a_later_decode_reads_its_own_cache(sbd_model):
    """The compiled step keeps only dynamo's tensor guards (static._guard_filter): a second decode
    with other prompts and a new static cache runs the first decode's graphs (none compiled anew)
    and still gives eager's tokens, so no per-call value is baked into a graph."""
    kw = dict(max_new_tokens=40, stop_token_ids=sbd_model.stop_token_ids)
    first, second = _prompts(sbd_model, 8)[:2], _prompts(sbd_model, 8)[4:6]
    _same(DECODERS["ar"].decode(sbd_model, first, **kw), DECODERS["ar"].decode(sbd_model, first, compile=True, **kw))
    graphs = len(static._compiled[sbd_model.model])
    _same(DECODERS["ar"].decode(sbd_model, second, **kw), DECODERS["ar"].decode(sbd_model, second, compile=True, **kw))
    assert len(static._compiled[sbd_model.model]) == graphs  # the same graphs ran on the new cache
    assert static._guard_filter(sbd_model.model)  # a model without hooks: tensor guards only


def test_a_model_with_forward_hooks_keeps_every_guard():
    model = tiny_llama()
    assert static._guard_filter(model)
    handle = model.model.register_forward_pre_hook(lambda module, args: None)  # e.g. an SBD adapter's gate
    assert static._guard_filter(model) == {}
    handle.remove()


@pytest.mark.parametrize("before", [None, "0"])
def test_sdpa_gqa_trace_restores_the_environment(monkeypatch, before):
    import os

    if before is None:
        monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    else:
        monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", before)
    with pytest.raises(RuntimeError):
        with static._sdpa_gqa():
            assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "1"
            raise RuntimeError("a failed compile")
    assert os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA") == before
