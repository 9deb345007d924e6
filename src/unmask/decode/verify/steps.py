"""Lossless Set Block Decoding: the block mode drafts, the NTP mode verifies in the same forward
(spec/sbd_exact.md §1–2).

Each forward feeds, per row, the *verify part* ``b, s_1..s_{K-1}`` (the last committed token and
the current draft, causal) and the *draft groups*: all-mask blocks of K tokens placed after draft
prefixes, which see the cache, their prefix of the verify part and themselves, never another
group. The NTP logits of the verify part accept the longest confirmed prefix of the draft plus one
bonus token (greedy: argmax agreement; sampling: the speculative-sampling rule), and the group after
the accepted prefix supplies the next draft. Only causal K/V of committed tokens survive a step, so
the output is exactly what NTP decoding of the same model gives: token for token under greedy
decoding, in distribution under sampling.

Two drafting layouts (spec §1):

- ``quadratic``: K groups, group i after ``b, s_1..s_i``; K + K² query tokens per row. A draft is
  available whatever was accepted.
- ``linear``: one group after the whole verify part (2K query tokens). Its draft is usable only
  when the whole draft was accepted; a row whose draft was rejected places its next group right
  after ``b`` and verifies nothing (it commits one token and gets a fresh draft).

Batching (spec §2): rows accept different lengths. Every row appends its K verify tokens to the
cache; rejected ones stay as invalid keys of that row (``key_valid``), and the tail that no row
accepted is cropped, so a batch of one keeps an exactly compact cache. This module holds the pure
pieces (layouts, the prefill's inputs, the accept rules) and ``decode``; the running batch that
applies them is :class:`unmask.decode.verify.batch.Verify` (AR is its K = 1 case).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter, OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from unmask.decode.verify import layout as dl
from unmask.decode.verify import siblings as sl
from unmask.decode.verify import tree as tv
from unmask.decode.engine.batching import left_pad
from unmask.decode.engine.stats import DecodeOutput
from unmask.errors import UnmaskError
from unmask.masks import causal_mask
from unmask.sampling import Sampling

DRAFTS = ("quadratic", "linear")
# the fastest lossless setting in tokens per second on both shipped SBD models (batch 1, 1 thread,
# benchmarks/sbd_lossless.py): linear drafts cost 2K queries per forward, quadratic ones K + K^2
DEFAULT_DRAFT = "linear"
DEFAULT_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 64  # the step tables grow as K^4 (tree_verify.TreeWindow.src): 64 is ~130 MB
MAX_TABLE_MIB = 256  # a layout's step tables (tree_verify.table_bytes): linear K = 64 needs ~200 MiB


@dataclass(frozen=True)
class VerifyConfig:
    """Draft block size K (the SBD block size, >= 2) and the drafting layout: ``linear``,
    ``quadratic`` (spec §1) or a budgeted one (spec §5.1: ``budget``, ``budget:Q``, ``D/S/G`` text,
    ``D/S/G+j[cC][gG]..`` with siblings (spec §5.3), a DraftLayout or a TreeLayout, kept as its text;
    then K = D + 1, whatever ``block_size`` says). ``smaller``: budgeted layouts (``D/S/G`` text, each
    D below the draft's) that rows of a smaller draft size run instead of the draft cut to their K:
    the load sizer's (a server's stored calibrated layouts, e.g. the 8-query one at a moderate load).
    Raises UnmaskError for a bad size or layout."""

    block_size: int = DEFAULT_BLOCK_SIZE
    draft: str = DEFAULT_DRAFT
    smaller: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 2:
            raise UnmaskError(f"lossless SBD needs a block size >= 2 (got {self.block_size!r}); "
                              "pass e.g. --block-size 8")
        draft = self.draft.spec if isinstance(self.draft, (dl.DraftLayout, sl.TreeLayout)) else self.draft
        if dl.is_layout(draft):
            draft = dl.resolve(draft)  # frozen: the resolved text and its K are set once, here
            object.__setattr__(self, "draft", draft)
            object.__setattr__(self, "block_size", sl.parse(draft).D + 1)
        elif draft not in DRAFTS:
            raise UnmaskError(f"unknown draft layout {draft!r}; choose one of {', '.join(DRAFTS)}, budget "
                              "(with --queries Q) or D/S/G text such as 3/0,2,3/4")
        if self.block_size > MAX_BLOCK_SIZE:
            raise UnmaskError(f"lossless SBD drafts at most {MAX_BLOCK_SIZE - 1} tokens per step ({self.block_size - 1} "
                              f"asked, block size K = {self.block_size}); lower --block-size or the layout's D")
        if isinstance(self.smaller, str) or not isinstance(self.smaller, (tuple, list)):
            raise UnmaskError(f"smaller layouts are a tuple of D/S/G texts (got {self.smaller!r}), e.g. ('3/3/4',)")
        object.__setattr__(self, "smaller", smaller := tuple(dict.fromkeys(dl.canonical(str(t)) for t in self.smaller)))
        if smaller and (not self.budgeted or any(sl.parse(t).D + 1 >= self.block_size for t in smaller)):
            raise UnmaskError(f"smaller layouts ({', '.join(smaller)}) need a budgeted draft (D/S/G, got {self.draft}) "
                              f"and fewer than its {self.block_size - 1} draft tokens; drop them")

    def check_fits(self, context_length: int) -> None:
        """Raise UnmaskError when a step of this config cannot fit the context window (2K positions,
        prefill group included, or more query tokens per forward than ``context_length``) or its step
        tables (:func:`~unmask.decode.verify.tree.table_bytes`) would pass MAX_TABLE_MIB."""
        if 2 * self.block_size > context_length:
            raise UnmaskError(f"block size {self.block_size} is too large for the context window of "
                              f"{context_length}; lower --block-size")
        if (Q := queries(self.block_size, self.draft, self.smaller)) > context_length:
            raise UnmaskError(f"draft layout {self.draft} needs {Q} query tokens per forward, more than the context "
                              f"window of {context_length}; use shorter groups (e.g. --draft budget)")
        mib = tv.table_bytes(family(self.draft, self.block_size, self.smaller)) / 2**20
        if mib > MAX_TABLE_MIB:  # before anything allocates them (the running batch builds them lazily)
            raise UnmaskError(f"draft layout {self.draft} at draft size {self.block_size} needs {mib:,.0f} MiB of step "
                              f"tables, more than the {MAX_TABLE_MIB} MiB allowed; use fewer draft tokens or shorter "
                              "groups (e.g. --draft budget)")

    def check_rows(self, K: int, context_length: int, capacity: int | None = None, longest: int = 0, sizes=()) -> None:
        """Raise UnmaskError unless rows of draft size K can join a running batch of this config:
        :meth:`check_fits` at K and, on a static cache of ``capacity`` columns, the longest row's
        prompt and new tokens (``longest``) plus the widest step window (of K and ``sizes``, the
        running rows' draft sizes). A cache sized for the context window passes ``longest`` =
        ``context_length`` and no sizes, so whether a row fits depends on that row alone."""
        if K > self.block_size:
            if (Q := max(queries(K, self.draft, self.smaller), 2 * K)) > context_length:
                raise UnmaskError(f"block size {K} with draft layout {self.draft} needs {Q} positions per forward, more "
                                  f"than the context window of {context_length}; lower block_size")
            dataclasses.replace(self, block_size=K).check_fits(context_length)  # its step tables
        if capacity is not None and longest + (Q := queries(max([K, *sizes]), self.draft, self.smaller)) > capacity:
            raise UnmaskError(f"a row of {longest} tokens (prompt and max_tokens) with a step window of {Q} queries does "
                              f"not fit the static KV cache of {capacity}; lower block_size or max_tokens, or run without "
                              "--compile")

    @property
    def budgeted(self) -> bool:
        return self.draft not in DRAFTS

    def row_size(self, K: int) -> int:
        """The draft size a row asking for K runs at: K, or at most D + 1 under a budgeted layout."""
        return min(K, self.block_size) if self.budgeted else K


@functools.lru_cache(maxsize=256)  # a step asks each time: parsing the layouts cost ~0.1 ms of a 1.4 ms step
def queries(K: int, draft: str, smaller: tuple[str, ...] = ()) -> int:
    """Query tokens per row of a step of draft size K: 1 for an AR step, else the step window of
    draft sizes up to K (:func:`~unmask.decode.verify.tree.slots`; K + G·K for linear and quadratic, spec §1, §5.1)."""
    return 1 if K == 1 else tv.slots(family(draft, K, smaller))[3]


def family(draft: str, Kmax: int, smaller: tuple[str, ...] = ()) -> list:
    """The layout of each draft size K = 1..Kmax (index K - 1; None: an AR step): ``linear(K)``,
    ``quadratic(K)``, or a budgeted ``D/S/G`` layout cut to K - 1 draft tokens (spec §5.1); a layout
    with siblings (spec §5.3) keeps them at its own K = D + 1 only (a smaller K runs the chain).
    ``smaller`` (budgeted only): layouts of fewer draft tokens; a size K runs the one of them with
    the fewest draft tokens >= K - 1 (cut the same way), the draft itself when none has enough."""
    if draft in DRAFTS:
        make = dl.quadratic if draft == "quadratic" else dl.linear
        return [None] + [make(K) for K in range(2, Kmax + 1)]
    trees = sorted((sl.parse(t) for t in (draft, *smaller)), key=lambda t: t.D)  # stable: the draft first at a tie

    def at(K: int):
        tree = next((t for t in trees if t.D >= K - 1), trees[-1])
        if K - 1 >= tree.D and tree.siblings:
            return tree
        return sl.TreeLayout(tree.chain.truncated(K - 1)) if any(t.siblings for t in trees) else tree.chain.truncated(K - 1)

    return [None] + [at(K) for K in range(2, Kmax + 1)]


# step tables of the last few small layouts, shared: a decode() would rebuild them per call (5.4 ms for the
# stories260K adapter's default); only small ones, so the server's bound on table memory still holds
_TABLES: OrderedDict = OrderedDict()
CACHED_TABLES, CACHED_TABLE_BYTES = 8, 1 << 20


def tables(draft: str, Kmax: int, smaller: tuple[str, ...] = (), device=None) -> tv.TreeWindow:
    """:func:`unmask.decode.verify.tree.tree_window` of ``family(draft, Kmax, smaller)`` on ``device``,
    shared by every running batch of that layout (read only). The last CACHED_TABLES whose tables
    take at most CACHED_TABLE_BYTES are kept; a larger one is built per call."""
    key = (draft, Kmax, tuple(smaller), str(device))
    tw = _TABLES.get(key)
    if tw is not None:
        _TABLES.move_to_end(key)
        return tw
    layouts = family(draft, Kmax, smaller)
    tw = tv.tree_window(layouts, device)
    if tv.table_bytes(layouts) <= CACHED_TABLE_BYTES:
        _TABLES[key] = tw
        while len(_TABLES) > CACHED_TABLES:
            _TABLES.popitem(last=False)
    return tw


def window_layout(layouts: list, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's step layout and next-draft rule inside one query window (:func:`queries`), the
    chain path of :func:`unmask.decode.verify.tree.tree_window`. Pure.

    Returns mask (Kmax, Kmax, Q, Q) bool and offsets (Kmax, Kmax, Q) long, indexed [K - 1, d] for a
    row of draft size K with a d-token draft; src (Kmax, Kmax, Kmax, max(Kmax - 1, 1)) long, the
    window query of each next-draft token, and length (Kmax, Kmax, Kmax) long, the next draft's
    length, both indexed [K - 1, d, a] after accepting a (spec §5.2). Verify token j (<= D) sees
    verify tokens 0..j at offset j; a group after prefix e (:meth:`DraftLayout.groups_for`) sees
    verify tokens 0..e and itself, its offset o at e + 1 + o; every other query sees only itself
    at offset 0 (never an all-masked query row). K = 1 is the AR step: query 0 alone."""
    tw = tv.tree_window(layouts, device)
    return tw.mask, tw.offsets, tw.src[:, :, 0], tw.length[:, :, 0]


def advance(a: torch.Tensor, step_tok: torch.Tensor, n: torch.Tensor, N: torch.Tensor, live: torch.Tensor,
            stops: torch.Tensor, next_len: torch.Tensor):
    """The commit rule of a step (spec §1, Accept). Pure.

    a (R,) accepted draft tokens; step_tok (R, W) the step's ids (the first a + 1 committed); n (R,)
    committed counts, N (R,) budgets, live (R,) bool rows; stops (S,) stop ids; next_len (R,) the
    next draft's length (:func:`window_layout`'s ``length``; 0 for AR rows). A dead slot commits
    nothing. Returns committed (R,), new (R, W) bool (which of step_tok are committed), n (R,),
    draft_len (R,) of the next draft and ended (R,) bool (a stop token committed or N reached)."""
    committed = (a + 1) * live  # (R,)
    new = torch.arange(step_tok.shape[1], device=a.device)[None, :] < committed[:, None]  # (R, W)
    n = n + committed
    ended = ((torch.isin(step_tok, stops) & new).any(dim=1) | (n >= N)) & live  # (R,)
    return committed, new, n, next_len, ended


def settle(a, p, step_tok, tw: tv.TreeWindow, K, dl, n, N, live, stops, b, Q: int):
    """A step's commit after acceptance (spec §1 Accept, §5.2). Pure. a, p (R,) the accepted draft tokens and
    path, step_tok (R, Kmax) its argmaxes; K, dl, n, N, live, b (R,) the rows' draft sizes, draft lengths,
    committed counts, budgets, liveness and bonus; stops (S,); Q the window. Returns the next bonus (R,),
    committed (R,), n (R,), the next draft lengths (R,), keep (R, Q) bool (the cache columns kept) and
    host (3R + R·Kmax,) long, the step's one host read: committed, ended, one past the last kept column, step_tok."""
    Kmax = step_tok.shape[1]
    nxt = dl if Kmax == 1 else tw.length[K - 1, dl, p, a]  # next draft lengths (AR rows: 0)
    committed, _, n, nxt, ended = advance(a, step_tok, n, N, live, stops, nxt)
    keep, last = tv.kept_columns(tw, K, dl, p, committed, Q)
    bonus = step_tok[:, 0] if Kmax == 1 else step_tok.gather(1, a[:, None])[:, 0]  # (R,)
    host = torch.cat([committed, ended.long(), last, step_tok.flatten()])
    return torch.where(live, bonus, b), committed, n, nxt, keep, host


def greedy_step(logits, inp, tw: tv.TreeWindow, K, dl):
    """A greedy step's acceptance and next draft (spec §1, §5.2-5.3), pure: tree acceptance on the logits (R, Q, V) and input ids inp (R, Q) of rows of draft sizes
    K (R,) and draft lengths dl (R,), steps of Kmax >= 2. Returns a (R,) accepted draft tokens, p (R,)
    the winning path, step_tok (R, Kmax) its argmaxes, the next draft (R, Kmax - 1) and its sibling
    ids (R, H), from the winning path's group."""
    top = logits.argmax(dim=-1)  # (R, Q): NTP targets of every query
    a, p, step_tok = tv.tree_accept(top, inp, tw, K, dl)  # (R,), (R,), (R, Kmax)
    src = tw.src[K - 1, dl, p, a]  # (R, W): the window query of each next-draft token (spec §5.2)
    return a, p, step_tok, top.gather(1, src[:, : step_tok.shape[1] - 1]), tv.siblings(logits, tw, K, src)


def greedy_commit(logits, inp, suppress, tw: tv.TreeWindow, K, dl, n, N, live, stops, b, Q: int):
    """A greedy step's work after its forward, pure (the compiled step runs it as one graph): the
    suppressed ids (n,) at -inf, :func:`greedy_step` (Kmax >= 2), then :func:`settle`. Returns the next
    draft (R, Kmax - 1), its sibling ids (R, H) and settle's six outputs."""
    logits = logits if suppress is None else logits.index_fill(-1, suppress, float("-inf"))  # (R, Q, V)
    a, p, step_tok, draft, sib = greedy_step(logits, inp, tw, K, dl)
    return (draft, sib, *settle(a, p, step_tok, tw, K, dl, n, N, live, stops, b, Q))


def window(tw: tv.TreeWindow, K, dl, b, s, sib, p_b, kvb, C, mask_id: int):
    """A step's query window, pure: input ids (R, Q), positions (R, Q) and the bool mask (R, 1, Q, Lb)
    over a static cache of Lb columns (kvb (R, Lb): the rows' valid keys in [0, C), C a 0-dim long:
    the cache length; the window's own Q columns start at C)."""
    m, o = tw.mask[K - 1, dl], tw.offsets[K - 1, dl]  # (R, Q, Q), (R, Q): each row's layout for its draft length
    inp = tv.inputs(tw, K, dl, b, s, sib, mask_id)  # (R, Q)
    R, Q, Lb = m.shape[0], m.shape[1], kvb.shape[1]
    rel = torch.arange(Lb, device=kvb.device) - C  # (Lb,): column index relative to the window
    win = m.gather(2, rel.clamp(0, Q - 1).expand(R, Q, Lb))  # (R, Q, Lb): the window's mask, repeated
    mask = torch.where(rel < 0, kvb[:, None, :], win & (rel < Q))  # (R, Q, Lb)
    return inp, p_b[:, None] + o, mask[:, None]


def whole_step(forward, cache, C, kvb, suppress, tw: tv.TreeWindow, K, dl, b, s, sib, p_b, n, N, live, stops,
               mask_id: int, Q: int):
    """A greedy step as one pure function (the compiled step's one graph): the query window
    (:func:`window`), the forward on ``cache`` and :func:`greedy_commit` (an AR step, Kmax = 1: the
    argmax and :func:`settle`). Returns greedy_commit's outputs."""
    inp, positions, mask = window(tw, K, dl, b, s, sib, p_b, kvb, C, mask_id)
    logits = forward(inp, positions, mask, cache)  # (R, Q, V)
    if tw.mask.shape[0] > 1:
        return greedy_commit(logits, inp, suppress, tw, K, dl, n, N, live, stops, b, Q)
    logits = logits if suppress is None else logits.index_fill(-1, suppress, float("-inf"))  # (R, 1, V)
    zero = torch.zeros_like(b)  # (R,): nothing to accept on an AR step's path 0
    return (s, sib[:, :0], *settle(zero, zero, logits.argmax(dim=-1), tw, K, dl, n, N, live, stops, b, Q))


def prefill_inputs(bundle, prompts: list[list[int]], K: int):
    """The prefill of lossless SBD (spec §1): each left-padded prompt, causal, then one group of
    K masks at the positions after it, which sees the whole prompt and itself.

    Returns inp (B, P+K) long, positions (B, P+K) long, the mask among them (P+K, P+K) bool
    (key padding not yet folded in), kv_valid (B, P+K) bool, valid (B, P) bool and row_len (B,)."""
    device = bundle.device
    ids, valid, pos = left_pad(prompts, bundle.pad_token_id, device)  # (B, P) each
    B, P = ids.shape
    row_len = valid.sum(dim=1)  # (B,)
    group = torch.full((B, K), bundle.mask_token_id or 0, dtype=torch.long, device=device)  # (B, K); K = 0: AR
    inp = torch.cat([ids, group], dim=1)  # (B, P+K)
    positions = torch.cat([pos, row_len[:, None] + torch.arange(K, device=device)], dim=1)  # (B, P+K)
    m = causal_mask(P + K, device=device)  # (P+K, P+K)
    m[P:, P:] = True  # the group is bidirectional and sees the whole prompt
    kv_valid = torch.cat([valid, valid.new_ones(B, K)], dim=1)  # (B, P+K)
    return inp, positions, m, kv_valid, valid, row_len


def stats_extra(batch, rows: list) -> dict:
    """:class:`~unmask.decode.verify.batch.Verify`'s ``stats_extra`` for finished ``rows`` (request order): accept
    histograms, layout, block size, query windows, row extras; ``compiled`` and ``static_cache`` when static
    (only those for an ``ar`` batch)."""
    static = {"compiled": batch.compile, "static_cache": batch.kv.capacity} if batch.static else {}
    if batch.ar:
        return static
    accepts = Counter(c for r in rows for c in r.accepts)
    drafted = Counter(c - 1 for r in rows for c in r.accepts[1:])  # accepted draft tokens per verify forward
    return {"verify": True, "draft": batch.cfg.draft, "block_size": batch.cfg.block_size,
            "accepts": dict(sorted(accepts.items())), "accepted_drafts": dict(sorted(drafted.items())),
            "query_windows": dict(sorted(batch.windows.items())), "row_extra": [r.extra for r in rows], **static}


def report(batch, inp, positions, logits, a) -> None:
    """Verify's ``on_forward`` (tests): a step's per-row tensors and the cache, for the live slots in order."""
    live = sorted(batch.rows)
    at = torch.tensor(live, dtype=torch.long, device=batch.device)
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=k[at], values=v[at]) for k, v in batch.kv.layers()])
    batch.on_forward({"step": batch.forwards - 1, "inp": inp[at], "positions": positions[at], "logits": logits[at],
                      "cache": cache, "key_valid": batch.key_valid[at], "accepted": a[at],
                      "rows": [batch.rows[i].job.id for i in live], "committed": batch.n[at].clone()})


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (), block_size: int = DEFAULT_BLOCK_SIZE,
           draft: str = DEFAULT_DRAFT, queries: int | None = None, on_forward=None, on_step=None,
           compile: bool = False, static: bool = False) -> DecodeOutput:
    """Lossless SBD decoding of a batch (spec/sbd_exact.md §1–2), on the one engine's AR / lossless
    SBD batch (:class:`unmask.decode.verify.batch.Verify`, every row at draft size K = ``block_size``).

    prompts: token ids per row (left-padded internally). One forward per step: prefill = prompt
    (causal) + one draft group; then verify part + draft groups. A row stops at a stop token
    (excluded, later tokens of the same step dropped), a stop string (the completing token kept)
    or ``max_new_tokens``, and its slot is freed. ``draft``: ``linear``, ``quadratic``, ``budget``
    (the model's stored layout for ``queries`` query tokens per row, default 16; spec §5), ``budget:Q``,
    ``D/S/G`` text or a :class:`~unmask.decode.verify.layout.DraftLayout`, or either with siblings
    (``3/0,1,3/4+1g3``, a :class:`~unmask.decode.verify.siblings.TreeLayout`; spec §5.3: greedy rows
    take the longest confirmed path; sampled rows draw siblings i.i.d. from the proposal and accept by SpecInfer's multi-candidate rule, which keeps the AR distribution). ``compile=True`` runs the same batch on a static KV
    cache whose pointer moves instead of cropping, with a ``torch.compile``-d forward; ``static=True``
    the static cache eagerly (tests, debugging); same tokens, NFE and step events, and stats.extra
    then records ``compiled`` and ``static_cache``; neither takes ``on_forward`` (UnmaskError).
    ``on_forward(info)`` (tests) sees each forward's inputs, logits and the cache after the step's
    rollback; ``on_step(event)`` gets :mod:`unmask.trace` step events (the committed tokens of each
    row; the canvas shows the unverified draft as masks).

    Returns DecodeOutput; stats.extra holds ``accepts`` (tokens committed per row per forward ->
    count), ``accepted_drafts`` (accepted draft tokens per row per verify forward -> count),
    ``draft``, ``block_size``, ``verify: True`` and ``row_extra``. Greedy output equals ``ar``
    decoding of the same model token for token; sampled output has its distribution.
    Raises UnmaskError for a model without a mask token or a bad block size / draft layout / budget.
    """
    from unmask.decode.verify.batch import Verify
    from unmask.decode.engine.running import drain, requests_for

    if bundle.mask_token_id is None:
        raise UnmaskError("lossless SBD needs a model with a mask token (an SBD model, or a base with an "
                          "SBD adapter: --adapter); train one with 'unmask train sbd' or 'unmask train sbd-adapter'")
    if isinstance(draft, (dl.DraftLayout, sl.TreeLayout)):
        draft = draft.spec
    cfg = VerifyConfig(block_size=block_size, draft=dl.resolve(draft, queries, bundle.meta.get("decode_defaults")))
    cfg.check_fits(bundle.context_length)
    if (compile or static) and on_forward is not None:
        raise UnmaskError("compile=True / static=True take no on_forward hook (the static cache is not a "
                          "DynamicCache); drop one of them")
    requests = requests_for(prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=stop_strings,
                            device=bundle.device)
    K = cfg.block_size
    length = max((len(p) for p in prompts), default=1) + max_new_tokens + K + tv.slots(family(cfg.draft, K))[3]
    events = None if on_step is None else (lambda row, event: on_step({**event, "row": row.job.id}))

    def make(capacity: int) -> Verify:
        return Verify(bundle, cfg, static=static, compile=compile, capacity=capacity, on_step=events,
                      on_forward=on_forward, stop_token_ids=stop_token_ids, length=length)

    return drain(make, requests)


def cut_row(bundle, prompt, row: list[int], stop_set: set, stop_strings, start: int) -> tuple[list[int], bool]:
    """A row's committed ids cut at its first stop token (excluded) or, without one, after the
    token completing a stop string (searched from token ``start`` on). Returns (ids, whether a
    stop string ended the row)."""
    cut = next((j for j, t in enumerate(row) if t in stop_set), None)
    if cut is not None:
        return row[:cut], False
    hit = _first_stop_string(bundle, prompt, row, start, stop_strings) if stop_strings else None
    return (row, False) if hit is None else (row[:hit], True)


def _first_stop_string(bundle, prompt, row, start, stop_strings):
    """The length of ``row`` up to and including the token that completes a stop string (searched
    from token ``start`` on), or None."""
    for end in range(max(start, 0) + 1, len(row) + 1):
        text = bundle.decode_continuation(prompt, row[:end])
        if any(s in text for s in stop_strings):
            return end
    return None
