"""Round 4 fault pass on the one engine: a forward that fails while a request joins a running
batch (its prefill) or during a step must fail only the requests it touched (500), leave no row
holding a slot, and the server must go on answering with the texts `unmask.generate` gives."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

for _m in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_m, reason=f"the server tests need {_m}: pip install -e '.[test]'")

import unmask  # noqa: E402
from unmask.serve import create_app  # noqa: E402
from unmask.serve.server import ServerThread  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_round3_serve import post  # noqa: E402


@pytest.fixture(scope="module")
def dlm():
    return unmask.load("stories260K-dlm")


class FailOnce:
    """Wraps a model's forward: raises RuntimeError on the first call after ``arm()``."""

    def __init__(self, model):
        self.model, self.inner, self.armed = model, model.forward, False
        model.forward = self

    def arm(self):
        self.armed = True

    def __call__(self, *a, **kw):
        if self.armed:
            self.armed = False
            raise RuntimeError("injected forward failure")
        return self.inner(*a, **kw)

    def restore(self):
        self.model.forward = self.inner


def drained(sched, timeout=10.0):
    """The scheduler frees a finished row's batch in the pass that answers it: wait for that pass."""
    deadline = time.monotonic() + timeout
    while (sched.active or sched.running_batches) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sched.active == 0 and not sched.running_batches, "a row or a batch outlived its request"


@pytest.mark.parametrize("opts", [
    {"decoder": "diffusion", "gen_length": 16, "block_size": 8},
    {"decoder": "diffusion", "gen_length": 16, "block_size": 8, "cache": "dual"},
    {"decoder": "early-bird", "cache": "prefix"},
])
def test_a_failed_forward_fails_its_request_and_leaks_no_slot(dlm, opts):
    app = create_app(dlm, max_batch_size=2, max_queue=8)
    hook = FailOnce(dlm.model)
    try:
        with ServerThread(app) as s:
            sched = app.state.scheduler
            hook.arm()
            status, err = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 8, **opts})
            assert status == 500 and "\n" not in err["error"]["message"], err
            drained(sched)
            d = {k: v for k, v in opts.items() if k != "decoder"}
            want = unmask.generate("Once upon a time", dlm, opts["decoder"], max_new_tokens=8, **d).texts[0]
            status, ok = post(s.url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, **opts})
            assert status == 200 and ok["choices"][0]["text"] == want
            drained(sched)
    finally:
        hook.restore()


@pytest.mark.parametrize("opts", [{"decoder": "ar"}, {"decoder": "sbd"}, {"decoder": "sbd", "gamma": 0.35}])
def test_a_failed_forward_in_the_shared_verify_batch_leaks_no_slot(opts):
    """The AR / lossless batch outlives its rows (it is not dropped when empty): after a failed
    forward it must still hold no row and serve the next request's exact greedy text."""
    sbd = unmask.load("stories260K-sbd")
    app = create_app(sbd, max_batch_size=2, max_queue=8)
    hook = FailOnce(sbd.model)
    try:
        with ServerThread(app) as s:
            sched = app.state.scheduler
            hook.arm()
            status, err = post(s.url + "/v1/completions", {"prompt": "Zoo", "max_tokens": 8, **opts})
            assert status == 500 and "\n" not in err["error"]["message"], err
            drained(sched)
            d = {k: v for k, v in opts.items() if k != "decoder"}
            want = unmask.generate("Once upon a time", sbd, opts["decoder"], max_new_tokens=8, **d).texts[0]
            status, ok = post(s.url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, **opts})
            assert status == 200 and ok["choices"][0]["text"] == want
            drained(sched)
    finally:
        hook.restore()


class FailPrefill(FailOnce):
    """Raises on the first armed forward of more than one token (a join's prefill), never on a
    running row's one-token AR step."""

    def __call__(self, *a, **kw):
        ids = kw.get("input_ids", a[0] if a else None)
        if self.armed and ids is not None and ids.shape[-1] > 1:
            self.armed = False
            raise RuntimeError("injected prefill failure")
        return self.inner(*a, **kw)


def test_a_join_that_fails_beside_a_running_row_fails_only_itself():
    """A request whose prefill raises while another AR row streams: it gets a 500, holds no slot
    afterwards, and the running row ends with its exact greedy text (the batch is not failed)."""
    import threading

    sbd = unmask.load("stories260K-sbd")
    app = create_app(sbd, max_batch_size=4, max_queue=8)
    hook = FailPrefill(sbd.model)
    try:
        with ServerThread(app) as s:
            sched, first = app.state.scheduler, {}
            t = threading.Thread(target=lambda: first.update(r=post(s.url + "/v1/completions", {
                "prompt": "Once upon a time", "max_tokens": 200, "decoder": "ar"})))
            t.start()
            deadline = time.monotonic() + 30
            while not sched.active and time.monotonic() < deadline:
                time.sleep(0.005)
            hook.arm()
            status, err = post(s.url + "/v1/completions", {"prompt": "Zoo and a cat", "max_tokens": 8, "decoder": "ar"})
            t.join(60)
            assert status == 500 and "\n" not in err["error"]["message"], err
            want = unmask.generate("Once upon a time", sbd, "ar", max_new_tokens=200).texts[0]
            assert first["r"][0] == 200 and first["r"][1]["choices"][0]["text"] == want
            drained(sched)
    finally:
        hook.restore()


@pytest.mark.parametrize("model,decoder,target", [
    ("stories260K-bd", "block", "unmask.decode.blocks.batch:BlockDecoder._prefill"),
    ("stories260K-mbd", "multiblock", "unmask.decode.multiblock.batch:prefill_whole_blocks"),
])
def test_a_failed_prefill_gives_its_slots_back(monkeypatch, model, decoder, target):
    """A step covers slots [0, high): a join whose prefill raised must not keep its slots, or the
    next step of the rows already running would cover a slot with no cache row."""
    import importlib

    from unmask.decode import DECODERS
    from unmask.decode.engine.running import Request

    bundle = unmask.load(model)
    spec = DECODERS[decoder]  # the server's running batch
    batch = spec.batch(bundle, spec.config.of({}), capacity=4)
    assert batch.join([Request(prompt_ids=bundle.tokenizer.encode("Once upon a time"), max_new_tokens=16, id=1)]) == []
    free = batch.slots.free
    mod, attr = target.split(":")
    owner = importlib.import_module(mod)
    *path, leaf = attr.split(".")
    for p in path:
        owner = getattr(owner, p)

    def boom(*a, **kw):
        raise RuntimeError("injected prefill failure")

    monkeypatch.setattr(owner, leaf, boom)
    with pytest.raises(RuntimeError, match="injected"):
        batch.join([Request(prompt_ids=bundle.tokenizer.encode("Zoo and a cat"), max_new_tokens=8, id=2)])
    monkeypatch.undo()
    assert batch.slots.free == free and batch.slots.high == 1
    while len(batch):
        done = batch.step()
    assert [r.job.id for r in done] == [1]
