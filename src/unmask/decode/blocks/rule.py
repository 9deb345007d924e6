"""The pure pieces of the block decoders' running batch (:mod:`unmask.decode.blocks.batch`): the commit
rule's bookkeeping (:func:`advance`), the per-row quota of the published quota-threshold loops
(:func:`quota`), and what differs between SingleBD and lossy SBD (:class:`Kind`). Tensors in,
tensors out; tested exhaustively on CPU (STYLE.md habit 2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def quota(block_size: int, steps: int, step: torch.Tensor) -> torch.Tensor:
    """:func:`unmask.decode.blocks.single.block_quota` per row: step (R,) long -> tokens to commit (R,) long."""
    base, rem = divmod(block_size, steps)
    return base + (step.clamp(max=steps - 1) < rem).long()


def advance(seq, dpos, block, chosen, tokens, editable, live, denoise, bstart, gen_start, gen_end, stops, B: int,
            lockstep: bool, mask_id: int):
    """The commit rule's bookkeeping (pure): write the commits, say which rows' blocks end.

    seq (R, L); dpos, block, chosen, tokens, editable (R, N); live, denoise (R,) bool; bstart,
    gen_start, gen_end (R,) long; stops (s,) long. A denoising row's block is complete when no
    editable position is masked; with ``lockstep`` it moves on only when every live row's is. A
    moving row ends when its block holds its first generated stop token or reaches ``gen_end``.
    Returns (seq, block (R, N), had (R,) bool: the row had masks, go (R,) bool: its block is done,
    ended (R,) bool)."""
    from unmask.decode.blocks.single import first_stop

    work = live & denoise  # (R,)
    had = (editable & (block == mask_id)).any(dim=1) & work  # (R,)
    block = torch.where(chosen, tokens, block)  # (R, N)
    seq = seq.scatter(1, dpos, torch.where(work[:, None], block, seq.gather(1, dpos)))  # (R, L)
    left = (editable & (block == mask_id)).any(dim=1) & work  # (R,)
    go = work & ~left
    if lockstep:
        go &= ~left.any()
    end = bstart + B  # (R,)
    ended = go & ((first_stop(seq, gen_start, gen_end, stops) < end) | (end >= gen_end))
    return seq, block, had, go, ended


@dataclass(frozen=True)
class Kind:
    """What differs between SingleBD and lossy SBD (see the module docstring)."""

    name: str
    aligned: bool  # blocks start at multiples of B (SingleBD) or at the prompt's end (SBD)
    causal_store: bool  # the store region is causal (SBD re-feed) or one bidirectional block


SINGLE_BD = Kind("block", aligned=True, causal_store=False)
SBD = Kind("sbd", aligned=False, causal_store=True)


__all__ = ["Kind", "SBD", "SINGLE_BD", "advance", "quota"]
