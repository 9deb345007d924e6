"""Everything that depends on the transformers version lives here (STYLE.md habit 8).

transformers 5.x renamed the cache keyword to ``cache=`` (``past_key_values=`` still works
until 5.40); ``DynamicCache.crop(-n)`` is the portable rollback; RoPE settings moved into
``config.rope_parameters`` (spec/models.md §3).
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch


@lru_cache(maxsize=64)
def _cache_keyword(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_keyword(model) -> str:
    """The name of the KV-cache argument of ``model.forward`` (``cache`` in 5.x)."""
    return _cache_keyword(type(model))


def new_cache(model):
    """An empty ``DynamicCache`` for ``model``."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def crop(cache, n: int) -> None:
    """Drop the last ``n`` positions from every layer of ``cache`` (``crop(-n)``: the
    positive absolute-length form raises in 5.24)."""
    if n > 0:
        cache.crop(-n)


def forward(model, input_ids: torch.Tensor, *, position_ids: torch.Tensor, attention_mask=None,
            cache=None, logits_to_keep: int | torch.Tensor = 0, is_causal: bool | None = None) -> torch.Tensor:
    """One model forward through HF's supported entry points.

    input_ids (B, q) long, position_ids (B, q) long (always explicit, spec/models.md §3.6),
    attention_mask None, (B, kv) 2D padding mask or (B, 1, q, kv) 4D mask (bool for SDPA,
    additive float for eager). logits_to_keep: an int keeps the last k positions (0: all); a 1D
    long tensor keeps those query positions (``*ForCausalLM`` in 4.5x-5.x). Returns logits
    (B, q or kept, V) in float32.
    """
    kwargs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask,
              "use_cache": cache is not None, "logits_to_keep": logits_to_keep}
    if cache is not None:
        kwargs[cache_keyword(model)] = cache
    if is_causal is not None:
        kwargs["is_causal"] = is_causal
    out = model(**kwargs)
    return out.logits.float()


def final_hidden(model, input_ids: torch.Tensor, *, position_ids: torch.Tensor, attention_mask=None,
                 cache=None) -> torch.Tensor:
    """The last hidden states (after the final norm: what the LM head reads) of one forward,
    through the model's own call, so wrappers around it (DDP's gradient hooks) stay in the loop.

    Same inputs as :func:`forward`. ``output_hidden_states`` (transformers >= 4.4x, whose last
    entry is the normed ``last_hidden_state``) with ``logits_to_keep=1``: the head runs on one
    position only. Returns (B, q, d) in the model's dtype, with grad when enabled.
    """
    kwargs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask,
              "use_cache": cache is not None, "logits_to_keep": 1, "output_hidden_states": True}
    if cache is not None:
        kwargs[cache_keyword(model)] = cache
    return model(**kwargs).hidden_states[-1]


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


def quiet_transformers() -> None:
    """Silence transformers' progress bars and info logs (the CLI prints its own output)."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def attention_mask(model, mask: torch.Tensor) -> torch.Tensor:
    """The 4D bool mask (B, 1, q, kv) in the form the model's attention backend needs: eager
    adds the mask to the scores, so it gets an additive float mask (a bool mask would be
    silently wrong there, spec/models.md §3.4); SDPA takes the bool mask as is."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl == "eager":
        from unmask.masks import to_additive

        return to_additive(mask, dtype=next(model.parameters()).dtype)
    return mask


def set_static_length(cache, length: int) -> None:
    """Point every layer of a ``StaticCache`` at ``length`` cached tokens (the next write goes
    to slot ``length``). An in-place tensor write, so it can sit inside a captured CUDA graph;
    ``StaticCache.crop`` does the same only from transformers 5.24 on."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)


def register_weight_renames(class_name: str, renames: list[tuple[str, str]], *,
                            split: list[tuple[str, list[str]]] = (),
                            merge_experts: list[tuple[list[str], str, int | None]] = ()) -> None:
    """Load checkpoints of ``class_name`` whose parameters carry another codebase's names and
    layout, and save them back in that form (transformers 5 weight conversion; ``save_pretrained``
    applies the reverse). Idempotent: re-registering replaces the mapping.

    renames: (published regex, our name) pairs. split: (published fused key, our keys), cut along
    dim 0 into pieces sized like our parameters (a fused q/k/v projection). merge_experts:
    (published per-expert keys with ``*`` for the expert index, our stacked 3D key, dim to
    concatenate several published keys along or None), e.g. gate and up projections fused.
    """
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import (Concatenate, MergeModulelist, Split, WeightConverter,
                                                 WeightRenaming)

    mapping = [WeightRenaming(src, dst) for src, dst in renames]
    mapping += [WeightConverter(source_patterns=src, target_patterns=list(dst), operations=[Split(dim=0)])
                for src, dst in split]
    for src, dst, cat_dim in merge_experts:
        ops = [MergeModulelist(dim=0)] + ([Concatenate(dim=cat_dim)] if cat_dim is not None else [])
        mapping.append(WeightConverter(source_patterns=list(src), target_patterns=dst, operations=ops))
    register_checkpoint_conversion_mapping(class_name, mapping, overwrite=True)
def tensor_parallel_kwargs(tp: int) -> dict:
    """``from_pretrained`` keyword arguments that load the model class's own tensor-parallel plan
    over ``tp`` processes: ``distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp)``,
    or the older ``tp_plan="auto", tp_size=tp`` where DistributedConfig does not exist yet."""
    try:
        from transformers import DistributedConfig
    except ImportError:  # transformers before DistributedConfig
        return {"tp_plan": "auto", "tp_size": tp}
    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=tp)}
