"""Fine-tune a causal LM into a Set Block Decoding model (spec/sbd.md §2–§3).

:func:`train_sbd` adds the mask token (Option A, §2), packs the data, runs the generic loop
with the joint NTP + masked-token objective (Eq. 14) and publishes a Hugging Face directory
whose ``unmask_config.json`` makes ``unmask.load(out)`` return kind ``sbd``.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from unmask.errors import UnmaskError
from unmask.fileio import atomic_write_json, publish_dir, staging_dir
from unmask.train.data import check_data_files, load_corpus, pack, separator_id
from unmask.train.loop import TrainConfig, TrainResult, checkpoints, save_model, train
from unmask.train.objectives import SBDObjective

SBD_FORMAT_VERSION = 1
UNMASK_CONFIG = "unmask_config.json"


def default_run_dir(out: str | Path) -> Path:
    """Checkpoints and logs of a run live next to its output: ``OUT.run/``."""
    out = Path(out)
    return out.with_name(out.name + ".run")


def _prepare_paths(out: Path, run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise UnmaskError("--resume and --overwrite contradict each other; pass one of them")
    if resume:
        return
    if out.exists() and not overwrite:
        raise UnmaskError(f"{out} already exists; pass --overwrite to replace it, --resume to continue its run, "
                          "or choose another --out")
    if checkpoints(run_dir) and not overwrite:
        raise UnmaskError(f"{run_dir} holds checkpoints of an earlier run; pass --resume to continue it or "
                          "--overwrite to start over")
    if overwrite and run_dir.exists():
        shutil.rmtree(run_dir)


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


def train_sbd(*, base: str, data: str | Path | Sequence[str | Path], out: str | Path, run_dir: str | Path | None = None,
              seq_len: int = 256, block_range: tuple[int, int] = (2, 16), val_fraction: float = 0.05,
              resume: bool = False, overwrite: bool = False, device: str = "cpu", dtype: str = "float32",
              progress: bool = True, **config) -> TrainResult:
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
        resume: continue from the newest checkpoint in ``run_dir`` (fresh start if none).
        overwrite: replace an existing ``out`` and discard ``run_dir``.
        progress: show a rich progress bar / progress lines.
        **config: :class:`~unmask.train.loop.TrainConfig` fields (lr, steps, batch_size, ...).

    Returns:
        TrainResult with ``out`` set (None when interrupted).

    Raises:
        UnmaskError: missing/empty data, ``out`` exists without overwrite/resume, a base that is
            not a causal LM, seq_len beyond the context, data too short for one chunk, bad options.
    """
    try:
        cfg = TrainConfig(**config)
    except TypeError as e:
        raise UnmaskError(f"unknown training option ({e}); see TrainConfig") from None
    paths = check_data_files([data] if isinstance(data, (str, Path)) else list(data))
    out = Path(out)
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(out)
    _prepare_paths(out, run_dir, resume=resume, overwrite=overwrite)
    bundle, mask_id, vocab = _load_base(base, dtype)
    context = bundle.context_length
    if not 1 <= seq_len <= context:
        raise UnmaskError(f"--seq-len {seq_len} must be between 1 and the model's context of {context} tokens; "
                          "pass a --seq-len in that range")
    low, high = block_range
    if not 1 <= low <= high <= seq_len:
        raise UnmaskError(f"block range [{low}, {high}] must satisfy 1 <= low <= high <= --seq-len ({seq_len}); "
                          "pass a block_range inside it or raise --seq-len")
    tok = bundle.tokenizer
    train_docs, val_docs = load_corpus(paths, tok, vocab_size=vocab, val_fraction=val_fraction, seed=cfg.seed)
    sep = separator_id(tok)
    train_chunks = pack(train_docs, seq_len, sep)  # (N, L+1)
    if len(train_chunks) == 0:
        n = sum(len(d) + 1 for d in train_docs)
        raise UnmaskError(f"the training data holds {n} tokens, fewer than one sequence of {seq_len + 1}; "
                          "lower --seq-len or add data")
    val_chunks = pack(val_docs, seq_len, sep) if val_docs else None  # (M, L+1)

    info = {"seq_len": seq_len, "data": [str(p) for p in paths], "train_chunks": len(train_chunks),
            "val_chunks": 0 if val_chunks is None else len(val_chunks), "objective": "sbd: NTP + masked (Eq. 14)",
            "config": asdict(cfg)}
    meta = {"kind": "sbd", "mask_token_id": mask_id, "train_block_range": [low, high], "version": SBD_FORMAT_VERSION,
            "stop_token_ids": list(bundle.stop_token_ids), "base": base}

    def save_extras(directory: Path, state: dict) -> None:
        tok.save_pretrained(directory)
        training = {**info, "step": state.get("step"), "stopped": state.get("stopped"),
                    "train_terms": state.get("last"), "val": state.get("val")}
        atomic_write_json(directory / UNMASK_CONFIG, {**meta, "training": training})

    console = None
    if progress:
        from rich.console import Console

        console = Console(stderr=True)
    objective = SBDObjective(mask_token_id=mask_id, block_range=(low, high))
    result = train(bundle.model, objective, train_chunks, val_chunks, cfg, run_dir, device=device, resume=resume,
                   save_extras=save_extras, console=console, meta=info)
    if result.stopped == "interrupted":
        return result
    tmp = staging_dir(out)
    try:
        save_model(bundle.model, tmp)
        save_extras(tmp, {"step": result.step, "stopped": result.stopped, "last": result.last, "val": result.val})
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.out = out
    return result
