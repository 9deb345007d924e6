"""The MultiTF group-aware dual-stream training mask (multiblock.md §4.3; MBD-LMs eqs. 3.2–3.3, B.5–B.9).

Input layout, as :func:`unmask.masks.bd_training_mask`: ``X = [x_t ; x_0]``, the noisy copy
(rows/columns 0..L-1) first, then the clean copy (L..2L-1), both with position ids 0..L-1. Block
ids are ``index // block_size`` inside each copy; a *layout* assigns every block a group id (a
group is a run of consecutive blocks). With β the block id, g the group id and α(i) the first
block of i's group::

    A = [[M_GD, M_GOC],      M_GD  noisy -> noisy: g(j) == g(i) and β(j) <= β(i)
         [0,    M_BC ]]      M_GOC noisy -> clean: β(j) < α(i)
                             M_BC  clean -> clean: β(j) <= β(i);  clean -> noisy: never

Because groups are runs of consecutive blocks, β(j) < α(i) is the same as the code's g(j) < g(i).
Blocks flagged not ``group_aware`` (prompt-only and padding/tail blocks in the released code) use
the plain TF rules for their noisy queries: same block only, and clean keys of strictly earlier
blocks. With every group of size 1 both rule sets coincide and the mask equals
``bd_training_mask`` (multiblock.md §1.3: TF is MultiTF with singleton groups); plain TF in
:mod:`unmask.train.block_diffusion` builds its mask here too, so the library has one builder.

Pure functions of indices; batched over any leading dimensions (one layout per training row).
"""

from __future__ import annotations

import torch

from unmask.errors import UnmaskError

__all__ = ["group_dual_stream_mask", "group_starts"]


def _check_groups(block_group: torch.Tensor, block_size: int, L: int | None) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise UnmaskError(f"block_size must be an integer >= 1, got {block_size!r}.")
    if block_group.dim() < 1 or block_group.shape[-1] < 1:
        raise UnmaskError(f"block_group must be (..., K) with K >= 1 blocks, got {tuple(block_group.shape)}.")
    if block_group.dtype.is_floating_point or block_group.dtype == torch.bool:
        raise UnmaskError(f"block_group must hold integer group ids, got {block_group.dtype}.")
    K = block_group.shape[-1]
    if L is None:
        L = K * block_size
    if not isinstance(L, int) or isinstance(L, bool) or L < 1:
        raise UnmaskError(f"L must be an integer >= 1, got {L!r}.")
    if -(-L // block_size) != K:
        raise UnmaskError(f"L={L} with block_size={block_size} has {-(-L // block_size)} blocks, "
                          f"but block_group gives {K}.")
    if K > 1 and bool((block_group[..., 1:] < block_group[..., :-1]).any()):
        raise UnmaskError("group ids must be non-decreasing along the blocks: a group is a run of consecutive blocks.")
    return L


def group_starts(block_group: torch.Tensor) -> torch.Tensor:
    """α per block: the index of the first block of each block's group.

    Args:
        block_group: (..., K) integer group ids, non-decreasing along the last dimension.

    Returns:
        (..., K) long.
    """
    K = block_group.shape[-1]
    idx = torch.arange(K, device=block_group.device).expand(block_group.shape)  # (..., K)
    first = torch.ones_like(block_group, dtype=torch.bool)  # (..., K) True where a group starts
    first[..., 1:] = block_group[..., 1:] != block_group[..., :-1]
    return torch.where(first, idx, torch.zeros_like(idx)).cummax(dim=-1).values  # (..., K)


def group_dual_stream_mask(block_group: torch.Tensor, block_size: int, L: int | None = None, *,
                           group_aware: torch.Tensor | None = None) -> torch.Tensor:
    """The group-aware dual-stream mask A_λ of one or many layouts (multiblock.md §4.3).

    Args:
        block_group: (..., K) integer group id of every block of a copy, non-decreasing (groups
            are runs of consecutive blocks; the ids need not start at 0 or be consecutive).
        block_size: B. Block k covers in-copy indices ``k*B .. min((k+1)*B, L) - 1``.
        L: length of each copy; default ``K * B``. ``ceil(L / B)`` must equal K (a short tail
            block is allowed, as in ``bd_training_mask``).
        group_aware: (..., K) bool, broadcastable to ``block_group``: the blocks whose noisy
            queries follow M_GD / M_GOC. Others (prompt and tail blocks, code-only rule of §4.3)
            follow the plain TF rules. Default: every block.

    Returns:
        (..., 2L, 2L) bool, True = the query (row) may attend the key (column); noisy copy
        first. Use with ``unmask.masks.bd_training_position_ids(L)``.

    Raises:
        UnmaskError: bad shapes or dtypes, K != ceil(L / B), or decreasing group ids.
    """
    L = _check_groups(block_group, block_size, L)
    device = block_group.device
    blk = torch.arange(L, device=device) // block_size  # (L,) block id of each in-copy index
    g = block_group[..., blk]  # (..., L) group id per position
    alpha = group_starts(block_group)[..., blk]  # (..., L) first block of the position's group
    if group_aware is None:
        aware = torch.ones_like(g, dtype=torch.bool)  # (..., L)
    else:
        if group_aware.dtype != torch.bool:
            raise UnmaskError(f"group_aware must be bool, got {group_aware.dtype}.")
        try:
            aware = torch.broadcast_to(group_aware, block_group.shape)[..., blk]  # (..., L)
        except RuntimeError:
            raise UnmaskError(f"group_aware {tuple(group_aware.shape)} does not broadcast to block_group "
                              f"{tuple(block_group.shape)}.") from None
    q_blk, k_blk = blk[:, None], blk[None, :]  # (L, 1), (1, L)
    q_aware = aware[..., :, None]  # (..., L, 1)
    same_group = g[..., :, None] == g[..., None, :]  # (..., L, L)
    m_gd = torch.where(q_aware, same_group & (k_blk <= q_blk), k_blk == q_blk)  # (..., L, L) noisy -> noisy
    m_goc = torch.where(q_aware, k_blk < alpha[..., :, None], k_blk < q_blk)  # (..., L, L) noisy -> clean
    m_bc = (k_blk <= q_blk).expand(m_gd.shape)  # (..., L, L) clean -> clean
    never = torch.zeros_like(m_gd)  # (..., L, L) clean -> noisy
    top = torch.cat([m_gd, m_goc], dim=-1)  # (..., L, 2L) noisy queries
    bottom = torch.cat([never, m_bc], dim=-1)  # (..., L, 2L) clean queries
    return torch.cat([top, bottom], dim=-2)  # (..., 2L, 2L)
