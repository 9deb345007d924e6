"""Label-free quality of generated text: judge NLL, distinct-n and agreement with a reference.

Used by the ``stories`` task, ``unmask bench`` and the per-paper benchmark scripts. All
functions work on token ids, so they compare decoders exactly, whatever the detokeniser does.

Definitions (*our choices*, stated once here):

- **Reference NLL** (:func:`reference_nll`): the mean negative log-likelihood in nats per
  generated token of a continuation under a causal *judge* model, teacher-forced with the
  prompt as context. Lower is better (more fluent as the judge sees it); degenerate
  repetition also scores low, so read it next to distinct-n.
- **Judge probability** (:func:`judge_prob_pct`): 100·exp(−NLL), the judge's geometric-mean
  per-token probability of the continuation in percent (= 100 / perplexity). This is the
  ``stories`` task's quality in percent, the y axis of its sweeps and AUP.
- **distinct-n** (:func:`distinct_n`): distinct n-grams / all n-grams of one sequence
  (Li et al. 2016, per sequence); ``None`` when the sequence is shorter than n.
- **Agreement** (:func:`agreement`) of a continuation ``a`` with a reference ``r`` (the
  greedy AR output of the same model):
  ``prefix`` = length of the longest common prefix / max(len(a), len(r)), the fraction of
  positions that match up to the first divergence; ``positional`` = number of positions
  i < min(len(a), len(r)) with a_i = r_i, divided by max(len(a), len(r)). Both are 1.0 iff
  the two sequences are identical (two empty sequences agree fully) and count a length
  difference as disagreement.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from unmask.compat import forward
from unmask.errors import UnmaskError

JUDGE_KINDS = ("causal", "sbd")  # kinds whose plain causal forward is a next-token LM


@torch.inference_mode()
def reference_nll(judge, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], *,
                  batch_size: int = 16) -> list[float]:
    """Mean per-token NLL (nats) of each continuation under ``judge``, prompt as context.

    Args:
        judge: a :class:`~unmask.models.ModelBundle` of kind ``causal`` or ``sbd`` (an SBD
            model is judged in its next-token mode, Eq. 9a).
        prompts: prompt token ids per row, as the judge's tokenizer writes them (BOS included).
        continuations: generated ids per row (no stop token).
        batch_size: rows per judge forward.

    Returns:
        One float per row; ``nan`` for an empty continuation. When prompt + continuation
        exceed the judge's context window the prompt is cut from the left (the continuation
        is always scored whole; a continuation alone longer than the window raises).

    Raises:
        UnmaskError: a judge of another kind, mismatched lengths, ids outside the judge's
            vocabulary, or a continuation longer than the judge's context window.
    """
    if judge.kind not in JUDGE_KINDS:
        raise UnmaskError(f"the judge model must be causal (kind {' or '.join(JUDGE_KINDS)}), "
                          f"got {judge.name!r} of kind {judge.kind!r}; pass --judge stories260K")
    if len(prompts) != len(continuations):
        raise UnmaskError(f"reference_nll: {len(prompts)} prompts but {len(continuations)} continuations")
    if batch_size < 1:
        raise UnmaskError(f"reference_nll: batch_size must be >= 1, got {batch_size}")
    vocab, ctx = judge.model.config.vocab_size, judge.context_length
    out: list[float] = [math.nan] * len(prompts)
    todo = []
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        if not c:
            continue
        if max(max(p, default=0), max(c)) >= vocab:
            raise UnmaskError(f"row {i} holds token ids outside the judge's vocabulary of {vocab}; "
                              "use a judge with the same tokenizer")
        if len(c) >= ctx:
            raise UnmaskError(f"row {i}: a continuation of {len(c)} tokens does not fit the judge's "
                              f"context window of {ctx}; lower --max-new-tokens")
        p = list(p)[-(ctx - len(c)):]  # keep the nearest context
        todo.append((i, p, list(c)))
    device, pad = judge.device, judge.pad_token_id
    for s in range(0, len(todo), batch_size):
        chunk = todo[s:s + batch_size]
        T = max(len(p) + len(c) for _, p, c in chunk)
        ids = torch.full((len(chunk), T), pad, dtype=torch.long, device=device)  # (B, T) right-padded
        valid = torch.zeros(len(chunk), T, dtype=torch.bool, device=device)  # (B, T)
        target = torch.zeros(len(chunk), T, dtype=torch.bool, device=device)  # (B, T) scored tokens
        for r, (_, p, c) in enumerate(chunk):
            seq = p + c
            ids[r, :len(seq)] = torch.tensor(seq, device=device)
            valid[r, :len(seq)] = True
            target[r, len(p):len(seq)] = True
        pos = torch.arange(T, device=device).expand(len(chunk), T)  # (B, T)
        logits = forward(judge.model, ids, position_ids=pos, attention_mask=valid.long())  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, T-1, V): position t scores token t+1
        tok_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
        scored = target[:, 1:]  # (B, T-1)
        nll = -(tok_logp * scored).sum(dim=1) / scored.sum(dim=1)  # (B,)
        for r, (i, _, _) in enumerate(chunk):
            out[i] = float(nll[r])
    return out


def judge_prob_pct(nll: float) -> float:
    """100·exp(−NLL): the judge's geometric-mean token probability in percent (nan stays nan)."""
    return 100.0 * math.exp(-nll) if not math.isnan(nll) else math.nan


def distinct_n(tokens: Sequence[int], n: int = 4) -> float | None:
    """Distinct n-grams / all n-grams of one sequence; ``None`` if it has fewer than n tokens."""
    if n < 1:
        raise UnmaskError(f"distinct_n: n must be >= 1, got {n}")
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def agreement(tokens: Sequence[int], reference: Sequence[int]) -> dict[str, float]:
    """``{"prefix": ..., "positional": ...}`` of ``tokens`` against ``reference`` (module doc)."""
    a, r = list(tokens), list(reference)
    longest = max(len(a), len(r))
    if longest == 0:
        return {"prefix": 1.0, "positional": 1.0}
    same = [x == y for x, y in zip(a, r)]
    prefix = next((i for i, s in enumerate(same) if not s), len(same))
    return {"prefix": prefix / longest, "positional": sum(same) / longest}


def mean(values: Sequence[float | None]) -> float | None:
    """Mean of the values that are not ``None`` or nan; ``None`` when there are none."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else None
