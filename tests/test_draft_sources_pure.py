"""The model-free draft sources of the verify batch (spec/draft_sources.md §1): prompt lookup and
suffix decoding, pure host-side Python, against brute-force references."""

from __future__ import annotations

import math
import random
import threading

import pytest

from unmask.decode.verify.lookup import Lookup
from unmask.decode.verify.suffix import Suffix, SuffixCache


def lookup_reference(h: list[int], limit: int, n_max: int = 4, n_min: int = 1) -> tuple[list[int], int]:
    """spec §1 by brute force: for n = n_max .. n_min, the most recent earlier occurrence of h[-n:]
    (not the suffix itself) and up to ``limit`` ids after it."""
    if limit <= 0:
        return [], 0
    for n in range(min(n_max, len(h)), n_min - 1, -1):
        gram = h[len(h) - n:]
        for s in range(len(h) - n - 1, -1, -1):
            if h[s:s + n] == gram:
                return h[s + n:s + n + limit], n
    return [], 0


# -- lookup ------------------------------------------------------------------------------------------------

def test_lookup_no_match():
    assert Lookup([1, 2, 3, 4]).propose(4) == ([], 0)
    assert Lookup([]).propose(4) == ([], 0)
    assert Lookup([7]).propose(4) == ([], 0)


def test_lookup_limit_not_positive():
    lk = Lookup([1, 2, 3, 1, 2])
    assert lk.propose(0) == ([], 0)
    assert lk.propose(-3) == ([], 0)


def test_lookup_match_at_the_very_end_truncates_the_continuation():
    # the latest earlier (1, 2) ends right before the suffix: only 3 follows it before the end of h
    assert Lookup([1, 2, 3, 1, 2]).propose(8) == ([3, 1, 2], 2)
    assert Lookup([9, 1, 2, 1, 2]).propose(8) == ([1, 2], 2)


def test_lookup_match_longer_than_the_limit():
    h = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert Lookup(h).propose(3) == ([3, 4, 5], 2)
    assert Lookup(h).propose(1) == ([3], 2)


def test_lookup_runs_of_one_token():
    assert Lookup([5, 5, 5, 5]).propose(4) == ([5], 3)
    assert Lookup([5, 5, 5, 5, 5, 5, 5, 5]).propose(3) == ([5], 4)
    assert Lookup([5, 5, 5, 5, 5, 5, 5, 5], n_max=2).propose(3) == ([5], 2)
    assert Lookup([5, 5]).propose(4) == ([5], 1)


def test_lookup_most_recent_occurrence_wins():
    assert Lookup([1, 2, 10, 1, 2, 20, 3, 1, 2]).propose(2) == ([20, 3], 2)
    assert Lookup([4, 10, 4, 20, 4]).propose(1) == ([20], 1)


def test_lookup_longer_ngram_before_a_more_recent_shorter_one():
    h = [1, 2, 3, 10, 9, 3, 20, 1, 2, 3]  # (2, 3) ... 10 is older than (3) ... 20 but longer
    assert Lookup(h).propose(1) == ([10], 3)
    assert Lookup(h, n_max=1).propose(1) == ([20], 1)
    assert Lookup(h, n_max=4, n_min=4).propose(1) == ([], 0)


def test_lookup_rejects_bad_n():
    with pytest.raises(ValueError, match="n_min"):
        Lookup([1], n_max=2, n_min=0)
    with pytest.raises(ValueError, match="n_max"):
        Lookup([1], n_max=1, n_min=2)


@pytest.mark.parametrize("n_max,n_min", [(4, 1), (3, 2), (1, 1), (5, 3)])
def test_lookup_incremental_equals_reference(n_max, n_min):
    rng = random.Random(51 + n_max * 10 + n_min)
    for _ in range(60):
        vocab = rng.choice([2, 3, 5, 20])
        h = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        cut = rng.randrange(0, len(h) + 1)
        inc = Lookup(h[:cut], n_max=n_max, n_min=n_min)
        pos = cut
        while pos < len(h):  # extend in random chunks, checking every intermediate history
            step = rng.randrange(1, 5)
            inc.extend(h[pos:pos + step])
            pos = min(len(h), pos + step)
            limit = rng.randrange(-1, 10)
            want = lookup_reference(h[:pos], limit, n_max, n_min)
            assert inc.propose(limit) == want
            assert Lookup(h[:pos], n_max=n_max, n_min=n_min).propose(limit) == want
        assert inc.history == h


# -- suffix ------------------------------------------------------------------------------------------------

def test_suffix_most_frequent_continuation_then_most_recent():
    # after 1: 2 twice, 3 once -> 2 even though 3 is the most recent
    s = Suffix([1, 2, 1, 2, 1, 3, 1], depth=2, alpha=1)
    assert s.propose(4) == ([2], 1)
    # a tie (2 once, 3 once): the most recent continuation wins
    assert Suffix([1, 2, 1, 3, 1], depth=2, alpha=1).propose(4) == ([3], 1)


def test_suffix_longest_match_and_greedy_walk():
    # context (7, 1) was followed by 4; context (1) alone mostly by 2: the longer match wins,
    # then the walk continues 4 -> 5 -> 6; the draft is capped by ceil(alpha * match length)
    h = [7, 1, 4, 5, 6, 1, 2, 1, 2, 1, 2, 7, 1]
    assert Suffix(h, depth=3, alpha=1.5).propose(8) == ([4, 5, 6], 2)
    assert Suffix(h, depth=3, alpha=1.0).propose(8) == ([4, 5], 2)
    assert Suffix(h, depth=3, alpha=10).propose(2) == ([4, 5], 2)
    assert Suffix(h, depth=2, alpha=10).propose(3) == ([2, 1, 2], 1)


def test_suffix_no_match_and_limit():
    assert Suffix([1, 2, 3]).propose(4) == ([], 0)
    assert Suffix([]).propose(4) == ([], 0)
    s = Suffix([1, 2, 1])
    assert s.propose(0) == ([], 0) and s.propose(-1) == ([], 0)
    assert s.propose(1) == ([2], 1)


def test_suffix_min_prob_stops_the_draft():
    h = [1, 2, 1, 3, 1, 4, 1]  # after 1: three ids once each, share 1/3
    assert Suffix(h, depth=2, alpha=4, min_prob=0.5).propose(4) == ([], 0)
    assert Suffix(h, depth=2, alpha=4, min_prob=0.3).propose(1) == ([4], 1)


def test_suffix_extend_equals_building_at_once():
    rng = random.Random(7)
    for _ in range(40):
        h = [rng.randrange(4) for _ in range(rng.randrange(0, 50))]
        cut = rng.randrange(0, len(h) + 1)
        inc = Suffix(h[:cut], depth=4, alpha=2)
        inc.extend(h[cut:])
        whole = Suffix(h, depth=4, alpha=2)
        assert inc.table == whole.table
        assert inc.propose(6) == whole.propose(6)


def test_suffix_shared_cache_drafts_from_other_documents():
    cache = SuffixCache(max_tokens=100, depth=4)
    cache.add([10, 11, 12, 13, 14, 15])
    row = Suffix([1, 10, 11, 12], shared=cache, depth=4, alpha=2)
    assert row.propose(8) == ([13, 14, 15], 3)
    assert Suffix([1, 10, 11, 12], depth=4).propose(8) == ([], 0)


def test_suffix_combine_sum_and_longest():
    cache = SuffixCache(max_tokens=100, depth=2)
    cache.add([1, 9, 1, 9])  # shared: after 1, 9 twice
    h = [1, 8, 1]  # row: after 1, 8 once
    assert Suffix(h, shared=cache, depth=2, alpha=1, combine="sum").propose(1) == ([9], 1)
    assert Suffix(h, shared=cache, depth=2, alpha=1, combine="longest").propose(1) == ([8], 1)


def test_suffix_caches_are_isolated():
    a, b = SuffixCache(max_tokens=100, depth=3), SuffixCache(max_tokens=100, depth=3)
    a.add([1, 2, 3, 4])
    assert Suffix([1, 2], shared=a, depth=3).propose(4)[0] == [3, 4]
    assert Suffix([1, 2], shared=b, depth=3).propose(4) == ([], 0)
    assert b.tokens == 0 and b.documents == 0 and b.table == {}


def table_of(docs: list[list[int]], depth: int) -> dict:
    """The count tables of ``docs`` by brute force (contexts of 1 .. depth - 1 ids)."""
    t: dict = {}
    for d in docs:
        for j in range(1, len(d)):
            for m in range(1, min(depth - 1, j) + 1):
                row = t.setdefault(tuple(d[j - m:j]), {})
                row[d[j]] = row.get(d[j], 0) + 1
    return t


def test_suffix_cache_evicts_oldest_first_and_counts_exactly():
    cache = SuffixCache(max_tokens=10, depth=3)
    docs = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 9], [8, 8, 8, 8]]
    cache.add(docs[0]); cache.add(docs[1]); cache.add(docs[2])
    assert (cache.tokens, cache.documents) == (10, 3)
    cache.add(docs[3])  # 14 ids > 10: the oldest ([1, 2, 3, 4]) goes
    assert (cache.tokens, cache.documents) == (10, 3)
    assert cache.table == table_of(docs[1:], 3)
    assert Suffix([1, 2], shared=cache, depth=3).propose(2) == ([9], 2)  # 3 went with its document
    cache.add([4, 4, 4, 4, 4, 4, 4, 4, 4, 4])
    assert cache.documents == 1 and cache.table == table_of([[4] * 10], 3)


def test_suffix_cache_long_document_keeps_its_tail():
    cache = SuffixCache(max_tokens=5, depth=3)
    cache.add(list(range(12)))
    assert (cache.tokens, cache.documents) == (5, 1)
    assert cache.table == table_of([[7, 8, 9, 10, 11]], 3)


def test_suffix_cache_memory_bound_and_evicting_all_empties_the_tables():
    rng = random.Random(3)
    cache = SuffixCache(max_tokens=300, depth=5)
    for _ in range(200):
        cache.add([rng.randrange(50) for _ in range(rng.randrange(1, 80))])
        assert cache.tokens <= 300
        assert cache.entries <= (cache.depth - 1) * cache.tokens
        assert cache.entries == sum(len(r) for r in cache.table.values())
        assert 0 < cache.bytes
    cache.add([0] * 300)  # evicts every random document
    assert cache.table == table_of([[0] * 300], 5) and cache.documents == 1
    one = SuffixCache(max_tokens=1, depth=5)
    for _ in range(10):
        one.add([rng.randrange(50) for _ in range(20)])
    assert (one.tokens, one.entries, one.table) == (1, 0, {})
    cache.clear()
    assert (cache.tokens, cache.documents, cache.entries, cache.table) == (0, 0, 0, {})


def test_suffix_rejects_bad_settings():
    with pytest.raises(ValueError, match="depth"):
        SuffixCache(depth=1)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixCache(max_tokens=0)
    with pytest.raises(ValueError, match="alpha"):
        Suffix([1], alpha=0)
    with pytest.raises(ValueError, match="combine"):
        Suffix([1], combine="max")
    with pytest.raises(ValueError, match="same depth"):
        Suffix([1], shared=SuffixCache(depth=4), depth=8)


def test_suffix_cache_thread_safety_smoke():
    cache = SuffixCache(max_tokens=2000, depth=6)
    rng = random.Random(11)
    docs = [[rng.randrange(30) for _ in range(rng.randrange(5, 100))] for _ in range(300)]
    errors: list[BaseException] = []

    def writer():
        try:
            for d in docs:
                cache.add(d)
        except BaseException as e:  # noqa: BLE001 - the reader must see the writer's failure
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    row = Suffix([rng.randrange(30) for _ in range(50)], shared=cache, depth=6, alpha=4)
    while t.is_alive():
        draft, m = row.propose(8)
        assert len(draft) <= min(8, math.ceil(4 * m))
        row.extend([rng.randrange(30)])
    t.join()
    assert not errors
    assert cache.tokens <= 2000 and cache.entries == sum(len(r) for r in cache.table.values())


# -- the offline replay (benchmarks/draft_replay.py) -------------------------------------------------------

def test_replay_accounting():
    from conftest import load_benchmark

    replay = load_benchmark("draft_replay")

    class Oracle:  # drafts the true next ids: every step commits limit + 1 (fewer at the end)
        def __init__(self, out):
            self.out, self.pos = out, 0

        def extend(self, tokens):
            self.pos += len(tokens)

        def propose(self, limit):
            return self.out[self.pos:self.pos + limit], 1

    rows = [{"prompt": [1, 2], "output": list(range(10, 20))}]
    res = replay.replay(rows, lambda i, p: Oracle(rows[i]["output"]), 3)
    assert (res["tokens"], res["steps"], res["queries"]) == (10, 3, 10)  # commits 4 + 4 + 2
    assert [d for _, d, _ in res["records"]] == [3, 3, 1]
    res = replay.replay(rows, lambda i, p: Lookup(p), 8)  # nothing repeats: plain AR steps
    assert (res["tokens"], res["steps"], res["queries"], res["cost"]) == (10, 10, 10, 10.0)
    s = replay.summary(replay.replay([{"prompt": [5, 6, 7], "output": [5, 6, 7, 5, 6, 7]}],
                                     lambda i, p: Lookup(p), 8))
    # steps: no match, commit 5; (5) drafts 6 7 5 (cut at the end of h), all accepted + 6; the last id
    # alone (a draft never runs past the output's end)
    assert (s["tpf"], s["q_per_step"]) == (2.0, 6 / 3)
