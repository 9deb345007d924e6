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
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import torch

from unmask.decode.engine.registry import Config, knob
from unmask.decode.verify.lookup import Lookup
from unmask.decode.verify.suffix import Suffix
from unmask.errors import UnmaskError, is_int

SOURCES = ("none", "block", "lookup", "suffix", "block+lookup", "block+suffix")
HOST = ("lookup", "suffix")  # the model-free sources
LOOKUP_ALPHA = 2.0  # a lookup draft from an n-id match is cut to ceil(alpha * n) ids (benchmarks/results/draft_replay.md)
# from CLOCK_ROWS rows on, a step's window is chosen by measured step seconds (StepClock), and a batch whose drafts
# do not pay stops proposing for up to QUIET_MAX steps; below it, each row sizes its own draft (its NFE as alone)
CLOCK_ROWS, QUIET_MAX = 4, 16
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
        self.block_len = 0  # the block draft's length in that step (beside_block)
        self.seen = 0  # the row's committed ids the drafter has been shown (after the history it started from)

    def _own(self, match: int) -> Acceptance:
        return self.own.setdefault(min(match, 3), Acceptance())

    def observe(self, accepted: int) -> None:
        """After a step in which ``accepted`` of this row's draft tokens were accepted."""
        if self.placed:
            self._own(self.match).update(self.placed, accepted)
        elif self.block_len:
            self.block.update(self.block_len, accepted)

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
        cap = min(cap, self.cfg.tokens)
        draft, self.match = self.drafter.propose(cap) if cap > 0 else ([], 0)
        if self.cfg.source == "lookup":  # a 1-id match accepts ~1 id however long its draft (draft_replay.md)
            draft = draft[: math.ceil(LOOKUP_ALPHA * self.match)]
        self.block_len = block_len
        own = self._own(self.match)
        if self.cfg.beside_block:  # the window is the block layout's either way: more accepted tokens wins
            if not draft or own.expected(len(draft)) <= self.block.expected(block_len):
                self.placed = 0
                return None
        else:
            draft = draft[: own.best_length(len(draft), self.cfg.cost)]
        self.placed = len(draft)
        return draft


class Tally:
    """Drafted and accepted tokens per source of a verify batch (the server's /metrics reads them)."""

    def __init__(self):
        self.drafted, self.accepted = Counter(), Counter()

    def add(self, source: str, drafted: int, accepted: int) -> None:
        if drafted:
            self.drafted[source] += drafted
            self.accepted[source] += accepted

    def as_dict(self) -> dict:
        """{source: {"drafted": n, "accepted": m}} (safe to call from another thread: copies first)."""
        drafted, accepted = dict(self.drafted), dict(self.accepted)
        return {s: {"drafted": drafted[s], "accepted": accepted.get(s, 0)} for s in sorted(drafted)}


def check_join(cfg, drafts: HostDrafts | None, K: int) -> None:
    """Raise UnmaskError unless rows of draft size K with ``drafts`` may join a verify batch of ``cfg``:
    model-free drafts run on the host layout, or beside a block draft (K >= 2)."""
    if drafts is not None and not cfg.host and (K < 2 or not drafts.beside_block):
        raise UnmaskError(f"{drafts.source} drafts run on the host layout, or beside a block draft "
                          f"(block+{drafts.source}); this batch runs {cfg.draft} at K = {K}")


def first_drafts(batch, rows: list, K: int) -> None:
    """Place the first model-free drafts of rows that joined at draft size K (after their prefill); in a
    host-layout batch of CLOCK_ROWS or more rows, within the window the batch's clock allows."""
    cap = batch.cfg.block_size - 1 if batch.cfg.host else K - 1
    placing = [(r, r.drafts.propose(cap, K - 1)) for r in rows if r.drafts is not None]
    if batch.cfg.host and len(batch.rows) >= CLOCK_ROWS and (drafting := [(r, d) for r, d in placing if d]):
        most = 0 if batch.quiet else window_cap(batch.clock, len(batch.rows), drafting, batch.drafts_cost) or 0
        placing = [(r, d[:most]) for r, d in placing]
        for r, d in placing:
            r.drafts.placed = len(d)
    place_drafts(batch, placing)


def learn(cache, rows: list) -> None:
    """The server's suffix cache (None: none) learns the prompt and committed ids of ``rows`` (leaving)."""
    if cache is not None:
        for r in rows:
            cache.add(list(r.job.prompt_ids) + r.committed)


class StepClock:
    """Seconds of a verify step by (row bucket, query window Q): an exponential average of the steps
    timed, so what a wider window costs is measured on this device, model and batch, not assumed
    (spec/draft_sources.md §3: a query is nearly free on a GPU, not on a CPU, and a tiny model's
    window costs its mask and bookkeeping). Row buckets are powers of two."""

    def __init__(self, decay: float = 0.7):
        self.seconds: dict[tuple[int, int], float] = {}
        self.decay = decay

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(rows - 1, 0).bit_length()

    def record(self, rows: int, Q: int, seconds: float) -> None:
        key, base = (self.bucket(rows), Q), self.seconds.get((self.bucket(rows), 1))
        if base is not None and Q > 1:  # a first step of a shape may include its compile: at most 2Q AR steps
            seconds = min(seconds, 2 * Q * base)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def estimate(self, rows: int, Q: int, cost: float) -> float | None:
        """The expected seconds of a step of ``rows`` rows and window Q: measured, else the one-query
        step's plus Q - 1 times the steepest per-query slope measured in the bucket (none yet: ``cost``
        times the one-query step); None before a one-query step of that bucket was timed."""
        b = self.bucket(rows)
        if (b, Q) in self.seconds:
            return self.seconds[(b, Q)]
        base = self.seconds.get((b, 1))
        if base is None:
            return None
        slopes = [(t - base) / (q - 1) for (bb, q), t in self.seconds.items() if bb == b and q > 1]
        return base + (Q - 1) * max(slopes, default=cost * base)

    def widest(self, rows: int) -> int:
        """The widest window timed in the bucket of ``rows`` (0: none)."""
        b = self.bucket(rows)
        return max((q for bb, q in self.seconds if bb == b), default=0)


def window_cap(clock: StepClock, rows: int, placing: list, cost: float) -> int:
    """The longest host draft a step of the host layout runs: the cap L maximising expected committed tokens
    per expected second, sum over ``rows`` running rows of 1 + E[accepted of min(L_i, L)] over the
    :class:`StepClock`'s seconds at window L + 1 (``placing``: (row, draft) of the rows that draft).
    None (a plain AR step, which times the bucket's baseline) while that baseline is unknown."""
    if clock.estimate(rows, 1, cost) is None:
        return None
    grow = clock.widest(rows)  # windows grow one query past the widest timed: a guess is tried one step at a time
    lens = sorted({min(len(d), grow) for _, d in placing})
    best, value = 0, -1.0
    for cap in [0, *lens]:
        seconds = clock.estimate(rows, cap + 1, cost)
        tokens = rows + sum(row.drafts.expected(min(len(d), cap)) for row, d in placing)
        if seconds and tokens / seconds > value:
            best, value = cap, tokens / seconds
    return best


def after_step(batch, got: dict, finished: set, timed: tuple | None = None) -> None:
    """The host side of draft sources after a step of ``batch`` (a Verify) whose one host read is ``got``
    (``committed`` and, for a batch with mask groups, ``dlen``: each slot's next block-draft length):
    tally every row's drafted and accepted tokens, show the model-free drafters what each running row
    committed (``finished``: slots that ended) and place their next drafts (:func:`place_drafts`), on the host layout cut to the window
    :func:`window_cap` chooses from ``timed``: (rows, Q, seconds) of the step that ran."""
    if batch.cfg.host and batch.quiet > 0:  # drafting did not pay lately: no draft and no host work this step
        batch.quiet -= 1
        return
    placing = []
    for slot, row in batch.rows.items():
        accepted = got["committed"][slot] - 1
        drafts = row.drafts
        used = drafts.placed if drafts is not None and drafts.placed else row.block_len
        if used:
            batch.tally.add(drafts.cfg.source if drafts is not None and drafts.placed else "block", used, accepted)
        row.block_len = got["dlen"][slot] if "dlen" in got else 0
        if drafts is None or slot in finished:
            continue
        drafts.observe(accepted)
        drafts.catch_up(row.committed)
        placing.append((row, drafts.propose(row.K - 1 if not batch.cfg.host else batch.cfg.block_size - 1,
                                            row.block_len)))
    if batch.cfg.host and timed is not None and len(batch.rows) - len(finished) >= CLOCK_ROWS:
        _cap(batch, placing, timed, len(batch.rows) - len(finished))
    place_drafts(batch, placing)


def _cap(batch, placing: list, timed: tuple, live: int) -> None:
    """Time the step that ran, then cut the host drafts in ``placing`` (in place) to :func:`window_cap`'s
    window: a batch of CLOCK_ROWS or more rows (fewer: each row sizes its own draft, so its NFE is
    its NFE alone). One whose drafts did not pay drafts nothing for the next 1, 2, 4, ... QUIET_MAX
    steps (its rows' proposals cost host time that a large batch of a small model feels); a step
    whose drafts pay ends that."""
    batch.clock.record(*timed)
    drafting = [(row, d) for row, d in placing if d]
    if not (live and drafting):
        return
    cap = window_cap(batch.clock, live, drafting, batch.drafts_cost)
    if cap == 0:
        batch.backoff = min(2 * batch.backoff, QUIET_MAX)
        batch.quiet = batch.backoff
    elif cap:
        batch.backoff = 1
    for i, (row, d) in enumerate(placing):
        placing[i] = (row, d[: cap or 0])
        row.drafts.placed = len(placing[i][1])


def place_drafts(batch, placing: list) -> None:
    """Write host drafts into ``batch``'s slot tensors: ``placing`` (row, draft ids or None: keep the block
    draft). On the host layout a row's K becomes its draft length + 1 (K = 1: a plain AR step); a sampled
    row's proposal is the draft's one-hot (spec/draft_sources.md §2). A block draft under a sibling layout
    stays for sampled rows (SpecInfer's rule needs the siblings drawn from the draft's proposal)."""
    keep = []
    for row, d in placing:
        if d is not None and (batch.cfg.host or row.job.sampling.greedy or not batch._tables(row.K).trees[row.K - 1]):
            if d or row.K > 1 or not batch.cfg.host:  # a host row at K = 1 with no draft has nothing to write
                keep.append((row, d))
            row.block_len = 0
        else:
            row.drafts.placed = 0  # the block draft runs
    if not (placing := keep):
        return
    L = max(len(d) for _, d in placing)
    batch._widen(L + 1)
    dev = batch.device
    idx = torch.tensor([row.slot for row, _ in placing], dtype=torch.long, device=dev)  # (n,)
    lens = torch.tensor([len(d) for _, d in placing], dtype=torch.long, device=dev)  # (n,)
    batch.draft_len[idx] = lens
    if batch.cfg.host:
        for row, d in placing:
            row.K = len(d) + 1
        batch.K[idx] = lens + 1
    if not L:
        return
    ids = torch.tensor([d + [0] * (L - len(d)) for _, d in placing], dtype=torch.long, device=dev)  # (n, L)
    batch.s[idx, :L] = ids
    sampled = [i for i, (row, _) in enumerate(placing) if not row.job.sampling.greedy]
    if sampled:
        at = torch.tensor(sampled, dtype=torch.long, device=dev)
        if batch.q is None:  # (cap, W, V)
            batch.q = torch.zeros((batch.slots.capacity, batch.s.shape[1], batch.vocab), device=dev)
        q = torch.nn.functional.one_hot(ids[at], batch.vocab).to(batch.q.dtype)  # (m, L, V): q = one-hot(draft)
        batch.q[idx[at], :L] = q


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
           "QUERY_COST", "RowDrafts", "SOURCES", "StepClock", "Tally", "after_step", "place_drafts", "query_cost",
           "window_cap"]
