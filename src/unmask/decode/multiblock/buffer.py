"""The Block Buffer slot state machine (multiblock.md §3.1–3.3) as pure tensor functions.

Each of R rows owns a window of S = N_buf slots of B tokens. Slot i of row r holds block
``front[r] + i``, the block covering absolute positions ``(front + i) * B .. (front + i) * B + B - 1``
(positions count from the row's first real prompt token). A slot moves through

    DUMMY -> ACTIVE -> TO_CACHE -> (IN_CACHE: popped from the front, a DUMMY appended at the tail)

Non-dummy slots form a prefix of the window, and TO_CACHE slots form a prefix of those, because a
block may only be marked to-cache when its predecessor is to-cache or in-cache. IN_CACHE is never
stored: a block is popped in the same step that makes it in-cache.

Every function here takes tensors (and a :class:`Window`) and returns new ones; nothing touches
a model. The decoder (:mod:`unmask.decode.multiblock.window`) runs one forward between
:func:`activate` and :func:`transition` and owns the KV cache.

Readings of the spec (our choices, see multiblock.md §7):

- progress and same_token_ratio count a non-editable position (prompt tail, or a position past
  ``max_new_tokens`` that stays ``[MASK]`` and is never decoded) as filled;
- the τ_semi gate of slot i reads slot i-1's progress as the forward saw it (before this step's
  commits), since every block of a step is updated from one forward;
- at most one block is activated per step (§3.3 step 1).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
from torch import Tensor

DUMMY, ACTIVE, TO_CACHE, IN_CACHE = 0, 1, 2, 3
STATE_NAMES = {DUMMY: "dummy", ACTIVE: "active", TO_CACHE: "to-cache", IN_CACHE: "in-cache"}
NO_STOP = torch.iinfo(torch.long).max  # stop_block value of a row without a stop token


@dataclass(frozen=True)
class Window:
    """The slots of every row plus the per-row constants the transitions need.

    state: (R, S) int8, one of DUMMY / ACTIVE / TO_CACHE.
    tokens: (R, S, B) long; ``mask_id`` at masked positions and everywhere in dummy slots.
    editable: (R, S, B) bool; False on prompt positions, on positions >= gen_end and in dummies.
    argmax: (R, S, B) long; the top-1 of the latest forward (same_token_ratio reads it).
    edit_steps: (R, S) long; steps in which a complete active block was still edited by T2T.
    front: (R,) long; block index of slot 0.
    admitted: (R,) long; highest block index activated so far.
    gen_start: (R,) long; first generated position (the prompt length).
    gen_end: (R,) long; one past the last position that may be generated.
    mask_id: the ``[MASK]`` token id.
    """

    state: Tensor
    tokens: Tensor
    editable: Tensor
    argmax: Tensor
    edit_steps: Tensor
    front: Tensor
    admitted: Tensor
    gen_start: Tensor
    gen_end: Tensor
    mask_id: int

    @property
    def block_size(self) -> int:
        return self.tokens.shape[-1]

    @property
    def slots(self) -> int:
        return self.tokens.shape[1]

    @property
    def last_block(self) -> Tensor:
        """(R,) long: index of the block holding the last position that may be generated."""
        return torch.div(self.gen_end - 1, self.block_size, rounding_mode="floor")

    def positions(self) -> Tensor:
        """(R, S, B) long absolute positions of every window token (dummies: the next ones)."""
        R, S, B = self.tokens.shape
        flat = self.front[:, None] * B + torch.arange(S * B, device=self.front.device)  # (R, S*B)
        return flat.view(R, S, B)

    def map(self, fn) -> "Window":
        """This window with every per-row tensor ``t`` (every field but ``mask_id``) replaced by ``fn(name, t)``."""
        return replace(self, **{f.name: fn(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "mask_id"})

    def describe(self, row: int) -> list[str]:
        """Slot states of one row as names, e.g. ``["to-cache", "active", "dummy"]`` (tests, traces)."""
        return [STATE_NAMES[int(s)] for s in self.state[row].tolist()]


def initial_window(prompts: list[list[int]], max_new_tokens: int | list[int], slots: int, block_size: int,
                   mask_id: int, device=None) -> Window:
    """The window after prefill (multiblock.md §3.2); ``max_new_tokens``: one per prompt, or one for all.

    The whole prompt blocks (``len(prompt) // B`` of them) are prefilled by the caller. Slot 0 is
    the first block that is not: it holds the prompt's tail (non-editable) followed by masks, or
    only masks when the prompt fills whole blocks. Every other slot is a dummy.
    """
    R, S, B = len(prompts), slots, block_size
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)  # (R,)
    front = torch.div(lens, B, rounding_mode="floor")  # (R,) whole prompt blocks
    tokens = torch.full((R, S, B), mask_id, dtype=torch.long, device=device)  # (R, S, B)
    for r, p in enumerate(prompts):
        tail = p[int(front[r]) * B:]
        if tail:
            tokens[r, 0, : len(tail)] = torch.tensor(tail, dtype=torch.long, device=device)
    state = torch.full((R, S), DUMMY, dtype=torch.int8, device=device)  # (R, S)
    state[:, 0] = ACTIVE
    w = Window(state=state, tokens=tokens, editable=torch.zeros((R, S, B), dtype=torch.bool, device=device),
               argmax=tokens.clone(), edit_steps=torch.zeros((R, S), dtype=torch.long, device=device),
               front=front, admitted=front.clone(), gen_start=lens,
               gen_end=lens + torch.as_tensor(max_new_tokens, dtype=torch.long, device=device), mask_id=mask_id)
    return replace(w, editable=_editable(w) & (state != DUMMY)[..., None])


def _editable(w: Window) -> Tensor:
    """(R, S, B) bool: the positions in [gen_start, gen_end), whatever the slot state."""
    pos = w.positions()  # (R, S, B)
    return (pos >= w.gen_start[:, None, None]) & (pos < w.gen_end[:, None, None])


def masked(w: Window) -> Tensor:
    """(R, S, B) bool: editable positions that still hold ``[MASK]``."""
    return w.editable & (w.tokens == w.mask_id)


def progress(w: Window) -> Tensor:
    """(R, S) float: fraction of each block's B positions that are filled (non-editable count as filled)."""
    return (~masked(w)).float().mean(dim=-1)


def complete(w: Window) -> Tensor:
    """(R, S) bool: no editable ``[MASK]`` left (dummy slots are trivially complete)."""
    return ~masked(w).any(dim=-1)


def same_token_ratio(w: Window) -> Tensor:
    """(R, S) float: among filled editable positions, the fraction whose latest argmax equals the
    current token; 1.0 when there is nothing to compare (multiblock.md §3.1)."""
    filled = w.editable & (w.tokens != w.mask_id)  # (R, S, B)
    same = (filled & (w.argmax == w.tokens)).sum(dim=-1)  # (R, S)
    n = filled.sum(dim=-1)  # (R, S)
    return torch.where(n > 0, same.float() / n.clamp(min=1), torch.ones_like(same, dtype=torch.float32))


def activate(w: Window, closed: Tensor, *, tau_add: float, tau_stable: float = 0.0) -> tuple[Window, Tensor]:
    """Step 1 of multiblock.md §3.3: turn at most one dummy slot per row ACTIVE (fully masked).

    With b_last the last non-dummy slot, the first dummy slot is activated when progress(b_last)
    >= tau_add, same_token_ratio(b_last) >= tau_stable, b_last is not the row's last block and the
    row is not ``closed`` (a stop token was generated, or the row is finished). Backup rule: a row
    whose slots are all dummies activates slot 0 unless closed or past its last block.

    closed: (R,) bool. Returns the new window and ``activated`` (R, S) bool.
    """
    R, S, _ = w.tokens.shape
    real = w.state != DUMMY  # (R, S)
    n_real = real.sum(dim=1)  # (R,) non-dummy slots form a prefix
    last = (n_real - 1).clamp(min=0)[:, None]  # (R, 1) slot index of b_last
    prog = progress(w).gather(1, last)[:, 0]  # (R,)
    ratio = same_token_ratio(w).gather(1, last)[:, 0]  # (R,)
    last_blk = w.front + n_real - 1  # (R,) block index of b_last
    main = (n_real > 0) & (n_real < S) & (prog >= tau_add) & (ratio >= tau_stable) & (last_blk < w.last_block)
    backup = (n_real == 0) & (w.front <= w.last_block)
    go = (main | backup) & ~closed  # (R,)
    slot = torch.arange(S, device=w.state.device)  # (S,)
    new = go[:, None] & (slot[None, :] == n_real[:, None])  # (R, S) the first dummy slot
    state = torch.where(new, torch.tensor(ACTIVE, dtype=torch.int8, device=w.state.device), w.state)
    editable = torch.where(new[..., None], _editable(w), w.editable)  # (R, S, B)
    tokens = torch.where(new[..., None], torch.full_like(w.tokens, w.mask_id), w.tokens)
    admitted = torch.where(go, torch.maximum(w.admitted, w.front + n_real), w.admitted)
    return replace(w, state=state, editable=editable, tokens=tokens, admitted=admitted), new


def m2t(mask: Tensor, kappa: Tensor, gate: Tensor, tau: float) -> Tensor:
    """Mask-to-token commits (multiblock.md §3.3 step 3, Diffulex naive sampler).

    mask: (..., B) bool, the positions that may be committed; kappa: (..., B) float confidence of
    each candidate; gate: (...) bool, True where the forced top-1 is allowed (the predecessor is
    semi-complete, cached, or absent). Every masked position with kappa > tau (strict) is committed;
    if none qualifies and the gate is open, the single most confident one (ties to the lower
    position). Returns (..., B) bool.
    """
    above = mask & (kappa > tau)  # (..., B)
    score = kappa.masked_fill(~mask, float("-inf"))  # (..., B)
    top = torch.zeros_like(mask).scatter(-1, score.argmax(dim=-1, keepdim=True), True)  # (..., B) one-hot
    forced = gate & mask.any(dim=-1) & ~above.any(dim=-1)  # (...)
    return above | (top & mask & forced[..., None])


def t2t(filled: Tensor, tokens: Tensor, top1: Tensor, kappa: Tensor, tau: float) -> Tensor:
    """Token-to-token edits (multiblock.md §3.3 step 4): filled positions whose argmax differs from the
    current token with kappa > tau. All arguments (..., B); returns (..., B) bool."""
    return filled & (top1 != tokens) & (kappa > tau)


class StepInfo(NamedTuple):
    """What one :func:`transition` did; tensors are in the slot order *before* the slide."""

    committed: Tensor  # (R, S, B) bool, M2T commits
    edited: Tensor     # (R, S, B) bool, T2T edits
    marked: Tensor     # (R, S) bool, slots newly marked TO_CACHE
    popped: Tensor     # (R,) long, slots popped from the front (their K/V were stored by this forward)


def transition(w: Window, top1: Tensor, kappa: Tensor, *, tau_m2t: float, tau_semi: float,
               tau_t2t: float | None = None, max_post_edit_steps: int = 16) -> tuple[Window, StepInfo]:
    """Steps 3–6 of multiblock.md §3.3, applied after the forward of window ``w``.

    top1, kappa: (R, S, B) candidate token and its confidence at every window position.
    The slots that were TO_CACHE when ``w`` was forwarded had their K/V stored by that forward, so
    they are popped here (IN_CACHE) and dummies appended. Returns the new window and a StepInfo.
    """
    R, S, B = w.tokens.shape
    active = w.state == ACTIVE  # (R, S)
    cand = masked(w) & active[..., None]  # (R, S, B)
    prog = progress(w)  # (R, S) snapshot the forward saw
    semi = torch.ones_like(active)  # slot 0: predecessor in cache (or none)
    semi[:, 1:] = prog[:, :-1] >= tau_semi
    commit = m2t(cand, kappa, semi, tau_m2t)  # (R, S, B)
    tokens = torch.where(commit, top1, w.tokens)
    if tau_t2t is None:
        edit = torch.zeros_like(commit)
    else:
        filled = w.editable & (w.tokens != w.mask_id) & active[..., None]  # committed in earlier steps
        edit = t2t(filled, tokens, top1, kappa, tau_t2t)
    tokens = torch.where(edit, top1, tokens)
    real = w.state != DUMMY
    argmax = torch.where(real[..., None], top1, torch.full_like(top1, w.mask_id))
    w2 = replace(w, tokens=tokens, argmax=argmax)

    # Step 5: mark to-cache (a prefix of the window, see the module docstring).
    done = active & complete(w2)  # (R, S)
    edited = edit.any(dim=-1)  # (R, S)
    ready = done & (~edited | (w.edit_steps >= max_post_edit_steps))
    edit_steps = w.edit_steps + (done & edited).long()
    ok = (w.state == TO_CACHE) | ready  # (R, S)
    run = ok.long().cumprod(dim=1).bool()  # (R, S) leading run
    marked = run & active
    state = torch.where(marked, torch.tensor(TO_CACHE, dtype=torch.int8, device=w.state.device), w.state)
    w2 = replace(w2, state=state, edit_steps=edit_steps)

    # Step 6: pop the slots stored by this forward (TO_CACHE before it).
    popped = (w.state == TO_CACHE).long().cumprod(dim=1).sum(dim=1)  # (R,)
    return slide(w2, popped), StepInfo(committed=commit, edited=edit, marked=marked, popped=popped)


def slide(w: Window, n: Tensor) -> Window:
    """Pop ``n`` (R,) slots from the front of each row and append as many dummies at the tail."""
    R, S, B = w.tokens.shape
    src = torch.arange(S, device=w.state.device)[None, :] + n[:, None]  # (R, S) source slot
    keep = src < S  # (R, S)
    src = src.clamp(max=S - 1)

    def take(x: Tensor, fill) -> Tensor:
        idx = src.view(R, S, *([1] * (x.dim() - 2))).expand_as(x)  # (R, S, ...)
        return torch.where(keep.view(R, S, *([1] * (x.dim() - 2))), x.gather(1, idx), fill)

    return replace(w, state=take(w.state, torch.tensor(DUMMY, dtype=torch.int8, device=w.state.device)),
                   tokens=take(w.tokens, w.mask_id), editable=take(w.editable, False),
                   argmax=take(w.argmax, w.mask_id), edit_steps=take(w.edit_steps, 0), front=w.front + n)


def finished(w: Window, stop_block: Tensor) -> Tensor:
    """Termination (multiblock.md §3.3 step 7): (R,) bool.

    A row is finished when a stop token was generated (``stop_block`` (R,) is the block index of
    its first stop token, :data:`NO_STOP` if none) or its last block was admitted, **and** every
    block up to that point (the stop's block, or the last block) is complete. Blocks after a stop
    token's block do not matter: the output is cut before the stop token.
    """
    stopped = stop_block != NO_STOP  # (R,)
    limit = torch.where(stopped, stop_block, w.last_block)  # (R,)
    blocks = w.front[:, None] + torch.arange(w.slots, device=w.front.device)[None, :]  # (R, S)
    relevant = (w.state != DUMMY) & (blocks <= limit[:, None])
    all_done = ~(relevant & ~complete(w)).any(dim=1)
    return (stopped | (w.admitted >= w.last_block)) & all_done


def release(w: Window, rows: Tensor) -> Window:
    """Turn every slot of the finished ``rows`` (R,) bool into a dummy (they keep the static shape)."""
    r2 = rows[:, None]
    return replace(w, state=torch.where(r2, torch.tensor(DUMMY, dtype=torch.int8, device=w.state.device), w.state),
                   tokens=torch.where(r2[..., None], w.mask_id, w.tokens),
                   editable=w.editable & ~r2[..., None], edit_steps=torch.where(r2, 0, w.edit_steps))
