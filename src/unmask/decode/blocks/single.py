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
with lossy SBD, that ``decode()`` drains and the server runs (:data:`SPEC`; its caches: :func:`batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from unmask.decode.blocks.batch import BlockDecoder, running_batch
from unmask.decode.blocks.rule import SINGLE_BD
from unmask.decode.engine.knobs import PolicyKnobs
from unmask.decode.engine.registry import Spec, knob
from unmask.errors import UnmaskError, check_choice, is_int
from unmask.policies import Policy, Threshold, gamma_option, make_policy

DEFAULT_TAU = 0.95  # τ_M2T of every SingleBD row of multiblock.md Table 4 (LLaDA2-Mini, SDAR)
STORES = ("separate", "fused")
# Published reference decodings (``schedule=``): the quota-threshold rule with steps = block size and
# this τ. "llada2": LLaDA2.0's ``generate`` (block 32, steps 32, threshold 0.95; models.md §2.6);
# "sdar": SDAR's ``block_diffusion_generate`` with ``low_confidence_dynamic`` (threshold 0.85, §2.5).
SCHEDULES = {"llada2": 0.95, "sdar": 0.85}


def native_block_size(bundle) -> int | None:
    """The checkpoint's block size: ``bundle.block_size`` (``unmask_config.json``), else the HF
    config's ``block_size`` / ``block_length`` (remote-code block-diffusion configs), else None."""
    native = bundle.block_size
    if native is None:
        config = getattr(bundle.model, "config", None)
        native = next((getattr(config, a) for a in ("block_size", "block_length")
                       if isinstance(getattr(config, a, None), int)), None)
    if native is not None and (not is_int(native) or native < 1):
        raise UnmaskError(f"the checkpoint's block size {native!r} is not an integer >= 1; fix \"block_size\" "
                          "in its unmask_config.json")
    return native


def resolve_block_size(bundle, block_size: int | None) -> int:
    """The block size B to decode with: the checkpoint's (:func:`native_block_size`), which an
    explicit ``block_size`` must equal. Raises UnmaskError on a mismatch, a bad value or when
    neither is known."""
    native = native_block_size(bundle)
    if block_size is None and native is None:
        raise UnmaskError("this block-diffusion model records no block size; pass --block-size or add "
                          "\"block_size\" to its unmask_config.json")
    if block_size is not None and (not is_int(block_size) or block_size < 1):
        raise UnmaskError(f"block size must be an integer >= 1 (got {block_size!r}); "
                          "drop --block-size to use the checkpoint's")
    if block_size is not None and native is not None and block_size != native:
        raise UnmaskError(f"--block-size {block_size} disagrees with the checkpoint's block size {native}; "
                          "a block-diffusion model decodes only with the block size it was trained with, "
                          "drop --block-size")
    B = int(native) if block_size is None else block_size
    if B > bundle.context_length:
        raise UnmaskError(f"block size {B} exceeds the context window of {bundle.context_length}; "
                          "use a model trained with a smaller block")
    return B


def check_block_model(bundle, decoder: str) -> None:
    """Raise a one-line UnmaskError unless ``bundle`` is a block-diffusion model with a mask token."""
    if bundle.kind != "block-diffusion" or bundle.mask_token_id is None:
        raise UnmaskError(f"the {decoder} decoder needs a block-diffusion model with a mask token "
                          f"(this one is {bundle.kind!r}); use --decoder ar or load a block-diffusion model")


@dataclass(frozen=True)
class BlockConfig:
    """SingleBD settings: block size B (the checkpoint's), the commit policy (default ``threshold``
    τ = 0.95, multiblock.md §3.5 SingleBD rows) and the store mode (§1.2 step 4).

    The threshold rule here is strict, κ > τ (plus the top-1), as in SDAR / Diffulex and in
    ``multiblock``'s M2T, so ``block`` equals ``multiblock --slots 1`` even on exact ties; the
    dLLM decoders keep Fast-dLLM's inclusive κ ≥ τ (diffusion.md §6)."""

    kind: ClassVar = SINGLE_BD  # the BlockDecoder's blocks: aligned to position 0, a block-causal store
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


@dataclass(frozen=True)
class BlockOptions(PolicyKnobs):
    """SingleBD's knobs: the block, its commit policy (default threshold τ 0.95) and a published
    reference schedule (spec/multiblock.md). :meth:`resolve` turns them into a :class:`BlockConfig`."""

    block_size: int | None = knob("block size (default: the model's native block)", low=1, short="-k")
    steps: int | None = knob("denoising steps per block (LLaDA2 / SDAR reference schedules)", low=1)
    schedule: str | None = knob("a published reference decoding: llada2 or sdar (their generate loops)",
                                choices=tuple(SCHEDULES))
    store: str | None = knob("how committed blocks enter the KV cache: separate or fused", choices=STORES,
                             cli=False)

    def resolve(self, bundle) -> BlockConfig:
        """The config these options decode ``bundle`` with: the checkpoint's block size
        (:func:`resolve_block_size`), the commit policy (default ``threshold`` τ = 0.95, strict), the
        store mode (default ``separate``). ``schedule`` ("llada2", "sdar") or ``steps`` select the
        published quota-threshold rule (:func:`~unmask.decode.blocks.rule.quota_threshold_commit`,
        threshold policy only); ``schedule`` sets τ and steps = B unless they are given. Raises
        UnmaskError for a model that is not block-diffusion, invalid values or combinations."""
        check_block_model(bundle, "block")
        policy, tau, steps, schedule = self.policy, self.tau, self.steps, self.schedule
        if schedule is not None:
            check_choice("schedule", schedule, SCHEDULES)
            tau = SCHEDULES[schedule] if tau is None else tau
        if (schedule is not None or steps is not None) and policy not in (None, "threshold"):
            raise UnmaskError(f"--schedule/--steps use the quota-threshold rule, not policy {policy!r}; drop --policy")
        B = resolve_block_size(bundle, self.block_size)
        if schedule is not None and steps is None:
            steps = B
        name = policy or "threshold"
        if name == "threshold" and tau is None:
            tau = DEFAULT_TAU
        params = {"gamma": gamma_option(self.gamma, self.preset), "tau": tau, "f": self.factor,
                  "k": self.tokens_per_step}
        built = make_policy(name, **{k: v for k, v in params.items() if v is not None})
        if isinstance(built, Threshold) and steps is None:  # κ > τ, as multiblock's M2T and SDAR (multiblock.md §1.2)
            built = Threshold(built.tau, strict=True)
        return BlockConfig(block_size=B, policy=built, store=self.store or "separate", steps=steps)


def batch(bundle, options: BlockOptions, **kw) -> BlockDecoder:
    """SingleBD's running batch (:func:`~unmask.decode.blocks.batch.running_batch`, ``kw`` as it
    takes them) of ``options`` resolved once (:meth:`BlockOptions.resolve`).

    ``decode()`` (``prompts`` given) runs it in lockstep: block j of a row is its j-th decoded block;
    a row whose block is complete waits, and its NFE counts only forwards in which it still had
    masks, plus the store forwards of its blocks. A row ends after the block that commits a stop
    token (tokens from the stop on are dropped), on a stop string, or at ``max_new_tokens``;
    ``schedule`` runs denoise the last block whole, past ``max_new_tokens``, before the output is
    cut. ``on_step`` gets one event per row per denoising forward: ``step``, ``row``, ``block``
    (absolute block index), ``positions`` / ``tokens`` committed (generated indices), ``canvas``
    (the generated region, None where masked); store forwards send none. ``compile=True``: a
    static KV cache of F + (blocks + 1)·B positions (F the prefilled prompt blocks, rounded up to
    ``LENGTH_BUCKET``) whose pointer moves instead of cropping, the block forwards (R, B) and fused
    (R, 2B) ``torch.compile``-d, the prefill eager; ``static=True``: that cache, eagerly. Both give
    the eager tokens, NFE and accepts.

    NFE versus reference code (SDAR, Diffulex SingleBD): the last block's store forward is not run
    (its K/V would never be read), so NFE is one less per row than theirs; and a row stops after
    the block holding its first stop token, where reference code decodes to the end: pass
    ``stop_token_ids=()`` to reproduce their NFE.

    stats.extra: ``policy``, ``block_size``, ``store``, ``store_forwards`` (store-only forwards, inside
    ``nfe``), ``steps``, ``accepts`` (histogram: tokens committed per row per forward -> count),
    ``row_extra`` (per row: ``accepts`` per denoising forward, ``store_forwards``), and on the static
    path ``compiled`` and ``static_cache`` (L). ``on_forward`` states carry ``cache``: per layer (keys,
    values) (R, H, length, D) copies. Raises UnmaskError as :meth:`BlockOptions.resolve` does, or for
    ``compile`` / ``static`` not a bool."""
    return running_batch(bundle, options.resolve(bundle), **kw)


SPEC = Spec("block", BlockOptions, batch=batch, kinds=("block-diffusion",), compiles=True,
            summary="SingleBD: one block at a time over an exact block-causal KV cache")

__all__ = ["BlockConfig", "BlockOptions", "DEFAULT_TAU", "SCHEDULES", "SPEC", "STORES", "batch", "check_block_model",
           "native_block_size", "resolve_block_size"]
