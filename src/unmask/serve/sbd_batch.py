"""Continuous batching for lossless SBD: rows join and leave at step boundaries (issue 16;
spec/sbd_exact.md §1–2).

:class:`VerifyBatch` owns the running rows of one model and one draft setting (block size K and
draft layout), their per-row draft state and one ``DynamicCache`` for all of them. A step is one
iteration of :func:`unmask.decode.sbd_verify.decode`'s loop, built from the same pure pieces
(``step_layout``, ``greedy_accept``, ``speculative_accept``, ``_draw``, ``_probs``, ``cut_row``): one
forward of every row's K verify tokens and G·K draft-group masks, per-row acceptance, the cache
cut back to the committed causal K/V.

Joining: a request is prefilled alone (prompt causal + one draft group: the first bonus token and
the first draft), exactly as ``decode`` on that prompt runs it, so it may finish at once (returned
by ``join``). Its cache is then left-padded to the running cache's length and concatenated along
the batch dimension (or the running cache is left-padded, when the newcomer's is longer).

The cache: every step appends the K verify columns of every row; a row's rejected ones stay as
invalid keys of that row (``key_valid`` (R, C) bool), the tail no row accepted and every group's
K/V are cropped, as in ``decode``. When the columns a row does not attend to make up more than half
of the cache they are reclaimed (``multiblock.compact``); a leaving row takes its cache row with it.

Equality (STYLE.md 14): a row's tokens, NFE, accept counts and step events are those of
``sbd_verify.decode(bundle, [prompt], ...)`` on its prompt alone, whatever the other rows and
whenever it joined. Greedy (then also AR's tokens), and sampled too: each row draws from its own
generator (``Sampling.row_generators([prompt])``, the one a single-prompt decode creates) the same
draws in the same order, and rows with different sampling settings are accepted and drafted
separately. Only the floating-point summation order of attention over the masked columns differs
from the single-prompt run (as in a batched ``decode``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from unmask.compat import attention_mask, forward, keep_rows
from unmask.decode import sbd_verify as sv
from unmask.decode.kv import DynamicKV
from unmask.errors import UnmaskError
from unmask.masks import as_4d, with_key_padding
from unmask.serve.running import compact_if_sparse, merge_kv, split_rows
from unmask.trace import step_event

OPTIONS = ("block_size", "draft")


@dataclass
class Row:
    """One running request.

    ``job`` is the scheduler's handle (``prompt_ids``, ``max_new_tokens``, ``sampling``, ``stop``);
    ``generator`` its own (None when greedy); ``committed`` the ids committed so far (a stop token
    and what follows it in its step included). Once finished: ``tokens`` (the output, cut before
    the first stop token or after the token completing a stop string, at most
    ``max_new_tokens``), ``nfe`` (its forwards, the prefill included), ``finish`` ("stop" or
    "length") and ``extra`` (``sbd_verify.decode``'s ``row_extra`` entry for it)."""

    job: object
    generator: torch.Generator | None
    committed: list[int] = field(default_factory=list)
    nfe: int = 0
    accepts: list[int] = field(default_factory=list)  # tokens committed by each of its forwards
    tokens: list[int] | None = None
    finish: str | None = None
    extra: dict | None = None


class VerifyBatch:
    """The running set of lossless SBD rows of one model and one draft setting, advanced one step
    (one forward) at a time.

    options: ``block_size`` (K >= 2) and ``draft`` ("quadratic" or "linear"; None = default),
    validated once by :class:`~unmask.decode.sbd_verify.VerifyConfig`. Per row (the job): prompt,
    ``max_new_tokens``, ``sampling``, stop strings. ``stop_token_ids`` defaults to the bundle's.
    ``on_step(row, event)`` gets each row's :mod:`unmask.trace` step event, the one
    ``sbd_verify.decode`` on that prompt alone emits (``row`` 0, ``step`` the row's own forward
    index; the prefill is step 0).

    ``join(jobs)`` prefills new rows and returns those finished by their first token; ``step()``
    runs one forward of shape (R, K + G·K) for every running row and returns the rows that finished
    in it (removed); ``drop(pred)`` evicts rows (cancelled, timed out). ``forwards`` counts this
    batch's prefill and step forwards. Raises UnmaskError for a model without a mask token, an
    unknown option or a bad value.
    """

    def __init__(self, bundle, options: dict | None = None, on_step=None, *, stop_token_ids=None):
        if bundle.mask_token_id is None:
            raise UnmaskError("lossless SBD needs a model with a mask token (an SBD model, or a base with an "
                              "SBD adapter: --adapter); train one with 'unmask train sbd' or "
                              "'unmask train sbd-adapter'")
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise UnmaskError(f"option(s) {', '.join(unknown)} do not apply to a continuous lossless SBD batch; "
                              f"use only {', '.join(OPTIONS)}")
        self.cfg = sv.VerifyConfig(**{k: v for k, v in options.items() if v is not None})
        K = self.cfg.block_size
        if 2 * K > bundle.context_length:
            raise UnmaskError(f"block size {K} is too large for the context window of {bundle.context_length}; "
                              "lower --block-size")
        self.bundle, self.on_step = bundle, on_step
        self.device, self.mask_id = bundle.device, bundle.mask_token_id
        self.layout = sv.step_layout(K, self.cfg.draft, self.device)
        ids = bundle.stop_token_ids if stop_token_ids is None else stop_token_ids
        self.stop_set = set(ids)
        self.suppress = list(bundle.suppress_ids)
        self.rows: list[Row] = []
        self.forwards = 0
        self._empty()

    def _empty(self) -> None:
        self.kv: DynamicKV | None = None
        self.key_valid: torch.Tensor | None = None  # (R, kv.length) bool: the cache columns each row attends to
        self.b: torch.Tensor | None = None  # (R,) long: the bonus token, committed, its K/V not yet cached
        self.s: torch.Tensor | None = None  # (R, K-1) long: the draft after b
        self.q: torch.Tensor | None = None  # (R, K-1, V) float: its proposal distributions (None: no sampled row)
        self.draft_len: torch.Tensor | None = None  # (R,) long: real draft tokens (K-1; 0 after a rejected linear one)
        self.p_b: torch.Tensor | None = None  # (R,) long: position of b

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def cache(self):
        """The running ``DynamicCache`` (None when no row is running)."""
        return None if self.kv is None else self.kv.cache

    # -- joining ------------------------------------------------------------------------------

    @torch.inference_mode()
    def join(self, jobs: list) -> list[Row]:
        """Prefill each job alone (its prompt, causal, and one draft group after it: spec §1,
        Prefill) and add it to the running batch. Returns the rows finished by the first bonus
        token (a stop token, a stop string or ``max_new_tokens`` <= 1), never added. Raises
        UnmaskError, before any job joins, when a prompt is empty."""
        K, model, dev = self.cfg.block_size, self.bundle.model, self.device
        if any(len(job.prompt_ids) == 0 for job in jobs):  # the verify step needs a cached prefix
            raise UnmaskError("lossless SBD needs a non-empty prompt; start it with the BOS token")
        done = []
        for job in jobs:
            prompt = list(job.prompt_ids)
            gens = job.sampling.row_generators([prompt], dev)  # the generator decode gives it
            row = Row(job=job, generator=None if gens is None else gens[0])
            inp, positions, m, kv_valid, valid, _ = sv.prefill_inputs(self.bundle, [prompt], K)  # (1, P+K) ...
            m = with_key_padding(as_4d(m, 1), kv_valid)  # (1, 1, P+K, P+K)
            kv = DynamicKV(model)
            logits = forward(model, inp, position_ids=positions, attention_mask=attention_mask(model, m),
                             cache=kv.cache, logits_to_keep=K + 1)  # (1, K+1, V): last prompt token + group
            kv.crop(K)
            self.forwards += 1
            if self.suppress:
                logits[..., self.suppress] = float("-inf")
            b, _ = sv._draw(logits[:, 0], job.sampling, gens)  # (1,) the first bonus
            s, q = sv._draw(logits[:, 2:], job.sampling, gens)  # (1, K-1) draft from group offsets 1..K-1
            row.committed, row.nfe, row.accepts = [int(b)], 1, [1]
            if self.on_step is not None:
                canvas = torch.tensor(row.committed + [self.mask_id] * (K - 1), device=dev)  # (K,)
                self.on_step(row, step_event(0, 0, torch.ones(1, dtype=torch.bool), b, 0, canvas, self.mask_id))
            if self._finished(row, 0):
                done.append(row)
                continue
            self._merge(row, kv, valid, b, s, q, len(prompt))
        return done

    def _merge(self, row: Row, kv: DynamicKV, valid: torch.Tensor, b, s, q, p_b: int) -> None:
        """Append one prefilled row: its cache (P columns), key validity (1, P), bonus (1,), draft
        (1, K-1) and proposals (1, K-1, V) or None."""
        K, dev = self.cfg.block_size, self.device
        draft_len = torch.full((1,), K - 1, dtype=torch.long, device=dev)
        pos = torch.full((1,), p_b, dtype=torch.long, device=dev)
        if not self.rows:
            self.rows, self.kv, self.key_valid = [row], kv, valid
            self.b, self.s, self.q, self.draft_len, self.p_b = b, s, q, draft_len, pos
            return
        self.kv, self.key_valid = merge_kv(self.bundle.model, self.kv, self.key_valid, kv, valid)  # (R + 1, T)
        if q is not None or self.q is not None:  # greedy rows hold zeros (never read)
            like = q if q is not None else self.q
            old_q = self.q if self.q is not None else like.new_zeros((len(self.rows), *like.shape[1:]))
            self.q = torch.cat([old_q, q if q is not None else like.new_zeros((1, *like.shape[1:]))])  # (R+1, K-1, V)
        self.b, self.s = torch.cat([self.b, b]), torch.cat([self.s, s])
        self.draft_len, self.p_b = torch.cat([self.draft_len, draft_len]), torch.cat([self.p_b, pos])
        self.rows.append(row)

    # -- stepping -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One verify forward (spec §1) for every running row: (R, Q) queries, Q = K + G·K. Each row
        commits its accepted draft prefix and a bonus token and takes its next draft. Returns the
        rows that finished in it (a stop token, a stop string, ``max_new_tokens``), already removed
        from the batch, with ``tokens``, ``nfe``, ``finish`` and ``extra`` set."""
        if not self.rows:
            return []
        cfg, layout, dev, mask_id = self.cfg, self.layout, self.device, self.mask_id
        K, G, Q, R = cfg.block_size, layout.groups, layout.queries, len(self.rows)
        self._compact_if_sparse()
        if cfg.draft == "linear":
            L = torch.where(self.draft_len > 0, K - 1, 0)  # (R,) layout index: the group follows K verify tokens, or 1
            lay_m, lay_o = layout.mask[L], layout.offsets[L]  # (R, Q, Q), (R, Q)
        else:
            lay_m, lay_o = layout.mask[K - 1].expand(R, Q, Q), layout.offsets[K - 1].expand(R, Q)
        draft_in = torch.where(self.draft_len[:, None] > 0, self.s, mask_id)  # (R, K-1): no draft -> mask placeholders
        inp = torch.cat([self.b[:, None], draft_in, torch.full((R, G * K), mask_id, dtype=torch.long, device=dev)],
                        dim=1)  # (R, Q)
        positions = self.p_b[:, None] + lay_o  # (R, Q)
        past = self.key_valid.shape[1]
        m = torch.cat([self.key_valid[:, None, :].expand(R, Q, past), lay_m], dim=2)[:, None]  # (R, 1, Q, past+Q)
        logits = forward(self.bundle.model, inp, position_ids=positions,
                         attention_mask=attention_mask(self.bundle.model, m), cache=self.kv.cache)  # (R, Q, V)
        self.forwards += 1
        if self.suppress:
            logits[..., self.suppress] = float("-inf")
        a, step_tok = self._accept(logits)  # (R,), (R, K)

        committed = a + 1  # (R,)
        if cfg.draft == "linear":  # the group's draft is usable only after a fully accepted one
            self.draft_len = torch.where(a == self.draft_len, K - 1, 0)
        self.b = step_tok.gather(1, a[:, None])[:, 0]  # (R,) the bonus
        self.p_b = self.p_b + committed
        new = torch.arange(K, device=dev)[None, :] < committed[:, None]  # (R, K) which step tokens are real
        host = torch.cat([committed, step_tok.flatten()]).tolist()  # the step's one host sync
        counts, toks = host[:R], host[R:]
        # cache: keep b, s_1..s_a of each row; the groups' K/V and the tail no row accepted go
        unused = K - max(counts)
        self.kv.crop(G * K + unused)
        self.key_valid = torch.cat([self.key_valid, new[:, : K - unused]], dim=1)  # (R, past + K - unused)
        finished = []
        for i, (row, c) in enumerate(zip(self.rows, counts)):
            n_before = len(row.committed)
            row.committed += toks[i * K: i * K + c]
            row.nfe += 1
            row.accepts.append(c)
            if self.on_step is not None:
                canvas = torch.tensor(row.committed + [mask_id] * (K - 1), device=dev)  # (n + K-1,)
                self.on_step(row, step_event(row.nfe - 1, 0, new[i], step_tok[i], n_before, canvas, mask_id))
            if self._finished(row, n_before):
                finished.append(row)
        if finished:
            ids = {id(row) for row in finished}
            self.drop(lambda row: id(row) in ids)
        return finished

    def _accept(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Accept and redraft every row from the verify forward's logits (R, Q, V) (spec §1, Accept),
        rows grouped by sampling setting, each sampled row with its own generator. Sets ``s`` and
        ``q`` to the next draft; returns a (R,) accepted draft tokens and step_tok (R, K) long, whose
        first a + 1 entries are the committed tokens (s_1..s_a, then the bonus)."""
        K, G, dev = self.cfg.block_size, self.layout.groups, self.device
        R = len(self.rows)
        ar = torch.arange(K, device=dev)  # (K,)
        groups: dict = {}
        for r, row in enumerate(self.rows):
            groups.setdefault(row.job.sampling, []).append(r)
        whole = len(groups) == 1
        a = torch.empty(R, dtype=torch.long, device=dev)
        step_tok = torch.empty((R, K), dtype=torch.long, device=dev)
        s_next = torch.empty_like(self.s)  # (R, K-1)
        q_next = None
        for sampling, idx in groups.items():
            at = torch.tensor(idx, dtype=torch.long, device=dev)  # (n,)
            lg = logits if whole else logits[at]  # (n, Q, V)
            s, draft_len = (self.s, self.draft_len) if whole else (self.s[at], self.draft_len[at])
            n = lg.shape[0]
            if sampling.greedy:
                top = lg.argmax(dim=-1)  # (n, Q): NTP targets at b, s_1..s_{K-1}, then the groups' fills
                ai = sv.greedy_accept(top[:, :K], s, draft_len)  # (n,)
                tok = top[:, :K]  # accepted drafts equal their targets: s_1..s_a, then the bonus
            else:
                gens = [self.rows[r].generator for r in idx]
                q = self.q if whole else self.q[at]
                ai, last = sv.speculative_accept(sv._probs(lg[:, :K], sampling), q, s, draft_len, gens)
                tok = torch.where(ar[None, :] < ai[:, None], torch.cat([s, s[:, :1]], dim=1), 0)  # (n, K)
                tok = tok.scatter(1, ai[:, None], last[:, None])  # (n, K): tokens 0..a valid
            # the next draft: group a's offsets 1..K-1 (quadratic), or the single group
            g = ai if self.cfg.draft == "quadratic" else torch.zeros_like(ai)
            rows = torch.arange(n, device=dev)
            if sampling.greedy:
                si, qi = top[:, K:].view(n, G, K)[rows, g, 1:], None  # (n, K-1)
            else:
                si, qi = sv._draw(lg[:, K:].view(n, G, K, -1)[rows, g, 1:], sampling, gens)  # (n, K-1), (n, K-1, V)
            a[at], step_tok[at], s_next[at] = ai, tok, si
            if qi is not None:
                if q_next is None:
                    q_next = qi.new_zeros((R, *qi.shape[1:]))  # (R, K-1, V); greedy rows keep zeros
                q_next[at] = qi
        self.s, self.q = s_next, q_next
        return a, step_tok

    def _finished(self, row: Row, start: int) -> bool:
        """Whether ``row`` ends after its latest commit (``start``: its committed count before it):
        a stop token, a stop string completed by a token from ``start`` on, or ``max_new_tokens``.
        Sets ``tokens``, ``finish`` and ``extra`` when it does (``sbd_verify._retire``'s cut)."""
        job, N = row.job, row.job.max_new_tokens
        ids, hit = sv.cut_row(self.bundle, list(job.prompt_ids), row.committed, self.stop_set, job.stop, start)
        at_stop = len(ids) < len(row.committed) and not hit  # cut before a stop token
        if not (at_stop or hit or len(row.committed) >= N):
            return False
        row.tokens = ids[:N]
        # a stop token past N or a stop string completed past N comes after the length limit
        row.finish = "stop" if (at_stop and len(ids) < N) or (hit and len(ids) <= N) else "length"
        row.extra = {"verify": True, "draft": self.cfg.draft, "block_size": self.cfg.block_size,
                     "accepts": row.accepts}
        return True

    # -- leaving ------------------------------------------------------------------------------

    @torch.inference_mode()
    def drop(self, pred) -> list[Row]:
        """Remove the rows for which ``pred(row)`` is true, with their draft state and cache rows. A
        batch left empty frees its cache (``cache`` None). Returns the removed rows."""
        gone, kept, idx = split_rows(self.rows, pred, self.device)  # idx (R',)
        if not gone:
            return []
        self.rows = kept
        if not self.rows:
            self._empty()
            return gone
        keep_rows(self.kv.cache, idx)
        self.key_valid, self.b, self.s = self.key_valid[idx], self.b[idx], self.s[idx]  # (R', ...) each
        self.draft_len, self.p_b = self.draft_len[idx], self.p_b[idx]
        if self.q is not None:
            self.q = self.q[idx] if any(not row.job.sampling.greedy for row in self.rows) else None
        self._compact_if_sparse()
        return gone

    def _compact_if_sparse(self) -> None:
        """Reclaim the cache columns no row attends to (rejected drafts, left padding, rows that left)
        when they make up more than half of the cache and at least one block."""
        self.key_valid = compact_if_sparse(self.kv, self.key_valid, self.cfg.block_size)


__all__ = ["OPTIONS", "Row", "VerifyBatch"]
