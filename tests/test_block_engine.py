"""The one running batch of SingleBD and lossy SBD (:class:`unmask.decode.blocks.batch.BlockDecoder`,
issue 25): at most one host sync per ``step()``, and its pure pieces."""

from __future__ import annotations

import pytest
import torch
from batch_helpers import job
from test_block_decode import bd_bundle
from test_sbd_decode import sbd_bundle

from unmask.decode import DECODERS
from unmask.decode.blocks import rule as block_rule
from unmask.decode.blocks.batch import BlockDecoder
from unmask.decode.blocks.single import BlockConfig, BlockOptions
from unmask.decode.engine.running import requests_for
from unmask.decode.blocks.sbd import SBDConfig, SBDOptions
from unmask.sampling import Sampling
from unmask.policies import Threshold

SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


class SyncCounter:
    """Counts the tensor-to-host reads (``Tensor.item``, ``tolist``, ``bool()``, ``int()``, ...) made
    while it is on, wherever they come from (the decoder, policies, transformers)."""

    def __init__(self, monkeypatch):
        self.on, self.count = False, 0
        for name in SYNCS:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, **kw):
                if self.on:
                    self.count += 1
                return _real(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def step(self, dec):
        self.on, self.count = True, 0
        try:
            done = dec.step()
        finally:
            self.on = False
        return done, self.count


PROMPTS = [[1, 3], [1, 3, 5, 7, 9], [1] + list(range(3, 14)), [2, 4, 6, 8]]


def sbd_batch(bundle, options, **kw):
    """The server's running batch of lossy sbd ``options`` (the registry's, as the server builds it)."""
    return DECODERS["sbd"].batch(bundle, SBDOptions.of(options), **kw)


CASES = [("block", dict(tau=0.6)), ("block", dict(tau=0.5, store="fused")), ("block", dict(steps=2, tau=0.7)),
         ("block", dict(policy="entropy-bound", gamma=0.4)), ("sbd", dict(block_size=4, gamma=0.5)),
         ("sbd", dict(block_size=3, policy="threshold", tau=0.3))]


def _bundle(decoder):
    return (bd_bundle if decoder == "block" else sbd_bundle)("llama", "sdpa", seed=3, initializer_range=0.4)


@pytest.mark.parametrize("decoder,options", CASES)
@pytest.mark.parametrize("sampled,static", [(False, False), (True, False), (False, True)])
def test_a_server_step_reads_the_host_once(monkeypatch, decoder, options, sampled, static):
    bundle = _bundle(decoder)
    spec = DECODERS[decoder]  # the server's running batch
    dec = spec.batch(bundle, spec.config.of(options), capacity=8, stop_token_ids=(55, 29), static=static)  # static: serve --compile's cache
    sampling = Sampling(temperature=0.9, seed=4) if sampled else Sampling()
    jobs = [job(p, n, sampling) for p, n in zip(PROMPTS, (14, 9, 20, 11))]
    for i, j in enumerate(jobs):
        j.id = i
    counter = SyncCounter(monkeypatch)
    dec.join(jobs[:2])
    # Sampled rows draw one by one from their own generators; the rows that draw are known from
    # the last read, so no step reads more.
    most = 1
    steps = 0
    while len(dec):
        _, syncs = counter.step(dec)
        assert syncs <= most, f"step {steps} read the host {syncs} times"
        steps += 1
        if steps == 3:
            dec.join(jobs[2:])  # mid-flight joins change nothing
    assert steps > 5 and dec.forwards == steps


@pytest.mark.parametrize("decoder,options", CASES)
def test_a_decode_step_reads_the_host_once(monkeypatch, decoder, options):
    bundle = _bundle(decoder)
    cfg = BlockOptions(**options).resolve(bundle) if decoder == "block" else SBDConfig.from_options(**options)
    for static in (False, True):
        dec = BlockDecoder(bundle, cfg, capacity=len(PROMPTS), lockstep=True, static=static, stop_token_ids=(55,))
        dec.join(requests_for(PROMPTS, max_new_tokens=13, sampling=Sampling()))
        counter = SyncCounter(monkeypatch)
        steps = 0
        while len(dec):
            _, syncs = counter.step(dec)
            assert syncs <= 1
            steps += 1
        assert steps == dec.forwards > 3


def test_advance_is_pure_and_waits_for_every_row_in_lockstep():
    # two rows, B = 2: row 0 fills its block this step, row 1 still has a mask after it
    seq = torch.tensor([[1, 9, 9, 0], [1, 9, 9, 0]])  # 9 = mask
    dpos = torch.tensor([[1, 2], [1, 2]])
    block = torch.tensor([[9, 9], [9, 9]])
    chosen = torch.tensor([[True, True], [True, False]])
    tokens = torch.tensor([[4, 5], [6, 7]])
    editable = torch.ones(2, 2, dtype=torch.bool)
    on = torch.ones(2, dtype=torch.bool)
    args = (dpos, block, chosen, tokens, editable, on, on, torch.tensor([1, 1]), torch.tensor([1, 1]),
            torch.tensor([3, 3]), torch.tensor([5]), 2)
    before = seq.clone()
    out, new_block, had, go, ended = block_rule.advance(seq, *args, lockstep=False, mask_id=9)
    assert torch.equal(seq, before)  # pure: the input is not written
    assert out.tolist() == [[1, 4, 5, 0], [1, 6, 9, 0]] and new_block.tolist() == [[4, 5], [6, 9]]
    assert had.tolist() == [True, True] and go.tolist() == [True, False] and ended.tolist() == [True, False]
    _, _, _, go, ended = block_rule.advance(seq, *args, lockstep=True, mask_id=9)
    assert go.tolist() == [False, False] and ended.tolist() == [False, False]  # row 0 waits for row 1


def test_the_quota_per_row_follows_block_quota():
    step = torch.arange(8)
    for B, steps in ((4, 4), (5, 2), (8, 3), (4, 1)):
        assert block_rule.quota(B, steps, step).tolist() == [block_rule.block_quota(B, steps, int(s)) for s in step]


def test_a_static_batch_takes_joins_that_leave_slots_free():
    # one row into a static batch of two slots, then a second mid-flight: each as on a dynamic cache
    bundle = _bundle("block")
    cfg = BlockConfig(block_size=4, policy=Threshold(0.5, strict=True))
    out = {}
    for static in (False, True):
        dec = BlockDecoder(bundle, cfg, capacity=2, static=static, length=64 if static else None)
        reqs = requests_for([[1, 2, 3, 5, 6], [1, 7, 8]], max_new_tokens=9, sampling=Sampling())
        reqs[1].id = 1
        done = dec.join(reqs[:1]) + dec.step()
        done += dec.join(reqs[1:])
        while len(dec):
            done += dec.step()
        out[static] = sorted((r.job.id, r.tokens, r.nfe) for r in done)
        assert dec.kv is None if not static else dec.kv.length == 0
    assert out[True] == out[False] and len(out[True]) == 2


@pytest.mark.parametrize("options", [dict(slots=2, tau_m2t=0.6, tau_add=0.3), dict(slots=3, tau_m2t=0.8, tau_t2t=0.5),
                                     dict(slots=1, tau_m2t=0.7, max_nfe=12)])
def test_a_multiblock_step_reads_the_host_once(monkeypatch, options):
    bundle = _bundle("block")
    spec = DECODERS["multiblock"]  # the server's running batch
    dec = spec.batch(bundle, spec.config.of(options), capacity=8, stop_token_ids=(55, 29))
    jobs = [job(p, n) for p, n in zip(PROMPTS, (14, 9, 20, 11))]
    for i, j in enumerate(jobs):
        j.id = i
    counter = SyncCounter(monkeypatch)
    dec.join(jobs[:2])
    steps = 0
    while len(dec):
        _, syncs = counter.step(dec)
        assert syncs <= 1, f"step {steps} read the host {syncs} times"
        steps += 1
        if steps == 3:
            dec.join(jobs[2:])
    assert steps > 5 and dec.forwards == steps


@pytest.mark.parametrize("static", [False, True])
def test_a_multiblock_decode_step_reads_the_host_once(monkeypatch, static):
    from unmask.decode.multiblock.batch import MultiBlockDecoder
    from unmask.decode.multiblock.window import MultiBlockOptions

    bundle = _bundle("block")
    cfg = MultiBlockOptions(slots=3, tau_m2t=0.7, tau_add=0.25, tau_semi=0.5).resolve(bundle)
    dec = MultiBlockDecoder(bundle, cfg, capacity=len(PROMPTS), lockstep=True, static=static, stop_token_ids=(55,))
    dec.join(requests_for(PROMPTS, max_new_tokens=40, sampling=Sampling()))
    counter = SyncCounter(monkeypatch)
    steps = 0
    while len(dec):
        _, syncs = counter.step(dec)
        assert syncs <= 1
        steps += 1
    assert steps == dec.forwards > 5
