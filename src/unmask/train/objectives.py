"""Training objectives for the generic loop (``unmask.train.loop``), which only needs
``objective.loss(model, chunks, generator)`` (STYLE.md habit 2).

SBD (spec/sbd.md §3): :class:`SBDObjective` binds the pure loss of :mod:`unmask.train.sbd_loss`
(and, with ``distill_lambda``, the self-distilled loss of :mod:`unmask.train.sbd_distill`).

Masked diffusion (spec/diffusion.md §1): :func:`masked_diffusion_loss`, the 1/t-weighted
masked-token cross-entropy (with the optional Dream-style shift of §2); the objective that draws
the noise and runs the bidirectional forward is ``unmask.train.diffusion``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unmask.errors import UnmaskError
from unmask.train.lm_loss import IGNORE  # noqa: F401 (public here: tests and recipes import it with the objective)
from unmask.train.sbd_distill import check_lambda, sbd_distill_loss
from unmask.train.sbd_loss import (OFFSETS, offset_ce, offset_terms, sample_block_size, sbd_attention_mask,  # noqa: F401
                                   sbd_batch, sbd_loss, sbd_nll)


@dataclass(frozen=True)
class SBDObjective:
    """SBD fine-tuning objective for :func:`unmask.train.loop.train` (sbd.md §3).

    The loop calls :meth:`step_params` once per optimizer step (k ~ U{block_range}, shared by
    every micro-batch of the step, sbd.md §3.1) and :meth:`loss` once per micro-batch; each
    validation adds :meth:`diagnostics` (masked CE per block offset at ``eval_block_size``).
    With ``distill_lambda`` (λ >= 0) the loss adds λ · KL(NTP ‖ block) at every masked target
    (spec/sbd_exact.md §5.5, :func:`unmask.train.sbd_distill.sbd_distill_loss`) and logs ``kl``.
    """

    mask_token_id: int
    block_range: tuple[int, int] = (2, 16)
    eval_block_size: int = 8
    distill_lambda: float | None = None
    name: str = "sbd"
    term_names: tuple[str, ...] = ("ntp", "mat")

    def __post_init__(self):
        if self.distill_lambda is not None:  # self-distilled block mode (spec/sbd_exact.md §5.5)
            object.__setattr__(self, "distill_lambda", check_lambda(self.distill_lambda))
            object.__setattr__(self, "name", "sbd-distill")
            object.__setattr__(self, "term_names", ("ntp", "mat", "kl"))
        low, high = self.block_range
        if not 1 <= low <= high:
            raise UnmaskError(f"block_range must satisfy 1 <= low <= high, got {self.block_range}; pass e.g. (2, 8)")
        if self.mask_token_id < 0:
            raise UnmaskError(f"mask_token_id must be >= 0, got {self.mask_token_id}; pass the model's mask token id")
        if self.eval_block_size < 1:
            raise UnmaskError(f"eval_block_size must be >= 1, got {self.eval_block_size}; pass e.g. 8")

    def step_params(self, generator: torch.Generator) -> dict:
        """Per-step draws: ``{"k": k}``."""
        return {"k": sample_block_size(generator, *self.block_range)}

    def loss(self, model, chunks: torch.Tensor, generator: torch.Generator, *, k: int,
             labels: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """chunks (B, L+1) long (labels (B, L+1) bool or None) on the model's device -> (loss,
        terms) of :func:`sbd_loss`."""
        batch = sbd_batch(chunks, self.mask_token_id, k, generator, labels=labels)
        if self.distill_lambda is not None:
            return sbd_distill_loss(model, batch, k, self.mask_token_id, self.distill_lambda)
        return sbd_loss(model, batch, k, self.mask_token_id)

    def diagnostics(self, model, chunks: torch.Tensor, labels: torch.Tensor | None) -> dict[str, float]:
        """Validation extras: ``d0 d1 d2 d3 d7`` of :func:`offset_ce` at ``eval_block_size``
        (its ``ntp`` is the ``ntp`` term already)."""
        k = min(self.eval_block_size, chunks.shape[1] - 1)
        terms = offset_ce(model, chunks, labels, self.mask_token_id, k, tuple(j for j in OFFSETS if j < k))
        return {name: v for name, v in terms.items() if name != "ntp"}


# ---------------------------------------------------------------------------------------------
# Masked diffusion (spec/diffusion.md §1–2)
# ---------------------------------------------------------------------------------------------

DIFFUSION_NORMS = ("token", "sequence", "batch")


def masked_token_nll(logits: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor, shift: bool,
                     mask_id: int | None = None) -> torch.Tensor:
    """−log pθ(x0^i | xt) at every masked position, 0 elsewhere (diffusion.md §1–2).

    The cross-entropy runs on the masked positions only, so its cost scales with the number of
    targets, not with B·T·V.

    Args:
        logits: (B, T, V) raw forward outputs over the noisy canvas xt (any float dtype).
        x0: (B, T) long clean tokens.
        masked: (B, T) bool, True where xt holds the mask token (the scored positions).
        shift: True for the Dream-style one-position shift (§2): position i is scored by the
            logits at i − 1, so position 0 cannot be scored and must not be masked.
        mask_id: vocabulary row whose logit is set to −inf first (§2 item 3); None = keep all.

    Returns:
        (B, T) float32 NLL in nats.
    """
    scored = masked
    if shift:
        logits = logits[:, :-1]  # (B, T-1, V): row i-1 scores token i
        x0, scored = x0[:, 1:], masked[:, 1:]  # (B, T-1) each
    picked = logits[scored].float()  # (n, V), n = number of targets
    if mask_id is not None:
        picked[:, mask_id] = float("-inf")
    nll = F.cross_entropy(picked, x0[scored], reduction="none")  # (n,)
    out = torch.zeros(scored.shape, dtype=torch.float32, device=logits.device)  # (B, T or T-1)
    out = out.masked_scatter(scored, nll)  # row-major order, the same order as the boolean gather
    if shift:
        out = F.pad(out, (1, 0))  # (B, T): position 0 is never a target
    return out


def diffusion_weighted_loss(nll: torch.Tensor, t: torch.Tensor, maskable: torch.Tensor,
                            norm: str = "token") -> torch.Tensor:
    """The §1 objective from per-token NLL: Σ_i NLL_bi / t_b, normalised by ``norm``.

    ``token``: divided by the number of maskable tokens in the batch (library default, as in
    ZHZisZZ/dllm). ``sequence``: each row divided by its own maskable count, then the mean over
    rows that have any. ``batch``: divided by the number of rows B (nats per sequence).

    Args:
        nll: (B, T) float, 0 at unmasked positions (:func:`masked_token_nll`).
        t: (B,) float mask ratio of each row, in (0, 1].
        maskable: (B, T) bool, the positions that could have been masked (response tokens).

    Returns:
        scalar float32 (0 with a graph when nothing is maskable).
    """
    per_row = (nll / t[:, None].to(nll.dtype)).sum(dim=1)  # (B,) 1/t-weighted sum
    n = maskable.sum(dim=1).to(nll.dtype)  # (B,) maskable tokens per row
    if norm == "token":
        return per_row.sum() / n.sum().clamp(min=1)
    if norm == "sequence":
        has = n > 0
        return (per_row[has] / n[has]).mean() if bool(has.any()) else per_row.sum() * 0
    if norm == "batch":
        return per_row.sum() / per_row.shape[0]
    raise UnmaskError(f"unknown loss normalisation --norm {norm!r}; choose one of: {', '.join(DIFFUSION_NORMS)}")


def masked_diffusion_loss(logits: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor, t: torch.Tensor,
                          shift: bool, norm: str = "token", *, maskable: torch.Tensor | None = None,
                          mask_id: int | None = None) -> torch.Tensor:
    """Masked-diffusion loss (diffusion.md §1; LLaDA arXiv 2502.09992, linear schedule w(t) = 1/t).

    ``L = Σ_b Σ_i 1[xt_b^i = m] · (−log pθ(x0_b^i | xt_b)) / t_b``, divided as ``norm`` says
    (:func:`diffusion_weighted_loss`). With t ~ U[1e-3, 1) per row (drawn by the caller) its
    expectation is an upper bound on the NLL per maskable token.

    Args:
        logits: (B, T, V) raw forward outputs over xt (bidirectional attention).
        x0: (B, T) long clean tokens.
        masked: (B, T) bool, True where xt holds the mask token.
        t: (B,) float mask ratio per row, each in (0, 1].
        shift: Dream-style realignment (§2): position i is read from the logits at i − 1.
        norm: ``token`` (default), ``sequence`` or ``batch``.
        maskable: (B, T) bool, the response positions that could be masked (prompt tokens of
            SFT and the leading BOS are not). Default: every position (all but 0 when shifted).
            ``masked`` must lie inside it.
        mask_id: the mask token; its logit is −inf so no probability goes to it (§2 item 3).

    Returns:
        scalar float32 tensor with grad.

    Raises:
        UnmaskError: mismatched shapes, an unknown norm, t outside (0, 1], a masked position
            outside ``maskable``, or a masked position 0 under ``shift``.
    """
    if logits.dim() != 3 or x0.shape != logits.shape[:2] or masked.shape != x0.shape:
        raise UnmaskError(f"logits must be (B, T, V) with x0 and masked (B, T), got {tuple(logits.shape)}, "
                          f"{tuple(x0.shape)}, {tuple(masked.shape)}; pass tensors of matching shapes")
    if t.shape != (x0.shape[0],):
        raise UnmaskError(f"t must hold one mask ratio per row, shape ({x0.shape[0]},), got {tuple(t.shape)}; "
                          "pass one t per row of x0")
    if norm not in DIFFUSION_NORMS:
        raise UnmaskError(f"unknown loss normalisation --norm {norm!r}; choose one of: {', '.join(DIFFUSION_NORMS)}")
    if bool(((t <= 0) | (t > 1)).any()):
        raise UnmaskError("every mask ratio t must lie in (0, 1]; draw t ~ U[1e-3, 1)")
    if maskable is None:
        maskable = torch.ones_like(masked)
        if shift:
            maskable[:, 0] = False
    if shift and bool(masked[:, 0].any()):
        raise UnmaskError("with the one-position shift, position 0 has no logits to be scored from and must "
                          "not be masked; start every sequence with BOS")
    if bool((masked & ~maskable).any()):
        raise UnmaskError("a masked position lies outside `maskable` (a prompt token or the leading BOS); "
                          "mask only maskable positions")
    nll = masked_token_nll(logits, x0, masked, shift, mask_id)  # (B, T)
    return diffusion_weighted_loss(nll, t, maskable, norm)
