"""LLaDA2.0-mini (inclusionAI, ``LLaDA2MoeModelLM``) as a native transformers model (spec/models.md §2.6).

LLaDA2.0 is a block-diffusion MoE built on the Ling 2.0 ("BailingMoeV2") architecture. Read from
its published model card, config and modeling file, each decoder layer is:

- pre-norm RMSNorm; attention with one fused ``query_key_value`` projection (rows: all query
  heads, then the key heads, then the value heads), per-head RMSNorm on q and k
  (``query_layernorm`` / ``key_layernorm``), RoPE on the first ``partial_rotary_factor`` of each
  head (half-split ``rotate_half``, θ = ``rope_theta``), grouped-query attention, output ``dense``;
- a SwiGLU MLP in the first ``first_k_dense_replace`` layers, then a mixture of experts: a
  sigmoid router in float32 whose expert choice adds a learned ``expert_bias`` and is limited to
  the ``topk_group`` best of ``n_group`` expert groups (a group scores the sum of its two best
  experts); the ``num_experts_per_tok`` chosen experts are weighted by their unbiased scores,
  normalised to sum to one and scaled by ``routed_scaling_factor``; plus ``num_shared_experts``
  always-on experts (one MLP of ``moe_intermediate_size * num_shared_experts``).

That is exactly transformers' GLM-4-MoE layer (``Glm4MoeTopkRouter`` implements the same
grouped routing), so the model here is ``Glm4MoeForCausalLM``; the published parameter names and
the fused q/k/v and per-expert layouts are converted at load by transformers' weight-conversion
loader (and back on save):

| published (``LLaDA2MoeModelLM``)                   | here (``Glm4MoeForCausalLM``)            |
|----------------------------------------------------|------------------------------------------|
| ``model.word_embeddings``                          | ``model.embed_tokens``                   |
| ``....attention.query_key_value``                  | ``....self_attn.{q,k,v}_proj`` (split)   |
| ``....attention.dense``                            | ``....self_attn.o_proj``                 |
| ``....attention.{query,key}_layernorm``            | ``....self_attn.{q,k}_norm``             |
| ``....mlp.gate.expert_bias``                       | ``....mlp.gate.e_score_correction_bias`` |
| ``....mlp.experts.e.{gate,up}_proj``               | ``....mlp.experts.gate_up_proj`` (stacked)|
| ``....mlp.experts.e.down_proj``                    | ``....mlp.experts.down_proj`` (stacked)  |

Attention is block-causal with blocks of 32 (the published ``generate`` default and SGLang's),
logits are not shifted, the mask id is 156895. The published forward *requires* a 4D mask; here a
missing or 2D mask gets the block-causal pattern, as for SDAR.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from unmask.compat import register_weight_renames
from unmask.errors import UnmaskError
from unmask.models.families.sdar import default_block_mask

ARCHITECTURE = "LLaDA2MoeModelLM"
DEFAULT_BLOCK_SIZE = 32
EOS_ID = 156892  # the published generate's eos_id; config.json names none

RENAMES = [
    (r"^model\.word_embeddings\.", "model.embed_tokens."),
    (r"\.attention\.dense\.", ".self_attn.o_proj."),
    (r"\.attention\.query_layernorm\.", ".self_attn.q_norm."),
    (r"\.attention\.key_layernorm\.", ".self_attn.k_norm."),
    (r"\.mlp\.gate\.expert_bias", ".mlp.gate.e_score_correction_bias"),
]
SPLIT = [("attention.query_key_value.weight",
          ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"])]
MERGE_EXPERTS = [
    (["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], "mlp.experts.gate_up_proj", 1),
    (["mlp.experts.*.down_proj.weight"], "mlp.experts.down_proj", None),
]

# published field -> value this implementation requires (anything else is refused).
_REQUIRED = {"use_qkv_bias": False, "use_bias": False, "norm_head": False, "use_rmsnorm": True,
             "score_function": "sigmoid", "using_split_qkv_in_self_attention": False, "rope_scaling": None,
             "hidden_act": "silu"}


@strict
class LLaDA2MoeConfig(Glm4MoeConfig):
    """A ``Glm4MoeConfig`` for LLaDA2.0 with its diffusion ``block_size`` and mask token id."""

    model_type = "llada2_moe"
    block_size: int = DEFAULT_BLOCK_SIZE
    mask_token_id: int | None = None


class LLaDA2MoeModelLM(Glm4MoeForCausalLM):
    """LLaDA2.0 as ``Glm4MoeForCausalLM`` with block-causal attention by default.

    forward: the standard transformers 5 arguments; ``attention_mask`` may be a 4D mask (bool, or
    additive float as the published ``generate`` passes it; used as given), a 2D padding mask
    (B, kv) or None (both give the block-causal pattern of ``config.block_size``). Logits
    (B, T, V) at index i score token i.
    """

    config_class = LLaDA2MoeConfig

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kwargs):
        if input_ids is not None and (attention_mask is None or attention_mask.dim() == 2):
            attention_mask = default_block_mask(self, input_ids, attention_mask, cache, self.config.block_size,
                                                position_ids)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, **kwargs)


def config_from_published(cfg: dict) -> LLaDA2MoeConfig:
    """The published ``config.json`` dict -> LLaDA2MoeConfig; a dict already in the GLM-4-MoE
    schema (a directory saved by unmask) passes through. Raises UnmaskError for an option this
    architecture does not implement (biases, other routers, dense-only or shared-expert-free MoE)."""
    if "n_routed_experts" in cfg:
        out = LLaDA2MoeConfig(**{k: v for k, v in cfg.items()
                                 if k not in ("model_type", "auto_map", "architectures", "is_causal")})
        out.architectures = [ARCHITECTURE]
        return out
    for key, want in _REQUIRED.items():
        if key in cfg and cfg[key] != want:
            raise UnmaskError(f"LLaDA2 config has {key}={cfg[key]!r}; unmask implements the published "
                              f"LLaDA2.0-mini architecture ({key}={want!r}) only")
    if not cfg.get("num_experts") or not cfg.get("num_shared_experts"):
        raise UnmaskError("LLaDA2 config without routed or shared experts; unmask implements the published "
                          "LLaDA2.0-mini MoE (num_experts and num_shared_experts >= 1) only")
    heads = cfg["num_attention_heads"]
    top_k = cfg["num_experts_per_tok"]
    out = LLaDA2MoeConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, hidden_act="silu",
        max_position_embeddings=cfg.get("max_position_embeddings", 32768), rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0)),
                         "partial_rotary_factor": float(cfg.get("partial_rotary_factor", 0.5))},
        moe_intermediate_size=cfg["moe_intermediate_size"], num_experts_per_tok=top_k,
        n_shared_experts=cfg["num_shared_experts"], n_routed_experts=cfg["num_experts"],
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)), n_group=cfg.get("n_group", 1),
        topk_group=cfg.get("topk_group", 1), first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
        norm_topk_prob=top_k > 1,  # the published router normalises whenever it picks more than one expert
        use_qk_norm=bool(cfg.get("use_qk_norm", True)), pad_token_id=cfg.get("pad_token_id"),
        eos_token_id=cfg.get("eos_token_id", EOS_ID if EOS_ID < cfg["vocab_size"] else None),
        bos_token_id=cfg.get("bos_token_id"), use_cache=False,
        mask_token_id=cfg.get("mask_token_id"), block_size=cfg.get("block_size", DEFAULT_BLOCK_SIZE),
    )
    out.architectures = [ARCHITECTURE]
    return out


register_weight_renames(ARCHITECTURE, RENAMES, split=SPLIT, merge_experts=MERGE_EXPERTS)
