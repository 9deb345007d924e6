"""Dream's own ``diffusion_generate`` schedule, "Dream-compat" (spec/diffusion.md §5, models.md §2.4).

Reached as ``diffusion.decode(..., schedule="dream")``. Unlike unmask's semi-AR diffusion decoder
there are no blocks: every step runs one bidirectional forward over the whole canvas
``[prompt | m^L]``, realigns the logits (Dream's shift), and with timesteps
``t_i = linspace(1, eps, steps + 1)[i]``, ``s = t_{i+1}``:

- ``alg="origin"``: every masked position is revealed independently with probability
  1 - s/t (1 at the last step), its token drawn by :func:`dream_sample`;
- ``alg="maskgit_plus"`` (confidence), ``"topk_margin"`` (top-1 minus top-2 probability),
  ``"entropy"`` (negative entropy): the k = int(n_masked · (1 - s/t)) masked positions with the
  highest score are committed (all of them at the last step); with ``alg_temp`` > 0 the k
  positions are drawn without replacement from softmax(score / alg_temp) instead.

Token draws follow Dream's ``sample_tokens``: logits / T when T > 0, top-p then top-k filtering,
softmax; T > 0 samples, T = 0 takes the maximum; the confidence is the chosen token's
probability. The mask column is not suppressed (a "committed" mask stays masked), as in the
published loop. Differences, all our choice: n_masked is the row's own count (the published code
averages over the batch, identical when rows share a canvas length), each row draws from its own
seeded generator (batch == single), and decoding stops once no masks are left (same tokens,
fewer forwards). ``steps`` defaults to the canvas length L (Dream's generation_config says 512).
"""

from __future__ import annotations

import time

import torch

from unmask.decode.batching import left_pad
from unmask.decode.stats import DecodeOutput, DecodeStats, stop_flags
from unmask.errors import UnmaskError
from unmask.models.adapters import bidirectional_forward, realign
from unmask.sampling import Sampling
from unmask.trace import step_event

ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
DEFAULT_ALG = "origin"  # Dream's generation_config.json
DEFAULT_EPS = 1e-3


def _top_p(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """Dream's ``top_p_logits``: drop a token once the mass strictly before it exceeds top_p. z (N, V)."""
    sorted_z, order = z.sort(dim=-1, descending=True)  # (N, V) each
    cum = sorted_z.softmax(-1).cumsum(-1)  # (N, V)
    drop = torch.zeros_like(cum, dtype=torch.bool)
    drop[:, 1:] = cum[:, :-1] > top_p  # (N, V), shifted right: the top-1 always stays
    return z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def dream_sample(logits: torch.Tensor, alg: str, sampling: Sampling,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's ``sample_tokens`` on logits (N, V) -> (score (N,) float32, tokens (N,) long).

    score: the chosen token's probability; for ``topk_margin`` top-1 minus top-2 probability; for
    ``entropy`` Σ p log p (negative entropy, nats). Raises nothing; ``generator`` is used when T > 0.
    """
    z = logits.float()
    if sampling.temperature > 0:
        z = z / sampling.temperature
    if sampling.top_p < 1:
        z = _top_p(z, sampling.top_p)
    if 0 < sampling.top_k < z.shape[-1]:
        z = z.masked_fill(z < z.topk(sampling.top_k, dim=-1).values[:, -1:], float("-inf"))
    probs = z.softmax(-1)  # (N, V)
    if sampling.temperature > 0:
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]  # (N,)
        score = probs.gather(1, tokens[:, None])[:, 0]
    else:
        score, tokens = probs.max(-1)
    if alg == "topk_margin":
        top2 = probs.topk(2, dim=-1).values  # (N, 2)
        score = top2[:, 0] - top2[:, 1]
    elif alg == "entropy":
        score = (probs * torch.log(probs + 1e-10)).sum(-1)
    return score, tokens


def transfer_counts(n_masked: torch.Tensor, t: torch.Tensor, s: torch.Tensor, last: bool) -> torch.Tensor:
    """k = int(n · (1 - s/t)) per row (all n at the last step), in Dream's float32 arithmetic. n_masked (B,) long."""
    if last:
        return n_masked
    return (n_masked.float() * (1 - s / t)).long()  # (B,), truncation as int()


def commit_row(logits: torch.Tensor, masked: torch.Tensor, alg: str, alg_temp: float | None, k: int,
               p_transfer: float, sampling: Sampling, generator: torch.Generator | None):
    """One row's step: logits (L, V), masked (L,) bool -> (chosen (L,) bool, tokens (L,) long)."""
    L = masked.shape[0]
    idx = torch.nonzero(masked).flatten()  # (n,)
    chosen = torch.zeros(L, dtype=torch.bool, device=masked.device)
    tokens = torch.zeros(L, dtype=torch.long, device=masked.device)
    if alg == "origin":
        reveal = torch.rand(idx.shape[0], generator=generator, device=masked.device) < p_transfer  # (n,)
        if bool(reveal.any()):
            _, tok = dream_sample(logits[idx[reveal]], alg, sampling, generator)
            chosen[idx[reveal]], tokens[idx[reveal]] = True, tok
        return chosen, tokens
    score, tok = dream_sample(logits[idx], alg, sampling, generator)  # (n,) each
    tokens[idx] = tok
    if k > 0:
        full = torch.full((L,), float("-inf"), device=masked.device)
        full[idx] = score
        if alg_temp:
            pick = torch.multinomial((full / alg_temp).softmax(-1), k, generator=generator)  # (k,)
        else:
            pick = full.topk(k).indices  # (k,)
        chosen[pick] = True
    return chosen, tokens


def validate(steps, alg: str, alg_temp, eps, L: int) -> int:
    """Check the options; returns steps (default L). Raises UnmaskError."""
    if alg not in ALGS:
        raise UnmaskError(f"unknown alg {alg!r}; choose one of: {', '.join(ALGS)}")
    steps = L if steps is None else steps
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise UnmaskError(f"steps must be an integer >= 1 (got {steps!r}); Dream's default is 512")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise UnmaskError(f"eps must be in (0, 1) (got {eps!r}); Dream's default is 1e-3")
    if alg_temp is not None and (not isinstance(alg_temp, (int, float)) or isinstance(alg_temp, bool) or alg_temp < 0):
        raise UnmaskError(f"alg_temp must be a number >= 0 (got {alg_temp!r}); leave it unset for top-k selection")
    return steps


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), gen_length: int | None = None, steps: int | None = None,
           alg: str | None = None, alg_temp: float | None = None, eps: float | None = None, on_step=None,
           on_forward=None) -> DecodeOutput:
    """Dream-compat decoding of a batch (diffusion.md §5); see the module docstring.

    prompts: token ids per row (left-padded; positions count real tokens only). The canvas is
    L = gen_length (default max_new_tokens) masks; the reported tokens are its first
    max_new_tokens, cut before the first stop id. NFE counts forwards. stats.extra: schedule,
    alg, steps, gen_length, ``row_extra`` with per-row commit counts. Raises UnmaskError for bad
    options, a model without a mask token or a canvas past the context window.
    """
    L = max_new_tokens if gen_length is None else gen_length
    alg = DEFAULT_ALG if alg is None else alg
    eps = DEFAULT_EPS if eps is None else eps
    steps = validate(steps, alg, alg_temp, eps, L)
    shift, mask_id, device = bundle.logit_shift, bundle.mask_token_id, bundle.device
    P = max(len(p) for p in prompts)
    if P + L > bundle.context_length:
        raise UnmaskError(f"prompt ({P} tokens) + gen length {L} exceeds the context window of "
                          f"{bundle.context_length}; lower --gen-length or --max-new-tokens")
    t0 = time.perf_counter()
    ids_p, valid_p, pos_p = left_pad(prompts, bundle.pad_token_id, device)  # (B, P) each
    B = ids_p.shape[0]
    ids = torch.cat([ids_p, torch.full((B, L), mask_id, dtype=torch.long, device=device)], dim=1)  # (B, P + L)
    pos = torch.cat([pos_p, valid_p.sum(1, keepdim=True) + torch.arange(L, device=device)], dim=1)  # (B, P + L)
    valid = torch.cat([valid_p, torch.ones(B, L, dtype=torch.bool, device=device)], dim=1)  # (B, P + L)
    gens = [sampling.generator(device) for _ in range(B)]
    ts = torch.linspace(1, eps, steps + 1)  # float32, as Dream
    nfe, nfe_rows = 0, torch.zeros(B, dtype=torch.long, device=device)
    commits: list[list[int]] = [[] for _ in range(B)]
    for i in range(steps):
        masked = ids[:, P:] == mask_id  # (B, L)
        if not bool(masked.any()):
            break
        raw = bidirectional_forward(bundle, ids, position_ids=pos, key_valid=valid, rows=(P - shift, P + L))
        logits = realign(raw, shift)[:, shift:]  # (B, L, V): index j scores canvas position P + j
        last = i == steps - 1
        k = transfer_counts(masked.sum(1), ts[i], ts[i + 1], last)  # (B,)
        p_transfer = 1.0 if last else float(1 - ts[i + 1] / ts[i])
        for r in torch.nonzero(masked.any(1)).flatten().tolist():
            chosen, tokens = commit_row(logits[r], masked[r], alg, alg_temp, int(k[r]), p_transfer, sampling, gens[r])
            ids[r, P:] = torch.where(chosen, tokens, ids[r, P:])
            landed = chosen & (tokens != mask_id)
            commits[r].append(int(landed.sum()))
            nfe_rows[r] += 1
            if on_step is not None:
                on_step(step_event(nfe, r, landed, tokens, 0, ids[r, P:], mask_id))
        if on_forward is not None:
            on_forward({"nfe": nfe, "step": i, "canvas": ids.clone(), "logits": logits, "masked": masked})
        nfe += 1
    stops = set(stop_token_ids) | {mask_id}
    out = []
    full = ids[:, P: P + min(max_new_tokens, L)].tolist()
    for r in range(B):
        row = []
        for t in full[r]:
            if t in stops:
                break
            row.append(t)
        out.append(row)
    extra = {"schedule": "dream", "alg": alg, "steps": steps, "gen_length": L, "policy": f"dream-{alg}",
             "cache": "none", "sampler": "dream",
             "row_extra": [{"schedule": "dream", "alg": alg, "commits": c} for c in commits]}
    stats = DecodeStats(nfe=nfe, nfe_per_row=nfe_rows.tolist(), tokens_per_row=[len(t) for t in out],
                        stops_per_row=stop_flags(full, out, stop_token_ids),
                        seconds=time.perf_counter() - t0, extra=extra)
    return DecodeOutput(tokens=out, stats=stats)
