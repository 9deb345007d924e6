"""A request's asks in the verify batch (``ar``, lossless ``sbd``; spec/structured.md §1–4): its
``logit_bias``, its grammar and its ``logprobs``, all exact: a row's output equals constrained (and
biased) AR's, its logprobs equal AR's.

Per step, for the rows that ask (no row asking: no work, and the compiled whole step runs):

- before the forward (:meth:`Shaping.prepare`; one host read of the drafts, none when each grammar row
  drafts from its candidates on a chain layout): a grammar row's forced
  ids (the grammar allows one id alone, then one after it, ...) go into its draft, so they are accepted
  for free (§3; within K - 1 on a block layout; on the host layout they replace the model-free draft); a
  greedy row's whole draft is rebuilt on the host from its block mode's ranked candidates
  (:data:`CANDIDATES` per position, read with the previous step) and the forced ids: the best id the
  grammar allows at each position (any draft is lossless; one the grammar refuses could never be
  accepted); then its matcher fills the allowed-id bitmask of every query on each draft path (the state
  after b and the path's ids before it, rolled back after), so a refused draft id ends its path (§2);
- after the forward (:meth:`Shaping.apply`, on the logits the acceptance reads): the raw logits kept
  for logprobs, the bias added, the grammar's disallowed ids set to -inf;
- after acceptance (:meth:`Shaping.record`): each committed id's logprob and top-k from the raw logits
  at the query that produced it (the winning path's node), packed into the step's one host read;
- after the read (:meth:`Shaping.after_read`): the entries appended to ``row.logprobs`` (aligned with
  ``row.committed``; cut to ``row.tokens`` when the row finishes) and each matcher advanced over the
  committed ids. A grammar that refuses every id ends its row: ``finish = "error"``.
"""

from __future__ import annotations

import numpy as np
import torch

from unmask.decode.engine import shaping as sh
from unmask.decode.verify.config import queries
from unmask.decode.verify.host_drafts import place_drafts
from unmask.grammar import allowed


CANDIDATES = 4  # ranked block-mode ids kept per next-draft position of a greedy grammar row


class Shaping:
    """The asks of a :class:`~unmask.decode.verify.batch.Verify` batch's rows (see the module docstring)."""

    def __init__(self, batch):
        self.batch = batch
        self.asking = 0  # running rows with any ask
        self.slot_bias = sh.SlotBias()  # the forward's (R, V) bias of the rows in its slots, cached
        self.bits = None  # (R, Q, words) int32 of the step: the grammar rows' allowed ids per query
        self.raw = None  # (R, Q, V) the step's logits before bias and mask (a row asks logprobs)
        self.cols = None  # the step's logprob columns, for the host read
        self.tables = {}  # Kmax -> the window tables' tok, path, path_len as host lists
        self.cand = None  # (R, Kmax - 1, CANDIDATES) the step's ranked next-draft ids (greedy grammar rows)

    @property
    def active(self) -> bool:
        return self.asking > 0

    def left(self, rows) -> None:
        """Rows left (finished or dropped)."""
        self.asking -= sum(sh.asks_any(r.job) for r in rows)

    # ------------------------------------------------------------------ prefill
    def prefill(self, rows, logits: torch.Tensor) -> torch.Tensor | None:
        """Joining ``rows`` (in order; not yet counted): each grammar row's matcher; on the prefill's
        first-token query ``logits[:, 0]`` (n, V): the raw copy for logprobs (returned; None when no row asks
        logprobs), the rows' bias and each grammar's mask at its start, in place."""
        if not any(sh.asks_any(r.job) for r in rows):
            return None
        for row in rows:
            row.logprobs = [] if sh.asks_logprobs(row.job) is not None else None
            row.matcher = None if (g := sh.asks_grammar(row.job)) is None else g.matcher()
        first = logits[:, 0]
        raw = first.clone() if any(sh.asks_logprobs(r.job) is not None for r in rows) else None
        sh.add_bias(first, sh.bias_rows([sh.asks_bias(r.job) for r in rows], first.shape[-1], first.device))
        for i, row in enumerate(rows):
            if row.matcher is not None:
                bits = torch.full((1, row.matcher.words), -1, dtype=torch.int32)
                row.matcher.mask(bits[0])
                first[i].masked_fill_(~allowed(bits[0], first.shape[-1]).to(first.device), float("-inf"))
        return raw

    def prefilled(self, rows, raw, b: torch.Tensor, firsts: list[int]) -> None:
        """The rows joined: counted; the first ids' logprobs (one extra read, the prefill's), matchers advanced."""
        self.asking += sum(sh.asks_any(r.job) for r in rows)
        if raw is not None:
            k = max(sh.asks_logprobs(r.job) or 0 for r in rows)
            chosen, ids, vals = sh.columns(raw, b, k)
            got = torch.cat([sh.as_bits(chosen)[:, None].long(), ids.long(), sh.as_bits(vals).long()], 1).tolist()
            for row, g, t in zip(rows, got, firsts):
                if row.logprobs is not None:
                    kk = sh.asks_logprobs(row.job)
                    row.logprobs.extend(sh.entries([t], [g[0]], [g[1: 1 + kk]], [g[1 + k: 1 + k + kk]]))
        for row, t in zip(rows, firsts):
            self._advance(row, [t])

    # ------------------------------------------------------------------ a step
    def prepare(self) -> list:
        """Before a step's forward: forced ids into the grammar rows' drafts, then their
        bitmasks (R, Q, words). Returns the rows whose grammar allows no id (``finish = "error"``; the
        caller frees them and prepares again), else []."""
        b = self.batch
        self.bits, self.raw, self.cols = None, None, None
        grammar = [r for r in b.rows.values() if r.matcher is not None] if self.asking else []
        if not grammar:
            return []
        if b.cfg.host and (placing := [(r, f) for r in grammar if (f := r.matcher.forced(b.cfg.block_size - 1))]):
            place_drafts(b, placing)  # the host layout: forced ids are the row's draft, its K follows them
            for r, _ in placing:
                if r.drafts is not None:
                    r.drafts.placed = 0  # its drafter's acceptance record learns nothing from forced ids
        Kmax = max(r.K for r in b.rows.values())
        R, Q, tw = b.slots.bucket if b.static else b.slots.high, queries(Kmax, b.cfg.draft, b.cfg.smaller), b._tables(Kmax)
        W = b.s.shape[1]
        # the drafts on the host (one read), unless every grammar row drafts from its candidates alone
        need = [r.slot for r in grammar if r.cands is None or r.K == 1 or tw.H or b.cfg.host]
        idx = torch.tensor(need, dtype=torch.long, device=b.device)
        got = dict(zip(need, torch.cat([b.draft_len[idx, None], b.s[idx], b.sib[idx, : tw.H]], 1).tolist()
                       if need else []))
        words = grammar[0].matcher.words
        bits = np.full((R, Q, words), -1, dtype=np.int32)  # numpy: filling and checking it reads no device
        if Kmax not in self.tables:
            self.tables[Kmax] = (tw.tok.tolist(), tw.path.tolist(), tw.path_len.tolist())
        tok, path, path_len = self.tables[Kmax]
        for row in grammar:
            g = got.get(row.slot) or [0] * (1 + W)
            K, dl, s, sib = row.K, g[0], g[1: 1 + W], g[1 + W:]
            if row.cands is not None and K > 1:  # greedy: forced ids and the best allowed candidates
                new = row.matcher.draft(row.cands, K - 1)
                s[: len(new)], dl, row.cands = new, len(new), None
            elif m := len(new := row.matcher.forced(0 if b.cfg.host else K - 1)):  # accepted for free (§3)
                s[:m], dl = new, max(dl, m)
            if new:
                b.s[row.slot, : len(new)] = torch.tensor(new, dtype=torch.long, device=b.device)
            b.draft_len[row.slot] = dl
            pool = [row.committed[-1], *s[: Kmax - 1], *sib, b.fill_id]  # tree.py's pool: b, the draft, siblings, mask
            for p, L in enumerate(path_len[K - 1][dl]):
                if p and not L:
                    continue  # no such sibling path at this draft length
                nodes = path[K - 1][dl][p][: L + 1]
                draft = [pool[tok[K - 1][dl][q]] for q in nodes[1:]]
                if p:  # a sibling path: its own rows, scattered to its queries
                    out = np.full((len(nodes), words), -1, dtype=np.int32)
                    row.matcher.path_masks(draft, out)
                    bits[row.slot, nodes] = out
                else:  # the chain: verify queries 0..L, consecutive rows of the row's bitmasks
                    row.matcher.path_masks(draft, bits[row.slot, : L + 1])
        failed = []
        for row in grammar:
            if row.error is not None:  # its matcher failed on the last commit: in error it allows EOS alone
                row.finish = "error"
                failed.append(row)
            elif not bits[row.slot, 0].any():  # the grammar allows no id at all (a numpy read)
                row.finish, row.error = "error", f"the grammar allows no token after {len(row.tokens)} generated " \
                    f"tokens{f' ({row.matcher.error})' if row.matcher.error else ''}; check the grammar"
                failed.append(row)
        self.bits = torch.from_numpy(bits).to(b.device)
        return failed

    def apply(self, logits: torch.Tensor) -> None:
        """After a step's forward, on its logits (R, Q, V) (suppressed ids already -inf): keep the raw logits
        for logprobs, add the bias, mask what the grammar refuses, in place."""
        if not self.active:
            return
        R, V = logits.shape[0], logits.shape[-1]
        bias = self.slot_bias([self.batch.rows.get(s) for s in range(R)], V, logits.device)
        if any(sh.asks_logprobs(r.job) is not None for r in self.batch.rows.values()):
            self.raw = logits.clone() if (bias is not None or self.bits is not None) else logits
        sh.add_bias(logits, bias)
        if self.bits is not None:
            logits.masked_fill_(~allowed(self.bits[:R], logits.shape[-1]), float("-inf"))

    def record(self, tw, K: torch.Tensor, dl: torch.Tensor, a: torch.Tensor, p: torch.Tensor, step_tok: torch.Tensor,
               logits: torch.Tensor) -> None:
        """After acceptance (a accepted on path p (R,), step_tok (R, Kmax), logits (R, Q, V) as accepted): the
        logprob columns of the step's ids, each at its window query on the winning path (AR rows: query 0);
        with greedy grammar rows on a block layout, the ranked candidates of each next-draft position (the
        queries the next draft comes from), from which :meth:`prepare` drafts ids the grammar allows."""
        R, Kmax = step_tok.shape
        if Kmax > 1 and self.bits is not None and not self.batch.cfg.host and any(
                r.matcher is not None and r.job.sampling.greedy for r in self.batch.rows.values()):
            src = tw.src[K - 1, dl, p, a][:, : Kmax - 1]  # (R, Kmax - 1)
            self.cand = logits.gather(1, src[..., None].expand(R, Kmax - 1, logits.shape[-1])).topk(
                min(CANDIDATES, logits.shape[-1]), dim=-1).indices  # (R, Kmax - 1, C)
        if self.raw is None:
            return
        at = tw.path[K - 1, dl, p, :Kmax]  # (R, Kmax): the winning path's nodes (AR rows: query 0)
        raw = self.raw.gather(1, at[..., None].expand(R, Kmax, self.raw.shape[-1]))  # (R, Kmax, V)
        k = max(sh.asks_logprobs(r.job) or 0 for r in self.batch.rows.values())
        chosen, ids, vals = sh.columns(raw, step_tok, k)
        self.cols = (k, sh.as_bits(chosen), ids, sh.as_bits(vals).reshape(R, -1))
        self.raw = None

    def read(self, read) -> None:
        """Add the step's logprob columns to its one host read."""
        if self.cols is not None:
            k, chosen, ids, vals = self.cols
            read.add("lp", chosen).add("lp_ids", ids.reshape(ids.shape[0], -1)).add("lp_vals", vals)
        if self.cand is not None:
            read.add("cand", self.cand.reshape(self.cand.shape[0], -1))

    def after_read(self, got: dict) -> None:
        """The host side of a step: logprob entries appended, matchers advanced over the committed ids."""
        if not self.active:
            return
        for slot, row in self.batch.rows.items():
            c = got["committed"][slot]
            new = got["tokens"][slot][:c]
            if row.logprobs is not None and "lp" in got:
                k, kk = self.cols[0], sh.asks_logprobs(row.job)
                ids, vals = got["lp_ids"][slot], got["lp_vals"][slot]
                row.logprobs.extend(sh.entries(new, got["lp"][slot][:c], [ids[j * k: j * k + kk] for j in range(c)],
                                               [vals[j * k: j * k + kk] for j in range(c)]))
            self._advance(row, new[: max(row.job.max_new_tokens - len(row.committed), 0)])  # ids past N: never output
            if "cand" in got and row.matcher is not None and row.job.sampling.greedy:
                C = self.cand.shape[2]
                n = got["dlen"][slot]  # the next block draft's length: its candidates past it are no draft
                row.cands = [got["cand"][slot][j * C: (j + 1) * C] for j in range(min(n, self.cand.shape[1]))]
        self.cols = self.cand = None

    def _advance(self, row, ids: list[int]) -> None:
        if row.matcher is not None and not row.matcher.consume(ids) and row.error is None:
            row.error = grammar_error(row.matcher)


def grammar_error(matcher) -> str:
    """The error of a row whose ``matcher`` failed on a committed id. A refused id is this module's fault (the
    masks allow only ids the grammar takes); an engine that gave up (its parser's item or lexer limits) is
    the grammar's."""
    if not getattr(matcher, "gave_up", False):
        return f"the grammar refused a committed token ({matcher.error}); report it with the request"
    return (f"the grammar engine gave up on this grammar ({matcher.error}): it is too large for the engine or has no "
            "finite output; simplify the grammar")


__all__ = ["Shaping"]
