"""The one engine's shared plumbing (decode/engine/running.py): the slot free list and drain()."""

import pytest

from unmask.decode.engine.running import Request, Row, Slots, drain
from unmask.errors import UnmaskError


def test_slots_hand_out_the_lowest_free_and_track_the_high_water_mark():
    s = Slots(4)
    assert s.take(3) == [0, 1, 2] and s.high == 3 and len(s) == 3
    s.give([1])
    assert s.free == 2 and s.high == 3
    assert s.take(1) == [1]  # the hole is refilled before slot 3 is used
    s.give([2, 0])
    assert s.high == 2 and s.take(2) == [0, 2]
    with pytest.raises(UnmaskError, match="running batch full"):
        s.take(2)
    s.give([0, 1, 2])
    assert s.high == 0 and s.free == 4


class _Countdown:
    """A toy running decoder: each row commits its prompt's first id once per step until its budget."""

    def __init__(self, capacity):
        self.slots, self.rows, self.forwards = Slots(capacity), [], 0

    def __len__(self):
        return len(self.rows)

    def join(self, requests):
        self.rows += [Row(job=r, slot=s) for r, s in zip(requests, self.slots.take(len(requests)))]
        return []

    def step(self):
        self.forwards += 1
        for row in self.rows:
            row.tokens.append(row.job.prompt_ids[0])
            row.nfe += 1
            if len(row.tokens) >= row.job.max_new_tokens:
                row.finish = "length"
        done = [r for r in self.rows if r.finish]
        self.rows = [r for r in self.rows if not r.finish]
        self.slots.give([r.slot for r in done])
        return done

    def drop(self, ids):
        return []

    def stats_extra(self, rows):
        return {"slots": [r.slot for r in rows]}


def test_drain_returns_rows_in_request_order_with_their_own_counts():
    reqs = [Request(prompt_ids=[7], max_new_tokens=3, id=0), Request(prompt_ids=[9], max_new_tokens=1, id=1)]
    out = drain(_Countdown, reqs)
    assert out.tokens == [[7, 7, 7], [9]]
    assert out.stats.nfe == 3 and out.stats.nfe_per_row == [3, 1]
    assert out.stats.extra == {"slots": [0, 1]}
