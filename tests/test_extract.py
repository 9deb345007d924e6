"""GSM8K answer extraction on hand-made outputs."""

import pytest

from unmask.eval.extract import (
    extract_flexible,
    extract_strict,
    gold_number,
    gsm8k_score,
    normalize_number,
)

GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"


@pytest.mark.parametrize("raw, expected", [
    ("72", "72"), ("$72", "72"), ("1,234", "1234"), ("72.", "72"), ("72.00", "72"),
    ("-3.50", "-3.5"), ("$1,000,000.", "1000000"), ("0.25", "0.25"), ("-$5", "-5"),
    ("n/a", "n/a"),
])
def test_normalize_number(raw, expected):
    assert normalize_number(raw) == expected


@pytest.mark.parametrize("text, strict, flexible", [
    ("She sold 24 in May, so 48 + 24 = 72.\n#### 72", True, True),
    ("48 + 24 = 72 clips.", False, True),                       # no #### line
    ("#### 72\nCheck: 72 - 24 = 48", True, False),              # last number is 48
    ("#### $72.00", True, True),
    ("The total is $1,072.\n#### 1,072", False, False),         # wrong value both ways
    ("Answer: 72\n\nQuestion: Tom has 5 apples...", False, True),  # cut at next question
    ("I am not sure.", False, False),
    ("", False, False),
])
def test_gsm8k_score(text, strict, flexible):
    assert gsm8k_score(text, GOLD) == {"strict": strict, "flexible": flexible}


def test_gold_with_commas_and_bare_gold():
    assert gold_number("... #### 1,450,000") == "1450000"
    assert gsm8k_score("so it costs $1,450,000.\n#### 1450000", "1,450,000") == {
        "strict": True, "flexible": True}


def test_strict_takes_first_marker_flexible_takes_last_number():
    text = "#### -7\nbut actually 9"
    assert extract_strict(text) == "-7"
    assert extract_flexible(text) == "9"
    assert extract_strict("####") is None


@pytest.mark.parametrize("text", [r"The answer is \boxed{\$9{,}500}", r"\boxed{9{,}500}.", r"so $9\,500$ in total",
                                  r"It costs \$9,500.", r"#### 9{,}500"])
def test_latex_thousands_separators_and_escaped_dollars(text):
    # issue 15 item 10: \boxed{$9{,}500} was read as 500
    assert gsm8k_score(text, "#### 9,500")["flexible"]
    assert extract_flexible(r"\boxed{1{,}234{,}567}") == "1234567"
    assert extract_strict(r"#### 9{,}500") == "9500"


def test_every_original_answer_scores_itself():
    import json

    from conftest import DATA_DIR

    paths = [DATA_DIR / "gsm8k" / f"{split}.jsonl" for split in ("train", "test")]
    if not all(p.is_file() for p in paths):
        pytest.skip(f"{paths[0].parent} not found; set UNMASK_DATA_DIR")
    rows = [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.strip()]
    assert len(rows) > 8000
    for r in rows:  # calculator notes <<a*b=c>>, gold "#### 1,450,000"
        assert gsm8k_score(r["answer"], r["answer"]) == {"strict": True, "flexible": True}, r["answer"][-60:]
