"""The commit policies as frozen, validated configs (SBD §5.1, §5.4; diffusion.md §3, §6, §7), their
γ presets, and :func:`make_policy`, which builds one from its CLI name and options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from unmask.errors import UnmaskError, is_int, is_number

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


def require(ok: bool, message: str) -> None:
    if not ok:
        raise UnmaskError(message)


def is_number_or_inf(x: object) -> bool:
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
        require(is_number_or_inf(self.gamma) and self.gamma >= 0,
                f"gamma must be >= 0 (got {self.gamma!r}); use 0 for one token per step, or --preset with one of "
                f"{', '.join(sorted(GAMMA_PRESETS))}")
        require(self.proxy in _PROXIES, f"proxy must be one of {list(_PROXIES)} (got {self.proxy!r})")

    @property
    def name(self) -> str:
        return f"{self.proxy}-bound"

    @classmethod
    def preset(cls, name: str, proxy: str = "entropy") -> EntropyBound:
        """EntropyBound with γ from :data:`GAMMA_PRESETS`, e.g. ``preset("chat-low")`` (SBD §5.4)."""
        require(name in GAMMA_PRESETS, f"unknown gamma preset {name!r}; use one of {sorted(GAMMA_PRESETS)}")
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
        require(is_number_or_inf(self.tau) and 0 < self.tau <= 1,
                f"tau must be in (0, 1] (got {self.tau!r}); use 1.0 to commit one token per step "
                "unless the model is certain")
        require(isinstance(self.strict, bool), f"strict must be True or False (got {self.strict!r})")

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
        require(is_number_or_inf(self.f) and self.f >= 0,
                f"factor f must be >= 0 (got {self.f!r}); larger f commits more tokens per step, 1.0 is usual")
        require(isinstance(self.compat, bool), f"compat must be True or False (got {self.compat!r})")

    @property
    def name(self) -> str:
        return "factor"


@dataclass(frozen=True)
class TopK:
    """Commit the k most confident masked positions per step (LLaDA low-confidence remasking, diffusion.md §3)."""

    k: int = 1

    def __post_init__(self) -> None:
        require(is_int(self.k) and self.k >= 1,
                f"tokens per step k must be an integer >= 1 (got {self.k!r}); use 1 for one token per step")

    @property
    def name(self) -> str:
        return "top-k"


@dataclass(frozen=True)
class EntropyThreshold:
    """d3LLM entropy threshold (diffusion.md §7): every H ≤ eta (nats), else the single argmin-H position."""

    eta: float = 0.4

    def __post_init__(self) -> None:
        require(is_number_or_inf(self.eta) and self.eta >= 0,
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
    require(isinstance(preset, str) and preset in GAMMA_PRESETS,
            f"unknown --preset {preset!r}; use one of {', '.join(sorted(GAMMA_PRESETS))}, or --gamma for a number")
    return preset


def make_policy(name: str, **params: object) -> Policy:
    """Build a policy from its CLI name and options, e.g. ``make_policy("threshold", tau=0.8)``.

    Options whose value is None are ignored, so a CLI can pass every flag it has. ``gamma`` also accepts
    a preset name from :data:`GAMMA_PRESETS`. Raises UnmaskError for an unknown name, an option the
    policy does not take, or an invalid value.
    """
    key = str(name).strip().lower().replace("_", "-")
    require(key in _REGISTRY, f"unknown policy {name!r}; use one of {list(POLICY_NAMES)}")
    cls, fixed = _REGISTRY[key]
    given = {k: v for k, v in params.items() if v is not None}
    allowed = [f.name for f in dataclasses.fields(cls)]
    for k, v in given.items():
        takes = [f"--{_OPTION_OF.get(a, a).replace('_', '-')}" for a in allowed if a not in fixed and a != "strict"]
        flag = f"--{_OPTION_OF.get(k, k).replace('_', '-')}"
        takers = [n for n, (c, f) in _REGISTRY.items() if k in {x.name for x in dataclasses.fields(c)} and k not in f]
        require(k in allowed, f"policy {key!r} does not take {flag}; it takes {', '.join(takes)}; drop {flag} or "
                              + (f"pass --policy {' / '.join(takers)}, which takes it" if takers else
                                 "choose a policy that takes it"))
        require(k not in fixed or v == fixed[k],
                f"policy {key!r} fixes {k}={fixed.get(k)!r} (got {v!r}); choose the policy named after it")
    if isinstance(given.get("gamma"), str):
        gamma = given["gamma"]
        require(gamma in GAMMA_PRESETS, f"unknown gamma preset {gamma!r}; use a number or one of {sorted(GAMMA_PRESETS)}")
        given["gamma"] = GAMMA_PRESETS[gamma]
    return cls(**{**given, **fixed})


