"""Teacher-forcing (TF) training of block-diffusion LMs with the dual-stream layout (multiblock.md §1.3).

One training row of L tokens becomes ``X = [x_t ; x_0]`` (2L tokens, both copies at positions
0..L-1): the noisy copy, where some positions of every block hold the mask token, then the clean
copy. The attention mask (:func:`unmask.masks_multitf.group_dual_stream_mask` with singleton
groups, equal to ``bd_training_mask``) lets a noisy block see itself and the clean blocks before
it, and the clean copy attend block-causally, so one forward trains every block in parallel on
exactly the context it has at inference (prefix in the KV cache, the block itself noisy). The loss
is the masked cross-entropy on the noisy copy, **without** a logit shift (position i predicts
token i, as SDAR/LLaDA2), averaged over the masked positions of the batch (eq. 3.4).

Noise (multiblock.md §1.3, our choice): per block ``t_k ~ U(t_low, t_high)`` i.i.d.
(``noise="sequence"``: one t per row), then ``n_k`` uniformly chosen maskable positions of block k
are masked, with ``n_k = floor(B_valid * t_k)`` (``rounding="floor"``, as the spec and the
released code) or ``floor(B_valid * t_k + u)``, ``u ~ U(0, 1)`` (``rounding="stochastic"``, ours:
E[n_k] = B_valid * t_k exactly, and for a small B both a fully masked block, which is what every
block's first forward sees at inference, and a clean one occur; with floor a B = 8 block is never
fully masked unless t = 1).

Alignment with the decoders (``unmask.decode.blocks.single`` / ``multiblock``): blocks start at multiples
of B from a row's first token, which at inference is the prompt's BOS. :func:`pack_aligned` makes
every training row start at a document's BOS, so block 0 of a row is block 0 of a story; the
first ``prompt_len`` positions (the BOS) are never masked, as a prompt never is.

:class:`TFObjective` binds these for :func:`unmask.train.loop.train`; :mod:`unmask.train.block_diffusion`
loads the base and publishes the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unmask.errors import UnmaskError

IGNORE = -100
ROUNDINGS = ("floor", "stochastic")
LOSSES = ("ce", "ipw")
IPW_EPS = 1e-3  # multiblock.md §4.4: the "small constant" under a 1/t weight (our choice, = t_low)
NOISES = ("block", "sequence")


def pack_aligned(docs: Sequence[Sequence[int]], seq_len: int, sep_id: int) -> torch.Tensor:
    """Rows that each start at a document's separator (BOS): (N, seq_len + 1) long.

    The documents are concatenated as :func:`unmask.train.data.pack` does (each starts with
    ``sep_id``), and one row of ``seq_len + 1`` tokens is cut at every document start that has
    that many tokens after it, running on into the following documents. Rows overlap when
    documents are shorter than ``seq_len``; a document start that is too close to the end of the
    stream gives no row. Block 0 of every row is therefore the first block of a story, as at
    inference (blocks are aligned to the prompt's first token).
    """
    if seq_len < 1:
        raise UnmaskError(f"--seq-len must be >= 1, got {seq_len}; pass --seq-len 1 or more")
    stream: list[int] = []
    starts: list[int] = []
    for d in docs:
        if not d:
            continue
        starts.append(len(stream))
        if d[0] != sep_id:
            stream.append(sep_id)
        stream.extend(d)
    flat = torch.tensor(stream, dtype=torch.long)  # (T,)
    starts_t = torch.tensor([s for s in starts if s + seq_len + 1 <= len(stream)], dtype=torch.long)  # (N,)
    if len(starts_t) == 0:
        return torch.zeros((0, seq_len + 1), dtype=torch.long)
    offsets = torch.arange(seq_len + 1)  # (L+1,)
    return flat[starts_t[:, None] + offsets[None, :]]  # (N, L+1)


def maskable_positions(L: int, prompt_len: int, device=None) -> torch.Tensor:
    """(L,) bool: True from ``prompt_len`` on (the prompt, here the BOS, is never masked)."""
    return torch.arange(L, device=device) >= prompt_len


def mask_counts(valid: torch.Tensor, ratios: torch.Tensor, rounding: str, generator: torch.Generator) -> torch.Tensor:
    """Masks per block from its maskable count and noise ratio (multiblock.md §4.2 step 3).

    valid (..., K) long maskable positions per block, ratios (..., K) float in [0, 1] ->
    (..., K) long in [0, valid]: ``floor(valid * t)`` or, stochastic, ``floor(valid * t + u)``.
    """
    if rounding not in ROUNDINGS:
        raise UnmaskError(f"--rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}; "
                          f"pass --rounding {ROUNDINGS[0]} or --rounding {ROUNDINGS[1]}")
    x = valid.double() * ratios.double()  # (..., K)
    if rounding == "stochastic":
        x = x + torch.rand(ratios.shape, generator=generator, dtype=torch.float64).to(x.device)
    return torch.minimum(x.floor().long(), valid)  # (..., K)


def mask_by_ratio(maskable: torch.Tensor, ratios: torch.Tensor, block_size: int, generator: torch.Generator,
                  rounding: str = "floor") -> torch.Tensor:
    """Mask ``n_k`` uniformly chosen maskable positions of every block (multiblock.md §1.3, §4.2).

    Args:
        maskable: (R, L) bool, L a multiple of ``block_size``.
        ratios: (R, K) float noise ratio per block, K = L / B.
        generator: CPU generator (the draws do not depend on the device).

    Returns:
        (R, L) bool, True = replaced by the mask token; never True where ``maskable`` is False.
    """
    R, L = maskable.shape
    B = block_size
    if L % B:
        raise UnmaskError(f"sequence length {L} must be a multiple of the block size {B}; pass a length that "
                          f"is a multiple of {B}")
    K = L // B
    if ratios.shape != (R, K):
        raise UnmaskError(f"ratios must be (R, K) = {(R, K)}, got {tuple(ratios.shape)}; pass one ratio per block")
    blocks = maskable.view(R, K, B)  # (R, K, B)
    n = mask_counts(blocks.sum(dim=-1), ratios, rounding, generator).to(maskable.device)  # (R, K)
    score = torch.rand((R, K, B), generator=generator).to(maskable.device)  # (R, K, B)
    score = score.masked_fill(~blocks, 2.0)  # unmaskable positions rank last
    rank = score.argsort(dim=-1).argsort(dim=-1)  # (R, K, B) rank of each position in its block
    return (rank < n[..., None]).view(R, L)  # (R, L)


def iid_ratios(R: int, K: int, t_low: float, t_high: float, generator: torch.Generator,
               noise: str = "block") -> torch.Tensor:
    """Plain TF noise (multiblock.md §1.3, our choice): (R, K) float, t ~ U(t_low, t_high) per
    block (``noise="block"``) or one t per row shared by its blocks (``"sequence"``)."""
    if noise not in NOISES:
        raise UnmaskError(f"--noise must be one of {', '.join(NOISES)}, got {noise!r}; "
                          f"pass --noise {NOISES[0]} or --noise {NOISES[1]}")
    cols = K if noise == "block" else 1
    t = t_low + (t_high - t_low) * torch.rand((R, cols), generator=generator, dtype=torch.float64)  # (R, cols)
    return t.expand(R, K).float()  # (R, K)


def dual_stream_inputs(tokens: torch.Tensor, noise_mask: torch.Tensor, mask_id: int) -> dict:
    """``[x_t ; x_0]`` inputs, shared position ids and noisy-copy labels (multiblock.md §1.3).

    tokens (R, L) long, noise_mask (R, L) bool -> ``input_ids`` (R, 2L), ``position_ids``
    (R, 2L) (0..L-1 twice), ``labels`` (R, L): the clean token at masked positions, -100
    elsewhere. No shift: label i belongs to noisy position i.
    """
    R, L = tokens.shape
    noisy = torch.where(noise_mask, torch.full_like(tokens, mask_id), tokens)  # (R, L)
    positions = torch.arange(L, device=tokens.device).repeat(2)  # (2L,)
    return {
        "input_ids": torch.cat([noisy, tokens], dim=1),  # (R, 2L)
        "position_ids": positions[None, :].expand(R, -1),  # (R, 2L)
        "labels": torch.where(noise_mask, tokens, torch.full_like(tokens, IGNORE)),  # (R, L)
        "noise_mask": noise_mask,
    }


def ipw_weights(ratios: torch.Tensor, block_size: int, eps: float = IPW_EPS) -> torch.Tensor:
    """Inverse-propensity weights of the SDAR training code (multiblock.md §4.4).

    ratios (R, K) float, the noise ratio t_k each block was masked with (its per-token mask
    probability p_mask) -> (R, K·B) float32, ``1 / max(t_k, eps)`` at every position of block k.
    """
    w = 1.0 / ratios.float().clamp(min=eps)  # (R, K)
    return w.repeat_interleave(block_size, dim=-1)  # (R, K·B)


def weighted_mean_nll(token_nll: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Σ w·ℓ / Σ w over the ``valid`` (masked) positions; w = 1 is the global mean of eq. 3.4,
    w = :func:`ipw_weights` the self-normalised IPW loss of the released SDAR code
    (``compute_self_normalized_ipw_losses``, multiblock.md §4.4).

    token_nll (R, L) float (any value where not valid), valid (R, L) bool, weights (R, L) or
    None -> scalar; 0 (with grad) when nothing is valid.
    """
    w = valid.to(token_nll.dtype) if weights is None else weights.to(token_nll) * valid  # (R, L)
    nll = torch.where(valid, token_nll, torch.zeros_like(token_nll))  # (R, L) NaN-safe outside
    return (w * nll).sum() / w.sum().clamp(min=1e-12)


def masked_ce_loss(model, batch: dict, mask_id: int, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Masked cross-entropy on the noisy copy (multiblock.md §4.4, eq. 3.4), one forward over 2L.

    The LM head runs on the noisy copy only (``logits_to_keep``). The mask-token logit is set to
    -inf: with tied embeddings it is a real output row and every decoder suppresses it.

    Args:
        model: an HF ``...ForCausalLM`` whose vocabulary contains ``mask_id``.
        batch: ``input_ids`` / ``position_ids`` (R, 2L) long, ``labels`` (R, L) long,
            ``attention`` bool (R or 1, 2L, 2L), all on the model's device.
        weights: (R, L) float per-position weights (:func:`ipw_weights`), or None for the plain
            mean; see :func:`weighted_mean_nll`.

    Returns:
        ``(loss, terms)``: the (weighted) mean NLL (nats) over the batch's masked positions, a
        float32 scalar with grad (0 when nothing is masked); terms ``mat`` (the same, detached),
        ``acc`` (argmax accuracy there), ``masked`` (their count) and, with ``weights``, ``nll``
        (the unweighted mean, so runs with different losses compare).
    """
    from unmask.compat import attention_mask, forward
    from unmask.masks import as_4d

    ids, labels = batch["input_ids"], batch["labels"]
    R, L = labels.shape
    mask4d = as_4d(batch["attention"], R)  # (R, 1, 2L, 2L)
    keep = torch.arange(L, device=ids.device)  # (L,) the noisy copy's rows
    logits = forward(model, ids, position_ids=batch["position_ids"], attention_mask=attention_mask(model, mask4d),
                     logits_to_keep=keep)  # (R, L, V) float32
    V = logits.shape[-1]
    if not 0 <= mask_id < V:
        raise UnmaskError(f"mask_token_id {mask_id} is outside the model vocabulary of {V}; pass a mask token id "
                          "below the vocabulary size")
    logits = logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), float("-inf"))  # (R, L, V)
    token_nll = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE,
                                reduction="none").view(R, L)  # (R, L), 0 where ignored
    valid = labels != IGNORE  # (R, L)
    n = valid.sum()
    mean_nll = token_nll.sum() / n.clamp(min=1)
    loss = mean_nll if weights is None else weighted_mean_nll(token_nll, valid, weights.to(token_nll.device))
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == labels) & valid  # (R, L)
        terms = {"mat": loss.detach(), "acc": correct.sum() / n.clamp(min=1), "masked": n}
        if weights is not None:
            terms["nll"] = mean_nll.detach()
    return loss, terms


def check_ratio_range(t_low: float, t_high: float) -> None:
    if not 0.0 <= t_low <= t_high <= 1.0:
        raise UnmaskError(f"noise range must satisfy 0 <= --t-low <= --t-high <= 1, got [{t_low}, {t_high}]; "
                          "pass --t-low and --t-high within [0, 1], the low one first")


def check_layout(block_size: int, prompt_len: int, mask_token_id: int, rounding: str) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise UnmaskError(f"--block-size must be an integer >= 1, got {block_size!r}; pass --block-size 1 or more")
    if not isinstance(prompt_len, int) or prompt_len < 0:
        raise UnmaskError(f"prompt_len must be an integer >= 0, got {prompt_len!r}; pass 0 or more (1 = the BOS)")
    if mask_token_id < 0:
        raise UnmaskError(f"mask_token_id must be >= 0, got {mask_token_id}; pass the model's mask token id")
    if rounding not in ROUNDINGS:
        raise UnmaskError(f"--rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}; "
                          f"pass --rounding {ROUNDINGS[0]} or --rounding {ROUNDINGS[1]}")


def row_tokens(chunks: torch.Tensor, block_size: int, prompt_len: int) -> torch.Tensor:
    """The L tokens a row trains on: (R, L+1) chunks (the loop's convention) -> (R, L), the last
    token dropped (no shift, so it has no role). Raises UnmaskError unless B divides L and the
    prompt leaves something to mask."""
    if chunks.dim() != 2 or chunks.shape[1] < 2:
        raise UnmaskError(f"chunks must be (R, L+1) with L >= 1, got {tuple(chunks.shape)}; pack them with "
                          "pack_aligned")
    L = chunks.shape[1] - 1
    if L % block_size:
        raise UnmaskError(f"--seq-len {L} must be a multiple of the block size {block_size}; pass e.g. "
                          f"--seq-len {max(1, L // block_size) * block_size}")
    if prompt_len >= L:
        raise UnmaskError(f"prompt_len {prompt_len} leaves nothing to mask in a row of {L} tokens; raise --seq-len "
                          f"above {prompt_len}")
    return chunks[:, :L]  # (R, L)


@dataclass(frozen=True)
class TFObjective:
    """Plain block-diffusion TF (multiblock.md §1.3) for :func:`unmask.train.loop.train`.

    block_size: B. t_low / t_high: the noise range. noise: ``block`` (i.i.d. t per block) or
    ``sequence``. rounding: ``floor`` or ``stochastic`` (module docstring). prompt_len: leading
    positions of every row that are never masked (1 = the BOS).
    """

    mask_token_id: int
    block_size: int
    t_low: float = 0.001
    t_high: float = 1.0
    noise: str = "block"
    rounding: str = "floor"
    prompt_len: int = 1
    name: str = "block-diffusion-tf"
    term_names: tuple[str, ...] = ("mat", "acc")

    def __post_init__(self):
        check_layout(self.block_size, self.prompt_len, self.mask_token_id, self.rounding)
        check_ratio_range(self.t_low, self.t_high)
        if self.noise not in NOISES:
            raise UnmaskError(f"--noise must be one of {', '.join(NOISES)}, got {self.noise!r}; "
                              f"pass --noise {NOISES[0]} or --noise {NOISES[1]}")

    def step_params(self, generator: torch.Generator) -> dict:
        return {}

    def batch(self, chunks: torch.Tensor, generator: torch.Generator) -> dict:
        """chunks (R, L+1) -> the dual-stream batch with ``attention`` (1, 2L, 2L) bool and
        ``ratios`` (R, K)."""
        from unmask.masks_multitf import group_dual_stream_mask

        tokens = row_tokens(chunks, self.block_size, self.prompt_len)  # (R, L)
        R, L = tokens.shape
        K = L // self.block_size
        ratios = iid_ratios(R, K, self.t_low, self.t_high, generator, self.noise)  # (R, K)
        maskable = maskable_positions(L, self.prompt_len, tokens.device).expand(R, L)  # (R, L)
        noise_mask = mask_by_ratio(maskable, ratios, self.block_size, generator, self.rounding)  # (R, L)
        batch = dual_stream_inputs(tokens, noise_mask, self.mask_token_id)
        singletons = torch.arange(K, device=tokens.device)  # (K,) every block its own group
        batch["attention"] = group_dual_stream_mask(singletons, self.block_size)[None]  # (1, 2L, 2L)
        batch["ratios"] = ratios.to(tokens.device)
        return batch

    def loss(self, model, chunks: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        return masked_ce_loss(model, self.batch(chunks, generator), self.mask_token_id)
