"""Dream-7B (Dream-v0-Base-7B, Dream-v0-Instruct-7B) as a native transformers model (spec/models.md §2.4).

Dream is Qwen2.5-7B trained as a masked-diffusion LM: the published ``DreamModel`` has the Qwen2
architecture and parameter names exactly (``model.embed_tokens``, ``model.layers.i.self_attn.
{q,k,v,o}_proj`` with q/k/v biases, SwiGLU ``mlp``, ``model.norm``, ``lm_head``), with full
bidirectional attention. Its remote code does not run under transformers 5 (it asks the RoPE
table for the removed "default" type), so the model here is ``Qwen2ForCausalLM`` with
``is_causal=False``; checkpoints load unchanged.

Dream keeps the autoregressive alignment: the output at position i-1 scores token i, so the
bundle's ``logit_shift`` is 1 (the adapter in :mod:`unmask.models.adapters` realigns). The mask
id (151666) is read from ``config.json``.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import Qwen2Config, Qwen2ForCausalLM

ARCHITECTURE = "DreamModel"


@strict
class DreamConfig(Qwen2Config):
    """A ``Qwen2Config`` for Dream: bidirectional, with the mask token id."""

    model_type = "Dream"
    mask_token_id: int | None = None


class DreamModel(Qwen2ForCausalLM):
    """Dream as ``Qwen2ForCausalLM`` with bidirectional attention (``config.is_causal`` False).

    forward: the standard transformers 5 arguments (``input_ids`` (B, T), 2D or 4D
    ``attention_mask``, ``position_ids`` (B, T), ``cache``, ``logits_to_keep``). Logits (B, T, V):
    index i - 1 scores token i (the published shift; realign with ``adapters.realign``).
    """

    config_class = DreamConfig


def config_from_published(cfg: dict) -> DreamConfig:
    """The published ``config.json`` dict -> DreamConfig (the published schema is Qwen2's)."""
    out = DreamConfig(**{k: v for k, v in cfg.items()
                         if k not in ("model_type", "auto_map", "architectures", "is_causal", "use_mrope")})
    out.is_causal = False
    out.architectures = [ARCHITECTURE]
    return out
