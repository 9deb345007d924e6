"""Issue 25, AR / lossless SBD: AR is lossless SBD with K = 1. One running batch
(``lossless.Verify``) holds AR rows and lossless SBD rows, each with its own draft size, which may
change between steps; every row equals its decoder's ``decode`` alone (STYLE.md 14), greedy and
seeded-sampled, on the dynamic and the static cache; a step syncs with the host once."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from test_sbd_verify import verify_bundle

import unmask
from unmask.decode.verify.batch import Verify
from unmask.decode.engine.running import Request
from unmask.decode.verify.config import VerifyConfig
from unmask.sampling import Sampling
from unmask.decode import DECODERS
from unmask.decode.verify import config as vconfig
from verify_helpers import lossless

GREEDY = Sampling()
SAMPLED = Sampling(temperature=0.9, top_k=20, seed=5)
TEXTS = ["Once upon a time", "The cat sat on the", "Lily and Ben went to the park", "One day",
         "Tom had a red ball and", "She"]
_ids = itertools.count()


def req(prompt, n, sampling=GREEDY, stop=()):
    return Request(prompt_ids=list(prompt), max_new_tokens=n, sampling=sampling, stop=tuple(stop), id=next(_ids))


@pytest.fixture(scope="module")
def sbd_model():
    return unmask.load("stories260K-sbd")


def run_staggered(batch, plan):
    """plan: [(requests, K or None, steps after joining)]. Returns {job id: finished row}."""
    done = []
    for requests, K, steps in plan:
        done += batch.join(requests, block_size=K)
        for _ in range(steps):
            done += batch.step()
    while len(batch):
        done += batch.step()
    return {r.job.id: r for r in done}


def alone(bundle, r, K, stops, **kw):
    """(tokens, nfe, events) of the request's decoder alone: ar for K = 1, else lossless sbd."""
    events = []
    common = dict(max_new_tokens=r.max_new_tokens, sampling=r.sampling, stop_token_ids=stops, stop_strings=r.stop)
    if K == 1:
        out = DECODERS["ar"].decode(bundle, [r.prompt_ids], **common)
    else:
        out = lossless(bundle, [r.prompt_ids], block_size=K, on_step=events.append, **common, **kw)
    return out.tokens[0], out.stats.nfe_per_row[0], events


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("draft", vconfig.DRAFTS)
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_ar_and_lossless_rows_of_different_sizes_share_one_batch_and_equal_their_decoders_alone(
        sbd_model, static, draft, sampling):
    s = {"greedy": GREEDY, "sampled": SAMPLED}[sampling]
    stops = sbd_model.stop_token_ids
    P = [sbd_model.encode(t) for t in TEXTS]
    events: dict[int, list] = {}
    batch = Verify(sbd_model, VerifyConfig.of(block_size=4, draft=draft), static=static, capacity=6,
                   on_step=lambda row, e: events.setdefault(row.job.id, []).append(e), stop_token_ids=stops)
    plan = [([req(P[0], 40, s)], 1, 2),  # an AR row alone
            ([req(P[1], 30, s), req(P[2], 48, s)], 4, 3),  # lossless rows of K = 4 join it
            ([req(P[3], 20, s, stop=("park",))], 1, 1),  # another AR row
            ([req(P[4], 36, s)], 2, 2),  # a lossless row of K = 2
            ([req(P[5], 1, s)], 1, 0)]  # finished by its prefill
    sizes = {r.id: K for rs, K, _ in plan for r in rs}
    rows = run_staggered(batch, plan)
    assert len(rows) == 6 and batch.slots.free == 6
    for rid, row in rows.items():
        K = sizes[rid]
        tokens, nfe, want = alone(sbd_model, row.job, K, stops, draft=draft)
        assert (row.tokens, row.nfe) == (tokens, nfe), (K, row.job.prompt_ids)
        if K > 1:
            assert events[rid] == want
            assert row.extra["accepts"] == row.accepts and row.extra["block_size"] == K
    assert max(c for r in rows.values() for c in r.accepts) >= 2  # lossless rows committed several at once


def test_a_rows_draft_size_changes_between_steps_and_its_greedy_text_stays_ars(sbd_model):
    # the server's load table sets K per step; greedy lossless output does not depend on K
    P = [sbd_model.encode(t) for t in TEXTS[:4]]
    stops = sbd_model.stop_token_ids
    batch = Verify(sbd_model, VerifyConfig.of(block_size=8, draft="linear"), capacity=4, stop_token_ids=stops)
    reqs = [req(p, 60) for p in P]
    done = batch.join(reqs[:2], block_size=8)
    for i, K in enumerate((8, 4, 1, 1, 2, 8, 3)):
        batch.resize(K)
        done += batch.step()
        if i == 2:
            done += batch.join(reqs[2:3], block_size=1)
    batch.resize(4, ids=[reqs[0].id])
    done += batch.join(reqs[3:], block_size=2)
    while len(batch):
        done += batch.step()
    assert len(done) == 4
    for row in done:
        assert row.tokens == DECODERS["ar"].decode(sbd_model, [row.job.prompt_ids], max_new_tokens=60,
                                       stop_token_ids=stops).tokens[0]
    assert sum(r.nfe for r in done) < sum(len(r.tokens) for r in done)  # the drafts paid


def test_sampled_rows_keep_their_draft_size(sbd_model):
    batch = Verify(sbd_model, VerifyConfig.of(block_size=4), capacity=2)
    batch.join([req(sbd_model.encode("Once"), 8, SAMPLED)])
    batch.resize(1)  # only greedy rows follow the load: a sampled row's proposals are drawn for its K
    assert [r.K for r in batch.rows.values()] == [4]


@contextmanager
def counting_host_syncs():
    """Count the tensor -> host conversions Python code makes (item, tolist, bool, int, cpu)."""
    count = [0]
    patches = []
    for name in ("item", "tolist", "__bool__", "__int__", "cpu"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **kw):
            count[0] += 1
            return _real(self, *a, **kw)

        patches.append(mock.patch.object(torch.Tensor, name, counted))
    for p in patches:
        p.start()
    try:
        yield count
    finally:
        for p in patches:
            p.stop()


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("sizes", [(1, 1, 1), (4, 4, 4), (1, 8, 2)], ids=["ar", "lossless", "mixed"])
def test_a_step_syncs_with_the_host_at_most_once(static, sizes):
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    batch = Verify(bundle, VerifyConfig.of(block_size=8), static=static, capacity=4, stop_token_ids=(2,), length=256)
    g = torch.Generator().manual_seed(0)
    for i, K in enumerate(sizes):
        prompt = torch.randint(3, 8, (3 + 2 * i,), generator=g).tolist()
        batch.join([req(prompt, 40, GREEDY if i != 1 else Sampling(temperature=1.0, seed=i))], block_size=K)
    steps = 0
    while len(batch):
        with counting_host_syncs() as syncs:
            batch.step()
        steps += 1
        assert syncs[0] <= 1, f"step {steps}: {syncs[0]} host syncs"
    assert steps >= 5
