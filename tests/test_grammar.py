"""unmask.grammar on the shipped stories260K tokenizer: every kind compiles, bad input is one line, the
compile cache, the masks along a draft (spec/structured.md §2) against token-by-token masks, the forced
tokens of a schema (§3), the bit unpacking, and the request shapes (response_format, structured_outputs)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from unmask.errors import UnmaskError
from unmask.grammar import Grammar, allowed, compile, tokenizer_for

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}

KINDS = {
    "json_object": Grammar("json_object"),
    "json_schema": Grammar.json_schema(PERSON),
    "regex": Grammar.regex("[0-9]{1,3}(-[a-z]+)?"),
    "grammar": Grammar.lark('start: "yes" | "no" | NUM\nNUM: /[0-9]+/'),
    "gbnf": Grammar.lark('root ::= "a" [b-d]+ "e"'),
    "choice": Grammar.choice(["red", "green", "café", 'a"b']),
}


@pytest.fixture(scope="module")
def V(stories):
    return stories.model.config.vocab_size


def tokenize(bundle, text: str) -> list[int]:
    """Ids of ``text`` as the grammar sees it (no sentencepiece prefix space)."""
    return tokenizer_for(bundle, bundle.model.config.vocab_size).tokenize_str(text)


def ids_of(bits: torch.Tensor, V: int) -> set[int]:
    return set(allowed(bits, V).nonzero().flatten().tolist())


def masks_by_consuming(compiled, committed: list[int], draft: list[int]) -> list[torch.Tensor]:
    """The masks a fresh matcher gives after ``committed`` and then each draft prefix, up to the first
    refused draft id (the reference for path_masks, one consume at a time)."""
    m = compiled.matcher()
    assert m.consume(committed)
    out = []
    for t in [None] + draft:
        if t is not None and (m.done or not m.consume([t])):
            break
        row = torch.zeros(m.words, dtype=torch.int32)
        m.mask(row)
        out.append(row)
    return out


def random_path(compiled, committed: list[int], n: int, rng: random.Random, V: int) -> list[int]:
    """``n`` ids after ``committed`` drawn from what the grammar allows (a draft that can be accepted)."""
    m = compiled.matcher()
    assert m.consume(committed)
    row = torch.zeros(m.words, dtype=torch.int32)
    path = []
    for _ in range(n):
        if m.done:
            break
        m.mask(row)
        t = rng.choice(sorted(ids_of(row, V)))
        path.append(t)
        assert m.consume([t]), m.error
    return path


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_compiles_and_allows_a_token(stories, V, kind):
    m = compile(stories, KINDS[kind]).matcher()
    row = torch.zeros(m.words, dtype=torch.int32)
    m.mask(row)
    assert m.words == (V + 31) // 32 and ids_of(row, V) and not m.done and m.error is None


@pytest.mark.parametrize("kind, text", [("choice", "café"), ("choice", 'a"b'), ("regex", "12-ab"), ("grammar", "yes"),
                                        ("grammar", "407"), ("gbnf", "abdce"), ("json_schema", '{"name": "Bo", "age": 3}'),
                                        ("json_object", '{"x": [1, 2]}')])
def test_a_matching_text_is_accepted(stories, kind, text):
    m = compile(stories, KINDS[kind]).matcher()
    assert m.consume(tokenize(stories, text)), m.error
    assert m.m.is_accepting()


@pytest.mark.parametrize("kind, text", [("choice", "blue"), ("regex", "1234"), ("gbnf", "ae"),
                                        ("json_schema", '{"age": 3}'), ("json_schema", '{"name":"Bo"')])
def test_a_refused_token_is_reported_in_one_line(stories, kind, text):
    m = compile(stories, KINDS[kind]).matcher()
    assert not m.consume(tokenize(stories, text))
    assert m.error and "\n" not in m.error


@pytest.mark.parametrize("make, match", [
    (lambda: Grammar.regex("[0-9"), "invalid regex"),
    (lambda: Grammar.regex("(?=a)b"), "invalid regex"),
    (lambda: Grammar.lark("start: foo"), "invalid grammar"),
    (lambda: Grammar.lark('root ::= "a'), "invalid GBNF"),
    (lambda: Grammar.json_schema({"type": "foo"}), "invalid json schema"),
    (lambda: Grammar.json_schema({"type": "object", "required": "a"}), "invalid json schema"),
    (lambda: Grammar.json_schema({"enum": []}), "invalid json schema"),
    (lambda: Grammar.json_schema({"$ref": "#/nowhere"}), "invalid json schema"),
    (lambda: Grammar.json_schema("{not json"), "not valid JSON"),
    (lambda: Grammar.json_schema("[1, 2]"), "must be a JSON object"),
    (lambda: Grammar.regex(""), "non-empty"),
    (lambda: Grammar.lark("  "), "non-empty"),
    (lambda: Grammar.choice([]), "non-empty list"),
    (lambda: Grammar.choice(["a", ""]), "non-empty list"),
])
def test_invalid_input_is_one_line_unmask_error(stories, make, match):
    with pytest.raises(UnmaskError) as e:
        compile(stories, make())
    assert match.lower() in str(e.value).lower() and "\n" not in str(e.value), str(e.value)


def test_compile_refuses_what_is_not_a_grammar(stories):
    with pytest.raises(UnmaskError, match="Grammar.json_schema"):
        compile(stories, '{"type": "object"}')


def test_compile_cache_returns_the_same_object_for_an_equal_grammar(stories):
    a = compile(stories, Grammar.json_schema(PERSON))
    assert compile(stories, Grammar.json_schema(json.dumps(PERSON))) is a  # text or dict: one grammar
    assert compile(stories, Grammar.regex("[0-9]+")) is compile(stories, Grammar.regex("[0-9]+"))
    assert compile(stories, Grammar.regex("[0-9]*")) is not compile(stories, Grammar.regex("[0-9]+"))
    assert a.matcher() is not a.matcher()  # one matcher per row, from the cached template


def test_matchers_of_one_compiled_grammar_are_independent(stories):
    c = compile(stories, Grammar.json_schema(PERSON))
    a, b = c.matcher(), c.matcher()
    assert a.consume(tokenize(stories, '{"name": "Al'))
    assert b.forced(8) == compile(stories, Grammar.json_schema(PERSON)).matcher().forced(8)


@pytest.mark.parametrize("kind", ["json_schema", "json_object", "regex", "gbnf"])
def test_path_masks_equal_token_by_token_masks_and_leave_the_state(stories, V, kind):
    c = compile(stories, KINDS[kind])
    rng = random.Random(kind)
    for trial in range(6):
        full = random_path(c, [], 24, rng, V)
        cut = rng.randrange(len(full) + 1)
        committed, draft = full[:cut], full[cut:cut + rng.randrange(1, 9)]
        if draft and trial % 2:  # a refused id in the draft: rows stop before it
            m = c.matcher()
            m.consume(committed + draft[:len(draft) // 2])
            row = torch.zeros(m.words, dtype=torch.int32)
            m.mask(row)
            refused = sorted(set(range(V)) - ids_of(row, V))
            draft = draft[:len(draft) // 2] + [rng.choice(refused)] + draft[len(draft) // 2:]
        m = c.matcher()
        assert m.consume(committed)
        want = masks_by_consuming(c, committed, draft)
        sentinel = -7  # rows past the refused id keep what they held
        out = torch.full((len(draft) + 1, m.words), sentinel, dtype=torch.int32)
        before = torch.zeros(m.words, dtype=torch.int32)
        m.mask(before)
        forced = m.forced(16)
        m.path_masks(draft, out)
        for j, row in enumerate(want):
            assert torch.equal(out[j], row), (kind, trial, j)
        assert (out[len(want):] == sentinel).all()
        after = torch.zeros(m.words, dtype=torch.int32)
        m.mask(after)
        assert torch.equal(after, before) and m.forced(16) == forced
        # the matcher goes on from the committed prefix as a fresh one does
        rest = full[cut:]
        assert m.consume(rest), m.error
        assert masks_by_consuming(c, full, [])[0].equal(_mask(m))


def _mask(m) -> torch.Tensor:
    row = torch.zeros(m.words, dtype=torch.int32)
    m.mask(row)
    return row


def test_path_masks_through_eos_roll_back(stories, V):
    c = compile(stories, Grammar.regex("[0-9]+"))  # open-ended: EOS is one choice after a digit, not the only one
    eos = stories.stop_token_ids[0]
    two = tokenize(stories, "42")
    m = c.matcher()
    assert eos not in ids_of(_mask(m), V)  # EOS only in an accepting state
    out = torch.full((len(two) + 2, m.words), -7, dtype=torch.int32)
    m.path_masks(two + [eos], out)
    assert eos in ids_of(out[len(two)], V) and not (out[len(two) + 1] == -7).all()  # EOS consumed, its row filled
    assert torch.equal(_mask(m), _mask(c.matcher())) and not m.done
    assert m.consume(two + [eos]) and m.done


def test_mask_agrees_with_the_engine_token_by_token(stories, V):
    """allowed() of a mask is the set of ids the matcher accepts one at a time."""
    m = compile(stories, Grammar.json_schema(PERSON)).matcher()
    assert m.consume(tokenize(stories, '{"name": "A'))
    assert ids_of(_mask(m), V) == {t for t in range(V) if m.m.validate_tokens([t]) == 1}


def test_forced_gives_the_schema_keys(stories):
    m = compile(stories, Grammar.json_schema(PERSON)).matcher()
    text = stories.tokenizer.decode
    first = m.forced(32)
    assert text(first) == '{"name": "'
    assert m.forced(3) == first[:3] and m.forced(0) == []
    assert m.consume(first + tokenize(stories, 'Bo"'))
    assert text(m.forced(32)) == ', "age": '
    assert m.consume(m.forced(32) + tokenize(stories, "7"))
    assert m.forced(32) == []  # more digits or "}": nothing forced
    assert m.consume(tokenize(stories, "}")) and m.forced(32) == []


def test_forced_is_empty_when_the_grammar_branches(stories):
    assert compile(stories, Grammar.choice(["red", "green"])).matcher().forced(8) == []
    assert compile(stories, Grammar("json_object")).matcher().forced(8) == tokenize(stories, "{")


def test_allowed_unpacks_bits_little_endian_per_word():
    V = 70  # three words, the last one partly used
    rng = random.Random(0)
    ids = sorted(rng.sample(range(V), 25)) + [31, 63]  # bit 31: a negative int32 word
    words = [sum(1 << (t % 32) for t in set(ids) if t // 32 == w) for w in range(3)]
    bits = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)  # as signed int32
    got = allowed(bits, V)
    assert got.shape == (V,) and got.dtype == torch.bool
    assert got.nonzero().flatten().tolist() == sorted(set(ids))
    batch = allowed(torch.stack([bits, torch.full((3,), -1, dtype=torch.int32)]), V)  # (..., words) -> (..., V)
    assert batch.shape == (2, V) and batch[1].all() and torch.equal(batch[0], got)


def test_of_response_format_shapes():
    assert Grammar.of_response_format(None) is None
    assert Grammar.of_response_format({"type": "text"}) is None
    assert Grammar.of_response_format({"type": "json_object"}) == Grammar("json_object")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    assert Grammar.of_response_format(fmt) == Grammar.json_schema(PERSON)


@pytest.mark.parametrize("fmt, match", [
    ({"type": "json_schema"}, '"json_schema": {"name"'),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, '"json_schema": {"name"'),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be a JSON object"),
    ({"type": "xml"}, "text, json_object or json_schema"),
    ("json_object", "text, json_object or json_schema"),
    ({}, "text, json_object or json_schema"),
])
def test_of_response_format_errors(fmt, match):
    with pytest.raises(UnmaskError) as e:
        Grammar.of_response_format(fmt)
    assert match in str(e.value) and "\n" not in str(e.value)


def test_of_structured_shapes():
    assert Grammar.of_structured({"json": PERSON}) == Grammar.json_schema(PERSON)
    assert Grammar.of_structured({"regex": "[a-z]+"}) == Grammar.regex("[a-z]+")
    assert Grammar.of_structured({"grammar": 'start: "x"'}) == Grammar.lark('start: "x"')
    assert Grammar.of_structured({"choice": ["a", "b"]}) == Grammar.choice(["a", "b"])
    assert Grammar.of_structured({"json_object": True}) == Grammar("json_object")
    assert Grammar.of_structured({"json_object": False, "regex": "x"}) == Grammar.regex("x")  # false: not given


@pytest.mark.parametrize("spec, match", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"regex": "a", "extra": 1}, "exactly one of"),
    (["regex"], "must be an object"),
    ({"choice": []}, "non-empty list"),
    ({"json": "[1]"}, "must be a JSON object"),
])
def test_of_structured_errors(spec, match):
    with pytest.raises(UnmaskError) as e:
        Grammar.of_structured(spec)
    assert match in str(e.value) and "\n" not in str(e.value)


def test_the_mask_token_past_the_tokenizer_is_never_allowed():
    """stories260K-sbd's logits are one wider than its tokenizer (the mask id 512): no grammar allows it."""
    import unmask

    b = unmask.load("stories260K-sbd")
    V = b.model.config.vocab_size
    assert V > len(b.tokenizer)
    for g in (Grammar("json_object"), Grammar.regex(".*")):
        m = compile(b, g).matcher()
        for t in random_path(compile(b, g), [], 6, random.Random(1), V) + [None]:
            assert not allowed(_mask(m), V)[len(b.tokenizer):].any()
            if t is not None:
                assert m.consume([t])


def draft_by_hand(compiled, committed: list[int], candidates: list[list[int]], n: int, V: int) -> list[int]:
    """Matcher.draft's contract one id at a time on a fresh matcher: the forced id where the grammar forces
    one, else the first candidate its mask allows; it ends at n ids, no allowed candidate, or the grammar's end."""
    m = compiled.matcher()
    assert m.consume(committed)
    out = []
    while len(out) < n and not m.done:
        forced = m.forced(1)
        ok = ids_of(_mask(m), V)
        j = len(out)
        pick = forced[0] if forced else next((c for c in (candidates[j] if j < len(candidates) else []) if c in ok), None)
        if pick is None:
            break
        assert m.consume([pick])
        out.append(pick)
    return out


def test_draft_is_the_forced_ids_then_the_first_allowed_candidate(stories, V):
    c = compile(stories, Grammar.json_schema(PERSON))
    m = c.matcher()
    keys = m.forced(32)  # '{"name": "'
    assert m.draft([], 32) == keys and m.draft([[]] * 40, 5) == keys[:5]
    bo = tokenize(stories, "Bo")[0]
    refused = next(t for t in range(V) if t not in ids_of(_mask(_after(c, keys)), V))
    got = m.draft([[]] * len(keys) + [[refused, bo]], 32)
    assert got == keys + [bo]
    assert torch.equal(_mask(m), _mask(c.matcher())) and m.forced(32) == keys  # the state is unchanged


def _after(compiled, ids):
    m = compiled.matcher()
    assert m.consume(ids)
    return m


def test_draft_ends_where_the_grammar_ends_and_rolls_back(stories, V):
    c = compile(stories, Grammar.regex("[0-9]{2}"))
    eos = stories.stop_token_ids[0]
    four, two = tokenize(stories, "4")[0], tokenize(stories, "2")[0]
    m = c.matcher()
    assert m.draft([[four], [two], [four]], 8) == [four, two]  # a third digit is refused
    assert _after(c, [four, two]).done  # the grammar ends there: EOS alone may follow, and the draft stops
    assert m.draft([[four], [two], [eos]], 8) == [four, two]
    assert torch.equal(_mask(m), _mask(c.matcher())) and not m.done


@pytest.mark.parametrize("kind", ["json_schema", "json_object", "regex", "grammar"])
def test_draft_equals_the_contract_one_id_at_a_time(stories, V, kind):
    c = compile(stories, KINDS[kind])
    rng = random.Random(kind)
    for _ in range(8):
        full = random_path(c, [], 20, rng, V)
        committed = full[: rng.randrange(len(full) + 1)]
        allowed_now = sorted(ids_of(_mask(_after(c, committed)), V))
        n = rng.randrange(1, 10)
        # candidates: random ids, sometimes one the grammar allows, sometimes none at all
        candidates = [rng.sample(range(V), 3) + ([rng.choice(allowed_now)] if rng.random() < 0.5 else [])
                      for _ in range(n)]
        m = _after(c, committed)
        before = _mask(m)
        got = m.draft(candidates, n)
        assert got == draft_by_hand(c, committed, candidates, n, V), (kind, committed, candidates)
        assert torch.equal(_mask(m), before)
        assert _after(c, committed).consume(got)


@pytest.mark.parametrize("text, output", [('start: "x ::= y"', "x ::= y"), ('start: A\nA: "a::=b"', "a::=b"),
                                          ('root ::= "x ::= y"', "x ::= y"), ('  root::="ab"', "ab")])
def test_lark_with_the_gbnf_operator_in_a_string_stays_lark(stories, text, output):
    """GBNF is told from Lark by a rule line ``name ::= ...``, not by "::=" anywhere (a Lark string may hold it)."""
    m = compile(stories, Grammar.lark(text)).matcher()
    assert m.consume(tokenize(stories, output)), m.error
    assert m.m.is_accepting()
