"""Knob groups several decoders share: the commit policy (SBD §5, spec/diffusion.md §5-6) and the
masked-diffusion canvas. A decoder's :class:`~unmask.decode.engine.registry.Config` inherits them."""

from __future__ import annotations

from dataclasses import dataclass

from unmask.decode.engine.registry import Config, knob

POLICIES = ("entropy-bound", "confidence-bound", "margin-bound", "threshold", "factor", "top-k", "entropy-threshold")
PRESETS = ("reasoning-low", "reasoning-high", "chat-low", "chat-high")


@dataclass(frozen=True)
class PolicyKnobs(Config):
    """The commit policy of a block: which masked positions a forward reveals."""

    policy: str | None = knob("commit policy: entropy-bound, confidence-bound, threshold, factor, top-k, "
                              "entropy-threshold (default: implied by the options given, else the decoder's)",
                              choices=POLICIES)
    gamma: float | None = knob("EB-sampler bound γ >= 0 (entropy-bound / confidence-bound)", low=0)
    preset: str | None = knob("γ preset: reasoning-low, reasoning-high, chat-low, chat-high", choices=PRESETS)
    tau: float | None = knob("confidence threshold τ in (0, 1] (threshold policy)", low=0, high=1)
    factor: float | None = knob("Fast-dLLM factor f (factor policy)", low=0)
    tokens_per_step: int | None = knob("tokens committed per step (top-k policy)", low=1)


@dataclass(frozen=True)
class CanvasKnobs(Config):
    """A masked-diffusion canvas: its length, block and approximate cache (spec/diffusion.md)."""

    gen_length: int | None = knob("fixed generation length (canvas size; default: max_new_tokens rounded up to "
                                  "a whole block)", low=1)
    cache: str | None = knob("none, prefix or dual (approximate caches; default none)", choices=("none", "prefix", "dual"))
    eos_early_stop: bool = knob("stop a row once its text before the first EOS is final", default=False, cli=False)
    sampler: str | None = knob("how tokens are drawn at T > 0: llada or dream", choices=("llada", "dream"), cli=False)
    confidence: str | None = knob("the distribution κ is read from: untempered (softmax(logits)) or tempered "
                                  "(Dream's softmax(logits / T))", choices=("untempered", "tempered"), cli=False,
                                  serve=True)


__all__ = ["CanvasKnobs", "POLICIES", "PRESETS", "PolicyKnobs"]
