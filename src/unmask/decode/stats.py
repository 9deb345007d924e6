"""What every decoder returns: generated tokens and DecodeStats (NFE, TPF, TPS)."""

from __future__ import annotations

from dataclasses import dataclass, field

from unmask.errors import UnmaskError


def check_nfe(nfe: int, ceiling: int, decoder: str) -> None:
    """Assert a decoder's forward ceiling (issue 15): every step commits at least one token per row
    that has masks, so NFE never exceeds the generation length plus one forward per block (cache
    refresh or store). Above it a step committed nothing (e.g. a mask id was written back) and the
    loop would never end. Raises UnmaskError naming the decoder."""
    if nfe > ceiling:
        raise UnmaskError(f"internal error: the {decoder} decoder ran {nfe} forwards, above its ceiling of {ceiling} "
                          "(generation length + blocks), so a step committed nothing; please report it with the "
                          "command line")


@dataclass
class DecodeStats:
    """Counters of one decode run over a batch.

    nfe: model forward calls made for the batch (one call serves every row).
    nfe_per_row: forwards in which each row still had work (a finished row stops counting).
    tokens_per_row: generated tokens per row, up to (not including) the stop token.
    seconds: wall-clock of the whole run, prefill included.
    extra: decoder-specific details (per-step accept histogram, commit counts, ...).

    NFE counts the forwards that commit tokens: for AR the prefill forward commits the first
    token and counts; for SBD and diffusion decoders the prefill commits nothing and is not
    counted (spec/sbd.md §4.2, spec/diffusion.md §10).
    """

    nfe: int
    nfe_per_row: list[int]
    tokens_per_row: list[int]
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def generated(self) -> int:
        return sum(self.tokens_per_row)

    @property
    def tpf(self) -> float:
        """Tokens per forward: generated tokens / per-row forwards, pooled over rows."""
        return self.generated / max(1, sum(self.nfe_per_row))

    @property
    def tps(self) -> float:
        """Tokens per second for the whole batch."""
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    def row(self, i: int) -> dict:
        nfe = self.nfe_per_row[i]
        n = self.tokens_per_row[i]
        return {"nfe": nfe, "generated": n, "tpf": n / nfe if nfe else 0.0}

    def to_dict(self) -> dict:
        return {"nfe": self.nfe, "nfe_per_row": self.nfe_per_row, "tokens_per_row": self.tokens_per_row,
                "generated": self.generated, "tpf": self.tpf, "seconds": self.seconds, "tps": self.tps,
                **self.extra}


@dataclass
class DecodeOutput:
    """tokens: generated ids per row (stop token excluded); stats: the run's counters."""

    tokens: list[list[int]]
    stats: DecodeStats
