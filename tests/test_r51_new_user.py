"""What a new user of model-free drafts (issue 51) sees: ``--json`` names the draft source instead of the
internal host layout and its last window size, the summary line gives the queries per forward to 2 decimals and says
how many lookup/suffix drafts were accepted, and a knob the decoder does not take names the decoders that do."""

from __future__ import annotations

import json
import re

import pytest
from conftest import run_cli

import unmask
from unmask.errors import UnmaskError

# a prompt that repeats itself, so lookup and suffix find matches on the shipped causal model
PROMPT = "Once upon a time, there was a cat. The cat was big. The cat was big. The cat was big."


@pytest.fixture(scope="module")
def base():
    return unmask.load("stories260K")


@pytest.mark.parametrize("source", ["lookup", "suffix"])
def test_json_row_names_the_draft_source_not_the_host_layout(base, source):
    row = unmask.generate(PROMPT, base, decoder="ar", draft_source=source, max_new_tokens=32).rows()[0]
    assert row["draft_source"] == source and row["verify"] is True
    # "host" and the last step's window (which follows the match) are internals, not a block size the user set
    assert "draft" not in row and "block_size" not in row
    assert sum(row["accepts"]) >= 32 and len(row["accepts"]) == row["nfe"]


def test_json_row_beside_the_block_names_both():
    row = unmask.generate(PROMPT, "stories260K-sbd", decoder="sbd", draft_source="block+lookup",
                          max_new_tokens=16).rows()[0]
    assert row["draft_source"] == "block+lookup" and ("/" in row["draft"] or row["draft"] in ("linear", "quadratic"))
    plain = unmask.generate(PROMPT, "stories260K-sbd", decoder="sbd", verify=True, max_new_tokens=16).rows()[0]
    assert "draft_source" not in plain and "block_size" in plain


def test_cli_json_and_summary_line(capsys):
    code, out, err = run_cli(capsys, "generate", PROMPT, "-m", "stories260K", "--decoder", "ar", "--draft-source",
                             "lookup", "-n", "32", "--json", "--no-progress")
    assert code == 0 and json.loads(out)["draft_source"] == "lookup", err
    code, out, err = run_cli(capsys, "generate", PROMPT, "-m", "stories260K", "--decoder", "ar", "--draft-source",
                             "lookup", "-n", "32", "--no-progress")
    assert code == 0, err
    assert re.search(r"· \d+(\.\d{1,2})? queries/forward ·", out), out  # 3.1, not 3.10345
    assert re.search(r"· lookup drafts \d+/\d+ accepted ·", out), out


def test_a_knob_the_decoder_does_not_take_names_the_decoders_that_do():
    with pytest.raises(UnmaskError, match=r"^--draft-source does not apply to decoder 'diffusion'; drop it or choose "
                                          r"a decoder that takes it \(ar, sbd\)$"):
        unmask.generate(PROMPT, "stories260K-dlm", decoder="diffusion", draft_source="lookup", max_new_tokens=8)
    with pytest.raises(UnmaskError, match=r"takes it\)?$"):  # a name no decoder takes: nothing to list
        unmask.generate(PROMPT, "stories260K", decoder="ar", no_such_knob=1, max_new_tokens=8)


def test_draft_tokens_help_states_its_range():
    from unmask.decode import DECODERS

    knob = next(k for k in DECODERS["ar"].knobs() if k.name == "draft_tokens")
    assert "1 to 31" in knob.help


def test_the_playground_offers_the_draft_sources_and_its_ar_pane_stays_plain_ar():
    """The playground lists the model-free sources, sends the chosen one, and its side-by-side AR pane asks
    for ``draft_source: "none"``: under ``serve --draft-source lookup`` it would otherwise be lookup too."""
    from importlib.resources import files

    from unmask.decode.verify.drafting import SOURCES

    page = (files("unmask.serve") / "playground.html").read_text(encoding="utf-8")
    select = re.search(r'<select id="draft_source">(.*?)</select>', page, re.S)
    assert select is not None
    offered = set(re.findall(r"<option>([\w+]+)</option>", select.group(1)))
    assert offered == set(SOURCES) - {"block"}  # block is sbd's own default: "default" covers it
    assert 'if (pane === "ar") body.draft_source = "none";' in page and "knobs(decoder, suffix)" in page


@pytest.mark.parametrize("source", ["block", "block+lookup", "block+suffix"])
def test_a_block_source_on_a_causal_model_says_what_it_needs(base, source):
    # README offers block+lookup; on a plain causal model it was only "unknown draft source ... for decoder 'ar'"
    with pytest.raises(UnmaskError, match=r"choose one of none, lookup, suffix \(block drafts need decoder sbd: an "
                                          r"SBD model or --adapter\)$"):
        unmask.generate(PROMPT, base, draft_source=source, max_new_tokens=4)
