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


# -- issue 48 item 6: CI runs README's test commands and nothing else --------------------------------

def _readme_bash_blocks() -> list[list[str]]:
    blocks, block = [], None
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            if block is not None:
                blocks.append(block)
            block = [] if line.strip() == "```bash" and block is None else None
        elif block is not None:
            block.append(line)
    return blocks


def _ci_commands() -> list[str]:
    """The commands .ci/run runs: its lines that are not comments, shell setup or the helper, with
    ``optional "CMD"`` read as CMD."""
    setup = ("#", "set -", "cd ", "optional() ")
    out = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(setup):
            continue
        if line.startswith("optional "):
            (line,) = shlex.split(line)[1:]
        out.append(line)
    return out


def test_ci_runs_exactly_a_readme_block_that_is_the_readme_test_command_plus_extras():
    commands = _ci_commands()
    block = next((b for b in _readme_bash_blocks() if [x.split("  #")[0].strip() for x in b if x.strip()] == commands),
                 None)
    assert block is not None, f".ci/run runs {commands}, which is no bash block of README.md"
    readme_test_command = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
                           "pip install -e '.[test]' && bash scripts/test.sh")
    assert any(b == [readme_test_command] for b in _readme_bash_blocks())
    # the CI block is README's test command with the optional installs before its last step
    assert commands[0] + " && " + commands[-1] == readme_test_command
    installs = commands[1:-1]
    assert all(c.startswith(("pip install ", "apt-get ")) and "'.[test]'" not in c for c in installs), installs


def test_the_test_extra_holds_gguf_which_the_convert_gguf_tests_import():
    """gguf was installed only by .ci/run: `pip install -e '.[test]'` alone failed 7 tests."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(req.startswith("gguf") for req in extra), extra
