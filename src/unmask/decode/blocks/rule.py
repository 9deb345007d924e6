"""The pure pieces of the block decoders (:mod:`unmask.decode.blocks.batch`, and the Block Buffer's
stop detection): the commit rule's bookkeeping (:func:`advance`), the first generated stop token
(:func:`first_stop`), the published quota-threshold rule (:func:`block_quota`, :func:`quota`,
:func:`quota_threshold_commit`), and what differs between SingleBD and lossy SBD (:class:`Kind`).
Tensors in, tensors out; tested exhaustively on CPU (STYLE.md habit 2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unmask.errors import UnmaskError
from unmask.policies import CONFIDENCES
from unmask.sampling import Sampling, filter_logits


def block_quota(block_size: int, steps: int, s: int) -> int:
    """Tokens to commit at denoising step s of a block (LLaDA2 ``_get_num_transfer_tokens``): the
    block size spread over ``steps``, the first ``block_size % steps`` steps taking one more."""
    base, rem = divmod(block_size, steps)
    return base + int(min(s, steps - 1) < rem)


def quota(block_size: int, steps: int, step: torch.Tensor) -> torch.Tensor:
    """:func:`block_quota` per row: step (R,) long -> tokens to commit (R,) long."""
    base, rem = divmod(block_size, steps)
    return base + (step.clamp(max=steps - 1) < rem).long()


def quota_threshold_commit(logits: torch.Tensor, masked: torch.Tensor, tau: float, quota: int | torch.Tensor,
                           sampling: Sampling, generator: torch.Generator | list | None,
                           confidence: str | None = None):
    """The LLaDA2 ``generate`` / SDAR ``low_confidence_dynamic`` commit rule (multiblock.md §1.2 step 3).

    logits (R, B, V); masked (R, B) bool; quota: an int or (R,) long. Tokens are the argmax
    (temperature 0) or a draw from softmax(logits / T) after top-k then top-p filtering. κ is the
    chosen token's probability under the same filtering of softmax(logits) (``confidence`` None or
    "untempered", the default: as T → 0 the rule tends to its T = 0 one) or, as the published code
    does, of softmax(logits / T) (``"tempered"``: at T = 0.1 most κ round to 1.0 and a block commits
    at once). A row commits every masked position with κ > τ (strict) when there are at least
    ``quota`` of them, else its ``quota`` most confident masked positions.
    (The published ``generate`` draws from softmax(logits) even at temperature 0; here 0 is greedy.)
    Returns (chosen (R, B) bool, tokens (R, B) long). Raises UnmaskError for an unknown ``confidence``.
    """
    R, B, V = logits.shape
    z = logits.float()
    if sampling.temperature > 0:
        z = z / sampling.temperature
    kept = filter_logits(z, sampling.top_k, sampling.top_p)  # (R, B, V), -inf outside top-k / top-p
    probs = kept.softmax(-1)  # (R, B, V)
    if sampling.temperature > 0 and isinstance(generator, (list, tuple)):  # one generator per row
        tokens = torch.stack([torch.multinomial(probs[r], 1, generator=g)[:, 0] for r, g in enumerate(generator)])
    elif sampling.temperature > 0:
        tokens = torch.multinomial(probs.reshape(R * B, V), 1, generator=generator).reshape(R, B)
    else:
        tokens = probs.argmax(-1)  # (R, B)
    if confidence is not None and confidence not in CONFIDENCES:
        raise UnmaskError(f"confidence must be one of {', '.join(CONFIDENCES)} (got {confidence!r})")
    if sampling.temperature > 0 and confidence != "tempered":
        probs = logits.float().masked_fill(kept == float("-inf"), float("-inf")).softmax(-1)  # (R, B, V), same support
    conf = probs.gather(-1, tokens[..., None])[..., 0].masked_fill(~masked, float("-inf"))  # (R, B)
    high = (conf > tau) & masked  # (R, B)
    k = masked.sum(dim=1).clamp(max=quota)  # (R,)
    order = conf.argsort(dim=1, descending=True, stable=True)  # (R, B)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(B, device=order.device).expand(R, B))  # (R, B)
    top = (rank < k[:, None]) & masked  # (R, B)
    return torch.where((high.sum(dim=1) >= k)[:, None], high, top), tokens


def first_stop(seq: torch.Tensor, gen_start: torch.Tensor, gen_end: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """(R,) long: position of the first generated stop token per row, ``seq.shape[1]`` if none.
    seq (R, L); gen_start, gen_end (R,) long: the generated positions [start, end); stops (s,) long."""
    L = seq.shape[1]
    pos = torch.arange(L, device=seq.device)  # (L,)
    hit = torch.isin(seq, stops) & (pos >= gen_start[:, None]) & (pos < gen_end[:, None])  # (R, L)
    return torch.where(hit.any(dim=1), hit.float().argmax(dim=1), torch.full_like(gen_start, L))


def advance(seq, dpos, block, chosen, tokens, editable, live, denoise, bstart, gen_start, gen_end, stops, B: int,
            lockstep: bool, mask_id: int):
    """The commit rule's bookkeeping (pure): write the commits, say which rows' blocks end.

    seq (R, L); dpos, block, chosen, tokens, editable (R, N); live, denoise (R,) bool; bstart,
    gen_start, gen_end (R,) long; stops (s,) long. A denoising row's block is complete when no
    editable position is masked; with ``lockstep`` it moves on only when every live row's is. A
    moving row ends when its block holds its first generated stop token or reaches ``gen_end``.
    Returns (seq, block (R, N), had (R,) bool: the row had masks, go (R,) bool: its block is done,
    ended (R,) bool)."""
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
    """What differs between SingleBD and lossy SBD (:mod:`unmask.decode.blocks.batch`): ``aligned`` blocks
    start at multiples of B and are stored as one block (SingleBD), else at the prompt's end, re-fed causally."""

    name: str
    aligned: bool


SINGLE_BD = Kind("block", aligned=True)
SBD = Kind("sbd", aligned=False)


__all__ = ["Kind", "SBD", "SINGLE_BD", "advance", "block_quota", "first_stop", "quota", "quota_threshold_commit"]
