"""Found by the round-8 fault pass: early-bird's router options, device/dtype beside a loaded
bundle, knob types (a bool as a size, a string as a flag, nan/inf), error messages that name the
field the user set, `unmask models` paths, and `unmask generate --help`'s paragraphs."""

from __future__ import annotations

import pytest
from conftest import one_line_error

import unmask
from unmask.errors import UnmaskError


@pytest.fixture(scope="module")
def dlm():
    return unmask.load("stories260K-dlm")


# -- 1. early-bird router options -------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"routers": 5}, "routers must be a directory path (got 5)"),
    ({"lbs_router": "x"}, "lbs_router must be an LBSRouter (got str)"),
    ({"lps_router": "x", "tau_psi": 0.5}, "lps_router must be an LPSRouter (got str)"),
])
def test_early_bird_router_options_of_the_wrong_type_are_one_line(dlm, kw, match):
    with pytest.raises(UnmaskError, match=match.replace("(", r"\(").replace(")", r"\)")):
        unmask.generate("Once upon a time", dlm, "early-bird", max_new_tokens=4, **kw)


def test_eval_routers_option_is_a_path(capsys):
    one_line_error(capsys, "eval", "--task", "stories", "-m", "stories260K-dlm", "--limit", "1", "-n", "8",
                   "--no-progress", "-d", "early-bird", "-O", "routers=5", match="no Early-Bird routers for "
                   "'stories260K-dlm' in 5")


# -- 2. device / dtype beside a loaded bundle ----------------------------------------------------------

def test_device_and_dtype_that_differ_from_a_loaded_bundle_are_refused():
    import torch

    b = unmask.load("stories260K")  # cpu, float32
    with pytest.raises(UnmaskError, match=r"already loaded on cpu, so device='cuda' would be ignored; load it with "
                                          r"unmask.load\(\.\.\., device='cuda'\)"):
        unmask.generate("Once upon a time", b, max_new_tokens=2, device="cuda")
    with pytest.raises(UnmaskError, match=r"already loaded in float32, so dtype='bfloat16' would be ignored"):
        unmask.generate("Once upon a time", b, max_new_tokens=2, dtype="bfloat16")
    with pytest.raises(UnmaskError, match=r"unknown dtype \['x'\]"):
        unmask.generate("Once upon a time", b, max_new_tokens=2, dtype=["x"])
    same = unmask.generate("Once upon a time", b, max_new_tokens=2, device="cpu", dtype=torch.float32)
    assert same.tokens == unmask.generate("Once upon a time", b, max_new_tokens=2).tokens
