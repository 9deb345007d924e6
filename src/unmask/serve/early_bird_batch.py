"""Continuous batching for Early-Bird decoding: rows join and leave at step boundaries (issue 16;
spec/early_bird.md §5, §9).

:class:`EarlyBirdBatch` holds one canvas per running row, ``[prompt | m^L]`` with L the LBS
router's gen length (the same for every row, so every row's generation region is the last L
columns of the left-padded (R, T) canvas), a per-row key validity mask and explicit positions
(real tokens from 0), and each row's own router state: its active block (selected by LBS, fixed
until resolved), its block counter and its commits.

A step is ONE bidirectional forward over every running row (``cache="none"``), the LM head on the
generated columns that cover every row's need: the whole region for a row without an active block
(its LBS selection step), else the span of its live block, as ``early_bird.decode`` scores it.
Each row then runs the rest of ``decode``'s step on its own slice with batch size 1, the way
``decode`` on its prompt alone runs it: token statistics, LBS + ``select_block`` when it selects,
its own sampled draws, κ, the LPS router on its packed candidates, ``union_accept``, and the stop
checks (§9). The routers run per row, so their inputs have exactly the single run's shapes.

Equality (STYLE.md 14): a row's tokens and NFE are those of ``early_bird.decode(bundle, [prompt],
...)`` on its prompt alone, whenever it joined and whatever else runs, greedy and seeded sampled
(each row draws from ``Sampling.row_generators([prompt])``). Only the float summation order over
masked padding keys differs from the single-prompt run (as in a batched ``decode``).

Not supported (refused with a one-line UnmaskError): the prefix/dual caches (their refresh serves
every row of a batch, so a cached batch is not the single run, module doc of early_bird.py),
``compile``/``static``, and remote-code models (no explicit positions per row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from unmask.decode.diffusion import early_stop, hit_stop_string, until_stop
from unmask.decode.early_bird import _commit_confidence, _draw_rows, configure
from unmask.decode.eb_select import lps_features, pack_rows, select_block, union_accept
from unmask.decode.stats import check_nfe
from unmask.errors import UnmaskError
from unmask.models.adapters import bidirectional_forward, is_remote, realign
from unmask.policies import Threshold, token_stats
from unmask.serve.running import append_canvas, row_canvas, split_rows, take_canvas
from unmask.trace import step_event

OPTIONS = ("gen_length", "block_size", "tau", "tau_psi", "l_min", "g_max", "lps", "cache", "gap_metric", "pos_mode",
           "eos_early_stop", "sampler", "confidence", "routers", "lbs_router", "lps_router")


@dataclass
class Row:
    """One running request.

    ``job`` is the scheduler's handle (``prompt_ids``, ``max_new_tokens``, ``sampling``, ``stop``);
    ``generator`` its own (None when greedy). Router state: ``block`` (L,) bool, its active block as
    selected; ``block_no`` (selections - 1). Once finished: ``tokens`` (cut before the first stop
    token and at ``max_new_tokens``), ``nfe``, ``finish`` ("stop" or "length") and ``extra``
    (``decode``'s ``row_extra`` entry, plus ``n_committed``)."""

    job: object
    generator: torch.Generator | None
    block: torch.Tensor
    block_no: int = -1
    done: bool = False
    nfe: int = 0
    commits: list[int] = field(default_factory=list)
    tokens: list[int] | None = None
    finish: str | None = None
    extra: dict | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.job.prompt_ids)


class EarlyBirdBatch:
    """The running set of ``early-bird`` rows of one model and one set of Early-Bird options,
    advanced one forward at a time.

    options: the knobs every row shares (:data:`OPTIONS`; None = default), validated and the routers
    resolved once by :func:`unmask.decode.early_bird.configure` (router objects given as
    ``lbs_router`` / ``lps_router`` are put in eval mode and stay so); per row (the job): prompt,
    ``max_new_tokens`` (≤ L), ``sampling``, stop strings. ``stop_token_ids`` defaults to the bundle's.
    ``on_step(row, event)`` gets each row's step event, the one ``early_bird.decode`` on that prompt
    alone emits (``row`` 0, ``step`` the row's own forward index, ``block``, ``selected``).

    ``join(jobs)`` adds rows (no forward; returns []); ``step()`` runs one forward for every running
    row and returns the rows that finished in it (removed); ``drop(pred)`` evicts rows.
    Raises UnmaskError for a model without a mask token, missing routers, an unknown or unsupported
    option (a cache, a remote-code model) or a bad value; ``join`` raises it for a job that does not
    fit (empty prompt, ``max_new_tokens`` above L, canvas past the context window) before adding any.
    """

    def __init__(self, bundle, options: dict | None = None, on_step=None, *, stop_token_ids=None):
        if is_remote(bundle.model):
            raise UnmaskError("a continuous early-bird batch needs explicit positions per row; this checkpoint's own "
                              "model code takes none, so decode it with per-call early-bird batches")
        options = {k: v for k, v in dict(options or {}).items() if v is not None}
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise UnmaskError(f"option(s) {', '.join(unknown)} do not apply to a continuous early-bird batch "
                              f"(eager forwards); use only {', '.join(OPTIONS)}")
        if str(options.get("cache", "none")) != "none":
            raise UnmaskError(f"cache {options['cache']!r} is not exact in a continuous early-bird batch (a refresh "
                              "serves every row); use cache 'none'")
        self.cfg, self.lbs, self.lps = configure(bundle, **options)
        for net in (self.lbs, self.lps):
            if net is not None:
                net.eval()
        self.bundle, self.on_step = bundle, on_step
        self.device, self.mask_id, self.shift = bundle.device, bundle.mask_token_id, bundle.logit_shift
        self.L = self.cfg.gen_length
        ids = bundle.stop_token_ids if stop_token_ids is None else stop_token_ids
        self.stops_list = sorted(set(ids))
        self.stops = torch.tensor(self.stops_list or [-1], device=self.device)
        self.suppress = list(bundle.suppress_ids)
        self.embed = bundle.model.get_input_embeddings()
        self.threshold = Threshold(self.cfg.tau)
        self.confidence, self.draw = self.cfg.commit_confidence, ("gumbel" if self.cfg.sampler == "llada" else "categorical")
        self.rows: list[Row] = []
        self.forwards = 0
        self._empty()

    def _empty(self) -> None:
        self.ids: torch.Tensor | None = None  # (R, T) long: left-padded canvases
        self.pos: torch.Tensor | None = None  # (R, T) long: positions, real tokens from 0
        self.valid: torch.Tensor | None = None  # (R, T) bool: False on padding

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def cache(self):
        """Always None: only ``cache="none"`` runs in a continuous early-bird batch."""
        return None

    @property
    def canvas(self) -> torch.Tensor | None:
        """The running canvases (R, T) long, left-padded; None when no row is running."""
        return self.ids

    # -- joining ------------------------------------------------------------------------------

    def _check(self, job) -> None:
        prompt, n = list(job.prompt_ids), job.max_new_tokens
        if not prompt:
            raise UnmaskError("every prompt needs at least one token (a Dream-style model scores position i from i-1)")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise UnmaskError(f"max_new_tokens must be an integer >= 1 (got {n!r})")
        if n > self.L:
            raise UnmaskError(f"max_new_tokens {n} exceeds the LBS router's gen length {self.L}; lower it "
                              f"or train LBS for a longer gen length")
        if len(prompt) + self.L > self.bundle.context_length:
            raise UnmaskError(f"prompt ({len(prompt)} tokens) + gen length {self.L} exceeds the context window of "
                              f"{self.bundle.context_length}; shorten the prompt or use a model with a longer window")

    @torch.inference_mode()
    def join(self, jobs: list) -> list[Row]:
        """Add each job as a row with canvas ``[prompt | m^L]`` and no active block (no forward). Every
        job is validated first, so a bad one adds none. Returns [] (no row finishes before its first step)."""
        for job in jobs:
            self._check(job)
        dev, L = self.device, self.L
        for job in jobs:
            gens = job.sampling.row_generators([list(job.prompt_ids)], dev)  # the generator decode gives it
            row = Row(job=job, generator=None if gens is None else gens[0],
                      block=torch.zeros(L, dtype=torch.bool, device=dev))
            canvas = row_canvas(job.prompt_ids, L, self.mask_id, dev)  # (1, C) each, C = prompt_len + L
            if not self.rows:
                self.ids, self.pos, self.valid = canvas
            else:
                self.ids, self.pos, self.valid = append_canvas((self.ids, self.pos, self.valid), canvas,
                                                               self.bundle.pad_token_id)  # (R + 1, T) each
            self.rows.append(row)
        return []

    # -- stepping -----------------------------------------------------------------------------

    def _span(self, r: int) -> tuple[int, int]:
        """Generated positions [lo, hi) row r's forward scores: all L when it has no active block
        (it selects), else the span of its live block (``decode``'s no-cache window)."""
        row = self.rows[r]
        live = row.block & (self.ids[r, -self.L:] == self.mask_id)  # (L,)
        if not bool(live.any()):
            return 0, self.L
        where = torch.nonzero(live).flatten()
        return int(where[0]), int(where[-1]) + 1

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One forward over every running row (early_bird.md §5 Alg. 5, no cache), then each row's
        selection, commit and stop checks as ``decode`` runs them on its prompt alone. Returns the
        finished rows, already removed, with ``tokens``, ``nfe``, ``finish`` and ``extra`` set."""
        if not self.rows:
            return []
        L, shift = self.L, self.shift
        T = self.ids.shape[1]
        spans = [self._span(r) for r in range(len(self.rows))]
        LO, HI = min(s[0] for s in spans), max(s[1] for s in spans)
        g0 = T - L  # every row's generation region is the last L columns
        raw = bidirectional_forward(self.bundle, self.ids, position_ids=self.pos, key_valid=self.valid,
                                    rows=(g0 + LO - shift, g0 + HI))  # (R, shift + HI - LO, V)
        self.forwards += 1
        scored = realign(raw, shift)[:, shift:]  # (R, HI - LO, V): index j scores generated position LO + j
        finished = []
        for r, (row, (lo, hi)) in enumerate(zip(self.rows, spans)):
            logits = scored[r: r + 1, lo - LO: hi - LO]  # (1, hi - lo, V)
            if self.suppress:
                logits = logits.clone()
                logits[..., self.suppress] = float("-inf")
            gen = self.ids[r: r + 1, g0:]  # (1, L) view: commits write through it
            if self._row_step(row, logits, gen, lo, hi):
                finished.append(row)
        if finished:
            ids = {id(row) for row in finished}
            self.drop(lambda row: id(row) in ids)
        return finished

    def _row_step(self, row: Row, logits: torch.Tensor, gen: torch.Tensor, lo: int, hi: int) -> bool:
        """``early_bird._run``'s step body for one row (batch size 1) on its scored logits (1, hi - lo, V);
        commits into ``gen`` (1, L). True when the row is finished (its output set)."""
        cfg, L, dev, mask_id = self.cfg, self.L, self.device, self.mask_id
        sampling = row.job.sampling
        masked = gen == mask_id  # (1, L): a running row is not done and has masks
        block = row.block[None]  # (1, L)
        select = not bool((block & masked).any())
        st = token_stats(logits)  # (1, hi - lo) each
        if hi - lo == L:
            top1, conf, ent, margin = st.top1, st.confidence, st.entropy, st.margin
        else:  # scatter the window into (1, L) tensors over the generation region
            top1, conf, ent, margin = (torch.zeros(1, L, dtype=x.dtype, device=dev) for x in st[:4])
            top1[:, lo:hi], conf[:, lo:hi], ent[:, lo:hi], margin[:, lo:hi] = st
        norm_ent = ent / math.log(logits.shape[-1])  # (1, L) H / log|V|
        if select:
            p = torch.sigmoid(self.lbs(norm_ent, self.embed(top1), masked))  # (1, L)
            new, _ = select_block(p, masked, top1, eos_ids=self.stops_list, l_min=cfg.l_min,
                                  fallback_block=cfg.block_size, g_max=cfg.g_max, gap_metric=cfg.gap_metric)
            row.block = new[0]  # (L,)
            block = new  # (1, L)
            row.block_no += 1
        cand = block & masked  # (1, L) B ∩ M
        cand_w = cand[:, lo:hi]  # (1, hi - lo)
        tok_w = st.top1 if row.generator is None else _draw_rows(logits, cand_w, st.top1, self.threshold, sampling,
                                                                 [row.generator], self.confidence, self.draw)
        tokens = torch.zeros(1, L, dtype=torch.long, device=dev)
        tokens[:, lo:hi] = tok_w
        kappa = _commit_confidence(logits, tok_w, cand_w, cfg.commit_confidence, sampling.temperature, lo, L)  # (1, L)
        p_lps = None
        if self.lps is not None:
            p_lps = torch.zeros(1, L, device=dev)
            # as decode: LPS cannot change A for a single candidate or when every one passes κ ≥ τ
            if int(cand.sum()) >= 2 and bool((cand & (kappa < cfg.tau)).any()):
                feats = lps_features(conf, norm_ent, margin, block, masked, cfg.pos_mode)  # (1, L, 5)
                index, ok = pack_rows(cand)  # (1, N) each
                x = feats.gather(1, index[..., None].expand(-1, -1, feats.shape[-1]))  # (1, N, 5)
                p = torch.sigmoid(self.lps(x, ok))  # (1, N)
                p_lps = torch.zeros(1, L, device=dev).scatter(1, index, torch.where(ok, p, 0.0))
        chosen = union_accept(kappa, p_lps, cand, cfg.tau, cfg.tau_psi if cfg.tau_psi is not None else 1.0)
        gen.copy_(torch.where(chosen, tokens, gen))
        resolved = not bool((block & (gen == mask_id)).any())
        if cfg.eos_early_stop:
            row.done |= bool(early_stop(gen, mask_id, self.stops)[0])
        elif resolved:
            row.done |= bool(early_stop(gen.clone(), mask_id, self.stops)[0])  # check only: no fill
        if row.job.stop and resolved:
            row.done |= bool(hit_stop_string(self.bundle, [list(row.job.prompt_ids)], gen, mask_id,
                                             tuple(row.job.stop))[0])
        report = row.job.max_new_tokens
        if report < L:  # positions from `report` on are never reported: stop once the rest is in
            row.done |= not bool((gen[:, :report] == mask_id).any())
        count = int(chosen.sum())
        row.commits.append(count)
        if self.on_step is not None:
            extra = {"block": row.block_no}
            if select:
                extra["selected"] = torch.nonzero(row.block).flatten().tolist()
            self.on_step(row, step_event(row.nfe, 0, chosen[0], tokens[0], 0, gen[0], mask_id, **extra))
        row.nfe += 1
        check_nfe(row.nfe, 2 * L, "early-bird")
        if row.done or not bool((gen == mask_id).any()):
            self._finish(row, gen[0])
            return True
        return False

    def _finish(self, row: Row, gen: torch.Tensor) -> None:
        """Set the row's output as ``decode`` reports it: gen (L,) cut at ``max_new_tokens`` and the first
        stop token; "length" when that fills ``max_new_tokens``, else "stop"."""
        row.tokens = until_stop(gen[: row.job.max_new_tokens].tolist(), set(self.stops_list) | {self.mask_id})
        row.finish = "length" if len(row.tokens) >= row.job.max_new_tokens else "stop"
        row.extra = {"decoder": "early-bird", "lps": self.lps is not None, "cache": self.cfg.cache, "steps": row.nfe,
                     "blocks": row.block_no + 1, "commits": list(row.commits),
                     "n_committed": int((gen != self.mask_id).sum())}

    # -- leaving ------------------------------------------------------------------------------

    def drop(self, pred) -> list[Row]:
        """Remove the rows for which ``pred(row)`` is true with their canvases, and the leading
        columns no remaining row uses. A batch left empty frees its canvases. Returns the removed rows."""
        gone, kept, idx = split_rows(self.rows, pred, self.device)  # idx (R',)
        if not gone:
            return []
        self.rows = kept
        if not self.rows:
            self._empty()
            return gone
        self.ids, self.pos, self.valid = take_canvas((self.ids, self.pos, self.valid), idx,
                                                     max(row.prompt_len + self.L for row in self.rows))  # (R', T') each
        return gone


__all__ = ["EarlyBirdBatch", "OPTIONS", "Row"]
