"""Set Block Decoding with an exact KV cache (SBD Algorithms 2 and 3, spec/sbd.md §4).

Prefill the prompt causally, then decode block by block: every block starts as k mask
tokens; each forward predicts all still-masked block positions at their own positions (block
mode, Eq. 9b) and the commit policy (default: the EB sampler, §5.1) reveals at least one of
them. Committed blocks are final.

The cache stays exact (§4.1): block K/V computed under bidirectional, noisy attention are
cropped after every forward, and the first forward of the next block re-feeds the committed
block causally together with the k new masks (one fused forward over 2k tokens), so only the
causal K/V of committed text ever stay in the cache.

The decoding itself is :class:`unmask.decode.blocks.batch.BlockDecoder`, the running batch SBD shares
with SingleBD (the re-feed is its causal store region) and that the server runs too; ``decode``
drains it. On the static cache every forward has one of at most four query shapes — k or 2k
tokens, and the same for a shorter last block — so ``compile=True`` reuses one graph per shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unmask.decode.verify import layout as draft_layout
from unmask.decode.verify import steps as sbd_verify
from unmask.decode.blocks.batch import running_batch
from unmask.decode.dllm.canvas import drain_prompts, event_hook
from unmask.decode.engine.batching import left_pad
from unmask.decode.engine.stats import DecodeOutput
from unmask.errors import UnmaskError, is_int
from unmask.masks import as_4d, causal_mask, with_key_padding
from unmask.policies import EntropyBound, Policy, gamma_option, make_policy
from unmask.sampling import Sampling
from unmask.decode.engine.knobs import PolicyKnobs
from unmask.decode.engine.registry import Spec, knob

DEFAULT_BLOCK_SIZE = 16
DEFAULT_PRESET = "chat-low"
# decode_defaults keys of lossless SBD (spec/sbd_exact.md); "block_size" stays the lossy path's
LOSSLESS_KEYS = ("verify", "draft", "verify_block_size", "queries", "draft_layouts")


@dataclass(frozen=True)
class SBDConfig:
    """Block size k (default 16, §4) and the commit policy (default EB, entropy proxy, γ of the
    ``chat-low`` preset)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    policy: Policy = EntropyBound.preset(DEFAULT_PRESET)

    def __post_init__(self):
        if not is_int(self.block_size) or self.block_size < 1:
            raise UnmaskError(f"block size must be an integer >= 1 (got {self.block_size!r}); 16 is the paper's "
                              "default")

    @classmethod
    def from_options(cls, *, block_size=None, policy=None, gamma=None, preset=None, tau=None, factor=None,
                     tokens_per_step=None, defaults: dict | None = None) -> "SBDConfig":
        """Build from CLI-style options; raises UnmaskError for invalid combinations.

        ``defaults`` (a checkpoint's ``decode_defaults`` in unmask_config.json, e.g.
        ``{"block_size": 8, "gamma": 0.35}``) fills the block size and, when no policy option is
        given at all, the policy; explicit options always win.
        """
        defaults = dict(defaults or {})
        if block_size is None:
            block_size = defaults.pop("block_size", None)
        defaults.pop("block_size", None)
        if all(v is None for v in (policy, gamma, preset, tau, factor, tokens_per_step)) and defaults:
            return cls.from_options(block_size=block_size, **defaults)
        name = policy or "entropy-bound"
        gamma = gamma_option(gamma, preset)
        if gamma is None and name in ("entropy-bound", "confidence-bound", "margin-bound"):
            gamma = DEFAULT_PRESET
        params = {"gamma": gamma, "tau": tau, "f": factor, "k": tokens_per_step}
        built = make_policy(name, **{k: v for k, v in params.items() if v is not None})
        return cls(block_size=DEFAULT_BLOCK_SIZE if block_size is None else block_size, policy=built)


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (), block_size: int | None = None,
           policy: str | None = None, gamma: float | str | None = None, preset: str | None = None,
           tau: float | None = None, factor: float | None = None, tokens_per_step: int | None = None,
           verify: bool | None = None, draft: str | None = None, queries: int | None = None, on_forward=None,
           on_step=None, compile: bool = False, static: bool = False) -> DecodeOutput:
    """SBD block decoding of a batch (SBD Alg. 2–3, §4.1 fused re-feed, §4.2 accounting).

    ``verify=True`` runs lossless SBD instead (spec/sbd_exact.md, :mod:`unmask.decode.verify.steps`):
    the block mode only drafts, the NTP mode verifies in the same forward, and the output equals
    ``ar`` decoding of the same model; ``draft`` picks its layout (quadratic, linear, or budget with
    ``queries`` query tokens per row: the checkpoint's calibrated layout, spec §5) and the
    commit-policy options do not apply. ``verify=None`` takes the checkpoint's ``decode_defaults``
    unless a policy option is given (then the lossy EB path runs). ``compile=True`` runs the
    static-cache, compiled fast path (lossless: :mod:`unmask.decode.engine.static`; lossy: this loop on a
    :class:`unmask.decode.engine.kv.StaticKV` with a compiled step, the prefill eager); ``static=True``
    runs the lossy loop on the static cache eagerly (tests, debugging). Both give the eager
    tokens and NFE; stats.extra records ``compiled`` and ``static_cache`` (its length, or None).

    prompts: token ids per row (left-padded internally). Rows advance block by block in
    lockstep; a row whose block is complete waits, and its NFE counts only the forwards in which
    it still had masks. A row stops after the block that commits a stop token (tokens after it
    are dropped) or a stop string. ``on_forward(state)`` (tests) sees each forward's inputs and
    block logits; ``on_step(event)`` gets :mod:`unmask.trace` step events.

    Returns DecodeOutput; stats.extra holds ``accepts`` (histogram: tokens committed per row per
    forward -> count), ``policy``, ``block_size`` and per-row accept lists in ``row_extra``.
    Raises UnmaskError for a non-SBD model, a bad block size or policy options.
    """
    if bundle.mask_token_id is None:
        raise UnmaskError("the sbd decoder needs a model with a mask token (an SBD fine-tuned model); "
                          "train one with 'unmask train sbd'")
    for name, value in (("compile", compile), ("static", static)):  # both paths: lossless passed "x" on as on
        if not isinstance(value, bool):
            raise UnmaskError(f"{name} must be True or False (got {value!r}); pass {name}=True")
    policy_options = {"--policy": policy, "--gamma": gamma, "--preset": preset, "--tau": tau, "--factor": factor,
                      "--tokens-per-step": tokens_per_step}
    given = [flag for flag, value in policy_options.items() if value is not None]
    defaults = dict(bundle.meta.get("decode_defaults") or {})
    only = [flag for flag, value in (("--draft", draft), ("--queries", queries)) if value is not None]
    lossless = _lossless(verify, given, draft if queries is None else "budget", defaults, only)
    if lossless:
        return sbd_verify.decode(bundle, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                 stop_token_ids=stop_token_ids, stop_strings=stop_strings,
                                 block_size=_first(block_size, defaults.get("verify_block_size"), sbd_verify.DEFAULT_BLOCK_SIZE),
                                 draft=draft_layout.option(draft, block_size, defaults, sbd_verify.DEFAULT_DRAFT),
                                 queries=queries, on_forward=on_forward, on_step=on_step, compile=compile, static=static)
    defaults = {k: v for k, v in defaults.items() if k not in LOSSLESS_KEYS}
    cfg = SBDConfig.from_options(block_size=block_size, policy=policy, gamma=gamma, preset=preset, tau=tau,
                                 factor=factor, tokens_per_step=tokens_per_step, defaults=defaults)
    if cfg.block_size > bundle.context_length:
        raise UnmaskError(f"block size {cfg.block_size} exceeds the context window of {bundle.context_length}; "
                          "lower --block-size")
    return drain_prompts(lambda capacity: running_batch(
        bundle, cfg, capacity=capacity, prompts=prompts, compile=compile, static=static, on_step=event_hook(on_step),
        on_forward=on_forward, stop_token_ids=tuple(stop_token_ids)), bundle, prompts, max_new_tokens=max_new_tokens,
        sampling=sampling, stop_strings=stop_strings)


POLICY_OPTIONS = ("policy", "gamma", "preset", "tau", "factor", "tokens_per_step")
BATCH_OPTIONS = ("block_size", *POLICY_OPTIONS, "verify", "draft")  # the server keys lossy batches by them


def serving_batch(bundle, options: dict | None = None, *, capacity: int = 8, on_step=None, on_token=None,
                  stop_token_ids=None, compile: bool = False, static: bool = False):
    """The server's running batch of lossy SBD rows for one set of request ``options``
    (:data:`BATCH_OPTIONS`; None = default, the checkpoint's ``decode_defaults`` filling the rest as
    in :func:`decode`), validated once: :func:`unmask.decode.blocks.single.serving` (``compile`` /
    ``static``: on a static KV cache). ``stop_token_ids`` defaults to the bundle's. Raises UnmaskError for a model without a mask
    token, an unknown option, a bad value, or options selecting lossless SBD (its own batch)."""
    if bundle.mask_token_id is None:
        raise UnmaskError("the sbd decoder needs a model with a mask token (an SBD fine-tuned model); "
                          "train one with 'unmask train sbd'")
    options = dict(options or {})
    unknown = sorted(set(options) - set(BATCH_OPTIONS))
    if unknown:
        raise UnmaskError(f"option(s) {', '.join(unknown)} do not apply to a continuous lossy sbd batch; "
                          f"use only {', '.join(BATCH_OPTIONS)}")
    given = [f"--{k.replace('_', '-')}" for k in POLICY_OPTIONS if options.get(k) is not None]
    defaults = dict(bundle.meta.get("decode_defaults") or {})
    if _lossless(options.get("verify"), given, options.get("draft"), defaults):
        raise UnmaskError("these options run lossless SBD (--verify), which the lossy sbd batch does not decode; "
                          "pass --no-verify or a policy option")
    defaults = {k: v for k, v in defaults.items() if k not in LOSSLESS_KEYS}
    cfg = SBDConfig.from_options(**{k: options.get(k) for k in ("block_size", *POLICY_OPTIONS)}, defaults=defaults)
    if cfg.block_size > bundle.context_length:
        raise UnmaskError(f"block size {cfg.block_size} exceeds the context window of {bundle.context_length}; "
                          "lower --block-size")
    return running_batch(bundle, cfg, capacity=capacity, on_step=on_step, on_token=on_token,
                         stop_token_ids=stop_token_ids, compile=compile, static=static)


def prefill(kv, prompts: list[list[int]], pad_id: int, device) -> torch.Tensor:
    """Prefill the left-padded prompts causally into the empty cache ``kv`` (SBD Alg. 2 step 1).
    Its length depends on the prompts, so it runs eagerly. Returns valid (B, P) bool, False on
    the left padding."""
    ids, valid, pos = left_pad(prompts, pad_id, device)  # (B, P) each
    B, P = ids.shape
    mask = with_key_padding(as_4d(causal_mask(P, device=device), B), valid)  # (B, 1, P, P)
    kv.forward(ids, pos, mask, logits_to_keep=1, compiled=False)
    return valid


def _first(*values):
    """The first value that is not None (an explicit 0 or "" stays, so its validation can refuse it)."""
    return next(v for v in values if v is not None)


def runs_lossless(bundle, options: dict) -> bool:
    """Whether :func:`decode` with these options runs lossless SBD (False when they contradict:
    decode then raises its own error)."""
    given = [k for k in ("policy", "gamma", "preset", "tau", "factor", "tokens_per_step") if options.get(k) is not None]
    try:
        return _lossless(options.get("verify"), given, options.get("draft"),
                         dict(bundle.meta.get("decode_defaults") or {}))
    except UnmaskError:
        return False


def _lossless(verify, given: list[str], draft, defaults: dict, only: list[str] = ("--draft",)) -> bool:
    """Whether this call runs lossless SBD. ``only``: the lossless-only flags the user set (a
    ``--queries`` alone sets the budget draft). Raises UnmaskError for contradicting options."""
    if verify is not None and not isinstance(verify, bool):
        raise UnmaskError(f"verify must be true or false (got {verify!r}); pass --verify or --no-verify")
    if verify and given:
        it = "them" if len(given) > 1 else "it"
        raise UnmaskError(f"{', '.join(given)} set a lossy commit policy, which lossless SBD (--verify) does not use; "
                          f"drop {it} or pass --no-verify")
    lossless = verify if verify is not None else (not given and bool(defaults.get("verify", False)))
    if draft is not None and not lossless:
        flags, it = (" and ".join(only), "them") if len(only) > 1 else (only[0], only[0])
        raise UnmaskError(f"{flags} appl{'y' if len(only) > 1 else 'ies'} to lossless SBD only; add --verify or "
                          f"drop {it}")
    return lossless


@dataclass(frozen=True)
class SBDOptions(PolicyKnobs):
    """Set Block Decoding's knobs: the block and its commit policy (lossy EB path, SBD §4-5), or
    lossless SBD's draft (spec/sbd_exact.md)."""

    block_size: int | None = knob("block size k (--verify: the draft size K; default the model's, else 16)", low=1,
                                  short="-k")
    verify: bool | None = knob("lossless SBD: the NTP mode verifies the block-mode draft (output = ar); default "
                               "from the model")
    draft: str | None = knob("--verify: draft layout, linear, quadratic, budget (the model's calibrated layout for "
                             "--queries) or D/S/G text such as 3/0,2,3/4, with siblings: 3/0,1,3/4+1g3 "
                             "(spec/sbd_exact.md §5.3); default from the model")
    queries: int | None = knob("--verify, budgeted draft: query tokens per row per forward (default: the "
                               "model's, else 16)", low=1)


SPEC = Spec("sbd", SBDOptions, batch=lambda bundle, cfg, **kw: serving_batch(bundle, cfg.given(), **kw), kinds=("sbd",), compiles=True, run=decode,
            summary="Set Block Decoding: block of masks, EB sampler, exact KV cache")
