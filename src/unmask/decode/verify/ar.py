"""Autoregressive decoding with an exact KV cache: the baseline every decoder is measured against.

AR is the verify batch (:class:`~unmask.decode.verify.batch.Verify`) with every row at draft size
K = 1, so it drafts nothing and has nothing to reject. One AR step, for every running row at once:

1. its query window is ONE query: ``b``, the last committed token (not yet in the cache), at its
   position ``p_b``, attending to the row's valid cache columns and itself
   (``Verify._pieces``: the K = 1 tables are skipped; with a full causal batch the mask is None);
2. one forward of all rows appends their ``b`` to the cache;
3. the next token is the argmax of that query's logits (suppressed ids at -inf; a sampled row draws
   it with :func:`unmask.sampling.sample` from its own generator: NTP mode, SBD Eq. 9a)
   (:func:`~unmask.decode.verify.sampled.accept_rows`);
4. :func:`~unmask.decode.verify.steps.settle` commits it (``committed`` = 1 per live row, a dead
   slot 0), moves ``b`` and ``p_b`` on and flags a row that ended (a stop id or ``max_new_tokens``);
5. one host read (:class:`~unmask.decode.engine.host.HostRead`) brings the tokens and flags back;
   :func:`~unmask.decode.verify.rows.settle` appends each row's token, cuts at a stop id (excluded)
   or after a stop string (the completing token kept) and frees the slots of rows that ended.

A prefill forward of the prompts gives each row its first token (it counts as a forward, so a row's
NFE is its token count). ``compile=True`` runs the same steps on a static KV cache, the whole step
(window, forward, argmax, commit) one compiled graph (:func:`~unmask.decode.verify.steps.whole_step`):
same tokens and NFE. AR rows and lossless SBD rows (K >= 2) share one batch in the server.
"""

from __future__ import annotations

from dataclasses import dataclass

from unmask.decode.engine.registry import Spec
from unmask.decode.verify.batch import Verify
from unmask.decode.verify.config import HOST_LAYOUT, VerifyConfig, default_layout
from unmask.decode.verify.drafting import HOST, DraftKnobs


@dataclass(frozen=True)
class AROptions(DraftKnobs):
    """AR's knob: a model-free draft source (``lookup``, ``suffix``; spec/draft_sources.md), which the
    model verifies, so the output stays AR's; ``none`` (default): one token per row per forward."""

    sources = ("none", *HOST)

    def batch_key(self, bundle, max_new_tokens: int):
        """``("verify", layout)``: AR rows join the server's verify batch of the checkpoint's default
        layout (:func:`~unmask.decode.verify.config.default_layout`), beside its lossless rows; rows
        with model-free drafts the batch of the host layout."""
        return "verify", HOST_LAYOUT if self.host_only else default_layout(bundle)

    def takes_grammar(self, bundle) -> bool:
        return True


def batch(bundle, cfg: AROptions, *, capacity: int, prompts=None, max_new_tokens=None, compile: bool = False,
          static: bool = False, on_step=None, on_token=None, on_forward=None, stop_token_ids=None) -> Verify:
    """A verify batch whose rows join at K = 1 (``stats_extra``: only ``compiled`` / ``static_cache``),
    or, with a model-free draft source, a batch of the host layout whose rows draft up to
    ``draft_tokens`` ids per step. ``prompts`` given: its static cache (``compile`` / ``static``) holds
    the longest prompt, its new tokens and one step window; None: a cache of the context window."""
    drafts = cfg.host_drafts(bundle.device)
    K = 1 if drafts is None else drafts.tokens + 1
    length = None if prompts is None else max((len(p) for p in prompts), default=1) + max_new_tokens + K
    run = VerifyConfig() if drafts is None else VerifyConfig(K, HOST_LAYOUT)
    return Verify(bundle, run, compile=compile, static=static, capacity=capacity, ar=drafts is None, length=length,
                  stop_token_ids=stop_token_ids, on_step=on_step, on_token=on_token, on_forward=on_forward,
                  drafts=drafts)


SPEC = Spec("ar", AROptions, batch=batch, kinds=("causal", "sbd"), compiles=True,
            summary="autoregressive, one token per forward, exact KV cache; --draft-source lookup/suffix: "
                    "model-free drafts verified by the model, output unchanged")
