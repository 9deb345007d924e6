"""The wiring every fine-tuning entry point shares around :func:`unmask.train.loop.train`.

``train_sbd``, ``train_diffusion`` and ``block_diffusion.fit`` (hence MultiTF) differ in the base
they load, how they cut the data into rows, the objective and the fields of ``unmask_config.json``.
The rest lives here: reading the loop options, checking the data files and the output/run paths
before anything is loaded, reading and packing the corpus, and publishing the trained model
atomically as a Hugging Face directory that ``unmask.load(out)`` opens.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from unmask.dist import env_rank
from unmask.errors import UnmaskError
from unmask.fileio import (atomic_write_json, check_model_out_dir, check_parents, output_lock, probe_writable,
                           publish_dir, staging_dir, sweep_stale_staging, write_errors)
from unmask.train.data import check_data_files, load_corpus, load_records, pack_labelled, separator_id
from unmask.train.loop import TrainConfig, TrainResult, checkpoints, save_model, train

UNMASK_CONFIG = "unmask_config.json"


def default_run_dir(out: str | Path) -> Path:
    """Checkpoints and logs of a run live next to its output: ``OUT.run/``."""
    out = Path(out)
    return out.with_name(out.name + ".run")


def prepare_paths(out: Path, run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber an earlier model or run unless asked. Only checks: the earlier run is
    discarded by :func:`train_and_publish`, after everything else was validated.

    Raises:
        UnmaskError: resume together with overwrite; ``run_dir`` equal to or inside ``out`` (publishing
            replaces ``out``, which would delete the checkpoints and log); a parent of either is a
            file or not writable; ``out`` exists, or ``run_dir`` holds checkpoints, without
            overwrite / resume.
    """
    if resume and overwrite:
        raise UnmaskError("--resume and --overwrite contradict each other; pass one of them")
    check_nesting(out, run_dir)
    for path, what in ((out, "--out"), (run_dir, "--run-dir")):
        check_parents(path, what)
        probe_writable(path.parent, f"{what} {path}")
    if resume:
        return
    if out.exists() and not overwrite:
        raise UnmaskError(f"{out} already exists; pass --overwrite to replace it, --resume to continue its run, "
                          "or choose another --out")
    if checkpoints(run_dir) and not overwrite:
        raise UnmaskError(f"{run_dir} holds checkpoints of an earlier run; pass --resume to continue it or "
                          "--overwrite to start over")


def check_nesting(out: Path, run_dir: Path) -> None:
    """Refuse a ``run_dir`` equal to or inside ``out`` (publishing replaces ``out``, which would
    delete the checkpoints and log) and an ``out`` inside ``run_dir``. Raises UnmaskError."""
    o, r = out.resolve(), run_dir.resolve()
    if r == o or o in r.parents:
        raise UnmaskError(f"--run-dir {run_dir} is inside --out {out}; publishing the model replaces {out} and would "
                          "delete the checkpoints, choose a --run-dir outside it (default OUT.run)")
    if r in o.parents:
        raise UnmaskError(f"--out {out} is inside --run-dir {run_dir}; choose an --out outside the run directory")


# The locks of the training command running in this context (see holds_output_locks).
_LOCKS: contextvars.ContextVar[tuple[contextlib.ExitStack, set] | None] = contextvars.ContextVar(
    "unmask_train_locks", default=None)


def holds_output_locks(fn):
    """Decorate a training entry point: the output locks :func:`run_paths` takes are held until
    the entry point returns or raises, i.e. for the whole command."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            token = _LOCKS.set((stack, set()))
            try:
                return fn(*args, **kwargs)
            finally:
                _LOCKS.reset(token)

    return wrapper


def train_config(config: dict) -> TrainConfig:
    """``**config`` of a training entry point as a TrainConfig; UnmaskError for an unknown field."""
    try:
        return TrainConfig(**config)
    except TypeError as e:
        raise UnmaskError(f"unknown training option ({e}); see TrainConfig") from None


# What an existing --out / --run-dir must hold to be replaced (publish_dir) or discarded (--overwrite).
MODEL_OUT = {"markers": ("config.json",), "kind": "a model directory (no config.json)"}
ADAPTER_OUT = {"markers": ("adapter.json",), "kind": "an adapter directory (no adapter.json)"}
RUN_DIR = {"markers": ("checkpoints", "log.jsonl"), "kind": "a run directory (no checkpoints/ or log.jsonl)"}


def model_dir(name_or_path: str | Path | None) -> Path | None:
    """The directory a ``--base`` / ``--model`` names (a shipped name or a local folder), None when it
    names none (a loaded bundle, an unknown name: its loading reports that)."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        return None
    from unmask.models.registry import shipped

    found = shipped().get(str(name_or_path))
    if found is not None:
        return found
    path = Path(name_or_path).expanduser()
    return path if path.is_dir() else None


def read_paths(data: Sequence[Path], base: str | Path | None = None, init: str | Path | None = None) -> list:
    """What a training command reads, as ``check_model_out_dir`` inputs: the data files, the base
    model directory and an ``init`` adapter (a folder, or a bare name under BASE/adapters/)."""
    reads: list = [(p, f"the --data file {p}") for p in data]
    base_dir = model_dir(base)
    if base_dir is not None:
        reads.append((base_dir, f"the --base model {base}"))
    if init is not None:
        candidates = [Path(init).expanduser()]
        if base_dir is not None and "/" not in str(init):
            candidates.append(base_dir / "adapters" / str(init))
        reads += [(c, f"the --init adapter {init}") for c in candidates if c.is_dir()]
    return reads


def check_out_paths(out: str | Path, run_dir: str | Path | None, reads: Sequence, *, resume: bool, overwrite: bool,
                    adapter: bool = False) -> tuple[Path, Path]:
    """-> (out, run_dir), checked as :func:`unmask.fileio.check_model_out_dir`: both named and not
    files; neither is nor holds anything in ``reads`` (publishing replaces ``out``, ``--overwrite``
    deletes ``run_dir``); an existing, non-empty ``out`` is a model (``adapter``: an adapter)
    directory, since ``--overwrite`` and ``--resume`` replace it; with ``overwrite`` an existing,
    non-empty ``run_dir`` is a run directory. Raises UnmaskError."""
    out = check_model_out_dir(out, reads, True, what="--out", example="my-model",
                              replaced="which publishing with --overwrite or --resume would replace",
                              **(ADAPTER_OUT if adapter else MODEL_OUT))
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(out)
    check_model_out_dir(run_dir, reads, overwrite and not resume, what="--run-dir", example="my-model.run", **RUN_DIR)
    return out, run_dir


def run_paths(data: str | Path | Sequence[str | Path], out: str | Path, run_dir: str | Path | None, *,
              resume: bool, overwrite: bool, base: str | Path | None = None, init: str | Path | None = None,
              adapter: bool = False) -> tuple[list[Path], Path, Path]:
    """Check the data files and the output paths -> (data files, out, run_dir); ``run_dir``
    defaults to ``OUT.run``. ``base`` / ``init``: the model (and adapter) the command starts from,
    which neither output may be or hold (:func:`check_out_paths`; ``adapter``: ``out`` is an
    adapter directory). Inside a :func:`holds_output_locks` entry point, ``out`` and ``run_dir``
    are locked first (a second writer is refused) and stay locked until it returns. Raises
    UnmaskError as :func:`check_data_files`, :func:`check_out_paths`,
    :func:`unmask.fileio.output_lock` and :func:`prepare_paths`."""
    paths = check_data_files([data] if isinstance(data, (str, Path)) else list(data))
    out, run_dir = check_out_paths(out, run_dir, read_paths(paths, base, init), resume=resume, overwrite=overwrite,
                                   adapter=adapter)
    check_nesting(out, run_dir)  # before a lock file is created inside out
    held = _LOCKS.get() if env_rank() == 0 else None  # under torchrun, rank 0 holds the locks for the job
    if held is not None:
        stack, locked = held
        for path, what in ((out, "--out"), (run_dir, "--run-dir")):
            if path.resolve() not in locked:  # entry points may check their paths twice
                stack.enter_context(output_lock(path, what))
                locked.add(path.resolve())
    prepare_paths(out, run_dir, resume=resume, overwrite=overwrite)
    return paths, out, run_dir


def load_chunks(paths: Sequence[Path], tokenizer, vocab: int, pack_rows: Callable, seq_len: int, *, need: int,
                val_fraction: float, seed: int, config=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read, split and pack the corpus -> (train rows (N, seq_len + 1) long, val rows (M, seq_len + 1)
    long or None when the split holds no documents).

    ``pack_rows(docs, seq_len, sep_id)`` cuts the rows (``data.pack``, ``pack_bos_chunks``,
    ``pack_aligned``); ``need`` is the row length the error message names.

    Raises:
        UnmaskError: the training split is too short for one row.
    """
    train_docs, val_docs = load_corpus(paths, tokenizer, vocab_size=vocab, val_fraction=val_fraction, seed=seed)
    sep = separator_id(tokenizer if tokenizer is not None or config is None else config)
    train_chunks = pack_rows(train_docs, seq_len, sep)  # (N, L+1)
    if len(train_chunks) == 0:
        n = sum(len(d) + 1 for d in train_docs)
        raise UnmaskError(f"the training data holds {n} tokens, fewer than one sequence of {need}; "
                          "lower --seq-len or add data")
    val_chunks = pack_rows(val_docs, seq_len, sep) if val_docs else None  # (M, L+1)
    return train_chunks, val_chunks


@dataclass(frozen=True)
class LabelledChunks:
    """Packed rows with their answer-only label masks (:func:`load_labelled_chunks`).

    train (N, L+1) long; val (M, L+1) long or None; train_labels / val_labels: (N, L+1) /
    (M, L+1) bool, True where the token is a loss target, or None when every token is trained
    (answer-only off). answer_only: whether the labels are in use.
    """

    train: torch.Tensor
    val: torch.Tensor | None
    train_labels: torch.Tensor | None
    val_labels: torch.Tensor | None
    answer_only: bool


def load_labelled_chunks(paths: Sequence[Path], tokenizer, vocab: int, seq_len: int, *, val_fraction: float,
                         seed: int, answer_only: bool | None = None, config=None) -> LabelledChunks:
    """Read, split and pack the corpus as :func:`load_chunks` with ``data.pack`` rows (L+1 tokens),
    keeping each record's ``loss_start`` as label masks (answer-only training, issue 18).

    answer_only: None = on when any record carries ``loss_start``; True = required (an error
    when no record has one); False = off (labels None: every token trained, as before).

    Raises:
        UnmaskError: the training split is too short for one row; ``answer_only=True`` on a corpus
            without ``loss_start``.
    """
    train_recs, val_recs = load_records(paths, tokenizer, vocab_size=vocab, val_fraction=val_fraction, seed=seed)
    has = any(r.get("loss_start") is not None for r in train_recs + val_recs)
    if answer_only and not has:
        raise UnmaskError("--answer-only needs records with 'loss_start' (the prompt length), and no record of the "
                          "data has one; pass --no-answer-only or a distilled corpus")
    use = has if answer_only is None else answer_only
    sep = separator_id(tokenizer if tokenizer is not None or config is None else config)

    def packed(recs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        return pack_labelled([r["ids"] for r in recs], [r.get("loss_start") for r in recs], seq_len, sep)

    train, train_labels = packed(train_recs)  # (N, L+1) each
    if len(train) == 0:
        n = sum(len(r["ids"]) + 1 for r in train_recs)
        raise UnmaskError(f"the training data holds {n} tokens, fewer than one sequence of {seq_len + 1}; "
                          "lower --seq-len or add data")
    if use and not bool(train_labels[:, 1:].any()):  # column 0 of a row is never a target
        raise UnmaskError("no training row holds an answer token (every record's 'loss_start' is at its end, or "
                          "packing cut the answers off); check the corpus, raise --seq-len or pass --no-answer-only")
    val, val_labels = packed(val_recs) if val_recs else (None, None)  # (M, L+1) each
    return LabelledChunks(train, val, train_labels if use else None, val_labels if use else None, use)


def set_decode_defaults(model_dir: str | Path, **defaults) -> dict:
    """Record the decoding defaults of a trained model (``decode_defaults`` in its
    ``unmask_config.json``, e.g. ``block_size=8, gamma=0.35`` for SBD, plus ``verify=True,
    verify_block_size=4, draft="quadratic"`` to make lossless SBD the default), which ``unmask
    generate`` uses when no policy option is given. The file is rewritten atomically; returns the new meta.

    Raises:
        UnmaskError: ``model_dir`` has no unmask_config.json, or the defaults are not valid SBD
            decoder options.
    """
    import json

    from unmask.models.checkpoint_checks import check_decode_defaults

    path = Path(model_dir) / UNMASK_CONFIG
    if not path.is_file():
        raise UnmaskError(f"{model_dir} has no {UNMASK_CONFIG}; pass a directory written by 'unmask train'")
    # known keys only (an unknown one was a raw TypeError), block size >= 1, γ >= 0, a known
    # policy, a lossless block size >= 2 and a known draft layout
    check_decode_defaults(dict(defaults), "decode defaults")
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
                      resume: bool, progress: bool, overwrite: bool = False, train_labels: torch.Tensor | None = None,
                      val_labels: torch.Tensor | None = None) -> TrainResult:
    """Run the loop on ``bundle.model`` and publish ``out`` atomically when it ends.

    Every checkpoint and the published directory hold the tokenizer and ``unmask_config.json``
    (``meta`` plus a ``training`` entry: ``info`` and the step, stop reason and last terms).
    ``out`` is not written when the run is interrupted; the returned TrainResult then has
    ``out`` None. A failure while publishing removes the staging directory and leaves ``out``
    as it was. With ``overwrite`` the earlier ``run_dir`` is deleted here, after the caller has
    validated the base, the data and the options. ``train_labels`` / ``val_labels``: the chunks'
    answer-only label masks, passed on to the loop.

    Raises:
        UnmaskError: as :func:`unmask.train.loop.train`, or ``out`` cannot be written.
    """
    tok = bundle.tokenizer

    def save_extras(directory: Path, state: dict) -> None:
        if tok is not None:  # a tokenizer-less checkpoint (token-id corpus) stays tokenizer-less
            tok.save_pretrained(directory)
        training = {**info, "step": state.get("step"), "stopped": state.get("stopped"),
                    "train_terms": state.get("last"), "val": state.get("val")}
        atomic_write_json(directory / UNMASK_CONFIG, {**meta, "training": training})

    console = None
    if progress and env_rank() == 0:
        from rich.console import Console

        console = Console(stderr=True)
    if overwrite and not resume and run_dir.exists() and env_rank() == 0:  # --overwrite, now that the inputs were accepted (rank 0 alone under torchrun)
        shutil.rmtree(run_dir)
    result = train(bundle.model, objective, train_chunks, val_chunks, cfg, run_dir, device=device, resume=resume,
                   save_extras=save_extras, console=console, meta=info, train_labels=train_labels,
                   val_labels=val_labels)
    if result.stopped == "interrupted":
        return result
    from unmask import dist
    from unmask.train.parallel import agree, full_state_dict

    full = full_state_dict(bundle.model) if dist.active() else None  # a collective under FSDP2: every rank
    error = None
    if dist.is_main():  # under torchrun rank 0 publishes; the others learn whether it did
        tmp = None
        try:
            sweep_stale_staging(out)  # a killed run's half-published copy (out is locked, run_paths)
            with write_errors(f"the model to {out}", "free disk space or choose another --out"):
                tmp = staging_dir(out)
            with write_errors(f"the model to {out}", f"free disk space; the run is kept in {run_dir}, publish it "
                                                     "with --resume"):
                save_model(bundle.model, tmp, state_dict=full)
                save_extras(tmp, {"step": result.step, "stopped": result.stopped, "last": result.last,
                                  "val": result.val})
                publish_dir(tmp, out)
        except BaseException as e:  # noqa: BLE001 - re-raised by agree
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            error = e
    agree(error, "publishing the model")
    result.out = out
    return result
