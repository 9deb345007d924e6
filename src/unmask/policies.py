"""Commit policies: which masked positions to reveal this step, and with which token.

Every decoder (SBD, LLaDA, Fast-dLLM, Dream, block diffusion) calls :func:`commit` once per forward.
It is a pure, batched function of the logits and the mask; the policy is a frozen config dataclass.

Conventions shared by every policy (SBD §5, diffusion.md §0, §4, §6, §7):

* Tokens are drawn from softmax(logits / T) for T > 0 (the argmax for T = 0), in float32 (SBD §5.1 step 1).
* Commit decisions (κ, H, Δ) read softmax(logits), the untempered q, at every T unless asked otherwise:
  a decoder then tends to its T = 0 behaviour as T → 0 (at T = 0.1 the tempered κ of most positions
  rounds to 1.0, which would commit a whole block in one step and make γ = 0 commit several tokens).
  Dream's convention, κ and H under softmax(logits / T), is ``confidence="tempered"`` (diffusion.md §4,
  SBD §5.2, which read the tempered q; our choice to default to the untempered one).
* Ranking is a stable sort: equal scores go to the lower position. Non-masked positions are never ranked
  before masked ones and are never committed.
* A row with r >= 1 masked positions commits between 1 and r of them; a row with r = 0 commits nothing.
  The one exception is an explicit TopK ``quota`` of 0 (LLaDA with more steps than block tokens).
* Decoders set the mask-token logit to -inf themselves (see :func:`suppress`) before calling.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from unmask.errors import UnmaskError, is_int, is_number
from unmask.sampling import TEMPERATURE_RANGE

# SBD §5.4, Table 1: γ_low keeps accuracy, γ_high is faster. Both assume the entropy proxy at T = 0.
GAMMA_PRESETS: dict[str, float] = {
    "reasoning-low": 0.1,
    "reasoning-high": 0.35,
    "chat-low": 0.35,
    "chat-high": 0.6,
}
_PROXIES = ("entropy", "confidence", "margin")
# Which distribution commit decisions read, by name (see :func:`commit`; None is the default).
CONFIDENCES = ("untempered", "tempered")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UnmaskError(message)


def _is_number(x: object) -> bool:
    # ∞ is a legal bound (γ = ∞ reveals every masked position, SBD §5.1); nan and bools never are
    return is_number(x, finite=False)


@dataclass(frozen=True)
class EntropyBound:
    """EB sampler (SBD §5.1 / EB Alg. 1): largest prefix, in proxy order, with Σ H − max H ≤ gamma.

    ``proxy`` orders the candidates: "entropy" (H ascending, the SBD default), "confidence" (max q
    descending, SBD Eq. 18) or "margin" (q(top1) − q(top2) descending). gamma is in nats; 0 commits one
    token per step (more only when entropies are exactly 0), ``math.inf`` commits every masked position.
    """

    gamma: float = 0.35
    proxy: Literal["entropy", "confidence", "margin"] = "entropy"

    def __post_init__(self) -> None:
        # --gamma is a number on the CLI and the server: the named values are --preset's
        _require(_is_number(self.gamma) and self.gamma >= 0,
                 f"gamma must be >= 0 (got {self.gamma!r}); use 0 for one token per step, or --preset with one of "
                 f"{', '.join(sorted(GAMMA_PRESETS))}")
        _require(self.proxy in _PROXIES, f"proxy must be one of {list(_PROXIES)} (got {self.proxy!r})")

    @property
    def name(self) -> str:
        return f"{self.proxy}-bound"

    @classmethod
    def preset(cls, name: str, proxy: str = "entropy") -> EntropyBound:
        """EntropyBound with γ from :data:`GAMMA_PRESETS`, e.g. ``preset("chat-low")`` (SBD §5.4)."""
        _require(name in GAMMA_PRESETS, f"unknown gamma preset {name!r}; use one of {sorted(GAMMA_PRESETS)}")
        return cls(gamma=GAMMA_PRESETS[name], proxy=proxy)

    @classmethod
    def gamma_low(cls, task: Literal["reasoning", "chat"] = "chat") -> EntropyBound:
        """Accuracy-preserving γ for ``task`` (SBD Table 1: reasoning 0.1, chat 0.35)."""
        return cls.preset(f"{task}-low")

    @classmethod
    def gamma_high(cls, task: Literal["reasoning", "chat"] = "chat") -> EntropyBound:
        """Faster γ for ``task`` (SBD Table 1: reasoning 0.35, chat 0.6)."""
        return cls.preset(f"{task}-high")


@dataclass(frozen=True)
class Threshold:
    """Fast-dLLM threshold rule (diffusion.md §6): top-1 by κ always, plus every κ ≥ tau (inclusive).

    ``strict=True`` commits κ > tau instead: the SDAR / Diffulex M2T rule (multiblock.md §1.2, §3.3),
    which the block-diffusion decoders use so that SingleBD equals the Block Buffer with one slot.
    """

    tau: float = 0.9
    strict: bool = False

    def __post_init__(self) -> None:
        _require(_is_number(self.tau) and 0 < self.tau <= 1,
                 f"tau must be in (0, 1] (got {self.tau!r}); use 1.0 to commit one token per step "
                 "unless the model is certain")
        _require(isinstance(self.strict, bool), f"strict must be True or False (got {self.strict!r})")

    @property
    def name(self) -> str:
        return "threshold"


@dataclass(frozen=True)
class Factor:
    """Fast-dLLM factor rule (diffusion.md §6, SBD §5.3) on κ sorted descending, c(1) ≥ c(2) ≥ ...

    Clean rule (default, our choice): commit the largest prefix of ranks n such that every rank r ≤ n
    has c(r) ≥ 1 − f/(r+1), i.e. (r+1)(1 − c(r)) ≤ f, inclusive as in diffusion.md §6 and the
    reference code (SBD §5.3's strict "<" differs only on exact equality). Rank 1 is always committed.

    ``compat=True`` reproduces ``get_transfer_index_dynamic`` bit-exactly: κ from the float64,
    untempered softmax, and when the first failing rank is the last rank every candidate is committed.
    """

    f: float = 1.0
    compat: bool = False

    def __post_init__(self) -> None:
        _require(_is_number(self.f) and self.f >= 0,
                 f"factor f must be >= 0 (got {self.f!r}); larger f commits more tokens per step, 1.0 is usual")
        _require(isinstance(self.compat, bool), f"compat must be True or False (got {self.compat!r})")

    @property
    def name(self) -> str:
        return "factor"


@dataclass(frozen=True)
class TopK:
    """Commit the k most confident masked positions per step (LLaDA low-confidence remasking, diffusion.md §3)."""

    k: int = 1

    def __post_init__(self) -> None:
        _require(is_int(self.k) and self.k >= 1,
                 f"tokens per step k must be an integer >= 1 (got {self.k!r}); use 1 for one token per step")

    @property
    def name(self) -> str:
        return "top-k"


@dataclass(frozen=True)
class EntropyThreshold:
    """d3LLM entropy threshold (diffusion.md §7): every H ≤ eta (nats), else the single argmin-H position."""

    eta: float = 0.4

    def __post_init__(self) -> None:
        _require(_is_number(self.eta) and self.eta >= 0,
                 f"eta must be >= 0 (got {self.eta!r}); use 0 for one token per step")

    @property
    def name(self) -> str:
        return "entropy-threshold"


Policy = EntropyBound | Threshold | Factor | TopK | EntropyThreshold

# CLI name -> (class, fixed fields). The *-bound names are EntropyBound with the proxy fixed.
_REGISTRY: dict[str, tuple[type, dict[str, object]]] = {
    "entropy-bound": (EntropyBound, {"proxy": "entropy"}),
    "confidence-bound": (EntropyBound, {"proxy": "confidence"}),
    "margin-bound": (EntropyBound, {"proxy": "margin"}),
    "threshold": (Threshold, {}),
    "factor": (Factor, {}),
    "top-k": (TopK, {}),
    "entropy-threshold": (EntropyThreshold, {}),
}
POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)
# Policy field -> the option that sets it (``--factor``, ``--tokens-per-step``; the others share their name).
_OPTION_OF = {"f": "factor", "k": "tokens_per_step", "compat": "factor_compat"}


def gamma_option(gamma=None, preset=None):
    """γ as :func:`make_policy` takes it from the ``gamma`` and ``preset`` options (None when
    neither is set): a number, or a preset name, checked here so that an unknown ``--preset`` is
    named as such (``--gamma`` takes numbers on the CLI and the server). Raises UnmaskError."""
    if preset is None:
        return gamma
    if gamma is not None:
        raise UnmaskError("--gamma and --preset both set γ; give either --gamma or --preset, not both")
    _require(isinstance(preset, str) and preset in GAMMA_PRESETS,
             f"unknown --preset {preset!r}; use one of {', '.join(sorted(GAMMA_PRESETS))}, or --gamma for a number")
    return preset


def make_policy(name: str, **params: object) -> Policy:
    """Build a policy from its CLI name and options, e.g. ``make_policy("threshold", tau=0.8)``.

    Options whose value is None are ignored, so a CLI can pass every flag it has. ``gamma`` also accepts
    a preset name from :data:`GAMMA_PRESETS`. Raises UnmaskError for an unknown name, an option the
    policy does not take, or an invalid value.
    """
    key = str(name).strip().lower().replace("_", "-")
    _require(key in _REGISTRY, f"unknown policy {name!r}; use one of {list(POLICY_NAMES)}")
    cls, fixed = _REGISTRY[key]
    given = {k: v for k, v in params.items() if v is not None}
    allowed = [f.name for f in dataclasses.fields(cls)]
    for k, v in given.items():
        takes = [f"--{_OPTION_OF.get(a, a).replace('_', '-')}" for a in allowed if a not in fixed and a != "strict"]
        flag = f"--{_OPTION_OF.get(k, k).replace('_', '-')}"
        takers = [n for n, (c, f) in _REGISTRY.items() if k in {x.name for x in dataclasses.fields(c)} and k not in f]
        _require(k in allowed, f"policy {key!r} does not take {flag}; it takes {', '.join(takes)}; drop {flag} or "
                               + (f"pass --policy {' / '.join(takers)}, which takes it" if takers else
                                  "choose a policy that takes it"))
        _require(k not in fixed or v == fixed[k],
                 f"policy {key!r} fixes {k}={fixed.get(k)!r} (got {v!r}); choose the policy named after it")
    if isinstance(given.get("gamma"), str):
        gamma = given["gamma"]
        _require(gamma in GAMMA_PRESETS, f"unknown gamma preset {gamma!r}; use a number or one of {sorted(GAMMA_PRESETS)}")
        given["gamma"] = GAMMA_PRESETS[gamma]
    return cls(**{**given, **fixed})


class TokenStats(NamedTuple):
    """Per-position statistics of q (diffusion.md §0); each field is (B, N)."""

    top1: Tensor        # long, argmax token
    confidence: Tensor  # float32, κ = max q
    entropy: Tensor     # float32, H = −Σ q log q, nats
    margin: Tensor      # float32, Δ = q(top1) − q(top2)


def _log_q(logits: Tensor, temperature: float) -> Tensor:
    # SBD §5.2: at T = 0 the unscaled softmax; the T → 0 limit would have zero entropy everywhere.
    z = logits.float()
    if temperature > 0:
        z = z / temperature
    return F.log_softmax(z, dim=-1)  # (B, N, V)


def _stats(log_q: Tensor) -> TokenStats:
    q = log_q.exp()  # (B, N, V)
    # A -inf logit (mask token) has q = 0 and log q = -inf; its term q log q is 0, not nan.
    entropy = -torch.where(q > 0, q * log_q, torch.zeros_like(q)).sum(-1)  # (B, N)
    top = q.topk(min(2, q.shape[-1]), dim=-1)  # values, indices: (B, N, 1 or 2)
    second = top.values[..., 1] if q.shape[-1] > 1 else torch.zeros_like(top.values[..., 0])
    return TokenStats(top1=q.argmax(-1), confidence=top.values[..., 0], entropy=entropy,
                      margin=top.values[..., 0] - second)


def _check_temperature(temperature: float) -> None:
    _require(_is_number(temperature) and 0 <= temperature < math.inf,
             f"temperature must be a finite number >= 0 (got {temperature!r}); use 0 for greedy decoding")
    low, high = TEMPERATURE_RANGE
    _require(temperature == 0 or low <= temperature <= high,
             f"temperature {temperature!r} is outside [{low:g}, {high:g}], where logits / T overflow or vanish in "
             "float32; use 0 for greedy decoding or a temperature in that range")


def token_stats(logits: Tensor, *, temperature: float = 0.0) -> TokenStats:
    """Top-1 token, confidence κ, entropy H (nats) and margin Δ of q, in float32 (SBD §5.1 steps 1–2).

    logits: (B, N, V), any float dtype. q = softmax(logits / T) if T > 0, else softmax(logits).
    Returns a :class:`TokenStats` of (B, N) tensors. Raises UnmaskError for a bad temperature or shape.
    """
    _check_temperature(temperature)
    _require(logits.dim() == 3, f"logits must be (B, N, V) (got shape {tuple(logits.shape)})")
    return _stats(_log_q(logits, temperature))


def suppress(logits: Tensor, ids: int | Sequence[int] | Tensor) -> Tensor:
    """Return a copy of ``logits`` (..., V) with the vocabulary columns ``ids`` set to -inf.

    Used for the mask token and EOS suppression (SBD §2, diffusion.md §9). The input is not modified.
    """
    V = logits.shape[-1]
    index = torch.as_tensor(ids, dtype=torch.long, device=logits.device).reshape(-1)  # (n_ids,)
    _require(bool(((index >= 0) & (index < V)).all()), f"suppress ids must lie in [0, {V}) (got {index.tolist()})")
    return logits.index_fill(-1, index, float("-inf"))


def gumbel_argmax(logits: Tensor, temperature: float, generator: torch.Generator | None = None) -> Tensor:
    """Gumbel-max sample from softmax(logits / T), LLaDA's ``add_gumbel_noise`` (diffusion.md §4).

    logits: (..., V). Returns long (...). T = 0 is a plain argmax. For T > 0 the score
    exp(logits) / (−log u)^T with u ~ U(0, 1) is formed in float64 and maximised, exactly as the
    reference (so, like it, logits above ~709 overflow to inf). u is drawn from ``generator``.
    """
    _check_temperature(temperature)
    if temperature == 0:
        return logits.argmax(-1)
    z = logits.to(torch.float64)
    u = torch.rand(z.shape, generator=generator, dtype=torch.float64, device=z.device)  # (..., V)
    # Keep u strictly inside (0, 1): at u = 1 the noise −log u is 0 and a −inf column (the mask
    # token) scores 0 / 0 = nan, which argmax picks. Inside (0, 1) this is the reference bit for bit.
    u = u.clamp(min=torch.finfo(torch.float64).tiny, max=math.nextafter(1.0, 0.0))
    return (z.exp() / (-torch.log(u)) ** temperature).argmax(-1)


def _filter(z: Tensor, top_k: int, top_p: float) -> Tensor:
    """Boolean (B, N, V) mask of the columns that top-k then top-p filtering removes from scaled logits z."""
    removed = torch.zeros_like(z, dtype=torch.bool)
    if 0 < top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]  # (B, N, 1)
        removed = z < kth
    if top_p < 1:
        z = z.masked_fill(removed, float("-inf"))
        probs, order = F.softmax(z, dim=-1).sort(dim=-1, descending=True)  # (B, N, V) each
        # Drop a token when the mass strictly before it already reaches top_p; the top-1 always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # (B, N, V), in sorted order
        drop_sorted[..., 0] = False  # a top_p below float32's range rounds to 0 and would drop every token
        removed = removed | torch.zeros_like(removed).scatter(-1, order, drop_sorted)
    return removed


def _draw(logits: Tensor, log_q: Tensor, temperature: float, top_k: int, top_p: float, sampling: str,
          generator: torch.Generator | None) -> Tensor:
    """Sample (B, N) tokens at T > 0 from logits (B, N, V) after top-k / top-p filtering (diffusion.md §4)."""
    B, N, V = logits.shape
    removed = _filter(logits.float() / temperature, top_k, top_p)  # (B, N, V)
    if sampling == "gumbel":
        return gumbel_argmax(logits.masked_fill(removed, float("-inf")), temperature, generator)
    probs = log_q.masked_fill(removed, float("-inf")).softmax(-1)  # (B, N, V)
    flat = probs.reshape(B * N, V)  # (B*N, V): multinomial takes 2-D input
    return torch.multinomial(flat, 1, generator=generator).reshape(B, N)  # (B, N)


def _certainty(log_q: Tensor, tokens: Tensor) -> Tensor:
    """−log(1 − q(token)): a ranking key increasing in q(token) that does not saturate.

    log_q (B, N, V), tokens (B, N) -> (B, N) float32. At a small temperature q(top-1) rounds to
    exactly 1.0 (even in float64) and every position would tie. Where 1 − q is small its float32
    value is coarse, so 1 − q = Σ_{v ≠ token} q_v is taken from the other tokens' log-probabilities,
    which stay exact; elsewhere the key is −log1p(−q) of q itself, so equal q still tie (ties go to
    the lower position). +inf when no other token has mass.
    """
    q = log_q.gather(-1, tokens[..., None])[..., 0].exp()  # (B, N)
    others = log_q.scatter(-1, tokens[..., None], float("-inf"))  # (B, N, V)
    fine = -torch.logsumexp(others, dim=-1)  # (B, N)
    return torch.where(q < 1 - 2 ** -10, -torch.log1p(-q), fine)


def _rank(score: Tensor, masked: Tensor) -> Tensor:
    """(B, N) positions ordered masked-first, then by score descending, ties to the lower position."""
    order = score.sort(dim=1, descending=True, stable=True).indices  # (B, N)
    # Second stable pass puts every non-masked position last, whatever its score (even a -inf tie).
    unmasked_sorted = (~masked.gather(1, order)).to(torch.uint8)  # (B, N)
    return order.gather(1, unmasked_sorted.sort(dim=1, stable=True).indices)  # (B, N)


def _prefix_len(ok_sorted: Tensor) -> Tensor:
    """Length of the leading run of True along dim 1: (B, N) bool -> (B,) long."""
    return ok_sorted.long().cumprod(dim=1).sum(dim=1)


def _take(order: Tensor, count: Tensor) -> Tensor:
    """Commit the first ``count`` (B,) entries of ``order`` (B, N) -> (B, N) bool in position order."""
    cols = torch.arange(order.shape[1], device=order.device)  # (N,)
    take_sorted = cols[None, :] < count[:, None]  # (B, N), in sorted order
    return torch.zeros_like(take_sorted).scatter(1, order, take_sorted)


def commit(
    logits: Tensor,
    masked: Tensor,
    policy: Policy,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    quota: Tensor | None = None,
    confidence: Literal["tempered", "untempered"] | None = None,
    sampling: Literal["categorical", "gumbel"] = "categorical",
    draws: Sequence[int] | None = None,
    validate: bool = True,
) -> tuple[Tensor, Tensor]:
    """Choose the positions to commit this step and their tokens (SBD §5, diffusion.md §3, §4, §6, §7).

    Args:
        logits: (B, N, V) float; mask (and suppressed) columns already -inf.
        masked: (B, N) bool, the positions that may be committed.
        policy: one of :data:`Policy`.
        temperature: T ≥ 0. T = 0 takes the argmax; T > 0 samples from softmax(logits / T) after top-k
            then top-p filtering. Entropy, margin and the EB proxies always use the unfiltered q.
        sampling: how tokens are drawn at T > 0: "categorical" (Dream; ``torch.multinomial``) or "gumbel"
            (LLaDA's float64 Gumbel-max, :func:`gumbel_argmax`). Randomness comes only from ``generator``:
            one generator, or B of them (row b drawn with generator b; rows without masks draw nothing).
        draws: with B generators, the rows that have masks when the caller knows them (a decoder's
            step: no host read); None reads them from ``masked``.
        quota: (B,) long, TopK only: tokens to commit per row this step (LLaDA's schedule), overriding k;
            clamped to the row's masked count. A 0 entry commits nothing in that row.
        validate: False skips the check that reads ``quota``'s values on the host (a decoder's step,
            which built them, keeps its one host sync); shapes and dtypes are always checked.
        confidence: which distribution the commit decision reads. None (default): κ (Threshold,
            Factor, TopK) and the EB / entropy-threshold statistics (H, max q, Δ) come from the
            float32 softmax(logits) at every T, the arithmetic of T = 0, so as T → 0 every policy
            tends to its T = 0 rule. "untempered" (LLaDA / Fast-dLLM, diffusion.md §3–4): the same
            distribution, with κ in float64 and ranked as the reference code does.
            "tempered" (Dream's convention): both from the float32 softmax(logits / T); at T = 0.1
            most κ round to 1.0 (a whole block commits at once) and many H to 0.
            ``Factor(compat=True)`` always uses "untempered". κ read in float32 (and the EB
            confidence proxy) is ranked by −log(1 − κ), computed from the other tokens'
            log-probabilities, so the order survives κ rounding to 1.0.

    Returns:
        (commit, tokens): commit (B, N) bool, True only at masked positions; tokens (B, N) long, the
        candidate at every position. Every row with r ≥ 1 masked positions commits 1..r of them.

    Raises:
        UnmaskError: bad shapes, options, or a quota with a policy other than TopK.
    """
    _check_temperature(temperature)
    _require(logits.dim() == 3, f"logits must be (B, N, V) (got shape {tuple(logits.shape)})")
    B, N, V = logits.shape
    _require(masked.shape == (B, N) and masked.dtype == torch.bool,
             f"masked must be a bool tensor of shape {(B, N)} (got {masked.dtype} {tuple(masked.shape)})")
    _require(_is_number(top_p) and 0 < top_p <= 1, f"top_p must be in (0, 1] (got {top_p!r}); use 1.0 to disable")
    _require(isinstance(top_k, int) and top_k >= 0, f"top_k must be an integer >= 0 (got {top_k!r}); use 0 to disable")
    _require(confidence is None or confidence in CONFIDENCES,
             f"confidence must be 'untempered' or 'tempered' (Dream's convention) (got {confidence!r})")
    _require(sampling in ("categorical", "gumbel"), f"sampling must be 'categorical' or 'gumbel' (got {sampling!r})")
    _require(isinstance(policy, (EntropyBound, Threshold, Factor, TopK, EntropyThreshold)),
             f"policy must be one of {list(POLICY_NAMES)} built by make_policy (got {type(policy).__name__})")
    _require(quota is None or isinstance(policy, TopK), f"quota applies only to the top-k policy (got {policy.name!r})")

    log_q = _log_q(logits, temperature)  # (B, N, V), the sampling distribution
    # The distribution commit decisions read: untempered unless Dream's tempered convention is asked for.
    log_c = log_q if confidence == "tempered" or temperature == 0 else _log_q(logits, 0.0)  # (B, N, V)
    stats = _stats(log_c)

    # Candidate tokens (SBD §5.1 step 3).
    if temperature == 0:
        tokens = stats.top1
    elif isinstance(generator, (list, tuple)):
        # One generator per row; rows without masks draw nothing (a waiting row's stream is unchanged).
        _require(len(generator) == B, f"generator must be one torch.Generator or {B} of them (got {len(generator)})")
        tokens = stats.top1.clone()
        for b in torch.nonzero(masked.any(dim=1)).flatten().tolist() if draws is None else draws:
            tokens[b] = _draw(logits[b: b + 1], log_q[b: b + 1], temperature, top_k, top_p, sampling, generator[b])[0]
    else:
        tokens = _draw(logits, log_q, temperature, top_k, top_p, sampling, generator)

    r = masked.sum(dim=1)  # (B,)
    if isinstance(policy, EntropyBound):
        # SBD §5.1 steps 4–5 / EB Fig. 4. Cumulative ops run over positions (dim 1), never the batch.
        if policy.proxy == "confidence":  # max q, ranked by a key that survives small T (diffusion.md §4)
            score = _certainty(log_c, stats.top1)
        else:
            score = -stats.entropy if policy.proxy == "entropy" else stats.margin
        order = _rank(score, masked)
        cols = torch.arange(N, device=logits.device)  # (N,)
        h = stats.entropy.gather(1, order).double()  # (B, N), sorted; float64 so tiny H is not absorbed
        h = torch.where(cols[None, :] < r[:, None], h, torch.zeros_like(h))
        excess = h.cumsum(dim=1) - h.cummax(dim=1).values  # (B, N), non-decreasing
        count = _prefix_len(excess <= policy.gamma)
    elif isinstance(policy, EntropyThreshold):
        # diffusion.md §7: when any H ≤ eta the argmin-H is among them, so this is "rank 1 plus all that qualify".
        order = _rank(-stats.entropy, masked)
        count = _prefix_len(stats.entropy.gather(1, order) <= policy.eta)  # gather: (B, N), sorted
    else:
        if confidence == "untempered" or (isinstance(policy, Factor) and policy.compat):
            # LLaDA / Fast-dLLM: p(chosen) from the float64 softmax of the raw logits, ranked as the reference.
            kappa = F.softmax(logits.to(torch.float64), dim=-1).gather(-1, tokens[..., None])[..., 0]  # (B, N)
            order = _rank(kappa, masked)
        else:
            # p(chosen) under log_c. Where it rounds to 1.0 (tempered at small T, or a sure model), rank
            # by the equivalent non-saturating key; compare the probability itself with τ / the factor rule.
            kappa = log_c.gather(-1, tokens[..., None])[..., 0].exp()  # (B, N)
            order = _rank(_certainty(log_c, tokens), masked)
        kappa_sorted = kappa.gather(1, order)  # (B, N)
        if isinstance(policy, Threshold):
            count = _prefix_len(kappa_sorted > policy.tau if policy.strict else kappa_sorted >= policy.tau)
        elif isinstance(policy, Factor):
            ranks = torch.arange(1, N + 1, device=logits.device, dtype=torch.float64)  # (N,), 1-based
            need = 1 - policy.f / (ranks + 1)  # same float64 arithmetic as the reference's Python floats
            need[0] = -math.inf  # rank 1 is always committed
            count = _prefix_len(kappa_sorted >= need[None, :])
            if policy.compat:
                # Reference quirk: a first failure on the last rank (count = r − 1) still accepts all r.
                count = torch.where((r >= 2) & (count == r - 1), r, count)
        else:  # TopK
            if quota is None:
                count = torch.full_like(r, policy.k)
            else:
                _require(quota.shape == (B,), f"quota must have shape {(B,)} (got {tuple(quota.shape)})")
                if quota.is_floating_point() or (validate and not bool((quota >= 0).all())):
                    raise UnmaskError(f"quota must hold integers >= 0 (got {quota.tolist()})")  # read on failure only
                count = quota.to(device=r.device, dtype=torch.long)
            return _take(order, torch.minimum(count, r)) & masked, tokens

    # Rank 1 always qualifies (at least one token per row with masks); never more than r.
    count = torch.minimum(count.clamp(min=1), r)
    return _take(order, count) & masked, tokens
