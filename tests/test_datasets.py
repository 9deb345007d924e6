"""Data loaders, prompt builders, code post-processing and pass@1 on canonical solutions."""

import os

import pytest

from unmask.errors import UnmaskError
from unmask.eval import datasets
from unmask.eval.code_tasks import (
    evaluate_humaneval,
    evaluate_mbpp,
    humaneval_program,
    mbpp_program,
    pass_at_1,
    postprocess_humaneval,
    postprocess_mbpp,
)
from unmask.eval.datasets import (
    MBPPTask,
    data_dir_candidates,
    find_data_dir,
    gsm8k_prompt,
    load_gsm8k,
    load_humaneval,
    load_mbpp,
    mbpp_prompt,
)
from unmask.eval.extract import gsm8k_score


@pytest.fixture(scope="module")
def data_dir():
    found = find_data_dir()
    if found is None or not (found / "gsm8k").is_dir():
        pytest.skip("shared/data not found; set UNMASK_DATA_DIR")
    return found


# ---------------------------------------------------------------- data directory


def test_search_order(monkeypatch, tmp_path):
    monkeypatch.delenv(datasets.DATA_DIR_ENV, raising=False)
    defaults = data_dir_candidates()
    assert [p.parts[-2:] for p in defaults] == [("shared", "data")] * 2
    assert defaults[0].parent.parent == type(tmp_path).cwd().parent
    monkeypatch.setenv(datasets.DATA_DIR_ENV, str(tmp_path))
    assert data_dir_candidates() == [tmp_path]
    assert data_dir_candidates(tmp_path / "explicit") == [tmp_path / "explicit"]
    assert find_data_dir() == tmp_path
    assert find_data_dir(tmp_path / "missing") is None


def test_missing_data_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv(datasets.DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(UnmaskError, match=r"GSM8K data not found in .*--data-dir DIR") as err:
        load_gsm8k()
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UnmaskError, match="HumanEval data not found"):
        load_humaneval(data_dir=tmp_path / "nowhere")
    with pytest.raises(UnmaskError, match="MBPP data not found"):
        load_mbpp(data_dir=tmp_path)


# ---------------------------------------------------------------- GSM8K


def test_gsm8k_loader(data_dir):
    test = load_gsm8k(data_dir=data_dir)
    assert len(test) == 1319 and test[0].target == "18"
    assert len(load_gsm8k(split="train", data_dir=data_dir)) == 7473
    assert gsm8k_score(test[0].answer, test[0].answer) == {"strict": True, "flexible": True}
    with pytest.raises(UnmaskError):
        load_gsm8k(split="dev", data_dir=data_dir)


def test_gsm8k_prompts(data_dir):
    q = load_gsm8k(data_dir=data_dir, limit=1)[0].question
    zero = gsm8k_prompt(q)
    assert zero.endswith(f"Question: {q}\nAnswer:") and "####" in zero
    five = gsm8k_prompt(q, shots=5, data_dir=data_dir)
    assert five == gsm8k_prompt(q, shots=5, data_dir=data_dir)   # deterministic
    assert five.count("Question:") == 6 and five.count("\n#### ") == 5
    assert "<<" not in five and five.endswith("\nAnswer:")
    first = load_gsm8k(split="train", data_dir=data_dir, limit=1)[0]
    assert five.startswith(f"Question: {first.question}")
    with pytest.raises(UnmaskError):
        gsm8k_prompt(q, shots=3, examples=[first])


# ---------------------------------------------------------------- HumanEval


@pytest.fixture(scope="module")
def humaneval(data_dir):
    return load_humaneval(data_dir=data_dir)


def test_humaneval_canonical_solutions_all_pass(humaneval):
    # All 164 tasks take ~6 s with 2 workers.
    assert len(humaneval) == 164
    result = evaluate_humaneval(tasks=humaneval,
                                completions=[t.canonical_solution for t in humaneval], workers=2)
    assert result.failed_ids == [] and result.pass_at_1 == 1.0


def test_humaneval_empty_body_scores_zero(humaneval):
    tasks = humaneval[:10]
    result = evaluate_humaneval(tasks=tasks, completions=["    pass\n"] * 10)
    assert result.pass_at_1 == 0.0
    assert {r.status for r in result.results} == {"failed"}


def test_humaneval_postprocess_continuation(humaneval):
    task = humaneval[0]
    noisy = (task.canonical_solution + "\n\ndef extra():\n    return 1\n\n"
             "print(has_close_elements([1.0], 0.5))\n")
    assert postprocess_humaneval(noisy).rstrip() == task.canonical_solution.rstrip()
    assert postprocess_humaneval("    return 1\n# tests\nassert f() == 1") == "    return 1"


def test_humaneval_postprocess_chat_style(humaneval):
    task = humaneval[2]  # truncate_number
    chat = ("Here is the solution:\n```python\ndef helper(x):\n    return x % 1.0\n\n\n"
            f"def {task.entry_point}(number: float) -> float:\n    return helper(number)\n\n\n"
            "if __name__ == '__main__':\n    print(truncate_number(3.5))\n```\nDone.")
    code = postprocess_humaneval(chat, entry_point=task.entry_point)
    assert "helper" in code and "__main__" not in code and "Done" not in code
    assert evaluate_humaneval(tasks=[task], completions=[chat]).pass_at_1 == 1.0
    program = humaneval_program(task, code)
    assert program.startswith(task.prompt) and program.endswith(f"check({task.entry_point})\n")


# ---------------------------------------------------------------- MBPP


@pytest.fixture(scope="module")
def mbpp(data_dir):
    return load_mbpp(data_dir=data_dir)


def test_mbpp_splits(mbpp, data_dir):
    assert len(mbpp) == 500 and [mbpp[0].task_id, mbpp[-1].task_id] == [11, 510]
    assert all("\r" not in t.code for t in mbpp)
    assert [t.task_id for t in load_mbpp(split="prompt", data_dir=data_dir)] == [2, 3, 4]
    assert len(load_mbpp(split="all", data_dir=data_dir)) == 974


def test_mbpp_prompt_format(mbpp, data_dir):
    task = mbpp[0]
    prompt = mbpp_prompt(task, data_dir=data_dir)
    assert prompt.startswith("You are an expert Python programmer, and here is your task: "
                             "Write a function to find the similar elements")
    assert prompt.count("[BEGIN]") == 4 and prompt.count("[DONE]") == 3
    assert prompt.endswith(f"{task.test_list[-1]}\n[BEGIN]\n")
    header = f"task: {task.text} Your code should pass these tests:\n\n{task.test_list[0]}\n"
    assert header in prompt
    assert mbpp_prompt(task, shots=[]).count("[BEGIN]") == 1


SAMPLE_IDS = (11, 12, 17, 100, 200, 300, 367, 400, 450, 510)  # 367 needs its setup code


def test_mbpp_canonical_sample_passes(mbpp):
    tasks = [t for t in mbpp if t.task_id in SAMPLE_IDS]
    completions = [f"{t.code}\n[DONE]\nYou are an expert Python programmer, ..." for t in tasks]
    result = evaluate_mbpp(tasks=tasks, completions=completions)
    assert len(tasks) == 10 and result.pass_at_1 == 1.0, result.failed_ids


def test_mbpp_empty_body_scores_zero(mbpp):
    tasks = [t for t in mbpp if t.task_id in SAMPLE_IDS]
    stubs = ["\n".join(line for line in t.code.split("\n") if line.startswith("def "))
             + "\n    pass" for t in tasks]
    assert evaluate_mbpp(tasks=tasks, completions=stubs).pass_at_1 == 0.0


@pytest.mark.parametrize("raw, code", [
    ("def f():\n    return 1\n[DONE]\nmore", "def f():\n    return 1"),
    ("[BEGIN]\ndef f():\n    return 1\n[DONE]", "def f():\n    return 1"),
    ("```python\ndef f():\n    return 1\n```\n[DONE]", "def f():\n    return 1"),
    ("def f():\r\n    return 1", "def f():\n    return 1"),
])
def test_mbpp_postprocess(raw, code):
    assert postprocess_mbpp(raw) == code


def test_mbpp_program_order():
    task = MBPPTask(1, "t", "class A: pass", ("assert a.x == 1",), "a = A(); a.x = 1")
    assert mbpp_program(task, task.code) == "class A: pass\n\na = A(); a.x = 1\n\nassert a.x == 1\n"
    assert pass_at_1(programs=[mbpp_program(task, task.code)]).pass_at_1 == 1.0


def test_pass_at_1_arguments():
    with pytest.raises(UnmaskError):
        pass_at_1(programs=["pass"], task_ids=["a", "b"])
    assert pass_at_1(programs=[]).pass_at_1 == 0.0
    r = pass_at_1(programs=["pass", "raise SystemExit(3)"], task_ids=["ok", "bad"])
    assert r.pass_at_1 == 0.5 and r.failed_ids == ["bad"]
    assert r.to_dict()["tasks"][1]["status"] == "failed"


def test_data_dir_env_is_respected(monkeypatch, data_dir):
    monkeypatch.setenv(datasets.DATA_DIR_ENV, os.fspath(data_dir))
    assert len(load_gsm8k(limit=3)) == 3


def test_mbpp_scores_test_list_only_unless_challenge_is_asked(mbpp):
    # issue 15 item 11: the published score runs test_list; challenge_test_list is opt-in
    with_challenge = [t for t in mbpp if t.challenge_test_list]
    assert [t.task_id for t in with_challenge] == [11, 16, 20, 23, 25, 26, 28, 42, 43, 44, 47]
    assert all(len(t.test_list) == 3 for t in mbpp)  # the prompt wrapper shows all of them
    task = with_challenge[0]
    plain = mbpp_program(task, task.code)
    assert all(c not in plain for c in task.challenge_test_list)
    hard = mbpp_program(task, task.code, challenge=True)
    assert all(c in hard for c in task.challenge_test_list) and hard.index(task.test_list[-1]) < hard.index(
        task.challenge_test_list[0])
    # every reference solution passes its challenge tests too (the data's own convention)
    result = evaluate_mbpp(tasks=with_challenge, completions=[t.code for t in with_challenge], challenge=True)
    assert result.pass_at_1 == 1.0, result.failed_ids
    assert [t.task_id for t in mbpp if t.test_setup_code] == [367]
