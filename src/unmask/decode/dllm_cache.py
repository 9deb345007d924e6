"""Window forwards of a bidirectional dLLM with no cache or Fast-dLLM's approximate caches
(spec/diffusion.md §8).

Each block b (canvas positions [s, e)) is decoded through a **window** [w0, w1) of the canvas:
w0 = s - shift (a Dream-style model scores s from the output at s-1, so that token is re-fed
too) and w1 = e for the dual cache, T (canvas end) otherwise. Every call returns the raw
logits of rows [w0, e) only (the LM head never runs on the suffix).

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
expressed with HF's supported cache calls only (append + ``crop``): no per-layer tensor writes.
"""

from __future__ import annotations

import torch

from unmask.compat import crop, new_cache
from unmask.errors import UnmaskError
from unmask.models.adapters import bidirectional_forward, supports_cache

CACHE_MODES = ("none", "prefix", "dual")


class WindowForward:
    """Runs the forwards of one decode for one cache mode.

    ids/pos/valid are the canvas tensors (B, T) owned by the decoder; ``ids`` is read afresh at
    every call (the decoder commits into it in place). ``begin(w0, e)`` starts a block whose
    scored rows are [w0, e) (the block, plus the token before it for a shift-1 model); each
    ``__call__(refresh)`` returns their raw logits (B, e - w0, V). The LM head runs on those rows
    only, never on the suffix.
    """

    def __init__(self, bundle, mode: str, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor):
        if mode not in CACHE_MODES:
            raise UnmaskError(f"unknown cache {mode!r}; choose one of: {', '.join(CACHE_MODES)}")
        if mode != "none" and not supports_cache(bundle):
            raise UnmaskError(f"cache {mode!r} needs a transformers-native model; this checkpoint runs its own "
                              "model code, so use --cache none")
        self.bundle, self.mode = bundle, mode
        self.ids, self.pos, self.valid = ids, pos, valid
        self.T = ids.shape[1]
        self.w0 = self.w1 = self.e = 0
        self.cache = None
        self.kept_valid = None  # (B, kept keys) validity of the cached prefix (+ suffix) keys

    def begin(self, w0: int, e: int) -> None:
        """Start a block: the window is [w0, e) for the dual cache and [w0, T) otherwise; the next
        call refreshes."""
        if not 0 <= w0 < e <= self.T:
            raise ValueError(f"rows [{w0}, {e}) outside the canvas of {self.T}")
        self.w0, self.e = w0, e
        self.w1 = e if self.mode == "dual" else self.T
        self.cache = None

    def __call__(self, refresh: bool) -> torch.Tensor:
        if self.mode == "none":
            return bidirectional_forward(self.bundle, self.ids, position_ids=self.pos, key_valid=self.valid,
                                         rows=(self.w0, self.e))  # (B, e - w0, V)
        if refresh or self.cache is None:
            return self._refresh()
        n = self.w1 - self.w0
        win = slice(self.w0, self.w1)
        key_valid = torch.cat([self.kept_valid, self.valid[:, win]], dim=1)  # (B, kept + n)
        raw = bidirectional_forward(self.bundle, self.ids[:, win], position_ids=self.pos[:, win],
                                    key_valid=key_valid, cache=self.cache, rows=(0, self.e - self.w0))
        crop(self.cache, n)
        return raw  # (B, e - w0, V)

    def _refresh(self) -> torch.Tensor:
        """Block-start (or periodic) full forward that also refills the cache (diffusion.md §8 step 1)."""
        device = self.ids.device
        n = self.w1 - self.w0
        order = torch.cat([torch.arange(0, self.w0, device=device), torch.arange(self.w1, self.T, device=device),
                           torch.arange(self.w0, self.w1, device=device)])  # (T,) window last
        valid = self.valid[:, order]  # (B, T)
        self.cache = new_cache(self.bundle.model)
        first = self.T - n  # the window's first row in this order
        raw = bidirectional_forward(self.bundle, self.ids[:, order], position_ids=self.pos[:, order],
                                    key_valid=valid, cache=self.cache,
                                    rows=(first, first + self.e - self.w0))  # (B, e - w0, V)
        crop(self.cache, n)
        self.kept_valid = valid[:, :first]  # (B, T - n) prefix (+ suffix) keys
        return raw
