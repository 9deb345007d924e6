"""Early-Bird's running batch (:class:`~unmask.decode.dllm.early_bird_batch.EarlyBird`, the server's, issues
16 and 25): whenever a row joins and whatever runs beside it, with every cache, its tokens, NFE,
row_extra and step events equal ``DECODERS["early-bird"].decode`` on its prompt alone (STYLE.md 14), with the
shipped stories260K-dlm routers."""

from __future__ import annotations

import itertools

import pytest
import torch
from batch_helpers import GREEDY, check_canvas_rows, single_decode

import unmask
from unmask.decode import DECODERS
from unmask.errors import UnmaskError
from unmask.sampling import Sampling
from unmask.decode.dllm.early_bird_batch import SPEC
from unmask.decode.engine.running import Request

_ids = itertools.count()


def job(prompt, max_new_tokens, sampling=GREEDY, stop=()) -> Request:
    return Request(prompt_ids=list(prompt), max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop),
                   id=next(_ids))

PROMPTS = [[1, 403, 407, 261, 378], [1, 60, 70], [1, 300, 310, 320, 330, 340, 350, 360], [1, 90]]
LBS_ONLY = {"lps": False}
LBS_LPS = {}  # the shipped LPS router with its saved τ_ψ


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
        self.mixed = False  # whether some forward held one row selecting and another inside its block

    def _on_step(self, row, event):
        self.events.setdefault(id(row.job), []).append(event)

    def join(self, jobs):
        self.done += self.batch.join(jobs)

    def step(self, n=1):
        for _ in range(n):
            b = self.batch
            self.mixed |= len({row.has_block for row in b.rows}) > 1
            self.done += b.step()
            if not len(b):
                assert b.slots.free == b.slots.capacity

    def drain(self):
        while len(self.batch):
            self.step()


def single(bundle, j, options, stop_token_ids=None):
    """DECODERS["early-bird"].decode on the job's prompt alone: (output, step events)."""
    stops = bundle.stop_token_ids if stop_token_ids is None else stop_token_ids
    return single_decode(DECODERS["early-bird"].decode, bundle, j, options, stops)


def check(run: Run, bundle, jobs, options, stop_token_ids=None):
    check_canvas_rows(run, bundle, jobs, options, DECODERS["early-bird"].decode, stop_token_ids)


@pytest.mark.parametrize("options", [LBS_ONLY, LBS_LPS], ids=["lbs", "lbs+lps"])
def test_staggered_joins_and_different_lengths_equal_single_runs(stories_dlm, options):
    jobs = [job(p, n) for p, n in zip(PROMPTS, [24, 12, 40, 9])]
    run = Run(stories_dlm, options)
    run.join(jobs[:1])
    run.step(2)
    run.join(jobs[1:3])
    run.step(1)
    run.join(jobs[3:])
    run.drain()
    assert run.mixed  # some forward held a selecting row beside a row inside its block
    assert run.batch.forwards < sum(row.nfe for row in run.done)
    check(run, stories_dlm, jobs, options)


@pytest.mark.parametrize("options", [LBS_ONLY, LBS_LPS], ids=["lbs", "lbs+lps"])
def test_seeded_sampling_per_row_equals_single_runs(stories_dlm, options):
    hot = Sampling(temperature=0.8, seed=7)
    warm = Sampling(temperature=1.0, top_k=20, seed=3)
    jobs = [job(PROMPTS[0], 16, hot), job(PROMPTS[1], 20, warm), job(PROMPTS[2], 12), job(PROMPTS[0], 16, hot)]
    run = Run(stories_dlm, options)
    run.join(jobs[:2])
    run.step(1)
    run.join(jobs[2:])
    run.drain()
    check(run, stories_dlm, jobs, options)


def test_a_row_dropped_mid_decode_leaves_the_others_exact(stories_dlm):
    jobs = [job(PROMPTS[2], 32), job(PROMPTS[1], 24), job(PROMPTS[0], 16)]
    run = Run(stories_dlm, LBS_LPS)
    run.join(jobs)
    run.step(2)
    gone = run.batch.drop([jobs[0].id])  # the longest prompt: its slot is free at once
    assert [row.job for row in gone] == [jobs[0]]
    assert run.batch.slots.free == run.batch.slots.capacity - 2
    run.drain()
    check(run, stories_dlm, jobs[1:], LBS_LPS)


@pytest.mark.parametrize("options", [LBS_ONLY, LBS_LPS], ids=["lbs", "lbs+lps"])
def test_stop_tokens_end_rows_as_single_runs(stories_dlm, options):
    probe = single(stories_dlm, job(PROMPTS[0], 48), options)[0].tokens[0]
    stops = (probe[5], probe[11])  # ids a single run produces, so rows stop early
    jobs = [job(PROMPTS[0], 48), job(PROMPTS[1], 40), job(PROMPTS[2], 30), job(PROMPTS[0], 48)]
    run = Run(stories_dlm, options, stop_token_ids=stops)
    run.join(jobs[:2])
    run.step(1)
    run.join(jobs[2:])
    run.drain()
    check(run, stories_dlm, jobs, options, stop_token_ids=stops)
    assert all(row.finish == "stop" for row in run.done)


@pytest.mark.parametrize("options", [LBS_ONLY, LBS_LPS], ids=["lbs", "lbs+lps"])
def test_stop_strings_end_rows_as_single_runs(stories_dlm, options):
    jobs = []
    for p in PROMPTS[:3]:  # a word each single run writes in its first block, so it stops there
        probe = single(stories_dlm, job(p, 48), options)[0].tokens[0]
        jobs.append(job(p, 48, stop=(stories_dlm.tokenizer.decode(probe[:24]).split()[3],)))
    jobs.append(job(PROMPTS[3], 40))
    run = Run(stories_dlm, options)
    run.join(jobs[:1])
    run.step(2)
    run.join(jobs[1:])
    run.drain()
    check(run, stories_dlm, jobs, options)
    assert all(len(row.tokens) < 48 for row in run.done if row.job.stop)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("options", [LBS_ONLY, LBS_LPS], ids=["lbs", "lbs+lps"])
def test_cached_rows_refresh_on_their_own_and_equal_single_runs(stories_dlm, cache, options):
    """Cached early-bird joins mid-flight (issue 25): a row's refresh is its own (its selection
    forward), so while one row refreshes another steps its window, and each equals its decode alone."""
    options = {**options, "cache": cache}
    jobs = [job(p, n) for p, n in zip(PROMPTS, [24, 12, 40, 9])]
    run = Run(stories_dlm, options)
    run.join(jobs[:1])
    run.step(2)
    run.join(jobs[1:3])
    run.step(1)
    gone = run.batch.drop([jobs[1].id])
    run.join(jobs[3:])
    run.drain()
    assert run.mixed and [row.job for row in gone] == [jobs[1]]
    check(run, stories_dlm, [jobs[0], *jobs[2:]], options)


def test_eos_early_stop_equals_single_runs(stories_dlm):
    options = {"eos_early_stop": True}
    probe = single(stories_dlm, job(PROMPTS[1], 48), options)[0].tokens[0]
    stops = (probe[7],)
    jobs = [job(p, 48) for p in PROMPTS]
    run = Run(stories_dlm, options, stop_token_ids=stops)
    run.join(jobs[:2])
    run.step(2)
    run.join(jobs[2:])
    run.drain()
    check(run, stories_dlm, jobs, options, stop_token_ids=stops)


def test_bad_options_and_jobs_are_refused(stories_dlm):
    for options, match in [({"cache": "bogus"}, "unknown cache"), ({"compile": True}, "compile"),
                           ({"tau": 2.0}, "tau"), ({"gen_length": 64}, "gen length 256")]:
        with pytest.raises(UnmaskError, match=match):
            serving(stories_dlm, options)
    batch = serving(stories_dlm, LBS_ONLY)
    for bad, match in [(job([], 8), "at least one token"), (job([1], 257), "exceeds"), (job([1], 0), ">= 1"),
                       (job([1] * 300, 8), "context window")]:
        with pytest.raises(UnmaskError, match=match):
            batch.join([job([1, 2], 8), bad])
        assert len(batch) == 0  # a bad job adds none
    assert batch.step() == [] and batch.forwards == 0


def test_an_emptied_batch_takes_new_rows(stories_dlm):
    run = Run(stories_dlm, LBS_ONLY)
    first = [job(PROMPTS[3], 6)]
    run.join(first)
    run.drain()
    second = [job(PROMPTS[2], 10), job(PROMPTS[1], 7)]
    run.join(second)
    run.drain()
    with torch.inference_mode():
        check(run, stories_dlm, first + second, LBS_ONLY)


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("use_lps", [False, True], ids=["lbs", "lbs+lps"])
def test_router_selected_blocks_on_a_tiny_model_equal_single_runs(shift, use_lps):
    # The shipped stories router always takes the min-tokens fallback on these prompts; this random
    # LBS router selects its own (non-contiguous) blocks, so rows step windows with holes.
    from test_early_bird import SMALL, dllm, lbs, lps

    bundle = dllm(shift, stops=(2, 5))
    options = {"lbs_router": lbs(seed=0), "lps": use_lps, **SMALL}
    if use_lps:
        options.update(lps_router=lps(), tau_psi=0.6)
    hot = Sampling(temperature=0.7, seed=1)
    prompts = [[1, 5, 9, 3], [1, 7], [1, 2, 3, 4, 5, 6], [1, 7]]
    jobs = [job(prompts[0], 32), job(prompts[1], 20, hot), job(prompts[2], 32), job(prompts[3], 27)]
    run = Run(bundle, options)
    run.join(jobs[:2])
    run.step(3)
    run.join(jobs[2:3])
    run.step(2)
    run.join(jobs[3:])
    run.drain()
    assert run.mixed
    check(run, bundle, jobs, options)
    paths = [e for j in jobs for e in run.events[id(j)] if "selected" in e]
    assert any(max(e["selected"]) - min(e["selected"]) + 1 > len(e["selected"]) for e in paths)  # a block with holes
