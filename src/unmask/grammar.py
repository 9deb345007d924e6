"""Structured output: the grammar a request's output must match, compiled by llguidance
(spec/structured.md). A :class:`Grammar` is what a user asks for (a JSON schema, any JSON object, a
regex, a Lark grammar or a list of choices); :func:`compile` turns it, once per (model, grammar), into
a :class:`Compiled` whose :meth:`~Compiled.matcher` gives each row its own :class:`Matcher`: the
token masks along a draft, the forced tokens and the state after each commit.

JSON is generated compactly with OpenAI's separators (``", "`` between items, ``": "`` after keys, no
other whitespace), so a schema's keys and punctuation are forced tokens.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass

import torch

from unmask.errors import UnmaskError

KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)  # a GBNF rule line; Lark's are "name: ..."
LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_]\w*(\.-?\d+)?\s*:", re.MULTILINE)  # a Lark rule or terminal definition
# llguidance's compiler recurses once per link of a rule (or $ref) chain, a few kB of C stack each: it runs on
# a thread of COMPILE_STACK bytes (a default thread's 8 MiB overflows, a segfault, at ~2,000 links), and a
# grammar past these counts is refused (at most ~10 kB per link fits); llguidance's GBNF converter is quadratic
# in the rules (1,000: under a second; 4,000: 13 s)
COMPILE_STACK = 256 << 20
MAX_RULES, MAX_REFS, MAX_GBNF_RULES = 10_000, 10_000, 1_000


def _llg():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:  # a core dependency; a broken install says how to mend it
        raise UnmaskError(f"structured output needs llguidance ({e}); pip install 'llguidance>=1.0'") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A request's output grammar. kind: one of :data:`KINDS`; source: its text (a schema as JSON with
    the keys in order, a regex, a Lark grammar (llguidance's dialect; GBNF, told by a rule line
    ``name ::= ...``, is converted), or the choices as a JSON list). Hashable: compiled grammars are
    cached by it."""

    kind: str
    source: str = ""

    @classmethod
    def json_schema(cls, schema) -> "Grammar":
        """A JSON schema (a dict or its JSON text). Raises UnmaskError for text that is not a JSON object."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise UnmaskError(f"the JSON schema is not valid JSON ({e}); fix it") from None
        if not isinstance(schema, dict):
            raise UnmaskError(f"a JSON schema must be a JSON object (got {type(schema).__name__}); pass e.g. "
                              '{"type": "object"}')
        try:
            source = json.dumps(schema)  # key order kept: the output follows it
        except (RecursionError, ValueError, TypeError) as e:  # nested past Python's limit, a cycle, a non-JSON value
            raise UnmaskError(f"the JSON schema cannot be written as JSON ({_one_line(e)}); pass a JSON object, "
                              "nested less deeply") from None
        if (refs := source.count('"$ref"')) > MAX_REFS:
            raise UnmaskError(f"invalid JSON schema: {refs} $refs, more than {MAX_REFS}; simplify the schema")
        return cls("json_schema", source)

    @classmethod
    def regex(cls, pattern) -> "Grammar":
        if not isinstance(pattern, str) or not pattern:
            raise UnmaskError(f"a regex must be non-empty text (got {pattern!r})")
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text) -> "Grammar":
        if not isinstance(text, str) or not text.strip():
            raise UnmaskError(f"a grammar must be non-empty Lark (or GBNF) text (got {text!r})")
        return cls("grammar", text)

    @classmethod
    def choice(cls, options) -> "Grammar":
        if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) and o for o in options):
            raise UnmaskError(f"choice must be a non-empty list of non-empty strings (got {options!r})")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def of_response_format(cls, fmt) -> "Grammar | None":
        """OpenAI's ``response_format``: ``{"type": "text"}`` -> None, ``{"type": "json_object"}``,
        ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``. Raises UnmaskError."""
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise UnmaskError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
            return cls.json_schema(schema)
        raise UnmaskError(f"response_format type must be text, json_object or json_schema (got {json.dumps(fmt)})")

    @classmethod
    def of_structured(cls, spec) -> "Grammar":
        """unmask's ``structured_outputs`` field (vLLM's shape): exactly one of ``{"json": schema}``,
        ``{"regex": "..."}``, ``{"grammar": "..."}`` (Lark or GBNF), ``{"choice": [...]}``,
        ``{"json_object": true}``. Raises UnmaskError."""
        if not isinstance(spec, dict):
            raise UnmaskError("structured_outputs must be an object with one of json, regex, grammar, choice, json_object")
        keys = ("json", "regex", "grammar", "choice", "json_object")
        unknown = sorted(set(spec) - set(keys))
        if unknown:  # e.g. vLLM's disable_any_whitespace / backend, which are not served
            raise UnmaskError(f"structured_outputs: unknown key {', '.join(map(repr, unknown))}; it takes exactly "
                              "one of json, regex, grammar, choice, json_object")
        given = sorted(k for k in keys if spec.get(k) not in (None, False))  # null / false ask for nothing
        if len(given) != 1:
            raise UnmaskError("structured_outputs takes exactly one of json, regex, grammar, choice, json_object "
                              f"(got {', '.join(given) or 'none'})")
        kind = given[0]
        return {"json": cls.json_schema, "regex": cls.regex, "grammar": cls.lark, "choice": cls.choice,
                "json_object": lambda _: cls("json_object")}[kind](spec[kind])

    def text(self) -> str:
        """The llguidance grammar (its JSON/Lark wire format). Raises UnmaskError for a schema it cannot read."""
        M = _llg().LLMatcher
        if self.kind in ("json_object", "json_schema"):
            schema = {"type": "object"} if self.kind == "json_object" else json.loads(self.source)
            try:
                return M.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except (ValueError, TypeError) as e:
                raise UnmaskError(f"invalid JSON schema: {_one_line(e)}") from None
        if self.kind == "regex":
            return M.grammar_from_regex(self.source)
        if self.kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(self.source)))
        text = self.source
        if GBNF_RULE.search(text):  # GBNF (llama.cpp's): llguidance's converter
            from llguidance.gbnf_to_lark import gbnf_to_lark
            if (n := len(GBNF_RULE.findall(text))) > MAX_GBNF_RULES:
                raise UnmaskError(f"invalid GBNF grammar: {n} rules, more than {MAX_GBNF_RULES}; merge rules, or "
                                  "write it in Lark")
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # noqa: BLE001 - the converter's parse errors are the user's grammar's
                raise UnmaskError(f"invalid GBNF grammar: {_one_line(e)}") from None
        if (n := len(LARK_RULE.findall(text))) > MAX_RULES:
            raise UnmaskError(f"invalid grammar: {n} rules, more than {MAX_RULES}; merge rules")
        return M.grammar_from_lark(text)


_STACK_LOCK = threading.Lock()


def _on_big_stack(fn):
    """``fn()`` on a thread with a :data:`COMPILE_STACK`-byte stack (reserved, touched only as deep as it
    recurses); its result, or its exception raised here. Ctrl-C while waiting interrupts the wait."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = e

    with _STACK_LOCK:  # the stack size is process-wide: set for this one thread, then put back
        old = threading.stack_size(COMPILE_STACK)
        try:
            t = threading.Thread(target=run, name="unmask-grammar-compile", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _one_line(e) -> str:
    """llguidance's message on one line: its first line and its ``error:`` lines (not the echoed source
    and caret lines between them, nor the parser state it appends)."""
    text = str(e).split("<state>")[0]  # llguidance appends its parser state: a dump, not a message
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    kept = [lines[0], *(line for line in lines[1:] if line.lower().startswith("error"))]
    return " ".join(kept)


class Compiled:
    """A grammar compiled for one model's tokenizer: ``vocab`` the logits' width V; :meth:`matcher` a
    fresh :class:`Matcher` at the grammar's start (a copy of one parsed template: cheap per row)."""

    def __init__(self, grammar: Grammar, tokenizer, vocab: int):
        self.grammar, self.vocab, self.tokenizer = grammar, vocab, tokenizer
        _on_big_stack(self._build)

    def _build(self) -> None:
        llg, grammar, tokenizer, vocab = _llg(), self.grammar, self.tokenizer, self.vocab
        text = grammar.text()
        error = llg.LLMatcher.validate_grammar(text, tokenizer)
        if error:
            raise UnmaskError(f"invalid {grammar.kind.replace('_', ' ')}: {_one_line(error)}")
        self._template = llg.LLMatcher(tokenizer, text, log_level=0)
        if not self._template.is_error():
            # the parser is built lazily: a grammar with no finite string (every rule recurses, no base case)
            # fails only at its first mask, which would end every row at once; refuse it here instead
            Matcher(probe := self._template.deep_copy(), vocab).mask(torch.zeros((vocab + 31) // 32, dtype=torch.int32))
            if probe.is_error():
                raise UnmaskError(f"invalid {grammar.kind.replace('_', ' ')}: it allows no output "
                                  f"({_one_line(probe.get_error())}); give it a rule that can end")
        if self._template.is_error():
            raise UnmaskError(f"invalid {grammar.kind.replace('_', ' ')}: {_one_line(self._template.get_error())}")

    def matcher(self) -> "Matcher":
        return Matcher(self._template.deep_copy(), self.vocab)


class Matcher:
    """One row's grammar state: the ids consumed so far (its committed tokens).

    :meth:`path_masks` fills the allowed-token bitmasks at a draft's positions without moving the state;
    :meth:`consume` moves it over committed ids (counting the forced ones: ``forced_ids``); :meth:`forced`
    gives the ids the grammar forces next; :meth:`draft` a draft it allows."""

    def __init__(self, m, vocab: int):
        self.m, self.vocab = m, vocab
        self.forced_ids = 0  # consumed ids the grammar forced (it allowed nothing else there)
        self.gave_up = False  # consume failed on the engine's limits, not on an id the grammar refuses

    @property
    def words(self) -> int:
        """int32 words per bitmask row: ceil(V / 32)."""
        return (self.vocab + 31) // 32

    def consume(self, ids: list[int]) -> bool:
        """Advance over committed ids (an id after the grammar stopped, EOS included, is ignored). False
        when the grammar refused one or the engine gave up (:attr:`gave_up`: a parser or lexer limit, or no
        finite output left): :attr:`error` says why."""
        ok = True
        for t in ids:
            if self.m.is_stopped():
                break
            forced = self.m.compute_ff_tokens()
            if not (ok := self.m.consume_token(int(t))):
                break
            self.forced_ids += bool(forced) and forced[0] == t
        if ok and not self.m.is_error():
            return True
        why = self.m.get_error() or ""
        self.gave_up = bool(why) and "doesn't satisfy the grammar" not in why  # llguidance's words for a refusal
        return False

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` ids the grammar allows alone from here, in order (llguidance's fast-forward
        tokens)."""
        return [] if limit <= 0 or self.m.is_stopped() else list(self.m.compute_ff_tokens()[:limit])

    def mask(self, out) -> None:
        """Fill ``out`` (words,) int32, a contiguous numpy array or CPU tensor, with the allowed ids at the
        current state."""
        if isinstance(out, torch.Tensor):
            self.m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
        else:
            self.m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def path_masks(self, draft: list[int], out) -> None:
        """Fill ``out`` (len(draft) + 1, words) int32 (numpy or CPU tensor, contiguous rows): row 0 the mask at the current
        state, row j the mask after draft[:j]. Past the first id the grammar refuses, rows are left as
        they are (no acceptance reaches them). The state is unchanged afterwards."""
        self.mask(out[0])
        n = 0
        for j, t in enumerate(draft):
            if self.m.is_stopped() or not self.m.validate_tokens([int(t)]):
                break
            self.m.consume_token(int(t))
            n += 1
            self.mask(out[j + 1])
        if n:
            self.m.rollback(n)

    def draft(self, candidates: list[list[int]], n: int) -> list[int]:
        """A draft of up to ``n`` ids the grammar allows from here: the forced ids wherever it forces,
        else the first allowed id of ``candidates[j]`` (ranked ids for draft position j); it ends at a
        position with no allowed candidate, or where the grammar stops. The state is unchanged afterwards."""
        out = []
        while len(out) < n and not self.m.is_stopped():
            if forced := self.m.compute_ff_tokens()[: n - len(out)]:
                if not self.m.consume_tokens(forced):
                    break
                out += forced
                continue
            j = len(out)
            pick = next((c for c in candidates[j] if self.m.validate_tokens([c])), None) if j < len(candidates) else None
            if pick is None or not self.m.consume_token(pick):
                break
            out.append(pick)
        if out:
            self.m.rollback(len(out))
        return out

    @property
    def error(self) -> str | None:
        return _one_line(self.m.get_error()) if self.m.is_error() else None

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no more ids (EOS aside)."""
        return self.m.is_stopped()


_TOKENIZERS: dict = {}
_CACHE: dict = {}
_LOCK = threading.Lock()
CACHE_SIZE = 64  # compiled grammars kept per process (oldest dropped first)


def tokenizer_for(bundle, vocab: int):
    """llguidance's tokenizer of ``bundle`` for logits of width ``vocab`` (cached per bundle). Raises
    UnmaskError for a model without tokenizer files."""
    key = (id(bundle), vocab)
    with _LOCK:
        if key in _TOKENIZERS:
            return _TOKENIZERS[key]
    if bundle.tokenizer is None:
        raise UnmaskError(f"{bundle.name} has no tokenizer files, which structured output needs; add them to the "
                          "checkpoint's directory")
    try:
        tok = _llg().hf.from_tokenizer(bundle.tokenizer, n_vocab=vocab)
    except Exception as e:  # noqa: BLE001 - a tokenizer llguidance cannot read: one line, not a traceback
        raise UnmaskError(f"structured output cannot use {bundle.name}'s tokenizer ({_one_line(e)})") from None
    with _LOCK:
        if key not in _TOKENIZERS:  # the bundle's entries leave with it (its id may be reused after)
            weakref.finalize(bundle, _forget, id(bundle))
        _TOKENIZERS[key] = tok
    return tok


def _forget(bundle_id: int) -> None:
    with _LOCK:
        for cache in (_TOKENIZERS, _CACHE):
            for key in [k for k in cache if k[0] == bundle_id]:
                del cache[key]


def compile(bundle, grammar: Grammar) -> Compiled:
    """``grammar`` compiled for ``bundle`` (cached per (model, grammar), :data:`CACHE_SIZE` kept). Raises
    UnmaskError, one line with the engine's message, for an invalid schema, regex or grammar."""
    if not isinstance(grammar, Grammar):
        raise UnmaskError(f"grammar must be a unmask.grammar.Grammar (got {type(grammar).__name__}); build one with "
                          "Grammar.json_schema(...), Grammar.regex(...), Grammar.lark(...) or Grammar.choice([...])")
    vocab = bundle.model.config.vocab_size
    key = (id(bundle), vocab, grammar)
    with _LOCK:
        got = _CACHE.pop(key, None)
        if got is not None:
            _CACHE[key] = got  # most recent last
            return got
    got = Compiled(grammar, tokenizer_for(bundle, vocab), vocab)
    with _LOCK:
        _CACHE[key] = got
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
    return got


def allowed(bits: torch.Tensor, V: int) -> torch.Tensor:
    """Bitmasks (..., words) int32 -> allowed ids (..., V) bool, on the bitmasks' device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., :V]


__all__ = ["Compiled", "Grammar", "KINDS", "Matcher", "allowed", "compile", "tokenizer_for"]
