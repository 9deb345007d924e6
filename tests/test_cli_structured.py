"""``unmask generate``'s output options on stories260K: --logprobs, --logit-bias and the grammar flags
(--json-schema, --json-object, --regex, --grammar, --choice); bad input is one line naming the flag,
the file and the fix."""

from __future__ import annotations

import json
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
