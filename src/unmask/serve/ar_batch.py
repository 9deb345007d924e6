"""Continuous batching for autoregressive decoding: rows join and leave at step boundaries.

:class:`ARBatch` owns one KV cache for every running row. All rows are right-aligned: each step
feeds every row's latest token into the same new cache column, so rows of different lengths sit
side by side with their unused leading columns masked out (``key_valid``). A joining request is
prefilled alone (a batch of one, exactly like ``unmask.decode.ar`` on that prompt), then its
cache is left-padded to the running length and concatenated along the batch dimension. A row
that finishes, is cancelled or times out is dropped from the cache before the next forward
(``keep_rows``), and leading columns no row needs any more are cut off, so the cache never holds
more than the longest running row.

Positions are explicit per row and padded keys are masked, so a row's tokens do not depend on
which other rows share its forwards (greedy outputs equal ``unmask.generate(..., "ar")``; a
seeded sampled row draws from its own generator and equals it too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from unmask.compat import attention_mask, forward, keep_rows, new_cache
from unmask.sampling import Sampling, sample
from unmask.serve.running import pad_left, split_rows


@dataclass
class Row:
    """One running request: its prompt, generated ids and sampling state.

    ``job`` is the scheduler's handle (anything with ``max_new_tokens``, ``sampling``, ``stop``
    and ``prompt_ids``); ``pending`` is the sampled token not yet fed to the model."""

    job: object
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    pending: int = -1
    next_pos: int = 0
    nfe: int = 0  # forwards that committed a token for this row (the stop token's included)
    finish: str | None = None  # "stop" or "length" once the row is done


class ARBatch:
    """The running set of AR rows of one model (NTP mode, SBD Eq. 9a), advanced one step at a time.

    ``join(jobs)`` prefills new rows; ``step()`` runs one forward for every running row and
    returns the rows that finished in it; ``drop(pred)`` evicts rows (cancelled, timed out).
    ``on_token(row)`` is called after every token a row commits (prefill included).
    """

    def __init__(self, bundle, on_token=None):
        self.bundle, self.on_token = bundle, on_token
        self.rows: list[Row] = []
        self.cache = None
        self.key_valid: torch.Tensor | None = None  # (b, L) bool: which cache columns each row attends to
        self.forwards = 0
        stops = sorted(set(bundle.stop_token_ids))
        self.stop_ids = set(stops)
        self.suppress = list(bundle.suppress_ids)

    def __len__(self) -> int:
        return len(self.rows)

    # -- joining ------------------------------------------------------------------------------

    @torch.inference_mode()
    def join(self, jobs: list) -> list[Row]:
        """Prefill each job alone and add it to the running batch. Returns the rows that already
        finished on their first token (max_new_tokens 1, a stop token or a stop string). A job
        with ``resume`` tokens (committed elsewhere, greedy, equal to AR's) is prefilled with
        them and continues after them; ``resume_nfe`` forwards are already counted."""
        done = []
        for job in jobs:
            sampling: Sampling = job.sampling
            gens = sampling.row_generators([job.prompt_ids], self.bundle.device)  # the generator `unmask generate` gives it
            row = Row(job=job, generator=gens[0] if gens else sampling.generator(self.bundle.device))
            # A row moved here mid-decode (greedy lossless sbd: its committed tokens are AR's) goes on
            # from them: they are prefilled with the prompt and count as already generated.
            resume = list(getattr(job, "resume", ()))
            row.tokens, row.nfe = list(resume), int(getattr(job, "resume_nfe", 0))
            ids = torch.tensor([job.prompt_ids + resume], dtype=torch.long, device=self.bundle.device)  # (1, P)
            P = ids.shape[1]
            pos = torch.arange(P, device=ids.device)[None]  # (1, P)
            cache = new_cache(self.bundle.model)
            logits = forward(self.bundle.model, ids, position_ids=pos, cache=cache, logits_to_keep=1)[:, -1]  # (1, V)
            self.forwards += 1
            row.next_pos = P
            if self._commit(row, logits[0]):
                done.append(row)
                continue
            self._merge(row, cache, P)
        return done

    def _merge(self, row: Row, cache, P: int) -> None:
        """Append a prefilled row (its own cache of P columns) to the running batch."""
        if not self.rows:
            self.rows, self.cache = [row], cache
            self.key_valid = torch.ones((1, P), dtype=torch.bool, device=self.bundle.device)  # (1, P)
            return
        L = self.key_valid.shape[1]
        T = max(L, P)
        layers = []
        for old, new in zip(self.cache.layers, cache.layers):
            # keys/values (b, H, L, D) and (1, H, P, D) -> (b + 1, H, T, D), padding on the left
            k = torch.cat([pad_left(old.keys, T - L, 2), pad_left(new.keys, T - P, 2)], dim=0)
            v = torch.cat([pad_left(old.values, T - L, 2), pad_left(new.values, T - P, 2)], dim=0)
            layers.append((k, v))
        self.cache = self._rebuild(layers)
        new_valid = torch.ones((1, P), dtype=torch.bool, device=self.key_valid.device)
        self.key_valid = torch.cat([pad_left(self.key_valid, T - L, 1), pad_left(new_valid, T - P, 1)], dim=0)  # (b+1, T)
        self.rows.append(row)

    def _rebuild(self, layers: list[tuple[torch.Tensor, torch.Tensor]]):
        cache = new_cache(self.bundle.model)
        for i, (k, v) in enumerate(layers):
            cache.update(k, v, i)
        return cache

    # -- stepping -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One forward over every running row; each commits one token. Returns the finished rows
        (already removed from the batch)."""
        if not self.rows:
            return []
        dev = self.bundle.device
        tok = torch.tensor([[r.pending] for r in self.rows], dtype=torch.long, device=dev)  # (b, 1)
        pos = torch.tensor([[r.next_pos] for r in self.rows], dtype=torch.long, device=dev)  # (b, 1)
        self.key_valid = torch.cat([self.key_valid, self.key_valid.new_ones(len(self.rows), 1)], dim=1)  # (b, L+1)
        # No mask when nothing is padded (as unmask.decode.ar does); else the 4D key mask (b, 1, 1, L+1).
        mask = None if bool(self.key_valid.all()) else attention_mask(self.bundle.model, self.key_valid[:, None, None, :])
        logits = forward(self.bundle.model, tok, position_ids=pos, attention_mask=mask, cache=self.cache)[:, -1]  # (b, V)
        self.forwards += 1
        finished = []
        for i, row in enumerate(self.rows):
            row.next_pos += 1
            if self._commit(row, logits[i]):
                finished.append(row)
        if finished:
            self.drop(lambda r: r.finish is not None)
        return finished

    def _commit(self, row: Row, logits: torch.Tensor) -> bool:
        """Sample the row's next token from logits (V,); True when the row is finished."""
        if self.suppress:
            logits = logits.clone()
            logits[self.suppress] = float("-inf")
        t = int(sample(logits[None], row.job.sampling, row.generator)[0])  # one row, its own generator
        row.pending = t
        row.nfe += 1
        if t in self.stop_ids:  # a stop token ends the row and is not part of the output
            row.finish = "stop"
            return True
        row.tokens.append(t)
        if self.on_token is not None:
            self.on_token(row)
        if row.job.stop and any(s in self.bundle.decode_continuation(row.job.prompt_ids, row.tokens) for s in row.job.stop):
            row.finish = "stop"
        elif len(row.tokens) >= row.job.max_new_tokens:
            row.finish = "length"
        return row.finish is not None

    # -- leaving ------------------------------------------------------------------------------

    def drop(self, pred) -> list[Row]:
        """Remove the rows for which ``pred(row)`` is true; frees their cache rows and trims
        leading columns no remaining row attends to. Returns the removed rows."""
        gone, kept, idx = split_rows(self.rows, pred, self.bundle.device)  # idx (b',)
        if not gone:
            return []
        self.rows = kept
        if not self.rows:
            self.cache, self.key_valid = None, None
            return gone
        keep_rows(self.cache, idx)
        self.key_valid = self.key_valid[idx]  # (b', L)
        first = int(self.key_valid.any(dim=0).long().argmax())  # first column some row still needs
        if first > 0:
            self.key_valid = self.key_valid[:, first:]  # (b', L - first)
            self.cache = self._rebuild([(layer.keys[:, :, first:], layer.values[:, :, first:])
                                        for layer in self.cache.layers])  # (b', H, L - first, D) each
        return gone
