"""Adapt a causal LM into a masked-diffusion LM, Dream-style (spec/diffusion.md §1–2).

:func:`train_diffusion` loads the causal weights unchanged, adds a mask token (Option A of
spec/sbd.md §2, unless the tokenizer has one), runs the model with **bidirectional** attention
and **keeps the one-position shift** (logit_shift = 1: the prediction for position i is read
from the logits at i − 1, so the AR head's alignment is reused), and trains it with the §1
objective through the generic loop. The published directory's ``unmask_config.json`` says
``kind: masked-diffusion``, so ``unmask.load(out)`` + ``decoder="diffusion"`` decodes it.

Training canvas (our choices):

- Every chunk starts with BOS (the tokenizer's BOS, else EOS), then ``seq_len`` tokens of the
  packed document stream (:func:`pack_bos_chunks`). Under the shift, position 0 must hold a
  real token; it is never masked and never scored.
- t ~ U[1e-3, 1) per sequence; each maskable token is masked with probability t; loss weight
  1/t; token normalisation (§1 library defaults).
- **Prompt conditioning**: with probability ``prefix_prob`` (default 0.5) a sequence keeps a
  clean prefix of c ~ U{1..seq_len} tokens (BOS included) that is never masked and carries no
  loss, as SFT prompts do (§1); only the suffix is noised. Decoding continues a clean prompt
  into a masked canvas, and half the sequences rehearse exactly that, at every prompt length;
  the other half are noised everywhere but BOS, the plain pre-training objective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.train.loop import TrainResult
from unmask.train.objectives import DIFFUSION_NORMS, diffusion_weighted_loss, masked_token_nll
from unmask.train.wiring import (holds_output_locks, load_chunks, run_info, run_paths, train_and_publish,
                                 train_config)

DLM_FORMAT_VERSION = 1
MIN_T = 1e-3  # t ~ U[MIN_T, 1): the 1/t weight stays finite (diffusion.md §1)


def pack_bos_chunks(docs: Sequence[Sequence[int]], seq_len: int, bos_id: int) -> torch.Tensor:
    """Cut the document stream into BOS-led chunks ``[BOS, x_1 .. x_seq_len]``.

    The stream is the documents joined with ``bos_id`` in front of each (as :func:`unmask.train.data.pack`
    does). A chunk takes the next ``seq_len`` stream tokens after a BOS of its own; when the
    stream itself is at a document start, that BOS is the chunk's (no doubled BOS). The
    trailing partial chunk is dropped.

    Returns:
        (N, seq_len + 1) long, column 0 all ``bos_id``; N >= 0.
    """
    if seq_len < 1:
        raise UnmaskError(f"--seq-len must be >= 1, got {seq_len}; pass --seq-len 1 or more")
    stream: list[int] = []
    for d in docs:
        if d:
            stream.extend(d if d[0] == bos_id else [bos_id, *d])
    rows, p = [], 0
    while True:
        if p < len(stream) and stream[p] == bos_id:
            p += 1  # the document's own BOS leads the chunk
        if p + seq_len > len(stream):
            break
        rows.append([bos_id] + stream[p:p + seq_len])
        p += seq_len
    if not rows:
        return torch.empty(0, seq_len + 1, dtype=torch.long)
    return torch.tensor(rows, dtype=torch.long)  # (N, seq_len + 1)


def diffusion_batch(chunks: torch.Tensor, mask_id: int, generator: torch.Generator, *, prefix_prob: float = 0.5,
                    min_t: float = MIN_T) -> dict:
    """Noise a batch of BOS-led chunks (diffusion.md §1 forward process, with prompt conditioning).

    Per row: t ~ U[min_t, 1); with probability ``prefix_prob`` a clean prefix length
    c ~ U{1..T−1}, else c = 1 (only BOS kept); positions >= c are maskable and each is masked
    with probability t.

    Args:
        chunks: (B, T) long, T >= 2, column 0 the BOS; any device.
        mask_id: the mask token id.
        generator: CPU generator (draws stay on CPU so a run is reproducible on any device).

    Returns:
        dict of tensors on ``chunks``' device: ``input_ids`` (B, T) the noisy canvas xt,
        ``masked`` / ``maskable`` (B, T) bool, ``t`` (B,) float32, ``prefix`` (B,) long (c).
    """
    if chunks.dim() != 2 or chunks.shape[1] < 2:
        raise UnmaskError(f"chunks must be (B, T) with T >= 2 (BOS + tokens), got {tuple(chunks.shape)}; "
                          "pack them with pack_bos_chunks")
    B, T = chunks.shape
    device = chunks.device
    t = min_t + (1 - min_t) * torch.rand(B, generator=generator)  # (B,) in [min_t, 1)
    conditioned = torch.rand(B, generator=generator) < prefix_prob  # (B,)
    c = torch.randint(1, T, (B,), generator=generator)  # (B,) in 1..T-1
    c = torch.where(conditioned, c, torch.ones_like(c))  # (B,)
    u = torch.rand(B, T, generator=generator)  # (B, T)
    maskable = torch.arange(T)[None, :] >= c[:, None]  # (B, T)
    masked = (u < t[:, None]) & maskable  # (B, T)
    masked, maskable = masked.to(device), maskable.to(device)
    return {"input_ids": torch.where(masked, torch.full_like(chunks, mask_id), chunks), "masked": masked,
            "maskable": maskable, "t": t.to(device), "prefix": c.to(device)}


@dataclass(frozen=True)
class MaskedDiffusionObjective:
    """The §1 objective for :func:`unmask.train.loop.train`, with a bidirectional forward.

    shift: True = Dream-style logit shift (canvas must start with a non-mask token, §2 item 4).
    prefix_prob: share of rows that keep a clean prefix (module docstring). norm: §1 option.
    Terms logged: ``nll`` (mean unweighted NLL of the masked tokens, nats) and ``masked`` (the
    masked share of maskable tokens).
    """

    mask_token_id: int
    shift: bool = True
    prefix_prob: float = 0.5
    norm: str = "token"
    min_t: float = MIN_T
    name: str = "masked-diffusion"
    term_names: tuple[str, ...] = ("nll", "masked")

    def __post_init__(self):
        if self.mask_token_id < 0:
            raise UnmaskError(f"mask_token_id must be >= 0, got {self.mask_token_id}; pass the model's mask token id")
        if not 0 <= self.prefix_prob <= 1:
            raise UnmaskError(f"--prefix-prob must be in [0, 1], got {self.prefix_prob}; pass a share between 0 and 1")
        if self.norm not in DIFFUSION_NORMS:
            raise UnmaskError(f"unknown loss normalisation --norm {self.norm!r}; choose one of: "
                              f"{', '.join(DIFFUSION_NORMS)}")
        if not 0 < self.min_t < 1:
            raise UnmaskError(f"min_t must be in (0, 1), got {self.min_t}; pass a small positive value, e.g. 1e-3")

    def step_params(self, generator: torch.Generator) -> dict:
        return {}

    def loss(self, model, chunks: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        """chunks (B, T) long (BOS-led) on the model's device -> (loss, terms)."""
        from unmask.compat import forward

        vocab = model.get_input_embeddings().weight.shape[0]
        if self.mask_token_id >= vocab:
            raise UnmaskError(f"mask_token_id {self.mask_token_id} is outside the model vocabulary of {vocab}; "
                              "pass a mask token id below the vocabulary size")
        batch = diffusion_batch(chunks, self.mask_token_id, generator, prefix_prob=self.prefix_prob,
                                min_t=self.min_t)
        B, T = chunks.shape
        pos = torch.arange(T, device=chunks.device).expand(B, T)  # (B, T) absolute, unchanged RoPE (§2 item 2)
        logits = forward(model, batch["input_ids"], position_ids=pos, is_causal=False)  # (B, T, V) float32
        masked = batch["masked"]
        nll = masked_token_nll(logits, chunks, masked, self.shift, self.mask_token_id)  # (B, T)
        loss = diffusion_weighted_loss(nll, batch["t"], batch["maskable"], self.norm)
        with torch.no_grad():
            n = masked.sum()
            terms = {"nll": nll.sum() / n.clamp(min=1), "masked": n / batch["maskable"].sum().clamp(min=1)}
        return loss, terms


def _load_base(base: str, dtype: str):
    """(bundle, mask id, vocab after the mask row). A causal base gets the tokenizer's mask token
    or a new row (Option A); a masked-diffusion base with shift 1 (or an SBD model) keeps its own."""
    from unmask.models import load
    from unmask.models.adapters import is_remote
    from unmask.models.mask_token import add_mask_token

    bundle = load(base, dtype=dtype)
    cls = type(bundle.model).__name__
    encoder_decoder = getattr(bundle.model.config, "is_encoder_decoder", False)
    if is_remote(bundle.model) or not cls.endswith("ForCausalLM") or encoder_decoder:
        raise UnmaskError(f"base {base!r} is a {cls}, not a transformers decoder-only LM; the AR-to-diffusion "
                          "adaptation starts from a causal LM, pass one with --base (Llama, Qwen2, Qwen3, ...)")
    if bundle.kind not in ("causal", "sbd", "masked-diffusion"):
        raise UnmaskError(f"base {base!r} is a {bundle.kind} model; pass a causal LM with --base "
                          "(or a masked-diffusion one to continue)")
    if bundle.kind == "masked-diffusion" and bundle.logit_shift != 1:
        raise UnmaskError(f"base {base!r} is a masked-diffusion model without the logit shift; this recipe keeps "
                          "the shift (logit_shift 1), so pass a shift-1 model or a causal LM with --base")
    if bundle.mask_token_id is not None:
        mask_id = int(bundle.mask_token_id)
    elif getattr(bundle.tokenizer, "mask_token_id", None) is not None:
        mask_id = int(bundle.tokenizer.mask_token_id)
    else:
        mask_id = add_mask_token(bundle.model)
    vocab = bundle.model.get_input_embeddings().weight.shape[0]
    if not 0 <= mask_id < vocab:
        raise UnmaskError(f"mask token {mask_id} is outside the model's embedding of {vocab} rows; fix mask_token_id "
                          "in the base's unmask_config.json")
    return bundle, mask_id, vocab


@holds_output_locks
def train_diffusion(*, base: str, data: str | Path | Sequence[str | Path], out: str | Path,
                    run_dir: str | Path | None = None, seq_len: int = 256, prefix_prob: float = 0.5,
                    norm: str = "token", val_fraction: float = 0.05, resume: bool = False, overwrite: bool = False,
                    device: str = "cpu", dtype: str = "float32", progress: bool = True, **config) -> TrainResult:
    """Adapt ``base`` into a masked-diffusion LM on ``data`` and publish it at ``out`` (diffusion.md §2).

    Args:
        base: shipped model name or local HF directory of a decoder-only causal LM (or a
            masked-diffusion model with logit shift 1 to continue).
        data: one or more ``.txt`` / ``.jsonl`` files (:func:`unmask.train.data.read_documents`).
        out: final model directory, written atomically when training ends (all steps done or
            ``max_minutes`` reached); not written when the run is interrupted.
        run_dir: checkpoints and ``log.jsonl``; default ``OUT.run``.
        seq_len: tokens per training sequence after its leading BOS (the canvas holds seq_len + 1).
        prefix_prob: share of sequences that keep a clean prefix (prompt conditioning).
        norm: loss normalisation, ``token`` / ``sequence`` / ``batch`` (§1).
        resume: continue from the newest checkpoint in ``run_dir`` (fresh start if none).
        overwrite: replace an existing ``out`` and discard ``run_dir``.
        progress: show a rich progress bar / progress lines.
        **config: :class:`~unmask.train.loop.TrainConfig` fields (lr, steps, batch_size, ...).

    Returns:
        TrainResult with ``out`` set (None when interrupted).

    Raises:
        UnmaskError: missing/empty data, ``out`` exists without overwrite/resume, a base that is
            not a causal LM, seq_len beyond the context, data too short for one chunk, bad options.
    """
    cfg = train_config(config)
    objective = MaskedDiffusionObjective(mask_token_id=0, prefix_prob=prefix_prob, norm=norm)  # validate early
    paths, out, run_dir = run_paths(data, out, run_dir, resume=resume, overwrite=overwrite, base=base)
    bundle, mask_id, vocab = _load_base(base, dtype)
    context = bundle.context_length
    if not 1 <= seq_len < context:
        raise UnmaskError(f"--seq-len {seq_len} must be between 1 and {context - 1} (a BOS + --seq-len tokens must "
                          f"fit the model's context of {context}); pass a --seq-len in that range")
    # (N, seq_len + 1), (M, seq_len + 1)
    train_chunks, val_chunks = load_chunks(paths, bundle.tokenizer, vocab, pack_bos_chunks, seq_len, need=seq_len,
                                           val_fraction=val_fraction, seed=cfg.seed, config=bundle.model.config)
    info = run_info(seq_len, paths, train_chunks, val_chunks, cfg,
                    objective=f"masked diffusion (diffusion.md §1): t ~ U[{MIN_T:g}, 1), 1/t weight, {norm} norm, "
                              f"shift 1, BOS-led chunks, clean prefix on {prefix_prob:.0%} of rows",
                    prefix_prob=prefix_prob, norm=norm)
    meta = {"kind": "masked-diffusion", "mask_token_id": mask_id, "logit_shift": 1, "attention": "bidirectional",
            "stop_token_ids": list(bundle.stop_token_ids), "version": DLM_FORMAT_VERSION, "base": base}
    objective = replace(objective, mask_token_id=mask_id)
    return train_and_publish(bundle, objective, train_chunks, val_chunks, cfg, run_dir, out, info=info, meta=meta,
                             device=device, resume=resume, progress=progress, overwrite=overwrite)
