"""Autoregressive decoding with an exact KV cache: the baseline every decoder is measured against."""

from __future__ import annotations

import time

import torch

from unmask.compat import attention_mask, forward, keep_rows, new_cache
from unmask.decode.batching import left_pad
from unmask.decode.stats import DecodeOutput, DecodeStats
from unmask.sampling import Sampling, sample


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (),
           compile: bool = False) -> DecodeOutput:
    """Batched greedy or sampled next-token decoding (NTP mode, SBD Eq. 9a).

    ``compile=True`` takes the fast path (:func:`unmask.decode.static.ar_decode`): a static KV
    cache and a ``torch.compile``-d step, with the same tokens and NFE.

    prompts: token ids per row (different lengths are left-padded). One forward per step for
    the rows still running, with a ``DynamicCache``; a row stops at a stop token (excluded from
    its output), a stop string (the completing token is kept) or ``max_new_tokens``, and is then
    pruned from the batch and the cache, so finished rows cost nothing. Returns the generated ids
    per row and DecodeStats where NFE counts every forward that commits a token (the prefill
    commits the first one). At most one host sync per step (the stop check; none without stops).
    """
    if compile:
        from unmask.decode import static

        return static.ar_decode(bundle, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                stop_token_ids=stop_token_ids, stop_strings=stop_strings, compile=True)
    model, device = bundle.model, bundle.device
    t0 = time.perf_counter()
    N = max_new_tokens
    ids, valid, pos = left_pad(prompts, bundle.pad_token_id, device)  # (B, P) each
    B, P = ids.shape
    # With left padding, every decode step's single query sees all valid keys: one 4D mask for
    # the whole run, built once in the backend's form (bool for SDPA, additive for eager); step t
    # passes the view [..., :P + t]. HF would otherwise rebuild a 4D mask from a 2D one per step.
    key_valid = torch.cat([valid, valid.new_ones(B, N)], dim=1)  # (B, P+N)
    mask = None if bool(valid.all()) else attention_mask(model, key_valid[:, None, None, :])  # (B, 1, 1, P+N)
    cache = new_cache(model)
    gens = sampling.row_generators(prompts, device)  # one per row (None when greedy)
    suppress = list(bundle.suppress_ids)
    stop = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    # Bookkeeping of finished rows is plain Python and happens only on the steps where rows end;
    # ``buf`` holds the running rows' tokens and is pruned together with the cache.
    running = list(range(B))  # original index of each running row
    tokens: list[list[int]] = [[] for _ in range(B)]
    nfe_rows = [N] * B
    stops_rows = [0] * B  # 1 where a row ended on a stop token (it counts for TPF, not in the text)
    buf = torch.empty((B, N), dtype=torch.long, device=device)  # (b, N)
    next_pos = pos[:, -1] + 1  # (b,)
    logits = forward(model, ids, position_ids=pos, attention_mask=None if mask is None else valid.long(),
                     cache=cache, logits_to_keep=1)[:, -1]  # (b, V); HF adds the causal part
    nfe = 1
    for step in range(N):
        if suppress:
            logits[:, suppress] = float("-inf")
        tok = sample(logits, sampling, gens and [gens[r] for r in running])  # (b,)
        buf[:, step] = tok
        if stop.numel() or stop_strings:
            is_stop = torch.isin(tok, stop)  # (b,)
            ended = is_stop
            if stop_strings:
                ended = is_stop | _hit_stop_string(bundle, prompts, buf[:, : step + 1], running, stop_strings)
            if bool(ended.any()):  # the one host sync per step
                keep = []
                for i, (row_ended, at_stop) in enumerate(zip(ended.tolist(), is_stop.tolist())):
                    if not row_ended:
                        keep.append(i)
                        continue
                    # A stop token is not part of the output; the token completing a stop string is.
                    tokens[running[i]] = buf[i, : step if at_stop else step + 1].tolist()
                    nfe_rows[running[i]] = step + 1
                    stops_rows[running[i]] = int(at_stop)
                running = [running[i] for i in keep]
                if not running:
                    break
                idx = torch.tensor(keep, device=device)  # (b',)
                buf, tok, next_pos = buf[idx], tok[idx], next_pos[idx]
                keep_rows(cache, idx)
                if mask is not None:
                    mask = mask[idx]
        if step == N - 1:
            break
        step_mask = None if mask is None else mask[..., : P + step + 1]  # (b, 1, 1, P + step + 1)
        logits = forward(model, tok[:, None], position_ids=next_pos[:, None], attention_mask=step_mask,
                         cache=cache)[:, -1]  # (b, V)
        next_pos = next_pos + 1
        nfe += 1
    for i, row in enumerate(buf.tolist() if running else []):  # rows that ran to max_new_tokens
        tokens[running[i]] = row
    stats = DecodeStats(nfe=nfe, nfe_per_row=nfe_rows, tokens_per_row=[len(t) for t in tokens],
                        seconds=time.perf_counter() - t0, stops_per_row=stops_rows)
    return DecodeOutput(tokens=tokens, stats=stats)


def _hit_stop_string(bundle, prompts, buf, running, stop_strings) -> torch.Tensor:
    """(b,) bool: whether each running row's decoded continuation contains a stop string.

    buf: (b, t) ids generated so far by the running rows; running[i]: row i's prompt index."""
    hit = [any(s in bundle.decode_continuation(prompts[r], row) for s in stop_strings)
           for r, row in zip(running, buf.tolist())]
    return torch.tensor(hit, dtype=torch.bool, device=buf.device)
