"""Continuous batching for semi-AR masked-diffusion decoding: rows join and leave at step
boundaries (issue 16; spec/diffusion.md §3, §4, §6–§9).

:class:`DiffusionBatch` holds one canvas per running row, ``[prompt | m^L]`` with the row's own
generation length L (``gen_length``, or its ``max_new_tokens`` rounded up to the block size, as
:meth:`~unmask.decode.diffusion.DiffusionConfig.from_options` gives it), and the row's own block
progress (block index, step inside the block, the block's mask count at its start). The canvases
are left-padded into one (R, T) tensor with a per-row key validity mask and explicit positions
(real tokens from 0), so a row's forward does not depend on its neighbours.

A step is ONE bidirectional forward over every running row: the one that row would get at that
point of ``diffusion.decode(bundle, [prompt], ...)``. With ``cache="none"`` that is a forward over
every whole canvas, the LM head on the columns [min w0, max e) that cover every row's current
block (plus the token before it for a shift-1 model). With Fast-dLLM's approximate caches
(``"prefix"`` / ``"dual"``, §8) each row keeps its own prefix (and, dual, suffix) K/V, right-aligned
in one set of per-layer tensors with a per-row validity mask; in one forward a row at a refresh
(its block start, or every ``refresh_every`` steps) feeds its whole canvas in WindowForward's
order ``[x[:w0] | x[w1:] | x[w0:w1]]`` ignoring its old K/V, while the other rows feed only their
windows against their kept K/V (queries right-aligned, padding masked); then each refreshed row's
kept K/V are gathered from the new columns. Each row then reads its own block's logits and
commits with diffusion.py's own pieces (``commit_rows``, ``llada_quota``, ``early_stop``,
``hit_stop_string``, ``until_stop``). Between forwards a row whose block has no masks left moves on
exactly as ``decode``'s block loop does: the stop-token and stop-string checks after the block, then
the next block or the end (its stop, its reported length, its last block).

Equality (STYLE.md 14): a row's tokens, NFE, ``row_extra`` and step events are those of
``diffusion.decode(bundle, [prompt], ...)`` on its prompt alone, whenever it joined and whatever
else runs, greedy and sampled: ``decode`` draws each row from its own seeded generator
(``Sampling.row_generators([prompt])``, recreated here for the row) and only for rows with masks,
so a row's draws do not depend on the batch. Rows with different sampling settings commit in
separate calls. Only the float summation order over masked padding keys differs from the
single-prompt run (as in a batched ``decode``).

Not supported (refused with a one-line UnmaskError): ``schedule="dream"`` and its
``alg``/``alg_temp``/``eps`` (no blocks), ``compile``/``static`` (the eager ``DynamicCache`` only),
the prefix/dual caches on remote-code models (as ``decode``), and remote-code models other than
Dream's (LLaDA's remote forward takes no positions, so left padding would shift a row's positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from unmask.decode.diffusion import (DEFAULT_BLOCK_SIZE, DiffusionConfig, commit_rows, early_stop, hit_stop_string,
                                     llada_quota, until_stop)
from unmask.decode.kv import DynamicKV
from unmask.decode.stats import check_nfe
from unmask.errors import UnmaskError
from unmask.models.adapters import bidirectional_forward, default_sampler, is_remote, realign, supports_cache
from unmask.serve.running import append_canvas, row_canvas, split_rows, take_canvas
from unmask.trace import step_event

OPTIONS = ("gen_length", "block_size", "policy", "gamma", "preset", "tau", "factor", "factor_compat",
           "tokens_per_step", "eta", "steps", "cache", "refresh_every", "eos_early_stop", "sampler",
           "confidence")
CACHES = ("none", "prefix", "dual")


@dataclass
class Row:
    """One running request.

    ``job`` is the scheduler's handle (``prompt_ids``, ``max_new_tokens``, ``sampling``, ``stop``);
    ``cfg`` its :class:`DiffusionConfig` (the batch's options with its own gen length); ``generator``
    its own (None when greedy). Block progress: ``block``, ``step`` (forwards in this block),
    ``n_start`` (the block's masks at its start). Once finished: ``tokens`` (cut before the first
    stop token and at ``max_new_tokens``), ``nfe`` (its forwards), ``finish`` ("stop" or "length")
    and ``extra`` (``decode``'s ``row_extra`` entry, plus ``n_committed``)."""

    job: object
    cfg: DiffusionConfig
    generator: torch.Generator | None
    report: int  # tokens reported: min(max_new_tokens, gen_length)
    block: int = 0
    step: int = 0
    n_start: int = 0
    done: bool = False  # decode's per-row ``done`` (early stop, stop token, stop string)
    nfe: int = 0
    commits: list[int] = field(default_factory=list)
    tokens: list[int] | None = None
    finish: str | None = None
    extra: dict | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.job.prompt_ids)

    @property
    def width(self) -> int:
        """The row's canvas length P + L."""
        return self.prompt_len + self.cfg.gen_length


class DiffusionBatch:
    """The running set of ``diffusion`` rows of one model and one set of diffusion options,
    advanced one forward at a time.

    options: the diffusion knobs every row shares (:data:`OPTIONS`; None = default), validated once
    by :meth:`DiffusionConfig.from_options`; per row (the job): prompt, ``max_new_tokens`` (which sets
    its gen length when ``gen_length`` is not given), ``sampling``, stop strings. ``stop_token_ids``
    defaults to the bundle's. ``on_step(row, event)`` gets each row's step event, the one
    ``diffusion.decode`` on that prompt alone emits (``row`` 0, ``step`` the row's own forward index,
    ``block``).

    ``join(jobs)`` adds rows (no forward: a row's first forward is its first step; returns [] since
    no row can finish before it); ``step()`` runs one forward for every running row and returns the
    rows that finished in it (removed); ``drop(pred)`` evicts rows (cancelled, timed out).
    Raises UnmaskError for a model without a mask token, an unknown or unsupported option
    (``schedule``, ``compile``, a cache on a remote-code model) or a bad value; ``join`` raises it for a job
    the options do not fit (empty prompt, canvas past the context window, a step budget that does
    not divide into its blocks, ``max_new_tokens`` above ``gen_length``) before adding any job.
    """

    def __init__(self, bundle, options: dict | None = None, on_step=None, *, stop_token_ids=None):
        if bundle.mask_token_id is None:
            raise UnmaskError("the diffusion decoder needs a masked-diffusion model with a mask token; "
                              "load it with mask_token_id=ID or name it in unmask_config.json")
        if is_remote(bundle.model) and bundle.meta.get("family") != "dream":
            raise UnmaskError("a continuous diffusion batch needs explicit positions per row; this checkpoint's "
                              "own model code takes none, so decode it with per-call diffusion batches")
        options = {k: v for k, v in dict(options or {}).items() if v is not None}
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise UnmaskError(f"option(s) {', '.join(unknown)} do not apply to a continuous diffusion batch "
                              f"(semi-AR blocks, eager forwards); use only {', '.join(OPTIONS)}")
        if str(options.get("cache", "none")) != "none" and not supports_cache(bundle):
            raise UnmaskError(f"cache {options['cache']!r} needs a transformers-native model; this checkpoint runs "
                              "its own model code, so use cache 'none'")
        if not isinstance(options.get("eos_early_stop", False), bool):
            raise UnmaskError(f"eos_early_stop must be true or false (got {options['eos_early_stop']!r})")
        options.setdefault("sampler", default_sampler(bundle))
        self.options = options
        # Validate once: a nominal length that fits any block size; per-row lengths are checked at join.
        nominal = options.get("gen_length") or options.get("block_size") or DEFAULT_BLOCK_SIZE
        self.cfg = DiffusionConfig.from_options(max_new_tokens=nominal if isinstance(nominal, int) else 1, **options)
        self.bundle, self.on_step = bundle, on_step
        self.device, self.mask_id, self.shift = bundle.device, bundle.mask_token_id, bundle.logit_shift
        ids = bundle.stop_token_ids if stop_token_ids is None else stop_token_ids
        self.stops = torch.tensor(sorted(set(ids)) or [-1], device=self.device)
        self.stop_set = set(self.stops.tolist()) | {self.mask_id}
        self.suppress = list(bundle.suppress_ids)
        self.confidence, self.draw = self.cfg.commit_confidence, ("gumbel" if self.cfg.sampler == "llada" else "categorical")
        self.rows: list[Row] = []
        self.forwards = 0
        self._empty()

    def _empty(self) -> None:
        self.ids: torch.Tensor | None = None  # (R, T) long: left-padded canvases
        self.pos: torch.Tensor | None = None  # (R, T) long: positions, real tokens from 0
        self.valid: torch.Tensor | None = None  # (R, T) bool: False on padding
        # prefix/dual caches: per layer (keys, values) (R, H, K, D) of each row's kept K/V, right-aligned
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.kept_valid: torch.Tensor | None = None  # (R, K) bool: the kept columns each row attends to

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def cache(self):
        """The rows' kept K/V (prefix/dual: per layer (keys, values) (R, H, K, D)); None with
        ``cache="none"`` and when no row has run a forward."""
        return self.kept

    @property
    def canvas(self) -> torch.Tensor | None:
        """The running canvases (R, T) long, left-padded; None when no row is running."""
        return self.ids

    # -- joining ------------------------------------------------------------------------------

    def _config(self, job) -> DiffusionConfig:
        """The job's config (the batch's options, its own gen length); UnmaskError when it does not fit."""
        prompt = list(job.prompt_ids)
        if not prompt:
            raise UnmaskError("every prompt needs at least one token (a Dream-style model scores position i from i-1)")
        cfg = DiffusionConfig.from_options(max_new_tokens=job.max_new_tokens, **self.options)
        if cfg.block_size != self.cfg.block_size:  # without --block-size a short request gets a shorter block
            raise UnmaskError(f"this request decodes with block size {cfg.block_size}, the running batch with "
                              f"{self.cfg.block_size}; give it a batch of its own (block_size={cfg.block_size})")
        if "gen_length" in self.options and isinstance(job.max_new_tokens, int) and job.max_new_tokens > cfg.gen_length:
            raise UnmaskError(f"max_new_tokens {job.max_new_tokens} exceeds gen length {cfg.gen_length}; lower "
                              "--max-new-tokens or raise --gen-length")
        if len(prompt) + cfg.gen_length > self.bundle.context_length:
            raise UnmaskError(f"prompt ({len(prompt)} tokens) + gen length {cfg.gen_length} exceeds the context "
                              f"window of {self.bundle.context_length}; lower --gen-length or --max-new-tokens")
        return cfg

    @torch.inference_mode()
    def join(self, jobs: list) -> list[Row]:
        """Add each job as a row at block 0 of its canvas ``[prompt | m^L]`` (no forward). Every job is
        validated first, so a bad one adds none. Returns [] (no row finishes before its first step)."""
        cfgs = [self._config(job) for job in jobs]
        dev = self.device
        for job, cfg in zip(jobs, cfgs):
            gens = job.sampling.row_generators([list(job.prompt_ids)], dev)  # the generator decode gives it
            row = Row(job=job, cfg=cfg, generator=None if gens is None else gens[0],
                      report=min(job.max_new_tokens, cfg.gen_length), n_start=cfg.block_size)
            canvas = row_canvas(job.prompt_ids, cfg.gen_length, self.mask_id, dev)  # (1, C) each, C = row.width
            if not self.rows:
                self.ids, self.pos, self.valid = canvas
            else:
                self.ids, self.pos, self.valid = append_canvas((self.ids, self.pos, self.valid), canvas,
                                                               self.bundle.pad_token_id)  # (R + 1, T) each
            if self.kept is not None:  # no kept K/V yet: its first forward is a refresh
                self.kept = [tuple(torch.cat([t, t.new_zeros((1, *t.shape[1:]))]) for t in kv) for kv in self.kept]
                self.kept_valid = torch.cat([self.kept_valid, self.kept_valid.new_zeros(1, self.kept_valid.shape[1])])
            self.rows.append(row)
        return []

    # -- stepping -----------------------------------------------------------------------------

    def _gen_start(self, r: int) -> int:
        """Column of row r's first generated position in the (R, T) canvas."""
        row = self.rows[r]
        return self.ids.shape[1] - row.cfg.gen_length

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One forward over every running row (diffusion.md §3 step 2.2.1, no cache): each row commits
        in its current block with the shared policy, then rows whose block is complete move on or
        finish (§9 stop rules, as ``decode``). Returns the finished rows, already removed, with
        ``tokens``, ``nfe``, ``finish`` and ``extra`` set."""
        if not self.rows:
            return []
        Bk, shift, dev, mask_id = self.cfg.block_size, self.shift, self.device, self.mask_id
        R = len(self.rows)
        starts = [self._gen_start(r) + row.block * Bk for r, row in enumerate(self.rows)]  # block start columns
        if self.cfg.cache == "none":
            lo, hi = min(starts) - shift, max(starts) + Bk
            raw = bidirectional_forward(self.bundle, self.ids, position_ids=self.pos, key_valid=self.valid,
                                        rows=(lo, hi))  # (R, hi - lo, V)
            first = torch.tensor(starts, device=dev) - shift - lo  # (R,) each row's window in raw
        else:
            raw, first = self._cached_forward()
        self.forwards += 1
        at = first[:, None] + torch.arange(shift + Bk, device=dev)  # (R, shift + Bk)
        win = raw.gather(1, at[:, :, None].expand(R, shift + Bk, raw.shape[2]))  # (R, shift + Bk, V)
        logits = realign(win, shift)[:, shift:].clone()  # (R, Bk, V): index j scores the row's block start + j
        if self.suppress:
            logits[..., self.suppress] = float("-inf")
        cols = torch.tensor(starts, device=dev)[:, None] + torch.arange(Bk, device=dev)  # (R, Bk)
        block = self.ids.gather(1, cols)  # (R, Bk)
        masked = block == mask_id  # (R, Bk): running rows always have masks in their block
        quota = None
        if self.cfg.steps is not None:
            quota = torch.cat([llada_quota(torch.tensor([row.n_start], device=dev),
                                           row.cfg.steps // row.cfg.n_blocks, row.step) for row in self.rows])  # (R,)
        chosen, tokens = self._commit(logits, masked, quota)  # (R, Bk) each
        self.ids.scatter_(1, cols, torch.where(chosen, tokens, block))
        for r, row in enumerate(self.rows):
            g0 = self._gen_start(r)
            count = int(chosen[r].sum())
            row.commits.append(count)
            if self.on_step is not None:
                gen = self.ids[r, g0:]  # (L,)
                self.on_step(row, step_event(row.nfe, 0, chosen[r], tokens[r], row.block * Bk, gen, mask_id,
                                             block=row.block))
            row.nfe += 1
            check_nfe(row.nfe, row.cfg.gen_length + row.cfg.n_blocks, "diffusion")
            row.step += 1
            if row.cfg.eos_early_stop:
                row.done |= bool(early_stop(self.ids[r: r + 1, g0:], mask_id, self.stops)[0])
        finished = [row for r, row in enumerate(self.rows) if self._advance(r)]
        if finished:
            ids = {id(row) for row in finished}
            self.drop(lambda row: id(row) in ids)
        return finished

    def _cached_forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the prefix/dual caches (diffusion.md §8, :class:`~unmask.decode.dllm_cache.WindowForward`'s
        layout) for every row at its own phase: a row at a refresh (its block's first step, or every
        ``refresh_every``) feeds its whole canvas as ``[x[:w0] | x[w1:] | x[w0:w1]]`` and ignores its
        kept K/V; any other row feeds its window x[w0:w1] against its kept K/V. Queries are
        right-aligned in (R, Q), padding masked as keys. Afterwards each refreshed row keeps the K/V of
        its prefix (and, dual, suffix); the others keep theirs. Returns the raw logits (R, n, V) of a
        column range and (R,) each row's first scored column in it (its window starts the scored rows)."""
        Bk, shift, dev = self.cfg.block_size, self.shift, self.device
        R, T = self.ids.shape
        plans = []  # per row: (canvas columns fed, in order; window length; refresh)
        for r, row in enumerate(self.rows):
            C, off = row.width, T - row.width
            w0 = row.prompt_len + row.block * Bk - shift
            w1 = w0 + shift + Bk if row.cfg.cache == "dual" else C
            every = row.cfg.refresh_every
            refresh = row.step == 0 or (every is not None and row.step % every == 0)
            order = [*range(w0), *range(w1, C), *range(w0, w1)] if refresh else list(range(w0, w1))
            plans.append(([off + c for c in order], w1 - w0, refresh))
        Q = max(len(cols) for cols, _, _ in plans)
        cols = torch.zeros(R, Q, dtype=torch.long, device=dev)  # (R, Q) canvas column of each query
        q_valid = torch.zeros(R, Q, dtype=torch.bool, device=dev)  # (R, Q)
        for r, (c, _, _) in enumerate(plans):
            cols[r, Q - len(c):] = torch.tensor(c, dtype=torch.long, device=dev)
            q_valid[r, Q - len(c):] = True
        refreshing = torch.tensor([p[2] for p in plans], device=dev)  # (R,)
        kv = DynamicKV(self.bundle.model)
        K = 0
        if self.kept is not None:
            K = self.kept_valid.shape[1]
            for i, (k, v) in enumerate(self.kept):
                kv.cache.update(k, v, i)
        kept_valid = (self.kept_valid & ~refreshing[:, None]) if K else q_valid[:, :0]  # (R, K)
        key_valid = torch.cat([kept_valid, q_valid], dim=1)  # (R, K + Q)
        firsts = [Q - n for _, n, _ in plans]  # each row's window start among the queries
        lo, hi = min(firsts), max(firsts) + shift + Bk
        raw = bidirectional_forward(self.bundle, self.ids.gather(1, cols), position_ids=self.pos.gather(1, cols),
                                    key_valid=key_valid, cache=kv.cache, rows=(lo, hi))  # (R, hi - lo, V)
        keep = []  # per row: the cache columns (of K + Q) it keeps
        for r, (c, n, refresh) in enumerate(plans):
            keep.append(list(range(K + Q - len(c), K + Q - n)) if refresh
                        else torch.nonzero(self.kept_valid[r]).flatten().tolist())
        K2 = max(len(k) for k in keep)
        idx = torch.zeros(R, K2, dtype=torch.long, device=dev)  # (R, K2) right-aligned kept columns
        self.kept_valid = torch.zeros(R, K2, dtype=torch.bool, device=dev)  # (R, K2)
        for r, k in enumerate(keep):
            if k:
                idx[r, K2 - len(k):] = torch.tensor(k, dtype=torch.long, device=dev)
                self.kept_valid[r, K2 - len(k):] = True
        layers = [(layer.keys, layer.values) for layer in kv.cache.layers]  # (R, H, K + Q, D) each
        H, D = layers[0][0].shape[1], layers[0][0].shape[3]
        at = idx[:, None, :, None].expand(R, H, K2, D)  # (R, H, K2, D)
        self.kept = [(k.gather(2, at), v.gather(2, at)) for k, v in layers]  # (R, H, K2, D) each
        return raw, torch.tensor(firsts, device=dev) - lo

    def _commit(self, logits, masked, quota):
        """``commit_rows`` per group of rows sharing a sampling setting, each row with its own generator."""
        groups: dict = {}
        for r, row in enumerate(self.rows):
            groups.setdefault(row.job.sampling, []).append(r)
        if len(groups) == 1:
            sampling = self.rows[0].job.sampling
            gens = None if sampling.greedy else [row.generator for row in self.rows]
            return commit_rows(logits, masked, self.cfg.policy, sampling, gens, quota, self.confidence, self.draw)
        chosen, tokens = torch.zeros_like(masked), torch.zeros(masked.shape, dtype=torch.long, device=masked.device)
        for sampling, idx in groups.items():
            at = torch.tensor(idx, dtype=torch.long, device=masked.device)  # (n,)
            gens = None if sampling.greedy else [self.rows[r].generator for r in idx]
            c, t = commit_rows(logits[at], masked[at], self.cfg.policy, sampling, gens,
                               None if quota is None else quota[at], self.confidence, self.draw)  # (n, Bk) each
            chosen[at], tokens[at] = c, t
        return chosen, tokens

    def _advance(self, r: int) -> bool:
        """Row r after a forward: while its block holds no masks (or it is done), apply decode's end of
        block (stop tokens unless early stop, stop strings) and move to the next block; True (row
        finished, its output set) at a stop, its reported length or its last block."""
        row, Bk = self.rows[r], self.cfg.block_size
        g0 = self._gen_start(r)
        gen = self.ids[r, g0:]  # (L,)
        while True:
            s = row.block * Bk
            if not row.done and bool((gen[s: s + Bk] == self.mask_id).any()):
                return False
            e = s + Bk
            if not row.cfg.eos_early_stop:
                row.done |= bool(torch.isin(gen[:e], self.stops).any())
            if row.job.stop:
                row.done |= bool(hit_stop_string(self.bundle, [list(row.job.prompt_ids)], gen[None, :e], self.mask_id,
                                                 tuple(row.job.stop))[0])
            if row.done or e >= row.report or row.block + 1 == row.cfg.n_blocks:
                self._finish(row, gen)
                return True
            row.block += 1
            row.step = 0
            row.n_start = int((gen[e: e + Bk] == self.mask_id).sum())

    def _finish(self, row: Row, gen: torch.Tensor) -> None:
        """Set the row's output as ``decode`` reports it: gen (L,) cut at the reported length and the
        first stop token; "length" when that fills ``max_new_tokens``, else "stop"."""
        row.tokens = until_stop(gen[: row.report].tolist(), self.stop_set)
        row.finish = "length" if len(row.tokens) >= row.job.max_new_tokens else "stop"
        row.extra = {"policy": row.cfg.policy.name, "cache": row.cfg.cache, "steps": row.nfe,
                     "commits": list(row.commits), "n_committed": int((gen != self.mask_id).sum())}

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
                                                     max(row.width for row in self.rows))  # (R', T') each
        if self.kept is not None:  # the kept K/V are right-aligned: cut the columns no remaining row keeps
            self.kept_valid = self.kept_valid[idx]  # (R', K)
            cut = self.kept_valid.shape[1] - int(self.kept_valid.sum(dim=1).max())
            self.kept_valid = self.kept_valid[:, cut:]  # (R', K')
            self.kept = [(k[idx, :, cut:], v[idx, :, cut:]) for k, v in self.kept]  # (R', H, K', D) each
        return gone


__all__ = ["CACHES", "DiffusionBatch", "OPTIONS", "Row"]
