"""Autoregressive decoding with an exact KV cache: the baseline every decoder is measured against.

It runs the one engine's AR / lossless SBD batch (:class:`unmask.decode.verify.batch.Verify`) with
every row at draft size K = 1: one token per row per forward (DESIGN.md "One engine")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unmask.decode.verify.batch import Verify
from unmask.decode.engine.running import drain, requests_for
from unmask.decode.verify.steps import VerifyConfig
from unmask.decode.engine.stats import DecodeOutput
from unmask.sampling import Sampling
from unmask.decode.engine.registry import Config, Spec


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (),
           compile: bool = False, on_step=None) -> DecodeOutput:
    """Batched greedy or sampled next-token decoding (NTP mode, SBD Eq. 9a).

    prompts: token ids per row (different lengths are left-padded). One prefill forward for every
    row, then one forward per step of one query per running row; a row stops at a stop token
    (excluded from its output), a stop string (the completing token is kept) or
    ``max_new_tokens``, and its slot is freed, so finished rows cost nothing more. ``compile=True``
    runs the same batch on a static KV cache with a ``torch.compile``-d forward (same tokens and
    NFE; stats.extra then records ``compiled`` and ``static_cache``, its length). Returns the
    generated ids per row and DecodeStats where NFE counts every forward that commits a token (the
    prefill commits the first one). One host sync per step. ``on_step(event)`` gets
    :mod:`unmask.trace` step events (each row's committed tokens after every forward, ``row`` its
    index in ``prompts``), as the other decoders emit them; they cost one list copy per row per step.
    """
    N = max_new_tokens
    requests = requests_for(prompts, max_new_tokens=N, sampling=sampling, stop_strings=stop_strings,
                            device=bundle.device)
    events = None if on_step is None else (lambda row, event: on_step({**event, "row": row.job.id}))
    length = max((len(p) for p in prompts), default=1) + N + 1

    def make(capacity: int) -> Verify:
        return Verify(bundle, VerifyConfig(), compile=compile, capacity=capacity, ar=True,
                      stop_token_ids=stop_token_ids, length=length, on_step=events)

    return drain(make, requests)


@dataclass(frozen=True)
class AROptions(Config):
    """AR takes no knobs: one token per row per forward (its draft size K = 1)."""


SPEC = Spec("ar", AROptions, batch=None, kinds=("causal", "sbd"), compiles=True, run=decode,
            summary="autoregressive, one token per forward, exact KV cache")
