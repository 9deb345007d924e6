"""The fast path of the diffusion and early-bird decoders (issue #13): ``static=True`` (the
preallocated ``StaticKV`` and fixed-shape forwards, run eagerly) gives the eager dynamic run's
tokens, NFE and per-row counts for every cache mode; ``compile=True`` gives the eager tokens
(one small test per decoder: compiling costs seconds per shape); padding buckets are bounded."""

from __future__ import annotations

import pytest
import torch
from conftest import prompts_around_a_block, tiny_bundle, tiny_llama, tiny_qwen3

import unmask
from unmask.decode import DECODERS
from unmask.decode.dllm.cache import BUCKET_STEP, bucket
from unmask.errors import UnmaskError
from unmask.models.mask_token import add_mask_token
from unmask.routers import LBSConfig, LBSRouter, LPSConfig, LPSRouter
from unmask.sampling import Sampling

STORIES = ["Once upon a time", "Lily wanted to play with her big red ball", "Tom", "The sun was"]


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


@pytest.fixture(scope="module")
def stories():
    bundle = unmask.load("stories260K-dlm")
    return bundle, [bundle.encode(t) for t in STORIES]


def same(a, b):
    """Identical tokens, NFE, per-row NFE and per-row token counts."""
    assert a.tokens == b.tokens
    assert a.stats.nfe == b.stats.nfe
    assert a.stats.nfe_per_row == b.stats.nfe_per_row
    assert a.stats.tokens_per_row == b.stats.tokens_per_row


def tiny_dllm(factory, shift):
    model = factory(vocab=64, seed=0, attn_implementation="eager", initializer_range=0.4)
    bundle = tiny_bundle(model, kind="masked-diffusion", mask_token_id=add_mask_token(model))
    bundle.logit_shift = shift
    return bundle


# -- diffusion -------------------------------------------------------------------------------------------

POLICIES = [dict(policy="top-k", steps=8), dict(policy="threshold"), dict(policy="factor", factor=1.0)]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_diffusion_static_equals_dynamic_on_stories(stories, cache):
    bundle, prompts = stories
    for policy in POLICIES:
        for rows in (prompts[1:2], prompts):  # batch 1 and 4 (4 is left-padded)
            kw = dict(max_new_tokens=32, block_size=8, cache=cache, stop_token_ids=bundle.stop_token_ids, **policy)
            eager = DECODERS["diffusion"].decode(bundle, rows, **kw)
            static = DECODERS["diffusion"].decode(bundle, rows, static=True, **kw)
            same(static, eager)
            assert static.stats.extra["compiled"] is False and eager.stats.extra["compiled"] is False
            assert ("static_cache" in static.stats.extra) == (cache != "none")
            assert "static_cache" not in eager.stats.extra


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_diffusion_static_equals_dynamic_when_sampling(stories, cache):
    bundle, prompts = stories
    kw = dict(max_new_tokens=32, block_size=8, cache=cache, sampling=Sampling(temperature=0.8, seed=7))
    same(DECODERS["diffusion"].decode(bundle, prompts, static=True, **kw), DECODERS["diffusion"].decode(bundle, prompts, **kw))


@pytest.mark.parametrize("factory, shift", [(tiny_llama, 0), (tiny_qwen3, 1)])
def test_diffusion_static_equals_dynamic_on_a_tiny_eager_model(factory, shift):
    bundle = tiny_dllm(factory, shift)
    prompts = [[1, 5, 9, 3, 11, 12], [1, 7], [1, 20, 21, 22]]
    for cache in ("none", "prefix", "dual"):
        for policy in (dict(policy="threshold", tau=0.5), dict(policy="top-k", steps=6)):
            kw = dict(max_new_tokens=24, block_size=8, cache=cache, refresh_every=3 if cache == "dual" else None,
                      **policy)
            same(DECODERS["diffusion"].decode(bundle, prompts, static=True, **kw), DECODERS["diffusion"].decode(bundle, prompts, **kw))


def test_diffusion_compiled_equals_eager(stories):
    """The dual cache: the compiled window step on the StaticKV (one graph; the refresh is eager)."""
    bundle, prompts = stories
    kw = dict(max_new_tokens=32, block_size=8, cache="dual", stop_token_ids=bundle.stop_token_ids)
    # prompts of 1, B + 1, 2, B - 1, B and B + 1 tokens, then the long ones, in turn (issue 48 item 1)
    for rows in prompts_around_a_block(bundle, 8, 2) + [prompts[:2]]:
        eager = DECODERS["diffusion"].decode(bundle, rows, **kw)
        fast = DECODERS["diffusion"].decode(bundle, rows, compile=True, **kw)
        same(fast, eager)
        assert fast.stats.extra["compiled"] is True and fast.stats.extra["static_cache"] == 128


# -- early-bird ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_early_bird_static_equals_dynamic_on_stories(stories, cache):
    """The shipped LBS and LPS routers; windows of every length are padded to buckets."""
    bundle, prompts = stories
    for lps in (False, True):
        for rows in (prompts[:1], prompts):
            kw = dict(max_new_tokens=16, cache=cache, lps=lps, stop_token_ids=bundle.stop_token_ids)
            eager = DECODERS["early-bird"].decode(bundle, rows, **kw)
            static = DECODERS["early-bird"].decode(bundle, rows, static=True, **kw)
            same(static, eager)
            assert static.stats.extra["refreshes"] == eager.stats.extra["refreshes"]
            assert ("static_cache" in static.stats.extra) == (cache != "none")


def test_early_bird_static_equals_dynamic_when_sampling(stories):
    bundle, prompts = stories
    kw = dict(max_new_tokens=24, cache="dual", sampling=Sampling(temperature=0.8, seed=3))
    same(DECODERS["early-bird"].decode(bundle, prompts, static=True, **kw), DECODERS["early-bird"].decode(bundle, prompts, **kw))


def test_early_bird_static_equals_dynamic_on_a_tiny_eager_model():
    bundle = tiny_dllm(tiny_llama, 1)
    torch.manual_seed(1)
    lbs = LBSRouter(LBSConfig(gen_length=32, d_base=32, vocab_size=65)).eval()
    torch.manual_seed(2)
    lps = LPSRouter(LPSConfig()).eval()
    prompts = [[1, 5, 9, 3], [1, 7], [1, 2, 3, 4, 5, 6]]
    for cache in ("none", "prefix", "dual"):
        kw = dict(max_new_tokens=32, lbs_router=lbs, lps_router=lps, tau_psi=0.6, block_size=8, l_min=2, g_max=2,
                  cache=cache)
        same(DECODERS["early-bird"].decode(bundle, prompts, static=True, **kw), DECODERS["early-bird"].decode(bundle, prompts, **kw))


def test_early_bird_compiled_equals_eager(stories):
    """No cache: the compiled canvas forward (one graph)."""
    bundle, prompts = stories
    kw = dict(max_new_tokens=32, cache="none", stop_token_ids=bundle.stop_token_ids)
    # prompts of 1, 9, 2, 7, 8 and 9 tokens, each beside the longest one (one canvas length: every
    # canvas length is a graph of its own), then the long ones, in turn (issue 48 item 1)
    longest = max(prompts, key=len)
    for rows in [[batch[0], longest] for batch in prompts_around_a_block(bundle, 8, 2)] + [[longest, prompts[0]]]:
        eager = DECODERS["early-bird"].decode(bundle, rows, **kw)
        fast = DECODERS["early-bird"].decode(bundle, rows, compile=True, **kw)
        same(fast, eager)
        assert fast.stats.extra["compiled"] is True


# -- shapes and refusals ---------------------------------------------------------------------------------


def test_window_buckets_are_few_and_pad_little():
    for q_max in (1, 9, 40, 64, 65, 129, 257, 513):
        shapes = {bucket(q, q_max) for q in range(1, q_max + 1)}
        assert len(shapes) <= 6 + q_max // BUCKET_STEP
        for q in range(1, q_max + 1):
            assert q <= bucket(q, q_max) <= q_max
            assert bucket(q, q_max) - q < (16 if q <= BUCKET_STEP else BUCKET_STEP)
    assert bucket(33, 257) == 48 and bucket(65, 257) == 128 and bucket(200, 257) == 256 and bucket(257, 257) == 257


def test_fast_path_refusals(stories, monkeypatch):
    bundle, prompts = stories
    with pytest.raises(UnmaskError, match="compile/static do not apply to --schedule dream"):
        DECODERS["diffusion"].decode(bundle, prompts[:1], max_new_tokens=8, schedule="dream", compile=True)
    with pytest.raises(UnmaskError, match="static must be true or false"):
        DECODERS["diffusion"].decode(bundle, prompts[:1], max_new_tokens=8, static="yes")
    with pytest.raises(UnmaskError, match="compile must be true or false"):
        DECODERS["early-bird"].decode(bundle, prompts[:1], max_new_tokens=8, compile=1)
    monkeypatch.setattr("unmask.decode.dllm.cache.supports_cache", lambda bundle: False)  # a remote-code model
    with pytest.raises(UnmaskError, match="compile needs a transformers-native model"):
        DECODERS["diffusion"].decode(bundle, prompts[:1], max_new_tokens=8, compile=True)
    with pytest.raises(UnmaskError, match="static needs a transformers-native model"):
        DECODERS["early-bird"].decode(bundle, prompts[:1], max_new_tokens=8, static=True)
