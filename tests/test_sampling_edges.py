"""Sampler edges and small-temperature ranking (issue 15 items 7 and 8, diffusion.md §4)."""

from __future__ import annotations

import torch

from unmask.policies import EntropyBound, Factor, Threshold, TopK, commit, gumbel_argmax


def test_gumbel_argmax_never_picks_a_minus_inf_column_at_the_uniform_edges(monkeypatch):
    logits = torch.tensor([[float("-inf"), 1.0, 0.5, -2.0]])  # column 0: the suppressed mask token
    real_rand = torch.rand
    for edge in (1.0, 0.0):
        monkeypatch.setattr(torch, "rand", lambda *a, edge=edge, **k: torch.full_like(real_rand(*a, **k), edge))
        assert gumbel_argmax(logits, 0.7).item() != 0
        _, tokens = commit(logits[None], torch.ones(1, 1, dtype=torch.bool), TopK(1), temperature=0.7,
                           sampling="gumbel", confidence="untempered")
        assert tokens.item() != 0
    monkeypatch.setattr(torch, "rand", real_rand)
    # Inside (0, 1) the draw is the reference's bit for bit: exp(z) / (−log u)^T.
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, 50, dtype=torch.float64, generator=g)
    u = torch.rand(z.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ref = (z.exp() / (-torch.log(u)) ** 0.6).argmax(-1)
    assert torch.equal(gumbel_argmax(z, 0.6, torch.Generator().manual_seed(9)), ref)


def _two_positions():
    # Position 1 is the more confident one under any temperature (gap 3 vs gap 2 to the rest),
    # but at T = 0.01 both tempered probabilities round to exactly 1.0 in float32 and float64.
    row0 = [5.0, 3.0, 0.0, 0.0]
    row1 = [5.0, 2.0, 0.0, 0.0]
    return torch.tensor([[row0, row1]])  # (1, 2, 4)


def test_tempered_confidence_ranks_correctly_when_it_saturates():
    logits, masked = _two_positions(), torch.ones(1, 2, dtype=torch.bool)
    q = torch.softmax(logits / 0.01, dim=-1).max(-1).values
    assert bool((q == 1.0).all())  # the saturation the issue describes: every position ties
    # top_k=1 draws the top-1 token, so κ is its tempered probability; the order is the one a
    # moderate temperature gives, where nothing saturates.
    for T in (0.01, 0.5, 1.0):
        chosen, _ = commit(logits, masked, TopK(1), temperature=T, top_k=1, confidence="tempered")
        assert chosen.tolist() == [[False, True]]


def test_eb_confidence_proxy_ranks_correctly_when_max_q_rounds_to_one():
    # 1 − q = 1e-8 at position 0 and 1e-20 at position 1: both q are 1.0 in float32, H > 0 at both.
    logits = torch.tensor([[[0.0, -18.42], [0.0, -46.05]]])  # (1, 2, 2)
    chosen, _ = commit(logits, torch.ones(1, 2, dtype=torch.bool), EntropyBound(0.0, "confidence"), temperature=1.0)
    assert chosen.tolist() == [[False, True]]


def test_saturated_confidence_still_compares_as_probability():
    logits, masked = _two_positions(), torch.ones(1, 2, dtype=torch.bool)
    # Tempered κ (Dream's convention, by name) = 1.0 at both: every κ ≥ τ commits, and the factor
    # rule accepts both ranks.
    kw = dict(temperature=0.01, top_k=1, confidence="tempered")
    assert commit(logits, masked, Threshold(0.9), **kw)[0].tolist() == [[True, True]]
    assert commit(logits, masked, Factor(1.0), **kw)[0].tolist() == [[True, True]]


def test_equal_confidences_still_tie_to_the_lower_position():
    row = [2.0, 1.0, 0.0, 0.0]
    logits, masked = torch.tensor([[row[::-1], row]]), torch.ones(1, 2, dtype=torch.bool)
    assert commit(logits, masked, TopK(1))[0].tolist() == [[True, False]]
