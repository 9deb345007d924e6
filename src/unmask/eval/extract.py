r"""GSM8K answer extraction and scoring (exact match on the final number).

Two extractors, as lm-eval's GSM8K task has them:

- **strict**: the number right after the first ``####`` (the format of the train answers);
- **flexible**: the last number anywhere in the text.

Numbers are normalised before comparison: ``$`` and thousands commas removed, a trailing
``.`` dropped, and equal values compared as decimals (``18.00`` == ``18``).

Conventions checked (tests/test_extract.py): every train and test answer of the original
dataset (``<<48/2=24>>`` calculator notes, ``#### 1,450,000`` with thousands commas) scores
itself as correct under both extractors; model outputs in LaTeX are read as their numbers:
``\boxed{\$9{,}500}``, ``9\,500`` and ``\$9,500`` are all 9500 (``{,}`` and ``\,`` are LaTeX
thousands separators, ``\$`` an escaped dollar sign).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Sequence

# A number with optional sign, dollar sign, thousands commas and decimals: -$1,234.50
_NUMBER = r"-?\$?\s?-?\d[\d,]*(?:\.\d+)?\.?"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY = re.compile(_NUMBER)

# Where a few-shot continuation starts the next problem (lm-eval's GSM8K ``until``).
GSM8K_STOP = ("Question:", "</s>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>")


def truncate_at(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the earliest occurrence of any stop string (all of it if none)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def normalize_number(raw: str) -> str:
    """Canonical form of a number string: ``"$1,234.50."`` → ``"1234.5"``, ``"18.00"`` →
    ``"18"``. A string that is not a number comes back stripped, unchanged otherwise."""
    s = raw.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if s.startswith("--"):
        s = s[1:]
    try:
        value = Decimal(s)
    except InvalidOperation:
        return raw.strip()
    if not value.is_finite() or value.adjusted() > 10_000:  # NaN/Infinity, or "1e999999999": no digits to write
        return s
    if value == value.to_integral_value():
        # formatted as a Decimal: int() refuses strings of more than 4,300 digits, which a model's
        # long run of 9s reaches (fault pass); "-0" is 0
        return "0" if value == 0 else format(value.to_integral_value(), "f")
    return format(value.normalize(), "f")


# LaTeX thousands separators between digits ({,} and the thin space \,) and escaped dollar signs.
_LATEX_SEP = re.compile(r"(?<=\d)(?:\{,\}|\\,)(?=\d)")


def _unlatex(text: str) -> str:
    """``9{,}500`` -> ``9,500``, ``9\\,500`` -> ``9,500``, ``\\$`` -> ``$`` (before number matching)."""
    return _LATEX_SEP.sub(",", text).replace("\\$", "$")


def extract_strict(text: str) -> str | None:
    """The normalised number after the first ``####``, or ``None``."""
    m = _STRICT.search(_unlatex(text))
    return normalize_number(m.group(1)) if m else None


def extract_flexible(text: str) -> str | None:
    """The normalised last number in ``text``, or ``None``."""
    found = _ANY.findall(_unlatex(text))
    return normalize_number(found[-1]) if found else None


def gold_number(gold_answer: str) -> str:
    """The reference number from a GSM8K ``answer`` field (``... #### 72``) or a bare number."""
    return extract_strict(gold_answer) or normalize_number(gold_answer)


def gsm8k_score(pred_text: str, gold_answer: str, *,
                stop: Sequence[str] = GSM8K_STOP) -> dict[str, bool]:
    """Score one generation against a GSM8K answer.

    Args:
        pred_text: the model's generated text (prompt excluded); it is first cut at the
            earliest ``stop`` string, so a few-shot continuation into the next
            ``Question:`` does not count.
        gold_answer: the dataset's ``answer`` field (ending ``#### N``) or just ``N``.

    Returns:
        ``{"strict": bool, "flexible": bool}``: exact match of the strict and the flexible
        extraction with the normalised gold number.
    """
    text = truncate_at(pred_text, stop)
    gold = gold_number(gold_answer)
    return {"strict": extract_strict(text) == gold, "flexible": extract_flexible(text) == gold}


def gsm8k_extract(pred_text: str, *, stop: Sequence[str] = GSM8K_STOP) -> dict[str, str | bool | None]:
    """The answers :func:`gsm8k_score` compares, for the eval rows: ``{"extracted": flexible number
    or None, "extracted_strict": number after #### or None, "no_answer": no number at all}``
    (normalised, from the text cut at the earliest ``stop`` string)."""
    text = truncate_at(pred_text, stop)
    flexible = extract_flexible(text)
    return {"extracted": flexible, "extracted_strict": extract_strict(text), "no_answer": flexible is None}
