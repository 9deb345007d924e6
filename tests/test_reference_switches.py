"""Reference-compatibility switches reachable from the command line (issue 15 item 12)."""

from __future__ import annotations

import json

from conftest import one_line_error, run_cli

import unmask
from unmask.decode import DECODERS


def test_factor_compat_on_the_command_line_equals_the_api(capsys):
    argv = ["generate", "Once upon a time", "--model", "stories260K-dlm", "--policy", "factor", "--factor", "2",
            "--block-size", "8", "-n", "16", "--json"]
    code, out, err = run_cli(capsys, *argv, "--factor-compat")
    assert code == 0, err
    row = json.loads(out.splitlines()[0])
    bundle = unmask.load("stories260K-dlm")
    ref = DECODERS["diffusion"].decode(bundle, [bundle.encode("Once upon a time")], max_new_tokens=16, block_size=8,
                           policy="factor", factor=2.0, factor_compat=True, stop_token_ids=bundle.stop_token_ids)
    assert row["tokens"] == ref.tokens[0] and row["nfe"] == ref.stats.nfe


def test_factor_compat_needs_the_factor_policy(capsys):
    one_line_error(capsys, "generate", "Zoo", "--model", "stories260K-dlm", "--policy", "threshold", "--factor-compat",
                   match="--factor-compat applies to the factor policy only")
    one_line_error(capsys, "generate", "Zoo", "--model", "stories260K-bd", "--decoder", "block", "--factor-compat",
                   match="--factor-compat does not apply to decoder 'block'")
