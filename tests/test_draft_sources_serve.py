"""The server's model-free draft sources (issue 51 item 4): a request's ``draft_source`` joins the
host-layout verify batch beside AR rows; staggered joins and drops leave every row equal to
``generate`` alone; the suffix cache is per scheduler (per model), bounded, and fed by finished rows;
/metrics counts drafted and accepted tokens per source."""

from __future__ import annotations

import queue
import time

import pytest

import unmask
from unmask.decode import DECODERS
from unmask.errors import UnmaskError
from unmask.sampling import Sampling
from unmask.serve.engine import Scheduler
from unmask.serve.jobs import Job
from unmask.serve.metrics import Metrics

TEXTS = ("Once upon a time", "Tom had a red ball. Tom had a red ball. Tom", "Lily and Sam went to the park",
         "The cat sat on the mat. The cat")


def _job(prompt, box, decoder="ar", **options):
    return Job(prompt_ids=prompt, decoder=decoder, options=options, sampling=Sampling(), max_new_tokens=48, stop=(),
               deadline=time.monotonic() + 300, post=lambda kind, payload, p=tuple(prompt), o=tuple(options.items()):
               box.put((p, o, kind, payload)))


def _wait(box, n):
    out = []
    while len(out) < n:
        p, o, kind, payload = box.get(timeout=300)
        if kind != "step":
            out.append((p, o, kind, payload))
    return out


@pytest.mark.parametrize("model", ["stories260K", "stories260K-sbd"])
def test_staggered_requests_with_draft_sources_equal_generate_alone(model):
    bundle = unmask.load(model)
    prompts = [bundle.encode(t) for t in TEXTS]
    sources = [None, "lookup", "suffix", "lookup"] if model == "stories260K" else ["block+lookup", "lookup", "suffix", None]
    decoder = "ar" if model == "stories260K" else "sbd"
    sched = Scheduler(bundle, max_batch_size=3).start()
    box: queue.Queue = queue.Queue()
    try:
        jobs = []
        for i, (p, s) in enumerate(zip(prompts, sources)):  # staggered: each joins a running batch
            jobs.append(_job(p, box, decoder, **({} if s is None else {"draft_source": s})))
            sched.submit(jobs[-1])
            time.sleep(0.05 * i)
        gone = _job(prompts[1], box, decoder, draft_source="lookup")
        sched.submit(gone)
        gone.cancel()  # dropped while the others run
        done = _wait(box, len(jobs) + 1)
    finally:
        sched.close()
    for p, o, kind, payload in done:
        if kind == "cancelled":
            continue  # the cancelled one
        assert kind == "done", payload
        alone = DECODERS[decoder].decode(bundle, [list(p)], max_new_tokens=48).tokens[0]
        assert payload["tokens"] == alone, o
    tally = sched.draft_tally.as_dict()
    assert tally["lookup"]["drafted"] > 0 and tally["suffix"]["drafted"] >= 0
    assert sched.suffix_cache.documents == sources.count("suffix")  # finished suffix rows feed the suffix cache
    text = Metrics(sched).text().decode()
    assert 'unmask_draft_tokens_total{source="lookup"}' in text
    assert "unmask_suffix_cache_tokens" in text


def test_suffix_cache_is_per_scheduler_and_bounded():
    bundle = unmask.load("stories260K")
    a, b = Scheduler(bundle, suffix_cache_tokens=64), Scheduler(bundle)
    assert a.suffix_cache is not b.suffix_cache
    for _ in range(10):
        a.suffix_cache.add(list(range(3, 40)))
    assert a.suffix_cache.tokens <= 64 and b.suffix_cache.tokens == 0
    assert Scheduler(bundle, suffix_cache_tokens=0).suffix_cache is None
    with pytest.raises(UnmaskError, match="suffix cache"):
        Scheduler(bundle, suffix_cache_tokens=-1)


def test_server_draft_defaults_and_a_request_that_turns_them_off():
    from fastapi.testclient import TestClient

    from unmask.serve.app import create_app

    bundle = unmask.load("stories260K")
    with pytest.raises(UnmaskError, match="draft_source"):
        create_app(bundle, defaults={"draft_tokens": 4})  # sizes nothing: refused at start
    app = create_app(bundle, defaults={"draft_source": "lookup", "draft_tokens": 4})
    body = {"prompt": "Tom had a red ball. Tom had a red ball. Tom", "max_tokens": 48}
    with TestClient(app) as client:
        drafted = client.post("/v1/completions", json=body).json()
        plain = client.post("/v1/completions", json={**body, "draft_source": "none"}).json()
        metrics = client.get("/metrics").text
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]
    assert drafted["usage"]["nfe"] < plain["usage"]["nfe"] == 48
    assert 'unmask_draft_accepted_tokens_total{source="lookup"}' in metrics
