"""The fast path of ``block`` and ``multiblock`` (issue #13): the preallocated static KV cache, eager
and compiled, gives the dynamic cache's tokens, NFE and accepts (STYLE.md 14: static against
dynamic, compiled against eager; multiblock.md §1.2, §3.6)."""

from __future__ import annotations

import pytest
import torch
from conftest import prompts_around_a_block
from test_block_decode import bd_bundle

import unmask
from unmask.decode import DECODERS
from unmask.decode.multiblock.window import window_mask
from unmask.sampling import Sampling

TEXTS = ["Once upon a time", "The cat sat on the", "Lily and Ben went to the park", "One day",
         "Tom had a red ball and", "She", "The sun was hot and the", "A little bird"]
SAMPLED = Sampling(temperature=0.9, top_k=20, seed=5)

block, multiblock = DECODERS["block"], DECODERS["multiblock"]


@pytest.fixture(scope="module")
def bd():
    return unmask.load("stories260K-bd")


@pytest.fixture(scope="module")
def mbd():
    return unmask.load("stories260K-mbd")


def _prompts(bundle, batch):
    return [bundle.encode(t) for t in TEXTS[:batch]]


def _same(a, b):
    assert a.tokens == b.tokens
    assert a.stats.nfe == b.stats.nfe
    assert a.stats.nfe_per_row == b.stats.nfe_per_row
    assert a.stats.tokens_per_row == b.stats.tokens_per_row
    assert a.stats.extra["accepts"] == b.stats.extra["accepts"]
    assert [r["accepts"] for r in a.stats.extra["row_extra"]] == [r["accepts"] for r in b.stats.extra["row_extra"]]


def _static_equals_dynamic(decoder, bundle, prompts, **kw):
    dynamic = decoder.decode(bundle, prompts, **kw)
    fast = decoder.decode(bundle, prompts, static=True, **kw)
    _same(dynamic, fast)
    assert "compiled" not in dynamic.stats.extra and "static_cache" not in dynamic.stats.extra
    assert fast.stats.extra["compiled"] is False and fast.stats.extra["static_cache"] % 128 == 0
    return dynamic, fast


BLOCK_CASES = {
    "separate-b1": ({}, 1, Sampling()),
    "separate-b8": ({}, 8, Sampling()),
    "fused-b8": ({"store": "fused"}, 8, Sampling()),
    "fused-b8-sampled": ({"store": "fused"}, 8, SAMPLED),
    "sdar-schedule-b8": ({"schedule": "sdar"}, 8, Sampling()),
}


@pytest.mark.parametrize("case", BLOCK_CASES)
def test_static_block_equals_dynamic(bd, case):
    opts, batch, sampling = BLOCK_CASES[case]
    dynamic, fast = _static_equals_dynamic(block, bd, _prompts(bd, batch), max_new_tokens=64, sampling=sampling,
                                           stop_token_ids=bd.stop_token_ids, **opts)
    assert fast.stats.extra["store_forwards"] == dynamic.stats.extra["store_forwards"]


MULTI_CASES = {
    "slots1-b8": ({"slots": 1}, 8, Sampling()),
    "default-b1": ({}, 1, Sampling()),
    "default-b8": ({}, 8, Sampling()),
    "default-b8-sampled": ({}, 8, SAMPLED),
    "slots3-eager-add-b8": ({"slots": 3, "tau_add": 0.5, "tau_semi": 0.5, "tau_m2t": 0.8}, 8, Sampling()),
    "t2t-b1": ({"tau_m2t": 0.7, "tau_t2t": 0.9}, 1, Sampling()),
}


@pytest.mark.parametrize("case", MULTI_CASES)
def test_static_multiblock_equals_dynamic(mbd, case):
    opts, batch, sampling = MULTI_CASES[case]
    dynamic, fast = _static_equals_dynamic(multiblock, mbd, _prompts(mbd, batch), max_new_tokens=64,
                                           sampling=sampling, stop_token_ids=mbd.stop_token_ids, **opts)
    assert fast.stats.extra["mean_running_set"] == dynamic.stats.extra["mean_running_set"]
    assert fast.stats.extra["edits"] == dynamic.stats.extra["edits"]


@pytest.mark.parametrize("decoder,name", [(block, "bd"), (multiblock, "mbd")])
def test_static_stops_at_a_stop_string(decoder, name, request):
    bundle = request.getfixturevalue(name)
    _, fast = _static_equals_dynamic(decoder, bundle, _prompts(bundle, 4), max_new_tokens=64,
                                     stop_token_ids=bundle.stop_token_ids, stop_strings=("the",))
    assert any(n < 64 for n in fast.stats.tokens_per_row)


def test_static_equals_dynamic_on_a_tiny_eager_attention_model():
    # eager attention takes the additive float mask over the whole static cache; prompts of 2, 5 and
    # 12 tokens (no, one and three whole blocks: left padding in the prefill and ragged rows)
    bundle = bd_bundle("qwen3", "eager", seed=3, initializer_range=0.4)
    prompts = [[1, 3], [1, 3, 5, 7, 9], [1] + list(range(3, 14))]
    for store in ("separate", "fused"):
        _static_equals_dynamic(block, bundle, prompts, max_new_tokens=17, tau=0.6, store=store, stop_token_ids=(5,))
    _static_equals_dynamic(multiblock, bundle, prompts, max_new_tokens=17, slots=3, tau_add=0.25, tau_semi=0.5,
                           tau_m2t=0.5, stop_token_ids=(5,))


@pytest.mark.parametrize("decoder,opts", [(block, {"store": "fused"}), (multiblock, {"slots": 2})])
def test_static_on_forward_sees_the_dynamic_logits_and_cache(decoder, opts):
    bundle = bd_bundle("llama", "sdpa", seed=1)
    prompts = [[1, 5, 9, 12, 7], [1, 3]]
    seen = {False: [], True: []}
    for static in (False, True):
        decoder.decode(bundle, prompts, max_new_tokens=10, static=static, on_forward=seen[static].append, **opts)
    assert len(seen[False]) == len(seen[True]) > 3
    for d, s in zip(seen[False], seen[True]):
        assert d["past"] == s["past"]
        torch.testing.assert_close(s["logits"], d["logits"], atol=1e-5, rtol=1e-5)
        for (dk, dv), (sk, sv) in zip(d["cache"], s["cache"]):
            assert dk.shape == sk.shape  # the static cache's live part: (R, H, length, D)
            torch.testing.assert_close(sk, dk, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(sv, dv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flag", ["compile", "static"])
def test_cache_flags_must_be_booleans(bd, flag):
    for decoder in (block, multiblock):
        with pytest.raises(unmask.UnmaskError, match=f"{flag} must be True or False"):
            decoder.decode(bd, [[1, 2]], max_new_tokens=2, **{flag: "yes"})


def _compiled_equals_eager(decoder, bundle, **kw):
    """Prompts of 1, B + 1, 2, B - 1, B and B + 1 tokens, then the long ones, in turn on ONE model:
    a compiled graph traced on a prompt shorter than a block, or run after one, gives eager's tokens
    (issue 48 item 1: a graph traced before the static cache existed poisoned every later call)."""
    for prompts in prompts_around_a_block(bundle, 8, 2) + [_prompts(bundle, 2)]:
        compiled = decoder.decode(bundle, prompts, compile=True, **kw)
        _same(decoder.decode(bundle, prompts, **kw), compiled)
        assert compiled.stats.extra["compiled"] is True


def test_compiled_block_equals_eager(bd):
    # the one compiled block test: two query shapes (B and the fused 2B), batch 2
    assert bd.block_size == 8
    _compiled_equals_eager(block, bd, max_new_tokens=32, stop_token_ids=bd.stop_token_ids, store="fused")


def test_compiled_multiblock_equals_eager(mbd):
    # the one compiled multiblock test: one query shape (R, N_buf·B), batch 2
    assert mbd.block_size == 8
    _compiled_equals_eager(multiblock, mbd, max_new_tokens=32, stop_token_ids=mbd.stop_token_ids)


def test_compact_slides_each_rows_valid_keys_right_in_order():
    from conftest import tiny_llama

    from unmask.decode.engine.kv import StaticKV, compact

    kv = StaticKV(tiny_llama(), 2, 16)
    kv.forward(torch.randint(3, 60, (2, 10)), torch.arange(10).expand(2, 10), None, compiled=False)
    key_valid = torch.zeros((2, kv.capacity), dtype=torch.bool)
    key_valid[0, [1, 2, 5, 7, 9]] = True  # 5 valid keys
    key_valid[1, [0, 4, 8]] = True  # 3 valid keys
    before = [(k.clone(), v.clone()) for k, v in kv.layers()]
    key_valid = compact(kv, key_valid[:, : kv.length], 5)  # 5: the most valid keys of a row
    assert kv.length == 5
    assert key_valid.tolist() == [[True] * 5, [False, False, True, True, True]]
    for (k0, v0), (k1, v1) in zip(before, kv.layers()):
        for old, new in ((k0, k1), (v0, v1)):  # (R, H, n, D)
            assert torch.equal(new[0], old[0][:, [1, 2, 5, 7, 9]])
            assert torch.equal(new[1, :, 2:], old[1][:, [0, 4, 8]])


def test_compacted_static_multiblock_equals_dynamic_on_eager_attention():
    # rows store blocks in different steps: the static cache (sized for the longest row) fills with
    # holes and is compacted, the additive eager mask following the moved keys
    bundle = bd_bundle("qwen3", "eager", seed=3, initializer_range=0.4)
    prompts = [[1, 3], [1, 3, 5, 7, 9], [1] + list(range(3, 14))]
    pasts = []
    _, fast = _static_equals_dynamic(multiblock, bundle, prompts, max_new_tokens=100, slots=3, tau_add=0.25,
                                     tau_semi=0.5, tau_m2t=0.5)
    multiblock.decode(bundle, prompts, max_new_tokens=100, slots=3, tau_add=0.25, tau_semi=0.5, tau_m2t=0.5,
                      static=True, on_forward=lambda s: pasts.append(s["past"]))
    assert fast.stats.extra["static_cache"] == 128 and any(b < a for a, b in zip(pasts, pasts[1:]))


def test_window_mask_equals_the_padded_block_buffer_mask():
    from unmask.masks import as_4d, block_buffer_mask, with_key_padding

    gen = torch.Generator().manual_seed(0)
    for past in (0, 3, 8, 13):
        for n_slots, B in ((1, 4), (2, 4), (3, 2), (1, 1)):
            q = n_slots * B
            key_valid = torch.rand((3, past + q + 5), generator=gen) < 0.6  # (R, C): columns past the window ignored
            key_valid[:, past: past + q] = True
            want = with_key_padding(as_4d(block_buffer_mask(past, n_slots, B), 3), key_valid[:, : past + q])
            assert torch.equal(window_mask(key_valid, past, n_slots, B), want)
