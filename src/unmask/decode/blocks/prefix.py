"""What the block decoders share (SingleBD, lossy SBD, the Block Buffer): the prefills of their exact
prefix cache and the cache-flag check. Nothing here imports a decoder."""

from __future__ import annotations

import torch

from unmask.decode.engine.batching import left_pad
from unmask.errors import UnmaskError
from unmask.masks import as_4d, block_causal_mask, causal_mask, with_key_padding


def check_cache_flags(compile, static) -> None:
    """Raise a one-line UnmaskError unless ``compile`` and ``static`` are True or False."""
    for name, value in (("compile", compile), ("static", static)):
        if not isinstance(value, bool):
            raise UnmaskError(f"{name} must be True or False (got {value!r}); pass {name}=True")


def whole_prompt_blocks(prompts: list[list[int]], B: int) -> int:
    """F: the prefill width, the longest prompt's whole blocks in tokens (rows are left-padded to it)."""
    return max(len(p) // B for p in prompts) * B


def static_length(aligned: bool, prompts: list[list[int]], budgets: list[int], B: int) -> int:
    """Tokens a block decoder's static cache needs for a join of ``prompts`` with these ``max_new_tokens``:
    aligned (SingleBD) the whole prompt blocks, every generated block and one of slack (j stored blocks,
    then one block or the fused pair); causal (SBD) the prompt and the committed text (noisy K/V are
    cropped before the next re-feed)."""
    if aligned:
        n_blocks = max((len(p) + m - 1) // B - len(p) // B + 1 for p, m in zip(prompts, budgets))
        return whole_prompt_blocks(prompts, B) + (n_blocks + 1) * B
    return max(len(p) for p in prompts) + max(budgets)


def prefill_whole_blocks(kv, prompts: list[list[int]], B: int, pad_id: int, device):
    """Prefill each row's whole prompt blocks block-causally into ``kv`` (multiblock.md §3.2 step 1).

    kv: an empty :mod:`unmask.decode.engine.kv` cache (DynamicKV or StaticKV). Rows are left-padded to the
    longest prefilled part, F = :func:`whole_prompt_blocks`; every row's pad is a multiple of B, so
    one block-causal mask over the padded columns is right for every row. The forward's length
    depends on the prompts, so it runs eagerly (``compiled=False``). Returns (kv, key_valid (R, F)
    bool, n_full (R,) long: whole prompt blocks per row). With F = 0 no forward runs.
    """
    n_full = [len(p) // B for p in prompts]
    heads = [p[: n * B] for p, n in zip(prompts, n_full)]
    n_full_t = torch.tensor(n_full, dtype=torch.long, device=device)
    if max(len(h) for h in heads) == 0:
        return kv, torch.zeros((len(prompts), 0), dtype=torch.bool, device=device), n_full_t
    ids, valid, pos = left_pad(heads, pad_id, device)  # (R, F) each
    R, F = ids.shape
    mask = with_key_padding(as_4d(block_causal_mask(F, B, device=device), R), valid)  # (R, 1, F, F)
    kv.forward(ids, pos, mask, logits_to_keep=1, compiled=False)
    return kv, valid, n_full_t


def causal_prefill(kv, prompts: list[list[int]], pad_id: int, device) -> torch.Tensor:
    """Prefill the left-padded prompts causally into the empty cache ``kv`` (SBD Alg. 2 step 1).
    Its length depends on the prompts, so it runs eagerly. Returns valid (R, P) bool, False on
    the left padding."""
    ids, valid, pos = left_pad(prompts, pad_id, device)  # (R, P) each
    R, P = ids.shape
    mask = with_key_padding(as_4d(causal_mask(P, device=device), R), valid)  # (R, 1, P, P)
    kv.forward(ids, pos, mask, logits_to_keep=1, compiled=False)
    return valid


__all__ = ["causal_prefill", "check_cache_flags", "prefill_whole_blocks", "static_length",
           "whole_prompt_blocks"]
