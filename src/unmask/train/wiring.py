"""The wiring every fine-tuning entry point shares around :func:`unmask.train.loop.train`.

``train_sbd``, ``train_diffusion`` and ``block_diffusion.fit`` (hence MultiTF) differ in the base
they load, how they cut the data into rows, the objective and the fields of ``unmask_config.json``.
The rest lives here: reading the loop options, checking the data files and the output/run paths
before anything is loaded, reading and packing the corpus, and publishing the trained model
atomically as a Hugging Face directory that ``unmask.load(out)`` opens.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from unmask.dist import env_rank
from unmask.errors import UnmaskError
from unmask.fileio import atomic_write_json, publish_dir, staging_dir
from unmask.train.data import check_data_files, load_corpus, separator_id
from unmask.train.loop import TrainConfig, TrainResult, checkpoints, save_model, train

UNMASK_CONFIG = "unmask_config.json"


def default_run_dir(out: str | Path) -> Path:
    """Checkpoints and logs of a run live next to its output: ``OUT.run/``."""
    out = Path(out)
    return out.with_name(out.name + ".run")


def prepare_paths(out: Path, run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber an earlier model or run unless asked; with ``overwrite`` drop ``run_dir``.

    Raises:
        UnmaskError: resume together with overwrite, ``out`` exists, or ``run_dir`` holds
            checkpoints, without overwrite / resume.
    """
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
    if overwrite and run_dir.exists() and env_rank() == 0:  # under torchrun, rank 0 alone clears it
        shutil.rmtree(run_dir)


def train_config(config: dict) -> TrainConfig:
    """``**config`` of a training entry point as a TrainConfig; UnmaskError for an unknown field."""
    try:
        return TrainConfig(**config)
    except TypeError as e:
        raise UnmaskError(f"unknown training option ({e}); see TrainConfig") from None


def run_paths(data: str | Path | Sequence[str | Path], out: str | Path, run_dir: str | Path | None, *,
              resume: bool, overwrite: bool) -> tuple[list[Path], Path, Path]:
    """Check the data files and the output paths -> (data files, out, run_dir); ``run_dir``
    defaults to ``OUT.run``. Raises UnmaskError as :func:`check_data_files` and :func:`prepare_paths`."""
    paths = check_data_files([data] if isinstance(data, (str, Path)) else list(data))
    out = Path(out)
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(out)
    prepare_paths(out, run_dir, resume=resume, overwrite=overwrite)
    return paths, out, run_dir


def load_chunks(paths: Sequence[Path], tokenizer, vocab: int, pack_rows: Callable, seq_len: int, *, need: int,
                val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read, split and pack the corpus -> (train rows (N, seq_len + 1) long, val rows (M, seq_len + 1)
    long or None when the split holds no documents).

    ``pack_rows(docs, seq_len, sep_id)`` cuts the rows (``data.pack``, ``pack_bos_chunks``,
    ``pack_aligned``); ``need`` is the row length the error message names.

    Raises:
        UnmaskError: the training split is too short for one row.
    """
    train_docs, val_docs = load_corpus(paths, tokenizer, vocab_size=vocab, val_fraction=val_fraction, seed=seed)
    sep = separator_id(tokenizer)
    train_chunks = pack_rows(train_docs, seq_len, sep)  # (N, L+1)
    if len(train_chunks) == 0:
        n = sum(len(d) + 1 for d in train_docs)
        raise UnmaskError(f"the training data holds {n} tokens, fewer than one sequence of {need}; "
                          "lower --seq-len or add data")
    val_chunks = pack_rows(val_docs, seq_len, sep) if val_docs else None  # (M, L+1)
    return train_chunks, val_chunks


def set_decode_defaults(model_dir: str | Path, **defaults) -> dict:
    """Record the decoding defaults of a trained model (``decode_defaults`` in its
    ``unmask_config.json``, e.g. ``block_size=8, gamma=0.35`` for SBD), which ``unmask generate``
    uses when no policy option is given. The file is rewritten atomically; returns the new meta.

    Raises:
        UnmaskError: ``model_dir`` has no unmask_config.json, or the defaults are not valid SBD
            decoder options.
    """
    import json

    from unmask.decode.sbd import SBDConfig

    path = Path(model_dir) / UNMASK_CONFIG
    if not path.is_file():
        raise UnmaskError(f"{model_dir} has no {UNMASK_CONFIG}; pass a directory written by 'unmask train'")
    SBDConfig.from_options(**defaults)  # validates: block size >= 1, γ >= 0, a known policy
    meta = json.loads(path.read_text())
    meta["decode_defaults"] = dict(defaults)
    atomic_write_json(path, meta)
    return meta


def data_record(path: Path) -> dict:
    """Provenance of one training file for ``unmask_config.json``: its file name, size in bytes
    and SHA-256. The absolute path is left out: it names the machine that trained, not the data."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for piece in iter(lambda: fh.read(1 << 20), b""):
            digest.update(piece)
    return {"name": Path(path).name, "bytes": Path(path).stat().st_size, "sha256": digest.hexdigest()}


def run_info(seq_len: int, paths: Sequence[Path], train_chunks: torch.Tensor, val_chunks: torch.Tensor | None,
             cfg: TrainConfig, **fields) -> dict:
    """The training summary kept in the run log and in ``unmask_config.json``; ``fields`` (the
    objective's description, ...) go between the data counts and the loop config."""
    return {"seq_len": seq_len, "data": [data_record(p) for p in paths], "train_chunks": len(train_chunks),
            "val_chunks": 0 if val_chunks is None else len(val_chunks), **fields, "config": asdict(cfg)}


def train_and_publish(bundle, objective, train_chunks: torch.Tensor, val_chunks: torch.Tensor | None,
                      cfg: TrainConfig, run_dir: Path, out: Path, *, info: dict, meta: dict, device: str,
                      resume: bool, progress: bool) -> TrainResult:
    """Run the loop on ``bundle.model`` and publish ``out`` atomically when it ends.

    Every checkpoint and the published directory hold the tokenizer and ``unmask_config.json``
    (``meta`` plus a ``training`` entry: ``info`` and the step, stop reason and last terms).
    ``out`` is not written when the run is interrupted; the returned TrainResult then has
    ``out`` None. A failure while publishing removes the staging directory and leaves ``out``
    as it was.
    """
    tok = bundle.tokenizer

    def save_extras(directory: Path, state: dict) -> None:
        tok.save_pretrained(directory)
        training = {**info, "step": state.get("step"), "stopped": state.get("stopped"),
                    "train_terms": state.get("last"), "val": state.get("val")}
        atomic_write_json(directory / UNMASK_CONFIG, {**meta, "training": training})

    console = None
    if progress and env_rank() == 0:
        from rich.console import Console

        console = Console(stderr=True)
    result = train(bundle.model, objective, train_chunks, val_chunks, cfg, run_dir, device=device, resume=resume,
                   save_extras=save_extras, console=console, meta=info)
    if result.stopped == "interrupted":
        return result
    from unmask import dist
    from unmask.train.parallel import agree, full_state_dict

    full = full_state_dict(bundle.model) if dist.active() else None  # a collective under FSDP2: every rank
    error = None
    if dist.is_main():  # under torchrun rank 0 publishes; the others learn whether it did
        tmp = staging_dir(out)
        try:
            save_model(bundle.model, tmp, state_dict=full)
            save_extras(tmp, {"step": result.step, "stopped": result.stopped, "last": result.last, "val": result.val})
            publish_dir(tmp, out)
        except BaseException as e:  # noqa: BLE001 - re-raised by agree
            shutil.rmtree(tmp, ignore_errors=True)
            error = e
    agree(error, "publishing the model")
    result.out = out
    return result
