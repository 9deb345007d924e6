"""Issue 28, decoder and eval correctness: low-temperature commit decisions (item 8), AUP units
(9), MBPP's quoted CRLF wrapper (10), cache crops and mask ids out of range (11), extracted
answers and failure reasons in eval rows (12, 6), the stop token in TPF (6) and the lm-eval
adapter through the real lm-eval package (7)."""

from __future__ import annotations

import math

import pytest
import torch

import unmask
from unmask.decode import DECODERS
from unmask.decode.blocks.rule import quota_threshold_commit
from unmask.decode.engine.kv import DynamicKV, StaticKV
from unmask.errors import UnmaskError
from unmask.eval import tasks as T
from unmask.eval.aup import aup, aup_report
from unmask.eval.code_tasks import evaluate_mbpp, failure_reason, postprocess_mbpp
from unmask.eval.datasets import GSM8KExample, HumanEvalTask, MBPPTask
from unmask.eval.sandbox import RunResult
from unmask.policies import EntropyBound, Threshold, commit
from unmask.sampling import Sampling


@pytest.fixture(scope="module")
def dlm():
    return unmask.load("stories260K-dlm")


@pytest.fixture(scope="module")
def sbd_model():
    return unmask.load("stories260K-sbd")


# ---------------------------------------------------------------- item 8: T → 0 tends to T = 0

def _dlm_decode(bundle, T, **kw):
    prompt = bundle.encode("Once upon a time")
    return DECODERS["diffusion"].decode(bundle, [prompt], max_new_tokens=32, policy="threshold",
                            sampling=Sampling(temperature=T, seed=0), **kw)


def test_threshold_on_the_dream_sampler_needs_about_as_many_forwards_at_low_temperature(dlm):
    from unmask.models.adapters import default_sampler

    assert default_sampler(dlm) == "dream"  # the shipped model's default, the case of the report
    greedy = _dlm_decode(dlm, 0.0)
    for T in (0.05, 0.1):
        cold = _dlm_decode(dlm, T)
        # Before: 2 and 4 forwards (tempered κ rounds to 1.0); greedy takes 30.
        assert cold.stats.nfe >= greedy.stats.nfe / 1.5, (T, cold.stats.nfe, greedy.stats.nfe)
        assert cold.stats.extra["confidence"] == "untempered"


def test_dreams_tempered_convention_stays_available_by_name(dlm):
    greedy = _dlm_decode(dlm, 0.0)
    tempered = _dlm_decode(dlm, 0.1, confidence="tempered")
    assert tempered.stats.extra["confidence"] == "tempered"
    assert tempered.stats.nfe < greedy.stats.nfe / 3  # κ rounds to 1.0: blocks commit at once
    with pytest.raises(UnmaskError, match="unknown confidence 'warm'"):
        _dlm_decode(dlm, 0.1, confidence="warm")


def test_early_bird_at_low_temperature_needs_about_as_many_forwards_as_greedy(dlm):
    from unmask.decode import DECODERS

    prompt = dlm.encode("Once upon a time")
    greedy = DECODERS["early-bird"].decode(dlm, [prompt], max_new_tokens=32)
    cold = DECODERS["early-bird"].decode(dlm, [prompt], max_new_tokens=32, sampling=Sampling(temperature=0.1, seed=0))
    hot = DECODERS["early-bird"].decode(dlm, [prompt], max_new_tokens=32, sampling=Sampling(temperature=0.1, seed=0),
                            confidence="tempered")
    assert cold.stats.nfe >= greedy.stats.nfe / 1.5  # before: 5 forwards against greedy's 23
    assert hot.stats.nfe < greedy.stats.nfe / 2 and hot.stats.extra["confidence"] == "tempered"


@pytest.mark.parametrize("T", [0.05, 0.1, 1.0])
def test_sbd_gamma_zero_commits_one_token_per_forward_at_any_temperature(sbd_model, T):
    prompt = sbd_model.encode("Once upon a time")
    out = DECODERS["sbd"].decode(sbd_model, [prompt], max_new_tokens=32, gamma=0.0, sampling=Sampling(temperature=T, seed=0))
    assert out.stats.extra["accepts"] == {1: out.stats.nfe}  # before: 2 tokens in 5-8 forwards at T <= 0.1
    assert out.stats.nfe == 32


def test_eb_statistics_are_untempered_by_default():
    # Two positions whose tempered entropies underflow to exactly 0 at T = 0.05 (logit gaps of 6 and 5).
    logits = torch.tensor([[[6.0, 0.0, 0.0], [5.0, 0.0, 0.0]]])
    masked = torch.ones(1, 2, dtype=torch.bool)
    kw = dict(temperature=0.05, top_k=1)  # top_k = 1 draws the argmax
    assert commit(logits, masked, EntropyBound(0.0), **kw)[0].sum().item() == 1
    assert commit(logits, masked, EntropyBound(0.0), confidence="tempered", **kw)[0].sum().item() == 2
    # T = 0 is unchanged, and the default equals T = 0 for the commit decision at any T.
    greedy = commit(logits, masked, Threshold(0.9))[0]
    for T in (1e-3, 0.1, 0.5):
        assert torch.equal(commit(logits, masked, Threshold(0.9), temperature=T, top_k=1)[0], greedy)


def test_quota_threshold_rule_reads_untempered_confidence():
    logits = torch.tensor([[[3.0, 0.0, 0.0], [2.0, 0.0, 0.0], [2.5, 0.0, 0.0]]])  # κ 0.91, 0.79, 0.86 untempered
    masked = torch.ones(1, 3, dtype=torch.bool)
    s = Sampling(temperature=0.1)  # logit gaps of 20+ at T = 0.1: every draw is the argmax
    gens = [torch.Generator().manual_seed(0)]
    greedy, _ = quota_threshold_commit(logits, masked, 0.85, 1, Sampling(), None)
    cold, _ = quota_threshold_commit(logits, masked, 0.85, 1, s, gens)
    hot, _ = quota_threshold_commit(logits, masked, 0.85, 1, s, gens, confidence="tempered")
    assert cold.tolist() == greedy.tolist() == [[True, False, True]]
    assert hot.tolist() == [[True, True, True]]  # the published rule at T = 0.1: κ ≈ 1 everywhere


def test_serve_batches_take_the_confidence_option(dlm):
    from unmask.decode.dllm.diffusion import DiffusionOptions
    from unmask.decode.dllm.diffusion_batch import batch

    assert batch(dlm, DiffusionOptions(confidence="tempered")).confidence == "tempered"
    assert batch(dlm, DiffusionOptions()).confidence is None  # dream sampler: float32 untempered
    with pytest.raises(UnmaskError, match="unknown confidence"):
        batch(dlm, DiffusionOptions(confidence="hot"))


# ---------------------------------------------------------------- item 9: AUP units

def test_aup_refuses_fractions_with_one_line():
    with pytest.raises(UnmaskError) as e:
        aup([(1.0, 0.72), (2.0, 0.70)], 0.72)
    assert "\n" not in str(e.value) and "fraction" in str(e.value) and "100" in str(e.value)
    with pytest.raises(UnmaskError, match="looks like fractions"):
        aup([(1.0, 0.72), (3.0, 0.6)], 99.0, variant="trapezoid")


def test_aup_converts_fractions_when_told():
    percent = aup([(1.0, 72.0), (2.0, 70.0)], 72.0)
    assert aup([(1.0, 0.72), (2.0, 0.70)], 0.72, unit="fraction") == pytest.approx(percent)
    assert aup_report([(1.0, 0.72), (2.0, 0.70)], 0.72, unit="fraction").value == pytest.approx(percent)
    with pytest.raises(UnmaskError, match="with unit 'fraction' accuracy must be in \\[0, 1\\], got 72"):
        aup([(1.0, 72.0)], 72.0, unit="fraction")
    with pytest.raises(UnmaskError, match="unknown unit"):
        aup([(1.0, 72.0)], 72.0, unit="per-mille")
    # Percent values below 1 % are legal when the unit says so (a tiny model on GSM8K).
    assert aup([(1.0, 0.5), (2.0, 0.5)], 0.5, unit="percent") > 0
    assert aup([(1.0, 72.0), (2.0, 70.0)], 72.0, unit="percent") == pytest.approx(percent)


# ---------------------------------------------------------------- item 10: MBPP wrapper

@pytest.mark.parametrize("raw", [
    "[BEGIN]\r\n'def add(a, b):\r\n    return a + b'\r\n[DONE]",
    "[BEGIN]\n 'def add(a, b):\n    return a + b' \n[DONE]",
    " 'def add(a, b):\r    return a + b' \r\n[DONE]\r\nmore",
])
def test_mbpp_unwraps_the_quoted_begin_done_form(raw):
    assert postprocess_mbpp(raw) == "def add(a, b):\n    return a + b"
    task = MBPPTask(1, "add", "def add(a, b):\n    return a + b", ("assert add(1, 2) == 3",))
    assert evaluate_mbpp(tasks=[task], completions=[raw]).pass_at_1 == 1.0


def test_mbpp_keeps_code_that_ends_in_a_string_literal():
    assert postprocess_mbpp("'a'\n[DONE]") == "'a'"  # valid Python as it stands
    assert postprocess_mbpp("x = 'a'\ny = 'b'\n[DONE]") == "x = 'a'\ny = 'b'"


# ---------------------------------------------------------------- item 11: clear errors

def test_static_cache_crop_past_its_length_is_one_clear_error(stories):
    kv = StaticKV(stories.model, 1, 32)
    ids = torch.tensor([[1, 5, 9]])
    kv.forward(ids, torch.arange(3)[None], None, compiled=False)
    with pytest.raises(UnmaskError, match="cannot crop 4 positions from a KV cache holding 3"):
        kv.crop(4)
    assert kv.length == 3  # unchanged, so the next forward still works
    kv.forward(torch.tensor([[7]]), torch.tensor([[3]]), None, compiled=False)
    kv.crop(2)
    assert kv.length == 2


def test_dynamic_cache_crop_past_its_length_is_one_clear_error(stories):
    kv = DynamicKV(stories.model)
    kv.forward(torch.tensor([[1, 5]]), torch.arange(2)[None], None)
    with pytest.raises(UnmaskError, match="cannot crop 3 positions"):
        kv.crop(3)
    with pytest.raises(UnmaskError, match="integer count"):
        kv.crop(1.5)
    kv.crop(torch.tensor(1))  # 0-d integer tensors are counts too
    assert kv.length == 1


@pytest.mark.parametrize("mask_id", [-1, -(2 ** 40)])
def test_negative_mask_token_id_is_one_clear_error(mask_id):
    with pytest.raises(UnmaskError, match=f"mask_token_id must be a token id >= 0 \\(got {mask_id}\\)"):
        unmask.load("stories260K-dlm", mask_token_id=mask_id)


def test_negative_mask_token_id_in_the_cli_is_one_line(capsys, tmp_path):
    import shutil
    from pathlib import Path

    from conftest import one_line_error

    dst = tmp_path / "dlm"
    shutil.copytree(Path(unmask.__file__).parent / "checkpoints" / "stories260K-dlm", dst)
    cfg = (dst / "unmask_config.json").read_text()
    assert '"mask_token_id": 512' in cfg
    (dst / "unmask_config.json").write_text(cfg.replace('"mask_token_id": 512', '"mask_token_id": -1'))
    one_line_error(capsys, "generate", "--model", str(dst), "Once", match="token id >= 0")


# ---------------------------------------------------------------- item 12 and 6: what rows keep

def test_gsm8k_rows_keep_the_extracted_answer():
    items = [T.Item(f"gsm8k/{i}", "q", GSM8KExample("q", "... #### 42", "42")) for i in range(3)]
    texts = ["So the total is 40 + 2 = 42.\n#### 42", "I think 41 apples.", "I do not know."]
    rows = T.score_texts("gsm8k", items, texts)
    assert [r["extracted"] for r in rows] == ["42", "41", None]
    assert [r["extracted_strict"] for r in rows] == ["42", None, None]
    assert [r["no_answer"] for r in rows] == [False, False, True]
    assert [r["strict"] for r in rows] == [True, False, False]


def _run(status, rc, stderr):
    return RunResult(status, rc, 0.1, "", stderr, True)


@pytest.mark.parametrize("result, code, reason", [
    (_run("passed", 0, ""), "x = 1", None),
    (_run("failed", 1, "Traceback (most recent call last):\n  File \"main.py\", line 3\nAssertionError\n"), "x",
     "assertion failed"),
    (_run("failed", 1, "Traceback (most recent call last):\nAssertionError: want 3\n"), "x", "assertion failed: want 3"),
    (_run("failed", 1, "Traceback (most recent call last):\nNameError: name 'y' is not defined\n"), "x",
     "NameError: name 'y' is not defined"),
    (_run("failed", 1, "Traceback (most recent call last):\n    def f(:\nSyntaxError: invalid syntax\n"), "x",
     "syntax error: invalid syntax"),
    (_run("timeout", None, ""), "x", "timeout"),
    (_run("crash", -11, ""), "x", "crash (signal 11)"),
    (_run("failed", 1, "Traceback (most recent call last):\nAssertionError\n"), "  \n", "empty completion"),
    (_run("failed", 0, "unmask sandbox: the program ended with status 0 before its last statement ran; not a "
                       "pass\n"), "x", "the program ended with status 0 before its last statement ran; not a pass"),
    (_run("failed", 3, ""), "x", "exit status 3"),
])
def test_failure_reason(result, code, reason):
    assert failure_reason(result, code) == reason


def test_failure_reason_is_short():
    long = _run("failed", 1, "Traceback (most recent call last):\nValueError: " + "bad " * 200 + "\n")
    why = failure_reason(long, "x")
    assert why.startswith("ValueError: bad bad") and len(why) <= 160 and "\n" not in why


def test_code_rows_keep_the_failure_reason():
    add = MBPPTask(1, "add", "def add(a, b):\n    return a + b", ("assert add(1, 2) == 3",))
    items = [T.Item(f"Mbpp/{i}", "q", add) for i in range(4)]
    texts = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b", "def add(a, b):\n    return c",
             "[DONE]"]
    rows = T.score_texts("mbpp", items, texts)
    assert [r["status"] for r in rows] == ["passed", "failed", "failed", "failed"]
    assert [r["reason"] for r in rows] == [None, "assertion failed", "NameError: name 'c' is not defined",
                                           "empty completion"]
    he = HumanEvalTask("HumanEval/0", "def one():\n", "one", "    return 1\n",
                       "def check(f):\n    assert f() == 1\n")
    rows = T.score_texts("humaneval", [T.Item("HumanEval/0", he.prompt, he)] * 2,
                         ["    return 1\n", "    while True:\n        pass\n"], timeout_s=1.0)
    assert [r["reason"] for r in rows] == [None, "timeout"]


# ---------------------------------------------------------------- item 7: lm-eval, the real package

LM_EVAL_TASKS = __import__("pathlib").Path(__file__).parent / "data" / "lm_eval"


def test_lm_eval_runs_the_local_gsm8k_task_with_decoder_knobs(tmp_path, monkeypatch, data_dir):
    lm_eval = pytest.importorskip("lm_eval", reason="needs lm-eval: pip install -e '.[lm-eval]' (README, Run the tests)")
    from lm_eval.tasks import TaskManager

    import unmask.api
    from unmask.eval.lm_eval_adapter import UnmaskLM  # noqa: F401  (registers the model "unmask")

    # No hub access: the task reads the local JSONL with the json builder, offline.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    # The YAML names ../shared/data/gsm8k relative to the working directory (the repository root);
    # lay that out around a scratch directory so the test holds wherever the data lives.
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "shared" / "data" / "gsm8k").symlink_to(data_dir / "gsm8k")
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")

    calls = []
    real = unmask.api.generate

    def spy(*args, **kwargs):
        g = real(*args, **kwargs)
        calls.append((args[2], kwargs, g.stats.extra))
        return g

    monkeypatch.setattr(unmask.api, "generate", spy)
    tm = TaskManager(include_path=str(LM_EVAL_TASKS))
    res = lm_eval.simple_evaluate(model="unmask", tasks=["unmask_gsm8k_local"], task_manager=tm, limit=3,
                                  model_args="model=stories260K-dlm,decoder=diffusion,tau=0.7,block_size=8",
                                  batch_size=2, log_samples=True, bootstrap_iters=0)
    row = res["results"]["unmask_gsm8k_local"]
    assert 0.0 <= row["exact_match,flexible-extract"] <= 1.0
    assert res["n-samples"]["unmask_gsm8k_local"]["effective"] == 3
    assert len(res["samples"]["unmask_gsm8k_local"]) == 3
    gold = res["samples"]["unmask_gsm8k_local"][0]["target"]
    assert gold == "18"  # the first test problem of the local file, Janet's ducks
    # The knobs reached the decoder: two batches (3 prompts, batch size 2) of the diffusion decoder
    # with τ = 0.7 and blocks of 8, as its own statistics say.
    assert [c[0] for c in calls] == ["diffusion", "diffusion"]
    assert all(c[1]["tau"] == 0.7 and c[1]["block_size"] == 8 for c in calls)
    assert all(c[2]["block_size"] == 8 and c[2]["policy"] == "threshold" for c in calls)


def test_lm_eval_adapter_needs_a_model():
    pytest.importorskip("lm_eval", reason="needs lm-eval: pip install -e '.[lm-eval]' (README, Run the tests)")
    from unmask.eval.lm_eval_adapter import UnmaskLM

    with pytest.raises(UnmaskError, match="needs a model"):
        UnmaskLM(decoder="ar")
    with pytest.raises(UnmaskError, match="name two models"):
        UnmaskLM(model="stories260K", pretrained="stories260K-sbd")


# ---------------------------------------------------------------- item 6: the stop token in TPF

def test_ar_stopping_on_eos_has_tpf_one(stories):
    from unmask.decode.verify import batch as lossless
    from unmask.decode.engine.running import drain, requests_for

    def static_ar(bundle, prompts, *, max_new_tokens, stop_token_ids):  # the static cache, eagerly
        reqs = requests_for(prompts, max_new_tokens=max_new_tokens, sampling=Sampling())
        return drain(lambda cap: lossless.Verify(bundle, static=True, capacity=cap, ar=True,
                                                 stop_token_ids=stop_token_ids, length=64), reqs)

    prompt = stories.encode("Once upon a time")
    free = DECODERS["ar"].decode(stories, [prompt], max_new_tokens=24)
    stop = free.tokens[0][9]  # make the 10th generated token the stop token
    first = free.tokens[0].index(stop)
    for run in (DECODERS["ar"].decode, static_ar):
        out = run(stories, [prompt], max_new_tokens=24, stop_token_ids=(stop,))
        assert out.tokens[0] == free.tokens[0][:first]  # the text excludes the stop token
        assert out.stats.tokens_per_row == [first] and out.stats.generated == first
        assert out.stats.nfe_per_row == [first + 1] and out.stats.stops_per_row == [1]
        assert out.stats.tpf == 1.0 and out.stats.row(0)["tpf"] == 1.0  # before: first / (first + 1)
    assert free.stats.tpf == 1.0 and free.stats.stops_per_row == [0]


def test_every_decoder_counts_the_stop_token_the_same_way(dlm):
    prompt = dlm.encode("Once upon a time")
    free = DECODERS["diffusion"].decode(dlm, [prompt], max_new_tokens=16, block_size=8, policy="top-k", steps=16)
    assert free.stats.tpf == 1.0  # one token per forward
    stop = free.tokens[0][5]
    first = free.tokens[0].index(stop)
    out = DECODERS["diffusion"].decode(dlm, [prompt], max_new_tokens=16, block_size=8, policy="top-k", steps=16,
                           stop_token_ids=(stop,))
    assert out.tokens[0] == free.tokens[0][:first] and out.stats.stops_per_row == [1]
    # The row's forwards: the 8 of the block holding the stop; TPF counts the stop token too.
    assert out.stats.tpf == pytest.approx((first + 1) / out.stats.nfe_per_row[0])


def test_stop_flags():
    from unmask.decode.engine.stats import stop_flags

    assert stop_flags([[5, 2, 7], [5, 6], [5, -1]], [[5], [5, 6], [5]], (2,)) == [1, 0, 0]
    assert stop_flags([[5, 2]], [[5]], (2,), limit=1) == [0]  # the stop lies past the budget
    assert stop_flags([[5, -1]], [[5]], (-1,)) == [0]  # -1 is "no stop ids", never a stop


# ---------------------------------------------------------------- fault pass after the merge

@pytest.mark.parametrize("T", [1e-6, 1e-3])
def test_multiblock_at_a_tiny_temperature_is_its_greedy_run(T):
    # multiblock's κ read softmax(logits / T): at T = 1e-6 every κ rounded to 1 and whole blocks
    # committed at once (stories260K-mbd: NFE 5 against 26 greedy, tokens differed from position 25)
    bundle = unmask.load("stories260K-mbd")
    prompt = bundle.encode("Once upon a time")
    greedy = DECODERS["multiblock"].decode(bundle, [prompt], max_new_tokens=32)
    cold = DECODERS["multiblock"].decode(bundle, [prompt], max_new_tokens=32, sampling=Sampling(temperature=T, seed=1))
    assert cold.tokens == greedy.tokens and cold.stats.nfe == greedy.stats.nfe


@pytest.mark.parametrize("call, match", [
    (lambda: aup([(1, 50), (2, 10)], 50, y_min_offset=float("nan")), "y_min_offset must be a finite number"),
    (lambda: aup([(1, 50), (2, 49)], 50, alpha=float("nan")), "alpha must be a finite number"),
    (lambda: aup([(1, 50), (2, 49)], 50, y_min_offset=-1), "y_min_offset must be a finite number >= 0"),
    (lambda: aup([(1, 0.5), (2, 40)], 50), "fractions mixed with percent"),
    (lambda: aup([(1, "50")], 50), "pair of numbers"),
    (lambda: aup([(1, True)], 50), "pair of numbers"),
    (lambda: aup([(1, 50, 3)], 50), "pair of numbers"),
    (lambda: aup([(1, 50)], "50"), "y_max must be a number"),
])
def test_aup_refuses_every_malformed_argument_with_one_error(call, match):
    with pytest.raises(UnmaskError, match=match):
        call()


def test_aup_mixed_small_percentages_pass_with_the_unit_named():
    assert aup([(1, 0.5), (2, 40)], 50, unit="percent", y_min_offset=50) > 0


def test_gsm8k_extracts_a_number_longer_than_pythons_int_string_limit():
    # int("9" * 5000) raises ValueError (4,300-digit limit): eval crashed on a long run of 9s
    items = [T.Item("gsm8k/0", "q", GSM8KExample("q", "... #### 42", "42"))]
    row = T.score_texts("gsm8k", items, ["9" * 5000])[0]
    assert row["extracted"] == "9" * 5000 and row["no_answer"] is False
