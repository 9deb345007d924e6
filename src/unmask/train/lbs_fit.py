"""Fitting the LBS router on the frozen base model's responses (spec/early_bird.md §3.3–§3.4, Alg. 3):
the block-wise masks of reading #1, the router's inputs from one frozen forward, Eq. 3's loss or its
BCE form, and the training loop. :mod:`unmask.train.routers` wires it into ``unmask train lbs``
(its docstring says why both losses exist).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from unmask.decode.engine.batching import left_pad
from unmask.errors import UnmaskError
from unmask.models.adapters import bidirectional_forward, realign
from unmask.policies import token_stats
from unmask.routers.lbs import LBSConfig, LBSRouter
from unmask.train.progress import Progress, say


def blockwise_mask(n_rows: int, L: int, block: int, generator: torch.Generator) -> torch.Tensor:
    """Blockwise-Masking (§3.4, reading #1): (n_rows, L) bool. Per row n ~ U{0..L/block−1},
    r ~ U(0, 1]; blocks < n clean, block n masked i.i.d. with probability r (at least one), blocks
    > n fully masked."""
    if L % block:
        raise UnmaskError(f"LBS training needs a gen length divisible by the block size ({L} % {block} != 0); "
                          "pass a --gen-length that is a multiple of --block-size")
    n = torch.randint(0, L // block, (n_rows,), generator=generator)  # (R,)
    r = 1.0 - torch.rand(n_rows, generator=generator)  # (R,) in (0, 1]
    cols = torch.arange(L)  # (L,)
    blk = cols[None, :] // block  # (1, L)
    inside = blk == n[:, None]  # (R, L)
    draw = torch.rand(n_rows, L, generator=generator) < r[:, None]  # (R, L)
    forced = n[:, None] * block + torch.randint(0, block, (n_rows, 1), generator=generator)  # (R, 1)
    return (blk > n[:, None]) | (inside & (draw | (cols[None, :] == forced)))  # (R, L)


@torch.no_grad()
def lbs_inputs(bundle, prompts: list[list[int]], responses: torch.Tensor, masked: torch.Tensor):
    """One frozen forward on [prompt | response with ``masked`` positions masked].

    responses: (B, L) long; masked: (B, L) bool. Returns (norm_entropy (B, L), token_emb
    (B, L, d_base), ce (B, L)) without gradients: H / log|V| and W_e(x̂) (the router's inputs) and
    the cross-entropy of the response token, all from the mask-suppressed distribution.
    """
    device = bundle.device
    B, L = responses.shape
    ids_p, valid_p, pos_p = left_pad(prompts, bundle.pad_token_id, device)  # (B, P) each
    P = ids_p.shape[1]
    canvas = torch.where(masked, bundle.mask_token_id, responses).to(device)  # (B, L)
    ids = torch.cat([ids_p, canvas], dim=1)  # (B, T)
    pos = torch.cat([pos_p, valid_p.sum(dim=1, keepdim=True) + torch.arange(L, device=device)], dim=1)  # (B, T)
    valid = torch.cat([valid_p, torch.ones(B, L, dtype=torch.bool, device=device)], dim=1)  # (B, T)
    shift = bundle.logit_shift
    raw = bidirectional_forward(bundle, ids, position_ids=pos, key_valid=valid, rows=(P - shift, P + L))
    logits = realign(raw, shift)[:, shift:].clone()  # (B, L, V)
    logits[..., list(bundle.suppress_ids)] = float("-inf")
    st = token_stats(logits)
    ce = F.cross_entropy(logits.transpose(1, 2), responses.to(device), reduction="none")  # (B, L)
    emb = bundle.model.get_input_embeddings()(st.top1)  # (B, L, d_base)
    return st.entropy / math.log(logits.shape[-1]), emb.float(), ce


def lbs_loss(logits: torch.Tensor, ce: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Eq. 3 per sample, averaged over the batch: (1/|M|) Σ_M σ(O)·CE − (1/|M|) Σ_M σ(O).

    logits: (B, L) router logits; ce: (B, L) detached CE; masked: (B, L) bool, M. Negative once
    the router includes well-predicted positions."""
    sig = torch.sigmoid(logits) * masked  # (B, L); -inf logits outside M give exactly 0
    n = masked.sum(dim=1).clamp(min=1)  # (B,)
    per_row = (sig * torch.where(masked, ce, 0.0)).sum(dim=1) / n - sig.sum(dim=1) / n  # (B,)
    return per_row.mean()


LBS_LOSSES = ("eq3", "bce")


def lbs_bce_loss(logits: torch.Tensor, ce: torch.Tensor, masked: torch.Tensor, margin: float = 1.0,
                 pos_weight: float = 1.0) -> torch.Tensor:
    """BCE of σ(O) against y = 1[CE < margin] over M, per sample mean, then batch mean.

    Eq. 3's per-position term σ·(CE − 1) is minimised by σ = y with margin 1, so this trains the
    same router decision as a classifier: p_φ > 0.5 ⇔ P(CE < 1) > 1 / (1 + pos_weight)
    (``pos_weight`` > 1 calibrates the decoder's fixed 0.5 cut to a lower probability).
    logits, ce: (B, L) float; masked: (B, L) bool. Scalar.
    """
    y = (ce < margin).float()  # (B, L)
    z = logits.masked_fill(~masked, 0.0)  # (B, L): -inf outside M would give NaN
    w = torch.tensor(float(pos_weight), device=z.device)
    bce = F.binary_cross_entropy_with_logits(z, y, reduction="none", pos_weight=w) * masked  # (B, L)
    n = masked.sum(dim=1).clamp(min=1)  # (B,)
    return (bce.sum(dim=1) / n).mean()


def _lbs_objective(config: "LBSTrainConfig"):
    if config.loss == "eq3":
        return lbs_loss
    return lambda logits, ce, masked: lbs_bce_loss(logits, ce, masked, pos_weight=config.pos_weight)


@dataclass(frozen=True)
class LBSTrainConfig:
    """LBS optimisation (§3.4; paper: lr 5e-5, 6 epochs on 92k prompts; batch 32, wd 0.01 and
    cosine without warm-up are our choices). block: L_B of Blockwise-Masking. val_fraction of
    the samples is held out for a validation loss. max_minutes bounds the loop. loss: ``eq3``
    (the paper's Eq. 3) or ``bce`` (:func:`lbs_bce_loss`, module docstring), with ``pos_weight``
    on its positives."""

    block: int = 32
    epochs: int = 6
    batch_size: int = 32
    lr: float = 5e-5
    weight_decay: float = 0.01
    val_fraction: float = 0.05
    seed: int = 0
    max_minutes: float | None = None
    loss: str = "eq3"
    pos_weight: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.pos_weight, (int, float)) and math.isfinite(self.pos_weight) and self.pos_weight > 0):
            raise UnmaskError(f"--pos-weight must be a finite number > 0, got {self.pos_weight!r}; pass e.g. 1 or 3")
        if self.loss not in LBS_LOSSES:
            raise UnmaskError(f"--loss must be one of {', '.join(LBS_LOSSES)}, got {self.loss!r}; pass --loss eq3 "
                              "(the paper) or --loss bce")
        for flag, value in (("--block-size", self.block), ("--epochs", self.epochs), ("--batch-size", self.batch_size)):
            if value < 1:
                raise UnmaskError(f"{flag} must be >= 1, got {value}; pass {flag} 1 or more")
        if not self.lr > 0:
            raise UnmaskError(f"--lr must be > 0, got {self.lr}; pass a positive learning rate, e.g. --lr 5e-5")
        if not 0 <= self.val_fraction < 1:
            raise UnmaskError(f"val_fraction must be in [0, 1), got {self.val_fraction}; pass a share below 1, "
                              "e.g. 0.05")


def train_lbs(bundle, prompts: list[list[int]], responses: list[list[int]], config: LBSTrainConfig = LBSTrainConfig(),
              router_config: LBSConfig | None = None, progress: Progress = None) -> tuple[LBSRouter, dict]:
    """Train R_φ on (prompt, response) pairs of the frozen ``bundle`` (Alg. 3).

    responses: L ids each (:func:`generate_responses`). router_config defaults to LBSConfig at
    this L and the base model's vocabulary / embedding width. Returns (router in eval mode,
    report {epochs, steps, train_loss, val_loss, seconds, stopped}).
    """
    from unmask.train.loop import TrainConfig, build_optimizer

    if len(prompts) != len(responses) or not prompts:
        raise UnmaskError(f"LBS training needs one response per prompt ({len(prompts)} prompts, {len(responses)} "
                          "responses); pass at least one prompt and one response for each")
    L = len(responses[0])
    if any(len(r) != L for r in responses):
        raise UnmaskError("the LBS responses differ in length; pad every response to the same length L with EOS "
                          "(pad_response)")
    emb = bundle.model.get_input_embeddings().weight
    rc = router_config or LBSConfig(gen_length=L, d_base=int(emb.shape[1]), vocab_size=int(emb.shape[0]))
    if rc.gen_length != L or rc.vocab_size != emb.shape[0] or rc.d_base != emb.shape[1]:
        raise UnmaskError(f"LBS config (L {rc.gen_length}, vocab {rc.vocab_size}, d_base {rc.d_base}) does not match "
                          f"the data (L {L}) and the model (vocab {emb.shape[0]}, d_base {emb.shape[1]}); build "
                          "it from this model and gen length")
    torch.manual_seed(config.seed)
    router = LBSRouter(rc).to(bundle.device)
    resp = torch.tensor(responses, dtype=torch.long)  # (N, L)
    order = list(range(len(prompts)))
    random.Random(config.seed).shuffle(order)
    n_val = int(round(len(order) * config.val_fraction)) if len(order) > 1 else 0
    val_ids, train_ids = order[:n_val], order[n_val:]
    per_epoch = math.ceil(len(train_ids) / config.batch_size)
    opt, sched = build_optimizer(router, TrainConfig(lr=config.lr, warmup=0, steps=config.epochs * per_epoch,
                                                     weight_decay=config.weight_decay, min_lr_ratio=0.0))
    gen = torch.Generator().manual_seed(config.seed + 1)
    t0, epoch_s, step, stopped = time.monotonic(), 0.0, 0, "done"
    report: dict = {"train_loss": [], "val_loss": []}
    for epoch in range(config.epochs):
        if config.max_minutes is not None and time.monotonic() - t0 + epoch_s > 60 * config.max_minutes:
            stopped = "time"
            break
        te = time.monotonic()
        router.train()
        perm = torch.randperm(len(train_ids), generator=gen).tolist()
        total = 0.0
        for s in range(0, len(perm), config.batch_size):
            rows = [train_ids[i] for i in perm[s: s + config.batch_size]]
            masked = blockwise_mask(len(rows), L, config.block, gen)  # (b, L), resampled every epoch
            h, e, ce = lbs_inputs(bundle, [prompts[i] for i in rows], resp[rows], masked)
            m = masked.to(bundle.device)
            loss = _lbs_objective(config)(router(h, e, m), ce, m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            total += loss.item() * len(rows)
        report["train_loss"].append(total / max(1, len(train_ids)))
        if val_ids:
            report["val_loss"].append(_lbs_val_loss(bundle, router, prompts, resp, val_ids, config))
        epoch_s = time.monotonic() - te
        val = f", val {report['val_loss'][-1]:.4f}" if val_ids else ""
        say(progress, f"LBS epoch {epoch + 1}/{config.epochs}: train {report['train_loss'][-1]:.4f}{val} "
                       f"({epoch_s:.0f} s)")
    report.update(epochs=len(report["train_loss"]), steps=step, seconds=time.monotonic() - t0, stopped=stopped,
                  samples=len(train_ids), val_samples=len(val_ids), config=asdict(config))
    return router.eval(), report


@torch.no_grad()
def _lbs_val_loss(bundle, router, prompts, resp, val_ids, config) -> float:
    """Validation loss with a fixed masking draw, so epochs are comparable."""
    g = torch.Generator().manual_seed(config.seed + 7919)
    router.eval()
    total = 0.0
    for s in range(0, len(val_ids), config.batch_size):
        rows = val_ids[s: s + config.batch_size]
        masked = blockwise_mask(len(rows), resp.shape[1], config.block, g)
        h, e, ce = lbs_inputs(bundle, [prompts[i] for i in rows], resp[rows], masked)
        m = masked.to(bundle.device)
        total += float(_lbs_objective(config)(router(h, e, m), ce, m)) * len(rows)
    return total / len(val_ids)
