"""Continuous batching for lossless SBD on the one engine's batch (``Verify``, issues 16 and
25): whenever a row joins and whatever runs beside it, its tokens, NFE, accept counts and step events
equal lossless ``sbd`` decoding of its prompt alone, greedy and seeded-sampled, and greedy rows are AR's
tokens (STYLE.md 14)."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from batch_helpers import GREEDY, RecordingRun, assert_row_equals_single, single_decode
from conftest import tiny_bundle, tiny_llama
from test_sbd_verify import verify_bundle

import unmask
from unmask.compat import forward, new_cache
from unmask.errors import UnmaskError
from unmask.sampling import Sampling
from unmask.decode.verify import batch as verify_batch
from unmask.decode.verify.batch import Verify
from unmask.decode.engine.running import Request
from unmask.decode.verify import config as vconfig
from verify_helpers import lossless

SAMPLED = Sampling(temperature=0.9, top_k=20, seed=5)
TEXTS = ["Once upon a time", "The cat sat on the", "Lily and Ben went to the park", "One day",
         "Tom had a red ball and", "She"]


_ids = itertools.count()


def job(prompt, max_new_tokens, sampling=GREEDY, stop=()) -> Request:
    return Request(prompt_ids=list(prompt), max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop),
                   id=next(_ids))


def verify(bundle, options, **kw) -> Verify:
    cfg = vconfig.VerifyConfig.of(**{k: v for k, v in options.items() if v is not None})
    return Verify(bundle, cfg, **kw)


class Run(RecordingRun):
    """A lossless SBD batch plus everything it reported."""

    def __init__(self, bundle, options, **kw):
        super().__init__()
        self.bundle = bundle
        self.batch = verify(bundle, options, on_step=self._on_step, **{"capacity": 32, **kw})

    def check_cache(self):
        """Each row attends to exactly its prompt and its committed tokens but the bonus (fed by the
        next step); the key mask covers the whole cache; a finished row is gone, its slot attends to
        nothing."""
        b = self.batch
        if not len(b):
            assert b.kv.length == 0 and b.key_valid.numel() == 0
            return
        assert b.key_valid.shape[1] == b.kv.length
        rows = b.rows.values()
        want = [len(r.job.prompt_ids) + len(r.committed) - 1 for r in rows]
        assert [int(b.key_valid[r.slot].sum()) for r in rows] == want
        assert [int(b.p_b[r.slot]) for r in rows] == want
        assert [int(b.b[r.slot]) for r in rows] == [r.committed[-1] for r in rows]
        free = [s for s in range(b.key_valid.shape[0]) if s not in b.rows]
        assert not b.key_valid[free].any()
        assert all(r.finish is None for r in rows)


def single(bundle, j, options, stop_token_ids):
    return single_decode(lossless, bundle, j, options, stop_token_ids)


def assert_rows_equal_single_decodes(run, options, stop_token_ids):
    for row in run.done:
        out, events = single(run.bundle, row.job, options, stop_token_ids)
        assert_row_equals_single(row, out, events, run.events[id(row.job)][0])
        assert row.extra == out.stats.extra["row_extra"][0]


def ar_rows(bundle, jobs):
    """The jobs run as AR rows (K = 1) of the one batch: {id(job): (tokens, finish)}."""
    batch, done = Verify(bundle, capacity=len(jobs), ar=True), []
    done += batch.join(jobs)
    while len(batch):
        done += batch.step()
    return {id(r.job): (r.tokens, r.finish) for r in done}


@pytest.fixture(scope="module")
def sbd_model():
    return unmask.load("stories260K-sbd")


# --------------------------------------------------------------------------------- staggered joins


@pytest.mark.parametrize("K", [2, 4, 8])
@pytest.mark.parametrize("draft", vconfig.DRAFTS)
def test_rows_joining_at_different_steps_equal_single_prompt_decodes_and_ar(K, draft):
    bundle = verify_bundle("llama", "eager", vocab=8, seed=K)
    g = torch.Generator().manual_seed(K)
    prompts = [torch.randint(3, 8, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (7,), generator=g)]
    jobs = [job(p, n) for p, n in zip(prompts, [24, 3, 40, 1, 17, 30, 2])]
    options = {"block_size": K, "draft": draft}
    run = Run(bundle, options)
    run.join(jobs[:1])
    run.step(2)
    run.join(jobs[1:4])  # max_new_tokens 1: finished by its prefill
    assert [r.job for r in run.done] == [jobs[3]]
    run.step(3)
    run.join(jobs[4:6])
    run.step()
    run.join(jobs[6:])
    run.drain()
    assert sorted(id(r.job) for r in run.done) == sorted(id(j) for j in jobs)
    assert_rows_equal_single_decodes(run, options, ())
    want = ar_rows(bundle, jobs)
    for row in run.done:
        assert (row.tokens, row.finish) == want[id(row.job)]
    assert max(c for r in run.done for c in r.accepts) >= 2  # multi-token commits were exercised
    assert run.batch.forwards == 4 + run.steps  # one prefill per join (its jobs together), one forward per step


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
@pytest.mark.parametrize("K,draft", [(4, "quadratic"), (8, "linear")])
def test_shipped_model_rows_equal_single_decodes(sbd_model, sampling, K, draft):
    s = {"greedy": GREEDY, "sampled": SAMPLED}[sampling]
    jobs = [job(sbd_model.encode(t), n, s) for t, n in zip(TEXTS, [48, 20, 64, 8, 40, 30])]
    options = {"block_size": K, "draft": draft}
    run = Run(sbd_model, options)
    run.join(jobs[:1])
    run.step(3)
    run.join(jobs[1:4])
    run.step(2)
    run.join(jobs[4:])
    run.drain()
    assert len(run.done) == len(jobs)
    assert_rows_equal_single_decodes(run, options, sbd_model.stop_token_ids)
    if sampling == "greedy":  # and AR's text
        want = ar_rows(sbd_model, jobs)
        for row in run.done:
            assert (row.tokens, row.finish) == want[id(row.job)]


def test_rows_with_different_sampling_settings_share_a_batch():
    bundle = verify_bundle("llama", "eager", vocab=8, seed=3)
    settings = [GREEDY, Sampling(temperature=1.0, seed=3), Sampling(temperature=0.7, top_p=0.9, seed=4), GREEDY,
                Sampling(temperature=1.0, seed=3)]
    prompts = [[1, 4, 5], [1, 6], [1, 3, 3, 7], [1, 7, 7], [1, 5]]
    jobs = [job(p, 20, s) for p, s in zip(prompts, settings)]
    for options in ({"block_size": 4, "draft": "quadratic"}, {"block_size": 3, "draft": "linear"}):
        run = Run(bundle, options)
        run.join(jobs[:2])
        run.step(2)
        run.join(jobs[2:])
        run.drain()
        assert_rows_equal_single_decodes(run, options, ())
    # the same seed and prompt, joined apart, draws the same sample a single decode draws
    again = Run(bundle, {"block_size": 4})
    again.join([jobs[1]])
    again.drain()
    assert again.done[0].tokens == single(bundle, jobs[1], {"block_size": 4}, ())[0].tokens[0]


# --------------------------------------------------------------------------------- leaving


def test_a_row_dropped_mid_decode_is_gone_and_the_others_go_on_unchanged():
    bundle = verify_bundle("llama", "eager", vocab=8, seed=4)
    jobs = [job([1, 4, 5, 6], 30), job([1, 7], 30, Sampling(temperature=1.0, seed=1)), job([1, 3, 3], 25)]
    options = {"block_size": 4, "draft": "quadratic"}
    run = Run(bundle, options)
    run.join(jobs)
    run.step(3)
    gone = run.batch.drop([jobs[1].id])
    assert [r.job for r in gone] == [jobs[1]] and len(run.batch) == 2
    run.check_cache()
    assert run.batch.q is None  # no sampled row left: no proposal distributions kept
    assert run.batch.drop([]) == []
    run.drain()
    assert {id(r.job) for r in run.done} == {id(jobs[0]), id(jobs[2])}
    assert_rows_equal_single_decodes(run, options, ())
    assert len(run.events[id(jobs[1])][0]) == 4  # the prefill and 3 steps, nothing after the drop


def test_a_batch_emptied_by_drop_frees_its_cache_and_takes_new_rows():
    bundle = verify_bundle("llama", "eager", vocab=8, seed=5)
    options = {"block_size": 4, "draft": "linear"}
    run = Run(bundle, options)
    run.join([job([1, 4, 5], 30), job([1, 6, 6, 6, 3], 30)])
    run.step(2)
    assert len(run.batch.drop([r.job.id for r in run.batch.rows.values()])) == 2
    assert len(run.batch) == 0 and run.batch.kv.length == 0 and run.batch.key_valid.numel() == 0
    assert run.batch.step() == []
    later = [job([1, 7, 3], 12), job([1, 5], 16)]
    run.join(later)
    run.drain()
    assert_rows_equal_single_decodes(run, options, ())


def test_the_cache_holds_exactly_the_committed_causal_kv_and_is_compacted():
    bundle = verify_bundle("llama", "eager", vocab=8, seed=1)
    compactions = []
    real = verify_batch.compact  # the batch reclaims holes through verify_batch.compact
    run = Run(bundle, {"block_size": 4, "draft": "quadratic"})
    # a long prompt that leaves early: its columns become holes of the short rows
    jobs = [job([1] + [4, 5, 6, 7] * 6, 6), job([1, 7], 40), job([1, 3, 3, 7, 5, 5], 40), job([1, 6], 30)]

    def check():
        b = run.batch
        for i, row in b.rows.items():
            cols = torch.nonzero(b.key_valid[i]).flatten()  # (n,) the row's valid cache columns
            seq = row.job.prompt_ids + row.committed[:-1]  # everything but the bonus
            cache = new_cache(bundle.model)
            forward(bundle.model, torch.tensor([seq]), position_ids=torch.arange(len(seq))[None], cache=cache)
            for layer, fresh in zip(b.kv.cache.layers, cache.layers):
                torch.testing.assert_close(layer.keys[i][:, cols], fresh.keys[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(layer.values[i][:, cols], fresh.values[0], atol=1e-5, rtol=1e-5)

    def counted(kv, key_valid, M):
        compactions.append(kv.length)
        return real(kv, key_valid, M)

    with mock.patch.object(verify_batch, "compact", counted):
        run.join(jobs[:2])
        for _ in range(4):
            run.step()
            check()
        run.join(jobs[2:])
        while len(run.batch):
            run.step()
            check()
    assert compactions  # holes were reclaimed on the way
    assert_rows_equal_single_decodes(run, {"block_size": 4, "draft": "quadratic"}, ())


# --------------------------------------------------------------------------------- stopping


def test_stop_tokens_stop_strings_and_lengths_end_rows_like_decode_and_ar():
    model = verify_bundle("llama", "eager", vocab=8, seed=1).model
    bundle = tiny_bundle(model, kind="sbd", mask_token_id=model.config.vocab_size - 1, stop_token_ids=(2,))
    prompts = [[1, 4, 5], [1, 6], [1, 3, 3, 7], [1, 5, 5], [1, 7, 4, 4]]
    jobs = [job(p, n, GREEDY, stop) for p in prompts for n, stop in
            [(30, ()), (30, (" 3 5 3",)), (30, (" 5 5 5 5 5", " 7 7")), (1, ()), (2, (" 4",)), (0, ())]]
    for options in ({"block_size": 4, "draft": "quadratic"}, {"block_size": 8, "draft": "linear"}):
        run = Run(bundle, options)
        run.join(jobs[::3])
        run.step(2)
        run.join(jobs[1::3])
        run.step()
        run.join(jobs[2::3])
        run.drain()
        assert len(run.done) == len(jobs)
        assert_rows_equal_single_decodes(run, options, (2,))
        want = ar_rows(bundle, jobs)
        for row in run.done:
            assert (row.tokens, row.finish) == want[id(row.job)], row.job
        finishes = [r.finish for r in run.done]
        assert "stop" in finishes and "length" in finishes
        assert any(r.job.stop and r.finish == "stop" for r in run.done)  # a stop string ended a row


# --------------------------------------------------------------------------------- options


def test_options_are_validated_once():
    bundle = verify_bundle("llama", "eager", vocab=8, seed=0)
    with pytest.raises(UnmaskError, match="block size"):
        verify(bundle, {"block_size": 1})
    with pytest.raises(UnmaskError, match="draft layout"):
        verify(bundle, {"draft": "cubic"})
    with pytest.raises(UnmaskError, match="mask token"):
        verify(tiny_bundle(tiny_llama(vocab=8)), {})
    b = verify(bundle, {"block_size": None, "draft": None})
    with pytest.raises(UnmaskError, match="non-empty prompt"):
        b.join([job([1, 4], 5), job([], 5)])
    assert len(b) == 0 and b.forwards == 0 and b.slots.free == b.slots.capacity  # nothing joined
    assert (b.cfg.block_size, b.cfg.draft) == (vconfig.DEFAULT_BLOCK_SIZE, vconfig.DEFAULT_DRAFT)
