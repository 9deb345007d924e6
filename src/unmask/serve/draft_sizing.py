"""Draft sizing for lossless SBD under load: the draft block size K as a function of the running
batch.

Lossless SBD turns each row's forward from 1 query token into 2K (linear drafts, spec
sbd_exact.md §1). While the running batch is small those extra queries are nearly free (the
forward is bound by reading the weights, not by arithmetic: the roofline's knee); once the batch
is large every query costs its share, and a fixed K that wins at one stream loses at many. The
output does not depend on K — greedy lossless SBD equals AR token for token whatever the draft —
so the scheduler may pick K per batch from the load, down to K = 1: plain one-token steps in the
AR running batch, which reproduce lossless SBD exactly.

``DraftSizes`` is the table ``rows -> K``: a list of ``(min_rows, K)`` steps, parsed from the
``--draft-sizes`` text ``"1:4,4:2,6:1"`` (1-3 rows: K = 4, 4-5 rows: K = 2, 6 and more: AR steps).
Under a budgeted layout (spec sbd_exact.md §5.1) a row of K < D + 1 runs the model's stored
calibrated layout of the fewest draft tokens >= K - 1 (``VerifyConfig.smaller``), not the layout cut
to K. The default, ``auto``, is measured on this project's CPU (``benchmarks/serve_load.py``, README
"Serving"): a budgeted layout runs itself below SMALL_ROWS rows, the smallest stored layout (the
8-query one) up to AR_ROWS, then AR steps (a compiled server: the smallest from 1 row, AR steps from
COMPILED_AR_ROWS); linear and quadratic drafts take LINEAR_TEXT. A GPU's knee sits far later, so pass a
table measured there.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from unmask.decode.verify import layout as draft_layout
from unmask.decode.verify import config as sbd_verify
from unmask.decode.verify import siblings as sl
from unmask.decode.blocks.sbd import runs_lossless
from unmask.errors import UnmaskError

# measured on the 2-core CPU with stories260K-sbd, 1 thread, linear drafts
# (benchmarks/results/draft_size_crossover.md): TPS vs AR at 1 row K2 1.09x, K4 1.34x, K8 1.23x;
# 2 rows 1.30x / 1.41x / 1.07x; 4 rows 1.05x / 1.01x / 0.87x; 8 rows every K < 1 (best 0.70x).
LINEAR_TEXT = "1:4,4:2,6:1"
# budgeted layouts (benchmarks/results/serve_draft_sizes.md): the batch's own layout below SMALL_ROWS
# rows, the smallest stored one below AR_ROWS, then AR steps
SMALL_ROWS, AR_ROWS = 3, 24
# a compiled server (`serve --compile`, whole-step graphs): the smallest stored layout from 1 row, AR steps
# from COMPILED_AR_ROWS (benchmarks/results/serve_load_r10.md: compiled, in-process, stories260K-sbd, the
# 8-query layout over K = 1: 2.66x at 1 row, 1.78x at 2, 1.17x at 3, 1.06x at 4, 0.89x at 6; the 16-query
# one 2.54x / 1.43x / 0.87x / 0.71x / 0.51x)
COMPILED_AR_ROWS = 5
LOG_ENTRIES = 4096  # the sizer's log keeps this many (a long-running server's memory stays flat)
AUTO = "auto"
VERIFY_OPTIONS = ("block_size", "draft", "verify", "queries", "draft_source", "draft_tokens")  # a lossless sbd request's


@dataclasses.dataclass(frozen=True)
class DraftSizes:
    """``steps``: ``((min_rows, K), ...)`` with strictly increasing ``min_rows``, the first 1; K >= 1
    (K = 1: one-token AR steps). ``size(rows)`` is the K of the last step whose ``min_rows <= rows``.

    Raises:
        UnmaskError: an empty table, a first step not at 1 row, ``min_rows`` not increasing, a K < 1.
    """

    steps: tuple[tuple[int, int], ...]

    def __post_init__(self):
        fix = "write it as ROWS:K pairs, e.g. --draft-sizes 1:8,2:4,4:1"
        if not self.steps:
            raise UnmaskError(f"the draft-size table is empty; {fix}")
        if self.steps[0][0] != 1:
            raise UnmaskError(f"the draft-size table must start at 1 row (got {self.steps[0][0]}); {fix}")
        rows = [r for r, _ in self.steps]
        if any(b <= a for a, b in zip(rows, rows[1:])):
            raise UnmaskError(f"the draft-size table's row counts must increase (got {rows}); {fix}")
        bad = [k for _, k in self.steps if k < 1]
        if bad:
            raise UnmaskError(f"a draft size must be >= 1 (got {bad[0]}); 1 means plain AR steps; {fix}")

    @classmethod
    def parse(cls, text: str) -> "DraftSizes":
        """``"1:8,2:4,4:1"`` -> DraftSizes(((1, 8), (2, 4), (4, 1))). Raises UnmaskError on bad text."""
        steps = []
        for part in str(text).split(","):
            rows, _, k = part.strip().partition(":")
            try:  # without ":", k is "": a ValueError too
                steps.append((int(rows), int(k)))
            except ValueError:
                raise UnmaskError(f"bad draft-size entry {part.strip()!r}; write ROWS:K pairs, "
                                  "e.g. --draft-sizes 1:8,2:4,4:1, or auto / off alone") from None
        return cls(tuple(steps))

    def size(self, rows: int) -> int:
        """The draft block size K for a running batch of ``rows`` rows (1 = plain AR steps)."""
        return next((k for min_rows, k in reversed(self.steps) if rows >= min_rows), self.steps[0][1])


DEFAULT = AUTO


def smaller_layouts(draft: str, defaults: dict | None) -> tuple[str, ...]:
    """The stored calibrated layouts (``decode_defaults`` ``draft_layouts``, else the presets) that draft
    fewer tokens than the budgeted ``draft``, by budget; () for linear and quadratic drafts."""
    if not draft_layout.is_layout(draft):
        return ()
    D = sl.parse(draft).D
    return tuple(t for _, t in sorted(draft_layout.stored_layouts(defaults).items()) if sl.parse(t).D < D)


def table_for(sizes: "DraftSizes | str | None", draft: str, defaults: dict | None, *,
              compiled: bool = False) -> DraftSizes | None:
    """The rows -> K table of the rows of layout ``draft``: ``sizes`` itself, or for ``auto`` the
    measured default (module docstring) of that layout, ``compiled``: a compiled server's (the
    smallest stored budgeted layout, ``draft`` itself if none is smaller, below COMPILED_AR_ROWS
    rows, then AR steps); None: sizing off."""
    if sizes != AUTO:
        return sizes
    smaller = smaller_layouts(draft, defaults)
    if compiled and draft_layout.is_layout(draft):
        return DraftSizes(((1, sl.parse((*smaller, draft)[0]).D + 1), (COMPILED_AR_ROWS, 1)))
    if not smaller:
        return DraftSizes.parse(LINEAR_TEXT)
    K, k = sl.parse(draft).D + 1, sl.parse(smaller[0]).D + 1
    return DraftSizes(((1, K), (SMALL_ROWS, k), (AR_ROWS, 1)))


def check_server_draft(draft: str | None, queries: int | None, defaults: dict | None = None) -> str | None:
    """``unmask serve --draft D [--queries Q]`` -> the layout they resolve to (``linear``, ``quadratic``
    or ``D/S/G`` text; with ``defaults``, a checkpoint's decode_defaults, its stored layouts), None
    when neither is given; ``--queries`` alone means ``--draft budget`` (as for ``unmask generate``). Raises
    UnmaskError (one line): ``--queries`` with a draft other than budget, a bad budget or layout text
    (draft_layout.resolve's and VerifyConfig's checks)."""
    if draft is None and queries is None:
        return None
    draft = "budget" if draft is None else draft
    if not isinstance(draft, str):
        raise UnmaskError(f"--draft must be text (got {draft!r}); pass linear, quadratic, budget or D/S/G text")
    return sbd_verify.VerifyConfig.of(draft=draft_layout.resolve(draft, queries, defaults)).draft


def with_server_draft(bundle, draft: str | None, queries: int | None):
    """``bundle`` as the server decodes it: a shallow copy whose decode_defaults take ``draft`` (and
    ``queries``), so the AR / lossless batch rows join by default and every lossless request that sets
    no draft runs that layout (its own ``draft``/``queries`` still win). ``bundle`` itself when neither
    is given. Raises UnmaskError (one line) for bad values (:func:`check_server_draft`) or a model
    that does not run lossless sbd."""
    defaults = bundle.meta.get("decode_defaults") or {}
    if check_server_draft(draft, queries, defaults) is None:
        return bundle
    if bundle.kind != "sbd" or bundle.mask_token_id is None:
        raise UnmaskError(f"--draft applies to lossless sbd, which {bundle.name} ({bundle.kind}) does not run; drop "
                          "--draft/--queries, or serve an sbd model (or a causal one with --adapter sbd)")
    served = {**defaults, "draft": draft or "budget", **({} if queries is None else {"queries": queries})}
    return dataclasses.replace(bundle, meta={**bundle.meta, "decode_defaults": served})


def draft_sizes_option(value: "str | DraftSizes | None") -> "DraftSizes | str | None":
    """``--draft-sizes`` value -> table: a DraftSizes passes through, ``None`` or ``"off"`` turns
    sizing off (every lossless batch keeps its own block size), ``"auto"`` is the measured default
    (:func:`table_for`), other text is parsed (:meth:`DraftSizes.parse`)."""
    if value is None or isinstance(value, DraftSizes):
        return value
    text = str(value).strip().lower()
    if text in ("off", AUTO):
        return None if text == "off" else AUTO
    return DraftSizes.parse(value)


class LoadSizer:
    """The draft sizes of one server's AR / lossless rows (:class:`~unmask.decode.verify.batch.Verify`):
    1 for AR, the request's or checkpoint's K, or for a *sizable* row (greedy lossless, no block size
    given) the ``table``'s K at its batch's load, chosen again before every step (None: sizing off).
    ``log``: (rows in the batch, K) whenever sizable rows join or get a new K (tests, benchmarks; the
    last LOG_ENTRIES)."""

    def __init__(self, bundle, table: "DraftSizes | str | None", *, compiled: bool = False):
        self.bundle, self.table = bundle, draft_sizes_option(table)  # text ("auto", "off", "1:4,6:1") parsed
        self.compiled = compiled  # auto: a compiled server's table
        self.defaults = bundle.meta.get("decode_defaults") or {}
        self.log: deque[tuple[int, int]] = deque(maxlen=LOG_ENTRIES)
        self._k: dict[str, int] = {}  # draft layout -> the K its sizable rows have now
        self._tables: dict[str, DraftSizes] = {}  # draft layout -> its table (auto: per layout)

    def sizable(self, job) -> bool:
        """Greedy lossless sbd with no block size or model-free draft source set by the request, while a
        table is set."""
        try:
            lossless = job.decoder == "sbd" and runs_lossless(self.bundle, job.options)
        except UnmaskError:
            return False
        return (self.table is not None and lossless and job.sampling.greedy and job.options.get("block_size") is None
                and job.options.get("draft_source") in (None, "block"))

    def size(self, draft: str, load: int, joining: bool, batch) -> int | None:
        """The table's K at ``load`` rows, logged when sizable rows join or it changes for ``batch``'s."""
        if self.table is None:
            return None
        if draft not in self._tables:
            self._tables[draft] = table_for(self.table, draft, self.defaults, compiled=self.compiled)
        K = self._tables[draft].size(load)
        if joining or (self._k.get(draft) != K and any(r.job.sizable for r in batch.rows.values())):
            self.log.append((load, K))
            self._k[draft] = K
        return K

    def resize(self, batch, draft: str) -> None:
        """Give ``batch``'s sizable rows the table's K at its load, before a step."""
        sizable = [r.job.id for r in batch.rows.values() if r.job.sizable]
        if sizable:
            batch.resize(self.size(draft, len(batch), False, batch), ids=sizable)

    def smaller(self, draft: str) -> tuple[str, ...]:
        """The layouts rows of ``draft`` run at a smaller K (``VerifyConfig.smaller``); () with sizing off."""
        return () if self.table is None else smaller_layouts(draft, self.defaults)

    def block_size(self, job, sized: int | None) -> int:
        """The draft size a job joins with: 1 for ar, ``sized`` (the table's) for a sizable job, else
        the request's or the checkpoint's K, validated as the sbd decoder does (1 on the host layout, whose
        rows' K follows their model-free drafts). Raises UnmaskError."""
        if job.decoder == "ar" or job.running_key[1] == sbd_verify.HOST_LAYOUT:
            return 1
        unknown = sorted(set(job.options) - set(VERIFY_OPTIONS))
        if unknown:
            raise UnmaskError(f"option(s) {', '.join(unknown)} do not apply to lossless SBD; use only "
                              f"{', '.join(VERIFY_OPTIONS)}")
        if job.sizable:
            return sized
        K = job.options.get("block_size")
        K = sbd_verify.default_block_size(self.bundle) if K is None else K
        sbd_verify.VerifyConfig.of(K, job.running_key[1])
        if 2 * K > self.bundle.context_length:
            raise UnmaskError(f"block size {K} is too large for the context window of "
                              f"{self.bundle.context_length}; lower --block-size")
        return K
