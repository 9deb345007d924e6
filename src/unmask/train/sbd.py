"""Fine-tune a causal LM into a Set Block Decoding model (spec/sbd.md §2–§3).

:func:`train_sbd` adds the mask token (Option A, §2), packs the data, runs the generic loop
with the joint NTP + masked-token objective (Eq. 14) and publishes a Hugging Face directory
whose ``unmask_config.json`` makes ``unmask.load(out)`` return kind ``sbd`` and records lossless
SBD (linear drafts, K = 8) as its decoding default; ``unmask calibrate-drafts`` replaces that with
the model's own budgeted layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from unmask.decode.verify.config import DEFAULT_BLOCK_SIZE, DEFAULT_DRAFT
from unmask.errors import UnmaskError
from unmask.train.loop import TrainResult
from unmask.train.objectives import SBDObjective
from unmask.train.sbd_distill import check_distill_corpus, check_distill_options
from unmask.train.wiring import (holds_output_locks, load_labelled_chunks, run_info, run_paths, train_and_publish,
                                 train_config)
from unmask.train.wiring import UNMASK_CONFIG, default_run_dir  # noqa: F401  (public here before wiring.py)

SBD_FORMAT_VERSION = 1


def _load_base(base: str, dtype: str):
    from unmask.models import load
    from unmask.models.mask_token import add_mask_token

    bundle = load(base, dtype=dtype)
    cls = type(bundle.model).__name__
    if not cls.endswith("ForCausalLM") or getattr(bundle.model.config, "is_encoder_decoder", False):
        raise UnmaskError(f"base {base!r} is a {cls}, not a decoder-only causal LM; SBD fine-tunes causal LMs, "
                          "pass one with --base (Llama, Qwen2, Qwen3, ...)")
    if bundle.kind not in ("causal", "sbd"):
        raise UnmaskError(f"base {base!r} is a {bundle.kind} model; SBD fine-tunes a causal LM (or continues an sbd "
                          "one), pass one with --base")
    vocab = bundle.model.get_input_embeddings().weight.shape[0]
    if bundle.kind == "sbd":  # continue training an SBD model: keep its mask token
        return bundle, int(bundle.mask_token_id), vocab
    return bundle, add_mask_token(bundle.model), vocab


@holds_output_locks
def train_sbd(*, base: str, data: str | Path | Sequence[str | Path], out: str | Path, run_dir: str | Path | None = None,
              seq_len: int = 256, block_range: tuple[int, int] = (2, 16), val_fraction: float = 0.05,
              answer_only: bool | None = None, eval_block_size: int = 8, resume: bool = False,
              overwrite: bool = False, device: str = "cpu", dtype: str = "float32", progress: bool = True,
              distill: bool = False, distill_lambda: float | None = None, **config) -> TrainResult:
    """Fine-tune ``base`` for SBD on ``data`` and publish the model at ``out``.

    Args:
        base: shipped model name or local HF directory of a decoder-only causal LM (or an SBD
            model to continue).
        data: one or more ``.txt`` / ``.jsonl`` files (see :func:`unmask.train.data.read_documents`).
        out: final model directory, written atomically when training ends (all steps done or
            ``max_minutes`` reached). Not written when the run is interrupted.
        run_dir: checkpoints and ``log.jsonl``; default ``OUT.run``.
        seq_len: L, tokens per training sequence (the model sees 2L per forward).
        block_range: k ~ U{low..high} per step (sbd.md §3.1).
        answer_only: train only on tokens from each record's ``loss_start`` on (None: when the
            corpus has ``loss_start``; True requires it; False trains every token).
        eval_block_size: block size of the validation's masked CE per block offset (``d0`` ...).
        dtype: ``float32`` or ``bfloat16``, the dtype the model is loaded and trained in.
        resume: continue from the newest checkpoint in ``run_dir`` (fresh start if none).
        overwrite: replace an existing ``out`` and discard ``run_dir``.
        progress: show a rich progress bar / progress lines.
        distill: self-distilled block mode (spec/sbd_exact.md §5.5): ``data`` must be a greedy
            ``unmask data distill`` corpus of ``base`` itself, and the loss adds, at every masked
            target, ``distill_lambda · KL(p_NTP ‖ p_block)`` with the NTP mode of the same forward
            as a detached teacher (:mod:`unmask.train.sbd_distill`). Pass an SBD model as
            ``base`` to fine-tune it (its mask token, decode defaults and training record carry over).
        distill_lambda: λ of the KL term (default :data:`unmask.train.sbd_distill.DEFAULT_LAMBDA`);
            only with ``distill``.
        **config: :class:`~unmask.train.loop.TrainConfig` fields (lr, steps, batch_size, ...).

    Returns:
        TrainResult with ``out`` set (None when interrupted).

    Raises:
        UnmaskError: missing/empty data, ``out`` exists without overwrite/resume, a base that is
            not a causal LM, seq_len beyond the context, data too short for one chunk, bad options,
            a ``distill`` combination
            :func:`~unmask.train.sbd_distill.check_distill_options` refuses or a corpus
            :func:`~unmask.train.sbd_distill.check_distill_corpus` refuses.
    """
    cfg = train_config(config)
    lam = check_distill_options(distill, distill_lambda, answer_only, cfg.fsdp)
    paths, out, run_dir = run_paths(data, out, run_dir, resume=resume, overwrite=overwrite, base=base)
    if distill:
        check_distill_corpus(paths, base)
    bundle, mask_id, vocab = _load_base(base, dtype)
    context = bundle.context_length
    if not 1 <= seq_len <= context:
        raise UnmaskError(f"--seq-len {seq_len} must be between 1 and the model's context of {context} tokens; "
                          "pass a --seq-len in that range")
    low, high = block_range
    if not 1 <= low <= high <= seq_len:
        raise UnmaskError(f"block range [{low}, {high}] must satisfy 1 <= low <= high <= --seq-len ({seq_len}); "
                          "pass a block_range inside it or raise --seq-len")
    if eval_block_size < 1:
        raise UnmaskError(f"--block-size {eval_block_size} must be >= 1; pass e.g. 8")
    rows = load_labelled_chunks(paths, bundle.tokenizer, vocab, seq_len, val_fraction=val_fraction, seed=cfg.seed,
                                answer_only=answer_only, config=bundle.model.config)  # (N, L+1), (M, L+1) + labels
    train_chunks, val_chunks = rows.train, rows.val
    what = "sbd: NTP + masked (Eq. 14)" if lam is None else \
        f"sbd-distill: NTP + masked (Eq. 14) + {lam:g} KL(NTP || block) on the base's greedy text (sbd_exact.md §5.5)"
    info = run_info(seq_len, paths, train_chunks, val_chunks, cfg, objective=what, answer_only=rows.answer_only,
                    dtype=dtype)
    meta = {"kind": "sbd", "mask_token_id": mask_id, "train_block_range": [low, high], "version": SBD_FORMAT_VERSION,
            "stop_token_ids": list(bundle.stop_token_ids), "base": base}
    # lossless SBD by default, as for an adapter (its greedy text is the base's AR text; the block mode
    # only sets how many tokens a forward commits); a fine-tune of an SBD model keeps its own preset
    meta["decode_defaults"] = {"verify": True, "verify_block_size": DEFAULT_BLOCK_SIZE, "draft": DEFAULT_DRAFT}
    if bundle.kind == "sbd":  # a fine-tune of an SBD model: keep its decode preset and where it came from
        meta.update({k: bundle.meta[k] for k in ("decode_defaults",) if k in bundle.meta})
        meta["init"] = {"model": base, "base": bundle.meta.get("base"), "training": bundle.meta.get("training"),
                        **({"init": bundle.meta["init"]} if "init" in bundle.meta else {})}
    objective = SBDObjective(mask_token_id=mask_id, block_range=(low, high), eval_block_size=eval_block_size,
                             distill_lambda=lam)
    return train_and_publish(bundle, objective, train_chunks, val_chunks, cfg, run_dir, out, info=info, meta=meta,
                             device=device, resume=resume, progress=progress, overwrite=overwrite,
                             train_labels=rows.train_labels, val_labels=rows.val_labels)
