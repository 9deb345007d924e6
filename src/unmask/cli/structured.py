"""``unmask generate``'s output options: ``--logprobs``, ``--logit-bias`` and the grammar flags
(``--json-schema``, ``--json-object``, ``--regex``, ``--grammar``, ``--choice``), read into the keyword
arguments of :func:`unmask.generate` (``logprobs=``, ``logit_bias=``, ``grammar=``)."""

from __future__ import annotations

import os
from pathlib import Path

from unmask.decode.engine.shaping import MAX_BIAS, check_logit_bias, check_logprobs
from unmask.errors import UnmaskError
from unmask.fileio import read_json_object
from unmask.grammar import Grammar, compile

SCHEMA_FIX = 'put a JSON schema in the file, e.g. {"type": "object", "properties": {"name": {"type": "string"}}}'


def parse_logit_bias(pairs: list[str] | None) -> dict[int, float] | None:
    """``--logit-bias ID=BIAS`` values -> {id: bias} (a repeated id: the last wins), BIAS in [-100, 100]; the
    ids are checked against the model once it is loaded (:func:`check_for_model`). Raises UnmaskError."""
    if not pairs:
        return None
    out = {}
    for pair in pairs:
        tid, sep, bias = pair.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(tid)] = float(bias)
        except ValueError:
            raise UnmaskError(f"--logit-bias takes TOKEN_ID=BIAS (got {pair!r}); pass e.g. --logit-bias 13=-100") from None
        if not -MAX_BIAS <= out[int(tid)] <= MAX_BIAS:  # nan fails too
            raise UnmaskError(f"--logit-bias {pair}: BIAS must be in [-100, 100]; -100 bans the token, 100 all but forces it")
    return out


def _read_schema(path: Path) -> Grammar:
    where = f"--json-schema {path}"
    # exists(), not is_file(): `--json-schema <(cmd)` gives /dev/fd/N, a pipe, which reads like a file
    if not path.exists() or path.is_dir():
        raise UnmaskError(f"{where}: {'is a directory' if path.is_dir() else 'no such file'}; pass a JSON schema file")
    schema = read_json_object(path, SCHEMA_FIX)
    if schema.get("type") == "json_schema" or "json_schema" in schema:  # an OpenAI response_format object
        raise UnmaskError(f"{where} holds a response_format object, not a schema; put its json_schema.schema "
                          "object in the file")
    return Grammar.json_schema(schema)


def _read_grammar(path: Path) -> Grammar:
    where = f"--grammar {path}"
    if not path.exists() or path.is_dir():  # a pipe (`--grammar <(cmd)`) is read as a file
        raise UnmaskError(f"{where}: {'is a directory' if path.is_dir() else 'no such file'}; pass a Lark (or GBNF) "
                          "grammar file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UnmaskError(f"{where} cannot be read ({e}); pass a readable UTF-8 grammar file") from None
    if not text.strip():
        raise UnmaskError(f"{where} is empty; write a Lark grammar (start: ...) or a GBNF one (root ::= ...) in it")
    return Grammar.lark(text)


def read_grammar(*, json_schema: Path | None = None, json_object: bool = False, regex: str | None = None,
                 grammar: Path | None = None, choice: list[str] | None = None) -> tuple[Grammar | None, str]:
    """The grammar the flags ask for and the flag that asked ("" for none), read before the model loads.
    Raises UnmaskError, one line naming the flag (and file) and the fix: two grammar flags at once, a
    missing, unreadable or empty file, a file that is not JSON or not a schema object, an empty regex or
    choice."""
    given = [name for name, v in (("--json-schema", json_schema), ("--json-object", json_object or None),
                                  ("--regex", regex), ("--grammar", grammar), ("--choice", choice or None))
             if v is not None]
    if len(given) > 1:
        raise UnmaskError(f"{' and '.join(given)} each set the output grammar; pass one of them")
    if not given:
        return None, ""
    flag = given[0]
    if flag == "--json-schema":
        return _read_schema(Path(os.path.expanduser(json_schema))), f"{flag} {json_schema}"
    if flag == "--grammar":
        return _read_grammar(Path(os.path.expanduser(grammar))), f"{flag} {grammar}"
    try:
        made = Grammar("json_object") if json_object else Grammar.regex(regex) if regex is not None \
            else Grammar.choice(list(choice))
    except UnmaskError as e:
        raise UnmaskError(f"{flag}: {e}; fix the flag's value") from None
    return made, flag


def check_for_model(bundle, grammar: Grammar | None, flag: str, logit_bias: dict | None) -> None:
    """Once the model is loaded: ``--logit-bias`` ids in its vocabulary, and ``grammar`` compiled for it
    (cached: the decode reuses it), so an invalid schema, regex or grammar is reported with the flag (and
    file) that gave it. Raises UnmaskError."""
    check_logit_bias(logit_bias, bundle.model.config.vocab_size, "--logit-bias")
    if grammar is None:
        return
    try:
        compile(bundle, grammar)
    except UnmaskError as e:
        what = {"json_schema": "the schema", "regex": "the regex", "grammar": "the grammar"}.get(grammar.kind, "it")
        raise UnmaskError(f"{flag}: {e}; fix {what}") from None


def check_logprobs_output(logprobs: int | None, *, as_json: bool) -> None:
    """--logprobs K: K in [0, 20], reported in the --json rows. Raises UnmaskError out of range or without --json."""
    check_logprobs(logprobs, "--logprobs")
    if logprobs is not None and not as_json:
        raise UnmaskError("--logprobs reports per-token values in the --json rows; add --json")
