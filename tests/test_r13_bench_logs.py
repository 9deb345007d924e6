"""Issue 52 item 9 (part): ``bench`` prints each row's TPS spread over repeats, the recipes print
warnings as one ``warning:`` line (the SBD-adapter smoke run printed Python's raw two-line form,
and had no validation row), and training progress names its columns."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]


def test_bench_prints_the_tps_spread_over_repeats(capsys):
    code, out, err = run_cli(capsys, "bench", "--limit", "1", "-n", "8", "-d", "ar", "-m", "stories260K",
                             "--repeats", "3", "--json")
    assert code == 0, err
    row = json.loads(out)["rows"][0]
    assert row["repeats"] == 3 and row["tps_min"] <= row["tps"] <= row["tps_max"], row
    code, out, err = run_cli(capsys, "bench", "--limit", "1", "-n", "8", "-d", "ar", "-m", "stories260K",
                             "--repeats", "2", "--no-progress")
    assert code == 0, err
    assert "min–max" in out and "median of 2 runs" in out, out
    spread = next(line for line in out.splitlines() if line.lstrip("│ ").startswith("ar "))
    assert "–" in spread.split("│")[6], spread  # the TPS min–max cell of the ar row


def test_bench_refuses_zero_repeats(capsys):
    from conftest import one_line_error

    one_line_error(capsys, "bench", "--repeats", "0", "-d", "ar", match="--repeats")


def test_training_progress_names_its_columns():
    from rich.console import Console

    from unmask.train.progress import TrainProgress

    out = io.StringIO()
    with TrainProgress(Console(file=out, width=80), 2, 0, ("mat", "draft", "ntp", "d0", "kl")) as p:
        p.update(1, {"loss": 1.0, "mat": 1.0, "draft": 2.0, "ntp": 3.0, "d0": 4.0, "kl": 0.1}, 100.0)
    first, second = out.getvalue().splitlines()[:2]
    assert first.startswith("columns: ") and second.startswith("step 1/2 loss 1.000 mat"), out.getvalue()
    for name, words in (("loss", "loss minimised"), ("mat", "masked-token cross-entropy"), ("ntp", "next-token"),
                        ("d0", "block offset 0"), ("kl", "KL"), ("tok/s", "tokens per second")):
        assert f"{name} = " in first and words in first, (name, first)


def test_a_recipe_prints_a_warning_on_one_line(tmp_path):
    # the recipes install the command line's warning format in main()
    code = ("import sys, warnings; sys.argv[1:] = []; sys.path.insert(0, 'recipes');"
            "import stories260K_sbd_adapter as r; from unmask.compat import quiet_transformers;"
            "from unmask.errors import one_line_warnings; one_line_warnings();"
            "warnings.warn('no validation row fills --seq-len tokens')")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 0 and res.stderr == "warning: no validation row fills --seq-len tokens\n", res.stderr
    for recipe in sorted((ROOT / "recipes").glob("*.py")):  # every recipe's main() installs it
        assert "one_line_warnings()" in recipe.read_text(), recipe.name


def test_the_adapter_recipe_smoke_run_validates_and_warns_nothing(tmp_path):
    res = subprocess.run([sys.executable, "recipes/stories260K_sbd_adapter.py", "--smoke", "--threads", "1",
                          "--work-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Warning" not in res.stdout + res.stderr and "warning:" not in res.stdout + res.stderr, res.stderr
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    assert summary["val"] is not None  # the held-out document fills a row at the smoke --seq-len
