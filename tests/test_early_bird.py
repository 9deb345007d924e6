"""Early-Bird decoder (spec/early_bird.md §5, §6, §11 conformance): zero routers reduce it to
Fast-dLLM threshold decoding, LPS commits below τ, caches exact on one layer, batch invariance,
trace events and router-time statistics, EOS handling, and bad inputs."""

from __future__ import annotations


import pytest
import torch
from conftest import tiny_bundle, tiny_llama

import unmask
from unmask.decode import DECODERS, spec_for
from unmask.errors import UnmaskError
from unmask.models.mask_token import add_mask_token
from unmask.routers import LBSConfig, LBSRouter, LPSConfig, LPSRouter, save_router
from unmask.routers.io import base_model_facts
from unmask.sampling import Sampling

L, LB = 32, 8
SMALL = dict(block_size=LB, l_min=2, g_max=2)
PROMPTS = [[1, 5, 9, 3], [1, 7], [1, 2, 3, 4, 5, 6]]


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


def dllm(shift=1, *, layers=2, stops=()):
    model = tiny_llama(vocab=64, seed=0, num_hidden_layers=layers, initializer_range=0.4)
    mask = add_mask_token(model)
    bundle = tiny_bundle(model, kind="masked-diffusion", mask_token_id=mask, stop_token_ids=stops)
    bundle.logit_shift = shift
    return bundle


def lbs(seed=0, bias=None):
    torch.manual_seed(seed)
    r = LBSRouter(LBSConfig(gen_length=L, d_base=32, vocab_size=65)).eval()
    if bias is not None:  # a constant router: all-zero output with bias 0
        with torch.no_grad():
            r.head.weight.zero_()
            r.head.bias.fill_(bias)
    return r


def lps(seed=0, bias=None):
    torch.manual_seed(seed)
    r = LPSRouter(LPSConfig()).eval()
    if bias is not None:
        with torch.no_grad():
            r.head.weight.zero_()
            r.head.bias.fill_(bias)
    return r


def eb(bundle, prompts=PROMPTS, stops=(), **kw):
    kw = {"lbs_router": lbs(), "lps_router": lps(), "tau_psi": 0.6, **SMALL, **kw}
    return DECODERS["early-bird"].decode(bundle, prompts, max_new_tokens=L, stop_token_ids=stops, **kw)


# -- reduction to the threshold rule -------------------------------------------------------------------


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("tau", [0.9, 0.3])
@pytest.mark.parametrize("stops", [(), (2, 5)])
def test_zero_routers_reduce_to_fast_dllm_threshold_decoding(shift, tau, stops):
    # All-zero router output: p_φ = 0.5 is never > 0.5, so every block is the min-tokens fallback
    # (the next L_B masks = the next semi-AR block); p_ψ = 0.5 never beats τ_ψ. On random weights
    # most τ = 0.9 steps are anti-stall single commits.
    bundle = dllm(shift, stops=stops)
    got = eb(bundle, stops=stops, tau=tau, lbs_router=lbs(bias=0.0), lps_router=lps(bias=0.0))
    ref = DECODERS["diffusion"].decode(bundle, PROMPTS, max_new_tokens=L, stop_token_ids=stops, policy="threshold", tau=tau,
                           block_size=LB)
    assert got.tokens == ref.tokens
    assert got.stats.nfe_per_row == ref.stats.nfe_per_row
    assert got.stats.extra["paths"] == {"min-tokens-fallback": got.stats.extra["blocks"]}
    assert got.stats.extra["lps_only"] == 0


def test_lbs_only_equals_a_never_firing_lps():
    bundle = dllm()
    a = eb(bundle, lps=False, lbs_router=lbs(seed=2))
    b = eb(bundle, lbs_router=lbs(seed=2), lps_router=lps(bias=-30.0), tau_psi=0.5)
    assert a.tokens == b.tokens and a.stats.nfe_per_row == b.stats.nfe_per_row
    assert a.stats.extra["lps"] is False and a.stats.extra["tau_psi"] is None


def test_a_confident_lps_commits_the_whole_block_in_one_step():
    bundle = dllm()
    out = eb(bundle, prompts=[[1, 5]], tau=0.999, lbs_router=lbs(bias=0.0), lps_router=lps(bias=30.0), tau_psi=0.9)
    assert out.stats.nfe == L // LB  # every fallback block of L_B positions resolves in its selection step
    assert set(out.stats.extra["row_extra"][0]["commits"]) == {LB}
    assert out.stats.extra["lps_only"] > 0


def test_a_confident_lbs_selects_everything_and_lps_threshold_still_commits():
    bundle = dllm()
    out = eb(bundle, prompts=[[1, 5]], lbs_router=lbs(bias=30.0), g_max=1)
    first = out.stats.extra["row_extra"][0]["blocks"]
    assert out.stats.extra["paths"].get("router", 0) >= 1 and first >= 1
    assert len(out.tokens[0]) == L


# -- caches -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("shift", [0, 1])
def test_caches_are_exact_on_a_one_layer_model(cache, shift):
    # One layer: the K/V depend on their own token only, so cached == uncached (diffusion.md §8).
    bundle = dllm(shift, layers=1)
    for prompt in PROMPTS:
        ref = eb(bundle, prompts=[prompt], lbs_router=lbs(seed=1))
        got = eb(bundle, prompts=[prompt], lbs_router=lbs(seed=1), cache=cache)
        assert got.tokens == ref.tokens and got.stats.nfe == ref.stats.nfe
        assert got.stats.extra["refreshes"] == got.stats.extra["blocks"]  # one refresh per LBS selection


def test_cached_batches_run_with_a_shared_refresh():
    bundle = dllm()
    out = eb(bundle, cache="dual", lbs_router=lbs(seed=1))
    assert all(len(t) == L for t in out.tokens)
    assert out.stats.extra["refreshes"] <= out.stats.extra["blocks"]


# -- batching, sampling, hooks, stats -----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batch_equals_single_runs(temperature):
    bundle = dllm()
    sampling = Sampling(temperature=temperature, seed=3)
    batch = eb(bundle, sampling=sampling, lbs_router=lbs(seed=5), lps_router=lps(seed=6), tau_psi=0.55)
    for i, p in enumerate(PROMPTS):
        one = eb(bundle, prompts=[p], sampling=sampling, lbs_router=lbs(seed=5), lps_router=lps(seed=6), tau_psi=0.55)
        assert one.tokens[0] == batch.tokens[i]
        assert one.stats.nfe_per_row[0] == batch.stats.nfe_per_row[i]


@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_rows_stop_once_the_reported_tokens_are_committed(cache):
    # L is fixed by LBS; with max_new_tokens < L the reported tokens are those of the full run and
    # a row spends no forwards beyond them. Prefix-cache rows run alone (its refresh is shared).
    bundle, n = dllm(), 12
    kw = {"lbs_router": lbs(seed=5), "lps_router": lps(seed=6), "tau_psi": 0.55, "cache": cache, **SMALL}
    groups = [PROMPTS] if cache == "none" else [[p] for p in PROMPTS]
    saved = 0
    for prompts in groups:
        full = DECODERS["early-bird"].decode(bundle, prompts, max_new_tokens=L, **kw)
        short = DECODERS["early-bird"].decode(bundle, prompts, max_new_tokens=n, **kw)
        explicit = DECODERS["early-bird"].decode(bundle, prompts, max_new_tokens=n, gen_length=L, **kw)  # -n with --gen-length
        assert short.tokens == [t[:n] for t in full.tokens] == explicit.tokens
        assert all(len(t) == n for t in short.tokens)
        assert all(s <= f for s, f in zip(short.stats.nfe_per_row, full.stats.nfe_per_row))
        saved += sum(full.stats.nfe_per_row) - sum(short.stats.nfe_per_row)
    assert saved > 0


def test_step_events_hooks_and_router_time_statistics():
    bundle = dllm()
    events, states = [], []
    out = eb(bundle, prompts=[[1, 5]], on_step=events.append, on_forward=states.append)
    assert len(events) == out.stats.nfe == len(states)
    assert sum(len(e["positions"]) for e in events) == L
    assert "selected" in events[0] and events[0]["block"] == 0
    for s in states:
        assert not (s["chosen"] & ~s["cand"]).any() and s["chosen"][s["cand"].any(dim=1)].any(dim=1).all()
        assert s["features"].shape == (1, L, 5)
    x = out.stats.extra
    assert 0 < x["router_share"] < 1 and x["router_seconds"] == pytest.approx(x["lbs_seconds"] + x["lps_seconds"])
    assert x["step_seconds"] >= x["forward_seconds"] > 0
    assert sum(x["accepts"].values()) == out.stats.nfe


def test_stop_ids_end_rows_and_early_stop_fills_the_tail():
    bundle = dllm()
    plain = eb(bundle, prompts=[[1, 5]], lbs_router=lbs(seed=1))
    stop = max(set(plain.tokens[0]), key=plain.tokens[0].count)  # a token the model likes: make it a stop id
    last = {}
    out = eb(bundle, prompts=[[1, 5]], lbs_router=lbs(seed=1), stops=(stop,),
             on_forward=lambda s: last.update(canvas=s["canvas"][0].tolist()))
    canvas = last["canvas"]
    assert stop in canvas
    first = canvas.index(stop)
    assert out.tokens[0] == canvas[:first] and mask_free(canvas[:first], bundle)
    early = eb(bundle, prompts=[[1, 5]], lbs_router=lbs(seed=1), stops=(stop,), eos_early_stop=True)
    assert early.tokens[0] == out.tokens[0]
    assert early.stats.extra["n_committed"] == [L] and early.stats.nfe <= out.stats.nfe


def mask_free(ids, bundle):
    return bundle.mask_token_id not in ids


def test_registry_and_api_with_saved_routers(tmp_path):
    bundle = dllm()
    assert "lps_router" in {k.name for k in spec_for("early-bird", "masked-diffusion").knobs()}
    with pytest.raises(UnmaskError, match="early-bird"):
        spec_for("early-bird", "causal")
    bundle.path = tmp_path
    save_router(lbs(), tmp_path / "routers", meta={"base_model": base_model_facts(bundle)})
    save_router(lps(), tmp_path / "routers", meta={"tau_psi": 0.6})
    res = unmask.generate("5 6 7", bundle, "early-bird", max_new_tokens=10, block_size=LB)
    assert len(res.tokens[0]) == 10 and res.rows()[0]["decoder"] == "early-bird"
    res2 = unmask.generate("5 6 7", bundle, "early-bird", max_new_tokens=10, block_size=LB, lps=False)
    assert res2.stats.extra["lps"] is False


# -- bad inputs ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, match", [
    (dict(g_max=0), "g_max"), (dict(l_min=0), "L_min"), (dict(tau_psi=1.0), "tau_psi"), (dict(tau_psi=0.0), "tau_psi"),
    (dict(tau=0.0), "tau"), (dict(cache="ring"), "cache"), (dict(gen_length=16), "gen length 32"),
    (dict(gap_metric="cosine"), "gap metric"), (dict(block_size=0), "block size"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(UnmaskError, match=match):
        eb(dllm(), **options)


def test_bad_models_and_router_combinations_are_refused(tmp_path):
    bundle = dllm()
    for gen_length in (None, L):
        with pytest.raises(UnmaskError, match="exceeds the LBS router's gen length"):
            DECODERS["early-bird"].decode(bundle, [[1]], max_new_tokens=L + 1, gen_length=gen_length, lbs_router=lbs(), lps=False)
    with pytest.raises(UnmaskError, match="lps must be true or false"):
        DECODERS["early-bird"].decode(bundle, [[1]], max_new_tokens=8, lbs_router=lbs(), lps="abc")
    with pytest.raises(UnmaskError, match="unmask train lbs"):
        DECODERS["early-bird"].decode(bundle, [[1]], max_new_tokens=8)  # no routers anywhere
    with pytest.raises(UnmaskError, match="lps=False"):
        DECODERS["early-bird"].decode(bundle, [[1]], max_new_tokens=8, lbs_router=lbs())  # LBS given, no LPS
    with pytest.raises(UnmaskError, match="tau_psi"):
        DECODERS["early-bird"].decode(bundle, [[1]], max_new_tokens=8, lbs_router=lbs(), lps_router=lps())
    wrong = LBSRouter(LBSConfig(gen_length=L, d_base=32, vocab_size=99))
    with pytest.raises(UnmaskError, match="vocabular"):
        DECODERS["early-bird"].decode(bundle, [[1]], max_new_tokens=8, lbs_router=wrong, lps=False)
    causal = tiny_bundle(tiny_llama(vocab=64))
    with pytest.raises(UnmaskError, match="mask token"):
        DECODERS["early-bird"].decode(causal, [[1]], max_new_tokens=8, lbs_router=lbs(), lps=False)
    with pytest.raises(UnmaskError, match="at least one token"):
        DECODERS["early-bird"].decode(bundle, [[]], max_new_tokens=8, lbs_router=lbs(), lps=False)
