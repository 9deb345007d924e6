"""Continuous batching for the Block Buffer on its one running batch
(:class:`unmask.decode.multiblock.batch.MultiBlockDecoder`, the server's batch), issues
16 and 25: whenever a row joins and whatever runs beside it, its tokens, NFE, per-row statistics
and step events equal ``DECODERS["multiblock"].decode`` on its prompt alone (STYLE.md 14)."""

from __future__ import annotations

import itertools

import pytest
from batch_helpers import GREEDY, RecordingRun, assert_row_equals_single, single_decode
from batch_helpers import job as _job
from test_block_decode import bd_bundle, scripted_bundle

import unmask
from unmask.decode import DECODERS
from unmask.errors import UnmaskError
from unmask.sampling import Sampling

_ids = itertools.count()


def MultiBlockBatch(bundle, options, capacity=8, **kw):
    """The server's running batch of these request options, built as the server builds it."""
    spec = DECODERS["multiblock"]
    return spec.batch(bundle, spec.config.of(options), capacity=capacity, **kw)


def job(*args, **kw):
    """A scheduler job with the ``id`` that ``drop`` takes."""
    j = _job(*args, **kw)
    j.id = next(_ids)
    return j


def tok(p):
    return (p * 7) % 50 + 3  # the scripted model's token at position p


class Run(RecordingRun):
    """A Block Buffer batch plus everything it reported."""

    def __init__(self, bundle, options, **kw):
        super().__init__()
        self.batch = MultiBlockBatch(bundle, options, capacity=16, on_step=self._on_step, **kw)

    def check_cache(self):
        """Each row attends to exactly its cached blocks: the whole prompt blocks and the blocks popped
        from its window, i.e. front·B keys; and the key mask covers the whole cache."""
        b = self.batch
        if not len(b):
            assert b.kv is None if not b.static else b.kv.length == 0  # a static cache stays, its pointer at 0
            return
        at = [r.slot for r in b.rows]
        assert b.key_valid[at, : b.kv.length].sum(dim=1).tolist() == (b.w.front[at] * b.cfg.block_size).tolist()
        assert b.w.tokens.shape[0] == b.seq.shape[0] == b.key_valid.shape[0] == b.R > max(at)


def single(bundle, j, options, stop_token_ids):
    return single_decode(DECODERS["multiblock"].decode, bundle, j, options, stop_token_ids)


def assert_rows_equal_single_decodes(bundle, run, options, stop_token_ids, replay=True):
    for row in run.done:
        out, events = single(bundle, row.job, options, stop_token_ids)
        got = run.events[id(row.job)][0]
        assert_row_equals_single(row, out, events, got)
        assert row.extra == out.stats.extra["row_extra"][0]
        capped = options.get("max_nfe") is not None and row.nfe >= options["max_nfe"]
        if not capped:  # a capped row ends "length" unless a stop ended it in the same step
            assert row.finish == ("length" if len(row.tokens) >= row.job.max_new_tokens else "stop")
        assert len(got) == row.nfe
        assert got[-1]["canvas"][: len(row.tokens)] == row.tokens
        if replay:  # the commits, applied in order, build the final canvas
            canvas = [None] * len(got[-1]["canvas"])
            for e in got:
                for p, t in zip(e["positions"], e["tokens"]):
                    assert canvas[p] is None
                    canvas[p] = t
                assert canvas == e["canvas"]


PROMPTS = [[1] + list(range(3, 3 + n)) for n in (1, 4, 2, 9, 5, 3, 7, 6, 11)]
SETTINGS = [dict(slots=1, tau_m2t=0.6),  # SingleBD with its storing bubble
            dict(),  # the defaults: N_buf 2, tau_add 0.1, tau_semi 0.9, tau_m2t 0.95
            dict(slots=3, tau_add=0.3, tau_semi=0.5, tau_m2t=0.7),
            dict(slots=2, tau_add=0.9, tau_semi=0.25, tau_m2t=0.5, max_nfe=9)]


@pytest.mark.parametrize("options", SETTINGS)
def test_rows_joining_at_different_steps_equal_single_prompt_decodes(options):
    bundle = bd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    stops = (55, 29)
    lengths = [3, 30, 14, 22, 5, 30, 9, 17, 26]
    jobs = [job(p, n) for p, n in zip(PROMPTS, lengths)]
    run = Run(bundle, options, stop_token_ids=stops)
    run.join(jobs[:1])
    run.step(3)
    run.join(jobs[1:4])
    run.step(2)
    run.join(jobs[4:5])
    run.step()
    run.join(jobs[5:])
    run.drain()
    assert sorted(id(r.job) for r in run.done) == sorted(id(j) for j in jobs)
    assert {r.finish for r in run.done} == {"stop", "length"}
    assert len({r.nfe for r in run.done}) > 2
    assert_rows_equal_single_decodes(bundle, run, options, stops)
    joins = (PROMPTS[:1], PROMPTS[1:4], PROMPTS[4:5], PROMPTS[5:])
    assert run.batch.forwards == run.steps  # a join prefills its rows' whole prompt blocks in one forward, if any
    assert run.batch.prefills == sum(any(len(p) >= 4 for p in group) for group in joins) == 3


def test_a_row_dropped_mid_decode_frees_its_slots_and_the_others_go_on_unchanged():
    bundle = bd_bundle("llama", "eager", seed=1)
    options = dict(slots=2, tau_add=0.5, tau_m2t=0.6)
    jobs = [job(p, 24) for p in PROMPTS[:5]]
    run = Run(bundle, options, stop_token_ids=())
    run.join(jobs[:3])
    run.step(4)
    gone = run.batch.drop([jobs[1].id])
    assert [r.job for r in gone] == [jobs[1]] and len(run.batch) == 2
    assert all(r.job is not jobs[1] for r in run.batch.rows)
    seen = len(run.events[id(jobs[1])][0])
    run.check_cache()
    run.step(2)
    run.join(jobs[3:])
    run.step()
    assert run.batch.drop([]) == [] and run.batch.drop([jobs[1].id]) == []
    run.drain()
    assert sorted(id(r.job) for r in run.done) == sorted(id(j) for j in jobs if j is not jobs[1])
    assert len(run.events[id(jobs[1])][0]) == seen == 4  # nothing after the drop
    assert_rows_equal_single_decodes(bundle, run, options, ())


def test_a_batch_emptied_by_drop_frees_its_cache_and_takes_new_rows():
    bundle = bd_bundle("qwen3", "sdpa", seed=2)
    options = dict(slots=3, tau_add=0.2, tau_m2t=0.5)
    run = Run(bundle, options, stop_token_ids=())
    run.join([job(PROMPTS[3], 20), job(PROMPTS[4], 20)])
    run.step(3)
    assert run.batch.kv is not None and run.batch.kv.length > 0
    assert len(run.batch.drop([r.job.id for r in run.batch.rows])) == 2
    assert len(run.batch) == 0 and run.batch.kv is None and run.batch.slots.free == run.batch.capacity
    assert run.batch.step() == []
    run.join([job(PROMPTS[0], 13)])  # a prompt shorter than a block: nothing to prefill
    run.step(2)
    run.join([job(PROMPTS[8], 11)])
    run.drain()
    assert len(run.done) == 2 and run.batch.kv is None
    assert_rows_equal_single_decodes(bundle, run, options, ())


def test_seeded_sampled_rows_equal_single_prompt_decodes():
    bundle = bd_bundle("llama", "sdpa", seed=2)
    options = dict(slots=2, tau_add=0.3, tau_m2t=0.3)
    samplings = [Sampling(temperature=1.0, seed=5), GREEDY, Sampling(temperature=0.7, top_k=8, seed=1),
                 Sampling(temperature=1.0, seed=5), Sampling(temperature=1.2, top_p=0.9, seed=9)]
    jobs = [job(p, 16, s) for p, s in zip(PROMPTS[2:7], samplings)]
    jobs.append(job(PROMPTS[2], 16, samplings[0]))  # the same prompt and seed: the same draws as row 0
    run = Run(bundle, options, stop_token_ids=(11,))
    run.join(jobs[:2])
    run.step(2)
    run.join(jobs[2:4])
    run.step()
    run.join(jobs[4:])
    run.drain()
    assert_rows_equal_single_decodes(bundle, run, options, (11,))
    by_job = {id(r.job): r for r in run.done}
    assert by_job[id(jobs[0])].tokens == by_job[id(jobs[-1])].tokens
    greedy = DECODERS["multiblock"].decode(bundle, [jobs[0].prompt_ids], max_new_tokens=16, **options)
    assert by_job[id(jobs[0])].tokens != greedy.tokens[0]  # really sampled


def test_stop_tokens_and_stop_strings_end_rows_like_decode():
    bundle = scripted_bundle(lambda p: [0.99, 0.3, 0.97, 0.6][p % 4])
    options = dict(slots=2, tau_m2t=0.9, tau_add=0.5, tau_semi=0.5)
    stops = (tok(9),)
    jobs = [job([1, 2, 3, 4], 20),  # reaches position 9: the stop token ends it
            job([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 12),  # starts past position 9, no stop token: length
            job([1, 2, 3], 12, stop=[f" {tok(5)}"]),  # a stop string, found once its block is complete
            job([1, 2], 12, stop=[f" {tok(5)}", "never"]),  # other stop strings: checked on their own
            job([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 2)]  # max_new_tokens short
    run = Run(bundle, options, stop_token_ids=stops)
    run.join(jobs[:2])
    run.step()
    run.join(jobs[2:])
    run.drain()
    rows = {id(r.job): r for r in run.done}
    assert rows[id(jobs[0])].tokens == [tok(p) for p in range(4, 9)] and rows[id(jobs[0])].finish == "stop"
    assert rows[id(jobs[1])].finish == "length" and len(rows[id(jobs[1])].tokens) == 12
    # the block holding the stop string completes; the output runs to the first mask, as decode's
    assert rows[id(jobs[2])].tokens[:5] == [tok(p) for p in range(3, 8)] and rows[id(jobs[2])].finish == "stop"
    assert rows[id(jobs[4])].tokens == [tok(13), tok(14)]
    assert_rows_equal_single_decodes(bundle, run, options, stops)


@pytest.mark.parametrize("tau_t2t", [0.0, 0.6])
def test_t2t_edits_equal_single_prompt_decodes(tau_t2t):
    bundle = bd_bundle("llama", "sdpa", seed=2)
    options = dict(slots=2, tau_m2t=0.5, tau_t2t=tau_t2t, tau_add=0.4)
    jobs = [job(p, 12) for p in PROMPTS[:4]]
    run = Run(bundle, options, stop_token_ids=())
    run.join(jobs[:1])
    run.step(2)
    run.join(jobs[1:])
    run.drain()
    assert_rows_equal_single_decodes(bundle, run, options, (), replay=False)


@pytest.fixture(scope="module")
def stories():
    return unmask.load("stories260K-mbd")


def test_shipped_model_rows_joining_mid_decode_equal_single_prompt_decodes(stories):
    prompts = [stories.tokenizer.encode(s) for s in ("Once upon a time", "The cat",
                                                     "Lily wanted to play with her ball in the park")]
    stops = tuple(stories.stop_token_ids)
    for options in ({}, dict(slots=3, tau_add=0.5, tau_m2t=0.8)):
        jobs = [job(prompts[0], 40), job(prompts[1], 24), job(prompts[2], 40),
                job(prompts[0], 33, Sampling(temperature=0.8, top_k=40, seed=2))]
        run = Run(stories, options)  # the bundle's stop tokens
        run.join(jobs[:1])
        run.step(3)
        run.join(jobs[1:3])
        run.step(5)
        run.join(jobs[3:])
        run.drain()
        assert len(run.done) == 4
        assert_rows_equal_single_decodes(stories, run, options, stops)


def test_options_are_validated_once():
    bundle = bd_bundle()
    for options, msg in [(dict(slots=0), "--slots"), (dict(tau_m2t=2), "--tau-m2t"), (dict(block_size=8), "disagrees"),
                         (dict(compile=True), "does not apply"), (dict(policy="threshold"), "does not apply")]:
        with pytest.raises(UnmaskError, match=msg):
            MultiBlockBatch(bundle, options)
    from conftest import tiny_bundle
    with pytest.raises(UnmaskError, match="block-diffusion"):
        MultiBlockBatch(tiny_bundle(bundle.model, kind="causal"), {})
    b = MultiBlockBatch(bundle, dict(slots=None, tau_add=0.2))  # None = the default
    assert (b.cfg.slots, b.cfg.tau_add, b.cfg.block_size) == (2, 0.2, 4)
    assert len(b) == 0 and b.step() == [] and b.drop([0, 1]) == []


def test_window_and_cache_stay_consistent_under_churn():
    # many short rows joining and leaving every few steps: the cache holds only live rows' keys
    bundle = bd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    options = dict(slots=2, tau_add=0.3, tau_m2t=0.8)
    run = Run(bundle, options, stop_token_ids=())
    jobs = [job(PROMPTS[i % len(PROMPTS)], 6 + (5 * i) % 17) for i in range(12)]
    for chunk in (jobs[i: i + 2] for i in range(0, 12, 2)):
        run.join(chunk)
        run.step(3)
        b = run.batch
        live = b.key_valid[[r.slot for r in b.rows], : b.kv.length].sum(dim=1)
        assert b.kv.length <= max(2 * int(live.max()), int(live.max()) + 8) + 8
    run.drain()
    assert len(run.done) == 12
    assert_rows_equal_single_decodes(bundle, run, options, ())
    assert all(r.generator is None for r in run.done)


@pytest.mark.parametrize("options", [SETTINGS[0], SETTINGS[2]])
def test_static_cache_rows_joining_mid_flight_equal_single_prompt_decodes(options):
    # the server's --compile batch: one static KV cache that rows join and leave at any step
    bundle = bd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    stops = (55, 29)
    lengths = [3, 30, 14, 22, 5, 30, 9, 17, 26]
    jobs = [job(p, n) for p, n in zip(PROMPTS, lengths)]
    run = Run(bundle, options, stop_token_ids=stops, static=True)
    run.staggered_with_a_drop(jobs)  # the first, shorter than a block: the first forward allocates every row
    assert run.batch.kv.static and run.batch.kv.length == 0 and run.batch.w is None
    assert_rows_equal_single_decodes(bundle, run, options, stops)


def test_a_static_cache_under_churn_is_compacted_in_place(monkeypatch):
    # a static cache of 64 columns in length buckets of 16: compacted when the next window would not
    # fit or would fit a smaller bucket, every row still equal to its decode alone
    from unmask.decode.engine import static

    monkeypatch.setattr(static, "LENGTH_BUCKET", 16)
    bundle = bd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    options = dict(slots=2, tau_add=0.3, tau_m2t=0.8)
    run = Run(bundle, options, stop_token_ids=(), static=True)
    assert run.batch.length == bundle.context_length + 3 * run.batch.cfg.block_size  # the serving batch's
    # 64 columns: as for a model of context window 64 - 3B, which every job below fits
    run.churn_static([job(PROMPTS[i % len(PROMPTS)], 6 + (5 * i) % 17) for i in range(24)], 64)
    assert_rows_equal_single_decodes(bundle, run, options, ())
