"""Model-free drafts inside a verify step (spec/draft_sources.md §3): placing each row's draft into
the slot tensors of a :class:`~unmask.decode.verify.batch.Verify` from what the step's one host read
brought back, sizing the host layout's window by measured step seconds (:class:`StepClock`), and
counting drafted and accepted tokens per source (:class:`Tally`). The drafts themselves and their
per-row sizing: :mod:`unmask.decode.verify.drafting`.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch

# from CLOCK_ROWS rows on, all greedy, measured step seconds (StepClock) choose a step's window and a batch whose drafts
# do not pay stops proposing up to QUIET_MAX steps; else rows size their own (NFE as alone; sampled text seed-stable)
CLOCK_ROWS, QUIET_MAX = 4, 16
# a wider window must promise this much more committed tokens per second than a one-query step: its gain is an
# estimate from the rows' acceptance, its cost a measurement, and a wrong guess costs every row of the batch
WIDER = 1.15


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


def first_drafts(batch, rows: list, K: int) -> None:
    """Place the first model-free drafts of rows that joined at draft size K (after their prefill); in a
    host-layout batch of CLOCK_ROWS or more rows, within the window the batch's clock allows."""
    placing = [(r, r.drafts.propose(_room(batch, r, K), K - 1)) for r in rows if r.drafts is not None]
    if _clocked(batch, len(batch.rows)) and (drafting := [(r, d) for r, d in placing if d]):
        _cut(placing, 0 if batch.quiet else window_cap(batch.clock, len(batch.rows), drafting, batch.drafts_cost))
    place_drafts(batch, placing)


def _clocked(batch, live: int) -> bool:
    """Whether the batch's clock sizes its host drafts: the host layout, every row greedy, CLOCK_ROWS rows or more."""
    return batch.cfg.host and not batch.n_sampled and live >= CLOCK_ROWS


def _cut(placing: list, cap: int | None) -> None:
    """Cut every host draft in ``placing`` (in place) to ``cap`` ids (None: 0) and record what each row placed."""
    for i, (row, d) in enumerate(placing):
        placing[i] = (row, d[: cap or 0])
        row.drafts.placed = len(placing[i][1])


def _room(batch, row, K: int) -> int:  # the row's window, cut to what a step can still commit (bonus included)
    return min(batch.cfg.block_size - 1 if batch.cfg.host else K - 1, row.job.max_new_tokens - len(row.committed) - 1)


def learn(cache, rows: list) -> None:
    """The server's suffix cache (None: none) learns the prompt and committed ids of the suffix-drafting
    ``rows`` (leaving): the cache serves suffix rows, so a server whose requests never ask for suffix
    drafts pays nothing for it (adding a 400-id document costs about a millisecond)."""
    if cache is not None:
        for r in rows:
            if r.drafts is not None and r.drafts.cfg.source == "suffix":
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


_CLOCKS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def clock_for(model, device) -> StepClock:
    """The :class:`StepClock` every verify batch of ``model`` on ``device`` shares (per thread count): what a
    window costs is the model's, so a fresh ``decode`` call starts from what earlier ones measured."""
    return _CLOCKS.setdefault(model, {}).setdefault((str(device), torch.get_num_threads()), StepClock())


def window_cap(clock: StepClock, rows: int, placing: list, cost: float) -> int:
    """The longest host draft a step of the host layout runs: the cap L maximising expected committed tokens
    per expected second, sum over ``rows`` running rows of 1 + E[accepted of min(L_i, L)] over the
    :class:`StepClock`'s seconds at window L + 1 (``placing``: (row, draft) of the rows that draft), a cap
    L > 0 counted WIDER times slower.
    None (a plain AR step, which times the bucket's baseline) while that baseline is unknown."""
    if clock.estimate(rows, 1, cost) is None:
        return None
    grow = clock.widest(rows)  # windows grow one query past the widest timed: a guess is tried one step at a time
    lens = sorted({min(len(d), grow) for _, d in placing})
    best, value = 0, -1.0
    for cap in [0, *lens]:
        seconds = clock.estimate(rows, cap + 1, cost)
        tokens = rows + sum(row.drafts.expected(min(len(d), cap)) for row, d in placing)
        rate = tokens / seconds / (WIDER if cap else 1) if seconds else -1.0
        if rate > value:
            best, value = cap, rate
    return best


def after_step(batch, got: dict, finished: set, timed: tuple | None = None) -> None:
    """The host side of draft sources after a step of ``batch`` (a Verify) whose one host read is ``got``
    (``committed`` and, for a batch with mask groups, ``dlen``: each slot's next block-draft length):
    tally every row's drafted and accepted tokens, show the model-free drafters what each running row
    committed (``finished``: slots that ended) and place their next drafts (:func:`place_drafts`), on the host layout cut to the window
    :func:`window_cap` chooses from ``timed``: (rows, Q, seconds) of the step that ran."""
    if batch.cfg.host and batch.quiet > 0 and not batch.n_sampled:  # drafts did not pay lately: none, no host work
        batch.quiet -= 1
        return
    placing = []
    for slot, row in batch.rows.items():
        accepted, drafts, block_ran = got["committed"][slot] - 1, row.drafts, row.block_len
        own = drafts is not None and drafts.placed  # the step verified the row's model-free draft, not the block's
        if own or block_ran:
            batch.tally.add(drafts.cfg.source if own else "block", drafts.placed if own else block_ran, accepted)
        row.block_len = got["dlen"][slot] if "dlen" in got else 0
        if drafts is None or slot in finished:
            continue
        drafts.observe(accepted, block_ran)
        drafts.catch_up(row.committed)
        placing.append((row, drafts.propose(_room(batch, row, row.K), row.block_len)))
    live = len(batch.rows) - len(finished)
    if timed is not None and _clocked(batch, live):
        batch.clock.record(*timed)
        if drafting := [(row, d) for row, d in placing if d]:
            cap = window_cap(batch.clock, live, drafting, batch.drafts_cost)
            if cap == 0:  # drafts did not pay: none for the next 1, 2, 4, ... QUIET_MAX steps (their proposals cost
                batch.backoff = min(2 * batch.backoff, QUIET_MAX)  # host time a large batch of a small model feels)
                batch.quiet = batch.backoff
            elif cap:  # drafts pay: the backoff starts over
                batch.backoff = 1
            _cut(placing, cap)
    place_drafts(batch, placing)


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


__all__ = ["CLOCK_ROWS", "QUIET_MAX", "StepClock", "Tally", "after_step", "clock_for", "first_drafts", "learn",
           "place_drafts", "window_cap"]
