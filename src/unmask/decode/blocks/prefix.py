"""What the block decoders share (SingleBD, lossy SBD, the Block Buffer): the prefills of their exact
prefix cache, the cache-flag check and the running batch's plumbing (:class:`PrefixBatch`). Nothing
here imports a decoder."""

from __future__ import annotations

import torch

from unmask.decode.blocks.commit_shaping import CommitShaping
from unmask.decode.engine.batching import left_pad
from unmask.decode.engine.kv import StaticKV, compact, pad
from unmask.decode.engine.running import SlotRows, Slots
from unmask.decode.engine.stop import StopRule
from unmask.errors import UnmaskError
from unmask.masks import as_4d, block_causal_mask, causal_mask, with_key_padding


def check_cache_flags(compile, static) -> None:
    """Raise a one-line UnmaskError unless ``compile`` and ``static`` are True or False."""
    for name, value in (("compile", compile), ("static", static)):
        if not isinstance(value, bool):
            raise UnmaskError(f"{name} must be True or False (got {value!r}); pass {name}=True")


def whole_prompt_blocks(prompts: list[list[int]], B: int) -> int:
    """F: the prefill width, the longest prompt's whole blocks in tokens (rows are left-padded to it)."""
    return max(len(p) // B for p in prompts) * B


def static_length(aligned: bool, prompts: list[list[int]], budgets: list[int], B: int) -> int:
    """Tokens a block decoder's static cache needs for a join of ``prompts`` with these ``max_new_tokens``:
    aligned (SingleBD) the whole prompt blocks, every generated block and one of slack (j stored blocks,
    then one block or the fused pair); causal (SBD) the prompt and the committed text (noisy K/V are
    cropped before the next re-feed)."""
    if aligned:
        n_blocks = max((len(p) + m - 1) // B - len(p) // B + 1 for p, m in zip(prompts, budgets))
        return whole_prompt_blocks(prompts, B) + (n_blocks + 1) * B
    return max(len(p) for p in prompts) + max(budgets)


def prefill_whole_blocks(kv, prompts: list[list[int]], B: int, pad_id: int, device):
    """Prefill each row's whole prompt blocks block-causally into ``kv`` (multiblock.md §3.2 step 1).

    kv: an empty :mod:`unmask.decode.engine.kv` cache (DynamicKV or StaticKV). Rows are left-padded to the
    longest prefilled part, F = :func:`whole_prompt_blocks`; every row's pad is a multiple of B, so
    one block-causal mask over the padded columns is right for every row. The forward's length
    depends on the prompts, so it runs eagerly (``compiled=False``). Returns (kv, key_valid (R, F)
    bool, n_full (R,) long: whole prompt blocks per row). With F = 0 no forward runs.
    """
    n_full = [len(p) // B for p in prompts]
    heads = [p[: n * B] for p, n in zip(prompts, n_full)]
    n_full_t = torch.tensor(n_full, dtype=torch.long, device=device)
    if max(len(h) for h in heads) == 0:
        return kv, torch.zeros((len(prompts), 0), dtype=torch.bool, device=device), n_full_t
    ids, valid, pos = left_pad(heads, pad_id, device)  # (R, F) each
    R, F = ids.shape
    mask = with_key_padding(as_4d(block_causal_mask(F, B, device=device), R), valid)  # (R, 1, F, F)
    kv.forward(ids, pos, mask, logits_to_keep=1, compiled=False)
    return kv, valid, n_full_t


def causal_prefill(kv, prompts: list[list[int]], pad_id: int, device) -> torch.Tensor:
    """Prefill the left-padded prompts causally into the empty cache ``kv`` (SBD Alg. 2 step 1).
    Its length depends on the prompts, so it runs eagerly. Returns valid (R, P) bool, False on
    the left padding."""
    ids, valid, pos = left_pad(prompts, pad_id, device)  # (R, P) each
    R, P = ids.shape
    mask = with_key_padding(as_4d(causal_mask(P, device=device), R), valid)  # (R, 1, P, P)
    kv.forward(ids, pos, mask, logits_to_keep=1, compiled=False)
    return valid


class PrefixBatch(SlotRows):
    """What the running batches over an exact prefix cache share (SingleBD's and lossy SBD's
    :class:`~unmask.decode.blocks.batch.BlockDecoder`, the Block Buffer's
    :class:`~unmask.decode.multiblock.batch.MultiBlockDecoder`), built by :meth:`of`.

    ``static`` / ``compile``: a :class:`~unmask.decode.engine.kv.StaticKV` of ``capacity`` rows and ``length``
    tokens (the server's: length-bucketed, rows joining mid-flight; None: sized at the first join, ``decode``),
    the forwards compiled; ``defer_compile``: see StaticKV. ``lockstep`` (``decode``): step events numbered
    by batch forward and slot; else (the server) by the row's own forwards, row 0. ``on_step(row, event)``:
    :mod:`unmask.trace` events; ``on_token(row)`` once per output token; ``on_forward(state)`` (tests) sees
    every forward (logits before the rows' ``logit_bias``). ``stop_token_ids`` None: the bundle's. Raises
    UnmaskError for a bad capacity. A subclass keeps ``R`` (the slots a forward covers), ``seq`` (slots, L),
    ``key_valid`` (slots, cache columns) and ``live`` (slots,)."""

    def __init__(self, bundle, cfg, *, static=False, compile=False, capacity=8, on_step=None, on_token=None,
                 on_forward=None, lockstep=False, stop_token_ids=None, length: int | None = None,
                 defer_compile: bool = False):
        self.bundle, self.cfg, self.static, self.compile = bundle, cfg, static or compile, compile
        self.on_step, self.on_token, self.on_forward, self.lockstep = on_step, on_token, on_forward, lockstep
        self.slots, self.capacity, self.length, self.defer = Slots(capacity), capacity, length, defer_compile
        self.device, self.mask_id, self.suppress = bundle.device, bundle.mask_token_id, list(bundle.suppress_ids)
        ids = bundle.stop_token_ids if stop_token_ids is None else stop_token_ids
        self.stop = StopRule.of(ids)  # the host copy: finishing a row reads no tensor
        self.stops = torch.tensor(sorted(self.stop.ids) or [-1], device=self.device)
        self.forwards = self.prefills = 0  # step forwards (the batch's NFE); joins that prefilled prompt keys
        self.running: dict = {}
        self.shaping = CommitShaping()  # the rows' logit_bias and commit-time logprobs
        self.kv = None

    @classmethod
    def of(cls, bundle, cfg, slack: int, *, capacity: int, prompts=None, max_new_tokens: int | None = None,
           compile: bool = False, static: bool = False, **hooks) -> "PrefixBatch":
        """The batch of a resolved ``cfg`` for ``capacity`` rows: ``prompts`` given, ``decode()``'s (lockstep; a
        static cache sized at the join); None, the server's (rows move on at once; ``static`` / ``compile``: a
        static cache of the context window and ``slack`` tokens, new step shapes compiled when idle). ``hooks``:
        ``on_step``, ``on_token``, ``on_forward``, ``stop_token_ids``. Raises UnmaskError for ``compile`` /
        ``static`` not a bool."""
        check_cache_flags(compile, static)
        serving = prompts is None
        length = bundle.context_length + slack if serving and (static or compile) else None
        return cls(bundle, cfg, static=static, compile=compile, capacity=capacity, lockstep=not serving,
                   length=length, defer_compile=serving and compile, **hooks)

    def _static_kv(self, size: int) -> StaticKV:
        return StaticKV(self.bundle.model, self.capacity, max(size, self.length or 0), compile=self.compile,
                        length_buckets=self.length is not None, defer_compile=self.defer)

    def _write(self, rows, prompts: list[list[int]], L: int) -> None:
        """Start ``rows``: each one's slot of ``seq`` (grown to ``L`` columns) holds its prompt, then masks."""
        if L > self.seq.shape[1]:
            self.seq = pad(self.seq, 1, L - self.seq.shape[1], self.mask_id)
        self.seq[[r.slot for r in rows]] = self.mask_id
        for r, p in zip(rows, prompts):
            self.seq[r.slot, : len(p)] = torch.tensor(p, dtype=torch.long, device=self.device)
            self.running[r.slot] = r

    def _make_room(self, q: int, floor: int) -> None:
        """Before a forward of ``q`` query tokens: compact the cache (:func:`~unmask.decode.engine.kv.compact`)
        when they would not fit the static one, or when holes are more than half of the server's dynamic one
        and at least ``floor`` columns (``decode()``'s is never compacted); then give ``key_valid`` their columns."""
        n, most, R = self.kv.length, max(r.keys for r in self.running.values()), self.R
        full = self.kv.crowded(most, q) if self.static else not self.lockstep and n and n - most >= max(most, floor)
        if full:  # a free slot's keys count for nobody
            kept = compact(self.kv, self.key_valid[:R, :n] & self.live[:R, None], most)  # (R, most)
            self.key_valid = pad(kept, 0, self.key_valid.shape[0] - R, False)  # rows past R: free slots, no keys
        self.key_valid = pad(self.key_valid, 1, self.kv.length + q - self.key_valid.shape[1], False)

    def warm(self) -> bool:
        """``defer_compile`` (the server, no row running): compile one step shape that ran eagerly."""
        return bool(self.static and not self.running and self.kv is not None and self.kv.warm())


__all__ = ["PrefixBatch", "causal_prefill", "check_cache_flags", "prefill_whole_blocks", "static_length",
           "whole_prompt_blocks"]
