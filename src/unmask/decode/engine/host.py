"""A step's one host sync: named per-row columns packed into one tensor, read with one ``tolist()``
and unpacked by name (DESIGN.md "One engine": a step costs one host sync, with or without
``on_step``)."""

from __future__ import annotations

import torch


class HostRead:
    """Collect the per-row tensors a step's bookkeeping needs, then read them all at once.

    ``add(name, t)``: ``t`` is (R,) or (R, w), any integer or bool dtype, on the batch's device; all
    added tensors share R. ``read()`` -> {name: list of R values (a (R,) column) or R lists of w
    values}: one ``torch.cat`` and one ``tolist()``, whatever the number of names. Raises ValueError
    for a float tensor (pack counts and ids only) or a row count that differs."""

    def __init__(self):
        self._parts: list[tuple[str, torch.Tensor]] = []

    def add(self, name: str, t: torch.Tensor) -> "HostRead":
        if t.is_floating_point():
            raise ValueError(f"HostRead packs integer and bool columns; {name!r} is {t.dtype}")
        if self._parts and t.shape[0] != self._parts[0][1].shape[0]:
            raise ValueError(f"HostRead column {name!r} has {t.shape[0]} rows, the others {self._parts[0][1].shape[0]}")
        self._parts.append((name, t.flatten(1) if t.dim() > 2 else t))  # (R,) or (R, w)
        return self

    def read(self) -> dict[str, list]:
        if not self._parts:
            return {}
        # column_stack takes (R,) as a column and promotes the dtypes in the same op: one op, then one sync
        packed = torch.column_stack([t for _, t in self._parts])  # (R, total width)
        rows = (packed.long() if packed.dtype == torch.bool else packed).tolist()  # the one host sync
        out, at = {}, 0
        for name, t in self._parts:
            if t.dim() == 1:
                out[name] = [r[at] for r in rows]
                at += 1
            else:
                w = t.shape[1]
                out[name] = [r[at: at + w] for r in rows]
                at += w
        return out


__all__ = ["HostRead"]
