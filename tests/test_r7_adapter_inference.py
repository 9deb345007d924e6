"""The gated adapter's decoding path (sbd_exact.md §3): without gradients every row's gated value
is computed and selected where the input id is the mask token (a full-rank delta through the
cached merged weight W + ΔW), with no gather and no host sync; with gradients (training) the
delta is gathered onto the mask rows. Both give the base model's values bit for bit on every
other row, and the same block-mode values on mask rows up to float rounding."""

from __future__ import annotations

import pytest
import torch

import unmask
from conftest import tiny_llama, tiny_qwen3
from test_sbd_adapter import _stories_adapter
from unmask.compat import attention_mask, forward, new_cache
from unmask.decode.engine import static
from unmask.masks import as_4d, sbd_inference_mask
from unmask.models.sbd_adapter import AdapterSpec, GatedLinear, attach

V = 64
FACTORIES = {"llama": tiny_llama, "qwen3": tiny_qwen3}


def _adapted(family: str, rank: int | None, seed: int = 0):
    base = FACTORIES[family](vocab=V, seed=seed, attn_implementation="sdpa")
    model = FACTORIES[family](vocab=V, seed=seed, attn_implementation="sdpa")
    ad = attach(model, AdapterSpec(rank=rank, mask_token_id=V, base_vocab=V))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in ad.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return base, model, ad


def _block_forward(model, grad: bool, block_id: int = V):
    """A causal prefix of 10 tokens + a block of 4 ``block_id`` (the mask: sbd.md §1), batch 2 ->
    logits (2, 14, V + 1) (V for the base). The prefix rows never see the block."""
    B, P, K = 2, 10, 4
    ids = torch.cat([torch.randint(3, V, (B, P), generator=torch.Generator().manual_seed(3)),
                     torch.full((B, K), block_id)], dim=1)
    pos = torch.arange(P + K).expand(B, -1)
    mask = attention_mask(model, as_4d(sbd_inference_mask(0, P, K), B))
    with torch.set_grad_enabled(grad):
        return forward(model, ids, position_ids=pos, attention_mask=mask, cache=new_cache(model)).detach()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("rank", [None, 4])
def test_decoding_path_equals_training_path(family, rank):
    base, model, _ = _adapted(family, rank)
    decoding, training = _block_forward(model, grad=False), _block_forward(model, grad=True)
    assert torch.equal(decoding[:, :10], training[:, :10])  # prefix rows: the base's arithmetic in both
    assert torch.equal(decoding[:, :10, :V], _block_forward(base, grad=False, block_id=3)[:, :10])
    torch.testing.assert_close(decoding[:, 10:], training[:, 10:], rtol=1e-5, atol=1e-5)
    assert (decoding[:, 10:] - _block_forward(model, grad=False, block_id=3)[:, 10:]).abs().max() > 1e-2


def test_merged_weight_follows_every_change_of_the_adapter():
    _, model, ad = _adapted("llama", rank=None)
    before = _block_forward(model, grad=False)
    layer = next(m for m in model.modules() if isinstance(m, GatedLinear))
    cached = layer.merged_weight()
    with torch.no_grad():
        for p in ad.parameters():
            p.mul_(-2.0)  # in place, as an optimizer step or load_state_dict does
    after = _block_forward(model, grad=False)
    assert not torch.equal(layer.merged_weight(), cached)
    torch.testing.assert_close(layer.merged_weight(), layer.base.weight + layer.delta)
    torch.testing.assert_close(after, _block_forward(model, grad=True), rtol=1e-5, atol=1e-5)
    assert torch.equal(before[:, :10, :V], after[:, :10, :V])
    assert not torch.equal(before[:, 10:], after[:, 10:])


def test_no_mask_token_skips_the_delta_and_syncs_nothing(monkeypatch):
    base, model, _ = _adapted("llama", rank=None)
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(4))
    calls = []
    monkeypatch.setattr(GatedLinear, "merged_weight", lambda self: calls.append(1) or self.base.weight + self.delta)
    with torch.no_grad():
        got = forward(model, ids, position_ids=torch.arange(9).expand(2, -1), cache=new_cache(model))
        ref = forward(base, ids, position_ids=torch.arange(9).expand(2, -1), cache=new_cache(base))
    assert torch.equal(got[..., :V], ref) and not calls


def test_adapter_hooks_keep_tensor_guards_only_and_a_foreign_hook_keeps_every_guard():
    _, model, _ = _adapted("llama", rank=4)
    assert static._guard_filter(model)  # the gate's hooks depend on the call's input_ids alone
    handle = model.model.register_forward_pre_hook(lambda module, args: None)
    assert static._guard_filter(model) == {}
    handle.remove()
    assert static._guard_filter(model)


def test_compiled_adapter_decoding_equals_eager_and_the_base(tmp_path, stories):
    """stories260K + a random rank-4 adapter: lossless SBD eager, on the static cache and compiled
    give stories260K's own greedy tokens, with the same forwards in all three."""
    bundle = unmask.load("stories260K", adapter=str(_stories_adapter(tmp_path, seed=5)[2]))
    prompts = ["Once upon a time", "The little dog"]
    want = unmask.generate(prompts, stories, "ar", max_new_tokens=24).tokens
    runs = [unmask.generate(prompts, bundle, "sbd", verify=True, block_size=4, max_new_tokens=24, **opts)
            for opts in ({}, {"static": True}, {"compile": True})]
    for run in runs:
        assert run.tokens == want
        assert run.stats.nfe_per_row == runs[0].stats.nfe_per_row


def test_an_adapter_made_in_inference_mode_decodes_like_the_base(stories):
    """Weights loaded inside ``torch.inference_mode`` keep no version counter: the merged weight
    is then computed per call instead of cached, in and out of inference mode."""
    want = unmask.generate("Once upon a time", stories, "ar", max_new_tokens=16).tokens
    with torch.inference_mode():
        bundle = unmask.load("stories260K", adapter="sbd")
        assert unmask.generate("Once upon a time", bundle, "sbd", verify=True, max_new_tokens=16).tokens == want
    assert unmask.generate("Once upon a time", bundle, "sbd", verify=True, max_new_tokens=16).tokens == want


def test_a_fused_optimizer_step_and_a_data_edit_never_leave_a_stale_merged_weight():
    """A fused optimizer updates parameters without bumping their version counters; every forward
    with gradients drops the cache. Edits through ``.data`` are covered by ``refresh()``."""
    _, model, ad = _adapted("llama", rank=None)
    layer = next(m for m in model.modules() if isinstance(m, GatedLinear))
    _block_forward(model, grad=False)  # fills the cache
    opt = torch.optim.AdamW(ad.parameters(), lr=0.1, fused=True)
    ids = torch.tensor([[5, 6, 7, V, V, V]])
    model(input_ids=ids).logits.square().mean().backward()
    opt.step()
    torch.testing.assert_close(layer.merged_weight(), layer.base.weight + layer.delta)
    torch.testing.assert_close(_block_forward(model, grad=False), _block_forward(model, grad=True),
                               rtol=1e-5, atol=1e-5)
    layer.delta.data.zero_()
    ad.refresh()
    assert torch.equal(layer.merged_weight(), layer.base.weight)
