"""Lossless SBD as the tests call it: the ``sbd`` decoder with ``verify=True`` (the generic
:meth:`unmask.decode.Spec.decode` over the verify batch)."""

from __future__ import annotations

from unmask.decode import DECODERS
from unmask.decode.verify.config import DEFAULT_BLOCK_SIZE, DEFAULT_DRAFT
from unmask.decode.verify.layout import is_layout


def lossless(bundle, prompts, *, block_size=None, draft=DEFAULT_DRAFT, **kw):
    """Lossless SBD of ``prompts`` at draft size ``block_size`` (default 8; a budgeted layout sets its
    own K, ``block_size`` ignored) with ``draft`` (default linear, whatever the checkpoint's default is)."""
    if is_layout(draft):
        block_size = None
    elif block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    return DECODERS["sbd"].decode(bundle, prompts, verify=True, block_size=block_size, draft=draft, **kw)
