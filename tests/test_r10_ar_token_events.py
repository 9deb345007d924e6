"""The server's AR rows stream one step event per token (issue 49): posting one reads only the new
token (O(1) per token, not a copy of the row's tokens), and the events a stream receives are the
ones it always got: step i commits position i, canvas = the first i + 1 tokens."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

from test_sbd_verify import verify_bundle

from unmask.sampling import Sampling
from unmask.serve.engine import Scheduler
from unmask.serve.jobs import Job
from unmask.decode import DECODERS


class Counted(list):
    """A token list that counts the items read from it whole (iteration, slices)."""

    reads = 0

    def __iter__(self):
        Counted.reads += len(self)
        return super().__iter__()

    def __getitem__(self, k):
        if isinstance(k, slice):
            Counted.reads += len(range(*k.indices(len(self))))
        return super().__getitem__(k)


def test_posting_a_token_reads_only_that_token():
    posted = []
    job = SimpleNamespace(events=False, gone=False, closed=False, logprobs=None,
                          post=lambda kind, payload: posted.append(payload))
    row = SimpleNamespace(job=job, tokens=Counted(range(5000)), logprobs=None)
    Counted.reads = 0
    Scheduler._ar_token(None, row)
    assert Counted.reads == 0 and len(posted) == 1
    assert posted[0]["tokens"] == [4999] and posted[0]["positions"] == [4999] and posted[0]["step"] == 4999


def test_an_ar_stream_receives_the_same_events():
    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=4)
    prompt = [1, 3, 5, 2]
    want = DECODERS["ar"].decode(bundle, [prompt], max_new_tokens=12).tokens[0]
    sched = Scheduler(bundle, max_batch_size=2).start()
    try:
        box: queue.Queue = queue.Queue()
        sched.submit(Job(prompt_ids=prompt, decoder="ar", options={}, sampling=Sampling(), max_new_tokens=12, stop=(),
                         deadline=time.monotonic() + 120, post=lambda kind, payload: box.put((kind, payload))))
        got = []
        while (event := box.get(timeout=120))[0] == "step":
            got.append(event[1])
    finally:
        sched.close()
    assert event[0] == "done" and event[1]["tokens"] == want
    assert len(got) == len(want)
    for i, ev in enumerate(got):  # read after the stream ended: each event shows its own step
        assert dict(ev) == {"step": i, "row": 0, "positions": [i], "tokens": [want[i]], "canvas": want[: i + 1]}
        assert ev == dict(ev) and ev.get("positions") == [i] and {**ev}["canvas"] == want[: i + 1]
