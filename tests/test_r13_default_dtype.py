"""Round 13: the default decoder is the fastest exact one here (issue 52 item 1), and lossless SBD's
identity with AR is stated with its dtype (issue 48 item 5)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import unmask
from conftest import run_cli, tiny_bundle, tiny_llama
from unmask.decode import choice
from unmask.decode.choice import MIN_GAIN, choose, default_for, recorded
from unmask.errors import UnmaskError
from unmask.eval.divergence import bf16_ulp, divergence, first_divergence, gap_of
from unmask.models import smollm2
from unmask.decode import DECODERS

# -- issue 52.1: the choice -------------------------------------------------------------------

TPFS = (1.0, 1.1, 1.2, 1.44, 2.0, 2.5, 2.99, 4.0, 8.0)
COSTS = (0.9, 1.0, 1.1, 1.18, 1.3, 1.5, 1.9, 2.3, 3.0, 16.0)


@pytest.mark.parametrize("tpf,cost", list(itertools.product(TPFS, COSTS)))
def test_choose_is_lossless_sbd_exactly_when_its_expected_speedup_reaches_min_gain(tpf, cost):
    assert choose(tpf, cost) == ("sbd" if tpf / cost >= MIN_GAIN else "ar")


def test_choose_at_the_boundary_and_with_nothing_measured():
    assert choose(MIN_GAIN * 2.0, 2.0) == "sbd"
    assert choose(MIN_GAIN * 2.0 - 1e-9, 2.0) == "ar"
    assert choose(1.2, 2.3) == "ar"  # the issue's SmolLM2 adapter on a CPU: 0.52x AR
    assert choose(2.99, 1.39) == "sbd"  # stories260K-sbd on a CPU
    for tpf, cost in ((None, 2.0), (2.0, None), (None, None)):  # unmeasured: the sbd model keeps its decoder
        assert choose(tpf, cost) == "sbd"


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "2"])
def test_choose_refuses_a_figure_that_is_not_a_positive_number(bad):
    with pytest.raises(UnmaskError, match="finite number > 0"):
        choose(bad, 1.5)
    with pytest.raises(UnmaskError, match="finite number > 0"):
        choose(1.5, bad)


def test_the_record_is_read_and_a_malformed_one_is_refused_by_name():
    assert recorded({}) is None
    rec = recorded({"lossless_measured": {"tpf": 2.5, "queries": 16, "source": "x"}})
    assert rec == choice.Measured(tpf=2.5, queries=16)
    for bad in ({"tpf": 0, "queries": 16}, {"tpf": 2.0}, {"tpf": 2.0, "queries": 0}, [2.0, 16], "fast"):
        with pytest.raises(UnmaskError, match="lossless_measured.*calibrate-drafts"):
            recorded({"lossless_measured": bad}, "adapter.json")


def test_every_shipped_sbd_checkpoint_records_its_lossless_tpf():
    b = unmask.load("stories260K-sbd")
    assert recorded(b.meta) == choice.Measured(tpf=2.99, queries=15)
    a = unmask.load("stories260K", adapter="sbd")
    assert recorded(a.meta) == choice.Measured(tpf=2.5, queries=16)


def test_an_sbd_option_or_an_unmeasured_model_keeps_sbd_without_timing(monkeypatch):
    b = unmask.load("stories260K-sbd")
    monkeypatch.setattr(choice, "forward_cost", lambda *a, **k: pytest.fail("timed"))
    for opt in ({"verify": True}, {"draft": "linear"}, {"queries": 8}, {"gamma": 0.35}, {"block_size": 4}):
        assert default_for(b, opt).decoder == "sbd"
    unmeasured = tiny_bundle(tiny_llama(vocab=64), kind="sbd", mask_token_id=63)
    assert default_for(unmeasured) == choice.Choice("sbd")
    assert default_for(unmask.load("stories260K")) == choice.Choice("ar")  # a causal model: ar, nothing timed


def test_a_slow_measurement_falls_back_to_ar_with_the_one_line_note(monkeypatch):
    b = unmask.load("stories260K-sbd")
    monkeypatch.setattr(choice, "forward_cost", lambda bundle, q: 3.0)
    c = default_for(b)
    assert (c.decoder, c.tpf, c.cost, c.queries) == ("ar", 2.99, 3.0, 15)
    assert c.note == ("lossless sbd on stories260K-sbd is expected at 1.0x AR on cpu (TPF 2.99, a 15-query forward "
                      "costs 3.0x); decoding with ar — pass --decoder sbd to use it")


def test_the_forward_cost_is_measured_once_per_model(monkeypatch):
    monkeypatch.delenv(choice.COST_ENV, raising=False)  # conftest fixes it for every other test
    b = unmask.load("stories260K-sbd")
    ratio = choice.forward_cost(b, 15)
    assert 1 <= ratio < 15 and choice.forward_cost(b, 15) == ratio  # cached: the same figure


def test_stories260K_sbd_keeps_lossless_sbd_as_the_cli_default(capsys):
    code, out, err = run_cli(capsys, "generate", "Once upon a time", "--model", "stories260K-sbd", "-n", "8", "--json",
                             "--no-progress")
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["decoder"] == "sbd" and "decoding with ar" not in err


def _smollm2_ready() -> str | None:
    if not smollm2.is_converted(smollm2.converted_dir()):
        return "smollm2-135m is not converted in the user cache (the first load converts it, 30 s or more)"
    return None


needs_smollm2 = pytest.mark.skipif(_smollm2_ready() is not None, reason=str(_smollm2_ready()))


@pytest.fixture(scope="module")
def smol():
    return unmask.load("smollm2-135m", adapter="sbd")


@needs_smollm2
def test_the_shipped_smollm2_adapter_defaults_to_ar_on_a_cpu_with_the_note(capsys, smol):
    # TPF 1.44 at 16 queries: lossless sbd needs a 16-query forward under 1.31x a 1-query one, which
    # no CPU gives a 135M model (1.9x measured on 2 busy cores)
    code, out, err = run_cli(capsys, "generate", "What is 2+2?", "--model", "smollm2-135m", "--adapter", "sbd",
                             "--chat", "-n", "2", "--json", "--no-progress")
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["decoder"] == "ar"
    note = [line for line in err.splitlines() if "decoding with ar" in line]
    assert len(note) == 1 and note[0].startswith("lossless sbd with this adapter is expected at ")
    assert "on cpu (TPF 1.44, a 16-query forward costs " in note[0] and note[0].endswith("pass --decoder sbd to use it")
    assert unmask.generate("What is 2+2?", smol, chat=True, max_new_tokens=2).decoder == "ar"  # the API alike
    assert unmask.generate("What is 2+2?", smol, "sbd", chat=True, max_new_tokens=2).decoder == "sbd"  # named: wins


@needs_smollm2
def test_the_server_default_of_the_smollm2_adapter_is_ar_and_stories260K_sbd_keeps_sbd(smol):
    pytest.importorskip("fastapi", reason="pip install -e '.[test]'")
    from unmask.serve import create_app

    assert "decoding with ar" in create_app(smol).state.default_note
    assert create_app(smol, defaults={"decoder": "sbd"}).state.default_note is None  # named: wins
    assert create_app(unmask.load("stories260K-sbd")).state.default_note is None


def test_the_server_default_follows_the_choice(monkeypatch):
    pytest.importorskip("fastapi", reason="pip install -e '.[test]'")
    import urllib.request

    from unmask.serve import create_app
    from unmask.serve.server import ServerThread

    monkeypatch.setattr(choice, "forward_cost", lambda bundle, q: 3.0)  # a device where lossless is slow
    app = create_app(unmask.load("stories260K-sbd"))
    assert "decoding with ar" in app.state.default_note
    with ServerThread(app) as s:
        models = json.loads(urllib.request.urlopen(s.url + "/v1/models").read())
    assert models["data"][0]["default_decoder"] == "ar"


# -- issue 48.5: the identity with AR and its dtype ----------------------------------------------

def test_first_divergence_finds_the_first_differing_position():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([], []) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([7, 2], [1, 2]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one row stopped earlier
    assert first_divergence([1, 2, 3], [1]) == 1


def test_bf16_ulp_and_the_top2_gap():
    assert bf16_ulp(1.0) == 2 ** -7 and bf16_ulp(-12.0) == 2 ** -4 and bf16_ulp(16.0) == 2 ** -3
    g = gap_of(torch.tensor([0.5, 16.25, 16.0, -3.0]))
    assert (g.top1, g.top2, g.gap, g.gap_ulps) == (1, 2, 0.25, 2.0)
    with pytest.raises(UnmaskError, match="logit vector"):
        gap_of(torch.zeros(2, 3))


def test_the_divergence_detector_finds_the_position_and_ar_s_top2_gap_there():
    torch.manual_seed(0)
    b = tiny_bundle(tiny_llama(vocab=64, seed=3))
    prompt = [1, 5, 9, 13]
    ref = DECODERS["ar"].decode(b, [prompt], max_new_tokens=8).tokens[0]
    assert divergence(b, prompt, ref, ref) is None
    with torch.inference_mode():  # the next-token logits after prompt + ref[:3], one uncached forward
        full = torch.tensor([prompt + ref[:3]])  # (1, T)
        logits = b.model(input_ids=full).logits[0, -1].float()  # (V,)
    top2 = int(torch.topk(logits, 2).indices[1])
    other = ref[:3] + [top2] + ref[4:]
    d = divergence(b, prompt, ref, other)
    assert (d.position, d.reference_token, d.other_token) == (3, ref[3], top2)
    v = torch.topk(logits, 2).values
    assert d.gap.top1 == ref[3] and d.gap.gap == pytest.approx(float(v[0] - v[1]), abs=1e-4)
    assert d.chosen_gap == pytest.approx(d.gap.gap, abs=1e-4)  # the other row took AR's runner-up
    shorter = divergence(b, prompt, ref, ref[:5])  # the other row stopped at position 5
    assert shorter.position == 5 and shorter.other_token is None and shorter.chosen_gap is None


def test_eval_names_the_dtype_its_agreement_with_ar_was_measured_in(capsys):
    from unmask.eval.runner import evaluate

    res = evaluate("stories", "stories260K-sbd", "sbd", limit=2, max_new_tokens=8, dtype="bfloat16", warmup=False,
                   verify=True)
    s = res.summary
    assert s["config"]["agreement_dtype"] == "bfloat16" and s["identical_pct"] in (0.0, 50.0, 100.0)
    code, out, err = run_cli(capsys, "eval", "--task", "stories", "--model", "stories260K-sbd", "--decoder", "sbd",
                             "--limit", "2", "--max-new-tokens", "8", "--dtype", "bfloat16")
    assert code == 0, err
    line = next(x for x in out.splitlines() if "identical_pct" in x)
    assert "vs greedy ar@stories260K-sbd in bfloat16" in line


def test_bench_names_the_dtype_of_its_identity_column():
    from unmask.bench.side_by_side import bench

    res = bench(limit=2, max_new_tokens=8, decoders=["sbd"], models=["stories260K-sbd"], dtype="bfloat16")
    row = next(r for r in res.rows if r["decoder"] == "sbd --verify")
    assert row["agreement_dtype"] == "bfloat16" and 0 <= row["identical_to_ar"] <= 2
    headers = [c.header for c in res.table().columns]
    assert "same as AR (bfloat16)" in headers


def test_the_bf16_report_names_the_dtype_and_each_divergence_s_gap(tmp_path):
    from conftest import load_benchmark

    bench = load_benchmark("lossless_bf16")
    results = bench.main(["--stories", "3", "--smollm2", "0", "--max-new-tokens", "16", "--fp32-check",
                          "--out-dir", str(tmp_path)])
    assert [(r["model"], r["dtype"], r["prompts"]) for r in results] == [("stories260K-sbd", "bfloat16", 3),
                                                                          ("stories260K-sbd", "float32", 3)]
    assert results[1]["identical"] == 3  # float32: lossless SBD is AR
    md = (tmp_path / "lossless_bf16.md").read_text()
    assert "| stories260K-sbd | bfloat16 | 3 |" in md and "| stories260K-sbd | float32 | 3 | 3 | 0 (0 %) |" in md
    saved = json.loads((tmp_path / "lossless_bf16.json").read_text())
    for r in saved["results"]:
        for row in r["rows"]:
            assert row["identical"] == (row["ar"] == row["sbd"])
            assert row["identical"] or row["divergence"]["gap"]["gap_ulps"] >= 0


def test_a_fixed_forward_cost_replaces_the_timing(monkeypatch):
    """UNMASK_FORWARD_COST: one default whatever the load (conftest sets 2.0 for the suite)."""
    b = unmask.load("stories260K-sbd")
    monkeypatch.setenv(choice.COST_ENV, "2.5")
    assert choice.forward_cost(b, 15) == 2.5
    for bad in ("0.5", "nan", "fast", "inf"):
        monkeypatch.setenv(choice.COST_ENV, bad)
        with pytest.raises(UnmaskError, match="UNMASK_FORWARD_COST=.* must be a number >= 1"):
            choice.forward_cost(b, 15)
