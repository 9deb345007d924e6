"""Sandboxed execution: statuses, timeout, limits and what the confinement guarantees."""

import os
import socket
import textwrap
import time

import pytest

from unmask.errors import UnmaskError
from unmask.eval import sandbox
from unmask.eval.sandbox import landlock_abi, run_program

needs_landlock = pytest.mark.skipif(landlock_abi() < 1, reason="kernel has no Landlock")


def test_pass_and_output():
    r = run_program("print('hello')")
    assert r.status == "passed" and r.passed and r.returncode == 0
    assert r.stdout_tail.strip() == "hello"


@pytest.mark.parametrize("program, status", [
    ("raise ValueError('boom')", "failed"),
    ("import sys; sys.exit(1)", "failed"),
    ("assert 1 == 2", "failed"),
    ("import ctypes; ctypes.string_at(0)", "crash"),  # segfault
    ("def f(:", "failed"),                            # syntax error
])
def test_failures_are_not_passes(program, status):
    r = run_program(program, timeout_s=5)
    assert r.status == status and not r.passed
    if status == "crash":
        assert r.returncode < 0


def test_stderr_tail_names_the_error():
    assert "ValueError: boom" in run_program("raise ValueError('boom')").stderr_tail


def test_infinite_loop_is_killed_at_timeout():
    start = time.monotonic()
    r = run_program("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout" and r.returncode is None
    assert 1.0 <= r.seconds < 3.0 and time.monotonic() - start < 4.0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
@pytest.mark.parametrize("parent_waits", [False, True])
def test_whole_process_group_is_killed(parent_waits):
    program = textwrap.dedent(f"""
        import os, sys, time
        pid = os.fork()
        if pid == 0:
            print(os.getpid(), flush=True)
            time.sleep(60)
        elif {parent_waits}:
            time.sleep(60)
    """)
    r = run_program(program, timeout_s=1.0)
    assert r.status == ("timeout" if parent_waits else "passed")
    child = int(r.stdout_tail.split()[0])
    deadline = time.monotonic() + 2
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(child)


def test_memory_limit():
    r = run_program("x = bytearray(2 * 1024**3)", memory_mb=256)
    assert r.status == "failed" and "MemoryError" in r.stderr_tail


def test_output_limit():
    r = run_program("import sys\nfor _ in range(64):\n    sys.stdout.write('x' * 65536)",
                    max_output_mb=1)
    assert not r.passed


def test_temp_dir_is_cwd_and_removed():
    r = run_program("import os\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())")
    assert r.passed
    workdir = r.stdout_tail.strip()
    assert os.path.basename(workdir).startswith("unmask-sandbox-")
    assert not os.path.exists(workdir)


def test_environment_is_stripped(monkeypatch):
    monkeypatch.setenv("UNMASK_TEST_SECRET", "hunter2")
    r = run_program("import os\nprint(sorted(os.environ))")
    assert r.passed and "UNMASK_TEST_SECRET" not in r.stdout_tail and "PATH" in r.stdout_tail


@needs_landlock
def test_writes_outside_the_temp_dir_are_prevented(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("original")
    program = textwrap.dedent(f"""
        import os, shutil
        target = {str(outside)!r}
        attempts = {{
            "create": lambda: open(os.path.join(target, "new.txt"), "w").write("x"),
            "overwrite": lambda: open(os.path.join(target, "keep.txt"), "w").write("x"),
            "append": lambda: open(os.path.join(target, "keep.txt"), "a").write("x"),
            "remove": lambda: os.remove(os.path.join(target, "keep.txt")),
            "mkdir": lambda: os.mkdir(os.path.join(target, "d")),
            "rename_out": lambda: (open("mine.txt", "w").write("x"),
                                   os.rename("mine.txt", os.path.join(target, "moved.txt"))),
            "symlink": lambda: os.symlink("/etc/passwd", os.path.join(target, "link")),
        }}
        for name, attempt in attempts.items():
            try:
                attempt()
                print(name, "ALLOWED")
            except PermissionError:
                print(name, "denied")
    """)
    r = run_program(program)
    assert r.passed, r.stderr_tail
    assert r.fs_confined
    lines = r.stdout_tail.split("\n")
    assert all(line.endswith("denied") for line in lines if line), r.stdout_tail
    assert len([line for line in lines if line]) == 7
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert (outside / "keep.txt").read_text() == "original"


def test_socket_module_is_disabled():
    r = run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))")
    assert r.status == "failed" and "network access is disabled" in r.stderr_tail


@pytest.mark.skipif(landlock_abi() < 4, reason="Landlock network rules need ABI >= 4")
def test_tcp_connect_is_refused_by_the_kernel():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        # _socket bypasses the monkeypatched socket module; the kernel rule still holds.
        r = run_program(f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))")
        assert r.status == "failed" and "PermissionError" in r.stderr_tail
        with pytest.raises(TimeoutError):
            server.accept()


def test_network_can_be_allowed():
    r = run_program("import socket\nsocket.socket().close()", network=True)
    assert r.passed, r.stderr_tail


def test_require_confinement_without_landlock(monkeypatch):
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)
    with pytest.raises(UnmaskError):
        run_program("pass", require_confinement=True)
    r = run_program("pass")
    assert r.passed and not r.fs_confined


def test_bad_limits():
    with pytest.raises(UnmaskError):
        run_program("pass", timeout_s=0)
