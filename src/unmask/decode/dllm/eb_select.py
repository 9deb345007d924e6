"""Pure pieces of Early-Bird decoding (spec/early_bird.md §3.5, §4.1, §5): LBS block selection
with its filters, LPS step features, and the union accept rule.

Everything here is a batched function of (B, L) tensors over the generation region (index 0 =
first generated position); rows are independent. No model, no state: the decoder
(:mod:`unmask.decode.dllm.early_bird`) and the trace collector (:mod:`unmask.train.lps_fit`) call the
same functions, so training and serving see identical features.

Filter order (Alg. 5 lines 10–20), applied only to rows without an active block:

1. size fallback: |M| ≤ L_min → B = M;
2. router cut: C = {i ∈ M : p_φ^i > 0.5};
3. EOS removal: drop i ∈ C whose top-1 is an EOS id;
4. max-gap cut: keep C up to (not including) its first element whose gap to the previous element
   of C exceeds g_max;
5. min-tokens fallback: |B| < L_min → B = the first L_B masked positions (all of M if fewer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from unmask.policies import commit
from unmask.routers.lps import POS_MODES
from unmask.sampling import Sampling

GAP_METRICS = ("absolute", "masked_rank")
# Which rule produced a row's block (the ``path`` codes of :func:`select_block`).
PATH_ROUTER, PATH_SIZE, PATH_MIN_TOKENS = 0, 1, 2
PATH_NAMES = ("router", "size-fallback", "min-tokens-fallback")


def first_masked(masked: Tensor, n: int) -> Tensor:
    """(B, L) bool: the first ``n`` masked positions of each row, left to right (all if fewer)."""
    return masked & (masked.long().cumsum(dim=1) <= n)  # (B, L)


def drop_eos(cand: Tensor, top1: Tensor, eos_ids: Sequence[int]) -> Tensor:
    """EOS removal (§3.5 step 3): ``cand`` (B, L) bool without the positions whose top-1 token
    ``top1`` (B, L) long is one of ``eos_ids`` (the adapter's full EOS/EOT set)."""
    if not len(eos_ids):
        return cand
    eos = torch.as_tensor(list(eos_ids), dtype=top1.dtype, device=top1.device)  # (n_eos,)
    return cand & ~torch.isin(top1, eos)


def max_gap_cut(cand: Tensor, g_max: int, *, masked: Tensor | None = None, metric: str = "absolute") -> Tensor:
    """``MaxGapFilter(C, g_max)`` (§3.5 step 4) on each row of ``cand`` (B, L) bool.

    Walking C left to right, the first element whose gap to the previous element of C exceeds
    ``g_max`` is dropped together with everything after it; the leftmost element always stays.
    ``metric="absolute"``: gap = index difference (g_max = 1 gives contiguous blocks).
    ``metric="masked_rank"``: gap = difference of ranks among the still-masked positions
    ``masked`` (B, L), so committed positions in between do not count. Returns (B, L) bool.
    """
    if metric not in GAP_METRICS:
        raise ValueError(f"unknown gap metric {metric!r}; choose one of: {', '.join(GAP_METRICS)}")
    B, L = cand.shape
    idx = torch.arange(L, device=cand.device)  # (L,)
    if metric == "absolute":
        coord = idx.expand(B, L)  # (B, L)
    else:
        if masked is None:
            raise ValueError("metric 'masked_rank' needs the masked set")
        coord = masked.long().cumsum(dim=1) - 1  # (B, L) rank among masked positions
    last = torch.where(cand, idx, torch.full_like(idx, -1)).cummax(dim=1).values  # (B, L) last C at or before i
    prev = torch.cat([torch.full((B, 1), -1, dtype=last.dtype, device=cand.device), last[:, :-1]], dim=1)  # (B, L)
    gap = coord - coord.gather(1, prev.clamp(min=0))  # (B, L), meaningful where prev >= 0
    breaks = cand & (prev >= 0) & (gap > g_max)  # (B, L)
    cut = torch.where(breaks.any(dim=1), breaks.long().argmax(dim=1), torch.full((B,), L, device=cand.device))  # (B,)
    return cand & (idx[None, :] < cut[:, None])  # (B, L)


def select_block(p: Tensor, masked: Tensor, top1: Tensor, *, eos_ids: Sequence[int], l_min: int,
                 fallback_block: int, g_max: int, gap_metric: str = "absolute", cut: float = 0.5
                 ) -> tuple[Tensor, Tensor]:
    """LBS block selection with every filter in order (§3.5, Alg. 5 lines 10–20).

    p: (B, L) float, σ(O_φ) (only masked positions are read). masked: (B, L) bool, M.
    top1: (B, L) long, x̂. Returns (block (B, L) bool, path (B,) long): path is PATH_SIZE when
    |M| ≤ l_min, PATH_MIN_TOKENS when the filtered set had fewer than l_min positions, else
    PATH_ROUTER. A row without masks gets an empty block.
    """
    size = masked.sum(dim=1) <= l_min  # (B,)
    chosen = drop_eos(masked & (p > cut), top1, eos_ids)  # (B, L)
    chosen = max_gap_cut(chosen, g_max, masked=masked, metric=gap_metric)
    small = chosen.sum(dim=1) < l_min  # (B,)
    block = torch.where(small[:, None], first_masked(masked, fallback_block), chosen)
    block = torch.where(size[:, None], masked, block)  # (B, L)
    path = torch.where(size, PATH_SIZE, torch.where(small, PATH_MIN_TOKENS, PATH_ROUTER))  # (B,)
    return block, path


def lps_features(confidence: Tensor, norm_entropy: Tensor, margin: Tensor, block: Tensor, masked: Tensor,
                 pos_mode: str = "literal") -> Tensor:
    """The five LPS inputs (§4.1) at every position: (B, L, 5) float32, zero outside B ∩ M.

    confidence κ, norm_entropy H̃ = H / log|V|, margin Δ: (B, L) float. block: (B, L) bool, the
    active block B as selected (it does not shrink while it resolves). masked: (B, L) bool.
    mask_ratio ρ = |B ∩ M| / |B| (shared by the row). pos = (i − min B) / |B| unclipped
    (``literal``; > 1 is possible for a non-contiguous B) or rank of i in B / |B| (``rank``).
    """
    if pos_mode not in POS_MODES:
        raise ValueError(f"unknown pos mode {pos_mode!r}; choose one of: {', '.join(POS_MODES)}")
    live = block & masked  # (B, L)
    size = block.sum(dim=1).clamp(min=1).float()  # (B,) |B|
    rho = live.sum(dim=1).float() / size  # (B,)
    L = block.shape[1]
    idx = torch.arange(L, device=block.device)  # (L,)
    if pos_mode == "literal":
        start = torch.where(block.any(dim=1), block.long().argmax(dim=1), torch.zeros_like(size, dtype=torch.long))
        pos = (idx[None, :] - start[:, None]).float() / size[:, None]  # (B, L)
    else:
        pos = (block.long().cumsum(dim=1) - 1).float() / size[:, None]  # (B, L)
    feats = torch.stack([confidence.float(), norm_entropy.float(), margin.float(),
                         rho[:, None].expand(-1, L), pos], dim=-1)  # (B, L, 5)
    return feats * live[..., None]


def pack_rows(select: Tensor, n: int | None = None) -> tuple[Tensor, Tensor]:
    """Gather plan for a ragged set per row: select (B, L) bool -> (index (B, N) long, valid
    (B, N) bool), N = ``n`` (a bound on every row's count the caller knows, <= L: no host read) or
    max(1, largest row count). Row r's selected positions come first, in index order; the padding
    slots point at distinct unselected positions, so scattering through ``index`` never writes
    one position twice."""
    counts = select.sum(dim=1)  # (B,)
    N = n if n is not None else max(1, int(counts.max())) if select.numel() else 1
    order = (~select).to(torch.uint8).sort(dim=1, stable=True).indices[:, :N]  # (B, N) selected first
    valid = torch.arange(N, device=select.device)[None, :] < counts[:, None]  # (B, N)
    return order, valid


def union_accept(kappa: Tensor, p_lps: Tensor | None, cand: Tensor, tau: float, tau_psi: float) -> Tensor:
    """EB-Decode commit rule (Alg. 5 steps 5–6): A = {i ∈ cand : κ ≥ τ or p_ψ > τ_ψ}; a row with
    candidates but an empty A commits its argmax-κ candidate (ties to the lower position).

    kappa: (B, L) float. p_lps: (B, L) float or None (LBS only: the Fast-dLLM threshold rule
    inside B). cand: (B, L) bool, B ∩ M. Returns (B, L) bool ⊆ cand. τ_ψ ≥ 1 never fires.
    """
    take = kappa >= tau
    if p_lps is not None:
        take = take | (p_lps > tau_psi)
    take = cand & take  # (B, L)
    score = torch.where(cand, kappa.double(), torch.full_like(kappa, -math.inf, dtype=torch.float64))  # (B, L)
    best = torch.zeros_like(cand).scatter(1, score.argmax(dim=1, keepdim=True), True)  # (B, L) first max
    stall = cand.any(dim=1) & ~take.any(dim=1)  # (B,)
    return take | (best & stall[:, None])


def commit_confidence(logits, tokens, cand, confidence: str | None, temperature: float, lo: int,
                      L: int) -> torch.Tensor:
    """κ of the chosen tokens as the diffusion threshold rule computes it (diffusion.md §4): the
    untempered softmax in float64 ("untempered", LLaDA's) or float32 (None), or the tempered
    probability ("tempered", Dream's).

    logits (B, n, V), tokens and cand (B, n) over generated positions [lo, lo + n). Computed at the
    candidates only; returns (B, L) float64, 0 elsewhere."""
    r, c = torch.nonzero(cand, as_tuple=True)  # (k,) each
    z, t = logits[r, c], tokens[r, c]  # (k, V), (k,)
    if confidence == "untempered":
        k = F.softmax(z.double(), dim=-1).gather(-1, t[:, None])[:, 0]
    else:
        z = z.float() / temperature if temperature > 0 and confidence == "tempered" else z.float()
        k = F.log_softmax(z, dim=-1).gather(-1, t[:, None])[:, 0].exp().double()
    kappa = torch.zeros(cand.shape[0], L, dtype=torch.float64, device=logits.device)
    kappa[r, c + lo] = k
    return kappa


def draw_rows(logits, cand, top1, policy, sampling: Sampling, gens, confidence, draw, draws) -> torch.Tensor:
    """Sampled tokens (B, n) at each row's candidates, drawn with that row's generator over its
    candidates only, so the draws do not depend on the batch's union window (batch == single
    runs); elsewhere the argmax ``top1``. ``draws``: the rows with candidates (host-known)."""
    tokens = top1.clone()
    for r in draws:
        where = torch.nonzero(cand[r]).flatten()  # (k,)
        sub = logits[r: r + 1, where]  # (1, k, V)
        _, t = commit(sub, torch.ones(1, len(where), dtype=torch.bool, device=sub.device), policy,
                      temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                      generator=gens[r], confidence=confidence, sampling=draw)
        tokens[r, where] = t[0]
    return tokens
