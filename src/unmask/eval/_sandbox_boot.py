"""The sandbox bootstrap: ``python -I -B -c <this file's text> CONFIG`` (see :mod:`unmask.eval.sandbox`).

Not a module to import. Self-contained, standard library only. It applies the limits, then
forks once: the parent half supervises (a child subreaper that enforces the deadline and the
disk quota, then kills every descendant, and reports to ``result_fd``), the child half confines
itself (Landlock, no sockets) and runs ``main.py``, writing the run's nonce to ``verdict_fd``
only after the program's last statement returned. With ``tests_fd`` (a split run) the child
forks again first: the tests' half reads the nonce and the tests and judges; the solution's half
closes all of that, then drops its privileges and serves the tests (``argv[2]``, the text of
``_sandbox_split.py``).
"""
if __name__ != "__main__":
    raise ImportError("unmask.eval._sandbox_boot is run by unmask.eval.sandbox.run_program, not imported")
import ctypes, json, os, resource, signal, sys, time
cfg = json.loads(sys.argv[1])
for name, value in (("RLIMIT_AS", cfg["mem"]), ("RLIMIT_CPU", cfg["cpu"]),
                    ("RLIMIT_FSIZE", cfg["fsize"]), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (value, value))

def descendants():
    """Live (non-zombie) descendants of this process, from /proc."""
    children = {}
    for name in (os.listdir("/proc") if os.path.isdir("/proc") else ()):
        if name.isdigit():
            try:
                with open("/proc/" + name + "/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append((int(name), fields[0] == b"Z"))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [os.getpid()]
    while todo:
        for pid, zombie in children.get(todo.pop(), ()):
            todo.append(pid)
            if not zombie:
                out.append(pid)
    return out

def reap():
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return

def kill_all():
    """SIGKILL every descendant; orphans come back to us (we are their subreaper) and die too."""
    for _ in range(1000):
        live = descendants()
        if not live:
            break
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.001)
        reap()
    reap()

def usage(root, cap_files):
    total = files = 0
    for top, dirs, names in os.walk(root):
        for n in dirs + names:
            files += 1
            try:
                total += os.lstat(os.path.join(top, n)).st_blocks * 512
            except OSError:
                pass
        if files > cap_files:
            break
    return total, files

def supervise(child):
    deadline = time.monotonic() + cfg["timeout"]
    next_check, status, reason = 0.0, None, None
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == child:
            status = st
            break
        if pid:
            continue  # an orphaned descendant, reaped
        now = time.monotonic()
        if now >= deadline:
            reason = "timeout"
            break
        if now >= next_check:
            total, files = usage(os.getcwd(), cfg["disk_files"])
            if total > cfg["disk"] or files > cfg["disk_files"]:
                reason = "disk"
                break
            next_check = now + 0.05
        time.sleep(0.002)
    kill_all()
    return {"status": status, "reason": reason}

_libc = ctypes.CDLL(None, use_errno=True)
if hasattr(_libc, "prctl"):  # Linux; elsewhere the parent's process-group kill is all there is
    _libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphaned descendants are reparented to us
_child = os.fork()
if _child:
    for _fd in (cfg["verdict_fd"], cfg["report_fd"], cfg["nonce_fd"], cfg.get("tests_fd")):
        if _fd is not None:
            os.close(_fd)
    os.write(cfg["result_fd"], json.dumps(supervise(_child)).encode())
    os._exit(0)
os.close(cfg["result_fd"])
del _libc, _child, descendants, reap, kill_all, usage, supervise
_split = _judge = None
if cfg.get("tests_fd") is not None:
    # Split run: fork the solution's process off before anything secret is read; it closes the
    # tests' channel and never holds the nonce, the tests' source or the verdict file.
    _to_solution, _to_tests = os.pipe(), os.pipe()
    _solution = os.fork()
    if _solution == 0:
        for _fd in (cfg["verdict_fd"], cfg["nonce_fd"], cfg["tests_fd"], _to_solution[1], _to_tests[0]):
            os.close(_fd)
        _split = (_to_solution[0], _to_tests[1])
    else:
        for _fd in (cfg["report_fd"], _to_solution[0], _to_tests[1]):
            os.close(_fd)
        _judge = (_solution, _to_tests[0], _to_solution[1])
    del _to_solution, _to_tests, _solution

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

def drop_privileges(uid):
    """Run as ``uid`` (and gid ``uid``, no supplementary groups) with no capability but
    CAP_DAC_READ_SEARCH, and no way to gain one (bounding set emptied, no_new_privs).

    Without uid 0 the program owns no file outside its directory, so it cannot chmod, chown,
    utime or setxattr them, and it cannot renice, pin or reschedule processes of another uid;
    a per-run uid keeps concurrent runs apart too. CAP_DAC_READ_SEARCH (also ambient, so a
    subprocess keeps it) keeps the one thing the sandbox allows, reading: the interpreter and
    its packages may sit under a directory only root can enter (/root/.pyenv). True when the
    program ends up without uid 0 and without any other capability."""
    libc = ctypes.CDLL(None, use_errno=True)
    read_search = 2                                    # CAP_DAC_READ_SEARCH
    if os.geteuid() == 0:
        for path in (".", "main.py"):                  # the program's own directory stays its own
            os.chown(path, uid, uid)
        for cap in range(64):                          # PR_CAPBSET_DROP each, up to the last (EINVAL)
            if cap != read_search and libc.prctl(24, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:
                break
        libc.prctl(8, 1, 0, 0, 0)                      # PR_SET_KEEPCAPS across the uid change
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        libc.prctl(8, 0, 0, 0, 0)
        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                        ("inheritable", ctypes.c_uint32)]
        keep = 1 << read_search
        data = (Data * 2)(Data(keep, keep, keep), Data(0, 0, 0))
        if libc.capset(ctypes.byref(Header(0x20080522, 0)), data) != 0:  # _LINUX_CAPABILITY_VERSION_3
            raise OSError(ctypes.get_errno(), "capset")
        libc.prctl(47, 2, read_search, 0, 0)           # PR_CAP_AMBIENT_RAISE: kept by subprocesses
    if libc.prctl(38, 1, 0, 0, 0) != 0:                # PR_SET_NO_NEW_PRIVS: no setuid binary regains root
        return False
    with open("/proc/self/status") as f:
        eff = int(next(ln for ln in f if ln.startswith("CapEff:")).split()[1], 16)
    return os.getuid() != 0 and os.geteuid() != 0 and eff & ~(1 << read_search) == 0

def judge_tests(solution, rfd, wfd):
    """The tests' process of a split run: it keeps its uid but lets no other process read its
    memory or files (not dumpable; its own Landlock domain, so the solution, in another one, cannot
    ptrace it), runs the tests against the solution's proxies, and writes the nonce only when
    their last statement returned. Ends the process with the run's status."""
    import traceback
    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    nonce = os.read(cfg["nonce_fd"], 64)
    os.close(cfg["nonce_fd"])
    with os.fdopen(cfg["tests_fd"], "rb") as f:
        f.seek(0)
        tests = f.read().decode("utf-8")
    if cfg["landlock"]:
        try:
            confined = landlock(os.getcwd(), not cfg["network"])
        except Exception:
            confined = False
        if cfg["require"] and not confined:
            sys.stderr.write("unmask sandbox: Landlock confinement failed\n")
            os._exit(97)
    rpc = {}
    exec(compile(sys.argv[2], "_sandbox_split.py", "exec"), rpc)
    try:
        rpc["judge"](tests, solution, rfd, wfd)
    except rpc["SolutionGone"]:
        _, status = os.waitpid(solution, 0)
        rpc["_flush"]()
        if os.WIFSIGNALED(status):  # end like the solution did: a crash stays a crash
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
            os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(os.waitstatus_to_exitcode(status))  # 0 leaves no nonce: not a pass
    except BaseException:
        traceback.print_exc()
        rpc["_flush"]()
        os._exit(1)
    os.write(cfg["verdict_fd"], nonce)
    try:  # let the solution flush its output and end
        rpc["_send"](wfd, __import__("pickle").dumps(("exit", None, (), {})))
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and os.waitpid(solution, os.WNOHANG)[0] == 0:
            time.sleep(0.005)
    except OSError:
        pass
    rpc["_flush"]()
    os._exit(0)

if _judge is not None:
    judge_tests(*_judge)  # never returns
unprivileged = False
try:
    unprivileged = drop_privileges(cfg["uid"])
    if unprivileged:  # the uid is this run's alone, so the count is exactly its processes and threads
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["procs"], cfg["procs"]))
except Exception:  # e.g. a uid outside this user namespace's map: try the overflow uid instead
    try:
        unprivileged = cfg["uid"] != 65534 and os.geteuid() == 0 and drop_privileges(65534)
    except Exception:
        unprivileged = False
confined = False
if cfg["landlock"]:
    try:
        confined = landlock(os.getcwd(), not cfg["network"])
    except Exception:
        confined = False
os.write(cfg["report_fd"], (b"1" if confined else b"0") + (b"1" if unprivileged else b"0"))  # tell the parent
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
if _split is not None:
    del ctypes, json, resource, signal, time, landlock, drop_privileges, judge_tests, cfg, confined, unprivileged
    _rpc = {}
    exec(compile(sys.argv[2], "_sandbox_split.py", "exec"), _rpc)
    sys.argv = ["main.py"]
    _ns = {"__name__": "__main__", "__builtins__": __builtins__}
    with open("main.py", encoding="utf-8") as _f:
        exec(compile(_f.read(), "main.py", "exec"), _ns)
    _rpc["serve"](_ns, *_split)
_nonce = os.read(cfg["nonce_fd"], 64)
os.close(cfg["nonce_fd"])
def _sealed(nonce, fd):
    def done():  # the evidence that the program ran to its last statement
        os.write(fd, nonce)
    return done

def _run(code, done):
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    done()

_done = _sealed(_nonce, cfg["verdict_fd"])
del ctypes, json, resource, signal, time, landlock, drop_privileges, judge_tests, cfg, confined, unprivileged
del _nonce, _sealed, _split, _judge
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f
_run(_code, globals().pop("_done"))  # held by _run's frame only, not by the module namespace
