"""Chain draft layouts of lossless SBD and the next-draft rule (spec/sbd_exact.md §5.1–5.2).

A layout ``(D, S, G)`` verifies ``b, s_1..s_D`` (D + 1 causal queries) and puts a group of
``G_i`` mask tokens after the draft prefix ``b, s_1..s_i`` for every ``i`` in ``S``; a row costs
``D + 1 + sum(G_i)`` query tokens per forward. ``linear(K)`` = ``(K-1, {K-1}, K)`` and
``quadratic(K)`` = ``(K-1, {0..K-1}, K)`` are special cases.

The next draft after accepting ``a`` tokens (§5.2): the latest group at a prefix ``i <= a`` gives
its offsets ``a - i + 1 .. G_i - 1`` (marginals of the block mode given committed tokens, so any
of them is a valid draft), cut to D; without such a group the next draft is empty. A draft can
therefore be shorter than D; a group placed after a prefix longer than the real draft ``d`` would
see mask tokens, so when no group sits at prefix ``d`` the first group after it moves there. That
is what makes ``linear`` a special case (after a rejected draft it re-drafts with its group right
after ``b``) and it never moves a quadratic group. The rules only choose drafts; acceptance is
unchanged, so the output stays the NTP mode's.

Layouts are written ``D/S/G``: ``3/0,2,3/4`` (groups of 4 after prefixes 0, 2, 3) or with one
length per group, ``3/0,2,3/4,4,5``. Siblings on top of a chain: :mod:`unmask.decode.verify.siblings`. Pure module: no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from unmask.errors import UnmaskError, is_int


@dataclass(frozen=True)
class DraftLayout:
    """A draft layout (spec §5.1): D draft tokens, groups after the prefixes ``prefixes`` (sorted,
    each in 0..D) of lengths ``lengths`` (one per group, each >= 2: offset 0 sits at the bonus); no
    group at all: the verify part alone, whose drafts come from the host (:func:`verify_only`).
    Raises UnmaskError for anything else."""

    D: int
    prefixes: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self):
        ok = (is_int(self.D) and self.D >= 1 and len(self.prefixes) == len(self.lengths)
              and all(is_int(i) and 0 <= i <= self.D for i in self.prefixes)
              and all(is_int(g) and g >= 2 for g in self.lengths)
              and list(self.prefixes) == sorted(set(self.prefixes)))
        if not ok:
            raise UnmaskError(f"bad draft layout D={self.D!r} S={self.prefixes!r} G={self.lengths!r}; a layout "
                              "needs D >= 1, distinct sorted prefixes in 0..D and one group length >= 2 each "
                              "(e.g. 3/0,2,3/4)")

    @property
    def queries(self) -> int:
        """Query tokens per row per forward: D + 1 + sum(G_i)."""
        return self.D + 1 + sum(self.lengths)

    @property
    def spec(self) -> str:
        """The ``D/S/G`` text of this layout (one G when all groups are alike)."""
        G = self.lengths if len(set(self.lengths)) > 1 else self.lengths[:1]
        return f"{self.D}/{','.join(map(str, self.prefixes))}/{','.join(map(str, G))}"

    def groups_for(self, d: int) -> list[int]:
        """Each group's prefix when the real draft has d <= D tokens: a group past d can only see
        masks, so the first one moves to prefix d when no group sits there (module docstring)."""
        e = list(self.prefixes)
        if d not in e:
            after = [g for g, i in enumerate(e) if i > d]
            if after:
                e[after[0]] = d
        return e

    def next_draft(self, d: int, a: int, path: int | None = None) -> tuple[int, int, int]:
        """(group, first offset, length) of the next draft after a step with a d-token draft that
        accepted a <= d of it (spec §5.2); group -1 and length 0: no draft. ``path``: the longest
        chain prefix on the accepted path (default a; a sibling path at offset j: j - 1, spec §5.3)."""
        e = self.groups_for(d)
        below = [g for g, i in enumerate(e) if i <= (a if path is None else path)]
        if not below:
            return -1, 0, 0
        g = max(below, key=lambda h: (e[h], h))  # the latest prefix; a tie (a moved group): the later group
        start = a - e[g] + 1
        return g, start, max(0, min(self.lengths[g] - start, self.D))

    def truncated(self, D: int) -> "DraftLayout":
        """This layout for rows of a smaller draft size (D' = D <= self.D): groups past D' sit at D'
        (the longest of those kept), the rest unchanged."""
        if D >= self.D:
            return self
        keep = [(i, g) for i, g in zip(self.prefixes, self.lengths) if i < D]
        tail = [g for i, g in zip(self.prefixes, self.lengths) if i >= D]
        if tail:
            keep.append((D, max(tail)))
        return DraftLayout(D, tuple(i for i, _ in keep), tuple(g for _, g in keep))


def linear(K: int) -> DraftLayout:
    """Linear drafting of draft size K (spec §1): ``(K-1, {K-1}, K)``, 2K query tokens."""
    return DraftLayout(K - 1, (K - 1,), (K,))


def verify_only(K: int) -> DraftLayout:
    """The verify part alone, ``b, s_1..s_{K-1}`` (K query tokens, no group): the layout of rows whose
    drafts come from a model-free source (spec/draft_sources.md §1)."""
    return DraftLayout(K - 1, (), ())


def quadratic(K: int) -> DraftLayout:
    """Quadratic drafting of draft size K (spec §1): ``(K-1, {0..K-1}, K)``, K + K² query tokens."""
    return DraftLayout(K - 1, tuple(range(K)), (K,) * K)


def parse(text: str) -> DraftLayout:
    """``D/S/G`` text (``3/0,2,3/4`` or ``3/0,2,3/4,4,5``) -> DraftLayout. Raises UnmaskError."""
    try:
        d, s, g = str(text).split("/")  # a ValueError unless three parts
        D, S, G = int(d), tuple(map(int, s.split(","))), tuple(map(int, g.split(",")))
    except ValueError:
        raise UnmaskError(f"bad draft layout {text!r}; write D/S/G, e.g. 3/0,2,3/4 (groups of 4 after draft "
                          "prefixes 0, 2 and 3) or 3/0,2,3/4,4,5 (one length per group)") from None
    if len(G) == 1:
        G = G * len(S)
    if len(G) != len(S):
        raise UnmaskError(f"draft layout {text!r} has {len(S)} prefixes but {len(G)} group lengths; give one "
                          "length or one per prefix")
    return DraftLayout(D, S, G)


__all__ = ["DraftLayout", "linear", "quadratic", "parse", "verify_only"]
