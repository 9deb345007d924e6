"""Token sampling shared by the decoders: greedy, temperature, top-k and top-p, seeded."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from unmask.errors import UnmaskError


# Non-zero temperatures whose logits / T stay finite and distinguishable in float32.
TEMPERATURE_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class Sampling:
    """How committed tokens are drawn.

    temperature 0 is greedy (argmax). top_k 0 and top_p 1.0 disable those filters. ``seed``
    seeds the generators a decode run creates, so runs are reproducible; every decoder draws each
    row from its own generator (:meth:`row_generators`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0

    def __post_init__(self):
        def number(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not (number(self.temperature) and 0 <= self.temperature < math.inf):
            raise UnmaskError(f"temperature must be a finite number >= 0 (got {self.temperature!r}); "
                              "use 0 for greedy decoding")
        if self.temperature != 0 and not TEMPERATURE_RANGE[0] <= self.temperature <= TEMPERATURE_RANGE[1]:
            raise UnmaskError(f"temperature {self.temperature!r} is outside [{TEMPERATURE_RANGE[0]:g}, "
                              f"{TEMPERATURE_RANGE[1]:g}], where logits / T overflow or vanish in float32; use 0 for "
                              "greedy decoding or a temperature in that range")
        if not (number(self.top_p) and 0 < self.top_p <= 1):
            raise UnmaskError(f"top-p must be in (0, 1] (got {self.top_p!r}); use 1.0 to disable it")
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise UnmaskError(f"top-k must be an integer >= 0 (got {self.top_k!r}); use 0 to disable it")
        if self.seed is not None and not (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                          and -2**63 <= self.seed < 2**64):
            raise UnmaskError(f"seed must be an integer in [-2**63, 2**64) or None (got {self.seed!r}); "
                              "pass e.g. 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(0 if self.seed is None else int(self.seed))
        return g

    def row_generators(self, prompts: Sequence[Sequence[int]], device) -> list[torch.Generator] | None:
        """One generator per row, or None when greedy (diffusion.md §4: seeded per request, our choice).

        Row r's seed mixes ``seed``, the row's prompt ids and how many earlier rows hold the same
        prompt. So a run is reproducible, a row draws the same tokens whatever else is in the batch
        (a batch equals single runs of its distinct prompts), and identical prompts in one batch are
        independent samples rather than clones.
        """
        if self.greedy:
            return None
        seen: Counter = Counter()
        gens = []
        for p in prompts:
            key = tuple(int(t) for t in p)
            g = torch.Generator(device=device)
            g.manual_seed(_row_seed(0 if self.seed is None else int(self.seed), key, seen[key]))
            seen[key] += 1
            gens.append(g)
        return gens


def _row_seed(seed: int, prompt: tuple[int, ...], copy: int) -> int:
    """A 64-bit seed from (seed, prompt ids, copy index); stable across processes and platforms."""
    text = f"{seed}|{copy}|{','.join(map(str, prompt))}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask logits outside the top-k / nucleus (top-p) set with -inf. logits (..., V)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop_sorted[..., 0] = False  # a top_p below float32's range rounds to 0 and would drop every token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, sampling: Sampling,
           generator: torch.Generator | Sequence[torch.Generator] | None) -> torch.Tensor:
    """Draw one token per position. logits (R, ..., V) float -> (R, ...) long.

    ``generator`` is one generator, or a sequence of R (:meth:`Sampling.row_generators`): then row r
    is drawn with generator r only, so its draws do not depend on the other rows.
    """
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return multinomial(probs(logits.float(), sampling), generator)  # (R, ...)


def uniform(shape: tuple[int, int], generator, device) -> torch.Tensor:
    """U[0, 1) of ``shape`` (B, n); with one generator per row, row r comes from generator r only."""
    if isinstance(generator, (list, tuple)):
        return torch.stack([torch.rand(shape[1], generator=g, device=device) for g in generator])
    return torch.rand(shape, generator=generator, device=device)


def multinomial(probs: torch.Tensor, generator) -> torch.Tensor:
    """One draw per distribution: probs (B, ..., V) -> (B, ...) long; with one generator per row,
    row r comes from generator r only. ``probs`` need not be normalized."""
    if isinstance(generator, (list, tuple)):
        return torch.stack([multinomial(probs[r], g) for r, g in enumerate(generator)])
    flat = probs.reshape(-1, probs.shape[-1])  # (rows, V)
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(..., V) logits -> tempered, top-k / top-p filtered probabilities (speculative sampling applies
    this same transform to the target p and the proposal q)."""
    return torch.softmax(filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p), dim=-1)


def draw(logits: torch.Tensor, sampling: Sampling, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens (...,) and, when sampling, the distributions (..., V) they were drawn from (greedy: None)."""
    if sampling.greedy:
        return logits.argmax(dim=-1), None
    dist = probs(logits, sampling)
    return multinomial(dist, generator), dist
