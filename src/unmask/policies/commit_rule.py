"""The commit rule: which masked positions to reveal this step, and with which token (SBD §5,
diffusion.md §3, §4, §6, §7). :func:`commit` is a pure, batched function of the logits and the mask;
the policy is one of the frozen configs of :mod:`unmask.policies.configs`.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from unmask.errors import UnmaskError
from unmask.policies.configs import (CONFIDENCES, POLICY_NAMES, EntropyBound, EntropyThreshold, Factor, Policy,
                                     Threshold, TopK, is_number_or_inf, require)
from unmask.policies.token_stats import check_temperature, draw_tokens, log_probs, stats_of


def _certainty(log_q: Tensor, tokens: Tensor) -> Tensor:
    """−log(1 − q(token)): a ranking key increasing in q(token) that does not saturate.

    log_q (B, N, V), tokens (B, N) -> (B, N) float32. At a small temperature q(top-1) rounds to
    exactly 1.0 (even in float64) and every position would tie. Where 1 − q is small its float32
    value is coarse, so 1 − q = Σ_{v ≠ token} q_v is taken from the other tokens' log-probabilities,
    which stay exact; elsewhere the key is −log1p(−q) of q itself, so equal q still tie (ties go to
    the lower position). +inf when no other token has mass.
    """
    q = log_q.gather(-1, tokens[..., None])[..., 0].exp()  # (B, N)
    others = log_q.scatter(-1, tokens[..., None], float("-inf"))  # (B, N, V)
    fine = -torch.logsumexp(others, dim=-1)  # (B, N)
    return torch.where(q < 1 - 2 ** -10, -torch.log1p(-q), fine)


def _rank(score: Tensor, masked: Tensor) -> Tensor:
    """(B, N) positions ordered masked-first, then by score descending, ties to the lower position."""
    order = score.sort(dim=1, descending=True, stable=True).indices  # (B, N)
    # Second stable pass puts every non-masked position last, whatever its score (even a -inf tie).
    unmasked_sorted = (~masked.gather(1, order)).to(torch.uint8)  # (B, N)
    return order.gather(1, unmasked_sorted.sort(dim=1, stable=True).indices)  # (B, N)


def _prefix_len(ok_sorted: Tensor) -> Tensor:
    """Length of the leading run of True along dim 1: (B, N) bool -> (B,) long."""
    return ok_sorted.long().cumprod(dim=1).sum(dim=1)


def _take(order: Tensor, count: Tensor) -> Tensor:
    """Commit the first ``count`` (B,) entries of ``order`` (B, N) -> (B, N) bool in position order."""
    cols = torch.arange(order.shape[1], device=order.device)  # (N,)
    take_sorted = cols[None, :] < count[:, None]  # (B, N), in sorted order
    return torch.zeros_like(take_sorted).scatter(1, order, take_sorted)


def commit(
    logits: Tensor,
    masked: Tensor,
    policy: Policy,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    quota: Tensor | None = None,
    confidence: Literal["tempered", "untempered"] | None = None,
    sampling: Literal["categorical", "gumbel"] = "categorical",
    draws: Sequence[int] | None = None,
    validate: bool = True,
) -> tuple[Tensor, Tensor]:
    """Choose the positions to commit this step and their tokens (SBD §5, diffusion.md §3, §4, §6, §7).

    Args:
        logits: (B, N, V) float; mask (and suppressed) columns already -inf.
        masked: (B, N) bool, the positions that may be committed.
        policy: one of :data:`Policy`.
        temperature: T ≥ 0. T = 0 takes the argmax; T > 0 samples from softmax(logits / T) after top-k
            then top-p filtering. Entropy, margin and the EB proxies always use the unfiltered q.
        sampling: how tokens are drawn at T > 0: "categorical" (Dream; ``torch.multinomial``) or "gumbel"
            (LLaDA's float64 Gumbel-max, :func:`gumbel_argmax`). Randomness comes only from ``generator``:
            one generator, or B of them (row b drawn with generator b; rows without masks draw nothing).
        draws: with B generators, the rows that have masks when the caller knows them (a decoder's
            step: no host read); None reads them from ``masked``.
        quota: (B,) long, TopK only: tokens to commit per row this step (LLaDA's schedule), overriding k;
            clamped to the row's masked count. A 0 entry commits nothing in that row.
        validate: False skips the check that reads ``quota``'s values on the host (a decoder's step,
            which built them, keeps its one host sync); shapes and dtypes are always checked.
        confidence: which distribution the commit decision reads. None (default): κ (Threshold,
            Factor, TopK) and the EB / entropy-threshold statistics (H, max q, Δ) come from the
            float32 softmax(logits) at every T, the arithmetic of T = 0, so as T → 0 every policy
            tends to its T = 0 rule. "untempered" (LLaDA / Fast-dLLM, diffusion.md §3–4): the same
            distribution, with κ in float64 and ranked as the reference code does.
            "tempered" (Dream's convention): both from the float32 softmax(logits / T); at T = 0.1
            most κ round to 1.0 (a whole block commits at once) and many H to 0.
            ``Factor(compat=True)`` always uses "untempered". κ read in float32 (and the EB
            confidence proxy) is ranked by −log(1 − κ), computed from the other tokens'
            log-probabilities, so the order survives κ rounding to 1.0.

    Returns:
        (commit, tokens): commit (B, N) bool, True only at masked positions; tokens (B, N) long, the
        candidate at every position. Every row with r ≥ 1 masked positions commits 1..r of them.

    Raises:
        UnmaskError: bad shapes, options, or a quota with a policy other than TopK.
    """
    check_temperature(temperature)
    require(logits.dim() == 3, f"logits must be (B, N, V) (got shape {tuple(logits.shape)})")
    B, N, V = logits.shape
    require(masked.shape == (B, N) and masked.dtype == torch.bool,
            f"masked must be a bool tensor of shape {(B, N)} (got {masked.dtype} {tuple(masked.shape)})")
    require(is_number_or_inf(top_p) and 0 < top_p <= 1, f"top_p must be in (0, 1] (got {top_p!r}); use 1.0 to disable")
    require(isinstance(top_k, int) and top_k >= 0, f"top_k must be an integer >= 0 (got {top_k!r}); use 0 to disable")
    require(confidence is None or confidence in CONFIDENCES,
            f"confidence must be 'untempered' or 'tempered' (Dream's convention) (got {confidence!r})")
    require(sampling in ("categorical", "gumbel"), f"sampling must be 'categorical' or 'gumbel' (got {sampling!r})")
    require(isinstance(policy, (EntropyBound, Threshold, Factor, TopK, EntropyThreshold)),
            f"policy must be one of {list(POLICY_NAMES)} built by make_policy (got {type(policy).__name__})")
    require(quota is None or isinstance(policy, TopK), f"quota applies only to the top-k policy (got {policy.name!r})")

    log_q = log_probs(logits, temperature)  # (B, N, V), the sampling distribution
    # The distribution commit decisions read: untempered unless Dream's tempered convention is asked for.
    log_c = log_q if confidence == "tempered" or temperature == 0 else log_probs(logits, 0.0)  # (B, N, V)
    stats = stats_of(log_c)

    # Candidate tokens (SBD §5.1 step 3).
    if temperature == 0:
        tokens = stats.top1
    elif isinstance(generator, (list, tuple)):
        # One generator per row; rows without masks draw nothing (a waiting row's stream is unchanged).
        require(len(generator) == B, f"generator must be one torch.Generator or {B} of them (got {len(generator)})")
        tokens = stats.top1.clone()
        for b in torch.nonzero(masked.any(dim=1)).flatten().tolist() if draws is None else draws:
            tokens[b] = draw_tokens(logits[b: b + 1], log_q[b: b + 1], temperature, top_k, top_p, sampling, generator[b])[0]
    else:
        tokens = draw_tokens(logits, log_q, temperature, top_k, top_p, sampling, generator)

    r = masked.sum(dim=1)  # (B,)
    if isinstance(policy, EntropyBound):
        # SBD §5.1 steps 4–5 / EB Fig. 4. Cumulative ops run over positions (dim 1), never the batch.
        if policy.proxy == "confidence":  # max q, ranked by a key that survives small T (diffusion.md §4)
            score = _certainty(log_c, stats.top1)
        else:
            score = -stats.entropy if policy.proxy == "entropy" else stats.margin
        order = _rank(score, masked)
        cols = torch.arange(N, device=logits.device)  # (N,)
        h = stats.entropy.gather(1, order).double()  # (B, N), sorted; float64 so tiny H is not absorbed
        h = torch.where(cols[None, :] < r[:, None], h, torch.zeros_like(h))
        excess = h.cumsum(dim=1) - h.cummax(dim=1).values  # (B, N), non-decreasing
        count = _prefix_len(excess <= policy.gamma)
    elif isinstance(policy, EntropyThreshold):
        # diffusion.md §7: when any H ≤ eta the argmin-H is among them, so this is "rank 1 plus all that qualify".
        order = _rank(-stats.entropy, masked)
        count = _prefix_len(stats.entropy.gather(1, order) <= policy.eta)  # gather: (B, N), sorted
    else:
        if confidence == "untempered" or (isinstance(policy, Factor) and policy.compat):
            # LLaDA / Fast-dLLM: p(chosen) from the float64 softmax of the raw logits, ranked as the reference.
            kappa = F.softmax(logits.to(torch.float64), dim=-1).gather(-1, tokens[..., None])[..., 0]  # (B, N)
            order = _rank(kappa, masked)
        else:
            # p(chosen) under log_c. Where it rounds to 1.0 (tempered at small T, or a sure model), rank
            # by the equivalent non-saturating key; compare the probability itself with τ / the factor rule.
            kappa = log_c.gather(-1, tokens[..., None])[..., 0].exp()  # (B, N)
            order = _rank(_certainty(log_c, tokens), masked)
        kappa_sorted = kappa.gather(1, order)  # (B, N)
        if isinstance(policy, Threshold):
            count = _prefix_len(kappa_sorted > policy.tau if policy.strict else kappa_sorted >= policy.tau)
        elif isinstance(policy, Factor):
            ranks = torch.arange(1, N + 1, device=logits.device, dtype=torch.float64)  # (N,), 1-based
            need = 1 - policy.f / (ranks + 1)  # same float64 arithmetic as the reference's Python floats
            need[0] = -math.inf  # rank 1 is always committed
            count = _prefix_len(kappa_sorted >= need[None, :])
            if policy.compat:
                # Reference quirk: a first failure on the last rank (count = r − 1) still accepts all r.
                count = torch.where((r >= 2) & (count == r - 1), r, count)
        else:  # TopK
            if quota is None:
                count = torch.full_like(r, policy.k)
            else:
                require(quota.shape == (B,), f"quota must have shape {(B,)} (got {tuple(quota.shape)})")
                if quota.is_floating_point() or (validate and not bool((quota >= 0).all())):
                    raise UnmaskError(f"quota must hold integers >= 0 (got {quota.tolist()})")  # read on failure only
                count = quota.to(device=r.device, dtype=torch.long)
            return _take(order, torch.minimum(count, r)) & masked, tokens

    # Rank 1 always qualifies (at least one token per row with masks); never more than r.
    count = torch.minimum(count.clamp(min=1), r)
    return _take(order, count) & masked, tokens
