"""Pure plumbing the continuous running batches share (issue 16): left-padding columns and caches,
merging a newcomer's cache into the running one, compacting a sparse cache, building and merging the
bidirectional decoders' left-padded canvases, and splitting rows on leaving.

Every running batch (:mod:`ar_batch`, :mod:`sbd_batch`,
:mod:`diffusion_batch`, :mod:`early_bird_batch`) keeps its rows' keys left-padded to one length with
a per-row key validity mask (R, T) bool; positions are explicit, so padding columns are simply
masked out. These helpers hold that logic once; each batch keeps its own per-row state.
"""

from __future__ import annotations

import torch

from unmask.decode.kv import DynamicKV
from unmask.decode.multiblock import compact

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def pad_left(t: torch.Tensor, n: int, dim: int = 1, fill=0) -> torch.Tensor:
    """Prepend ``n`` slices of ``fill`` to ``t`` along ``dim`` (``t`` itself when ``n`` is 0).

    E.g. key validity (R, T) bool -> (R, n + T), or keys (R, H, T, D) with dim 2 -> (R, H, n + T, D)."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_full(shape, fill), t], dim=dim)


def pad_right(t: torch.Tensor, n: int, dim: int = 1, fill=0) -> torch.Tensor:
    """Append ``n`` slices of ``fill`` to ``t`` along ``dim`` (``t`` itself when ``n`` is 0)."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t, t.new_full(shape, fill)], dim=dim)


def kv_layers(kv: DynamicKV) -> Layers | None:
    """Per layer (keys, values), each (R, H, n, D), or None while the cache holds no keys yet."""
    layers = [(layer.keys, layer.values) for layer in kv.cache.layers if getattr(layer, "keys", None) is not None]
    return layers if layers and layers[0][0].numel() > 0 else None


def rebuild_kv(model, layers: Layers) -> DynamicKV:
    """A fresh ``DynamicKV`` for ``model`` holding ``layers`` (keys, values) (R, H, n, D) each."""
    kv = DynamicKV(model)
    for i, (k, v) in enumerate(layers):
        kv.cache.update(k, v, i)
    return kv


def merge_kv(model, kv: DynamicKV, valid: torch.Tensor, new_kv: DynamicKV,
             new_valid: torch.Tensor) -> tuple[DynamicKV, torch.Tensor]:
    """Append a newcomer's cache (1 row, validity ``new_valid`` (1, n_new)) below the running one
    (R rows, validity ``valid`` (R, n_old)): both sides are left-padded with zero keys/values to
    T = max(n_old, n_new) columns, and the padding is invalid. A side holding no keys yet counts as
    zeros shaped like the other's. Returns (cache (R + 1, H, T, D) per layer, validity (R + 1, T) bool);
    an empty ``DynamicKV`` when neither side holds keys."""
    n_old, n_new = valid.shape[1], new_valid.shape[1]
    T = max(n_old, n_new)
    old, new = kv_layers(kv), kv_layers(new_kv)
    if old is None and new is None:  # no keys on either side (prompts shorter than a block)
        merged = DynamicKV(model)
    else:
        like = old if old is not None else new

        def side(layers, rows, i):
            if layers is None:  # no keys yet: zeros shaped like the other side's (masked anyway)
                shape = list(like[i][0].shape)
                shape[0], shape[2] = rows, 0
                return like[i][0].new_zeros(shape), like[i][1].new_zeros(shape)
            return layers[i]

        out = []
        for i in range(len(like)):
            (ko, vo), (kn, vn) = side(old, valid.shape[0], i), side(new, 1, i)
            out.append((torch.cat([pad_left(ko, T - n_old, 2), pad_left(kn, T - n_new, 2)]),
                        torch.cat([pad_left(vo, T - n_old, 2), pad_left(vn, T - n_new, 2)])))  # (R+1, H, T, D)
        merged = rebuild_kv(model, out)
    key_valid = torch.cat([pad_left(valid, T - n_old, 1, False), pad_left(new_valid, T - n_new, 1, False)])  # (R+1, T)
    return merged, key_valid


def compact_if_sparse(kv: DynamicKV, key_valid: torch.Tensor, slack: int) -> torch.Tensor:
    """Compact ``kv`` in place when the columns no row attends to (left padding, rows that left,
    rejected drafts, blocks stored in different steps) make up more than half of it and at least
    ``slack`` columns. key_valid (R, n) bool; returns the validity of the (possibly shorter) cache,
    (R, n') with each row's keys right-aligned (``multiblock.compact``)."""
    n = kv.length
    if n == 0:
        return key_valid
    most = int(key_valid.sum(dim=1).max())  # the most valid keys of any row
    if n - most >= max(most, slack):
        compact(kv, key_valid)  # right-aligns each row's keys in the first `most` columns
        key_valid = key_valid[:, : kv.length]
    return key_valid


def row_canvas(prompt: list[int], gen_length: int, mask_id: int, device) -> tuple[torch.Tensor, ...]:
    """One row's canvas [prompt | mask^L] for a bidirectional running batch (diffusion, early-bird):
    (ids, pos, valid), each (1, C) with C = len(prompt) + L (long, long from 0, bool all True)."""
    C = len(prompt) + gen_length
    ids = torch.cat([torch.tensor(list(prompt), dtype=torch.long, device=device),
                     torch.full((gen_length,), mask_id, dtype=torch.long, device=device)])[None]  # (1, C)
    pos = torch.arange(C, device=device)[None]  # (1, C)
    valid = torch.ones(1, C, dtype=torch.bool, device=device)  # (1, C)
    return ids, pos, valid


def append_canvas(running: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...],
                  pad_id: int) -> tuple[torch.Tensor, ...]:
    """Append a row's canvas ``new`` (ids, pos, valid) (1, C) below the running canvases (R, T0),
    both left-padded to T = max(T0, C) columns (ids with ``pad_id``, positions 0, validity False).
    Returns (ids, pos, valid) (R + 1, T) each."""
    T = max(running[0].shape[1], new[0].shape[1])
    return tuple(torch.cat([pad_left(old, T - old.shape[1], 1, fill), pad_left(one, T - one.shape[1], 1, fill)])
                 for old, one, fill in zip(running, new, (pad_id, 0, False)))  # (R + 1, T) each


def take_canvas(canvas: tuple[torch.Tensor, ...], idx: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """Rows ``idx`` (R',) of the left-padded canvases (ids, pos, valid) (R, T), keeping only the last
    ``width`` columns (the widest remaining row's; the leading ones are padding for every kept row).
    Returns (R', width) each."""
    cut = canvas[0].shape[1] - width  # leading columns nobody uses
    return tuple(t[idx, cut:] for t in canvas)  # (R', T') each


def split_rows(rows: list, pred, device) -> tuple[list, list, torch.Tensor]:
    """Split ``rows`` on leaving: (gone, kept, idx) where ``gone`` are the rows with ``pred(row)``
    true, ``kept`` the others in order and ``idx`` (R',) long their indices in ``rows`` (on ``device``),
    for taking the kept rows of every per-row tensor."""
    keep = [i for i, row in enumerate(rows) if not pred(row)]
    kept = set(keep)
    gone = [row for i, row in enumerate(rows) if i not in kept]
    idx = torch.tensor(keep, dtype=torch.long, device=device)  # (R',)
    return gone, [rows[i] for i in keep], idx


__all__ = ["append_canvas", "compact_if_sparse", "kv_layers", "merge_kv", "pad_left", "pad_right", "rebuild_kv",
           "row_canvas", "split_rows", "take_canvas"]
