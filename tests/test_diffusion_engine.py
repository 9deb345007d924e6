"""The diffusion decoder's one running batch (issue 25, :class:`~unmask.decode.dllm.diffusion_batch.Diffusion`):
host syncs per step, slot canvases that widen, lockstep (decode) and free (server) block progress."""

from __future__ import annotations

import pytest
import torch

import unmask
from unmask.decode import DECODERS
from unmask.decode.dllm.diffusion import DiffusionOptions
from unmask.decode.dllm.diffusion_batch import SPEC, Diffusion
from unmask.decode.engine.running import Request, requests_for
from unmask.sampling import Sampling

SYNCS = ("item", "tolist", "__bool__", "__int__", "cpu")


@pytest.fixture(scope="module")
def dlm():
    return unmask.load("stories260K-dlm")


def prompts(bundle):
    return [bundle.encode(t) for t in ("Once upon a time", "Tom", "Lily wanted to play with her big red ball")]


class SyncCounter:
    """Counts calls of the Tensor methods that wait for the device while active."""

    def __init__(self, monkeypatch):
        self.count, self.on = 0, False
        for name in SYNCS:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(real))

    def _wrap(self, real):
        def counted(t, *args, **kwargs):
            self.count += self.on
            return real(t, *args, **kwargs)

        return counted


@pytest.mark.parametrize("cache, policy", [("none", "threshold"), ("prefix", "top-k"), ("dual", "factor"),
                                           ("dual", "entropy-bound")])
def test_a_step_syncs_with_the_host_once(dlm, monkeypatch, cache, policy):
    """Greedy, no on_step, no stop strings: one host sync per step (the per-row counts, flags and
    block ids), in the steps where rows finish too."""
    cfg = DiffusionOptions(block_size=8, cache=cache, policy=policy, sampler="llada").resolve(dlm, 24)
    dec = Diffusion(dlm, cfg, capacity=3, width=64)
    dec.join(requests_for(prompts(dlm), max_new_tokens=24, sampling=Sampling()))
    counter = SyncCounter(monkeypatch)
    per_step = []
    while len(dec):
        counter.count, counter.on = 0, True
        finished = dec.step()
        counter.on = False
        per_step.append((counter.count, len(finished)))
    assert len(per_step) > 3
    assert all(n == 1 for n, _ in per_step) and any(done for _, done in per_step), per_step


def test_a_widened_canvas_pads_earlier_rows(dlm):
    """A wider row joining later left-pads the running rows: their new columns are padding (invalid)."""
    cfg = DiffusionOptions(block_size=8).resolve(dlm, 8)
    dec = Diffusion(dlm, cfg, capacity=2, options=DiffusionOptions(block_size=8))
    short, wide = Request(prompt_ids=[1, 60], max_new_tokens=8, id=0), Request(prompt_ids=[1] + [70] * 9,
                                                                                max_new_tokens=8, id=1)
    dec.join([short])
    dec.step()
    dec.join([wide])
    T = dec.canvas.width
    assert T == 10 + 8
    assert dec.canvas.valid[0].tolist() == [False] * (T - 10) + [True] * 10
    assert dec.canvas.pos[0, T - 10:].tolist() == list(range(10))
    assert dec.canvas.padded == [True, False]  # the widest row has no padding: no mask needed for it alone


def test_lockstep_keeps_decode_nfe_and_free_rows_finish_sooner(dlm):
    """decode's batch advances block by block together (its NFE, as before the one engine); the
    server's rows advance each on its own. Same tokens and per-row NFE either way."""
    ps = prompts(dlm)
    cfg = DiffusionOptions(block_size=8, policy="threshold", tau=0.7, sampler="llada").resolve(dlm, 32)
    runs = {}
    for lockstep in (True, False):
        dec = Diffusion(dlm, cfg, capacity=3, width=max(map(len, ps)) + 32, lockstep=lockstep)
        done = dec.join(requests_for(ps, max_new_tokens=32, sampling=Sampling()))
        while len(dec):
            done += dec.step()
        runs[lockstep] = (dec.forwards, sorted((r.job.id, r.tokens, r.nfe) for r in done))
    alone = [DECODERS["diffusion"].decode(dlm, [p], max_new_tokens=32, block_size=8, policy="threshold", tau=0.7) for p in ps]
    assert runs[True][1] == runs[False][1] == [(i, a.tokens[0], a.stats.nfe) for i, a in enumerate(alone)]
    batch = DECODERS["diffusion"].decode(dlm, ps, max_new_tokens=32, block_size=8, policy="threshold", tau=0.7)
    assert batch.stats.nfe == runs[True][0] > runs[False][0] >= max(a.stats.nfe for a in alone)


def test_a_full_batch_refuses_in_one_line(dlm):
    cfg = DiffusionOptions(block_size=8).resolve(dlm, 8)
    dec = Diffusion(dlm, cfg, capacity=1, width=16)
    dec.join([Request(prompt_ids=[1, 5], max_new_tokens=8, id=0)])
    with pytest.raises(unmask.UnmaskError, match="running batch full") as e:
        dec.join([Request(prompt_ids=[1, 6], max_new_tokens=8, id=1)])
    assert "\n" not in str(e.value) and len(dec) == 1


# -- Dream's schedule: a running batch of its own ------------------------------------------------------


def test_dream_rows_joining_mid_flight_equal_decode_alone(dlm):
    """Dream-schedule rows join and leave a running DreamSchedule at any step; each row's tokens,
    NFE, row_extra and step events equal DECODERS["diffusion"].decode(schedule="dream") on its prompt alone."""
    opts = {"alg": "entropy", "steps": 6}
    events: dict[int, list] = {}
    dec = SPEC.batch(dlm, DiffusionOptions(schedule="dream", **opts), capacity=3,
                     on_step=lambda row, e: events.setdefault(row.job.id, []).append(e))
    hot = Sampling(temperature=0.9, seed=4)
    ps = prompts(dlm)
    reqs = [Request(prompt_ids=ps[0], max_new_tokens=12, id=0), Request(prompt_ids=ps[1], max_new_tokens=8, id=1),
            Request(prompt_ids=ps[2], max_new_tokens=12, sampling=hot, id=2),
            Request(prompt_ids=ps[1], max_new_tokens=10, id=3)]
    done = dec.join(reqs[:1])
    for _ in range(2):
        done += dec.step()
    done += dec.join(reqs[1:3])
    done += dec.step()
    assert [row.job.id for row in dec.drop([1])] == [1]
    done += dec.join(reqs[3:])  # into the slot the dropped row freed
    while len(dec):
        done += dec.step()
    assert sorted(row.job.id for row in done) == [0, 2, 3]
    for row in done:
        j = row.job
        seen = []
        alone = DECODERS["diffusion"].decode(dlm, [j.prompt_ids], max_new_tokens=j.max_new_tokens, sampling=j.sampling,
                                 stop_token_ids=dlm.stop_token_ids, schedule="dream", on_step=seen.append, **opts)
        assert row.tokens == alone.tokens[0] and row.nfe == alone.stats.nfe == alone.stats.nfe_per_row[0]
        assert row.extra == alone.stats.extra["row_extra"][0] and events[j.id] == seen


def test_dream_batch_refuses_what_decode_refuses(dlm):
    from unmask.decode.dllm.dream import DreamSchedule

    with pytest.raises(unmask.UnmaskError, match=r"do\(es\) not apply to --schedule dream"):
        SPEC.batch(dlm, DiffusionOptions(schedule="dream", block_size=4))
    dec = SPEC.batch(dlm, DiffusionOptions(schedule="dream"))
    assert isinstance(dec, DreamSchedule)
    with pytest.raises(unmask.UnmaskError, match="stop strings do not apply"):
        dec.join([Request(prompt_ids=[1, 5], max_new_tokens=4, stop=("x",), id=0)])
    assert len(dec) == 0


def test_the_server_runs_dream_requests_in_one_running_batch(dlm):
    """Dream-schedule requests no longer run per call: they share a running batch (which a request
    joins mid-flight) and every text equals unmask.generate's."""
    pytest.importorskip("fastapi")
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import post, wait_until

    from unmask.serve import create_app
    from unmask.serve.server import ServerThread

    knobs = {"schedule": "dream", "alg": "maskgit_plus", "steps": 8}
    cases = [("Once upon a time", 16), ("Tom had a red ball", 8), ("The sun", 12)]
    refs = [unmask.generate(p, dlm, "diffusion", max_new_tokens=n, **knobs).texts[0] for p, n in cases]
    app = create_app(dlm, max_batch_size=4)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        sched.pause()
        with ThreadPoolExecutor(len(cases)) as pool:
            futures = [pool.submit(post, s.url + "/v1/completions",
                                   {"prompt": p, "max_tokens": n, "decoder": "diffusion", **knobs}) for p, n in cases]
            wait_until(lambda: sched.queue_depth == len(cases))
            sched.resume()
            texts = [f.result()[2]["choices"][0]["text"] for f in futures]
        assert texts == refs and sched.peak_running == len(cases)
        wait_until(lambda: sched.active == 0 and not sched.running_batches)


# -- early-bird: the same canvas machinery ---------------------------------------------------------------


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_an_early_bird_step_syncs_with_the_host_once(dlm, monkeypatch, cache):
    """LBS only, greedy, no on_step, no stop strings: one host sync per step, in the steps where rows
    finish too (tests/test_r5_host_syncs.py adds LPS and sampling)."""
    from unmask.decode.dllm.early_bird import EarlyBirdOptions
    from unmask.decode.dllm.early_bird_batch import EarlyBird

    dec = EarlyBird(dlm, EarlyBirdOptions(cache=cache, lps=False).resolve(dlm), capacity=2, width=300)
    dec.join(requests_for(prompts(dlm)[:2], max_new_tokens=32, sampling=Sampling()))
    counter = SyncCounter(monkeypatch)
    per_step = []
    with torch.inference_mode():
        while len(dec):
            counter.count, counter.on = 0, True
            finished = dec.step()
            counter.on = False
            per_step.append((counter.count, len(finished)))
    assert len(per_step) > 3
    assert all(n == 1 for n, _ in per_step) and any(done for _, done in per_step), per_step


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_cached_early_bird_batch_equals_its_rows_alone(cache):
    """Every row refreshes its own cache (issue 25): decode of a batch with a cache equals each
    prompt decoded alone (it did not while one refresh, one window, served every row). A random
    LBS router on a tiny model selects different blocks per row, so the windows differ."""
    from test_early_bird import SMALL, dllm, lbs

    from unmask.decode import DECODERS

    bundle = dllm(1)
    ps = [[1, 5, 9, 3], [1, 7], [1, 2, 3, 4, 5, 6]]
    kw = dict(max_new_tokens=32, cache=cache, lps=False, **SMALL)
    with torch.inference_mode():
        batch = DECODERS["early-bird"].decode(bundle, ps, lbs_router=lbs(seed=0), **kw)
        for i, p in enumerate(ps):
            alone = DECODERS["early-bird"].decode(bundle, [p], lbs_router=lbs(seed=0), **kw)
            assert batch.tokens[i] == alone.tokens[0] and batch.stats.nfe_per_row[i] == alone.stats.nfe
