"""Continuous batching for lossy SBD (the EB-sampler path of :mod:`unmask.decode.sbd`) and SingleBD
(:mod:`unmask.decode.block`): rows join and leave at step boundaries (issue 16).

Both decoders run, per row, a sequence of forwards of the same form: a *kept* part whose causal
(SBD's re-fed committed block, sbd.md §4.1) or block-causal (SingleBD's stored block,
multiblock.md §1.2 step 4) K/V stay in the cache, followed by a *noisy* block whose K/V are
cropped. Rows sit at different points of different blocks, so one step lays every row out as

    [kept part, right-aligned in C columns ; noisy block, left-aligned in N columns]   (R, C + N)

with the unused columns padding: masked as keys (``key_valid``), their own logits ignored. Each
real query sees exactly the keys it sees in the single-prompt decode (the structure mask
``sbd_inference_mask(past, C, N)`` or ``block_buffer_mask(past, slots, B)``, and the row's key
validity); positions are explicit per row, so a row's keys may sit at any cache column. After
the forward the N noisy columns are cropped and the C kept columns stay, valid for the rows
that kept something there. Rows that kept nothing leave holes; when they make up more than half
of the cache it is compacted (``multiblock.compact``), and leaving rows take their cache rows.

Joining prefills a request alone, as the single-prompt decode does (``sbd.prefill``, the causal
prompt; ``block.prefill_whole_blocks``, the whole prompt blocks), then left-pads its cache and
concatenates it along the batch dimension (or left-pads the running cache), as
``ARBatch._merge`` / ``MultiBlockBatch._merge`` do.

Equality (STYLE.md 14): a row's tokens, NFE, per-row statistics and step events equal
``sbd.decode`` / ``block.decode`` on its prompt alone, whenever it joined and whatever runs beside
it. Greedy, and sampled too: both decoders draw row by row from per-row generators
(``Sampling.row_generators([prompt])``), so each sampled row draws alone from its own generator
over exactly its own block (greedy rows commit together). Only the floating-point summation order
of attention over masked padding columns differs from the single-prompt run (as in a batched
decode). The row assembly is per-row Python: a serving step, not a compiled one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from unmask.decode import sbd
from unmask.decode.block import (BlockConfig, block_quota, check_block_model, first_stop, hit_stop_string, outputs,
                                 prefill_whole_blocks, quota_threshold_commit, row_sequences, step_event as bd_event)
from unmask.decode.kv import DynamicKV
from unmask.decode.stats import check_nfe
from unmask.errors import UnmaskError
from unmask.masks import as_4d, block_buffer_mask, sbd_inference_mask, with_key_padding
from unmask.policies import commit
from unmask.serve.running import compact_if_sparse, kv_layers, merge_kv, rebuild_kv, split_rows
from unmask.trace import step_event

POLICY_OPTIONS = ("policy", "gamma", "preset", "tau", "factor", "tokens_per_step")
SBD_OPTIONS = ("block_size", *POLICY_OPTIONS, "verify", "draft")
BLOCK_OPTIONS = ("block_size", *POLICY_OPTIONS, "store", "steps", "schedule")


@dataclass
class Row:
    """One running request. ``job`` is the scheduler's handle (``prompt_ids``, ``max_new_tokens``,
    ``sampling``, ``stop``); ``generator`` its own (None when greedy). ``nfe`` counts its forwards
    (the decoder's ``nfe_per_row``). Once finished: ``tokens`` (cut before the first stop token),
    ``finish`` ("stop" or "length") and ``extra`` (the decoder's ``row_extra`` entry for it)."""

    job: object
    generator: torch.Generator | None
    nfe: int = 0
    tokens: list[int] | None = None
    finish: str | None = None
    accepts: list[int] = field(default_factory=list)  # tokens committed at each denoising forward
    extra: dict | None = None


class _RunningBatch:
    """The cache plumbing both batches share: one ``DynamicCache`` for every running row, per-row
    key validity, merge on join, the padded forward, per-row commits, drop and compaction."""

    def __init__(self, bundle, on_step, stop_token_ids, slack: int):
        self.bundle, self.on_step, self.slack = bundle, on_step, slack
        self.device, self.mask_id = bundle.device, bundle.mask_token_id
        ids = bundle.stop_token_ids if stop_token_ids is None else stop_token_ids
        self.stops = torch.tensor(sorted(set(ids)) or [-1], device=self.device)
        self.rows: list = []
        self.forwards = 0  # prefill and step forwards of this batch
        self.kv: DynamicKV | None = None
        self.key_valid: torch.Tensor | None = None  # (R, kv.length) bool: the columns each row attends to

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def cache(self):
        """The running ``DynamicCache`` (None when no row is running)."""
        return None if self.kv is None else self.kv.cache

    def _merge(self, row, kv: DynamicKV, valid: torch.Tensor) -> None:
        """Append one prefilled row: its cache and key validity (1, n), both sides left-padded to
        the longer one (the padding is masked out)."""
        if not self.rows:
            self.rows, self.kv, self.key_valid = [row], kv, valid
            return
        self.kv, self.key_valid = merge_kv(self.bundle.model, self.kv, self.key_valid, kv, valid)  # (R + 1, T)
        self.rows.append(row)

    def _forward(self, inp: torch.Tensor, positions: torch.Tensor, q_valid: torch.Tensor, structure, n_logits: int,
                 n_crop: int) -> torch.Tensor:
        """One forward of every row: inp, positions, q_valid (R, q) (q_valid False on padding);
        ``structure(past)`` the (q, past + q) bool mask of the decoder. Crops the last ``n_crop``
        columns afterwards. Returns float32 logits (R, n_logits, V)."""
        self._compact_if_sparse()
        R, past = len(self.rows), self.kv.length
        kv_valid = torch.cat([self.key_valid, q_valid], dim=1)  # (R, past + q)
        mask = with_key_padding(as_4d(structure(past), R), kv_valid)  # (R, 1, q, past + q)
        logits = self.kv.forward(inp, positions, mask, logits_to_keep=n_logits)  # (R, n_logits, V)
        self.kv.crop(n_crop)
        self.key_valid = kv_valid[:, : self.kv.length]
        self.forwards += 1
        return logits

    def _commit(self, logits: torch.Tensor, masked: torch.Tensor, policy, widths: list[int]):
        """``policies.commit`` row by row as the single-prompt decode calls it: greedy rows together,
        each sampled row alone on its own ``widths[r]`` block positions with its own generator (a
        row without masks draws nothing). logits (R, N, V), masked (R, N) -> (chosen, tokens) (R, N)."""
        chosen = torch.zeros_like(masked)  # (R, N)
        tokens = torch.zeros(masked.shape, dtype=torch.long, device=masked.device)  # (R, N)
        greedy = [r for r, row in enumerate(self.rows) if row.generator is None]
        if greedy:
            at = torch.tensor(greedy, dtype=torch.long, device=masked.device)  # (g,)
            chosen[at], tokens[at] = commit(logits[at], masked[at], policy)
        for r, row in enumerate(self.rows):
            n = widths[r]
            if row.generator is None or not bool(masked[r, :n].any()):
                continue
            s = row.job.sampling
            c, t = commit(logits[r: r + 1, :n], masked[r: r + 1, :n], policy, temperature=s.temperature,
                          top_k=s.top_k, top_p=s.top_p, generator=[row.generator])  # (1, n) each
            chosen[r, :n], tokens[r, :n] = c[0], t[0]
        return chosen, tokens

    def _compact_if_sparse(self) -> None:
        """Compact the cache when columns no row attends to make up more than half of it."""
        self.key_valid = compact_if_sparse(self.kv, self.key_valid, self.slack)

    def _leave(self, finished: list) -> list:
        ids = {id(row) for row in finished}
        self.drop(lambda row: id(row) in ids)
        return finished

    def drop(self, pred) -> list:
        """Remove the rows for which ``pred(row)`` is true, with their cache rows. A batch left empty
        frees its cache (``cache`` None). Returns the removed rows."""
        gone, kept, idx = split_rows(self.rows, pred, self.device)  # idx (R',)
        if not gone:
            return []
        self.rows = kept
        if not self.rows:
            self.kv, self.key_valid = None, None
            return gone
        self.key_valid = self.key_valid[idx]  # (R', n)
        layers = kv_layers(self.kv)
        if layers is None:
            self.kv = DynamicKV(self.bundle.model)
        else:
            self.kv = rebuild_kv(self.bundle.model, [(k[idx], v[idx]) for k, v in layers])  # (R', H, n, D) each
            self._compact_if_sparse()
        return gone


@dataclass
class SBDRow(Row):
    """A lossy SBD row: ``start`` (generated index of its block), ``block`` (n,) (mask where still
    masked), ``refeed`` (c,) the committed block its block's first forward re-feeds (c = 0 after
    it), ``out`` the committed generated ids."""

    prompt_len: int = 0
    start: int = 0
    block: torch.Tensor | None = None
    refeed: torch.Tensor | None = None
    out: list[int] = field(default_factory=list)


class SBDBatch(_RunningBatch):
    """The running set of lossy SBD rows (SBD Alg. 2–3, EB sampler; :func:`unmask.decode.sbd.decode`
    without ``verify``) of one model and one set of options, one forward per step.

    options: ``block_size``, ``policy``, ``gamma``, ``preset``, ``tau``, ``factor``,
    ``tokens_per_step`` (None = default; the checkpoint's ``decode_defaults`` fill the rest, as in
    ``sbd.decode``), validated once by :class:`~unmask.decode.sbd.SBDConfig`; ``verify``/``draft``
    only to say "lossy": options that select lossless SBD raise. ``on_step(row, event)`` gets the
    event ``sbd.decode`` on that prompt alone emits (``row`` 0, ``step`` the row's forward index).
    Raises UnmaskError for a model without a mask token, an unknown option or a bad value.
    """

    def __init__(self, bundle, options: dict | None = None, on_step=None, *, stop_token_ids=None):
        if bundle.mask_token_id is None:
            raise UnmaskError("the sbd decoder needs a model with a mask token (an SBD fine-tuned model); "
                              "train one with 'unmask train sbd'")
        options = dict(options or {})
        unknown = sorted(set(options) - set(SBD_OPTIONS))
        if unknown:
            raise UnmaskError(f"option(s) {', '.join(unknown)} do not apply to a continuous lossy sbd batch; "
                              f"use only {', '.join(SBD_OPTIONS)}")
        given = [f"--{k.replace('_', '-')}" for k in POLICY_OPTIONS if options.get(k) is not None]
        defaults = dict(bundle.meta.get("decode_defaults") or {})
        if sbd._lossless(options.get("verify"), given, options.get("draft"), defaults):
            raise UnmaskError("these options run lossless SBD (--verify), which the lossy sbd batch does not decode; "
                              "pass --no-verify or a policy option")
        defaults = {k: v for k, v in defaults.items() if k not in sbd.LOSSLESS_KEYS}
        self.cfg = sbd.SBDConfig.from_options(**{k: options.get(k) for k in ("block_size", *POLICY_OPTIONS)},
                                              defaults=defaults)
        if self.cfg.block_size > bundle.context_length:
            raise UnmaskError(f"block size {self.cfg.block_size} exceeds the context window of "
                              f"{bundle.context_length}; lower --block-size")
        super().__init__(bundle, on_step, stop_token_ids, slack=self.cfg.block_size)
        self.suppress = list(bundle.suppress_ids)

    @torch.inference_mode()
    def join(self, jobs: list) -> list[SBDRow]:
        """Prefill each job's prompt alone (``sbd.prefill``) and add it. Returns the rows that finished
        at once (``max_new_tokens`` 0), removed."""
        done = []
        for job in jobs:
            prompt = list(job.prompt_ids)
            gens = job.sampling.row_generators([prompt], self.device)  # the generator decode gives it
            row = SBDRow(job=job, generator=None if gens is None else gens[0], prompt_len=len(prompt))
            kv = DynamicKV(self.bundle.model)
            valid = sbd.prefill(kv, [prompt], self.bundle.pad_token_id, self.device)  # (1, P)
            self.forwards += 1
            if job.max_new_tokens <= 0:
                done.append(self._finish(row))
                continue
            row.block = self._masks(min(self.cfg.block_size, job.max_new_tokens))
            row.refeed = row.block[:0]
            self._merge(row, kv, valid)
        return done

    def _masks(self, n: int) -> torch.Tensor:
        return torch.full((n,), self.mask_id, dtype=torch.long, device=self.device)  # (n,)

    @torch.inference_mode()
    def step(self) -> list[SBDRow]:
        """One forward for every running row: ``[re-fed block ; block]`` (first forward of a block) or
        ``[block]``, then each row's EB commit (sbd.md §4, §5.1). Returns the rows that finished in
        it (a stop token or string in a committed block, or ``max_new_tokens``), removed, with
        ``tokens``, ``nfe``, ``finish`` and ``extra`` set."""
        if not self.rows:
            return []
        k, dev, R = self.cfg.block_size, self.device, len(self.rows)
        C = max(row.refeed.numel() for row in self.rows)
        N = max(row.block.numel() for row in self.rows)
        inp = torch.full((R, C + N), self.mask_id, dtype=torch.long, device=dev)  # (R, C + N)
        pos = torch.zeros((R, C + N), dtype=torch.long, device=dev)  # (R, C + N)
        q_valid = torch.zeros((R, C + N), dtype=torch.bool, device=dev)  # (R, C + N)
        widths = []
        for r, row in enumerate(self.rows):
            c, n, at = row.refeed.numel(), row.block.numel(), row.prompt_len + row.start
            pos[r] = at + torch.arange(-C, N, device=dev).clamp(min=-c, max=n - 1)  # padding repeats a real position
            inp[r, C - c: C], inp[r, C: C + n] = row.refeed, row.block
            q_valid[r, C - c: C + n] = True
            widths.append(n)
        logits = self._forward(inp, pos, q_valid, lambda past: sbd_inference_mask(past, C, N, device=dev), N, N)
        if self.suppress:
            logits[..., self.suppress] = float("-inf")
        blocks = inp[:, C:]  # (R, N)
        width = torch.tensor(widths, device=dev)  # (R,)
        masked = (blocks == self.mask_id) & (torch.arange(N, device=dev)[None, :] < width[:, None])  # (R, N)
        chosen, tokens = self._commit(logits, masked, self.cfg.policy, widths)
        blocks = torch.where(chosen, tokens, blocks)  # (R, N)
        counts = chosen.sum(dim=1).tolist()
        finished = []
        for r, row in enumerate(self.rows):
            n, M = widths[r], row.job.max_new_tokens
            row.block, row.refeed = blocks[r, :n].clone(), row.block[:0]
            row.nfe += 1
            check_nfe(row.nfe, M + -(-M // k), "sbd")
            row.accepts.append(counts[r])
            if self.on_step is not None:  # canvas = committed blocks + this block
                canvas = torch.cat([torch.tensor(row.out, dtype=torch.long, device=dev), row.block])
                self.on_step(row, step_event(row.nfe - 1, 0, chosen[r, :n], tokens[r, :n], row.start, canvas,
                                             self.mask_id))
            if bool((row.block == self.mask_id).any()):
                continue
            row.out += row.block.tolist()
            row.start += n
            stopped = bool(torch.isin(row.block, self.stops).any())
            if not stopped and row.job.stop:
                text = self.bundle.decode_continuation(list(row.job.prompt_ids), row.out)
                stopped = any(s in text for s in row.job.stop)
            if stopped or row.start >= M:
                finished.append(self._finish(row))
            else:  # the next block: its first forward re-feeds this one causally (§4.1)
                row.refeed, row.block = row.block, self._masks(min(k, M - row.start))
        return self._leave(finished)

    def _finish(self, row: SBDRow) -> SBDRow:
        row.tokens = sbd.until_stop(row.out, self.stops)
        row.finish = "length" if len(row.tokens) >= row.job.max_new_tokens else "stop"
        row.extra = {"policy": self.cfg.policy.name, "block_size": self.cfg.block_size, "accepts": row.accepts}
        return row


@dataclass
class BlockRow(Row):
    """A SingleBD row: its sequence ``seq`` (1, L) (prompt, generated, masks), block ``j`` of
    ``n_blocks`` at positions ``pos`` (B,), ``store`` (B,) the finished block whose clean K/V this
    step writes (at ``store_pos``), ``denoise`` whether this step denoises block j (False: a
    separate store forward), ``step`` the denoising forwards of block j, ``stores`` its store
    forwards."""

    prompt: list[int] = field(default_factory=list)
    seq: torch.Tensor | None = None
    gen_start: torch.Tensor | None = None  # (1,) long
    n_full: int = 0
    n_blocks: int = 0
    j: int = 0
    pos: torch.Tensor | None = None
    block: torch.Tensor | None = None
    editable: torch.Tensor | None = None
    step: int = 0
    store: torch.Tensor | None = None
    store_pos: torch.Tensor | None = None
    denoise: bool = True
    stores: int = 0


class BlockBatch(_RunningBatch):
    """The running set of SingleBD rows (:func:`unmask.decode.block.decode`, multiblock.md §1.2) of
    one model and one set of options, one forward per step: a row denoises its block, stores its
    finished block (``store="separate"``: that forward counts in its NFE), or both in one forward of
    two blocks (``store="fused"``). The quota rule (``schedule`` / ``steps``) is supported.

    options: ``block_size``, ``policy``, ``tau``, ``gamma``, ``preset``, ``factor``,
    ``tokens_per_step``, ``store``, ``steps``, ``schedule`` (None = default), validated once by
    :class:`~unmask.decode.block.BlockConfig`. ``on_step(row, event)`` gets the event
    ``block.decode`` on that prompt alone emits (``row`` 0). Raises UnmaskError for a model that is
    not block-diffusion, an unknown option or a bad value.
    """

    def __init__(self, bundle, options: dict | None = None, on_step=None, *, stop_token_ids=None):
        check_block_model(bundle, "block")
        options = dict(options or {})
        unknown = sorted(set(options) - set(BLOCK_OPTIONS))
        if unknown:
            raise UnmaskError(f"option(s) {', '.join(unknown)} do not apply to a continuous block batch; "
                              f"use only {', '.join(BLOCK_OPTIONS)}")
        self.cfg = BlockConfig.from_options(bundle, **options)
        B = self.cfg.block_size
        super().__init__(bundle, on_step, stop_token_ids, slack=B)
        # The published quota-threshold loops rank by the model's own softmax, mask column included.
        self.suppress = list(bundle.suppress_ids) if self.cfg.steps is None else []
        self.arange = torch.arange(B, device=self.device)

    @torch.inference_mode()
    def join(self, jobs: list) -> list[BlockRow]:
        """Prefill each job's whole prompt blocks alone (``block.prefill_whole_blocks``) and add it.
        Returns the rows that finished at once (``max_new_tokens`` 0), removed."""
        B, dev, done = self.cfg.block_size, self.device, []
        for job in jobs:
            prompt = list(job.prompt_ids)
            gens = job.sampling.row_generators([prompt], dev)
            P, M = len(prompt), job.max_new_tokens
            n_full = P // B
            row = BlockRow(job=job, generator=None if gens is None else gens[0], prompt=prompt, n_full=n_full,
                           n_blocks=(P + M - 1) // B - n_full + 1,
                           gen_start=torch.tensor([P], dtype=torch.long, device=dev))
            kv, valid, _ = prefill_whole_blocks(DynamicKV(self.bundle.model), [prompt], B, self.bundle.pad_token_id,
                                                dev)  # valid (1, F)
            self.forwards += int(valid.shape[1] > 0)
            row.seq = row_sequences([prompt], (n_full + row.n_blocks) * B, self.mask_id, dev)  # (1, L)
            if M <= 0:
                done.append(self._finish(row))
                continue
            self._enter_block(row, 0)
            self._merge(row, kv, valid)
        return done

    def _enter_block(self, row: BlockRow, j: int) -> None:
        B = self.cfg.block_size
        row.j, row.step = j, 0
        row.pos = (row.n_full + j) * B + self.arange  # (B,) absolute positions
        row.block = row.seq[0, row.pos].clone()  # (B,) prompt tail (first block) and masks
        # The published quota-threshold loops denoise the whole last block, past max_new_tokens too.
        gen_start = len(row.prompt)
        edit_end = gen_start + row.job.max_new_tokens if self.cfg.steps is None else (row.n_full + row.n_blocks) * B
        row.editable = (row.pos >= gen_start) & (row.pos < edit_end)  # (B,)

    @torch.inference_mode()
    def step(self) -> list[BlockRow]:
        """One forward for every running row (multiblock.md §1.2): its block (B queries), its finished
        block's store (B queries) or both (2B). Returns the rows that finished in it (the block
        holding the first stop token, a stop string, or the last block), removed."""
        if not self.rows:
            return []
        cfg, dev, R = self.cfg, self.device, len(self.rows)
        B = cfg.block_size
        S = any(row.store is not None for row in self.rows)  # a store region this step
        D = any(row.denoise for row in self.rows)  # a denoising region this step
        slots = int(S) + int(D)
        inp = torch.full((R, slots * B), self.mask_id, dtype=torch.long, device=dev)  # (R, slots·B)
        pos = torch.zeros((R, slots * B), dtype=torch.long, device=dev)  # (R, slots·B)
        q_valid = torch.zeros((R, slots * B), dtype=torch.bool, device=dev)  # (R, slots·B)
        for r, row in enumerate(self.rows):
            pos[r] = row.pos.repeat(slots)  # padding takes the block's positions
            if S and row.store is not None:
                inp[r, :B], pos[r, :B], q_valid[r, :B] = row.store, row.store_pos, True
            if D and row.denoise:
                inp[r, -B:], pos[r, -B:], q_valid[r, -B:] = row.block, row.pos, True
        logits = self._forward(inp, pos, q_valid, lambda past: block_buffer_mask(past, slots, B, device=dev), B,
                               B if D else 0)  # (R, B, V): the last region's
        if self.suppress:
            logits[..., self.suppress] = float("-inf")
        denoising = torch.tensor([row.denoise for row in self.rows], device=dev)  # (R,)
        blocks = torch.stack([row.block for row in self.rows])  # (R, B)
        editable = torch.stack([row.editable for row in self.rows])  # (R, B)
        masked = editable & (blocks == self.mask_id) & denoising[:, None]  # (R, B)
        if cfg.steps is None:
            chosen, tokens = self._commit(logits, masked, cfg.policy, [B] * R)
        else:  # the quota rule, row by row (each row's quota follows its own step)
            chosen, tokens = torch.zeros_like(masked), torch.zeros_like(blocks)
            for r, row in enumerate(self.rows):
                if row.denoise:
                    chosen[r: r + 1], tokens[r: r + 1] = quota_threshold_commit(
                        logits[r: r + 1], masked[r: r + 1], cfg.policy.tau, block_quota(B, cfg.steps, row.step),
                        row.job.sampling, None if row.generator is None else [row.generator])
        counts = chosen.sum(dim=1).tolist()
        finished = []
        for r, row in enumerate(self.rows):
            row.nfe += 1
            check_nfe(row.nfe, row.n_blocks * (max(B, cfg.steps or 0) + 1), "block")
            row.store = row.store_pos = None
            if not row.denoise:  # a separate store forward: commits nothing, sends no event
                row.stores += 1
                row.denoise = True
                continue
            row.step += 1
            row.block = torch.where(chosen[r], tokens[r], row.block)  # (B,)
            row.seq[0, row.pos] = row.block
            row.accepts.append(counts[r])
            gen_end = len(row.prompt) + row.job.max_new_tokens
            if self.on_step is not None:
                self.on_step(row, bd_event(row.nfe - 1, 0, row.pos[chosen[r]], row.block[chosen[r]], row.seq[0],
                                           len(row.prompt), gen_end, self.mask_id, block=row.n_full + row.j))
            if bool((row.editable & (row.block == self.mask_id)).any()):
                continue
            # A row ends after the block holding its first stop token, or after its last block.
            stop_at = int(first_stop(row.seq, row.gen_start, row.gen_start + row.job.max_new_tokens, self.stops)[0])
            ended = stop_at < (row.n_full + row.j + 1) * B or row.j == row.n_blocks - 1
            if not ended and row.job.stop:
                tokens_so_far = outputs(row.seq, row.gen_start, row.job.max_new_tokens, self.stops, self.mask_id)
                ended = bool(hit_stop_string(self.bundle, [row.prompt], tokens_so_far,
                                             torch.ones(1, dtype=torch.bool, device=dev), row.job.stop)[0])
            if ended:
                finished.append(self._finish(row))
                continue
            row.store, row.store_pos = row.block, row.pos  # the finished block's clean K/V, next forward
            self._enter_block(row, row.j + 1)
            row.denoise = cfg.store == "fused"
        return self._leave(finished)

    def _finish(self, row: BlockRow) -> BlockRow:
        cfg = self.cfg
        row.tokens = outputs(row.seq, row.gen_start, row.job.max_new_tokens, self.stops, self.mask_id)[0]
        row.finish = "length" if len(row.tokens) >= row.job.max_new_tokens else "stop"
        row.extra = {"policy": cfg.policy.name, "block_size": cfg.block_size, "store": cfg.store,
                     "accepts": row.accepts, "store_forwards": row.stores}
        return row


__all__ = ["BlockBatch", "BlockRow", "Row", "SBDBatch", "SBDRow"]
