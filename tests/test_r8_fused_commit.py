"""Compiled greedy lossless SBD (and AR) runs its whole step, window, forward, acceptance and commit
(``sbd_verify.whole_step``), as one compiled graph. It must give the eager step's tokens, NFE and
accept histograms, for chains and sibling trees, alone and in ragged batches; a sampled row keeps the
eager path; the server's deferred cache compiles it when idle, never mid-request."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_sbd_verify import verify_bundle

from unmask.decode.verify import steps as sbd_verify
from unmask.decode.engine import static
from unmask.decode.verify import tree as tv
from unmask.decode.verify.batch import Verify
from unmask.decode.engine.running import Request
from unmask.decode.verify.config import VerifyConfig
from unmask.errors import UnmaskError
from unmask.sampling import Sampling
from unmask.decode import DECODERS
from unmask.decode.verify import config as vconfig
from verify_helpers import lossless

_ids = itertools.count()


def _req(prompt, n, sampling=Sampling()):
    return Request(prompt_ids=list(prompt), max_new_tokens=n, sampling=sampling, id=next(_ids))


def _fused_calls(monkeypatch):
    """Count the calls of compiled whole steps (any key)."""
    calls, real = [], static.compiled_step

    def counting(model, body, key, **kw):
        compiled = real(model, body, key, **kw)
        return lambda *a: calls.append(key) or compiled(*a)

    monkeypatch.setattr(static, "compiled_step", counting)
    return calls


@pytest.mark.parametrize("draft", ["linear", "3/0,2,3/4", "3/0,2/4+1c1g3+1"])
def test_compiled_commit_equals_the_eager_commit_and_ar(monkeypatch, draft):
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    prompts = [[1, 4, 5], [1, 6, 2, 2], [1, 3]]
    kw = dict(max_new_tokens=20, draft=draft, block_size=4)
    eager = lossless(bundle, prompts, **kw, static=True)
    calls = _fused_calls(monkeypatch)
    fused = lossless(bundle, prompts, **kw, compile=True)
    assert calls, "the compiled decode never ran the whole step"
    assert fused.tokens == eager.tokens == DECODERS["ar"].decode(bundle, prompts, max_new_tokens=20).tokens
    assert fused.stats.nfe_per_row == eager.stats.nfe_per_row
    for key in ("accepts", "accepted_drafts", "query_windows"):
        assert fused.stats.extra[key] == eager.stats.extra[key], key
    assert max(fused.stats.extra["accepts"]) > 1  # multi-token accepts happened


def test_a_sampled_row_keeps_the_eager_step(monkeypatch):
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    calls = _fused_calls(monkeypatch)
    batch = Verify(bundle, VerifyConfig.of(block_size=4), compile=True, capacity=2, length=128)
    batch.join([_req([1, 4, 5], 8), _req([1, 6], 8, Sampling(temperature=1.0, seed=3))])
    while len(batch):
        batch.step()
    assert not calls


def test_deferred_cache_compiles_the_whole_step_while_no_row_runs(monkeypatch):
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=4)
    batch = Verify(bundle, VerifyConfig.of(block_size=4), compile=True, capacity=2, length=128, defer_compile=True)
    calls = _fused_calls(monkeypatch)
    prompt = [1, 5, 3, 6]
    want = DECODERS["ar"].decode(bundle, [prompt], max_new_tokens=12).tokens[0]

    def run():
        done = batch.join([_req(prompt, 12)])
        while len(batch):
            assert not batch.warm()  # never while a row runs
            done += batch.step()
        return done[0].tokens

    assert run() == want and not calls
    pending = [k for k, done in batch._steps.items() if not done]
    assert pending and not batch.kv.pending  # one graph per step shape: no forward graph to compile besides
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    while batch.warm():
        pass
    assert all(batch._steps.values()) and not batch.kv.pending
    warmed = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    calls.clear()
    assert run() == want and calls
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == warmed  # no compile mid-request


def test_greedy_commit_is_the_eager_acceptance_then_settle():
    """The pure function the graph compiles, run eagerly, against acceptance and settle called as
    the eager step calls them (suppressed ids at -inf in place first)."""
    cfg = VerifyConfig.of(block_size=4, draft="3/0,2/4+1c1g3+1")
    tw = vconfig.tables(cfg.draft, 4, cfg.smaller)
    R, Q, V = 3, vconfig.queries(4, cfg.draft), 9
    g = torch.Generator().manual_seed(0)
    logits, inp = torch.randn((R, Q, V), generator=g), torch.randint(0, 8, (R, Q), generator=g)
    K, dl = torch.tensor([4, 4, 2]), torch.tensor([3, 1, 1])
    n, N, live = torch.tensor([1, 5, 2]), torch.tensor([20, 6, 20]), torch.tensor([True, True, False])
    stops, b, suppress = torch.tensor([2]), torch.tensor([4, 5, 6]), torch.tensor([8])
    got = sbd_verify.greedy_commit(logits, inp, suppress, tw, K, dl, n, N, live, stops, b, Q)
    ref_logits = logits.clone()
    ref_logits[..., [8]] = float("-inf")
    a, p, step_tok, draft, sib = sbd_verify.greedy_step(ref_logits, inp, tw, K, dl)
    want = (draft, sib, *sbd_verify.settle(a, p, step_tok, tw, K, dl, n, N, live, stops, b, Q))
    assert len(got) == len(want) == 10  # draft, siblings and settle's eight
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_a_whole_step_after_a_sampled_run_compiled_its_forward_still_compiles_when_idle(monkeypatch):
    # the forward shape compiles while only a sampled row runs (its commit stays eager); a later greedy
    # row records its whole step, which /health counts and the next idle warm() compiles
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=4)
    batch = Verify(bundle, VerifyConfig.of(block_size=4), compile=True, capacity=2, length=128, defer_compile=True)
    calls = _fused_calls(monkeypatch)
    prompt = [1, 5, 3, 6]

    def run(sampling=Sampling()):
        done = batch.join([_req(prompt, 12, sampling)])
        while len(batch):
            done += batch.step()
        return done[0].tokens

    run(Sampling(temperature=0.8, seed=7))
    while batch.warm():
        pass
    assert not batch.kv.pending and not batch._steps
    want = DECODERS["ar"].decode(bundle, [prompt], max_new_tokens=12).tokens[0]
    assert run() == want and not calls and batch.pending_steps == 1
    seen = []
    real = static.compiled_step

    def watching(model, body, key, **kw):  # while it compiles, the step still counts as pending
        compiled = real(model, body, key, **kw)
        return lambda *a: seen.append(batch.pending_steps) or compiled(*a)

    monkeypatch.setattr(static, "compiled_step", watching)
    assert batch.warm() and seen == [1] and batch.pending_steps == 0 and not batch.warm()
    monkeypatch.setattr(static, "compiled_step", real)
    calls = _fused_calls(monkeypatch)
    assert run() == want and calls


def test_a_whole_step_that_fails_to_compile_stays_eager_and_is_not_pending(monkeypatch):
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=4)
    batch = Verify(bundle, VerifyConfig.of(block_size=4), compile=True, capacity=2, length=128, defer_compile=True)
    prompt = [1, 5, 3, 6]
    want = DECODERS["ar"].decode(bundle, [prompt], max_new_tokens=12).tokens[0]

    def run():
        done = batch.join([_req(prompt, 12)])
        while len(batch):
            done += batch.step()
        return done[0].tokens

    assert run() == want
    while batch.kv.pending:
        batch.warm()

    def broken(model, body, key, **kw):
        def fail(*a):
            raise RuntimeError("inductor failed")
        return fail

    monkeypatch.setattr(static, "compiled_step", broken)
    with pytest.raises(RuntimeError, match="inductor failed"):
        batch.warm()
    assert batch.pending_steps == 0 and not batch.warm()
    assert run() == want  # eager step


def test_a_row_whose_draft_window_does_not_fit_is_refused_before_joining():
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=4)
    ctx = bundle.context_length
    batch = Verify(bundle, VerifyConfig.of(block_size=4, draft="quadratic"), compile=True, capacity=4, length=128)
    running = batch.join([_req([1, 5, 3], 20)])
    assert not running and len(batch) == 1
    K = 10  # quadratic: K + K^2 = 110 queries; with 23 tokens of the running row: past the 128 columns
    with pytest.raises(UnmaskError, match="does not fit the static KV cache of 128; lower block_size or max_tokens"):
        batch.join([_req([1, 6], 4)], block_size=K)
    assert len(batch) == 1 and batch.slots.free == 3  # nothing joined, no slot taken
    done = []
    while len(batch):
        done += batch.step()
    assert done[0].tokens == DECODERS["ar"].decode(bundle, [[1, 5, 3]], max_new_tokens=20).tokens[0]
    eager = Verify(bundle, VerifyConfig.of(block_size=4, draft="quadratic"), capacity=2)
    big = next(k for k in range(2, 64) if k + k * k > ctx)
    with pytest.raises(UnmaskError, match=f"block size {big} with draft layout quadratic needs {big + big * big} positions "
                       f"per forward, more than the context window of {ctx}; lower block_size"):
        eager.join([_req([1, 6], 4)], block_size=big)
    assert not len(eager)


def test_on_a_cache_sized_for_the_context_window_a_row_fits_or_not_by_itself():
    # the server's batches (no explicit length): any request up to the context window joins whatever the
    # running rows' draft sizes; a draft size whose window cannot sit beside such a request is refused alone
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=4)
    ctx = bundle.context_length
    batch = Verify(bundle, VerifyConfig.of(block_size=4, draft="quadratic"), compile=True, capacity=4, defer_compile=True)
    spare = batch.kv.capacity - ctx  # columns past the context window
    fits = max(k for k in range(2, 64) if k + k * k <= spare)
    assert not batch.join([_req([1, 5, 3], 6)], block_size=fits)
    long = [1] + [3, 4, 5, 6] * ((ctx - 8) // 4)
    assert not batch.join([_req(long, ctx - len(long))])  # a whole context window beside the widest running window
    with pytest.raises(UnmaskError, match="does not fit the static KV cache"):
        batch.join([_req([1, 6], 4)], block_size=fits + 1)
    done = []
    while len(batch):
        done += batch.step()
    want = DECODERS["ar"].decode(bundle, [[1, 5, 3], long], max_new_tokens=6).tokens[0]
    assert sorted(len(r.tokens) for r in done) == [6, ctx - len(long)] and want in [r.tokens for r in done]


@pytest.mark.parametrize("draft,Kmax", [("linear", 4), ("3/0,2/4+1c1g3+1", 4), ("linear", 1)])
def test_the_whole_steps_window_is_the_eager_steps_inputs_and_mask(draft, Kmax):
    """window() builds in one graph what the eager step builds in pieces: ids from the pool, positions,
    and the mask [valid keys | the layout's window | nothing] over the length bucket, for every C."""
    cfg = VerifyConfig.of(block_size=4, draft=draft)
    tw = vconfig.tables(cfg.draft, Kmax, cfg.smaller)
    R, Q, Lb, mask_id = 3, vconfig.queries(Kmax, cfg.draft), 40, 7
    g = torch.Generator().manual_seed(1)
    K = torch.tensor([Kmax, max(Kmax - 2, 1), 1])
    dl = torch.minimum(torch.tensor([Kmax - 1, 1, 0]), K - 1)
    b, p_b = torch.randint(0, 7, (R,), generator=g), torch.tensor([5, 9, 2])
    s, sib = torch.randint(0, 7, (R, max(Kmax - 1, 0)), generator=g), torch.randint(0, 7, (R, tw.H), generator=g)
    for C in range(0, Lb - Q + 1, 3):
        key_valid = torch.rand((R, C), generator=g) < 0.7  # (R, C)
        kvb = torch.nn.functional.pad(key_valid, (0, Lb - C))
        inp, positions, mask = sbd_verify.window(tw, K, dl, b, s, sib, p_b, kvb, torch.tensor(C), mask_id)
        m = tw.mask[K - 1, dl]  # (R, Q, Q)
        want = torch.zeros((R, 1, Q, Lb), dtype=torch.bool)
        want[..., : C + Q] = torch.cat([key_valid[:, None, :].expand(R, Q, C), m], dim=2)[:, None]
        assert torch.equal(mask, want), C
        assert torch.equal(inp, tv.inputs(tw, K, dl, b, s, sib, mask_id))
        assert torch.equal(positions, p_b[:, None] + tw.offsets[K - 1, dl])
