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
(our reading #13, per row); its window [lo, hi] (b_lo = min B, b_hi = max B) is then fixed until
its next selection: ``prefix`` keeps the K/V left of lo and feeds x[lo:] (block and suffix);
``dual`` also keeps the K/V right of hi and feeds x[lo:hi+1], holes included. The cache keeps the
whole canvas's K/V of the refresh and hides the window's stale ones with the attention mask,
since the window is known only after the refresh forward (:class:`~unmask.decode.dllm.cache.SlotCanvas`).
Every row refreshes on its own, so a batched run equals single runs with every cache; the loop
is :class:`~unmask.decode.dllm.early_bird_batch.EarlyBird`, the server's running batch too.

Stopping (§9): a row stops when a block of it resolves and its canvas holds a committed stop id
with every position before the first one committed (the text before it is then final); with
``eos_early_stop`` this is checked after every step and the tail is filled with that id.
The EOS set of the LBS filter is the decode's stop ids (reading #4).

Statistics: NFE counts base-model forwards only (routers are not NFE, §10). ``stats.extra`` adds
the router overhead: ``lbs_seconds``, ``lps_seconds``, ``router_seconds``, ``forward_seconds``,
``step_seconds``, ``router_share`` = router / step time and ``router_vs_forward`` = router /
base-model forward time (the paper's "fraction of per-step backbone time").

Block-causal models (§7, g_max = 1 and ``eb_select.effective_l_min``) are a documented seam,
not wired here: this decoder runs on ``masked-diffusion`` models only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unmask.decode.dllm.canvas import check_canvas, check_mask_token, event_hook
from unmask.decode.dllm.cache import check_fast_path, prompt_width
from unmask.decode.dllm.eb_select import GAP_METRICS, POS_MODES
from unmask.decode.engine.running import drain, requests_for
from unmask.decode.engine.stats import DecodeOutput
from unmask.errors import UnmaskError, is_int, is_number
from unmask.models.adapters import SAMPLERS, default_sampler
from unmask.policies import CONFIDENCES, commit
from unmask.sampling import Sampling
from unmask.decode.engine.knobs import CanvasKnobs
from unmask.decode.engine.registry import knob

CACHE_MODES = ("none", "prefix", "dual")
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


def _int_at_least(value, low: int, what: str, hint: str) -> None:
    if not is_int(value) or value < low:
        raise UnmaskError(f"{what} must be an integer >= {low} (got {value!r}); {hint}")


@dataclass(frozen=True)
class EarlyBirdConfig:
    """Validated settings of one Early-Bird decode (App. F defaults).

    gen_length: L (the LBS router's training length). block_size: L_B, the min-tokens fallback
    block. tau: confidence threshold τ. tau_psi: LPS threshold τ_ψ in (0, 1), None for LBS only.
    l_min: L_min. g_max: largest allowed gap. cache: none / prefix / dual. gap_metric: absolute or
    masked_rank. pos_mode: literal or rank (must match the LPS router). eos_early_stop: §9.
    sampler: llada or dream (how sampled tokens are drawn, diffusion.md §4). confidence: None
    (default) or "untempered", κ under softmax(logits) at every T, so T → 0 tends to T = 0 (float64
    with the llada sampler, as its reference); "tempered", Dream's κ under softmax(logits / T).
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

    def __post_init__(self):
        _int_at_least(self.gen_length, 1, "gen length", "it is the LBS router's training length")
        _int_at_least(self.block_size, 1, "block size (L_B)", "32 is the paper's fallback block")
        _int_at_least(self.l_min, 1, "L_min", "the paper uses 8 (16 for LLaDA-1.5)")
        _int_at_least(self.g_max, 1, "g_max", "the paper uses 5, and 1 for contiguous blocks")
        if not is_number(self.tau) or not 0 < self.tau <= 1:
            raise UnmaskError(f"tau must be in (0, 1] (got {self.tau!r}); the paper uses 0.9")
        if self.tau_psi is not None and (not is_number(self.tau_psi) or not 0 < self.tau_psi < 1):
            raise UnmaskError(f"tau_psi must be in (0, 1) (got {self.tau_psi!r}); use lps=False (--no-lps) to turn "
                              "the LPS router off")
        if self.cache not in CACHE_MODES:
            raise UnmaskError(f"unknown cache {self.cache!r}; choose one of: {', '.join(CACHE_MODES)}")
        if self.gap_metric not in GAP_METRICS:
            raise UnmaskError(f"unknown gap metric {self.gap_metric!r}; choose one of: {', '.join(GAP_METRICS)}")
        if self.pos_mode not in POS_MODES:
            raise UnmaskError(f"unknown pos mode {self.pos_mode!r}; choose one of: {', '.join(POS_MODES)}")
        if self.sampler not in SAMPLERS:
            raise UnmaskError(f"unknown sampler {self.sampler!r}; choose one of: {', '.join(SAMPLERS)}")
        if self.confidence is not None and self.confidence not in CONFIDENCES:
            raise UnmaskError(f"unknown confidence {self.confidence!r}; choose one of: {', '.join(CONFIDENCES)}")

    @property
    def commit_confidence(self) -> str | None:
        """``confidence`` as :func:`unmask.policies.commit` takes it (float64 κ with the llada sampler)."""
        return "untempered" if self.confidence is None and self.sampler == "llada" else self.confidence


def _commit_confidence(logits, tokens, cand, confidence: str | None, temperature: float, lo: int,
                       L: int) -> torch.Tensor:
    """κ of the chosen tokens as the diffusion threshold rule computes it (diffusion.md §4): the
    untempered softmax in float64 ("untempered", LLaDA's) or float32 (None), or the tempered
    probability ("tempered", Dream's).

    logits (B, n, V), tokens and cand (B, n) over generated positions [lo, lo + n). Computed at the
    candidates only; returns (B, L) float64, 0 elsewhere."""
    r, c = torch.nonzero(cand, as_tuple=True)  # (k,) each
    z, t = logits[r, c], tokens[r, c]  # (k, V), (k,)
    if confidence == "untempered":
        k = F.softmax(z.double(), dim=-1).gather(-1, t[:, None])[:, 0]
    else:
        z = z.float() / temperature if temperature > 0 and confidence == "tempered" else z.float()
        k = F.log_softmax(z, dim=-1).gather(-1, t[:, None])[:, 0].exp().double()
    kappa = torch.zeros(cand.shape[0], L, dtype=torch.float64, device=logits.device)
    kappa[r, c + lo] = k
    return kappa


def _draw_rows(logits, cand, top1, policy, sampling: Sampling, gens, confidence, draw, draws) -> torch.Tensor:
    """Sampled tokens (B, n) at each row's candidates, drawn with that row's generator over its
    candidates only, so the draws do not depend on the batch's union window (batch == single
    runs); elsewhere the argmax ``top1``. ``draws``: the rows with candidates (host-known)."""
    tokens = top1.clone()
    for r in draws:
        where = torch.nonzero(cand[r]).flatten()  # (k,)
        sub = logits[r: r + 1, where]  # (1, k, V)
        _, t = commit(sub, torch.ones(1, len(where), dtype=torch.bool, device=sub.device), policy,
                      temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                      generator=gens[r], confidence=confidence, sampling=draw)
        tokens[r, where] = t[0]
    return tokens


def _sync(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _resolve_routers(bundle, use_lps: bool, routers, lbs_router, lps_router, tau_psi):
    """(lbs, lps | None, τ_ψ | None, serving): given router objects first, the model's saved routers
    otherwise. ``serving`` is the configuration the saved LPS traces were collected under."""
    from unmask.routers.io import check_lbs_fits, load_router, load_routers, routers_dir

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
    import os

    from unmask.routers.lbs import LBSRouter
    from unmask.routers.lps import LPSRouter

    if routers is not None and not isinstance(routers, (str, os.PathLike)):
        raise UnmaskError(f"routers must be a directory path (got {routers!r}); pass the directory holding lbs.json "
                          "and lps.json, or leave it unset for the model's own MODEL_DIR/routers")
    for name, value, cls in (("lbs_router", lbs_router, LBSRouter), ("lps_router", lps_router, LPSRouter)):
        if value is not None and not isinstance(value, cls):
            kind = name.split("_")[0]
            raise UnmaskError(f"{name} must be an {cls.__name__} (got {type(value).__name__}); load one with "
                              f"unmask.routers.load_router(DIR, {kind!r})[0], or pass routers=DIR instead")


def configure(bundle, *, max_new_tokens: int | None = None, gen_length=None, block_size=None, tau=None,
              tau_psi=None, l_min=None, g_max=None, lps=None, cache=None, gap_metric=None, pos_mode=None,
              eos_early_stop=False, sampler=None, confidence=None, routers=None, lbs_router=None, lps_router=None, static=False,
              compile=False) -> tuple[EarlyBirdConfig, object, object]:
    """Validate :func:`decode`'s options and resolve its routers: (cfg, LBS router, LPS router | None).
    ``max_new_tokens`` None skips its checks (a continuous batch checks it per job). Raises the
    UnmaskErrors :func:`decode` documents for these options."""
    check_mask_token(bundle, "early-bird")
    check_router_options(routers, lbs_router, lps_router)
    if tau_psi is not None and (not is_number(tau_psi) or not 0 < tau_psi < 1):
        raise UnmaskError(f"tau_psi must be in (0, 1) (got {tau_psi!r}); use lps=False (--no-lps) to turn the LPS "
                          "router off")
    for flag, value in (("lps", lps), ("eos_early_stop", eos_early_stop)):
        if value is not None and not isinstance(value, bool):
            raise UnmaskError(f"{flag} must be true or false (got {value!r})")
    check_fast_path(bundle, static, compile, "the early-bird decoder")
    use_lps = True if lps is None else lps
    lbs, lps_net, tau_psi, serving = _resolve_routers(bundle, use_lps, routers, lbs_router, lps_router, tau_psi)
    L = lbs.config.gen_length
    if gen_length is not None and gen_length != L:
        raise UnmaskError(f"the LBS router works at gen length {L} only (E_pos has {L} rows), got {gen_length}; "
                          f"use --gen-length {L} or train LBS for {gen_length}")
    if max_new_tokens is not None:
        check_max_new_tokens(max_new_tokens, L)
    # Unset options: the serving configuration the LPS router was trained under, else App. F.
    defaults = {"block_size": DEFAULT_BLOCK_SIZE, "tau": DEFAULT_TAU, "l_min": DEFAULT_L_MIN, "g_max": DEFAULT_G_MAX}
    defaults.update({k: serving[k] for k in defaults if k in serving})
    cfg = EarlyBirdConfig(
        gen_length=L, block_size=defaults["block_size"] if block_size is None else block_size,
        tau=defaults["tau"] if tau is None else tau, tau_psi=tau_psi,
        l_min=defaults["l_min"] if l_min is None else l_min,
        g_max=defaults["g_max"] if g_max is None else g_max, cache="none" if cache is None else str(cache),
        gap_metric="absolute" if gap_metric is None else gap_metric,
        pos_mode=pos_mode if pos_mode is not None else lps_net.config.pos_mode if lps_net is not None else "literal",
        eos_early_stop=bool(eos_early_stop), sampler=default_sampler(bundle) if sampler is None else sampler,
        confidence=confidence)
    return cfg, lbs, lps_net


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (), gen_length: int | None = None,
           block_size: int | None = None, tau: float | None = None, tau_psi: float | None = None,
           l_min: int | None = None, g_max: int | None = None, lps: bool | None = None, cache: str | None = None,
           gap_metric: str | None = None, pos_mode: str | None = None, eos_early_stop: bool = False,
           sampler: str | None = None, confidence: str | None = None, routers=None, lbs_router=None,
           lps_router=None, on_step=None,
           on_forward=None, compile: bool = False, static: bool = False) -> DecodeOutput:
    """Early-Bird decoding of a batch (spec/early_bird.md §5, Alg. 5).

    prompts: token ids per row (left-padded; positions count real tokens only). Routers: the
    model's ``MODEL_DIR/routers`` (or ``routers=DIR``), unless ``lbs_router`` / ``lps_router``
    objects are given. ``lps`` (default True) adds the LPS term; ``tau_psi`` overrides the
    router's saved threshold. ``gen_length`` defaults to, and must equal, the LBS router's L;
    ``max_new_tokens`` (≤ L) cuts the reported tokens, and a row stops once they are all committed
    (the tokens are those of the full-length run; only the forwards spent beyond them are saved). block_size is L_B; block_size, tau, l_min
    and g_max default to the configuration the saved LPS router was trained under, else to App. F
    (32, 0.9, 8, 5). pos_mode defaults to the LPS router's.

    Hooks: ``on_step(event)`` (:mod:`unmask.trace`) once per row that had masks, with ``block``
    (the row's block counter) and, on selection steps, ``selected`` (the block's positions);
    ``on_forward(state)`` (trace collection, tests) after every commit with the (B, L) tensors
    ``masked`` (before), ``block``, ``cand``, ``features`` (B, L, 5), ``top1``, ``kappa``,
    ``p_lps``, ``chosen``, ``tokens``, ``canvas`` (after), ``selected`` / ``path`` (B,) and ``ids``
    (B ints: each tensor row's prompt index, -1 for a free slot; B is the running batch's slot
    count, which shrinks as rows finish, so read a prompt's rows through ``ids``).

    Returns DecodeOutput; stats.extra: decoder settings, ``accepts`` (histogram of per-row commits
    per forward), ``n_committed``, ``blocks`` (selections), ``mean_block``, ``paths`` (selection
    rule counts), ``lps_only`` (commits only LPS allowed), ``refreshes`` (cache), router timing,
    ``compiled``, ``static_cache`` (positions, on a static cache) and ``row_extra``.

    Fast path: ``static=True`` runs the forwards on a preallocated ``StaticKV`` with bounded
    shapes (what ``compile`` runs, eagerly; for tests and debugging); ``compile=True`` also runs
    them through ``torch.compile`` (inductor on CPU, CUDA graphs on CUDA), one graph per shape
    (see :class:`~unmask.decode.dllm.cache.SlotCanvas`). Routers and the commit rule stay eager. Same tokens and NFE as the
    eager run up to float rounding.

    Raises UnmaskError for a model without a mask token, missing routers (saying how to train
    them), a ``routers`` that is not a path, router objects of the wrong class, an LBS router of
    another vocabulary or L, g_max < 1, L_min < 1, τ_ψ outside (0, 1), an unknown cache / gap
    metric / pos mode, a canvas longer than the context window, or ``compile`` / ``static`` on a
    remote-code model.
    """
    cfg, lbs, lps_net = configure(bundle, max_new_tokens=max_new_tokens, gen_length=gen_length,
                                  block_size=block_size, tau=tau, tau_psi=tau_psi, l_min=l_min, g_max=g_max, lps=lps,
                                  cache=cache, gap_metric=gap_metric, pos_mode=pos_mode,
                                  eos_early_stop=eos_early_stop, sampler=sampler, confidence=confidence,
                                  routers=routers,
                                  lbs_router=lbs_router, lps_router=lps_router, static=static, compile=compile)
    L = cfg.gen_length
    for p in prompts:  # before the canvases are allocated
        check_canvas(bundle, len(p), L, CANVAS_HINT)
    from unmask.decode.dllm.early_bird_batch import EarlyBird  # it builds on this module's config and pieces

    width = prompt_width(max(map(len, prompts)), L, bundle.context_length, static or compile) + L  # fast path: a bucket
    requests = requests_for(prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=stop_strings,
                            device=bundle.device)
    modes = [(r, r.training) for r in (lbs, lps_net) if r is not None]
    for r, _ in modes:
        r.eval()
    try:
        return drain(lambda capacity: EarlyBird(bundle, cfg, lbs, lps_net, static=static, compile=compile,
                                                capacity=capacity, on_step=event_hook(on_step),
                                                stop_token_ids=stop_token_ids, width=width, lockstep=True,
                                                on_forward=on_forward), requests)
    finally:
        for r, was in modes:
            r.train(was)


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

