"""Forwards of a bidirectional dLLM with no cache or Fast-dLLM's approximate caches
(spec/diffusion.md §8), on a growing or a preallocated, compilable KV cache, for running batches
(:class:`SlotCanvas`; early-bird's decode uses the forward helpers too).

Each row decodes its current block b (canvas positions [s, e)) through a **window** [w0, w1):
w0 = s - shift (a Dream-style model scores s from the output at s-1, so that token is re-fed too)
and w1 = e for the dual cache, the canvas end otherwise.

- ``none``: every step is one full forward over the canvas (no K/V kept).
- ``prefix``: a *refresh* is a full forward whose K/V of [0, w0) are kept; each further step
  feeds only x[w0:] (block and whole suffix) against them.
- ``dual``: a refresh keeps the K/V of [0, w0) **and** of the suffix [w1, T); each further step
  feeds only the window x[w0:w1] against them.

Both caches are approximate: in a bidirectional model the kept K/V depend on the block (and, for
the prefix, the suffix) contents, which change inside the block, so they are stale until the next
refresh (at each block start; ``refresh_every`` adds refreshes inside a block). They are exact
only when the kept K/V cannot see the block, e.g. a one-layer model, where layer-0 K/V depend on
their own token only: the tests use that.

**The fast path** (``static`` / ``compile``): the K/V live in a ``StaticKV`` sized once and the
prompts are left-padded to a multiple of PROMPT_BUCKET, so every forward has a bounded shape:
a refresh is the whole canvas and runs eagerly (COMPILE_REFRESH), a dual step is the window
(R, shift + block), and a prefix step, whose length shrinks block by block, is padded to
:func:`bucket` with masked tokens, so a decode compiles few graphs (at most 6 + L / 64). The
no-cache step is :func:`unmask.decode.engine.kv.canvas_forward`, compiled once per canvas shape.
"""

from __future__ import annotations

import torch

from unmask.compat import attention_mask
from unmask.decode.engine.kv import DynamicKV, StaticKV, canvas_forward, make_kv
from unmask.errors import UnmaskError, check_choice
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
               *, pad_to: int | None = None, compiled: bool = True, padded: bool | None = None) -> torch.Tensor:
    """One bidirectional forward that appends q = ids.shape[1] K/V to ``kv`` (q padded to ``pad_to``
    on a static cache). ids, pos (B, q) long; key_valid (B, kv.length + q) bool. Returns the raw
    logits (B, rows[1] - rows[0], V) of query rows [rows[0], rows[1]), float32.

    On ``DynamicKV`` this is exactly the eager forward (:func:`bidirectional_forward` on its
    ``DynamicCache``). On ``StaticKV`` the padding tokens (copies of the last token, their keys
    masked for every query) only fix the shape; the cache then holds ``pad_to`` new positions,
    which is what the caller crops. ``compiled=False`` runs a static forward eagerly. ``padded``:
    whether some key is invalid, when the caller knows (None: read from key_valid, a host sync)."""
    if not kv.static:
        return bidirectional_forward(bundle, ids, position_ids=pos, key_valid=key_valid, cache=kv.cache, rows=rows,
                                     padded=padded)
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
                rows: tuple[int, int], padded: bool | None = None) -> torch.Tensor:
    """The cache-free forward of the whole canvas through ``step`` (a :func:`canvas_forward`), or
    :func:`bidirectional_forward` when ``step`` is None (the eager default, remote models too).
    ids, pos, valid (B, T); ``padded`` as :func:`kv_forward`'s. Returns raw logits (B, rows[1] -
    rows[0], V) float32."""
    if step is None:
        return bidirectional_forward(bundle, ids, position_ids=pos, key_valid=valid, rows=rows, padded=padded)
    B, T = ids.shape
    mask = None
    if (not bool(valid.all())) if padded is None else padded:  # as bidirectional_forward: unmasked attention when nothing is padding
        full = torch.ones(T, T, dtype=torch.bool, device=ids.device)  # (T, T)
        mask = attention_mask(bundle.model, with_key_padding(as_4d(full, B), valid))  # (B, 1, T, T)
    keep = torch.arange(rows[0], rows[1], device=ids.device)  # (n,)
    return step(ids, pos, mask, keep).clone()  # (B, n, V); a copy: CUDA graphs reuse their output buffer


class SlotCanvas:
    """The canvases of a running diffusion batch and their forwards, for one cache mode (§8).

    Slot tensors, ``capacity`` rows of width T: ``ids`` (long), ``pos`` (long, real tokens from 0),
    ``valid`` (bool, False on padding); each row's canvas ``[prompt | m^L]`` is right-aligned (left
    padding), so its generated region is its last L columns. A forward covers slots ``[0, n)``.

    The caches keep, per row, the K/V of every canvas column from the row's last refresh and
    ``kept_valid`` (cap, T): its prefix (and, dual, suffix) columns. A forward then feeds per row
    either its whole canvas (a refresh: its kept K/V are ignored and afterwards replaced) or only
    its window ([w0, T) for the prefix cache, [w0, e) for the dual one, w0 = block start - shift)
    against its kept K/V; rows at either phase share one forward. The fed queries' K/V sit after
    the T kept columns and are dropped again (``crop``): on ``DynamicKV`` a fresh cache over the
    kept tensors, on the preallocated ``StaticKV`` (``static``/``compile``) a pointer move, the kept
    K/V being its first T positions. Bidirectional attention with explicit positions does not
    depend on key order, so this equals Fast-dLLM's in-place ``replace_position`` layout.

    ``length`` (the server's ``--compile``, dual cache): the static cache holds length + shift + block
    positions with length buckets and deferred compiles (:class:`~unmask.decode.engine.kv.StaticKV`), so
    canvases of any width up to ``length`` join mid-flight: a wider one widens every canvas and moves
    the kept K/V right in place (:meth:`_widen`); refreshes run apart (:meth:`_split`); :meth:`clear`
    starts an emptied batch narrow again.
    """

    def __init__(self, bundle, mode: str, capacity: int, width: int, block: int | None, *, static: bool = False,
                 compile: bool = False, length: int | None = None):
        check_choice("cache", mode, CACHE_MODES)
        if mode != "none" and not supports_cache(bundle):
            raise UnmaskError(f"cache {mode!r} needs a transformers-native model; this checkpoint runs its own "
                              "model code, so use --cache none")
        self.bundle, self.mode, self.block, self.shift = bundle, mode, block, bundle.logit_shift
        self.static, self.compile = static or compile, compile
        C, T = capacity, width
        self._slots(C, T)
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # DynamicKV: (C', H, T, D) per layer
        self.kv = self.canvas = None
        self.length = length if self.static and mode == "dual" else None  # serving: canvases widen up to it
        if self.length:  # kept K/V in [0, T), a window's queries in [T, T + shift + block); refreshes run apart
            self.kv = StaticKV(bundle.model, C, length + self.shift + block, compile=compile, length_buckets=True,
                               defer_compile=True)
        elif mode != "none" and self.static:  # kept K/V in [0, T), a forward's queries in [T, 2T)
            self.kv = make_kv(bundle.model, batch=C, capacity=2 * T, static=True, compile=compile)
        elif mode == "none" and self.static:
            self.canvas = canvas_forward(bundle.model, compile)

    def _slots(self, C: int, T: int) -> None:
        """Fresh slot tensors of C rows and width T: every slot a finite dummy canvas (a row whose keys
        were all masked would give NaN K/V)."""
        dev = self.bundle.device
        self.ids = torch.full((C, T), self.bundle.pad_token_id, dtype=torch.long, device=dev)  # (C, T)
        self.pos = torch.arange(T, device=dev).repeat(C, 1)  # (C, T)
        self.valid = torch.ones(C, T, dtype=torch.bool, device=dev)  # (C, T)
        self.kept_valid = torch.zeros(C, T, dtype=torch.bool, device=dev)  # (C, T)
        self.padded = [False] * C  # per slot: its canvas has left padding (known here: no host sync per forward)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def static_capacity(self) -> int | None:
        """Positions of the preallocated cache, None without one."""
        return None if self.kv is None else self.kv.capacity

    def place(self, slot: int, prompt: list[int], gen_length: int, mask_id: int) -> None:
        """Write a row's canvas ``[prompt | m^L]`` right-aligned into ``slot``, widening every canvas
        (more left padding) when it is the widest; a static canvas cannot widen (UnmaskError)."""
        C = len(prompt) + gen_length
        if C > self.width:
            if self.static and (self.length is None or C > self.length):
                raise UnmaskError(f"a canvas of {C} tokens does not fit the static batch's {self.width}; "
                                  "decode it without static/compile")
            self._widen(C - self.width)
        T, dev = self.width, self.ids.device
        row = torch.tensor(list(prompt) + [mask_id] * gen_length, dtype=torch.long, device=dev)  # (C,)
        self.ids[slot] = self.bundle.pad_token_id
        self.ids[slot, T - C:] = row
        self.pos[slot] = 0
        self.pos[slot, T - C:] = torch.arange(C, device=dev)
        self.valid[slot] = False
        self.valid[slot, T - C:] = True
        self.kept_valid[slot] = False
        self.padded[slot] = C < T

    def _widen(self, d: int) -> None:
        """d more left-padding columns on every slot tensor and kept K/V."""
        def pad(t, fill, dim=1):
            shape = list(t.shape)
            shape[dim] = d
            return torch.cat([t.new_full(shape, fill), t], dim=dim)

        self.ids, self.pos = pad(self.ids, self.bundle.pad_token_id), pad(self.pos, 0)  # (C, T + d)
        self.valid, self.kept_valid = pad(self.valid, False), pad(self.kept_valid, False)  # (C, T + d)
        self.padded = [True] * len(self.padded)
        if self.kept is not None:
            self.kept = [(pad(k, 0, 2), pad(v, 0, 2)) for k, v in self.kept]  # (C', H, T + d, D)
        if self.kv is not None and self.kv.length:  # static (serving): the kept K/V move d columns right, in place
            T = self.kv.length
            for layer in self.kv.cache.layers:
                for t in (layer.keys, layer.values):  # (C, H, capacity, D)
                    t[:, :, d: d + T] = t[:, :, :T].clone()
            self.kv.ptr = T + d

    def clear(self) -> None:
        """Forget every canvas and the kept K/V (serving on the static cache, when no row runs): the
        next rows start from width 1, so a batch that once held a wide canvas stops paying for it."""
        self._slots(self.ids.shape[0], 1)
        self.kv.reset()

    def forward(self, n: int, starts: list[int], refresh: list[bool], live: list[bool] | None = None) -> torch.Tensor:
        """One forward of slots [0, n) for block decoding: row r scores its block [starts[r], starts[r]
        + block) (canvas columns) from the rows [w0, e) = [starts[r] - shift, starts[r] + block);
        ``refresh[r]``: the row refreshes its cache in this forward (ignored without one); ``live``:
        the running rows (dual cache: eager, a step where some live rows refresh and others do not,
        and serving on the static cache, every step with a refresh, runs as :meth:`_split`). Returns
        the raw logits (n, shift + block, V) float32 of each row's [w0, e)."""
        dev, sh, Bk, T = self.ids.device, self.shift, self.block, self.width
        w0 = [s - sh for s in starts]
        w1 = [s + Bk for s in starts] if self.mode == "dual" else [T] * n
        others = any(alive and not again for alive, again in zip(live or [True] * n, refresh))  # a row steps a window
        # serving on the static cache, a refresh never runs on it; eager, it runs apart when other rows step
        eager = others and not self.static and self.kept is not None and self.mode == "dual"
        if any(refresh) and (self.length or eager):
            return self._split(n, w0, w1, refresh, others)
        raw, col0 = self.run(n, w0, w1, refresh, min(w0), max(starts) + Bk)  # (n, m, V), (n,)
        at = (torch.tensor(w0, device=dev) - col0)[:, None] + torch.arange(sh + Bk, device=dev)  # (n, shift + block)
        return raw.gather(1, at[:, :, None].expand(n, sh + Bk, raw.shape[2]))  # (n, shift + block, V)

    def run(self, n: int, w0: list[int], w1: list[int], refresh: list[bool], lo: int, hi: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of slots [0, n). Row r's window is the canvas columns [w0[r], w1[r]); a row
        with ``refresh[r]`` feeds its whole canvas and then keeps its K/V of every column, valid
        outside that window (see :meth:`hide`); the others feed their window against their kept
        K/V (no cache: every row feeds its whole canvas). [lo, hi): the canvas columns whose logits
        the caller reads. Returns (raw (n, m, V) float32, col0 (n,) long: the canvas column of
        ``raw[r, 0]``); a dual window step returns each row's window (col0 = w0), any other forward
        the columns [lo, hi)."""
        dev, T = self.ids.device, self.width
        if self.mode == "none":
            raw = canvas_call(self.bundle, self.canvas, self.ids[:n], self.pos[:n], self.valid[:n], (lo, hi),
                              padded=any(self.padded[:n]))  # (n, hi - lo, V)
            return raw, torch.full((n,), lo, device=dev)
        a, b = torch.tensor(w0, device=dev), torch.tensor(w1, device=dev)  # (n,) each
        cols = torch.arange(T, device=dev)  # (T,)
        window = (cols[None, :] >= a[:, None]) & (cols[None, :] < b[:, None])  # (n, T) each row's window
        first = self.kv.length == 0 if self.static else self.kept is None
        fresh = torch.tensor(refresh, device=dev) | first  # (n,)
        full = first or any(refresh)
        if full:  # whole canvases: a refreshing row's queries are all its columns
            q0, width = 0, T
            q_ids, q_pos = self.ids[:n], self.pos[:n]  # (n, T)
            q_valid = self.valid[:n] & (fresh[:, None] | window)  # (n, T)
        elif self.mode == "prefix":  # windows [w0, T): the last T - min(w0) columns, masked per row
            q0 = min(w0)
            width = T - q0
            q_ids, q_pos, q_valid = self.ids[:n, q0:], self.pos[:n, q0:], window[:, q0:]  # (n, T - q0)
        else:  # dual windows [w0, w1): gathered, each row's own (shorter ones masked at the end)
            q0, width = None, max(e - s for s, e in zip(w0, w1))
            at = (a[:, None] + torch.arange(width, device=dev)).clamp(max=T - 1)  # (n, W)
            inside = torch.arange(width, device=dev)[None, :] < (b - a)[:, None]  # (n, W)
            q_ids, q_pos = self.ids[:n].gather(1, at), self.pos[:n].gather(1, at)  # (n, W) each
            q_valid = window.gather(1, at) & inside  # (n, W)
        K = 0 if first else T
        key_valid = q_valid if first else torch.cat([self.kept_valid[:n] & ~fresh[:, None], q_valid], dim=1)
        rows = (lo - q0, hi - q0) if q0 is not None else (0, width)
        # a window whose length varies (prefix; early-bird's blocks) is padded to a bucket: few static shapes
        pad_to = bucket(width, T) if self.static and not full and (self.mode == "prefix" or not self.block) else width
        kv = self.kv if self.static else self._dynamic(n)
        # only the first forward (no kept K/V yet) of unpadded canvases sees every key
        padded = not first or any(self.padded[:n])
        raw = kv_forward(self.bundle, kv, q_ids, q_pos, key_valid, rows, pad_to=pad_to,
                         compiled=COMPILE_REFRESH or not full, padded=padded)  # (n, m, V)
        if full:  # a refreshing row keeps its new K/V of every column, valid outside its window
            self._keep(kv, n, K, fresh)
            self.kept_valid[:n] = torch.where(fresh[:, None], self.valid[:n] & ~window, self.kept_valid[:n])
        if self.static:
            kv.crop(kv.length - T)
        return raw, (torch.full((n,), q0 + rows[0], device=dev) if q0 is not None else a)

    def _split(self, n: int, w0: list[int], w1: list[int], refresh: list[bool], others: bool) -> torch.Tensor:
        """A dual-cache step where rows refresh, in two forwards: the refreshing rows' canvases alone
        (eager, on a fresh ``DynamicKV``: their new kept K/V and their logits), then, when ``others``
        step, every row's window against its kept K/V (on the static cache, a plain step's compiled
        shape), so the static cache never holds more than a window past the canvas. Returns (n, shift
        + block, V) float32."""
        dev, T, W = self.ids.device, self.width, self.shift + self.block
        fresh = [r for r in range(n) if refresh[r]]
        at = torch.tensor(fresh, device=dev)  # (r,)
        lo, hi = min(w0[r] for r in fresh), max(w1[r] for r in fresh)
        new = DynamicKV(self.bundle.model)
        raw = kv_forward(self.bundle, new, self.ids[at], self.pos[at], self.valid[at], (lo, hi),
                         padded=any(self.padded[r] for r in fresh))  # (r, hi - lo, V)
        if self.static:
            if not self.kv.allocated:  # the first refresh allocates every slot's columns
                for layer, theirs in zip(self.kv.cache.layers, new.cache.layers):
                    like = (t[:1].expand(self.kv.batch, -1, -1, -1) for t in (theirs.keys, theirs.values))
                    layer.lazy_initialization(*like)  # zeros (C, H, capacity, D)
            kept = [(layer.keys, layer.values) for layer in self.kv.cache.layers]  # (C, H, capacity, D) each
            self.kv.ptr = T  # the kept columns (after clear(), nothing was kept)
        else:
            kept = self._grow_kept(n)  # (C', H, T, D) each
        for (k, v), theirs in zip(kept, new.cache.layers):
            k[at, :, :T], v[at, :, :T] = theirs.keys, theirs.values  # (r, H, T, D)
        a = torch.tensor([w0[r] for r in fresh], device=dev)  # (r,)
        cols = torch.arange(T, device=dev)  # (T,)
        self.kept_valid[at] = self.valid[at] & ~((cols >= a[:, None]) & (cols < a[:, None] + W))  # (r, T)
        if others:
            out, _ = self.run(n, w0, w1, [False] * n, min(w0), max(w1))  # (n, W, V): each row's window
        else:  # every running row refreshed: no window to step
            out = raw.new_zeros((n, W, raw.shape[2]))  # (n, W, V)
        take = (a - lo)[:, None] + torch.arange(W, device=dev)  # (r, W)
        out[at] = raw.gather(1, take[:, :, None].expand(len(fresh), W, raw.shape[2]))
        return out

    def hide(self, n: int, rows: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor) -> None:
        """Mark the kept K/V of the window [w0, w1) (n,) long each as stale for the ``rows`` (n,) bool:
        for a decoder that picks its window after the refresh forward (early-bird)."""
        cols = torch.arange(self.width, device=self.ids.device)  # (T,)
        window = (cols[None, :] >= w0[:, None]) & (cols[None, :] < w1[:, None])  # (n, T)
        self.kept_valid[:n] &= ~(window & rows[:, None])

    def _dynamic(self, n: int):
        """A DynamicKV over the kept K/V of slots [0, n) (empty before the first forward)."""
        kv = DynamicKV(self.bundle.model)
        if self.kept is not None:
            for i, (k, v) in enumerate(self._grow_kept(n)):
                kv.cache.update(k[:n], v[:n], i)
        return kv

    def _grow_kept(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The kept K/V with at least n rows: a slot past them gets zeros, masked until it refreshes."""
        R = self.kept[0][0].shape[0]
        if R < n:
            self.kept = [tuple(torch.cat([t, t.new_zeros((n - R, *t.shape[1:]))]) for t in kv) for kv in self.kept]
        return self.kept

    def _keep(self, kv, n: int, K: int, rows: torch.Tensor) -> None:
        """Copy the new K/V (after the K kept columns) of the ``rows`` (n,) bool into the kept store."""
        T, pick = self.width, rows[:, None, None, None]  # (n, 1, 1, 1)
        if not self.static and self.kept is None:  # the first forward: every row refreshed
            self.kept = [(layer.keys.clone(), layer.values.clone()) for layer in kv.cache.layers]  # (n, H, T, D)
            return
        for i, layer in enumerate(kv.cache.layers):
            new_k, new_v = layer.keys[:n, :, K: K + T], layer.values[:n, :, K: K + T]  # (n, H, T, D)
            k, v = (layer.keys, layer.values) if self.static else self.kept[i]
            k[:n, :, :T] = torch.where(pick, new_k, k[:n, :, :T])
            v[:n, :, :T] = torch.where(pick, new_v, v[:n, :, :T])

