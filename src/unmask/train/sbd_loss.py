"""The SBD training loss as pure tensor functions (spec/sbd.md §3; STYLE.md habit 2).

The clean + noisy layout of Figs. 7–8 built by :func:`sbd_batch`, the joint NTP + masked-token
loss of Eq. 14 computed by :func:`sbd_loss` in one forward over 2L tokens with the §3.3 attention
mask (:func:`sbd_attention_mask`). :func:`offset_ce` is the draft-mode diagnostic: masked CE per
block offset next to the NTP CE. :class:`unmask.train.objectives.SBDObjective` binds them for the
training loop.

Answer-only training (issue 18): with a (B, L+1) bool label mask, only labelled tokens are
targets: an NTP position counts iff the token it predicts is labelled, and only labelled tokens
are ever masked in the noisy copy (so a block that straddles the prompt/answer boundary keeps
its prompt tokens, as at inference, where the prompt is never masked). The logits are computed
at target positions only (unmask.train.lm_loss).
"""

from __future__ import annotations

import torch

from unmask.errors import UnmaskError
from unmask.masks import as_4d, sbd_training_mask, sbd_training_position_ids, to_additive
from unmask.train.lm_loss import IGNORE, lm_nll

OFFSETS = (0, 1, 2, 3, 7)  # block offsets of the draft-mode diagnostic


def sample_block_size(generator: torch.Generator, low: int = 2, high: int = 16) -> int:
    """k ~ U{low..high}, both ends inclusive: one draw per training step (sbd.md §3.1, fix #1 of §3.5)."""
    if not 1 <= low <= high:
        raise UnmaskError(f"block range must satisfy 1 <= low <= high, got [{low}, {high}]; pass e.g. (2, 8)")
    return int(torch.randint(low, high + 1, (1,), generator=generator).item())


def sbd_batch(chunks: torch.Tensor, mask_id: int, k: int, generator: torch.Generator,
              eta: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> dict:
    """Clean + noisy SBD training layout (sbd.md §3.1–3.2, SBD Figs. 7–8, Eq. 13).

    Per sequence η ~ U(0,1); each clean token x_i is replaced by the mask token with
    probability η. Masked-half labels are the *unshifted* clean tokens at masked positions of
    complete, block-aligned blocks (Eq. 14's T); everything else there is -100, including the
    trailing L mod k positions (fixes #2, #3 of §3.5).

    Args:
        chunks: (B, L+1) long token ids (L >= 1), on any device.
        mask_id: the mask token id m.
        k: block size for this step (>= 1).
        generator: CPU ``torch.Generator`` for η and the masks (kept on CPU so that a run is
            reproducible whatever the device).
        eta: (B,) float CPU noise levels to use instead of drawing η ~ U(0,1) (1.0 = all-mask
            blocks, the draft mode of spec/sbd_exact.md §3).
        labels: (B, L+1) bool, True where a token is a loss target (answer-only training); None
            = every token. Unlabelled tokens are never NTP targets and never masked (the draws
            are the same either way, so an all-True mask gives exactly the unlabelled batch).

    Returns:
        dict with ``input_ids`` (B, 2L), ``labels`` (B, 2L), ``position_ids`` (B, 2L) long;
        ``noise_mask`` (B, L) bool (True where the noisy copy holds m); ``eta`` (B,) float;
        ``k`` int and ``L`` int. All tensors on ``chunks``' device.
    """
    if chunks.dim() != 2 or chunks.shape[1] < 2:
        raise UnmaskError(f"chunks must be (B, L+1) with L >= 1, got {tuple(chunks.shape)}; pack them with "
                          "unmask.train.data.pack")
    if k < 1:
        raise UnmaskError(f"block size k must be >= 1, got {k}; pass k >= 1")
    B, L = chunks.shape[0], chunks.shape[1] - 1
    device = chunks.device
    input_ids = chunks[:, :-1]  # (B, L) clean x_1..x_L
    ar_labels = chunks[:, 1:]  # (B, L) NTP targets x_2..x_{L+1}
    eta = torch.rand(B, generator=generator) if eta is None else eta  # (B,) noise level per sequence
    noise = torch.rand(B, L, generator=generator) < eta[:, None]  # (B, L) True = masked
    noise = noise.to(device)
    if labels is not None:
        if labels.shape != chunks.shape or labels.dtype != torch.bool:
            raise UnmaskError(f"labels must be a bool tensor shaped like chunks {tuple(chunks.shape)}, got "
                              f"{labels.dtype} {tuple(labels.shape)}; pass the mask made by pack_labelled")
        labels = labels.to(device)
        ar_labels = torch.where(labels[:, 1:], ar_labels, torch.full_like(ar_labels, IGNORE))  # (B, L)
        noise = noise & labels[:, :-1]  # (B, L): a prompt token stays in the noisy copy
    noisy_ids = torch.where(noise, torch.full_like(input_ids, mask_id), input_ids)  # (B, L)
    complete = torch.arange(L, device=device) < (L // k) * k  # (L,) inside a complete block
    mat_labels = torch.where(noise & complete[None, :], input_ids, torch.full_like(input_ids, IGNORE))  # (B, L)
    positions = sbd_training_position_ids(L, device=device)  # (2L,)
    return {
        "input_ids": torch.cat([input_ids, noisy_ids], dim=1),  # (B, 2L)
        "labels": torch.cat([ar_labels, mat_labels], dim=1),  # (B, 2L)
        "position_ids": positions[None, :].expand(B, -1),  # (B, 2L)
        "noise_mask": noise,
        "eta": eta.to(device),
        "k": k,
        "L": L,
    }


def sbd_attention_mask(model, L: int, k: int, device) -> torch.Tensor:
    """The §3.3 mask in the form the model's attention backend expects.

    Returns (1, 1, 2L, 2L): bool for SDPA (and other backends that take bool), additive float
    in the model's dtype for eager, which *adds* the mask (models.md §3.4).
    """
    mask = as_4d(sbd_training_mask(L, k, device=device))  # (1, 1, 2L, 2L) bool
    if getattr(model.config, "_attn_implementation", "sdpa") == "eager":
        return to_additive(mask, dtype=next(model.parameters()).dtype)
    return mask


def sbd_loss(model, batch: dict, k: int, mask_id: int) -> tuple[torch.Tensor, dict]:
    """Joint SBD loss, Eq. 14 (sbd.md §3.4), from one forward over the 2L-token layout.

    The mask-token logit is set to -inf in both terms: with tied embeddings it is a real output
    row, and decoders suppress it, so the model is never trained to spend mass on it.
    Reduction (our reading of Fig. 7): one cross-entropy averaged over every non-ignored target
    of both halves, i.e. Eq. 14 divided by the batch's target count.

    Args:
        model: a causal LM (HF ``...ForCausalLM``) whose vocabulary contains ``mask_id``.
        batch: output of :func:`sbd_batch` (tensors on the model's device).
        k: the block size ``batch`` was built with.

    Returns:
        ``(loss, terms)``: loss a scalar float32 tensor with grad; terms
        ``{"ntp": ..., "mat": ..., "ntp_tokens": n, "mat_tokens": n}`` (detached scalars; a term
        with no targets is 0).
    """
    L = batch["L"]
    nll = sbd_nll(model, batch, k, mask_id)  # (B, 2L), 0 at ignored targets
    valid = batch["labels"] != IGNORE  # (B, 2L)
    n_ntp = valid[:, :L].sum()
    n_mat = valid[:, L:].sum()
    loss = nll.sum() / (n_ntp + n_mat).clamp(min=1)
    with torch.no_grad():
        terms = {
            "ntp": nll[:, :L].sum() / n_ntp.clamp(min=1),
            "mat": nll[:, L:].sum() / n_mat.clamp(min=1),
            "ntp_tokens": n_ntp,
            "mat_tokens": n_mat,
        }
    return loss, terms


def sbd_nll(model, batch: dict, k: int, mask_id: int) -> torch.Tensor:
    """Per-position NLL of the SBD layout (sbd.md §3.2–3.4) from one forward over 2L tokens.

    Logits are formed only at target positions, a bounded number of rows at a time
    (:func:`unmask.train.lm_loss.lm_nll`); the mask token's logit is −inf.

    Args:
        model: a causal LM whose vocabulary (``config.vocab_size``) contains ``mask_id``.
        batch: :func:`sbd_batch` output; k: its block size.

    Returns:
        (B, 2L) float32, 0 at ignored targets; with grad when enabled.

    Raises:
        UnmaskError: ``mask_id`` outside the model vocabulary.
    """
    L = batch["L"]
    V = model.config.vocab_size
    if not 0 <= mask_id < V:
        raise UnmaskError(f"mask_token_id {mask_id} is outside the model vocabulary of {V}; pass a mask token id "
                          "below the vocabulary size")
    attn = sbd_attention_mask(model, L, k, batch["input_ids"].device)  # (1, 1, 2L, 2L)
    B = batch["input_ids"].shape[0]
    return lm_nll(model, batch["input_ids"], position_ids=batch["position_ids"],
                  attention_mask=attn.expand(B, -1, -1, -1), labels=batch["labels"], suppress=mask_id)  # (B, 2L)


def offset_terms(nll: torch.Tensor, valid: torch.Tensor, k: int, offsets=OFFSETS) -> dict[str, torch.Tensor]:
    """Mean masked CE at each block offset: ``{"d{j}": mean of nll where valid and i % k == j}``.

    nll: (B, L) float NLL of the noisy half (unshifted: position i is scored on token i);
    valid: (B, L) bool positions to average. An offset with no position gives 0.
    """
    offset = torch.arange(nll.shape[1], device=nll.device) % k  # (L,) position within its block
    out = {}
    for j in offsets:
        where = valid & (offset == j)[None, :]  # (B, L)
        out[f"d{j}"] = nll[where].sum() / where.sum().clamp(min=1)
    return out


@torch.no_grad()
def offset_ce(model, chunks: torch.Tensor, labels: torch.Tensor | None, mask_id: int, k: int = 8,
              offsets=OFFSETS) -> dict[str, float]:
    """Draft-mode diagnostic (spec/sbd_exact.md §3): masked CE per block offset and the NTP CE.

    Every block of size k of every row is all-mask (η = 1; prompt tokens stay, see the module
    docstring); ``d{j}`` is the mean CE of the masked tokens at offset j of their block, whose
    context is the clean prefix before the block; ``ntp`` is the model's ordinary next-token
    CE on the same rows (the clean half). Works for SBD models and for gated adapters (one 2L
    forward, which equals the adapter trainer's two passes).

    Args:
        chunks: (B, L+1) long held-out rows on the model's device; labels: (B, L+1) bool or None.
        mask_id: the mask token; k: block size; offsets: block offsets to report (each < k).

    Returns:
        ``{"ntp": float, "d0": float, ...}`` in nats.
    """
    B = chunks.shape[0]
    batch = sbd_batch(chunks, mask_id, k, torch.Generator().manual_seed(0), eta=torch.ones(B), labels=labels)
    L = batch["L"]
    nll = sbd_nll(model, batch, k, mask_id)  # (B, 2L)
    valid = batch["labels"] != IGNORE  # (B, 2L)
    terms = {"ntp": nll[:, :L][valid[:, :L]].sum() / valid[:, :L].sum().clamp(min=1),
             **offset_terms(nll[:, L:], valid[:, L:], k, offsets)}
    return {name: float(v) for name, v in terms.items()}
