"""Round 5, compiled serving: a step on the static cache covers only the row bucket of its slots
(1, 2, 4, ... up to the capacity), so one stream pays for one row, not for the server's
--max-batch-size; compiled == eager and batch == alone while the bucket grows and shrinks
(STYLE.md 14)."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_sbd_verify import verify_bundle

from unmask.decode.engine import static
from unmask.decode.verify.batch import Verify
from unmask.decode.engine.running import Request
from unmask.decode.verify.config import VerifyConfig
from unmask.errors import UnmaskError
from unmask.sampling import Sampling
from unmask.decode import DECODERS
from verify_helpers import lossless

_ids = itertools.count()


def _req(prompt, n, sampling=Sampling()):
    return Request(prompt_ids=list(prompt), max_new_tokens=n, sampling=sampling, id=next(_ids))


def _prompts(k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 8, (2 + 3 * i % 7,), generator=g).tolist() for i in range(k)]


def _rows_per_forward(batch):
    """Record the row count of every step forward of ``batch``'s cache (a forward alone, or inside a
    compiled whole step)."""
    seen, real, whole = [], batch.kv.forward, getattr(batch.kv, "fused", None)

    def counted(inp, *a, **kw):
        seen.append(inp.shape[0])
        return real(inp, *a, **kw)

    def counted_whole(body, key, B, *a):
        out = whole(body, key, B, *a)
        if out is not None:
            seen.append(B)
        return out

    batch.kv.forward = counted
    if whole is not None:
        batch.kv.fused = counted_whole
    return seen


def _graph_shape(key):
    """(rows, queries) of a compiled graph's key: a step forward's or a whole step's."""
    return key[3][-3:-1] if key[0] == "step" else key[0]


def _staggered(batch, plan):
    """plan: [(requests, K, steps after joining, job ids to drop after them)] -> finished rows by id."""
    done = []
    for requests, K, steps, drop in plan:
        done += batch.join(requests, block_size=K)
        for _ in range(steps):
            done += batch.step()
        batch.drop(drop)
    while len(batch):
        done += batch.step()
    return {r.job.id: r for r in done}


def _alone(bundle, r, K):
    kw = dict(max_new_tokens=r.max_new_tokens, sampling=r.sampling)
    out = DECODERS["ar"].decode(bundle, [r.prompt_ids], **kw) if K == 1 else \
        lossless(bundle, [r.prompt_ids], block_size=K, **kw)
    return out.tokens[0], out.stats.nfe_per_row[0]


def test_a_static_step_covers_the_row_bucket_of_its_slots_not_the_capacity():
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=3)
    batch = Verify(bundle, VerifyConfig.of(block_size=4), static=True, capacity=8, length=128)
    seen = _rows_per_forward(batch)
    P = _prompts(5)
    one = _req(P[0], 30)
    batch.join([one], block_size=1)
    batch.step()  # slot 0: bucket 1
    batch.join([_req(p, 30) for p in P[1:3]], block_size=2)
    batch.step()  # slots 0-2: bucket 4
    batch.join([_req(p, 30) for p in P[3:5]], block_size=1)
    batch.step()  # slots 0-4: bucket 8
    batch.drop([r.job.id for r in batch.rows.values() if r.slot >= 2])
    batch.step()  # slots 0-1: back to bucket 2
    batch.drop([r.job.id for r in batch.rows.values() if r.slot == 1])
    batch.step()  # slot 0 alone again
    assert seen == [1, 4, 8, 2, 1]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, top_k=5, seed=4)], ids=["greedy", "sampled"])
def test_rows_joining_and_leaving_across_buckets_equal_their_decoders_alone(sampling):
    # AR and lossless rows: the bucket grows 1 -> 4 -> 8 and shrinks as rows finish or are dropped;
    # a later row reuses a low slot whose stale cache columns the larger bucket left behind
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    batch = Verify(bundle, VerifyConfig.of(block_size=4), static=True, capacity=8, length=256)
    seen = _rows_per_forward(batch)
    P = _prompts(8, seed=1)
    r = [_req(p, n, sampling) for p, n in zip(P, (40, 12, 30, 9, 25, 6, 33, 20))]
    plan = [([r[0]], 1, 3, ()), (r[1:3], 4, 2, ()), (r[3:6], 1, 4, (r[4].id,)), ([r[6]], 2, 12, ()),
            ([r[7]], 1, 0, ())]
    sizes = {q.id: K for rs, K, _, _ in plan for q in rs}
    done = _staggered(batch, plan)
    assert batch.slots.free == 8 and r[4].id not in done  # dropped
    assert seen[0] == 1 and 8 in seen and min(seen[seen.index(8):]) < 8  # grew, then shrank
    for q in r[:4] + r[5:]:
        assert (done[q.id].tokens, done[q.id].nfe) == _alone(bundle, q, sizes[q.id]), sizes[q.id]


def test_compiled_rows_across_buckets_equal_eager_and_compile_once_per_bucket():
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=5)
    P = _prompts(4, seed=2)

    def run(compile):
        batch = Verify(bundle, VerifyConfig.of(block_size=4), compile=compile, static=True, capacity=4, length=128,
                       ar=True)
        seen = _rows_per_forward(batch)
        reqs = [_req(p, n) for p, n in zip(P, (24, 6, 10, 16))]
        rows = _staggered(batch, [([reqs[0]], 1, 2, ()), (reqs[1:3], 1, 3, ()), ([reqs[3]], 1, 2, ())])
        return [rows[r.id].tokens for r in reqs], [rows[r.id].nfe for r in reqs], seen

    eager = run(False)
    buckets = sorted(set(eager[2]))
    assert eager[2][0] == 1 and buckets[-1] == 4 and eager[2][-1] == 1  # grew to 4 rows and back to 1
    before = len(static._compiled.get(bundle.model, {}))
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    assert run(True) == eager
    keys = list(static._compiled[bundle.model])[before:]
    assert sorted(_graph_shape(k) for k in keys) == [(b, 1) for b in buckets]  # one graph per (rows bucket, query length)
    assert counters["stats"]["unique_graphs"] - graphs == len(buckets)  # and none recompiled per step


def test_a_static_step_attends_over_the_length_bucket_not_the_whole_cache():
    # the server's cache holds context_length columns; a short row's step reads the first 128 of them
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=3)
    batch = Verify(bundle, VerifyConfig.of(block_size=4), static=True, capacity=2, length=512)
    widths, real = [], batch.kv._step

    def step(inp, positions, mask, cache):
        widths.append((mask.shape[-1], cache.layers[0].keys.shape[2]))
        return real(inp, positions, mask, cache)

    batch.kv._step = step
    short, long = _req(_prompts(1)[0], 20), _req([3, 4, 5, 6] * 40, 30)
    done = batch.join([short], block_size=1)
    for _ in range(3):
        done += batch.step()
    assert set(widths) == {(128, 128)}
    done += batch.join([long], block_size=2)  # 160 prompt tokens: the next bucket
    while len(batch):
        done += batch.step()
    assert (256, 256) in widths and all(w <= 256 for w, _ in widths)  # a compaction may shrink it back
    for row in done:
        assert (row.tokens, row.nfe) == _alone(bundle, row.job, 1 if row.job is short else 2)


SYNCS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy")


class _HostSyncs:
    """Count the tensor -> host conversions Python code makes while active (``SYNCS`` patched)."""

    def __init__(self):
        self.count, self._real = 0, {name: getattr(torch.Tensor, name) for name in SYNCS}

    def __enter__(self):
        for name, real in self._real.items():
            def counted(t, *a, _real=real, **kw):
                self.count += 1
                return _real(t, *a, **kw)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(torch.Tensor, name, real)


def _syncs_per_step(batch) -> list[int]:
    """Step ``batch`` until it is empty; the host syncs of each step."""
    counts = []
    while len(batch):
        with _HostSyncs() as syncs:
            batch.step()
        counts.append(syncs.count)
    return counts


ROWS = {"ar": [(1, Sampling())] * 3,
        "lossless greedy": [(4, Sampling())] * 3,
        "lossless sampled": [(4, Sampling(temperature=1.0, seed=s)) for s in range(3)],
        "mixed K": [(1, Sampling()), (8, Sampling()), (2, Sampling(temperature=0.8, top_k=4, seed=1)),
                    (1, Sampling(temperature=1.0, seed=2))]}


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("rows", ROWS)
def test_every_verify_step_syncs_with_the_host_at_most_once(static, rows):
    # no on_step, no stop strings: the step's one host sync is the committed counts it hands back
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    batch = Verify(bundle, VerifyConfig.of(block_size=8), static=static, capacity=4, stop_token_ids=(2,), length=256)
    for prompt, (K, sampling), n in zip(_prompts(4, seed=7), ROWS[rows], (40, 25, 33, 12)):
        with _HostSyncs() as syncs:
            batch.join([_req(prompt, n, sampling)], block_size=K)
        assert syncs.count >= 1  # the counter sees the prefill's token read-back
    counts = _syncs_per_step(batch)
    assert len(counts) >= 5 and max(counts) <= 1, counts


def test_step_events_of_lossless_rows_add_no_host_sync():
    # the server streams lossless rows through on_step: building their events must not sync per row
    # (it did: a canvas tensor and three .tolist() per row per step made a K = 1 lossless row dearer than AR)
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    events = []
    batch = Verify(bundle, VerifyConfig.of(block_size=4), capacity=4, stop_token_ids=(2,),
                   on_step=lambda row, e: events.append(e))
    for prompt, K in zip(_prompts(4, seed=7), (1, 4, 2, 1)):
        batch.join([_req(prompt, 30)], block_size=K)
    counts = _syncs_per_step(batch)
    assert len(events) > 4 * 3 and max(counts) <= 1, counts


def test_serve_compile_builds_the_ar_lossless_batch_compiled_with_buckets_and_names_what_stays_eager(capsys):
    pytest.importorskip("fastapi", reason="the scheduler needs the serve extra: pip install -e '.[test]'")
    from conftest import run_cli

    from unmask.serve.engine import Scheduler

    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    sched = Scheduler(bundle, compile=True, max_batch_size=16)
    kv = sched.ar.kv
    assert sched.ar.compile and kv.static and kv.batch == 16 and kv.length_buckets
    assert not Scheduler(bundle, max_batch_size=16).ar.static
    code, out, _ = run_cli(capsys, "serve", "--help")
    text = " ".join(out.replace("│", " ").split())
    assert code == 0
    for eager in ("ar / lossless sbd, block, multiblock and lossy sbd running batches",
                  "diffusion with the dual cache",
                  "diffusion's other caches, early-bird and Dream's schedule stay eager", "buckets"):
        assert eager in text, eager


def test_deferred_compile_runs_a_new_shape_eagerly_then_compiles_it_while_no_row_runs():
    # the server's batches (defer_compile): a running request never waits for a compile; its new shapes
    # run eagerly on the same static cache, and warm() compiles them once the batch is empty
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=4)
    batch = Verify(bundle, VerifyConfig.of(block_size=4), compile=True, capacity=2, length=128, ar=True,
                   defer_compile=True)
    kv, calls = batch.kv, []
    real_whole, real_eager = kv.fused, kv._eager  # a greedy AR step compiles whole (window, forward, commit)
    kv.fused = lambda *a: calls.append("compiled") or real_whole(*a)
    kv._eager = lambda *a: calls.append("eager") or real_eager(*a)
    pending = lambda: [k for k, done in batch._steps.items() if done is False]  # noqa: E731
    prompt = _prompts(1, seed=3)[0]
    want = DECODERS["ar"].decode(bundle, [prompt], max_new_tokens=12).tokens[0]

    def run():
        calls.clear()
        done = batch.join([_req(prompt, 12)], block_size=1)
        while len(batch):
            assert not batch.warm()  # never while a row runs
            done += batch.step()
        return done[0].tokens

    assert run() == want and calls == ["eager"] * 11 and pending() == [(1, 1, 128, 1)] and not kv.pending
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    calls.clear()
    assert batch.warm() and not pending() and batch._steps == {(1, 1, 128, 1): True} and not batch.warm()
    assert calls == ["compiled"] and not kv.pending
    assert run() == want and calls == ["compiled"] * 11  # every step (the prefill runs on its own DynamicKV)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1  # warm()'s graph, no recompile
    kv.ptr = 3
    with pytest.raises(UnmaskError, match="no row holds it"):
        kv.warm()


def test_the_compiled_scheduler_compiles_new_shapes_only_after_an_idle_while_and_then_steps_compiled():
    pytest.importorskip("fastapi", reason="the scheduler needs the serve extra: pip install -e '.[test]'")
    import queue
    import time

    from unmask.serve import engine
    from unmask.serve.engine import Scheduler
    from unmask.serve.jobs import Job

    idle_s = engine.IDLE_COMPILE_S
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=4)
    sched = Scheduler(bundle, compile=True, max_batch_size=2).start()
    kv, prompt = sched.ar.kv, _prompts(1, seed=5)[0]
    want = DECODERS["ar"].decode(bundle, [prompt], max_new_tokens=10).tokens[0]
    compiled_steps, real = [], kv.fused  # a greedy AR step compiles whole (window, forward, commit)
    kv.fused = lambda *a: compiled_steps.append(a[2:4]) or real(*a)
    compiled = lambda: any(sched.ar._steps.values())  # noqa: E731

    def answer():
        box: queue.Queue = queue.Queue()
        sched.submit(Job(prompt_ids=prompt, decoder="ar", options={}, sampling=Sampling(), max_new_tokens=10, stop=(),
                         deadline=time.monotonic() + 120, post=lambda kind, payload: box.put((kind, payload))))
        while (event := box.get(timeout=120))[0] == "step":
            pass
        return event

    try:
        engine.IDLE_COMPILE_S = 3600.0  # a gap between requests is not idleness: nothing compiles
        first, again = answer(), answer()
        assert sched.pending_compiles and not compiled_steps and first == again
        engine.IDLE_COMPILE_S = 0.0  # idle now: its shape compiles
        deadline = time.monotonic() + 120
        while (sched.pending_compiles or not compiled()) and time.monotonic() < deadline:
            time.sleep(0.05)
        n = len(compiled_steps)  # the idle compile's own forward
        second = answer()
    finally:
        engine.IDLE_COMPILE_S = idle_s
        sched.close()
    assert first == second == ("done", {"tokens": want, "nfe": 10, "finish_reason": "length", "stop_token": 0})
    assert compiled() and not kv.pending and n == 1 and len(compiled_steps) == 1 + 9  # the second: compiled steps
    assert sched.pending_compiles == 0


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_sampled_sibling_step_syncs_with_the_host_at_most_once(static):
    # SpecInfer's multi-candidate rule walks the tree in tensors: no host sync of its own
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    batch = Verify(bundle, VerifyConfig.of(draft="3/0,1,3/4+1g3+1"), static=static, capacity=4, stop_token_ids=(2,),
                   length=256)
    for prompt, seed, n in zip(_prompts(3, seed=7), range(3), (30, 22, 12)):
        batch.join([_req(prompt, n, Sampling(temperature=1.0, seed=seed))])
    counts = _syncs_per_step(batch)
    assert len(counts) >= 4 and max(counts) <= 1, counts


def test_a_static_row_bucket_over_a_slot_freed_by_the_last_row_steps_it_as_a_dead_ar_row():
    # found by serve_load --compile at 8 streams (a 500): the last rows' slots kept K = 4, a later bucket of
    # K = 1 rows covered one of them, and the step indexed the K = 1 window tables with K = 4
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    batch = Verify(bundle, VerifyConfig.of(block_size=4), static=True, capacity=4, length=128)
    P = _prompts(4, seed=9)
    batch.join([_req(p, 20) for p in P], block_size=4)
    batch.step()
    batch.drop([r.job.id for r in batch.rows.values()])  # slots 0-3 free, the batch empty
    reqs = [_req(p, 12) for p in P[:3]]
    done = {r.job.id: r for r in _staggered(batch, [(reqs, 1, 0, ())]).values()}  # slots 0-2: bucket 4
    for q in reqs:
        assert (done[q.id].tokens, done[q.id].nfe) == _alone(bundle, q, 1)


@pytest.mark.parametrize("K", [1, 4], ids=["ar", "lossless"])
def test_a_compiled_whole_step_syncs_with_the_host_at_most_once(K):
    # the greedy compiled step is one graph (window, forward, commit): its one host read is still the commit's
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    batch = Verify(bundle, VerifyConfig.of(block_size=4), compile=True, capacity=1, stop_token_ids=(2,), length=128)
    whole, calls = batch.kv.fused, []
    batch.kv.fused = lambda *a: calls.append(a[2:4]) or whole(*a)
    prompt = _prompts(1, seed=7)[0]
    batch.join([_req(prompt, 20)], block_size=K)
    while len(batch):  # the first run compiles the graph
        batch.step()
    calls.clear()
    batch.join([_req(prompt, 20)], block_size=K)
    counts = _syncs_per_step(batch)
    assert len(calls) == len(counts) >= 5 and max(counts) <= 1, (calls, counts)  # every step whole, one read
