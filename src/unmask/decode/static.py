"""The fast path: AR and lossless SBD on a preallocated KV cache with a fixed-shape, compilable step.

gpt-fast's recipe (STYLE.md): the KV cache is a transformers ``StaticCache`` allocated once per
batch; a commit or a rejected draft moves its length pointer instead of copying tensors; every
step's inputs have the same shapes (ids (B, q), positions (B, q), a 4D mask over the whole cache
(B, 1, q, L)). Batch rows are never pruned (a finished row rides along masked), so the shapes
stay fixed and the step never recompiles; the prefill, whose length depends on the prompts, runs
eagerly. These functions reproduce the eager decoders' tokens and NFE (:mod:`unmask.decode.ar`,
:mod:`unmask.decode.sbd_verify`), with one host sync per step.

What is compiled: for AR (and the decoders on :mod:`unmask.decode.kv`) the model forward of one
step (:func:`step_function`), acceptance and stops outside it. For lossless SBD, greedy, the
whole step (:func:`verify_step`): a pure function of a fixed-shape :class:`VerifyState` that
builds the mask from a pointer tensor, runs the forward, takes the argmax, applies the accept
rule and moves the per-row state, so one graph replaces the ~30 small eager ops that cost a
fifth of a compiled step; only the accepted counts and ended flags come back to the host.

``compile=False`` runs the same static loop eagerly (what the equality tests exercise quickly);
``compile=True`` compiles: on CPU inductor (lossless SBD with its C++ wrapper), on CUDA
``mode="reduce-overhead"`` (CUDA graphs). The first call per (model, batch size, cache length)
pays the compile (5-30 s for the shipped models on one CPU core); later calls reuse it.
"""

from __future__ import annotations

import itertools
import time
import types
import weakref
from collections import Counter
from typing import NamedTuple

import torch

from unmask.compat import attention_mask, cache_keyword, set_static_length
from unmask.decode.ar import _hit_stop_string
from unmask.decode import sbd_verify as sv
from unmask.decode.batching import left_pad
from unmask.decode.stats import DecodeOutput, DecodeStats
from unmask.errors import UnmaskError
from unmask.masks import as_4d, causal_mask, with_key_padding
from unmask.sampling import Sampling, sample
from unmask.trace import step_event

# cache lengths are rounded up to a multiple of this, so batches of similar prompts share one
# compiled step instead of compiling per prompt length
LENGTH_BUCKET = 128

_serial = itertools.count()
_compiled: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def _forward(model, inp: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache,
             logits_to_keep: int = 0, cache_kw: str | None = None) -> torch.Tensor:
    """One forward on the static cache: inp, positions (B, q) long, mask (B, 1, q, L) in the
    backend's form. Returns float32 logits (B, q or logits_to_keep, V). Writes q K/V at the
    cache's length pointer and advances it by q."""
    out = model(input_ids=inp, position_ids=positions, attention_mask=mask, use_cache=True,
                logits_to_keep=logits_to_keep, **{cache_kw or cache_keyword(model): cache})
    return out.logits.float()


def step_function(model, compile: bool, *, cpp_wrapper: bool = False):
    """The decode-step forward ``f(inp, positions, mask, cache) -> logits``; with ``compile``, one
    ``torch.compile``-d function per (model, input shapes), cached weakly by model, so each compiled
    graph sits alone on its code object and a call checks only its own guards. ``cpp_wrapper``
    (CPU only): inductor's C++ wrapper instead of its Python one — for AR's one-token step, where
    the wrapper is most of the step on a small model (stories260K: 0.48 -> 0.29 ms per step,
    compiling ~19 s instead of ~6 s); the multi-token steps of block/multiblock measured no gain."""
    kw = cache_keyword(model)  # resolved here: the compiled function calls no lru_cache

    def step(inp, positions, mask, cache):
        return _forward(model, inp, positions, mask, cache, cache_kw=kw)

    if not compile:
        return step
    table = _compiled.setdefault(model, {})
    cuda = next(model.parameters()).device.type == "cuda"
    how = {"mode": "reduce-overhead"} if cuda else {"options": {"cpp_wrapper": True}} if cpp_wrapper else {}

    def compiled(inp, positions, mask, cache):
        key = (tuple(inp.shape), tuple(mask.shape), mask.dtype, bool(how))
        fn = table.get(key)
        if fn is None:
            fn = table[key] = torch.compile(_own_code(step), dynamic=False, **how)
        return fn(inp, positions, mask, cache)

    return compiled


def _own_code(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs per code object and
    checks their guards in turn on every call: one shared step function would make every step pay
    for the guards of every other model's and shape's graphs (measured: 0.41 -> 1.05 ms per AR
    step after 15 graphs), and fall back to eager past 8 of them."""
    code = fn.__code__.replace(co_name=f"unmask_step_{next(_serial)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def static_cache(model, batch: int, length: int):
    """A ``StaticCache`` of ``length`` rounded up to LENGTH_BUCKET tokens (allocated on first
    write, for ``batch`` rows). Returns (cache, L)."""
    from transformers import StaticCache

    L = -(-length // LENGTH_BUCKET) * LENGTH_BUCKET
    return StaticCache(config=model.config, max_cache_len=L), L


def _prefill_mask(model, q_mask: torch.Tensor, key_valid: torch.Tensor, L: int) -> torch.Tensor:
    """q_mask (q, q) bool among the prefill tokens, key_valid (B, q) -> (B, 1, q, L) backend mask."""
    B, q = key_valid.shape
    m = with_key_padding(as_4d(q_mask, B), key_valid)  # (B, 1, q, q)
    full = torch.zeros((B, 1, q, L), dtype=torch.bool, device=key_valid.device)
    full[..., :q] = m
    return attention_mask(model, full)


@torch.inference_mode()
def ar_decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
              stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (),
              compile: bool = False) -> DecodeOutput:
    """Autoregressive decoding on a static KV cache (the fast path of :func:`unmask.decode.ar.decode`).

    prompts: token ids per row (left-padded). Same tokens, NFE and per-row NFE as the eager
    decoder: one forward per step of q = 1 query per row against the whole cache (B, 1, 1, L),
    rows that stopped ride along until every row is done. Raises UnmaskError when the prompt plus
    ``max_new_tokens`` exceeds the model's context window.
    """
    model, device = bundle.model, bundle.device
    t0 = time.perf_counter()
    N = max_new_tokens
    ids, valid, pos = left_pad(prompts, bundle.pad_token_id, device)  # (B, P) each
    B, P = ids.shape
    cache, L = static_cache(model, B, P + N)
    cols = torch.arange(L, device=device)  # (L,)
    key_valid = torch.ones((B, L), dtype=torch.bool, device=device)  # (B, L): padding is the only invalid key
    key_valid[:, :P] = valid
    step = step_function(model, compile, cpp_wrapper=True)
    gens = sampling.row_generators(prompts, device)
    suppress = list(bundle.suppress_ids)
    stop = torch.tensor(sorted(set(stop_token_ids)) or [-1], dtype=torch.long, device=device)
    buf = torch.empty((B, N), dtype=torch.long, device=device)  # (B, N) generated tokens
    end = torch.full((B,), -1, dtype=torch.long, device=device)  # (B,) output length of a finished row
    on_stop = torch.zeros(B, dtype=torch.bool, device=device)  # (B,) ended on a stop token (counts for TPF)
    nfe_rows = [N] * B

    logits = _forward(model, ids, pos, _prefill_mask(model, causal_mask(P, device=device), valid, L), cache,
                      logits_to_keep=1)[:, -1]  # (B, V)
    next_pos = pos[:, -1:] + 1  # (B, 1)
    nfe = 1
    for t in range(N):
        if suppress:
            logits[:, suppress] = float("-inf")
        tok = sample(logits, sampling, gens)  # (B,)
        buf[:, t] = tok
        if stop_token_ids or stop_strings:
            running = end < 0  # (B,)
            at_stop = torch.isin(tok, stop) & running
            ended = at_stop
            if stop_strings:
                rows = list(range(B))
                ended = ended | (_hit_stop_string(bundle, prompts, buf[:, : t + 1], rows, stop_strings) & running)
            if bool(ended.any()):  # the one host sync per step, as in the eager decoder
                end = torch.where(at_stop, t, torch.where(ended, t + 1, end))
                on_stop |= at_stop
                for r in ended.nonzero()[:, 0].tolist():
                    nfe_rows[r] = t + 1
                if bool((end >= 0).all()):
                    break
        if t == N - 1:
            break
        mask = (key_valid & (cols <= P + t))[:, None, None, :]  # (B, 1, 1, L): keys 0..P+t
        logits = step(tok[:, None], next_pos, attention_mask(model, mask), cache)[:, -1]  # (B, V)
        next_pos = next_pos + 1
        nfe += 1
    lengths = torch.where(end >= 0, end, N).tolist()
    tokens = [row[:n] for row, n in zip(buf.tolist(), lengths)]
    stats = DecodeStats(nfe=nfe, nfe_per_row=nfe_rows, tokens_per_row=lengths, seconds=time.perf_counter() - t0,
                        extra={"compiled": bool(compile), "static_cache": L},
                        stops_per_row=on_stop.long().tolist())
    return DecodeOutput(tokens=tokens, stats=stats)


class VerifyState(NamedTuple):
    """The fixed-shape per-row state of lossless SBD on a static cache (B rows, L cache slots).
    Every step maps it to a new one (:func:`verify_step`); nothing in it changes shape."""

    b: torch.Tensor  # (B,) long: the bonus token, committed, its K/V not yet cached
    s: torch.Tensor  # (B, K-1) long: the draft after b
    q: torch.Tensor | None  # (B, K-1, V) float: the draft's proposal distributions (sampling only)
    draft_len: torch.Tensor  # (B,) long: real draft tokens (K-1, or 0 after a rejected linear draft)
    p_b: torch.Tensor  # (B,) long: position of b
    key_valid: torch.Tensor  # (B, L) bool: the cache slots a row attends to (False from the pointer on)
    n: torch.Tensor  # (B,) long: committed tokens per row (frozen once the row ends)
    out: torch.Tensor  # (B, N + 2K) long: committed ids (a finished row keeps writing past n)
    live: torch.Tensor  # (B,) bool: rows still running


def step_inputs(layout, st: VerifyState, ptr: torch.Tensor, mask_id: int, linear: bool):
    """The verify forward's inputs (spec/sbd_exact.md §1) at cache pointer ``ptr`` (0-d long).
    Pure. Returns inp (B, Q) long, positions (B, Q) long and the mask over the whole cache
    (B, 1, Q, L) bool: slots before ``ptr`` as ``key_valid``, the Q new ones as the layout, the
    rest masked."""
    K, Q = layout.K, layout.queries
    B, L = st.key_valid.shape
    if linear:
        Li = torch.where(st.draft_len > 0, K - 1, 0)  # (B,) the group follows K verify tokens, or only b
        lay_m, lay_o = layout.mask[Li], layout.offsets[Li]  # (B, Q, Q), (B, Q)
    else:
        lay_m, lay_o = layout.mask[K - 1].expand(B, Q, Q), layout.offsets[K - 1].expand(B, Q)
    draft_in = torch.where(st.draft_len[:, None] > 0, st.s, mask_id)  # (B, K-1)
    groups = torch.full((B, Q - K), mask_id, dtype=torch.long, device=st.s.device)  # (B, G·K)
    inp = torch.cat([st.b[:, None], draft_in, groups], dim=1)  # (B, Q)
    positions = st.p_b[:, None] + lay_o  # (B, Q)
    rel = torch.arange(L, device=ptr.device) - ptr  # (L,) slot index relative to the pointer
    own = lay_m.gather(2, rel.clamp(0, Q - 1).expand(B, Q, L)) & (rel < Q)  # (B, Q, L): the step's own slots
    mask = torch.where(rel < 0, st.key_valid[:, None, :], own)  # (B, Q, L)
    return inp, positions, mask[:, None]  # mask (B, 1, Q, L)


def advance(st: VerifyState, a, last, step_tok, s, q, ptr, stops, N, linear: bool):
    """Commit a step (spec §1, Accept): a (B,) accepted drafts, last (B,) the token after them,
    step_tok (B, K) the committed ids (valid up to a), s (B, K-1) / q the next draft. Pure.

    The committed verify tokens' K/V stay in the cache: slots ptr .. ptr+a of a running row
    become valid keys (the host moves the pointer by the most any running row kept). Returns the
    new state, ``host`` (2B,) long = per-row committed counts then ended flags (the step's one
    host sync), and ``new`` (B, K) bool, which of step_tok were committed."""
    K = step_tok.shape[1]
    committed = a + 1  # (B,)
    ar = torch.arange(K, device=a.device)  # (K,)
    new = ar[None, :] < committed[:, None]  # (B, K)
    out = st.out.scatter(1, st.n[:, None] + ar, step_tok)  # (B, N + 2K)
    n = st.n + committed * st.live
    draft_len = torch.where(a == st.draft_len, K - 1, 0) if linear else st.draft_len
    ended = (torch.isin(step_tok, stops) & new).any(dim=1) | (n >= N)  # (B,)
    rel = torch.arange(st.key_valid.shape[1], device=a.device) - ptr  # (L,)
    kept = (rel >= 0) & (rel < committed[:, None]) & st.live[:, None]  # (B, L)
    nxt = VerifyState(b=last, s=s, q=q, draft_len=draft_len, p_b=st.p_b + committed,
                      key_valid=st.key_valid | kept, n=n, out=out, live=st.live)
    return nxt, torch.cat([committed, ended.long()]), new


def _group_draft(x: torch.Tensor, g: torch.Tensor, K: int) -> torch.Tensor:
    """x (B, G·K, ...) per-group outputs -> (B, K-1, ...): group g's offsets 1..K-1 (the new draft).
    A gather, not a slice, so the draft is laid out like the prefill's and the step compiles once."""
    idx = g[:, None] * K + torch.arange(1, K, device=g.device)  # (B, K-1) query index in the groups
    if x.dim() == 3:
        idx = idx[:, :, None].expand(-1, -1, x.shape[2])  # (B, K-1, V)
    return x.gather(1, idx)


def verify_step(model, layout, *, mask_id: int, suppress: list[int], linear: bool, sampling: Sampling, gens,
                compile: bool):
    """One lossless SBD step on the static cache, ``f(st, ptr, stops, N, cache) -> (st, host, new,
    step_tok)``: build the inputs and mask, run the forward (writing Q K/V at ``ptr``), accept
    and advance. Greedy, the whole step is one pure function and ``compile`` compiles it (masks,
    forward, argmax and acceptance fused in one graph); sampling draws from per-row generators,
    so only inputs + forward are compiled and the acceptance runs eagerly after it."""
    kw = cache_keyword(model)
    K = layout.K

    def logits_of(st, ptr, cache):  # (B, Q, V)
        inp, positions, mask = step_inputs(layout, st, ptr, mask_id, linear)
        logits = _forward(model, inp, positions, attention_mask(model, mask), cache, cache_kw=kw)
        if suppress:
            logits[..., suppress] = float("-inf")
        return logits

    if sampling.greedy:
        def step(st, ptr, stops, N, cache):
            top = logits_of(st, ptr, cache).argmax(dim=-1)  # (B, Q)
            step_tok = top[:, :K]  # (B, K): accepted drafts equal their targets, then the bonus
            a = sv.greedy_accept(step_tok, st.s, st.draft_len)  # (B,)
            last = step_tok.gather(1, a[:, None])[:, 0]  # (B,)
            s = _group_draft(top[:, K:], a if not linear else torch.zeros_like(a), K)  # (B, K-1)
            return (*advance(st, a, last, step_tok, s, None, ptr, stops, N, linear), step_tok)

        key = ("verify", layout.K, linear, mask_id, tuple(suppress))
        return _compiled_fn(model, key, step) if compile else step

    fwd = _compiled_fn(model, ("verify-logits", layout.K, linear, mask_id, tuple(suppress)), logits_of) \
        if compile else logits_of

    def sampled(st, ptr, stops, N, cache):
        logits = fwd(st, ptr, cache)  # (B, Q, V)
        a, last = sv.speculative_accept(sv._probs(logits[:, :K], sampling), st.q, st.s, st.draft_len, gens)
        ar = torch.arange(K, device=a.device)
        step_tok = torch.where(ar[None, :] < a[:, None], torch.cat([st.s, st.s[:, :1]], dim=1), 0)  # (B, K)
        step_tok = step_tok.scatter(1, a[:, None], last[:, None])
        g = a if not linear else torch.zeros_like(a)
        s, q = sv._draw(_group_draft(logits[:, K:], g, K), sampling, gens)  # (B, K-1), (B, K-1, V)
        return (*advance(st, a, last, step_tok, s, q, ptr, stops, N, linear), step_tok)

    return sampled


def _compiled_fn(model, key, fn):
    """``fn(st, ...)`` compiled once per (model, key, batch size, cache length), each graph on a
    code object of its own (:func:`_own_code`); ``key`` names everything ``fn`` closes over
    besides the model (the other inputs' shapes follow from these)."""
    table = _compiled.setdefault(model, {})
    # CUDA: CUDA graphs. CPU: a C++ wrapper instead of inductor's Python one, which on a small
    # model is a third of the step (measured on stories260K-sbd: 0.82 -> 0.68 ms CPU per step;
    # compiling takes ~20 s instead of ~10 s)
    cuda = next(model.parameters()).device.type == "cuda"
    how = {"mode": "reduce-overhead"} if cuda else {"options": {"cpp_wrapper": True}}

    def compiled(st, *args):
        full = (key, st.key_valid.shape)
        f = table.get(full)
        if f is None:
            f = table[full] = torch.compile(_own_code(fn), dynamic=False, **how)
        return f(st, *args)

    return compiled


@torch.inference_mode()
def verify_decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
                  stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (), block_size: int = 8,
                  draft: str = "linear", compile: bool = False, on_step=None) -> DecodeOutput:
    """Lossless SBD on a static KV cache (the fast path of :func:`unmask.decode.sbd_verify.decode`,
    spec/sbd_exact.md §1–2).

    Each step writes the Q = K + G·K verify and draft-group queries at the cache pointer; the
    pointer then moves past the K - unused verify tokens some row accepted, so the groups' K/V
    and rejected drafts are overwritten by the next step instead of being cropped. Per-row key
    validity (B, L) masks what a row rejected. For a batch, where the pointer moves by the
    largest acceptance, a full cache is compacted in place (each row's valid keys slid to the
    right, order kept); a batch of one never compacts. The step is a function of a fixed-shape
    :class:`VerifyState` (:func:`verify_step`; greedy, one compiled graph from the mask to the
    accept rule), with one host sync per step. Same tokens and NFE as the eager decoder, and the
    same :mod:`unmask.trace` step events to ``on_step`` (built after each step, outside the
    compiled step). Raises UnmaskError as :func:`unmask.decode.sbd_verify.decode` does.
    """
    if bundle.mask_token_id is None:
        raise UnmaskError("lossless SBD needs a model with a mask token (an SBD model, or a base with an "
                          "SBD adapter: --adapter); train one with 'unmask train sbd' or 'unmask train sbd-adapter'")
    cfg = sv.VerifyConfig(block_size=block_size, draft=draft)
    K, model, device, mask_id = cfg.block_size, bundle.model, bundle.device, bundle.mask_token_id
    if 2 * K > bundle.context_length:
        raise UnmaskError(f"block size {K} is too large for the context window of {bundle.context_length}; "
                          "lower --block-size")
    t0 = time.perf_counter()
    layout = sv.step_layout(K, cfg.draft, device)
    Q = layout.queries
    N = max_new_tokens
    gens = sampling.row_generators(prompts, device)
    suppress = list(bundle.suppress_ids)
    stops = torch.tensor(sorted(set(stop_token_ids)) or [-1], device=device)
    step = verify_step(model, layout, mask_id=mask_id, suppress=suppress, linear=cfg.draft == "linear",
                       sampling=sampling, gens=gens, compile=compile)

    # ---- prefill (eager: its length depends on the prompts): the prompt, causal, and one draft group
    inp, positions, m, kv_valid, valid, row_len = sv.prefill_inputs(bundle, prompts, K)  # (B, P+K), ...
    B, P = valid.shape
    cache, L = static_cache(model, B, P + N + K + Q)
    logits = _forward(model, inp, positions, _prefill_mask(model, m, kv_valid, L), cache,
                      logits_to_keep=K + 1)  # (B, K+1, V): last prompt token + group
    ptr = P  # cache pointer: the group's K/V are overwritten by the first step
    key_valid = torch.zeros((B, L), dtype=torch.bool, device=device)  # (B, L)
    key_valid[:, :P] = valid
    if suppress:
        logits[..., suppress] = float("-inf")
    b, _ = sv._draw(logits[:, 0], sampling, gens)  # (B,) the first bonus token
    s, q = sv._draw(logits[:, 2:], sampling, gens)  # (B, K-1) draft
    out = torch.full((B, N + 2 * K), -1, dtype=torch.long, device=device)  # slack: finished rows keep writing
    out[:, 0] = b
    st = VerifyState(b=b, s=s, q=q, draft_len=torch.full((B,), K - 1, dtype=torch.long, device=device),
                     p_b=row_len.clone(), key_valid=key_valid, n=torch.ones(B, dtype=torch.long, device=device),
                     out=out, live=torch.ones(B, dtype=torch.bool, device=device))
    alive = [True] * B  # a finished row rides along, its n frozen
    tokens: list[list[int]] = [[] for _ in range(B)]
    stopped = [0] * B  # 1 where a row ended on a stop token (counts for TPF, see DecodeStats)
    nfe, nfe_rows = 1, [1] * B
    row_accepts: list[list[int]] = [[1] for _ in range(B)]
    ended = sv._ended(out[:, :1], torch.ones((B, 1), dtype=torch.bool, device=device), st.n, N, stops)
    if on_step is not None:
        for r in range(B):
            canvas = torch.cat([b[r: r + 1], torch.full((K - 1,), mask_id, device=device)])
            on_step(step_event(0, r, torch.ones(1, dtype=torch.bool), b[r: r + 1], 0, canvas, mask_id))
    _finish(bundle, prompts, alive, (tokens, stopped), out, st.n, ended.tolist(), None, stops, stop_strings, N)
    st = st._replace(live=torch.tensor(alive, device=device))
    ptr_t = torch.zeros((), dtype=torch.long, device=device)  # the pointer as a tensor: no recompile per value
    N_t = torch.tensor(N, device=device)
    while any(alive):
        set_static_length(cache, ptr)
        ptr_t.fill_(ptr)
        n_before = st.n
        st, host_t, new, step_tok = step(st, ptr_t, stops, N_t, cache)
        nfe += 1
        host = host_t.tolist()  # the step's one host sync: committed counts, ended flags
        live = [i for i in range(B) if alive[i]]
        ptr += max(host[i] for i in live)  # verify tokens some running row accepted
        for i in live:
            nfe_rows[i] += 1
            row_accepts[i].append(host[i])
            if on_step is not None:
                canvas = torch.cat([st.out[i, : st.n[i]], torch.full((K - 1,), mask_id, device=device)])
                on_step(step_event(nfe - 1, i, new[i], step_tok[i], int(n_before[i]), canvas, mask_id))
        if stop_strings or any(host[B + i] for i in live):
            _finish(bundle, prompts, alive, (tokens, stopped), st.out, st.n, host[B:], n_before, stops, stop_strings, N)
            st = st._replace(live=torch.tensor(alive, device=device))
        if any(alive) and ptr + Q > L:
            ptr = _compact(cache, st.key_valid, ptr)

    accepts = Counter(c for ra in row_accepts for c in ra)
    drafted = Counter(c - 1 for ra in row_accepts for c in ra[1:])
    extra = {"verify": True, "draft": cfg.draft, "block_size": K, "accepts": dict(sorted(accepts.items())),
             "accepted_drafts": dict(sorted(drafted.items())), "compiled": bool(compile), "static_cache": L,
             "row_extra": [{"verify": True, "draft": cfg.draft, "block_size": K, "accepts": ra} for ra in row_accepts]}
    stats = DecodeStats(nfe=nfe, nfe_per_row=nfe_rows, tokens_per_row=[len(t) for t in tokens],
                        seconds=time.perf_counter() - t0, extra=extra, stops_per_row=stopped)
    return DecodeOutput(tokens=tokens, stats=stats)


def _finish(bundle, prompts, alive, outs, out, n, ended, n_before, stops, stop_strings, N) -> None:
    """Retire finished rows in place: ``alive[i] = False``, ``stopped[i]`` (1 when cut before a stop
    token) and ``tokens[i]`` = the row's output, with ``outs`` = (tokens, stopped),
    cut at its first stop token (excluded) or after the token completing a stop string, and at
    N tokens (the eager decoder's ``_retire`` without pruning)."""
    from unmask.decode.sbd_verify import cut_row

    tokens, stopped = outs
    counts = n.tolist()
    stop_set = set(stops.tolist())
    for i in range(len(alive)):
        if not alive[i]:
            continue
        start = 0 if n_before is None else int(n_before[i])
        full = out[i, : counts[i]].tolist()
        row, hit = cut_row(bundle, prompts[i], full, stop_set, stop_strings, start)
        if ended[i] or hit:
            tokens[i], alive[i] = row[:N], False
            stopped[i] = int(not hit and len(row) < min(len(full), N))  # cut before a stop token


def _compact(cache, key_valid: torch.Tensor, ptr: int) -> int:
    """Slide each row's valid keys (key_valid (B, L) over columns < ptr) to the right end of
    columns 0..M-1, order kept, in every cache layer; M = the most valid keys of any row.
    Rejected drafts of a batch leave holes that the shared pointer cannot reuse; this reclaims
    them without changing the cache's shape. Returns the new pointer M."""
    B = key_valid.shape[0]
    counts = key_valid[:, :ptr].sum(dim=1)  # (B,)
    M = int(counts.max())
    idx = torch.zeros((B, M), dtype=torch.long, device=key_valid.device)  # (B, M) source column per new column
    for r in range(B):
        src = key_valid[r, :ptr].nonzero()[:, 0]  # (c_r,)
        idx[r, M - src.numel():] = src
    for layer in cache.layers:
        for t in (layer.keys, layer.values):  # (B, H, L, D)
            H, D = t.shape[1], t.shape[3]
            t[:, :, :M] = t.gather(2, idx[:, None, :, None].expand(B, H, M, D))
    cols = torch.arange(M, device=key_valid.device)  # (M,)
    key_valid[:, :M] = cols[None, :] >= (M - counts)[:, None]
    key_valid[:, M:] = False
    return M
