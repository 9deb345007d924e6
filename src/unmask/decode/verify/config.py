"""The resolved configuration of a verify batch (AR and lossless SBD, spec/sbd_exact.md §1, §5): the
draft size K, the draft layout and the smaller layouts of a load-sized server, plus what follows
from them alone: the query window of a step (:func:`queries`), the layout of every draft size
(:func:`family`) and its shared step tables (:func:`tables`).

A :class:`VerifyConfig` is built once, resolved (:meth:`VerifyConfig.of`: a budget or a layout
object becomes its canonical ``D/S/G`` text and fixes K = D + 1), and only validated after that.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from dataclasses import dataclass

from unmask.decode.verify import layout as dl
from unmask.decode.verify import siblings as sl
from unmask.decode.verify import tree as tv
from unmask.decode.verify.chain import DraftLayout, verify_only
from unmask.errors import UnmaskError, is_int

DRAFTS = ("quadratic", "linear")
HOST_LAYOUT = "host"  # the verify part alone: every draft comes from a model-free source (no mask groups)
# the fastest lossless setting in tokens per second on both shipped SBD models (batch 1, 1 thread,
# benchmarks/sbd_lossless.py): linear drafts cost 2K queries per forward, quadratic ones K + K^2
DEFAULT_DRAFT = "linear"
DEFAULT_BLOCK_SIZE = 8  # lossless SBD's draft size K when neither the request nor the checkpoint sets one
MAX_BLOCK_SIZE = 64  # the step tables grow as K^4 (tree.TreeWindow.src): 64 is ~130 MB
MAX_TABLE_MIB = 256  # a layout's step tables (tree.table_bytes): linear K = 64 needs ~200 MiB


def default_block_size(bundle) -> int:
    """The checkpoint's lossless K (decode_defaults ``verify_block_size``), else DEFAULT_BLOCK_SIZE."""
    got = (bundle.meta.get("decode_defaults") or {}).get("verify_block_size")
    return DEFAULT_BLOCK_SIZE if got is None else got


def default_layout(bundle) -> str:
    """The layout a bundle's AR rows and option-less lossless rows run: decode_defaults ``draft``
    (a budget resolved to its ``D/S/G`` text), else DEFAULT_DRAFT. Raises UnmaskError for bad defaults."""
    defaults = bundle.meta.get("decode_defaults") or {}
    return dl.resolve(defaults.get("draft") or DEFAULT_DRAFT, None, defaults)


def _smaller_texts(smaller) -> tuple[str, ...]:
    if not isinstance(smaller, (tuple, list)):  # a str too
        raise UnmaskError(f"smaller layouts are a tuple of D/S/G texts (got {smaller!r}), e.g. ('3/3/4',)")
    return tuple(smaller)


@dataclass(frozen=True)
class VerifyConfig:
    """Draft size K (``block_size``, 2..MAX_BLOCK_SIZE) and the drafting layout: ``linear``,
    ``quadratic`` (spec §1), ``host`` (the verify part alone, drafts from a model-free source,
    spec/draft_sources.md) or canonical ``D/S/G`` text, siblings ``+j[cC][gG]`` included (spec §5.1,
    §5.3; then K = D + 1). ``smaller``: canonical budgeted layouts (each D below the draft's) that rows
    of a smaller draft size run instead of the draft cut to their K: the load sizer's (a server's
    stored calibrated layouts). Build one with :meth:`of`, which resolves budgets and layout objects;
    construction only validates. Raises UnmaskError for a bad size or layout."""

    block_size: int = DEFAULT_BLOCK_SIZE
    draft: str = DEFAULT_DRAFT
    smaller: tuple[str, ...] = ()

    @classmethod
    def of(cls, block_size: int = DEFAULT_BLOCK_SIZE, draft=DEFAULT_DRAFT, smaller=()) -> "VerifyConfig":
        """The config of a K and a draft option (``linear``, ``quadratic``, ``budget:Q``, ``D/S/G`` text,
        a DraftLayout or TreeLayout: a layout sets K = D + 1, whatever ``block_size`` says)."""
        _check_size(block_size)
        draft = draft.spec if isinstance(draft, (DraftLayout, sl.TreeLayout)) else draft
        if dl.is_layout(draft):
            draft = dl.resolve(draft)
            block_size = sl.parse(draft).D + 1
        smaller = tuple(dict.fromkeys(dl.canonical(str(t)) for t in _smaller_texts(smaller)))
        return cls(block_size, draft, smaller)

    def __post_init__(self):
        _check_size(self.block_size)
        if self.draft not in (*DRAFTS, HOST_LAYOUT) and not (isinstance(self.draft, str) and "/" in self.draft):
            raise UnmaskError(f"unknown draft layout {self.draft!r}; choose one of {', '.join(DRAFTS)}, budget "
                              "(with --queries Q) or D/S/G text such as 3/0,2,3/4")
        if self.budgeted and (self.draft != dl.canonical(self.draft) or self.block_size != sl.parse(self.draft).D + 1):
            raise UnmaskError(f"draft layout {self.draft} with block size {self.block_size} is not resolved; build "
                              "the config with VerifyConfig.of(block_size, draft)")
        if self.block_size > MAX_BLOCK_SIZE:
            raise UnmaskError(f"lossless SBD drafts at most {MAX_BLOCK_SIZE - 1} tokens per step ({self.block_size - 1} "
                              f"asked, block size K = {self.block_size}); lower --block-size or the layout's D")
        smaller = _smaller_texts(self.smaller)
        if smaller and (not self.budgeted or any(sl.parse(t).D + 1 >= self.block_size for t in smaller)):
            raise UnmaskError(f"smaller layouts ({', '.join(smaller)}) need a budgeted draft (D/S/G, got {self.draft}) "
                              f"and fewer than its {self.block_size - 1} draft tokens; drop them")

    def check_fits(self, context_length: int) -> None:
        """Raise UnmaskError when a step of this config cannot fit the context window (2K positions,
        prefill group included; the host layout's K queries; or more query tokens per forward than
        ``context_length``) or its step tables (:func:`~unmask.decode.verify.tree.table_bytes`) would
        pass MAX_TABLE_MIB."""
        if self.host:  # K queries and no prefill group: the window alone must fit
            if self.block_size > context_length:
                raise UnmaskError(f"model-free drafts of {self.block_size - 1} tokens need {self.block_size} queries "
                                  f"per forward, more than the context window of {context_length}; lower --draft-tokens")
        elif 2 * self.block_size > context_length:
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
        return self.draft not in (*DRAFTS, HOST_LAYOUT)

    @property
    def host(self) -> bool:
        """Whether every draft comes from the host (:data:`HOST_LAYOUT`): no mask token needed."""
        return self.draft == HOST_LAYOUT

    def row_size(self, K: int) -> int:
        """The draft size a row asking for K runs at: K, or at most D + 1 under a budgeted layout."""
        return min(K, self.block_size) if self.budgeted else K


def _check_size(K) -> None:
    if not is_int(K) or K < 2:
        raise UnmaskError(f"lossless SBD needs a block size >= 2 (got {K!r}); pass e.g. --block-size 8")


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
    if draft in (*DRAFTS, HOST_LAYOUT):
        make = {"quadratic": dl.quadratic, "linear": dl.linear, HOST_LAYOUT: verify_only}[draft]
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


__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_DRAFT", "DRAFTS", "HOST_LAYOUT", "MAX_BLOCK_SIZE", "MAX_TABLE_MIB", "VerifyConfig",
           "default_block_size", "default_layout", "family", "queries", "tables"]
