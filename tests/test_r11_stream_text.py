"""A stream's text is decoded incrementally (``TextStream._continuation``): each step decodes only the ids
after the last fixed prefix, with a few ids of context, instead of the prompt and the whole text again.
These tests hold it equal to decoding the whole continuation, at every step, for the shipped tokenizer
(SentencePiece-style BPE with byte fallback) and for byte-level BPE and WordPiece tokenizers trained here,
on random id sequences that split multi-byte characters and spaces every way."""

from __future__ import annotations

import random
import types

import pytest

import unmask
from unmask.models.bundle import ModelBundle
from unmask.serve.stream import CONTEXT_IDS, TextStream

CORPUS = ["Once upon a time, a naïve café owner said “hello” — then «bonjour»! Don't stop; it's 42 . ",
          "日本語のテキスト and emoji 🙂🚀 mixed with ascii words, tabs\tand\nnew lines  double  spaces.",
          "The quick brown fox jumps over the lazy dog ... isn't it ? Ünïcödé ẞ ø å œ ∑ ∫ √ ≈ ≠ ≤ ≥"] * 20


def _trained(kind: str):
    """A tiny fast tokenizer of ``kind`` trained on CORPUS, as a bundle stand-in with its decode_continuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "byte-level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<eos>"])
    else:  # WordPiece, "##" continuations, BERT's clean-up of spaces before punctuation
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "<eos>"])
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                   clean_up_tokenization_spaces=kind == "wordpiece")
    bundle = types.SimpleNamespace(tokenizer=fast, stop_token_ids=())
    bundle.decode_continuation = types.MethodType(ModelBundle.decode_continuation, bundle)
    return bundle, fast.vocab_size


@pytest.fixture(scope="module", params=["stories260K", "byte-level", "wordpiece"])
def tokenizer_bundle(request):
    if request.param == "stories260K":
        return unmask.load("stories260K"), 512
    pytest.importorskip("tokenizers")
    return _trained(request.param)


def test_incremental_text_equals_decoding_the_whole_continuation_at_every_step(tokenizer_bundle):
    bundle, vocab = tokenizer_bundle
    rng = random.Random(0)
    steps = 0
    for _ in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        stream = TextStream(bundle, prompt, ())
        i = 0
        while i < len(ids):
            i = min(len(ids), i + rng.randrange(1, 4))  # a step commits 1-3 ids, as lossless SBD does
            assert stream._continuation(ids[:i]) == bundle.decode_continuation(prompt, ids[:i])
            steps += 1
    assert steps > 1000


def test_incremental_text_on_real_text_and_after_a_changed_prefix(tokenizer_bundle):
    bundle, _ = tokenizer_bundle
    ids = bundle.tokenizer.encode(CORPUS[0] + CORPUS[1] + CORPUS[2], add_special_tokens=False)
    prompt, text = ids[:7], ids[7:]
    stream = TextStream(bundle, prompt, ())
    for i in range(1, len(text) + 1):
        assert stream._continuation(text[:i]) == bundle.decode_continuation(prompt, text[:i])
    assert stream._fixed_ids  # the fixed prefix advanced: later steps decoded only their tail
    other = text[:5] + text[::-1]  # not an extension of what was fixed: it starts over, still right
    assert stream._continuation(other) == bundle.decode_continuation(prompt, other)


def test_a_long_prompt_is_not_decoded_again_every_step(monkeypatch):
    """The reason for the incremental decode: with a 2,000-id prompt every step of every stream decoded
    it whole. Count the ids the tokenizer decodes over a 200-id stream."""
    bundle = unmask.load("stories260K")
    rng = random.Random(1)
    prompt = [rng.randrange(259, 512) for _ in range(2000)]
    text = [rng.randrange(259, 512) for _ in range(200)]
    stream = TextStream(bundle, prompt, ())
    want = bundle.decode_continuation(prompt, text)
    decoded = []
    real = type(bundle.tokenizer).decode

    def counting(self, ids, *args, **kwargs):
        decoded.append(len(ids))
        return real(self, ids, *args, **kwargs)

    monkeypatch.setattr(type(bundle.tokenizer), "decode", counting)
    sent = "".join(stream.update(text[:i]) for i in range(1, len(text) + 1))
    assert sent + stream.finish(text) == want
    assert decoded[0] == len(prompt) + 1 and decoded[-1] == len(prompt) + len(text)  # the first step, finish
    assert max(decoded[1:-1]) <= CONTEXT_IDS + 3  # every step between: its context and new ids, not the prompt
