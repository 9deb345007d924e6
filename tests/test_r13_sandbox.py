"""Issue 48 items 11 and 12: the sandbox's verdict cannot be forged from inside the program, and
the program runs without privileges (no uid 0, no capabilities)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from unmask.eval.sandbox import run_program

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="the privilege drop is tested where the sandbox starts as root (here and in CI)")


# --- item 12: no privileges ---------------------------------------------------------------------


def all_denied(attempts: dict[str, str]) -> None:
    """Runs each ``name: statement`` inside the sandbox; asserts every one raised OSError."""
    program = "import os\n" + "".join(
        f"try:\n    {stmt}\n    print({name!r}, 'ALLOWED')\n"
        f"except OSError as e:\n    print({name!r}, 'denied', type(e).__name__)\n" for name, stmt in attempts.items())
    r = run_program(program)
    assert r.passed, r
    lines = [ln for ln in r.stdout_tail.splitlines() if ln]
    assert len(lines) == len(attempts) and all(" denied " in ln for ln in lines), r.stdout_tail


@linux_only
@as_root
def test_program_runs_unprivileged():
    r = run_program(textwrap.dedent("""
        import os
        print(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())
        status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
        print(status["CapEff"].strip(), status["CapPrm"].strip(), status["CapBnd"].strip(), status["NoNewPrivs"].strip())
        open("mine.txt", "w").write("the program can still use its own directory")
        print(open("mine.txt").read())
        import subprocess, sys  # a subprocess still reads the interpreter's files
        subprocess.run([sys.executable, "-c", "import fractions, email.mime.text"], check=True)
    """))
    assert r.passed, r
    ids, caps, mine = r.stdout_tail.strip().splitlines()
    uid, euid, gid, groups = ids.split(" ", 3)
    assert int(uid) != 0 and int(euid) != 0 and int(gid) != 0 and groups == "[]", ids
    # CAP_DAC_READ_SEARCH (bit 2) alone is kept: reading stays allowed, the interpreter may live
    # under /root; every other capability is gone from every set, and none can come back.
    assert caps.split() == ["0000000000000004"] * 3 + ["1"], caps
    assert mine == "the program can still use its own directory"
    assert r.unprivileged


@linux_only
@as_root
def test_program_cannot_change_metadata_outside_its_directory(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    os.chmod(victim, 0o644)
    before = os.stat(victim)
    target = repr(str(victim))
    all_denied({
        "chmod": f"os.chmod({target}, 0o777)",
        "chown": f"os.chown({target}, 12345, 12345)",
        "utime_now": f"os.utime({target})",
        "utime_past": f"os.utime({target}, (0, 0))",
        "setxattr": f"os.setxattr({target}, 'user.unmask', b'x')",
        "removexattr": f"os.removexattr({target}, 'user.absent')",
    })
    after = os.stat(victim)
    assert (after.st_mode, after.st_uid, after.st_gid, after.st_mtime_ns) == \
        (before.st_mode, before.st_uid, before.st_gid, before.st_mtime_ns)
    assert os.listxattr(victim) == []


@linux_only
@as_root
def test_program_cannot_renice_or_pin_other_processes():
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        prio, affinity = os.getpriority(os.PRIO_PROCESS, outside.pid), os.sched_getaffinity(outside.pid)
        pid = outside.pid
        all_denied({
            "setpriority": f"os.setpriority(os.PRIO_PROCESS, {pid}, 19)",
            "setpriority_pgrp": f"os.setpriority(os.PRIO_PGRP, os.getpgid({pid}), 19)",
            "setpriority_supervisor": "os.setpriority(os.PRIO_PROCESS, os.getppid(), 19)",
            "sched_setaffinity": f"os.sched_setaffinity({pid}, {{0}})",
            "sched_setaffinity_supervisor": "os.sched_setaffinity(os.getppid(), {0})",
            "sched_setscheduler": f"os.sched_setscheduler({pid}, os.SCHED_IDLE, os.sched_param(0))",
        })
        assert os.getpriority(os.PRIO_PROCESS, outside.pid) == prio
        assert os.sched_getaffinity(outside.pid) == affinity
        assert os.sched_getscheduler(outside.pid) == os.SCHED_OTHER
    finally:
        outside.kill()
        outside.wait()


@linux_only
@as_root
def test_concurrent_runs_do_not_share_a_uid():
    program = "import os, time\nprint(os.getuid(), flush=True)\ntime.sleep(0.3)\n"
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        uids = [int(r.stdout_tail) for r in pool.map(lambda _: run_program(program), range(4))]
    assert len(set(uids)) == 4 and 0 not in uids, uids


def test_unprivileged_run_still_cleans_up():
    start = time.monotonic()
    r = run_program("import os\nos.mkdir('d')\nopen('d/f', 'w').write('x')\nos.chmod('d', 0o500)\nprint(os.getcwd())")
    assert r.passed, r
    assert not os.path.exists(r.stdout_tail.strip())
    assert time.monotonic() - start < 10


# --- item 11: the verdict cannot be forged --------------------------------------------------------

from unmask.eval.code_tasks import JudgedProgram, evaluate_humaneval, evaluate_mbpp, pass_at_1  # noqa: E402
from unmask.eval.datasets import HumanEvalTask, MBPPTask  # noqa: E402

# A wrong answer (always True; the task's tests expect False as well) that tries to forge a pass.
TASK = HumanEvalTask(
    task_id="HumanEval/forge", prompt="def is_even(n: int) -> bool:\n    \"\"\"True for even n.\"\"\"\n",
    entry_point="is_even", canonical_solution="    return n % 2 == 0\n",
    test="\n\nMARKER = 'expected-values-6f3c'\n\ndef check(candidate):\n    assert candidate(2) is True\n"
         "    assert candidate(3) is False\n    assert candidate(7) is False\n")
MBPP = MBPPTask(task_id=1, text="is_even", code="def is_even(n):\n    return n % 2 == 0",
                test_list=("assert is_even(2) == True", "assert is_even(3) == False"))

# The frame trick of the issue: the bootstrap's caller frame holds `done`.
FRAME_LITERAL = "import os, sys\ntry:\n    sys._getframe(1).f_locals['done']()\nexcept Exception:\n    pass\n"
# Every frame up the stack, locals and globals, for anything that looks like the verdict.
FRAME_WALK = """
import os, sys
_f = sys._getframe()
while _f is not None:
    for _scope in (_f.f_locals, _f.f_globals):
        for _v in list(_scope.values()):
            if callable(_v) and getattr(_v, "__name__", "") in ("done", "_done", "judge", "judge_tests"):
                try:
                    _v()
                except BaseException:
                    pass
    _f = _f.f_back
"""
GC_WALK = """
import gc, os
for _o in gc.get_objects():
    if callable(_o) and getattr(_o, "__name__", "") in ("done", "_done"):
        try:
            _o()
        except BaseException:
            pass
    for _cell in (getattr(_o, "__closure__", None) or ()):  # (nonce, fd) kept in a closure
        try:
            _c = _cell.cell_contents
        except ValueError:
            continue
        if isinstance(_c, bytes) and len(_c) == 32:
            for _fd in range(3, 64):
                try:
                    os.write(_fd, _c)
                except OSError:
                    pass
"""
# Every secret-looking string from every place this process can read, written to every file
# descriptor it has or can open through /proc; the tests' source searched for on the way.
EVERYTHING = GC_WALK + FRAME_WALK + """
import re, secrets
_hex = re.compile(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")
_found, _leak = set(), []
_needle = "expected-values-" + "6f3c"  # the tests' marker; only this process' memory holds it whole
def _scan(data, own=False):
    _found.update(_hex.findall(data))
    if not own and _needle.encode() in data:
        _leak.append(True)
def _read(path, limit=1 << 22):
    try:  # non-blocking: a pipe with nothing in it must not stall the forge
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        _scan(os.read(fd, limit))
    except OSError:
        pass
    finally:
        os.close(fd)
for _pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for _name in ("cmdline", "environ"):
        _read(f"/proc/{_pid}/{_name}")
    try:
        _maps = open(f"/proc/{_pid}/maps").read().splitlines()
        _mem = open(f"/proc/{_pid}/mem", "rb", 0)
    except OSError:
        continue
    for _line in _maps:
        _lo, _hi = (int(x, 16) for x in _line.split()[0].split("-"))
        if "r" not in _line.split()[1] or _hi - _lo > 1 << 26:
            continue
        try:
            _mem.seek(_lo)
            _scan(_mem.read(_hi - _lo), own=int(_pid) == os.getpid())
        except (OSError, ValueError, OverflowError):
            pass
    try:
        _fds = os.listdir(f"/proc/{_pid}/fd")
    except OSError:
        continue
    for _fd in _fds:
        _read(f"/proc/{_pid}/fd/{_fd}")
for _top, _dirs, _names in os.walk("."):
    for _n in _names:
        _read(os.path.join(_top, _n))
_guesses = list(_found) + [secrets.token_hex(16).encode() for _ in range(64)]
_targets = list(range(3, 1024))
for _pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        _fds = os.listdir(f"/proc/{_pid}/fd")
    except OSError:
        continue
    for _fd in _fds:
        try:
            _targets.append(os.open(f"/proc/{_pid}/fd/{_fd}", os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        except OSError:
            pass
for _fd in _targets:
    try:
        os.set_blocking(_fd, False)  # a full pipe must not stall the forge
    except OSError:
        continue
    for _g in _guesses:
        try:
            os.write(_fd, _g)
        except OSError:
            break
if _leak:
    print("TESTS LEAKED", flush=True)
"""
FORGES = {"frame literal": FRAME_LITERAL, "frame walk": FRAME_WALK, "gc walk": GC_WALK,
          "everything": EVERYTHING}
ENDINGS = {"os._exit(0)": "os._exit(0)\n", "sys.exit(0)": "sys.exit(0)\n",
           "return": ""}  # return: the forge then answers wrongly and lets the tests fail


def _body(code: str, indent: str) -> str:
    return textwrap.indent(code, indent)


CASES = [(forge, ending) for forge in FORGES if forge != "everything" for ending in ENDINGS] + [
    ("everything", "os._exit(0)")]  # a few seconds: it reads every process' memory it can


@linux_only
@pytest.mark.parametrize("where", ["top level", "inside the call"])
@pytest.mark.parametrize("forge, ending", CASES)
def test_humaneval_verdict_cannot_be_forged(forge, ending, where):
    code = FORGES[forge] + "import sys\n" + ENDINGS[ending]
    if where == "inside the call":
        completion = _body(code, "    ") + "    return True\n"
    else:
        completion = "    return True\n" + code
    r = evaluate_humaneval(tasks=[TASK], completions=[completion], postprocess=False, timeout_s=30)
    assert r.pass_at_1 == 0.0, r.results[0]
    assert "TESTS LEAKED" not in r.results[0].stdout_tail
    if forge != "everything":  # the same code around a right answer still passes
        honest = evaluate_humaneval(tasks=[TASK], completions=[_body(code.replace(ENDINGS[ending], ""), "    ")
                                                               + "    return n % 2 == 0\n"], postprocess=False)
        assert honest.pass_at_1 == 1.0, honest.results[0]


@linux_only
@pytest.mark.parametrize("forge", ["frame walk", "gc walk"])
def test_mbpp_verdict_cannot_be_forged(forge):
    wrong = "def is_even(n):\n" + _body(FORGES[forge] + "os._exit(0)\n", "    ") + "    return True\n"
    assert evaluate_mbpp(tasks=[MBPP], completions=[wrong], postprocess=False).pass_at_1 == 0.0
    top = "def is_even(n):\n    return True\n" + FORGES[forge] + "os._exit(0)\n"
    assert evaluate_mbpp(tasks=[MBPP], completions=[top], postprocess=False).pass_at_1 == 0.0
    assert evaluate_mbpp(tasks=[MBPP], completions=[MBPP.code]).pass_at_1 == 1.0


LIARS = {
    "__eq__ always True": "class Liar:\n    def __eq__(self, other):\n        return True\n",
    "__bool__ always True": "class Liar:\n    def __bool__(self):\n        return True\n",
    "int subclass": "class Liar(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n",
    "list subclass": "class Liar(list):\n    def __eq__(self, other):\n        return True\n",
}


@pytest.mark.parametrize("liar", list(LIARS))
def test_an_object_that_lies_about_equality_is_not_a_pass(liar):
    """The tests compare plain values in their own process: a result is converted to the plain
    value it stands for, or, when it has none, refused for comparison."""
    solution = LIARS[liar] + "def add(a, b):\n    return Liar()\n"
    r = run_program(solution, tests="assert add(1, 2) == 3\nassert add(1, 2)\nassert add(2, 2) == [4]\n")
    assert r.status == "failed", r


def test_judged_program_keeps_what_tests_need():
    """Objects of the solution's own classes travel as proxies (task 367 builds a tree from
    them in its setup code); generators, exceptions, output and plain values work as in one
    process."""
    solution = textwrap.dedent("""
        import collections
        class Node:
            def __init__(self, data):
                self.data, self.left = data, None
        def depth(node):
            return 0 if node is None else 1 + depth(node.left)
        def squares(n):
            print("squares", n)
            return (i * i for i in range(n))
        def counts(s):
            return collections.Counter(s)
        def boom():
            raise ValueError("no")
    """)
    tests = textwrap.dedent("""
        import collections
        root = Node(1)
        root.left = Node(2)
        root.left.left = Node(3)
        assert depth(root) == 3 and root.left.data == 2
        assert list(squares(4)) == [0, 1, 4, 9]
        assert counts("abca") == collections.Counter({"a": 2, "b": 1, "c": 1}) == {"a": 2, "b": 1, "c": 1}
        try:
            boom()
        except ValueError as e:
            assert str(e) == "no"
        else:
            raise AssertionError("no exception")
        print("tests done")
    """)
    r = run_program(solution, tests=tests)
    assert r.passed, r
    assert r.stdout_tail.split() == ["squares", "4", "tests", "done"]
    assert r.unprivileged or os.geteuid() != 0  # the solution's process drops its privileges too
    r = run_program(solution, tests=tests + "assert depth(root) == 4\n")
    assert r.status == "failed" and "assert depth(root) == 4" in r.stderr_tail, r


def test_judged_crash_and_early_exit_keep_their_status():
    assert run_program("def f():\n    import ctypes; ctypes.string_at(0)\n", tests="f()\n").status == "crash"
    early = run_program("def f():\n    import os; os._exit(0)\n", tests="f()\n")
    assert early.status == "failed" and "before its last statement" in early.stderr_tail
    assert run_program("import sys\nsys.exit(3)\n", tests="pass\n").returncode == 3
    assert run_program("while True:\n    pass\n", tests="pass\n", timeout_s=1).status == "timeout"


def test_pass_at_1_takes_judged_programs():
    r = pass_at_1(programs=[JudgedProgram("def f():\n    return 1\n", "assert f() == 1\n"),
                            JudgedProgram("def f():\n    return 2\n", "assert f() == 1\n")])
    assert [x.status for x in r.results] == ["passed", "failed"]
