"""At most one host sync per ``step()`` for every canvas and block decoder (issue 25, STYLE.md 13):
diffusion (no / prefix / dual cache), Dream's schedule, early-bird (every cache, LBS only and
with LPS), block (SingleBD), lossy sbd and multiblock, greedy and sampled, in every step
including the ones where rows finish, with no stop strings (the documented per-row read). Each runs
quiet (on_step None) and, as the server always runs them (issue 49), with ``on_step`` set at batch 8:
the step events are built on the host from the step's one read."""

from __future__ import annotations

import traceback

import pytest
import torch
from batch_helpers import job

import unmask
from unmask.decode.engine.running import requests_for
from unmask.sampling import Sampling

# Every tensor -> Python conversion: ``if t.any()`` goes through __bool__, ``range(t)`` through
# __index__, ``float(t)`` through __float__.
SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
GREEDY, SAMPLED = Sampling(), Sampling(temperature=0.9, seed=4)


class SyncCounter:
    """Counts (and remembers where) the tensor-to-host reads made while a ``step()`` runs."""

    def __init__(self, monkeypatch):
        self.on, self.where = False, []
        for name in SYNCS:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, _name=name, **kw):
                if self.on:
                    self.on = False  # a read made inside another (tolist -> __index__) counts once
                    try:
                        self.where.append(_name + " at " + "".join(traceback.format_stack(limit=4)[:-1]).strip())
                        return _real(t, *a, **kw)
                    finally:
                        self.on = True
                return _real(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def drain(self, dec, joins=()):
        """Step ``dec`` until empty (joining ``joins[i]`` before step i); asserts every step read the
        host at most once. Returns (steps, rows finished in some step)."""
        steps, done = 0, 0
        joins = list(joins)
        while len(dec) or joins:
            if joins:
                dec.join(joins.pop(0))
            self.where, self.on = [], True
            try:
                with torch.inference_mode():
                    finished = dec.step()
            finally:
                self.on = False
            assert len(self.where) <= 1, f"step {steps} read the host {len(self.where)} times:\n" + "\n".join(
                self.where)
            steps, done = steps + 1, done + len(finished)
        return steps, done


class Recorder:
    """An ``on_step(row, event)`` that keeps the events (the server's ``_event`` posts each one)."""

    def __init__(self):
        self.events = []

    def __call__(self, row, event):
        self.events.append(event)


@pytest.fixture(params=[False, True], ids=["quiet", "on_step"])
def hook(request):
    """None (quiet, the rows the test names) or a :class:`Recorder` (batch 8: the server's case)."""
    return Recorder() if request.param else None


def rows_for(hook, n: int) -> int:
    return 8 if hook is not None else n


def heard(hook) -> bool:
    """Quiet, or the recorder got events."""
    return hook is None or len(hook.events) > 0


@pytest.fixture(scope="module")
def dlm():
    return unmask.load("stories260K-dlm")


def texts(bundle, n: int = 3):
    base = ("Once upon a time", "Tom", "Lily wanted to play with her big red ball")
    return [bundle.encode(base[i % 3]) for i in range(n)]


def reqs(ps, n, sampling):
    return requests_for(ps, max_new_tokens=n, sampling=sampling, device=torch.device("cpu"))


# -- diffusion ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("cache, options", [("none", dict(policy="threshold", tau=0.7)),
                                            ("prefix", dict(policy="top-k", steps=12)),
                                            ("dual", dict(policy="entropy-bound", gamma=0.3)),
                                            ("none", dict(policy="threshold", tau=0.8, eos_early_stop=True))])
@pytest.mark.parametrize("lockstep", [True, False], ids=["decode", "server"])
def test_a_diffusion_step_reads_the_host_once(dlm, monkeypatch, sampling, cache, options, lockstep, hook):
    from unmask.decode.dllm.diffusion import DiffusionOptions
    from unmask.decode.dllm.diffusion_batch import Diffusion

    n = 8  # quiet and with on_step (the server's case): batch 8
    cfg = DiffusionOptions(block_size=8, cache=cache, sampler="llada", **options).resolve(dlm, 24)
    dec = Diffusion(dlm, cfg, capacity=n, width=64, lockstep=lockstep, stop_token_ids=(2,), on_step=hook)
    ps = texts(dlm, n)
    steps, done = SyncCounter(monkeypatch).drain(dec, [reqs(ps[:2], 24, sampling), reqs(ps[2:], 24, sampling)])
    assert steps > 3 and done == n and heard(hook)


# -- Dream's schedule -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("options", [dict(alg="origin", steps=6), dict(alg="entropy", steps=5),
                                     dict(alg="maskgit_plus", alg_temp=0.5, steps=4), dict(alg="topk_margin")])
def test_a_dream_step_reads_the_host_once(dlm, monkeypatch, sampling, options, hook):
    from unmask.decode.dllm.dream import DreamConfig, DreamSchedule

    n = 8  # quiet and with on_step (the server's case): batch 8
    dec = DreamSchedule(dlm, DreamConfig.of(**options), capacity=n, stop_token_ids=(2,), on_step=hook)
    ps = texts(dlm, n)
    first = requests_for(ps[:2], max_new_tokens=10, sampling=sampling)
    for r in first:
        r.generator = sampling.generator(torch.device("cpu"))
    later = requests_for(ps[2:], max_new_tokens=7, sampling=sampling)
    for r in later:
        r.generator, r.id = sampling.generator(torch.device("cpu")), 5
    steps, done = SyncCounter(monkeypatch).drain(dec, [first, later])
    assert steps > 3 and done == n and heard(hook)


# -- early-bird -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("lps", [False, True], ids=["lbs", "lps"])
@pytest.mark.parametrize("lockstep", [True, False], ids=["decode", "server"])
def test_an_early_bird_step_reads_the_host_once(dlm, monkeypatch, sampling, cache, lps, lockstep, hook):
    from unmask.decode.dllm.early_bird import EarlyBirdOptions
    from unmask.decode.dllm.early_bird_batch import EarlyBird

    # a low τ_ψ and τ so that LPS decides for some rows (open rows run the router)
    cfg = EarlyBirdOptions(cache=cache, lps=lps, **(dict(tau_psi=0.3, tau=0.95) if lps else {})).resolve(dlm)
    n = 8  # quiet and with on_step (the server's case): batch 8
    dec = EarlyBird(dlm, cfg, capacity=n, width=300, lockstep=lockstep, stop_token_ids=(2,),
                    on_step=hook)
    ps = texts(dlm, n)
    steps, done = SyncCounter(monkeypatch).drain(dec, [reqs(ps[:2], 40, sampling), reqs(ps[2:], 30, sampling)])
    assert steps > 3 and done == n and heard(hook)


# -- block (SingleBD), lossy sbd, multiblock ------------------------------------------------------------

PROMPTS = [[1, 3], [1, 3, 5, 7, 9], [1] + list(range(3, 14)), [2, 4, 6, 8]]


def _bundle(decoder):
    from test_block_decode import bd_bundle
    from test_sbd_decode import sbd_bundle

    return (bd_bundle if decoder == "block" else sbd_bundle)("llama", "sdpa", seed=3, initializer_range=0.4)


def _jobs(sampling, lengths=(14, 9, 20, 11), n: int = 4):
    jobs = [job(PROMPTS[i % 4], lengths[i % 4], sampling) for i in range(n)]
    for i, j in enumerate(jobs):
        j.id = i
    return jobs


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("decoder, options", [("block", dict(tau=0.6)), ("block", dict(tau=0.5, store="fused")),
                                              ("block", dict(steps=2, tau=0.7)),
                                              ("block", dict(policy="entropy-bound", gamma=0.4)),
                                              ("sbd", dict(block_size=4, gamma=0.5)),
                                              ("sbd", dict(block_size=3, policy="threshold", tau=0.3))])
def test_a_block_step_reads_the_host_once(monkeypatch, sampling, decoder, options, hook):
    from unmask.decode import DECODERS

    bundle = _bundle(decoder)
    spec = DECODERS[decoder]  # the server's running batch
    dec = spec.batch(bundle, spec.config.of(options), capacity=8, stop_token_ids=(55, 29), on_step=hook)
    n = rows_for(hook, 4)
    jobs = _jobs(sampling, n=n)
    steps, done = SyncCounter(monkeypatch).drain(dec, [jobs[:2], [], [], jobs[2:]])
    assert steps > 5 and dec.forwards == steps and done == n and heard(hook)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("options", [dict(slots=2, tau_m2t=0.6, tau_add=0.3), dict(slots=3, tau_m2t=0.8, tau_t2t=0.5)])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_multiblock_step_reads_the_host_once(monkeypatch, sampling, options, static, hook):
    from unmask.decode import DECODERS

    spec = DECODERS["multiblock"]  # the server's running batch; static: the cache serve --compile runs on
    dec = spec.batch(_bundle("block"), spec.config.of(options), capacity=8, stop_token_ids=(55, 29), static=static,
                     on_step=hook)
    n = rows_for(hook, 4)
    jobs = _jobs(sampling, n=n)
    steps, done = SyncCounter(monkeypatch).drain(dec, [jobs[:2], [], [], jobs[2:]])
    assert steps > 5 and dec.forwards == steps and done == n and heard(hook)
