"""LBS / LPS router modules (spec/early_bird.md §3.2, §4.2) and their save/load next to a model:
shapes with padding and variable block lengths, padding invariance, the paper's parameter counts,
bit-exact round trips, and refusals (missing routers, another vocabulary, corrupted files)."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from conftest import tiny_bundle, tiny_llama

from unmask.errors import UnmaskError
from unmask.models.mask_token import add_mask_token
from unmask.routers import LBSConfig, LBSRouter, LPSConfig, LPSRouter, load_router, load_routers, save_router
from unmask.routers.io import base_model_facts, check_lbs_fits


def lbs_router(L=16, d_base=32, vocab=65, seed=0, **kw):
    torch.manual_seed(seed)
    return LBSRouter(LBSConfig(gen_length=L, d_base=d_base, vocab_size=vocab, **kw)).eval()


def lps_router(seed=0, **kw):
    torch.manual_seed(seed)
    return LPSRouter(LPSConfig(**kw)).eval()


def dllm(vocab=64):
    model = tiny_llama(vocab=vocab, seed=0)
    mask = add_mask_token(model)
    return tiny_bundle(model, kind="masked-diffusion", mask_token_id=mask)


# -- LBS ------------------------------------------------------------------------------------------------


def test_lbs_shapes_and_minus_inf_outside_the_masked_set():
    r = lbs_router()
    masked = torch.rand(3, 16, generator=torch.Generator().manual_seed(0)) < 0.5
    out = r(torch.rand(3, 16), torch.randn(3, 16, 32), masked)
    assert out.shape == (3, 16) and out.dtype == torch.float32
    assert torch.isinf(out[~masked]).all() and torch.isfinite(out[masked]).all()


@torch.no_grad()
def test_lbs_ignores_the_features_of_non_masked_slots():
    r = lbs_router()
    masked = torch.tensor([[True, False] * 8])
    h, e = torch.rand(1, 16), torch.randn(1, 16, 32)
    h2, e2 = h.clone(), e.clone()
    h2[~masked], e2[~masked] = 9.0, 9.0  # scatter reading: non-masked slots carry zero features
    assert torch.equal(r(h, e, masked), r(h2, e2, masked))


def test_lbs_refuses_another_length():
    with pytest.raises(UnmaskError, match="gen length 16"):
        lbs_router()(torch.rand(1, 8), torch.randn(1, 8, 32), torch.ones(1, 8, dtype=torch.bool))


def test_paper_sized_routers_match_the_spec_parameter_counts():
    lbs = LBSRouter(LBSConfig(gen_length=512, d_base=4096, vocab_size=126464, d=128, layers=2, ffn=256))
    assert abs(lbs.n_params() - 613_697) < 10  # ≈ 0.61M (App. C.1, spec §3.2 item 7)
    assert abs(LPSRouter(LPSConfig()).n_params() - 17_377) < 10  # the listed sizes give ≈ 17.4k (§4.2 item 5)


@pytest.mark.parametrize("bad", [dict(d=31), dict(d=30, heads=4), dict(layers=0), dict(dropout=1.0)])
def test_lbs_config_validation(bad):
    with pytest.raises(UnmaskError):
        LBSConfig(gen_length=16, d_base=32, vocab_size=65, **bad)


# -- LPS ------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_lps_padding_and_variable_block_lengths_do_not_change_a_row():
    r = lps_router()
    g = torch.Generator().manual_seed(1)
    lengths = [5, 1, 3, 0]
    x = torch.rand(4, 6, 5, generator=g)
    valid = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    out = r(x, valid)
    assert out.shape == (4, 6)
    assert torch.isinf(out[~valid]).all() and torch.isfinite(out[valid]).all()  # an empty row gives no NaN
    for i, n in enumerate(lengths):
        if n:
            alone = r(x[i: i + 1, :n], torch.ones(1, n, dtype=torch.bool))
            assert torch.allclose(alone[0], out[i, :n], atol=1e-5)
            garbage = x[i: i + 1].clone()
            garbage[0, n:] = 100.0  # padding content is never seen
            assert torch.allclose(r(garbage, valid[i: i + 1])[0, :n], out[i, :n], atol=1e-5)


def test_lps_rejects_another_feature_count_and_bad_config():
    with pytest.raises(UnmaskError, match="5 features"):
        lps_router()(torch.rand(1, 3, 4), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(UnmaskError):
        LPSConfig(pos_mode="clip")
    with pytest.raises(UnmaskError):
        LPSConfig(d=30, heads=4)


# -- save / load ----------------------------------------------------------------------------------------


@torch.no_grad()
def test_save_load_round_trip_is_bit_exact(tmp_path):
    lbs, lps = lbs_router(seed=3), lps_router(seed=4, layers=1, pos_mode="rank")
    save_router(lbs, tmp_path, meta={"base_model": {"name": "tiny"}})
    save_router(lps, tmp_path, meta={"tau_psi": 0.87, "metrics": {"recall": 0.5}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lbs.json", "lbs.safetensors", "lps.json", "lps.safetensors"]
    lbs2, info = load_router(tmp_path, "lbs")
    lps2, info2 = load_router(tmp_path, "lps")
    assert info["config"] == lbs.config.to_dict() and info2["tau_psi"] == 0.87
    assert lps2.config == lps.config and not lbs2.training
    for a, b in ((lbs, lbs2), (lps, lps2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    m = torch.rand(2, 16) < 0.5
    h, e = torch.rand(2, 16), torch.randn(2, 16, 32)
    assert torch.equal(lbs(h, e, m), lbs2(h, e, m))


def test_corrupted_or_mismatched_files_are_refused(tmp_path):
    save_router(lps_router(), tmp_path, meta={"tau_psi": 0.9})
    (tmp_path / "lps.safetensors").write_bytes(b"not weights")
    with pytest.raises(UnmaskError, match="sha256"):
        load_router(tmp_path, "lps")
    with pytest.raises(UnmaskError, match="no LBS router"):
        load_router(tmp_path, "lbs")
    info = json.loads((tmp_path / "lps.json").read_text())
    (tmp_path / "lps.json").write_text(json.dumps({**info, "format": "other/9"}))
    with pytest.raises(UnmaskError, match="not an unmask"):
        load_router(tmp_path, "lps")


def test_missing_routers_say_how_to_train_them(tmp_path):
    bundle = dllm()
    with pytest.raises(UnmaskError, match="unmask train lbs"):
        load_routers(bundle)  # no model directory
    bundle.path = tmp_path
    # a local model is named by its directory (its name alone would not resolve), with --data
    with pytest.raises(UnmaskError, match=re.escape(f"unmask train lbs --model {tmp_path} --data CORPUS")):
        load_routers(bundle)
    save_router(lbs_router(), tmp_path / "routers", meta={"base_model": base_model_facts(bundle)})
    assert load_routers(bundle, lps=False).lps is None
    with pytest.raises(UnmaskError, match="--no-lps"):
        load_routers(bundle)
    save_router(lps_router(), tmp_path / "routers", meta={"tau_psi": 0.88})
    loaded = load_routers(bundle)
    assert loaded.tau_psi == 0.88 and loaded.lps is not None


def test_lbs_for_another_vocabulary_is_refused_and_another_embedding_warns(tmp_path):
    bundle = dllm(vocab=64)  # vocabulary 65 with the mask token
    save_router(lbs_router(vocab=33), tmp_path, meta={"base_model": {"name": "other"}})
    _, info = load_router(tmp_path, "lbs")
    with pytest.raises(UnmaskError, match="does not transfer across vocabularies"):
        check_lbs_fits(info, bundle)
    with pytest.raises(UnmaskError, match="vocabulary"):
        load_routers(bundle, routers=tmp_path, lps=False)
    facts = {**base_model_facts(bundle), "embedding": "0" * 16}
    save_router(lbs_router(), tmp_path, meta={"base_model": facts})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_routers(bundle, routers=tmp_path, lps=False)
    assert any("different embedding" in str(w.message) for w in caught)


def test_saved_tau_psi_must_lie_in_the_open_unit_interval(tmp_path):
    bundle = dllm()
    save_router(lbs_router(), tmp_path)
    save_router(lps_router(), tmp_path, meta={"tau_psi": 1.0})
    with pytest.raises(UnmaskError, match="tau_psi"):
        load_routers(bundle, routers=tmp_path)
