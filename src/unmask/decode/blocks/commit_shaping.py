"""A request's ``logit_bias`` and commit-time ``logprobs`` on the decoders that commit from a canvas or a
block (diffusion, Dream's schedule, early-bird, block, lossy sbd, multiblock): written once here, called
by each running batch at the same three points of its step (structured.md §1, §4).

1. :meth:`CommitShaping.shape` after the forward: one dense bias row per slot of the forward
   (:class:`~unmask.decode.engine.shaping.SlotBias`, rebuilt only when the rows in the slots change),
   added to the logits before the decoder's confidence, entropy or sampling rule reads them; a batch with
   no bias adds nothing, a row without one adds zeros (its logits stay bit-identical).
2. :meth:`CommitShaping.add` after the commit: with some row asking ``logprobs``, the log-softmax of
   the RAW logits (suppressed ids at -inf; before bias, temperature, top-k/top-p) at every query
   column, the committed token's value and the top-k, added to the step's one
   :class:`~unmask.decode.engine.host.HostRead` as int32 bits; nothing when no row asks.
3. :meth:`CommitShaping.take` per row after the read, and :meth:`CommitShaping.finish` when it ends:
   ``row.logprobs``, one :class:`~unmask.decode.engine.shaping.TokenLogprob` per output token in
   position order, from the forward that last committed (or, multiblock's T2T, edited) it.
"""

from __future__ import annotations

import math

import torch

from unmask.decode.engine.shaping import SlotBias, TokenLogprob, add_bias, as_bits, asks_logprobs, columns, entries


def slotted(running: dict, n: int) -> list:
    """The row in each slot [0, n) of a forward (``running``: slot -> row), None for a free one."""
    return [running.get(s) for s in range(n)]


class CommitShaping:
    """Per-slot logit bias and commit-time logprobs of one running batch (see the module docstring).

    Holds, per running row that asks logprobs, {generated position: (logprob, top)} until
    :meth:`finish` or :meth:`forget`."""

    def __init__(self):
        self.bias = SlotBias()  # (rows, V, device) -> the forward's (n, V) bias, or None
        self._marks: dict = {}  # row -> {generated position: (logprob, ((id, logprob), ...))}

    def shape(self, rows: list, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bias ``logits`` (n, Q, V) in place for the rows in slots [0, n): returns (the biased logits,
        the raw ones), the raw a copy only when a bias is added and some row asks logprobs."""
        bias = self.bias(rows, logits.shape[-1], logits.device)
        if bias is None:
            return logits, logits
        raw = logits.clone() if self.k(rows) is not None else logits
        return add_bias(logits, bias), raw

    @staticmethod
    def k(rows) -> int | None:
        """The most top alternatives any of ``rows`` (rows or None) asks; None when none asks logprobs."""
        ks = [asks_logprobs(r.job) for r in rows if r is not None and asks_logprobs(r.job) is not None]
        return max(ks) if ks else None

    def add(self, read, rows: list, step) -> None:
        """Add the step's logprob columns ("lp_*") to ``read`` (a HostRead over the same n slots) when
        some of ``rows`` asks. ``step()`` -> (raw, tokens, on, first), called only then (a step no row
        asks of runs no tensor op more): ``raw`` (n, Q, V) the forward's raw logits, ``tokens`` (n, Q)
        the ids committed, ``on`` (n, Q) bool the columns committed this step, ``first`` (n,) long (or
        an int, or a list of n ints) the generated position of column 0 (column j is position first + j)."""
        k = self.k(rows)
        if k is None:
            return
        raw, tokens, on, first = step()
        n, Q = tokens.shape
        chosen, ids, vals = columns(raw, tokens, k)  # (n, Q), (n, Q, k), (n, Q, k)
        if not torch.is_tensor(first):
            first = torch.tensor([first] * n if isinstance(first, int) else first, dtype=torch.long,
                                 device=tokens.device)
        read.add("lp_on", on).add("lp_first", first).add("lp", as_bits(chosen))
        read.add("lp_ids", ids.reshape(n, Q * k)).add("lp_vals", as_bits(vals).reshape(n, Q * k))

    def take(self, row, got: dict, r: int) -> None:
        """Keep what row ``row`` (index ``r`` of the read ``got``) committed this step, when it asks
        logprobs (a later commit at a position replaces an earlier one)."""
        k = asks_logprobs(row.job)
        if k is None or "lp_on" not in got:
            return
        on, first = got["lp_on"][r], got["lp_first"][r]
        cols = [j for j, c in enumerate(on) if c and first + j >= 0]
        if not cols:
            return
        K = len(got["lp_ids"][r]) // len(on)  # the step's k (the most any row asked)
        ids, vals = got["lp_ids"][r], got["lp_vals"][r]
        got_entries = entries([0] * len(cols), [got["lp"][r][j] for j in cols],
                              [ids[j * K: j * K + k] for j in cols], [vals[j * K: j * K + k] for j in cols])
        marks = self._marks.setdefault(row, {})
        for j, e in zip(cols, got_entries):
            marks[first + j] = (e.logprob, e.top)

    def finish(self, row) -> None:
        """Set a finished row's ``logprobs``: one TokenLogprob per id of ``row.tokens``, in position order
        (NaN for a position no step recorded, which the decoders' commit rules never leave)."""
        marks = self._marks.pop(row, {})
        if asks_logprobs(row.job) is None:
            return
        row.logprobs = [TokenLogprob(t, *marks.get(i, (math.nan, ()))) for i, t in enumerate(row.tokens)]

    def forget(self, row) -> None:
        """A row left without finishing (dropped): its marks go."""
        self._marks.pop(row, None)


__all__ = ["CommitShaping", "slotted"]
