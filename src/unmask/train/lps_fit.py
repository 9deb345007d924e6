"""LPS training data and fitting for Early-Bird (spec/early_bird.md §4.3–§4.4, Alg. 4): step-record
traces from the serving configuration, labels y = 1[x̂_t = x_0], the oracle replay rule, the
trace-level split, weighted BCE and the choice of τ_ψ. :mod:`unmask.train.routers` wires it into
``unmask train lps``; see its docstring for the recipe."""

from __future__ import annotations

import math
import os
import random
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from unmask.decode.engine.batching import left_pad
from unmask.decode.dllm.eb_select import lps_features
from unmask.errors import UnmaskError
from unmask.models.adapters import bidirectional_forward, realign
from unmask.policies import token_stats
from unmask.routers.lbs import LBSRouter
from unmask.routers.lps import LPSConfig, LPSRouter

Progress = Callable[[str], None] | None


def _say(progress: Progress, message: str) -> None:
    if progress is not None:
        progress(message)

# ---------------------------------------------------------------------------------------------
# LPS traces
# ---------------------------------------------------------------------------------------------


@dataclass
class LPSTraces:
    """Step records of LPS traces, stored flat.

    features: (n_pos, 5) float32 (FEATURE_NAMES order); labels: (n_pos,) bool, y = 1[x̂_t = x_0];
    offsets: (n_rec + 1,) long, record k's positions are [offsets[k], offsets[k+1]); trace and
    step: (n_rec,) long. meta: the decode settings the traces were collected under.
    """

    features: torch.Tensor
    labels: torch.Tensor
    offsets: torch.Tensor
    trace: torch.Tensor
    step: torch.Tensor
    meta: dict = field(default_factory=dict)

    @property
    def n_records(self) -> int:
        return len(self.trace)

    @property
    def n_traces(self) -> int:
        return int(self.trace.max()) + 1 if len(self.trace) else 0

    def records_of(self, traces: Sequence[int]) -> torch.Tensor:
        """(k,) long: indices of the records that belong to ``traces``."""
        return torch.nonzero(torch.isin(self.trace, torch.as_tensor(list(traces), dtype=torch.long))).flatten()

    def batch(self, records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded batch of records (k,) -> (x (k, N, 5), y (k, N) bool, valid (k, N) bool)."""
        start, length = self.offsets[records], self.offsets[records + 1] - self.offsets[records]  # (k,) each
        N = max(1, int(length.max())) if len(records) else 1
        cols = torch.arange(N)  # (N,)
        valid = cols[None, :] < length[:, None]  # (k, N)
        index = torch.where(valid, start[:, None] + cols[None, :], 0)  # (k, N)
        return self.features[index], self.labels[index] & valid, valid

    def save(self, path) -> None:
        """torch.save through a temporary file and a rename."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            torch.save({k: getattr(self, k) for k in ("features", "labels", "offsets", "trace", "step", "meta")}, tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path) -> "LPSTraces":
        """Read a file written by :meth:`save`. Raises UnmaskError for anything else (garbage,
        truncated, another pickle)."""
        from unmask.errors import UnmaskError

        try:
            with warnings.catch_warnings():  # garbage makes torch warn about the "pickle protocol" first
                warnings.simplefilter("ignore")
                fields = torch.load(path, map_location="cpu", weights_only=True)
            traces = cls(**fields)
            if not all(isinstance(getattr(traces, k), torch.Tensor) for k in ("features", "labels", "offsets", "trace")):
                raise ValueError("its fields are not tensors")
            return traces
        except Exception as e:  # torch's unpickler raises anything on garbage (IndexError, EOFError, ...)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
            raise UnmaskError(f"--traces-file {path} is not an LPS traces file ({first}); delete it to collect the "
                              "traces again, or pass another --traces-file") from None

    @classmethod
    def concat(cls, parts: Sequence["LPSTraces"], batch_size: int) -> "LPSTraces":
        """Traces collected batch by batch (part b from prompts ``b·batch_size ...``, trace ids
        counted from 0 within it) as one set with prompt-level trace ids."""
        if len(parts) == 1:
            return parts[0]
        lengths = torch.cat([p.offsets[1:] - p.offsets[:-1] for p in parts])  # (n_rec,)
        meta = {**parts[0].meta, "traces": sum(int(p.meta.get("traces", 0)) for p in parts)}
        return cls(torch.cat([p.features for p in parts]), torch.cat([p.labels for p in parts]),
                   torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                   torch.cat([p.trace + b * batch_size for b, p in enumerate(parts)]),
                   torch.cat([p.step for p in parts]), meta)

    @classmethod
    def from_steps(cls, steps: list[tuple[int, int, torch.Tensor, torch.Tensor]], meta: dict) -> "LPSTraces":
        """steps: (trace, t, features (n, 5), labels (n,) bool) per record."""
        feats = torch.cat([s[2] for s in steps]) if steps else torch.zeros(0, 5)
        labels = torch.cat([s[3] for s in steps]) if steps else torch.zeros(0, dtype=torch.bool)
        lengths = torch.tensor([len(s[3]) for s in steps], dtype=torch.long)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        return cls(feats.float(), labels.bool(), offsets, torch.tensor([s[0] for s in steps], dtype=torch.long),
                   torch.tensor([s[1] for s in steps], dtype=torch.long), meta)


def label_records(top1: Sequence[torch.Tensor], positions: Sequence[torch.Tensor], x0: torch.Tensor) -> list[torch.Tensor]:
    """y_t^i = 1[x̂_t^i = x_0^i] (§4.3) for each record's top-1 tokens (n_t,) at ``positions`` (n_t,)
    of the final canvas x0 (L,) (a still-masked final position never matches)."""
    return [t == x0[p] for t, p in zip(top1, positions)]


def collect_lps_traces(bundle, lbs: LBSRouter, prompts: list[list[int]], *, block_size: int = 32, tau: float = 0.9,
                       l_min: int = 8, g_max: int = 5, pos_mode: str = "literal", cache: str = "none",
                       batch_size: int = 16, replay: bool = False, max_minutes: float | None = None,
                       progress: Progress = None) -> LPSTraces:
    """Generate-then-label LPS traces (§4.3) under the serving configuration (LBS + threshold,
    no LPS). One trace per prompt; ``replay=True`` recomputes the features by re-running the
    model on the recorded schedule with the oracle rule (:func:`replay_traces`). With
    ``max_minutes`` collection stops before a batch that would not fit (judged by the previous one)."""
    from unmask.decode import DECODERS

    stops = tuple(bundle.stop_token_ids)
    settings = dict(block_size=block_size, tau=tau, l_min=l_min, g_max=g_max, pos_mode=pos_mode, cache=cache)
    L = lbs.config.gen_length
    steps: list = []
    t0 = time.monotonic()
    last = 0.0  # seconds of the previous batch
    for s in range(0, len(prompts), batch_size):
        if max_minutes is not None and time.monotonic() - t0 + last > 60 * max_minutes:
            break
        tb = time.monotonic()
        batch = prompts[s: s + batch_size]
        recs: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        schedule: list[list] = [[] for _ in batch]
        x0 = torch.full((len(batch), L), bundle.mask_token_id, dtype=torch.long)  # (b, L) final canvases

        def hook(state):
            # state row r is a running-batch slot: prompt ids[r] (the batch shrinks as rows finish)
            ids, cand, canvas = state["ids"], state["cand"], state["canvas"].cpu()  # (n,), (n, L) each
            for r in torch.nonzero(cand.any(dim=1)).flatten().tolist():
                i, where = ids[r], torch.nonzero(cand[r]).flatten()
                recs.append((i, len(schedule[i]), state["features"][r, where].float().cpu(),
                             state["top1"][r, where].cpu(), where.cpu()))
                schedule[i].append((torch.nonzero(state["block"][r]).flatten().cpu(),
                                    torch.nonzero(state["chosen"][r]).flatten().cpu()))
            for r, i in enumerate(ids):
                if i >= 0:  # a running row: its canvas after the step it finishes on is x_0
                    x0[i] = canvas[r]

        DECODERS["early-bird"].decode(bundle, batch, max_new_tokens=L, gen_length=L, stop_token_ids=stops, lps=False,
                          lbs_router=lbs, on_forward=hook, **settings)
        if replay:
            steps += [(s + r, t, f, y) for r, t, f, y in
                      replay_traces(bundle, batch, schedule, x0, pos_mode=pos_mode)]
        else:
            for r, t, f, top1, where in recs:
                steps.append((s + r, t, f, label_records([top1], [where], x0[r])[0]))
        last = time.monotonic() - tb
        _say(progress, f"LPS traces {min(s + batch_size, len(prompts))}/{len(prompts)}, {len(steps)} step records "
                       f"({time.monotonic() - t0:.0f} s)")
    meta = {**settings, "gen_length": L, "replay": replay, "traces": len({st[0] for st in steps}), "model": bundle.name}
    return LPSTraces.from_steps(steps, meta)


@torch.inference_mode()
def replay_traces(bundle, prompts: list[list[int]], schedule: list[list], x0: torch.Tensor, *,
                  pos_mode: str = "literal") -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Oracle replay (§4.3, reading #7) of recorded trajectories, batched.

    schedule[r][t] = (B_t positions, A_t positions) of row r; x0: (b, L) final canvases. At every
    step each row runs one no-cache forward, records the features of B_t ∩ M_t and y = 1[x̂ = x_0],
    then writes x_0's tokens at A_t. Returns (row, t, features (n, 5), labels (n,)) per record.
    """
    device, mask_id, shift = bundle.device, bundle.mask_token_id, bundle.logit_shift
    B, L = x0.shape
    ids_p, valid_p, pos_p = left_pad(prompts, bundle.pad_token_id, device)  # (B, P) each
    P = ids_p.shape[1]
    ids = torch.cat([ids_p, torch.full((B, L), mask_id, dtype=torch.long, device=device)], dim=1)  # (B, T)
    pos = torch.cat([pos_p, valid_p.sum(dim=1, keepdim=True) + torch.arange(L, device=device)], dim=1)  # (B, T)
    valid = torch.cat([valid_p, torch.ones(B, L, dtype=torch.bool, device=device)], dim=1)  # (B, T)
    x0 = x0.to(device)
    out = []
    for t in range(max(len(s) for s in schedule)):
        raw = bidirectional_forward(bundle, ids, position_ids=pos, key_valid=valid, rows=(P - shift, P + L))
        logits = realign(raw, shift)[:, shift:].clone()  # (B, L, V)
        logits[..., list(bundle.suppress_ids)] = float("-inf")
        st = token_stats(logits)
        masked = ids[:, P:] == mask_id  # (B, L)
        block = torch.zeros(B, L, dtype=torch.bool, device=device)
        commit = torch.zeros(B, L, dtype=torch.bool, device=device)
        rows = [r for r in range(B) if t < len(schedule[r])]
        for r in rows:
            block[r, schedule[r][t][0].to(device)] = True
            commit[r, schedule[r][t][1].to(device)] = True
        feats = lps_features(st.confidence, st.entropy / math.log(logits.shape[-1]), st.margin, block, masked,
                             pos_mode)  # (B, L, 5)
        for r in rows:
            where = torch.nonzero(block[r] & masked[r]).flatten()
            out.append((r, t, feats[r, where].float().cpu(), (st.top1[r, where] == x0[r, where]).cpu()))
        ids[:, P:] = torch.where(commit, x0, ids[:, P:])  # oracle: recorded schedule, x_0's tokens
    return out


# ---------------------------------------------------------------------------------------------
# LPS training
# ---------------------------------------------------------------------------------------------


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
        _say(progress, f"LPS epoch {epoch + 1}: loss {loss.item():.4f}, val recall {sel['recall']:.3f} at FPR "
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
