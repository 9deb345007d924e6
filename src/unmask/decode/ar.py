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
    the whole batch with a ``DynamicCache``; every row stops at a stop token, a stop string or
    ``max_new_tokens``. Returns the generated ids per row (stop token excluded) and DecodeStats
    where NFE counts every forward that commits a token (the prefill commits the first one).
    """
    model, device = bundle.model, bundle.device
    t0 = time.perf_counter()
    ids, valid, pos = left_pad(prompts, bundle.pad_token_id, device)  # (B, P) each
    B = ids.shape[0]
    mask2d = None if bool(valid.all()) else valid.long()
    cache = new_cache(model)
    gen = sampling.generator(device)
    suppress = list(bundle.suppress_ids)
    stop = torch.tensor(sorted(set(stop_token_ids)) or [-1], device=device)
    out = torch.full((B, max_new_tokens), -1, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    nfe_rows = torch.zeros(B, dtype=torch.long, device=device)
    next_pos = pos[:, -1:] + 1  # (B, 1)
    logits = forward(model, ids, position_ids=pos, attention_mask=mask2d, cache=cache, logits_to_keep=1)[:, -1]
    nfe = 1
    for step in range(max_new_tokens):
        if suppress:
            logits[:, suppress] = float("-inf")
        tok = sample(logits, sampling, gen)  # (B,)
        nfe_rows += (~done).long()
        is_stop = torch.isin(tok, stop)
        out[:, step] = torch.where(done, -1, tok)
        lengths += (~done & ~is_stop).long()
        done |= is_stop
        if stop_strings:
            done |= _hit_stop_string(bundle, prompts, out[:, : step + 1], done, stop_strings)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if mask2d is not None:
            mask2d = torch.cat([mask2d, torch.ones(B, 1, dtype=mask2d.dtype, device=device)], dim=1)
        logits = forward(model, tok[:, None], position_ids=next_pos, attention_mask=mask2d, cache=cache)[:, -1]
        next_pos = next_pos + 1
        nfe += 1
    tokens = [out[b, : int(lengths[b])].tolist() for b in range(B)]
    stats = DecodeStats(nfe=nfe, nfe_per_row=nfe_rows.tolist(), tokens_per_row=[len(t) for t in tokens],
                        seconds=time.perf_counter() - t0)
    return DecodeOutput(tokens=tokens, stats=stats)


def _hit_stop_string(bundle, prompts, out, done, stop_strings) -> torch.Tensor:
    hit = torch.zeros_like(done)
    for b in range(out.shape[0]):
        if done[b]:
            continue
        row = [t for t in out[b].tolist() if t >= 0]
        text = bundle.decode_continuation(prompts[b], row)
        hit[b] = any(s in text for s in stop_strings)
    return hit
