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
