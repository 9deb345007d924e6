"""The one running batch of the block decoders (DESIGN.md "One engine"): SingleBD
(:mod:`unmask.decode.blocks.single`, multiblock.md §1.2) and lossy SBD (:mod:`unmask.decode.blocks.sbd`, SBD
Alg. 2–3) are the same machine, so it is written once.

Every row denoises one block at a time over an exact KV cache. A step is ONE forward of every
row's query window ``[store region (B) ; denoise region (N)]``:

- the store region carries the row's just-finished block, whose clean K/V stay in the cache:
  block-causal for SingleBD (its own forward with ``store="separate"``, or together with the next
  block, ``"fused"``), causal for SBD (the re-feed of §4.1, always fused);
- the denoise region is the row's current block, whose noisy K/V are cropped afterwards.

The two decoders differ only in a :class:`Kind`: where blocks start (SingleBD: aligned to position
0, the prompt's tail inside the first block; SBD: at the prompt's end), the prefill (whole prompt
blocks block-causally; the whole prompt causally), the store region's mask, and their statistics.

Per-row state lives in slot tensors (``Slots``): the sequence, generation bounds, the block start, the
denoising step, and the phase (denoise / store). :func:`advance` is the commit rule's bookkeeping as a
pure tensor function; the step's only host sync is one :class:`~unmask.decode.engine.host.HostRead` of
the per-row results (commits, block ends, the block's tokens; with ``on_step`` what the events show,
with ``logprobs`` the :class:`~unmask.decode.blocks.commit_shaping.CommitShaping` columns). With
``lockstep`` (``decode()``) a row whose block is complete waits until every row's is; the server's rows
move on at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from unmask.decode.blocks import report
from unmask.decode.blocks.commit_shaping import slotted
from unmask.decode.blocks.prefix import PrefixBatch, causal_prefill, prefill_whole_blocks, static_length
from unmask.decode.blocks.rule import SBD, advance, quota, quota_threshold_commit
from unmask.decode.engine.host import HostRead
from unmask.decode.engine.kv import DynamicKV, check_fits, place
from unmask.decode.engine.running import Row, finish, group_by, row_generator
from unmask.decode.engine.stats import check_nfe
from unmask.decode.engine.stop import StopRule
from unmask.errors import UnmaskError
from unmask.masks import as_4d, block_buffer_mask, sbd_inference_mask
from unmask.policies import commit
from unmask.sampling import Sampling


@dataclass(eq=False)
class BlockRow(Row):
    """A running block row: ``full`` its committed generated ids (whole blocks, up to
    ``max_new_tokens``); ``bstart`` its block's first absolute position; ``storing`` /
    ``denoising`` its next forward's regions; ``accepts`` commits per denoising forward."""

    generator: object = None
    full: list = field(default_factory=list)
    bstart: int = 0
    storing: bool = False
    denoising: bool = True
    accepts: list = field(default_factory=list)
    stores: int = 0
    keys: int = 0  # cached keys the row attends to (prefill and stored blocks): compaction reads no tensor
    more: bool = True  # its block has editable masks (the last read): only such rows draw, found with no read


class BlockDecoder(PrefixBatch):
    """The running batch of SingleBD (``cfg`` a :class:`~unmask.decode.blocks.single.BlockConfig`) or lossy
    SBD rows (an :class:`~unmask.decode.blocks.sbd.SBDConfig`), one forward per :meth:`step`. The
    config's ``kind`` (:class:`~unmask.decode.blocks.rule.Kind`) says which; a config without one is SBD's.

    Settings and hooks: :class:`~unmask.decode.blocks.prefix.PrefixBatch`. As in
    :class:`~unmask.decode.verify.batch.Verify`, a prefill runs eagerly and is placed into its slots, a
    forward covers the row bucket, and ``StaticKV.crowded`` decides compaction. ``on_token(row)`` runs
    after each committed token. A row's ``logit_bias`` is added before its commit rule; with ``logprobs``
    its finished row has them (commit-time). Rows end on their first stop token (the block holding it is
    kept whole, the output cut before it), a stop string, or ``max_new_tokens``. Raises UnmaskError for a
    bad capacity, or a row that does not fit a static cache.
    """

    def __init__(self, bundle, cfg, **kw):
        super().__init__(bundle, cfg, **kw)
        self.kind, self.B, self.quota_steps = getattr(cfg, "kind", SBD), cfg.block_size, getattr(cfg, "steps", None)
        self.fused = self.kind is SBD or cfg.store == "fused"
        if self.quota_steps is not None:  # the published quota-threshold loops rank by the model's own softmax
            self.suppress = []
        self.store_forwards, self.R = 0, 0  # store-only forwards; slots [0, R) go through every forward
        C, dev = self.capacity, self.device
        self.seq = torch.full((C, 0), self.mask_id, dtype=torch.long, device=dev)  # (C, L) prompt, generated, masks
        self.gen_start, self.gen_end, self.edit_end, self.bstart, self.qstep = (
            torch.zeros(C, dtype=torch.long, device=dev) for _ in range(5))  # (C,) each
        self.live, self.denoise, self.store = (torch.zeros(C, dtype=torch.bool, device=dev) for _ in range(3))
        self.key_valid = torch.zeros((C, 0), dtype=torch.bool, device=dev)  # (R, W >= kv.length)

    # -- joining ------------------------------------------------------------------------------

    @torch.inference_mode()
    def join(self, requests) -> list[BlockRow]:
        """Prefill the requests together (one forward: SingleBD's whole prompt blocks, block-causal;
        SBD's prompts, causal) into free slots. Returns the rows that finished at once
        (``max_new_tokens`` <= 0). Raises UnmaskError, before any joins, for an empty SBD prompt,
        a row past a static cache, or more requests than free slots."""
        if not requests:
            return []
        B, dev = self.B, self.device
        if not self.kind.aligned and any(len(job.prompt_ids) == 0 for job in requests):  # SBD's causal prefill
            raise UnmaskError("sbd decoding needs a non-empty prompt; start it with the BOS token")
        check_fits(requests, self.length if self.static else None, 3 * B)
        slots = self.slots.take(len(requests))
        rows, done = [], []
        for job, s in zip(requests, slots):
            P = len(job.prompt_ids)
            start = (P // B) * B if self.kind.aligned else P
            row = BlockRow(job=job, slot=s, generator=row_generator(job, dev), bstart=start, keys=start)
            (done if job.max_new_tokens <= 0 else rows).append(row)
        for row in done:
            self.slots.give([row.slot])
            self._finish(row)
        if rows:
            try:
                self._prefill(rows)
            except BaseException:  # a failed prefill gives its slots back (a step covers [0, high))
                self.slots.give([row.slot for row in rows])
                raise
        return done

    def _prefill(self, rows: list[BlockRow]) -> None:
        B, dev, model = self.B, self.device, self.bundle.model
        prompts, budgets = [list(r.job.prompt_ids) for r in rows], [r.job.max_new_tokens for r in rows]
        ends = [len(p) + m for p, m in zip(prompts, budgets)]
        if self.static and self.kv is None:  # the first join (a static cache is reset, never dropped)
            self.kv = self._static_kv(static_length(self.kind.aligned, prompts, budgets, B))
        new = DynamicKV(model)
        if self.kind.aligned:
            new, valid, _ = prefill_whole_blocks(new, prompts, B, self.bundle.pad_token_id, dev)  # (n, F)
        else:
            valid = causal_prefill(new, prompts, self.bundle.pad_token_id, dev)  # (n, P)
        self.prefills += int(valid.shape[1] > 0)
        if self.kv is None:  # an empty dynamic batch adopts the prefill (its rows padded to the highest slot)
            self.kv, self.key_valid = DynamicKV(model), valid[:0]
        self.kv, self.key_valid = place(self.kv, self.key_valid[:, : self.kv.length], new, valid,
                                        [r.slot for r in rows], rows=bool(self.running))
        self.R = self._rows_in_forward()
        self._write(rows, prompts, max(ends) + 2 * B)  # room for a whole last block past gen_end: no window clamps
        at = torch.tensor([r.slot for r in rows], dtype=torch.long, device=dev)  # (n,)
        P = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)  # (n,)
        E = torch.tensor(ends, dtype=torch.long, device=dev)  # (n,)
        self.gen_start[at], self.gen_end[at] = P, E
        self.bstart[at] = torch.tensor([r.bstart for r in rows], dtype=torch.long, device=dev)
        # The published quota-threshold loops denoise the whole last block, past max_new_tokens too.
        self.edit_end[at] = E if self.quota_steps is None else torch.div(E - 1, B, rounding_mode="floor") * B + B
        self.qstep[at], self.live[at], self.denoise[at], self.store[at] = 0, True, True, False

    def _rows_in_forward(self) -> int:
        """Slots a forward covers: the dynamic cache's rows, or on the static cache the row bucket
        (every row until a first write allocates them; never smaller in lockstep)."""
        if not self.static:
            return self.key_valid.shape[0]
        R = self.slots.bucket if self.kv.allocated else self.capacity
        return max(R, self.R) if self.lockstep else R

    # -- stepping -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[BlockRow]:
        """One forward for every running row (its store region, its block, or both), the commit
        rule, and one host sync. Returns the rows that finished in it (slots freed)."""
        if not self.running:
            return []
        if self.static:
            self.R = self._rows_in_forward()
        B, dev, R = self.B, self.device, self.R
        rows = self.rows
        S = any(r.storing for r in rows)
        D = any(r.denoising for r in rows)
        N = 0 if not D else B if self.kind.aligned else max(
            min(B, r.job.max_new_tokens + len(r.job.prompt_ids) - r.bstart) for r in rows)
        live, denoise, store = self.live[:R], self.denoise[:R], self.store[:R] & self.live[:R]
        bstart, gen_start, gen_end = self.bstart[:R], self.gen_start[:R], self.gen_end[:R]
        pos, qv = [], []
        if S:  # the finished block, B columns before this block
            pos.append((bstart - B).clamp(min=0)[:, None] + torch.arange(B, device=dev))  # (R, B)
            qv.append(store[:, None].expand(R, B))
        if D:
            dpos = bstart[:, None] + torch.arange(N, device=dev)  # (R, N)
            pos.append(dpos)
            real = dpos < gen_end[:, None] if not self.kind.aligned else torch.ones_like(dpos, dtype=torch.bool)
            qv.append(real & (live & denoise)[:, None])
        pos, qv = torch.cat(pos, 1), torch.cat(qv, 1)  # (R, q) each
        inp = self.seq[:R].gather(1, pos)  # (R, q)
        self._make_room(inp.shape[1], B)
        past, q = self.kv.length, inp.shape[1]
        logits = self._forward(inp, pos, qv, past, S, D)  # (R, N or B, V)
        self.kv.crop(q - (B if S else 0))  # only the stored block's clean K/V stay
        if S:
            self.key_valid[:R, past: past + B] = store[:, None]
        self.forwards += 1
        if self.on_forward is not None:
            self.on_forward(report.forward_state(self, inp, pos, logits, past, S, D, N))
        read, had = HostRead(), torch.zeros_like(live)  # a store-only forward commits nothing
        go = ended = had
        if D:
            blk = inp[:, -N:]
            chosen, tokens, editable, raw = self._commit(logits, blk, dpos, live & denoise)
            seq, block, had, go, ended = advance(self.seq[:R], dpos, blk, chosen, tokens, editable, live, denoise,
                                                 bstart, gen_start, gen_end, self.stops, B, self.lockstep,
                                                 self.mask_id)
            self.seq[:R] = seq
            self.qstep[:R] += had.long()
            read.add("count", chosen.sum(dim=1)).add("block", block)
            read.add("left", (editable & (block == self.mask_id)).any(dim=1))
            self.shaping.add(read, slotted(self.running, R), lambda: (raw, tokens, chosen, bstart - gen_start))
        adv = go & ~ended
        self.bstart[:R] += adv.long() * B
        self.qstep[:R] *= (~adv).long()
        self.store[:R] = adv
        self.denoise[:R] = ~adv | self.fused
        self.live[:R] &= ~ended
        read.add("had", had).add("adv", adv).add("ended", ended)
        events = self.on_step is not None and D
        if events:  # what the step events show, in the same read
            read.add("chosen", chosen).add("tokens", tokens).add("first", dpos[:, 0]).add("start", gen_start)
            read.add("end", gen_end).add("seq", self.seq[:R])
        info = read.read()  # the step's one host sync
        if events:
            report.events(self, rows, info)
        return self._bookkeep(rows, info, S and not D)

    def _forward(self, inp, pos, qv, past, S, D) -> torch.Tensor:
        B, R, q = self.B, self.R, inp.shape[1]
        if S and not D:  # a separate store forward: one block-causal block
            structure = block_buffer_mask(past, 1, B, device=self.device)
        elif not self.kind.aligned:  # SBD's causal re-feed
            structure = sbd_inference_mask(past, B if S else 0, q - (B if S else 0), device=self.device)
        else:
            structure = block_buffer_mask(past, q // B, B, device=self.device)  # (q, past + q)
        self.key_valid[:R, past: past + q] = qv
        mask = as_4d(structure, R) & self.key_valid[:R, None, None, : past + q]  # (R, 1, q, past + q)
        # A padding query sees itself only, so no query row is empty (and nothing attends to it).
        idx = torch.arange(q, device=self.device)
        mask[:, 0, idx, past + idx] |= ~qv
        return self.kv.forward(inp, pos, mask, logits_to_keep=q - (B if S and D else 0))

    def _commit(self, logits, block, dpos, denoising):
        """The commit rule of every row (greedy rows together; each sampling setting with its rows' own
        generators) on its biased logits. Returns (chosen, tokens, editable) (R, N) each and the raw logits."""
        if self.suppress:
            logits[..., self.suppress] = float("-inf")
        logits, raw = self.shaping.shape(slotted(self.running, self.R), logits)
        editable = (dpos >= self.gen_start[: self.R, None]) & (dpos < self.edit_end[: self.R, None])  # (R, N)
        masked = editable & (block == self.mask_id) & denoising[:, None]  # (R, N)
        # rows by sampling setting; a row that only stores draws nothing (the quota rule draws for every row it gets)
        groups = group_by(((r, r) for r in self.rows),
                          lambda r: r.job.sampling if r.generator is not None and r.denoising else None)
        if list(groups) == [None]:
            chosen, tokens = self._rule(logits, masked, None, None)
        else:
            chosen, tokens = torch.zeros_like(masked), torch.zeros_like(block)
            for sampling, members in groups.items():
                at = torch.tensor([r.slot for r in members], dtype=torch.long, device=self.device)
                gens = None if sampling is None else [r.generator for r in members]
                draws = [i for i, r in enumerate(members) if r.more]
                chosen[at], tokens[at] = self._rule(logits[at], masked[at], sampling, gens, at, draws)
        return chosen, tokens, editable, raw

    def _rule(self, logits, masked, sampling, gens, at=None, draws=None):
        s = sampling or Sampling()
        if self.quota_steps is None:
            return commit(logits, masked, self.cfg.policy, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                          generator=gens, draws=draws)
        step = self.qstep[: self.R] if at is None else self.qstep[at]
        return quota_threshold_commit(logits, masked, self.cfg.policy.tau, quota(self.B, self.quota_steps, step), s,
                                      gens)

    def _bookkeep(self, rows, info: dict, store_only: bool) -> list[BlockRow]:
        """Per-row statistics and ends from the step's one host read ``info`` (by name, per slot:
        commits, had masks, moves on, ended, masks left, the block's tokens)."""
        if store_only:
            self.store_forwards += 1
        finished = []
        for row in rows:
            had, adv, ended = (info[k][row.slot] for k in ("had", "adv", "ended"))
            block = info["block"][row.slot] if "block" in info else []
            if row.denoising:
                row.more = bool(info["left"][row.slot])
                self.shaping.take(row, info, row.slot)
            row.keys += self.B if row.storing else 0
            if row.storing and not row.denoising:
                row.stores += 1
                row.nfe += 1
            if had:
                row.nfe += 1
                row.accepts.append(info["count"][row.slot])
            check_nfe(row.nfe, report.nfe_ceiling(self, row), self.kind.name)
            if adv or ended:
                P, M = len(row.job.prompt_ids), row.job.max_new_tokens
                lo, hi = max(0, P - row.bstart), min(len(block), P + M - row.bstart)
                row.full += block[lo:hi]
                if self.on_token is not None:
                    for _ in block[lo:hi]:
                        self.on_token(row)
            if adv and row.job.stop:
                ended = StopRule(self.stop.ids, tuple(row.job.stop)).hit(self.bundle, row.job.prompt_ids, row.full,
                                                                        {self.mask_id})
            if ended:
                finished.append(row)
            elif adv:
                row.bstart += self.B
                row.storing, row.denoising, row.more = True, self.fused, True
            else:
                row.storing, row.denoising = False, True
        for row in finished:
            self._finish(row)
            self._leave(row)
        return finished

    def _finish(self, row: BlockRow) -> None:
        finish(row, row.full, sorted(self.stop.ids), self.mask_id)
        row.extra = report.row_extra(self, row)
        self.shaping.finish(row)

    @torch.inference_mode()
    def _leave(self, row: BlockRow) -> None:
        super()._leave(row)
        self.shaping.forget(row)
        self.live[row.slot] = self.store[row.slot] = False
        if not self.running and self.static:  # the pointer back at 0: the next join starts a fresh cache
            self.kv.reset()
            self.key_valid, self.R = self.key_valid[:, :0], 0
        elif not self.running:
            self.kv, self.R = None, 0

    stats_extra = report.stats_extra  # (rows) -> DecodeStats.extra of finished rows


def running_batch(bundle, cfg, *, capacity: int, **kw) -> BlockDecoder:
    """The :class:`BlockDecoder` of a resolved ``cfg`` (SingleBD's or lossy SBD's), as
    :meth:`~unmask.decode.blocks.prefix.PrefixBatch.of` builds it (the server's static cache: three blocks of slack)."""
    return BlockDecoder.of(bundle, cfg, 3 * cfg.block_size, capacity=capacity, **kw)


__all__ = ["BlockDecoder", "BlockRow", "running_batch"]
