"""Native transformers classes for published diffusion-LM checkpoints (spec/models.md §2.3-2.6).

The published checkpoints ship their architecture as Hugging Face remote code that does not run
under transformers 5. unmask recognises them by the ``architectures`` entry of ``config.json``
and loads their unmodified weights into its own classes, built from transformers' Llama, Qwen2
and Qwen3 modules (standard attention interface: eager and SDPA, ``DynamicCache`` and
``StaticCache``, 4D masks, explicit ``position_ids``). No code from the checkpoint directory is
ever imported. One family per module:

| ``architectures``   | module   | base                     |
|---------------------|----------|--------------------------|
| ``LLaDAModelLM``    | llada    | LlamaForCausalLM         |
| ``DreamModel``      | dream    | Qwen2ForCausalLM         |
| ``SDARForCausalLM`` | sdar     | Qwen3ForCausalLM         |
| ``LLaDA2MoeModelLM``| llada2   | Llama attention + grouped-routing MoE |
"""

from __future__ import annotations

import importlib
from pathlib import Path

from unmask.errors import UnmaskError

MODULES = {"LLaDAModelLM": "llada", "DreamModel": "dream", "SDARForCausalLM": "sdar", "LLaDA2MoeModelLM": "llada2"}


def native_module(hf_config: dict):
    """The family module that implements this ``config.json`` dict's architecture, or None."""
    for arch in hf_config.get("architectures") or ():
        if arch in MODULES:
            return importlib.import_module(f"unmask.models.families.{MODULES[arch]}")
    return None


def load_native(module, path: Path, hf_config: dict, *, dtype, attn_implementation: str = "sdpa"):
    """Build the family's config from the published ``config.json`` dict and load the weights in
    ``path`` (published parameter names) into its native class, with ``trust_remote_code`` off.
    Raises UnmaskError for a config option the native class does not implement."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        config = module.config_from_published(hf_config)
    except UnmaskError:
        raise
    except (KeyError, TypeError, ValueError, StrictDataclassError) as e:
        detail = " ".join(str(e).split())  # strict-dataclass messages span lines
        raise UnmaskError(f"{path / 'config.json'} does not match the published {module.ARCHITECTURE} schema "
                          f"({type(e).__name__}: {detail}); restore the checkpoint's config.json") from None
    model_cls = getattr(module, module.ARCHITECTURE)
    model, info = model_cls.from_pretrained(path, config=config, dtype=dtype, attn_implementation=attn_implementation,
                                            trust_remote_code=False, output_loading_info=True)
    # transformers initialises missing weights at random with only a warning; a checkpoint whose
    # names do not match the published ones must not decode silently with random layers.
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UnmaskError(f"{path} lacks weights the {module.ARCHITECTURE} architecture needs ({', '.join(missing[:3])}"
                          f"{more}); the shards are incomplete or use other parameter names, restore the checkpoint")
    return model
