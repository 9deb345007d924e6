"""Block Buffer slot state machine (multiblock.md §3.1–3.3): pure transitions on hand-built windows."""

from __future__ import annotations

from dataclasses import replace

import torch

from unmask.decode.multiblock import buffer as bb
from unmask.decode.multiblock.buffer import ACTIVE, DUMMY, NO_STOP, TO_CACHE

M = 99  # mask id in these tests


def window(prompts=([1, 2, 3, 4, 5],), max_new=12, slots=3, B=4):
    return bb.initial_window([list(p) for p in prompts], max_new, slots, B, M)


def fill(w, row, slot, values):
    """Set the tokens of one slot (None keeps a position as it is)."""
    tokens = w.tokens.clone()
    for i, v in enumerate(values):
        if v is not None:
            tokens[row, slot, i] = v
    return replace(w, tokens=tokens)


def states(w, row=0):
    return w.describe(row)


def test_initial_window_puts_the_prompt_tail_in_the_first_active_block():
    w = window(prompts=([1, 2, 3, 4, 5, 6], [7, 8, 9, 10]), max_new=5, slots=2, B=4)
    assert w.front.tolist() == [1, 1]  # one whole prompt block each
    assert w.tokens[0, 0].tolist() == [5, 6, M, M] and w.editable[0, 0].tolist() == [False, False, True, True]
    assert w.tokens[1, 0].tolist() == [M] * 4 and w.editable[1, 0].tolist() == [True] * 4
    assert states(w) == ["active", "dummy"] and not w.editable[:, 1].any()
    assert w.last_block.tolist() == [2, 2]  # positions 6..10 and 4..8
    assert w.positions()[0].tolist() == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert bb.progress(w)[0, 0] == 0.5  # prompt positions count as filled


def test_positions_past_max_new_tokens_are_frozen_and_count_as_filled():
    w = window(prompts=([1, 2],), max_new=1, slots=1, B=4)
    assert w.editable[0, 0].tolist() == [False, False, True, False]
    assert bb.progress(w)[0, 0] == 0.75
    w = fill(w, 0, 0, [None, None, 7])
    assert bool(bb.complete(w)[0, 0])


def test_same_token_ratio_compares_filled_editable_positions_with_the_last_argmax():
    w = fill(window(), 0, 0, [None, 10, 11, M])  # position 0 is prompt
    assert bb.same_token_ratio(w)[0, 0] == 0.0  # argmax starts as the initial tokens (masks)
    w = replace(w, argmax=w.tokens.clone())
    assert bb.same_token_ratio(w)[0, 0] == 1.0
    argmax = w.argmax.clone()
    argmax[0, 0, 1] = 12
    assert bb.same_token_ratio(replace(w, argmax=argmax))[0, 0] == 0.5
    assert bb.same_token_ratio(window())[0, 1] == 1.0  # nothing to compare


def test_activation_needs_tau_add_progress_and_activates_one_slot_per_step():
    w = window()  # slot 0: 1 prompt + 3 masks -> progress 0.25
    open_ = torch.zeros(1, dtype=torch.bool)
    w1, new = bb.activate(w, open_, tau_add=0.5)
    assert not new.any() and states(w1) == ["active", "dummy", "dummy"]
    w1, new = bb.activate(w, open_, tau_add=0.25)
    assert new[0].tolist() == [False, True, False] and states(w1) == ["active", "active", "dummy"]
    assert w1.editable[0, 1].all() and (w1.tokens[0, 1] == M).all() and w1.admitted.tolist() == [2]
    # the new block is fully masked: progress 0 < tau_add, so the next step activates nothing
    w2, new = bb.activate(w1, open_, tau_add=0.25)
    assert not new.any()


def test_activation_gates_stable_ratio_closed_rows_and_the_last_block():
    w = fill(window(), 0, 0, [None, 10, 11, 12])  # complete
    open_ = torch.zeros(1, dtype=torch.bool)
    assert not bb.activate(w, open_, tau_add=0.1, tau_stable=0.5)[1].any()  # argmax disagrees everywhere
    assert bb.activate(replace(w, argmax=w.tokens.clone()), open_, tau_add=0.1, tau_stable=0.5)[1].any()
    assert not bb.activate(w, torch.ones(1, dtype=torch.bool), tau_add=0.0)[1].any()  # stop token seen
    last = window(max_new=3)  # positions 5..7: the first block is also the last
    assert not bb.activate(last, open_, tau_add=0.0)[1].any()


def test_backup_rule_activates_slot_zero_when_every_slot_is_dummy():
    w = window(slots=1)
    w = replace(w, state=torch.full_like(w.state, DUMMY), front=w.front + 1)
    w1, new = bb.activate(w, torch.zeros(1, dtype=torch.bool), tau_add=1.0)
    assert new.tolist() == [[True]] and states(w1) == ["active"] and w1.editable[0, 0].all()
    assert not bb.activate(w, torch.ones(1, dtype=torch.bool), tau_add=1.0)[1].any()
    past = replace(w, front=w.front + 10)  # beyond the last block
    assert not bb.activate(past, torch.zeros(1, dtype=torch.bool), tau_add=1.0)[1].any()


def test_m2t_strict_threshold_and_gated_forced_top1():
    mask = torch.tensor([[True, True, True, False]])
    kappa = torch.tensor([[0.95, 0.96, 0.5, 0.99]])
    gate = torch.tensor([False])
    assert bb.m2t(mask, kappa, gate, 0.95).tolist() == [[False, True, False, False]]  # strict >, unmasked ignored
    assert bb.m2t(mask, kappa, gate, 0.97).tolist() == [[False, False, False, False]]  # gate closed: nothing
    assert bb.m2t(mask, kappa, ~gate, 0.97).tolist() == [[False, True, False, False]]  # forced top-1
    ties = torch.tensor([[0.5, 0.7, 0.7, 0.9]])
    assert bb.m2t(mask, ties, ~gate, 0.97).tolist() == [[False, True, False, False]]  # tie -> lower position
    assert not bb.m2t(torch.zeros_like(mask), kappa, ~gate, 0.0).any()


def test_t2t_edits_only_filled_positions_whose_argmax_changed_above_tau():
    filled = torch.tensor([True, True, True, False])
    tokens = torch.tensor([5, 6, 7, M])
    top1 = torch.tensor([5, 8, 9, 3])
    kappa = torch.tensor([0.99, 0.9, 0.4, 0.99])
    assert bb.t2t(filled, tokens, top1, kappa, 0.5).tolist() == [False, True, False, False]


def scripted(w, conf, token=None):
    """(R, S, B) candidates: token = 40 + position, confidence from ``conf`` (R, S, B) nested lists."""
    top1 = w.positions() + 40 if token is None else token
    return top1, torch.tensor(conf, dtype=torch.float32)


def test_transition_commits_marks_to_cache_and_pops_one_step_later():
    w = window(prompts=([1, 2, 3, 4],), max_new=12, slots=2, B=4)  # blocks 1..3, slot 0 = block 1
    w, _ = bb.activate(fill(w, 0, 0, [50, 51, None, None]), torch.zeros(1, dtype=torch.bool), tau_add=0.5)
    assert states(w) == ["active", "active"]
    conf = [[[0.1, 0.1, 0.99, 0.99], [0.99, 0.2, 0.3, 0.1]]]
    w1, info = bb.transition(w, *scripted(w, conf), tau_m2t=0.9, tau_semi=0.9)
    # slot 0 completes (two > 0.9) and is marked; slot 1 commits its confident position only:
    # its predecessor was at progress 0.5 < tau_semi when the forward ran, so no forced top-1.
    assert info.committed[0].int().tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert info.marked[0].tolist() == [True, False] and info.popped.tolist() == [0]
    assert states(w1) == ["to-cache", "active"] and w1.tokens[0, 0].tolist() == [50, 51, 46, 47]
    # next step: this forward stores slot 0, which is then popped; slot 1 may now force its top-1
    conf = [[[0.1] * 4, [0.99, 0.2, 0.3, 0.1]]]
    w2, info = bb.transition(w1, *scripted(w1, conf), tau_m2t=0.9, tau_semi=0.9)
    assert info.popped.tolist() == [1] and info.committed[0, 1].int().tolist() == [0, 0, 1, 0]
    assert states(w2) == ["active", "dummy"] and w2.front.tolist() == [2]
    assert w2.tokens[0, 0].tolist() == [48, M, 50, M] and (w2.tokens[0, 1] == M).all()
    assert not w2.editable[0, 1].any()


def test_a_complete_block_waits_for_its_predecessor_before_to_cache():
    w = window(prompts=([1, 2, 3, 4],), max_new=12, slots=2, B=4)
    w, _ = bb.activate(fill(w, 0, 0, [50, 51, 52, None]), torch.zeros(1, dtype=torch.bool), tau_add=0.5)
    conf = [[[0.1] * 4, [0.99] * 4]]  # slot 1 completes at once; slot 0's only mask is below tau
    w1, info = bb.transition(w, *scripted(w, conf), tau_m2t=0.9, tau_semi=0.9)
    assert info.committed[0, 0].int().tolist() == [0, 0, 0, 1]  # slot 0 always may force its top-1
    assert info.marked[0].tolist() == [True, True]  # slot 0 completes too, so both are marked in order
    w = window(prompts=([1, 2, 3, 4],), max_new=12, slots=2, B=4)
    w, _ = bb.activate(fill(w, 0, 0, [50, 51, None, None]), torch.zeros(1, dtype=torch.bool), tau_add=0.5)
    w1, info = bb.transition(w, *scripted(w, conf), tau_m2t=0.9, tau_semi=0.9)
    assert info.marked[0].tolist() == [False, False] and states(w1) == ["active", "active"]
    assert bool(bb.complete(w1)[0, 1])  # complete but not to-cache: its predecessor is not


def test_t2t_edit_delays_to_cache_until_max_post_edit_steps():
    w = window(prompts=([1, 2, 3, 4],), max_new=4, slots=1, B=4)
    w = fill(w, 0, 0, [60, 61, 62, None])
    conf = [[[0.99] * 4]]
    top1 = torch.tensor([[[60, 70, 62, 63]]])  # disagrees with the token at position 1
    w1, info = bb.transition(w, top1, torch.tensor(conf), tau_m2t=0.9, tau_semi=0.9, tau_t2t=0.5,
                             max_post_edit_steps=1)
    assert info.edited[0, 0].tolist() == [False, True, False, False] and w1.tokens[0, 0].tolist() == [60, 70, 62, 63]
    assert states(w1) == ["active"]  # edited this step: not commit-ready
    top1 = torch.tensor([[[80, 70, 62, 63]]])
    w2, info = bb.transition(w1, top1, torch.tensor(conf), tau_m2t=0.9, tau_semi=0.9, tau_t2t=0.5,
                             max_post_edit_steps=1)
    assert info.edited.any() and states(w2) == ["to-cache"]  # edit budget used up
    w3, info = bb.transition(w, top1, torch.tensor(conf), tau_m2t=0.9, tau_semi=0.9, tau_t2t=None)
    assert not info.edited.any() and states(w3) == ["to-cache"]  # T2T off


def test_slide_pops_per_row_and_appends_dummies():
    w = window(prompts=([1, 2, 3, 4], [5, 6, 7, 8]), slots=3)
    w = replace(w, state=torch.tensor([[TO_CACHE, TO_CACHE, ACTIVE], [TO_CACHE, ACTIVE, DUMMY]], dtype=torch.int8))
    w = fill(fill(w, 0, 2, [7, 7, 7, 7]), 1, 1, [8, 8, 8, 8])
    w2 = bb.slide(w, torch.tensor([2, 1]))
    assert states(w2, 0) == ["active", "dummy", "dummy"] and states(w2, 1) == ["active", "dummy", "dummy"]
    assert w2.tokens[0, 0].tolist() == [7] * 4 and w2.tokens[1, 0].tolist() == [8] * 4
    assert w2.front.tolist() == [3, 2] and (w2.tokens[:, 1:] == M).all()


def test_finished_needs_a_stop_or_the_last_block_and_everything_before_complete():
    w = window(prompts=([1, 2, 3, 4],), max_new=8, slots=2, B=4)  # blocks 1 and 2
    no = torch.tensor([NO_STOP])
    assert not bb.finished(w, no).any()
    assert not bb.finished(w, torch.tensor([1])).any()  # stop in block 1, but block 1 has masks
    w = fill(w, 0, 0, [5, 6, 2, 7])
    assert bb.finished(w, torch.tensor([1])).all()
    assert not bb.finished(w, no).any()  # block 2 not admitted yet
    w, _ = bb.activate(w, torch.zeros(1, dtype=torch.bool), tau_add=0.1)
    assert bb.finished(w, torch.tensor([1])).all()  # a block after the stop's block does not matter
    assert not bb.finished(w, no).any()
    assert bb.finished(fill(w, 0, 1, [1, 1, 1, 1]), no).all()


def test_release_turns_finished_rows_into_dummies():
    w = window(prompts=([1, 2], [3, 4]), slots=2)
    w2 = bb.release(w, torch.tensor([True, False]))
    assert states(w2, 0) == ["dummy", "dummy"] and states(w2, 1) == ["active", "dummy"]
    assert (w2.tokens[0] == M).all() and not w2.editable[0].any() and w2.editable[1].any()
