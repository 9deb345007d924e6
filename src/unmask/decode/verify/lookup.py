"""Prompt-lookup drafts of one row (spec/draft_sources.md §1; Saxena 2023, vLLM ``ngram``).

Pure host-side Python: no torch, no model. The verify batch asks one :class:`Lookup` per row for a
draft before each step and feeds it the row's committed ids after the step.
"""

from __future__ import annotations

from collections.abc import Sequence


class Lookup:
    """Prompt-lookup drafts of one row (spec/draft_sources.md §1).

    The history ``h`` is the row's prompt ids followed by its committed ids. For n = ``n_max`` down to
    ``n_min``, the draft is the continuation of the most recent earlier occurrence of ``h[-n:]`` in
    ``h`` (the suffix itself excluded; an occurrence whose continuation would be empty is never one,
    since only the suffix ends at the end of ``h``): up to ``limit`` ids that followed it, cut at the end
    of ``h``. The first n that matches wins, so a longer match is preferred to a more recent shorter one.

    Incremental: for each n the row keeps a dict from an n-gram (a tuple of ids) to the index just
    after its latest occurrence whose continuation is non-empty, so :meth:`extend` costs O(n_max) per
    id and :meth:`propose` O(n_max + limit), however long the history.

    Raises:
        ValueError: ``n_min < 1`` or ``n_max < n_min``.
    """

    def __init__(self, history: Sequence[int], n_max: int = 4, n_min: int = 1):
        if n_min < 1 or n_max < n_min:
            raise ValueError(f"Lookup needs 1 <= n_min <= n_max (got n_min={n_min}, n_max={n_max}); "
                             "pass e.g. n_max=4, n_min=1")
        self.n_max, self.n_min = int(n_max), int(n_min)
        self.history: list[int] = []
        # starts[n - n_min][gram] = index in history of the id after gram's latest occurrence that
        # has a continuation; an n-gram is indexed only once an id follows it, so the suffix itself
        # (no continuation yet) is never its own match.
        self._starts: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.n_max - self.n_min + 1)]
        self.extend(history)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (ids committed to the row) to the history. O(n_max) per id."""
        h = self.history
        for t in tokens:
            end = len(h)  # the n-grams ending at end - 1 get their first continuation: t at index end
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._starts[n - self.n_min][tuple(h[end - n:end])] = end
            h.append(int(t))

    def propose(self, limit: int) -> tuple[list[int], int]:
        """The draft for the next step: ``(ids, n)``, at most ``limit`` ids and the length n of the
        matched n-gram; ``([], 0)`` when nothing matches or ``limit <= 0``."""
        h = self.history
        if limit <= 0:
            return [], 0
        for n in range(min(self.n_max, len(h)), self.n_min - 1, -1):
            start = self._starts[n - self.n_min].get(tuple(h[len(h) - n:]))
            if start is not None:
                return h[start:start + limit], n
        return [], 0
