"""The one engine's contract (DESIGN.md "One engine"): every decoder is one running-batch class that
``decode()``, the compiled path and the server all drive.

A decoder class ``D(bundle, cfg, *, static=False, compile=False, capacity=8, on_step=None, on_token=None)``:

- ``join(requests) -> finished rows``: prefills the requests into free slots, together in one
  forward where the decoder's prefill allows it (``decode`` of B prompts counts one prefill); a row
  may finish at once (AR's first token is a stop token, ``max_new_tokens`` 1).
- ``step() -> finished rows``: ONE forward for every running row, the commit rule as a pure tensor
  function, at most one host sync (the accepted counts / ended flags the rows' bookkeeping needs).
- ``drop(ids) -> dropped rows``: cancel or time out rows by request id; their slots are free at once.
- ``len(d)``: running rows; ``d.forwards``: forwards run so far (the batch's NFE).
- ``stats_extra(rows) -> dict``: the decoder-specific ``DecodeStats.extra`` of finished rows (in
  request order), e.g. accept histograms.

Per-row state lives in tensors of ``capacity`` slots indexed by ``Row.slot``; :class:`Slots` hands
out the lowest free slot, so live rows stay packed at the front and a forward over slots
``[0, high)`` (``Slots.high``) covers them without re-packing when a row leaves.

:func:`drain` is ``decode()`` for every decoder: join every prompt, step until empty, and assemble
the :class:`~unmask.decode.engine.stats.DecodeOutput`.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from unmask.decode.engine.shaping import asks_logprobs
from unmask.decode.engine.stats import DecodeOutput, DecodeStats, stop_flags
from unmask.decode.engine.stop import StopRule
from unmask.errors import UnmaskError
from unmask.sampling import Sampling


@dataclass(eq=False)
class Request:
    """What a running decoder reads of a request: the scheduler's ``Job`` has the same fields.

    prompt_ids: token ids; max_new_tokens: the generation budget; sampling: the request's
    ``Sampling``; stop: stop strings (a completing token is kept); generator: the row's
    ``torch.Generator`` when sampled (None: the decoder draws it from ``sampling``); id: the key
    ``drop`` takes (the scheduler's job id; ``drain`` uses the prompt index). ``logprobs``: None, or k in
    [0, 20]: the row records each generated token's logprob and its k most likely alternatives
    (:mod:`unmask.decode.engine.shaping`); ``logit_bias``: {token id: bias} added to the logits it draws
    from; ``grammar``: the :class:`unmask.grammar.Compiled` grammar its output must match (decoders whose config
    :meth:`~unmask.decode.engine.registry.Config.takes_grammar`)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    generator: object = None
    id: int = 0
    logprobs: int | None = None
    logit_bias: dict | None = None
    grammar: object = None


@dataclass(eq=False)
class Row:
    """One running (then finished) request. ``tokens``: generated ids (the stop token excluded);
    ``nfe``: forwards in which the row had work; ``stop_token``: 1 when it ended on a stop token it
    committed (it counts for TPF, not in the text); ``finish``: "stop" or "length" once done ("error"
    when its grammar allowed no token or its matcher gave up: ``error`` says why, and a row with ``error``
    set is an error whatever its ``finish``); ``extra``: per-row statistics the decoder's
    ``stats_extra`` reads; ``logprobs``: with ``job.logprobs`` set, one
    :class:`~unmask.decode.engine.shaping.TokenLogprob` per id of ``tokens`` once it finished."""

    job: Request
    slot: int
    tokens: list[int] = field(default_factory=list)
    nfe: int = 0
    stop_token: int = 0
    finish: str | None = None
    extra: dict = field(default_factory=dict)
    logprobs: list | None = None
    error: str | None = None


class Slots:
    """A fixed-capacity free list of slot indices: ``take`` the lowest free ones, ``give`` them back.

    ``high`` is one past the highest slot in use (0 when empty): a step's tensors cover slots
    ``[0, high)``. Raises UnmaskError when more slots are taken than are free."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise UnmaskError(f"a running batch needs at least one slot (got capacity {capacity})")
        self.capacity = capacity
        self._free = list(range(capacity))  # a heap: the lowest free slot first
        self._used: set[int] = set()

    def __len__(self) -> int:
        return len(self._used)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def high(self) -> int:
        return max(self._used) + 1 if self._used else 0

    @property
    def bucket(self) -> int:
        """The row bucket a static-cache forward covers: the next power of two >= ``high`` (at most
        the capacity), so a running batch compiles one graph per bucket, not per row count."""
        return min(1 << max(self.high - 1, 0).bit_length(), self.capacity)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise UnmaskError(f"running batch full: {n} slots asked, {len(self._free)} of {self.capacity} free; "
                              "join fewer rows or raise the capacity")
        got = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(got)
        return got

    def give(self, slots: Sequence[int]) -> None:
        for s in slots:
            if s in self._used:
                self._used.remove(s)
                heapq.heappush(self._free, s)


class SlotRows:
    """``len``, ``rows`` and ``drop`` for a running batch that keeps its rows in ``self.running``
    (slot -> :class:`Row`) and its free list in ``self.slots`` (:class:`Slots`)."""

    running: dict
    slots: Slots

    def __len__(self) -> int:
        return len(self.running)

    @property
    def rows(self) -> list:
        """The running rows in slot order (a copy: the server's other threads read it)."""
        return sorted(self.running.values(), key=lambda row: row.slot)

    def drop(self, ids) -> list:
        """Remove the rows of these request ids (:meth:`_leave`); their slots are free at once."""
        ids = set(ids)
        gone = [row for row in self.rows if row.job.id in ids]
        for row in gone:
            self._leave(row)
        return gone

    def _leave(self, row) -> None:
        """A row leaves (finished or dropped): its slot is free at once. Decoders add their slot
        tensors' clean-up."""
        self.running.pop(row.slot, None)
        self.slots.give([row.slot])


class CanvasRows(SlotRows):
    """What the running batches on a :class:`~unmask.decode.dllm.cache.SlotCanvas` (diffusion,
    early-bird) share: the slots a forward covers and, serving on the static cache (``canvas.length``
    set), the deferred compile the server's idle loop drives (``kv``, :meth:`warm`)."""

    canvas: object  # a unmask.decode.dllm.cache.SlotCanvas
    static: bool

    @property
    def kv(self):
        return self.canvas.kv

    def _covered(self) -> int:
        """Slots [0, n) a forward covers: the used ones (eager), every slot (decode's static batch; a
        first write allocates the cache's rows), or serving, the row bucket (:attr:`Slots.bucket`)."""
        if not self.static:
            return self.slots.high
        return self.slots.bucket if self.canvas.length else self.slots.capacity

    def _restart(self) -> None:
        """Before a join into an empty serving batch: its canvases start again from width 1."""
        if self.canvas.length and not self.running:
            self.canvas.clear()

    def warm(self) -> bool:
        """Compile one window shape this batch ran eagerly (serving on the static cache, no row
        running: the server's idle loop). False when there is none; a failed compile re-raises
        (:meth:`~unmask.decode.engine.kv.StaticKV.warm`)."""
        if self.running or not self.canvas.length:
            return False
        self.canvas.clear()
        return self.canvas.kv.warm()


class RunningDecoder(Protocol):
    forwards: int

    def __len__(self) -> int: ...
    def join(self, requests: list[Request]) -> list[Row]: ...
    def step(self) -> list[Row]: ...
    def drop(self, ids) -> list[Row]: ...
    def stats_extra(self, rows: list[Row]) -> dict: ...


def group_by(pairs, key) -> dict:
    """``(index, row)`` pairs -> {key(row): [index, ...]}, in order."""
    out: dict = {}
    for i, row in pairs:
        out.setdefault(key(row), []).append(i)
    return out


def requests_for(prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling, stop_strings=(),
                 device=None, **asks) -> list[Request]:
    """One :class:`Request` per prompt (id = its index), each with the generator ``unmask generate``
    gives that row (``Sampling.row_generators``: seeded by prompt, so a row draws the same tokens
    whatever else runs); ``asks``: ``logprobs`` / ``logit_bias`` / ``grammar`` of every row."""
    gens = sampling.row_generators(prompts, device) or [None] * len(prompts)
    return [Request(prompt_ids=list(p), max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop_strings),
                    generator=g, id=i, **asks) for i, (p, g) in enumerate(zip(prompts, gens))]


def drain(make: Callable[[int], RunningDecoder], requests: list[Request], *, nfe: Callable | None = None
          ) -> DecodeOutput:
    """``decode()`` on the one engine: build the decoder for ``len(requests)`` slots (``make(capacity)``),
    join every request, ``step()`` until no row runs, and return the rows' tokens and DecodeStats in
    request order. ``nfe(decoder, rows)`` overrides the batch NFE (default ``decoder.forwards``)."""
    t0 = time.perf_counter()
    dec = make(max(1, len(requests)))
    done = list(dec.join(requests))
    while len(dec):
        done += dec.step()
    by_id = {row.job.id: row for row in done}
    rows = [by_id[r.id] for r in requests]
    stats = DecodeStats(nfe=dec.forwards if nfe is None else nfe(dec, rows), nfe_per_row=[r.nfe for r in rows],
                        tokens_per_row=[len(r.tokens) for r in rows], seconds=time.perf_counter() - t0,
                        extra=dec.stats_extra(rows), stops_per_row=[r.stop_token for r in rows])
    errors = [r.error for r in rows if r.error]
    if errors:
        raise UnmaskError(errors[0])
    asked = any(asks_logprobs(r.job) is not None for r in rows)
    return DecodeOutput(tokens=[r.tokens for r in rows], stats=stats,
                        logprobs=[r.logprobs or [] for r in rows] if asked else None)


def row_generator(job, device):
    """A row's ``torch.Generator``: the request's own, else (sampled) the one ``decode`` gives its
    prompt alone (so a row draws the same tokens whatever runs beside it), else None (greedy)."""
    gen = getattr(job, "generator", None)
    if gen is None and not job.sampling.greedy:
        gen = job.sampling.row_generators([list(job.prompt_ids)], device)[0]
    return gen


def finish(row, full: list[int], stop_ids, mask_id: int) -> None:
    """Set a finished row's ``tokens`` (``full``, its reported ids, cut at the first stop id or
    mask), ``stop_token`` and ``finish`` ("length" or "stop")."""
    rule = stop_ids if isinstance(stop_ids, StopRule) else StopRule.of(stop_ids)
    row.tokens = rule.until_stop(full, also=(mask_id,))
    row.stop_token = stop_flags([full], [row.tokens], rule.ids)[0]
    row.finish = "length" if len(row.tokens) >= row.job.max_new_tokens else "stop"


__all__ = ["Request", "Row", "RunningDecoder", "SlotRows", "Slots", "drain", "finish", "requests_for", "row_generator"]
