"""The diffusion decoder as one running batch (DESIGN.md "One engine"; spec/diffusion.md §3, §6–§9):
``decode(decoder="diffusion")``, its static/compiled fast path and the server all run :class:`Diffusion`
(built by :func:`batch`, the registry's factory).

Each row has its own canvas (a :class:`~unmask.decode.dllm.cache.SlotCanvas` slot), block progress
and seeded generator, so it decodes as it would alone, whenever it joined. A step is ONE forward
for every running row, the commit policy (:func:`unmask.policies.commit`, a pure tensor function)
on each row's block, and one host read of the per-row counts, flags and block ids (and, with
``on_step``, what the step events show: they are built from that read); a row whose
block has no masks then takes decode's end of block (stop ids, stop strings) and moves on or
finishes. ``lockstep=True`` (decode) moves the rows of one ``join`` block by block together, as
decode's batch always has (same tokens; decode's batch NFE and step numbering).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unmask.decode.dllm.cache import SlotCanvas, check_fast_path
from unmask.decode.dllm.canvas import CanvasBatch, CanvasRow, canvas_width, check_canvas, check_mask_token, early_stop
from unmask.decode.dllm.diffusion import CANVAS_HINT, DEFAULT_BLOCK_SIZE, DiffusionConfig, DiffusionOptions, llada_quota
from unmask.decode.dllm.dream import DreamSchedule
from unmask.decode.engine.host import HostRead
from unmask.decode.engine.registry import Spec
from unmask.decode.engine.running import Request, group_by
from unmask.decode.engine.stats import check_nfe
from unmask.errors import UnmaskError
from unmask.models.adapters import is_remote, realign, supports_cache
from unmask.policies import commit


@dataclass(eq=False)
class DiffusionRow(CanvasRow):
    """A running row plus its block progress: ``cfg`` (its gen length), ``block``, ``step`` (forwards
    in the block), ``cohort`` (its join, for lockstep), ``complete`` (its block is done), ``done`` (a
    stop seen) and ``more`` (its block has masks, from the last step's read); a block not reached
    yet is masks in ``gen``."""

    cfg: DiffusionConfig = None
    block: int = 0
    step: int = 0
    cohort: int = 0
    complete: bool = False
    done: bool = False
    more: bool = True


class Diffusion(CanvasBatch):
    """Semi-AR masked-diffusion decoding as a running batch (``decode/engine/running.py``'s contract).

    cfg: the resolved knobs every row shares; a row's gen length is ``cfg.gen_length``, or with
    ``options`` (the server) the one ``options.resolve(bundle, max_new_tokens)`` gives its request.
    ``width``: the canvas width to allocate (grows on join unless static; ``length``: static, it
    grows up to that many columns, see :class:`SlotCanvas`). ``stop_token_ids`` (None: the
    bundle's); ``on_step(row, event)`` step events (lockstep: the batch forward index and the
    request id as row, else the row's own forward index and row 0); ``on_forward(state)`` (tests)
    before each commit; ``reference_steps`` runs LLaDA's zero-quota steps. ``static``/``compile``
    run the forwards on the preallocated cache / compiled (every forward then covers all
    ``capacity`` slots; with ``length``, the row bucket). Raises UnmaskError for a model without a
    mask token and for fast-path options the model cannot run; ``join`` for a request that does
    not fit.
    """

    def __init__(self, bundle, cfg: DiffusionConfig, *, static=False, compile=False, capacity=8, on_step=None,
                 on_token=None, stop_token_ids=None, lockstep=False, width=0, reference_steps=False,
                 on_forward=None, options: DiffusionOptions | None = None, length: int | None = None):
        check_mask_token(bundle, "diffusion")
        check_fast_path(bundle, static, compile, "the diffusion decoder")
        super().__init__(bundle, cfg, block=cfg.block_size, width=max(width, 1), capacity=capacity, static=static,
                         compile=compile, on_step=on_step, on_forward=on_forward, lockstep=lockstep,
                         stop_token_ids=stop_token_ids, length=length)
        self.options, self.reference, self._cohorts = options, reference_steps, 0
        self._fast = dict(static=static, compile=compile, length=length)

    # -- joining ------------------------------------------------------------------------------------

    def _config(self, job) -> DiffusionConfig:
        """The request's config; UnmaskError when it does not fit."""
        cfg = self.cfg
        if self.options is not None:
            cfg = self.options.resolve(self.bundle, job.max_new_tokens)
            if cfg.block_size != self.cfg.block_size:  # without --block-size a short request gets a shorter block
                raise UnmaskError(f"this request decodes with block size {cfg.block_size}, the running batch with "
                                  f"{self.cfg.block_size}; give it a batch of its own (block_size={cfg.block_size})")
        check_canvas(self.bundle, len(job.prompt_ids), cfg.gen_length, CANVAS_HINT)
        return cfg

    @torch.inference_mode()
    def join(self, requests: list[Request]) -> list[DiffusionRow]:
        """Place each request's canvas at block 0 of a free slot (no forward: a row's first forward
        is its first step). Every request is validated first, so a bad one adds none. Returns []."""
        opts = self.options
        if opts is not None and opts.block_size is None and requests and not self.running:
            # a server batch without --block-size decodes with its first request's (the batch key pins it)
            first = opts.resolve(self.bundle, requests[0].max_new_tokens)
            if first.block_size != self.cfg.block_size:
                self.cfg = first
                self.canvas = SlotCanvas(self.bundle, first.cache, self.slots.capacity, 1, first.block_size,
                                         **self._fast)
        cfgs = {id(job): self._config(job) for job in requests}
        self._cohorts += 1

        def row(job, slot, generator):
            cfg = cfgs[id(job)]
            return DiffusionRow(job=job, slot=slot, cfg=cfg, generator=generator, cohort=self._cohorts,
                                report=min(job.max_new_tokens, cfg.gen_length),
                                gen=[self.bundle.mask_token_id] * cfg.gen_length)

        return self._place(requests, row)

    # -- stepping -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[DiffusionRow]:
        """One forward for every running row; returns the rows that finished in it (removed), with
        ``tokens``, ``nfe``, ``finish``, ``stop_token`` and ``extra`` set."""
        if not self.running:
            return []
        cfg, canvas, dev, mask_id = self.cfg, self.canvas, self.bundle.device, self.bundle.mask_token_id
        Bk, sh, T = cfg.block_size, self.bundle.logit_shift, canvas.width
        n = self._covered()
        rows = [self.running.get(s) for s in range(n)]  # None: a free slot, carried along
        active = [r is not None and not (r.complete and self.lockstep) for r in rows]
        starts = [T - r.cfg.gen_length + r.block * Bk if r is not None else T - Bk for r in rows]  # block columns
        every = cfg.refresh_every
        refresh = [a and (r.step == 0 or (every is not None and r.step % every == 0)) for r, a in zip(rows, active)]
        logits = realign(canvas.forward(n, starts, refresh, active), sh)[:, sh:].clone()  # (n, Bk, V): j scores start + j
        if self.suppress:
            logits[..., self.suppress] = float("-inf")
        logits, raw = self.shaping.shape(rows, logits)  # (n, Bk, V) each: biased, and raw for logprobs
        cols = torch.tensor(starts, device=dev)[:, None] + torch.arange(Bk, device=dev)  # (n, Bk)
        block = canvas.ids[:n].gather(1, cols)  # (n, Bk)
        live = torch.tensor(active, device=dev) & ~self.done[:n]  # (n,)
        masked = (block == mask_id) & live[:, None]  # (n, Bk)
        quota = None
        if cfg.steps is not None:  # LLaDA's schedule: each row's own steps per block (its gen length's blocks)
            steps = torch.tensor([0 if r is None else r.step for r in rows], device=dev)  # (n,)
            per_block = torch.tensor([1 if r is None else r.cfg.steps // r.cfg.n_blocks for r in rows], device=dev)
            quota = llada_quota(torch.full_like(steps, Bk), per_block, steps)  # (n,)
        # the rows with masks, known from the last read: only they draw, with no read to find them
        draws = [r for r, row in enumerate(rows) if active[r] and row.more]
        chosen, tokens = self._commit(rows, logits, masked, quota, draws)  # (n, Bk) each
        if self.on_forward is not None:
            first = next(r for r, a in zip(rows, active) if a)
            self.on_forward({"nfe": self.forwards, "block": first.block, "step": first.step, "start": first.block * Bk,
                             "refresh": any(refresh), "canvas": canvas.ids[:n].clone(), "logits": logits,
                             "masked": masked, "chosen": chosen, "tokens": tokens})
        canvas.ids[:n].scatter_(1, cols, torch.where(chosen, tokens, block))
        gen_cols = torch.arange(T, device=dev)[None, :] >= torch.tensor(
            [T - (r.cfg.gen_length if r else Bk) for r in rows], device=dev)[:, None]  # (n, T) generated columns
        had = masked.any(dim=1)  # (n,)
        if cfg.eos_early_stop:
            self.done[:n] |= early_stop(canvas.ids[:n], mask_id, self.stops, gen_cols) & had
        left = ((canvas.ids[:n].gather(1, cols) == mask_id) & ~self.done[:n, None]).any(dim=1)  # (n,)
        ended = (torch.isin(canvas.ids[:n], self.stops) & gen_cols & (torch.arange(T, device=dev) < cols[:, -1:] + 1)
                 ).any(dim=1)  # (n,) a stop id at or before the block's end
        committed = ((canvas.ids[:n] != mask_id) & gen_cols).sum(dim=1)  # (n,)
        # the step's one host sync: the rows' bookkeeping and block ids (with on_step, what its events show)
        host = HostRead().add("count", chosen.sum(dim=1)).add("had", had).add("more", left).add("done", self.done[:n])
        host.add("stop", ended).add("committed", committed).add("block", canvas.ids[:n].gather(1, cols))
        Lmax = max(r.cfg.gen_length if r else Bk for r in rows)
        if self.on_step is not None:
            host.add("chosen", chosen).add("tokens", tokens).add("gen", canvas.ids[:n, T - Lmax:])
        self.shaping.add(host, rows, lambda: (raw, tokens, chosen, [0 if r is None else r.block * Bk for r in rows]))
        got = host.read()
        self.forwards += 1
        for r, row in enumerate(rows):
            if row is None or not active[r]:
                continue
            was, more, done = got["had"][r], got["more"][r], got["done"][r]
            row.extra["n_committed"] = got["committed"][r]
            row.gen[row.block * Bk: (row.block + 1) * Bk] = got["block"][r]
            self.shaping.take(row, got, r)
            row.more = bool(more)
            if was:
                row.commits.append(got["count"][r])
                if self.on_step is not None:
                    self._event(row, self.forwards - 1, got["chosen"][r], got["tokens"][r], row.block * Bk,
                                got["gen"][r][Lmax - row.cfg.gen_length:], block=row.block)
            row.nfe += int(bool(was) or (self.reference and not done))
            row.step += 1
            check_nfe(row.nfe, max(row.cfg.gen_length, row.cfg.steps or 0) + row.cfg.n_blocks, "diffusion")
            row.done = bool(done)
            pending = self.reference and cfg.steps is not None and row.step < row.cfg.steps // row.cfg.n_blocks
            row.complete = not more and not pending
            if row.complete and not cfg.eos_early_stop:
                row.done |= bool(got["stop"][r])
        return self._advance()

    def _commit(self, rows, logits, masked, quota, draws):
        """:func:`unmask.policies.commit` per group of rows sharing a sampling setting, each sampled row
        with its generator; ``draws``: the row indices with masks (the only ones that draw)."""
        groups = group_by(((r, row) for r, row in enumerate(rows) if row is not None), lambda row: row.job.sampling)
        if len(groups) == 1:  # the whole batch at once: free slots have no masks, so they commit nothing
            groups = {next(iter(groups)): list(range(len(rows)))}
        kw = dict(confidence=self.cfg.commit_confidence, validate=False,
                  sampling="gumbel" if self.cfg.sampler == "llada" else "categorical")
        chosen = torch.zeros_like(masked)
        tokens = torch.zeros(masked.shape, dtype=torch.long, device=masked.device)
        for s, idx in groups.items():
            at = torch.tensor(idx, dtype=torch.long, device=masked.device)  # (m,)
            pick = (lambda t: t) if len(idx) == len(rows) else (lambda t: t[at])  # no copy of the whole logits
            gens = None if s.greedy else [None if rows[r] is None else rows[r].generator for r in idx]
            c, t = commit(pick(logits), pick(masked), self.cfg.policy, temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, generator=gens, quota=None if quota is None else pick(quota),
                          draws=[i for i, r in enumerate(idx) if r in draws], **kw)  # (m, Bk) each
            chosen[at], tokens[at] = c, t
        return chosen, tokens

    def _advance(self) -> list[DiffusionRow]:
        """Rows whose block is complete (lockstep: every row of their join) take decode's end of block:
        stop strings, then finish (a stop, the reported length, the last block) or the next block."""
        busy = {row.cohort for row in self.running.values() if not row.complete}  # joins with a block to go
        finished = []
        for row in self.rows:
            if not row.complete or (self.lockstep and row.cohort in busy):
                continue
            e = (row.block + 1) * self.cfg.block_size
            if row.job.stop and not row.done:
                row.done = self._stop_hit(row, row.gen[:e])
            if row.done or e >= row.report or row.block + 1 == row.cfg.n_blocks:
                finished.append(row)
            else:  # a block not reached yet holds masks only (commits and early-stop fills stay in reached ones)
                row.block, row.step, row.complete, row.more = row.block + 1, 0, False, True
        if finished:
            self._finish(finished)
        return finished

    def _row_extra(self, row: DiffusionRow) -> dict:
        return {"policy": row.cfg.policy.name, "cache": row.cfg.cache, "steps": row.nfe, "commits": list(row.commits),
                "n_committed": row.extra["n_committed"]}

    def stats_extra(self, rows: list[DiffusionRow]) -> dict:
        """decode's ``stats.extra`` for finished rows in request order (:meth:`CanvasBatch._extra`)."""
        cfg = self.cfg
        return self._extra(rows, {"policy": cfg.policy.name, "cache": cfg.cache, "gen_length": cfg.gen_length,
                                  "block_size": cfg.block_size, "sampler": cfg.sampler,
                                  "confidence": cfg.confidence or "untempered"}, ("policy", "cache", "steps", "commits"))


def batch(bundle, cfg: DiffusionOptions, *, capacity: int = 64, prompts=None, max_new_tokens=None, compile=False,
          static=False, on_step=None, on_token=None, on_forward=None, stop_token_ids=None):
    """The running batch of ``cfg`` (:attr:`Spec.batch`): Dream's schedule
    (:class:`~unmask.decode.dllm.dream.DreamSchedule`) when ``cfg`` asks for it, else :class:`Diffusion`.

    ``prompts`` given (``decode()``): one batch for them, every row with the config of
    ``max_new_tokens`` (gen_length defaults to it rounded up to the block size; the tokens are cut
    to it and decoding ends after the block holding the last reported position), blocks advancing
    in lockstep, canvases as wide as the longest prompt (on the fast path rounded up,
    :func:`~unmask.decode.dllm.cache.prompt_width`). A row stops after the block in which it
    committed a stop id, reporting the tokens before it (§9); with ``eos_early_stop`` as soon as
    every position before its first stop id is committed (the rest filled with it, counted in
    ``n_committed``); stop strings end a row after its block. NFE counts forwards (block-start
    refreshes included, §10), per row those in which it had masks; LLaDA's zero-quota steps are
    skipped unless ``reference_steps``. ``stats_extra``: policy, cache, gen_length, block_size,
    sampler, confidence, ``accepts``, ``n_committed``, ``row_extra`` {policy, cache, steps,
    commits}, ``compiled``, ``static_cache``. ``static`` / ``compile``: the preallocated cache,
    eagerly / compiled (same tokens and NFE up to float rounding).

    None (the server): rows join and leave at any step, each with its own gen length; ``compile``
    (``serve --compile``) runs the dual cache's window steps on a static cache of the context
    window, compiled (a new shape eagerly until the idle server compiles it; refreshes eagerly,
    :meth:`SlotCanvas._split`); the prefix cache (its window shrinks block by block: many shapes),
    no cache and Dream's schedule stay eager: compiled, they measured slower under load
    (benchmarks/results/). Raises UnmaskError for a model without a mask token, bad options,
    ``compile`` / ``static`` with Dream's schedule or on a remote-code model, ``reference_steps``
    or a remote-code model other than Dream's (no positions per row) in a server's batch, or a
    prompt whose canvas does not fit."""
    check_mask_token(bundle, "diffusion")
    if not isinstance(cfg.reference_steps, bool):
        raise UnmaskError(f"reference_steps must be true or false (got {cfg.reference_steps!r}); pass --reference-nfe "
                          "to generate, which sets it")
    if prompts is not None and cfg.dreams and (compile or static):
        raise UnmaskError("compile/static do not apply to --schedule dream (Dream's own loop runs eagerly); "
                          "drop --compile or use the semi-AR diffusion schedule")
    if prompts is None and is_remote(bundle.model) and bundle.meta.get("family") != "dream":
        raise UnmaskError("a continuous diffusion batch needs explicit positions per row; this checkpoint's "
                          "own model code takes none, so decode it with per-call diffusion batches")
    if cfg.dreams:
        dream = cfg.dream()
        if prompts is None:
            return DreamSchedule(bundle, dream, capacity=capacity, on_step=on_step, stop_token_ids=stop_token_ids)
        L = max_new_tokens if dream.gen_length is None else dream.gen_length
        for p in prompts:  # before the canvases are allocated
            dream.plan(bundle, len(p), max_new_tokens)
        return DreamSchedule(bundle, dream, capacity=capacity, on_step=on_step, stop_token_ids=stop_token_ids,
                             width=max(map(len, prompts), default=0) + L, lockstep=True, on_forward=on_forward)
    if prompts is None:
        if cfg.reference_steps:
            raise UnmaskError("reference_steps does not apply to a continuous diffusion batch; decode it per call")
        if cfg.cache not in (None, "none") and not supports_cache(bundle):
            raise UnmaskError(f"cache {cfg.cache!r} needs a transformers-native model; this checkpoint runs "
                              "its own model code, so use cache 'none'")
        # validated once on a nominal length that fits any block size; per-row lengths are checked at join
        nominal = cfg.gen_length or cfg.block_size or DEFAULT_BLOCK_SIZE
        nominal = nominal if isinstance(nominal, int) and nominal >= 1 else 1  # a bad block size: reported as such
        rc = cfg.resolve(bundle, nominal)
        fast = {"compile": True, "length": bundle.context_length} if compile and rc.cache == "dual" else {}
        return Diffusion(bundle, rc, capacity=capacity, on_step=on_step, stop_token_ids=stop_token_ids, options=cfg,
                         **fast)
    check_fast_path(bundle, static, compile, "the diffusion decoder")
    rc = cfg.resolve(bundle, max_new_tokens)
    rc.warn_degenerate()
    width = canvas_width(bundle, prompts, rc.gen_length, CANVAS_HINT, static or compile)
    return Diffusion(bundle, rc, static=static, compile=compile, capacity=capacity, on_step=on_step,
                     stop_token_ids=stop_token_ids, lockstep=True, width=width, reference_steps=cfg.reference_steps,
                     on_forward=on_forward)


SPEC = Spec("diffusion", DiffusionOptions, batch=batch, kinds=("masked-diffusion",), compiles=True,
            summary="semi-AR masked diffusion: LLaDA top-k steps, Fast-dLLM threshold/factor, EB; "
                    "approximate prefix/dual caches")

__all__ = ["Diffusion", "DiffusionRow", "SPEC", "batch"]
