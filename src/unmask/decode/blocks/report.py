"""What the block decoders' running batch (:mod:`unmask.decode.blocks.batch`) reports, gathered after
its step: per-row and batch statistics (``DecodeStats.extra``), ``on_step`` trace events and the
tests' ``on_forward`` states. Host reads here are tracing's and statistics', never the step's."""

from __future__ import annotations

from collections import Counter

from unmask.trace import host_event


def row_extra(dec, row) -> dict:
    """A finished row's ``row_extra`` entry (its decoder's per-row statistics)."""
    cfg = dec.cfg
    if dec.kind.aligned:
        return {"policy": cfg.policy.name, "block_size": dec.B, "store": cfg.store, "accepts": row.accepts,
                "store_forwards": row.stores}
    return {"policy": cfg.policy.name, "block_size": dec.B, "accepts": row.accepts}


def events(dec, rows, info: dict) -> None:
    """on_step events of the rows that denoised, from the step's one host read ``info`` (by name, per
    slot: ``had`` masks, the ``block`` after the commits, ``chosen`` and candidate ``tokens`` (N each),
    the block's ``first`` position, the generation ``start`` and ``end``, the sequence ``seq``)."""
    for row in rows:
        if not info["had"][row.slot]:
            continue
        block, chosen, tokens, seq = (info[k][row.slot] for k in ("block", "chosen", "tokens", "seq"))
        first, start, end = (info[k][row.slot] for k in ("first", "start", "end"))
        step, at = (dec.forwards - 1, row.slot) if dec.lockstep else (row.nfe, 0)
        if dec.kind.aligned:  # the block's committed ids; the canvas has no negative ids
            ev = host_event(step, at, chosen, block, first - start, seq[start:end], dec.mask_id,
                            block=row.bstart // dec.B)
        else:
            n = min(len(block), end - row.bstart)
            ev = host_event(step, at, chosen[:n], tokens[:n], row.bstart - start, seq[start: row.bstart + n],
                            dec.mask_id)
        dec.on_step(row, ev)


def forward_state(dec, inp, pos, logits, past, S, D, N) -> dict:
    """The ``on_forward`` state (tests) of one forward: its inputs, logits and the cache after it."""
    return {"inp": inp, "positions": pos, "logits": logits, "slots": int(S) + int(D), "stored": S, "past": past,
            "refeed": dec.B if S else 0, "block": inp[:, -N:].clone() if D else inp[:, :0],
            "start": int(dec.bstart[0] - dec.gen_start[0]),
            "cache": [(k.clone(), v.clone()) for k, v in dec.kv.layers()]}


def nfe_ceiling(dec, row) -> int:
    """The most forwards a correct run can charge ``row`` (:func:`~unmask.decode.engine.stats.check_nfe`)."""
    B, M = dec.B, row.job.max_new_tokens
    if dec.kind.aligned:
        P = len(row.job.prompt_ids)
        return ((P + M - 1) // B - P // B + 1) * (max(B, dec.quota_steps or 0) + 1)
    return M + -(-M // B)


def stats_extra(dec, rows: list) -> dict:
    """``DecodeStats.extra`` of finished rows (the decoder's ``stats_extra``)."""
    cfg, hist = dec.cfg, Counter(a for r in rows for a in r.accepts)
    common = {"policy": cfg.policy.name, "block_size": dec.B}
    if dec.kind.aligned:
        cache = {"compiled": bool(dec.compile), "static_cache": dec.kv.capacity} if dec.static else {}
        return {**common, "store": cfg.store, "store_forwards": dec.store_forwards, "steps": cfg.steps,
                "accepts": dict(sorted(hist.items())), **cache, "row_extra": [r.extra for r in rows]}
    return {**common, "accepts": dict(sorted(hist.items())), "compiled": bool(dec.compile),
            "static_cache": dec.kv.capacity if dec.static else None, "row_extra": [r.extra for r in rows]}


__all__ = ["events", "forward_state", "nfe_ceiling", "row_extra", "stats_extra"]
