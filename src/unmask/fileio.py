"""Atomic file and directory writes: nothing half-written is ever left at a final path."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


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


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
