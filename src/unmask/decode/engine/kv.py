"""One KV-cache interface for every decoder: a growing ``DynamicCache`` (the eager default) or a
preallocated ``StaticCache`` whose length pointer moves (the fast path, STYLE.md habit 4).

A decoder written against :class:`DynamicKV` / :class:`StaticKV` runs unchanged on either:

- ``kv.forward(inp, positions, mask)`` writes the q query tokens' K/V after the ``kv.length``
  cached ones and returns their logits; ``mask`` (B, 1, q, length + q) bool says which cached
  and new keys each query sees (the decoders' masks today).
- ``kv.crop(n)`` drops the last n cached positions: a ``crop(-n)`` on the dynamic cache, a pointer
  move on the static one (the next forward overwrites them, as gpt-fast rolls back drafts).
- ``kv.reset()`` empties the cache (a Fast-dLLM prefix refresh rebuilds it from position 0).

The static cache is sized once (``capacity`` tokens, rounded up to
:data:`unmask.decode.engine.static.LENGTH_BUCKET`); each forward pads the mask to the full cache width
(B, 1, q, L) with the columns past ``length + q`` masked, so every step of a given query length
has the same input shapes and ``compile=True`` reuses one compiled graph per shape
(:func:`unmask.decode.engine.static.step_function`). Forwards whose length depends on the prompt
(prefill, refresh) pass ``compiled=False`` and run eagerly on the same cache.
"""

from __future__ import annotations

import operator
import weakref

import torch

from unmask.compat import attention_mask, crop, forward, new_cache, set_static_length
from unmask.decode.engine import static  # read by module: tests and benchmarks patch its attributes
from unmask.errors import UnmaskError


def _check_crop(n: int, length: int) -> None:
    try:
        n = operator.index(n)  # an int, numpy or 0-d integer tensor
    except TypeError:
        raise UnmaskError(f"KV cache crop takes an integer count of positions (got {n!r})") from None
    if n > length:
        raise UnmaskError(f"cannot crop {n} positions from a KV cache holding {length}; crop at most {length} "
                          "(or reset() to empty it)")


class DynamicKV:
    """The eager cache: a ``DynamicCache`` that grows by ``torch.cat`` and is cropped on rollback."""

    static = False

    def __init__(self, model):
        self.model = model
        self.cache = new_cache(model)

    @property
    def length(self) -> int:
        """Cached positions (every row has the same count; padding is masked, not skipped)."""
        return self.cache.get_seq_length()

    def forward(self, inp: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, *,
                logits_to_keep: int = 0, compiled: bool = True) -> torch.Tensor:
        """inp, positions (B, q) long; mask (B, 1, q, length + q) bool, or None (causal over the
        cache). Returns float32 logits (B, q or logits_to_keep, V). ``compiled`` is ignored."""
        m = None if mask is None else attention_mask(self.model, mask)
        return forward(self.model, inp, position_ids=positions, attention_mask=m, cache=self.cache,
                       logits_to_keep=logits_to_keep)

    def crop(self, n: int) -> None:
        """Drop the last ``n`` cached positions (n <= 0: nothing). Raises UnmaskError for n > length."""
        _check_crop(n, self.length)
        crop(self.cache, n)

    def reset(self) -> None:
        self.cache = new_cache(self.model)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values), each (B, H, length, D): views of the cached K/V (tests)."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]


class StaticKV:
    """A ``StaticCache`` of ``capacity`` tokens for ``batch`` rows, allocated once, with a length
    pointer. ``compile=True`` runs every ``compiled=True`` forward through a ``torch.compile``-d
    step (inductor on CPU, CUDA graphs on CUDA). A forward of B < ``batch`` rows covers rows
    ``[0, B)`` only, and with ``length_buckets`` only the first Lb columns (Lb: LENGTH_BUCKET
    doubled until it holds ``length + q``, at most ``capacity``), through a cache whose layers are
    views of the full buffers (:meth:`view`): a running batch pays for its rows and its length, not
    for its capacity, at one compiled graph per (B, q, Lb). Raises UnmaskError when a forward would
    run past the capacity (a sizing bug of the caller: the static cache never grows) or covers more
    than ``batch`` rows. The forward that first writes the cache (allocating it) always runs eagerly.
    ``defer_compile`` (the server): a forward of a shape not compiled yet runs
    eagerly on the same static cache (same logits) and the shape waits in ``pending`` until
    :meth:`warm` compiles it while no row runs, so no running request ever waits for a compile."""

    static = True

    def __init__(self, model, batch: int, capacity: int, *, compile: bool = False, cpp_wrapper: bool = False,
                 length_buckets: bool = False, defer_compile: bool = False):
        from transformers import StaticCache

        self.model, self.batch, self.length_buckets = model, batch, length_buckets
        self.defer = compile and defer_compile
        self.compiled: set[tuple[int, int, int]] = set()  # (B, q, Lb) this cache ran compiled
        self.pending: dict[tuple[int, int, int], None] = {}  # (B, q, Lb) run eagerly, to compile (in order)
        self.broken: set[tuple[int, int, int]] = set()  # shapes whose compile failed: they stay eager
        self.capacity = -(-capacity // static.LENGTH_BUCKET) * static.LENGTH_BUCKET
        self.cache = StaticCache(config=model.config, max_cache_len=self.capacity)  # allocated by the first write
        self.ptr = 0
        self._step = static.step_function(model, compile, cpp_wrapper=cpp_wrapper)  # cpp_wrapper: CPU only
        self._eager = static.step_function(model, False)
        self._masks: dict[tuple[int, int, int], torch.Tensor] = {}  # (B, q, Lb) -> (B, 1, q, Lb) bool buffer
        self._views: dict[tuple[int, int], object] = {}  # (B, Lb) -> a StaticCache over those rows and columns
        self._device = next(model.parameters()).device

    @property
    def length(self) -> int:
        return self.ptr

    @property
    def allocated(self) -> bool:
        """Whether the buffers exist (a first write allocates them for the rows it covers)."""
        return all(layer.is_initialized for layer in self.cache.layers)

    def forward(self, inp: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, *,
                logits_to_keep: int = 0, compiled: bool = True) -> torch.Tensor:
        """As :meth:`DynamicKV.forward`; ``mask`` None means causal over the cache (no padding).
        ``compiled=False`` runs this forward eagerly (prefill and refresh, whose lengths vary), as does
        the first write (e.g. a block decoder's first step after a prompt shorter than a block)."""
        B, q = inp.shape
        end = self.ptr + q
        if end > self.capacity:
            raise UnmaskError(f"static KV cache overflow: {end} positions needed, {self.capacity} allocated; "
                              "this is a bug in the decoder's cache sizing, run without --compile")
        if B > self.batch:
            raise UnmaskError(f"a forward of {B} rows on a static cache of {self.batch}; this is a bug in the "
                              "decoder's row count, run without --compile")
        allocated = self.allocated
        Lb = self.bucket(end) if allocated else self.capacity  # a first write allocates all the columns
        buf = self._masks.get((B, q, Lb))
        if buf is None:
            buf = self._masks[(B, q, Lb)] = torch.zeros((B, 1, q, Lb), dtype=torch.bool, device=self._device)
        if mask is None:
            cols = torch.arange(Lb, device=self._device)  # (Lb,)
            rows = torch.arange(self.ptr, end, device=self._device)  # (q,)
            buf.copy_((cols[None, :] <= rows[:, None]).expand(B, 1, q, Lb))
        else:
            buf[..., :end] = mask  # (B, 1, q, end), broadcast from the caller's mask
            buf[..., end:] = False
        set_static_length(self.cache, self.ptr)
        if not allocated:
            # The first write allocates the buffers (StaticLayer.lazy_initialization): a graph traced
            # on that branch would allocate fresh zeros on every later call, and with tensor guards
            # only (static._guard_filter) it would also serve allocated caches of its shape.
            compiled = False
        elif compiled and self.defer and (B, q, Lb) not in self.compiled:
            if (B, q, Lb) not in self.broken:
                self.pending[(B, q, Lb)] = None
            compiled = False
        step = self._step if compiled else self._eager
        logits = step(inp, positions, attention_mask(self.model, buf), self.view(B, Lb))  # (B, q, V)
        if compiled:
            self.compiled.add((B, q, Lb))
        self.ptr = end
        return logits[:, -logits_to_keep:] if logits_to_keep else logits

    def fused(self, body, key: tuple, B: int, q: int, *args):
        """One step of B rows and q queries as ONE compiled graph (:func:`unmask.decode.engine.static.compiled_step`):
        ``body(forward, cache, C, *args)``, C (0-dim long) the cache length before the step, ``cache`` the
        rows' view of the length bucket, whose columns [C, C + q) the forward writes. ``key``: the
        non-tensor values ``body`` bakes in (the caller defers compiles). Returns body's outputs, or None
        (nothing run) before the first write allocates the cache or past its capacity: the caller's
        eager pieces then allocate it or raise."""
        end = self.ptr + q
        if not self.allocated or end > self.capacity or B > self.batch:
            return None
        Lb = self.bucket(end)
        set_static_length(self.cache, self.ptr)
        fn = static.compiled_step(self.model, body, key + (B, q, Lb))
        out = fn(self.view(B, Lb), self.cache.layers[0].cumulative_length, *args)
        self.ptr = end
        return out

    def crowded(self, most: int, q: int) -> bool:
        """Whether to compact the cache to ``most`` columns (every running row's valid keys, known on
        the host) before a forward of ``q`` queries: it would not fit, or compacted it would take a
        smaller length bucket (rows joining and leaving would otherwise attend over ever larger ones).
        Raises UnmaskError when even ``most + q`` columns do not fit."""
        if most + q > self.capacity:
            raise UnmaskError(f"static KV cache overflow: {most + q} positions needed, {self.capacity} "
                              "allocated; lower max_new_tokens or run without --compile")
        return self.ptr + q > self.capacity or self.bucket(self.ptr + q) > self.bucket(most + q)

    def bucket(self, end: int) -> int:
        """The columns a forward ending at ``end`` covers: the capacity, or with ``length_buckets``
        LENGTH_BUCKET doubled until it holds ``end`` (at most the capacity)."""
        if not self.length_buckets:
            return self.capacity
        return min(static.LENGTH_BUCKET << max(0, (-(-end // static.LENGTH_BUCKET) - 1).bit_length()), self.capacity)

    @torch.inference_mode()
    def warm(self) -> bool:
        """Compile the oldest pending shape (B, q, Lb) by one forward of token id 0 at the end of its
        length bucket, then move the pointer back to 0. Only for an empty cache: the K/V it writes lie
        past every row's valid keys (the next prefill places its own). Returns False when nothing is
        pending. Raises UnmaskError when rows still hold the cache (ptr > 0); a failed compile
        re-raises and leaves that shape eager for good."""
        if self.ptr:
            raise UnmaskError("a static KV cache compiles a pending shape only while no row holds it; "
                              "call warm() when its running batch is empty")
        if not self.pending:
            return False
        B, q, Lb = key = next(iter(self.pending))  # pending until its compile is done (/health counts it)
        self.ptr = Lb - q  # the forward's end lands in bucket Lb
        zeros = torch.zeros((B, q), dtype=torch.long, device=self._device)
        self.compiled.add(key)  # so the forward takes the compiled step
        try:
            self.forward(zeros, zeros + torch.arange(q, device=self._device), None)
        except Exception:
            self.compiled.discard(key)
            self.broken.add(key)
            raise
        finally:
            self.ptr = 0
            del self.pending[key]
        return True

    def view(self, B: int, Lb: int):
        """The cache of rows ``[0, B)`` and columns ``[0, Lb)``: ``self.cache`` itself when that is all
        of it (or before the first write allocates it), else a ``StaticCache`` whose layers hold views
        (B, H, Lb, D) of the full buffers and share their length counters, so its writes land in the
        full cache. Built once per (B, Lb): a compiled step sees the same objects every call (one
        graph per shape, no recompiles)."""
        if (B, Lb) == (self.batch, self.capacity) or not self.allocated:
            return self.cache
        view = self._views.get((B, Lb))
        if view is None:
            from transformers import StaticCache

            view = StaticCache(config=self.model.config, max_cache_len=Lb)
            for mine, full in zip(view.layers, self.cache.layers):
                mine.__dict__.update(full.__dict__)  # device, heads, dims and the shared cumulative_length
                mine.keys, mine.values = full.keys[:B, :, :Lb], full.values[:B, :, :Lb]  # (B, H, Lb, D) views
                mine.batch_size, mine.max_cache_len = B, Lb  # max_cache_len: the mask width HF expects
                if self._device.type == "cuda":  # CUDA graphs replay on fixed addresses
                    torch._dynamo.mark_static_address(mine.keys)
                    torch._dynamo.mark_static_address(mine.values)
            self._views[(B, Lb)] = view
        return view

    def crop(self, n: int) -> None:
        """Move the pointer back ``n`` positions (n <= 0: nothing). Raises UnmaskError for n > length:
        a negative pointer would make the next forward index before the cache's start."""
        _check_crop(n, self.ptr)
        if n > 0:
            self.ptr -= n

    def reset(self) -> None:
        self.ptr = 0

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys[:, :, : self.ptr], layer.values[:, :, : self.ptr]) for layer in self.cache.layers]


def check_fits(requests, length: int | None, slack: int) -> None:
    """Raise UnmaskError for a request whose prompt, new tokens and ``slack`` positions exceed a
    static cache of ``length`` (None: sized for its first join, nothing to check)."""
    for job in requests if length is not None else ():
        if len(job.prompt_ids) + job.max_new_tokens + slack > length:
            raise UnmaskError(f"a prompt of {len(job.prompt_ids)} tokens and {job.max_new_tokens} new tokens do "
                              f"not fit the static KV cache of {length}; lower max_tokens or run without --compile")


def pad(t: torch.Tensor, dim: int, n: int, fill, *, left: bool = False) -> torch.Tensor:
    """``t`` with ``n`` slices of ``fill`` added along ``dim`` (before when ``left``)."""
    if n <= 0:
        return t
    later = (0, 0) * (t.dim() - dim % t.dim() - 1)  # F.pad's pairs run from the last dimension back
    return torch.nn.functional.pad(t, (*later, *((n, 0) if left else (0, n))), value=fill)


def place(kv, key_valid: torch.Tensor, new: DynamicKV, valid: torch.Tensor, slots: list[int], *, rows: bool = True):
    """Put a prefill's K/V (``new``: n rows, P columns, key validity ``valid`` (n, P) bool) into batch
    rows ``slots`` of a running cache ``kv`` (key validity ``key_valid`` (R, C)), right-aligned at
    T = max(C, P) columns: the running rows get the columns past their C as invalid keys. A static
    cache is written in place (allocated for all its rows on first use); a dynamic one is rebuilt,
    grown to the highest slot, or adopted when it is empty (``rows`` False) and ``slots`` are 0..n-1.
    Returns (kv, key_valid (R', T)). Raises UnmaskError when a static cache cannot hold T columns."""
    n, P = valid.shape
    C = kv.length
    T = max(C, P)
    if not kv.static and not rows and slots == list(range(n)):
        return new, valid
    at = torch.tensor(slots, dtype=torch.long, device=valid.device)  # (n,)
    if kv.static:
        if T > kv.capacity:
            raise UnmaskError(f"a prompt of {P} tokens does not fit the static cache of {kv.capacity}; "
                              "shorten it or run without --compile")
        R, out = key_valid.shape[0], kv
        for layer, (k, v) in zip(kv.cache.layers, new.layers() if P else []):  # P = 0: no keys
            if not layer.is_initialized:  # allocate the static cache for every row
                shape = (R, k.shape[1], 1, k.shape[3])
                layer.lazy_initialization(k.new_zeros(shape), v.new_zeros((*shape[:3], v.shape[3])))
            layer.keys[at, :, T - P: T], layer.values[at, :, T - P: T] = k, v
        kv.ptr = T
    else:
        R, out = max(key_valid.shape[0], max(slots) + 1), DynamicKV(kv.model)
        old_layers = kv.layers() if C else None
        for i, (k, v) in enumerate(new.layers() if P else [(None, None)] * len(old_layers or [])):  # P = 0: no keys
            full = []
            for old, t in zip(old_layers[i] if old_layers else (None, None), (k, v)):
                like = t if P else old
                f = like.new_zeros((R, like.shape[1], T, like.shape[3]))  # (R, H, T, D)
                if old is not None:
                    f[: old.shape[0], :, :C] = old
                if P:
                    f[at, :, T - P:] = t
                full.append(f)
            out.cache.update(full[0], full[1], i)
    kvld = torch.zeros((R, T), dtype=torch.bool, device=valid.device)  # (R, T)
    kvld[: key_valid.shape[0], :C] = key_valid
    kvld[at] = False
    kvld[at, T - P:] = valid
    return out, kvld


def compact(kv, key_valid: torch.Tensor, M: int) -> torch.Tensor:
    """Slide each row's valid keys (key_valid (R, C) over the cache's C columns) to the right end of
    columns 0..M-1, order kept, in every layer; M >= every row's valid count (known on the host, so
    no sync). Returns the new key validity (R, M); the cache is cut to M columns (crop or pointer)."""
    R, C = key_valid.shape
    order = torch.sort(key_valid.to(torch.uint8), dim=1, stable=True).indices  # (R, C): invalid columns first
    src = order[:, C - M:]  # (R, M) source column of each kept column
    for keys, values in kv.layers():
        for t in (keys, values):  # (R', H, C, D), R' >= R
            H, D = t.shape[1], t.shape[3]
            t[:R, :, :M] = t[:R].gather(2, src[:, None, :, None].expand(R, H, M, D))  # (R, H, M, D)
    kept = key_valid.gather(1, src)  # (R, M)
    kv.crop(C - M)
    return kept


def make_kv(model, *, batch: int, capacity: int, static: bool = False, compile: bool = False):
    """The cache a decoder runs on: :class:`StaticKV` when ``static`` or ``compile``, else
    :class:`DynamicKV` (``batch`` and ``capacity`` are then unused)."""
    if static or compile:
        return StaticKV(model, batch, capacity, compile=compile)
    return DynamicKV(model)


_canvas_steps: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def canvas_forward(model, compile: bool = False):
    """The cache-free bidirectional forward of a whole canvas, ``f(inp, positions, mask, rows) ->
    logits``, for decoders without a KV cache (a no-cache dLLM step, spec/diffusion.md §3).

    inp, positions (B, T) long; mask (B, 1, T, T) in the backend's form, or None when no key is
    padding (attention then runs unmasked, ``is_causal=False``); rows (n,) long, the query rows
    whose logits are wanted (the LM head runs on those only). Returns float32 logits (B, n, V).
    With ``compile`` the forward is ``torch.compile``-d once per (model, input shapes), each graph
    on a code object of its own as in :func:`unmask.decode.engine.static.step_function` (inductor on
    CPU, CUDA graphs on CUDA); a decode's canvas has one shape, so it compiles once.
    """
    def step(inp, positions, mask, rows):
        out = model(input_ids=inp, position_ids=positions, attention_mask=mask, use_cache=False,
                    logits_to_keep=rows, is_causal=False)
        return out.logits.float()

    if not compile:
        return step
    table = _canvas_steps.setdefault(model, {})
    cuda = next(model.parameters()).device.type == "cuda"  # mode="reduce-overhead", as its option

    def compiled(inp, positions, mask, rows):
        key = (tuple(inp.shape), None if mask is None else (tuple(mask.shape), mask.dtype), tuple(rows.shape),
               model.training)
        fn = table.get(key)
        if fn is None:
            options = {**({"triton.cudagraphs": True} if cuda else {}), **static._guard_filter(model)} or None
            fn = table[key] = torch.compile(static._own_code(step), dynamic=False, options=options)
        return fn(inp, positions, mask, rows)

    return compiled
