"""Window forwards of a bidirectional dLLM with no cache or Fast-dLLM's approximate caches
(spec/diffusion.md §8).

Each block b (canvas positions [s, e)) is decoded through a **window** [w0, w1) of the canvas:
w0 = s - shift (a Dream-style model scores s from the output at s-1, so that token is re-fed
too) and w1 = e for the dual cache, T (canvas end) otherwise. Every call returns the raw
logits of the window's tokens.

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
    every call (the decoder commits into it in place). ``begin(w0, w1)`` starts a block; each
    ``__call__(refresh)`` returns the raw window logits (B, w1 - w0, V).
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
        self.w0 = self.w1 = 0
        self.cache = None
        self.kept_valid = None  # (B, kept keys) validity of the cached prefix (+ suffix) keys

    def begin(self, w0: int, w1: int) -> None:
        """Start a block whose window is [w0, w1); the next call must refresh."""
        if not 0 <= w0 < w1 <= self.T:
            raise ValueError(f"window [{w0}, {w1}) outside the canvas of {self.T}")
        self.w0, self.w1, self.cache = w0, w1, None

    def __call__(self, refresh: bool) -> torch.Tensor:
        n = self.w1 - self.w0
        if self.mode == "none":
            # Logits of x[w0:] only: the window is its first n entries (w1 = T unless dual).
            raw = bidirectional_forward(self.bundle, self.ids, position_ids=self.pos, key_valid=self.valid,
                                        logits_to_keep=self.T - self.w0)  # (B, T - w0, V)
            return raw[:, :n]
        if refresh or self.cache is None:
            return self._refresh(n)
        win = slice(self.w0, self.w1)
        key_valid = torch.cat([self.kept_valid, self.valid[:, win]], dim=1)  # (B, kept + n)
        raw = bidirectional_forward(self.bundle, self.ids[:, win], position_ids=self.pos[:, win],
                                    key_valid=key_valid, cache=self.cache)  # (B, n, V)
        crop(self.cache, n)
        return raw

    def _refresh(self, n: int) -> torch.Tensor:
        """Block-start (or periodic) full forward that also refills the cache (diffusion.md §8 step 1)."""
        device = self.ids.device
        order = torch.cat([torch.arange(0, self.w0, device=device), torch.arange(self.w1, self.T, device=device),
                           torch.arange(self.w0, self.w1, device=device)])  # (T,) window last
        valid = self.valid[:, order]  # (B, T)
        self.cache = new_cache(self.bundle.model)
        raw = bidirectional_forward(self.bundle, self.ids[:, order], position_ids=self.pos[:, order],
                                    key_valid=valid, cache=self.cache, logits_to_keep=n)  # (B, n, V)
        crop(self.cache, n)
        self.kept_valid = valid[:, : self.T - n]  # (B, T - n) prefix (+ suffix) keys
        return raw
