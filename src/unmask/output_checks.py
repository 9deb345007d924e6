"""Checks made before a command writes anything, each refusing in one line that names the path:
an output file or directory that cannot be written there (:func:`check_output_file`,
:func:`check_model_out_dir`, :func:`check_parents`, :func:`probe_writable`), and a full or read-only
disk met while saving (:func:`write_errors`).

The writes themselves (atomic, locked) are :mod:`unmask.fileio`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from unmask.errors import UnmaskError


@contextlib.contextmanager
def write_errors(what: str, fix: str):
    """Turn the errors a full or read-only disk raises while saving (OSError; RuntimeError from
    ``torch.save``; SafetensorError from safetensors) into one UnmaskError naming ``what``."""
    from safetensors import SafetensorError

    try:
        yield
    except UnmaskError:
        raise
    except (OSError, RuntimeError, SafetensorError) as e:
        reason = getattr(e, "strerror", None) or (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise UnmaskError(f"cannot write {what}: {reason.rstrip('.')}; {fix}") from None
    except BaseException as e:
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if type(e).__name__ != "CheckpointException" or not isinstance(failures, dict) or not failures:
            raise
        first = next(iter(failures.values()))
        first = getattr(first, "exc", first)  # a wrapped per-rank failure
        reason = getattr(first, "strerror", None) or (str(first).strip().splitlines() or [type(first).__name__])[-1]
        raise UnmaskError(f"cannot write {what}: {reason.rstrip('.')}; {fix}") from None


def check_output_file(path: str | os.PathLike, what: str = "output file", *, exists_ok: bool = True,
                      probe: bool = False) -> Path:
    """Fail fast, before any work, when ``path`` cannot become a file: it is a directory, or a
    parent is a file; with ``exists_ok`` False, when it exists (the CLI's outputs are replaced only
    with ``--overwrite``); with ``probe``, when its folder does not accept a new file (a
    temporary file is created and removed there). Raises UnmaskError naming the path."""
    if not str(path).strip():
        raise UnmaskError(f"the {what} path is empty; give a file path")
    path = Path(path)
    if path.is_dir():
        raise UnmaskError(f"{what} {path} is a directory; give a file path inside it")
    # The write renames a temporary file over the path: that would replace a device such as
    # /dev/null, a pipe or a symlink itself instead of writing through it.
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise UnmaskError(f"{what} {path} is not a regular file (a device, pipe or link); give a plain file path")
    if not exists_ok and path.exists():
        raise UnmaskError(f"{what} {path} already exists; pass --overwrite to replace it or choose another path")
    check_parents(path, what)
    if probe:
        probe_writable(path.parent, f"{what} {path}")
    return path


def check_model_out_dir(out_dir: str | os.PathLike, inputs, overwrite: bool, *, what: str = "OUT_DIR",
                        markers: tuple[str, ...] = ("config.json",), kind: str = "a model directory (no config.json)",
                        replaced: str = "which --overwrite would delete", example: str = "stories260K-hf") -> Path:
    """``out_dir`` as a Path, when a command may publish a new directory there (it is swapped in
    whole, replacing whatever was at that path).

    Refused, before any work: a path without a name (``.``, ``..``, ``''``, ``/``: the lock and the
    staging folder are named after it); a parent or ``out_dir`` itself that is a file; an
    ``out_dir`` that is one of the ``inputs`` or holds one of them (publishing would delete it);
    and with ``overwrite`` an existing, non-empty folder holding none of ``markers`` (a model
    directory's ``config.json`` by default), i.e. some other folder. ``inputs``: paths the command
    reads, each a path or a ``(path, label)`` pair, e.g. ``(data, "the --data file data.txt")``;
    an input may be a directory (a base model), inside which ``out_dir`` may still lie. ``what``
    names the option in the messages; ``kind`` and ``replaced`` describe the refused folder.

    Raises:
        UnmaskError: one line naming ``what`` and the path.
    """
    out = Path(out_dir)
    if out.name in ("", ".", ".."):
        raise UnmaskError(f"{what} {str(out_dir)!r} names no new directory; give the output directory a name, "
                          f"e.g. {example}")
    check_parents(out, what)
    target = out.resolve()
    for item in inputs:
        path, label = item if isinstance(item, tuple) else (item, "the input file")
        path = Path(path).expanduser().resolve()
        if target == path:
            raise UnmaskError(f"{what} {out} is {label}; write to another directory")
        if target in path.parents:
            raise UnmaskError(f"{what} {out} holds {label}; write to another directory")
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        raise UnmaskError(f"{what} {out} is a file; choose a directory")
    if overwrite and out.is_dir() and any(out.iterdir()) and not any((out / m).exists() for m in markers):
        raise UnmaskError(f"{what} {out} is a folder but not {kind}, {replaced}; choose another {what}")
    return out


def probe_writable(folder: Path, what: str) -> None:
    """Raise UnmaskError unless a file can be created in ``folder`` (its existing ancestor, when
    it does not exist yet): create and remove a temporary file there."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=".unmask-probe-", dir=folder)
    except OSError as e:
        raise UnmaskError(f"cannot write {what}: {e.strerror or e} in {folder}; choose a writable path") from None
    os.close(fd)
    os.unlink(tmp)


def check_parents(path: str | os.PathLike, what: str = "output") -> Path:
    """Raise UnmaskError when a parent of ``path`` exists but is not a directory."""
    path = Path(path)
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UnmaskError(f"cannot write {what} {path}: {parent} is a file, not a directory; "
                                  "choose another path")
            break
    return path
