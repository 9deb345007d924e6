"""Multi-Block Diffusion decoding with the Block Buffer engine (multiblock.md §3; MBD-LMs §3.3,
App. C, Alg. 5).

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

The cache is a :mod:`unmask.decode.engine.kv` object (multiblock.md §3.6): a growing ``DynamicCache`` by
default, or (``static=True`` / ``compile=True``) a ``StaticCache`` sized once per batch whose
pointer moves on each crop; the window forward has the same shape (R, N_buf·B) at every step, so
``compile=True`` runs it through one ``torch.compile``-d graph. One loop runs on either cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unmask.decode.multiblock import buffer as bb
from unmask.decode.blocks.single import (check_block_model, check_cache_flags, hit_stop_string, outputs, resolve_block_size,
                                 window_forward)
from unmask.decode.dllm.canvas import drain_prompts, event_hook
from unmask.decode.engine.stats import DecodeOutput
from unmask.errors import UnmaskError, is_int, is_number
from unmask.sampling import Sampling, sample
from unmask.trace import host_event
from unmask.decode.engine.registry import Config, knob


@dataclass(frozen=True)
class MultiBlockConfig:
    """Block Buffer settings (multiblock.md §3.3, defaults §3.5: the LLaDA2-Mini MultiBD row).

    slots: N_buf (2; keep it <= the G_max the model was trained with). tau_add: progress of the
    last running block that admits the next one (0.1; Table 4 uses 0.9 for code). tau_semi:
    progress of the predecessor that allows the forced top-1 commit (0.9). tau_m2t: M2T commit
    threshold, strict (0.95). tau_t2t: T2T edit threshold, None = no edits. tau_stable:
    same_token_ratio gate on activation (0 = off). max_nfe: per-row forward cap (None = none).
    max_post_edit_steps: a complete block still being edited is cached after this many steps.
    """

    block_size: int
    slots: int = 2
    tau_add: float = 0.1
    tau_semi: float = 0.9
    tau_m2t: float = 0.95
    tau_t2t: float | None = None
    tau_stable: float = 0.0
    max_nfe: int | None = None
    max_post_edit_steps: int = 16

    def __post_init__(self):
        if not is_int(self.block_size) or self.block_size < 1:
            raise UnmaskError(f"block size must be an integer >= 1 (got {self.block_size!r}); "
                              "drop --block-size to use the checkpoint's")
        if not is_int(self.slots) or self.slots < 1:
            raise UnmaskError(f"--slots must be an integer >= 1 (got {self.slots!r}); "
                              "1 is SingleBD, 2 the usual buffer")
        for name in ("tau_add", "tau_semi", "tau_m2t", "tau_t2t", "tau_stable"):
            v = getattr(self, name)
            if v is None and name == "tau_t2t":
                continue
            if not is_number(v) or not 0.0 <= v <= 1.0:
                raise UnmaskError(f"--{name.replace('_', '-')} must be a number in [0, 1] (got {v!r}); thresholds "
                                  "are probabilities or fill ratios")
        if self.max_nfe is not None and (not is_int(self.max_nfe) or self.max_nfe < 1):
            raise UnmaskError(f"max_nfe must be an integer >= 1 (got {self.max_nfe!r}); leave it unset for no cap")
        if not is_int(self.max_post_edit_steps) or self.max_post_edit_steps < 0:
            raise UnmaskError(f"max_post_edit_steps must be an integer >= 0 (got {self.max_post_edit_steps!r})")

    @classmethod
    def from_options(cls, bundle, *, block_size=None, **options) -> "MultiBlockConfig":
        """Build from CLI-style options (None = default); raises UnmaskError for invalid values."""
        given = {k: v for k, v in options.items() if v is not None}
        return cls(block_size=resolve_block_size(bundle, block_size), **given)


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


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (), block_size: int | None = None,
           slots: int | None = None, tau_add: float | None = None, tau_semi: float | None = None,
           tau_m2t: float | None = None, tau_t2t: float | None = None, tau_stable: float | None = None,
           max_nfe: int | None = None, on_forward=None, on_step=None, compile: bool = False,
           static: bool = False) -> DecodeOutput:
    """Block Buffer decoding of a batch (multiblock.md §3.2–3.3), one static-shape forward per step.

    prompts: token ids per row. A row finishes when a stop token was generated (or its last block
    admitted) and every block up to it is complete (Diffulex termination, §3.3 step 7), on a stop
    string in its completed blocks, or at ``max_nfe``; its output is cut before the first stop
    token. Every step forward has input shape (R, slots * B). ``on_forward(state)`` (tests) sees
    each forward's inputs, logits, the window before the forward, and the cache after it.
    ``on_step(event)`` (``unmask.trace`` contract) gets one event per live row per step: ``step``,
    ``row``, ``positions`` / ``tokens`` (M2T commits, generated indices), ``edited`` (T2T edits),
    ``canvas`` (None where masked), and the Block Buffer view: ``slots`` (state of every slot at
    the forward, e.g. ``["to-cache", "active", "dummy"]``), ``blocks`` (their block indices) and
    ``running_set`` (|R_s|).

    ``compile=True`` takes the fast path (multiblock.md §3.6): a static KV cache allocated once per
    batch, whose pointer moves instead of cropping, and the window forward through a
    ``torch.compile``-d step (inductor on CPU, CUDA graphs on CUDA;
    :func:`unmask.decode.engine.static.step_function`); the prefill runs eagerly. ``static=True`` runs on
    the preallocated static cache without compiling: what compile runs, eagerly (tests,
    debugging). Both give the eager tokens, NFE and statistics. The cache holds the prefill, the
    longest row's blocks and one window: L = F + (blocks + N_buf)·B, rounded up to
    ``LENGTH_BUCKET``; rows store in different steps, leaving holes under the shared pointer, so a
    full cache is compacted in place (:func:`unmask.decode.engine.kv.compact`). Every forward's mask covers all of it,
    (R, 1, N_buf·B, L).

    Returns DecodeOutput. stats.extra: the thresholds, ``accepts`` (histogram of M2T commits per
    row per step), ``mean_running_set`` (running-set size |R_s| averaged over row-steps), ``edits``,
    and ``row_extra`` per row: ``running_set`` (|R_s| at each of its steps), ``mean_running_set``,
    ``accepts`` (commits per step), ``edits``. Raises UnmaskError for a model that is not
    block-diffusion, slots < 1, a threshold outside [0, 1] or a block size that disagrees with the
    checkpoint's. On the static path stats.extra also has ``compiled`` and ``static_cache`` (L).
    """
    check_block_model(bundle, "multiblock")
    check_cache_flags(compile, static)
    cfg = MultiBlockConfig.from_options(bundle, block_size=block_size, slots=slots, tau_add=tau_add,
                                        tau_semi=tau_semi, tau_m2t=tau_m2t, tau_t2t=tau_t2t, tau_stable=tau_stable,
                                        max_nfe=max_nfe)
    from unmask.decode.multiblock.batch import MultiBlockDecoder

    def make(capacity):
        return MultiBlockDecoder(bundle, cfg, static=static, compile=compile, capacity=capacity, drained=True,
                                 on_step=event_hook(on_step), on_forward=on_forward, stop_token_ids=tuple(stop_token_ids))

    return drain_prompts(make, bundle, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                         stop_strings=stop_strings)


def window_step(kv, key_valid: torch.Tensor, w: bb.Window, keep: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One Block Buffer forward (multiblock.md §3.3 step 2) of window ``w`` after ``kv``'s keys.

    Every row's S·B slot tokens go through :func:`window_forward`; the forward also yields the
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
    logits = window_forward(kv, key_valid, ids, positions, S, B)  # (R, S*B, V)
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


def event_columns(before: bb.Window, info: bb.StepInfo, top1: torch.Tensor, w: bb.Window) -> torch.Tensor:
    """What :func:`row_event` reads of one step, packed for the step's one host read: (R, 3·S·B + S + 3)
    long: committed, edited, top-1 (S·B each, slot-major), the slot states, then ``before``'s front
    and ``w``'s generation start and end."""
    R, S, B = top1.shape
    return torch.cat([info.committed.view(R, S * B).long(), info.edited.view(R, S * B).long(), top1.view(R, S * B),
                      before.state.long(), torch.stack([before.front, w.gen_start, w.gen_end], 1)], 1)


def row_event(step: int, row: int, got: list[int], seq: list[int], slots: int, B: int, mask_id: int,
              running_set: int) -> dict:
    """The ``on_step`` event of one row after one step (``unmask.trace`` contract plus the Block
    Buffer view: ``edited``, ``slots``, ``blocks``, ``running_set``), from host lists: ``got`` its
    :func:`event_columns`, ``seq`` its sequence after the write-back; ``row`` the event's row index."""
    n = slots * B
    committed, edited, top1 = got[:n], got[n: 2 * n], got[2 * n: 3 * n]
    states, (front, start, end) = got[3 * n: 3 * n + slots], got[3 * n + slots: 3 * n + slots + 3]
    first = front * B - start  # generated index of the window's first token
    return host_event(step, row, committed, top1, first, seq[start:end], mask_id,
                      edited=[first + i for i, e in enumerate(edited) if e], slots=[bb.STATE_NAMES[s] for s in states],
                      blocks=[front + i for i in range(slots)], running_set=running_set)


def stop_string_rows(bundle, prompts, seq, seq_pos, w, stops, max_new_tokens, rows, checked, stop_strings):
    """Rows whose completed blocks (the contiguous complete prefix of the output) contain a stop
    string. Only rows whose complete prefix grew since the last check are decoded."""
    B = w.block_size
    undecided = (seq == w.mask_id) & (seq_pos >= w.gen_start[:, None]) & (seq_pos < w.gen_end[:, None])  # (R, L)
    first_mask = torch.where(undecided.any(dim=1), undecided.float().argmax(dim=1), w.gen_end)  # (R,)
    complete_end = torch.where(first_mask >= w.gen_end, w.gen_end,
                               torch.div(first_mask, B, rounding_mode="floor") * B)  # (R,) end of complete blocks
    grew = rows & (complete_end > checked)
    if not bool(grew.any()):
        return torch.zeros_like(rows)
    checked.copy_(torch.where(grew, complete_end, checked))
    cut = seq.masked_fill(seq_pos >= complete_end[:, None], w.mask_id)
    return hit_stop_string(bundle, prompts, outputs(cut, w.gen_start, max_new_tokens, stops, w.mask_id), grew,
                           stop_strings)



@dataclass(frozen=True)
class MultiBlockOptions(Config):
    """Multi-Block Diffusion's knobs (spec/multiblock.md §3, Table 4 defaults)."""

    block_size: int | None = knob("block size B (default: the model's native block)", low=1, short="-k")
    slots: int | None = knob("Block Buffer slots N_buf", low=1)
    tau_add: float | None = knob("fill ratio that activates the next block", low=0, high=1)
    tau_semi: float | None = knob("fill ratio of the preceding block that allows a forced commit", low=0, high=1)
    tau_m2t: float | None = knob("mask-to-token commit threshold", low=0, high=1)
    tau_t2t: float | None = knob("token-to-token edit threshold (off when unset)", low=0, high=1)
    tau_stable: int | None = knob("forwards a block stays unchanged before it is final", low=1, cli=False)
    max_nfe: int | None = knob("forwards at most per row", low=1, cli=False)


__all__ = ["MultiBlockConfig", "candidates", "decode", "event_columns", "row_event", "stop_blocks", "stop_string_rows",
           "window_step", "write_window"]
