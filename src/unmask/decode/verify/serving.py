"""The server's running batches of AR and lossless SBD rows: one :class:`~unmask.decode.verify.batch.Verify`
per draft layout of a checkpoint."""

from __future__ import annotations

from unmask.decode.verify.batch import Verify
from unmask.decode.verify.config import HOST_LAYOUT, VerifyConfig, default_block_size
from unmask.decode.verify.drafting import MAX_DRAFT_TOKENS


def for_layout(bundle, draft: str, *, capacity: int, compile: bool = False, smaller: tuple[str, ...] = (),
               on_step=None, on_token=None, suffix_cache=None, tally=None) -> Verify:
    """The server's running batch of AR and lossless SBD rows of one draft layout (``draft``: a
    resolved layout, as :meth:`~unmask.decode.engine.registry.Config.batch_key` of ``ar`` / lossless
    ``sbd`` names it): the checkpoint's K (:func:`~unmask.decode.verify.config.default_block_size`),
    ``smaller`` layouts of the load sizer, a static cache of the context window with the compiled forward when
    ``compile`` (new shapes compiled by :meth:`Verify.warm`); no mask token: AR rows only; ``host``: model-free
    drafts (K <= MAX_DRAFT_TOKENS + 1 and the context). Raises UnmaskError."""
    host = draft == HOST_LAYOUT  # host: a window of K queries must fit the context
    cfg = VerifyConfig(min(MAX_DRAFT_TOKENS + 1, bundle.context_length), draft) if host else \
        VerifyConfig.of(default_block_size(bundle), draft, smaller)
    return Verify(bundle, cfg, compile=compile, capacity=capacity, on_step=on_step, on_token=on_token,
                  ar=not host and bundle.mask_token_id is None, defer_compile=True, drafts=None,
                  suffix_cache=suffix_cache, tally=tally)


__all__ = ["for_layout"]
