"""Row plumbing the one-engine block decoders share (:mod:`unmask.decode.blocks`,
:mod:`unmask.decode.multiblock_engine`): padding a tensor and placing joining rows' prefilled
caches into their slots of a running cache."""

from __future__ import annotations

import torch

from unmask.decode.kv import DynamicKV


def pad(t: torch.Tensor, dim: int, n: int, fill, *, left: bool = False) -> torch.Tensor:
    """``t`` with ``n`` slices of ``fill`` added along ``dim`` (before when ``left``)."""
    if n <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    pad = t.new_full(shape, fill)
    return torch.cat([pad, t] if left else [t, pad], dim=dim)


def place(model, kv, R: int, key_valid: torch.Tensor, slots: list[int], new, valid: torch.Tensor):
    """Put joining rows' prefilled cache ``new`` (validity ``valid`` (n, F)) into ``slots`` of the
    running DynamicKV ``kv`` (R rows, validity ``key_valid`` (R, >= kv.length)): both sides are
    left-padded to the longer cache (positions are explicit; padding is invalid) and the rows grow
    to cover every slot. Returns (kv, rows, key_valid (rows, T))."""
    rows = max(R, max(slots) + 1)
    old_n, new_n = kv.length, new.length
    T = max(old_n, new_n)
    at = torch.tensor(slots, dtype=torch.long, device=key_valid.device)  # (n,)
    kv_valid = pad(pad(key_valid[:, :old_n], 1, T - old_n, False, left=True), 0, rows - R, False)  # (rows, T)
    kv_valid[at] = pad(valid, 1, T - new_n, False, left=True)
    old, fresh = kv.layers() if old_n else None, new.layers() if new_n else None
    out = DynamicKV(model)
    for i in range(len(old or fresh or [])):
        like = (old or fresh)[i][0]
        kept = []
        for j in range(2):  # keys, values (R, H, n, D)
            o = old[i][j] if old else like.new_zeros((R, like.shape[1], 0, like.shape[3]))
            t = pad(pad(o, 2, T - old_n, 0, left=True), 0, rows - R, 0)  # (rows, H, T, D)
            if fresh:
                t[at] = pad(fresh[i][j], 2, T - new_n, 0, left=True)
            kept.append(t)
        out.cache.update(kept[0], kept[1], i)
    return out, rows, kv_valid


__all__ = ["pad", "place"]
