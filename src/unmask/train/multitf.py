"""MultiTF post-training of block-diffusion LMs (multiblock.md §4; MBD-LMs §3.2, App. B).

MultiTF trains a TF model to decode several blocks at once, the way the Block Buffer runs them:
a *noise group* of consecutive blocks plays a running set. Each block of a group sees the clean
prefix before the group plus the **noisy** copies of the group's earlier blocks (block-causal
inside the group), and the group's noise ratios rise from slot to slot with large random gaps, as
observed at inference (the front slot nearly done, the next nearly empty).

Pieces (pure, except for the explicit generator):

- layouts (§4.1): :func:`systematic_layouts` (every group size 2..G_max at every shift, so every
  run of g consecutive blocks is exactly one group once per size) and :func:`random_layout`
  (sizes ~ U{2..G_max} until the blocks are covered, with the released code's fix-ups);
- the chain-uniform scheduler (§4.2): :class:`ChainUniform`, :func:`chain_uniform_ratios`;
- the group-aware dual-stream mask (§4.3): :func:`unmask.masks_multitf.group_dual_stream_mask`;
- the objective (§4.4): :class:`MultiTFObjective`, every clean row expanded into one training row
  per layout; ``loss="ce"`` (default, eq. 3.4) averages the masked CE over all masked positions,
  ``loss="ipw"`` is the released SDAR code's self-normalised 1/p-weighted mean (p = the block's
  noise ratio), the loss the SDAR rows of Table 5 ran with.

:func:`train_multitf` post-trains a block-diffusion checkpoint and publishes the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.train.wiring import holds_output_locks
from unmask.train.block_diffusion import fit, load_base
from unmask.train.dual_stream import (LOSSES, ROUNDINGS, check_layout, check_ratio_range, dual_stream_inputs, ipw_weights,
                                      mask_by_ratio, masked_ce_loss, maskable_positions, row_tokens)

# (G_max, N_rand) of the released configurations (multiblock.md §4.1 "Totals", Table 5). Each is
# decoded with N_buf = G_max slots (Table 1: LLaDA2 (2, 32), SDAR (4, ·)).
PRESETS = {"llada2": (2, 0), "llada2-dmax-code": (2, 2), "sdar-b32": (4, 3), "sdar-b4": (4, 2)}


# ---------------------------------------------------------------------------------------------
# Layouts (§4.1)
# ---------------------------------------------------------------------------------------------


def _check_sizes(K: int, g_max: int) -> None:
    if not isinstance(K, int) or isinstance(K, bool) or K < 1:
        raise UnmaskError(f"the number of blocks K must be an integer >= 1, got {K!r}; pass K >= 1")
    if not isinstance(g_max, int) or isinstance(g_max, bool) or g_max < 2:
        raise UnmaskError(f"G_max (--g-max) must be an integer >= 2 (a group of 1 is plain TF), got {g_max!r}; "
                          "pass --g-max 2 or more")


def systematic_layouts(K: int, g_max: int) -> list[tuple[int, ...]]:
    """The shifted layouts of App. B.1 as group sizes, in order g = 2..G_max, h = 0..g-1.

    Layout (g, h): a first group of h blocks when h > 0, then groups of g, the last one
    truncated (so the sizes sum to K). (G_max+2)(G_max-1)/2 layouts; for a small K some repeat.
    Coverage: for every g and every run of blocks a..a+g-1 inside 0..K-1, the layout
    (g, a mod g) has exactly that run as a group.
    """
    _check_sizes(K, g_max)
    layouts = []
    for g in range(2, g_max + 1):
        for h in range(g):
            sizes = [min(h, K)] if h > 0 else []
            left = K - sum(sizes)
            while left > 0:
                sizes.append(min(g, left))
                left -= sizes[-1]
            layouts.append(tuple(sizes))
    return layouts


def random_layout(K: int, g_max: int, generator: torch.Generator, *, code_fixups: bool = True) -> tuple[int, ...]:
    """One random layout of K blocks as group sizes (multiblock.md §4.1).

    Paper: draw g ~ U{2..G_max} until the blocks are covered, truncating the last group.
    ``code_fixups`` (default, the released ``_sample_active_buffer_sizes``): a truncated last
    group of size 1 with G_max >= 3 is instead absorbed by the first group smaller than G_max, or
    else splits the first group of size >= 3 into (s - 1) and a new group of 2 (else it stays a
    singleton); the sizes are then randomly permuted.
    """
    _check_sizes(K, g_max)

    def draw(n: int) -> int:
        return int(torch.randint(n, (1,), generator=generator))

    sizes: list[int] = []
    left = K
    while left > 0:
        g = 2 + draw(g_max - 1)  # U{2..G_max}
        if g < left:
            sizes.append(g)
            left -= g
            continue
        if left == 1 and code_fixups and g_max >= 3 and sizes:
            grow = next((i for i, s in enumerate(sizes) if s < g_max), None)
            split = next((i for i, s in enumerate(sizes) if s >= 3), None)
            if grow is not None:
                sizes[grow] += 1
            elif split is not None:
                sizes[split] -= 1
                sizes.append(2)
            else:
                sizes.append(1)
        else:
            sizes.append(left)
        left = 0
    if code_fixups:
        sizes = [sizes[i] for i in torch.randperm(len(sizes), generator=generator).tolist()]
    return tuple(sizes)


def group_ids(sizes: tuple[int, ...] | list[int]) -> torch.Tensor:
    """Group sizes -> (K,) long group id of every block (0, 0, 1, 1, 1, 2, ...)."""
    if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise UnmaskError(f"group sizes must be positive integers, got {sizes!r}; pass sizes >= 1")
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))  # (K,)


# ---------------------------------------------------------------------------------------------
# Chain-uniform noise scheduler (§4.2, Alg. 1, eqs. B.3–B.4)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainUniform:
    """t_eff = t_high - ρ·(t_high - t_low); released values t_low 0.001, t_high 1.0, ρ 0.01
    (t_eff ≈ 0.99001). ``chain_over_prompt``: prompt blocks inside a group consume chain draws
    (the released code; they are never masked, but later blocks start from a raised floor)."""

    t_low: float = 0.001
    t_high: float = 1.0
    rho: float = 0.01
    chain_over_prompt: bool = True

    def __post_init__(self):
        check_ratio_range(self.t_low, self.t_high)
        if not 0.0 <= self.rho <= 1.0:
            raise UnmaskError(f"--rho must be in [0, 1], got {self.rho}; pass a value between 0 and 1")

    @property
    def t_eff(self) -> float:
        return self.t_high - self.rho * (self.t_high - self.t_low)


def chain_uniform_ratios(block_group: torch.Tensor, scheduler: ChainUniform, generator: torch.Generator,
                         chained: torch.Tensor | None = None) -> torch.Tensor:
    """Noise ratio of every block of one layout (Alg. 1).

    For each group (j_1..j_n) in slot order: floor ℓ ~ U(t_low, t_eff); then for i = 1..n,
    t_{j_i} ~ U(ℓ, t_eff) and ℓ ← t_{j_i}. Ratios are non-decreasing within a group and every
    group restarts from a fresh floor.

    Args:
        block_group: (K,) group ids, non-decreasing.
        chained: (K,) bool, blocks that take part in the chain (default all). Blocks left out
            (prompt blocks when ``chain_over_prompt`` is False) get ratio 0 and consume no draw.

    Returns:
        (K,) float32 in [t_low, t_eff] for chained blocks.
    """
    if block_group.dim() != 1:
        raise UnmaskError(f"block_group must be (K,), got {tuple(block_group.shape)}; pass one group id per block")
    K = block_group.shape[0]
    lo, hi = scheduler.t_low, scheduler.t_eff
    on = [True] * K if chained is None else chained.tolist()
    u = torch.rand(2 * K, generator=generator, dtype=torch.float64).tolist()  # at most K floors + K steps
    out = [0.0] * K
    groups = block_group.tolist()
    level = lo
    for k in range(K):
        if k == 0 or groups[k] != groups[k - 1]:  # a new group: a fresh floor ℓ ~ U(t_low, t_eff)
            level = lo + (hi - lo) * u[2 * k]
        if not on[k]:
            continue
        level = level + (hi - level) * u[2 * k + 1]  # t ~ U(ℓ, t_eff), then ℓ ← t
        out[k] = level
    return torch.tensor(out, dtype=torch.float32)  # (K,)


# ---------------------------------------------------------------------------------------------
# Objective (§4.4)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultiTFObjective:
    """MultiTF masked CE (multiblock.md §4.4, eq. 3.4) for :func:`unmask.train.loop.train`.

    Every clean row becomes one training row per layout: the (G_max+2)(G_max-1)/2 systematic
    layouts plus ``n_rand`` fresh random ones (|Λ| rows, §4.1), each with its own chain-uniform
    noise and group-aware mask. ``layouts_per_row`` > 0 keeps a uniformly drawn subset of that
    many of them per row (our option to bound compute; 0 = all, the paper). Blocks with no
    maskable position (a prompt longer than a block) are not group-aware (§4.3 code-only rule).
    rounding / prompt_len: as :class:`unmask.train.block_diffusion.TFObjective` (``floor``, the
    default and the released rule, never masks a whole block since t <= t_eff < 1).
    loss_type: ``ce`` (eq. 3.4) or ``ipw`` (Σ ℓ/t_k / Σ 1/t_k over the masked positions,
    :func:`unmask.train.block_diffusion.weighted_mean_nll`).
    """

    mask_token_id: int
    block_size: int
    g_max: int = 4
    n_rand: int = 2
    scheduler: ChainUniform = ChainUniform()
    rounding: str = "floor"
    prompt_len: int = 1
    code_fixups: bool = True
    layouts_per_row: int = 0
    loss_type: str = "ce"
    name: str = "multitf"
    term_names: tuple[str, ...] = ("mat", "acc")

    def __post_init__(self):
        check_layout(self.block_size, self.prompt_len, self.mask_token_id, self.rounding)
        _check_sizes(1, self.g_max)
        if not isinstance(self.n_rand, int) or self.n_rand < 0:
            raise UnmaskError(f"--n-rand must be an integer >= 0, got {self.n_rand!r}; pass --n-rand 0 or more")
        if not isinstance(self.layouts_per_row, int) or not 0 <= self.layouts_per_row <= self.n_layouts:
            raise UnmaskError(f"--layouts-per-row must be in 0..{self.n_layouts} (0 = all), got "
                              f"{self.layouts_per_row!r}; pass a value in that range")
        if self.loss_type not in LOSSES:
            raise UnmaskError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss_type!r}; "
                              f"pass --loss {LOSSES[0]} or --loss {LOSSES[1]}")

    @classmethod
    def preset(cls, name: str, **fields) -> "MultiTFObjective":
        """G_max and N_rand of a released configuration (``PRESETS``); other fields as given."""
        if name not in PRESETS:
            raise UnmaskError(f"unknown MultiTF preset {name!r}; choose one of {', '.join(PRESETS)}")
        g_max, n_rand = PRESETS[name]
        return cls(g_max=g_max, n_rand=n_rand, **fields)

    @property
    def n_layouts(self) -> int:
        """|Λ| = (G_max+2)(G_max-1)/2 + N_rand."""
        return (self.g_max + 2) * (self.g_max - 1) // 2 + self.n_rand

    def step_params(self, generator: torch.Generator) -> dict:
        return {}

    def layouts(self, K: int, generator: torch.Generator) -> list[tuple[int, ...]]:
        """The |Λ| layouts of one clean row (or the kept subset), as group sizes."""
        out = systematic_layouts(K, self.g_max)
        out += [random_layout(K, self.g_max, generator, code_fixups=self.code_fixups) for _ in range(self.n_rand)]
        if self.layouts_per_row:
            keep = torch.randperm(len(out), generator=generator)[: self.layouts_per_row].sort().values
            out = [out[i] for i in keep.tolist()]
        return out

    def batch(self, chunks: torch.Tensor, generator: torch.Generator) -> dict:
        """chunks (R, L+1) -> the dual-stream batch of R·n rows (n layouts per clean row), with
        ``attention`` (R·n, 2L, 2L) bool, ``groups`` / ``ratios`` (R·n, K) and ``row`` (R·n,),
        the clean row each training row comes from."""
        from unmask.masks_multitf import group_dual_stream_mask

        tokens = row_tokens(chunks, self.block_size, self.prompt_len)  # (R, L)
        R, L = tokens.shape
        B = self.block_size
        K = L // B
        maskable = maskable_positions(L, self.prompt_len)  # (L,)
        has_masks = maskable.view(K, B).any(dim=-1)  # (K,) response blocks
        chained = None if self.scheduler.chain_over_prompt else has_masks
        groups, ratios, rows = [], [], []
        for r in range(R):
            for sizes in self.layouts(K, generator):
                g = group_ids(sizes)  # (K,)
                groups.append(g)
                ratios.append(chain_uniform_ratios(g, self.scheduler, generator, chained))
                rows.append(r)
        groups_t = torch.stack(groups)  # (R·n, K)
        ratios_t = torch.stack(ratios)  # (R·n, K)
        rows_t = torch.tensor(rows, dtype=torch.long)  # (R·n,)
        N = len(rows)
        noise = mask_by_ratio(maskable.expand(N, L), ratios_t, B, generator, self.rounding)  # (R·n, L)
        device = tokens.device
        batch = dual_stream_inputs(tokens[rows_t.to(device)], noise.to(device), self.mask_token_id)
        batch["attention"] = group_dual_stream_mask(groups_t.to(device), B, group_aware=has_masks.to(device))
        batch.update(groups=groups_t, ratios=ratios_t, row=rows_t)
        return batch

    def loss(self, model, chunks: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        batch = self.batch(chunks, generator)
        weights = ipw_weights(batch["ratios"], self.block_size) if self.loss_type == "ipw" else None  # (R·n, L)
        return masked_ce_loss(model, batch, self.mask_token_id, weights)


@holds_output_locks
def train_multitf(*, base: str, data, out: str | Path, run_dir: str | Path | None = None, seq_len: int = 256,
                  g_max: int = 4, n_rand: int = 2, t_low: float = 0.001, t_high: float = 1.0, rho: float = 0.01,
                  chain_over_prompt: bool = True, rounding: str = "floor", prompt_len: int = 1,
                  layouts_per_row: int = 0, loss: str = "ce", preset: str | None = None,
                  val_fraction: float = 0.05, resume: bool = False,
                  overwrite: bool = False, device: str = "cpu", dtype: str = "float32", progress: bool = True,
                  **config):
    """MultiTF post-training of a block-diffusion model (multiblock.md §4); publishes ``out``.

    Args:
        base: shipped name or local directory of a block-diffusion model (e.g. ``stories260K-bd``);
            its mask token and block size are kept.
        data: ``.txt`` / ``.jsonl`` files. seq_len: L, a multiple of the block size.
        g_max, n_rand: layouts (§4.1). preset: a name of ``PRESETS`` (``llada2``: G_max 2,
            N_rand 0, decode with ``--slots 2``; ``sdar-b4``: 4 / 2, ``--slots 4``), which
            overrides g_max and n_rand. t_low, t_high, rho, chain_over_prompt: the scheduler
            (§4.2). rounding, prompt_len, layouts_per_row: see :class:`MultiTFObjective`.
            loss: ``ce`` or ``ipw`` (``MultiTFObjective.loss_type``).
        run_dir, resume, overwrite, device, dtype, progress, **config: as
            :func:`unmask.train.block_diffusion.train_block_diffusion`.

    Returns:
        TrainResult with ``out`` set (None when interrupted). The published ``unmask_config.json``
        records ``train_g_max``: decode with ``--slots`` at most that (§3.1).

    Raises:
        UnmaskError: a base that is not block-diffusion, bad data or options, a g_max above the
            blocks per row (seq_len / B).
    """
    from unmask.train.wiring import run_paths

    run_paths(data, out, run_dir, resume=resume, overwrite=overwrite, base=base)  # paths, locks before the base
    scheduler = ChainUniform(t_low=t_low, t_high=t_high, rho=rho, chain_over_prompt=chain_over_prompt)
    if preset is not None:
        if preset not in PRESETS:
            raise UnmaskError(f"unknown --preset {preset!r}; choose one of {', '.join(PRESETS)}")
        g_max, n_rand = PRESETS[preset]
    if loss not in LOSSES:
        raise UnmaskError(f"--loss must be one of {', '.join(LOSSES)}, got {loss!r}; "
                          f"pass --loss {LOSSES[0]} or --loss {LOSSES[1]}")
    if rounding not in ROUNDINGS:
        raise UnmaskError(f"--rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}; "
                          f"pass --rounding {ROUNDINGS[0]} or --rounding {ROUNDINGS[1]}")
    bundle, mask_id, B = load_base(base, dtype, block_size=None, allow_causal=False)
    objective = MultiTFObjective(mask_token_id=mask_id, block_size=B, g_max=g_max, n_rand=n_rand, scheduler=scheduler,
                                 rounding=rounding, prompt_len=prompt_len, layouts_per_row=layouts_per_row,
                                 loss_type=loss)
    K = seq_len // B if isinstance(seq_len, int) and seq_len >= B and seq_len % B == 0 else None
    if K is not None and g_max > K:  # a group larger than a row would never occur (fit checks the seq_len itself)
        lower = f", or lower --g-max to {K}" if K >= 2 else ""
        raise UnmaskError(f"--g-max {g_max} exceeds the {K} blocks per row (--seq-len {seq_len} / block size {B}); "
                          f"raise --seq-len to {g_max * B} or more{lower}")
    meta = {"kind": "block-diffusion", "block_size": B, "mask_token_id": mask_id, "train_g_max": g_max}
    what = "CE" if loss == "ce" else "self-normalised IPW CE"
    return fit(bundle=bundle, objective=objective, base=base, data=data, out=out, run_dir=run_dir, seq_len=seq_len,
               val_fraction=val_fraction, resume=resume, overwrite=overwrite, device=device, progress=progress,
               config=config, meta=meta, describe=f"MultiTF: group-aware dual-stream masked {what} (multiblock.md §4)")
