"""SDAR (JetAstra/SDAR: 1.7B/4B/8B-Chat) as a native transformers model (spec/models.md §2.5).

SDAR is Qwen3 trained for block diffusion: the published ``SDARForCausalLM`` has the Qwen3
architecture and parameter names exactly (per-head q/k RMSNorm, no biases, SwiGLU MLP), and
attends block-causally: bidirectional inside a block of ``block_size`` tokens (4 by default,
SGLang's and JetAstra's ``generate.py`` value), causal across blocks (multiblock.md §1.1). Its
remote code needs ``flash_attn`` and transformers 4.x modules, so the model here is
``Qwen3ForCausalLM``; checkpoints load unchanged. Logits are not shifted; the mask id is
151669 (``<|MASK|>``).

The decoders pass their own 4D masks. Without one (or with a 2D padding mask) the forward builds
the block-causal mask itself, for keys at positions 0..kv-1 (the ``DynamicCache`` layout), so a
plain ``model(input_ids)`` is already the published attention pattern.
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config, Qwen3ForCausalLM

ARCHITECTURE = "SDARForCausalLM"
DEFAULT_BLOCK_SIZE = 4
_DROP = ("model_type", "auto_map", "architectures", "is_causal", "attn_implementation")


@strict
class SDARConfig(Qwen3Config):
    """A ``Qwen3Config`` for SDAR with its diffusion ``block_size`` and mask token id."""

    model_type = "sdar"
    block_size: int = DEFAULT_BLOCK_SIZE
    mask_token_id: int | None = None


def default_block_mask(model, input_ids: torch.Tensor, attention_mask, cache, block_size: int,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The block-causal 4D mask (B, 1, q, kv) for a forward without one, in the model backend's
    form; a 2D padding mask ``attention_mask`` (B, kv) is folded in. Blocks follow ``position_ids``
    (B, q) when there is no cache (so left-padded rows keep their own blocks), else key index."""
    from unmask.compat import attention_mask as backend_mask
    from unmask.masks import as_4d, block_causal_mask, with_key_padding

    B, q = input_ids.shape
    past = cache.get_seq_length() if cache is not None else 0
    if past == 0 and position_ids is not None:
        blk = torch.div(position_ids.expand(B, q), block_size, rounding_mode="floor")  # (B, q)
        mask = blk[:, None, None, :] <= blk[:, None, :, None]  # (B, 1, q, q)
    else:
        mask = as_4d(block_causal_mask(q, block_size, past, device=input_ids.device), B)  # (B, 1, q, past + q)
    if attention_mask is not None:
        mask = with_key_padding(mask, attention_mask.bool())
    return backend_mask(model, mask)


class SDARForCausalLM(Qwen3ForCausalLM):
    """SDAR as ``Qwen3ForCausalLM`` with block-causal attention by default.

    forward: the standard transformers 5 arguments; ``attention_mask`` may be a 4D mask (used as
    given), a 2D padding mask (B, kv) or None (both give the block-causal pattern of
    ``config.block_size``). Logits (B, T, V) at index i score token i.
    """

    config_class = SDARConfig

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kwargs):
        if input_ids is not None and (attention_mask is None or attention_mask.dim() == 2):
            attention_mask = default_block_mask(self, input_ids, attention_mask, cache, self.config.block_size,
                                                position_ids)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, **kwargs)


def config_from_published(cfg: dict) -> SDARConfig:
    """The published ``config.json`` dict -> SDARConfig. The published file names
    ``flex_attention`` (GPU-only here) and no block size; the attention backend is chosen at
    load and the block size defaults to 4."""
    out = SDARConfig(**{k: v for k, v in cfg.items() if k not in _DROP})
    out.architectures = [ARCHITECTURE]
    return out
