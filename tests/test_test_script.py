"""scripts/test.sh prints pytest's summary line (issue 15 item 4): -q in addopts plus -q on the
command line is -qq, which drops "N passed in S s"."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script_args() -> list[str]:
    line = next(x for x in (ROOT / "scripts" / "test.sh").read_text().splitlines() if "-m pytest" in x)
    args = shlex.split(line)
    return [a for a in args[args.index("pytest") + 1:] if a not in ("tests", '"$@"', "$@")]


def test_the_test_command_prints_the_summary_line(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_ok():\n    assert True\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                          str(tmp_path), str(tmp_path / "test_one.py"), *_script_args()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
