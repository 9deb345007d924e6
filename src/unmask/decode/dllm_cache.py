"""Window forwards of a bidirectional dLLM with no cache or Fast-dLLM's approximate caches
(spec/diffusion.md §8), on a growing or a preallocated, compilable KV cache.

Each block b (canvas positions [s, e)) is decoded through a **window** [w0, w1) of the canvas:
w0 = s - shift (a Dream-style model scores s from the output at s-1, so that token is re-fed
too) and w1 = e for the dual cache, T (canvas end) otherwise. Every call returns the raw
logits of rows [w0, e) only.

- ``none``: every step is one full forward over the canvas (no K/V kept).
- ``prefix``: a *refresh* is a full forward with a cache; the K/V of [0, w0) are kept (``crop``)
  and each further step feeds only x[w0:] (block and whole suffix) against them.
- ``dual``: a refresh keeps the K/V of [0, w0) **and** of the suffix [w1, T); each further step
  feeds only the window x[w0:w1] against them; its own fresh K/V take the place of the block's.

Both caches are approximate: in a bidirectional model the kept K/V depend on the block (and, for
the prefix, the suffix) contents, which change inside the block, so they are stale until the next
refresh (at each block start; ``refresh_every`` adds refreshes inside a block). They are exact
only when the kept K/V cannot see the block, e.g. a one-layer model, where layer-0 K/V depend on
their own token only: the tests use that.

**Layout (our choice).** Bidirectional attention with explicit ``position_ids`` does not depend on
the order of the keys (RoPE is applied per token, the mask is all-ones apart from padding), so a
refresh feeds the canvas as ``[x[:w0] | x[w1:] | x[w0:w1]]``. The window's K/V then sit at the
cache end and ``crop(-n)`` drops them: the cache holds prefix and suffix, and every step appends
the window's fresh K/V and crops them again. This is Fast-dLLM's in-place ``replace_position``
expressed with the cache interface of :mod:`unmask.decode.kv` (append + crop): on the eager
``DynamicKV`` a ``crop(-n)``, on the preallocated ``StaticKV`` a pointer move.

**The fast path** (``static`` / ``compile``): the K/V live in a ``StaticKV`` sized once and the
prompts are left-padded to a multiple of PROMPT_BUCKET, so every forward has a bounded shape:
the refresh is the whole canvas (B, T) and runs eagerly (COMPILE_REFRESH), a dual step is the
window (B, w1 - w0), and a prefix step, whose length shrinks block by block, is padded to
:func:`bucket` with masked tokens, so a decode compiles few graphs (at most 6 + L / 64). The
no-cache step is :func:`unmask.decode.kv.canvas_forward`, compiled once per canvas shape.
"""

from __future__ import annotations

import torch

from unmask.compat import attention_mask
from unmask.decode.batching import left_pad
from unmask.decode.kv import canvas_forward, make_kv
from unmask.errors import UnmaskError
from unmask.masks import as_4d, with_key_padding
from unmask.models.adapters import bidirectional_forward, supports_cache

CACHE_MODES = ("none", "prefix", "dual")
MIN_BUCKET = 8
PROMPT_BUCKET = 16  # the fast path left-pads prompts to a multiple of this: one canvas shape for similar prompts
# The refresh (the whole canvas) runs eagerly on the static cache even under compile=True: measured
# on stories260K-dlm (1 thread, batch 1, 128 tokens) a compiled refresh was no faster for diffusion's
# dual cache (774 vs 751 TPS) and slower for early-bird's (230 vs 419 TPS; inductor's attention over
# the long canvas loses to eager SDPA), and it costs a compile per canvas shape.
COMPILE_REFRESH = False
BUCKET_STEP = 64  # past this, padded lengths are multiples of it: at most BUCKET_STEP - 1 padding tokens


def check_fast_path(bundle, static: bool, compile: bool, decoder: str) -> None:
    """Refuse ``static`` / ``compile`` where they cannot run: they call the transformers model
    class with a preallocated cache and explicit 4D masks. Raises UnmaskError (one line)."""
    for name, value in (("static", static), ("compile", compile)):
        if not isinstance(value, bool):
            raise UnmaskError(f"{name} must be true or false (got {value!r})")
    if (static or compile) and not supports_cache(bundle):
        raise UnmaskError(f"{'compile' if compile else 'static'} needs a transformers-native model; this checkpoint "
                          f"runs its own model code, so decode with {decoder} without compile/static")


def prompt_width(P: int, L: int, context_length: int, fast: bool) -> int:
    """The prompt region's width: the longest prompt P, or on the fast path (``fast``) P rounded
    up to PROMPT_BUCKET (within the context window), so that prompts of similar lengths share the
    canvas shape (B, width + L) and its compiled graphs."""
    if not fast:
        return P
    return max(P, min(-(-P // PROMPT_BUCKET) * PROMPT_BUCKET, context_length - L))


def left_pad_to(prompts: list[list[int]], pad_id: int, device, width: int):
    """:func:`unmask.decode.batching.left_pad` to ``width`` >= the longest prompt: ids (B, width)
    long, valid (B, width) bool (False on padding), positions (B, width) long (real tokens from 0)."""
    ids, valid, pos = left_pad(prompts, pad_id, device)  # (B, P) each
    extra = width - ids.shape[1]
    if extra > 0:  # more left padding: masked keys at position 0, as left_pad's own
        B = ids.shape[0]
        ids = torch.cat([ids.new_full((B, extra), pad_id), ids], dim=1)  # (B, width)
        valid = torch.cat([valid.new_zeros(B, extra), valid], dim=1)  # (B, width)
        pos = torch.cat([pos.new_zeros(B, extra), pos], dim=1)  # (B, width)
    return ids, valid, pos


def bucket(q: int, q_max: int) -> int:
    """The padded query length of a variable-length window step, capped at q_max (the longest
    window of the decode, a shape of its own): 8 or 16 up to 16, the next multiple of 16 up to
    BUCKET_STEP (an early-bird block of 32 plus the shift token pads to 48, not 64), then the
    next multiple of BUCKET_STEP. A decode of L tokens therefore has at most 6 + L / BUCKET_STEP
    window shapes, and a step pads fewer than BUCKET_STEP tokens (16 below BUCKET_STEP)."""
    if q <= 2 * MIN_BUCKET:
        return min(q_max, MIN_BUCKET if q <= MIN_BUCKET else 2 * MIN_BUCKET)
    step = 2 * MIN_BUCKET if q <= BUCKET_STEP else BUCKET_STEP
    return min(q_max, -(-q // step) * step)


def kv_forward(bundle, kv, ids: torch.Tensor, pos: torch.Tensor, key_valid: torch.Tensor, rows: tuple[int, int],
               *, pad_to: int | None = None, compiled: bool = True) -> torch.Tensor:
    """One bidirectional forward that appends q = ids.shape[1] K/V to ``kv`` (q padded to ``pad_to``
    on a static cache). ids, pos (B, q) long; key_valid (B, kv.length + q) bool. Returns the raw
    logits (B, rows[1] - rows[0], V) of query rows [rows[0], rows[1]), float32.

    On ``DynamicKV`` this is exactly the eager forward (:func:`bidirectional_forward` on its
    ``DynamicCache``). On ``StaticKV`` the padding tokens (copies of the last token, their keys
    masked for every query) only fix the shape; the cache then holds ``pad_to`` new positions,
    which is what the caller crops. ``compiled=False`` runs a static forward eagerly."""
    if not kv.static:
        return bidirectional_forward(bundle, ids, position_ids=pos, key_valid=key_valid, cache=kv.cache, rows=rows)
    B, q = ids.shape
    pad = (pad_to or q) - q
    if pad:
        ids = torch.cat([ids, ids[:, -1:].expand(B, pad)], dim=1)  # (B, q + pad)
        pos = torch.cat([pos, pos[:, -1:].expand(B, pad)], dim=1)  # (B, q + pad)
        key_valid = torch.cat([key_valid, key_valid.new_zeros(B, pad)], dim=1)  # (B, length + q + pad)
    mask = key_valid[:, None, None, :].expand(B, 1, q + pad, key_valid.shape[1])  # (B, 1, q + pad, length + q + pad)
    logits = kv.forward(ids, pos, mask, compiled=compiled)  # (B, q + pad, V)
    return logits[:, rows[0]: rows[1]].clone()  # a copy: CUDA graphs reuse their output buffer


def canvas_call(bundle, step, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                rows: tuple[int, int]) -> torch.Tensor:
    """The cache-free forward of the whole canvas through ``step`` (a :func:`canvas_forward`), or
    :func:`bidirectional_forward` when ``step`` is None (the eager default, remote models too).
    ids, pos, valid (B, T). Returns raw logits (B, rows[1] - rows[0], V) float32."""
    if step is None:
        return bidirectional_forward(bundle, ids, position_ids=pos, key_valid=valid, rows=rows)
    B, T = ids.shape
    mask = None
    if not bool(valid.all()):  # as bidirectional_forward: unmasked attention when nothing is padding
        full = torch.ones(T, T, dtype=torch.bool, device=ids.device)  # (T, T)
        mask = attention_mask(bundle.model, with_key_padding(as_4d(full, B), valid))  # (B, 1, T, T)
    keep = torch.arange(rows[0], rows[1], device=ids.device)  # (n,)
    return step(ids, pos, mask, keep).clone()  # (B, n, V); a copy: CUDA graphs reuse their output buffer


class WindowForward:
    """Runs the forwards of one decode for one cache mode.

    ids/pos/valid are the canvas tensors (B, T) owned by the decoder; ``ids`` is read afresh at
    every call (the decoder commits into it in place). ``begin(w0, e)`` starts a block whose
    scored rows are [w0, e) (the block, plus the token before it for a shift-1 model); each
    ``__call__(refresh)`` returns their raw logits (B, e - w0, V). The LM head runs on those rows
    only, never on the suffix (on the static cache it runs on every fed row). ``static`` puts
    the K/V in a preallocated ``StaticKV``, ``compile`` also compiles the forwards
    (:mod:`unmask.decode.kv`); ``shift`` bounds the first block's window (static prefix padding).
    """

    def __init__(self, bundle, mode: str, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, *,
                 static: bool = False, compile: bool = False, P: int | None = None, shift: int = 0):
        if mode not in CACHE_MODES:
            raise UnmaskError(f"unknown cache {mode!r}; choose one of: {', '.join(CACHE_MODES)}")
        if mode != "none" and not supports_cache(bundle):
            raise UnmaskError(f"cache {mode!r} needs a transformers-native model; this checkpoint runs its own "
                              "model code, so use --cache none")
        self.bundle, self.mode = bundle, mode
        self.ids, self.pos, self.valid = ids, pos, valid
        B, self.T = ids.shape
        self.w0 = self.w1 = self.e = 0
        self.fresh = False  # whether the cache holds this block's kept K/V
        self.kept_valid = None  # (B, kept keys) validity of the cached prefix (+ suffix) keys
        # the longest prefix window: the first block's, [P - shift, T)
        self.q_max = self.T - ((P if P is not None else 0) - shift)
        self.kv = self.canvas = None
        if mode != "none":
            # a padded prefix step writes up to BUCKET_STEP - 1 positions past the canvas end
            capacity = self.T + (BUCKET_STEP if mode == "prefix" else 0)
            self.kv = make_kv(bundle.model, batch=B, capacity=capacity, static=static, compile=compile)
        elif static or compile:
            self.canvas = canvas_forward(bundle.model, compile)

    @property
    def cache(self):
        """The cache object (a ``DynamicCache`` on the eager path; tests read its layers)."""
        return None if self.kv is None else self.kv.cache

    @property
    def static_capacity(self) -> int | None:
        """Positions of the preallocated cache, None without one."""
        return self.kv.capacity if self.kv is not None and self.kv.static else None

    def begin(self, w0: int, e: int) -> None:
        """Start a block: the window is [w0, e) for the dual cache and [w0, T) otherwise; the next
        call refreshes."""
        if not 0 <= w0 < e <= self.T:
            raise ValueError(f"rows [{w0}, {e}) outside the canvas of {self.T}")
        self.w0, self.e = w0, e
        self.w1 = e if self.mode == "dual" else self.T
        self.fresh = False

    def __call__(self, refresh: bool) -> torch.Tensor:
        if self.mode == "none":
            return canvas_call(self.bundle, self.canvas, self.ids, self.pos, self.valid, (self.w0, self.e))
        if refresh or not self.fresh:
            return self._refresh()
        n = self.w1 - self.w0
        win = slice(self.w0, self.w1)
        key_valid = torch.cat([self.kept_valid, self.valid[:, win]], dim=1)  # (B, kept + n)
        # a prefix window shrinks block by block: pad it to a bucket so the static shapes repeat
        pad_to = bucket(n, self.q_max) if self.kv.static and self.mode == "prefix" else n
        raw = kv_forward(self.bundle, self.kv, self.ids[:, win], self.pos[:, win], key_valid,
                         (0, self.e - self.w0), pad_to=pad_to)
        self.kv.crop(pad_to)
        return raw  # (B, e - w0, V)

    def _refresh(self) -> torch.Tensor:
        """Block-start (or periodic) full forward that also refills the cache (diffusion.md §8 step 1)."""
        device = self.ids.device
        n = self.w1 - self.w0
        order = torch.cat([torch.arange(0, self.w0, device=device), torch.arange(self.w1, self.T, device=device),
                           torch.arange(self.w0, self.w1, device=device)])  # (T,) window last
        valid = self.valid[:, order]  # (B, T)
        self.kv.reset()
        first = self.T - n  # the window's first row in this order
        raw = kv_forward(self.bundle, self.kv, self.ids[:, order], self.pos[:, order], valid,
                         (first, first + self.e - self.w0), compiled=COMPILE_REFRESH)  # (B, e - w0, V)
        self.kv.crop(n)
        self.kept_valid = valid[:, :first]  # (B, T - n) prefix (+ suffix) keys
        self.fresh = True
        return raw
