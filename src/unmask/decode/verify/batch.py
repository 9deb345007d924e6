"""The one running batch of AR and lossless SBD rows (issue 25, DESIGN.md "One engine"): AR is
lossless SBD with draft size K = 1 (:mod:`unmask.decode.verify.ar`).

Rows live in slot tensors (:class:`~unmask.decode.engine.running.Slots`), each with its own K (1: a plain
AR step; >= 2: lossless SBD, spec/sbd_exact.md §1–2), which may change between steps (greedy output
does not depend on K), and its draft source (the block mode's groups, or a model-free drafter on the
host: :mod:`unmask.decode.verify.drafting`). A step is ONE forward of every row, each row's layout in
the step's query window (:func:`~unmask.decode.verify.tree.tree_window`; siblings, spec §5.3: greedy rows
take the longest confirmed path, sampled rows SpecInfer's multi-candidate rule), the pure commit rule
:func:`~unmask.decode.verify.steps.settle` and one host read (:class:`~unmask.decode.engine.host.HostRead`);
the rows' bookkeeping (stop rule, events: :mod:`unmask.decode.verify.rows`; host drafts) runs on what it
read. The cache is ``DynamicKV`` (the forward covers slots ``[0, high)``) or ``StaticKV``
(``static``/``compile``: the row bucket of ``high``, the length bucket of the cache, one compiled graph
per shape). Rejected verify columns stay as invalid keys of their row (``key_valid``); the tail no row
kept is cut; holes are compacted once they are half the cache, or when a static one is full.
"""
from __future__ import annotations

import time
from collections import Counter

import torch

from unmask.decode.engine.host import HostRead
from unmask.decode.engine.kv import DynamicKV, StaticKV, compact, place
from unmask.decode.engine.running import Request, Slots, group_by, row_generator
from unmask.decode.engine.stop import StopRule
from unmask.decode.verify import rows as vr
from unmask.decode.verify.rows import VerifyRow
from unmask.decode.verify import sampled as ss
from unmask.decode.verify import steps as sv
from unmask.decode.verify import tree as tv
from unmask.decode.verify.config import VerifyConfig, family, queries, tables
from unmask.decode.verify.drafting import HostDrafts, query_cost
from unmask.decode.verify.host_drafts import Tally, after_step, clock_for, first_drafts, learn
from unmask.decode.verify.shaped import Shaping
from unmask.errors import UnmaskError
from unmask.masks import as_4d, with_key_padding


class Verify:
    """The running batch of AR (K = 1) and lossless SBD rows of one model (the contract of
    :mod:`unmask.decode.engine.running`; ``join(..., block_size=K)`` sets a joining row's K).

    cfg: the draft layout of every row and the default K (``ar``: rows join at K = 1 and
    ``stats_extra`` is AR's). ``static`` / ``compile``: the static cache of ``length`` columns and
    the compiled forward. ``on_step(row, event)``: each row's step events as ``decode`` of its prompt
    alone emits them (row 0; none for a request whose ``events`` is False: the server's AR rows
    stream through ``on_token(row)``, called per token appended to ``row.tokens``); ``on_forward``
    (tests): each forward's tensors for the live rows; ``defer_compile``: see :class:`StaticKV`.
    ``drafts``: joining rows' model-free drafting (spec/draft_sources.md; ``join(drafts=)`` per call):
    on the ``host`` layout every draft (a row's K follows it), beside a block layout the block draft
    when they expect more; ``suffix_cache``: the server's, fed every finished suffix row; ``tally``: where
    drafted and accepted tokens per source are counted (default: the batch's own). Raises UnmaskError
    for a model without a mask token (unless ``ar`` or the host layout) or a block size too large for
    the context window.
    """

    def __init__(self, bundle, cfg: VerifyConfig = VerifyConfig(), *, static: bool = False,
                 compile: bool = False, capacity: int = 8, on_step=None, on_token=None, on_forward=None,
                 stop_token_ids=None, length: int | None = None, ar: bool = False, defer_compile: bool = False,
                 drafts: HostDrafts | None = None, suffix_cache=None, tally: Tally | None = None):
        if bundle.mask_token_id is None and not ar and not cfg.host:
            raise UnmaskError("lossless SBD needs a model with a mask token (an SBD model, or a base with an "
                              "SBD adapter: --adapter); train one with 'unmask train sbd' or 'unmask train sbd-adapter'")
        if not ar:
            cfg.check_fits(bundle.context_length)
        self.bundle, self.cfg, self.model, self.device = bundle, cfg, bundle.model, bundle.device
        self.on_step, self.on_token, self.on_forward = on_step, on_token, on_forward
        self.static, self.compile = bool(static or compile), bool(compile)
        self.ar, self.default_K = ar, 1 if ar or cfg.host else cfg.block_size  # AR rows, host rows: K = 1 at join
        self.drafts, self.suffix_cache, self.tally, self.vocab = drafts, suffix_cache, tally or Tally(), 0
        self.shaping = Shaping(self)  # rows' logprobs, logit_bias and grammar (spec/structured.md)
        self.clock, self.drafts_cost, self.quiet, self.backoff = clock_for(bundle.model, bundle.device), query_cost(
            bundle.device), 0, 1  # host_drafts.after_step's: the window's cost, and its pause when drafts do not pay
        self.mask_id = -1 if bundle.mask_token_id is None else bundle.mask_token_id
        self.fill_id = max(self.mask_id, 0)  # a window's unused queries (the host layout: no mask token) see only themselves
        stop_ids = sorted(set(bundle.stop_token_ids if stop_token_ids is None else stop_token_ids))
        self.stop_ids, self.stops = frozenset(stop_ids), torch.tensor(stop_ids or [-1], dtype=torch.long, device=self.device)  # (S,)
        self.slots = Slots(capacity)
        self.rows: dict[int, VerifyRow] = {}  # slot -> running row
        self.forwards, self.windows, self.n_sampled = 0, Counter(), 0  # windows: forwards by query window Q; n_sampled: rows not greedy
        cap, dev, W = capacity, self.device, max(cfg.block_size - 1, 1)
        self.b = torch.zeros(cap, dtype=torch.long, device=dev)  # (cap,) the bonus: committed, not yet cached
        self.s = torch.zeros((cap, W), dtype=torch.long, device=dev)  # (cap, W) the draft after b
        self.q: torch.Tensor | None = None  # (cap, W, V) its proposal distributions (sampled rows only)
        self.draft_len = torch.zeros(cap, dtype=torch.long, device=dev)  # (cap,) real draft tokens
        H = 0 if ar else len(tv.slots(family(cfg.draft, cfg.block_size, cfg.smaller))[2])
        self.sib = torch.zeros((cap, H), dtype=torch.long, device=dev)  # (cap, H) the draft's sibling ids
        self.K = torch.ones(cap, dtype=torch.long, device=dev)  # (cap,) draft size per slot (1: AR)
        self.p_b = torch.zeros(cap, dtype=torch.long, device=dev)  # (cap,) position of b
        self.n = torch.zeros(cap, dtype=torch.long, device=dev)  # (cap,) committed tokens
        self.N = torch.zeros(cap, dtype=torch.long, device=dev)  # (cap,) max_new_tokens
        self.live = torch.zeros(cap, dtype=torch.bool, device=dev)  # (cap,)
        self._zero = torch.zeros(cap, dtype=torch.long, device=dev)  # (cap,) an AR step's a and path (read only)
        self._one = torch.ones((cap, 1, 1), dtype=torch.bool, device=dev)  # (cap, 1, 1) an AR step's window mask
        self._layouts, self._steps = {}, {}  # Kmax -> the layout's window tables; (R, Q, Lb, Kmax) -> whole step compiled?
        ids = bundle.suppress_ids
        self.suppress = torch.tensor(ids, dtype=torch.long, device=dev) if ids else None  # (n,) ids never generated
        self.sized_for = None if length else bundle.context_length  # the longest row a static cache must hold
        if self.static:
            L = length or bundle.context_length + 2 * queries(max(cfg.block_size, 2), cfg.draft, cfg.smaller)
            self.kv = StaticKV(self.model, cap, L, compile=compile, length_buckets=True, cpp_wrapper=True,
                               defer_compile=defer_compile)  # cpp_wrapper, CPU: AR 0.48 -> 0.29 ms
        self._empty()

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def warm(self) -> bool:
        """defer_compile (the server, no row running): compile one step shape run eagerly, a forward's (sampled
        rows) or a greedy step's whole graph (on the dead rows, past every valid key). False: none left."""
        if not self.static or self.rows or not self.kv.allocated:
            return False
        if self.kv.pending:
            return self.kv.warm()
        if (key := next((k for k, done in self._steps.items() if done is False), None)) is None:
            return False
        R, Q, Lb, Kmax = key
        self.kv.ptr = Lb - Q  # the step's end lands in bucket Lb
        try:  # pending (False) until compiled: /health counts it
            self._run_whole(R, Q, Kmax, torch.zeros((R, Lb), dtype=torch.bool, device=self.device))
        except Exception:
            self._steps[key] = None  # its compile failed: it stays eager for good
            raise
        finally:
            self.kv.ptr = 0
        self._steps[key] = True
        return True

    @property
    def pending_steps(self) -> int:  # /health counts them with the forward shapes to compile
        return sum(done is False for done in self._steps.values())

    def _empty(self) -> None:
        """No row runs: a fresh dynamic cache, or the static one's pointer back at 0."""
        if self.static:
            self.kv.reset()
        else:
            self.kv = DynamicKV(self.model)
        rows = self.slots.capacity if self.static else 0  # key_valid (R, C): the cache columns each slot attends to
        self.key_valid = torch.zeros((rows, 0), dtype=torch.bool, device=self.device)

    @torch.inference_mode()
    def join(self, requests: list[Request], *, block_size: int | None = None, drafts=...) -> list[VerifyRow]:
        """Prefill ``requests`` into free slots with draft size ``block_size`` (default the config's,
        1 with ``ar`` or the host layout; 1: AR rows) and model-free ``drafts`` (default the batch's; None:
        none). Returns the rows finished by their first token (a stop token, a stop string or
        ``max_new_tokens`` <= 1), never added. Raises UnmaskError, before any request joins, for an
        empty prompt, more requests than free slots, or model-free drafts with AR rows of a block layout."""
        drafts = self.drafts if drafts is ... else drafts
        K = self.default_K if block_size is None else self.cfg.row_size(int(block_size))
        if drafts is not None and not self.cfg.host and (K < 2 or not drafts.beside_block):
            raise UnmaskError(f"{drafts.source} drafts run on the host layout, or beside a block draft "
                              f"(block+{drafts.source}); this batch runs {self.cfg.draft} at K = {K}")
        if K < 1:
            raise UnmaskError(f"a draft size must be >= 1 (got {K}); 1 means plain AR steps")
        if any(len(r.prompt_ids) == 0 for r in requests):  # the verify step needs a cached prefix
            raise UnmaskError("decoding needs a non-empty prompt; start it with the BOS token")
        if K > 1 and self.bundle.mask_token_id is None:
            raise UnmaskError("lossless SBD needs a model with a mask token; drop the draft size or load an SBD model")
        if not requests:
            return []
        running = list(self.rows.values())
        longest = self.sized_for or max(len(j.prompt_ids) + j.max_new_tokens for j in [*requests, *(r.job for r in running)])
        self.cfg.check_rows(K, self.bundle.context_length, self.kv.capacity if self.static else None, longest,
                            [] if self.sized_for else [r.K for r in running])
        self._widen(K)  # then the slots, which a failed prefill gives back (a step covers [0, high))
        slots = self.slots.take(len(requests))
        try:
            prompts = [list(r.prompt_ids) for r in requests]
            Kp = K if K > 1 else 0  # an AR prefill is the prompt alone
            inp, positions, m, kv_valid, valid, row_len = sv.prefill_inputs(self.bundle, prompts, Kp)  # (n, P+Kp) ...
            new_kv = DynamicKV(self.model)
            ragged = len({len(p) for p in prompts}) > 1
            mask = with_key_padding(as_4d(m, len(prompts)), kv_valid) if (ragged or Kp) else None  # (n, 1, P+Kp, P+Kp)
            logits = new_kv.forward(inp, positions, mask, logits_to_keep=Kp + 1)  # (n, Kp+1, V)
            new_kv.crop(Kp)
            self.forwards, self.vocab = self.forwards + 1, logits.shape[-1]
            if self.suppress is not None:
                logits[..., self.suppress] = float("-inf")
            rows = [VerifyRow(job=req, slot=slot, K=K, generator=row_generator(req, self.device))
                    for req, slot in zip(requests, slots)]
            raw = self.shaping.prefill(rows, logits)
            groups = group_by(enumerate(rows), lambda r: r.job.sampling)  # sampling -> row indices
            b, s, q, sib = ss.prefill_draws(logits, K, {k: (v, [rows[i].generator for i in v]) for k, v in groups.items()},
                                            self._tables(K))
            idx = torch.tensor(slots, dtype=torch.long, device=self.device)  # (n,)
            self.kv, self.key_valid = place(self.kv, self.key_valid, new_kv, valid, slots, rows=bool(self.rows))
        except BaseException:
            self.slots.give(slots)
            raise
        self.b[idx], self.p_b[idx], self.K[idx] = b, row_len, K
        self.draft_len[idx], self.n[idx], self.live[idx] = K - 1, 1, True
        self.N[idx] = torch.tensor([r.max_new_tokens for r in requests], dtype=torch.long, device=self.device)
        if K > 1:
            self.s[idx, : K - 1], self.sib[idx, : sib.shape[1]] = s, sib
            if q is not None:
                if self.q is None:
                    self.q = q.new_zeros((self.slots.capacity, self.s.shape[1], q.shape[-1]))  # (cap, W, V)
                self.q[idx, : K - 1] = q
        if self.on_forward is not None:
            self.on_forward({"step": 0, "inp": inp, "positions": positions, "logits": logits,
                             "cache": new_kv.cache, "key_valid": valid})
        done, self.n_sampled, firsts = [], self.n_sampled + sum(not r.sampling.greedy for r in requests), b.tolist()
        self.shaping.prefilled(rows, raw, b, firsts)
        for req, row, t in zip(requests, rows, firsts):  # join is not a step: its host syncs are the prefill's
            self.rows[row.slot] = row
            row.committed, row.nfe, row.accepts, row.block_len = [t], 1, [1], K - 1
            if self.on_step is not None and getattr(req, "events", True):
                self.on_step(row, vr.event(row, 0, self.mask_id))
            if self._settle(row, 0):
                done.append(row)
            elif drafts is not None:
                row.drafts = drafts.start(list(req.prompt_ids) + [t], self.suffix_cache)
        first_drafts(self, rows, K)
        self._free(done)
        return done

    def _widen(self, K: int) -> None:
        """Grow the draft buffers to hold drafts of K - 1 tokens."""
        if (more := K - 1 - self.s.shape[1]) > 0:
            self.s = torch.nn.functional.pad(self.s, (0, more))  # (cap, K-1)
            self.q = None if self.q is None else torch.nn.functional.pad(self.q, (0, 0, 0, more))  # (cap, K-1, V)

    @torch.inference_mode()
    def resize(self, K: int, ids=None) -> None:
        """Set the draft size of the greedy running rows ``ids`` (job ids; None: all) to K from the next
        step on: a draft is cut to K - 1 (any greedy draft is lossless). Sampled rows keep their K."""
        K = self.cfg.row_size(K)
        want = None if ids is None else set(ids)
        moved = [r.slot for r in self.rows.values() if (want is None or r.job.id in want)
                 and r.job.sampling.greedy and r.K != K]
        if not moved:
            return
        self._widen(K)
        for slot in moved:  # the host-side K; the slot tensors below
            self.rows[slot].K = K
        idx = torch.tensor(moved, dtype=torch.long, device=self.device)
        self.K[idx], self.draft_len[idx] = K, torch.clamp(self.draft_len[idx], max=K - 1)

    @torch.inference_mode()
    def step(self) -> list[VerifyRow]:
        """One forward of every row, (R, Q) queries (Q = ``queries(Kmax)``, Kmax the largest K running):
        each row commits its accepted draft prefix and a bonus and takes its next draft. Returns the
        rows that finished (removed, ``tokens``/``nfe``/``finish``/``extra`` set). One host sync, more
        only with ``on_step``/``on_forward`` or a row's stop strings."""
        failed = []
        while self.rows and (bad := self.shaping.prepare()):  # grammar rows: masks, forced ids; none allowed: ended
            self._free(bad)
            failed += bad
        if not self.rows:
            return failed
        t0, n_rows = time.perf_counter(), len(self.rows)
        Kmax = max(r.K for r in self.rows.values())
        Q = queries(Kmax, self.cfg.draft, self.cfg.smaller)
        R = self._rows_in_forward()
        self._reclaim(Q)
        C, tw = self.kv.length, self._tables(Kmax)
        K, dl = self.K[:R], self.draft_len[:R]
        rows = (tw, K, dl, self.n[:R], self.N[:R], self.live[:R], self.stops, self.b[:R], Q)
        self.forwards, self.windows[Q] = self.forwards + 1, self.windows[Q] + 1
        if out := self._whole(R, Q, Kmax, C):  # greedy, compiled: the step is one graph
            self.s[:R, : Kmax - 1], self.sib[:R, : tw.H], *out = out
        else:
            out = self._pieces(R, Q, Kmax, C, tw, rows, compiled=out is None)
        self.b[:R], committed, self.n[:R], self.draft_len[:R], keep, ended, last, step_tok = out
        self.p_b[:R] += committed
        read = HostRead().add("committed", committed).add("ended", ended).add("last", last).add("tokens", step_tok)
        self.shaping.read(read if self.ar or self.cfg.host else read.add("dlen", self.draft_len[:R]))
        self.shaping.after_read(got := read.read())  # the one host sync
        kept = max(got["last"][i] for i in self.rows)  # window columns some running row keeps
        if kept < Q:  # the tail no running row keeps
            self.kv.crop(Q - kept)
        cols = keep[:, :kept]  # (R, kept); a static cache's rows past R ride along as invalid keys
        if self.key_valid.shape[0] > R:
            cols = torch.cat([cols, cols.new_zeros((self.key_valid.shape[0] - R, kept))])  # (cap, kept)
        self.key_valid = torch.cat([self.key_valid, cols], dim=1)  # (R or cap, C + kept)
        finished = []
        for slot, row in list(self.rows.items()):
            c = got["committed"][slot]
            start = len(row.committed)
            row.committed += got["tokens"][slot][:c]
            row.nfe += 1
            row.accepts.append(c)
            if self.on_step is not None and getattr(row.job, "events", True):
                self.on_step(row, vr.event(row, start, self.mask_id))
            if (got["ended"][slot] or row.job.stop or self.on_token is not None) and self._settle(row, start):
                finished.append(row)
        if not self.ar:
            after_step(self, got, {r.slot for r in finished}, (n_rows, Q, time.perf_counter() - t0))
        self._free(finished)
        return failed + finished

    def _whole(self, R: int, Q: int, Kmax: int, C: int):
        """A greedy compiled step as ONE graph (:func:`~unmask.decode.verify.steps.whole_step`: window, forward,
        commit); its outputs, or None when it does not apply (not compiled, a sampled row, ``on_forward``), or
        False when its shape waits for :meth:`warm` (a deferred cache) or failed to compile: then the step runs
        its pieces eagerly."""
        if not self.compile or self.n_sampled or self.on_forward is not None or self.shaping.active:
            return None
        Lb = self.kv.bucket(C + Q)
        if not self._steps.setdefault((R, Q, Lb, Kmax), not self.kv.defer):
            return False
        return self._run_whole(R, Q, Kmax, torch.nn.functional.pad(self.key_valid[:R], (0, Lb - C)))  # kvb (R, Lb)

    def _run_whole(self, R: int, Q: int, Kmax: int, kvb: torch.Tensor):
        """Run the compiled whole step of R rows, window Q, on the slot buffers; kvb (R, Lb) the valid keys."""
        tw = self._tables(Kmax)
        key = (self.fill_id, Q, tw.trees, tuple(tw.path.shape), self.s.shape[1], self.sib.shape[1], self.suppress is None)
        return self.kv.fused(sv.whole_step, key, R, Q, kvb, self.suppress, tw, self.K[:R], self.draft_len[:R],
                             self.b[:R], self.s[:R, : Kmax - 1], self.sib[:R], self.p_b[:R], self.n[:R], self.N[:R],
                             self.live[:R], self.stops, self.fill_id, Q)

    def _pieces(self, R: int, Q: int, Kmax: int, C: int, tw: tv.TreeWindow, rows: tuple, compiled: bool):
        """A step as its pieces: the window and mask, the forward (``compiled``: the compiled one, which a
        deferred cache may still run eagerly), then the eager commit. Returns settle's outputs."""
        K, dl = rows[1], rows[2]
        if Kmax == 1:  # an AR step: the K = 1 tables are b alone at its position, so skip their gathers
            # (R, 0), (R, 1, 1), (R, 1) x2; copies: a view of a buffer made outside inference mode would recompile warm()'s graph
            s, m, inp, positions = self.s[:R, :0], self._one[:R], self.b[:R, None].clone(), self.p_b[:R, None].clone()
        else:
            s = self.s[:R, : Kmax - 1].clone()  # the draft accept_rows replaces
            m, o = tw.mask[K - 1, dl], tw.offsets[K - 1, dl]  # (R, Q, Q), (R, Q): each row's layout for its draft length
            inp = tv.inputs(tw, K, dl, self.b[:R], s, self.sib[:R], self.fill_id)  # (R, Q): b, the draft, siblings, masks
            positions = self.p_b[:R, None] + o  # (R, Q)
        causal = Q == 1 and not self.static and len(self.rows) == R and all(self._held(r) == C for r in self.rows.values())
        mask = None if causal else torch.cat([self.key_valid[:R, None, :].expand(R, Q, C), m], dim=2)[:, None]  # (R, 1, Q, C+Q)
        logits = self.kv.forward(inp, positions, mask, **({} if compiled else {"compiled": False}))  # (R, Q, V)
        out = sv.settle(*(a_p_tok := ss.accept_rows(self, logits, inp, tw, R, Kmax, s, dl)), *rows)
        self.shaping.record(tw, K, dl, *a_p_tok, logits)
        if self.on_forward is not None:
            vr.forward_info(self, inp, positions, logits, a_p_tok[0])
        return out

    def _rows_in_forward(self) -> int:
        """Slots a step covers: [0, high) (the dynamic cache cut to them), or on the static cache the
        row bucket (:attr:`Slots.bucket`; Slots hands out the lowest first)."""
        if self.static:
            return self.slots.bucket
        R = self.slots.high
        if self.key_valid.shape[0] > R:
            self.kv.cache.batch_select_indices(torch.arange(R, device=self.device))
            self.key_valid = self.key_valid[:R]
        return R

    def _held(self, row: VerifyRow) -> int:  # valid cache columns of a row: its prompt, its committed ids but b
        return len(row.job.prompt_ids) + len(row.committed) - 1

    def _reclaim(self, Q: int) -> None:
        """Compact the cache (host-known counts, no sync) when the columns no row attends to are more
        than half of it, or, static, when :meth:`~unmask.decode.engine.kv.StaticKV.crowded` says so."""
        C, most = self.kv.length, max(self._held(r) for r in self.rows.values())
        if (self.static and self.kv.crowded(most, Q)) or C - most >= max(most, self.cfg.block_size):
            self.key_valid = compact(self.kv, self.key_valid, most)  # (R, most)

    def _tables(self, Kmax: int) -> tv.TreeWindow:
        """The window tables of the draft layout for steps whose largest draft size is Kmax (cached)."""
        if Kmax not in self._layouts:
            self._layouts[Kmax] = tables(self.cfg.draft, Kmax, self.cfg.smaller, self.device)
        return self._layouts[Kmax]

    def _settle(self, row: VerifyRow, start: int) -> bool:
        """:func:`~unmask.decode.verify.rows.settle` of ``row`` under this batch's stop ids and the row's strings."""
        return vr.settle(row, StopRule(self.stop_ids, tuple(row.job.stop)), self.bundle, start, self.cfg.draft,
                           self.on_token)

    @torch.inference_mode()
    def drop(self, ids) -> list[VerifyRow]:
        """Remove the running rows whose job id is in ``ids``; their slots are free at once. Returns them."""
        gone = [r for r in self.rows.values() if r.job.id in set(ids)]
        self._free(gone)
        return gone

    def _free(self, rows: list[VerifyRow]) -> None:
        if not rows:
            return
        slots = [r.slot for r in rows if self.rows.get(r.slot) is r]
        self.shaping.left([self.rows[s] for s in slots])
        learn(self.suffix_cache, rows)
        for s in slots:
            self.n_sampled -= not self.rows.pop(s).job.sampling.greedy
        self.slots.give(slots)
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)  # a free slot steps as a dead AR row:
        self.live[idx], self.K[idx], self.draft_len[idx] = False, 1, 0  # a static row bucket covers free slots too
        if self.q is not None and not self.n_sampled:
            self.q = None  # no sampled row left: no proposal distributions kept
        if not self.rows:
            return self._empty()
        self.key_valid[[s for s in slots if s < self.key_valid.shape[0]]] = False

    stats_extra = vr.stats_extra  # (self, rows) -> decode's stats.extra


__all__ = ["Verify", "VerifyRow"]
