"""MultiTF recipe options (issue 29 item 1): floor rounding by default, all layouts per row, the
SDAR code's self-normalised IPW loss, and the LLaDA2 / SDAR presets, in the library, the CLI and
recipes/stories260K_mbd.py."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import SMALL_RUN, ids_file, run_cli, tiny_llama, with_mask_row
from unmask.errors import UnmaskError
from unmask.train.block_diffusion import IGNORE, ipw_weights, masked_ce_loss, weighted_mean_nll
from unmask.train.multitf import PRESETS, MultiTFObjective, systematic_layouts

VOCAB, MASK = 64, 64
RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def _recipe():
    sys.path.insert(0, str(RECIPES))  # the recipe imports its sibling stories260K_bd
    spec = importlib.util.spec_from_file_location("stories260K_mbd_under_test", RECIPES / "stories260K_mbd.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _objective(args, B: int = 8) -> MultiTFObjective:
    return MultiTFObjective(mask_token_id=MASK, block_size=B, g_max=args.g_max, n_rand=args.n_rand,
                            rounding=args.rounding, layouts_per_row=args.layouts_per_row, loss_type=args.loss)


# ---------------------------------------------------------------------------------------------
# Rounding: floor (the released rule) never masks a whole block
# ---------------------------------------------------------------------------------------------


def test_floor_is_the_default_and_never_masks_a_whole_block():
    B, L = 8, 8 * 12
    obj = MultiTFObjective(mask_token_id=MASK, block_size=B, g_max=4, n_rand=2)  # library default: floor
    assert obj.rounding == "floor"
    chunks = torch.randint(3, VOCAB, (40, L + 1), generator=torch.Generator().manual_seed(0))
    b = obj.batch(chunks, torch.Generator().manual_seed(1))
    per_block = b["noise_mask"].view(b["noise_mask"].shape[0], L // B, B).sum(-1)  # (N, K)
    assert int(per_block.max()) == B - 1  # t_eff ≈ 0.99 < 1: floor(8 t) <= 7, and 7 does occur
    # the contrast the spec describes: stochastic rounding fully masks blocks
    stoch = MultiTFObjective(mask_token_id=MASK, block_size=B, g_max=4, n_rand=2, rounding="stochastic")
    bs = stoch.batch(chunks, torch.Generator().manual_seed(1))
    assert int(bs["noise_mask"].view(-1, L // B, B).sum(-1).eq(B).sum()) > 0


def test_recipe_defaults_rebuild_the_shipped_checkpoint():
    """The recipe's defaults are the objective and schedule recorded in the shipped stories260K-mbd
    (issue 29 run c: the official recipe at G_max 2, floor, all layouts)."""
    import unmask

    shipped = json.loads((unmask.load("stories260K-mbd").path / "unmask_config.json").read_text())
    cfg = shipped["training"]["objective_config"]
    args = _recipe().parse_args([])
    assert (args.rounding, args.layouts_per_row, args.g_max, args.n_rand) == (
        cfg["rounding"], cfg["layouts_per_row"], cfg["g_max"], cfg["n_rand"])
    train = shipped["training"]["config"]
    assert args.loss == cfg["loss_type"] and (args.lr, args.steps, args.batch_size) == (
        train["lr"], train["steps"], train["batch_size"])
    assert (args.rounding, shipped["train_g_max"]) == ("floor", 2)
    assert _recipe().parse_args(["--smoke"]).steps == 20 and _recipe().parse_args(["--steps", "0"]).steps == 0
    sdar = _recipe().parse_args(["--preset", "sdar-b4"])
    assert _objective(sdar).rounding == "floor" and _objective(sdar).n_layouts == 11


# ---------------------------------------------------------------------------------------------
# The self-normalised IPW loss
# ---------------------------------------------------------------------------------------------


def test_ipw_formula_on_a_hand_computed_batch():
    token_nll = torch.tensor([[9.0, 1.0, 2.0, 3.0], [4.0, 9.0, 6.0, 9.0]])  # (R=2, L=4), 9 = not masked
    valid = torch.tensor([[False, True, True, True], [True, False, True, False]])
    ratios = torch.tensor([[0.5, 0.25], [0.1, 0.0]])  # (R, K=2), B = 2; 0 clamps to 1e-3
    w = ipw_weights(ratios, 2)
    assert torch.allclose(w, torch.tensor([[2.0, 2.0, 4.0, 4.0], [10.0, 10.0, 1000.0, 1000.0]]))
    # by hand: (2·1 + 4·2 + 4·3 + 10·4 + 1000·6) / (2 + 4 + 4 + 10 + 1000) = 6062 / 1020
    assert math.isclose(float(weighted_mean_nll(token_nll, valid, w)), 6062 / 1020, rel_tol=1e-6)
    assert math.isclose(float(weighted_mean_nll(token_nll, valid, None)), 16 / 5, rel_tol=1e-6)  # plain CE mean
    assert float(weighted_mean_nll(token_nll, torch.zeros_like(valid), w)) == 0.0


def test_multitf_ipw_loss_is_the_formula_on_its_batch():
    model = with_mask_row(tiny_llama(vocab=VOCAB, seed=0))
    B, L = 4, 24
    chunks = torch.randint(3, VOCAB, (2, L + 1), generator=torch.Generator().manual_seed(0))
    ce = MultiTFObjective(mask_token_id=MASK, block_size=B, g_max=3, n_rand=1)
    ipw = MultiTFObjective(mask_token_id=MASK, block_size=B, g_max=3, n_rand=1, loss_type="ipw")
    batch = ipw.batch(chunks, torch.Generator().manual_seed(5))
    with torch.no_grad():
        loss, terms = ipw.loss(model, chunks, torch.Generator().manual_seed(5))
        ce_loss, ce_terms = ce.loss(model, chunks, torch.Generator().manual_seed(5))
        from unmask.compat import attention_mask, forward
        from unmask.masks import as_4d

        N = batch["labels"].shape[0]
        logits = forward(model, batch["input_ids"], position_ids=batch["position_ids"],
                         attention_mask=attention_mask(model, as_4d(batch["attention"], N)),
                         logits_to_keep=torch.arange(L))  # (N, L, V)
        logits[..., MASK] = float("-inf")
        labels = batch["labels"]
        valid = labels != IGNORE
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1),
                              reduction="none").view(N, L)  # (N, L)
        t = batch["ratios"].repeat_interleave(B, dim=-1).clamp(min=1e-3)  # (N, L) the block's p_mask
        expected = (nll[valid] / t[valid]).sum() / (1 / t[valid]).sum()
    assert torch.allclose(loss, expected, rtol=1e-5)
    assert torch.allclose(terms["nll"], nll[valid].mean(), rtol=1e-5)  # the unweighted mean alongside
    assert torch.allclose(ce_loss, nll[valid].mean(), rtol=1e-5) and not torch.allclose(loss, ce_loss)
    with pytest.raises(UnmaskError, match="--loss"):
        MultiTFObjective(mask_token_id=MASK, block_size=B, loss_type="1/t")


# ---------------------------------------------------------------------------------------------
# All layouts per row (the official recipe) vs a sampled subset
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["llada2", "sdar-b4"])
def test_all_layouts_rows_cover_every_layout(preset):
    g_max, n_rand = PRESETS[preset]
    B, K, R = 2, 9, 3
    obj = MultiTFObjective.preset(preset, mask_token_id=MASK, block_size=B)
    chunks = torch.randint(3, VOCAB, (R, K * B + 1), generator=torch.Generator().manual_seed(0))
    b = obj.batch(chunks, torch.Generator().manual_seed(2))
    n = obj.n_layouts
    assert b["input_ids"].shape[0] == R * n and b["row"].tolist() == [r for r in range(R) for _ in range(n)]
    for r in range(R):
        rows = [i for i in range(R * n) if int(b["row"][i]) == r]
        sizes = [tuple(torch.unique_consecutive(b["groups"][i], return_counts=True)[1].tolist()) for i in rows]
        assert sizes[: len(sizes) - n_rand] == systematic_layouts(K, g_max)
        runs = {(a, a + g) for g in range(2, g_max + 1) for a in range(K - g + 1)}
        for a, e in runs:  # every run of g consecutive blocks is one whole group in some row of r
            assert any(len(set(b["groups"][i, a:e].tolist())) == 1
                       and (a == 0 or b["groups"][i, a - 1] != b["groups"][i, a])
                       and (e == K or b["groups"][i, e] != b["groups"][i, e - 1]) for i in rows), (a, e)
    sub = MultiTFObjective.preset(preset, mask_token_id=MASK, block_size=B, layouts_per_row=1)
    assert sub.batch(chunks, torch.Generator().manual_seed(2))["input_ids"].shape[0] == R


def test_recipe_presets_and_options():
    recipe = _recipe()
    args = recipe.parse_args(["--preset", "llada2", "--layouts-per-row", "0", "--loss", "ipw"])
    assert (args.g_max, args.n_rand, args.layouts_per_row, args.loss) == (2, 0, 0, "ipw")
    assert _objective(args).n_layouts == 2
    args = recipe.parse_args(["--preset", "sdar-b4"])
    assert (args.g_max, args.n_rand) == (4, 2) and _objective(args).n_layouts == 11
    with pytest.raises(SystemExit):
        recipe.parse_args(["--loss", "mse"])


# ---------------------------------------------------------------------------------------------
# train_multitf and the CLI
# ---------------------------------------------------------------------------------------------


def test_train_multitf_records_the_options_and_the_cli_refuses_bad_ones(tmp_path, capsys):
    from unmask.train.block_diffusion import train_block_diffusion
    from unmask.train.multitf import train_multitf

    data = ids_file(tmp_path / "d.jsonl")
    bd = tmp_path / "bd"
    train_block_diffusion(base="stories260K", block_size=8, data=data, out=bd, **SMALL_RUN)
    out = tmp_path / "mbd"
    train_multitf(base=str(bd), data=data, out=out, preset="llada2", loss="ipw", **SMALL_RUN)
    meta = json.loads((out / "unmask_config.json").read_text())
    cfg = meta["training"]["objective_config"]
    assert meta["train_g_max"] == 2 and (cfg["g_max"], cfg["n_rand"], cfg["loss_type"]) == (2, 0, "ipw")
    assert cfg["rounding"] == "floor" and cfg["layouts_per_row"] == 0
    with pytest.raises(UnmaskError, match="--preset"):
        train_multitf(base=str(bd), data=data, out=tmp_path / "x", preset="sdar", **SMALL_RUN)
    code, stdout, err = run_cli(capsys, "train", "multitf", "--base", bd, "--data", data, "--out", tmp_path / "cli",
                                "--seq-len", "32", "--steps", "2", "--preset", "sdar-b4", "--loss", "ipw",
                                "--warmup", "1", "--eval-every", "0")
    assert code == 0, err
    cfg = json.loads((tmp_path / "cli" / "unmask_config.json").read_text())["training"]["objective_config"]
    assert (cfg["g_max"], cfg["n_rand"], cfg["loss_type"]) == (4, 2, "ipw")
    for bad, word in ((["--loss", "mse"], "--loss"), (["--preset", "big"], "--preset")):
        code, stdout, err = run_cli(capsys, "train", "multitf", "--base", bd, "--data", data, "--out",
                                    tmp_path / "bad", "--seq-len", "32", "--steps", "1", *bad)
        assert code == 2 and word in err and err.startswith("error:") and err.count("\n") == 1, err
        assert not (tmp_path / "bad").exists()
