"""LLaDA-8B (Base, Instruct, LLaDA-1.5) as a native transformers model (spec/models.md §2.3).

The published ``modeling_llada.py`` (an OLMo-derived codebase, ``LLaDAModelLM``) does not run
under transformers 5. Its "llama" block is exactly a Llama decoder layer without causality:
RMSNorm pre-norm, q/k/v projections with half-split RoPE on the full head (``rotate_half`` over
two halves, θ = ``rope_theta``), a SwiGLU MLP ``ff_out(silu(ff_proj(x)) * up_proj(x))``, final
RMSNorm and an untied output layer. So the model here *is* ``LlamaForCausalLM`` with
``is_causal=False``; only the names differ, and transformers' weight-renaming loader maps them
(saving maps them back):

| published (``LLaDAModelLM``)                 | here (``LlamaForCausalLM``)        |
|----------------------------------------------|------------------------------------|
| ``model.transformer.wte``                    | ``model.embed_tokens``             |
| ``model.transformer.blocks.i.attn_norm``     | ``model.layers.i.input_layernorm`` |
| ``....q_proj`` / ``k_proj`` / ``v_proj``     | ``....self_attn.q_proj`` ...       |
| ``....attn_out``                             | ``....self_attn.o_proj``           |
| ``....ff_norm``                              | ``....post_attention_layernorm``   |
| ``....ff_proj`` / ``up_proj`` / ``ff_out``   | ``....mlp.gate_proj`` / ``up_proj`` / ``down_proj`` |
| ``model.transformer.ln_f``                   | ``model.norm``                     |
| ``model.transformer.ff_out``                 | ``lm_head``                        |

The config keeps the published OLMo-style schema on load (``d_model``, ``n_heads``, ...); the
options this architecture does not implement (ALiBi, q/k layer norm, biases, non-RMS norms,
other block types) are refused with an error rather than silently ignored.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig, LlamaForCausalLM

from unmask.compat import register_weight_renames
from unmask.errors import UnmaskError

ARCHITECTURE = "LLaDAModelLM"

# (published regex, native name); applied in order to each checkpoint key.
RENAMES = [
    (r"^model\.transformer\.wte\.", "model.embed_tokens."),
    (r"^model\.transformer\.ln_f\.", "model.norm."),
    (r"^model\.transformer\.ff_out\.", "lm_head."),
    (r"^model\.transformer\.blocks\.", "model.layers."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ff_norm\.", ".post_attention_layernorm."),
    (r"\.q_proj\.", ".self_attn.q_proj."),
    (r"\.k_proj\.", ".self_attn.k_proj."),
    (r"\.v_proj\.", ".self_attn.v_proj."),
    (r"\.attn_out\.", ".self_attn.o_proj."),
    (r"\.ff_proj\.", ".mlp.gate_proj."),
    (r"\.up_proj\.", ".mlp.up_proj."),
    (r"\.ff_out\.", ".mlp.down_proj."),
]

# published field -> value this implementation requires (anything else is refused).
_REQUIRED = {"block_type": "llama", "layer_norm_type": "rms", "alibi": False, "rope": True,
             "attention_layer_norm": False, "include_bias": False, "include_qkv_bias": False,
             "input_emb_norm": False, "scale_logits": False, "layer_norm_with_affine": True,
             "activation_type": "silu"}


@strict
class LLaDAConfig(LlamaConfig):
    """A ``LlamaConfig`` for LLaDA: bidirectional, with the mask token id (126336 in LLaDA-8B)."""

    model_type = "llada"
    mask_token_id: int | None = None


class LLaDAModelLM(LlamaForCausalLM):
    """LLaDA as ``LlamaForCausalLM`` with full bidirectional attention (``config.is_causal`` False).

    forward: the standard transformers 5 arguments (``input_ids`` (B, T), ``attention_mask`` 2D
    padding or 4D (B, 1, T, kv), ``position_ids`` (B, T), ``cache``, ``logits_to_keep``); logits
    (B, T, V) at index i score token i (no shift).
    """

    config_class = LLaDAConfig


def config_from_published(cfg: dict) -> LLaDAConfig:
    """The published ``config.json`` dict (OLMo-style keys) -> LLaDAConfig. A dict already in the
    Llama schema (a directory saved by unmask) passes through. Raises UnmaskError for an option
    this architecture does not implement."""
    if "d_model" not in cfg:
        out = LLaDAConfig(**_strip(cfg))
    else:
        for key, want in _REQUIRED.items():
            if key in cfg and cfg[key] is not None and cfg[key] != want:
                raise UnmaskError(f"LLaDA config has {key}={cfg[key]!r}; unmask implements the published LLaDA-8B "
                                  f"architecture ({key}={want!r}) only")
        heads = cfg["n_heads"]
        kv = 1 if cfg.get("multi_query_attention") else (cfg.get("n_kv_heads") or heads)
        mlp = cfg.get("mlp_hidden_size") or cfg.get("mlp_ratio", 4) * cfg["d_model"]
        out = LLaDAConfig(
            vocab_size=cfg.get("embedding_size") or cfg["vocab_size"], hidden_size=cfg["d_model"],
            intermediate_size=mlp, num_hidden_layers=cfg["n_layers"], num_attention_heads=heads,
            num_key_value_heads=kv, hidden_act="silu", max_position_embeddings=cfg.get("max_sequence_length", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), tie_word_embeddings=bool(cfg.get("weight_tying", False)),
            rope_parameters={"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))},
            attention_bias=False, mlp_bias=False, mask_token_id=cfg.get("mask_token_id"),
            pad_token_id=cfg.get("pad_token_id"), eos_token_id=cfg.get("eos_token_id"),
            bos_token_id=cfg.get("bos_token_id"), use_cache=False,
        )
    out.is_causal = False
    out.architectures = [ARCHITECTURE]
    return out


def _strip(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in ("model_type", "auto_map", "architectures", "is_causal")}


register_weight_renames(ARCHITECTURE, RENAMES)
