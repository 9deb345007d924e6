"""LBS router R_φ: learnable block size (spec/early_bird.md §3.1–§3.3, App. C.1).

For every slot i of the generation region (length L) the router reads the normalised entropy H̃^i
and the frozen base-model embedding of the top-1 token x̂^i, both zeroed where i is not masked
(scatter to the absolute index, our reading #2), and returns a logit O_φ^i; p_φ = σ(O_φ) > 0.5
proposes i for the next active block (filters: :mod:`unmask.decode.dllm.eb_select`).

Architecture, with the paper's sizes in brackets (d = 128):

- entropy branch Linear(1 → d/2) → GELU → Linear(d/2 → d/2) → LayerNorm        [64]
- token branch W_tok · W_e(x̂), W_tok ∈ R^{d/2 × d_base}, no bias; W_e stays outside the router
  (the caller embeds x̂ with the base model's frozen input embedding)             [64 × 4096]
- fusion Z = W_combine [f_ent ; f_tok] + E_pos, W_combine d × d, E_pos ∈ R^{L × d} learnable
- post-norm Transformer encoder blocks (PyTorch's default layout, written out:
  :class:`unmask.routers.lps.EncoderBlock`), GELU, no key-padding mask    [2 layers, 4 heads, FFN 256]
- head Linear(d → 1)

E_pos ties the router to its training L (use it only at that L), and W_tok to the base model's
embedding width; the vocabulary check lives in :mod:`unmask.routers.io`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from unmask.errors import UnmaskError
from unmask.routers.lps import EncoderBlock


@dataclass(frozen=True)
class LBSConfig:
    """Shape of an LBS router.

    gen_length: L, the generation length it works at (rows of E_pos). d_base: width of the base
    model's input embedding. vocab_size: the base model's vocabulary (checked when loading).
    d: fusion / encoder width (paper 128; even). layers, heads, ffn: the encoder (paper 2, 4, 256).
    dropout: encoder dropout while training (PyTorch's default 0.1).
    """

    gen_length: int
    d_base: int
    vocab_size: int
    d: int = 32
    layers: int = 1
    heads: int = 4
    ffn: int = 64
    dropout: float = 0.1

    def __post_init__(self):
        for name in ("gen_length", "d_base", "vocab_size", "d", "layers", "heads", "ffn"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UnmaskError(f"LBS {name} must be an integer >= 1 (got {v!r})")
        if self.d % 2 or self.d % self.heads:
            raise UnmaskError(f"LBS width d={self.d} must be even and divisible by heads={self.heads}")
        if not 0 <= self.dropout < 1:
            raise UnmaskError(f"LBS dropout must be in [0, 1) (got {self.dropout!r})")

    def to_dict(self) -> dict:
        return asdict(self)


class LBSRouter(nn.Module):
    """R_φ (App. C.1). ``forward(norm_entropy, token_emb, masked) -> logits``; see the module doc."""

    kind = "lbs"

    def __init__(self, config: LBSConfig):
        super().__init__()
        self.config = config
        half = config.d // 2
        self.entropy = nn.Sequential(nn.Linear(1, half), nn.GELU(), nn.Linear(half, half), nn.LayerNorm(half))
        self.token = nn.Linear(config.d_base, half, bias=False)
        self.combine = nn.Linear(config.d, config.d)
        self.pos = nn.Parameter(torch.randn(config.gen_length, config.d) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(config.d, config.heads, config.ffn, config.dropout, pre_norm=False)
                                    for _ in range(config.layers))
        self.head = nn.Linear(config.d, 1)

    def forward(self, norm_entropy: Tensor, token_emb: Tensor, masked: Tensor) -> Tensor:
        """norm_entropy: (B, L) float, H / log|V|. token_emb: (B, L, d_base) float, W_e(x̂).
        masked: (B, L) bool. Returns logits O_φ (B, L) float32, -inf where not masked.
        Raises UnmaskError when L is not the router's gen_length."""
        B, L = masked.shape
        if L != self.config.gen_length:
            raise UnmaskError(f"this LBS router was trained for gen length {self.config.gen_length}, got {L}; "
                              f"decode with --gen-length {self.config.gen_length} or train LBS for {L}")
        keep = masked[..., None].float()  # (B, L, 1): zero features at non-masked slots
        dtype = self.pos.dtype
        f_ent = self.entropy(norm_entropy.to(dtype)[..., None]) * keep  # (B, L, d/2)
        f_tok = self.token(token_emb.to(dtype)) * keep  # (B, L, d/2)
        z = self.combine(torch.cat([f_ent, f_tok], dim=-1)) + self.pos[None]  # (B, L, d)
        for block in self.blocks:
            z = block(z)  # (B, L, d): all L slots attend (no key-padding mask, reading #2)
        logits = self.head(z)[..., 0].float()  # (B, L)
        return logits.masked_fill(~masked, float("-inf"))

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
