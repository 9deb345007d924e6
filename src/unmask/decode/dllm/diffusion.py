"""Semi-autoregressive decoding of masked-diffusion LMs: its knobs and their resolution
(spec/diffusion.md §3, §4, §6–§9).

The canvas is ``[prompt | m^L]`` (L = gen_length), split into L / block_size blocks decoded left
to right: each step runs one bidirectional forward, reads the current block's logits (realigned,
§2) and lets the commit policy (:mod:`unmask.policies`) reveal some of its masks; committed tokens
never change. Policies: ``top-k`` (LLaDA's low-confidence remasking with ``steps``, §3, or a fixed
``tokens_per_step``), ``threshold`` (default, τ = 0.9, Fast-dLLM §6), ``factor``, ``entropy-bound`` /
``confidence-bound`` / ``margin-bound`` (§7, γ = 0.1), ``entropy-threshold``.

Temperature (§4): ``sampler="llada"`` draws with float64 Gumbel-max, ``"dream"`` from the tempered
categorical (default: the model family's); κ is read under the untempered softmax unless
``confidence="tempered"`` (Dream's). Caches (§8, approximate): none / prefix / dual,
:mod:`unmask.decode.dllm.cache`. ``schedule="dream"`` runs Dream's own ``diffusion_generate``
instead (§5, :mod:`unmask.decode.dllm.dream`).

:class:`DiffusionOptions` are the knobs; :meth:`DiffusionOptions.resolve` turns them, once, into the
validated :class:`DiffusionConfig` a row decodes with. The running batch is
:mod:`unmask.decode.dllm.diffusion_batch`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace

import torch

from unmask.decode.dllm.cache import CACHE_MODES
from unmask.decode.dllm.canvas import SamplerKnobs
from unmask.decode.dllm.dream import DreamConfig
from unmask.decode.engine.knobs import CanvasKnobs, PolicyKnobs
from unmask.decode.engine.registry import knob
from unmask.errors import UnmaskError, check_choice, check_int, is_int
from unmask.models.adapters import default_sampler, is_remote
from unmask.policies import Policy, TopK, gamma_option, make_policy

DEFAULT_BLOCK_SIZE = 32  # Fast-dLLM's LLaDA setting (models.md §2.3)
DEFAULT_POLICY = "threshold"  # with τ = 0.9 (Fast-dLLM, diffusion.md §6)
DEFAULT_EB_GAMMA = 0.1  # confidence proxy (diffusion.md §7, our choice)
CANVAS_HINT = "lower --gen-length, --max-new-tokens or --block-size (the canvas is whole blocks)"
DREAM_KNOBS = ("schedule", "alg", "alg_temp", "eps")
# what Dream's schedule has no use for (one forward over the whole canvas per step, its own commit rule)
NOT_DREAM = ("block_size", "policy", "gamma", "preset", "tau", "factor", "factor_compat", "tokens_per_step", "eta",
             "cache", "refresh_every", "sampler", "confidence")


def llada_quota(n_masked: torch.Tensor, steps: int, s: int) -> torch.Tensor:
    """Tokens to commit at step s of a block (LLaDA ``get_num_transfer_tokens``, diffusion.md §3).

    n_masked: (B,) long, masks in the block at its start. Returns (B,) long: n // steps, plus one
    for the first n % steps steps, so the S quotas sum to n.
    """
    base, rem = n_masked // steps, n_masked % steps  # (B,) each
    return base + (s < rem).long()


def batches_fit(bundle) -> bool:
    """Whether this model's diffusion and early-bird requests can share running batches: a
    masked-diffusion model with a mask token whose forward takes explicit positions per row (a
    remote-code LLaDA takes none, so its rows cannot be padded: the server runs those per call)."""
    return (bundle.kind == "masked-diffusion" and bundle.mask_token_id is not None
            and (not is_remote(bundle.model) or bundle.meta.get("family") == "dream"))


@dataclass(frozen=True)
class DiffusionConfig(SamplerKnobs):
    """The resolved, validated settings a diffusion row decodes with.

    gen_length: canvas length L; block_size divides it. steps: LLaDA's total step budget (top-k
    only, a multiple of the block count) or None. cache: none / prefix / dual. refresh_every: a
    full refresh forward every this many steps inside a block (None: at block starts only).
    eos_early_stop: stop a row as soon as its text before the first EOS is final (§9).
    sampler: "llada" or "dream" (§4), how tokens are drawn at T > 0.
    confidence: the distribution κ is read from: None (default) or "untempered", softmax(logits)
    (float64 with the llada sampler, as its reference; float32 with dream's); "tempered", Dream's
    softmax(logits / T). See :func:`unmask.policies.commit`.
    """

    gen_length: int
    block_size: int
    policy: Policy
    steps: int | None = None
    cache: str = "none"
    refresh_every: int | None = None
    eos_early_stop: bool = False
    sampler: str = "llada"
    confidence: str | None = None

    def __post_init__(self):
        L, B = self.gen_length, self.block_size
        check_int(L, 1, "gen length", "pass e.g. --gen-length 64")
        check_int(B, 1, "block size", "32 is Fast-dLLM's default")
        if L % B:
            divisors = [d for d in range(1, L + 1) if L % d == 0]
            near = ", ".join(map(str, sorted(sorted(divisors, key=lambda d: (abs(d - B), d))[:4])))
            if B > L:  # a longer canvas is not what was asked for: only a smaller block fits
                raise UnmaskError(f"block size {B} is longer than gen length {L}; use a block size that divides "
                                  f"{L}: {near}")
            low = L // B * B
            raise UnmaskError(f"block size {B} does not divide gen length {L}; use a block size of {near} "
                              f"or a gen length of {low} or {low + B}")
        check_choice("cache", self.cache, CACHE_MODES)
        if self.refresh_every is not None:
            check_int(self.refresh_every, 1, "refresh_every", "leave it unset to refresh at block starts only")
        self.check_sampler()
        if self.steps is not None:
            nb = L // B
            if not isinstance(self.policy, TopK):
                raise UnmaskError(f"steps applies to the top-k policy only (got {self.policy.name!r}); "
                                  "drop --steps or use --policy top-k")
            if not is_int(self.steps) or self.steps < nb or self.steps % nb:
                low = max(nb, (self.steps // nb) * nb) if is_int(self.steps) else nb
                raise UnmaskError(f"steps must be a positive multiple of the {nb} blocks (gen length {L} / block "
                                  f"size {B}), got {self.steps!r}; use e.g. {low} or {low + nb}")

    @property
    def n_blocks(self) -> int:
        return self.gen_length // self.block_size

    def warn_degenerate(self) -> None:
        """Warn (one line) when LLaDA's schedule gives one step per block: every block is committed
        whole from a single forward, which is legal (§3) but rarely what was meant."""
        if self.steps is not None and self.steps == self.n_blocks and self.block_size > 1:
            warnings.warn(f"--steps {self.steps} equals the number of blocks (gen length {self.gen_length} / block "
                          f"size {self.block_size}): each block of {self.block_size} tokens commits in one step; use "
                          f"--steps {self.gen_length} for one token per step", stacklevel=4)


@dataclass(frozen=True)
class DiffusionOptions(CanvasKnobs, PolicyKnobs):
    """Semi-AR masked diffusion's knobs (spec/diffusion.md): canvas, block, commit policy, cache,
    or Dream's published schedule."""

    block_size: int | None = knob("semi-AR block size (default 32, or the requested length when shorter)", low=1,
                                  short="-k")
    factor_compat: bool | None = knob("Fast-dLLM's factor rule bit for bit (float64 untempered κ, and its last-rank "
                                      "quirk; spec diffusion.md §6)")
    eta: float | None = knob("entropy bound η in nats (entropy-threshold policy)", low=0)
    steps: int | None = knob("total denoising steps (top-k policy, LLaDA; --schedule dream)", low=1)
    refresh_every: int | None = knob("a full refresh forward every this many steps inside a block (default: at "
                                     "block starts only)", low=1, cli=False)
    schedule: str | None = knob("a published reference decoding: dream (Dream's diffusion_generate)",
                                choices=("dream",))
    alg: str | None = knob("--schedule dream: origin, maskgit_plus, topk_margin or entropy",
                           choices=("origin", "maskgit_plus", "topk_margin", "entropy"))
    alg_temp: float | None = knob("--schedule dream: the confidence temperature of its alg", cli=False)
    eps: float | None = knob("--schedule dream: the time schedule's end point", cli=False)
    reference_steps: bool = knob("run LLaDA's zero-quota steps too, as the reference does (NFE = steps)",
                                 default=False, cli=False, serve=False)

    @property
    def dreams(self) -> bool:
        """Whether these options ask for Dream's schedule (or one of its knobs)."""
        return any(getattr(self, k) is not None for k in DREAM_KNOBS)

    def resolve(self, bundle, max_new_tokens: int) -> DiffusionConfig:
        """The config a request of ``max_new_tokens`` decodes with on ``bundle`` (sampler: the model
        family's unless given). gen_length defaults to max_new_tokens rounded up to a multiple of
        the block size; the block size to 32, or to the requested length when that is shorter.
        Raises UnmaskError for bad values and combinations."""
        gamma = gamma_option(self.gamma, self.preset)
        if not isinstance(self.eos_early_stop, bool):
            raise UnmaskError(f"eos_early_stop must be true or false (got {self.eos_early_stop!r})")
        if self.steps is not None and self.tokens_per_step is not None:
            raise UnmaskError("--steps and --tokens-per-step conflict; give either --steps (LLaDA schedule) or "
                              "--tokens-per-step, not both")
        compat = self.factor_compat
        # without --policy, the policy an option implies (threshold otherwise)
        implied = (("factor", compat), ("top-k", self.steps is not None or self.tokens_per_step is not None),
                   ("confidence-bound", gamma is not None), ("factor", self.factor is not None),
                   ("entropy-threshold", self.eta is not None))
        name = self.policy or next((p for p, on in implied if on), DEFAULT_POLICY)
        if compat and name != "factor":
            raise UnmaskError(f"--factor-compat applies to the factor policy only (got {name!r}); "
                              "use --policy factor or drop --factor-compat")
        if gamma is None and name in ("entropy-bound", "confidence-bound", "margin-bound"):
            gamma = DEFAULT_EB_GAMMA
        built = make_policy(name, gamma=gamma, tau=self.tau, f=self.factor, compat=compat, k=self.tokens_per_step,
                            eta=self.eta)
        gen_length = self.gen_length
        requested = gen_length if gen_length is not None else max_new_tokens
        check_int(requested, 1, "gen length", "pass e.g. --gen-length 64")
        block = self.block_size if self.block_size is not None else min(DEFAULT_BLOCK_SIZE, requested)
        if gen_length is None:  # an invalid block size is reported by DiffusionConfig
            gen_length = math.ceil(requested / block) * block if is_int(block) and block >= 1 else requested
        elif is_int(max_new_tokens) and is_int(gen_length) and max_new_tokens > gen_length:
            raise UnmaskError(f"max_new_tokens {max_new_tokens} exceeds gen length {gen_length}; lower "
                              "--max-new-tokens or raise --gen-length")
        return DiffusionConfig(gen_length=gen_length, block_size=block, policy=built, steps=self.steps,
                               cache="none" if self.cache is None else str(self.cache),
                               refresh_every=self.refresh_every, eos_early_stop=self.eos_early_stop,
                               sampler=default_sampler(bundle) if self.sampler is None else self.sampler,
                               confidence=self.confidence)

    def dream(self) -> DreamConfig:
        """Dream's schedule of these options. Raises UnmaskError for another schedule, Dream's knobs
        without it, or options Dream's loop has no use for."""
        if self.schedule != "dream":
            raise UnmaskError(f"unknown schedule {self.schedule!r} for the diffusion decoder; use \"dream\" (Dream's "
                              "diffusion_generate) or leave it unset" if self.schedule is not None else
                              "--alg/--alg-temp/--eps apply to Dream's schedule; add --schedule dream")
        given = sorted(k for k in NOT_DREAM if getattr(self, k) not in (None, "none"))
        if self.eos_early_stop:
            given.append("eos_early_stop")
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise UnmaskError(f"{flags} do(es) not apply to --schedule dream (one forward over the whole canvas per "
                              "step, Dream's own commit rule); drop them")
        return DreamConfig.of(gen_length=self.gen_length, steps=self.steps, alg=self.alg, alg_temp=self.alg_temp,
                              eps=self.eps)

    def batch_key(self, bundle, max_new_tokens: int):
        """("dream", self) for Dream's schedule (a running batch of its own); ("diffusion", these options
        with the block size the request decodes with: a short request gets a shorter block, so it is
        part of the key); None (per call) for a model whose rows cannot share a batch
        (:func:`batches_fit`), ``reference_steps``, or options that fail (the call reports them)."""
        if not batches_fit(bundle) or self.reference_steps:
            return None
        try:
            if self.dreams:
                self.dream()
                return "dream", self
            block = self.resolve(bundle, max_new_tokens).block_size
        except (UnmaskError, TypeError):
            return None
        return "diffusion", replace(self, block_size=block)


__all__ = ["CANVAS_HINT", "DEFAULT_BLOCK_SIZE", "DiffusionConfig", "DiffusionOptions", "batches_fit", "llada_quota"]
