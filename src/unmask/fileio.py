"""Atomic file and directory writes: nothing half-written is ever left at a final path.

Also the exclusive writer lock every command that publishes an output takes (:func:`output_lock`),
so that two processes writing the same output cannot both report success. The checks made before
a write (:func:`check_output_file` and the others) are :mod:`unmask.output_checks`, re-exported here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from unmask.errors import UnmaskError
# the checks before a write; public here too, where every command imports them from
from unmask.output_checks import (check_model_out_dir, check_output_file, check_parents, probe_writable,  # noqa: F401
                                  write_errors)


_held: set[str] = set()  # outputs this process holds an output_lock on (resolved paths)
_published: list[Path] = []  # outputs published complete by this command (see published_outputs)


def published_outputs() -> list[Path]:
    """The outputs this command has published complete: a directory or file renamed into place
    at a path it held an :func:`output_lock` on, or written with ``output=True``. The command
    line's Ctrl-C handling reads it (issue 28 item 20): an interrupt after the output is
    published ends with exit 0 and a warning, before it with exit 130 and nothing published."""
    return list(_published)


def replace_output(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``os.replace(src, dst)`` for a command's finished output file: SIGINT/SIGTERM wait for the
    rename, and ``dst`` then counts as published (:func:`published_outputs`)."""
    with _signals_deferred(Path(dst), True):
        os.replace(src, dst)


def mark_published(path: str | os.PathLike) -> None:
    """Record ``path`` as a complete output of this command (one written in place, such as a
    corpus appended to row by row, once its last row is on disk)."""
    _published.append(Path(path))


def forget_published() -> None:
    """Start a new command: no output published yet."""
    _published.clear()


@contextlib.contextmanager
def _signals_deferred(final: Path, output: bool) -> Iterator[None]:
    """Hold SIGINT/SIGTERM while the block renames ``final`` into place, then record it as
    published when it is a command output (``output`` or a path under this process's output
    lock) and deliver a signal that came meanwhile: the rename and its record are one step, so
    the command line never reports "interrupted" for an output that is in place, or success for
    one that is not. Off the main thread (where signals cannot be caught) only the record."""
    is_output = output or str(Path(final).absolute()) in _held or _resolved(final) in _held
    if threading.current_thread() is not threading.main_thread():
        yield
        if is_output:
            _published.append(Path(final))
        return
    pending: list[tuple[int, object]] = []
    old = {sig: signal.signal(sig, lambda signum, frame: pending.append((signum, frame)))
           for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
        if is_output:
            _published.append(Path(final))
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if pending:
            signum, frame = pending[0]
            handler = old[signum]
            if callable(handler):
                handler(signum, frame)  # raises KeyboardInterrupt for the default SIGINT handler
            elif handler in (signal.SIG_DFL, None):
                os.kill(os.getpid(), signum)


def _resolved(path: str | os.PathLike) -> str:
    try:
        return str(Path(path).resolve())
    except OSError:
        return str(Path(path).absolute())


def _staging_prefix(final: Path, pid: int | None = None) -> str:
    return f".{final.name}.staging-{os.getpid() if pid is None else pid}-"


def staging_dir(final: Path) -> Path:
    """A fresh temporary directory next to ``final`` (same filesystem, so rename is atomic),
    named ``.NAME.staging-PID-XXXXXXXX`` after the process that owns it (see
    :func:`sweep_stale_staging`)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=_staging_prefix(final), dir=final.parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True


def sweep_stale_staging(final: str | os.PathLike) -> list[Path]:
    """Remove the staging directories of ``final`` that a killed writer left behind (a killed
    GGUF conversion left 478 MiB): ``.NAME.staging-PID-*`` folders next to ``final`` whose owner
    process PID no longer exists. Returns the folders removed.

    Call it only while holding :func:`output_lock` on ``final``: every writer of ``final`` holds
    that lock, so no live writer (even one whose PID this process cannot see, in another PID
    namespace on a shared disk) can own them. Folders of live processes, of this process, other
    outputs' folders, links and plain files are never touched.
    """
    import re

    final = Path(final)
    if not final.parent.is_dir():
        return []
    pattern = re.compile(re.escape(f".{final.name}.staging-") + r"(\d+)-[^/]+")
    removed = []
    for entry in final.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def make_readable(directory: Path) -> None:
    """Give ``directory`` and everything in it the permissions of a published model: 0755
    directories, 0644 files (``mkdtemp`` creates 0700)."""
    os.chmod(directory, 0o755)
    for f in Path(directory).rglob("*"):
        os.chmod(f, 0o755 if f.is_dir() else 0o644)


_RENAME_EXCHANGE = 2  # renameat2 flag (linux/fs.h)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).
    False when the kernel, libc or file system cannot, so that the caller falls back."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE))
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_dir(src: Path, dst: Path, *, output: bool = False) -> None:
    """Move the finished directory ``src`` to ``dst`` atomically, readable by all.

    An existing ``dst`` is swapped with ``src`` in one step (``renameat2(RENAME_EXCHANGE)``), so
    a crash at any moment leaves either the old or the new directory at ``dst``, never neither;
    the old one is removed afterwards. Where the swap is not supported the old ``dst`` is renamed
    aside first (a crash between the two renames then leaves it at ``.NAME.old-PID``). SIGINT and
    SIGTERM wait for the renames; ``dst`` then counts as published (:func:`published_outputs`)
    when it is under this process's :func:`output_lock` or ``output`` is true.
    """
    make_readable(src)
    old = None
    with _signals_deferred(dst, output):
        if dst.exists():
            if _exchange(src, dst):  # src now holds the old directory (or file)
                old = src
            else:
                old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
                os.replace(dst, old)
                os.replace(src, dst)
        else:
            os.replace(src, dst)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def output_lock(path: str | os.PathLike, what: str = "output") -> Iterator[Path]:
    """Hold an exclusive lock on the output ``path`` for the duration of the ``with`` block.

    The lock is ``flock`` on a hidden sibling file ``.NAME.lock`` (removed on release); a second
    process that asks for the same output while the first holds it gets UnmaskError at once, so
    two writers never both report success. Locks are released by the kernel when a process
    dies, so a killed run never leaves a stale lock behind.

    Raises:
        UnmaskError: another process holds the lock, or the lock file cannot be created (a
            parent is a file, or the folder is not writable).
    """
    import fcntl

    path = Path(path)
    check_parents(path, what)
    lock = _lock_path(path)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UnmaskError(f"cannot write {what} {path}: {e.strerror or e}; choose a writable path") from None
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UnmaskError(f"cannot write {what} {path}: {e.strerror or e}; choose a writable path") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UnmaskError(f"{what} {path} is being written by another unmask process; wait for it to "
                                  "finish or choose another path") from None
            raise UnmaskError(f"cannot lock {what} {path}: {e.strerror or e}; choose another path") from None
        try:  # the previous holder may have removed the file between our open and flock: retry
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    key = _resolved(path)
    _held.add(key)
    try:
        yield path
    finally:
        _held.discard(key)
        with contextlib.suppress(OSError):
            os.unlink(lock)  # while still holding it: a waiter re-checks the inode
        os.close(fd)


def _write_via_temp(path: Path, write, what: str, output: bool = False) -> None:
    """Create ``path`` through a temporary sibling file written by ``write(tmp_path)`` and a rename
    (SIGINT/SIGTERM wait for the rename; ``output``: the command's output, see :func:`published_outputs`)."""
    check_output_file(path, what)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o644)
        with _signals_deferred(path, output):
            os.replace(tmp, path)
    except OSError as e:
        raise UnmaskError(f"cannot write {what} {path}: {e.strerror or e}; choose a writable path") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str, what: str = "file", *, output: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename; ``output``: it is the
    command's output (:func:`published_outputs`). Raises UnmaskError when the path is a
    directory or not writable."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    _write_via_temp(Path(path), write, what, output)


def atomic_savefig(fig, path: str | os.PathLike, **kwargs) -> Path:
    """``fig.savefig`` through a temporary file and a rename. A path without a suffix gets
    ``.png`` (as matplotlib would); returns the path written."""
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")
    fmt = kwargs.pop("format", None) or path.suffix[1:].lower()
    if fmt not in fig.canvas.get_supported_filetypes():
        raise UnmaskError(f"cannot plot to {path}: unknown image format {fmt!r}; use a .png, .pdf or .svg file name")
    _write_via_temp(path, lambda tmp: fig.savefig(tmp, format=fmt, **kwargs), "plot", True)
    return path


def atomic_write_json(path: str | os.PathLike, obj, what: str = "file", *, output: bool = False) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", what, output=output)


def read_json_object(path: str | os.PathLike, fix: str) -> dict:
    """The JSON object in the file ``path`` (a checkpoint's config or record).

    Raises:
        FileNotFoundError: ``path`` does not exist (callers word that case themselves).
        UnmaskError: ``"PATH is not valid JSON (why); FIX"`` for an unreadable file, bad UTF-8,
            invalid JSON or nesting deeper than Python's parser recurses (a RecursionError
            otherwise), and ``"PATH holds a JSON list, not an object; FIX"``.
    """
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except RecursionError:
        raise UnmaskError(f"{path} is not valid JSON (nested too deeply to read); {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnmaskError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(value, dict):
        raise UnmaskError(f"{path} holds a JSON {type(value).__name__}, not an object; {fix}")
    return value


def user_cache_dir() -> Path:
    """Where unmask keeps what it builds once per user (models converted on first use):
    ``$UNMASK_CACHE_DIR``, else ``$XDG_CACHE_HOME/unmask``, else ``~/.cache/unmask``."""
    if os.environ.get("UNMASK_CACHE_DIR"):
        return Path(os.environ["UNMASK_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "unmask"
    return Path.home() / ".cache" / "unmask"


def file_lines(text: str) -> list[str]:
    """The lines of a line-based file (JSONL, one prompt per line): split at ``\\n`` only, a
    trailing ``\\r`` dropped. ``str.splitlines`` would also split at U+2028, U+2029, ``\\x0b``,
    ``\\x0c``, ``\\x1c``-``\\x1e`` and ``\\x85``, which JSON strings may hold raw (one GSM8K train
    question has a U+2028) and which belong to the text of a prompt."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]
