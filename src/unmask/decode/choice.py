"""The default decoder of an SBD model: lossless SBD only where it is expected to beat AR here.

Lossless SBD gives AR's tokens (spec/sbd_exact.md); it pays off when its tokens per forward (TPF)
outweigh what its Q-query forward costs against AR's 1-query forward on this device. The TPF is a
property of the model (its drafts on its own text): ``calibrate-drafts`` records it, with the query
count of the default layout it was measured at, as ``lossless_measured`` in ``unmask_config.json``
or ``adapter.json``. The cost ratio is a property of the device: :func:`forward_cost` times both
forwards once per loaded model and caches the ratio. :func:`choose` (pure) turns the two into a
decoder; :func:`default_for` applies it to a bundle and words the note for falling back to AR.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from dataclasses import dataclass

import torch

from unmask.compat import crop, forward, new_cache
from unmask.decode import DECODERS, default_decoder
from unmask.errors import UnmaskError, is_int
from unmask.threads import scoped

# Lossless SBD must be expected this much faster than AR to be the default: the verify step's
# acceptance and bookkeeping cost time the forward-cost ratio leaves out.
MIN_GAIN = 1.1
COST_ENV = "UNMASK_FORWARD_COST"  # a fixed cost ratio instead of the timing (forward_cost)
RECORD_KEY = "lossless_measured"  # unmask_config.json / adapter.json: {"tpf", "queries", ...}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def choose(tpf: float | None, cost_ratio: float | None) -> str:
    """``"sbd"`` or ``"ar"``: lossless SBD when its expected speed-up ``tpf / cost_ratio`` is at
    least :data:`MIN_GAIN`, or when either figure is unknown (None: nothing measured, the SBD
    model's own decoder stays); else ``"ar"``. ``tpf``: tokens per forward of the default lossless
    layout (>= 1 in practice); ``cost_ratio``: its forward's seconds over AR's 1-query forward's.
    Raises UnmaskError for a figure that is not a finite number > 0."""
    for name, x in (("tpf", tpf), ("cost ratio", cost_ratio)):
        if x is not None and not _positive(x):
            raise UnmaskError(f"{name} must be a finite number > 0 (got {x!r})")
    if tpf is None or cost_ratio is None:
        return "sbd"
    return "sbd" if tpf / cost_ratio >= MIN_GAIN else "ar"


@dataclass(frozen=True)
class Measured:
    """A model's recorded lossless TPF at its default layout of ``queries`` query tokens per row."""

    tpf: float
    queries: int


def recorded(meta: dict, where: str = "the model's config") -> Measured | None:
    """The ``lossless_measured`` record of a bundle's ``meta`` (None when absent). Raises
    UnmaskError naming ``where`` for a record that is not ``{"tpf": > 0, "queries": int >= 1, ...}``."""
    rec = meta.get(RECORD_KEY)
    if rec is None:
        return None
    if not (isinstance(rec, dict) and _positive(rec.get("tpf")) and is_int(rec.get("queries")) and rec["queries"] >= 1):
        raise UnmaskError(f"{where}: {RECORD_KEY!r} must be an object with 'tpf' (a number > 0) and 'queries' (an "
                          f"integer >= 1), got {rec!r}; restore it or rerun 'unmask calibrate-drafts'")
    return Measured(tpf=float(rec["tpf"]), queries=int(rec["queries"]))


# model -> {(queries, device, dtype, threads): ratio}; weak, so a freed model's figures go with it
_COSTS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


@torch.inference_mode()
def forward_cost(bundle, queries: int, *, repeats: int = 5, budget_s: float = 0.3, prefix: int = 32) -> float:
    """Seconds of a ``queries``-token forward over a 1-token forward of ``bundle`` on its device,
    both after a ``prefix``-token KV cache (the Q tokens are mask tokens, so a gated adapter runs);
    the ratio of the fastest run of each, timed interleaved (at least ``repeats`` pairs, more until
    ``budget_s`` seconds have passed; a fast model: the median of 3 such windows; at least 1),
    after a warm-up. Cached per loaded
    model, query count, device, dtype and thread count: measured once per process.
    ``UNMASK_FORWARD_COST`` (a number >= 1), when set, is the ratio instead of a measurement (a
    fleet of servers, or a test, that must choose one default whatever the load). Raises
    UnmaskError for a value of it that is not such a number."""
    if (fixed := os.environ.get(COST_ENV, "").strip()):
        try:
            ratio = float(fixed)
        except ValueError:
            ratio = math.nan
        if not (math.isfinite(ratio) and ratio >= 1):
            raise UnmaskError(f"{COST_ENV}={fixed!r} must be a number >= 1 (a {queries}-query forward's cost over a "
                              "1-query forward's); unset it to measure")
        return ratio
    known = _COSTS.setdefault(bundle.model, {})
    key = (queries, str(bundle.device), str(bundle.dtype), torch.get_num_threads())
    if key in known:
        return known[key]
    dev, model = bundle.device, bundle.model
    P = max(1, min(prefix, bundle.context_length - queries - 1))
    fill = bundle.mask_token_id if bundle.mask_token_id is not None else 0
    cache = new_cache(model)
    forward(model, torch.zeros(1, P, dtype=torch.long, device=dev), position_ids=torch.arange(P, device=dev)[None],
            cache=cache, logits_to_keep=1)  # (1, 1, V): the prefix in the cache

    def timed(q: int) -> float:
        ids = torch.full((1, q), fill, dtype=torch.long, device=dev)  # (1, q)
        pos = torch.arange(P, P + q, device=dev)[None]  # (1, q)
        t0 = time.perf_counter()
        forward(model, ids, position_ids=pos, cache=cache)  # (1, q, V): every query's logits, as a verify step
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        crop(cache, q)
        return dt

    fast = True
    for i in range(3):  # warm-up: first-call allocations and kernel selection for both shapes
        fast = timed(1) + timed(queries) < 0.05
        if not fast and i:  # a large model: two warm-up pairs are enough
            break
    # a small model's forward takes a millisecond, which a busy machine's preemption dwarfs: time
    # interleaved pairs in 3 windows, take each window's fastest run of each shape (preemption
    # only adds time) and the median window, so one disturbed window cannot decide
    windows, ratios = (3 if fast else 1), []
    for _ in range(windows):
        one, many, t0 = [], [], time.perf_counter()
        while len(one) < repeats or (time.perf_counter() - t0 < budget_s / windows and len(one) < 500):
            one.append(timed(1))
            many.append(timed(queries))
        ratios.append(min(many) / max(min(one), 1e-9))
    # below 1 (more queries cheaper than one) is noise
    known[key] = ratio = max(1.0, sorted(ratios)[len(ratios) // 2])
    return ratio


@dataclass(frozen=True)
class Choice:
    """The default decoder of a bundle: ``decoder``, and when lossless SBD was measured, its
    recorded ``tpf``, the ``cost`` ratio of its forward, the ``queries`` per forward and ``note``
    (one line for stderr when the choice falls back to AR; None otherwise)."""

    decoder: str
    tpf: float | None = None
    cost: float | None = None
    queries: int | None = None
    note: str | None = None


@scoped  # timed at the thread count unmask.generate runs the model at
def default_for(bundle, options: dict | None = None) -> Choice:
    """The decoder to run on ``bundle`` when the user names none: the natural decoder of its kind
    (:func:`unmask.decode.default_decoder`); for an SBD model with a recorded lossless TPF and no
    knob of the ``sbd`` decoder in ``options`` (one asks for sbd, as a block draft source does),
    :func:`choose` over that TPF and :func:`forward_cost` measured here (``ar`` when lossless SBD is
    expected slower); a tensor-parallel bundle keeps its natural decoder (every rank must run the same
    one). Raises UnmaskError for a bad record."""
    natural = default_decoder(bundle.kind)
    sbd_only = {k.name for k in DECODERS["sbd"].knobs()} - {k.name for k in DECODERS["ar"].knobs()}
    source = (options or {}).get("draft_source")  # a block draft source (block, block+lookup, ...) is sbd's alone
    block_source = isinstance(source, str) and source in DECODERS["sbd"].config.sources \
        and source not in DECODERS["ar"].config.sources
    if bundle.kind != "sbd" or block_source or any((options or {}).get(k) is not None for k in sbd_only):
        return Choice(natural)
    if bundle.meta.get("tp"):  # tensor-parallel ranks must run one decoder: no per-rank timing
        return Choice(natural)
    where = (f"adapter {bundle.meta['adapter'].get('name')!r}" if bundle.meta.get("adapter")
             else f"{bundle.name}'s unmask_config.json")
    rec = recorded(bundle.meta, where)
    if rec is None:
        return Choice(natural)
    cost = forward_cost(bundle, rec.queries)
    decoder = choose(rec.tpf, cost)
    note = None
    if decoder == "ar":
        what = "with this adapter" if bundle.meta.get("adapter") else f"on {bundle.name}"
        note = (f"lossless sbd {what} is expected at {rec.tpf / cost:.1f}x AR on {bundle.device.type} (TPF "
                f"{rec.tpf:.2f}, a {rec.queries}-query forward costs {cost:.1f}x); decoding with ar — pass "
                "--decoder sbd to use it")
    return Choice(decoder, tpf=rec.tpf, cost=cost, queries=rec.queries, note=note)
