"""Sibling candidates of a budgeted draft layout (spec/sbd_exact.md §5.3, issue 26 item 2).

A chain layout ``(D, S, G)`` (:mod:`unmask.decode.verify.chain`) verifies one draft
``s_1..s_D``. A *sibling* at offset ``j`` is the block mode's 2nd (or 3rd) candidate for ``s_j``,
from the same group query that drafted ``s_j``, verified as a child of ``s_{j-1}`` at the causal
position of ``s_j`` (a tree: it sees the cache, ``b, s_1..s_{j-1}`` and itself). It may carry

- a *continuation* of ``c`` tokens: the chain's own draft tokens ``s_{j+1}..s_{j+c}`` verified
  again under the sibling (block-mode marginals of those positions: still a valid draft), and
- a *group* of ``g`` mask tokens after ``b, s_1..s_{j-1}, sibling`` (§1's group rule).

It costs ``1 + c + g`` query tokens. Greedy acceptance (§5.3): the chain's accepted prefix ``a``
as before; when ``s_{a+1}`` is rejected and a sibling at offset ``a + 1`` equals the NTP argmax, the
path goes through it and its continuation as far as they are confirmed. The next draft (§5.2)
comes from the latest group on the accepted path: the sibling's own group when it has one, else
the latest chain group at a prefix ``<= j - 1``. The first sibling written at an offset is that
offset's rank-2 candidate, the second its rank 3 (greedy rows; sampled rows draw every sibling
i.i.d. from the draft token's proposal and accept by SpecInfer's rule, :func:`unmask.decode.verify.tree.sampled_tree_accept`).

Text: the chain's ``D/S/G`` then ``+j[cC][gG]`` per sibling, e.g. ``3/0,1,3/4+1g3+1`` (rank 2 at
offset 1 with a group of 3, rank 3 at offset 1 bare) or ``5/0,1/4+1c2``. Pure module: no tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from unmask.decode.verify import chain as dl
from unmask.errors import UnmaskError, is_int

TOPK = 3  # candidates per draft position a sibling can use: rank 2 and rank 3
_ITEM = re.compile(r"^(\d+)(?:c(\d+))?(?:g(\d+))?$")


@dataclass(frozen=True)
class Sibling:
    """An alternative to draft token ``s_offset`` (offset >= 1): ``cont`` chain tokens after it,
    ``group`` mask tokens after it (0: none, else >= 2). Raises UnmaskError for anything else."""

    offset: int
    cont: int = 0
    group: int = 0

    def __post_init__(self):
        ok = all(map(is_int, (self.offset, self.cont, self.group)))
        if not (ok and self.offset >= 1 and self.cont >= 0 and (self.group == 0 or self.group >= 2)):
            raise UnmaskError(f"bad sibling offset={self.offset!r} cont={self.cont!r} group={self.group!r}; a sibling "
                              "needs offset >= 1, cont >= 0 and a group of 0 or >= 2 (e.g. +1c1g3)")

    @property
    def queries(self) -> int:
        return 1 + self.cont + self.group

    @property
    def spec(self) -> str:
        return f"{self.offset}{f'c{self.cont}' if self.cont else ''}{f'g{self.group}' if self.group else ''}"


@dataclass(frozen=True)
class TreeLayout:
    """A chain layout plus siblings (spec §5.3). ``ranks[h]`` is sibling h's candidate rank
    (2, 3: its order among the siblings at its offset). Raises UnmaskError when a sibling's
    offset or continuation runs past D or an offset has more than TOPK - 1 siblings."""

    chain: dl.DraftLayout
    siblings: tuple[Sibling, ...] = ()

    def __post_init__(self):
        for h, s in enumerate(self.siblings):
            if s.offset + s.cont > self.chain.D:
                raise UnmaskError(f"sibling +{s.spec} of layout {self.chain.spec} runs past its {self.chain.D} draft "
                                  "tokens; lower its offset or continuation")
            if self.ranks[h] > TOPK:
                raise UnmaskError(f"layout {self.spec} has more than {TOPK - 1} siblings at offset {s.offset}; "
                                  f"give each offset at most {TOPK - 1}")

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(2 + sum(t.offset == s.offset for t in self.siblings[:h]) for h, s in enumerate(self.siblings))

    @property
    def D(self) -> int:
        return self.chain.D

    @property
    def queries(self) -> int:
        """Query tokens per row per forward: the chain's plus 1 + cont + group per sibling."""
        return self.chain.queries + sum(s.queries for s in self.siblings)

    @property
    def spec(self) -> str:
        return self.chain.spec + "".join(f"+{s.spec}" for s in self.siblings)


def parse(text: str) -> TreeLayout:
    """``D/S/G`` or ``D/S/G+j[cC][gG]+...`` text -> TreeLayout. Raises UnmaskError (one line)."""
    chain, *items = str(text).split("+")
    sibs = []
    for item in items:
        m = _ITEM.match(item)
        if not m:
            raise UnmaskError(f"bad sibling {item!r} in draft layout {text!r}; write +j, +jcC, +jgG or +jcCgG, e.g. "
                              "3/0,1,3/4+1g3 (a sibling at offset 1 with a group of 3)")
        sibs.append(Sibling(int(m[1]), int(m[2] or 0), int(m[3] or 0)))
    return TreeLayout(dl.parse(chain), tuple(sibs))


def as_tree(layout) -> TreeLayout:
    """A DraftLayout, TreeLayout or layout text as a TreeLayout (a chain: no siblings)."""
    if isinstance(layout, TreeLayout):
        return layout
    if isinstance(layout, dl.DraftLayout):
        return TreeLayout(layout)
    return parse(layout)


__all__ = ["Sibling", "TreeLayout", "parse", "as_tree", "TOPK"]
