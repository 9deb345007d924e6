"""Lossless SBD as the tests call it: the ``sbd`` decoder with ``verify=True`` (the generic
:meth:`unmask.decode.Spec.decode` over the verify batch)."""

from __future__ import annotations

from unmask.decode import DECODERS
from unmask.decode.verify.config import DEFAULT_BLOCK_SIZE, DEFAULT_DRAFT
from unmask.decode.verify import tree as tv
from unmask.decode.verify.layout import is_layout


def lossless(bundle, prompts, *, block_size=None, draft=DEFAULT_DRAFT, **kw):
    """Lossless SBD of ``prompts`` at draft size ``block_size`` (default 8; a budgeted layout sets its
    own K, ``block_size`` ignored) with ``draft`` (default linear, whatever the checkpoint's default is)."""
    if is_layout(draft):
        block_size = None
    elif block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    return DECODERS["sbd"].decode(bundle, prompts, verify=True, block_size=block_size, draft=draft, **kw)


def chain_tables(layouts):
    """The chain path of :func:`unmask.decode.verify.tree.tree_window` (the former ``window_layout``):
    mask, offsets, and the next-draft ``src`` and ``length`` of path 0."""
    tw = tv.tree_window(layouts)
    return tw.mask, tw.offsets, tw.src[:, :, 0], tw.length[:, :, 0]
