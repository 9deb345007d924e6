"""``unmask generate``'s output options on stories260K: --logprobs, --logit-bias and the grammar flags
(--json-schema, --json-object, --regex, --grammar, --choice); bad input is one line naming the flag,
the file and the fix."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest

from conftest import one_line_error, run_cli

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "mood": {"enum": ["happy", "sad"]}},
          "required": ["name", "mood"], "additionalProperties": False}
GEN = ("generate", "Once upon a time", "-m", "stories260K", "-n", "48", "--no-progress")


def rows(capsys, *argv) -> list[dict]:
    code, out, err = run_cli(capsys, *GEN, "--json", *argv)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    return path


# bad input: one line, exit 2, before or right after the model loads

def test_two_grammar_flags_are_refused(capsys, schema_file):
    line = one_line_error(capsys, *GEN, "--json-schema", schema_file, "--regex", "[0-9]+", match="pass one of them")
    assert "--json-schema and --regex" in line


def test_missing_schema_file(capsys, tmp_path):
    one_line_error(capsys, *GEN, "--json-schema", tmp_path / "nope.json", match=f"{tmp_path / 'nope.json'}: no such file")


def test_schema_file_is_a_directory(capsys, tmp_path):
    one_line_error(capsys, *GEN, "--json-schema", tmp_path, match="is a directory")


@pytest.mark.parametrize("text, match", [("{not json", "is not valid JSON"), ("[1, 2]", "holds a JSON list"),
                                         ("\udcff", "is not valid JSON")])
def test_schema_file_that_is_not_a_json_object(capsys, tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    line = one_line_error(capsys, *GEN, "--json-schema", path, match=match)
    assert str(path) in line and "JSON schema" in line


def test_schema_file_holding_a_response_format(capsys, tmp_path):
    path = tmp_path / "fmt.json"
    path.write_text(json.dumps({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}))
    one_line_error(capsys, *GEN, "--json-schema", path, match="holds a response_format object")


@pytest.mark.parametrize("schema", [{"type": "foo"}, {"type": "object", "required": "name"}, {"enum": []}])
def test_invalid_schema_names_the_file(capsys, tmp_path, schema):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema))
    line = one_line_error(capsys, *GEN, "--json-schema", path, match="invalid json schema")
    assert f"--json-schema {path}" in line and line.endswith("fix the schema")


def test_invalid_regex(capsys):
    one_line_error(capsys, *GEN, "--regex", "[0-9", match="--regex: invalid regex")


def test_empty_regex_and_choice(capsys):
    one_line_error(capsys, *GEN, "--regex", "", match="--regex: a regex must be non-empty")
    one_line_error(capsys, *GEN, "--choice", "a", "--choice", "", match="--choice: choice must be a non-empty list")


@pytest.mark.parametrize("text, match", [('start: "a" | foo', "invalid grammar"), ('root ::= "a', "invalid GBNF"),
                                         ("  \n", "is empty")])
def test_invalid_grammar_file(capsys, tmp_path, text, match):
    path = tmp_path / "g.lark"
    path.write_text(text)
    line = one_line_error(capsys, *GEN, "--grammar", path, match=match)
    assert f"--grammar {path}" in line


def test_missing_grammar_file(capsys, tmp_path):
    one_line_error(capsys, *GEN, "--grammar", tmp_path / "g.lark", match="no such file")


def test_logprobs_need_json(capsys):
    one_line_error(capsys, *GEN, "--logprobs", "2", match="add --json")


@pytest.mark.parametrize("pair", ["13", "x=1", "13=big", "=4"])
def test_logit_bias_format(capsys, pair):
    one_line_error(capsys, *GEN, "--logit-bias", pair, match="--logit-bias takes TOKEN_ID=BIAS")


def test_logit_bias_range_is_checked_before_loading(capsys):
    one_line_error(capsys, *GEN, "--logit-bias", "5=200", match="BIAS must be in [-100, 100]")


def test_logit_bias_unknown_id_names_it(capsys):
    one_line_error(capsys, *GEN, "--logit-bias", "99999=3", match="keys that are not token ids of this model (99999)")


def test_logprobs_out_of_range(capsys):
    one_line_error(capsys, *GEN, "--json", "--logprobs", "21", match="--logprobs must be an integer in [0, 20]")


def test_a_decoder_without_grammars_is_refused(capsys):
    one_line_error(capsys, "generate", "x", "-m", "stories260K-sbd", "--json-object", "-d", "sbd", "--gamma", "0.35",
                   "--no-progress", match="does not take a grammar")


def test_a_model_whose_decoders_take_no_grammar_says_to_change_the_model(capsys):
    # on stories260K-dlm neither ar nor sbd runs, so "choose one of them" would only lead to a second error
    line = one_line_error(capsys, "generate", "x", "-m", "stories260K-dlm", "--regex", "a+", "--no-progress",
                          match="does not take a grammar")
    assert "choose one of them" not in line and "no decoder of this model" in line and "unmask models" in line


# what the flags produce

def test_json_schema_output_validates_and_lossless_equals_ar(capsys, schema_file):
    ar = rows(capsys, "--json-schema", schema_file, "-m", "stories260K-sbd", "-d", "ar")[0]
    default = rows(capsys, "--json-schema", schema_file, "-m", "stories260K-sbd")[0]  # lossless sbd
    assert default["decoder"] == "sbd" and default["tokens"] == ar["tokens"]
    assert len(ar["tokens"]) < 48  # finished: a stop token after the closing brace
    jsonschema.validate(json.loads(ar["text"]), PERSON)


def test_json_object_output_is_an_object(capsys):
    row = rows(capsys, "--json-object")[0]
    assert row["text"].startswith('{"')
    if len(row["tokens"]) < 48:
        assert isinstance(json.loads(row["text"]), dict)


def test_regex_and_choice_outputs_match(capsys):
    row = rows(capsys, "--regex", "[0-9]{3}-(yes|no)")[0]
    assert re.fullmatch("[0-9]{3}-(yes|no)", row["text"]), row["text"]
    texts = [r["text"] for r in rows(capsys, "--choice", "red fox", "--choice", "blue whale", "--choice", "cat")]
    assert texts[0] in ("red fox", "blue whale", "cat")


@pytest.mark.parametrize("text", ['start: "The " ANIMAL " sat."\nANIMAL: "cat" | "dog"',
                                  'root ::= "The " animal " sat."\nanimal ::= "cat" | "dog"'])
def test_grammar_file_lark_or_gbnf(capsys, tmp_path, text):
    path = tmp_path / "g.txt"
    path.write_text(text)
    assert rows(capsys, "--grammar", path)[0]["text"] in ("The cat sat.", "The dog sat.")


@pytest.mark.parametrize("flag, text, ok", [
    ("--grammar", 'start: "The " ANIMAL " sat."\nANIMAL: "cat" | "dog"', ("The cat sat.", "The dog sat.")),
    ("--json-schema", '{"enum": ["yes", "no"]}', ('"yes"', '"no"'))])
def test_grammar_and_schema_from_a_pipe(capsys, flag, text, ok):
    # `--grammar <(make_grammar)` hands over /dev/fd/N, a pipe: it exists but is no regular file
    r, w = os.pipe()
    try:
        os.write(w, text.encode())
        os.close(w)
        assert rows(capsys, flag, f"/dev/fd/{r}")[0]["text"] in ok
    finally:
        os.close(r)


def test_logprobs_rows(capsys):
    row = rows(capsys, "--logprobs", "3", "-n", "12")[0]
    lp = row["logprobs"]
    assert [e["token"] for e in lp] == row["tokens"] and len(lp) == 12
    for e in lp:
        top = e["top_logprobs"]
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert e["logprob"] <= 0 and top[0][1] >= e["logprob"] - 1e-6
        assert top[0][0] == e["token"]  # greedy: the chosen token is the most likely


def test_logprobs_zero_and_without_the_flag(capsys):
    assert all(e["top_logprobs"] == [] for e in rows(capsys, "--logprobs", "0", "-n", "4")[0]["logprobs"])
    assert "logprobs" not in rows(capsys, "-n", "4")[0]


def test_logit_bias_bans_the_greedy_token(capsys):
    first = rows(capsys, "-n", "4")[0]["tokens"][0]
    banned = rows(capsys, "-n", "4", "--logit-bias", f"{first}=-100")[0]["tokens"]
    assert first not in banned[:1]
    sbd = rows(capsys, "-n", "24", "-m", "stories260K-sbd", "--logit-bias", f"{first}=-100")[0]
    ar = rows(capsys, "-n", "24", "-m", "stories260K-sbd", "-d", "ar", "--logit-bias", f"{first}=-100")[0]
    assert sbd["decoder"] == "sbd" and sbd["tokens"] == ar["tokens"] and first not in ar["tokens"]


def test_chat_leaves_the_output_options_out(capsys):
    """``unmask chat`` takes generate's model and decoder options, not its per-request output ones."""
    one_line_error(capsys, "chat", "-m", "stories260K", "--json-object", match="no such option", fix=False)
