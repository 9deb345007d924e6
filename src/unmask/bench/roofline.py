"""Roofline model of block decoding cost (SBD §4, Eq. 15–17, Figs. 6 and 11, Tables 3–4).

A forward pass is a list of :class:`Op` (FLOPs, bytes, which peak). Each op takes
``max(flops / peak, bytes / bandwidth)`` seconds (Eq. 15) and a forward is the sum over its
ops. Two cost models produce the op lists (spec ``sbd.md`` §7.5):

- ``mode="paper"``: Fig. 11 literally, with the printed mistakes (§7.4): the FFN uses
  4096·16384 as one dimension, K/V projections are 256 wide, one layer, no LM head. Absolute
  times are meaningless (≈0.149 s per "layer"); only the ratios reproduce Tables 3 and 4.
- ``mode="corrected"``: a real :class:`ModelShape` (all layers, gated MLP, GQA, LM head),
  a :class:`GPUSpec` and a :class:`Precision` (:mod:`unmask.bench.specs`, re-exported here).

Tables (§7.3), with ``time(n)`` the forward time for a query block of n tokens per row:

- Table 3, slowdown: ``time(k) / time(1)``.
- Table 4, wall-clock speed-up: ``k·time(1) / (time(2k) + (l−1)·time(k))`` with the NFE
  speed-up ``k / l``; the first forward of each block re-feeds the previous block (2k tokens).

Units: FLOP, bytes, seconds, FLOP/s and bytes/s throughout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from unmask.errors import UnmaskError
from unmask.bench.specs import GPU_PRESETS, MODEL_PRESETS, GPUSpec, ModelShape, Precision  # noqa: F401 (public here too)
from unmask.fileio import atomic_savefig

Mode = Literal["paper", "corrected"]

TABLE3_BLOCKS = (1, 2, 4, 8, 16, 32, 64)
TABLE3_BATCHES = (1, 4, 8, 16)
TABLE3_KV = (2**4, 2**8, 2**10, 2**12, 2**14, 2**16, 2**20, 2**22)
TABLE4_BLOCKS = (8, 16, 32, 64)
TABLE4_BATCHES = (1, 4, 8)
TABLE4_NFE = (2, 4, 8)


@dataclass(frozen=True)
class Op:
    """One roofline op: ``count`` identical ops of ``flops`` FLOP moving ``bytes`` bytes."""

    name: str
    flops: float
    bytes: float
    kind: Literal["linear", "attention"] = "linear"
    count: int = 1


def _gemm(name: str, m: int, n: int, d: int, *, a_bytes: float = 1.0, w_bytes: float = 1.0,
          count: int = 1) -> Op:
    """[m×d]·[d×n]: reads m·d activations and d·n weights, writes m·n (Fig. 11 ``gemm``)."""
    return Op(name, 2.0 * m * n * d, a_bytes * m * d + w_bytes * d * n + a_bytes * m * n,
              "linear", count)


def paper_ops(*, n: int, batch: int, kv_len: int) -> list[Op]:
    """Fig. 11 as printed, for one "layer" (SBD spec §7.2, mistakes of §7.4 kept).

    1 byte per element everywhere. The FFN dimension is 4096·16384 as a single number and the
    K/V projections are num_heads·num_kv_heads = 256 wide. The block's own keys are not added
    to ``kv_len``.
    """
    T = n * batch
    ffn = 4096 * 16384  # §7.4 mistake 1: a product used as one dimension
    attn = Op("attention", 4.0 * T * kv_len * 4096,
              2.0 * T * 32 * 128 + 2.0 * batch * kv_len * 8 * 128, "attention")
    return [
        attn,
        _gemm("ffn_up", T, 4096, ffn),
        _gemm("ffn_down", T, ffn, 4096),
        _gemm("q_proj", T, 4096, 4096),
        _gemm("k_proj", T, 32 * 8, 4096),  # §7.4 mistake 2: heads·kv_heads, not kv_heads·hd
        _gemm("v_proj", T, 32 * 8, 4096),
        _gemm("o_proj", T, 4096, 4096),
    ]


def corrected_ops(*, n: int, batch: int, kv_len: int, n_logits: int, shape: ModelShape,
                  precision: Precision) -> list[Op]:
    """One forward of the whole model (SBD spec §7.5, corrected mode).

    Per layer, with T = n·batch: Q, K, V, O projections; gate/up/down MLP (gate omitted when
    ``shape.gated_mlp`` is false); attention of T queries over ``kv_len + n`` keys per row,
    reading Q and writing O in activation precision and reading the cache plus writing the
    block's new K/V (2·batch·n·nkv·hd elements) in KV precision. Then the LM head on
    ``n_logits`` rows. Attention FLOPs count the full (non-causal) block, as in the paper.
    """
    T = n * batch
    H, hd, nh, nkv = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads
    L, a, w, kv = shape.layers, precision.act, precision.weight, precision.kv
    keys = kv_len + n  # the cache plus the block's own keys
    kv_bytes = kv * 2 * batch * nkv * hd * (keys + n)  # read K, V of all keys; write the new ones
    attn = Op("attention", 4.0 * T * keys * nh * hd, a * 2 * T * nh * hd + kv_bytes,
              "attention", L)
    mlp_in = ["mlp_gate", "mlp_up"] if shape.gated_mlp else ["mlp_up"]
    return [
        attn,
        _gemm("q_proj", T, nh * hd, H, a_bytes=a, w_bytes=w, count=L),
        _gemm("k_proj", T, nkv * hd, H, a_bytes=a, w_bytes=w, count=L),
        _gemm("v_proj", T, nkv * hd, H, a_bytes=a, w_bytes=w, count=L),
        _gemm("o_proj", T, H, nh * hd, a_bytes=a, w_bytes=w, count=L),
        *(_gemm(nm, T, shape.intermediate, H, a_bytes=a, w_bytes=w, count=L) for nm in mlp_in),
        _gemm("mlp_down", T, H, shape.intermediate, a_bytes=a, w_bytes=w, count=L),
        _gemm("lm_head", n_logits, shape.vocab, H, a_bytes=a, w_bytes=w),
    ]


def ops_time(ops: list[Op], gpu: GPUSpec) -> float:
    """Seconds for a forward: Σ count·max(flops / peak, bytes / bandwidth) (SBD Eq. 15)."""
    total = 0.0
    for op in ops:
        peak = gpu.attention_flops if op.kind == "attention" else gpu.linear_flops
        total += op.count * max(op.flops / peak, op.bytes / gpu.bandwidth)
    return total


@dataclass(frozen=True)
class Roofline:
    """A configured cost model: ``time(n, batch, kv_len, n_logits)`` in seconds.

    Build it with :func:`roofline`. In paper mode ``n_logits`` is ignored (no LM head).
    """

    mode: Mode
    gpu: GPUSpec
    shape: ModelShape | None = None
    precision: Precision = Precision()

    def ops(self, *, n: int, batch: int, kv_len: int, n_logits: int | None = None) -> list[Op]:
        if self.mode == "paper":
            return paper_ops(n=n, batch=batch, kv_len=kv_len)
        assert self.shape is not None
        return corrected_ops(n=n, batch=batch, kv_len=kv_len, shape=self.shape,
                             n_logits=batch * n if n_logits is None else n_logits,
                             precision=self.precision)

    def time(self, *, n: int, batch: int, kv_len: int, n_logits: int | None = None) -> float:
        """Seconds for one forward of ``n`` query tokens per row over ``kv_len`` cached keys."""
        return ops_time(self.ops(n=n, batch=batch, kv_len=kv_len, n_logits=n_logits), self.gpu)

    def slowdown(self, *, k: int, batch: int, kv_len: int) -> float:
        """Table 3 cell: time(k) / time(1); logits for all k rows in time(k) (§7.5)."""
        t1 = self.time(n=1, batch=batch, kv_len=kv_len, n_logits=batch)
        return self.time(n=k, batch=batch, kv_len=kv_len, n_logits=batch * k) / t1

    def speedup(self, *, k: int, nfe_speedup: float, batch: int, kv_len: int) -> float:
        """Table 4 cell: k·time(1) / (time(2k) + (l−1)·time(k)), l = k / nfe_speedup (§7.3).

        time(2k) and time(k) both compute logits for batch·k rows (``logits_to_keep``).
        """
        if not 1 <= nfe_speedup <= k:
            raise UnmaskError(f"NFE speed-up must be in [1, k={k}], got {nfe_speedup}; "
                              "pass speed-ups between 1 and the block size")
        steps = k / nfe_speedup
        t1 = self.time(n=1, batch=batch, kv_len=kv_len, n_logits=batch)
        tk = self.time(n=k, batch=batch, kv_len=kv_len, n_logits=batch * k)
        t2k = self.time(n=2 * k, batch=batch, kv_len=kv_len, n_logits=batch * k)
        return k * t1 / (t2k + (steps - 1) * tk)


def roofline(*, mode: Mode = "paper", shape: ModelShape | str | Mapping | None = None,
             gpu: GPUSpec | str | None = None, precision: Precision | None = None) -> Roofline:
    """Configure a cost model (SBD spec §7.5).

    ``mode="paper"`` takes no arguments beyond an optional ``gpu`` (default
    ``h100-sxm-paper``; bytes are always 1 per element). ``mode="corrected"`` takes ``shape``
    (a :class:`ModelShape`, a preset name or an HF config dict; default ``llama-3.1-8b``),
    ``gpu`` (default ``h100-sxm``) and ``precision`` (default 1/1/2 bytes).
    Raises :class:`UnmaskError` on an unknown mode or preset.
    """
    if isinstance(gpu, str):
        gpu = GPUSpec.preset(gpu)
    if mode == "paper":
        if shape is not None or precision is not None:
            raise UnmaskError("mode='paper' uses the fixed Fig. 6 shape and 1-byte elements; "
                              "use mode='corrected' to pass a shape or precision")
        return Roofline("paper", gpu or GPU_PRESETS["h100-sxm-paper"])
    if mode != "corrected":
        raise UnmaskError(f"unknown roofline mode {mode!r}; use 'paper' or 'corrected'")
    if shape is None or isinstance(shape, str):
        shape = ModelShape.preset(shape or "llama-3.1-8b")
    elif not isinstance(shape, ModelShape):
        shape = ModelShape.from_config(shape)
    return Roofline("corrected", gpu or GPU_PRESETS["h100-sxm"], shape, precision or Precision())


def _kv_label(kv: int) -> str:
    return f"2^{kv.bit_length() - 1}" if kv > 0 and kv & (kv - 1) == 0 else str(kv)


@dataclass(frozen=True)
class RooflineTable:
    """Table 3 or Table 4 of SBD §4: one row per key, one column per KV length.

    ``row_names`` is ``("batch", "block")`` for the slowdown table and
    ``("batch", "block", "nfe_speedup")`` for the speed-up table; ``rows`` holds the key
    tuples in the paper's order and ``values[i][j]`` the cell of ``rows[i]`` at
    ``kv_lengths[j]`` (a ratio, dimensionless).
    """

    kind: Literal["slowdown", "speedup"]
    model: Roofline
    row_names: tuple[str, ...]
    rows: tuple[tuple[float, ...], ...]
    kv_lengths: tuple[int, ...]
    values: tuple[tuple[float, ...], ...]

    def value(self, *, kv_length: int, **key: float) -> float:
        """One cell, e.g. ``value(batch=1, block=16, nfe_speedup=2, kv_length=1024)``."""
        wanted = tuple(key.get(name) for name in self.row_names)
        try:
            return self.values[self.rows.index(wanted)][self.kv_lengths.index(kv_length)]
        except ValueError:
            raise UnmaskError(f"no {self.kind} cell {key} at KV {kv_length}") from None

    def format(self, *, digits: int = 3) -> str:
        """Aligned text in the paper's layout, with a one-line title."""
        what = "time(k) / time(1)" if self.kind == "slowdown" else "wall-clock speed-up"
        title = f"{what}, {self.model.mode} mode, {self.model.gpu.name}" + (
            f", {self.model.shape.name}" if self.model.shape else "")
        head = [*(n.replace("nfe_speedup", "NFE") for n in self.row_names),
                *(f"KV {_kv_label(kv)}" for kv in self.kv_lengths)]
        body = [[*(f"{x:g}" for x in key), *(f"{v:.{digits}f}" for v in vals)]
                for key, vals in zip(self.rows, self.values)]
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
        return "\n".join([title, line(head), "  ".join("-" * w for w in widths),
                          *map(line, body)])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the table, the model, the GPU, the precision and all cells."""
        m = self.model
        return {"table": self.kind, "mode": m.mode, "gpu": dataclasses.asdict(m.gpu),
                "shape": dataclasses.asdict(m.shape) if m.shape else None,
                "precision": dataclasses.asdict(m.precision) if m.mode == "corrected" else None,
                "row_names": list(self.row_names), "kv_lengths": list(self.kv_lengths),
                "rows": [dict(zip(self.row_names, key), values=list(vals))
                         for key, vals in zip(self.rows, self.values)]}

    def plot(self, path: str) -> Path:
        """Cells against KV length, one panel per batch size; needs matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise UnmaskError("plotting needs matplotlib; pip install 'unmask[plot]'") from None
        batches = sorted({key[0] for key in self.rows})
        fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5),
                                 squeeze=False, sharey=True)
        for ax, b in zip(axes[0], batches):
            for key, vals in zip(self.rows, self.values):
                if key[0] == b:
                    label = ", ".join(f"{n}={x:g}" for n, x in zip(self.row_names[1:], key[1:]))
                    ax.plot(self.kv_lengths, vals, marker=".", label=label)
            ax.set(xscale="log", xlabel="KV length", title=f"batch {b:g}")
        axes[0][0].set_ylabel(self.kind)
        axes[0][-1].legend(fontsize="x-small")
        fig.tight_layout()
        try:
            return atomic_savefig(fig, path)
        finally:
            plt.close(fig)


SlowdownTable = SpeedupTable = RooflineTable


def slowdown_table(*, mode: Mode = "paper", shape: ModelShape | str | Mapping | None = None,
                   gpu: GPUSpec | str | None = None, precision: Precision | None = None,
                   blocks: tuple[int, ...] = TABLE3_BLOCKS,
                   batches: tuple[int, ...] = TABLE3_BATCHES,
                   kv_lengths: tuple[int, ...] = TABLE3_KV) -> RooflineTable:
    """SBD Table 3 (slowdown time(k)/time(1)) over the given grid; defaults are the paper's.

    Rows (batch, block) in the paper's order. Arguments as in :func:`roofline`.
    Raises :class:`UnmaskError` on bad arguments.
    """
    model = roofline(mode=mode, shape=shape, gpu=gpu, precision=precision)
    rows = tuple((b, k) for b in batches for k in blocks)
    values = tuple(tuple(model.slowdown(k=k, batch=b, kv_len=kv) for kv in kv_lengths)
                   for b, k in rows)
    return RooflineTable("slowdown", model, ("batch", "block"), rows, tuple(kv_lengths), values)


def speedup_table(*, mode: Mode = "paper", shape: ModelShape | str | Mapping | None = None,
                  gpu: GPUSpec | str | None = None, precision: Precision | None = None,
                  blocks: tuple[int, ...] = TABLE4_BLOCKS,
                  batches: tuple[int, ...] = TABLE4_BATCHES,
                  nfe_speedups: tuple[float, ...] = TABLE4_NFE,
                  kv_lengths: tuple[int, ...] = TABLE3_KV) -> RooflineTable:
    """SBD Table 4 (wall-clock speed-up at a given NFE speed-up) over the given grid.

    The paper's grid is k ∈ {8, 16, 32, 64}, batch ∈ {1, 4, 8}, NFE ∈ {2, 4, 8}; the KV
    lengths default to Table 3's. Rows (batch, block, nfe_speedup). Arguments as in
    :func:`roofline`. Raises :class:`UnmaskError` when an NFE speed-up exceeds its block.
    """
    model = roofline(mode=mode, shape=shape, gpu=gpu, precision=precision)
    rows = tuple((b, k, s) for b in batches for k in blocks for s in nfe_speedups)
    values = tuple(tuple(model.speedup(k=k, nfe_speedup=s, batch=b, kv_len=kv)
                         for kv in kv_lengths) for b, k, s in rows)
    return RooflineTable("speedup", model, ("batch", "block", "nfe_speedup"), rows,
                         tuple(kv_lengths), values)
