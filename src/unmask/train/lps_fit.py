"""Fitting the LPS router for Early-Bird (spec/early_bird.md §4.4, Alg. 4) on the traces of
:mod:`unmask.train.lps_traces`: the trace-level split, weighted BCE and the choice of τ_ψ.
:mod:`unmask.train.routers` wires it into ``unmask train lps``; see its docstring for the recipe."""

from __future__ import annotations

import math
import random
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from unmask.errors import UnmaskError
from unmask.routers.lps import LPSConfig, LPSRouter
from unmask.train.lps_traces import LPSTraces
from unmask.train.progress import Progress, say



def split_traces(n_traces: int, seed: int = 42, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
                 ) -> tuple[list[int], list[int], list[int]]:
    """Deterministic trace-level train/val/test split (§4.4): a ``random.Random(seed)`` shuffle
    cut at the fractions (val and test get at least one trace each when n_traces >= 3)."""
    order = list(range(n_traces))
    random.Random(seed).shuffle(order)
    n_val = int(n_traces * fractions[1])
    n_test = int(n_traces * fractions[2])
    if n_traces >= 3:
        n_val, n_test = max(1, n_val), max(1, n_test)
    n_train = n_traces - n_val - n_test
    return sorted(order[:n_train]), sorted(order[n_train:n_train + n_val]), sorted(order[n_train + n_val:])


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, w_neg: float = 2.0) -> torch.Tensor:
    """Eq. 4: BCE with weight 1 on y = 1 and ``w_neg`` on y = 0, averaged over the valid positions.
    logits, labels, valid: (k, N); padding (valid False, logit -inf) contributes nothing."""
    y = labels.float()
    safe = torch.where(valid, logits, torch.zeros_like(logits))  # (k, N): no -inf into the loss
    bce = F.binary_cross_entropy_with_logits(safe, y, reduction="none")  # (k, N)
    w = torch.where(labels, 1.0, w_neg) * valid  # (k, N)
    return (w * bce).sum() / valid.sum().clamp(min=1)


TAU_GRID = (0.8, 0.9999, 250)  # linspace(0.8, 0.9999, 250), reading #10


def rates(probs: torch.Tensor, labels: torch.Tensor, taus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Recall TP/(TP+FN) over positives and FPR FP/(FP+TN) over negatives of the rule p > τ, for
    every τ in ``taus`` (G,). probs, labels: (n,). Returns (recall (G,), fpr (G,)) float64."""
    pos = probs[labels].double().sort().values
    neg = probs[~labels].double().sort().values
    t = taus.double()
    above_pos = len(pos) - torch.searchsorted(pos, t, right=True)  # (G,) positives with p > τ
    above_neg = len(neg) - torch.searchsorted(neg, t, right=True)  # (G,)
    return above_pos / max(1, len(pos)), above_neg / max(1, len(neg))


def select_tau_psi(probs: torch.Tensor, labels: torch.Tensor, fpr_budget: float = 0.01,
                   grid: torch.Tensor | None = None) -> dict:
    """τ_ψ = the grid value with the largest recall subject to FPR ≤ ``fpr_budget`` (§4.4); ties
    go to the lower FPR, then the larger τ. With no feasible value the largest grid τ is returned
    with ``feasible`` False. Returns {tau_psi, recall, fpr, feasible, in_band} where in_band says
    whether the achieved FPR lies within budget ± 0.5 points (the paper's report)."""
    grid = torch.linspace(*TAU_GRID[:2], TAU_GRID[2], dtype=torch.float64) if grid is None else grid.double()
    recall, fpr = rates(probs, labels, grid)
    ok = fpr <= fpr_budget + 1e-12  # (G,)
    if not bool(ok.any()):
        k = len(grid) - 1
    else:
        # lexicographic: recall desc, fpr asc, tau desc
        best = max((float(recall[i]), -float(fpr[i]), float(grid[i]), i) for i in torch.nonzero(ok).flatten().tolist())
        k = best[3]
    f = float(fpr[k])
    return {"tau_psi": float(grid[k]), "recall": float(recall[k]), "fpr": f, "feasible": bool(ok.any()),
            "in_band": abs(f - fpr_budget) <= 0.005}


@dataclass(frozen=True)
class LPSTrainConfig:
    """LPS optimisation (App. D.3): AdamW lr 1e-3, wd 0.01, clip 1.0, warm-up over the first
    ``warmup_frac`` of max_epochs × steps per epoch, then ×``decay`` per epoch; batches of 512 step
    records; up to 2000 epochs, patience 100 on validation recall at FPR ≤ ``fpr_budget``; w⁻ = 2;
    split seed 42. amp: bfloat16 autocast on CUDA only. max_minutes bounds the loop."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    clip: float = 1.0
    batch_size: int = 512
    max_epochs: int = 2000
    patience: int = 100
    warmup_frac: float = 0.005
    decay: float = 0.97
    w_neg: float = 2.0
    fpr_budget: float = 0.01
    seed: int = 42
    amp: bool = True
    max_minutes: float | None = None

    def __post_init__(self):
        if not self.lr > 0:
            raise UnmaskError(f"--lr must be > 0, got {self.lr}; pass a positive learning rate, e.g. --lr 1e-3")
        for flag, value in (("--batch-size", self.batch_size), ("--max-epochs", self.max_epochs),
                            ("--patience", self.patience)):
            if value < 1:
                raise UnmaskError(f"{flag} must be >= 1, got {value}; pass {flag} 1 or more")
        if not 0 < self.fpr_budget < 1:
            raise UnmaskError(f"--fpr must be in (0, 1), got {self.fpr_budget}; pass e.g. --fpr 0.01")
        if self.w_neg <= 0:
            raise UnmaskError(f"w_neg must be > 0, got {self.w_neg}; pass a positive weight, e.g. 2.0")


@torch.no_grad()
def predict(router: LPSRouter, traces: LPSTraces, records: torch.Tensor, *, chunk: int = 4096, device="cpu"):
    """p_ψ and labels of every position of ``records``: (probs (n,), labels (n,) bool)."""
    router.eval()
    probs, labels = [], []
    for s in range(0, len(records), chunk):
        x, y, ok = traces.batch(records[s: s + chunk])
        p = torch.sigmoid(router(x.to(device), ok.to(device))).cpu()  # (k, N)
        probs.append(p[ok])
        labels.append(y[ok])
    if not probs:
        return torch.zeros(0), torch.zeros(0, dtype=torch.bool)
    return torch.cat(probs), torch.cat(labels)


def train_lps(traces: LPSTraces, config: LPSTrainConfig = LPSTrainConfig(), router_config: LPSConfig = LPSConfig(),
              *, device="cpu", progress: Progress = None) -> tuple[LPSRouter, float, dict]:
    """Train R_ψ on step records (Alg. 4 stage 2). Returns (best router in eval mode, τ_ψ, report
    with the split sizes, per-epoch validation recall/FPR, the best epoch, and recall / FPR on the
    test split at τ_ψ). Warns when the validation FPR at τ_ψ is outside budget ± 0.5 points.
    Raises UnmaskError with fewer than 3 traces or without positives and negatives."""
    if traces.n_traces < 3:
        raise UnmaskError(f"LPS training needs at least 3 traces for the 80/10/10 split (got {traces.n_traces}); "
                          "pass --prompts 3 or more")
    if traces.labels.all() or not traces.labels.any():
        raise UnmaskError("the LPS traces hold only one label class; collect more traces (raise --prompts)")
    tr, va, te = (traces.records_of(ids) for ids in split_traces(traces.n_traces, config.seed))
    torch.manual_seed(config.seed)
    router = LPSRouter(router_config).to(device)
    per_epoch = max(1, math.ceil(len(tr) / config.batch_size))
    warm = max(1, round(config.warmup_frac * config.max_epochs * per_epoch))
    opt = torch.optim.AdamW(router.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    epoch_of = {"e": 0}
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * config.decay ** epoch_of["e"])
    amp = config.amp and torch.device(device).type == "cuda"
    gen = torch.Generator().manual_seed(config.seed)
    best = {"recall": -1.0}
    history, waited, stopped = [], 0, "done"
    t0, epoch_s = time.monotonic(), 0.0
    for epoch in range(config.max_epochs):
        if config.max_minutes is not None and time.monotonic() - t0 + epoch_s > 60 * config.max_minutes:
            stopped = "time"
            break
        te0 = time.monotonic()
        epoch_of["e"] = epoch
        router.train()
        perm = tr[torch.randperm(len(tr), generator=gen)]
        for s in range(0, len(perm), config.batch_size):
            x, y, ok = traces.batch(perm[s: s + config.batch_size])
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                logits = router(x.to(device), ok.to(device))
            loss = weighted_bce(logits.float(), y.to(device), ok.to(device), config.w_neg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(router.parameters(), config.clip)
            opt.step()
            sched.step()
        probs, labels = predict(router, traces, va, device=device)
        sel = select_tau_psi(probs, labels, config.fpr_budget)
        history.append({"epoch": epoch + 1, "loss": loss.item(), **sel})
        if sel["recall"] > best["recall"]:
            best = {**sel, "epoch": epoch + 1, "state": {k: v.detach().clone() for k, v in router.state_dict().items()}}
            waited = 0
        else:
            waited += 1
        epoch_s = time.monotonic() - te0
        say(progress, f"LPS epoch {epoch + 1}: loss {loss.item():.4f}, val recall {sel['recall']:.3f} at FPR "
                       f"{sel['fpr']:.4f} (τψ {sel['tau_psi']:.4f}); best {best['recall']:.3f} @ {best['epoch']}")
        if waited >= config.patience:
            stopped = "early-stop"
            break
    router.load_state_dict(best.pop("state"))
    router.eval()
    tau_psi = best["tau_psi"]
    probs, labels = predict(router, traces, te, device=device)
    recall, fpr = rates(probs, labels, torch.tensor([tau_psi]))
    if not best["in_band"]:
        warnings.warn(f"LPS validation FPR at τψ={tau_psi:.4f} is {best['fpr']:.2%}, outside "
                      f"{config.fpr_budget:.1%} ± 0.5 points (the paper's range); more traces give a finer curve",
                      stacklevel=2)
    report = {"split": {"train": len(tr), "val": len(va), "test": len(te)}, "best_epoch": best["epoch"],
              "epochs": len(history), "stopped": stopped, "seconds": time.monotonic() - t0,
              "val": {k: best[k] for k in ("recall", "fpr", "feasible", "in_band")},
              "test": {"recall": float(recall[0]), "fpr": float(fpr[0]), "positives": int(labels.sum()),
                       "negatives": int((~labels).sum())},
              "history": history, "config": asdict(config)}
    return router, tau_psi, report
