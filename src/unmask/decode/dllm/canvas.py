"""What the one-engine decoders share (diffusion, Dream's schedule, early-bird, block, multiblock):
request checks, a row's generator, decode's drain of a running batch, the stop rules on a
generated region (spec/diffusion.md §9) and a finished row's output. Pure functions of host values
or (B, L) tensors; no model, no state."""

from __future__ import annotations

import torch

from unmask.decode.engine.running import drain, requests_for
from unmask.decode.engine.stats import DecodeOutput, stop_flags
from unmask.decode.engine.stop import StopRule
from unmask.errors import UnmaskError


def check_canvas(bundle, prompt_len: int, gen_length: int, hint: str) -> None:
    """Raise the one-line UnmaskError for an empty prompt or a canvas past the context window
    (``hint`` says what to lower)."""
    if prompt_len == 0:
        raise UnmaskError("every prompt needs at least one token (a Dream-style model scores position i from i-1)")
    if prompt_len + gen_length > bundle.context_length:
        raise UnmaskError(f"prompt ({prompt_len} tokens) + gen length {gen_length} exceeds the context window of "
                          f"{bundle.context_length}; {hint}")


def check_mask_token(bundle, decoder: str) -> None:
    if bundle.mask_token_id is None:
        raise UnmaskError(f"the {decoder} decoder needs a masked-diffusion model with a mask token; "
                          "load it with mask_token_id=ID or name it in unmask_config.json")


def serving_options(options: dict | None, allowed, what: str) -> dict:
    """The set (non-None) ``options`` of a server batch; UnmaskError naming any not in ``allowed``."""
    options = {k: v for k, v in dict(options or {}).items() if v is not None}
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise UnmaskError(f"option(s) {', '.join(unknown)} do not apply to {what}; use only {', '.join(allowed)}")
    return options


def row_generator(job, device):
    """The request's generator, else (sampled) the one ``decode`` gives its prompt alone, else None."""
    gen = getattr(job, "generator", None)
    if gen is None and not job.sampling.greedy:
        gen = job.sampling.row_generators([list(job.prompt_ids)], device)[0]
    return gen


def event_hook(on_step):
    """``decode``'s ``on_step(event)`` as a running batch's ``on_step(row, event)``."""
    return None if on_step is None else (lambda row, event: on_step(event))


def drain_prompts(make, bundle, prompts, *, max_new_tokens: int, sampling, stop_strings=()) -> DecodeOutput:
    """``decode()`` of a running-batch class: :func:`~unmask.decode.engine.running.drain` of ``make(capacity)``
    over one request per prompt (each with the generator ``unmask generate`` gives it)."""
    return drain(make, requests_for(prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                    stop_strings=stop_strings, device=bundle.device))


def until_stop(row: list[int], stop_set) -> list[int]:
    """``row`` up to (not including) its first id in ``stop_set`` (:meth:`StopRule.until_stop`)."""
    return StopRule.of(stop_set).until_stop(row)


def stop_string_in(bundle, prompt, ids: list[int], mask_id: int, stop_strings) -> bool:
    """Whether the text of ``ids`` (generated ids, cut at the first mask) holds a stop string."""
    return StopRule.of(strings=stop_strings).hit(bundle, prompt, ids, also=(mask_id,))


def finish(row, full: list[int], stop_ids, mask_id: int) -> None:
    """Set a finished row's ``tokens`` (``full``, its reported ids, cut at the first stop id or
    mask), ``stop_token`` and ``finish`` ("length" or "stop")."""
    rule = stop_ids if isinstance(stop_ids, StopRule) else StopRule.of(stop_ids)
    row.tokens = rule.until_stop(full, also=(mask_id,))
    row.stop_token = stop_flags([full], [row.tokens], rule.ids)[0]
    row.finish = "length" if len(row.tokens) >= row.job.max_new_tokens else "stop"


def early_stop(gen: torch.Tensor, mask_id: int, stops: torch.Tensor) -> torch.Tensor:
    """diffusion.md §9 early stop on the generation region gen (B, L), in place.

    A row whose first committed stop id at e has every position before e committed gets all
    positions after e set to that id. Returns (B,) bool: the rows that stopped.
    """
    return early_stop_in(gen, torch.ones_like(gen, dtype=torch.bool), mask_id, stops)


def early_stop_in(ids: torch.Tensor, gen: torch.Tensor, mask_id: int, stops: torch.Tensor) -> torch.Tensor:
    """:func:`early_stop` on canvases ids (B, T) whose generated columns are ``gen`` (B, T) bool (a
    row's last L columns), in place. Returns (B,) bool: the rows that stopped."""
    T = ids.shape[1]
    is_stop = torch.isin(ids, stops) & gen  # (B, T)
    first = torch.where(is_stop.any(dim=1), is_stop.float().argmax(dim=1), torch.full_like(ids[:, 0], T))  # (B,)
    cols = torch.arange(T, device=ids.device)  # (T,)
    before = gen & (cols[None, :] < first[:, None])  # (B, T)
    ready = (first < T) & ~((ids == mask_id) & before).any(dim=1)  # (B,)
    fill_value = ids.gather(1, first.clamp(max=T - 1)[:, None])  # (B, 1) the stop id found
    fill = ready[:, None] & (cols[None, :] > first[:, None])  # (B, T)
    ids.copy_(torch.where(fill, fill_value, ids))
    return ready


__all__ = ["check_canvas", "check_mask_token", "drain_prompts", "early_stop", "early_stop_in", "event_hook", "finish",
           "row_generator", "serving_options", "stop_string_in", "until_stop"]
