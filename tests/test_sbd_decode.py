"""SBD decoder: exact KV cache, accounting, batching (spec/sbd.md §4)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_bundle, tiny_llama, tiny_qwen3

import unmask
from unmask.compat import attention_mask, forward, new_cache
from unmask.decode import spec_for
from unmask.errors import UnmaskError
from unmask.masks import as_4d, causal_mask, sbd_inference_mask
from unmask.models.mask_token import add_mask_token
from unmask.decode import DECODERS

FACTORIES = {"llama": tiny_llama, "qwen3": tiny_qwen3}


def sbd_bundle(arch="llama", impl="eager", seed=0, **overrides):
    model = FACTORIES[arch](vocab=64, seed=seed, attn_implementation=impl, **overrides)
    mask_id = add_mask_token(model)
    return tiny_bundle(model, kind="sbd", mask_token_id=mask_id)


def uncached_block_logits(bundle, seq: list[int], n_block: int) -> torch.Tensor:
    """Fig. 10: one uncached forward, causal prefix, bidirectional final block. -> (n_block, V)."""
    model = bundle.model
    ids = torch.tensor([seq])
    c = len(seq) - n_block
    mask = as_4d(sbd_inference_mask(0, c, n_block), 1)  # (1, 1, L, L)
    pos = torch.arange(len(seq))[None]
    logits = forward(model, ids, position_ids=pos, attention_mask=attention_mask(model, mask))
    return logits[0, c:]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_cached_block_logits_equal_uncached_forward(arch, impl):
    bundle = sbd_bundle(arch, impl)
    prompt = [1, 5, 9, 12, 7]
    seen = []
    out = DECODERS["sbd"].decode(bundle, [prompt], max_new_tokens=14, block_size=4, gamma=0.5,
                     on_forward=lambda s: seen.append(s))
    assert len(seen) >= 4  # several blocks (incl. a short tail block) and several steps per block
    final = prompt + out.tokens[0]
    assert len(out.tokens[0]) == 14
    for state in seen:
        start, block = state["start"], state["block"][0].tolist()
        seq = final[: len(prompt) + start] + block
        want = uncached_block_logits(bundle, seq, len(block))[:, :-1]  # mask column is suppressed
        got = state["logits"][0, :, :-1]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cache_after_each_block_equals_causal_prefill():
    bundle = sbd_bundle("llama", "eager")
    prompt = [1, 4, 8, 15]
    caches = []
    out = DECODERS["sbd"].decode(bundle, [prompt], max_new_tokens=12, block_size=4, gamma=0.3,
                     on_forward=lambda s: caches.append((s["start"], s["refeed"], s["cache"])) if s["refeed"] else None)
    final = prompt + out.tokens[0]
    assert [c[0] for c in caches] == [4, 8]
    for start, _, layers in caches:
        # after the fused forward + crop the cache holds prompt + every committed block, causally
        n_ctx = len(prompt) + start
        ref = new_cache(bundle.model)
        ids = torch.tensor([final[:n_ctx]])
        mask = as_4d(causal_mask(n_ctx), 1)
        forward(bundle.model, ids, position_ids=torch.arange(n_ctx)[None],
                attention_mask=attention_mask(bundle.model, mask), cache=ref)
        for (k, v), layer in zip(layers, ref.layers):
            assert k.shape[-2] == n_ctx
            torch.testing.assert_close(k, layer.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, layer.values, atol=1e-5, rtol=1e-5)


def test_gamma_zero_commits_one_token_per_forward():
    bundle = sbd_bundle()
    out = DECODERS["sbd"].decode(bundle, [[1, 3, 5], [1, 7]], max_new_tokens=10, block_size=4, gamma=0.0)
    assert out.stats.extra["accepts"] == {1: 20}
    assert out.stats.nfe == 10 and out.stats.nfe_per_row == [10, 10]
    assert out.stats.tpf == pytest.approx(1.0)


def test_block_size_one_matches_one_token_per_forward_any_gamma():
    bundle = sbd_bundle()
    out = DECODERS["sbd"].decode(bundle, [[1, 3, 5]], max_new_tokens=6, block_size=1, gamma=100.0)
    assert out.stats.nfe == 6 and len(out.tokens[0]) == 6


def test_large_gamma_fills_a_block_per_forward_and_counts_nfe():
    bundle = sbd_bundle()
    out = DECODERS["sbd"].decode(bundle, [[1, 3, 5]], max_new_tokens=10, block_size=4, gamma=float("inf"))
    assert out.stats.nfe == 3  # blocks of 4, 4, 2
    assert out.stats.extra["accepts"] == {2: 1, 4: 2}
    assert out.stats.tpf == pytest.approx(10 / 3)


def test_batch_of_eight_equals_eight_single_rows():
    # a peaked random model (large init) so greedy argmax is not decided by 1e-7 noise
    bundle = sbd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    prompts = [[1] + list(range(3, 3 + n)) for n in (1, 4, 2, 9, 5, 3, 7, 6)]
    batch = DECODERS["sbd"].decode(bundle, prompts, max_new_tokens=12, block_size=4, gamma=0.6, stop_token_ids=(2,))
    for i, p in enumerate(prompts):
        single = DECODERS["sbd"].decode(bundle, [p], max_new_tokens=12, block_size=4, gamma=0.6, stop_token_ids=(2,))
        assert single.tokens[0] == batch.tokens[i]
        assert single.stats.nfe_per_row[0] == batch.stats.nfe_per_row[i]


class ScriptedLlama(torch.nn.Module):
    """Wraps a tiny Llama (for its cache) but returns scripted logits: every block position
    predicts ``(position * 7) % 50 + 3`` with confidence ``conf[position % len(conf)]``."""

    def __init__(self, conf):
        super().__init__()
        self.inner = tiny_llama(vocab=64)
        self.config = self.inner.config
        self.conf = conf

    def forward(self, input_ids, position_ids, cache=None, logits_to_keep=0, **kw):
        out = self.inner(input_ids=input_ids, position_ids=position_ids, cache=cache, logits_to_keep=logits_to_keep, **kw)
        pos = position_ids[:, -out.logits.shape[1]:]  # (B, n)
        logits = torch.full(out.logits.shape, -20.0)
        token = (pos * 7) % 50 + 3
        conf = torch.tensor(self.conf)[pos % len(self.conf)]  # (B, n)
        logits.scatter_(-1, token[..., None], torch.log(conf / (1 - conf) * (logits.shape[-1] - 1))[..., None] - 20.0)
        out.logits = logits
        return out


def test_nfe_and_tpf_on_a_scripted_model():
    model = ScriptedLlama([0.99, 0.5])  # even positions confident, odd ones not
    bundle = tiny_bundle(model, kind="sbd", mask_token_id=63)
    out = DECODERS["sbd"].decode(bundle, [[1, 2, 3, 4]], max_new_tokens=8, policy="threshold", tau=0.9, block_size=4)
    # prompt length 4 -> block positions 4..7: 4 and 6 confident. Step 1 commits the top-1 (4) plus 6,
    # step 2 the top-1 of {5, 7}, step 3 the last one: 3 forwards per block, 2 blocks.
    assert out.stats.nfe == 6
    assert out.stats.extra["row_extra"][0]["accepts"] == [2, 1, 1, 2, 1, 1]
    assert out.tokens[0] == [(p * 7) % 50 + 3 for p in range(4, 12)]
    assert out.stats.tpf == pytest.approx(8 / 6)


def test_stop_token_drops_the_rest_of_the_block():
    model = ScriptedLlama([0.99])
    bundle = tiny_bundle(model, kind="sbd", mask_token_id=63)
    stop = (6 * 7) % 50 + 3  # the token predicted at position 6
    out = DECODERS["sbd"].decode(bundle, [[1, 2, 3, 4]], max_new_tokens=12, block_size=4, gamma=100.0, stop_token_ids=(stop,))
    assert out.tokens[0] == [(4 * 7) % 50 + 3, (5 * 7) % 50 + 3]
    assert out.stats.nfe == 1  # stops after the block that committed the stop token


def test_ntp_mode_on_sbd_kind_reproduces_reference():
    bundle = unmask.load("stories260K")
    bundle.mask_token_id = add_mask_token(bundle.model)
    bundle.kind = "sbd"
    out = unmask.generate("Zoo", bundle, "ar", max_new_tokens=56)
    assert out.texts[0].startswith(" was a little girl named Lily. She loved to play outside in the park.")


def test_bad_inputs():
    bundle = sbd_bundle()
    with pytest.raises(UnmaskError, match="block size"):
        DECODERS["sbd"].decode(bundle, [[1, 2]], max_new_tokens=4, block_size=0)
    with pytest.raises(UnmaskError, match="gamma"):
        DECODERS["sbd"].decode(bundle, [[1, 2]], max_new_tokens=4, gamma=-1.0)
    with pytest.raises(UnmaskError, match="context window"):
        DECODERS["sbd"].decode(bundle, [[1, 2]], max_new_tokens=4, block_size=10_000)
    with pytest.raises(UnmaskError, match="kind sbd"):
        spec_for("sbd", "causal")


def test_checkpoint_decode_defaults_apply_unless_overridden():
    bundle = sbd_bundle()
    bundle.meta = {"decode_defaults": {"block_size": 2, "gamma": float("inf")}}
    out = DECODERS["sbd"].decode(bundle, [[1, 3, 5]], max_new_tokens=6)
    assert out.stats.extra["block_size"] == 2 and out.stats.nfe == 3
    out = DECODERS["sbd"].decode(bundle, [[1, 3, 5]], max_new_tokens=6, gamma=0.0)
    assert out.stats.extra["block_size"] == 2 and out.stats.nfe == 6
    out = DECODERS["sbd"].decode(bundle, [[1, 3, 5]], max_new_tokens=6, block_size=3)
    assert out.stats.nfe == 2
