"""The Block Buffer's running batch (multiblock.md §3; DESIGN.md "One engine"): the one class that
``decode(decoder="multiblock")`` drains and the server runs, built by :func:`batch` (:data:`SPEC`).

Each slot holds one row's window of N_buf blocks (:class:`~unmask.decode.multiblock.buffer.Window`, one
row per slot), its sequence and its stop bookkeeping. A step is one Block Buffer iteration for
every slot: activate, one forward of the N_buf·B window tokens that also stores the to-cache
slots' K/V (:func:`~unmask.decode.multiblock.window.window_step`), M2T/T2T (``block_buffer.transition``),
write-back and termination, all tensor ops, then ONE host read (:class:`~unmask.decode.engine.host.HostRead`)
of the per-row results (running-set size, commits, edits, stored slots, ended, and the rows'
sequences, so stop strings are checked and a finishing row is cut with no further read). A free
slot's window is all dummies: it rides along in the forward.

``lockstep=True`` is ``decode()``'s numbering (events by batch forward and slot; the dynamic cache
is never compacted, as before); the server runs ``lockstep=False`` (events by the row's own
forwards, row 0; the cache compacted when holes are most of it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from unmask.decode.blocks.commit_shaping import slotted
from unmask.decode.blocks.prefix import PrefixBatch, check_cache_flags, prefill_whole_blocks, whole_prompt_blocks
from unmask.decode.blocks.rule import first_stop
from unmask.decode.engine.host import HostRead
from unmask.decode.engine.kv import DynamicKV, check_fits, pad, place
from unmask.decode.engine.registry import Spec
from unmask.decode.engine.running import Row, group_by, row_generator
from unmask.decode.engine.stats import check_nfe, stop_flags
from unmask.decode.engine.stop import StopRule
from unmask.decode.multiblock import buffer as bb
from unmask.decode.multiblock.window import (MultiBlockOptions, candidates, event_columns, row_event, stop_blocks,
                                             window_step, write_window)
from unmask.errors import UnmaskError
from unmask.sampling import Sampling


@dataclass(eq=False)
class BufferRow(Row):
    """A running Block Buffer row: its generator, |R_s| and M2T commits per step, T2T edits, and
    ``keys`` (cache columns it attends to, for compaction without a host read)."""

    generator: object = None
    running_set: list = field(default_factory=list)
    accepts: list = field(default_factory=list)
    edits: int = 0
    keys: int = 0
    to_cache: int = 0  # its window's to-cache slots after the last step: the next forward stores them
    checked: int = 0  # end of its complete blocks at the last stop-string check (absolute position)


class MultiBlockDecoder(PrefixBatch):
    """The running batch of Block Buffer rows of one resolved
    :class:`~unmask.decode.multiblock.window.MultiBlockOptions` (:meth:`~MultiBlockOptions.resolve`).

    Settings and hooks: :class:`~unmask.decode.blocks.prefix.PrefixBatch`. A prefill runs eagerly and is
    placed into the joining slots; on the static cache the slot tensors grow to a power-of-two row bucket.
    ``on_token(row)`` runs once per output token, at the end (T2T may still edit committed tokens); a row's
    ``logit_bias`` is added before M2T/T2T read the logits; with ``logprobs`` a finished row has them from
    the forward that committed or last edited each token. Raises UnmaskError when N_buf·B exceeds the
    context window, or a row does not fit a static cache.
    """

    def __init__(self, bundle, cfg, **kw):
        S, B = cfg.slots, cfg.block_size
        if S * B > bundle.context_length:
            raise UnmaskError(f"--slots {S} × block size {B} = {S * B} positions exceeds the context window of "
                              f"{bundle.context_length}; use --slots {max(1, bundle.context_length // B)} or fewer")
        super().__init__(bundle, cfg, **kw)
        self._empty()

    def _empty(self) -> None:
        """No row runs: the dynamic cache goes, the static one's pointer goes back to 0, the window goes and
        the other slot tensors have no rows."""
        if self.static and self.kv is not None:
            self.kv.reset()
        else:
            self.kv = None
        dev = self.device
        self.R, self.w = 0, None
        self.seq = torch.full((0, 0), self.mask_id, dtype=torch.long, device=dev)  # (R, L)
        self.key_valid = torch.zeros((0, 0), dtype=torch.bool, device=dev)  # (R, C)
        self.live = torch.zeros(0, dtype=torch.bool, device=dev)  # (R,)
        self.nfe_rows = torch.zeros(0, dtype=torch.long, device=dev)  # (R,)

    @torch.inference_mode()
    def join(self, requests) -> list[BufferRow]:
        """Prefill the requests' whole prompt blocks together (one forward) into free slots (multiblock.md
        §3.2). A Block Buffer row commits nothing before its first step: returns []."""
        if not requests:
            return []
        S, B, dev, model = self.cfg.slots, self.cfg.block_size, self.device, self.bundle.model
        check_fits(requests, self.length if self.static else None, (S + 1) * B)
        rows = []
        for job, s in zip(requests, self.slots.take(len(requests))):
            gen = row_generator(job, dev)
            rows.append(BufferRow(job=job, slot=s, generator=gen, keys=len(job.prompt_ids) // B * B))
        try:  # a failed prefill gives its slots back (a step covers [0, high))
            prompts = [list(r.job.prompt_ids) for r in rows]
            w = bb.initial_window(prompts, [r.job.max_new_tokens for r in rows], S, B, self.mask_id, dev)
            if self.static and self.kv is None:  # the prefill, the longest row's blocks and one window
                blocks = w.last_block - w.front + 1  # (n,) blocks per row
                self.kv = self._static_kv(whole_prompt_blocks(prompts, B) + (int(blocks.max()) + S) * B)
            new, valid, _ = prefill_whole_blocks(DynamicKV(model), prompts, B, self.bundle.pad_token_id, dev)  # (n, F)
            self._place(rows, new, valid, w)
        except BaseException:
            self.slots.give([r.slot for r in rows])
            raise
        self.prefills += int(valid.shape[1] > 0)
        # Room for every real block and the dummies after the last one, so window writes never clamp.
        self._write(rows, prompts, int((w.last_block.max() + 1 + S) * B))
        at = torch.tensor([r.slot for r in rows], dtype=torch.long, device=dev)  # (n,)
        self.live[at], self.nfe_rows[at] = True, 0
        return []

    def _place(self, rows: list[BufferRow], new, valid: torch.Tensor, w: bb.Window) -> None:
        """Place the prefilled cache ``new`` (validity ``valid`` (n, F)) and windows ``w`` into the
        rows' slots, growing the slot tensors to R rows (the static cache's row bucket)."""
        slots, R0 = [r.slot for r in rows], self.R
        if self.kv is None:
            self.kv = DynamicKV(self.bundle.model)
        C = self.kv.length
        if self.static:  # every row of the cache goes through place (it allocates them all on first use)
            full = pad(self.key_valid[:, :C], 0, self.capacity - R0, False)  # (capacity, C)
            self.kv, full = place(self.kv, full, new, valid, slots)
            self.R = max(R0, self.slots.bucket if self.kv.allocated else self.capacity)  # a first write: every row
            self.key_valid = full[: self.R]
        else:
            self.kv, self.key_valid = place(self.kv, self.key_valid[:, :C], new, valid, slots, rows=bool(self.running))
            self.R = self.key_valid.shape[0]
        at, more = torch.tensor(slots, dtype=torch.long, device=self.device), self.R - R0  # (n,), rows added
        dummy = {"state": bb.DUMMY, "tokens": self.mask_id, "editable": False, "argmax": self.mask_id}  # else 0
        old = w.map(lambda k, t: t[:0]) if self.w is None else self.w
        self.w = old.map(lambda k, t: pad(t, 0, more, dummy.get(k, 0)).index_put((at,), getattr(w, k)))
        self.live, self.nfe_rows = pad(self.live, 0, more, False), pad(self.nfe_rows, 0, more, 0)
        self.seq = pad(self.seq, 0, more, self.mask_id)

    @torch.inference_mode()
    def step(self) -> list[BufferRow]:
        """One Block Buffer step (multiblock.md §3.3) for every slot: one forward of shape (R, N_buf·B).
        Returns the rows that finished in it (a stop token with every block up to it complete, a stop
        string in its complete blocks, ``max_new_tokens`` or ``max_nfe``), their slots freed."""
        if not self.running:
            return []
        cfg, S, B, R = self.cfg, self.cfg.slots, self.cfg.block_size, self.R
        rows, L = self.rows, self.seq.shape[1]
        stop_pos = first_stop(self.seq, self.w.gen_start, self.w.gen_end, self.stops)  # (R,)
        before, _ = bb.activate(self.w, ~self.live | (stop_pos < L), tau_add=cfg.tau_add, tau_stable=cfg.tau_stable)
        self._make_room(S * B, S * B)
        past = self.kv.length
        keep = max(r.to_cache for r in rows)  # to-cache slots are marked by a step, so the host knows them
        logits, stored = window_step(self.kv, self.key_valid, before, keep)  # (R, S*B, V), (R,)
        self.forwards += 1
        if self.suppress:
            logits[..., self.suppress] = float("-inf")
        if self.on_forward is not None:
            self.on_forward({"inp": before.tokens.view(R, S * B), "positions": before.positions().view(R, S * B),
                             "logits": logits, "window": before, "past": past, "stored": stored.clone(),
                             "key_valid": self.key_valid[:, : self.kv.length].clone(),
                             "cache": [(k.clone(), v.clone()) for k, v in self.kv.layers()]})
        slots = slotted(self.running, R)
        logits, raw = self.shaping.shape(slots, logits)  # (R, S*B, V): biased, raw for logprobs
        top1, kappa = self._candidates(logits.view(R, S, B, -1))  # (R, S, B) each
        w, info = bb.transition(before, top1, kappa, tau_m2t=cfg.tau_m2t, tau_semi=cfg.tau_semi, tau_t2t=cfg.tau_t2t,
                                max_post_edit_steps=cfg.max_post_edit_steps)
        write_window(self.seq, w)
        self.nfe_rows += self.live.long()
        size = (before.state != bb.DUMMY).sum(dim=1)  # (R,) |R_s| of this step
        stop_block = stop_blocks(first_stop(self.seq, w.gen_start, w.gen_end, self.stops), L, B)  # (R,)
        done = self.live & bb.finished(w, stop_block)  # (R,)
        capped = self.live & (self.nfe_rows >= cfg.max_nfe) if cfg.max_nfe is not None else torch.zeros_like(done)
        self.w = bb.release(w, done | capped)
        self.live &= ~(done | capped)
        read = HostRead().add("size", size).add("commits", info.committed.sum(dim=(1, 2)))
        read.add("edits", info.edited.sum(dim=(1, 2))).add("stored", stored).add("done", done).add("capped", capped)
        read.add("stopped", (stop_block != bb.NO_STOP) & done).add("to_cache", (self.w.state == bb.TO_CACHE).sum(dim=1))
        read.add("seq", self.seq)
        self.shaping.add(read, slots, lambda: (raw, top1.view(R, S * B), (info.committed | info.edited).view(
            R, S * B), before.front * B - before.gen_start))  # a T2T edit's logprob replaces its commit's
        if self.on_step is not None:  # what the step events show, in the same read
            event_columns(read, before, info, top1, w)
        got = read.read()  # the step's one host sync
        if self.on_step is not None:
            for row in rows:
                step, r = (self.forwards - 1, row.slot) if self.lockstep else (row.nfe, 0)
                self.on_step(row, row_event(step, r, got, row.slot, B, self.mask_id))
        return self._bookkeep(rows, got)

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``multiblock.candidates`` for every slot, each sampling setting with its rows' generators:
        logits (R, S, B, V) -> (top1, kappa) (R, S, B)."""
        groups = group_by(((r, r) for r in self.rows), lambda r: r.job.sampling if r.generator is not None else None)
        if list(groups) == [None]:
            return candidates(logits, Sampling(), None)
        top1 = torch.full(logits.shape[:-1], self.mask_id, dtype=torch.long, device=logits.device)  # (R, S, B)
        kappa = torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)  # (R, S, B)
        for sampling, members in groups.items():
            at = torch.tensor([r.slot for r in members], dtype=torch.long, device=logits.device)  # (n,)
            gens = None if sampling is None else [r.generator for r in members]
            t, k = candidates(logits[at], sampling or Sampling(), gens)
            top1[at], kappa[at] = t, k.float()
        return top1, kappa

    def _stop_string(self, row: BufferRow, seq: list[int]) -> bool:
        """Whether the row's complete blocks (the contiguous complete prefix of its output, ``seq`` its
        sequence) hold one of its stop strings; decoded only when that prefix grew since the last check."""
        B, P = self.cfg.block_size, len(row.job.prompt_ids)
        E = P + row.job.max_new_tokens
        first_mask = next((i for i in range(P, E) if seq[i] == self.mask_id), E)
        complete = E if first_mask >= E else first_mask // B * B  # end of the complete blocks
        if complete <= row.checked:
            return False
        row.checked = complete
        rule = StopRule(self.stop.ids, tuple(row.job.stop))
        return rule.hit(self.bundle, row.job.prompt_ids, seq[P:complete], {self.mask_id})

    def _bookkeep(self, rows, got: dict) -> list[BufferRow]:
        """Per-row statistics and ends from the step's one host read ``got`` (by name, per slot: |R_s|,
        commits, edits, stored slots, done / capped / stopped, to-cache slots for the next step, the
        row's sequence)."""
        cfg, B, done = self.cfg, self.cfg.block_size, []
        edit_steps = cfg.max_post_edit_steps if cfg.tau_t2t is not None else 0
        for row in rows:
            size, commits, edits, stored, ended, capped, stopped, row.to_cache, seq = (got[k][row.slot] for k in (
                "size", "commits", "edits", "stored", "done", "capped", "stopped", "to_cache", "seq"))
            row.nfe += 1
            self.shaping.take(row, got, row.slot)
            P, M = len(row.job.prompt_ids), row.job.max_new_tokens
            blocks = (P + M - 1) // B - P // B + 1
            check_nfe(row.nfe, blocks * (B + 2 + edit_steps) + cfg.slots, "multiblock")
            row.running_set.append(size)
            row.accepts.append(commits)
            row.edits += edits
            row.keys += stored * B
            if not ended and row.job.stop and self._stop_string(row, seq):
                ended = stopped = True
            if not (ended or capped):
                continue
            full = seq[P: P + M]
            row.tokens = self.stop.until_stop(full, {self.mask_id})
            row.stop_token = stop_flags([full], [row.tokens], self.stop.ids)[0]
            row.finish = "stop" if stopped and len(row.tokens) < M else "length"
            self.shaping.finish(row)
            rs = row.running_set
            row.extra = {"slots": cfg.slots, "block_size": B, "running_set": rs,
                         "mean_running_set": sum(rs) / max(1, len(rs)), "accepts": row.accepts, "edits": row.edits}
            if self.on_token is not None:
                for _ in row.tokens:
                    self.on_token(row)
            done.append(row)
        for row in done:
            self._leave(row)
        return done

    @torch.inference_mode()
    def _leave(self, row: BufferRow) -> None:
        super()._leave(row)
        self.shaping.forget(row)
        self.live[row.slot] = False
        self.w = bb.release(self.w, torch.arange(self.R, device=self.device) == row.slot)
        if not self.running:
            self._empty()

    def stats_extra(self, rows: list[BufferRow]) -> dict:
        """``DecodeStats.extra`` of finished rows, as ``multiblock.decode`` reports it."""
        cfg = self.cfg
        hist = Counter(a for r in rows for a in r.accepts)
        sizes = [x for r in rows for x in r.running_set]
        cache = {"compiled": bool(self.compile), "static_cache": self.kv.capacity} if self.static else {}
        return {"slots": cfg.slots, "block_size": cfg.block_size, "tau_add": cfg.tau_add, "tau_semi": cfg.tau_semi,
                "tau_m2t": cfg.tau_m2t, "tau_t2t": cfg.tau_t2t, "tau_stable": cfg.tau_stable,
                "accepts": dict(sorted(hist.items())), "mean_running_set": sum(sizes) / max(1, len(sizes)),
                "edits": sum(r.edits for r in rows), **cache, "row_extra": [r.extra for r in rows]}


def batch(bundle, options: MultiBlockOptions, *, capacity: int, prompts=None, max_new_tokens: int | None = None,
          compile: bool = False, static: bool = False, on_step=None, on_token=None, on_forward=None,
          stop_token_ids=None) -> MultiBlockDecoder:
    """The Block Buffer's running batch (multiblock.md §3.2–3.3) of ``options`` resolved once
    (:meth:`MultiBlockOptions.resolve`), for ``capacity`` rows: ``prompts`` given, ``decode()``'s
    (events numbered by batch forward and slot; a static cache sized at the join); None, the
    server's (with ``static`` / ``compile``, a static cache of the context window and N_buf + 1
    blocks that rows join mid-flight, new step shapes compiled when the server is idle).
    ``max_new_tokens`` is not needed (the join sizes the cache); ``stop_token_ids`` None: the bundle's.

    One static-shape forward (R, slots·B) per step. A row finishes when a stop token was generated
    (or its last block admitted) and every block up to it is complete (Diffulex termination, §3.3
    step 7), on a stop string in its completed blocks, or at ``max_nfe``; its output is cut before
    the first stop token. ``on_step`` gets one event per live row per step: ``step``, ``row``,
    ``positions`` / ``tokens`` (M2T commits, generated indices), ``edited`` (T2T edits), ``canvas``
    (None where masked), and the Block Buffer view: ``slots`` (state of every slot at the forward,
    e.g. ``["to-cache", "active", "dummy"]``), ``blocks`` (their block indices), ``running_set``
    (|R_s|). ``on_forward(state)`` (tests) sees each forward's inputs, logits, the window before the
    forward, and the cache after it. ``compile=True``: a static KV cache of the prefill, the longest
    row's blocks and one window (L = F + (blocks + N_buf)·B, rounded up to ``LENGTH_BUCKET``; rows
    store in different steps, so a full cache is compacted in place) whose pointer moves instead of
    cropping, the window forward ``torch.compile``-d, the prefill eager; ``static=True``: that cache,
    eagerly. Both give the eager tokens, NFE and statistics.

    stats.extra: the thresholds, ``accepts`` (histogram of M2T commits per row per step),
    ``mean_running_set`` (|R_s| averaged over row-steps), ``edits``, ``row_extra`` per row
    (``running_set`` at each of its steps, ``mean_running_set``, ``accepts``, ``edits``), and on the
    static path ``compiled`` and ``static_cache`` (L). Raises UnmaskError for a model that is not
    block-diffusion, a block size that disagrees with the checkpoint's, slots·B past the context
    window, or ``compile`` / ``static`` not a bool."""
    check_cache_flags(compile, static)
    cfg = options.resolve(bundle)
    return MultiBlockDecoder.of(bundle, cfg, (cfg.slots + 1) * cfg.block_size, capacity=capacity, prompts=prompts,
                                compile=compile, static=static, on_step=on_step, on_token=on_token,
                                on_forward=on_forward, stop_token_ids=stop_token_ids)


SPEC = Spec("multiblock", MultiBlockOptions, batch=batch, kinds=("block-diffusion",), compiles=True,
            summary="Multi-Block Diffusion: Block Buffer of N_buf slots, one static forward per step")

__all__ = ["BufferRow", "MultiBlockDecoder", "SPEC", "batch"]
