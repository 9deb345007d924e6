"""Run an untrusted Python program in a separate, limited process.

What :func:`run_program` does, and how far each measure goes:

- **Process**: ``sys.executable -I -B -c <bootstrap>`` in a new session (its own process
  group), stdin from ``/dev/null``, with an environment holding only ``PATH``, ``HOME``,
  ``TMPDIR``, locale and ``OMP_NUM_THREADS``; ``-I`` also ignores ``PYTHON*`` variables and
  the user site-packages.
- **Every descendant contained**: the bootstrap forks once. Its parent half is a supervisor,
  a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every process the program starts, even
  one that calls ``setsid()``, ``setpgid(0, 0)`` or double-forks, stays its descendant or is
  reparented to it. It enforces the wall-clock timeout and, when the program ends (or is
  killed), SIGKILLs every remaining descendant (found through ``/proc``) until none is left.
  With Landlock ABI ≥ 6 the program cannot signal the supervisor (signal scoping). The parent
  also kills the whole process group as a last resort.
- **Disk quota**: the supervisor measures the directory every 50 ms and kills the program
  once it keeps more than ``max_disk_mb`` (or 10,000 entries) there (``RLIMIT_FSIZE`` only
  bounds each file).
- **Verdict from positive evidence**: ``passed`` needs exit status 0 *and* a per-run nonce
  written to a verdict file only after the last statement returned; ending early with status 0
  (``sys.exit``, ``os._exit``, ``atexit``, ``exec``) is ``failed``.
- **Verdict out of the program's reach** (``run_program(solution, tests=...)``, what
  :mod:`unmask.eval.code_tasks` uses): the solution runs in one process and the tests in
  another, forked off before the nonce or the tests' source is read; the solution's process
  closes every descriptor of the tests' side and never holds the nonce, the tests' source or the
  verdict file. The tests see the solution's top-level names as proxies: a call runs in the
  solution's process and its result comes back as plain data (numbers, strings, bytes, the
  built-in and ``collections`` containers; a subclass such as a numpy scalar becomes the plain
  value it stands for) read by a loader that builds nothing else; any other object comes back
  as a proxy that the tests may call, index, iterate and pass back but never compare or test for
  truth. An exception a call raises is raised again on the tests' side by its name (a
  ``StopIteration`` as ``RuntimeError``, as in a generator: it would end the tests' ``map()``
  early and pass ``all(map(...))`` unchecked).
  The tests' process is not dumpable and keeps its own uid and its own Landlock domain,
  so the unprivileged solution cannot read its memory or descriptors either. A single
  ``program`` holds its nonce in the same interpreter as the code it judges, so code that
  searches that interpreter (its frames, ``gc``) can forge it: use ``tests`` for scoring. What a
  split run gives up: an argument the solution changes in place is not changed on the tests'
  side, and a result of the solution's own class can only be compared through plain values.
  The tests' namespace still holds the solution's top-level names, as the benchmarks define it
  (one program): a solution that rebinds a name the tests call (a builtin such as ``abs``, a
  module the prompt imported) changes what they call, in either form.
  Started as another user *and* without Landlock, the solution shares the caller's uid, and
  where the kernel lets a process read its ancestors' memory (Yama ``ptrace_scope`` 0) it could
  read the nonce from the caller; root or Landlock closes that.
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
- **Privileges**: started as root, the program runs as a uid of its own (one per run, no
  account's), gid the same, no supplementary groups, with every capability dropped from every
  set but ``CAP_DAC_READ_SEARCH`` (reading stays allowed: the interpreter may sit under
  ``/root``) and ``no_new_privs`` set, so a setuid binary cannot give root back. It owns nothing
  outside its directory, so ``chmod``, ``chown``, ``utime`` and ``setxattr`` there fail, and it
  cannot renice, pin or reschedule any process of another uid (its supervisor, other runs).
  That uid holds at most :data:`MAX_PROCESSES` processes and threads (``RLIMIT_NPROC``), so a fork
  bomb gets ``BlockingIOError`` there instead of filling the machine's process table until the timeout.
  ``RunResult.unprivileged`` says whether this held. Started as another user, the program keeps
  that user's rights.
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
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from unmask.errors import UnmaskError

Status = Literal["passed", "failed", "timeout", "crash"]

_SETUP_FAILED = 97  # exit code of the bootstrap when required confinement failed
# Each run gets its own uid from this range (start, size), one no account uses, so concurrent
# runs cannot renice or pin each other either.
_RUN_UIDS = (0x7F000000, 0x00FFFFFF)
MAX_PROCESSES = 256  # tasks (processes and threads) a run's own uid may hold: a fork bomb stops there

# Runs in the child before the program (python -c): limits, the supervisor, confinement.
_BOOTSTRAP = (Path(__file__).with_name("_sandbox_boot.py")).read_text(encoding="utf-8")
# Both halves of a split run (tests apart from the solution); the bootstrap executes it.
_SPLIT = (Path(__file__).with_name("_sandbox_split.py")).read_text(encoding="utf-8")


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

    ``status``: ``passed`` (ran to its last statement, then exit code 0), ``failed`` (non-zero
    exit: an exception, a failed assert, ``sys.exit(1)``, ``MemoryError``; an exit with status 0
    before the last statement; the disk quota exceeded), ``timeout`` (wall clock exceeded; killed) or
    ``crash`` (killed by a signal such as SIGSEGV, SIGXCPU or SIGXFSZ, or sandbox set-up
    failed). ``returncode`` is negative for a signal, ``None`` after a timeout.
    ``seconds`` is wall-clock time. The tails are the last characters of each stream.
    ``fs_confined``: Landlock confined the run's writes. ``unprivileged``: the program ran without
    uid 0 and without capabilities (but CAP_DAC_READ_SEARCH), see the module doc.
    """

    status: Status
    returncode: int | None
    seconds: float
    stdout_tail: str
    stderr_tail: str
    fs_confined: bool
    unprivileged: bool = False

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


def _read(f) -> bytes:
    f.seek(0)
    return f.read()


def _verdict(result: dict | None, rc_exited: bool, verdict: bytes, nonce: bytes, require: bool,
             confined: bool) -> tuple[Status, int | None, str]:
    """(status, returncode, note for stderr) from the supervisor's report and the verdict file."""
    if result is None or result.get("reason") == "timeout" or not rc_exited:
        return "timeout", None, ""
    raw = result.get("status")
    rc = os.waitstatus_to_exitcode(raw) if isinstance(raw, int) else None
    if result.get("reason") == "disk":
        return "failed", rc, "unmask sandbox: the program wrote more than its disk quota to its directory; killed"
    if rc is None:
        return "crash", rc, ""
    if rc == 0 and verdict == nonce:
        return "passed", rc, ""
    if rc == 0:
        return "failed", rc, "unmask sandbox: the program ended with status 0 before its last statement ran; not a pass"
    if rc < 0 or (rc == _SETUP_FAILED and require and not confined):
        return "crash", rc, ""
    return "failed", rc, ""


def run_program(program: str, *, tests: str | None = None, timeout_s: float = 10.0, memory_mb: int = 2048,
                max_output_mb: int = 16, max_disk_mb: int = 64, network: bool = False,
                require_confinement: bool = False, tail_chars: int = 2000) -> RunResult:
    """Run ``program`` (Python source) in a sandboxed child process; see the module doc.

    The verdict needs positive evidence: ``passed`` means the program's top level ran to its
    last statement (for a test program: the final ``check(...)`` or assert returned) and then
    exited with status 0. The bootstrap writes a per-run random nonce, received on a pipe that
    is closed before the program starts and never in its namespace, to a verdict file after the
    program returns; a program that ends the interpreter early (``sys.exit(0)``, ``os._exit(0)``,
    an ``atexit`` hook, ``exec`` of another binary, a thread, ...) leaves no nonce and fails.
    With ``tests``, the verdict is the tests': they run in their own process, ``passed`` means
    their last statement returned, and the solution cannot reach the nonce (see the module doc).

    Args:
        program: source code, run as ``__main__`` from ``main.py`` in a temporary directory; with
            ``tests``, the solution: its top level runs first, then it answers the tests' calls.
        tests: test source, run as ``__main__`` in a separate process that sees ``program``'s
            top-level names as proxies. Its uncaught exception (traceback on stderr) is ``failed``,
            the solution's crash ``crash``, the solution's exit with status 0 before the tests end
            ``failed``.
        timeout_s: wall-clock limit in seconds; every descendant is killed after it.
        memory_mb: address-space limit (``RLIMIT_AS``) in MiB.
        max_output_mb: largest file the child may write, stdout/stderr included, in MiB.
        max_disk_mb: total bytes the program may keep in its directory (all files; also at most
            10,000 entries), in MiB; the supervisor checks every 50 ms and kills it beyond that.
        network: leave sockets alone (default: disabled, best effort).
        require_confinement: raise instead of running when Landlock is unavailable.
        tail_chars: how many trailing characters of stdout/stderr to keep.

    Raises:
        UnmaskError: bad limits, or ``require_confinement`` without kernel support.
    """
    if timeout_s <= 0 or memory_mb <= 0 or max_output_mb <= 0 or max_disk_mb <= 0:
        raise UnmaskError("run_program: timeout_s, memory_mb, max_output_mb and max_disk_mb must be > 0")
    use_landlock = landlock_abi() > 0
    if require_confinement and not use_landlock:
        raise UnmaskError("file-system confinement needs Linux Landlock (kernel >= 5.13 with "
                          "the landlock LSM); run without require_confinement or in a container")
    cfg = {"mem": memory_mb * 2**20, "fsize": max_output_mb * 2**20,
           "cpu": int(timeout_s) + 2, "network": network, "landlock": use_landlock,
           "require": require_confinement, "timeout": timeout_s, "disk": max_disk_mb * 2**20,
           "disk_files": 10_000, "uid": _RUN_UIDS[0] + secrets.randbelow(_RUN_UIDS[1]),
           "procs": MAX_PROCESSES}
    nonce = secrets.token_hex(16).encode()
    workdir = tempfile.mkdtemp(prefix="unmask-sandbox-")
    env = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    nonce_r = nonce_w = None
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(program)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                tempfile.TemporaryFile() as report, tempfile.TemporaryFile() as result, \
                tempfile.TemporaryFile() as verdict, tempfile.TemporaryFile() as tests_file:
            nonce_r, nonce_w = os.pipe()
            os.write(nonce_w, nonce)  # 32 bytes: fits the pipe buffer, so this never blocks
            os.close(nonce_w)
            nonce_w = None
            cfg.update(report_fd=report.fileno(), result_fd=result.fileno(), verdict_fd=verdict.fileno(),
                       nonce_fd=nonce_r)
            fds = [report.fileno(), result.fileno(), verdict.fileno(), nonce_r]
            if tests is not None:  # an unlinked file, not the directory: the solution must not read it
                tests_file.write(tests.encode("utf-8"))
                tests_file.flush()
                cfg["tests_fd"] = tests_file.fileno()
                fds.append(tests_file.fileno())
            start = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, json.dumps(cfg)] + ([_SPLIT] if tests is not None else []),
                cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True, close_fds=True, pass_fds=tuple(fds))
            os.close(nonce_r)
            nonce_r = None
            # The supervisor enforces the deadline itself; the grace covers its start and clean-up.
            exited = _wait_for_exit(proc, timeout_s + 10.0)
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # a last resort when the supervisor itself died
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            seconds = time.monotonic() - start
            stdout, stderr = _tail(out, tail_chars), _tail(err, tail_chars)
            flags = _read(report)
            confined, unprivileged = flags[:1] == b"1", flags[1:2] == b"1"
            try:
                supervisor = json.loads(_read(result) or b"null")
            except ValueError:
                supervisor = None
            status, rc, note = _verdict(supervisor, exited, _read(verdict), nonce, require_confinement, confined)
    finally:
        for fd in (nonce_r, nonce_w):
            if fd is not None:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    if note:
        stderr = (stderr + ("\n" if stderr and not stderr.endswith("\n") else "") + note + "\n")[-tail_chars:]
    return RunResult(status, rc, seconds, stdout, stderr, confined, unprivileged)
