"""The fast path's compiled pieces: the decode-step forward that :class:`unmask.decode.engine.kv.StaticKV`
runs for every decoder on its preallocated ``StaticCache``.

gpt-fast's recipe (STYLE.md): the KV cache is a transformers ``StaticCache`` allocated once per
batch; a commit or a rejected draft moves its length pointer instead of copying tensors; every
step's inputs have the same shapes (ids (B, q), positions (B, q), a 4D mask over the whole cache
(B, 1, q, L)), so the step never recompiles; the prefill, whose length depends on the prompts, runs
eagerly. The decoders' loops are their running-batch classes (AR and lossless SBD:
:class:`unmask.decode.verify.batch.Verify`).

What is compiled: the model forward of one step (:func:`step_function`) and, for greedy AR and
lossless SBD steps, the whole step as ONE graph (:func:`compiled_step`: the query window and its mask,
the forward, the acceptance and commit); host-side bookkeeping stays outside. ``compile=False``
runs the same static cache eagerly (what the equality tests exercise quickly); ``compile=True``
compiles: on CPU inductor, on CUDA ``mode="reduce-overhead"`` (CUDA graphs). The first call per
(model, input shapes) pays the compile (README "The fast path" gives measured start-up times;
:func:`compile_progress` reports each compile); later calls reuse it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import types
import weakref

import torch

from unmask.compat import attention_mask, cache_keyword

# static cache lengths are rounded up to a multiple of this, so batches of similar prompts share one
# compiled step instead of compiling per prompt length
LENGTH_BUCKET = 128

_serial = itertools.count()
_graphs = itertools.count(1)  # compiles started in this process, for progress lines
_compiled: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()
_listeners: list = []  # compile_progress callbacks


@contextlib.contextmanager
def compile_progress(callback):
    """Within the block, ``callback(event)`` is called when a graph starts compiling and when it is
    done: ``{"graph": n, "rows": B, "queries": q, "cache": L, "done": False}``, then the same with
    ``"done": True`` and ``"seconds"`` (the first call's wall-clock: trace, compile and one run).
    ``n`` counts the process's compiles from 1; B, q, L: the step's rows, query tokens per row and
    cache columns. For a progress line (``unmask generate --compile``, ``serve --warmup``)."""
    _listeners.append(callback)
    try:
        yield
    finally:
        _listeners.remove(callback)


def _tell(event: dict) -> None:
    for callback in list(_listeners):
        callback(event)


def _eager(model):
    """One forward on the static cache, ``f(inp, positions, mask, cache) -> logits``: inp, positions
    (B, q) long, mask (B, 1, q, L) in the backend's form; float32 logits (B, q, V). Writes q K/V at
    the cache's length pointer and advances it by q."""
    kw = cache_keyword(model)  # resolved here: the compiled function calls no lru_cache

    def step(inp, positions, mask, cache):
        out = model(input_ids=inp, position_ids=positions, attention_mask=mask, use_cache=True, logits_to_keep=0,
                    **{kw: cache})
        return out.logits.float()

    return step


def step_function(model, compile: bool, *, cpp_wrapper: bool = False):
    """The decode-step forward ``f(inp, positions, mask, cache) -> logits``; with ``compile``, one
    ``torch.compile``-d function per (model, input shapes), cached weakly by model, so each compiled
    graph sits alone on its code object and a call checks only its own guards. ``cpp_wrapper``
    (CPU only): inductor's C++ wrapper instead of its Python one — for AR's one-token step, where
    the wrapper is most of the step on a small model (stories260K: 0.48 -> 0.29 ms per step,
    compiling ~19 s instead of ~6 s); the multi-token steps of block/multiblock measured no gain."""
    step = _eager(model)
    if not compile:
        return step
    table = _compiled.setdefault(model, {})
    cuda = next(model.parameters()).device.type == "cuda"
    # CUDA: mode="reduce-overhead" (CUDA graphs), written as its option to sit beside the guard filter
    how = {"triton.cudagraphs": True} if cuda else {"cpp_wrapper": True} if cpp_wrapper else {}

    def compiled(inp, positions, mask, cache):
        key = (tuple(inp.shape), tuple(mask.shape), mask.dtype, bool(how), model.training)
        fn = table.get(key) or _compile(model, step, how, table, key, (*inp.shape, mask.shape[-1]))
        return fn(inp, positions, mask, cache)

    return compiled


def _compile(model, fn, how: dict, table: dict, key, shape: tuple[int, int, int]):
    """``fn`` compiled on a code object of its own with options ``how`` and the guard filter, wrapped so that
    its first call (trace and compile) is reported to :func:`compile_progress` and stores it in ``table[key]``."""
    guards = _guard_filter(model)
    compiled = torch.compile(_own_code(fn), dynamic=False, options={**how, **guards} or None)
    gqa = bool(guards) and next(model.parameters()).device.type != "cuda"

    def first(*args):
        table[key] = compiled
        event = {"graph": next(_graphs), "rows": shape[0], "queries": shape[1], "cache": shape[2], "done": False}
        _tell(event)
        t0 = time.perf_counter()
        with _sdpa_gqa() if gqa else contextlib.nullcontext():  # the trace: SDPA's own GQA, not repeat_kv copies
            out = compiled(*args)
        _tell({**event, "done": True, "seconds": time.perf_counter() - t0})
        return out

    return first


def compiled_step(model, body, key: tuple):
    """``body(forward, *args)`` compiled with the model's step forward inside it, so a decoder's whole
    step (its query window, the forward and its commit rule) is ONE graph (STYLE.md habit 13):
    ``forward(inp, positions, mask, cache) -> logits`` as :func:`step_function`'s (``mask`` bool).
    One graph per (model, body, key), ``key`` every non-tensor value the trace bakes in (shapes,
    Python ints), ending with the step's (rows, queries, cache columns); guards as :func:`_guard_filter`;
    CUDA graphs on a GPU, inductor's C++ wrapper on CPU. Every output must be read before the next
    call (CUDA graphs reuse their buffers)."""
    table = _compiled.setdefault(model, {})
    k = ("step", body.__qualname__, body.__module__, key)
    if (fn := table.get(k)) is not None:
        return fn
    eager, device = _eager(model), next(model.parameters()).device.type

    def forward(inp, positions, mask, cache):
        return eager(inp, positions, attention_mask(model, mask), cache)

    def step(*args):
        return body(forward, *args)

    how = {"triton.cudagraphs": True} if device == "cuda" else {"cpp_wrapper": True} if device == "cpu" else {}
    return _compile(model, step, how, table, k, key[-3:])


def _guard_filter(model) -> dict:
    """Dynamo's guards keep only their tensor checks (dtype, device, shape, strides of every
    parameter, cache buffer and input) when nothing else the forward reads can change between
    calls of one graph: the graph's key holds the shapes and ``model.training``, and a model
    without forward hooks reads no Python state set per call. That cuts the guard check of every
    call (stories260K's AR step: 0.9 -> 0.7 ms). A hook marked ``unmask_tensor_only`` (an SBD
    adapter's gate, set from the call's ``input_ids``) keeps that; any other hook keeps every guard.
    The cache's one Python state, whether its buffers exist, is kept out of every graph instead:
    :class:`unmask.decode.engine.kv.StaticKV` runs the forward that allocates them eagerly (a graph traced on
    an unallocated cache allocates fresh zeros on each call and would pass these guards for any cache)."""
    hooks = [h for m in model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
    if any(not getattr(h, "unmask_tensor_only", False) for h in hooks):
        return {}
    return {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}


@contextlib.contextmanager
def _sdpa_gqa():
    """Trace with transformers' ``TRANSFORMERS_SDPA_FORCE_GQA``: a grouped-query model's attention
    calls SDPA with ``enable_gqa`` instead of copying K/V into every query head (``repeat_kv``, which
    eager skips for one query by ``pack_gqa``, but not under dynamo). On CPU that copy of the whole
    length bucket was most of a 64-row step (stories260K AR: 7.1 -> 4.2 ms). Only for graphs with
    tensor guards alone (:func:`_guard_filter`), which the variable's later value cannot invalidate."""
    name, old = "TRANSFORMERS_SDPA_FORCE_GQA", os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")
    os.environ[name] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _own_code(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs per code object and
    checks their guards in turn on every call: one shared step function would make every step pay
    for the guards of every other model's and shape's graphs (measured: 0.41 -> 1.05 ms per AR
    step after 15 graphs), and fall back to eager past 8 of them."""
    code = fn.__code__.replace(co_name=f"unmask_step_{next(_serial)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
