"""Training the Early-Bird routers (spec/early_bird.md §3.3–§3.4 LBS, §4.3–§4.4 LPS).

**LBS** (Alg. 3). Responses are the frozen base model's own outputs for the training prompts
(our choice; ``response_policy`` "top-k" = vanilla 1 token/step, or "threshold" = Fast-dLLM τ,
cheaper on CPU), padded to L with the stop id the model ended on. Every epoch each sample draws
a block index n ~ U{0..L/L_B−1} and a ratio r ~ U(0, 1] (:func:`blockwise_mask`, reading #1),
one frozen forward gives H̃, x̂ and the per-position cross-entropy against the response, and
R_φ takes a step on Eq. 3: mean_M(σ·CE) − mean_M(σ) (:func:`lbs_loss`).

**LPS** (Alg. 4). Traces come from the exact serving configuration: Early-Bird decoding with the
trained LBS and the threshold rule (no LPS), L, L_B, τ, L_min, g_max as served. A step record is
the features of B_t ∩ M_t and the labels y = 1[x̂_t = x_0], x_0 being the trace's final canvas.
By default features are recorded during generation and labelled once x_0 is known; ``replay``
re-runs the model on the recorded schedule and writes x_0's tokens at the recorded commits (the
oracle rule, reading #7). Training: trace-level 80/10/10 split (seed 42), weighted BCE (w⁻ = 2),
AdamW + 0.5 % warm-up + ×0.97 per epoch, batches of 512 step records, after every epoch τ_ψ =
the grid value with the largest validation recall at FPR ≤ 1 % (:func:`select_tau_psi`), early
stopping on that recall (patience 100), and recall / FPR on the test split at the chosen τ_ψ.
"""

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

from unmask.decode.batching import left_pad
from unmask.decode.eb_select import lps_features
from unmask.errors import UnmaskError
from unmask.models.adapters import bidirectional_forward, realign
from unmask.policies import token_stats
from unmask.routers.lbs import LBSConfig, LBSRouter
from unmask.routers.lps import LPSConfig, LPSRouter

Progress = Callable[[str], None] | None


def _say(progress: Progress, message: str) -> None:
    if progress is not None:
        progress(message)


# ---------------------------------------------------------------------------------------------
# Prompts and responses
# ---------------------------------------------------------------------------------------------


def prompts_from_corpus(paths: Sequence, n: int, *, bos: int, seed: int = 0, from_end: bool = False,
                        prefix_range: tuple[int, int] = (4, 24), vocab_size: int | None = None,
                        tokenizer=None) -> list[list[int]]:
    """``n`` prompts [BOS] + the first k ~ U[prefix_range] ids of corpus documents (JSONL/TXT via
    :func:`unmask.train.data.read_documents`; ``tokenizer`` encodes text documents), in a seeded
    document order. LBS takes its prompts from the front of that order and LPS (``from_end``) from
    the back, so the two sets are disjoint while together they fit the corpus. Raises UnmaskError
    when the corpus holds fewer documents."""
    from unmask.train.data import read_documents

    docs = [r["ids"] for p in paths for r in read_documents(p, tokenizer, vocab_size=vocab_size) if len(r["ids"]) >= 2]
    random.Random(seed).shuffle(docs)
    if n > len(docs):
        raise UnmaskError(f"the corpus holds {len(docs)} usable documents, {n} needed; add data with --data or ask "
                          "for fewer --prompts")
    picked = docs[::-1][:n] if from_end else docs[:n]
    rng = random.Random(seed + (1 if from_end else 0))
    lo, hi = prefix_range
    return [[bos] + d[: rng.randint(min(lo, len(d) - 1), min(hi, len(d) - 1))] for d in picked]


def pad_response(canvas: Sequence[int | None], stop_ids: Sequence[int], L: int, fill: int) -> list[int]:
    """The response as the model ended it, L ids: everything before the first stop id (or mask,
    None), then that stop id (``fill`` when the cut was a mask or the canvas ended) repeated."""
    out: list[int] = []
    for t in list(canvas)[:L]:
        if t is None or t in stop_ids:
            fill = fill if t is None else t
            break
        out.append(int(t))
    return out + [fill] * (L - len(out))


def generate_responses(bundle, prompts: list[list[int]], *, gen_length: int, block_size: int = 32,
                       policy: str = "top-k", tau: float = 0.9, cache: str = "none", batch_size: int = 16,
                       max_minutes: float | None = None, progress: Progress = None) -> list[list[int]]:
    """The base model's own greedy responses (L ids each, EOS-padded, §3.4): ``policy="top-k"``
    is vanilla 1 token/step decoding, ``"threshold"`` Fast-dLLM at τ (both with L_B blocks;
    ``cache`` as in the diffusion decoder). With ``max_minutes`` generation stops before a batch
    that would not fit (judged by the previous one), so fewer responses than prompts may come back
    (the first ones)."""
    from unmask.decode import diffusion

    stops = tuple(bundle.stop_token_ids)
    if not stops:
        raise UnmaskError(f"{bundle.name} has no stop token, so responses cannot be EOS-padded; name its "
                          "stop_token_ids in the model's unmask_config.json")
    options = {"top-k": {"policy": "top-k", "tokens_per_step": 1}, "threshold": {"policy": "threshold", "tau": tau}}
    if policy not in options:
        raise UnmaskError(f"unknown response policy --responses {policy!r}; choose top-k (vanilla) or threshold")
    out: list[list[int]] = []
    t0 = time.monotonic()
    last = 0.0  # seconds of the previous batch: stop when the next one would not fit the budget
    for s in range(0, len(prompts), batch_size):
        if max_minutes is not None and time.monotonic() - t0 + last > 60 * max_minutes:
            break
        tb = time.monotonic()
        batch = prompts[s: s + batch_size]
        canvases: dict[int, list] = {}
        diffusion.decode(bundle, batch, max_new_tokens=gen_length, gen_length=gen_length, block_size=block_size,
                         stop_token_ids=stops, on_step=lambda e: canvases.__setitem__(e["row"], e["canvas"]),
                         cache=cache, **options[policy])
        out += [pad_response(canvases[r], stops, gen_length, stops[0]) for r in range(len(batch))]
        last = time.monotonic() - tb
        _say(progress, f"responses {len(out)}/{len(prompts)} ({time.monotonic() - t0:.0f} s)")
    return out


# ---------------------------------------------------------------------------------------------
# LBS
# ---------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class LBSTrainConfig:
    """LBS optimisation (§3.4; paper: lr 5e-5, 6 epochs on 92k prompts; batch 32, wd 0.01 and
    cosine without warm-up are our choices). block: L_B of Blockwise-Masking. val_fraction of
    the samples is held out for a validation loss. max_minutes bounds the loop."""

    block: int = 32
    epochs: int = 6
    batch_size: int = 32
    lr: float = 5e-5
    weight_decay: float = 0.01
    val_fraction: float = 0.05
    seed: int = 0
    max_minutes: float | None = None

    def __post_init__(self):
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
            loss = lbs_loss(router(h, e, m), ce, m)
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
        _say(progress, f"LBS epoch {epoch + 1}/{config.epochs}: train {report['train_loss'][-1]:.4f}{val} "
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
        total += float(lbs_loss(router(h, e, m), ce, m)) * len(rows)
    return total / len(val_ids)


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
        return cls(**torch.load(path, map_location="cpu", weights_only=True))

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
    from unmask.decode import early_bird

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
        last: dict = {}

        def hook(state):
            for r in torch.nonzero(state["cand"].any(dim=1)).flatten().tolist():
                where = torch.nonzero(state["cand"][r]).flatten()
                recs.append((r, len(schedule[r]), state["features"][r, where].float().cpu(), state["top1"][r, where].cpu(),
                             where.cpu()))
                schedule[r].append((torch.nonzero(state["block"][r]).flatten().cpu(),
                                    torch.nonzero(state["chosen"][r]).flatten().cpu()))
            last["canvas"] = state["canvas"].cpu()

        early_bird.decode(bundle, batch, max_new_tokens=L, gen_length=L, stop_token_ids=stops, lps=False,
                          lbs_router=lbs, on_forward=hook, **settings)
        x0 = last["canvas"]  # (b, L) final canvases
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


# ---------------------------------------------------------------------------------------------
# Saving with provenance (used by the CLI and the recipe)
# ---------------------------------------------------------------------------------------------


def save_lbs(router: LBSRouter, bundle, directory, report: dict | None = None) -> Path:
    """Save R_φ with the base model's facts (vocabulary check on load) and its training report."""
    from unmask.routers.io import base_model_facts, save_router

    return save_router(router, directory, meta={"base_model": base_model_facts(bundle), "training": report or {}})


def save_lps(router: LPSRouter, tau_psi: float, bundle, directory, report: dict | None = None,
             serving: dict | None = None) -> Path:
    """Save R_ψ with τ_ψ, its validation/test metrics and the serving configuration its traces
    were collected under (the decoder's defaults for L_B, τ, L_min, g_max)."""
    from unmask.routers.io import base_model_facts, save_router

    report = dict(report or {})
    history = report.pop("history", None)
    meta = {"tau_psi": float(tau_psi), "base_model": base_model_facts(bundle), "serving": serving or {},
            "metrics": {k: report.get(k) for k in ("val", "test", "split", "best_epoch")},
            "training": {**report, "history_tail": (history or [])[-5:]}}
    return save_router(router, directory, meta=meta)


# ---------------------------------------------------------------------------------------------
# End to end: what ``unmask train lbs`` / ``unmask train lps`` run
# ---------------------------------------------------------------------------------------------


def _load(model, device):
    from unmask.models import ModelBundle, load

    bundle = model if isinstance(model, ModelBundle) else load(model, device=device)
    if bundle.kind != "masked-diffusion" or bundle.mask_token_id is None:
        raise UnmaskError(f"Early-Bird routers need a masked-diffusion model with a mask token, {bundle.name!r} is "
                          f"{bundle.kind!r}; pass a masked-diffusion model with --model")
    return bundle


def _out_dir(bundle, out) -> Path:
    from unmask.routers.io import routers_dir

    where = routers_dir(bundle, out)
    if where is None:
        raise UnmaskError(f"{bundle.name!r} has no model directory; pass --out DIR for the routers")
    return where


def _check_counts(**flags) -> None:
    """Integer command options that must be >= 1, named by their --flag."""
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UnmaskError(f"{flag} must be an integer >= 1, got {value!r}; pass {flag} 1 or more")


def _check_router_sizes(router: dict | None, config_cls, even: bool) -> None:
    """--d / --layers / --ffn of a router before any generation (the config re-checks the rest)."""
    router = router or {}
    _check_counts(**{k: router[k] for k in ("d", "layers", "ffn") if k in router})
    d, heads = router.get("d", config_cls.d), router.get("heads", config_cls.heads)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        return  # not a command option; the config names it
    step = math.lcm(2, heads) if even else heads
    if d % step:
        what = f"even and divisible by the {heads} heads" if even else f"divisible by the {heads} heads"
        raise UnmaskError(f"router width --d {d} must be {what}; pass a multiple of {step}, "
                          f"e.g. --d {max(step, d // step * step)}")


def _check_context(bundle, prompts: list[list[int]], gen_length: int) -> None:
    P = max(len(p) for p in prompts)
    if P + gen_length > bundle.context_length:
        raise UnmaskError(f"prompt ({P} tokens) + --gen-length {gen_length} exceeds the context window of "
                          f"{bundle.context_length}; pass --gen-length {bundle.context_length - P} or less")


def run_lbs(*, model, data: Sequence, out=None, n_prompts: int = 1000, gen_length: int = 256, block_size: int = 32,
            response_policy: str = "top-k", response_cache: str = "none", gen_batch: int = 16,
            train: LBSTrainConfig | None = None,
            router: dict | None = None, device: str = "cpu", progress: Progress = None) -> dict:
    """Prompts from ``data`` (ids, or text encoded with the model's tokenizer), the model's own
    responses, Alg. 3 training, save to ``out`` (default MODEL_DIR/routers). ``router``: LBSConfig
    fields (d, layers, heads, ffn). Every option is checked before any response is generated.
    Returns a summary."""
    from unmask.decode.dllm_cache import CACHE_MODES

    _check_counts(prompts=n_prompts, gen_length=gen_length, block_size=block_size, gen_batch=gen_batch)
    if gen_length % block_size:
        raise UnmaskError(f"--gen-length {gen_length} is not a multiple of --block-size {block_size}; pass e.g. "
                          f"--gen-length {max(1, gen_length // block_size) * block_size}")
    if response_policy not in ("top-k", "threshold"):
        raise UnmaskError(f"unknown response policy --responses {response_policy!r}; choose top-k (vanilla) or "
                          "threshold")
    if response_cache not in CACHE_MODES:
        raise UnmaskError(f"unknown --response-cache {response_cache!r}; choose one of: {', '.join(CACHE_MODES)}")
    _check_router_sizes(router, LBSConfig, even=True)
    bundle = _load(model, device)
    where = _out_dir(bundle, out)
    train = train or LBSTrainConfig(block=block_size)
    emb = bundle.model.get_input_embeddings().weight
    rc = LBSConfig(gen_length=gen_length, d_base=int(emb.shape[1]), vocab_size=int(emb.shape[0]), **(router or {}))
    vocab = emb.shape[0]
    prompts = prompts_from_corpus(data, n_prompts, bos=bundle.bos_token_id if bundle.bos_token_id is not None else 1,
                                  seed=train.seed, vocab_size=vocab, tokenizer=bundle.tokenizer)
    _check_context(bundle, prompts, gen_length)
    responses = generate_responses(bundle, prompts, gen_length=gen_length, block_size=block_size,
                                   policy=response_policy, cache=response_cache, batch_size=gen_batch,
                                   progress=progress)
    lbs, report = train_lbs(bundle, prompts, responses, train, rc, progress=progress)
    report.update(prompts=len(prompts), response_policy=response_policy, response_cache=response_cache,
                  gen_length=gen_length)
    path = save_lbs(lbs, bundle, where, report)
    return {"out": str(path), "params": lbs.n_params(), "epochs": report["epochs"],
            "train_loss": report["train_loss"][-1] if report["train_loss"] else None,
            "val_loss": report["val_loss"][-1] if report["val_loss"] else None}


def run_lps(*, model, data: Sequence, routers=None, out=None, n_prompts: int = 300, block_size: int = 32,
            tau: float = 0.9, l_min: int = 8, g_max: int = 5, pos_mode: str = "literal", replay: bool = False,
            gen_batch: int = 16, traces_file=None, train: LPSTrainConfig | None = None, router: dict | None = None,
            seed: int = 0, device: str = "cpu", progress: Progress = None) -> dict:
    """Collect traces with the saved LBS (``routers``, default MODEL_DIR/routers) under the serving
    configuration, train R_ψ, choose τ_ψ, save next to the LBS (or to ``out``). ``traces_file``
    caches the traces (reused when it exists). Returns a summary with test recall / FPR."""
    from unmask.decode.eb_select import POS_MODES
    from unmask.routers.io import check_lbs_fits, load_router

    if pos_mode not in POS_MODES:
        raise UnmaskError(f"unknown --pos-mode {pos_mode!r}; choose one of: {', '.join(POS_MODES)}")
    _check_router_sizes(router, LPSConfig, even=False)
    rc = LPSConfig(pos_mode=pos_mode, **(router or {}))  # checked before any trace is collected
    bundle = _load(model, device)
    source = _out_dir(bundle, routers)
    where = _out_dir(bundle, out if out is not None else source)
    lbs, info = load_router(source, "lbs", device=bundle.device)
    check_lbs_fits(info, bundle)
    serving = {"block_size": block_size, "tau": tau, "l_min": l_min, "g_max": g_max}
    if traces_file is not None and Path(traces_file).is_file():
        traces = LPSTraces.load(traces_file)
        _say(progress, f"LPS traces: reusing {traces_file} ({traces.n_traces} traces, {traces.n_records} records)")
    else:
        _check_counts(prompts=n_prompts, gen_batch=gen_batch)
        vocab = bundle.model.get_input_embeddings().weight.shape[0]
        prompts = prompts_from_corpus(data, n_prompts, bos=bundle.bos_token_id if bundle.bos_token_id is not None
                                      else 1, seed=seed, from_end=True, vocab_size=vocab, tokenizer=bundle.tokenizer)
        traces = collect_lps_traces(bundle, lbs, prompts, pos_mode=pos_mode, replay=replay, batch_size=gen_batch,
                                    progress=progress, **serving)
        if traces_file is not None:
            traces.save(traces_file)
    lps, tau_psi, report = train_lps(traces, train or LPSTrainConfig(), rc, device=bundle.device, progress=progress)
    report["traces"] = traces.meta
    path = save_lps(lps, tau_psi, bundle, where, report, serving)
    return {"out": str(path), "tau_psi": tau_psi, "params": lps.n_params(), "traces": traces.n_traces,
            "records": traces.n_records, "val": report["val"], "test": report["test"], "epochs": report["epochs"],
            "stopped": report["stopped"]}
