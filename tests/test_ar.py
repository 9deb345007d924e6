"""AR decoder (decode/verify/ar.py): exact KV cache, batch invariance, seeded sampling, stopping and
DecodeStats, on tiny random Llama/Qwen3 models and on stories260K."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_bundle, tiny_llama, tiny_qwen3

import unmask
from unmask.compat import forward, new_cache
from unmask.decode.engine.batching import left_pad
from unmask.sampling import Sampling
from unmask.decode import DECODERS

FACTORIES = {"llama": tiny_llama, "qwen3": tiny_qwen3}
STORY_PROMPTS = [
    "Once upon a time",
    "Tom had a red ball.",
    "The sun",
    "Lily and her mom went to the park to play on the swings and slide.",
    "A cat",
    "One day, a little boy named Ben found a shiny stone in the garden.",
    "Zoo",
    "The big dog was sad because",
]


def _ids(seed: int, n: int, vocab: int = 64) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()


# --- exact KV cache -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_cached_equals_uncached(family, attn):
    model = FACTORIES[family](attn_implementation=attn)
    ids = torch.tensor([_ids(0, 16)])  # (1, 16)
    pos = torch.arange(16)[None]  # (1, 16)
    with torch.no_grad():
        full = forward(model, ids, position_ids=pos)  # (1, 16, V)
        cache = new_cache(model)
        steps = [forward(model, ids[:, :5], position_ids=pos[:, :5], cache=cache)]
        for t in range(5, 16):
            steps.append(forward(model, ids[:, t: t + 1], position_ids=pos[:, t: t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.get_seq_length() == 16


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_left_padded_cached_rows_equal_single_rows(family):
    """The decoder's batching: left padding + 2D mask + explicit positions == each row alone."""
    model = FACTORIES[family]()
    prompts = [_ids(s, n) for s, n in [(1, 3), (2, 9), (3, 6)]]
    ids, valid, pos = left_pad(prompts, 0, "cpu")  # (B, P)
    nxt = torch.tensor([[7], [8], [9]])  # (B, 1)
    with torch.no_grad():
        cache = new_cache(model)
        first = forward(model, ids, position_ids=pos, attention_mask=valid.long(), cache=cache, logits_to_keep=1)
        mask = torch.cat([valid.long(), torch.ones(3, 1, dtype=torch.long)], dim=1)
        second = forward(model, nxt, position_ids=pos[:, -1:] + 1, attention_mask=mask, cache=cache)
        for b, p in enumerate(prompts):
            alone = forward(model, torch.tensor([p + [7 + b]]), position_ids=torch.arange(len(p) + 1)[None])
            torch.testing.assert_close(first[b, -1], alone[0, -2], atol=1e-5, rtol=0)
            torch.testing.assert_close(second[b, -1], alone[0, -1], atol=1e-5, rtol=0)


# --- batch invariance -------------------------------------------------------------------------


def test_batch_of_8_equals_8_singles_on_stories(stories):
    batch = unmask.generate(STORY_PROMPTS, model=stories, max_new_tokens=48)
    singles = [unmask.generate(p, model=stories, max_new_tokens=48) for p in STORY_PROMPTS]
    assert len({len(p) for p in batch.prompt_tokens}) >= 6  # really mixed lengths
    assert batch.tokens == [s.tokens[0] for s in singles]
    assert batch.texts == [s.texts[0] for s in singles]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_batch_of_8_equals_8_singles_on_tiny(family, attn):
    bundle = tiny_bundle(FACTORIES[family](attn_implementation=attn))
    prompts = [_ids(10 + i, n) for i, n in enumerate([2, 5, 11, 3, 8, 1, 17, 6])]
    batch = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=24)
    singles = [DECODERS["ar"].decode(bundle, [p], max_new_tokens=24).tokens[0] for p in prompts]
    assert batch.tokens == singles


def test_batch_invariance_with_stops_on_tiny():
    """Rows that stop early keep being fed (padded) and must not disturb the others."""
    bundle = tiny_bundle(tiny_llama())
    prompts = [_ids(20 + i, n) for i, n in enumerate([4, 9, 2, 6])]
    free = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=20).tokens
    stop = (free[0][3], free[2][5])  # make two rows end early
    batch = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=20, stop_token_ids=stop)
    singles = [DECODERS["ar"].decode(bundle, [p], max_new_tokens=20, stop_token_ids=stop).tokens[0] for p in prompts]
    assert batch.tokens == singles
    assert len(batch.tokens[0]) <= 3 and len(batch.tokens[2]) <= 5


# --- sampling ---------------------------------------------------------------------------------


def test_sampling_reproducible_with_seed(stories):
    kw = dict(model=stories, max_new_tokens=40, temperature=1.0, top_p=0.95)
    a = unmask.generate(STORY_PROMPTS[:3], seed=7, **kw)
    b = unmask.generate(STORY_PROMPTS[:3], seed=7, **kw)
    c = unmask.generate(STORY_PROMPTS[:3], seed=8, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_sampling_reproducible_on_tiny():
    bundle = tiny_bundle(tiny_qwen3())
    prompts = [_ids(1, 4), _ids(2, 7)]

    def run(seed, **kw):
        return DECODERS["ar"].decode(bundle, prompts, max_new_tokens=16, sampling=Sampling(temperature=1.0, seed=seed, **kw)).tokens

    assert run(0) == run(0) and run(0) != run(1)
    assert run(3, top_k=5) == run(3, top_k=5)
    greedy = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=16).tokens
    assert run(0, top_k=1) == greedy  # top-1 sampling is greedy


# --- stopping -------------------------------------------------------------------------------


def test_stops_at_bos_or_eos_on_stories(stories):
    ids = [stories.encode("The sun")]
    free = DECODERS["ar"].decode(stories, ids, max_new_tokens=300)  # no stop ids: runs to the end
    stopped = DECODERS["ar"].decode(stories, ids, max_new_tokens=300, stop_token_ids=stories.stop_token_ids)
    assert set(stories.stop_token_ids) == {1, 2}
    n = len(stopped.tokens[0])
    assert n < 300 and stopped.tokens[0] == free.tokens[0][:n]
    assert free.tokens[0][n] in (1, 2) and not {1, 2} & set(stopped.tokens[0])
    assert stopped.stats.nfe_per_row == [n + 1]  # the forward that produced the stop token counts


def test_stop_token_on_tiny():
    bundle = tiny_bundle(tiny_llama())
    free = DECODERS["ar"].decode(bundle, [_ids(5, 6)], max_new_tokens=20).tokens[0]
    k = 7
    first = free.index(free[k])  # the stop token may already occur earlier
    out = DECODERS["ar"].decode(bundle, [_ids(5, 6)], max_new_tokens=20, stop_token_ids=(free[k],))
    assert out.tokens[0] == free[:first]
    assert out.stats.nfe == first + 1


def test_stop_token_at_the_last_step_on_tiny():
    bundle = tiny_bundle(tiny_llama())
    prompts = [_ids(6, 5), _ids(7, 9)]
    free = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=20).tokens
    first = free[0].index(free[0][12])
    n = first + 1  # row 0 samples the stop token exactly at its last step
    out = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=n, stop_token_ids=(free[0][12],))
    assert out.tokens[0] == free[0][:first] and out.stats.nfe_per_row[0] == n
    alone = DECODERS["ar"].decode(bundle, prompts[:1], max_new_tokens=n, stop_token_ids=(free[0][12],))  # every row ends
    assert alone.tokens == [free[0][:first]] and alone.stats.nfe == n


def test_stop_strings(stories):
    free = unmask.generate("Zoo", model=stories, max_new_tokens=56)
    assert " named Lily" in free.texts[0]
    out = unmask.generate("Zoo", model=stories, max_new_tokens=56, stop=["Lily"])
    assert out.texts[0] == " was a little girl named "
    assert len(out.tokens[0]) < 15  # decoding stopped, not just the text cut
    assert out.tokens[0] == free.tokens[0][: len(out.tokens[0])]


# --- statistics -------------------------------------------------------------------------------


def test_stats_without_stops(stories):
    out = unmask.generate(STORY_PROMPTS[:4], model=stories, max_new_tokens=12)
    s = out.stats
    assert s.nfe == 12  # prefill commits the first token, then one forward per token
    assert s.nfe_per_row == [12] * 4 and s.tokens_per_row == [12] * 4
    assert s.generated == 48 and s.tpf == 1.0 and s.seconds > 0 and s.tps > 0
    assert [r["tpf"] for r in out.rows()] == [1.0] * 4


def test_stats_with_early_stop_on_tiny():
    bundle = tiny_bundle(tiny_llama())
    prompts = [_ids(30, 5), _ids(31, 3)]
    free = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=10).tokens
    stop = free[0][2]
    out = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=10, stop_token_ids=(stop,))
    s = out.stats
    n0 = len(out.tokens[0])
    assert n0 <= 2 and s.nfe_per_row[0] == n0 + 1
    if stop not in free[1]:
        assert s.tokens_per_row[1] == 10 and s.nfe_per_row[1] == 10 and s.nfe == 10
    assert s.tokens_per_row == [len(t) for t in out.tokens]


def test_one_new_token_is_one_forward():
    bundle = tiny_bundle(tiny_llama())
    out = DECODERS["ar"].decode(bundle, [_ids(0, 4)], max_new_tokens=1)
    assert out.stats.nfe == 1 and len(out.tokens[0]) == 1


def test_mask_token_is_never_generated():
    model = tiny_llama()
    prompt = [_ids(0, 4)]
    first = DECODERS["ar"].decode(tiny_bundle(model), prompt, max_new_tokens=1).tokens[0][0]
    with torch.no_grad():  # make id 9 score 10x the winner: it wins unless suppressed
        model.lm_head.weight[9] = 10 * model.lm_head.weight[first]
    assert 9 in DECODERS["ar"].decode(tiny_bundle(model), prompt, max_new_tokens=8).tokens[0]
    out = DECODERS["ar"].decode(tiny_bundle(model, kind="sbd", mask_token_id=9), prompt, max_new_tokens=8)
    assert 9 not in out.tokens[0]
