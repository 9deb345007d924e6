"""Suffix-decoding drafts (SuffixDecoding, arXiv 2411.04975; spec/draft_sources.md §1; vLLM ``suffix``).

A suffix tree of bounded depth D is kept as its count tables: for each context length m = 1 .. D-1,
how often each id followed each m-gram. A row's own history has its tables (:class:`Suffix`); a
server keeps one shared, memory-bounded :class:`SuffixCache` per model over recent requests'
prompts and outputs, and every row of that model reads it. Pure host-side Python: no torch, no model.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import deque
from collections.abc import Sequence

# A table maps a context (a tuple of 1 .. D-1 ids; tuples of different lengths never collide) to
# {next id: count}. The inner dict's order is the order of the latest count of each id (an id counted
# again is moved to the end), so the most recent of equally frequent continuations is the last one.
Table = dict[tuple[int, ...], dict[int, int]]

# Approximate CPython bytes of one (context, next id) entry (its share of the context tuple, the outer
# and inner dict slots, the count) and of one stored id (a list slot and the int). Fitted to tracemalloc
# on stories260K's and SmolLM2's greedy outputs, depth 4 and 8: within about a third of the truth.
BYTES_PER_ENTRY = 240
BYTES_PER_TOKEN = 36


def _count(table: Table, seq: Sequence[int], j: int, depth: int, delta: int) -> int:
    """Add ``delta`` (+1 or -1) to the counts of ``seq[j]`` after each context ``seq[j-m:j]``, m = 1 ..
    min(depth - 1, j). Returns the change in the number of entries."""
    nxt, change = seq[j], 0
    for m in range(1, min(depth - 1, j) + 1):
        ctx = tuple(seq[j - m:j])
        row = table.get(ctx)
        if delta > 0:
            if row is None:
                table[ctx] = row = {}
            c = row.pop(nxt, 0)
            row[nxt] = c + 1  # re-inserted last: the most recent continuation
            change += c == 0
        else:
            c = row[nxt] - 1
            if c:
                row[nxt] = c
            else:
                del row[nxt]
                change -= 1
                if not row:
                    del table[ctx]
    return change


class SuffixCache:
    """Shared, memory-bounded store of recent documents (a finished request's prompt + output ids) of
    ONE model, for suffix decoding (arXiv 2411.04975, spec §1).

    :meth:`add` stores a document and its count tables (contexts of 1 .. ``depth`` - 1 ids); while more
    than ``max_tokens`` ids are stored, the oldest documents are evicted and their counts removed
    exactly, so the tables hold at most (``depth`` - 1) · ``max_tokens`` entries. A document longer
    than ``max_tokens`` keeps only its last ``max_tokens`` ids. Documents of different models must go
    to different caches (ids of one vocabulary mean nothing in another). Thread-safe: :meth:`add` and
    :meth:`clear` from one thread while rows of other threads read it (:class:`Suffix`).

    Raises:
        ValueError: ``max_tokens < 1`` or ``depth < 2``.
    """

    def __init__(self, max_tokens: int = 262144, depth: int = 8):
        if max_tokens < 1 or depth < 2:
            raise ValueError(f"SuffixCache needs max_tokens >= 1 and depth >= 2 (got max_tokens={max_tokens}, "
                             f"depth={depth}); pass e.g. max_tokens=262144, depth=8")
        self.max_tokens, self.depth = int(max_tokens), int(depth)
        self.table: Table = {}
        self.lock = threading.Lock()
        self._docs: deque[list[int]] = deque()
        self.tokens = 0  # ids stored, over all documents (<= max_tokens)
        self.entries = 0  # (context, next id) pairs in the tables (<= (depth - 1) · tokens)

    @property
    def documents(self) -> int:
        """Documents stored."""
        return len(self._docs)

    @property
    def bytes(self) -> int:
        """Approximate memory of the tables and documents in bytes (CPython; an estimate to report)."""
        return self.entries * BYTES_PER_ENTRY + self.tokens * BYTES_PER_TOKEN

    def add(self, tokens: Sequence[int]) -> None:
        """Store one document (its ids), evicting the oldest documents while more than ``max_tokens``
        ids are stored."""
        doc = [int(t) for t in tokens[-self.max_tokens:]]
        if not doc:
            return
        with self.lock:
            self._docs.append(doc)
            self.tokens += len(doc)
            for j in range(1, len(doc)):
                self.entries += _count(self.table, doc, j, self.depth, +1)
            while self.tokens > self.max_tokens:
                old = self._docs.popleft()
                self.tokens -= len(old)
                for j in range(1, len(old)):
                    self.entries += _count(self.table, old, j, self.depth, -1)

    def clear(self) -> None:
        """Forget every document."""
        with self.lock:
            self.table, self._docs, self.tokens, self.entries = {}, deque(), 0, 0


class Suffix:
    """Suffix-decoding drafts of one row: its own history plus (optionally) a shared :class:`SuffixCache`.

    Draft rule (arXiv 2411.04975 §3, on count tables of depth ``depth``): the match is the longest
    suffix of the history, m <= ``depth`` - 1 ids, that has a continuation in the row's tables or the
    shared ones; the next draft id is its most frequent continuation (``combine="longest"``: from the
    table with the longer match, the row's on a tie; ``"sum"``: the counts of both tables summed; ties
    between ids: the most recent, the row's before the shared), then the draft is extended greedily by
    matching again with the draft appended (walking down the tree) while a continuation exists whose
    share of its context's counts is at least ``min_prob`` (the first id too). The draft is at most ``limit`` ids and at
    most ceil(``alpha`` · m) for the first match's length m (the paper's α · match length). The defaults
    (depth 8, α 2, ``"longest"``) are the best of benchmarks/results/draft_replay.md on a CPU cost model.

    The row's own tables count each id once the id after it is known, so the history's own suffix
    is never its own match. :meth:`extend` costs O(depth²) per id; :meth:`propose` O(depth² · limit) plus
    the distinct continuations of each matched context (few: long contexts match first).

    Raises:
        ValueError: ``depth < 2``, ``alpha <= 0``, ``min_prob`` outside [0, 1], an unknown ``combine``,
            or a ``shared`` cache of another depth.
    """

    def __init__(self, history: Sequence[int], shared: SuffixCache | None = None, depth: int = 8,
                 alpha: float = 2.0, min_prob: float = 0.0, combine: str = "longest"):
        if depth < 2 or not alpha > 0 or not 0.0 <= min_prob <= 1.0 or combine not in ("sum", "longest"):
            raise ValueError(f"Suffix needs depth >= 2, alpha > 0, 0 <= min_prob <= 1 and combine 'sum' or "
                             f"'longest' (got depth={depth}, alpha={alpha}, min_prob={min_prob}, "
                             f"combine={combine!r}); pass e.g. depth=8, alpha=2.0")
        if shared is not None and shared.depth != depth:
            raise ValueError(f"the shared SuffixCache has depth {shared.depth}, the row depth {depth}; "
                             "build both with the same depth")
        self.depth, self.alpha, self.min_prob, self.combine = int(depth), float(alpha), float(min_prob), combine
        self.shared = shared
        self.history: list[int] = []
        self.table: Table = {}
        self.extend(history)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (ids committed to the row) to the history and count them."""
        h = self.history
        for t in tokens:
            h.append(int(t))
            if len(h) > 1:
                _count(self.table, h, len(h) - 1, self.depth, +1)

    def _next(self, seq: list[int], shared: Table | None) -> tuple[int, int, float]:
        """The continuation of ``seq``'s longest matched suffix: (id, match length, its share of the
        context's counts); (-1, 0, 0.0) when no suffix matches."""
        for m in range(min(self.depth - 1, len(seq)), 0, -1):
            ctx = tuple(seq[len(seq) - m:])
            own = self.table.get(ctx)
            other = shared.get(ctx) if shared is not None else None
            if own is None and other is None:
                continue
            if self.combine == "longest" and own is not None:
                other = None
            counts: dict[int, int] = dict(other) if other else {}
            for t, c in (own or {}).items():  # the row's ids last: they win ties (the most recent)
                counts[t] = counts.pop(t, 0) + c
            best, top = -1, 0
            for t, c in counts.items():
                if c >= top:
                    best, top = t, c
            return best, m, top / sum(counts.values())
        return -1, 0, 0.0

    def propose(self, limit: int) -> tuple[list[int], int]:
        """The draft for the next step: ``(ids, m)``, at most ``limit`` ids and the first match's length
        m; ``([], 0)`` when no suffix of the history matches or ``limit <= 0``."""
        if limit <= 0:
            return [], 0
        with self.shared.lock if self.shared is not None else contextlib.nullcontext():
            shared = self.shared.table if self.shared is not None else None
            seq = self.history[-(self.depth - 1):]  # all a match can read: O(depth), not O(history)
            t, m0, p = self._next(seq, shared)
            if t < 0 or p < self.min_prob:
                return [], 0
            cap = min(limit, math.ceil(self.alpha * m0))
            draft = [t]
            while len(draft) < cap:
                seq.append(t)
                t, _, p = self._next(seq[-(self.depth - 1):], shared)
                if t < 0 or p < self.min_prob:
                    break
                draft.append(t)
            return draft, m0
