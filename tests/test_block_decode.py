"""SingleBD ``block`` decoder: exact block KV cache, store modes, NFE accounting, batching (multiblock.md §1)."""

from __future__ import annotations


import pytest
import torch
from conftest import assert_batch_equals_single_rows, tiny_bundle, tiny_llama, tiny_qwen3

from unmask.compat import attention_mask, forward, new_cache
from unmask.decode import DECODERS, default_decoder, spec_for
from unmask.decode.blocks.single import SPEC
from unmask.errors import UnmaskError
from unmask.masks import as_4d, block_causal_mask
from unmask.models.mask_token import add_mask_token

FACTORIES = {"llama": tiny_llama, "qwen3": tiny_qwen3}


def bd_bundle(arch="llama", impl="eager", seed=0, B=4, **overrides):
    model = FACTORIES[arch](vocab=64, seed=seed, attn_implementation=impl, **overrides)
    mask_id = add_mask_token(model)
    bundle = tiny_bundle(model, kind="block-diffusion", mask_token_id=mask_id)
    bundle.block_size = B
    return bundle


def uncached_logits(bundle, seq: list[int], B: int) -> torch.Tensor:
    """One uncached block-causal forward over the whole sequence (positions from 0) -> (L, V)."""
    model = bundle.model
    mask = as_4d(block_causal_mask(len(seq), B), 1)  # (1, 1, L, L)
    return forward(model, torch.tensor([seq]), position_ids=torch.arange(len(seq))[None],
                   attention_mask=attention_mask(model, mask))[0]


def check_against_uncached(bundle, prompt, final, seen, B):
    for state in seen:
        start = int(state["positions"][0, 0])  # first query position of this forward
        window = state["inp"][0].tolist()
        seq = final[:start] + window
        want = uncached_logits(bundle, seq, B)[-B:, :-1]  # the last block; the mask column is suppressed
        got = state["logits"][0, :, :-1]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("store", ["separate", "fused"])
def test_cached_block_logits_equal_uncached_block_causal_forward(arch, impl, store):
    bundle = bd_bundle(arch, impl)
    prompt = [1, 5, 9, 12, 7]  # one whole prompt block, a tail of 1 in the first decoded block
    seen = []
    out = DECODERS["block"].decode(bundle, [prompt], max_new_tokens=13, tau=0.5, store=store, on_forward=seen.append)
    final = prompt + out.tokens[0]
    assert len(out.tokens[0]) == 13 and len(seen) >= 8
    assert any(s["slots"] == 2 for s in seen) == (store == "fused")
    check_against_uncached(bundle, prompt, final, seen, 4)


@pytest.mark.parametrize("prompt", [[1, 5, 9], [1, 5, 9, 12], [1, 5, 9, 12, 7, 8, 3, 4]])
def test_prompt_alignment_short_whole_and_multi_block_prompts(prompt):
    bundle = bd_bundle("llama", "sdpa")
    seen = []
    out = DECODERS["block"].decode(bundle, [prompt], max_new_tokens=6, tau=0.5, on_forward=seen.append)
    n_full = len(prompt) // 4
    assert int(seen[0]["positions"][0, 0]) == n_full * 4  # the first decoded block starts at a block boundary
    assert seen[0]["past"] == n_full * 4  # only whole prompt blocks were prefilled
    assert seen[0]["inp"][0, : len(prompt) % 4].tolist() == prompt[n_full * 4:]  # the tail sits in the block
    check_against_uncached(bundle, prompt, prompt + out.tokens[0], seen, 4)


def test_cache_after_each_store_equals_the_block_causal_prefill_of_the_prefix():
    bundle = bd_bundle("qwen3", "eager")
    prompt = [1, 4, 8, 15, 16, 3]
    stored = []
    out = DECODERS["block"].decode(bundle, [prompt], max_new_tokens=11, tau=0.6,
                       on_forward=lambda s: stored.append(s) if s["stored"] else None)
    final = prompt + out.tokens[0]
    assert len(stored) == 3  # positions 6..16: blocks 1..3 are stored, block 4 (the last) is not
    for s in stored:
        n_ctx = int(s["positions"][0, -1]) + 1  # the cache now ends with the stored block
        ref = new_cache(bundle.model)
        mask = as_4d(block_causal_mask(n_ctx, 4), 1)
        forward(bundle.model, torch.tensor([final[:n_ctx]]), position_ids=torch.arange(n_ctx)[None],
                attention_mask=attention_mask(bundle.model, mask), cache=ref)
        for (k, v), layer in zip(s["cache"], ref.layers):
            assert k.shape[-2] == n_ctx
            torch.testing.assert_close(k, layer.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, layer.values, atol=1e-5, rtol=1e-5)


class ScriptedBD(torch.nn.Module):
    """A tiny Llama (for its cache) whose logits are scripted: position p predicts ``token(p)`` with
    probability ``conf(p)`` (before the mask column is suppressed)."""

    def __init__(self, conf, token=lambda p: (p * 7) % 50 + 3):
        super().__init__()
        self.inner = tiny_llama(vocab=64)
        self.config = self.inner.config
        self.conf, self.token = conf, token

    def forward(self, input_ids, position_ids, cache=None, logits_to_keep=0, **kw):
        out = self.inner(input_ids=input_ids, position_ids=position_ids, cache=cache, logits_to_keep=logits_to_keep,
                         **kw)
        pos = position_ids[:, -out.logits.shape[1]:]  # (B, n)
        V = out.logits.shape[-1]
        token = torch.tensor([[self.token(p) for p in row] for row in pos.tolist()], dtype=torch.long)  # (B, n)
        conf = torch.tensor([[self.conf(p) for p in row] for row in pos.tolist()], dtype=torch.float32)  # (B, n)
        logits = torch.full(out.logits.shape, -20.0)
        logits.scatter_(-1, token[..., None], (torch.log(conf / (1 - conf) * (V - 1)) - 20.0)[..., None])
        out.logits = logits
        return out


def scripted_bundle(conf, B=4, **kw):
    bundle = tiny_bundle(ScriptedBD(conf, **kw), kind="block-diffusion", mask_token_id=63)
    bundle.block_size = B
    return bundle


def test_nfe_counts_denoising_and_store_forwards():
    bundle = scripted_bundle(lambda p: 0.99 if p % 2 == 0 else 0.5)
    prompt = [1, 2, 3, 4]
    out = DECODERS["block"].decode(bundle, [prompt], max_new_tokens=8, tau=0.9)
    # block 4..7: step 1 commits 4 and 6, then 5, then 7 -> 3 forwards; one store; block 8..11 the same.
    assert out.tokens[0] == [(p * 7) % 50 + 3 for p in range(4, 12)]
    assert out.stats.extra["row_extra"][0]["accepts"] == [2, 1, 1, 2, 1, 1]
    assert out.stats.extra["store_forwards"] == 1 and out.stats.nfe == 7 and out.stats.nfe_per_row == [7]
    fused = DECODERS["block"].decode(bundle, [prompt], max_new_tokens=8, tau=0.9, store="fused")
    assert fused.tokens == out.tokens and fused.stats.nfe == 6 and fused.stats.extra["store_forwards"] == 0
    assert fused.stats.tpf == pytest.approx(8 / 6)


def test_tail_and_cap_positions_are_never_decoded():
    bundle = scripted_bundle(lambda p: 0.99)
    out = DECODERS["block"].decode(bundle, [[1, 2, 3, 4, 5, 6]], max_new_tokens=3, tau=0.9)
    # positions 6, 7 (block 1, after the prompt tail) then 8 (block 2; 9..11 stay masks): 2 blocks
    assert out.tokens[0] == [(p * 7) % 50 + 3 for p in (6, 7, 8)]
    assert out.stats.nfe == 3 and out.stats.extra["row_extra"][0]["accepts"] == [2, 1]


def test_stop_token_ends_the_row_after_its_block():
    bundle = scripted_bundle(lambda p: 0.99)
    stop = (6 * 7) % 50 + 3
    out = DECODERS["block"].decode(bundle, [[1, 2, 3, 4]], max_new_tokens=12, tau=0.9, stop_token_ids=(stop,))
    assert out.tokens[0] == [(4 * 7) % 50 + 3, (5 * 7) % 50 + 3]
    assert out.stats.nfe == 1 and out.stats.extra["store_forwards"] == 0


def test_any_policy_works():
    bundle = bd_bundle("llama", "sdpa")
    out = DECODERS["block"].decode(bundle, [[1, 3, 5, 7]], max_new_tokens=8, policy="entropy-bound", gamma=float("inf"))
    assert out.stats.nfe == 3 and out.stats.extra["accepts"] == {4: 2}  # one forward per block + one store
    out = DECODERS["block"].decode(bundle, [[1, 3, 5, 7]], max_new_tokens=8, policy="top-k", tokens_per_step=2)
    assert out.stats.extra["row_extra"][0]["accepts"] == [2, 2, 2, 2] and out.stats.extra["policy"] == "top-k"


@pytest.mark.parametrize("store", ["separate", "fused"])
def test_batch_of_left_padded_rows_equals_single_rows(store):
    bundle = bd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    prompts = [[1] + list(range(3, 3 + n)) for n in (1, 4, 2, 9, 5, 3, 7, 6)]
    assert_batch_equals_single_rows(DECODERS["block"].decode, bundle, prompts, max_new_tokens=11, tau=0.7, stop_token_ids=(2,),
                                    store=store)


def test_registry_and_bad_inputs():
    assert default_decoder("block-diffusion") == "block"
    assert spec_for("block", "block-diffusion") is SPEC and "store" in {k.name for k in SPEC.knobs()}
    with pytest.raises(UnmaskError, match="kind block-diffusion"):
        spec_for("block", "causal")
    with pytest.raises(UnmaskError, match="kind block-diffusion"):
        spec_for("multiblock", "sbd")
    bundle = bd_bundle()
    with pytest.raises(UnmaskError, match="disagrees with the checkpoint's block size 4"):
        DECODERS["block"].decode(bundle, [[1, 2]], max_new_tokens=4, block_size=8)
    assert DECODERS["block"].decode(bundle, [[1, 2]], max_new_tokens=4, block_size=4).stats.extra["block_size"] == 4
    with pytest.raises(UnmaskError, match="store"):
        DECODERS["block"].decode(bundle, [[1, 2]], max_new_tokens=4, store="later")
    with pytest.raises(UnmaskError, match="tau"):
        DECODERS["block"].decode(bundle, [[1, 2]], max_new_tokens=4, tau=1.5)
    bundle.block_size = None
    with pytest.raises(UnmaskError, match="records no block size"):
        DECODERS["block"].decode(bundle, [[1, 2]], max_new_tokens=4)
    assert DECODERS["block"].decode(bundle, [[1, 2]], max_new_tokens=4, block_size=2).stats.extra["block_size"] == 2
    bundle.model.config.block_size = 4  # a remote-code config that names its block size
    with pytest.raises(UnmaskError, match="block size 4"):
        DECODERS["block"].decode(bundle, [[1, 2]], max_new_tokens=4, block_size=2)
    sbd = tiny_bundle(tiny_llama(), kind="sbd", mask_token_id=63)
    with pytest.raises(UnmaskError, match="block-diffusion"):
        DECODERS["block"].decode(sbd, [[1, 2]], max_new_tokens=4, block_size=4)
