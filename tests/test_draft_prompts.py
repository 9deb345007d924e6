"""The prompt builder of benchmarks/draft_sources.py (issue 51): deterministic, 40 + 40 distinct prompts."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import load_benchmark

from unmask.errors import UnmaskError
from unmask.eval.datasets import find_data_dir

pytestmark = pytest.mark.skipif(find_data_dir() is None, reason="needs the shared data directory (shared/data)")


def test_the_prompts_are_deterministic_distinct_and_cover_every_task():
    dp = load_benchmark("draft_prompts")
    grounded, again = dp.grounded_prompts(40), load_benchmark("draft_prompts").grounded_prompts(40)
    assert grounded == again
    assert len(grounded) == 40 and len({r["text"] for r in grounded}) == 40 and len({r["id"] for r in grounded}) == 40
    assert Counter(r["task"] for r in grounded) == {t: 10 for t in dp.TASKS}
    assert [r["task"] for r in grounded[:4]] == list(dp.TASKS)  # interleaved: a --quick prefix mixes the tasks
    assert dp.grounded_prompts(8) == grounded[:8]
    opened = dp.open_prompts(40)
    assert opened == dp.open_prompts(40) and len({r["text"] for r in opened}) == 40
    assert not {r["text"] for r in opened} & {r["text"] for r in grounded}


def test_grounded_prompts_hold_the_text_to_copy():
    dp = load_benchmark("draft_prompts")
    by_task = {r["task"]: r["text"] for r in dp.grounded_prompts(4)}
    from unmask.eval.datasets import load_gsm8k, load_mbpp

    assert load_mbpp(split="eval")[0].code.strip() in by_task["mbpp"]
    assert load_gsm8k(split="test")[0].question in by_task["gsm8k"]
    assert "def " in by_task["humaneval"] and "Shakespeare" in by_task["shakespeare"]


def test_a_missing_data_directory_is_a_one_line_error(tmp_path):
    dp = load_benchmark("draft_prompts")
    with pytest.raises(UnmaskError, match="not found"):
        dp.grounded_prompts(4, data_dir=tmp_path)
