"""``serve --compile`` for diffusion (issue 25): a running batch with the dual cache runs on a static
cache of the context window plus one window, widening in place as wider canvases join, each window step through
the (deferred) compiled forward of its (row bucket, query length, length bucket) shape, and a step
where some rows refresh split in two forwards (eager batches too). Whenever a row joins, its tokens, NFE, row_extra and
step events equal ``decode`` on its prompt alone, as the eager batch's do (STYLE.md 14)."""

from __future__ import annotations

import queue
import time

import pytest
from test_diffusion_batch import CACHES, PROMPTS, Run, check, job, serving

import unmask
from unmask.decode import DECODERS
from unmask.sampling import Sampling


@pytest.fixture(scope="module")
def stories_dlm():
    return unmask.load("stories260K-dlm")


def _staggered(run, jobs, drop=True):
    """Join one job, step twice, join two wider or narrower ones, step, drop the second, join the last, drain."""
    run.join(jobs[:1])
    run.step(2)
    width = run.batch.canvas.width
    run.join(jobs[1:3])  # PROMPTS[2] is the widest canvas: the kept K/V move right in place
    assert run.batch.canvas.width > width
    run.step(1)
    gone = run.batch.drop([jobs[1].id]) if drop else []
    run.join(jobs[3:])
    run.drain()
    return gone


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("options", [CACHES[0], CACHES[2]], ids=["dual", "dual-refresh"])
def test_serving_dual_cache_batch_splits_refreshes_and_equals_single_runs(stories_dlm, options, compile):
    jobs = [job(p, n) for p, n in zip(PROMPTS, [16, 12, 16, 9])]
    run = Run(stories_dlm, options, compile=compile)
    static = run.batch.canvas.length == stories_dlm.context_length
    assert run.batch.static == static == compile
    if compile:  # the context window plus one window (a refresh never runs on it), rounded to 128 columns
        assert run.batch.kv.static and run.batch.kv.capacity == 640 and stories_dlm.context_length == 512
    splits, real = [], run.batch.canvas._split
    run.batch.canvas._split = lambda n, w0, w1, refresh, others: splits.append(others) or real(n, w0, w1, refresh,
                                                                                          others)
    gone = _staggered(run, jobs)
    assert run.mixed and run.mixed_refresh and [row.job for row in gone] == [jobs[1]]
    assert any(splits)  # steps where one row refreshed beside others stepping their windows ran split
    check(run, stories_dlm, [jobs[0], *jobs[2:]], options)
    if compile:  # the window shapes ran eagerly, to compile when the server is idle
        assert run.batch.kv.pending and not run.batch.kv.compiled


def test_compiled_window_steps_equal_single_runs_and_an_emptied_batch_starts_narrow(stories_dlm):
    options = CACHES[0]
    run = Run(stories_dlm, options, compile=True)
    run.join([job(p, n) for p, n in zip(PROMPTS, [16, 12, 16, 9])])
    run.drain()
    shapes = set(run.batch.kv.pending)
    while run.batch.warm():  # what the idle server does: compile each pending shape
        pass
    assert run.batch.kv.compiled == shapes and not run.batch.kv.pending
    calls, real = [], run.batch.kv._step
    run.batch.kv._step = lambda *a: calls.append(a[0].shape) or real(*a)
    narrow = job(PROMPTS[3], 9)
    run.join([narrow])  # the emptied batch restarted at width 1: this canvas sets it
    assert run.batch.canvas.width == len(PROMPTS[3]) + 12
    run.batch.drop([narrow.id])
    run.done, jobs = [], [job(p, n) for p, n in zip(PROMPTS, [16, 12, 16, 9])]
    run.join(jobs)
    run.drain()
    check(run, stories_dlm, jobs, options)
    assert calls and not run.batch.kv.pending  # every window step ran compiled: no new shape


def test_what_stays_eager(stories_dlm):
    """Measured slower compiled under load (benchmarks/results/serve_compile_canvas.md): the prefix cache,
    no cache and early-bird keep their eager running batches under serve --compile."""
    pytest.importorskip("fastapi", reason="the scheduler needs the serve extra: pip install -e '.[test]'")
    from unmask.decode import DECODERS

    for options in ({"block_size": 4}, {"cache": "prefix", "block_size": 4}):
        assert not Run(stories_dlm, options, compile=True).batch.static
    assert DECODERS["diffusion"].compiles and not DECODERS["early-bird"].compiles


def test_the_compiled_server_runs_cached_diffusion_on_the_static_cache(stories_dlm):
    pytest.importorskip("fastapi", reason="the scheduler needs the serve extra: pip install -e '.[test]'")
    from unmask.serve.engine import Scheduler
    from unmask.serve.jobs import Job

    options = {"cache": "dual", "block_size": 4}
    want = DECODERS["diffusion"].decode(stories_dlm, [PROMPTS[0]], max_new_tokens=8, **options)
    sched = Scheduler(stories_dlm, compile=True, max_batch_size=2).start()
    try:
        box: queue.Queue = queue.Queue()
        sched.submit(Job(prompt_ids=PROMPTS[0], decoder="diffusion", options=options, sampling=Sampling(),
                         max_new_tokens=8, stop=(), deadline=time.monotonic() + 120,
                         post=lambda kind, payload: box.put((kind, payload))))
        while (event := box.get(timeout=120))[0] == "step":
            pass
        (batch,) = sched.running_batches.values()
        assert batch.static and batch.kv.pending and sched.pending_compiles == len(batch.kv.pending)
    finally:
        sched.close()
    assert event == ("done", {"tokens": want.tokens[0], "nfe": want.stats.nfe, "finish_reason": "length",
                              "stop_token": 0})


def test_a_negative_block_size_is_named_as_such(stories_dlm):
    # the fault pass: the server's batch validated it as a nominal gen length ("gen length must be ...")
    from unmask.errors import UnmaskError

    for options in ({"block_size": -4}, {"block_size": -4, "cache": "dual"}):
        with pytest.raises(UnmaskError, match="block size must be an integer >= 1"):
            serving(stories_dlm, options, compile=True)


def test_serve_cache_dual_makes_every_diffusion_request_compiled(stories_dlm):
    """``unmask serve --cache dual``: the server's default cache, so a plain diffusion request joins the
    compiled dual-cache batch; a model whose decoder takes no cache refuses it at start, in one line."""
    pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install -e '.[test]'")
    import openai

    from unmask.errors import UnmaskError
    from unmask.serve import create_app
    from unmask.serve.server import ServerThread

    app = create_app(stories_dlm, defaults={"cache": "dual"}, compile=True, max_batch_size=2)
    with ServerThread(app) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.completions.create(model="stories260K-dlm", prompt="Once upon a time", max_tokens=8)
    want = unmask.generate("Once upon a time", stories_dlm, "diffusion", max_new_tokens=8, cache="dual")
    assert r.choices[0].text == want.texts[0] and r.usage.model_extra["nfe"] == want.stats.nfe
    (batch,) = app.state.scheduler.running_batches.values()
    assert batch.static and batch.cfg.cache == "dual"
    with pytest.raises(UnmaskError, match="cache does not apply to decoder 'sbd'"):
        create_app(unmask.load("stories260K-sbd"), defaults={"cache": "dual"})
