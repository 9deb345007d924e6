"""SingleBD: block-diffusion decoding one block at a time over an exact prefix KV cache
(multiblock.md §1.2).

Blocks are aligned to absolute position 0 of every row (position 0 = the row's first prompt
token), as in block-causal training. Prefill covers the prompt's **whole** blocks only; the
prompt's tail (``len(prompt) % B`` tokens) sits, fixed, at the start of the first decoded block,
followed by masks (SDAR's ``generate``; multiblock.md §3.2). Each block is denoised by forwarding
its B tokens against the cache (block-causal: the block sees the prefix and itself) and letting
the commit policy reveal at least one mask per forward. The prefix never attends forward, so
once a finished block's clean K/V are written they are final and the cache is exact (§1.1).

Storing a finished block's K/V (§1.2 step 4), ``store=``:

- ``"separate"`` (default): one extra forward over the clean block, the "storing bubble" of
  Diffulex SingleBD. It **counts as a forward** (NFE), so TPF matches MBD's SingleBD numbers;
  ``stats.extra["store_forwards"]`` says how many there were.
- ``"fused"``: the next block's first forward carries the finished block too (2B query tokens,
  ``block_buffer_mask(past, 2, B)``), as SBD Alg. 3 does; its K/V are kept, the new block's
  cropped.

The last block of a row is never stored (nothing follows it). Positions past ``max_new_tokens``
in the last block stay ``[MASK]``, are never decoded, and never reach the output.

The decoding is :class:`unmask.decode.blocks.batch.BlockDecoder`, the one running batch SingleBD shares
with lossy SBD and that the server runs; :func:`decode` drains it (:func:`run_blocks`). Its cache
is a :mod:`unmask.decode.engine.kv` object: a growing ``DynamicCache`` by default, or (``static=True`` /
``compile=True``) a ``StaticCache`` sized once per batch whose length pointer moves on every crop,
with the block forwards (B or 2B queries) through a ``torch.compile``-d step
(:func:`unmask.decode.engine.static.step_function`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unmask.decode.engine.batching import left_pad
from unmask.decode.dllm.canvas import drain_prompts, event_hook, serving_options
from unmask.decode.engine.stats import DecodeOutput
from unmask.errors import UnmaskError, is_int
from unmask.masks import as_4d, block_buffer_mask, block_causal_mask, with_key_padding
from unmask.policies import CONFIDENCES, Policy, Threshold, gamma_option, make_policy
from unmask.sampling import Sampling, filter_logits
from unmask.decode.engine.knobs import PolicyKnobs
from unmask.decode.engine.registry import Spec, knob

DEFAULT_TAU = 0.95  # τ_M2T of every SingleBD row of multiblock.md Table 4 (LLaDA2-Mini, SDAR)
STORES = ("separate", "fused")
# Published reference decodings (``schedule=``): the quota-threshold rule with steps = block size and
# this τ. "llada2": LLaDA2.0's ``generate`` (block 32, steps 32, threshold 0.95; models.md §2.6);
# "sdar": SDAR's ``block_diffusion_generate`` with ``low_confidence_dynamic`` (threshold 0.85, §2.5).
SCHEDULES = {"llada2": 0.95, "sdar": 0.85}


def block_quota(block_size: int, steps: int, s: int) -> int:
    """Tokens to commit at denoising step s of a block (LLaDA2 ``_get_num_transfer_tokens``): the
    block size spread over ``steps``, the first ``block_size % steps`` steps taking one more."""
    base, rem = divmod(block_size, steps)
    return base + int(min(s, steps - 1) < rem)


def quota_threshold_commit(logits: torch.Tensor, masked: torch.Tensor, tau: float, quota: int,
                           sampling: Sampling, generator: torch.Generator | list | None,
                           confidence: str | None = None):
    """The LLaDA2 ``generate`` / SDAR ``low_confidence_dynamic`` commit rule (multiblock.md §1.2 step 3).

    logits (R, B, V); masked (R, B) bool. Tokens are the argmax (temperature 0) or a draw from
    softmax(logits / T) after top-k then top-p filtering. κ is the chosen token's probability
    under the same filtering of softmax(logits) (``confidence`` None or "untempered", the default: as
    T → 0 the rule tends to its T = 0 one) or, as the published code does, of softmax(logits / T)
    (``"tempered"``: at T = 0.1 most κ round to 1.0 and a block commits at once). A row commits
    every masked position with κ > τ (strict) when there are at least ``quota`` of them, else its
    ``quota`` most confident masked positions.
    (The published ``generate`` draws from softmax(logits) even at temperature 0; here 0 is greedy.)
    Returns (chosen (R, B) bool, tokens (R, B) long).
    """
    R, B, V = logits.shape
    z = logits.float()
    if sampling.temperature > 0:
        z = z / sampling.temperature
    kept = filter_logits(z, sampling.top_k, sampling.top_p)  # (R, B, V), -inf outside top-k / top-p
    probs = kept.softmax(-1)  # (R, B, V)
    if sampling.temperature > 0 and isinstance(generator, (list, tuple)):  # one generator per row
        tokens = torch.stack([torch.multinomial(probs[r], 1, generator=g)[:, 0] for r, g in enumerate(generator)])
    elif sampling.temperature > 0:
        tokens = torch.multinomial(probs.reshape(R * B, V), 1, generator=generator).reshape(R, B)
    else:
        tokens = probs.argmax(-1)  # (R, B)
    if confidence is not None and confidence not in CONFIDENCES:
        raise UnmaskError(f"confidence must be one of {', '.join(CONFIDENCES)} (got {confidence!r})")
    if sampling.temperature > 0 and confidence != "tempered":
        probs = logits.float().masked_fill(kept == float("-inf"), float("-inf")).softmax(-1)  # (R, B, V), same support
    conf = probs.gather(-1, tokens[..., None])[..., 0].masked_fill(~masked, float("-inf"))  # (R, B)
    high = (conf > tau) & masked  # (R, B)
    k = masked.sum(dim=1).clamp(max=quota)  # (R,)
    order = conf.argsort(dim=1, descending=True, stable=True)  # (R, B)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(B, device=order.device).expand(R, B))  # (R, B)
    top = (rank < k[:, None]) & masked  # (R, B)
    return torch.where((high.sum(dim=1) >= k)[:, None], high, top), tokens


def native_block_size(bundle) -> int | None:
    """The checkpoint's block size: ``bundle.block_size`` (``unmask_config.json``), else the HF
    config's ``block_size`` / ``block_length`` (remote-code block-diffusion configs), else None."""
    native = bundle.block_size
    if native is None:
        config = getattr(bundle.model, "config", None)
        native = next((getattr(config, a) for a in ("block_size", "block_length")
                       if isinstance(getattr(config, a, None), int)), None)
    if native is not None and (not isinstance(native, int) or isinstance(native, bool) or native < 1):
        raise UnmaskError(f"the checkpoint's block size {native!r} is not an integer >= 1; fix \"block_size\" "
                          "in its unmask_config.json")
    return native


def resolve_block_size(bundle, block_size: int | None) -> int:
    """The block size B to decode with: the checkpoint's (:func:`native_block_size`), which an
    explicit ``block_size`` must equal. Raises UnmaskError on a mismatch, a bad value or when
    neither is known."""
    native = native_block_size(bundle)
    if block_size is not None:
        if not is_int(block_size) or block_size < 1:
            raise UnmaskError(f"block size must be an integer >= 1 (got {block_size!r}); "
                              "drop --block-size to use the checkpoint's")
        if native is not None and block_size != native:
            raise UnmaskError(f"--block-size {block_size} disagrees with the checkpoint's block size {native}; "
                              "a block-diffusion model decodes only with the block size it was trained with, "
                              "drop --block-size")
        B = block_size
    elif native is None:
        raise UnmaskError("this block-diffusion model records no block size; pass --block-size or add "
                          "\"block_size\" to its unmask_config.json")
    else:
        B = int(native)
    if B > bundle.context_length:
        raise UnmaskError(f"block size {B} exceeds the context window of {bundle.context_length}; "
                          "use a model trained with a smaller block")
    return B


def check_block_model(bundle, decoder: str) -> None:
    if bundle.kind != "block-diffusion" or bundle.mask_token_id is None:
        raise UnmaskError(f"the {decoder} decoder needs a block-diffusion model with a mask token "
                          f"(this one is {bundle.kind!r}); use --decoder ar or load a block-diffusion model")


def whole_prompt_blocks(prompts: list[list[int]], B: int) -> int:
    """F: the prefill width, the longest prompt's whole blocks in tokens (rows are left-padded to it)."""
    return max(len(p) // B for p in prompts) * B


def prefill_whole_blocks(kv, prompts: list[list[int]], B: int, pad_id: int, device):
    """Prefill each row's whole prompt blocks block-causally into ``kv`` (multiblock.md §3.2 step 1).

    kv: an empty :mod:`unmask.decode.engine.kv` cache (DynamicKV or StaticKV). Rows are left-padded to the
    longest prefilled part, F = :func:`whole_prompt_blocks`; every row's pad is a multiple of B, so
    one block-causal mask over the padded columns is right for every row. The forward's length
    depends on the prompts, so it runs eagerly (``compiled=False``). Returns (kv, key_valid (R, F)
    bool, n_full (R,) long: whole prompt blocks per row). With F = 0 no forward runs.
    """
    n_full = [len(p) // B for p in prompts]
    heads = [p[: n * B] for p, n in zip(prompts, n_full)]
    n_full_t = torch.tensor(n_full, dtype=torch.long, device=device)
    if max(len(h) for h in heads) == 0:
        return kv, torch.zeros((len(prompts), 0), dtype=torch.bool, device=device), n_full_t
    ids, valid, pos = left_pad(heads, pad_id, device)  # (R, F) each
    R, F = ids.shape
    mask = with_key_padding(as_4d(block_causal_mask(F, B, device=device), R), valid)  # (R, 1, F, F)
    kv.forward(ids, pos, mask, logits_to_keep=1, compiled=False)
    return kv, valid, n_full_t


def window_mask(key_valid: torch.Tensor, past: int, n_slots: int, B: int) -> torch.Tensor:
    """The mask of a forward of ``n_slots`` blocks after ``past`` cached keys: (R, 1, q, past + q)
    bool, q = n_slots·B. Equals ``with_key_padding(block_buffer_mask(past, n_slots, B), key_valid)``
    (multiblock.md §3.1: each block sees the valid cached keys, earlier blocks and itself) when the
    query columns ``key_valid[:, past:past + q]`` are True: no query row is then left empty.
    key_valid (R, C >= past + q) bool."""
    R, q = key_valid.shape[0], n_slots * B
    m = key_valid[:, None, None, : past + q].expand(R, 1, q, past + q).clone()  # (R, 1, q, past + q)
    m[..., past:] &= block_buffer_mask(0, n_slots, B, device=key_valid.device)  # (q, q) block-causal window
    return m


def window_forward(kv, key_valid: torch.Tensor, inp: torch.Tensor, positions: torch.Tensor, n_slots: int, B: int,
                   **kw) -> torch.Tensor:
    """One forward of ``n_slots`` blocks (inp, positions (R, n_slots*B)) after the cache, masked by
    :func:`window_mask`. Marks the query columns of ``key_valid`` (R, capacity) valid; the caller
    crops and records which kept columns are real. Returns ``kv.forward``'s logits."""
    past = kv.length
    key_valid[:, past: past + n_slots * B] = True
    return kv.forward(inp, positions, window_mask(key_valid, past, n_slots, B), **kw)


def check_cache_flags(compile, static) -> None:
    """Raise a one-line UnmaskError unless ``compile`` and ``static`` are True or False."""
    for name, value in (("compile", compile), ("static", static)):
        if not isinstance(value, bool):
            raise UnmaskError(f"{name} must be True or False (got {value!r}); pass {name}=True")


def first_stop(seq: torch.Tensor, gen_start: torch.Tensor, gen_end: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """(R,) long: position of the first generated stop token per row, ``seq.shape[1]`` if none."""
    L = seq.shape[1]
    pos = torch.arange(L, device=seq.device)  # (L,)
    hit = torch.isin(seq, stops) & (pos >= gen_start[:, None]) & (pos < gen_end[:, None])  # (R, L)
    return torch.where(hit.any(dim=1), hit.float().argmax(dim=1), torch.full_like(gen_start, L))


def outputs(seq: torch.Tensor, gen_start: torch.Tensor, max_new_tokens: int, stops: torch.Tensor,
            mask_id: int) -> list[list[int]]:
    """Generated ids per row, cut before the first stop token (or an undecoded mask)."""
    stop_set = set(stops.tolist())
    out = []
    for r in range(seq.shape[0]):
        s = int(gen_start[r])
        row = []
        for t in seq[r, s: s + max_new_tokens].tolist():
            if t in stop_set or t == mask_id:
                break
            row.append(t)
        out.append(row)
    return out


def hit_stop_string(bundle, prompts, tokens: list[list[int]], rows: torch.Tensor, stop_strings) -> torch.Tensor:
    """(R,) bool: rows (among ``rows``) whose decoded continuation contains a stop string."""
    hit = torch.zeros_like(rows)
    for r in torch.nonzero(rows).flatten().tolist():
        text = bundle.decode_continuation(prompts[r], tokens[r])
        hit[r] = any(s in text for s in stop_strings)
    return hit


@dataclass(frozen=True)
class BlockConfig:
    """SingleBD settings: block size B (the checkpoint's), the commit policy (default ``threshold``
    τ = 0.95, multiblock.md §3.5 SingleBD rows) and the store mode (§1.2 step 4).

    The threshold rule here is strict, κ > τ (plus the top-1), as in SDAR / Diffulex and in
    ``multiblock``'s M2T, so ``block`` equals ``multiblock --slots 1`` even on exact ties; the
    dLLM decoders keep Fast-dLLM's inclusive κ ≥ τ (diffusion.md §6)."""

    block_size: int
    policy: Policy = Threshold(DEFAULT_TAU, strict=True)
    store: str = "separate"
    steps: int | None = None

    def __post_init__(self):
        if self.steps is not None and (not is_int(self.steps) or not 1 <= self.steps <= self.block_size):
            raise UnmaskError(f"steps must be an integer in 1..{self.block_size} (the block size), got {self.steps!r}; "
                              f"use {self.block_size} for one token per step")
        if not is_int(self.block_size) or self.block_size < 1:
            raise UnmaskError(f"block size must be an integer >= 1 (got {self.block_size!r}); "
                              "drop --block-size to use the checkpoint's")
        if self.store not in STORES:
            raise UnmaskError(f"store must be one of {', '.join(STORES)} (got {self.store!r}); pick one of those")

    @classmethod
    def from_options(cls, bundle, *, block_size=None, policy=None, tau=None, gamma=None, preset=None, factor=None,
                     tokens_per_step=None, store=None, steps=None, schedule=None) -> "BlockConfig":
        """Build from CLI-style options; raises UnmaskError for invalid values or combinations.

        ``schedule`` ("llada2", "sdar") or ``steps`` select the published quota-threshold rule
        (:func:`quota_threshold_commit`, threshold policy only); ``schedule`` sets τ and steps = B
        unless they are given."""
        if schedule is not None:
            if schedule not in SCHEDULES:
                raise UnmaskError(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
            tau = SCHEDULES[schedule] if tau is None else tau
        if (schedule is not None or steps is not None) and policy not in (None, "threshold"):
            raise UnmaskError(f"--schedule/--steps use the quota-threshold rule, not policy {policy!r}; drop --policy")
        if schedule is not None and steps is None:
            steps = resolve_block_size(bundle, block_size)
        name = policy or "threshold"
        gamma = gamma_option(gamma, preset)
        if name == "threshold" and tau is None:
            tau = DEFAULT_TAU
        params = {"gamma": gamma, "tau": tau, "f": factor, "k": tokens_per_step}
        built = make_policy(name, **{k: v for k, v in params.items() if v is not None})
        if isinstance(built, Threshold) and steps is None:  # κ > τ, as multiblock's M2T and SDAR (multiblock.md §1.2)
            built = Threshold(built.tau, strict=True)
        return cls(block_size=resolve_block_size(bundle, block_size), policy=built, store=store or "separate",
                   steps=steps)


POLICY_OPTIONS = ("policy", "gamma", "preset", "tau", "factor", "tokens_per_step")
BATCH_OPTIONS = ("block_size", *POLICY_OPTIONS, "store", "steps", "schedule")  # the server keys batches by them


def serving_batch(bundle, options: dict | None = None, *, capacity: int = 8, on_step=None, on_token=None,
                  stop_token_ids=None, compile: bool = False, static: bool = False):
    """The server's running batch of SingleBD rows for one set of request ``options``
    (:data:`BATCH_OPTIONS`; None = default), validated once: :func:`serving`
    (``compile`` / ``static``: on a static KV cache). ``stop_token_ids`` defaults to the bundle's.
    Raises UnmaskError for a model that is not block-diffusion, an unknown option or a bad value."""
    check_block_model(bundle, "block")
    options = serving_options(options, BATCH_OPTIONS, "a continuous block batch")
    return serving(bundle, BlockConfig.from_options(bundle, **options), capacity=capacity, on_step=on_step,
                   on_token=on_token, stop_token_ids=stop_token_ids, compile=compile, static=static)


def serving(bundle, cfg, *, capacity: int, on_step, on_token, stop_token_ids, compile: bool = False,
            static: bool = False):
    """The server's running :class:`~unmask.decode.blocks.batch.BlockDecoder` for ``cfg``: rows move on at
    once (no lockstep); with ``static`` / ``compile`` a static KV cache of the context window and
    three blocks of slack that rows join mid-flight, new step shapes compiled when the server is
    idle (``defer_compile``)."""
    from unmask.decode.blocks.batch import BlockDecoder

    length = bundle.context_length + 3 * cfg.block_size if static or compile else None
    return BlockDecoder(bundle, cfg, capacity=capacity, on_step=on_step, on_token=on_token, static=static,
                        compile=compile, stop_token_ids=stop_token_ids, length=length, defer_compile=compile)


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (), block_size: int | None = None,
           policy: str | None = None, tau: float | None = None, gamma: float | str | None = None,
           preset: str | None = None, factor: float | None = None, tokens_per_step: int | None = None,
           store: str | None = None, steps: int | None = None, schedule: str | None = None, on_forward=None,
           on_step=None, compile: bool = False, static: bool = False) -> DecodeOutput:
    """SingleBD decoding of a batch (multiblock.md §1.2) with an exact block KV cache.

    ``schedule="llada2"`` reproduces LLaDA2.0's ``generate`` (block 32, 32 steps, τ 0.95) and
    ``schedule="sdar"`` SDAR's ``low_confidence_dynamic`` (τ 0.85, steps = B): at step s of a
    block the quota is :func:`block_quota`, and :func:`quota_threshold_commit` commits (``steps``
    alone selects the same rule with the threshold policy's τ). As in those loops, the last block
    is denoised whole, past ``max_new_tokens``, before the output is cut.

    prompts: token ids per row (left-padded internally). Rows advance block by block in lockstep
    (block j of a row is its j-th decoded block); a row whose block is complete waits, and its NFE
    counts only forwards in which it still had masks, plus the store forwards of its blocks. A
    row ends after the block that commits a stop token (tokens from the stop on are dropped), on a
    stop string, or at ``max_new_tokens``. ``on_forward(state)`` (tests) sees every forward.
    ``on_step(event)`` (``unmask.trace`` contract) gets one event per row per denoising forward:
    ``step``, ``row``, ``block`` (absolute block index), ``positions`` / ``tokens`` committed
    (generated indices), ``canvas`` (the generated region, None where masked). Store forwards
    commit nothing and send no event.

    ``compile=True`` takes the fast path: a static KV cache of L = F + (blocks + 1)·B positions
    (F the prefilled prompt blocks, rounded up to ``LENGTH_BUCKET``) allocated once, whose pointer
    moves instead of cropping, and the block forwards (R, B) and fused (R, 2B) through a
    ``torch.compile``-d step (inductor on CPU, CUDA graphs on CUDA;
    :func:`unmask.decode.engine.static.step_function`); the prefill runs eagerly. ``static=True`` runs on
    the preallocated static cache without compiling: what compile runs, eagerly (tests,
    debugging). Both give the eager tokens, NFE and accepts; every forward's mask covers the
    whole cache (R, 1, q, L).

    NFE versus reference code (SDAR, Diffulex SingleBD): the last block's store forward is not
    run (its K/V would never be read), so NFE is one less per row than theirs; and a row stops
    after the block holding its first stop token, where reference code decodes to the end: pass
    ``stop_token_ids=()`` to reproduce their NFE.

    Returns DecodeOutput; stats.extra holds ``policy``, ``block_size``, ``store``,
    ``store_forwards`` (the batch's store-only forwards, already inside ``nfe``), ``accepts``
    (histogram: tokens committed per row per forward -> count) and ``row_extra`` (per row:
    ``accepts`` per denoising forward, ``store_forwards``), and on the static path ``compiled`` and
    ``static_cache`` (L). ``on_forward`` states carry ``cache``: per layer (keys, values) (R, H,
    length, D) copies. Raises UnmaskError for a model that is not block-diffusion, a block size that
    disagrees with the checkpoint's, bad policy options, or ``compile`` / ``static`` not a bool.
    """
    check_block_model(bundle, "block")
    check_cache_flags(compile, static)
    cfg = BlockConfig.from_options(bundle, block_size=block_size, policy=policy, tau=tau, gamma=gamma, preset=preset,
                                   factor=factor, tokens_per_step=tokens_per_step, store=store, steps=steps,
                                   schedule=schedule)
    return run_blocks(bundle, cfg, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                      stop_token_ids=stop_token_ids, stop_strings=stop_strings, on_forward=on_forward, on_step=on_step,
                      compile=compile, static=static)


def run_blocks(bundle, cfg, prompts, *, max_new_tokens, sampling, stop_token_ids, stop_strings, on_forward, on_step,
               compile, static) -> DecodeOutput:
    """``decode()`` of SingleBD or lossy SBD: :func:`unmask.decode.engine.running.drain` of a lockstep
    :class:`~unmask.decode.blocks.batch.BlockDecoder` (``cfg`` a BlockConfig or an SBDConfig)."""
    from unmask.decode.blocks.batch import BlockDecoder

    def make(capacity):
        return BlockDecoder(bundle, cfg, static=static, compile=compile, capacity=capacity, lockstep=True,
                            on_step=event_hook(on_step), on_forward=on_forward, stop_token_ids=tuple(stop_token_ids))

    return drain_prompts(make, bundle, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                         stop_strings=stop_strings)


@dataclass(frozen=True)
class BlockOptions(PolicyKnobs):
    """SingleBD's knobs: the block, its commit policy (default threshold τ 0.95) and a published
    reference schedule (spec/multiblock.md)."""

    block_size: int | None = knob("block size (default: the model's native block)", low=1, short="-k")
    steps: int | None = knob("denoising steps per block (LLaDA2 / SDAR reference schedules)", low=1)
    schedule: str | None = knob("a published reference decoding: llada2 or sdar (their generate loops)",
                                choices=tuple(SCHEDULES))
    store: str | None = knob("how committed blocks enter the KV cache: separate or fused", choices=STORES,
                             cli=False)


SPEC = Spec("block", BlockOptions, batch=lambda bundle, cfg, **kw: serving_batch(bundle, cfg.given(), **kw), kinds=("block-diffusion",), compiles=True, run=decode,
            summary="SingleBD: one block at a time over an exact block-causal KV cache")
