"""Early-Bird pure pieces (spec/early_bird.md §3.5, §4.1, §5): LBS filters in order on hand-made
cases and against a plain-Python statement of Alg. 5 lines 10–20, LPS features, the gather plan,
and the union accept rule with its anti-stall fallback."""

from __future__ import annotations

import math
import random

import pytest
import torch

from unmask.decode.dllm.eb_select import (PATH_MIN_TOKENS, PATH_ROUTER, PATH_SIZE, drop_eos, first_masked,
                                     lps_features, max_gap_cut, pack_rows, select_block, union_accept)

EOS = 2


def row(L, positions):
    t = torch.zeros(1, L, dtype=torch.bool)
    t[0, list(positions)] = True
    return t


def pos_of(t):
    return torch.nonzero(t[0]).flatten().tolist()


# -- individual filters ---------------------------------------------------------------------------


def test_first_masked_takes_the_leftmost_masks_or_all():
    masked = row(12, [1, 2, 4, 7, 8, 11])
    assert pos_of(first_masked(masked, 3)) == [1, 2, 4]
    assert pos_of(first_masked(masked, 32)) == [1, 2, 4, 7, 8, 11]


def test_eos_removal_drops_every_eos_id_prediction():
    cand = row(6, [0, 1, 2, 3, 4])
    top1 = torch.tensor([[5, 2, 7, 1, 9, 2]])
    assert pos_of(drop_eos(cand, top1, [2])) == [0, 2, 3, 4]
    assert pos_of(drop_eos(cand, top1, [1, 2])) == [0, 2, 4]  # the adapter's full EOS/EOT set
    assert pos_of(drop_eos(cand, top1, [])) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("g_max, kept", [(1, [2, 3]), (2, [2, 3, 5]), (3, [2, 3, 5]), (4, [2, 3, 5, 9, 10]),
                                         (100, [2, 3, 5, 9, 10])])
def test_max_gap_cut_keeps_the_prefix_up_to_the_first_large_gap(g_max, kept):
    # gaps: 3-2=1, 5-3=2, 9-5=4, 10-9=1: everything from the first gap > g_max on is dropped,
    # including 10 whose own gap is small.
    assert pos_of(max_gap_cut(row(12, [2, 3, 5, 9, 10]), g_max)) == kept


def test_max_gap_cut_edge_cases():
    assert pos_of(max_gap_cut(row(8, []), 1)) == []
    assert pos_of(max_gap_cut(row(8, [6]), 1)) == [6]  # the leftmost element always stays
    assert pos_of(max_gap_cut(row(8, [0, 7]), 7)) == [0, 7]  # gap 7 == g_max is allowed


def test_masked_rank_gap_ignores_committed_positions():
    masked = row(10, [0, 1, 5, 6, 9])  # 2, 3, 4, 7, 8 already committed
    cand = row(10, [1, 5, 9])
    assert pos_of(max_gap_cut(cand, 1, masked=masked, metric="absolute")) == [1]
    assert pos_of(max_gap_cut(cand, 1, masked=masked, metric="masked_rank")) == [1, 5]  # ranks 1, 2, 4
    assert pos_of(max_gap_cut(cand, 2, masked=masked, metric="masked_rank")) == [1, 5, 9]
    with pytest.raises(ValueError):
        max_gap_cut(cand, 1, metric="nope")


# -- select_block: filter order and fallbacks -------------------------------------------------------


def select(p, masked, top1, **kw):
    kw = {"eos_ids": [EOS], "l_min": 2, "fallback_block": 4, "g_max": 1, **kw}
    block, path = select_block(torch.tensor([p]), masked, torch.tensor([top1]), **kw)
    return pos_of(block), int(path[0])


def test_size_fallback_takes_all_masks_before_any_filter():
    masked = row(8, [3, 6])
    # |M| = 2 <= L_min: B = M even though the router rejects both and one predicts EOS.
    assert select([0.0] * 8, masked, [EOS] * 8) == ([3, 6], PATH_SIZE)


def test_router_cut_is_strictly_above_one_half_and_only_on_masks():
    masked = row(8, [0, 1, 2, 3, 4, 5])
    p = [0.9, 0.5, 0.51, 0.52, 0.0, 0.0, 0.99, 0.99]  # 6, 7 are not masked
    assert select(p, masked, [5] * 8, g_max=3) == ([0, 2, 3], PATH_ROUTER)


def test_eos_removal_comes_before_the_max_gap_cut():
    masked = row(10, range(10))
    p = [0.9] * 7 + [0.0] * 3
    top1 = [5, 5, 5, 5, EOS, 5, 5, 5, 5, 5]
    # Without EOS removal 0..6 would be contiguous; removing 4 opens a gap of 2 > g_max = 1.
    assert select(p, masked, top1) == ([0, 1, 2, 3], PATH_ROUTER)
    assert select(p, masked, top1, g_max=2) == ([0, 1, 2, 3, 5, 6], PATH_ROUTER)


def test_min_tokens_fallback_takes_the_first_lb_masks():
    masked = row(10, [1, 2, 3, 5, 6, 7, 8, 9])
    p = [0.0] * 9 + [0.9]  # one candidate (9) < L_min = 2
    assert select(p, masked, [5] * 10) == ([1, 2, 3, 5], PATH_MIN_TOKENS)
    # the fallback block may hold EOS predictions: they are committed by the normal rule
    assert select(p, masked, [EOS] * 10) == ([1, 2, 3, 5], PATH_MIN_TOKENS)
    # fewer masks than L_B: all of them (and not the size fallback, since |M| > L_min)
    assert select([0.0] * 10, row(10, [4, 8, 9]), [5] * 10, fallback_block=32) == ([4, 8, 9], PATH_MIN_TOKENS)


def test_blocks_may_be_non_contiguous_with_holes_up_to_g_max_minus_one():
    masked = row(12, range(12))
    p = [0.9 if i in (0, 3, 6, 8, 11) else 0.1 for i in range(12)]
    assert select(p, masked, [5] * 12, g_max=3) == ([0, 3, 6, 8, 11], PATH_ROUTER)


def reference_select(p, masked, top1, eos, l_min, lb, g_max):
    """Alg. 5 lines 10–20 stated on Python lists, one row."""
    M = [i for i in range(len(p)) if masked[i]]
    if len(M) <= l_min:
        return M
    C = [i for i in M if p[i] > 0.5 and top1[i] not in eos]
    B = C[:1]
    for a, b in zip(C, C[1:]):
        if b - a > g_max:
            break
        B.append(b)
    if len(B) < l_min:
        B = M[:lb]
    return B


def test_vectorised_selection_matches_the_reference_on_random_rows():
    rng = random.Random(0)
    for _ in range(60):
        B, L = 5, rng.randint(4, 40)
        p = torch.rand(B, L, generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
        p = torch.where(torch.rand(B, L) < 0.2, torch.full_like(p, 0.5), p)  # exact ties at the cut
        masked = torch.rand(B, L) < rng.random()
        top1 = torch.randint(0, 6, (B, L))
        l_min, lb, g_max = rng.randint(1, 6), rng.randint(1, 10), rng.randint(1, 4)
        block, _ = select_block(p, masked, top1, eos_ids=[2, 3], l_min=l_min, fallback_block=lb, g_max=g_max)
        for r in range(B):
            want = reference_select(p[r].tolist(), masked[r].tolist(), top1[r].tolist(), {2, 3}, l_min, lb, g_max)
            assert torch.nonzero(block[r]).flatten().tolist() == want


# -- LPS features and packing -----------------------------------------------------------------------


def test_lps_features_ratio_and_literal_or_rank_position():
    L = 10
    block = row(L, [2, 3, 6, 9])  # non-contiguous, |B| = 4, b = 2
    masked = row(L, [3, 6, 9, 0])  # 2 already committed; 0 is masked but outside B
    kappa, h, d = torch.full((1, L), 0.7), torch.full((1, L), 0.2), torch.full((1, L), 0.4)
    f = lps_features(kappa, h, d, block, masked)
    assert f.shape == (1, L, 5)
    assert torch.all(f[0, [0, 1, 2, 4, 5, 7, 8]] == 0)  # zero outside B ∩ M
    assert torch.allclose(f[0, 3], torch.tensor([0.7, 0.2, 0.4, 0.75, 0.25]))
    assert math.isclose(float(f[0, 9, 4]), 7 / 4)  # literal (i − b)/|B| > 1, unclipped
    rank = lps_features(kappa, h, d, block, masked, pos_mode="rank")
    assert [float(rank[0, i, 4]) for i in (3, 6, 9)] == [0.25, 0.5, 0.75]
    with pytest.raises(ValueError):
        lps_features(kappa, h, d, block, masked, pos_mode="clip")


def test_pack_rows_puts_selected_positions_first_and_never_repeats_a_slot():
    sel = torch.tensor([[0, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    index, valid = pack_rows(sel)
    assert index.shape == valid.shape == (3, 3)
    assert valid.sum(dim=1).tolist() == [3, 0, 1]
    assert index[0, :3].tolist() == [1, 3, 4] and index[2, 0] == 0
    for r in range(3):
        assert len(set(index[r].tolist())) == 3
        assert not sel[r, index[r][~valid[r]]].any()


# -- union accept rule --------------------------------------------------------------------------------


def test_union_accept_threshold_or_lps_and_anti_stall():
    cand = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    kappa = torch.tensor([[0.9, 0.5, 0.3, 0.2, 0.99]])
    p = torch.tensor([[0.1, 0.95, 0.9, 0.0, 0.99]])
    assert pos_of(union_accept(kappa, None, cand, 0.9, 0.9)) == [0]  # κ ≥ τ inclusive; 4 not a candidate
    assert pos_of(union_accept(kappa, p, cand, 0.9, 0.9)) == [0, 1]  # p_ψ > τ_ψ strictly
    assert pos_of(union_accept(kappa, p, cand, 0.95, 0.9)) == [1]  # only LPS fires: no forced top-1
    assert pos_of(union_accept(kappa, p * 0, cand, 0.95, 0.9)) == [0]  # anti-stall: argmax κ


def test_union_accept_ties_go_to_the_lower_position_and_empty_rows_commit_nothing():
    kappa = torch.tensor([[0.4, 0.6, 0.6, 0.1], [0.5, 0.5, 0.5, 0.5]])
    cand = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    out = union_accept(kappa, None, cand, 0.9, 0.9)
    assert out.tolist() == [[False, True, False, False], [False] * 4]


def test_tau_psi_one_never_fires():
    cand = torch.ones(1, 4, dtype=torch.bool)
    kappa = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    saturated = torch.ones(1, 4)  # σ(large logit) rounds to exactly 1.0 in float32
    assert pos_of(union_accept(kappa, saturated, cand, 0.9, 1.0)) == [3]
