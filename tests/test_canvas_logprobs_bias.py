"""``logit_bias`` on the canvas and block decoders (issue 50; structured.md §1): a row's bias is in the
distribution every one of its tokens is committed from, a row without one decodes exactly as before;
and a server batch with mixed asks (logprobs, biases, neither) reports each row as alone and still
reads the host once per step (tests/test_r5_host_syncs.py)."""

from __future__ import annotations

import pytest
import torch
from test_canvas_logprobs import CASES, bundles, case  # noqa: F401  (bundles: the fixture)
from test_r5_host_syncs import SyncCounter

from unmask.decode.engine.running import drain, requests_for
from unmask.sampling import Sampling


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


def unused_token(bundle, tokens) -> int:
    """A token id the row did not produce, neither a stop, the mask nor a suppressed id."""
    banned = set(tokens) | set(bundle.stop_token_ids or ()) | set(bundle.suppress_ids) | {bundle.mask_token_id}
    return next(t for t in range(5, 60) if t not in banned)


def asks(bundle, base):
    """Per-row asks of three rows decoded as ``base``: row 0 logprobs only, row 1 a -100 bias on its
    first token, row 2 a +100 bias on a token it never produced (and logprobs)."""
    ban, boost = base.tokens[1][0], unused_token(bundle, base.tokens[2])
    return [dict(logprobs=2), dict(logit_bias={ban: -100.0}), dict(logit_bias={boost: 100.0}, logprobs=1)], ban, boost


@pytest.mark.parametrize("name", list(CASES))
def test_a_rows_bias_steers_only_that_row(bundles, name):
    spec, bundle, prompts, options = case(name, bundles)
    base = spec.decode(bundle, prompts, max_new_tokens=12, **options)
    with_lp = spec.decode(bundle, prompts, max_new_tokens=12, logprobs=2, **options)
    per_row, ban, boost = asks(bundle, base)
    reqs = requests_for(prompts, max_new_tokens=12, sampling=Sampling())
    for r, a in zip(reqs, per_row):
        for k, v in a.items():
            setattr(r, k, v)
    cfg = spec.config.of(options, spec.name)
    out = drain(lambda capacity: spec.batch(bundle, cfg, capacity=capacity, prompts=prompts, max_new_tokens=12),
                reqs)
    assert out.tokens[0] == base.tokens[0]  # no bias: as before, whatever its neighbours' biases
    assert ban in base.tokens[1] and ban not in out.tokens[1]
    assert boost not in base.tokens[2] and boost in out.tokens[2]
    assert out.logprobs[1] == []  # asked none
    for a, b in zip(out.logprobs[0], with_lp.logprobs[0]):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    boosted = [e for e in out.logprobs[2] if e.token == boost]
    assert boosted and [e.token for e in out.logprobs[2]] == out.tokens[2]
    # the reported logprob is the model's own, before the bias: a +100 biased token would read ≈ 0
    assert all(e.logprob < -0.05 for e in boosted)


def server_rows(spec, bundle, cfg, batches, monkeypatch):
    """Run a server batch (rows join in waves) to the end, every step reading the host at most once.
    Returns {request id: finished row}."""
    dec = spec.batch(bundle, cfg, capacity=8)
    counter, done, waves = SyncCounter(monkeypatch), {}, list(batches)
    while len(dec) or waves:
        if waves:
            dec.join(waves.pop(0))
        counter.where, counter.on = [], True
        try:
            finished = dec.step()
        finally:
            counter.on = False
        assert len(counter.where) <= 1, "\n".join(counter.where)
        done.update({row.job.id: row for row in finished})
    return done


@pytest.mark.parametrize("name", list(CASES))
def test_a_server_batch_with_mixed_asks_reads_once_and_reports_each_row_as_alone(bundles, name, monkeypatch):
    spec, bundle, prompts, options = case(name, bundles)
    base = spec.decode(bundle, prompts, max_new_tokens=12, **options)
    per_row, _, _ = asks(bundle, base)
    rows = [*zip(prompts, per_row), (prompts[0], {})]
    reqs = []
    for i, (p, a) in enumerate(rows):
        (r,) = requests_for([p], max_new_tokens=12, sampling=Sampling(), **a)
        r.id = i
        reqs.append(r)
    done = server_rows(spec, bundle, spec.config.of(options, spec.name), [reqs[:2], [], reqs[2:]], monkeypatch)
    assert sorted(done) == [0, 1, 2, 3]
    for i, (p, a) in enumerate(rows):
        alone = spec.decode(bundle, [p], max_new_tokens=12, stop_token_ids=bundle.stop_token_ids, **a, **options)
        row = done[i]
        assert row.tokens == alone.tokens[0]
        if a.get("logprobs") is None:
            assert row.logprobs is None
            continue
        assert [e.token for e in row.logprobs] == row.tokens
        for x, y in zip(row.logprobs, alone.logprobs[0]):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.parametrize("name", ["diffusion", "early-bird", "block", "multiblock"])
def test_the_bias_rows_are_built_once_while_the_rows_stay(bundles, name, monkeypatch):
    import unmask.decode.engine.shaping as cs  # SlotBias builds the rows there

    spec, bundle, prompts, options = case(name, bundles)
    built, real = [], cs.bias_rows
    monkeypatch.setattr(cs, "bias_rows", lambda *a, **kw: built.append(1) or real(*a, **kw))
    out = spec.decode(bundle, prompts[:1], max_new_tokens=12, logit_bias={7: 0.5}, **options)
    assert out.stats.nfe > 1 and len(built) == 1
