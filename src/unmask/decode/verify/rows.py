"""The host side of a :class:`~unmask.decode.verify.batch.Verify` batch's rows, built from what its
step already read (no further sync): a row's ids cut at its stop rule and its finish, its
:mod:`unmask.trace` step event, ``decode``'s ``stats.extra`` and the ``on_forward`` tensors tests inspect."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from unmask.decode.engine.running import Row
from unmask.decode.engine.stop import StopRule


@dataclass(eq=False)
class VerifyRow(Row):
    """A :class:`~unmask.decode.engine.running.Row` of AR or lossless SBD: ``committed`` every id committed (a stop
    token and what its step committed after it included), ``accepts`` per forward, its K, its generator."""

    committed: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)
    K: int = 1
    generator: object = None
    drafts: object = None  # its model-free drafting (:class:`~unmask.decode.verify.drafting.RowDrafts`), if any
    block_len: int = 0  # the block draft's length in the next step
    matcher: object = None  # its grammar's state (:class:`unmask.grammar.Matcher`), if any
    cands: list | None = None  # greedy grammar rows: ranked ids per next-draft position (verify/shaped.py)


def settle(row: VerifyRow, rule: StopRule, bundle, start: int, draft: str, on_token=None) -> bool:
    """Update ``row.tokens`` (calling ``on_token(row)`` per new token) after a commit (``start``: its
    committed count before); True when the row ends: a stop id (excluded), a stop string completed by
    a token from ``start`` on (that token kept), or ``max_new_tokens``. Sets ``finish``,
    ``stop_token`` and ``extra`` of an ended row."""
    job, N = row.job, row.job.max_new_tokens
    cut = rule.first_id(row.committed, start=start)  # a stop id before ``start`` would have ended the row
    end = None if cut is not None else rule.string_end(bundle, job.prompt_ids, row.committed, start)
    ids, hit = row.committed[:cut if end is None else end], end is not None
    at_stop = cut is not None  # cut before a stop token
    ended = at_stop or hit or len(row.committed) >= N
    for t in ids[len(row.tokens): N]:
        row.tokens.append(t)
        if on_token is not None:
            on_token(row)
    if not ended:
        return False
    if row.logprobs is not None:
        row.logprobs = row.logprobs[: len(row.tokens)]
    # a stop token past N or a stop string completed past N comes after the length limit
    row.finish = "stop" if (at_stop and len(ids) < N) or (hit and len(ids) <= N) else "length"
    row.stop_token = int(not hit and len(ids) < min(len(row.committed), N))
    row.extra = {"verify": True, "draft": draft, "block_size": row.K, "accepts": row.accepts}
    if row.matcher is not None:  # ids its grammar forced: committed in some forward's draft, never predicted
        row.extra["forced"] = row.matcher.forced_ids
    if row.drafts is not None:  # name the model-free source; alone, its "host" layout and last K are internals
        cfg = row.drafts.cfg
        row.extra["draft_source"] = f"block+{cfg.source}" if cfg.beside_block else cfg.source
        if not cfg.beside_block:
            del row.extra["draft"], row.extra["block_size"]
    return True


def stats_extra(batch, rows: list) -> dict:
    """``Verify.stats_extra`` of finished ``rows`` (request order): accept histograms, layout, block
    size, query windows, drafted and accepted tokens per draft source (``drafts``), row extras;
    ``compiled`` and ``static_cache`` when static (only those for an ``ar`` batch)."""
    static = {"compiled": batch.compile, "static_cache": batch.kv.capacity} if batch.static else {}
    if batch.ar:
        return static
    accepts = Counter(c for r in rows for c in r.accepts)
    drafted = Counter(c - 1 for r in rows for c in r.accepts[1:])  # accepted draft tokens per verify forward
    return {"verify": True, "draft": batch.cfg.draft, "block_size": batch.cfg.block_size,
            "accepts": dict(sorted(accepts.items())), "accepted_drafts": dict(sorted(drafted.items())),
            "query_windows": dict(sorted(batch.windows.items())), "drafts": batch.tally.as_dict(),
            "row_extra": [r.extra for r in rows], **static}


def event(row, start: int, mask_id: int) -> dict:
    """The row's last :func:`unmask.trace.step_event`, from host-side ids (no sync): the tokens it
    committed from ``start`` on; the canvas shows its unverified draft as masks."""
    ids = row.committed
    return {"step": row.nfe - 1, "row": 0, "positions": list(range(start, len(ids))), "tokens": ids[start:],
            "canvas": [None if t == mask_id or t < 0 else t for t in ids] + [None] * (row.K - 1)}


def forward_info(batch, inp, positions, logits, a) -> None:
    """Call ``batch.on_forward`` (tests) with a step's per-row tensors and the cache, for the live slots in order."""
    live = sorted(batch.rows)
    at = torch.tensor(live, dtype=torch.long, device=batch.device)
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=k[at], values=v[at]) for k, v in batch.kv.layers()])
    batch.on_forward({"step": batch.forwards - 1, "inp": inp[at], "positions": positions[at], "logits": logits[at],
                      "cache": cache, "key_valid": batch.key_valid[at], "accepted": a[at],
                      "rows": [batch.rows[i].job.id for i in live], "committed": batch.n[at].clone()})


__all__ = ["VerifyRow", "event", "forward_info", "settle", "stats_extra"]
