"""Per-position statistics of q and token draws (SBD §5.1 steps 1–2, diffusion.md §0, §4): pure, batched.

:func:`token_stats` gives top-1, κ, H and Δ of q; :func:`suppress` sets vocabulary columns to -inf;
:func:`gumbel_argmax` and :func:`draw_tokens` draw tokens at T > 0. :func:`unmask.policies.commit`
builds on them.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from unmask.policies.configs import is_number_or_inf, require
from unmask.sampling import TEMPERATURE_RANGE


class TokenStats(NamedTuple):
    """Per-position statistics of q (diffusion.md §0); each field is (B, N)."""

    top1: Tensor        # long, argmax token
    confidence: Tensor  # float32, κ = max q
    entropy: Tensor     # float32, H = −Σ q log q, nats
    margin: Tensor      # float32, Δ = q(top1) − q(top2)


def log_probs(logits: Tensor, temperature: float) -> Tensor:
    # SBD §5.2: at T = 0 the unscaled softmax; the T → 0 limit would have zero entropy everywhere.
    z = logits.float()
    if temperature > 0:
        z = z / temperature
    return F.log_softmax(z, dim=-1)  # (B, N, V)


def stats_of(log_q: Tensor) -> TokenStats:
    q = log_q.exp()  # (B, N, V)
    # A -inf logit (mask token) has q = 0 and log q = -inf; its term q log q is 0, not nan.
    entropy = -torch.where(q > 0, q * log_q, torch.zeros_like(q)).sum(-1)  # (B, N)
    top = q.topk(min(2, q.shape[-1]), dim=-1)  # values, indices: (B, N, 1 or 2)
    second = top.values[..., 1] if q.shape[-1] > 1 else torch.zeros_like(top.values[..., 0])
    return TokenStats(top1=q.argmax(-1), confidence=top.values[..., 0], entropy=entropy,
                      margin=top.values[..., 0] - second)


def check_temperature(temperature: float) -> None:
    require(is_number_or_inf(temperature) and 0 <= temperature < math.inf,
            f"temperature must be a finite number >= 0 (got {temperature!r}); use 0 for greedy decoding")
    low, high = TEMPERATURE_RANGE
    require(temperature == 0 or low <= temperature <= high,
            f"temperature {temperature!r} is outside [{low:g}, {high:g}], where logits / T overflow or vanish in "
            "float32; use 0 for greedy decoding or a temperature in that range")


def token_stats(logits: Tensor, *, temperature: float = 0.0) -> TokenStats:
    """Top-1 token, confidence κ, entropy H (nats) and margin Δ of q, in float32 (SBD §5.1 steps 1–2).

    logits: (B, N, V), any float dtype. q = softmax(logits / T) if T > 0, else softmax(logits).
    Returns a :class:`TokenStats` of (B, N) tensors. Raises UnmaskError for a bad temperature or shape.
    """
    check_temperature(temperature)
    require(logits.dim() == 3, f"logits must be (B, N, V) (got shape {tuple(logits.shape)})")
    return stats_of(log_probs(logits, temperature))


def suppress(logits: Tensor, ids: int | Sequence[int] | Tensor) -> Tensor:
    """Return a copy of ``logits`` (..., V) with the vocabulary columns ``ids`` set to -inf.

    Used for the mask token and EOS suppression (SBD §2, diffusion.md §9). The input is not modified.
    """
    V = logits.shape[-1]
    index = torch.as_tensor(ids, dtype=torch.long, device=logits.device).reshape(-1)  # (n_ids,)
    require(bool(((index >= 0) & (index < V)).all()), f"suppress ids must lie in [0, {V}) (got {index.tolist()})")
    return logits.index_fill(-1, index, float("-inf"))


def gumbel_argmax(logits: Tensor, temperature: float, generator: torch.Generator | None = None) -> Tensor:
    """Gumbel-max sample from softmax(logits / T), LLaDA's ``add_gumbel_noise`` (diffusion.md §4).

    logits: (..., V). Returns long (...). T = 0 is a plain argmax. For T > 0 the score
    exp(logits) / (−log u)^T with u ~ U(0, 1) is formed in float64 and maximised, exactly as the
    reference (so, like it, logits above ~709 overflow to inf). u is drawn from ``generator``.
    """
    check_temperature(temperature)
    if temperature == 0:
        return logits.argmax(-1)
    z = logits.to(torch.float64)
    u = torch.rand(z.shape, generator=generator, dtype=torch.float64, device=z.device)  # (..., V)
    # Keep u strictly inside (0, 1): at u = 1 the noise −log u is 0 and a −inf column (the mask
    # token) scores 0 / 0 = nan, which argmax picks. Inside (0, 1) this is the reference bit for bit.
    u = u.clamp(min=torch.finfo(torch.float64).tiny, max=math.nextafter(1.0, 0.0))
    return (z.exp() / (-torch.log(u)) ** temperature).argmax(-1)


def _filter(z: Tensor, top_k: int, top_p: float) -> Tensor:
    """Boolean (B, N, V) mask of the columns that top-k then top-p filtering removes from scaled logits z."""
    removed = torch.zeros_like(z, dtype=torch.bool)
    if 0 < top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]  # (B, N, 1)
        removed = z < kth
    if top_p < 1:
        z = z.masked_fill(removed, float("-inf"))
        probs, order = F.softmax(z, dim=-1).sort(dim=-1, descending=True)  # (B, N, V) each
        # Drop a token when the mass strictly before it already reaches top_p; the top-1 always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # (B, N, V), in sorted order
        drop_sorted[..., 0] = False  # a top_p below float32's range rounds to 0 and would drop every token
        removed = removed | torch.zeros_like(removed).scatter(-1, order, drop_sorted)
    return removed


def draw_tokens(logits: Tensor, log_q: Tensor, temperature: float, top_k: int, top_p: float, sampling: str,
          generator: torch.Generator | None) -> Tensor:
    """Sample (B, N) tokens at T > 0 from logits (B, N, V) after top-k / top-p filtering (diffusion.md §4)."""
    B, N, V = logits.shape
    removed = _filter(logits.float() / temperature, top_k, top_p)  # (B, N, V)
    if sampling == "gumbel":
        return gumbel_argmax(logits.masked_fill(removed, float("-inf")), temperature, generator)
    probs = log_q.masked_fill(removed, float("-inf")).softmax(-1)  # (B, N, V)
    flat = probs.reshape(B * N, V)  # (B*N, V): multinomial takes 2-D input
    return torch.multinomial(flat, 1, generator=generator).reshape(B, N)  # (B, N)
