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
