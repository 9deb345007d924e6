"""Set Block Decoding with an exact KV cache (SBD Algorithms 2 and 3, spec/sbd.md §4).

Prefill the prompt causally, then decode block by block: every block starts as k mask
tokens; each forward predicts all still-masked block positions at their own positions (block
mode, Eq. 9b) and the commit policy (default: the EB sampler, §5.1) reveals at least one of
them. Committed blocks are final.

The cache stays exact (§4.1): block K/V computed under bidirectional, noisy attention are
cropped after every forward, and the first forward of the next block re-feeds the committed
block causally together with the k new masks (one fused forward over 2k tokens), so only the
causal K/V of committed text ever stay in the cache.

One loop runs on either cache of :mod:`unmask.decode.kv`: the growing ``DynamicCache`` (the
default) or, with ``static``/``compile``, a preallocated ``StaticCache`` whose crop is a pointer
move. No row is ever pruned (a finished row rides along with its masks inactive), so every
forward of a block has one of at most four query shapes — k or 2k tokens, and the same for a
shorter last block — and ``compile=True`` reuses one compiled step per shape.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from unmask.decode import sbd_verify
from unmask.decode.batching import left_pad
from unmask.decode.kv import make_kv
from unmask.decode.stats import DecodeOutput, DecodeStats, check_nfe, stop_flags
from unmask.errors import UnmaskError
from unmask.masks import as_4d, causal_mask, sbd_inference_mask, with_key_padding
from unmask.policies import EntropyBound, Policy, commit, make_policy
from unmask.sampling import Sampling
from unmask.trace import step_event

DEFAULT_BLOCK_SIZE = 16
DEFAULT_PRESET = "chat-low"
# decode_defaults keys of lossless SBD (spec/sbd_exact.md); "block_size" stays the lossy path's
LOSSLESS_KEYS = ("verify", "draft", "verify_block_size")


@dataclass(frozen=True)
class SBDConfig:
    """Block size k (default 16, §4) and the commit policy (default EB, entropy proxy, γ of the
    ``chat-low`` preset)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    policy: Policy = EntropyBound.preset(DEFAULT_PRESET)

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise UnmaskError(f"block size must be an integer >= 1 (got {self.block_size}); 16 is the paper's default")

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
        if preset is not None and gamma is not None:
            raise UnmaskError("--gamma and --preset both set γ; give either --gamma or --preset, not both")
        if preset is not None:
            gamma = preset
        elif gamma is None and name in ("entropy-bound", "confidence-bound", "margin-bound"):
            gamma = DEFAULT_PRESET
        params = {"gamma": gamma, "tau": tau, "f": factor, "k": tokens_per_step}
        built = make_policy(name, **{k: v for k, v in params.items() if v is not None})
        return cls(block_size=DEFAULT_BLOCK_SIZE if block_size is None else block_size, policy=built)


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (), block_size: int | None = None,
           policy: str | None = None, gamma: float | str | None = None, preset: str | None = None,
           tau: float | None = None, factor: float | None = None, tokens_per_step: int | None = None,
           verify: bool | None = None, draft: str | None = None, on_forward=None, on_step=None,
           compile: bool = False, static: bool = False) -> DecodeOutput:
    """SBD block decoding of a batch (SBD Alg. 2–3, §4.1 fused re-feed, §4.2 accounting).

    ``verify=True`` runs lossless SBD instead (spec/sbd_exact.md, :mod:`unmask.decode.sbd_verify`):
    the block mode only drafts, the NTP mode verifies in the same forward, and the output equals
    ``ar`` decoding of the same model; ``draft`` picks its layout (quadratic or linear) and the
    commit-policy options do not apply. ``verify=None`` takes the checkpoint's ``decode_defaults``
    unless a policy option is given (then the lossy EB path runs). ``compile=True`` runs the
    static-cache, compiled fast path (lossless: :mod:`unmask.decode.static`; lossy: this loop on a
    :class:`unmask.decode.kv.StaticKV` with a compiled step, the prefill eager); ``static=True``
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
    policy_options = {"--policy": policy, "--gamma": gamma, "--preset": preset, "--tau": tau, "--factor": factor,
                      "--tokens-per-step": tokens_per_step}
    given = [flag for flag, value in policy_options.items() if value is not None]
    defaults = dict(bundle.meta.get("decode_defaults") or {})
    lossless = _lossless(verify, given, draft, defaults)
    if lossless:
        return sbd_verify.decode(bundle, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                 stop_token_ids=stop_token_ids, stop_strings=stop_strings,
                                 block_size=_first(block_size, defaults.get("verify_block_size"), sbd_verify.DEFAULT_BLOCK_SIZE),
                                 draft=_first(draft, defaults.get("draft"), sbd_verify.DEFAULT_DRAFT),
                                 on_forward=on_forward, on_step=on_step, compile=compile, static=static)
    for name, value in (("compile", compile), ("static", static)):
        if not isinstance(value, bool):
            raise UnmaskError(f"{name} must be True or False (got {value!r}); pass {name}=True")
    defaults = {k: v for k, v in defaults.items() if k not in LOSSLESS_KEYS}
    cfg = SBDConfig.from_options(block_size=block_size, policy=policy, gamma=gamma, preset=preset, tau=tau,
                                 factor=factor, tokens_per_step=tokens_per_step, defaults=defaults)
    k, model, device, mask_id = cfg.block_size, bundle.model, bundle.device, bundle.mask_token_id
    if k > bundle.context_length:
        raise UnmaskError(f"block size {k} exceeds the context window of {bundle.context_length}; lower --block-size")
    t0 = time.perf_counter()
    B, P = len(prompts), max(len(p) for p in prompts)
    gens = sampling.row_generators(prompts, device)  # one per row (None when greedy)
    suppress = list(bundle.suppress_ids)
    stops = torch.tensor(sorted(set(stop_token_ids)) or [-1], device=device)

    # the cache never holds more than the prompt and the committed text: a block's noisy K/V
    # (at most max_new_tokens - start of them) are cropped before the next block is re-fed
    kv = make_kv(model, batch=B, capacity=P + max_new_tokens, static=static, compile=compile)
    key_valid = prefill(kv, prompts, bundle.pad_token_id, device)  # (B, kv.length) grows with every committed block
    row_len = key_valid.sum(dim=1)  # (B,) real prompt length per row

    out = torch.full((B, max_new_tokens), -1, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    nfe, nfe_rows = 0, torch.zeros(B, dtype=torch.long, device=device)
    histogram: Counter = Counter()
    accepts: list[list[int]] = [[] for _ in range(B)]
    prev_block = None  # (B, k_prev) committed tokens not yet in the cache
    for start in range(0, max_new_tokens, k):
        n = min(k, max_new_tokens - start)
        block = torch.full((B, n), mask_id, dtype=torch.long, device=device)  # (B, n)
        active = ~done  # rows that decode this block
        first = True
        while True:
            masked = (block == mask_id) & active[:, None]  # (B, n)
            if not bool(masked.any()):
                break
            refeed = prev_block if first and prev_block is not None else block[:, :0]
            c = refeed.shape[1]
            past = kv.length  # == key_valid.shape[1]
            inp = torch.cat([refeed, block], dim=1)  # (B, c + n)
            positions = (row_len + start - c)[:, None] + torch.arange(c + n, device=device)  # (B, c + n)
            kv_valid = torch.cat([key_valid, torch.ones(B, c + n, dtype=torch.bool, device=device)], dim=1)
            m = with_key_padding(as_4d(sbd_inference_mask(past, c, n, device=device), B), kv_valid)  # (B,1,c+n,kv)
            logits = kv.forward(inp, positions, m, logits_to_keep=n)  # (B, n, V)
            kv.crop(n)  # drop the noisy block K/V; a re-fed block's causal K/V stay (§4.1)
            if c:
                key_valid = torch.cat([key_valid, torch.ones(B, c, dtype=torch.bool, device=device)], dim=1)
            first = False
            if suppress:
                logits[..., suppress] = float("-inf")
            if on_forward is not None:
                on_forward({"inp": inp, "positions": positions, "logits": logits, "block": block.clone(),
                            "start": start, "refeed": c,
                            "cache": [(keys.clone(), values.clone()) for keys, values in kv.layers()]})
            chosen, tokens = commit(logits, masked, cfg.policy, temperature=sampling.temperature,
                                    top_k=sampling.top_k, top_p=sampling.top_p, generator=gens)
            block = torch.where(chosen, tokens, block)
            nfe += 1
            check_nfe(nfe, max_new_tokens + -(-max_new_tokens // k), "sbd")
            had = masked.any(dim=1)  # (B,)
            nfe_rows += had.long()
            for b in torch.nonzero(had).flatten().tolist():
                count = int(chosen[b].sum())
                accepts[b].append(count)
                histogram[count] += 1
                if on_step is not None:  # unmask.trace event; canvas = committed blocks + this block
                    canvas = torch.cat([out[b, :start], block[b]])
                    on_step(step_event(nfe - 1, b, chosen[b], tokens[b], start, canvas, mask_id))
        out[:, start:start + n] = torch.where(active[:, None], block, -1)
        done |= active & torch.isin(block, stops).any(dim=1)
        if stop_strings:
            done |= _hit_stop_string(bundle, prompts, out[:, : start + n], stop_strings) & active
        prev_block = block
        if bool(done.all()):
            break

    full = out.tolist()
    tokens = [until_stop(full[b], stops) for b in range(B)]
    extra = {"policy": cfg.policy.name, "block_size": k, "accepts": dict(sorted(histogram.items())),
             "compiled": bool(compile), "static_cache": kv.capacity if kv.static else None,
             "row_extra": [{"policy": cfg.policy.name, "block_size": k, "accepts": a} for a in accepts]}
    stats = DecodeStats(nfe=nfe, nfe_per_row=nfe_rows.tolist(), tokens_per_row=[len(t) for t in tokens],
                        seconds=time.perf_counter() - t0, extra=extra,
                        stops_per_row=stop_flags(full, tokens, stops.tolist()))
    return DecodeOutput(tokens=tokens, stats=stats)


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


def _lossless(verify, given: list[str], draft, defaults: dict) -> bool:
    """Whether this call runs lossless SBD. Raises UnmaskError for contradicting options."""
    if verify is not None and not isinstance(verify, bool):
        raise UnmaskError(f"verify must be true or false (got {verify!r}); pass --verify or --no-verify")
    if verify and given:
        raise UnmaskError(f"{', '.join(given)} set a lossy commit policy, which lossless SBD (--verify) does not use; "
                          "drop them or pass --no-verify")
    lossless = verify if verify is not None else (not given and bool(defaults.get("verify", False)))
    if draft is not None and not lossless:
        raise UnmaskError("--draft applies to lossless SBD only; add --verify or drop --draft")
    return lossless


def until_stop(row: list[int], stops: torch.Tensor) -> list[int]:
    """The generated ids of ``row`` before its first stop token (or -1, an undecoded position)."""
    stop_set = set(stops.tolist())
    out = []
    for t in row:
        if t < 0 or t in stop_set:
            break
        out.append(t)
    return out


def _hit_stop_string(bundle, prompts, out, stop_strings) -> torch.Tensor:
    hit = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    for b in range(out.shape[0]):
        text = bundle.decode_continuation(prompts[b], [t for t in out[b].tolist() if t >= 0])
        hit[b] = any(s in text for s in stop_strings)
    return hit
