"""Model-family conventions of masked-diffusion LMs (spec/models.md §2.1 adapter contract,
spec/diffusion.md §2 item 6).

Decoders never branch on the model family. They read the bundle's ``mask_token_id`` and
``logit_shift`` and call :func:`bidirectional_forward`, which hides how each family takes its
attention mask and positions:

- **native** transformers classes (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ... run
  bidirectionally, e.g. the tiny stand-ins and AR-adapted checkpoints, and the published LLaDA /
  Dream checkpoints, which load into :mod:`unmask.models.families`): ``is_causal=False``,
  padding folded into a 4D bool mask (additive for eager), explicit ``position_ids`` and an HF
  ``Cache``, all through :mod:`unmask.compat` (models.md §3).
- **LLaDA** remote code (``AutoModel``, ``trust_remote_code``): ``input_ids`` plus a 2D padding
  mask when there is padding; positions are internal; no HF cache (models.md §2.3).
- **Dream** remote code: ``attention_mask="full"`` without padding, else a 4D bool mask with
  ``position_ids = cumsum(valid) - 1``; no HF cache (models.md §2.4).

The remote forwards follow the published generation code; they serve directories whose own
code is loaded with ``trust_remote_code`` (the published LLaDA/Dream files themselves fail under
transformers 5, which is why their architectures are recognised and loaded natively instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unmask.errors import UnmaskError

SAMPLERS = ("llada", "dream")


@dataclass(frozen=True)
class Family:
    """What a model family fixes (models.md §2.1).

    logit_shift: 1 when the output at i-1 scores token i (Dream), else 0.
    mask_token_id: the documented id, used only when neither the config nor the tokenizer names
        one (None: the config must name it; Dream's id is read at load, models.md §2.4).
    stop_token_ids: extra ids that end a response (LLaDA's end-of-turn, diffusion.md §9).
    sampler: "llada" (float64 Gumbel-max, untempered κ) or "dream" (categorical, tempered κ),
        diffusion.md §4.
    loader: the transformers auto class its remote code registers.
    kind: the bundle kind its checkpoints load as. block_size: the native block of a
        block-diffusion family (SDAR 4, LLaDA2 32; models.md §2.5-2.6), else None.
    model_types: the ``model_type`` values of its published configs.
    tokenizer: the transformers tokenizer class that reads its published tokenizer files without
        remote code (Dream's and SDAR's ``tokenizer_config.json`` name remote classes).
    """

    name: str
    logit_shift: int = 0
    mask_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    sampler: str = "llada"
    loader: str = "AutoModelForCausalLM"
    kind: str = "masked-diffusion"
    block_size: int | None = None
    model_types: tuple[str, ...] = ()
    tokenizer: str = "PreTrainedTokenizerFast"


FAMILIES: dict[str, Family] = {
    "llada": Family("llada", logit_shift=0, mask_token_id=126336, stop_token_ids=(126081, 126348), sampler="llada",
                    loader="AutoModel", model_types=("llada",)),
    "dream": Family("dream", logit_shift=1, mask_token_id=None, sampler="dream", loader="AutoModel",
                    model_types=("dream",), tokenizer="Qwen2Tokenizer"),
    "sdar": Family("sdar", mask_token_id=151669, stop_token_ids=(151645, 151643), kind="block-diffusion",
                   block_size=4, model_types=("sdar",), tokenizer="Qwen2Tokenizer"),
    "llada2": Family("llada2", mask_token_id=156895, stop_token_ids=(156892,), kind="block-diffusion", block_size=32,
                     model_types=("llada2_moe",)),
}


def family_of(config: dict) -> Family | None:
    """The dLLM family of a ``config.json`` dict (by ``model_type``, then ``architectures``), or None."""
    model_type = str(config.get("model_type", "")).lower()
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    for arch in config.get("architectures") or ():
        for name, fam in sorted(FAMILIES.items(), key=lambda kv: -len(kv[0])):  # llada2 before llada
            if str(arch).lower().startswith(name):
                return fam
    return None


def loader_name(config: dict, family: Family | None) -> str:
    """Which auto class loads this directory: remote-code dLLMs register ``AutoModel`` (LLaDA also
    registers ``AutoModelForCausalLM``); everything else is a causal-LM class."""
    auto_map = config.get("auto_map") or {}
    if family is not None and family.loader in auto_map:
        return family.loader
    if auto_map and "AutoModelForCausalLM" not in auto_map and "AutoModel" in auto_map:
        return "AutoModel"
    return "AutoModelForCausalLM"


def is_remote(model) -> bool:
    """True for a model whose class came from a checkpoint's own code (``trust_remote_code``)."""
    return type(model).__module__.startswith("transformers_modules")


def default_sampler(bundle) -> str:
    """The bundle's family sampler (diffusion.md §4): recorded at load, else by logit shift."""
    name = bundle.meta.get("sampler")
    if name in SAMPLERS:
        return name
    fam = FAMILIES.get(bundle.meta.get("family", ""))
    if fam is not None:
        return fam.sampler
    return "dream" if bundle.logit_shift == 1 else "llada"


def supports_cache(bundle) -> bool:
    """Whether the approximate prefix/dual caches can run: they need an HF ``Cache`` and explicit
    positions, which only native transformers classes take."""
    return not is_remote(bundle.model)


def realign(logits: torch.Tensor, shift: int) -> torch.Tensor:
    """Logits (B, T, V) of a forward over tokens 0..T-1 -> logits whose index i scores token i.

    shift 0 (LLaDA): unchanged. shift 1 (Dream): ``cat([logits[:, :1], logits[:, :-1]])``; index 0
    is a duplicate placeholder that must never be read (diffusion.md §2, models.md §2.4).
    """
    if shift == 0:
        return logits
    if shift != 1:
        raise UnmaskError(f"logit shift must be 0 or 1 (got {shift}); use 1 for Dream-style models")
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # (B, T, V)


def bidirectional_forward(bundle, ids: torch.Tensor, *, position_ids: torch.Tensor, key_valid: torch.Tensor,
                          cache=None, rows: tuple[int, int] | None = None, padded: bool | None = None) -> torch.Tensor:
    """One bidirectional forward of a masked-diffusion model; returns **raw** logits (not realigned).

    ids, position_ids: (B, q) long. key_valid: (B, kv) bool over every key the queries see (the
    cache's keys first, then ``ids``), False at padding. cache: an HF ``Cache`` (native models
    only) extended by the q new K/V. rows: (start, stop) query rows whose logits are wanted (the LM
    head runs on those only); None = all. padded: whether some key is invalid, when the caller knows
    (None: read from key_valid, a host sync). Returns (B, stop - start or q, V) float32.
    Raises UnmaskError when a cache is asked of a remote model.
    """
    model = bundle.model
    padded = not bool(key_valid.all()) if padded is None else padded
    if not is_remote(model):
        from unmask.compat import attention_mask, forward
        from unmask.masks import as_4d, with_key_padding

        mask = None
        if padded:
            B, q = ids.shape
            full = torch.ones(q, key_valid.shape[1], dtype=torch.bool, device=ids.device)  # (q, kv)
            mask = attention_mask(model, with_key_padding(as_4d(full, B), key_valid))  # (B, 1, q, kv)
        keep = 0 if rows is None else torch.arange(rows[0], rows[1], device=ids.device)  # (stop - start,)
        return forward(model, ids, position_ids=position_ids, attention_mask=mask, cache=cache,
                       logits_to_keep=keep, is_causal=False)
    if cache is not None:
        raise UnmaskError("the prefix/dual caches need a transformers-native model; this checkpoint runs its own "
                          "model code, so use cache='none'")
    if key_valid.shape[1] != ids.shape[1]:
        raise UnmaskError("remote-code models take the whole canvas in one forward; key and query lengths differ")
    family = bundle.meta.get("family")
    if family == "dream":
        # Dream's generation code: "full" without padding, else a (B, 1, T, T) bool mask and positions
        # counted over real tokens only.
        if padded:
            mask = key_valid[:, None, None, :] & key_valid[:, None, :, None]  # (B, 1, T, T)
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids)
        else:
            out = model(input_ids=ids, attention_mask="full")
    else:
        # LLaDA's remote forward: input_ids, and a 2D padding mask when rows are left-padded.
        out = model(input_ids=ids, attention_mask=key_valid.long()) if padded else model(input_ids=ids)
    logits = out.logits if hasattr(out, "logits") else out[0]  # (B, T, V)
    if rows is not None:
        logits = logits[:, rows[0]: rows[1]]
    return logits.float()
