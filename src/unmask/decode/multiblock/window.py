"""Multi-Block Diffusion decoding with the Block Buffer engine (multiblock.md §3; MBD-LMs §3.3,
App. C, Alg. 5): its knobs (:class:`MultiBlockOptions`) and the pieces of one step that its running
batch (:mod:`unmask.decode.multiblock.batch`) calls.

Every row keeps N_buf slots of B tokens after its exact prefix cache: the running set (active
blocks being denoised, then complete blocks waiting to be cached) followed by dummy slots that
keep the shape static. Each step runs **one** forward over all N_buf·B slot tokens of every row
(block-causal: a slot sees the prefix, earlier slots and itself, so trailing dummies are
invisible to real blocks). That forward also yields the clean K/V of the blocks marked
to-cache in the previous step; they are kept, everything else is cropped. The slot state machine
itself (activation, M2T/T2T, to-cache, slide, termination) is pure and lives in
:mod:`unmask.decode.multiblock.buffer`.

Prompt alignment, as in :mod:`unmask.decode.blocks.single`: blocks start at multiples of B from each
row's first prompt token, the whole prompt blocks are prefilled and the prompt's tail sits, fixed,
in the first active block (§3.2).

Batching: rows advance independently, one forward per step for the whole batch. Each row stores
its own to-cache slots; the cache keeps as many columns as the row storing the most needs, and
the columns a row did not store are masked out for it (they play the part of §3.6's scratch page).
A finished row turns into dummies, stays in the forward (static shape) and stops counting NFE.

NFE counts every step forward a row takes part in (prefill excluded), including forwards whose
only effect for the row is storing a block: with N_buf = 1 this is exactly the SingleBD storing
bubble, and ``slots=1`` reproduces :mod:`unmask.decode.blocks.single` (``store="separate"``, threshold
policy with τ = τ_M2T) token for token and forward for forward.

The window forward has the same shape (R, N_buf·B) at every step, so ``compile=True`` runs it through
one ``torch.compile``-d graph over a static cache (multiblock.md §3.6; :func:`unmask.decode.multiblock.batch.batch`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from unmask.decode.blocks.single import check_block_model, resolve_block_size
from unmask.decode.engine.registry import Config, knob
from unmask.decode.multiblock import buffer as bb
from unmask.errors import UnmaskError, is_int, is_number
from unmask.masks import block_buffer_mask
from unmask.sampling import Sampling, sample
from unmask.trace import host_event

# The resolved value of each knob left unset (multiblock.md §3.5: the LLaDA2-Mini MultiBD row).
DEFAULTS = {"slots": 2, "tau_add": 0.1, "tau_semi": 0.9, "tau_m2t": 0.95, "tau_stable": 0.0}


@dataclass(frozen=True)
class MultiBlockOptions(Config):
    """Multi-Block Diffusion's knobs (multiblock.md §3.3), None = the default (:data:`DEFAULTS`);
    :meth:`resolve` gives the config a batch runs, every knob set. Keep ``slots`` (N_buf) <= the G_max
    the model was trained with; Table 4 uses ``tau_add`` 0.9 for code. ``max_post_edit_steps`` (not a
    knob): a complete block still being edited is cached after this many steps. Construction raises
    UnmaskError for a value out of range (the block size is checked against the model's by resolve).
    """

    block_size: int | None = knob("block size B (default: the model's native block)", low=1, short="-k")
    slots: int | None = knob("Block Buffer slots N_buf (default 2; at most the G_max the model was trained with)",
                             low=1)
    tau_add: float | None = knob("fill ratio that activates the next block (default 0.1)", low=0, high=1)
    tau_semi: float | None = knob("fill ratio of the preceding block that allows a forced commit (default 0.9)",
                                  low=0, high=1)
    tau_m2t: float | None = knob("mask-to-token commit threshold (default 0.95)", low=0, high=1)
    tau_t2t: float | None = knob("token-to-token edit threshold (off when unset)", low=0, high=1)
    tau_stable: float | None = knob("same-token ratio a block needs before the next one activates (default 0: off)",
                                    low=0, high=1, cli=False)
    max_nfe: int | None = knob("forwards at most per row", low=1, cli=False)
    max_post_edit_steps: int = 16

    def __post_init__(self):
        if self.slots is not None and (not is_int(self.slots) or self.slots < 1):
            raise UnmaskError(f"--slots must be an integer >= 1 (got {self.slots!r}); "
                              "1 is SingleBD, 2 the usual buffer")
        for name in ("tau_add", "tau_semi", "tau_m2t", "tau_t2t", "tau_stable"):
            v = getattr(self, name)
            if v is not None and (not is_number(v) or not 0.0 <= v <= 1.0):
                raise UnmaskError(f"--{name.replace('_', '-')} must be a number in [0, 1] (got {v!r}); thresholds "
                                  "are probabilities or fill ratios")
        if self.max_nfe is not None and (not is_int(self.max_nfe) or self.max_nfe < 1):
            raise UnmaskError(f"max_nfe must be an integer >= 1 (got {self.max_nfe!r}); leave it unset for no cap")
        if not is_int(self.max_post_edit_steps) or self.max_post_edit_steps < 0:
            raise UnmaskError(f"max_post_edit_steps must be an integer >= 0 (got {self.max_post_edit_steps!r})")

    def resolve(self, bundle) -> "MultiBlockOptions":
        """These options with every unset knob resolved: the checkpoint's block size (which an
        explicit one must equal), :data:`DEFAULTS`. Raises UnmaskError for a model that is not
        block-diffusion or a block size that disagrees with the checkpoint's."""
        check_block_model(bundle, "multiblock")
        unset = {k: v for k, v in DEFAULTS.items() if getattr(self, k) is None}
        return replace(self, block_size=resolve_block_size(bundle, self.block_size), **unset)


def candidates(logits: torch.Tensor, sampling: Sampling, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate token and its confidence at every position: logits (..., V) -> (tokens, kappa) (...).

    Greedy (T = 0): the argmax and its softmax probability (Diffulex). T > 0: a token drawn after
    top-k/top-p filtering, with its probability under the untempered, unfiltered softmax: the
    commit thresholds then read the same κ as at T = 0, so decoding tends to the greedy run as
    T -> 0 (under softmax(logits / T) every κ rounds to 1 at T = 1e-3 and whole blocks commit at
    once; policies.py's default, issue 28 item 8).
    """
    if sampling.greedy:  # token_stats' top-1 and confidence, without its entropy and margin
        q = torch.log_softmax(logits.reshape(1, -1, logits.shape[-1]).float(), dim=-1).exp()  # (1, n, V)
        return q.argmax(-1).view(logits.shape[:-1]), q.amax(-1).view(logits.shape[:-1])
    tokens = sample(logits, sampling, generator)  # (...)
    log_q = torch.log_softmax(logits.float(), dim=-1)  # (..., V) untempered: κ as at T = 0
    return tokens, log_q.gather(-1, tokens[..., None])[..., 0].exp()


def window_mask(key_valid: torch.Tensor, past: int, n_slots: int, B: int) -> torch.Tensor:
    """The mask of a forward of ``n_slots`` blocks after ``past`` cached keys: (R, 1, q, past + q)
    bool, q = n_slots·B. Equals ``with_key_padding(block_buffer_mask(past, n_slots, B), key_valid)``
    (multiblock.md §3.1: each block sees the valid cached keys, earlier blocks and itself) when the
    query columns ``key_valid[:, past:past + q]`` are True: no query row is then left empty.
    key_valid (R, C >= past + q) bool."""
    R, q = key_valid.shape[0], n_slots * B
    m = key_valid[:, None, None, : past + q].expand(R, 1, q, past + q).clone()  # (R, 1, q, past + q)
    m[..., past:] &= block_buffer_mask(0, n_slots, B, device=key_valid.device)  # (q, q) block-causal window
    return m


def window_step(kv, key_valid: torch.Tensor, w: bb.Window, keep: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One Block Buffer forward (multiblock.md §3.3 step 2) of window ``w`` after ``kv``'s keys.

    Every row's S·B slot tokens go through :func:`window_mask`; the forward also yields the
    clean K/V of each row's to-cache slots (a prefix of its window). The cache keeps as many
    columns as the row storing the most needs, the rest is cropped, and ``key_valid`` (R, C >=
    kv.length + S·B) marks the kept columns a row did not store as scratch (§3.6). Returns the
    logits (R, S·B, V) and ``stored`` (R,) long, the to-cache slots of each row. ``keep``: the
    most to-cache slots of any row, when the caller knows it (spares a host read).
    """
    R, S, B = w.tokens.shape
    stored = (w.state == bb.TO_CACHE).sum(dim=1)  # (R,) to-cache slots form a prefix
    past = kv.length
    ids = w.tokens.view(R, S * B)  # (R, S*B)
    positions = w.positions().view(R, S * B)  # (R, S*B)
    key_valid[:, past: past + S * B] = True  # the window's own columns
    logits = kv.forward(ids, positions, window_mask(key_valid, past, S, B))  # (R, S*B, V)
    keep = int(stored.max()) if keep is None else keep
    kv.crop((S - keep) * B)
    cols = torch.arange(keep * B, device=key_valid.device)  # (keep*B,)
    key_valid[:, past: past + keep * B] = cols[None, :] < (stored * B)[:, None]  # other rows: scratch
    return logits, stored


def write_window(seq: torch.Tensor, w: bb.Window) -> None:
    """Write the real slots of ``w`` into the row sequences ``seq`` (R, L) in place (dummies leave
    ``seq`` alone; popped blocks were written when they were complete: to-cache blocks never change)."""
    R, S, B = w.tokens.shape
    flat = w.positions().view(R, S * B)  # (R, S*B)
    real = (w.state != bb.DUMMY)[..., None].expand(R, S, B).reshape(R, S * B)  # (R, S*B)
    seq.scatter_(1, flat, torch.where(real, w.tokens.view(R, S * B), seq.gather(1, flat)))


def stop_blocks(stop_pos: torch.Tensor, length: int, B: int) -> torch.Tensor:
    """(R,) long block index of each row's first stop token (:func:`first_stop`'s ``stop_pos``
    (R,); ``length`` = no stop), :data:`block_buffer.NO_STOP` where there is none."""
    return torch.where(stop_pos < length, torch.div(stop_pos, B, rounding_mode="floor"),
                       torch.full_like(stop_pos, bb.NO_STOP))


def event_columns(read, before: bb.Window, info: bb.StepInfo, top1: torch.Tensor, w: bb.Window) -> None:
    """Add what :func:`row_event` reads of one step to the step's one host read ``read``
    (:class:`~unmask.decode.engine.host.HostRead`): ``committed``, ``edited``, ``top1`` (S·B each,
    slot-major), the slot ``states``, ``before``'s ``front`` and ``w``'s generation ``start`` and ``end``."""
    R, S, B = top1.shape
    read.add("committed", info.committed.view(R, S * B)).add("edited", info.edited.view(R, S * B))
    read.add("top1", top1.view(R, S * B)).add("states", before.state).add("front", before.front)
    read.add("start", w.gen_start).add("end", w.gen_end)


def row_event(step: int, row: int, got: dict, slot: int, B: int, mask_id: int) -> dict:
    """The ``on_step`` event of one row after one step (``unmask.trace`` contract plus the Block
    Buffer view: ``edited``, ``slots``, ``blocks``, ``running_set``), from the host read ``got`` (by
    name, :func:`event_columns` plus ``seq``, the sequence after the write-back, and ``size``, |R_s|)
    at ``slot``; ``row`` the event's row index."""
    front, start, end, states = (got[k][slot] for k in ("front", "start", "end", "states"))
    first = front * B - start  # generated index of the window's first token
    return host_event(step, row, got["committed"][slot], got["top1"][slot], first, got["seq"][slot][start:end],
                      mask_id, edited=[first + i for i, e in enumerate(got["edited"][slot]) if e],
                      slots=[bb.STATE_NAMES[s] for s in states], blocks=[front + i for i in range(len(states))],
                      running_set=got["size"][slot])


__all__ = ["DEFAULTS", "MultiBlockOptions", "candidates", "event_columns", "row_event", "stop_blocks", "window_mask",
           "window_step", "write_window"]
