"""Attention masks as pure functions of indices (bd3lms style).

Every builder returns a **bool** mask, True = the query may attend the key, with rows indexed by
query and columns by key. Convert for a backend with :func:`as_4d` and, for eager attention,
:func:`to_additive` (models.md §3.4: eager *adds* the mask, so a bool mask there is silently wrong;
SDPA takes either form). Custom 4D masks bypass the 2D padding mask, so left padding is folded in
with :func:`with_key_padding` (models.md §3.3).

Key columns always use absolute positions ``0 .. past_len + q_len - 1`` (cached keys first, then
the new tokens), which is the ``DynamicCache`` layout. Pass the matching ``position_ids``
explicitly (models.md §3.6); the ``*_position_ids`` helpers below give them.

Contents:

- generic: :func:`to_additive`, :func:`as_4d`, :func:`with_key_padding`, :func:`causal_mask`,
  :func:`decode_position_ids`;
- SBD (sbd.md §1, §3.3, §4.1): :func:`sbd_training_mask`, :func:`sbd_training_position_ids`,
  :func:`sbd_inference_mask`;
- block diffusion (multiblock.md §1, §3.1): :func:`block_causal_mask`, :func:`bd_training_mask`,
  :func:`bd_training_position_ids`, :func:`block_buffer_mask`.

The MultiTF group-aware dual-stream mask (multiblock.md §4.3: M_GD / M_GOC / M_BC) is *not* here.
It generalises the noisy->noisy and noisy->clean pieces of :func:`_dual_stream_mask` with group ids;
with every group of size 1 it must equal :func:`bd_training_mask` (multiblock.md §1.3), which is
the test that builder should carry.
"""

from __future__ import annotations

import torch

from unmask.errors import UnmaskError

__all__ = [
    "as_4d",
    "bd_training_mask",
    "bd_training_position_ids",
    "block_buffer_mask",
    "block_causal_mask",
    "causal_mask",
    "decode_position_ids",
    "sbd_inference_mask",
    "sbd_training_mask",
    "sbd_training_position_ids",
    "to_additive",
    "with_key_padding",
]


def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UnmaskError(f"{name} must be an integer >= {minimum}, got {value!r}.")


# ---------------------------------------------------------------------------------------------
# Generic pieces
# ---------------------------------------------------------------------------------------------


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bool mask -> additive float mask for eager attention (models.md §3.4).

    Args:
        mask: bool tensor of any shape, True = may attend.
        dtype: floating dtype of the result; use the model's compute dtype.

    Returns:
        Tensor of ``mask``'s shape and device in ``dtype``: 0 where ``mask`` is True and
        ``torch.finfo(dtype).min`` where it is False. ``finfo.min`` (not -inf) keeps a fully
        masked row finite, as transformers itself does.

    Raises:
        TypeError: ``mask`` is not bool or ``dtype`` is not floating.
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"to_additive expects a bool mask, got {mask.dtype}.")
    if not dtype.is_floating_point:
        raise TypeError(f"to_additive needs a floating dtype, got {dtype}.")
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)  # same shape as mask
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


def as_4d(mask: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """Lift a mask to the (B, 1, q_len, kv_len) layout transformers expects (models.md §3.3).

    Args:
        mask: (q, kv), (B, q, kv) or already (B, 1, q, kv); any dtype.
        batch: if given, a batch dimension of 1 is broadcast to ``batch``.

    Returns:
        (B, 1, q, kv) tensor, B = ``batch`` or the input's batch (1 for a 2D input). It may be a
        broadcast view of ``mask``: do not write into it in place.

    Raises:
        ValueError: wrong rank, a 4D input with a head dimension other than 1, or a batch that is
            neither 1 nor ``batch``.
    """
    if mask.dim() == 2:
        out = mask[None, None]  # (1, 1, q, kv)
    elif mask.dim() == 3:
        out = mask[:, None]  # (B, 1, q, kv)
    elif mask.dim() == 4 and mask.shape[1] == 1:
        out = mask  # (B, 1, q, kv)
    else:
        raise ValueError(f"as_4d expects (q, kv), (B, q, kv) or (B, 1, q, kv); got {tuple(mask.shape)}.")
    if batch is not None and out.shape[0] != batch:
        if out.shape[0] != 1:
            raise ValueError(f"mask batch {out.shape[0]} cannot be broadcast to batch {batch}.")
        out = out.expand(batch, -1, -1, -1)  # (batch, 1, q, kv), a view
    return out


def with_key_padding(
    mask4d: torch.Tensor, key_valid: torch.Tensor, past_len: int | None = None
) -> torch.Tensor:
    """Fold per-row key validity (e.g. left padding) into a 4D bool mask (models.md §3.3).

    A custom 4D mask bypasses transformers' 2D padding mask, so padding has to be removed from
    the mask itself: ``out = mask4d & key_valid``.

    **Empty-row rule.** A query row left with no visible key (typically a padding query, whose
    every allowed key is padding) is given back exactly one key: its own, at column
    ``past_len + i`` for query row i. Softmax then never sees an all-masked row (NaN under SDPA's
    -inf bool path, a uniform average under eager's finfo.min). Such rows are padding; their
    outputs are meaningless and must be ignored (label -100), but they stay finite. Rows with at
    least one visible key are never changed.

    Args:
        mask4d: (B or 1, 1, q, kv) bool, True = may attend.
        key_valid: (B, kv) bool, False at padded key positions.
        past_len: column of query row 0's own key. Default ``kv - q`` (the ``DynamicCache``
            layout, keys = past + new tokens); pass it for a ``StaticCache`` whose kv is
            ``max_cache_len``.

    Returns:
        (B, 1, q, kv) bool, a new tensor.

    Raises:
        TypeError: either input is not bool.
        ValueError: shapes do not match, or the own-key column falls outside ``kv``.
    """
    if mask4d.dtype != torch.bool or key_valid.dtype != torch.bool:
        raise TypeError("with_key_padding expects bool tensors; convert with to_additive afterwards.")
    if mask4d.dim() != 4 or mask4d.shape[1] != 1 or key_valid.dim() != 2:
        raise ValueError(
            f"expected mask4d (B, 1, q, kv) and key_valid (B, kv); got {tuple(mask4d.shape)} and "
            f"{tuple(key_valid.shape)}."
        )
    _, _, q_len, kv_len = mask4d.shape
    if key_valid.shape[1] != kv_len or mask4d.shape[0] not in (1, key_valid.shape[0]):
        raise ValueError(f"key_valid {tuple(key_valid.shape)} does not match mask4d {tuple(mask4d.shape)}.")
    past = kv_len - q_len if past_len is None else past_len
    if past < 0 or past + q_len > kv_len:
        raise ValueError(f"own-key columns {past}..{past + q_len - 1} fall outside kv_len={kv_len}.")
    out = mask4d & key_valid[:, None, None, :]  # (B, 1, q, kv)
    empty = ~out.any(dim=-1, keepdim=True)  # (B, 1, q, 1) rows with nothing left to attend
    rows = torch.arange(q_len, device=mask4d.device)  # (q,)
    cols = torch.arange(kv_len, device=mask4d.device)  # (kv,)
    own = cols[None, :] == (rows + past)[:, None]  # (q, kv) one True per row: the query's own key
    return out | (empty & own)  # (B, 1, q, kv)


def causal_mask(q_len: int, past_len: int = 0, *, device=None) -> torch.Tensor:
    """Plain causal mask for q_len new tokens after past_len cached ones.

    Query row i sits at absolute position ``past_len + i`` and sees keys ``j <= past_len + i``.

    Returns:
        (q_len, past_len + q_len) bool.
    """
    _check_int("q_len", q_len, 0)
    _check_int("past_len", past_len, 0)
    q_pos = torch.arange(past_len, past_len + q_len, device=device)  # (q,) absolute query positions
    k_pos = torch.arange(past_len + q_len, device=device)  # (kv,) absolute key positions
    return k_pos[None, :] <= q_pos[:, None]  # (q, kv)


def decode_position_ids(past_len: int, q_len: int, *, device=None) -> torch.Tensor:
    """Position ids matching every inference builder here: ``arange(past_len, past_len + q_len)``.

    Returns:
        (q_len,) long. Add a batch dimension (and per-row left-padding offsets) in the caller.
    """
    _check_int("q_len", q_len, 0)
    _check_int("past_len", past_len, 0)
    return torch.arange(past_len, past_len + q_len, device=device)  # (q,)


# ---------------------------------------------------------------------------------------------
# Dual-stream (clean + noisy copy) training masks
# ---------------------------------------------------------------------------------------------


def _dual_stream_mask(
    L: int, block_size: int, *, noisy_first: bool, clean_block_causal: bool, device
) -> torch.Tensor:
    """Shared core of the SBD and block-diffusion teacher-forcing masks, (2L, 2L) bool.

    Both copies share in-copy indices 0..L-1 and block ids ``index // block_size`` (a short
    tail block when L % block_size != 0). Rules:

    - clean -> clean: token-causal (SBD) or block-causal (block diffusion);
    - noisy -> noisy: same block only, bidirectional;
    - noisy -> clean: strictly earlier blocks only;
    - clean -> noisy: never.

    MultiTF seam: the group-aware builder replaces the two noisy-query pieces (M_GD, M_GOC).
    """
    pos = torch.arange(2 * L, device=device)  # (2L,) index in the concatenated input
    noisy = pos < L if noisy_first else pos >= L  # (2L,) True on the noisy copy
    idx = pos % L  # (2L,) index inside its own copy
    blk = idx // block_size  # (2L,) block id, shared by both copies
    q_noisy, k_noisy = noisy[:, None], noisy[None, :]  # (2L, 1), (1, 2L)
    q_blk, k_blk = blk[:, None], blk[None, :]  # (2L, 1), (1, 2L)
    if clean_block_causal:
        clean_vis = k_blk <= q_blk  # (2L, 2L)
    else:
        clean_vis = idx[None, :] <= idx[:, None]  # (2L, 2L)
    clean_clean = ~q_noisy & ~k_noisy & clean_vis  # (2L, 2L)
    noisy_noisy = q_noisy & k_noisy & (k_blk == q_blk)  # (2L, 2L)
    noisy_clean = q_noisy & ~k_noisy & (k_blk < q_blk)  # (2L, 2L)
    return clean_clean | noisy_noisy | noisy_clean  # (2L, 2L)


def _dual_stream_position_ids(L: int, device) -> torch.Tensor:
    _check_int("L", L, 1)
    ar = torch.arange(L, device=device)  # (L,)
    return torch.cat([ar, ar])  # (2L,) both copies share positions 0..L-1


# ---------------------------------------------------------------------------------------------
# Set Block Decoding (sbd.md)
# ---------------------------------------------------------------------------------------------


def sbd_training_mask(L: int, k: int, device=None) -> torch.Tensor:
    """SBD training mask over ``cat([clean, noisy])`` (sbd.md §3.2–3.3, SBD Fig. 9).

    With ``half = L``, query q may attend key j iff

    1. ``q < L and j < L and j <= q`` (clean -> clean, causal);
    2. ``q >= L and j >= L and (q-L)//k == (j-L)//k`` (noisy -> noisy, same block);
    3. ``q >= L and j < L and (q-L)//k > j//k`` (noisy -> clean, strictly earlier blocks).

    This is Fig. 9 with fix #4 of sbd.md §3.5 (Q_LEN = KV_LEN = 2L, half = L). When L % k != 0
    the trailing block is shorter; it follows the same rule (its labels are -100, §3.4).

    Args:
        L: length of each copy, >= 1.
        k: block size, >= 1.

    Returns:
        (2L, 2L) bool. Use with :func:`sbd_training_position_ids`.

    Raises:
        UnmaskError: L or k < 1.
    """
    _check_int("L", L, 1)
    _check_int("k", k, 1)
    return _dual_stream_mask(L, k, noisy_first=False, clean_block_causal=False, device=device)


def sbd_training_position_ids(L: int, device=None) -> torch.Tensor:
    """Repeated positions ``cat([arange(L), arange(L)])`` for SBD training (sbd.md §3.2).

    Returns:
        (2L,) long; noisy token i shares clean token i's RoPE position.
    """
    return _dual_stream_position_ids(L, device)


def sbd_inference_mask(past_len: int, n_causal: int, n_block: int, *, device=None) -> torch.Tensor:
    """Mask of one cached SBD decode forward (sbd.md §1 block mode, §4.1 fused re-feed).

    The new tokens are ``n_causal`` re-fed tokens (the previous, now committed block) followed by
    ``n_block`` block tokens. The re-fed rows are causal over the past and themselves, so their
    K/V are the exact causal ones to keep in the cache; the block rows see the past, every re-fed
    token and the whole block (bidirectional). ``n_causal = 0`` is the plain block step.

    The uncached form ``sbd_inference_mask(0, c, L - c)`` is Fig. 10's rule ``j <= q or q >= c``.

    Returns:
        (n_causal + n_block, past_len + n_causal + n_block) bool. Positions:
        ``decode_position_ids(past_len, n_causal + n_block)``.

    Raises:
        UnmaskError: a negative size.
    """
    _check_int("n_causal", n_causal, 0)
    _check_int("n_block", n_block, 0)
    q_len = n_causal + n_block
    causal = causal_mask(q_len, past_len, device=device)  # (q, kv)
    is_block = torch.arange(q_len, device=device) >= n_causal  # (q,) rows of the noisy block
    return causal | is_block[:, None]  # (q, kv)


# ---------------------------------------------------------------------------------------------
# Block diffusion (multiblock.md)
# ---------------------------------------------------------------------------------------------


def block_causal_mask(
    q_len: int, block_size: int, past_len: int = 0, offset: int = 0, *, device=None
) -> torch.Tensor:
    """Block-causal mask (multiblock.md §1.1): attend iff ``block(key) <= block(query)``.

    Keys are absolute positions ``0 .. past_len + q_len - 1``, query row i is position
    ``past_len + i``, and ``block(pos) = (pos - offset) // block_size`` (floor division, so
    positions before ``offset`` fall in negative blocks and stay visible to everything after).
    ``offset`` aligns blocks to a boundary other than position 0; multiblock.md §3.2 aligns them
    to 0 (prompt padded to a multiple of B), so the default needs no offset.

    Returns:
        (q_len, past_len + q_len) bool. Positions: ``decode_position_ids(past_len, q_len)``.

    Raises:
        UnmaskError: a negative length or block_size < 1.
    """
    _check_int("q_len", q_len, 0)
    _check_int("block_size", block_size, 1)
    _check_int("past_len", past_len, 0)
    if not isinstance(offset, int):
        raise UnmaskError(f"offset must be an integer, got {offset!r}.")
    q_pos = torch.arange(past_len, past_len + q_len, device=device)  # (q,)
    k_pos = torch.arange(past_len + q_len, device=device)  # (kv,)
    q_blk = torch.div(q_pos - offset, block_size, rounding_mode="floor")  # (q,)
    k_blk = torch.div(k_pos - offset, block_size, rounding_mode="floor")  # (kv,)
    return k_blk[None, :] <= q_blk[:, None]  # (q, kv)


def bd_training_mask(L: int, block_size: int, device=None, *, noisy_first: bool = True) -> torch.Tensor:
    """Dual-stream teacher-forcing mask for block diffusion (multiblock.md §1.3).

    Layout follows multiblock.md §1.3 / §4.3: ``X = [x_t ; x_0]``, the **noisy copy first**, then
    the clean copy (``noisy_first=False`` gives ``[x_0 ; x_t]``, SBD's order). With β the block
    id ``index // block_size`` inside each copy:

    - noisy query i, noisy key j: visible iff β(j) == β(i) (bidirectional inside the block);
    - noisy query, clean key: visible iff β(j) < β(i);
    - clean query, clean key: visible iff β(j) <= β(i) (block-causal);
    - clean query, noisy key: never.

    This is MultiTF's mask with every group of size 1 (multiblock.md §1.3).

    Returns:
        (2L, 2L) bool. Use with :func:`bd_training_position_ids`.

    Raises:
        UnmaskError: L or block_size < 1.
    """
    _check_int("L", L, 1)
    _check_int("block_size", block_size, 1)
    return _dual_stream_mask(L, block_size, noisy_first=noisy_first, clean_block_causal=True, device=device)


def bd_training_position_ids(L: int, device=None) -> torch.Tensor:
    """Shared positions ``cat([arange(L), arange(L)])`` for either dual-stream order (multiblock.md §1.3).

    Returns:
        (2L,) long.
    """
    return _dual_stream_position_ids(L, device)


def block_buffer_mask(past_len: int, n_slots: int, block_size: int, *, device=None) -> torch.Tensor:
    """Mask of one Block Buffer forward (multiblock.md §3.1, §3.3 step 2).

    The window holds ``n_slots`` slots of ``block_size`` tokens after ``past_len`` cached tokens.
    Every slot sees the whole cached prefix, the earlier slots and itself (bidirectionally); it
    never sees later slots, which is what hides dummy slots from real ones. Slots are counted from
    the window start, so the rule holds whether or not ``past_len`` is a multiple of the block
    size.

    Also serves SingleBD (``n_slots=1``) and its fused store (``n_slots=2``: the finished block's
    clean K/V are block-causal, i.e. bidirectional inside the block, unlike SBD's causal re-feed).

    Returns:
        (n_slots * block_size, past_len + n_slots * block_size) bool. Positions:
        ``decode_position_ids(past_len, n_slots * block_size)``.

    Raises:
        UnmaskError: a negative size or block_size < 1.
    """
    _check_int("n_slots", n_slots, 0)
    _check_int("block_size", block_size, 1)
    # offset = past_len puts every cached key in a negative block, hence visible to all slots.
    return block_causal_mask(n_slots * block_size, block_size, past_len, offset=past_len, device=device)
