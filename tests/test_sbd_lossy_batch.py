"""Continuous batching for lossy SBD and SingleBD on their one running batch
(:class:`unmask.decode.blocks.batch.BlockDecoder`, the server's running batch), issues 16 and 25:
whenever a row joins and whatever runs beside it, its tokens, NFE, per-row statistics and step
events equal the ``sbd`` decoder's / ``decode(decoder="block")`` on its prompt alone (STYLE.md 14)."""

from __future__ import annotations

import itertools

import pytest
from batch_helpers import GREEDY, RecordingRun, assert_row_equals_single, single_decode
from batch_helpers import job as _job
from conftest import tiny_bundle
from test_block_decode import bd_bundle, scripted_bundle
from test_sbd_decode import sbd_bundle

import unmask
from unmask.decode import DECODERS
from unmask.decode.blocks import sbd
from unmask.decode.verify.batch import Verify
from unmask.errors import UnmaskError
from unmask.sampling import Sampling
SBDBatch, BlockBatch = "sbd", "block"  # the decoders' names, as the server keys their batches
DECODE = {SBDBatch: DECODERS["sbd"].decode, BlockBatch: DECODERS["block"].decode}


def serving_batch(decoder, bundle, options, capacity=8, **kw):
    """The server's running batch of these request options, built as the server builds it."""
    spec = DECODERS[decoder]
    return spec.batch(bundle, spec.config.of(options), capacity=capacity, **kw)

_ids = itertools.count()


def job(*args, **kw):
    """A scheduler job with the ``id`` that ``drop`` takes."""
    j = _job(*args, **kw)
    j.id = next(_ids)
    return j


class Run(RecordingRun):
    """A lossy SBD or SingleBD batch plus everything it reported, and each step forward's layout."""

    def __init__(self, cls, bundle, options, **kw):
        super().__init__()
        self.batch = serving_batch(cls, bundle, options, capacity=16, on_step=self._on_step, **kw)
        self.layouts = []  # each step forward's query validity (R, q): padding where rows differ
        forward = self.batch._forward

        def recorded(inp, positions, q_valid, *args):
            self.layouts.append(q_valid.clone())
            return forward(inp, positions, q_valid, *args)

        self.batch._forward = recorded

    def mixed(self) -> bool:
        """Whether some forward laid out rows at different points (padding in some row)."""
        return any(not bool(v.all()) for v in self.layouts)

    def check_cache(self):
        b = self.batch
        if not len(b):
            assert b.kv is None if not b.static else b.kv.length == 0  # a static cache stays, its pointer at 0
            return
        assert b.key_valid.shape[0] == (b.capacity if b.static else b.R) and b.R > max(r.slot for r in b.rows)
        for row in b.rows:  # each row attends to exactly its prompt and stored (SBD: re-fed) text
            want = row.bstart - b.B * row.storing  # a block waiting to be stored is not cached yet
            assert int(b.key_valid[row.slot, : b.kv.length].sum()) == want


def assert_rows_equal_single_decodes(bundle, run, options, stop_token_ids):
    decode = DECODE[run.batch.kind.name]
    for row in run.done:
        j = row.job
        out, events = single_decode(decode, bundle, j, options, stop_token_ids)
        assert_row_equals_single(row, out, events, run.events.get(id(j), ([],))[0])
        assert row.extra == out.stats.extra["row_extra"][0]
        assert row.finish == ("length" if len(row.tokens) >= j.max_new_tokens else "stop")


PROMPTS = [[1] + list(range(3, 3 + n)) for n in (1, 4, 2, 9, 5, 3, 7, 6, 11)]
LENGTHS = [3, 30, 14, 22, 5, 30, 9, 17, 26]


def staggered(run, jobs):
    run.join(jobs[:1])
    run.step(3)
    run.join(jobs[1:4])
    run.step(2)
    run.join(jobs[4:5])
    run.step()
    run.join(jobs[5:])
    run.drain()


SBD_SETTINGS = [dict(block_size=4, gamma=0.5),
                dict(block_size=3, policy="confidence-bound", gamma=0.8),
                dict(block_size=5, policy="threshold", tau=0.2)]


@pytest.mark.parametrize("options", SBD_SETTINGS)
def test_sbd_rows_joining_at_different_steps_equal_single_prompt_decodes(options):
    bundle = sbd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    stops = (55, 29)
    jobs = [job(p, n) for p, n in zip(PROMPTS, LENGTHS)]
    run = Run(SBDBatch, bundle, options, stop_token_ids=stops)
    staggered(run, jobs)
    assert sorted(id(r.job) for r in run.done) == sorted(id(j) for j in jobs)
    assert len({r.nfe for r in run.done}) > 2
    assert_rows_equal_single_decodes(bundle, run, options, stops)
    assert run.mixed() and len(run.layouts) == run.steps
    assert run.batch.forwards == run.steps and run.batch.prefills == 4  # a join's prompts prefill together


BLOCK_SETTINGS = [dict(tau=0.6), dict(store="fused", tau=0.5), dict(policy="entropy-bound", gamma=0.4),
                  dict(steps=2, tau=0.7)]


@pytest.mark.parametrize("options", BLOCK_SETTINGS)
def test_block_rows_joining_at_different_steps_equal_single_prompt_decodes(options):
    bundle = bd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    stops = (55, 29)
    jobs = [job(p, n) for p, n in zip(PROMPTS, LENGTHS)]
    run = Run(BlockBatch, bundle, options, stop_token_ids=stops)
    staggered(run, jobs)
    assert sorted(id(r.job) for r in run.done) == sorted(id(j) for j in jobs)
    assert len({r.nfe for r in run.done}) > 2
    assert_rows_equal_single_decodes(bundle, run, options, stops)
    assert run.mixed() and len(run.layouts) == run.steps
    joins = (PROMPTS[:1], PROMPTS[1:4], PROMPTS[4:5], PROMPTS[5:])  # staggered's joins
    assert run.batch.forwards == run.steps  # a join prefills its rows' whole prompt blocks in one forward, if any
    assert run.batch.prefills == sum(any(len(p) >= 4 for p in group) for group in joins) == 3


@pytest.mark.parametrize("cls,make,options", [(SBDBatch, sbd_bundle, dict(block_size=4, gamma=0.3)),
                                              (BlockBatch, bd_bundle, dict(tau=0.5)),
                                              (BlockBatch, bd_bundle, dict(store="fused", tau=0.5))])
def test_a_row_dropped_mid_decode_leaves_the_others_unchanged(cls, make, options):
    bundle = make("llama", "eager", seed=1, initializer_range=0.4)
    jobs = [job(p, 24) for p in PROMPTS[:5]]
    run = Run(cls, bundle, options, stop_token_ids=())
    run.join(jobs[:3])
    run.step(4)
    gone = run.batch.drop([jobs[1].id])
    assert [r.job for r in gone] == [jobs[1]] and len(run.batch) == 2
    seen = len(run.events[id(jobs[1])][0])
    run.check_cache()
    run.step(2)
    run.join(jobs[3:])
    run.step()
    assert run.batch.drop([]) == [] and run.batch.drop([jobs[1].id]) == []
    run.drain()
    assert sorted(id(r.job) for r in run.done) == sorted(id(j) for j in jobs if j is not jobs[1])
    assert len(run.events[id(jobs[1])][0]) == seen > 0  # nothing after the drop
    assert_rows_equal_single_decodes(bundle, run, options, ())


@pytest.mark.parametrize("cls,make,options", [(SBDBatch, sbd_bundle, dict(block_size=4, gamma=0.3)),
                                              (BlockBatch, bd_bundle, dict(tau=0.5))])
def test_a_batch_emptied_by_drop_frees_its_cache_and_takes_new_rows(cls, make, options):
    bundle = make("qwen3", "sdpa", seed=2, initializer_range=0.4)
    run = Run(cls, bundle, options, stop_token_ids=())
    run.join([job(PROMPTS[3], 20), job(PROMPTS[4], 20)])
    run.step(3)
    assert run.batch.kv is not None and run.batch.kv.length > 0
    assert len(run.batch.drop([r.job.id for r in run.batch.rows])) == 2
    assert len(run.batch) == 0 and run.batch.kv is None and run.batch.slots.free == run.batch.capacity
    assert run.batch.step() == []
    run.join([job(PROMPTS[0], 13)])  # for SingleBD a prompt shorter than a block: nothing to prefill
    run.step(2)
    run.join([job(PROMPTS[8], 11)])
    run.drain()
    assert len(run.done) == 2 and run.batch.kv is None
    assert_rows_equal_single_decodes(bundle, run, options, ())


@pytest.mark.parametrize("cls,make,options", [(SBDBatch, sbd_bundle, dict(block_size=4, gamma=0.6)),
                                              (BlockBatch, bd_bundle, dict(tau=0.3)),
                                              (BlockBatch, bd_bundle, dict(steps=4, tau=0.6))])
def test_seeded_sampled_rows_equal_single_prompt_decodes(cls, make, options):
    bundle = make("llama", "sdpa", seed=2, initializer_range=0.4)
    samplings = [Sampling(temperature=1.0, seed=5), GREEDY, Sampling(temperature=0.7, top_k=8, seed=1),
                 Sampling(temperature=1.0, seed=5), Sampling(temperature=1.2, top_p=0.9, seed=9)]
    jobs = [job(p, 16, s) for p, s in zip(PROMPTS[2:7], samplings)]
    jobs.append(job(PROMPTS[2], 16, samplings[0]))  # the same prompt and seed: the same draws as row 0
    run = Run(cls, bundle, options, stop_token_ids=(11,))
    run.join(jobs[:2])
    run.step(2)
    run.join(jobs[2:4])
    run.step()
    run.join(jobs[4:])
    run.drain()
    assert_rows_equal_single_decodes(bundle, run, options, (11,))
    by_job = {id(r.job): r for r in run.done}
    assert by_job[id(jobs[0])].tokens == by_job[id(jobs[-1])].tokens
    greedy = DECODE[cls](bundle, [jobs[0].prompt_ids], max_new_tokens=16, **options)
    assert by_job[id(jobs[0])].tokens != greedy.tokens[0]  # really sampled


def tok(p):
    return (p * 7) % 50 + 3  # the scripted model's token at position p


def test_block_stop_tokens_stop_strings_and_lengths_end_rows_like_decode():
    bundle = scripted_bundle(lambda p: [0.99, 0.3, 0.97, 0.6][p % 4])
    stops = (tok(9),)
    jobs = [job([1, 2, 3, 4], 20),  # reaches position 9: the stop token ends it
            job([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 12),  # starts past position 9: length
            job([1, 2, 3], 12, stop=[f" {tok(5)}"]),  # a stop string, found once its block is complete
            job([1, 2], 12, stop=[f" {tok(5)}", "never"]),
            job([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 2),  # max_new_tokens short
            job([1, 2, 3], 1)]
    for options in (dict(tau=0.9), dict(tau=0.9, store="fused")):
        run = Run(BlockBatch, bundle, options, stop_token_ids=stops)
        run.join(jobs[:2])
        run.step()
        run.join(jobs[2:])
        run.drain()
        rows = {id(r.job): r for r in run.done}
        assert rows[id(jobs[0])].tokens == [tok(p) for p in range(4, 9)] and rows[id(jobs[0])].finish == "stop"
        assert rows[id(jobs[1])].finish == "length" and len(rows[id(jobs[1])].tokens) == 12
        assert rows[id(jobs[2])].finish == "stop" and rows[id(jobs[3])].finish == "stop"
        assert rows[id(jobs[4])].tokens == [tok(13), tok(14)]
        assert_rows_equal_single_decodes(bundle, run, options, stops)


def test_sbd_stop_tokens_stop_strings_and_lengths_end_rows_like_decode():
    bundle = sbd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    options = dict(block_size=4, gamma=0.5)
    probe = DECODERS["sbd"].decode(bundle, [PROMPTS[1]], max_new_tokens=16, **options).tokens[0]
    first = next(i for i in range(4, 8) if probe[i] not in probe[:i])
    stops = (probe[first],)  # a token the row first commits in its second block
    jobs = [job(PROMPTS[1], 16),
            job(PROMPTS[1], 16, Sampling(temperature=0.9, seed=3)),
            job(PROMPTS[2], 16, stop=[f" {probe[2]}"]),  # another prompt may or may not hit it
            job(PROMPTS[1], 16, stop=[f" {probe[1]} {probe[2]}"]),  # found after the first block
            job(PROMPTS[5], 1), job(PROMPTS[6], 2), job(PROMPTS[7], 7)]
    run = Run(SBDBatch, bundle, options, stop_token_ids=stops)
    run.join(jobs[:3])
    run.step()
    run.join(jobs[3:])
    run.drain()
    rows = {id(r.job): r for r in run.done}
    assert rows[id(jobs[0])].tokens == probe[:first] and rows[id(jobs[0])].finish == "stop"
    assert rows[id(jobs[3])].tokens == probe[:4] and rows[id(jobs[3])].nfe < 8
    assert [len(rows[id(j)].tokens) for j in jobs[4:6]] == [1, 2]
    assert_rows_equal_single_decodes(bundle, run, options, stops)


@pytest.fixture(scope="module")
def stories_sbd():
    return unmask.load("stories260K-sbd")


@pytest.fixture(scope="module")
def stories_bd():
    return unmask.load("stories260K-bd")


def _shipped(bundle, cls, settings):
    prompts = [bundle.tokenizer.encode(s) for s in ("Once upon a time", "The cat",
                                                   "Lily wanted to play with her ball in the park")]
    stops = tuple(bundle.stop_token_ids)
    for options in settings:
        jobs = [job(prompts[0], 40), job(prompts[1], 24, stop=["."]), job(prompts[2], 40),
                job(prompts[0], 33, Sampling(temperature=0.8, top_k=40, seed=2))]
        run = Run(cls, bundle, options)  # the bundle's stop tokens
        run.join(jobs[:1])
        run.step(3)
        run.join(jobs[1:3])
        run.step(5)
        run.join(jobs[3:])
        run.drain()
        assert len(run.done) == 4
        assert_rows_equal_single_decodes(bundle, run, options, stops)


def test_shipped_sbd_model_rows_joining_mid_decode_equal_single_prompt_decodes(stories_sbd):
    _shipped(stories_sbd, SBDBatch, [dict(verify=False), dict(block_size=4, gamma=0.1)])


def test_shipped_bd_model_rows_joining_mid_decode_equal_single_prompt_decodes(stories_bd):
    _shipped(stories_bd, BlockBatch, [dict(), dict(store="fused", tau=0.7), dict(schedule="sdar")])


def test_options_are_validated_once(stories_sbd):
    sb, bb = sbd_bundle(), bd_bundle()
    for options, msg in [(dict(block_size=0), "block size"), (dict(gamma=0.1, preset="chat-low"), "both"),
                         (dict(compile=True), "does not apply to decoder 'sbd'"),
                         (dict(store="fused"), "does not apply to decoder 'sbd'"), (dict(block_size=999), "context window")]:
        with pytest.raises(UnmaskError, match=msg):
            serving_batch(SBDBatch, sb, options)
    # options selecting lossless SBD get the verify batch (the sbd decoder's batch runs both paths)
    assert isinstance(serving_batch(SBDBatch, sb, dict(verify=True)), Verify)
    assert isinstance(serving_batch(SBDBatch, stories_sbd, {}), Verify)  # its decode_defaults select lossless SBD
    with pytest.raises(UnmaskError, match="mask token"):
        serving_batch(SBDBatch, tiny_bundle(sb.model), {})
    for options, msg in [(dict(block_size=8), "disagrees"), (dict(store="x"), "store"), (dict(slots=2), "does not apply"),
                         (dict(schedule="x"), "schedule")]:
        with pytest.raises(UnmaskError, match=msg):
            serving_batch(BlockBatch, bb, options)
    with pytest.raises(UnmaskError, match="block-diffusion"):
        serving_batch(BlockBatch, sb, {})
    b = serving_batch(SBDBatch, sb, dict(block_size=None, gamma=0.2))  # None = the default
    assert b.cfg.block_size == sbd.DEFAULT_BLOCK_SIZE and b.cfg.policy.gamma == 0.2
    assert len(b) == 0 and b.step() == [] and b.drop([0, 1]) == []
    assert serving_batch(BlockBatch, bb, {}).cfg.block_size == 4


@pytest.mark.parametrize("cls,make,options", [(SBDBatch, sbd_bundle, dict(block_size=3, gamma=0.4)),
                                              (BlockBatch, bd_bundle, dict(tau=0.8))])
def test_cache_stays_small_under_churn(cls, make, options):
    # many short rows joining and leaving every few steps: holes are compacted, leavers take their rows
    bundle = make("llama", "sdpa", seed=3, initializer_range=0.4)
    run = Run(cls, bundle, options, stop_token_ids=())
    jobs = [job(PROMPTS[i % len(PROMPTS)], 6 + (5 * i) % 17) for i in range(12)]
    for chunk in (jobs[i: i + 2] for i in range(0, 12, 2)):
        run.join(chunk)
        run.step(3)
        if len(run.batch):
            b = run.batch
            live = max(int(b.key_valid[r.slot, : b.kv.length].sum()) for r in b.rows)
            assert b.kv.length <= 2 * live + 8
    run.drain()
    assert len(run.done) == 12
    assert_rows_equal_single_decodes(bundle, run, options, ())


@pytest.mark.parametrize("cls,make,options", [(SBDBatch, sbd_bundle, SBD_SETTINGS[0]),
                                              (SBDBatch, sbd_bundle, SBD_SETTINGS[2]),
                                              (BlockBatch, bd_bundle, BLOCK_SETTINGS[0]),
                                              (BlockBatch, bd_bundle, BLOCK_SETTINGS[1]),
                                              (BlockBatch, bd_bundle, BLOCK_SETTINGS[3])])
def test_static_cache_rows_joining_mid_flight_equal_single_prompt_decodes(cls, make, options):
    # the server's --compile batch: one static KV cache of the context window that rows join and
    # leave at any step (placed into free slots, forwards over a row bucket, compacted in place)
    bundle = make("llama", "sdpa", seed=3, initializer_range=0.4)
    stops = (55, 29)
    jobs = [job(p, n) for p, n in zip(PROMPTS, LENGTHS)]
    run = Run(cls, bundle, options, stop_token_ids=stops, static=True)
    run.staggered_with_a_drop(jobs)
    assert run.batch.kv.static and run.batch.kv.length == 0  # empty: the pointer is back at 0
    assert_rows_equal_single_decodes(bundle, run, options, stops)


@pytest.mark.parametrize("cls,make,options", [(SBDBatch, sbd_bundle, dict(block_size=3, gamma=0.4)),
                                              (BlockBatch, bd_bundle, dict(tau=0.8))])
def test_a_static_cache_under_churn_is_compacted_in_place(monkeypatch, cls, make, options):
    # rows keep joining and leaving one static cache of 48 columns in length buckets of 16: its
    # pointer only grows between compactions, which move the valid keys left in place when the next
    # window would not fit or would fit a smaller bucket
    from unmask.decode.engine import static

    monkeypatch.setattr(static, "LENGTH_BUCKET", 16)
    bundle = make("llama", "sdpa", seed=3, initializer_range=0.4)
    run = Run(cls, bundle, options, stop_token_ids=(), static=True)
    assert run.batch.length == bundle.context_length + 3 * run.batch.B  # the serving batch's cache
    # 48 columns: as for a model of context window 48 - 3B, which every job below fits
    run.churn_static([job(PROMPTS[i % len(PROMPTS)], 6 + (5 * i) % 17) for i in range(24)], 48)
    assert_rows_equal_single_decodes(bundle, run, options, ())


def test_a_static_batch_refuses_a_row_past_its_cache():
    bundle = sbd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    batch = serving_batch(SBDBatch, bundle, dict(block_size=4, gamma=0.5), capacity=2, static=True)
    with pytest.raises(UnmaskError, match="do not fit the static KV cache"):
        batch.join([job([1, 3, 5], bundle.context_length)])
    assert len(batch) == 0 and batch.slots.high == 0


@pytest.mark.parametrize("static", [False, True])
def test_an_empty_sbd_prompt_is_refused_in_one_line(static):
    # found by the fault pass: a RuntimeError from the prefill's reshape; SBD's causal prefill needs a token
    bundle = sbd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    batch = serving_batch(SBDBatch, bundle, dict(block_size=4, gamma=0.5), capacity=2, static=static)
    with pytest.raises(UnmaskError, match="non-empty prompt; start it with the BOS token"):
        batch.join([job([], 8), job([1, 3], 8)])
    assert len(batch) == 0 and batch.slots.high == 0  # nothing joined
    with pytest.raises(UnmaskError, match="non-empty prompt"):
        DECODERS["sbd"].decode(bundle, [[]], max_new_tokens=8, gamma=0.5)
