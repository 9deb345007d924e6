"""Run an untrusted Python program in a separate, limited process.

What :func:`run_program` does, and how far each measure goes:

- **Process**: ``sys.executable -I -B -c <bootstrap>`` in a new session (its own process
  group), stdin from ``/dev/null``, with an environment holding only ``PATH``, ``HOME``,
  ``TMPDIR``, locale and ``OMP_NUM_THREADS``; ``-I`` also ignores ``PYTHON*`` variables and
  the user site-packages.
- **Wall-clock timeout**: the whole process group is killed with SIGKILL. The group is
  also killed after a normal exit, so leftover children die too. A program that calls
  ``setsid()`` leaves the group and escapes this.
- **Limits** (``setrlimit``): address space (``RLIMIT_AS``), CPU seconds (backstop), file
  size (bounds stdout/stderr too) and no core dumps. The bootstrap applies them itself,
  before the program runs, rather than in ``preexec_fn``: ``preexec_fn`` can deadlock when
  the parent has threads, and :func:`unmask.eval.code_tasks.pass_at_1` runs workers in threads.
- **Working directory**: a fresh temporary directory (also ``HOME`` and ``TMPDIR``),
  removed afterwards.
- **File writes outside that directory**: *prevented* by Landlock (Linux ≥ 5.13 with the
  Landlock LSM enabled): creating, writing, truncating, renaming or deleting anything
  outside the temporary directory fails with ``PermissionError``; reading is allowed.
  :func:`landlock_abi` says whether the kernel supports it; ``RunResult.fs_confined`` says
  whether a run was confined. Without Landlock nothing stops such writes (pass
  ``require_confinement=True`` to refuse to run instead).
- **Network**: best effort. The bootstrap replaces ``socket.socket`` and friends with a
  function that raises ``OSError`` (a program can undo that, e.g. through ``_socket`` or
  ``ctypes``). With Landlock ABI ≥ 4 the kernel also refuses every TCP ``bind`` and
  ``connect``; UDP and already reachable Unix sockets stay open.

This is protection against accidents in model-written code (stray files, runaway loops,
memory blow-ups), **not a security boundary** against deliberately hostile code. Use a
container or VM for that.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

from unmask.errors import UnmaskError

Status = Literal["passed", "failed", "timeout", "crash"]

_SETUP_FAILED = 97  # exit code of the bootstrap when required confinement failed

# Runs in the child before the program. Kept self-contained: it may import only stdlib.
_BOOTSTRAP = r'''
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
for name, value in (("RLIMIT_AS", cfg["mem"]), ("RLIMIT_CPU", cfg["cpu"]),
                    ("RLIMIT_FSIZE", cfg["fsize"]), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (value, value))

def landlock(root, block_tcp):
    libc = ctypes.CDLL(None, use_errno=True)
    sc = libc.syscall
    sc.restype = ctypes.c_long
    abi = sc(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # landlock_create_ruleset
    if abi < 1:
        return False
    # Write-type rights: WRITE_FILE, REMOVE_DIR, REMOVE_FILE, MAKE_CHAR..MAKE_SYM,
    # then REFER (ABI 2) and TRUNCATE (ABI 3). Reads and execution are not handled.
    fs = (1 << 1) | (1 << 4) | (1 << 5) | sum(1 << b for b in range(6, 13))
    fs |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    net = 3 if block_tcp and abi >= 4 else 0          # BIND_TCP | CONNECT_TCP, no rules
    scoped = 3 if abi >= 6 else 0                      # abstract unix sockets, signals
    class Attr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64),
                    ("scoped", ctypes.c_uint64)]
    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    rs = sc(444, ctypes.byref(Attr(fs, net, scoped)), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if rs < 0:
        return False
    file_rights = fs & ((1 << 1) | (1 << 14))          # rights valid on a non-directory
    for path, rights in ((root, fs), ("/dev/null", file_rights)):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        ok = sc(445, rs, 1, ctypes.byref(Beneath(rights, fd)), ctypes.c_uint32(0))
        os.close(fd)
        if ok != 0:
            return False
    if libc.prctl(38, 1, 0, 0, 0) != 0:                # PR_SET_NO_NEW_PRIVS
        return False
    return sc(446, rs, ctypes.c_uint32(0)) == 0        # landlock_restrict_self

confined = False
if cfg["landlock"]:
    try:
        confined = landlock(os.getcwd(), not cfg["network"])
    except Exception:
        confined = False
os.write(cfg["report_fd"], b"1" if confined else b"0")  # tell the parent, then close
os.close(cfg["report_fd"])
if cfg["require"] and not confined:
    sys.stderr.write("unmask sandbox: Landlock confinement failed\n")
    os._exit(97)
if not cfg["network"]:
    import socket
    def _no_network(*args, **kwargs):
        raise OSError("network access is disabled in the unmask sandbox")
    for _name in ("socket", "create_connection", "create_server", "socketpair", "fromfd"):
        setattr(socket, _name, _no_network)
del ctypes, json, resource, landlock, cfg, confined
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
'''


@functools.cache
def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0 when unavailable or not on Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        return max(int(libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))), 0)
    except (OSError, AttributeError):
        return 0


@dataclass(frozen=True)
class RunResult:
    """Outcome of one :func:`run_program` call.

    ``status``: ``passed`` (exit code 0), ``failed`` (non-zero exit: an exception, a failed
    assert, ``sys.exit(1)``, ``MemoryError``), ``timeout`` (wall clock exceeded; killed) or
    ``crash`` (killed by a signal such as SIGSEGV, SIGXCPU or SIGXFSZ, or sandbox set-up
    failed). ``returncode`` is negative for a signal, ``None`` after a timeout.
    ``seconds`` is wall-clock time. The tails are the last characters of each stream.
    """

    status: Status
    returncode: int | None
    seconds: float
    stdout_tail: str
    stderr_tail: str
    fs_confined: bool

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _wait_for_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait until ``proc`` exits, *without reaping it* (so its pid, and with it the process
    group id, cannot be reused before we kill the group). True if it exited in time."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            return bool(select.select([pidfd], [], [], timeout)[0])
        finally:
            os.close(pidfd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        time.sleep(0.005)
    return False


def _tail(f, n: int) -> str:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - 4 * n))
    return f.read().decode("utf-8", errors="replace")[-n:]


def run_program(program: str, *, timeout_s: float = 10.0, memory_mb: int = 2048,
                max_output_mb: int = 16, network: bool = False,
                require_confinement: bool = False, tail_chars: int = 2000) -> RunResult:
    """Run ``program`` (Python source) in a sandboxed child process; see the module doc.

    Args:
        program: source code, run as ``__main__`` from ``main.py`` in a temporary directory.
        timeout_s: wall-clock limit in seconds; the process group is killed after it.
        memory_mb: address-space limit (``RLIMIT_AS``) in MiB.
        max_output_mb: largest file the child may write, stdout/stderr included, in MiB.
        network: leave sockets alone (default: disabled, best effort).
        require_confinement: raise instead of running when Landlock is unavailable.
        tail_chars: how many trailing characters of stdout/stderr to keep.

    Raises:
        UnmaskError: bad limits, or ``require_confinement`` without kernel support.
    """
    if timeout_s <= 0 or memory_mb <= 0 or max_output_mb <= 0:
        raise UnmaskError("run_program: timeout_s, memory_mb and max_output_mb must be > 0")
    use_landlock = landlock_abi() > 0
    if require_confinement and not use_landlock:
        raise UnmaskError("file-system confinement needs Linux Landlock (kernel >= 5.13 with "
                          "the landlock LSM); run without require_confinement or in a container")
    cfg = {"mem": memory_mb * 2**20, "fsize": max_output_mb * 2**20,
           "cpu": int(timeout_s) + 2, "network": network, "landlock": use_landlock,
           "require": require_confinement}
    workdir = tempfile.mkdtemp(prefix="unmask-sandbox-")
    env = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(program)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                tempfile.TemporaryFile() as report:
            cfg["report_fd"] = report.fileno()
            start = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, json.dumps(cfg)],
                cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True, close_fds=True, pass_fds=(report.fileno(),))
            exited = _wait_for_exit(proc, timeout_s)
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the program's own children, or all
            except (ProcessLookupError, PermissionError):
                pass
            rc = proc.wait()
            seconds = time.monotonic() - start
            stdout, stderr = _tail(out, tail_chars), _tail(err, tail_chars)
            report.seek(0)
            confined = report.read() == b"1"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not exited:
        status: Status = "timeout"
    elif rc == 0:
        status = "passed"
    elif rc < 0 or (rc == _SETUP_FAILED and require_confinement and not confined):
        status = "crash"
    else:
        status = "failed"
    return RunResult(status, rc if exited else None, seconds, stdout, stderr, confined)
