"""The diffusion decoder's running batch (:class:`~unmask.decode.dllm.diffusion_batch.Diffusion`, the
server's, issues 16 and 25): whenever a row joins and whatever runs beside it, its tokens, NFE,
row_extra and step events equal ``DECODERS["diffusion"].decode`` on its prompt alone (STYLE.md 14)."""

from __future__ import annotations

import itertools

import pytest
import torch
from batch_helpers import GREEDY, check_canvas_rows, single_decode
from test_diffusion_decode import dllm

import unmask
from unmask.decode import DECODERS
from unmask.errors import UnmaskError
from unmask.sampling import Sampling
from unmask.decode.dllm.diffusion_batch import SPEC
from unmask.decode.engine.running import Request

_ids = itertools.count()


def job(prompt, max_new_tokens, sampling=GREEDY, stop=()) -> Request:
    return Request(prompt_ids=list(prompt), max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop),
                   id=next(_ids))


@pytest.fixture(scope="module")
def stories_dlm():
    return unmask.load("stories260K-dlm")


def serving(bundle, options, **kw):
    """The server's running batch of these options (the registry's factory with no prompts)."""
    return SPEC.batch(bundle, SPEC.config.of(options), **kw)


class Run:
    """A batch plus what it reported: finished rows and each job's step events."""

    def __init__(self, bundle, options, **kw):
        self.events: dict[int, list[dict]] = {}
        self.batch = serving(bundle, options, on_step=self._on_step, **kw)
        self.done = []
        self.mixed = False  # whether some forward held rows at different blocks
        self.mixed_refresh = False  # whether some forward refreshed one row's cache and stepped another's window

    def _on_step(self, row, event):
        self.events.setdefault(id(row.job), []).append(event)

    def join(self, jobs):
        self.done += self.batch.join(jobs)

    def step(self, n=1):
        for _ in range(n):
            if len({row.block for row in self.batch.rows}) > 1:
                self.mixed = True
            if len({row.step == 0 for row in self.batch.rows}) > 1:
                self.mixed_refresh = True
            self.done += self.batch.step()
            self.check_cache()

    def check_cache(self):
        b = self.batch
        if b.cfg.cache == "none":
            assert b.canvas.kept is None
            return
        T = b.canvas.width
        for row in b.rows:
            if row.step == 0:  # a new block: refreshed at its next forward
                continue
            w0 = T - row.cfg.gen_length + row.block * b.cfg.block_size - b.bundle.logit_shift
            window = b.cfg.block_size + b.bundle.logit_shift if b.cfg.cache == "dual" else T - w0
            width = len(row.job.prompt_ids) + row.cfg.gen_length
            assert int(b.canvas.kept_valid[row.slot].sum()) == width - window  # exactly its prefix (+ suffix) K/V

    def drain(self):
        while len(self.batch):
            self.step()


def single(bundle, j, options, stop_token_ids=None):
    """DECODERS["diffusion"].decode on the job's prompt alone: (output, step events)."""
    stops = bundle.stop_token_ids if stop_token_ids is None else stop_token_ids
    return single_decode(DECODERS["diffusion"].decode, bundle, j, options, stops)


def check(run: Run, bundle, jobs, options, stop_token_ids=None):
    check_canvas_rows(run, bundle, jobs, options, DECODERS["diffusion"].decode, stop_token_ids)


PROMPTS = [[1, 403, 407, 261, 378], [1, 60, 70], [1, 300, 310, 320, 330, 340, 350, 360], [1, 90]]

POLICIES = [
    {"policy": "top-k", "steps": 16, "gen_length": 16, "block_size": 8},  # LLaDA top-k with a step budget
    {"policy": "threshold", "tau": 0.5, "block_size": 8},
    {"policy": "factor", "factor": 1.0, "block_size": 4},
]


@pytest.mark.parametrize("options", POLICIES, ids=["topk-steps", "threshold", "factor"])
def test_staggered_joins_equal_single_runs(stories_dlm, options):
    mnt = [16, 12, 16, 9] if "gen_length" in options else [16, 12, 20, 9]
    jobs = [job(p, n) for p, n in zip(PROMPTS, mnt)]
    run = Run(stories_dlm, options)
    run.join(jobs[:1])
    run.step(2)
    run.join(jobs[1:3])
    run.step(1)
    run.join(jobs[3:])
    run.drain()
    assert run.mixed
    check(run, stories_dlm, jobs, options)


CACHES = [
    {"cache": "dual", "block_size": 4, "tau": 0.6},
    {"cache": "prefix", "policy": "top-k", "steps": 16, "gen_length": 16, "block_size": 8},
    {"cache": "dual", "refresh_every": 2, "policy": "factor", "block_size": 8},
]


@pytest.mark.parametrize("options", CACHES, ids=["dual", "prefix-topk", "dual-refresh"])
def test_caches_per_row_equal_single_runs(stories_dlm, options):
    """Fast-dLLM's approximate caches (diffusion.md §8) per row: a row refreshes at its own block
    starts while others step their windows, and ends with decode's own (cached) tokens."""
    jobs = [job(p, n) for p, n in zip(PROMPTS, [16, 12, 16, 9])]
    run = Run(stories_dlm, options)
    run.join(jobs[:1])
    run.step(2)
    run.join(jobs[1:3])
    run.step(1)
    gone = run.batch.drop([jobs[1].id])
    run.join(jobs[3:])
    run.drain()
    assert run.mixed and run.mixed_refresh and [row.job for row in gone] == [jobs[1]]
    check(run, stories_dlm, [jobs[0], *jobs[2:]], options)


def test_dropped_row_leaves_others_exact(stories_dlm):
    options = {"policy": "top-k", "steps": 32, "gen_length": 16, "block_size": 8}
    jobs = [job(p, 16) for p in PROMPTS[:3]]
    run = Run(stories_dlm, options)
    run.join(jobs[:2])
    run.step(3)
    gone = run.batch.drop([jobs[0].id])
    assert [row.job for row in gone] == [jobs[0]]
    run.join(jobs[2:])
    run.drain()
    check(run, stories_dlm, jobs[1:], options)
    assert len(run.events[id(jobs[0])]) == 3


def test_stop_token_and_stop_string():
    """A random tiny model (eager attention, shift 0) with stop ids it commits, early stop off and on,
    a stop string, with and without a cache: rows end at different blocks, each as decode ends it alone."""
    bundle = dllm(shift=0, impl="eager", seed=3, stops=(29, 51, 63))
    prompts = [[1, 9, 12, 30], [1, 40], [1, 22, 23, 24, 25, 26]]
    for options in ({"policy": "top-k", "tokens_per_step": 2, "block_size": 4},
                    {"policy": "threshold", "tau": 0.3, "block_size": 4, "eos_early_stop": True},
                    {"cache": "prefix", "tokens_per_step": 2, "block_size": 4},
                    {"cache": "dual", "tau": 0.3, "block_size": 4, "eos_early_stop": True}):
        jobs = [job(prompts[0], 24, stop=(" 30",)), job(prompts[1], 13), job(prompts[2], 20)]
        run = Run(bundle, options)
        run.join(jobs[:2])
        run.step()
        run.join(jobs[2:])
        run.drain()
        assert run.mixed
        check(run, bundle, jobs, options)
        by_job = {id(row.job): row for row in run.done}
        assert by_job[id(jobs[0])].finish == "stop"  # the stop string, after the block that holds it
        assert sum(row.finish == "stop" for row in run.done) >= 2  # and a stop id
        if options.get("eos_early_stop"):  # the canvas after the stop id filled with it
            assert any(row.finish == "stop" and row.extra["n_committed"] == 16 for row in run.done)


def test_seeded_sampling_per_row(stories_dlm):
    options = {"policy": "threshold", "tau": 0.7, "block_size": 8}
    hot, warm = Sampling(temperature=0.8, seed=3), Sampling(temperature=1.2, top_k=20, seed=5)
    jobs = [job(PROMPTS[0], 16, hot), job(PROMPTS[0], 16, hot), job(PROMPTS[1], 12, warm), job(PROMPTS[2], 16)]
    run = Run(stories_dlm, options)
    run.join(jobs[:1])
    run.step(2)
    run.join(jobs[1:])
    run.drain()
    # identical prompts joined at different times: each one's generator is the one decode gives it
    check(run, stories_dlm, jobs, options)


def test_sampling_dream_sampler_shift1(stories_dlm):
    options = {"policy": "top-k", "steps": 8, "gen_length": 8, "block_size": 4, "sampler": "dream"}
    jobs = [job(PROMPTS[2], 8, Sampling(temperature=1.0, seed=1)), job(PROMPTS[3], 6)]
    run = Run(stories_dlm, options)
    run.join(jobs[:1])
    run.step()
    run.join(jobs[1:])
    run.drain()
    check(run, stories_dlm, jobs, options)


def test_emptied_batch_frees_its_slots(stories_dlm):
    run = Run(stories_dlm, {"block_size": 4}, capacity=2)
    run.join([job(PROMPTS[0], 4), job(PROMPTS[1], 8)])
    assert run.batch.canvas.width == len(PROMPTS[1]) + 8  # the longer canvas sets the width
    run.drain()
    assert len(run.batch) == 0 and run.batch.slots.free == 2
    forwards = run.batch.forwards
    assert run.batch.step() == [] and run.batch.forwards == forwards  # an empty batch runs no forward
    late = job(PROMPTS[3], 4)
    run.join([late, job(PROMPTS[2], 4)])  # both slots are free again
    run.batch.drop([late.id])
    assert [row.slot for row in run.batch.rows] == [1] and run.batch.slots.free == 1


def test_refused_options(stories_dlm):
    for options, word in (({"cache": "bogus"}, "unknown cache"), ({"schedule": "bogus"}, "unknown schedule"),
                          ({"compile": True}, "compile"), ({"policy": "nope"}, "nope"),
                          ({"block_size": 8, "gen_length": 12}, "block size")):
        with pytest.raises(UnmaskError, match=word) as e:
            serving(stories_dlm, options)
        assert "\n" not in str(e.value)
    batch = serving(stories_dlm, {"policy": "top-k", "steps": 4, "block_size": 4})
    with pytest.raises(UnmaskError, match="multiple"):  # 12 tokens = 3 blocks; 4 steps do not divide
        batch.join([job(PROMPTS[0], 8), job(PROMPTS[1], 12)])
    assert len(batch) == 0  # a bad job adds none
    with pytest.raises(UnmaskError, match="at least one token"):
        batch.join([job([], 4)])
    with pytest.raises(UnmaskError, match="exceeds gen length"):
        serving(stories_dlm, {"gen_length": 8, "block_size": 4}).join([job(PROMPTS[0], 9)])


def test_row_positions_ignore_padding(stories_dlm):
    """Canvases are right-aligned; positions count each row's real tokens from 0."""
    batch = serving(stories_dlm, {"block_size": 4})
    batch.join([job(PROMPTS[1], 4), job(PROMPTS[2], 8)])
    T = batch.canvas.width
    assert T == len(PROMPTS[2]) + 8
    n = len(PROMPTS[1]) + 4
    assert batch.canvas.valid[0].tolist() == [False] * (T - n) + [True] * n
    assert batch.canvas.pos[0, T - n:].tolist() == list(range(n))
    assert torch.equal(batch.canvas.pos[1], torch.arange(T))


def test_a_batch_built_from_unpinned_options_takes_its_first_requests_block(stories_dlm):
    """The server may build a batch from a request's own options, not the key's (block size pinned):
    without --block-size a short request decodes with a shorter block (8 for 8 tokens), and the
    batch takes it from its first request instead of refusing it; rows equal decode alone."""
    from unmask.decode.dllm.diffusion import DiffusionOptions

    jobs = [job(PROMPTS[0], 8), job(PROMPTS[1], 8)]
    keys = {DiffusionOptions().batch_key(stories_dlm, j.max_new_tokens) for j in jobs}
    assert keys == {("diffusion", DiffusionOptions(block_size=8))}  # one batch, its block in the key
    run = Run(stories_dlm, {})
    run.join(jobs[:1])
    run.step(1)
    run.join(jobs[1:])
    run.drain()
    assert run.batch.cfg.block_size == 8
    check(run, stories_dlm, jobs, {})
    with pytest.raises(UnmaskError, match="block size 16, the running batch with 4"):  # one block per batch
        run.batch.join([job(PROMPTS[0], 4), job(PROMPTS[2], 16)])  # an emptied one takes its next first request's


def test_batch_keys_are_the_servers_running_kinds(stories_dlm):
    """Config.batch_key of diffusion and early-bird: Dream's schedule its own batch, the block size a
    request decodes with part of the key, None (per call) for what a running batch cannot take or
    a model whose rows cannot share one."""
    from types import SimpleNamespace

    from unmask.decode.dllm.diffusion import DiffusionOptions as O
    from unmask.decode.dllm.early_bird import EarlyBirdOptions

    b = stories_dlm
    assert O(schedule="dream", steps=4).batch_key(b, 8) == ("dream", O(schedule="dream", steps=4))
    assert O(block_size=4, tau=0.5).batch_key(b, 8) == ("diffusion", O(block_size=4, tau=0.5))
    assert O().batch_key(b, 40) == ("diffusion", O(block_size=32)) != O().batch_key(b, 8)
    for bad in (O(schedule="dream", cache="prefix"), O(alg="entropy"), O(reference_steps=True), O(policy="nope"),
                O(block_size=8, gen_length=12)):
        assert bad.batch_key(b, 8) is None  # decode reports it (or runs it) per call
    assert EarlyBirdOptions(lps=False).batch_key(b, 8) == ("early-bird", EarlyBirdOptions(lps=False))
    causal = SimpleNamespace(kind="causal", mask_token_id=None, model=None, meta={})
    assert O().batch_key(causal, 8) is None and EarlyBirdOptions().batch_key(causal, 8) is None
