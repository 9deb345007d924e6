"""What every decoder returns: generated tokens and DecodeStats (NFE, TPF, TPS)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

from unmask.errors import UnmaskError


def check_nfe(nfe: int, ceiling: int, decoder: str) -> None:
    """Assert a decoder's forward ceiling: every step commits at least one token per row
    that has masks, so NFE never exceeds the generation length plus one forward per block (cache
    refresh or store). Above it a step committed nothing (e.g. a mask id was written back) and the
    loop would never end. Raises UnmaskError naming the decoder."""
    if nfe > ceiling:
        raise UnmaskError(f"internal error: the {decoder} decoder ran {nfe} forwards, above its ceiling of {ceiling} "
                          "(generation length + blocks), so a step committed nothing; please report it with the "
                          "command line")


def stop_flags(full: list[list[int]], kept: list[list[int]], stop_ids, limit: int | None = None) -> list[int]:
    """1 per row whose output ``kept[r]`` (a prefix of its committed ids ``full[r]``) ends because
    the next committed id is a stop id within ``limit`` generated tokens, else 0 (the stop token
    rule of :class:`DecodeStats`). Negative ids are ignored."""
    stop_set = {int(t) for t in stop_ids if int(t) >= 0}  # -1 stands for "no stop ids" / undecoded
    return [int(len(k) < len(f) and (limit is None or len(k) < limit) and int(f[len(k)]) in stop_set)
            for f, k in zip(full, kept)]


def mean_window(windows: dict) -> float | None:
    """{query tokens per row of a forward: forwards} -> the mean query tokens per forward (None: no
    forward). Keys may be JSON strings."""
    forwards = sum(windows.values())
    return sum(int(q) * n for q, n in windows.items()) / forwards if forwards else None


@dataclass
class DecodeStats:
    """Counters of one decode run over a batch.

    nfe: model forward calls made for the batch (one call serves every row).
    nfe_per_row: forwards in which each row still had work (a finished row stops counting).
    tokens_per_row: generated tokens per row, up to (not including) the stop token.
    seconds: wall-clock of the whole run, prefill included.
    extra: decoder-specific details (per-step accept histogram, commit counts, ...).
    stops_per_row: 1 where the row ended on a stop token (EOS) it committed, else 0 (empty: none).

    :attr:`queries_per_forward` (lossless SBD only, else None) is read from ``extra["query_windows"]``
    ({query tokens per row of a verify forward: forwards}); :attr:`accept_histogram` is
    ``extra["accepts"]`` ({tokens a row committed in one forward: row forwards}) of the decoders that
    keep one (lossless SBD counts its prefill too, so its counts sum to ``sum(nfe_per_row)``; AR: None).
    :meth:`row` gives each row's own histogram from ``extra["row_extra"][i]["accepts"]`` (its tokens
    per forward, in order) where the decoder keeps that list.

    The stop token rule, the same for every decoder: a stop token a row commits counts as a
    generated token for TPF (a forward was spent committing it, so AR stopping on EOS has TPF 1.0),
    while the text, ``tokens_per_row``, ``generated`` and TPS exclude it (they measure output).

    NFE counts the forwards that commit tokens: for AR the prefill forward commits the first
    token and counts; for SBD and diffusion decoders the prefill commits nothing and is not
    counted (spec/sbd.md §4.2, spec/diffusion.md §10).
    """

    nfe: int
    nfe_per_row: list[int]
    tokens_per_row: list[int]
    seconds: float
    extra: dict = field(default_factory=dict)
    stops_per_row: list[int] = field(default_factory=list)

    def __repr__(self) -> str:  # the derived figures first: what a reader of a printed result looks for
        rest = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name not in ("nfe", "seconds"))
        return (f"DecodeStats(nfe={self.nfe}, tpf={self.tpf:.3f}, tps={self.tps:.1f}, generated={self.generated}, "
                f"seconds={self.seconds:.4f}, {rest})")

    @property
    def generated(self) -> int:
        return sum(self.tokens_per_row)

    @property
    def tpf(self) -> float:
        """Tokens per forward: committed tokens (generated + stop tokens) / per-row forwards, pooled."""
        return (self.generated + sum(self.stops_per_row)) / max(1, sum(self.nfe_per_row))

    @property
    def tps(self) -> float:
        """Tokens per second for the whole batch."""
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def queries_per_forward(self) -> float | None:
        """Lossless SBD: query tokens per row per verify forward (the step's query window, e.g.
        D + 1 + |S|·G = 16 for layout ``3/0,1,3/4``, 2K linear, K + K² quadratic; spec/sbd_exact.md
        §5.1), the mean over the verify forwards (prefills excluded); None for other decoders or
        when no verify forward ran."""
        return mean_window(self.extra.get("query_windows") or {})

    @property
    def accept_histogram(self) -> dict[int, int] | None:
        """{tokens committed by a row in one forward: row forwards} over the batch (int keys), for the
        decoders that keep it (lossless SBD: prefill included, counts sum to ``sum(nfe_per_row)``), else None."""
        acc = self.extra.get("accepts")
        return None if acc is None else {int(k): v for k, v in sorted(acc.items(), key=lambda kv: int(kv[0]))}

    def row(self, i: int) -> dict:
        """Row i's nfe, generated, stop_token and tpf; ``accept_histogram``, its own, where the decoder
        keeps per-row accepts (lossless SBD: summing to its nfe), and for lossless SBD the batch's
        ``queries_per_forward``."""
        nfe = self.nfe_per_row[i]
        n = self.tokens_per_row[i]
        stop = self.stops_per_row[i] if i < len(self.stops_per_row) else 0
        out = {"nfe": nfe, "generated": n, "stop_token": stop, "tpf": (n + stop) / nfe if nfe else 0.0}
        rows = self.extra.get("row_extra") or []
        accepts = rows[i].get("accepts") if i < len(rows) and isinstance(rows[i], dict) else None
        if self.accept_histogram is not None and isinstance(accepts, list):
            out["accept_histogram"] = dict(sorted(Counter(accepts).items()))
        if self.queries_per_forward is not None:
            out["queries_per_forward"] = self.queries_per_forward
        return out

    def to_dict(self) -> dict:
        lossless = {k: v for k, v in (("queries_per_forward", self.queries_per_forward),
                                      ("accept_histogram", self.accept_histogram)) if v is not None}
        return {"nfe": self.nfe, "nfe_per_row": self.nfe_per_row, "tokens_per_row": self.tokens_per_row,
                "stops_per_row": self.stops_per_row,
                "generated": self.generated, "tpf": self.tpf, "seconds": self.seconds, "tps": self.tps,
                **self.extra, **lossless}


@dataclass
class DecodeOutput:
    """tokens: generated ids per row (stop token excluded); stats: the run's counters; logprobs: per
    row one :class:`~unmask.decode.engine.shaping.TokenLogprob` per token (None: not asked)."""

    tokens: list[list[int]]
    stats: DecodeStats
    logprobs: list | None = None
