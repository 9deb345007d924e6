"""Dream's own ``diffusion_generate`` schedule, "Dream-compat" (spec/diffusion.md §5, models.md §2.4).

Reached as ``decode(..., decoder="diffusion", schedule="dream")``. Unlike unmask's semi-AR diffusion decoder
there are no blocks: every step runs one bidirectional forward over the whole canvas
``[prompt | m^L]``, realigns the logits (Dream's shift), and with timesteps
``t_i = linspace(1, eps, steps + 1)[i]``, ``s = t_{i+1}``:

- ``alg="origin"``: every masked position is revealed independently with probability
  1 - s/t (1 at the last step), its token drawn by :func:`dream_sample`;
- ``alg="maskgit_plus"`` (confidence), ``"topk_margin"`` (top-1 minus top-2 probability),
  ``"entropy"`` (negative entropy): the k = int(n_masked · (1 - s/t)) masked positions with the
  highest score are committed (all of them at the last step); with ``alg_temp`` > 0 the k
  positions are drawn without replacement from softmax(score / alg_temp) instead.

Token draws follow Dream's ``sample_tokens``: logits / T when T > 0, top-p then top-k filtering,
softmax; T > 0 samples, T = 0 takes the maximum; the confidence is the chosen token's
probability. The mask column is not suppressed (a "committed" mask stays masked), as in the
published loop. Differences, all our choice: n_masked is the row's own count (the published code
averages over the batch, identical when rows share a canvas length), each row draws from its own
seeded generator (batch == single), and decoding stops once no masks are left (same tokens,
fewer forwards). ``steps`` defaults to the canvas length L (Dream's generation_config says 512).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from unmask.decode.dllm.canvas import CanvasBatch, CanvasRow, check_canvas
from unmask.decode.dllm.cache import canvas_call
from unmask.decode.engine.host import HostRead
from unmask.errors import UnmaskError, check_choice, check_int, is_number
from unmask.models.adapters import realign
from unmask.sampling import Sampling

ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
DEFAULT_ALG = "origin"  # Dream's generation_config.json
DEFAULT_EPS = 1e-3


def _top_p(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """Dream's ``top_p_logits``: drop a token once the mass strictly before it exceeds top_p. z (N, V)."""
    sorted_z, order = z.sort(dim=-1, descending=True)  # (N, V) each
    cum = sorted_z.softmax(-1).cumsum(-1)  # (N, V)
    drop = torch.zeros_like(cum, dtype=torch.bool)
    drop[:, 1:] = cum[:, :-1] > top_p  # (N, V), shifted right: the top-1 always stays
    return z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def dream_sample(logits: torch.Tensor, alg: str, sampling: Sampling,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's ``sample_tokens`` on logits (N, V) -> (score (N,) float32, tokens (N,) long).

    score: the chosen token's probability; for ``topk_margin`` top-1 minus top-2 probability; for
    ``entropy`` Σ p log p (negative entropy, nats). Raises nothing; ``generator`` is used when T > 0.
    """
    z = logits.float()
    if sampling.temperature > 0:
        z = z / sampling.temperature
    if sampling.top_p < 1:
        z = _top_p(z, sampling.top_p)
    if 0 < sampling.top_k < z.shape[-1]:
        z = z.masked_fill(z < z.topk(sampling.top_k, dim=-1).values[:, -1:], float("-inf"))
    probs = z.softmax(-1)  # (N, V)
    if sampling.temperature > 0:
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]  # (N,)
        score = probs.gather(1, tokens[:, None])[:, 0]
    else:
        score, tokens = probs.max(-1)
    if alg == "topk_margin":
        top2 = probs.topk(2, dim=-1).values  # (N, 2)
        score = top2[:, 0] - top2[:, 1]
    elif alg == "entropy":
        score = (probs * torch.log(probs + 1e-10)).sum(-1)
    return score, tokens


def schedule(steps: int, eps: float) -> np.ndarray:
    """Dream's 1 - s/t per step (t_i = linspace(1, eps, steps + 1)[i], s = t_{i+1}) in its float32
    arithmetic: (steps,) float32, host values, so a step computes k and p with no device read."""
    ts = torch.linspace(1, eps, steps + 1)  # float32, as Dream
    return (1 - ts[1:] / ts[:-1]).numpy()


def commit_row(logits: torch.Tensor, masked: torch.Tensor, n: int, alg: str, alg_temp: float | None, k: int,
               p_transfer: float, sampling: Sampling, generator: torch.Generator | None):
    """One row's step: logits (L, V), masked (L,) bool with ``n`` masks (host-known) -> (chosen (L,)
    bool, tokens (L,) long). Reads nothing on the host; origin's draw over the revealed positions
    indexes by a mask (on CUDA an implicit sync: Dream's draws consume the generator per revealed
    position, so their number decides the stream)."""
    L = masked.shape[0]
    idx = (~masked).to(torch.uint8).sort(stable=True).indices[:n]  # (n,) the masked positions, in order
    chosen = torch.zeros(L, dtype=torch.bool, device=masked.device)
    tokens = torch.zeros(L, dtype=torch.long, device=masked.device)
    if alg == "origin":
        reveal = torch.rand(n, generator=generator, device=masked.device) < p_transfer  # (n,)
        _, tok = dream_sample(logits[idx[reveal]], alg, sampling, generator)  # none revealed: no draw
        chosen[idx[reveal]], tokens[idx[reveal]] = True, tok
        return chosen, tokens
    score, tok = dream_sample(logits[idx], alg, sampling, generator)  # (n,) each
    tokens[idx] = tok
    if k > 0:
        full = torch.full((L,), float("-inf"), device=masked.device)
        full[idx] = score
        if alg_temp:
            pick = torch.multinomial((full / alg_temp).softmax(-1), k, generator=generator)  # (k,)
        else:
            pick = full.topk(k).indices  # (k,)
        chosen[pick] = True
    return chosen, tokens


@dataclass(frozen=True)
class DreamConfig:
    """Dream's schedule, validated: ``gen_length`` (None: each row's ``max_new_tokens``), ``steps``
    (None: the row's L), ``alg``, ``alg_temp`` (None: top-k selection), ``eps``. Raises UnmaskError."""

    gen_length: int | None = None
    steps: int | None = None
    alg: str = DEFAULT_ALG
    alg_temp: float | None = None
    eps: float = DEFAULT_EPS
    cache: ClassVar[str] = "none"  # one forward over the whole canvas per step
    confidence: ClassVar[None] = None

    def __post_init__(self):
        check_choice("alg", self.alg, ALGS)
        if self.steps is not None:
            check_int(self.steps, 1, "steps", "Dream's default is 512")
        if not is_number(self.eps) or not 0 < self.eps < 1:
            raise UnmaskError(f"eps must be in (0, 1) (got {self.eps!r}); Dream's default is 1e-3")
        if self.alg_temp is not None and (not is_number(self.alg_temp) or self.alg_temp < 0):  # nan / inf: nan softmax
            raise UnmaskError(f"alg_temp must be a finite number >= 0 (got {self.alg_temp!r}); leave it unset for "
                              "top-k selection")

    @classmethod
    def of(cls, *, gen_length=None, steps=None, alg=None, alg_temp=None, eps=None) -> "DreamConfig":
        """None = Dream's default (alg origin, eps 1e-3)."""
        return cls(gen_length=gen_length, steps=steps, alg=DEFAULT_ALG if alg is None else alg, alg_temp=alg_temp,
                   eps=DEFAULT_EPS if eps is None else eps)

    def plan(self, bundle, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
        """(L, steps) of a request; UnmaskError when it does not fit."""
        L = max_new_tokens if self.gen_length is None else self.gen_length
        if not isinstance(L, int) or L < 1:
            raise UnmaskError(f"gen length must be an integer >= 1 (got {L!r}); pass e.g. --gen-length 64")
        check_canvas(bundle, prompt_len, L, "lower --gen-length or --max-new-tokens")
        return L, L if self.steps is None else self.steps


@dataclass(eq=False)
class DreamRow(CanvasRow):
    """A running row of Dream's schedule: ``L`` (its canvas of masks), ``steps`` (its schedule's
    length), ``i`` (steps run), ``factors`` (:func:`schedule`)."""

    L: int = 0
    steps: int = 0
    i: int = 0
    factors: object = None


class DreamSchedule(CanvasBatch):
    """Dream's schedule as a running batch (``decode/engine/running.py``'s contract; DESIGN.md "One engine").

    Every row runs its own schedule over its own canvas (steps default to its L = ``gen_length`` or
    its ``max_new_tokens``) and leaves once no mask is left or its steps are run; a step is ONE
    forward for every running row and one host read. Each row draws from its own generator (Dream's
    draws need one even at T = 0), so a row equals its decode alone whenever it joined. ``lockstep``
    (decode) numbers step events by the batch forward and the request id, else by the row's own
    forward (row 0). ``join`` raises UnmaskError for a request that does not fit.
    """

    def __init__(self, bundle, cfg: DreamConfig, *, capacity=8, on_step=None, on_token=None, stop_token_ids=None,
                 width=0, lockstep=False, on_forward=None):
        super().__init__(bundle, cfg, block=1, width=max(width, 1), capacity=capacity, static=False, compile=False,
                         on_step=on_step, on_forward=on_forward, lockstep=lockstep, stop_token_ids=stop_token_ids)

    @torch.inference_mode()
    def join(self, requests) -> list[DreamRow]:
        """Place each request's canvas (no forward; every request is validated first). Returns []."""
        plans = {}
        for job in requests:
            plans[id(job)] = self.cfg.plan(self.bundle, len(job.prompt_ids), job.max_new_tokens)  # (L, steps)
            if job.stop:
                raise UnmaskError("stop strings do not apply to --schedule dream (Dream's own loop ends on masks "
                                  "and steps only); drop them")

        def row(job, slot, _):
            # decode's rows each draw from Dream's one seeded stream, as its published loop; a server row
            # from its request's generator
            L, steps = plans[id(job)]
            gen = None if self.lockstep else getattr(job, "generator", None)
            return DreamRow(job=job, slot=slot, L=L, steps=steps, report=min(job.max_new_tokens, L),
                            generator=gen or job.sampling.generator(self.bundle.device),
                            factors=schedule(steps, self.cfg.eps), gen=[self.bundle.mask_token_id] * L)

        return self._place(requests, row)

    @torch.inference_mode()
    def step(self) -> list[DreamRow]:
        """One forward for every running row, then each row's step of its schedule; returns the rows
        that finished (no mask left, or their steps run), removed, with ``tokens`` etc. set."""
        if not self.running:
            return []
        c, mask_id, shift = self.canvas, self.bundle.mask_token_id, self.bundle.logit_shift
        n, T, rows = self.slots.high, c.width, self.rows
        Lmax = max(row.L for row in rows)
        raw = canvas_call(self.bundle, None, c.ids[:n], c.pos[:n], c.valid[:n], (T - Lmax - shift, T),
                          padded=any(c.padded[:n]))  # (n, shift + Lmax, V)
        logits = realign(raw, shift)[:, shift:]  # (n, Lmax, V): index j scores column T - Lmax + j
        slotted = [self.running.get(s) for s in range(n)]
        logits, raw = self.shaping.shape(slotted, logits)  # biased, and raw for logprobs
        masked_all = c.ids[:n, T - Lmax:] == mask_id  # (n, Lmax) before this step's commits
        landed_all = torch.zeros_like(masked_all)  # (n, Lmax)
        tokens_all = torch.zeros(masked_all.shape, dtype=torch.long, device=masked_all.device)  # (n, Lmax)
        for row in rows:
            gen = c.ids[row.slot, T - row.L:]  # (L,) view: commits write through it
            masked = gen == mask_id  # (L,)
            left = row.gen.count(mask_id)  # the masks the last read saw
            last = row.i == row.steps - 1
            factor = row.factors[row.i]
            k = left if last else int(np.float32(left) * factor)  # Dream's float32 k, truncated as Tensor.long()
            chosen, tokens = commit_row(logits[row.slot, Lmax - row.L:], masked, left, self.cfg.alg, self.cfg.alg_temp,
                                        k, 1.0 if last else float(factor), row.job.sampling, row.generator)
            gen.copy_(torch.where(chosen, tokens, gen))
            landed = chosen & (tokens != mask_id)
            landed_all[row.slot, Lmax - row.L:] = landed
            tokens_all[row.slot, Lmax - row.L:] = tokens
        # the step's one host sync: the rows' commits and generated ids (with on_step, what its events show)
        host = HostRead().add("count", landed_all.sum(dim=1)).add("gen", c.ids[:n, T - Lmax:])
        if self.on_step is not None:
            host.add("landed", landed_all).add("tokens", tokens_all)
        self.shaping.add(host, slotted, lambda: (raw, tokens_all, landed_all,
                                                 [0 if r is None else r.L - Lmax for r in slotted]))
        read = host.read()
        finished = []
        for row in rows:
            lo, s = Lmax - row.L, row.slot
            row.commits.append(read["count"][s])
            row.gen = read["gen"][s][lo:]
            self.shaping.take(row, read, s)
            if self.on_step is not None:
                self._event(row, self.forwards, read["landed"][s][lo:], read["tokens"][s][lo:], 0, row.gen)
            row.nfe += 1
            row.i += 1
            if row.i == row.steps or mask_id not in row.gen:
                finished.append(row)
        if self.on_forward is not None:
            self.on_forward({"nfe": self.forwards, "step": rows[0].i - 1, "canvas": c.ids[:n].clone(),
                             "logits": logits, "masked": masked_all})
        self.forwards += 1
        self._finish(finished)
        return finished

    def _row_extra(self, row: DreamRow) -> dict:
        return {"schedule": "dream", "alg": self.cfg.alg, "commits": list(row.commits)}

    def stats_extra(self, rows: list[DreamRow]) -> dict:
        """decode's ``stats.extra`` for finished rows in request order."""
        L = rows[0].L if rows else self.cfg.gen_length
        steps = rows[0].steps if rows else self.cfg.steps
        alg = self.cfg.alg
        return {"schedule": "dream", "alg": alg, "steps": steps, "gen_length": L, "policy": f"dream-{alg}",
                "cache": "none", "sampler": "dream", "row_extra": [dict(row.extra) for row in rows]}


__all__ = ["ALGS", "DreamConfig", "DreamRow", "DreamSchedule", "commit_row", "dream_sample", "schedule"]
