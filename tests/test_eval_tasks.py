"""Evaluation tasks end to end: items, scorers, quality measures, the runner and ``unmask eval``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import run_cli

from unmask.errors import UnmaskError
from unmask.eval import quality
from unmask.eval import tasks as T
from unmask.eval.runner import _budget, evaluate
from unmask.eval.story_openings import STORY_OPENINGS

ENV_KEYS = {"unmask", "git_sha", "torch", "transformers", "cpu", "gpu", "device", "dtype", "batch_size"}
ROW_KEYS = {"id", "prompt", "text", "n_tokens", "nfe", "tpf", "tps", "seconds", "config", "env"}


# ---------------------------------------------------------------- quality measures


def test_distinct_n():
    assert quality.distinct_n([1, 2, 3, 4, 5], 4) == 1.0
    assert quality.distinct_n([1, 2, 1, 2, 1, 2, 1], 4) == 2 / 4  # (1,2,1,2) and (2,1,2,1)
    assert quality.distinct_n([1, 2, 3], 4) is None
    with pytest.raises(UnmaskError):
        quality.distinct_n([1, 2], 0)


@pytest.mark.parametrize("a, r, prefix, positional", [
    ([1, 2, 3], [1, 2, 3], 1.0, 1.0),
    ([], [], 1.0, 1.0),
    ([1, 2, 3], [1, 2, 4, 5], 2 / 4, 2 / 4),
    ([9, 2, 3], [1, 2, 3], 0.0, 2 / 3),   # positional keeps counting after the divergence
    ([1, 2], [1, 2, 3, 4], 2 / 4, 2 / 4),  # a shorter continuation is not full agreement
])
def test_agreement(a, r, prefix, positional):
    assert quality.agreement(a, r) == {"prefix": prefix, "positional": positional}


def test_reference_nll_matches_a_manual_teacher_forced_sum(stories):
    prompts = [stories.encode("Once upon a time"), stories.encode("Tom had a big red ball that he loved.")]
    conts = [[403, 407, 261, 378, 300], [300, 301]]
    got = quality.reference_nll(stories, prompts, conts, batch_size=2)  # right-padded batch
    for p, c, nll in zip(prompts, conts, got):
        seq = torch.tensor([p + c])
        logp = torch.log_softmax(stories.model(seq).logits[0].float(), -1)  # (T, V)
        want = -sum(logp[t - 1, seq[0, t]].item() for t in range(len(p), len(p) + len(c))) / len(c)
        assert nll == pytest.approx(want, abs=1e-4)
    assert math.isnan(quality.reference_nll(stories, [prompts[0]], [[]])[0])
    assert quality.judge_prob_pct(0.0) == 100.0


def test_reference_nll_refuses_a_non_causal_judge(stories):
    import dataclasses

    with pytest.raises(UnmaskError, match="judge"):
        quality.reference_nll(dataclasses.replace(stories, kind="masked-diffusion"), [[1]], [[5]])


# ---------------------------------------------------------------- items and scorers


def test_story_openings_fixed_and_limited():
    assert len(STORY_OPENINGS) >= 100 and len(set(STORY_OPENINGS)) == len(STORY_OPENINGS)
    items = T.load_items("stories", limit=5)
    assert [it.prompt for it in items] == list(STORY_OPENINGS[:5])
    assert [it.id for it in items] == [f"story/{i}" for i in range(5)]


def test_bad_task_options():
    with pytest.raises(UnmaskError, match="unknown task"):
        T.get_task("nope")
    with pytest.raises(UnmaskError, match="--shots"):
        T.load_items("stories", shots=2)
    with pytest.raises(UnmaskError, match="--limit"):
        T.load_items("stories", limit=0)


def test_gsm8k_and_code_scorers(data_dir):
    items = T.load_items("gsm8k", limit=2, data_dir=data_dir)
    right = [f"So the answer is\n#### {it.data.target}" for it in items]
    assert T.summarize("gsm8k", T.score_texts("gsm8k", items, right)) == {"strict_pct": 100.0, "flexible_pct": 100.0}
    few = T.load_items("gsm8k", limit=1, shots=2, data_dir=data_dir)[0].prompt
    assert few.count("Question:") == 3 and few.endswith("Answer:")
    he = T.load_items("humaneval", limit=2, data_dir=data_dir)
    scores = T.score_texts("humaneval", he, [it.data.canonical_solution for it in he])
    assert T.summarize("humaneval", scores) == {"pass_at_1_pct": 100.0}
    scores = T.score_texts("humaneval", he, ["    return None\n"] * 2)
    assert T.summarize("humaneval", scores) == {"pass_at_1_pct": 0.0}
    with pytest.raises(UnmaskError, match="0 or 3"):
        T.load_items("mbpp", shots=1, data_dir=data_dir)


def test_budget_is_clipped_to_the_context_with_a_note(stories):
    spec = T.get_task("gsm8k")
    assert _budget(stories, [[1] * 100], None, spec) == (256, None)
    budget, note = _budget(stories, [[1] * 400], None, spec)
    assert budget == 112 and "clipped" in note
    with pytest.raises(UnmaskError, match="context"):
        _budget(stories, [[1] * 500], None, spec)
    assert _budget(stories, [[1] * 500], 4, spec) == (4, None)  # an explicit budget is generate's to check


# ---------------------------------------------------------------- the runner


def test_stories_ar_agrees_with_itself(stories):
    res = evaluate("stories", stories, "ar", limit=3, batch_size=3, max_new_tokens=24, judge=stories)
    assert len(res.rows) == 3
    for row in res.rows:
        assert ROW_KEYS <= set(row) and math.isfinite(row["nll"]) and row["nll"] > 0
        assert row["agreement_prefix"] == row["agreement_positional"] == 1.0
    s = res.summary
    assert s["agreement_positional"] == 1.0 and s["agreement_pct"] == 100.0
    assert s["quality_metric"] == "judge_prob_pct"
    assert s["quality_pct"] == pytest.approx(100 * math.exp(-s["nll"]))
    assert 0 < s["distinct_4"] <= 1 and s["tpf"] == 1.0
    assert s["config"]["agreement_reference"] == "ar@stories260K" and s["config"]["judge"] == "stories260K"


def test_eval_gsm8k_end_to_end_through_the_cli(capsys, tmp_path, data_dir):
    out = tmp_path / "gsm8k.jsonl"
    code, stdout, err = run_cli(capsys, "eval", "--task", "gsm8k", "--model", "stories260K", "--decoder", "ar",
                                "--limit", "3", "--batch-size", "2", "--max-new-tokens", "32",
                                "--data-dir", str(data_dir), "--out", str(out), "--no-progress")
    assert code == 0, err
    assert "flexible_pct" in stdout and "strict_pct" in stdout and "tps" in stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    items, summary = rows[:-1], rows[-1]
    assert [r["type"] for r in items] == ["item"] * 3 and summary["type"] == "summary"
    for r in items:
        assert ROW_KEYS | {"strict", "flexible", "gold"} <= set(r)
        # TPF counts a committed stop token (issue 28 item 6); the text and n_tokens do not.
        assert r["stop_token"] in (0, 1)
        assert r["nfe"] >= 1 and r["n_tokens"] <= 32
        assert r["tpf"] == pytest.approx((r["n_tokens"] + r["stop_token"]) / r["nfe"])
        assert ENV_KEYS <= set(r["env"]) and r["env"]["torch"] == torch.__version__
        assert r["env"]["batch_size"] == 2 and r["env"]["device"] == "cpu" and r["env"]["dtype"] == "float32"
        assert r["config"]["decoder"] == "ar" and r["config"]["max_new_tokens"] == 32
    assert {it["batch"] for it in items} == {0, 1}
    assert 0.0 <= summary["strict_pct"] <= 100.0 and 0.0 <= summary["flexible_pct"] <= 100.0
    assert summary["n"] == 3 and summary["generated"] == sum(r["n_tokens"] for r in items)


def test_missing_data_is_one_line_with_the_fix(capsys, tmp_path):
    code, out, err = run_cli(capsys, "eval", "--task", "gsm8k", "--data-dir", str(tmp_path / "none"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "--data-dir" in lines[0]


def test_eval_refuses_an_option_the_decoder_does_not_take(capsys):
    code, out, err = run_cli(capsys, "eval", "--task", "stories", "--decoder", "ar", "--gamma", "0.1",
                             "--limit", "1", "--no-progress")
    assert code == 2 and "--gamma" in err and len(err.strip().splitlines()) == 1


def test_judge_ids_reencode_text_when_tokenizers_differ(stories):
    from unmask.eval.runner import _judge_ids

    item = T.Item("x", "Once upon a time")
    same = {"prompt_tokens": stories.encode(item.prompt), "tokens": [5, 6], "text": "ignored"}
    assert _judge_ids(stories, [item], [same]) == ([same["prompt_tokens"]], [[5, 6]])
    other = {"prompt_tokens": [1, 2, 3], "tokens": [9999], "text": " there was a cat."}  # another tokenizer's ids
    prompts, conts = _judge_ids(stories, [item], [other])
    full = stories.encode(item.prompt + other["text"])
    assert prompts == [stories.encode(item.prompt)] and conts == [full[len(prompts[0]):]]


# ---------------------------------------------------------------- lm-evaluation-harness adapter

LM_EVAL_TASK = """\
task: unmask_local_stories
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""
LM_EVAL_MC_TASK = """\
task: unmask_local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_adapter_on_a_local_jsonl_task(tmp_path, stories, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="the lm-eval extra is not installed")
    from lm_eval.tasks import TaskManager

    import unmask
    from unmask.eval.lm_eval_adapter import UnmaskLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    prompts = list(STORY_OPENINGS[:2])
    # The target of each prompt is the greedy AR continuation up to its first ".", so exact match is 1.
    ar = unmask.generate(prompts, stories, "ar", max_new_tokens=16, stop=["."])
    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "target": t, "choices": [t, " Zzz qq."], "label": 0}) + "\n"
                            for p, t in zip(prompts, ar.texts)))
    (tmp_path / "gen.yaml").write_text(LM_EVAL_TASK.format(data=data))
    (tmp_path / "mc.yaml").write_text(LM_EVAL_MC_TASK.format(data=data))
    tm = TaskManager(include_path=str(tmp_path))
    res = lm_eval.simple_evaluate(model="unmask", model_args="pretrained=stories260K,decoder=ar",
                                  tasks=["unmask_local_stories", "unmask_local_choice"], task_manager=tm,
                                  batch_size=2, log_samples=False, bootstrap_iters=0)
    assert res["results"]["unmask_local_stories"]["exact_match,none"] == 1.0
    assert res["results"]["unmask_local_choice"]["acc,none"] == 1.0
    lm = UnmaskLM(pretrained="stories260K", decoder="ar")
    assert lm.stats == {"nfe": 0, "generated": 0, "seconds": 0.0}


def test_eval_option_passes_any_decoder_option(capsys, tmp_path):
    out = tmp_path / "rows.jsonl"
    code, stdout, err = run_cli(capsys, "eval", "--task", "stories", "-m", "stories260K-dlm", "--limit", "1", "-n", "8",
                                "-k", "8", "-O", "cache=prefix", "--option", "tau=0.95", "--out", str(out),
                                "--no-progress")
    assert code == 0, err
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["config"]["options"] == {"block_size": 8, "cache": "prefix", "tau": 0.95}
    assert "cache=prefix" in stdout


@pytest.mark.parametrize("argv, match", [
    (["-O", "cache"], "--option needs KEY=VALUE"),
    (["-k", "8", "-O", "block-size=8"], "'block_size' is set twice"),
    (["-O", "cache=prefix", "-O", "cache=dual"], "--option cache is given twice"),
    (["-O", "slots=4"], "slots"),  # the diffusion decoder does not take it: the decoder's own check
    (["-O", "temperature=0.5"], "--option temperature: not a decoder option"),  # has its own flag
    (["-O", "max_new_tokens=5"], "--option max_new_tokens: not a decoder option"),
    (["-O", "on_step=1"], "--option on_step: not a decoder option"),  # a Python hook
    (["-O", "references=1"], "--option references: not a decoder option"),
    (["-d", "early-bird", "-O", "lps=abc"], "--option lps must be true or false"),
    (["-O", "gen_length=4"], "max_new_tokens 8 exceeds gen length 4"),
    (["-O", "gamma=nan"], "--option gamma must be a finite number"),  # as generate's --gamma and the server
    (["-O", "tau=inf"], "--option tau must be a finite number"),
])
def test_eval_option_errors_are_one_line(capsys, argv, match):
    code, out, err = run_cli(capsys, "eval", "--task", "stories", "-m", "stories260K-dlm", "--limit", "1", "-n", "8",
                             "--no-progress", *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and match in lines[0], err
