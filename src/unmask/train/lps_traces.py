"""LPS training data for Early-Bird (spec/early_bird.md §4.3, Alg. 4): step-record traces from the
serving configuration, labels y = 1[x̂_t = x_0], and the oracle replay rule (reading #7).
:mod:`unmask.train.lps_fit` fits the router on them; :mod:`unmask.train.routers` wires both into
``unmask train lps``."""

from __future__ import annotations

import math
import os
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unmask.decode.engine.batching import left_pad
from unmask.decode.dllm.eb_select import lps_features
from unmask.errors import UnmaskError
from unmask.models.adapters import bidirectional_forward, realign
from unmask.policies import token_stats
from unmask.routers.lbs import LBSRouter
from unmask.train.progress import Progress, say


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
        say(progress, f"LPS traces {min(s + batch_size, len(prompts))}/{len(prompts)}, {len(steps)} step records "
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
