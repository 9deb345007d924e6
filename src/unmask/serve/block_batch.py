"""Continuous batching for the Block Buffer (``multiblock``) decoder: rows join and leave at step
boundaries (issue 16; multiblock.md §3).

:class:`MultiBlockBatch` owns one window of N_buf slots per running row (a
:class:`~unmask.decode.block_buffer.Window` whose rows are the running requests), the rows'
sequences, and one ``DynamicCache`` (:class:`~unmask.decode.kv.DynamicKV`) for all of them. A step
is exactly one iteration of :func:`unmask.decode.multiblock.decode`'s loop, built from the same
pure pieces (``block_buffer.activate`` / ``transition`` / ``finished``, ``multiblock.window_step``,
``candidates``, the stop helpers): activate, one forward of every row's N_buf·B slot tokens that
also stores the to-cache slots' K/V, M2T/T2T, slide, write back, termination.

Joining: a request's whole prompt blocks are prefilled alone (a batch of one, as ``decode`` on that
prompt runs it), then its cache is left-padded to the running cache's length and concatenated along
the batch dimension (or the running cache is left-padded, when the newcomer's is longer). Which
columns a row may attend to is ``key_valid``; positions are explicit, so a row's keys may sit at any
column. Rows store their blocks in different steps, which leaves columns a row did not store (masked
for it, §3.6's scratch); when these holes make up more than half of the cache it is compacted
(``multiblock.compact``), and leaving rows take their cache rows with them.

Equality (STYLE.md 14): a row's tokens, NFE, per-row statistics and step events are those of
``multiblock.decode(bundle, [prompt], ...)`` on its prompt alone, whatever the other rows and
whenever it joined. Greedy, and sampled too: each row draws from its own generator
(``Sampling.row_generators([prompt])``, the one a single-prompt decode creates) exactly the S·B
draws per step that decode makes, and rows with different sampling settings draw separately.
Only the floating-point summation order of attention over the masked padding columns differs
from the single-prompt run (as in a batched ``decode``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from unmask.decode import block_buffer as bb
from unmask.decode.block import check_block_model, first_stop, outputs, prefill_whole_blocks, row_sequences
from unmask.decode.kv import DynamicKV
from unmask.decode.multiblock import (MultiBlockConfig, candidates, row_event, stop_blocks, stop_string_rows,
                                      window_step, write_window)
from unmask.decode.stats import check_nfe
from unmask.errors import UnmaskError
from unmask.serve.running import compact_if_sparse, kv_layers, merge_kv, pad_right, rebuild_kv, split_rows

OPTIONS = ("block_size", "slots", "tau_add", "tau_semi", "tau_m2t", "tau_t2t", "tau_stable", "max_nfe")


@dataclass
class Row:
    """One running request.

    ``job`` is the scheduler's handle (``prompt_ids``, ``max_new_tokens``, ``sampling``, ``stop``);
    ``generator`` its own (None when greedy). Once finished: ``tokens`` (the output, cut before the
    first stop token), ``nfe`` (its step forwards), ``finish`` ("stop" or "length") and ``extra``
    (``multiblock.decode``'s ``row_extra`` entry for it)."""

    job: object
    generator: torch.Generator | None
    nfe: int = 0
    tokens: list[int] | None = None
    finish: str | None = None
    running_set: list[int] = field(default_factory=list)  # |R_s| at each step
    accepts: list[int] = field(default_factory=list)  # M2T commits at each step
    edits: int = 0
    extra: dict | None = None


def _cat_windows(a: bb.Window | None, b: bb.Window) -> bb.Window:
    """Rows of ``a`` then rows of ``b`` (same S, B and mask id)."""
    if a is None:
        return b
    return replace(a, **{f.name: torch.cat([getattr(a, f.name), getattr(b, f.name)]) for f in fields(a)
                         if f.name != "mask_id"})


def _take_window(w: bb.Window, idx: torch.Tensor) -> bb.Window:
    """Rows ``idx`` (n,) long of ``w``."""
    return replace(w, **{f.name: getattr(w, f.name)[idx] for f in fields(w) if f.name != "mask_id"})


class MultiBlockBatch:
    """The running set of ``multiblock`` rows of one model and one set of Block Buffer options,
    advanced one step (one forward) at a time.

    options: the multiblock knobs every row of this batch shares (``block_size``, ``slots``,
    ``tau_add``, ``tau_semi``, ``tau_m2t``, ``tau_t2t``, ``tau_stable``, ``max_nfe``; None = default),
    validated once by :class:`~unmask.decode.multiblock.MultiBlockConfig`. Per row (the job):
    prompt, ``max_new_tokens``, ``sampling``, stop strings. ``stop_token_ids`` defaults to the
    bundle's. ``on_step(row, event)`` gets each row's step event, the one ``multiblock.decode`` on
    that prompt alone emits (``row`` 0, ``step`` the row's own forward index).

    ``join(jobs)`` prefills new rows; ``step()`` runs one forward for every running row and returns
    the rows that finished in it (removed); ``drop(pred)`` evicts rows (cancelled, timed out).
    Raises UnmaskError for a model that is not block-diffusion, an unknown option or a bad value.
    """

    def __init__(self, bundle, options: dict | None = None, on_step=None, *, stop_token_ids=None):
        check_block_model(bundle, "multiblock")
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise UnmaskError(f"option(s) {', '.join(unknown)} do not apply to a continuous multiblock batch; "
                              f"use only {', '.join(OPTIONS)}")
        self.cfg = MultiBlockConfig.from_options(bundle, **options)
        S, B = self.cfg.slots, self.cfg.block_size
        if S * B > bundle.context_length:
            raise UnmaskError(f"--slots {S} × block size {B} = {S * B} positions exceeds the context window of "
                              f"{bundle.context_length}; use --slots {max(1, bundle.context_length // B)} or fewer")
        self.bundle, self.on_step = bundle, on_step
        self.device, self.mask_id = bundle.device, bundle.mask_token_id
        ids = bundle.stop_token_ids if stop_token_ids is None else stop_token_ids
        self.stops = torch.tensor(sorted(set(ids)) or [-1], device=self.device)
        self.suppress = list(bundle.suppress_ids)
        self.rows: list[Row] = []
        self.forwards = 0  # prefill and step forwards of this batch
        self._empty()

    def _empty(self) -> None:
        self.w: bb.Window | None = None
        self.seq: torch.Tensor | None = None  # (R, L) prompt + generated tokens, mask elsewhere
        self.stop_block: torch.Tensor | None = None  # (R,) block of the first stop token, NO_STOP if none
        self.checked: torch.Tensor | None = None  # (R,) complete tokens already checked for stop strings
        self.kv: DynamicKV | None = None
        self.key_valid: torch.Tensor | None = None  # (R, kv.length) bool: the cache columns each row attends to

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def cache(self):
        """The running ``DynamicCache`` (None when no row is running)."""
        return None if self.kv is None else self.kv.cache

    # -- joining ------------------------------------------------------------------------------

    @torch.inference_mode()
    def join(self, jobs: list) -> list[Row]:
        """Prefill each job's whole prompt blocks alone and add it to the running batch (multiblock.md
        §3.2). A Block Buffer row commits nothing before its first step, so no row finishes here:
        returns [] (the scheduler's interface, as ``ARBatch.join``)."""
        S, B, dev = self.cfg.slots, self.cfg.block_size, self.device
        for job in jobs:
            prompt = list(job.prompt_ids)
            gens = job.sampling.row_generators([prompt], dev)  # the generator decode gives it
            row = Row(job=job, generator=None if gens is None else gens[0])
            kv, valid, _ = prefill_whole_blocks(DynamicKV(self.bundle.model), [prompt], B, self.bundle.pad_token_id,
                                                dev)  # valid (1, F)
            self.forwards += int(valid.shape[1] > 0)
            w = bb.initial_window([prompt], job.max_new_tokens, S, B, self.mask_id, dev)
            # Room for every real block and the dummies after the last one, so window writes never clamp.
            seq = row_sequences([prompt], int((w.last_block[0] + 1 + S) * B), self.mask_id, dev)  # (1, L)
            self._merge(row, w, seq, kv, valid)
        return []

    def _merge(self, row: Row, w: bb.Window, seq: torch.Tensor, kv: DynamicKV, valid: torch.Tensor) -> None:
        """Append one prefilled row (its window, sequence (1, L), cache and key validity (1, P))."""
        dev = self.device
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        if not self.rows:
            self.rows, self.w, self.seq, self.kv, self.key_valid = [row], w, seq, kv, valid
            self.stop_block, self.checked = torch.full_like(zero, bb.NO_STOP), zero
            return
        L = max(self.seq.shape[1], seq.shape[1])
        self.seq = torch.cat([pad_right(self.seq, L - self.seq.shape[1], 1, self.mask_id),
                              pad_right(seq, L - seq.shape[1], 1, self.mask_id)])  # (R + 1, L)
        self.w = _cat_windows(self.w, w)
        self.stop_block = torch.cat([self.stop_block, torch.full_like(zero, bb.NO_STOP)])
        self.checked = torch.cat([self.checked, zero])
        # Cache columns: both sides left-padded to the longer one; the padding is masked out.
        self.kv, self.key_valid = merge_kv(self.bundle.model, self.kv, self.key_valid, kv, valid)  # (R + 1, T)
        self.rows.append(row)

    # -- stepping -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One Block Buffer step (multiblock.md §3.3) for every running row: one forward of shape
        (R, N_buf·B). Returns the rows that finished in it (a stop token with every block up to it
        complete, a stop string in its complete blocks, ``max_new_tokens`` or ``max_nfe``), already
        removed from the batch, with ``tokens``, ``nfe``, ``finish`` and ``extra`` set."""
        if not self.rows:
            return []
        cfg, bundle = self.cfg, self.bundle
        S, B, dev = cfg.slots, cfg.block_size, self.device
        R = len(self.rows)
        w, _ = bb.activate(self.w, self.stop_block != bb.NO_STOP, tau_add=cfg.tau_add, tau_stable=cfg.tau_stable)
        before = w
        self._compact_if_sparse()
        key_valid = pad_right(self.key_valid, S * B, 1, False)  # (R, n + S*B): the forward's query columns
        logits, _ = window_step(self.kv, key_valid, w)  # (R, S*B, V)
        self.key_valid = key_valid[:, : self.kv.length]
        self.forwards += 1
        if self.suppress:
            logits[..., self.suppress] = float("-inf")
        top1, kappa = self._candidates(logits.view(R, S, B, -1))  # (R, S, B) each
        w, info = bb.transition(w, top1, kappa, tau_m2t=cfg.tau_m2t, tau_semi=cfg.tau_semi, tau_t2t=cfg.tau_t2t,
                                max_post_edit_steps=cfg.max_post_edit_steps)
        self.w = w
        sizes = (before.state != bb.DUMMY).sum(dim=1).tolist()  # (R,) |R_s| of this step
        commits, n_edits = info.committed.sum(dim=(1, 2)).tolist(), info.edited.sum(dim=(1, 2)).tolist()
        edit_steps = cfg.max_post_edit_steps if cfg.tau_t2t is not None else 0
        blocks = (w.last_block - w.gen_start.div(B, rounding_mode="floor") + 1).tolist()  # (R,) blocks per row
        for r, row in enumerate(self.rows):
            row.nfe += 1
            check_nfe(row.nfe, blocks[r] * (B + 2 + edit_steps) + S, "multiblock")  # decode's ceiling
            row.running_set.append(sizes[r])
            row.accepts.append(commits[r])
            row.edits += n_edits[r]
        write_window(self.seq, w)
        if self.on_step is not None:
            at = before.positions()  # (R, S, B)
            for r, row in enumerate(self.rows):
                self.on_step(row, row_event(row.nfe - 1, r, at, before, info, top1, self.seq, w, sizes[r], row=0))

        L = self.seq.shape[1]
        self.stop_block = stop_blocks(first_stop(self.seq, w.gen_start, w.gen_end, self.stops), L, B)  # (R,)
        ended = bb.finished(w, self.stop_block)  # (R,)
        stopped = (self.stop_block != bb.NO_STOP) & ended
        by_stop: dict[tuple, list[int]] = {}
        for r, row in enumerate(self.rows):
            if row.job.stop:
                by_stop.setdefault(tuple(row.job.stop), []).append(r)
        if by_stop:  # rows with different stop strings are checked separately, each against its own
            prompts = [list(row.job.prompt_ids) for row in self.rows]
            seq_pos = torch.arange(L, device=dev)
            longest = max(row.job.max_new_tokens for row in self.rows)  # past gen_end every row holds masks
            for strings, idx in by_stop.items():
                mine = torch.zeros(R, dtype=torch.bool, device=dev)
                mine[idx] = True
                hit = stop_string_rows(bundle, prompts, self.seq, seq_pos, w, self.stops, longest, mine & ~ended,
                                       self.checked, strings)
                ended |= hit
                stopped |= hit
        if cfg.max_nfe is not None:
            ended |= torch.tensor([row.nfe >= cfg.max_nfe for row in self.rows], device=dev)
        if not bool(ended.any()):
            return []
        idx = torch.nonzero(ended).flatten()  # (n,)
        tokens = outputs(self.seq[idx], w.gen_start[idx], max(row.job.max_new_tokens for row in self.rows),
                         self.stops, self.mask_id)
        done = []
        for r, out in zip(idx.tolist(), tokens):
            row = self.rows[r]
            row.tokens = out
            full = len(row.tokens) >= row.job.max_new_tokens
            row.finish = "stop" if bool(stopped[r]) and not full else "length"
            rs = row.running_set
            row.extra = {"slots": S, "block_size": B, "running_set": rs, "mean_running_set": sum(rs) / max(1, len(rs)),
                         "accepts": row.accepts, "edits": row.edits}
            done.append(row)
        ids = {id(row) for row in done}
        self.drop(lambda row: id(row) in ids)
        return done

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``multiblock.candidates`` for every row: logits (R, S, B, V) -> (top1, kappa) (R, S, B).
        Rows sharing a sampling setting are drawn together, each from its own generator."""
        groups: dict = {}
        for r, row in enumerate(self.rows):
            groups.setdefault(row.job.sampling, []).append(r)
        if len(groups) == 1:
            sampling, idx = next(iter(groups.items()))
            gens = None if sampling.greedy else [self.rows[r].generator for r in idx]
            return candidates(logits, sampling, gens)
        top1 = torch.empty(logits.shape[:-1], dtype=torch.long, device=logits.device)  # (R, S, B)
        kappa = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)  # (R, S, B)
        for sampling, idx in groups.items():
            gens = None if sampling.greedy else [self.rows[r].generator for r in idx]
            at = torch.tensor(idx, dtype=torch.long, device=logits.device)  # (n,)
            t, k = candidates(logits[at], sampling, gens)  # (n, S, B) each
            top1[at], kappa[at] = t, k.float()
        return top1, kappa

    def _compact_if_sparse(self) -> None:
        """Compact the cache in place when the columns no row attends to (rows store in different
        steps, and rows leave) make up more than half of it and at least one window."""
        self.key_valid = compact_if_sparse(self.kv, self.key_valid, self.cfg.slots * self.cfg.block_size)

    # -- leaving ------------------------------------------------------------------------------

    def drop(self, pred) -> list[Row]:
        """Remove the rows for which ``pred(row)`` is true, with their slots and cache rows. A batch
        left empty frees its cache (``cache`` None). Returns the removed rows."""
        gone, kept, idx = split_rows(self.rows, pred, self.device)  # idx (R',)
        if not gone:
            return []
        self.rows = kept
        if not self.rows:
            self._empty()
            return gone
        self.w, self.seq = _take_window(self.w, idx), self.seq[idx]
        self.stop_block, self.checked, self.key_valid = self.stop_block[idx], self.checked[idx], self.key_valid[idx]
        layers = kv_layers(self.kv)
        if layers is not None:
            self.kv = rebuild_kv(self.bundle.model, [(k[idx], v[idx]) for k, v in layers])  # (R', H, n, D) each
            self._compact_if_sparse()
        elif self.kv.length == 0:
            self.kv = DynamicKV(self.bundle.model)
        # The rows' sequences only need to reach the longest remaining row's last window.
        self.seq = self.seq[:, : int((self.w.last_block.max() + 1 + self.cfg.slots) * self.cfg.block_size)]
        return gone


__all__ = ["MultiBlockBatch", "OPTIONS", "Row"]
