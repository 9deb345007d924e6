"""Decoding trajectories: ``--show`` (live terminal view) and ``--trace FILE`` (JSON).

Placeholder seam: the Masked-diffusion work implements ``attach_trace`` (a per-step callback
that decoders accept as ``on_step``) and the rich live renderer.
"""

from __future__ import annotations

from pathlib import Path

from unmask.errors import UnmaskError


def attach_trace(*, show: bool, trace_file: Path | None) -> dict:
    """Decoder options that record/render the trajectory. Raises UnmaskError until implemented."""
    raise UnmaskError("--show/--trace are not available yet for this decoder")
