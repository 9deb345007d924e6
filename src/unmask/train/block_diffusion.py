"""Block-diffusion training from a causal checkpoint (multiblock.md §1.3): the teacher-forcing
objective of :mod:`unmask.train.dual_stream` run by the training loop on a base model that gains a
mask token.

:func:`train_block_diffusion` turns a causal checkpoint into a block-diffusion one (adds the mask
token) and publishes a directory with ``unmask_config.json`` ``{"kind": "block-diffusion",
"block_size": B, "mask_token_id": ..., "stop_token_ids": [...]}``. :func:`fit` is the wiring it
shares with MultiTF post-training (:mod:`unmask.train.multitf`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.train.dual_stream import (  # noqa: F401  (re-exported: recipes and benchmarks import them from here)
    IGNORE, IPW_EPS, LOSSES, NOISES, ROUNDINGS, TFObjective, dual_stream_inputs, iid_ratios, ipw_weights, mask_by_ratio,
    mask_counts, maskable_positions, masked_ce_loss, pack_aligned, row_tokens, weighted_mean_nll)
from unmask.train.wiring import holds_output_locks

BD_FORMAT_VERSION = 1


def load_base(base: str, dtype: str, *, block_size: int | None, allow_causal: bool):
    """Load ``base`` for block-diffusion training -> (bundle, mask_id, block_size).

    A causal LM gets a new mask token (``add_mask_token``; only with ``allow_causal``); a
    block-diffusion model keeps its mask token and block size, which ``block_size`` must equal.

    Raises:
        UnmaskError: another kind, a model that is not a decoder-only causal LM class, a
            block-diffusion base without a block size, or a block size that disagrees.
    """
    from unmask.models import load
    from unmask.models.mask_token import add_mask_token

    bundle = load(base, dtype=dtype)
    cls = type(bundle.model).__name__
    causal_lm = any(c.__name__.endswith("ForCausalLM") for c in type(bundle.model).__mro__)  # incl. LLaDA2MoeModelLM
    if not causal_lm or getattr(bundle.model.config, "is_encoder_decoder", False):
        raise UnmaskError(f"base {base!r} is a {cls}, not a decoder-only LM; pass one with --base (Llama, Qwen2, "
                          "Qwen3, ...)")
    allowed = ("causal", "block-diffusion") if allow_causal else ("block-diffusion",)
    if bundle.kind not in allowed:
        what = "a causal LM or a block-diffusion model" if allow_causal else "a block-diffusion model (TF-trained)"
        raise UnmaskError(f"base {base!r} is a {bundle.kind} model; this training needs {what}, pass one with "
                          "--base")
    if bundle.kind == "causal":
        if block_size is None:
            raise UnmaskError("a causal base has no block size; pass --block-size B")
        return bundle, add_mask_token(bundle.model), block_size
    native = bundle.block_size
    if native is None:
        raise UnmaskError(f"block-diffusion base {base!r} records no block_size in its unmask_config.json; add "
                          "\"block_size\" there")
    if block_size is not None and block_size != native:
        raise UnmaskError(f"--block-size {block_size} disagrees with the base's block size {native}; drop it")
    return bundle, int(bundle.mask_token_id), int(native)


def fit(*, bundle, objective, base: str, data, out: str | Path, run_dir: str | Path | None, seq_len: int,
        val_fraction: float, resume: bool, overwrite: bool, device: str, progress: bool, config: dict,
        meta: dict, describe: str):
    """Pack the data, run the loop with ``objective`` and publish ``out`` atomically.

    ``meta`` goes into ``unmask_config.json`` next to the training summary. Returns the loop's
    TrainResult with ``out`` set (None when interrupted). Raises UnmaskError for bad data or
    options (before any training step).
    """
    from unmask.train.wiring import load_chunks, run_info, run_paths, train_and_publish, train_config

    cfg = train_config(config)
    paths, out, run_dir = run_paths(data, out, run_dir, resume=resume, overwrite=overwrite, base=base)
    if not 1 <= seq_len <= bundle.context_length:
        raise UnmaskError(f"--seq-len {seq_len} must be between 1 and the model's context of "
                          f"{bundle.context_length} tokens; pass a --seq-len in that range")
    row_tokens(torch.zeros((1, seq_len + 1), dtype=torch.long), objective.block_size, objective.prompt_len)
    vocab = bundle.model.get_input_embeddings().weight.shape[0]
    # (N, L+1), (M, L+1)
    train_chunks, val_chunks = load_chunks(paths, bundle.tokenizer, vocab, pack_aligned, seq_len, need=seq_len + 1,
                                           val_fraction=val_fraction, seed=cfg.seed, config=bundle.model.config)
    info = run_info(seq_len, paths, train_chunks, val_chunks, cfg, objective=describe,
                    objective_config={k: v for k, v in asdict(objective).items() if k not in ("name", "term_names")})
    meta = {**meta, "stop_token_ids": list(bundle.stop_token_ids), "base": base, "version": BD_FORMAT_VERSION}
    return train_and_publish(bundle, objective, train_chunks, val_chunks, cfg, run_dir, out, info=info, meta=meta,
                             device=device, resume=resume, progress=progress, overwrite=overwrite)


@holds_output_locks
def train_block_diffusion(*, base: str, data, out: str | Path, block_size: int | None = None,
                          run_dir: str | Path | None = None, seq_len: int = 256, t_low: float = 0.001,
                          t_high: float = 1.0, noise: str = "block", rounding: str = "floor", prompt_len: int = 1,
                          val_fraction: float = 0.05, resume: bool = False, overwrite: bool = False,
                          device: str = "cpu", dtype: str = "float32", progress: bool = True, **config):
    """Teacher-forcing training of a block-diffusion LM (multiblock.md §1.3); publishes ``out``.

    Args:
        base: shipped name or local HF directory of a decoder-only causal LM (a mask token is
            added) or of a block-diffusion model to continue (its mask token and block size kept).
        data: one or more ``.txt`` / ``.jsonl`` files (``unmask.train.data.read_documents``).
        out: final model directory, written atomically when training ends (not when interrupted).
        block_size: B; required for a causal base, must match a block-diffusion base.
        seq_len: L, tokens per row (a multiple of B; a forward sees 2L).
        t_low, t_high, noise, rounding, prompt_len: see :class:`TFObjective`.
        run_dir: checkpoints and ``log.jsonl`` (default ``OUT.run``); resume / overwrite as
            ``unmask.train.sbd.train_sbd``.
        **config: :class:`~unmask.train.loop.TrainConfig` fields (lr, steps, batch_size, ...).

    Returns:
        TrainResult with ``out`` set (None when interrupted).

    Raises:
        UnmaskError: bad data or options, ``out`` exists without overwrite/resume, a base of the
            wrong kind, L not a multiple of B or beyond the context.
    """
    from unmask.train.wiring import run_paths

    run_paths(data, out, run_dir, resume=resume, overwrite=overwrite, base=base)  # paths, locks before the base
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise UnmaskError(f"--block-size must be an integer >= 1, got {block_size!r}; pass --block-size 1 or more")
    bundle, mask_id, B = load_base(base, dtype, block_size=block_size, allow_causal=True)
    objective = TFObjective(mask_token_id=mask_id, block_size=B, t_low=t_low, t_high=t_high, noise=noise,
                            rounding=rounding, prompt_len=prompt_len)
    meta = {"kind": "block-diffusion", "block_size": B, "mask_token_id": mask_id}
    return fit(bundle=bundle, objective=objective, base=base, data=data, out=out, run_dir=run_dir, seq_len=seq_len,
               val_fraction=val_fraction, resume=resume, overwrite=overwrite, device=device, progress=progress,
               config=config, meta=meta, describe="block-diffusion TF: dual-stream masked CE (multiblock.md §1.3)")
