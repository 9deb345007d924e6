"""Autoregressive decoding with an exact KV cache: the baseline every decoder is measured against."""

from __future__ import annotations

import time

import torch

from unmask.compat import forward, new_cache
from unmask.decode.batching import left_pad
from unmask.decode.stats import DecodeOutput, DecodeStats
from unmask.sampling import Sampling, sample


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = ()) -> DecodeOutput:
    """Batched greedy or sampled next-token decoding (NTP mode, SBD Eq. 9a).

    prompts: token ids per row (different lengths are left-padded). One forward per step for
    the rows still running, with a ``DynamicCache``; a row stops at a stop token (excluded from
    its output), a stop string (the completing token is kept) or ``max_new_tokens``, and is then
    pruned from the batch and the cache, so finished rows cost nothing. Returns the generated ids
    per row and DecodeStats where NFE counts every forward that commits a token (the prefill
    commits the first one). One host sync per step (the stop check).
    """
    model, device = bundle.model, bundle.device
    t0 = time.perf_counter()
    N = max_new_tokens
    ids, valid, pos = left_pad(prompts, bundle.pad_token_id, device)  # (B, P) each
    B, P = ids.shape
    # The 2D padding mask for the whole run, allocated once; step t passes the view [:, :P + t].
    mask = None if bool(valid.all()) else torch.cat([valid, valid.new_ones(B, N)], dim=1).long()  # (B, P+N)
    cache = new_cache(model)
    gen = sampling.generator(device)
    suppress = list(bundle.suppress_ids)
    stop = torch.tensor(sorted(set(stop_token_ids)) or [-1], device=device)
    out = torch.full((B, N), -1, dtype=torch.long, device=device)  # (B, N)
    lengths = torch.full((B,), N, dtype=torch.long, device=device)  # rows that never stop keep N
    nfe_rows = torch.zeros(B, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)  # (b,) original index of each running row
    next_pos = pos[:, -1] + 1  # (b,)
    logits = forward(model, ids, position_ids=pos, attention_mask=None if mask is None else mask[:, :P],
                     cache=cache, logits_to_keep=1)[:, -1]  # (b, V)
    nfe = 1
    for step in range(N):
        if suppress:
            logits[:, suppress] = float("-inf")
        tok = sample(logits, sampling, gen)  # (b,)
        out[rows, step] = tok
        nfe_rows[rows] += 1
        is_stop = torch.isin(tok, stop)  # (b,)
        ended = is_stop
        if stop_strings:
            ended = is_stop | _hit_stop_string(bundle, prompts, out[:, : step + 1], rows, stop_strings)  # (b,)
        # A stop token is not part of the output; the token that completed a stop string is.
        lengths[rows] = torch.where(is_stop, step, torch.where(ended, step + 1, lengths[rows]))
        if step == N - 1:
            break
        if bool(ended.any()):  # the one host sync per step
            keep = (~ended).nonzero().squeeze(1)  # (b',)
            if keep.numel() == 0:
                break
            rows, tok, next_pos = rows[keep], tok[keep], next_pos[keep]
            cache.batch_select_indices(keep)
            if mask is not None:
                mask = mask[keep]
        step_mask = None if mask is None else mask[:, : P + step + 1]  # (b, P + step + 1)
        logits = forward(model, tok[:, None], position_ids=next_pos[:, None], attention_mask=step_mask,
                         cache=cache)[:, -1]  # (b, V)
        next_pos = next_pos + 1
        nfe += 1
    tokens = [out[b, : int(lengths[b])].tolist() for b in range(B)]
    stats = DecodeStats(nfe=nfe, nfe_per_row=nfe_rows.tolist(), tokens_per_row=[len(t) for t in tokens],
                        seconds=time.perf_counter() - t0)
    return DecodeOutput(tokens=tokens, stats=stats)


def _hit_stop_string(bundle, prompts, out, rows, stop_strings) -> torch.Tensor:
    """(b,) bool: whether the running row ``rows[i]``'s decoded continuation contains a stop string.

    out: (B, t) ids generated so far for every row (-1 where none)."""
    hit = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    for i, b in enumerate(rows.tolist()):
        text = bundle.decode_continuation(prompts[b], [t for t in out[b].tolist() if t >= 0])
        hit[i] = any(s in text for s in stop_strings)
    return hit
