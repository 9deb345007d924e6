"""Training: corpora (``data``), pure objectives (``objectives``), the generic loop (``loop``)
and the SBD fine-tuning entry point (``sbd.train_sbd``)."""

from __future__ import annotations

from unmask.train.loop import TrainConfig, TrainResult


def train_sbd(**kwargs) -> TrainResult:
    """See :func:`unmask.train.sbd.train_sbd` (imported lazily: it loads transformers)."""
    from unmask.train.sbd import train_sbd as _train_sbd

    return _train_sbd(**kwargs)


__all__ = ["TrainConfig", "TrainResult", "train_sbd"]
