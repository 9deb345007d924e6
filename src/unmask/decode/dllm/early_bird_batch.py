"""Early-Bird decoding as one running batch (DESIGN.md "One engine"; spec/early_bird.md §5–§6, §9):
``decode(decoder="early-bird")``, its static/compiled fast path and the server all run :class:`EarlyBird`
(built by :func:`batch`, the registry's factory); the algorithm is :mod:`unmask.decode.dllm.early_bird`'s.

Each row has its own canvas slot (its generation region is the canvas's last L columns, L the LBS
router's), active block and generator. A step is ONE forward for every running row (a row without
a block scores its whole region: with a cache, its own refresh; the others their block's window),
then the routers and the commit rule batched over the rows, and one host sync for the rows'
bookkeeping. ``lockstep=True`` (decode) runs each router once over every row that needs it and
numbers step events by the batch forward and the request id; otherwise (the server) each row runs
the routers alone, with exactly the shapes of its decode alone, and events count its own forwards.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from unmask.decode.dllm.canvas import CanvasBatch, CanvasRow, canvas_width, check_canvas, early_stop
from unmask.decode.dllm.early_bird import CANVAS_HINT, EarlyBirdConfig, EarlyBirdOptions, check_max_new_tokens
from unmask.decode.dllm.eb_select import (PATH_NAMES, commit_confidence, draw_rows, lps_features, pack_rows,
                                          select_block, union_accept)
from unmask.decode.engine.host import HostRead
from unmask.decode.engine.registry import Spec
from unmask.decode.engine.running import Request, group_by
from unmask.decode.engine.stats import check_nfe
from unmask.errors import UnmaskError
from unmask.models.adapters import is_remote
from unmask.policies import Threshold, token_stats


def _sync(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextmanager
def _eval(*nets):
    """The routers in eval mode for a step, their modes restored after (a caller's router may be training)."""
    modes = [(net, net.training) for net in nets if net is not None]
    for net, _ in modes:
        net.eval()
    try:
        yield
    finally:
        for net, was in modes:
            net.train(was)


@dataclass(eq=False)
class EarlyBirdRow(CanvasRow):
    """A running row plus its router state: ``has_block`` (an active block with masks), ``window``
    [lo, hi) (generated positions its next forward scores), ``blocks`` (selections), ``sizes`` /
    ``paths`` (of its selections) and ``lps_only``."""

    has_block: bool = False
    window: tuple[int, int] = (0, 0)
    blocks: int = 0
    sizes: int = 0
    paths: list[str] = field(default_factory=list)
    lps_only: int = 0


class EarlyBird(CanvasBatch):
    """EB-Decode as a running batch (``decode/engine/running.py``'s contract).

    cfg: :meth:`EarlyBirdOptions.resolve`'s (routers included; each step runs them in eval mode).
    ``width``: the canvas width to allocate (grows on join unless static). ``stop_token_ids`` (None:
    the bundle's; the LBS filter's EOS set too, reading #4); ``on_step(row, event)``, with ``block``
    (the row's block counter) and, on selection steps, ``selected`` (the block's positions);
    ``on_forward(state)`` (trace collection, tests) after every commit with the (n, L) tensors
    ``masked`` (before), ``block``, ``cand``, ``features`` (n, L, 5), ``top1``, ``kappa``, ``p_lps``,
    ``chosen``, ``tokens``, ``canvas`` (after), ``selected`` / ``path`` (n,), ``ids`` (each
    slot's request id, -1 for a free slot) and ``logits`` (n, HI - LO, V), the forward's as the routers
    and the rule read them (column j scores generated position ``window[0] + j``). A row's
    ``logit_bias`` is added before the routers and the commit rule read the logits; with ``logprobs``
    its finished row has them (commit-time, :mod:`unmask.decode.blocks.commit_shaping`). ``static``/``compile``: the preallocated cache /
    compiled forwards (every forward then covers all ``capacity`` slots; routers and the commit
    rule stay eager). Raises UnmaskError from ``join`` for a request that does not fit.
    """

    def __init__(self, bundle, cfg: EarlyBirdConfig, *, static=False, compile=False, capacity=8, on_step=None,
                 on_token=None, stop_token_ids=None, width=0, lockstep=False, on_forward=None):
        super().__init__(bundle, cfg, block=None, width=max(width, cfg.gen_length + 1), capacity=capacity,
                         static=static, compile=compile, on_step=on_step, on_forward=on_forward, lockstep=lockstep,
                         stop_token_ids=stop_token_ids)
        self.lbs, self.lps, self.stop_ids = cfg.lbs, cfg.lps, sorted(self.stop.ids)
        self.embed = bundle.model.get_input_embeddings()
        self.threshold = Threshold(cfg.tau)
        self.draw = "gumbel" if cfg.sampler == "llada" else "categorical"
        self.block = torch.zeros(capacity, cfg.gen_length, dtype=torch.bool, device=bundle.device)  # (C, L) as selected
        self.refreshes = 0
        self.seconds = Counter()  # lbs, lps, forward, step

    # -- joining and leaving ------------------------------------------------------------------------

    @torch.inference_mode()
    def join(self, requests: list[Request]) -> list[EarlyBirdRow]:
        """Place each request's canvas with no active block (no forward; every request is validated
        first, so a bad one adds none). Returns []."""
        L = self.cfg.gen_length
        for job in requests:
            check_max_new_tokens(job.max_new_tokens, L)
            check_canvas(self.bundle, len(job.prompt_ids), L, CANVAS_HINT)

        def row(job, slot, generator):
            self.block[slot] = False  # (L,) no active block yet
            return EarlyBirdRow(job=job, slot=slot, generator=generator, report=job.max_new_tokens,
                                gen=[self.bundle.mask_token_id] * L)

        return self._place(requests, row)

    # -- stepping -----------------------------------------------------------------------------------

    def _forward(self, n: int, rows: list, select: list[bool]) -> tuple[torch.Tensor, int, int]:
        """One forward of slots [0, n): (logits (n, HI - LO, V) realigned, LO, HI), index j scoring
        generated position LO + j; [LO, HI) covers every row's window (all L when a row selects)."""
        c, cfg, sh = self.canvas, self.cfg, self.bundle.logit_shift
        T, L = c.width, cfg.gen_length
        g0 = T - L
        spans = [(0, L) if s else row.window for row, s in zip(rows, select) if row is not None]
        LO, HI = min(a for a, _ in spans), max(b for _, b in spans)
        w0, w1 = [], []
        for row, s in zip(rows, select):
            if row is None or s:  # a free slot, or a refresh: its window is hidden once selected
                w0.append(T - 1 if row is None else T)
                w1.append(T)
            else:
                w0.append(g0 + row.window[0] - sh)
                w1.append(g0 + row.window[1] if cfg.cache == "dual" else T)
        refresh = [row is not None and s for row, s in zip(rows, select)]
        if cfg.cache != "none" and any(refresh):
            self.refreshes += 1
        raw, col0 = c.run(n, w0, w1, refresh, g0 + LO - sh, g0 + HI)  # (n, m, V), (n,)
        at = (g0 + LO - sh - col0)[:, None] + torch.arange(HI - LO, device=raw.device)  # (n, HI - LO)
        at = at.clamp(0, raw.shape[1] - 1)  # outside a row's own window: unused (no candidates there)
        logits = raw.gather(1, at[:, :, None].expand(n, HI - LO, raw.shape[2]))  # (n, HI - LO, V)
        if self.suppress:
            logits[..., self.suppress] = float("-inf")
        return logits, LO, HI

    def _groups(self, idx: list[int]) -> list[list[int]]:
        """Rows that run a router together: all at once in lockstep (decode), else one by one."""
        return ([idx] if idx else []) if self.lockstep else [[r] for r in idx]

    @torch.inference_mode()
    def step(self) -> list[EarlyBirdRow]:
        """One forward for every running row, then EB-Decode's selection and commit (Alg. 5) and the
        stop checks (§9). Returns the finished rows (removed) with ``tokens``, ``nfe``, ``finish``,
        ``stop_token`` and ``extra`` set."""
        if not self.running:
            return []
        with _eval(self.lbs, self.lps):
            return self._step()

    def _step(self) -> list[EarlyBirdRow]:
        cfg, dev, mask_id, c = self.cfg, self.bundle.device, self.bundle.mask_token_id, self.canvas
        L = cfg.gen_length
        n = self._covered()
        rows = [self.running.get(s) for s in range(n)]  # None: a free slot, carried along
        select = [row is not None and not row.has_block for row in rows]
        t0 = _sync(dev)
        logits, LO, HI = self._forward(n, rows, select)  # (n, HI - LO, V)
        logits, raw = self.shaping.shape(rows, logits)  # biased (what the routers and the rule read), raw
        self.seconds["forward"] += _sync(dev) - t0
        gen = c.ids[:n, c.width - L:]  # (n, L) view: commits write through it
        live = torch.tensor([row is not None for row in rows], device=dev)  # (n,)
        masked = (gen == mask_id) & (live & ~self.done[:n])[:, None]  # (n, L)
        st = token_stats(logits)  # (n, HI - LO) each, T = 0: the router features
        top1, conf, ent, margin = (F.pad(x, (LO, L - HI)) for x in st[:4])  # (n, L) each, 0 outside the window
        norm_ent = ent / math.log(logits.shape[-1])  # (n, L) H / log|V|
        t1 = _sync(dev)
        sel = [r for r, s in enumerate(select) if s]
        path = torch.full((n,), -1, dtype=torch.long, device=dev)
        for g in self._groups(sel):
            at = torch.tensor(g, device=dev)  # (b,)
            p = torch.sigmoid(self.lbs(norm_ent[at], self.embed(top1[at]), masked[at]))  # (b, L)
            new, how = select_block(p, masked[at], top1[at], eos_ids=self.stop_ids, l_min=cfg.l_min,
                                    fallback_block=cfg.block_size, g_max=cfg.g_max, gap_metric=cfg.gap_metric)
            self.block[at], path[at] = new, how
        block = self.block[:n]  # (n, L)
        self.seconds["lbs"] += _sync(dev) - t1
        cand = block & masked  # (n, L) B ∩ M
        cand_w = cand[:, LO:HI]  # (n, HI - LO)
        tok_w, kappa = self._tokens(rows, logits, cand_w, st.top1, LO)  # (n, HI - LO), (n, L)
        tokens = F.pad(tok_w, (LO, L - HI))  # (n, L)
        t3 = _sync(dev)
        feats = p_lps = None
        if self.lps is not None or self.on_forward is not None:
            feats = lps_features(conf, norm_ent, margin, block, masked, cfg.pos_mode)  # (n, L, 5)
        if self.lps is not None:
            p_lps = torch.zeros(n, L, device=dev)
            # LPS cannot change A for a row whose candidates all pass κ ≥ τ or that has a single
            # candidate (committed anyway, by the anti-stall rule): its p_ψ is zeroed, so it counts
            # no LPS-only commit. Every running row has candidates (a row without finished last
            # step), so the router runs over them all, packed to their widest window (host-known):
            # which rows are open is not read.
            open_rows = (cand.sum(dim=1) >= 2) & (cand & (kappa < cfg.tau)).any(dim=1)  # (n,)
            for g in self._groups([r for r, row in enumerate(rows) if row is not None]):
                at = torch.tensor(g, device=dev)  # (b,)
                N = max(L if select[r] else rows[r].window[1] - rows[r].window[0] for r in g)
                index, ok = pack_rows(cand[at], N)  # (b, N) each
                x = feats[at].gather(1, index[..., None].expand(-1, -1, feats.shape[-1]))  # (b, N, 5)
                p = torch.sigmoid(self.lps(x, ok))  # (b, N)
                p_lps[at] = torch.zeros(len(g), L, device=dev).scatter(1, index, torch.where(ok, p, 0.0))
            p_lps = p_lps * open_rows[:, None]
        self.seconds["lps"] += _sync(dev) - t3
        tau_psi = cfg.tau_psi if cfg.tau_psi is not None else 1.0
        chosen = union_accept(kappa, p_lps, cand, cfg.tau, tau_psi)  # (n, L)
        lps_only = (chosen & (kappa < cfg.tau) & (p_lps > tau_psi)).sum(dim=1) if p_lps is not None else path * 0
        gen.copy_(torch.where(chosen, tokens, gen))
        return self._settle(rows, select, masked, chosen, tokens, path, lps_only, feats, top1, kappa, p_lps,
                            (LO, HI), t0, (logits, raw))

    def _tokens(self, rows, logits, cand_w, top1_w, LO):
        """The candidates' tokens (n, HI - LO) (argmax, or each sampled row's draw with its generator)
        and their κ (n, L), per group of rows sharing a sampling setting."""
        cfg, L = self.cfg, self.cfg.gen_length
        groups = group_by(((r, row) for r, row in enumerate(rows) if row is not None), lambda row: row.job.sampling)
        tokens, kappa = top1_w, torch.zeros(len(rows), L, dtype=torch.float64, device=logits.device)
        for sampling, idx in groups.items():
            pick = torch.zeros_like(cand_w)
            pick[idx] = cand_w[idx]
            if not sampling.greedy:
                gens = [None if row is None else row.generator for row in rows]
                # every running row has candidates (see step), so the group's rows are the ones that draw
                tokens = draw_rows(logits, pick, tokens, self.threshold, sampling, gens, cfg.commit_confidence,
                                    self.draw, idx)
            kappa = kappa + commit_confidence(logits, tokens, pick, cfg.commit_confidence, sampling.temperature, LO, L)
        return tokens, kappa

    def _settle(self, rows, select, masked, chosen, tokens, path, lps_only, feats, top1, kappa, p_lps, window, t0,
                scores):
        """After the commit: stop checks (§9), cached windows of new blocks, the step's one host sync
        (with the logprob columns of ``scores`` = (the window's biased logits, its raw ones)) and the rows'
        bookkeeping.
        Returns the finished rows."""
        cfg, dev, mask_id, c = self.cfg, self.bundle.device, self.bundle.mask_token_id, self.canvas
        L, n, sh = cfg.gen_length, len(rows), self.bundle.logit_shift
        gen, block = c.ids[:n, c.width - L:], self.block[:n]  # (n, L) each
        had = masked.any(dim=1)  # (n,)
        open_block = block & (gen == mask_id)  # (n, L)
        resolved = had & ~open_block.any(dim=1)  # (n,) blocks finished by this step
        if cfg.eos_early_stop:
            self.done[:n] |= early_stop(gen, mask_id, self.stops) & had
        else:
            self.done[:n] |= early_stop(gen.clone(), mask_id, self.stops) & resolved  # check only: no fill
        reports = torch.tensor([L if row is None else row.job.max_new_tokens for row in rows], device=dev)  # (n,)
        before = torch.arange(L, device=dev)[None, :] < reports[:, None]  # (n, L) reported positions
        self.done[:n] |= had & (reports < L) & ~((gen == mask_id) & before).any(dim=1)  # the reported part is in
        span = block if cfg.cache != "none" else open_block  # (n, L) the next window: B (cached), else its masks
        lo = torch.where(span.any(dim=1), span.long().argmax(dim=1), 0)  # (n,) min
        hi = L - torch.where(span.any(dim=1), span.flip(1).long().argmax(dim=1), L)  # (n,) max + 1
        if cfg.cache != "none" and any(select):  # a new block's window: its stale K/V are hidden from now on
            g0 = c.width - L
            new = torch.tensor(select, device=dev) & open_block.any(dim=1) & ~self.done[:n]  # (n,)
            end = g0 + hi if cfg.cache == "dual" else torch.full_like(hi, c.width)
            c.hide(n, new, g0 + lo - sh, end)
        # the step's one host sync: the rows' bookkeeping and generated ids (with on_step, what its events show)
        host = HostRead().add("count", chosen.sum(dim=1)).add("had", had).add("resolved", resolved)
        host.add("done", self.done[:n]).add("has_block", open_block.any(dim=1)).add("left", (gen == mask_id).any(dim=1))
        host.add("lo", lo).add("hi", hi).add("path", path)
        host.add("size", block.sum(dim=1)).add("lps_only", lps_only).add("committed", (gen != mask_id).sum(dim=1))
        host.add("gen", gen)
        if self.on_step is not None:
            host.add("chosen", chosen).add("tokens", tokens).add("block", block)
        (LO, HI), (logits, raw) = window, scores
        self.shaping.add(host, rows, lambda: (raw, tokens[:, LO:HI], chosen[:, LO:HI], LO))
        got = host.read()
        self.seconds["step"] += _sync(dev) - t0
        finished = []
        for r, row in enumerate(rows):
            if row is None:
                continue
            was, done = got["had"][r], got["done"][r]
            row.gen = got["gen"][r]
            self.shaping.take(row, got, r)
            if select[r]:
                row.blocks, row.sizes = row.blocks + 1, row.sizes + got["size"][r]
                row.paths.append(PATH_NAMES[got["path"][r]])
            row.lps_only += got["lps_only"][r]
            row.has_block = bool(got["has_block"][r])
            row.window = (got["lo"][r], got["hi"][r])
            if was:
                row.commits.append(got["count"][r])
                if self.on_step is not None:
                    extra = {"block": row.blocks - 1}
                    if select[r]:
                        extra["selected"] = [i for i, b in enumerate(got["block"][r]) if b]
                    self._event(row, self.forwards, got["chosen"][r], got["tokens"][r], 0, row.gen, **extra)
            row.nfe += int(bool(was))
            check_nfe(row.nfe, 2 * L, "early-bird")  # ≥ 1 commit per forward; L blocks at most (size 1)
            if row.job.stop and got["resolved"][r] and not done:
                done = self._stop_hit(row, row.gen)
            row.extra["n_committed"] = got["committed"][r]
            if done or not got["left"][r]:
                finished.append(row)
        if self.on_forward is not None:
            self.on_forward({"nfe": self.forwards, "masked": masked, "block": self.block[:n].clone(),
                             "cand": self.block[:n] & masked, "features": feats, "top1": top1, "kappa": kappa,
                             "p_lps": p_lps, "chosen": chosen, "tokens": tokens, "canvas": gen.clone(),
                             "selected": torch.tensor(select, device=dev), "path": path, "window": window,
                             "logits": logits,  # (n, HI - LO, V), column j scoring generated position LO + j
                             # slot r's request id (-1: a free slot); slots are not prompt order once rows finish
                             "ids": [-1 if row is None else row.job.id for row in rows]})
        self.forwards += 1
        if finished:
            self._finish(finished)
        return finished

    def _row_extra(self, row: EarlyBirdRow) -> dict:
        return {"decoder": "early-bird", "lps": self.lps is not None, "cache": self.cfg.cache, "steps": row.nfe,
                "blocks": row.blocks, "commits": list(row.commits), "n_committed": row.extra["n_committed"]}

    def stats_extra(self, rows: list[EarlyBirdRow]) -> dict:
        """decode's ``stats.extra`` for finished rows in request order (:meth:`CanvasBatch._extra`)."""
        cfg, t = self.cfg, self.seconds
        blocks = sum(row.blocks for row in rows)
        router = t["lbs"] + t["lps"]
        extra = {"lps": self.lps is not None, "cache": cfg.cache, "gen_length": cfg.gen_length,
                 "block_size": cfg.block_size, "tau": cfg.tau, "tau_psi": cfg.tau_psi, "l_min": cfg.l_min,
                 "g_max": cfg.g_max, "gap_metric": cfg.gap_metric, "pos_mode": cfg.pos_mode, "sampler": cfg.sampler,
                 "confidence": cfg.confidence or "untempered", "blocks": blocks,
                 "mean_block": sum(row.sizes for row in rows) / max(1, blocks),
                 "paths": dict(Counter(p for row in rows for p in row.paths)),
                 "lps_only": sum(row.lps_only for row in rows), "refreshes": self.refreshes,
                 "lbs_seconds": t["lbs"], "lps_seconds": t["lps"], "router_seconds": router,
                 "forward_seconds": t["forward"], "step_seconds": t["step"],
                 "router_share": router / t["step"] if t["step"] > 0 else 0.0,
                 "router_vs_forward": router / t["forward"] if t["forward"] > 0 else 0.0}
        return self._extra(rows, extra, ("decoder", "lps", "cache", "steps", "blocks", "commits"))


def batch(bundle, cfg: EarlyBirdOptions, *, capacity: int = 64, prompts=None, max_new_tokens=None, compile=False,
          static=False, on_step=None, on_token=None, on_forward=None, stop_token_ids=None):
    """The running batch of ``cfg`` (:attr:`Spec.batch`; :meth:`EarlyBirdOptions.resolve` says how
    options and routers resolve). ``prompts`` given (``decode()``): one batch for them, each
    router run once over every row that needs it, a row stopping once its ``max_new_tokens`` (≤ L)
    are committed (the tokens are those of the full-length run); ``static`` / ``compile`` run the
    forwards on a preallocated cache with bounded shapes / compiled (same tokens and NFE up to
    float rounding). None (the server): rows join and leave at any step, eager under ``serve
    --compile`` (its windows vary per step: compiled it measured 0.73x eager at 8 streams,
    benchmarks/results/serve_compile_canvas.md). NFE counts base-model forwards only (routers are
    not NFE, §10). ``stats_extra``: decoder settings, ``accepts`` (histogram of per-row commits per
    forward), ``n_committed``, ``blocks`` (selections), ``mean_block``, ``paths`` (selection rule
    counts), ``lps_only`` (commits only LPS allowed), ``refreshes`` (cache), router timing
    (``lbs_seconds``, ``lps_seconds``, ``router_seconds``, ``forward_seconds``, ``step_seconds``,
    ``router_share`` = router / step time, ``router_vs_forward`` = router / forward time),
    ``compiled``, ``static_cache`` and ``row_extra``. Raises UnmaskError as ``resolve`` does, for
    a remote-code model in a server's batch (no explicit positions per row), or a prompt whose
    canvas does not fit."""
    if prompts is None:
        if is_remote(bundle.model):
            raise UnmaskError("a continuous early-bird batch needs explicit positions per row; this checkpoint's own "
                              "model code takes none, so decode it with per-call early-bird batches")
        return EarlyBird(bundle, cfg.resolve(bundle), capacity=capacity, on_step=on_step, stop_token_ids=stop_token_ids)
    rc = cfg.resolve(bundle, max_new_tokens, static=static, compile=compile)
    width = canvas_width(bundle, prompts, rc.gen_length, CANVAS_HINT, static or compile)
    return EarlyBird(bundle, rc, static=static, compile=compile, capacity=capacity, on_step=on_step,
                     stop_token_ids=stop_token_ids, width=width, lockstep=True, on_forward=on_forward)


SPEC = Spec("early-bird", EarlyBirdOptions, batch=batch, kinds=("masked-diffusion",), compiles=False,
            summary="Early-Bird: learned variable blocks (LBS) and learned parallel commits (LPS)")

__all__ = ["EarlyBird", "EarlyBirdRow", "SPEC", "batch"]
