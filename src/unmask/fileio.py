"""Atomic file and directory writes: nothing half-written is ever left at a final path."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from unmask.errors import UnmaskError


def staging_dir(final: Path) -> Path:
    """A fresh temporary directory next to ``final`` (same filesystem, so rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))


def publish_dir(src: Path, dst: Path) -> None:
    """Move the finished directory ``src`` to ``dst`` atomically (rename), readable by all; an
    existing ``dst`` is first renamed aside and removed only after the new one is in place."""
    os.chmod(src, 0o755)
    for f in src.rglob("*"):
        os.chmod(f, 0o755 if f.is_dir() else 0o644)
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_output_file(path: str | os.PathLike, what: str = "output file") -> Path:
    """Fail fast, before any work, when ``path`` cannot become a file: it is a directory, or a
    parent is a file. Raises UnmaskError naming the path."""
    path = Path(path)
    if path.is_dir():
        raise UnmaskError(f"{what} {path} is a directory; give a file path inside it")
    # The write renames a temporary file over the path: that would replace a device such as
    # /dev/null, a pipe or a symlink itself instead of writing through it.
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise UnmaskError(f"{what} {path} is not a regular file (a device, pipe or link); give a plain file path")
    return check_parents(path, what)


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


def _write_via_temp(path: Path, write, what: str) -> None:
    """Create ``path`` through a temporary sibling file written by ``write(tmp_path)`` and a rename."""
    check_output_file(path, what)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        raise UnmaskError(f"cannot write {what} {path}: {e.strerror or e}; choose a writable path") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str, what: str = "file") -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename. Raises UnmaskError
    when the path is a directory or not writable."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    _write_via_temp(Path(path), write, what)


def atomic_savefig(fig, path: str | os.PathLike, **kwargs) -> Path:
    """``fig.savefig`` through a temporary file and a rename. A path without a suffix gets
    ``.png`` (as matplotlib would); returns the path written."""
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")
    fmt = kwargs.pop("format", None) or path.suffix[1:].lower()
    if fmt not in fig.canvas.get_supported_filetypes():
        raise UnmaskError(f"cannot plot to {path}: unknown image format {fmt!r}; use a .png, .pdf or .svg file name")
    _write_via_temp(path, lambda tmp: fig.savefig(tmp, format=fmt, **kwargs), "plot")
    return path


def atomic_write_json(path: str | os.PathLike, obj, what: str = "file") -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", what)
