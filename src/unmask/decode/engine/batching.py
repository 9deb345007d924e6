"""Helpers for batching prompts of different lengths."""

from __future__ import annotations

import torch


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token rows to one length.

    Returns ids (B, P) long, valid (B, P) bool (False on padding) and position_ids (B, P) long,
    where each row's first real token has position 0 (padding positions are clamped to 0).
    """
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), P), dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[b, P - len(p):] = True
    pos = (valid.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, P)
    return ids.to(device), valid.to(device), pos.to(device)
