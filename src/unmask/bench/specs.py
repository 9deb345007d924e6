"""What the roofline model (:mod:`unmask.bench.roofline`, SBD §4) is evaluated on: a GPU's peaks and
bandwidth (:class:`GPUSpec`), the bytes per weight, KV entry and activation (:class:`Precision`) and a
transformer's sizes (:class:`ModelShape`), each with named presets.

Units: FLOP/s, bytes/s and bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from unmask.errors import UnmaskError


def _preset(table: Mapping[str, Any], name: str, what: str) -> Any:
    if name not in table:
        raise UnmaskError(f"unknown {what} {name!r}; choose one of: {', '.join(sorted(table))}")
    return table[name]


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf


@dataclass(frozen=True)
class GPUSpec:
    """Peak throughputs of one accelerator.

    ``linear_flops`` is the dense peak for the weight GEMMs (FLOP/s), ``attention_flops`` the
    dense peak for attention (FLOP/s), ``bandwidth`` the memory bandwidth in **bytes/s**.
    """

    name: str
    linear_flops: float
    attention_flops: float
    bandwidth: float
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("linear_flops", "attention_flops", "bandwidth"):
            if not _positive(getattr(self, field)):
                raise UnmaskError(f"GPUSpec {self.name!r}: {field} must be a finite number > 0 "
                                  f"(got {getattr(self, field)!r}); give FLOP/s and bytes/s, e.g. 1e15")

    @classmethod
    def preset(cls, name: str) -> "GPUSpec":
        """Return a preset from :data:`GPU_PRESETS`; raise :class:`UnmaskError` if unknown."""
        return _preset(GPU_PRESETS, name, "GPU preset")


GPU_PRESETS: dict[str, GPUSpec] = {
    # SBD Fig. 6 as printed. 3.35 × 1024^4 is TiB/s, ~10% above the datasheet's decimal TB/s.
    "h100-sxm-paper": GPUSpec("h100-sxm-paper", 1978e12, 989e12, 3.35 * 1024**4,
                              "SBD Fig. 6 constants, as printed"),
    "h100-sxm": GPUSpec("h100-sxm", 1979e12, 989e12, 3.35e12,
                        "datasheet (unverified): FP8 dense, BF16 dense, 3.35 TB/s HBM3"),
    "h200": GPUSpec("h200", 1979e12, 989e12, 4.8e12,
                    "datasheet (unverified): FP8 dense, BF16 dense, 4.8 TB/s HBM3e"),
    # The A100 has no FP8 tensor cores: FP8-stored weights are multiplied in BF16, so the
    # linear peak is the BF16 dense peak too (our choice; INT8 would need integer kernels).
    "a100": GPUSpec("a100", 312e12, 312e12, 2.039e12,
                    "datasheet (unverified): A100 SXM 80GB, BF16 dense for both, 2.039 TB/s"),
}


@dataclass(frozen=True)
class Precision:
    """Bytes per element of weights, KV cache and activations (default 1/1/2, *our choice*:
    FP8 weights and KV cache, BF16 activations)."""

    weight: float = 1.0
    kv: float = 1.0
    act: float = 2.0

    def __post_init__(self) -> None:
        if not all(_positive(v) for v in (self.weight, self.kv, self.act)):
            raise UnmaskError(f"bytes per element must be finite numbers > 0, got weight={self.weight!r} "
                              f"kv={self.kv!r} act={self.act!r}; use e.g. 1 for FP8, 2 for BF16")


@dataclass(frozen=True)
class ModelShape:
    """Decoder-only transformer shape, as read from a Hugging Face config (SBD spec §7.5)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    gated_mlp: bool = True

    def __post_init__(self) -> None:
        for field in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab"):
            if int(getattr(self, field)) <= 0:
                raise UnmaskError(f"ModelShape {self.name!r}: {field} must be > 0")
        if self.heads % self.kv_heads:
            raise UnmaskError(f"ModelShape {self.name!r}: heads ({self.heads}) must be a "
                              f"multiple of kv_heads ({self.kv_heads})")

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        """Return a preset from :data:`MODEL_PRESETS`; raise :class:`UnmaskError` if unknown."""
        return _preset(MODEL_PRESETS, name, "model shape")

    @classmethod
    def from_config(cls, config: Any, *, name: str | None = None) -> "ModelShape":
        """Build from a ``transformers`` config object or a ``config.json`` dict.

        Reads ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads`` (default: heads), ``head_dim``
        (default: hidden / heads), ``vocab_size`` and ``tie_word_embeddings``. A nested
        ``text_config`` is used when present. The MLP counts as gated (3 matrices, as in
        Llama/Qwen) unless the config says ``gated_mlp: false`` or is a GPT-2/NeoX/OPT family.
        """
        if not (hasattr(config, "to_dict") or isinstance(config, Mapping)):
            raise UnmaskError(f"a model config must be a JSON object (got {type(config).__name__}); "
                              "pass a Hugging Face config.json")
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        if isinstance(cfg.get("text_config"), Mapping):
            cfg = {**cfg, **cfg["text_config"]}
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "vocab_size") if cfg.get(k) is None]
        if missing:
            raise UnmaskError(f"config lacks {', '.join(missing)}; cannot build a ModelShape")
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                  "num_key_value_heads", "head_dim"):
            if cfg.get(k) is not None and (isinstance(cfg[k], bool) or not isinstance(cfg[k], int)):
                raise UnmaskError(f"config field {k} must be an integer (got {cfg[k]!r}); fix the config.json")
        heads = int(cfg["num_attention_heads"])
        if heads <= 0:
            raise UnmaskError(f"config field num_attention_heads must be > 0 (got {heads}); fix the config.json")
        ungated = cfg.get("model_type") in {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon"}
        return cls(
            name=name or cfg.get("_name_or_path") or cfg.get("model_type") or "custom",
            hidden=int(cfg["hidden_size"]),
            intermediate=int(cfg["intermediate_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            gated_mlp=bool(cfg.get("gated_mlp", not ungated)),
        )

    @property
    def n_params(self) -> int:
        """Parameter count of the matrices (norms ignored)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attn + mlp) + emb


MODEL_PRESETS: dict[str, ModelShape] = {
    # meta-llama/Llama-3.1-8B config.json.
    "llama-3.1-8b": ModelShape("llama-3.1-8b", hidden=4096, intermediate=14336, layers=32,
                               heads=32, kv_heads=8, head_dim=128, vocab=128256, tied=False),
}
