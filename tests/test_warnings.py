"""One-line warnings (issue 15 items 5 and 9)."""

from __future__ import annotations

import warnings

import pytest
from conftest import run_cli

import unmask


def test_steps_equal_to_blocks_warns_on_one_line(capsys):
    code, out, err = run_cli(capsys, "generate", "Once upon a time", "--model", "stories260K-dlm", "--policy", "top-k",
                             "--gen-length", "64", "--block-size", "8", "--steps", "8")
    assert code == 0 and out.strip()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: --steps 8 equals the number of blocks")
    assert "commits in one step" in lines[0]


def test_steps_equal_to_blocks_warns_in_the_api_and_more_steps_do_not():
    kw = dict(model="stories260K-dlm", policy="top-k", gen_length=16, block_size=8, max_new_tokens=16)
    with pytest.warns(UserWarning, match="each block of 8 tokens commits in one step"):
        unmask.generate("Zoo", steps=2, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unmask.generate("Zoo", steps=4, **kw)


def test_cli_prints_any_python_warning_as_one_line(capsys):
    from unmask.errors import warning_line

    warning_line(UserWarning("LPS validation FPR at τψ=0.5 is 3.00%,\n outside the budget"), UserWarning,
                  "/x/lps_fit.py", 376)
    err = capsys.readouterr().err
    assert err == "warning: LPS validation FPR at τψ=0.5 is 3.00%, outside the budget\n"
