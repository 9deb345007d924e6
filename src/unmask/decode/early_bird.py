"""Early-Bird decoding of masked-diffusion LMs (EB-Decode, spec/early_bird.md §5–§6; arXiv
2609.16450 Alg. 5).

Each step is one bidirectional forward of the frozen base model. A row without an active block
selects one with the LBS router and the filters of :func:`unmask.decode.eb_select.select_block`
(size fallback, σ > 0.5, EOS removal, max-gap cut at g_max, min-tokens fallback); the block may be
non-contiguous and stays fixed until all its positions are committed. Inside the block the row
commits A = {i ∈ B ∩ M : κ^i ≥ τ or p_ψ^i > τ_ψ} (LPS router), or its argmax-κ position when A is
empty. ``lps=False`` drops the LPS term: the Fast-dLLM threshold rule inside B. The selection step
commits from the same forward's logits. Rows are independent: each has its own block, and only
rows without one run LBS.

Caches (§6, approximate): a step where any row selects is a full forward that refreshes every
K/V (our reading #13). The union window [lo, hi] of the rows' blocks (one row: b_lo = min B,
b_hi = max B) is then fixed until the next refresh: ``prefix`` keeps the K/V left of lo and feeds
x[lo:] (block and suffix); ``dual`` also keeps the K/V right of hi and feeds x[lo:hi+1], holes
included. The dual cache holds the whole canvas in natural order and hides the window's stale
K/V with the attention mask, since the window is known only after the refresh forward; every
step's fresh K/V are appended and ``crop``-ped again (supported HF cache calls only). With a batch
a refresh serves every row, so a cached batched run is not identical to single runs (no-cache
runs are).

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

import math
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unmask.decode import dllm_cache
from unmask.decode.diffusion import early_stop, hit_stop_string, until_stop
from unmask.decode.dllm_cache import (BUCKET_STEP, bucket, canvas_call, check_fast_path, kv_forward, left_pad_to,
                                      prompt_width)
from unmask.decode.kv import canvas_forward, make_kv
from unmask.decode.eb_select import (GAP_METRICS, PATH_NAMES, POS_MODES, lps_features, pack_rows, select_block,
                                     union_accept)
from unmask.decode.stats import DecodeOutput, DecodeStats, check_nfe, stop_flags
from unmask.errors import UnmaskError
from unmask.models.adapters import SAMPLERS, bidirectional_forward, default_sampler, realign, supports_cache
from unmask.policies import CONFIDENCES, Threshold, commit, token_stats
from unmask.sampling import Sampling
from unmask.trace import step_event

CACHE_MODES = ("none", "prefix", "dual")
DEFAULT_BLOCK_SIZE = 32  # L_B, base and fallback block (App. F)
DEFAULT_TAU = 0.9
DEFAULT_L_MIN = 8
DEFAULT_G_MAX = 5


def _int_at_least(value, low: int, what: str, hint: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
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
        if not isinstance(self.tau, (int, float)) or isinstance(self.tau, bool) or not 0 < self.tau <= 1:
            raise UnmaskError(f"tau must be in (0, 1] (got {self.tau!r}); the paper uses 0.9")
        if self.tau_psi is not None and (not isinstance(self.tau_psi, (int, float)) or isinstance(self.tau_psi, bool)
                                         or not 0 < self.tau_psi < 1):
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


class _Forwards:
    """The base-model forwards of one decode; every call returns realigned logits (B, n, V) that
    score generated positions [lo, hi). ``full()`` refreshes the cache; ``set_window(lo, hi)``
    keeps the K/V outside the union window (see the module doc); ``window(lo, hi)`` feeds it.

    The K/V live in a :mod:`unmask.decode.kv` cache: the eager ``DynamicKV``, or with ``static`` /
    ``compile`` a preallocated ``StaticKV`` of T + BUCKET_STEP positions, where the dual cache
    slides the suffix's K/V over the window's once it is selected (a copy per selection instead
    of attending to T hidden keys at every step). On the static path every forward has a
    bounded shape: the refresh (eager, ``dllm_cache.COMPILE_REFRESH``) and the no-cache step are
    the whole canvas (the no-cache step scores all L rows and slices the window), and a cached
    window step, whose length depends on the selected blocks, is padded to
    :func:`unmask.decode.dllm_cache.bucket` (at most 6 + L / 64 shapes)."""

    def __init__(self, bundle, mode: str, ids, pos, valid, P: int, L: int, *, static: bool = False,
                 compile: bool = False):
        if mode != "none" and not supports_cache(bundle):
            raise UnmaskError(f"cache {mode!r} needs a transformers-native model; this checkpoint runs its own "
                              "model code, so use --cache none")
        self.bundle, self.mode, self.shift = bundle, mode, bundle.logit_shift
        self.ids, self.pos, self.valid, self.P, self.L = ids, pos, valid, P, L
        self.T = ids.shape[1]
        self.kept_valid, self.span = None, None  # span: (w0, w1, glo, ghi)
        self.refreshes = 0
        self.q_max = L + self.shift  # the longest window: the whole generation region
        self.kv = self.canvas = None
        if mode != "none":
            # a padded window step writes fewer than BUCKET_STEP positions past the canvas end
            self.kv = make_kv(bundle.model, batch=ids.shape[0], capacity=self.T + BUCKET_STEP, static=static,
                              compile=compile)
        elif static or compile:
            self.canvas = canvas_forward(bundle.model, compile)

    @property
    def static_capacity(self) -> int | None:
        return self.kv.capacity if self.kv is not None and self.kv.static else None

    def _scored(self, raw):
        return realign(raw, self.shift)[:, self.shift:]  # (B, n, V)

    def full(self) -> torch.Tensor:
        rows = (self.P - self.shift, self.P + self.L)
        if self.mode == "none":
            raw = canvas_call(self.bundle, self.canvas, self.ids, self.pos, self.valid, rows)  # (B, shift + L, V)
            return self._scored(raw)
        self.kv.reset()
        self.span = None
        self.refreshes += 1
        raw = kv_forward(self.bundle, self.kv, self.ids, self.pos, self.valid, rows,
                         compiled=dllm_cache.COMPILE_REFRESH)  # (B, shift + L, V)
        return self._scored(raw)

    def set_window(self, lo: int, hi: int) -> None:
        if self.mode == "none":
            return
        w0 = self.P + lo - self.shift
        w1 = self.P + hi if self.mode == "dual" else self.T
        if self.mode == "prefix":
            self.kv.crop(self.T - w0)  # keep the K/V of [0, w0)
            self.kept_valid = self.valid[:, :w0]  # (B, w0)
        elif self.kv.static:
            # Slide the suffix's K/V left over the window's stale ones (keys carry their RoPE
            # positions, and bidirectional attention ignores key order): the cache then holds
            # [prefix | suffix] and each step's window K/V go after them, within T + BUCKET_STEP.
            n = w1 - w0
            for keys, values in self.kv.layers():  # views of the static cache, (B, H, T, D) each
                keys[:, :, w0: self.T - n] = keys[:, :, w1:].clone()
                values[:, :, w0: self.T - n] = values[:, :, w1:].clone()
            self.kv.crop(n)
            self.kept_valid = torch.cat([self.valid[:, :w0], self.valid[:, w1:]], dim=1)  # (B, T - n)
        else:
            kept = self.valid.clone()  # (B, T): the cache keeps all T keys ...
            kept[:, w0:w1] = False  # ... but the window's stale ones are hidden
            self.kept_valid = kept
        self.span = (w0, w1, lo, hi)

    def window(self, lo: int, hi: int) -> torch.Tensor:
        a, b = self.P + lo - self.shift, self.P + hi
        if self.mode == "none":
            if self.canvas is not None:  # one shape: score the whole generation region, keep the window
                return self.full()[:, lo:hi]  # (B, hi - lo, V)
            raw = bidirectional_forward(self.bundle, self.ids, position_ids=self.pos, key_valid=self.valid,
                                        rows=(a, b))  # (B, b - a, V)
            return self._scored(raw)
        w0, w1, _, _ = self.span
        if not (w0 <= a and b <= w1):
            raise RuntimeError(f"rows [{a}, {b}) outside the cached window [{w0}, {w1})")
        win = slice(w0, w1)
        key_valid = torch.cat([self.kept_valid, self.valid[:, win]], dim=1)  # (B, kept + n)
        pad_to = bucket(w1 - w0, self.q_max) if self.kv.static else w1 - w0
        raw = kv_forward(self.bundle, self.kv, self.ids[:, win], self.pos[:, win], key_valid, (a - w0, b - w0),
                         pad_to=pad_to)  # (B, b - a, V)
        self.kv.crop(pad_to)  # drop this step's K/V again
        return self._scored(raw)


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


def _draw_rows(logits, cand, top1, policy, sampling: Sampling, gens, confidence, draw) -> torch.Tensor:
    """Sampled tokens (B, n) at each row's candidates, drawn with that row's generator over its
    candidates only, so the draws do not depend on the batch's union window (batch == single
    runs); elsewhere the argmax ``top1``."""
    tokens = top1.clone()
    for r in torch.nonzero(cand.any(dim=1)).flatten().tolist():
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


def configure(bundle, *, max_new_tokens: int | None = None, gen_length=None, block_size=None, tau=None,
              tau_psi=None, l_min=None, g_max=None, lps=None, cache=None, gap_metric=None, pos_mode=None,
              eos_early_stop=False, sampler=None, confidence=None, routers=None, lbs_router=None, lps_router=None, static=False,
              compile=False) -> tuple[EarlyBirdConfig, object, object]:
    """Validate :func:`decode`'s options and resolve its routers: (cfg, LBS router, LPS router | None).
    ``max_new_tokens`` None skips its checks (a continuous batch checks it per job). Raises the
    UnmaskErrors :func:`decode` documents for these options."""
    if bundle.mask_token_id is None:
        raise UnmaskError("the early-bird decoder needs a masked-diffusion model with a mask token; "
                          "load it with mask_token_id=ID or name it in unmask_config.json")
    if tau_psi is not None and (not isinstance(tau_psi, (int, float)) or not 0 < tau_psi < 1):
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
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens):
        raise UnmaskError(f"max_new_tokens must be an integer >= 1 (got {max_new_tokens!r})")
    if max_new_tokens is not None and max_new_tokens > L:
        raise UnmaskError(f"max_new_tokens {max_new_tokens} exceeds the LBS router's gen length {L}; lower it "
                          f"or train LBS for a longer gen length")
    # Unset options: the serving configuration the LPS router was trained under, else App. F.
    defaults = {"block_size": DEFAULT_BLOCK_SIZE, "tau": DEFAULT_TAU, "l_min": DEFAULT_L_MIN, "g_max": DEFAULT_G_MAX}
    defaults.update({k: serving[k] for k in defaults if k in serving})
    cfg = EarlyBirdConfig(
        gen_length=L, block_size=defaults["block_size"] if block_size is None else block_size,
        tau=defaults["tau"] if tau is None else tau, tau_psi=tau_psi,
        l_min=defaults["l_min"] if l_min is None else l_min,
        g_max=defaults["g_max"] if g_max is None else g_max, cache="none" if cache is None else str(cache),
        gap_metric=gap_metric or "absolute",
        pos_mode=pos_mode or (lps_net.config.pos_mode if lps_net is not None else "literal"),
        eos_early_stop=bool(eos_early_stop), sampler=sampler or default_sampler(bundle),
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
    ``p_lps``, ``chosen``, ``tokens``, ``canvas`` (after) and ``selected`` / ``path`` (B,).

    Returns DecodeOutput; stats.extra: decoder settings, ``accepts`` (histogram of per-row commits
    per forward), ``n_committed``, ``blocks`` (selections), ``mean_block``, ``paths`` (selection
    rule counts), ``lps_only`` (commits only LPS allowed), ``refreshes`` (cache), router timing,
    ``compiled``, ``static_cache`` (positions, on a static cache) and ``row_extra``.

    Fast path: ``static=True`` runs the forwards on a preallocated ``StaticKV`` with bounded
    shapes (what ``compile`` runs, eagerly; for tests and debugging); ``compile=True`` also runs
    them through ``torch.compile`` (inductor on CPU, CUDA graphs on CUDA), one graph per shape
    (see :class:`_Forwards`). Routers and the commit rule stay eager. Same tokens and NFE as the
    eager run up to float rounding.

    Raises UnmaskError for a model without a mask token, missing routers (saying how to train
    them), an LBS router of another vocabulary or L, g_max < 1, L_min < 1, τ_ψ outside (0, 1),
    an unknown cache / gap metric / pos mode, a canvas longer than the context window, or
    ``compile`` / ``static`` on a remote-code model.
    """
    cfg, lbs, lps_net = configure(bundle, max_new_tokens=max_new_tokens, gen_length=gen_length,
                                  block_size=block_size, tau=tau, tau_psi=tau_psi, l_min=l_min, g_max=g_max, lps=lps,
                                  cache=cache, gap_metric=gap_metric, pos_mode=pos_mode,
                                  eos_early_stop=eos_early_stop, sampler=sampler, confidence=confidence,
                                  routers=routers,
                                  lbs_router=lbs_router, lps_router=lps_router, static=static, compile=compile)
    L = cfg.gen_length
    report = max_new_tokens  # ≤ L; a row stops once its first report tokens are committed
    if any(len(p) == 0 for p in prompts):
        raise UnmaskError("every prompt needs at least one token (a Dream-style model scores position i from i-1)")
    shift, mask_id, device = bundle.logit_shift, bundle.mask_token_id, bundle.device
    P = max(len(p) for p in prompts)
    if P + L > bundle.context_length:
        raise UnmaskError(f"prompt ({P} tokens) + gen length {L} exceeds the context window of "
                          f"{bundle.context_length}; shorten the prompt or use a model with a longer window")
    modes = [(r, r.training) for r in (lbs, lps_net) if r is not None]
    for r, _ in modes:
        r.eval()
    try:
        return _run(bundle, prompts, cfg, lbs, lps_net, sampling, stop_token_ids, stop_strings, P, L, report,
                    shift, mask_id, device, on_step, on_forward, static, compile)
    finally:
        for r, was in modes:
            r.train(was)


def _run(bundle, prompts, cfg: EarlyBirdConfig, lbs, lps_net, sampling, stop_token_ids, stop_strings, P, L, report,
         shift, mask_id, device, on_step, on_forward, static=False, compile=False) -> DecodeOutput:
    t_start = _sync(device)
    P = prompt_width(P, L, bundle.context_length, static or compile)  # the fast path pads to a bucket
    ids_p, valid_p, pos_p = left_pad_to(prompts, bundle.pad_token_id, device, P)  # (B, P) each
    B = ids_p.shape[0]
    row_len = valid_p.sum(dim=1)  # (B,)
    ids = torch.cat([ids_p, torch.full((B, L), mask_id, dtype=torch.long, device=device)], dim=1)  # (B, T)
    pos = torch.cat([pos_p, row_len[:, None] + torch.arange(L, device=device)], dim=1)  # (B, T)
    valid = torch.cat([valid_p, torch.ones(B, L, dtype=torch.bool, device=device)], dim=1)  # (B, T)
    run = _Forwards(bundle, cfg.cache, ids, pos, valid, P, L, static=static, compile=compile)
    gen = ids[:, P:]  # (B, L) view: commits write through it

    stops_list = sorted(set(stop_token_ids))
    stops = torch.tensor(stops_list or [-1], device=device)
    suppress = list(bundle.suppress_ids)
    embed = bundle.model.get_input_embeddings()
    gens = sampling.row_generators(prompts, device)  # one per row (None when greedy)
    confidence, draw = cfg.commit_confidence, ("gumbel" if cfg.sampler == "llada" else "categorical")
    threshold = Threshold(cfg.tau)

    block = torch.zeros(B, L, dtype=torch.bool, device=device)  # active block per row, as selected
    block_no = torch.full((B,), -1, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    nfe, nfe_rows = 0, torch.zeros(B, dtype=torch.long, device=device)
    commits: list[list[int]] = [[] for _ in range(B)]
    histogram: Counter = Counter()
    paths: Counter = Counter()
    n_blocks, block_total, lps_only = 0, 0, 0
    t_lbs = t_lps = t_fwd = t_steps = 0.0
    while True:
        masked = (gen == mask_id) & ~done[:, None]  # (B, L)
        if not bool(masked.any()):
            break
        t0 = _sync(device)
        select = masked.any(dim=1) & ~(block & masked).any(dim=1)  # (B,) rows without an active block
        if bool(select.any()):
            lo, hi = 0, L
            logits = run.full()  # (B, L, V)
        else:
            live = (block & masked).any(dim=0)  # (L,) union of the active blocks
            if cfg.cache == "none":
                where = torch.nonzero(live).flatten()
                lo, hi = int(where[0]), int(where[-1]) + 1
            else:
                lo, hi = run.span[2], run.span[3]
            logits = run.window(lo, hi)  # (B, hi - lo, V)
        if suppress:
            logits = logits.clone()
            logits[..., suppress] = float("-inf")
        t_fwd += _sync(device) - t0

        st = token_stats(logits)  # (B, hi - lo) each, T = 0: the router features
        if hi - lo == L:
            top1, conf, ent, margin = st.top1, st.confidence, st.entropy, st.margin
        else:  # scatter the window into (B, L) tensors over the generation region
            top1, conf, ent, margin = (torch.zeros(B, L, dtype=x.dtype, device=device) for x in st[:4])
            top1[:, lo:hi], conf[:, lo:hi], ent[:, lo:hi], margin[:, lo:hi] = st
        norm_ent = ent / math.log(logits.shape[-1])  # (B, L) H / log|V|
        t1 = _sync(device)  # the statistics above are what any commit rule computes: not router time

        path = torch.full((B,), -1, dtype=torch.long, device=device)
        if bool(select.any()):
            rows = torch.nonzero(select).flatten()
            p = torch.sigmoid(lbs(norm_ent[rows], embed(top1[rows]), masked[rows]))  # (b, L)
            new, how = select_block(p, masked[rows], top1[rows], eos_ids=stops_list, l_min=cfg.l_min,
                                    fallback_block=cfg.block_size, g_max=cfg.g_max, gap_metric=cfg.gap_metric)
            block[rows], path[rows] = new, how
            block_no[rows] += 1
            n_blocks += len(rows)
            block_total += int(new.sum())
            paths.update(PATH_NAMES[c] for c in how.tolist())
        t2 = _sync(device)
        t_lbs += t2 - t1

        cand = block & masked  # (B, L) B ∩ M
        cand_w = cand[:, lo:hi]  # (B, hi - lo)
        tok_w = st.top1 if gens is None else _draw_rows(logits, cand_w, st.top1, threshold, sampling, gens,
                                                        confidence, draw)
        tokens = torch.zeros(B, L, dtype=torch.long, device=device)
        tokens[:, lo:hi] = tok_w
        kappa = _commit_confidence(logits, tok_w, cand_w, cfg.commit_confidence, sampling.temperature, lo, L)  # (B, L)
        t3 = _sync(device)

        feats = p_lps = None
        if lps_net is not None or on_forward is not None:
            feats = lps_features(conf, norm_ent, margin, block, masked, cfg.pos_mode)  # (B, L, 5)
        if lps_net is not None:
            p_lps = torch.zeros(B, L, device=device)
            # LPS cannot change A for a row whose candidates all pass κ ≥ τ or that has a single
            # candidate (committed anyway, by the anti-stall rule): those rows skip the router.
            open_rows = (cand.sum(dim=1) >= 2) & (cand & (kappa < cfg.tau)).any(dim=1)  # (B,)
            rows = torch.nonzero(open_rows).flatten()
            if len(rows):
                index, ok = pack_rows(cand[rows])  # (b, N) each
                x = feats[rows].gather(1, index[..., None].expand(-1, -1, feats.shape[-1]))  # (b, N, 5)
                p = torch.sigmoid(lps_net(x, ok))  # (b, N)
                p_lps[rows] = torch.zeros(len(rows), L, device=device).scatter(1, index, torch.where(ok, p, 0.0))
        t4 = _sync(device)
        t_lps += t4 - t3

        chosen = union_accept(kappa, p_lps, cand, cfg.tau, cfg.tau_psi if cfg.tau_psi is not None else 1.0)
        if p_lps is not None:
            lps_only += int((chosen & (kappa < cfg.tau) & (p_lps > cfg.tau_psi)).sum())
        gen.copy_(torch.where(chosen, tokens, gen))
        had = masked.any(dim=1)  # (B,)
        resolved = had & ~(block & (gen == mask_id)).any(dim=1)  # (B,) blocks finished by this step
        if cfg.eos_early_stop:
            done |= early_stop(gen, mask_id, stops) & had
        elif bool(resolved.any()):
            done |= early_stop(gen.clone(), mask_id, stops) & resolved  # check only: no fill
        if stop_strings and bool(resolved.any()):
            done |= hit_stop_string(bundle, prompts, gen, mask_id, stop_strings) & resolved
        if report < L:  # LBS fixes L; positions from `report` on are never reported, so stop once the rest is in
            done |= had & ~(gen[:, :report] == mask_id).any(dim=1)
        if cfg.cache != "none" and bool(select.any()):
            # Cache at the blocks' boundaries as selected (min B .. max B), not at what is left
            # of them: positions committed by this step must be re-fed, their cached K/V are stale.
            alive = (block & (gen == mask_id)).any(dim=1) & ~done  # (B,)
            if bool(alive.any()):
                where = torch.nonzero(block[alive].any(dim=0)).flatten()
                run.set_window(int(where[0]), int(where[-1]) + 1)
        t_steps += _sync(device) - t0

        nfe_rows += had.long()
        counts = chosen.sum(dim=1).tolist()  # (B,) one transfer per step
        for r in torch.nonzero(had).flatten().tolist():
            count = counts[r]
            commits[r].append(count)
            histogram[count] += 1
            if on_step is not None:
                extra = {"block": int(block_no[r])}
                if bool(select[r]):
                    extra["selected"] = torch.nonzero(block[r]).flatten().tolist()
                on_step(step_event(nfe, r, chosen[r], tokens[r], 0, gen[r], mask_id, **extra))
        if on_forward is not None:
            on_forward({"nfe": nfe, "masked": masked, "block": block.clone(), "cand": cand, "features": feats,
                        "top1": top1, "kappa": kappa, "p_lps": p_lps, "chosen": chosen, "tokens": tokens,
                        "canvas": gen.clone(), "selected": select, "path": path, "window": (lo, hi)})
        nfe += 1
        check_nfe(nfe, 2 * L, "early-bird")  # ≥ 1 commit per forward; L blocks at most (size 1)

    full = gen[:, :report].tolist()
    tokens_out = [until_stop(full[r], set(stops_list) | {mask_id}) for r in range(B)]
    seconds = _sync(device) - t_start
    router = t_lbs + t_lps
    row_extra = [{"decoder": "early-bird", "lps": lps_net is not None, "cache": cfg.cache, "steps": int(nfe_rows[r]),
                  "blocks": int(block_no[r]) + 1, "commits": commits[r]} for r in range(B)]
    extra = {"lps": lps_net is not None, "cache": cfg.cache, "gen_length": L, "block_size": cfg.block_size,
             "tau": cfg.tau, "tau_psi": cfg.tau_psi, "l_min": cfg.l_min, "g_max": cfg.g_max,
             "gap_metric": cfg.gap_metric, "pos_mode": cfg.pos_mode, "sampler": cfg.sampler, "confidence": cfg.confidence or "untempered",
             "accepts": dict(sorted(histogram.items())), "n_committed": (gen != mask_id).sum(dim=1).tolist(),
             "blocks": n_blocks, "mean_block": block_total / max(1, n_blocks), "paths": dict(paths),
             "lps_only": lps_only, "refreshes": run.refreshes, "lbs_seconds": t_lbs, "lps_seconds": t_lps,
             "router_seconds": router, "forward_seconds": t_fwd, "step_seconds": t_steps,
             "router_share": router / t_steps if t_steps > 0 else 0.0,
             "router_vs_forward": router / t_fwd if t_fwd > 0 else 0.0, "row_extra": row_extra,
             "compiled": bool(compile)}
    if run.static_capacity is not None:
        extra["static_cache"] = run.static_capacity
    stats = DecodeStats(nfe=nfe, nfe_per_row=nfe_rows.tolist(), tokens_per_row=[len(t) for t in tokens_out],
                        stops_per_row=stop_flags(full, tokens_out, stops_list),
                        seconds=seconds, extra=extra)
    return DecodeOutput(tokens=tokens_out, stats=stats)
