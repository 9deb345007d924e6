"""Token sampling shared by the decoders: greedy, temperature, top-k and top-p, seeded."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from unmask.errors import UnmaskError


# Non-zero temperatures whose logits / T stay finite and distinguishable in float32.
TEMPERATURE_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class Sampling:
    """How committed tokens are drawn.

    temperature 0 is greedy (argmax). top_k 0 and top_p 1.0 disable those filters. ``seed``
    seeds the torch.Generator a decode run creates, so runs are reproducible.
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


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. logits (..., V) float -> (...) long."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    scaled = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    probs = torch.softmax(scaled, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])  # (rows, V)
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
