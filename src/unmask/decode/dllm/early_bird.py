"""Early-Bird decoding of masked-diffusion LMs (EB-Decode, spec/early_bird.md §5–§6; arXiv
2609.16450 Alg. 5).

Each step is one bidirectional forward of the frozen base model. A row without an active block
selects one with the LBS router and the filters of :func:`unmask.decode.dllm.eb_select.select_block`
(size fallback, σ > 0.5, EOS removal, max-gap cut at g_max, min-tokens fallback); the block may be
non-contiguous and stays fixed until all its positions are committed. Inside the block the row
commits A = {i ∈ B ∩ M : κ^i ≥ τ or p_ψ^i > τ_ψ} (LPS router), or its argmax-κ position when A is
empty. ``lps=False`` drops the LPS term: the Fast-dLLM threshold rule inside B. The selection step
commits from the same forward's logits. Rows are independent: each has its own block, and only
rows without one run LBS.

Caches (§6, approximate): a row's selection step is a full forward that refreshes its own K/V
(our reading #13, per row); its window [lo, hi] (lo = min B, hi = max B) is then fixed until
its next selection: ``prefix`` keeps the K/V left of lo and feeds x[lo:] (block and suffix);
``dual`` also keeps the K/V right of hi and feeds x[lo:hi+1], holes included. The cache keeps the
whole canvas's K/V of the refresh and hides the window's stale ones with the attention mask,
since the window is known only after the refresh forward (:class:`~unmask.decode.dllm.cache.SlotCanvas`).
Every row refreshes on its own, so a batched run equals single runs with every cache; the loop
is :class:`~unmask.decode.dllm.early_bird_batch.EarlyBird`, the server's running batch too.
:class:`EarlyBirdOptions` are the knobs; :meth:`EarlyBirdOptions.resolve` turns them, once, into
the :class:`EarlyBirdConfig` (with its routers) the batch runs.

Stopping (§9): a row stops when a block of it resolves and its canvas holds a committed stop id
with every position before the first one committed (the text before it is then final); with
``eos_early_stop`` this is checked after every step and the tail is filled with that id.
The EOS set of the LBS filter is the decode's stop ids (reading #4). NFE and the router overhead
in ``stats.extra``: :func:`~unmask.decode.dllm.early_bird_batch.batch`.
This decoder runs on ``masked-diffusion`` models only (block-causal models, §7, are not wired).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from unmask.decode.dllm.cache import CACHE_MODES, check_fast_path
from unmask.decode.dllm.canvas import SamplerKnobs, check_mask_token
from unmask.decode.dllm.diffusion import batches_fit
from unmask.decode.dllm.eb_select import GAP_METRICS, POS_MODES
from unmask.decode.engine.knobs import CanvasKnobs
from unmask.decode.engine.registry import knob
from unmask.errors import UnmaskError, check_choice, check_int, is_int, is_number
from unmask.models.adapters import default_sampler
from unmask.routers.io import check_lbs_fits, load_router, load_routers, routers_dir
from unmask.routers.lbs import LBSRouter
from unmask.routers.lps import LPSRouter

DEFAULT_BLOCK_SIZE = 32  # L_B, base and fallback block (App. F)
DEFAULT_TAU = 0.9
DEFAULT_L_MIN = 8
DEFAULT_G_MAX = 5
CANVAS_HINT = "shorten the prompt or use a model with a longer window"


def check_max_new_tokens(n, L: int) -> None:
    """Raise the one-line UnmaskError unless 1 <= n <= L (the LBS router's gen length)."""
    if not is_int(n) or n < 1:
        raise UnmaskError(f"max_new_tokens must be an integer >= 1 (got {n!r})")
    if n > L:
        raise UnmaskError(f"max_new_tokens {n} exceeds the LBS router's gen length {L}; lower it or train LBS for a "
                          "longer gen length")


def _check_tau_psi(tau_psi) -> None:
    if tau_psi is not None and (not is_number(tau_psi) or not 0 < tau_psi < 1):
        raise UnmaskError(f"tau_psi must be in (0, 1) (got {tau_psi!r}); use lps=False (--no-lps) to turn the LPS "
                          "router off")


@dataclass(frozen=True)
class EarlyBirdConfig(SamplerKnobs):
    """The resolved, validated settings an Early-Bird batch runs (App. F defaults).

    gen_length: L (the LBS router's training length). block_size: L_B, the min-tokens fallback
    block. tau: confidence threshold τ. tau_psi: LPS threshold τ_ψ in (0, 1), None for LBS only.
    l_min: L_min. g_max: largest allowed gap. cache: none / prefix / dual. gap_metric: absolute or
    masked_rank. pos_mode: literal or rank (must match the LPS router). eos_early_stop: §9.
    sampler: llada or dream (how sampled tokens are drawn, diffusion.md §4). confidence: None
    (default) or "untempered", κ under softmax(logits) at every T, so T → 0 tends to T = 0 (float64
    with the llada sampler, as its reference); "tempered", Dream's κ under softmax(logits / T).
    lbs, lps: the routers (lps None: LBS only).
    """

    gen_length: int
    block_size: int = DEFAULT_BLOCK_SIZE
    tau: float = DEFAULT_TAU
    tau_psi: float | None = None
    l_min: int = DEFAULT_L_MIN
    g_max: int = DEFAULT_G_MAX
    cache: str = "none"
    gap_metric: str = "absolute"
    pos_mode: str = "literal"
    eos_early_stop: bool = False
    sampler: str = "llada"
    confidence: str | None = None
    lbs: object = field(default=None, compare=False, repr=False)
    lps: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        check_int(self.gen_length, 1, "gen length", "it is the LBS router's training length")
        check_int(self.block_size, 1, "block size (L_B)", "32 is the paper's fallback block")
        check_int(self.l_min, 1, "L_min", "the paper uses 8 (16 for LLaDA-1.5)")
        check_int(self.g_max, 1, "g_max", "the paper uses 5, and 1 for contiguous blocks")
        if not is_number(self.tau) or not 0 < self.tau <= 1:
            raise UnmaskError(f"tau must be in (0, 1] (got {self.tau!r}); the paper uses 0.9")
        _check_tau_psi(self.tau_psi)
        check_choice("cache", self.cache, CACHE_MODES)
        check_choice("gap metric", self.gap_metric, GAP_METRICS)
        check_choice("pos mode", self.pos_mode, POS_MODES)
        self.check_sampler()


def _resolve_routers(bundle, use_lps: bool, routers, lbs_router, lps_router, tau_psi):
    """(lbs, lps | None, τ_ψ | None, serving): given router objects first, the model's saved routers
    otherwise. ``serving`` is the configuration the saved LPS traces were collected under."""
    saved_tau, serving = None, {}
    if lbs_router is None:
        loaded = load_routers(bundle, routers=routers, lps=use_lps and lps_router is None)
        lbs_router, saved_tau = loaded.lbs, loaded.tau_psi
        if use_lps and lps_router is None:
            lps_router, serving = loaded.lps, dict(loaded.lps_info.get("serving") or {})
    else:
        check_lbs_fits({"config": lbs_router.config.to_dict()}, bundle)
        if use_lps and lps_router is None:
            where = routers_dir(bundle, routers)
            if where is None or not (where / "lps.json").is_file():
                raise UnmaskError(f"no LPS router for {bundle.name!r}; pass lps_router= and tau_psi=, train one with "
                                  f"`unmask train lps --model {bundle.name}`, or decode LBS-only with lps=False")
            lps_router, info = load_router(where, "lps", device=bundle.device)
            saved_tau, serving = info.get("tau_psi"), dict(info.get("serving") or {})
    if not use_lps:
        return lbs_router, None, None, {}
    tau = tau_psi if tau_psi is not None else saved_tau
    if tau is None:
        raise UnmaskError("the LPS router came without a threshold; pass tau_psi= (the paper's are 0.87-0.90)")
    return lbs_router, lps_router, tau, serving


def check_router_options(routers, lbs_router, lps_router) -> None:
    """Refuse a ``routers`` that is not a directory path and router objects of the wrong class
    before anything reads them (an int path or a str router raised TypeError / AttributeError)."""
    if routers is not None and not isinstance(routers, (str, os.PathLike)):
        raise UnmaskError(f"routers must be a directory path (got {routers!r}); pass the directory holding lbs.json "
                          "and lps.json, or leave it unset for the model's own MODEL_DIR/routers")
    for name, value, cls in (("lbs_router", lbs_router, LBSRouter), ("lps_router", lps_router, LPSRouter)):
        if value is not None and not isinstance(value, cls):
            kind = name.split("_")[0]
            raise UnmaskError(f"{name} must be an {cls.__name__} (got {type(value).__name__}); load one with "
                              f"unmask.routers.load_router(DIR, {kind!r})[0], or pass routers=DIR instead")


@dataclass(frozen=True)
class EarlyBirdOptions(CanvasKnobs):
    """Early-Bird's knobs (spec/early_bird.md §5): the canvas, the LBS block bounds and the LPS commit
    router; the routers come from the model directory unless given as objects."""

    block_size: int | None = knob("base and fallback block L_B (default 32)", low=1, short="-k")
    tau: float | None = knob("confidence threshold τ of the base commit rule (default 0.9)", low=0, high=1)
    lps: bool | None = knob("use the LPS commit router (default on)")
    tau_psi: float | None = knob("LPS commit threshold τ_ψ (default: the router's)", cli=False)
    l_min: int | None = knob("LBS: the shortest block (default 8)", low=1, cli=False)
    g_max: int | None = knob("LBS: the largest block growth (default 5)", low=1, cli=False)
    gap_metric: str | None = knob("LBS: the gap metric (default: the router's)", cli=False)
    pos_mode: str | None = knob("LBS: the position feature mode (default: the router's)", cli=False)
    routers: object = knob("a routers directory (default MODEL_DIR/routers)", cli=False)
    lbs_router: object = knob("an LBS router object instead of the directory's", cli=False)
    lps_router: object = knob("an LPS router object instead of the directory's", cli=False)

    def resolve(self, bundle, max_new_tokens: int | None = None, *, static: bool = False,
                compile: bool = False) -> EarlyBirdConfig:
        """The config (routers loaded: ``routers=DIR`` or the model's ``MODEL_DIR/routers``, unless
        router objects are given) of these options on ``bundle``. ``gen_length`` defaults to, and
        must equal, the LBS router's L; block_size, tau, l_min and g_max default to the
        configuration the saved LPS router was trained under, else to App. F (32, 0.9, 8, 5);
        pos_mode to the LPS router's; ``lps`` to True. ``max_new_tokens`` None skips its checks (a
        server's batch checks it per row). Raises UnmaskError for a model without a mask token,
        missing routers (saying how to train them), a ``routers`` that is not a path, router objects
        of the wrong class, an LBS router of another vocabulary or L, a bad value, or ``static`` /
        ``compile`` on a remote-code model."""
        check_mask_token(bundle, "early-bird")
        check_router_options(self.routers, self.lbs_router, self.lps_router)
        _check_tau_psi(self.tau_psi)
        for flag, value in (("lps", self.lps), ("eos_early_stop", self.eos_early_stop)):
            if value is not None and not isinstance(value, bool):
                raise UnmaskError(f"{flag} must be true or false (got {value!r})")
        check_fast_path(bundle, static, compile, "the early-bird decoder")
        use_lps = True if self.lps is None else self.lps
        lbs, lps, tau_psi, serving = _resolve_routers(bundle, use_lps, self.routers, self.lbs_router, self.lps_router,
                                                      self.tau_psi)
        L = lbs.config.gen_length
        if self.gen_length is not None and self.gen_length != L:
            raise UnmaskError(f"the LBS router works at gen length {L} only (E_pos has {L} rows), got "
                              f"{self.gen_length}; use --gen-length {L} or train LBS for {self.gen_length}")
        if max_new_tokens is not None:
            check_max_new_tokens(max_new_tokens, L)
        # Unset options: the serving configuration the LPS router was trained under, else App. F.
        defaults = {"block_size": DEFAULT_BLOCK_SIZE, "tau": DEFAULT_TAU, "l_min": DEFAULT_L_MIN,
                    "g_max": DEFAULT_G_MAX}
        defaults.update({k: serving[k] for k in defaults if k in serving})
        given = {k: getattr(self, k) for k in defaults if getattr(self, k) is not None}
        pos_mode = self.pos_mode if self.pos_mode is not None else lps.config.pos_mode if lps is not None else "literal"
        return EarlyBirdConfig(
            gen_length=L, **{**defaults, **given}, tau_psi=tau_psi,
            cache="none" if self.cache is None else str(self.cache),
            gap_metric="absolute" if self.gap_metric is None else self.gap_metric, pos_mode=pos_mode,
            eos_early_stop=bool(self.eos_early_stop), confidence=self.confidence, lbs=lbs, lps=lps,
            sampler=default_sampler(bundle) if self.sampler is None else self.sampler)

    def batch_key(self, bundle, max_new_tokens: int):
        """("early-bird", self), or None (per call) for a model whose rows cannot share a batch
        (:func:`~unmask.decode.dllm.diffusion.batches_fit`)."""
        return ("early-bird", self) if batches_fit(bundle) else None


__all__ = ["CANVAS_HINT", "EarlyBirdConfig", "EarlyBirdOptions", "check_max_new_tokens", "check_router_options"]
