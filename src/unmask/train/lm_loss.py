"""Memory-lean token cross-entropy through the LM head (issue 18 item 4).

A training forward over SBD's 2L-token layout used to materialise float logits for every
position, (B, 2L, V): 0.8 GB per copy at B = 8, L = 256 and SmolLM2's 49K vocabulary, several
copies alive at once (logits, log-softmax, their gradients), most of them at positions that carry
no target. Here the loss reads the final hidden states instead (:func:`unmask.compat.final_hidden`:
the model's own forward with ``output_hidden_states`` and the head on one position), gathers
the n positions that carry a target, and applies the head ``chunk`` rows at a time inside
``torch.utils.checkpoint``: the forward keeps only each chunk's inputs, the backward recomputes
one chunk's logits at a time. Peak logits memory is ``chunk × V`` floats (a few of them for the
softmax and its gradient), whatever B, L and n; ``chunk`` defaults to ``2**24 // V`` rows
(64 MiB of float32 logits).

Heads it cannot read as one linear map (an FSDP2-sharded model, a logit soft-cap or scale) fall
back to the full logits of :func:`unmask.compat.forward`, with the same result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE = -100
LOGITS_BUDGET = 1 << 24  # logit elements per chunk: 64 MiB in float32


def head_weights(model) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight (V, d), bias (V,) or None)`` of ``model``'s LM head when the logits are exactly
    ``F.linear(final_hidden, weight, bias)``; else None (the caller uses full logits).

    A gated adapter's ``MaskLogitHead`` counts as its base head: its extra column is the added
    mask token's logit, which every loss suppresses anyway. None for an FSDP2-sharded model (its
    parameters are shards outside its forward), a ``final_logit_softcapping`` or a ``logit_scale``.
    """
    from unmask.models.sbd_adapter import MaskLogitHead
    from unmask.train.parallel import inner, is_sharded

    if is_sharded(model):
        return None
    cfg = inner(model).config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    head = model.get_output_embeddings()
    if isinstance(head, MaskLogitHead):
        head = head.base
    if type(head) is not nn.Linear:
        return None
    return head.weight, head.bias


def _rows_nll(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
              suppress: torch.Tensor | None) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # (c, V): the head in the model's dtype, then fp32 as HF does
    if suppress is not None:  # in place: the head's backward does not read its output, so no copy is needed
        logits.index_fill_(-1, suppress, float("-inf"))
    return F.cross_entropy(logits, targets, reduction="none")  # (c,)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          bias: torch.Tensor | None = None, suppress: int | None = None,
                          chunk: int | None = None) -> torch.Tensor:
    """``−log softmax(hidden Wᵀ + b)[target]`` per row, ``chunk`` rows at a time.

    Args:
        hidden: (n, d) final hidden states (any float dtype).
        weight: (V, d) LM head; bias: (V,) or None.
        targets: (n,) long, each in ``[0, V)``.
        suppress: a vocabulary id whose logit is −inf (the mask token); ignored outside ``[0, V)``.
        chunk: rows per piece (default ``LOGITS_BUDGET // V``, at least 1).

    Returns:
        (n,) float32 NLL in nats, with grad to ``hidden`` / ``weight`` / ``bias`` when they have
        it. Under grad each chunk runs in a non-reentrant checkpoint, so the backward holds one
        chunk's logits at a time: peak logits memory is O(chunk × V), independent of n.
    """
    n, V = hidden.shape[0], weight.shape[0]
    chunk = max(1, LOGITS_BUDGET // V) if chunk is None else chunk
    drop = torch.tensor([suppress], device=hidden.device) if suppress is not None and 0 <= suppress < V else None
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    pieces = []
    for start in range(0, n, chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]  # (c, d), (c,)
        if grad:
            pieces.append(checkpoint(_rows_nll, h, weight, bias, t, drop, use_reentrant=False,
                                     preserve_rng_state=False))
        else:
            pieces.append(_rows_nll(h, weight, bias, t, drop))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)  # (n,)


def lm_nll(model, input_ids: torch.Tensor, *, position_ids: torch.Tensor, attention_mask, labels: torch.Tensor,
           suppress: int | None = None, cache=None, chunk: int | None = None) -> torch.Tensor:
    """One forward and the per-position NLL of ``labels``, logits only where a label is.

    Args:
        input_ids, position_ids, attention_mask, cache: as :func:`unmask.compat.forward`.
        labels: (B, q) long targets read at the same position (no shift here), IGNORE (-100)
            where a position has none.
        suppress: the mask token id, whose logit is −inf.

    Returns:
        (B, q) float32 NLL, 0 at ignored positions, with grad when enabled.
    """
    from unmask.compat import final_hidden, forward

    valid = labels != IGNORE  # (B, q)
    head = head_weights(model)
    if head is None:  # full logits, as before
        logits = forward(model, input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         cache=cache)  # (B, q, V) float32
        if suppress is not None and 0 <= suppress < logits.shape[-1]:
            logits = logits.index_fill(-1, torch.tensor([suppress], device=logits.device), float("-inf"))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                               reduction="none").view(labels.shape)  # (B, q)
    hidden = final_hidden(model, input_ids, position_ids=position_ids, attention_mask=attention_mask,
                          cache=cache)  # (B, q, d)
    weight, bias = head
    nll = chunked_cross_entropy(hidden[valid], weight, labels[valid], bias=bias, suppress=suppress,
                                chunk=chunk)  # (n,): hidden[valid] is (n, d), row-major
    out = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)  # (B, q)
    return out.masked_scatter(valid, nll)  # the same row-major order as the boolean gather
