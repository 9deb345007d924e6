"""logprobs, logit_bias and grammars in the verify batch (``ar``, lossless ``sbd``; spec/structured.md):
logprobs equal a full forward's (so lossless == AR), a bias and a grammar keep lossless == AR, forced
ids ride in the draft, constrained outputs validate, and a grammar that allows nothing ends the row."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import tiny_bundle, tiny_llama

import unmask
from unmask import Grammar
from unmask.compat import forward
from unmask.decode import DECODERS
from unmask.errors import UnmaskError
from unmask.models.mask_token import add_mask_token
from unmask.sampling import Sampling
from verify_helpers import lossless

LAYOUTS = ["linear", "quadratic", "3/0,2,3/4"]  # the chain layouts and a budgeted one with siblings
PROMPTS = [[1, 5, 9, 12, 7], [1, 3], [1, 8, 8, 2, 4, 6]]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer"}, "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(vocab=16, seed=0, attn_implementation="eager", initializer_range=0.2)
    return tiny_bundle(model, kind="sbd", mask_token_id=add_mask_token(model))


@pytest.fixture(scope="module")
def stories():
    return unmask.load("stories260K-sbd")


def full_forward_logprobs(bundle, prompt, tokens):
    """log_softmax of one causal forward of prompt + tokens at the positions that produced ``tokens``."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = forward(bundle.model, ids, position_ids=torch.arange(ids.shape[1])[None])[0].float()
        logits[:, list(bundle.suppress_ids)] = float("-inf")
        return torch.log_softmax(logits, -1)[len(prompt) - 1: len(prompt) - 1 + len(tokens)]  # (n, V)


def check_against_full_forward(bundle, out, k):
    for prompt, toks, lps in zip(PROMPTS, out.tokens, out.logprobs):
        assert [e.token for e in lps] == toks
        ref = full_forward_logprobs(bundle, prompt, toks)
        for i, e in enumerate(lps):
            assert abs(e.logprob - float(ref[i, e.token])) < 1e-5
            want = ref[i].topk(k)
            assert [t for t, _ in e.top] == want.indices.tolist()
            assert [v for _, v in e.top] == pytest.approx(want.values.tolist(), abs=1e-5)


@pytest.mark.parametrize("layout", ["ar", *LAYOUTS])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_full_forwards_at_every_committed_token(tiny, layout, temperature):
    sampling = Sampling(temperature=temperature, seed=3)
    kw = dict(max_new_tokens=14, sampling=sampling, logprobs=3)
    out = DECODERS["ar"].decode(tiny, PROMPTS, **kw) if layout == "ar" else lossless(tiny, PROMPTS, block_size=4,
                                                                                    draft=layout, **kw)
    if layout != "ar" and temperature == 0:
        assert max(c for r in out.stats.extra["row_extra"] for c in r["accepts"]) > 1  # drafts were accepted
    check_against_full_forward(tiny, out, 3)


def test_greedy_lossless_logprobs_equal_ar(tiny):
    ar = DECODERS["ar"].decode(tiny, PROMPTS, max_new_tokens=16, logprobs=5)
    for layout in LAYOUTS:
        ls = lossless(tiny, PROMPTS, max_new_tokens=16, block_size=4, draft=layout, logprobs=5)
        assert ls.tokens == ar.tokens
        for ra, rl in zip(ar.logprobs, ls.logprobs):
            assert [e.token for e in rl] == [e.token for e in ra]
            assert max(abs(a.logprob - b.logprob) for a, b in zip(ra, rl)) < 1e-5
            assert [[t for t, _ in e.top] for e in rl] == [[t for t, _ in e.top] for e in ra]


def test_no_logprobs_asked_none_returned(tiny):
    assert DECODERS["ar"].decode(tiny, PROMPTS, max_new_tokens=4).logprobs is None
    assert lossless(tiny, PROMPTS, max_new_tokens=4, block_size=4, logprobs=0).logprobs[0][0].top == ()


def test_logit_bias_keeps_lossless_equal_to_biased_ar(tiny):
    plain = DECODERS["ar"].decode(tiny, PROMPTS, max_new_tokens=16)
    banned = plain.tokens[0][1]
    bias = {banned: -100, 7: 3.5}
    ar = DECODERS["ar"].decode(tiny, PROMPTS, max_new_tokens=16, logit_bias=bias)
    assert ar.tokens != plain.tokens and all(banned not in t for t in ar.tokens)
    for layout in LAYOUTS:
        assert lossless(tiny, PROMPTS, max_new_tokens=16, block_size=4, draft=layout, logit_bias=bias).tokens == ar.tokens
    # one biased row beside unbiased ones: each row as alone
    from unmask.decode.engine.running import Request, drain
    reqs = [Request(prompt_ids=p, max_new_tokens=16, id=i, logit_bias=bias if i == 1 else None)
            for i, p in enumerate(PROMPTS)]
    cfg = DECODERS["sbd"].config.of({"verify": True, "block_size": 4})
    out = drain(lambda cap: DECODERS["sbd"].batch(tiny, cfg, capacity=cap, prompts=PROMPTS, max_new_tokens=16), reqs)
    assert out.tokens == [plain.tokens[0], ar.tokens[1], plain.tokens[2]]


def test_logit_bias_ids_outside_the_vocabulary_are_named(tiny):
    with pytest.raises(UnmaskError, match=r"keys that are not token ids of this model \(99, -1\)"):
        DECODERS["ar"].decode(tiny, PROMPTS, max_new_tokens=4, logit_bias={99: 1, -1: 1})
    with pytest.raises(UnmaskError, match=r"\[-100, 100\]"):
        DECODERS["ar"].decode(tiny, PROMPTS, max_new_tokens=4, logit_bias={3: 101})


GRAMMARS = [Grammar.json_schema(SCHEMA), Grammar.regex(r"[A-Z][a-z]+( [a-z]+){2,5}\."),
            Grammar.choice(["a cat", "a dog", "a little red bird"]), Grammar("json_object")]


def valid(g: Grammar, text: str) -> bool:
    if g.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(g.source))
        return True
    if g.kind == "json_object":
        return isinstance(json.loads(text), dict)
    if g.kind == "regex":
        return re.fullmatch(g.source, text) is not None
    return text in json.loads(g.source)


@pytest.mark.parametrize("g", GRAMMARS, ids=lambda g: g.kind)
def test_constrained_lossless_equals_constrained_ar_and_validates(stories, g):
    prompts = ["Once upon a time", "The little dog", "Lily wanted to"]
    ar = unmask.generate(prompts, stories, "ar", max_new_tokens=60, grammar=g)
    for layout in (None, "linear", "quadratic"):
        opts = {} if layout is None else {"draft": layout}
        ls = unmask.generate(prompts, stories, "sbd", max_new_tokens=60, grammar=g, **opts)
        assert ls.tokens == ar.tokens, layout
    finished = [t for t, n in zip(ar.texts, ar.tokens) if len(n) < 60]
    assert all(valid(g, t) for t in finished)
    assert finished or g.kind == "json_object"  # stories260K writes one endless string value into a bare object
    lookup = unmask.generate(prompts, stories, "ar", max_new_tokens=60, grammar=g, draft_source="lookup")
    assert lookup.tokens == ar.tokens


def test_forced_ids_are_committed_without_forwards_of_their_own(stories):
    g = Grammar.json_schema(SCHEMA)
    out = unmask.generate(["Once upon a time"], stories, "sbd", max_new_tokens=60, grammar=g)
    accepts, K = out.stats.extra["row_extra"][0]["accepts"], out.stats.extra["block_size"]
    assert accepts[0] == 1 and accepts[1] == K  # '{' from the prefill, then '"name": "' forced: a full window
    forced = out.stats.extra["row_extra"][0]["forced"]
    text = out.texts[0]  # '{' '"name": "' ... '", "age": ' ... ', "pet": "' ...: the schema's punctuation and keys
    assert 8 <= forced < len(out.tokens[0])  # at least '{"name": "' (8 ids in this tokenizer)
    assert text.startswith('{"name": "')
    ar = unmask.generate(["Once upon a time"], stories, "ar", max_new_tokens=60, grammar=g)
    assert out.tokens == ar.tokens and out.stats.nfe < ar.stats.nfe


def test_sampled_constrained_output_validates(stories):
    g = Grammar.json_schema(SCHEMA)
    prompts = ["Once upon a time", "The little dog", "Lily wanted to", "Tom and Sue"]
    for decoder in ("ar", "sbd"):
        out = unmask.generate(prompts, stories, decoder, max_new_tokens=80, grammar=g, temperature=0.8, seed=1)
        done = [t for t, n in zip(out.texts, out.tokens) if len(n) < 80]
        assert done and all(valid(g, t) for t in done)


def test_a_grammar_is_refused_by_lossy_sbd_naming_the_decoders_that_take_one(stories):
    with pytest.raises(UnmaskError, match=r"does not take a grammar \(structured output runs on ar and lossless sbd"):
        unmask.generate("Once", stories, "sbd", verify=False, max_new_tokens=8, grammar=Grammar.regex("[a-z]+"))


def test_invalid_grammars_are_one_line_errors(stories):
    for g in (Grammar.regex("(["), Grammar.lark("start: foo"), Grammar.json_schema({"type": "objectx"})):
        with pytest.raises(UnmaskError) as e:
            unmask.generate("Once", stories, "ar", max_new_tokens=8, grammar=g)
        assert "\n" not in str(e.value) and "invalid" in str(e.value)


def test_a_grammar_that_allows_nothing_ends_the_row_with_an_error(stories, monkeypatch):
    from unmask import grammar as G
    mask = G.Matcher.mask
    calls = []

    def starve(self, out):  # from the 5th mask on, the grammar allows no id at all
        calls.append(1)
        mask(self, out)
        if len(calls) > 4:
            out[...] = 0

    monkeypatch.setattr(G.Matcher, "mask", starve)
    for decoder in ("ar", "sbd"):
        calls.clear()
        with pytest.raises(UnmaskError, match="the grammar allows no token"):
            unmask.generate("Once upon a time", stories, decoder, max_new_tokens=40, grammar=Grammar.regex("[a-z ]+"))


def test_a_constrained_chain_step_reads_the_host_once(stories, monkeypatch):
    """Greedy grammar rows on a chain layout draft from candidates read with the step: after their first
    step (no candidates yet: the drafts are read once more, and the window tables once per window), one
    host read per step; logprobs and a bias ride in that read too."""
    from test_r5_host_syncs import SyncCounter

    from unmask.decode.engine.running import requests_for
    counter = SyncCounter(monkeypatch)
    spec = DECODERS["sbd"]
    cfg = spec.config.of({"verify": True, "block_size": 6, "draft": "linear"})
    prompts = [stories.encode(p) for p in ("Once upon a time", "The little dog", "Lily wanted to", "Tom and Sue")]
    reqs = requests_for(prompts, max_new_tokens=48, sampling=Sampling(), logprobs=2, logit_bias={5: -1.0},
                        grammar=unmask.grammar.compile(stories, Grammar.json_schema(SCHEMA)))
    dec = spec.batch(stories, cfg, capacity=4, prompts=prompts, max_new_tokens=48)
    dec.join(reqs)
    reads = []
    while len(dec):
        counter.where, counter.on = [], True
        try:
            with torch.inference_mode():
                dec.step()
        finally:
            counter.on = False
        reads.append(len(counter.where))
    assert len(reads) > 5 and max(reads[1:]) == 1, reads


def test_forced_ids_are_the_draft_of_a_model_free_drafting_row(stories):
    """``ar --draft-source lookup``: on the host layout the forced ids replace the row's model-free draft (its K
    follows them), so constrained AR with a draft source commits a schema's keys without their forwards; the
    drafter's own record is not credited with them."""
    g = Grammar.json_schema(SCHEMA)
    prompts = ["Once upon a time", "The little dog"]
    ar = unmask.generate(prompts, stories, "ar", max_new_tokens=60, grammar=g)
    for source in ("lookup", "suffix"):
        out = unmask.generate(prompts, stories, "ar", max_new_tokens=60, grammar=g, draft_source=source)
        assert out.tokens == ar.tokens
        assert out.stats.nfe < ar.stats.nfe and all(r["forced"] >= 8 for r in out.stats.extra["row_extra"])
        assert all(r["accepts"][1] >= 8 for r in out.stats.extra["row_extra"])  # '"name": "' in the first step
        tally = out.stats.extra["drafts"].get(source, {"drafted": 0})
        assert tally["drafted"] < sum(r["forced"] for r in out.stats.extra["row_extra"])


def test_n_choices_per_prompt_in_the_python_api(stories):
    """``generate(n=3)``: each prompt's choices side by side (p * n + i), choice i drawn as row i of the prompt
    repeated n times (the generator the server gives choice i); greedy choices are copies."""
    sampled = unmask.generate(["Once upon a time", "Zoo"], stories, "ar", max_new_tokens=12, temperature=1.0, seed=7,
                              n=3)
    assert len(sampled.texts) == 6 and sampled.prompts == ["Once upon a time"] * 3 + ["Zoo"] * 3
    assert sampled.texts[3:] == unmask.generate(["Zoo"] * 3, stories, "ar", max_new_tokens=12, temperature=1.0,
                                                seed=7).texts
    assert len(set(sampled.texts[3:])) == 3  # independent samples ("Once upon a time" is memorized: one text)
    greedy = unmask.generate("Zoo", stories, "sbd", max_new_tokens=12, n=2, logprobs=1)
    assert greedy.tokens[0] == greedy.tokens[1] and len(greedy.logprobs) == 2
    with pytest.raises(UnmaskError, match="n must be an integer >= 1"):
        unmask.generate("Zoo", stories, "ar", n=0)
