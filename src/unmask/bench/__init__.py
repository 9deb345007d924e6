"""Benchmarks and cost models. :mod:`unmask.bench.roofline` is the SBD §4 roofline model."""

from unmask.bench.roofline import (
    GPU_PRESETS,
    MODEL_PRESETS,
    GPUSpec,
    ModelShape,
    Precision,
    Roofline,
    SlowdownTable,
    SpeedupTable,
    roofline,
    slowdown_table,
    speedup_table,
)

__all__ = [
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "GPUSpec",
    "ModelShape",
    "Precision",
    "Roofline",
    "SlowdownTable",
    "SpeedupTable",
    "roofline",
    "slowdown_table",
    "speedup_table",
]
