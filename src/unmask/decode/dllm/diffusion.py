"""Semi-autoregressive decoding of masked-diffusion LMs (spec/diffusion.md §3, §4, §6–§9).

The canvas is ``[prompt | m^L]`` (L = gen_length), split into L / block_size blocks decoded left
to right: each step runs one bidirectional forward, reads the current block's logits (realigned,
§2) and lets the commit policy (:mod:`unmask.policies`) reveal some of its masks; committed tokens
never change. Policies: ``top-k`` (LLaDA's low-confidence remasking with ``steps``, §3, or a fixed
``tokens_per_step``), ``threshold`` (default, τ = 0.9, Fast-dLLM §6), ``factor``, ``entropy-bound`` /
``confidence-bound`` / ``margin-bound`` (§7, γ = 0.1), ``entropy-threshold``.

Temperature (§4): ``sampler="llada"`` draws with float64 Gumbel-max, ``"dream"`` from the tempered
categorical (default: the model family's); κ is read under the untempered softmax unless
``confidence="tempered"`` (Dream's). Each row has its own seeded generator, so a batch equals
single runs. Caches (§8, approximate): none / prefix / dual, :mod:`unmask.decode.dllm.cache`.
The loop is :class:`~unmask.decode.dllm.diffusion_batch.Diffusion`, the server's running batch too.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from unmask.decode.dllm.canvas import check_canvas, check_mask_token, event_hook
from unmask.decode.dllm.cache import CACHE_MODES, check_fast_path, prompt_width
from unmask.decode.engine.running import drain, requests_for
from unmask.decode.engine.stats import DecodeOutput
from unmask.errors import UnmaskError, is_int
from unmask.models.adapters import SAMPLERS, default_sampler
from unmask.policies import CONFIDENCES, Policy, TopK, gamma_option, make_policy
from unmask.sampling import Sampling
from unmask.decode.engine.knobs import CanvasKnobs, PolicyKnobs
from unmask.decode.engine.registry import knob

DEFAULT_BLOCK_SIZE = 32  # Fast-dLLM's LLaDA setting (models.md §2.3)
DEFAULT_POLICY = "threshold"  # with τ = 0.9 (Fast-dLLM, diffusion.md §6)
DEFAULT_EB_GAMMA = 0.1  # confidence proxy (diffusion.md §7, our choice)
CANVAS_HINT = "lower --gen-length, --max-new-tokens or --block-size (the canvas is whole blocks)"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def llada_quota(n_masked: torch.Tensor, steps: int, s: int) -> torch.Tensor:
    """Tokens to commit at step s of a block (LLaDA ``get_num_transfer_tokens``, diffusion.md §3).

    n_masked: (B,) long, masks in the block at its start. Returns (B,) long: n // steps, plus one
    for the first n % steps steps, so the S quotas sum to n.
    """
    base, rem = n_masked // steps, n_masked % steps  # (B,) each
    return base + (s < rem).long()


@dataclass(frozen=True)
class DiffusionConfig:
    """Validated settings of one diffusion decode.

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
        if not is_int(L) or L < 1:
            raise UnmaskError(f"gen length must be an integer >= 1 (got {L!r}); pass e.g. --gen-length 64")
        if not is_int(B) or B < 1:
            raise UnmaskError(f"block size must be an integer >= 1 (got {B!r}); 32 is Fast-dLLM's default")
        if L % B:
            near = ", ".join(map(str, sorted(sorted(_divisors(L), key=lambda d: (abs(d - B), d))[:4])))
            if B > L:  # a longer canvas is not what was asked for: only a smaller block fits
                raise UnmaskError(f"block size {B} is longer than gen length {L}; use a block size that divides "
                                  f"{L}: {near}")
            low = L // B * B
            raise UnmaskError(f"block size {B} does not divide gen length {L}; use a block size of {near} "
                              f"or a gen length of {low} or {low + B}")
        if self.cache not in CACHE_MODES:
            raise UnmaskError(f"unknown cache {self.cache!r}; choose one of: {', '.join(CACHE_MODES)}")
        if self.refresh_every is not None and (not is_int(self.refresh_every) or self.refresh_every < 1):
            raise UnmaskError(f"refresh_every must be an integer >= 1 (got {self.refresh_every!r}); "
                              "leave it unset to refresh at block starts only")
        if self.sampler not in SAMPLERS:
            raise UnmaskError(f"unknown sampler {self.sampler!r}; choose one of: {', '.join(SAMPLERS)}")
        if self.confidence is not None and self.confidence not in CONFIDENCES:
            raise UnmaskError(f"unknown confidence {self.confidence!r}; choose one of: {', '.join(CONFIDENCES)}")
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
    def commit_confidence(self) -> str | None:
        """``confidence`` as :func:`unmask.policies.commit` takes it: the llada sampler's untempered κ
        is float64, as in the LLaDA / Fast-dLLM reference."""
        return "untempered" if self.confidence is None and self.sampler == "llada" else self.confidence

    @property
    def n_blocks(self) -> int:
        return self.gen_length // self.block_size

    def warn_degenerate(self) -> None:
        """Warn (one line) when LLaDA's schedule gives one step per block: every block is committed
        whole from a single forward, which is legal (§3) but rarely what was meant."""
        if self.steps is not None and self.steps == self.n_blocks and self.block_size > 1:
            warnings.warn(f"--steps {self.steps} equals the number of blocks (gen length {self.gen_length} / block "
                          f"size {self.block_size}): each block of {self.block_size} tokens commits in one step; use "
                          f"--steps {self.gen_length} for one token per step", stacklevel=3)

    @classmethod
    def from_options(cls, *, max_new_tokens: int, gen_length=None, block_size=None, policy=None, gamma=None,
                     preset=None, tau=None, factor=None, factor_compat=None, tokens_per_step=None, eta=None,
                     steps=None, cache=None, refresh_every=None, eos_early_stop=False,
                     sampler="llada", confidence=None) -> "DiffusionConfig":
        """Build from API/CLI options (None = default). Raises UnmaskError for bad combinations.

        gen_length defaults to max_new_tokens rounded up to a multiple of the block size; the block
        size defaults to 32, or to the requested length when that is shorter.
        """
        gamma = gamma_option(gamma, preset)
        if not isinstance(eos_early_stop, bool):
            raise UnmaskError(f"eos_early_stop must be true or false (got {eos_early_stop!r})")
        if steps is not None and tokens_per_step is not None:
            raise UnmaskError("--steps and --tokens-per-step conflict; give either --steps (LLaDA schedule) or "
                              "--tokens-per-step, not both")
        name = policy or ("factor" if factor_compat else _infer_policy(gamma, tau, factor, tokens_per_step, steps, eta))
        if factor_compat and name != "factor":
            raise UnmaskError(f"--factor-compat applies to the factor policy only (got {name!r}); "
                              "use --policy factor or drop --factor-compat")
        if gamma is None and name in ("entropy-bound", "confidence-bound", "margin-bound"):
            gamma = DEFAULT_EB_GAMMA
        params = {"gamma": gamma, "tau": tau, "f": factor, "compat": factor_compat, "k": tokens_per_step,
                  "eta": eta}
        built = make_policy(name, **params)
        requested = gen_length if gen_length is not None else max_new_tokens
        if not is_int(requested) or requested < 1:
            raise UnmaskError(f"gen length must be an integer >= 1 (got {requested!r}); pass e.g. --gen-length 64")
        block = block_size if block_size is not None else min(DEFAULT_BLOCK_SIZE, requested)
        if gen_length is None:  # an invalid block size is reported by __post_init__
            gen_length = math.ceil(requested / block) * block if is_int(block) and block >= 1 else requested
        elif is_int(max_new_tokens) and is_int(gen_length) and max_new_tokens > gen_length:
            raise UnmaskError(f"max_new_tokens {max_new_tokens} exceeds gen length {gen_length}; lower "
                              "--max-new-tokens or raise --gen-length")
        return cls(gen_length=gen_length, block_size=block, policy=built, steps=steps,
                   cache="none" if cache is None else str(cache), refresh_every=refresh_every,
                   eos_early_stop=eos_early_stop, sampler=sampler,
                   confidence=confidence)


def _infer_policy(gamma, tau, factor, tokens_per_step, steps, eta) -> str:
    """The policy an option implies when --policy is not given (threshold otherwise)."""
    if steps is not None or tokens_per_step is not None:
        return "top-k"
    if gamma is not None:
        return "confidence-bound"
    if factor is not None:
        return "factor"
    if eta is not None:
        return "entropy-threshold"
    return DEFAULT_POLICY


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (), gen_length: int | None = None,
           block_size: int | None = None, policy: str | None = None, gamma: float | str | None = None,
           preset: str | None = None, tau: float | None = None, factor: float | None = None,
           factor_compat: bool | None = None, tokens_per_step: int | None = None, eta: float | None = None,
           steps: int | None = None, cache: str | None = None, refresh_every: int | None = None,
           eos_early_stop: bool = False, sampler: str | None = None, confidence: str | None = None,
           schedule: str | None = None, reference_steps: bool = False,
           alg: str | None = None, alg_temp: float | None = None, eps: float | None = None, on_step=None,
           on_forward=None, compile: bool = False, static: bool = False) -> DecodeOutput:
    """Semi-AR masked-diffusion decoding of a batch (diffusion.md §3, §6–§9).

    prompts: token ids per row (left-padded; positions count real tokens only, so every row
    decodes exactly as it would alone). Blocks advance in lockstep: a row whose block is complete
    waits without committing. ``max_new_tokens`` sets gen_length when that is not given (rounded
    up to the block size). The reported tokens are cut to ``max_new_tokens`` in either case, and
    decoding ends after the block that holds the last reported position: later blocks cannot
    change committed tokens, so they would only cost forwards (pass ``max_new_tokens=gen_length``
    to decode and report the whole canvas).

    Stopping (§9): a row stops after the block in which it committed a stop id (stop_token_ids,
    e.g. EOS) and reports the tokens before the first one. With ``eos_early_stop`` a row stops as
    soon as every position before its first committed stop id is committed; the rest of the
    canvas is filled with that id (counted in ``n_committed``). Stop strings end a row after its
    block.

    Hooks: ``on_step(event)`` (see :mod:`unmask.trace`) after every forward, once per row that
    had masks; ``on_forward(state)`` (tests) with the canvas before the commit, the block logits
    (B, block, V) and the commit mask.

    Returns DecodeOutput. NFE counts forwards (the block-start refresh included, §10); per row,
    the forwards in which that row still had masks. stats.extra: policy, cache, gen_length,
    block_size, sampler, confidence, ``accepts`` (histogram of per-row commits per forward), ``n_committed``
    and per-row ``row_extra`` {policy, cache, steps (forwards used), commits (per-step counts)}.
    With ``steps`` larger than the generation length LLaDA's trailing steps have a quota of 0 and
    commit nothing; they are skipped (same tokens, fewer forwards). ``reference_steps=True`` runs
    them as LLaDA's ``generate`` does (NFE = steps; what ``--reference-nfe`` asks for).

    Fast path: ``static=True`` runs the K/V on a preallocated ``StaticKV`` with fixed-shape
    forwards (what ``compile`` runs, eagerly; for tests and debugging); ``compile=True`` also runs
    them through ``torch.compile`` (inductor on CPU, CUDA graphs on CUDA), one graph per shape:
    no cache compiles the canvas forward (B, P + L), the caches the window step (a prefix window
    padded to a bucket; the block-start refresh stays eager), see :mod:`unmask.decode.dllm.cache`.
    Prompts are left-padded to a multiple of 16 there, so similar prompts share the graphs. Same
    tokens and NFE as the eager run up to float rounding. stats.extra adds ``compiled`` and, on a
    static cache, ``static_cache`` (its positions).

    ``schedule="dream"`` runs Dream's own ``diffusion_generate`` instead (§5, no blocks; ``steps``,
    ``alg`` origin / maskgit_plus / topk_margin / entropy, ``alg_temp``, ``eps``): see
    :mod:`unmask.decode.dllm.dream`.

    Raises UnmaskError for a model without a mask token, max_new_tokens above an explicit
    gen_length, a block size that does not divide the generation length, a bad step budget, bad
    policy options, an unknown cache or sampler, a canvas longer than the context window, or
    ``compile`` / ``static`` on a remote-code model or with ``schedule="dream"``.
    """
    check_mask_token(bundle, "diffusion")
    if not isinstance(reference_steps, bool):
        raise UnmaskError(f"reference_steps must be true or false (got {reference_steps!r}); pass --reference-nfe to "
                          "generate, which sets it")
    if schedule is not None or alg is not None or alg_temp is not None or eps is not None:
        if compile or static:
            raise UnmaskError("compile/static do not apply to --schedule dream (Dream's own loop runs eagerly); "
                              "drop --compile or use the semi-AR diffusion schedule")
        return _dream_schedule(bundle, prompts, schedule, locals())
    check_fast_path(bundle, static, compile, "the diffusion decoder")
    cfg = DiffusionConfig.from_options(
        max_new_tokens=max_new_tokens, gen_length=gen_length, block_size=block_size, policy=policy, gamma=gamma,
        preset=preset, tau=tau, factor=factor, factor_compat=factor_compat, tokens_per_step=tokens_per_step,
        eta=eta, steps=steps, cache=cache, refresh_every=refresh_every, eos_early_stop=eos_early_stop,
        sampler=default_sampler(bundle) if sampler is None else sampler, confidence=confidence)
    cfg.warn_degenerate()
    for p in prompts:  # before the canvases are allocated
        check_canvas(bundle, len(p), cfg.gen_length, CANVAS_HINT)
    L = cfg.gen_length
    width = prompt_width(max(map(len, prompts)), L, bundle.context_length, static or compile) + L  # fast path: a bucket
    requests = requests_for(prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=stop_strings,
                            device=bundle.device)
    from unmask.decode.dllm.diffusion_batch import Diffusion  # it builds on this module's config and pieces

    return drain(lambda capacity: Diffusion(bundle, cfg, static=static, compile=compile, capacity=capacity,
                                            on_step=event_hook(on_step), stop_token_ids=stop_token_ids, lockstep=True,
                                            width=width, reference_steps=reference_steps, on_forward=on_forward),
                 requests)


_DREAM_OPTIONS = ("max_new_tokens", "sampling", "stop_token_ids", "gen_length", "steps", "alg", "alg_temp", "eps",
                  "on_step", "on_forward")


def _dream_schedule(bundle, prompts, schedule, options: dict) -> DecodeOutput:
    """Dispatch ``schedule="dream"`` to :mod:`unmask.decode.dllm.dream`, refusing options it has no use for."""
    from unmask.decode.dllm import dream as dream_compat

    if schedule != "dream":
        raise UnmaskError(f"unknown schedule {schedule!r} for the diffusion decoder; use \"dream\" (Dream's "
                          "diffusion_generate) or leave it unset" if schedule is not None else
                          "--alg/--alg-temp/--eps apply to Dream's schedule; add --schedule dream")
    unused = {"block_size", "policy", "gamma", "preset", "tau", "factor", "factor_compat", "tokens_per_step", "eta",
              "cache", "refresh_every", "sampler", "confidence", "stop_strings"}
    given = sorted(k for k in unused if options.get(k) not in (None, (), "none"))
    if options.get("eos_early_stop"):
        given.append("eos_early_stop")
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise UnmaskError(f"{flags} do(es) not apply to --schedule dream (one forward over the whole canvas per "
                          "step, Dream's own commit rule); drop them")
    return dream_compat.decode(bundle, prompts, **{k: options[k] for k in _DREAM_OPTIONS})


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

