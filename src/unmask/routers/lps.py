"""LPS router R_ψ: learnable parallel sampling (spec/early_bird.md §4.1–§4.2, App. D.1).

Input: for each still-masked position of the active block B, five scalars (κ, H̃, Δ, ρ, pos)
(:func:`unmask.decode.dllm.eb_select.lps_features`). The positions of one block form one sequence (in
index order), padded per batch with a key-padding mask; attention is joint over the block.

Architecture (paper sizes in brackets): Linear(5 → d) → LayerNorm → GELU [d = 32]; pre-norm
Transformer blocks with GELU and dropout [2 blocks, 4 heads, FFN 64, dropout 0.1]; Linear(d → 1).
p_ψ = σ(O_ψ) > τ_ψ commits a position even below the confidence threshold.

The features are vocabulary-free, so an LPS router transfers across base models (§4.4).
``pos_mode`` is part of the config because the router must be served with the position feature
it was trained on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from unmask.errors import UnmaskError

POS_MODES = ("literal", "rank")
FEATURE_NAMES = ("confidence", "norm_entropy", "margin", "mask_ratio", "pos")  # LPS input order (§4.1)


@dataclass(frozen=True)
class LPSConfig:
    """Shape of an LPS router. d, layers, heads, ffn, dropout: see the module doc.
    pos_mode: "literal" (i − min B) / |B| or "rank" (our reading #6)."""

    d: int = 32
    layers: int = 2
    heads: int = 4
    ffn: int = 64
    dropout: float = 0.1
    pos_mode: str = "literal"

    def __post_init__(self):
        for name in ("d", "layers", "heads", "ffn"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UnmaskError(f"LPS {name} must be an integer >= 1 (got {v!r})")
        if self.d % self.heads:
            raise UnmaskError(f"LPS width d={self.d} must be divisible by heads={self.heads}")
        if not 0 <= self.dropout < 1:
            raise UnmaskError(f"LPS dropout must be in [0, 1) (got {self.dropout!r})")
        if self.pos_mode not in POS_MODES:
            raise UnmaskError(f"unknown LPS pos_mode {self.pos_mode!r}; choose one of: {', '.join(POS_MODES)}")

    def to_dict(self) -> dict:
        return asdict(self)


class EncoderBlock(nn.Module):
    """One Transformer encoder block with GELU. Pre-norm (LPS): h + Attn(LN(h)), then
    h + FFN(LN(h)). Post-norm (LBS, PyTorch's default layout): LN(h + Attn(h)), then
    LN(h + FFN(h)).

    Written out (rather than ``nn.TransformerEncoderLayer``) so that training and serving run the
    same arithmetic (PyTorch's fused inference path differs in the last bits from its training
    path) and a step costs a handful of small ops; same parameter count as the PyTorch layer."""

    def __init__(self, d: int, heads: int, ffn: int, dropout: float, pre_norm: bool = True):
        super().__init__()
        self.heads, self.dropout, self.pre_norm = heads, dropout, pre_norm
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff1, self.ff2 = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, h: Tensor, keep: Tensor | None = None) -> Tensor:
        """h: (B, N, d); keep: (B, N) bool, the keys each query may attend to (None: all)."""
        if self.pre_norm:
            h = h + self._attend(self.norm1(h), keep)
            return h + self._ffn(self.norm2(h))
        h = self.norm1(h + self._attend(h, keep))
        return self.norm2(h + self._ffn(h))

    def _attend(self, x: Tensor, keep: Tensor | None) -> Tensor:
        B, N, d = x.shape
        p = self.dropout if self.training else 0.0
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # (B, nh, N, hs) each
        mask = None if keep is None else keep[:, None, None, :]  # (B, 1, 1, N)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)  # (B, nh, N, hs)
        return F.dropout(self.out(a.transpose(1, 2).reshape(B, N, d)), p, self.training)  # (B, N, d)

    def _ffn(self, x: Tensor) -> Tensor:
        p = self.dropout if self.training else 0.0
        return F.dropout(self.ff2(F.dropout(F.gelu(self.ff1(x)), p, self.training)), p, self.training)


class LPSRouter(nn.Module):
    """R_ψ (App. D.1). ``forward(features, valid) -> logits``; see the module doc."""

    kind = "lps"
    n_features = len(FEATURE_NAMES)

    def __init__(self, config: LPSConfig = LPSConfig()):
        super().__init__()
        self.config = config
        self.embed = nn.Sequential(nn.Linear(self.n_features, config.d), nn.LayerNorm(config.d), nn.GELU())
        self.blocks = nn.ModuleList(EncoderBlock(config.d, config.heads, config.ffn, config.dropout, pre_norm=True)
                                    for _ in range(config.layers))
        self.head = nn.Linear(config.d, 1)

    def forward(self, features: Tensor, valid: Tensor) -> Tensor:
        """features: (B, N, 5) float in FEATURE_NAMES order; valid: (B, N) bool, False at padding.
        Returns logits O_ψ (B, N) float32, -inf at padding. Padding never influences a real slot."""
        B, N, F = features.shape
        if F != self.n_features:
            raise UnmaskError(f"LPS takes {self.n_features} features per position {FEATURE_NAMES}, got {F}")
        # A row with no real slot would attend to nothing (NaN); let it see its first slot, then drop it.
        keep = valid.clone()
        keep[:, 0] |= ~valid.any(dim=1)
        h = self.embed(features.to(self.head.weight.dtype))  # (B, N, d)
        for block in self.blocks:
            h = block(h, keep)  # (B, N, d)
        logits = self.head(h)[..., 0].float()  # (B, N)
        return logits.masked_fill(~valid, float("-inf"))

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
