"""Draft sources of the verify batch (spec/draft_sources.md): which source proposes a row's draft,
how long a model-free draft is, and the knobs that choose them.

A *draft source* proposes, per row and step, the tokens the verify forward checks; acceptance is
spec/sbd_exact.md §1's, so the source changes speed, never output:

- ``block``: the block mode's draft (lossless SBD; the groups of the draft layout, needs a mask token);
- ``lookup``: prompt lookup (:class:`~unmask.decode.verify.lookup.Lookup`), model-free;
- ``suffix``: suffix decoding (:class:`~unmask.decode.verify.suffix.Suffix`), model-free, with a
  server-wide :class:`~unmask.decode.verify.suffix.SuffixCache` of recent requests;
- ``block+lookup`` / ``block+suffix``: per step, the one of the two drafts with more expected
  accepted tokens (spec §1, combination: per-step choice).

A model-free draft is computed on the host from ids the step already read (no extra sync) and
placed into the slot tensors before the next step. Its length follows the evidence (spec §3): the
longest continuation the source has, cut to the length that maximises expected committed tokens
per unit of forward cost under the row's running acceptance (:class:`Acceptance`); no match, or a
poor record, gives a plain K = 1 step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from unmask.decode.engine.registry import Config, knob
from unmask.decode.verify.lookup import Lookup
from unmask.decode.verify.suffix import Suffix
from unmask.errors import UnmaskError, is_int

SOURCES = ("none", "block", "lookup", "suffix", "block+lookup", "block+suffix")
HOST = ("lookup", "suffix")  # the model-free sources
LOOKUP_ALPHA = 2.0  # a lookup draft from an n-id match is cut to ceil(alpha * n) ids (benchmarks/results/draft_replay.md)
DEFAULT_DRAFT_TOKENS = 8  # the most ids a model-free draft proposes per row per step
MAX_DRAFT_TOKENS = 31  # K <= 32: the host layout's step tables stay small (K^4 growth)
# the cost of one more query token per row, relative to a one-query forward (spec §3): SmolLM2-135M, 1 CPU
# thread: 1.8x at 8 queries, 2.5x at 16 (~0.1 each); an H200 at the 8B shape: 1.19x at 16 (~0.01)
QUERY_COST = {"cpu": 0.1}
DEFAULT_QUERY_COST = 0.02


def query_cost(device) -> float:
    """The relative cost of one more query token per row on ``device`` (a torch.device or its type)."""
    return QUERY_COST.get(getattr(device, "type", str(device)), DEFAULT_QUERY_COST)


class Acceptance:
    """A row's running acceptance of one source's drafts: the chance ``rate`` that a draft token is
    accepted given its predecessors were (a geometric model, the usual one for speculative decoding),
    estimated from decayed counts with a prior of ``prior`` over ``weight`` tokens."""

    def __init__(self, prior: float = 0.6, weight: float = 2.0, decay: float = 0.9):
        self.hits, self.trials, self.decay = prior * weight, weight, decay

    @property
    def rate(self) -> float:
        return self.hits / self.trials

    def update(self, drafted: int, accepted: int) -> None:
        """Record a step whose ``drafted``-token draft had ``accepted`` tokens accepted."""
        if drafted <= 0:
            return
        miss = int(accepted < drafted)
        self.hits = self.decay * self.hits + accepted
        self.trials = self.decay * self.trials + accepted + miss

    def expected(self, length: int) -> float:
        """Expected accepted tokens of a draft of ``length`` tokens: r + r^2 + ... + r^length."""
        r = self.rate
        return float(length) if r >= 1 else r * (1 - r ** length) / (1 - r)

    def best_length(self, available: int, cost: float) -> int:
        """The draft length in 0..available maximising (1 + expected accepted) / (1 + cost * length):
        committed tokens per unit of forward cost."""
        best, value, gain, r = 0, 1.0, 0.0, self.rate
        for L in range(1, available + 1):
            gain += r ** L
            if (v := (1 + gain) / (1 + cost * L)) > value:
                best, value = L, v
        return best


@dataclass(frozen=True)
class HostDrafts:
    """How a row drafts on the host: ``source`` lookup or suffix, at most ``tokens`` ids per step,
    ``beside_block`` (the block+X combinations: chosen per step against the block draft), ``cost`` the
    relative cost of a query token (:func:`query_cost`)."""

    source: str
    tokens: int = DEFAULT_DRAFT_TOKENS
    beside_block: bool = False
    cost: float = 0.1

    def start(self, history: list[int], shared=None) -> "RowDrafts":
        """The drafting state of a row whose history (prompt and first committed ids) is ``history``;
        ``shared``: the server's :class:`~unmask.decode.verify.suffix.SuffixCache` (suffix only)."""
        drafter = Lookup(history) if self.source == "lookup" else Suffix(history, shared)
        return RowDrafts(self, drafter)


class RowDrafts:
    """One row's model-free drafting: its drafter, the acceptance of its own drafts (by the length of
    the match they came from: a longer match predicts better) and, beside the block, of the block's,
    and what it placed last step."""

    def __init__(self, cfg: HostDrafts, drafter):
        self.cfg, self.drafter = cfg, drafter
        self.own = {}  # match-length class (1, 2, 3+) -> the Acceptance of drafts from such matches
        self.block = Acceptance()
        self.placed = 0  # the length of the host draft in the step that just ran (0: none, or the block's)
        self.match = 0  # its match-length class
        self.seen = 0  # the row's committed ids the drafter has been shown (after the history it started from)

    def _own(self, match: int) -> Acceptance:
        return self.own.setdefault(min(match, 3), Acceptance())

    def observe(self, accepted: int, block_len: int = 0) -> None:
        """After a step in which ``accepted`` of this row's draft tokens were accepted: its own draft's, or
        (none placed) the block draft's of ``block_len`` tokens."""
        if self.placed:
            self._own(self.match).update(self.placed, accepted)
        elif block_len:
            self.block.update(block_len, accepted)

    def catch_up(self, committed: list[int]) -> None:
        """Show the drafter the row's committed ids it has not seen (``committed``: all of them, the first
        being part of the history it started from); lazy, so a batch that does not draft pays nothing."""
        if len(committed) > self.seen + 1:
            self.drafter.extend(committed[self.seen + 1:])
            self.seen = len(committed) - 1

    def expected(self, length: int) -> float:
        """Expected accepted tokens of this row's current draft cut to ``length`` tokens."""
        return self._own(self.match).expected(length)

    def propose(self, cap: int, block_len: int = 0) -> list[int] | None:
        """The next draft (at most ``cap`` ids): a host draft, [] for none (a K = 1 step), or None to
        keep the block draft of ``block_len`` tokens (beside_block: it expects more accepted tokens)."""
        draft, self.match = self.drafter.propose(min(cap, self.cfg.tokens))  # ([], 0) when cap <= 0
        if self.cfg.source == "lookup":  # a 1-id match accepts ~1 id however long its draft (draft_replay.md)
            draft = draft[: math.ceil(LOOKUP_ALPHA * self.match)]
        own = self._own(self.match)
        if self.cfg.beside_block:  # the window is the block layout's either way: more accepted tokens wins
            if not draft or own.expected(len(draft)) <= self.block.expected(block_len):
                self.placed = 0
                return None
        else:
            draft = draft[: own.best_length(len(draft), self.cfg.cost)]
        self.placed = len(draft)
        return draft


@dataclass(frozen=True)
class DraftKnobs(Config):
    """The draft source of AR and lossless SBD rows (spec/draft_sources.md)."""

    draft_source: str | None = knob(
        "draft source of a lossless row: lookup (prompt lookup) or suffix (suffix decoding): model-free, any causal "
        "model, output = ar; with sbd also block (the block mode's draft, its default), block+lookup, block+suffix; "
        "none: plain ar (ar's default)", choices=SOURCES)
    draft_tokens: int | None = knob(f"--draft-source lookup/suffix: most drafted tokens per row per step, 1 to "
                                    f"{MAX_DRAFT_TOKENS} (default {DEFAULT_DRAFT_TOKENS}, with block+lookup/suffix the block's "
                                    "K - 1; the draft follows the match and the row's acceptance)", low=1, high=MAX_DRAFT_TOKENS)

    sources: ClassVar[tuple[str, ...]] = SOURCES  # the draft sources this decoder takes

    def __post_init__(self):
        """Raise UnmaskError unless ``draft_source`` is None or one of :attr:`sources` and ``draft_tokens``
        is an integer in 1..MAX_DRAFT_TOKENS given with a model-free source."""
        src, n = self.draft_source, self.draft_tokens
        if src is not None and src not in self.sources:
            need = " (block drafts need decoder sbd: an SBD model or --adapter)" if src in SOURCES else ""
            raise UnmaskError(f"unknown draft source {src!r} for decoder {self.decoder!r}; choose one of "
                              f"{', '.join(self.sources)}{need}")
        if n is not None:
            if not is_int(n) or not 1 <= n <= MAX_DRAFT_TOKENS:
                raise UnmaskError(f"--draft-tokens must be an integer in 1..{MAX_DRAFT_TOKENS} (got {n!r})")
            if not any(h in (src or "") for h in HOST):
                raise UnmaskError("--draft-tokens sizes a model-free draft; add --draft-source lookup (or suffix)")

    @property
    def host_only(self) -> bool:
        """Whether every draft comes from a model-free source (the host layout, no mask token needed)."""
        return self.draft_source in HOST

    def host_drafts(self, device, block_size: int | None = None) -> HostDrafts | None:
        """The row's model-free drafting (None: none); ``block_size`` caps it beside the block draft."""
        src = self.draft_source or ""
        host = next((h for h in HOST if src.endswith(h)), None)
        if host is None:
            return None
        beside = src.startswith("block+")
        n = self.draft_tokens or (block_size - 1 if beside and block_size else DEFAULT_DRAFT_TOKENS)
        return HostDrafts(host, n, beside, query_cost(device))


__all__ = ["Acceptance", "DEFAULT_DRAFT_TOKENS", "DraftKnobs", "HOST", "HostDrafts", "MAX_DRAFT_TOKENS",
           "QUERY_COST", "RowDrafts", "SOURCES", "query_cost"]
