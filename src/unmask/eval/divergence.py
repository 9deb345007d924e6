"""Where two greedy decodings of one prompt part, and how close the next-token choice was there.

Lossless SBD equals AR token for token in float32. In bfloat16 its K-query verify forward sums in
another order than AR's 1-query forward, so at a near-tie (the two best logits within bfloat16
rounding of each other) the argmax can flip and the texts part from there on (README "Lossless
and lossy SBD"). :func:`first_divergence` finds the position; :func:`top2_gap` measures the
top-2 logit gap of the AR computation there (one prefill, then 1-query forwards over the common
prefix with a KV cache); :func:`divergence` does both for one prompt.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from unmask.compat import forward, new_cache
from unmask.errors import UnmaskError

# bfloat16 keeps 8 significant bits (7 stored): the spacing of representable values near x is
# 2**(floor(log2|x|) - 7).
BF16_MANTISSA_BITS = 7


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where token lists ``a`` and ``b`` differ (a length difference counts:
    the shorter one's length), or None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 values at magnitude ``|x|`` (its unit in the last place); 0 -> the
    smallest normal spacing."""
    x = abs(float(x))
    if x == 0.0 or not math.isfinite(x):
        return 2.0 ** (-126 - BF16_MANTISSA_BITS)
    return 2.0 ** (math.floor(math.log2(x)) - BF16_MANTISSA_BITS)


@dataclass(frozen=True)
class Gap:
    """The next-token logits' two best entries at one position: ids, values and their gap (logit
    units), also in bfloat16 ulps at the top logit's magnitude."""

    top1: int
    top2: int
    logit1: float
    logit2: float
    gap: float
    gap_ulps: float


def gap_of(logits: torch.Tensor) -> Gap:
    """:class:`Gap` of one next-token logit vector ``logits`` (V,) (any float dtype)."""
    if logits.dim() != 1 or logits.numel() < 2:
        raise UnmaskError(f"gap_of needs one logit vector of >= 2 entries (got shape {tuple(logits.shape)})")
    v, i = torch.topk(logits.float(), 2)  # (2,), (2,)
    g = float(v[0] - v[1])
    return Gap(top1=int(i[0]), top2=int(i[1]), logit1=float(v[0]), logit2=float(v[1]), gap=g,
               gap_ulps=g / bf16_ulp(float(v[0])))


@torch.inference_mode()
def ar_logits(bundle, prompt: Sequence[int], prefix: Sequence[int]) -> torch.Tensor:
    """The next-token logits (V,) float32 after ``prompt + prefix``, computed as AR does: a prefill
    of ``prompt``, then one 1-query forward per token of ``prefix`` on a KV cache (in the bundle's
    dtype and device). Raises UnmaskError for an empty prompt."""
    if not prompt:
        raise UnmaskError("ar_logits needs a non-empty prompt")
    dev, model = bundle.device, bundle.model
    cache = new_cache(model)
    ids = torch.tensor([list(prompt)], device=dev)  # (1, P)
    pos = torch.arange(ids.shape[1], device=dev)[None]  # (1, P)
    logits = forward(model, ids, position_ids=pos, cache=cache, logits_to_keep=1)  # (1, 1, V)
    for j, t in enumerate(prefix):
        p = torch.tensor([[len(prompt) + j]], device=dev)  # (1, 1)
        logits = forward(model, torch.tensor([[t]], device=dev), position_ids=p, cache=cache,
                         logits_to_keep=1)  # (1, 1, V)
    return logits[0, -1].float()


def top2_gap(bundle, prompt: Sequence[int], prefix: Sequence[int]) -> Gap:
    """:class:`Gap` of :func:`ar_logits` after ``prompt + prefix``."""
    return gap_of(ar_logits(bundle, prompt, prefix))


@dataclass(frozen=True)
class Divergence:
    """Where ``other`` first leaves ``reference`` (a greedy AR decoding) and the AR logits there:
    ``position`` (index into the generated tokens), the two tokens (None past a row's end), the
    top-2 :class:`Gap`, and ``chosen_gap``: AR's logit of its token minus its logit of ``other``'s
    token (0 < chosen_gap <= the gap's second place, when ``other`` took AR's runner-up)."""

    position: int
    reference_token: int | None
    other_token: int | None
    gap: Gap
    chosen_gap: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def divergence(bundle, prompt: Sequence[int], reference: Sequence[int], other: Sequence[int]) -> Divergence | None:
    """The :class:`Divergence` of ``other`` from ``reference`` (both generated after ``prompt`` by
    ``bundle``), or None when they are identical."""
    i = first_divergence(reference, other)
    if i is None:
        return None
    ref_tok = reference[i] if i < len(reference) else None
    oth_tok = other[i] if i < len(other) else None
    last = ar_logits(bundle, prompt, reference[:i])  # (V,)
    chosen = (float(last[ref_tok] - last[oth_tok]) if ref_tok is not None and oth_tok is not None else None)
    return Divergence(position=i, reference_token=ref_tok, other_token=oth_tok, gap=gap_of(last), chosen_gap=chosen)
