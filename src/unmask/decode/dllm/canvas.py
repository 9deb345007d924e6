"""What the canvas decoders share (diffusion, Dream's schedule, early-bird): request and option checks, the
stop rules on a generated region (spec/diffusion.md §9) and :class:`CanvasBatch` / :class:`CanvasRow`, the
running-batch base of diffusion, Dream and early-bird."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from unmask.decode.blocks.commit_shaping import CommitShaping
from unmask.decode.dllm.cache import SlotCanvas, prompt_width
from unmask.decode.engine.running import CanvasRows, Row, Slots, finish, row_generator
from unmask.decode.engine.stop import StopRule
from unmask.errors import UnmaskError, check_choice
from unmask.models.adapters import SAMPLERS
from unmask.policies import CONFIDENCES
from unmask.trace import host_event


def check_canvas(bundle, prompt_len: int, gen_length: int, hint: str) -> None:
    """Raise the one-line UnmaskError for an empty prompt or a canvas past the context window
    (``hint`` says what to lower)."""
    if prompt_len == 0:
        raise UnmaskError("every prompt needs at least one token (a Dream-style model scores position i from i-1)")
    if prompt_len + gen_length > bundle.context_length:
        raise UnmaskError(f"prompt ({prompt_len} tokens) + gen length {gen_length} exceeds the context window of "
                          f"{bundle.context_length}; {hint}")


class SamplerKnobs:
    """What the diffusion and early-bird configs share: ``sampler`` (llada or dream, diffusion.md §4)
    and ``confidence`` (κ's distribution, None = untempered)."""

    def check_sampler(self) -> None:
        check_choice("sampler", self.sampler, SAMPLERS)
        if self.confidence is not None:
            check_choice("confidence", self.confidence, CONFIDENCES)

    @property
    def commit_confidence(self) -> str | None:
        """``confidence`` as :func:`unmask.policies.commit` takes it: the llada sampler's untempered κ
        is float64, as in the LLaDA / Fast-dLLM reference."""
        return "untempered" if self.confidence is None and self.sampler == "llada" else self.confidence


def canvas_width(bundle, prompts, L: int, hint: str, fast: bool) -> int:
    """The canvas width of decode's batch of ``prompts`` (each checked by :func:`check_canvas` before
    the canvases are allocated): the prompt region (:func:`~unmask.decode.dllm.cache.prompt_width`) + L."""
    for p in prompts:
        check_canvas(bundle, len(p), L, hint)
    return prompt_width(max(map(len, prompts), default=0), L, bundle.context_length, fast) + L


def check_mask_token(bundle, decoder: str) -> None:
    if bundle.mask_token_id is None:
        raise UnmaskError(f"the {decoder} decoder needs a masked-diffusion model with a mask token; "
                          "load it with mask_token_id=ID or name it in unmask_config.json")


def early_stop(ids: torch.Tensor, mask_id: int, stops: torch.Tensor, gen: torch.Tensor | None = None) -> torch.Tensor:
    """diffusion.md §9 early stop on canvases ids (B, T) whose generated columns are ``gen`` (B, T)
    bool (None: every column), in place.

    A row whose first committed stop id at e has every generated position before e committed gets
    all positions after e set to that id. Returns (B,) bool: the rows that stopped.
    """
    T = ids.shape[1]
    gen = torch.ones_like(ids, dtype=torch.bool) if gen is None else gen  # (B, T)
    is_stop = torch.isin(ids, stops) & gen  # (B, T)
    first = torch.where(is_stop.any(dim=1), is_stop.float().argmax(dim=1), torch.full_like(ids[:, 0], T))  # (B,)
    cols = torch.arange(T, device=ids.device)  # (T,)
    before = gen & (cols[None, :] < first[:, None])  # (B, T)
    ready = (first < T) & ~((ids == mask_id) & before).any(dim=1)  # (B,)
    fill_value = ids.gather(1, first.clamp(max=T - 1)[:, None])  # (B, 1) the stop id found
    fill = ready[:, None] & (cols[None, :] > first[:, None])  # (B, T)
    ids.copy_(torch.where(fill, fill_value, ids))
    return ready


@dataclass(eq=False)
class CanvasRow(Row):
    """A running row on a canvas: ``generator`` (sampled rows), ``report`` (tokens reported),
    ``commits`` (per forward it had masks) and ``gen``: its generated ids as the last step's read
    left them (masks where nothing is committed), so finishing reads nothing more."""

    generator: object = None
    report: int = 0
    commits: list[int] = field(default_factory=list)
    gen: list[int] = field(default_factory=list)


class CanvasBatch(CanvasRows):
    """What the diffusion and early-bird running batches share: a :class:`SlotCanvas` slot per row,
    one :class:`StopRule` (ids: ``stop_token_ids``, None = the bundle's; ``stops`` as a tensor),
    per-slot stop flags ``done``, placing validated requests (:meth:`_place`), finishing rows from
    the ids a step read (:meth:`_finish`, the subclass's ``_row_extra``) and the ``stats.extra``
    keys both report (:meth:`_extra`). ``block``: the canvas's block (None: early-bird's windows).
    ``shaping`` (:class:`~unmask.decode.blocks.commit_shaping.CommitShaping`): a row's ``logit_bias`` is
    added to its logits before the commit rule reads them (``on_forward`` sees them biased); with
    ``logprobs`` its finished row has them, commit-time."""

    def __init__(self, bundle, cfg, *, block, width, capacity, static, compile, on_step, on_forward, lockstep,
                 stop_token_ids, length=None):
        self.bundle, self.cfg = bundle, cfg
        self.static, self.compile = static or compile, compile
        self.on_step, self.on_forward, self.lockstep = on_step, on_forward, lockstep
        self.slots = Slots(capacity)
        self.canvas = SlotCanvas(bundle, cfg.cache, capacity, width, block, static=static, compile=compile,
                                 length=length)
        self.stop = StopRule.of(bundle.stop_token_ids if stop_token_ids is None else stop_token_ids)
        self.stops = torch.tensor(sorted(self.stop.ids) or [-1], device=bundle.device)
        self.suppress = list(bundle.suppress_ids)
        self.done = torch.zeros(capacity, dtype=torch.bool, device=bundle.device)  # (C,) a stop seen
        self.running: dict = {}  # slot -> row
        self.forwards = 0
        self.shaping = CommitShaping()  # the rows' logit_bias and commit-time logprobs

    @property
    def confidence(self) -> str | None:
        return self.cfg.confidence

    def _place(self, requests, rows) -> list:
        """Give each (validated) request a free slot with its canvas ``[prompt | m^L]`` and its row,
        ``rows(job, slot, generator)`` (L = the row's ``len(gen)``). No forward: returns []."""
        if len(requests) > self.slots.free:
            self.slots.take(len(requests))  # raises the one-line "running batch full"
        self._restart()
        for job, slot in zip(requests, self.slots.take(len(requests))):
            row = self.running[slot] = rows(job, slot, row_generator(job, self.bundle.device))
            self.canvas.place(slot, list(job.prompt_ids), len(row.gen), self.bundle.mask_token_id)
            self.done[slot] = False
        return []

    def _event(self, row, forward: int, chosen, tokens, offset: int, gen, **extra) -> None:
        """Send the row's step event (:func:`~unmask.trace.host_event`): lockstep numbered by the batch
        ``forward`` and the request id, else by the row's own forward (row 0)."""
        at, who = (forward, row.job.id) if self.lockstep else (row.nfe, 0)
        self.on_step(row, host_event(at, who, chosen, tokens, offset, gen, self.bundle.mask_token_id, **extra))

    def _stop_hit(self, row, gen: list[int]) -> bool:
        """Whether the row's stop strings occur in the text of ``gen`` (up to its first mask)."""
        return StopRule.of(strings=row.job.stop).hit(self.bundle, row.job.prompt_ids, gen,
                                                     also=(self.bundle.mask_token_id,))

    def _finish(self, rows: list) -> None:
        """Set the rows' outputs as decode reports them (cut at the reported length and the first stop
        id, from the ids the step read) and free their slots."""
        for row in rows:
            finish(row, row.gen[: row.report], self.stop, self.bundle.mask_token_id)
            self.shaping.finish(row)
            row.extra = self._row_extra(row)
            self._leave(row)

    def _leave(self, row) -> None:
        super()._leave(row)
        self.shaping.forget(row)

    def _extra(self, rows: list, extra: dict, keys: tuple[str, ...]) -> dict:
        """``extra`` plus what both decoders report: ``accepts`` (histogram of per-row commits per
        forward), ``n_committed``, ``row_extra`` (``keys`` of each row's extra), ``compiled`` and, on
        a static cache, ``static_cache`` (its positions)."""
        extra.update(accepts=dict(sorted(Counter(c for row in rows for c in row.commits).items())),
                     n_committed=[row.extra["n_committed"] for row in rows],
                     row_extra=[{k: row.extra[k] for k in keys} for row in rows], compiled=bool(self.compile))
        if self.canvas.static_capacity is not None:
            extra["static_cache"] = self.canvas.static_capacity
        return extra


__all__ = ["CanvasBatch", "CanvasRow", "SamplerKnobs", "canvas_width", "check_canvas", "check_mask_token",
           "early_stop"]
