"""Draft layout options of lossless SBD (spec/sbd_exact.md §5.1, §5.4): the text a user passes
(``linear``, ``quadratic``, ``budget``, ``budget:Q``, ``D/S/G`` with or without siblings), resolved to
the layout a batch runs, the model's calibrated layouts by query budget and the presets. The layouts
themselves: :mod:`unmask.decode.verify.chain` (``D/S/G`` and the next-draft rule) and
:mod:`unmask.decode.verify.siblings` (§5.3). Pure module: no tensors, no model.
"""

from __future__ import annotations

from unmask.decode.verify import siblings as sl
from unmask.decode.verify.chain import DraftLayout, linear, parse, quadratic
from unmask.errors import UnmaskError, is_int

BUDGETS = (8, 16, 24, 32)  # the query budgets calibrate-drafts searches (issue 26)
DEFAULT_BUDGET = 16
# Uncalibrated defaults: the best layouts of the replay on stories260K-sbd (spec §5.4, issue 26's
# table); a model's own calibration (decode_defaults "draft_layouts") replaces them.
PRESETS = {8: "2/0/5", 16: "3/0,2,3/4", 24: "5/0,1,3/6", 32: "4/0,1,2,3,4/5"}


def canonical(text: str) -> str:
    """The canonical text of a ``D/S/G`` layout, siblings (``+j[cC][gG]``, spec §5.3) included.
    Raises UnmaskError for bad text."""
    return sl.parse(text).spec


def is_layout(draft) -> bool:
    """Whether ``draft`` names a budgeted layout: ``budget``, ``budget:Q`` or ``D/S/G`` text (with
    siblings or not)."""
    return isinstance(draft, str) and (draft == "budget" or draft.startswith("budget:") or "/" in draft)


def stored_layouts(defaults: dict | None) -> dict[int, str]:
    """A model's calibrated layouts by budget (decode_defaults ``draft_layouts``: ``"8=2/0/5 16=..."``),
    else the presets. Raises UnmaskError for malformed text."""
    text = (defaults or {}).get("draft_layouts")
    if text is None:
        return dict(PRESETS)
    out = {}
    try:
        for item in str(text).split():
            q, spec = item.split("=")
            out[int(q)] = canonical(spec)
    except (ValueError, UnmaskError):
        raise UnmaskError(f"decode_defaults draft_layouts {text!r} is not 'Q=D/S/G ...'; rerun "
                          "'unmask calibrate-drafts' or remove the key") from None
    return out


def format_layouts(table: dict[int, str]) -> str:
    """{budget: layout text} -> the decode_defaults ``draft_layouts`` text."""
    return " ".join(f"{q}={canonical(s)}" for q, s in sorted(table.items()))


def option(draft, block_size=None, defaults: dict | None = None, fallback: str = "linear"):
    """The draft option a lossless call runs: ``draft`` when given, else the model's default
    (decode_defaults ``draft``), except that an explicit ``block_size`` under a budgeted default
    asks for that draft size K, which only a named layout has: then ``fallback`` (linear, the
    default layout of K). A budget is sized by its queries, never by a block size: an explicit
    budgeted ``draft`` with a ``block_size`` raises UnmaskError (the layout fixes its draft size)."""
    if draft is not None:
        if block_size is not None and is_layout(draft):
            raise UnmaskError(f"--block-size sets K of a linear or quadratic draft; the budgeted draft {draft!r} "
                              "takes its draft size from its layout: drop --block-size, or pass --draft linear")
        return draft
    default = (defaults or {}).get("draft")
    if default is None or (block_size is not None and is_layout(default)):
        return fallback
    return default


def resolve(draft, queries=None, defaults: dict | None = None) -> str:
    """The draft option as the decoder takes it: ``linear``/``quadratic`` unchanged, a budgeted one
    (``budget`` with ``queries`` Q, ``budget:Q``, or ``D/S/G``) as ``D/S/G`` text: the model's stored
    layout for the largest budget <= Q (default Q: decode_defaults ``queries``, else 16).
    Raises UnmaskError for a bad budget, ``queries`` without a budgeted draft, or bad text."""
    if queries is not None and draft != "budget":
        raise UnmaskError(f"--queries applies to --draft budget (got --draft {draft}); add --draft budget "
                          "or drop --queries")
    if not is_layout(draft):
        return draft
    if "/" in draft:
        return canonical(draft)
    if draft.startswith("budget:"):
        try:
            queries = int(draft.split(":", 1)[1])
        except ValueError:
            raise UnmaskError(f"bad draft {draft!r}; write budget:Q with Q query tokens, e.g. budget:16") from None
    if queries is None:
        queries = (defaults or {}).get("queries", DEFAULT_BUDGET)
    if not is_int(queries) or queries < 4:
        raise UnmaskError(f"a query budget must be an integer >= 4 (got {queries!r}); pass e.g. --queries 16")
    table = stored_layouts(defaults)
    fits = [q for q in table if q <= queries]
    if not fits:  # smaller than every stored budget: one group after the bonus
        return DraftLayout(1, (0,), (queries - 2,)).spec
    return table[max(fits)]


__all__ = ["DraftLayout", "linear", "quadratic", "parse", "canonical", "option", "resolve", "is_layout", "stored_layouts", "PRESETS",
           "BUDGETS", "DEFAULT_BUDGET"]
