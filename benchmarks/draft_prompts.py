"""The chat prompts of benchmarks/draft_sources.py (issue 51): input-grounded ones and open-ended ones.

Input-grounded prompts ask for an answer that copies from the prompt, where a model-free draft
(prompt lookup, suffix decoding) has something to find; they are built deterministically (no
random numbers, fixed rows of the files) from the shared data (``unmask.eval.datasets`` finds it):

  * ``mbpp``: an MBPP solution (eval split), code first, to repeat with a docstring added;
  * ``humaneval``: a HumanEval task (prompt + canonical solution) to repeat with a comment added;
  * ``gsm8k``: a GSM8K test question to repeat word for word, then solve;
  * ``shakespeare``: a tinyshakespeare speech of 4 to 10 lines, to quote the line holding a given
    word, or to rewrite with its lines numbered.

The wording is what SmolLM2-135M-Instruct copies from (checked by eye on its greedy answers): it
rewrites code it is asked to "copy" or "rename", but repeats it to add a docstring or a comment.

Open-ended prompts (:data:`OPEN_ENDED`, written for this benchmark) have nothing to copy: short
questions and story requests.
"""

from __future__ import annotations

import re

from unmask.errors import UnmaskError
from unmask.eval.datasets import find_data_dir, load_gsm8k, load_humaneval, load_mbpp

TASKS = ("mbpp", "humaneval", "gsm8k", "shakespeare")
WORD = re.compile(r"[A-Za-z]{5,}")

OPEN_ENDED = (
    "Write a short story about a dragon who learns to bake bread.",
    "What are three tips for sleeping better?",
    "Tell me a story about a lighthouse keeper and a lost whale.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Write a poem about autumn leaves.",
    "What should I pack for a weekend camping trip?",
    "Invent a new board game and describe how to play it.",
    "How do plants make their food?",
    "Write a short story about a robot who wants to become a gardener.",
    "Give me five ideas for a birthday party for a seven-year-old.",
    "What is the difference between weather and climate?",
    "Describe a perfect day in a city you would like to visit.",
    "Write a bedtime story about a sleepy owl.",
    "How can I become better at public speaking?",
    "Explain what a black hole is in simple words.",
    "Write a letter from a cat to its owner.",
    "What are the benefits of learning a second language?",
    "Tell a story about two friends who find a map in an old book.",
    "Suggest a healthy breakfast and explain why it is healthy.",
    "What would happen if people could breathe under water?",
    "Write a short fable with a moral about patience.",
    "How does a bicycle stay upright when it moves?",
    "Describe the ocean to someone who has never seen it.",
    "Write a story about a girl who can talk to the wind.",
    "What are some good habits for studying?",
    "Why do we have seasons?",
    "Write a dialogue between the sun and the moon.",
    "Give advice to someone starting their first job.",
    "Tell me a story about a small town that loses its clocks.",
    "What makes a good friend?",
    "Write a short adventure story set on a pirate ship.",
    "How do bees make honey?",
    "Describe your ideal library.",
    "Write a story about a snowman who wants to see summer.",
    "What are three ways to reduce waste at home?",
    "Explain how a rainbow forms.",
    "Write a funny story about a dog who thinks he is a cat.",
    "What is the most important invention in history, and why?",
    "Tell a story about a knight who is afraid of the dark.",
    "How can a family save energy in winter?",
)


def _mbpp(n: int, data_dir) -> list[dict]:
    """Every 20th MBPP eval task whose code defines exactly one function: repeat it with a docstring."""
    out = []
    for t in load_mbpp(split="eval", data_dir=data_dir)[::20]:
        names = re.findall(r"^def (\w+)\(", t.code, flags=re.M)
        if len(names) != 1 or len(t.code) > 600:
            continue
        text = (f"```python\n{t.code.strip()}\n```\n\n"
                "Add a one-line docstring to this function. Reply with the full code.")
        out.append({"task": "mbpp", "id": f"mbpp/{t.task_id}", "text": text})
    return out[:n]


def _humaneval(n: int, data_dir) -> list[dict]:
    """Every 8th HumanEval task of at most 900 characters: repeat prompt + canonical solution with a
    comment added."""
    out = []
    for t in load_humaneval(data_dir=data_dir)[::8]:
        code = (t.prompt + t.canonical_solution).strip()
        if len(code) > 900:
            continue
        text = f"Repeat this code, adding the comment `# checked` as its first line:\n\n```python\n{code}\n```"
        out.append({"task": "humaneval", "id": t.task_id, "text": text})
    return out[:n]


def _gsm8k(n: int, data_dir) -> list[dict]:
    """Every 50th GSM8K test question: repeat it, then solve it."""
    out = []
    for i, ex in enumerate(load_gsm8k(split="test", data_dir=data_dir)):
        if i % 50 == 0:
            text = f"Repeat the question below word for word, then solve it.\n\n{ex.question}"
            out.append({"task": "gsm8k", "id": f"gsm8k/test/{i}", "text": text})
    return out[:n]


def speeches(data_dir=None) -> list[tuple[str, list[str]]]:
    """(speaker, lines) of every tinyshakespeare speech, in file order. Raises UnmaskError (one line)
    when ``tinyshakespeare/input.txt`` is not in the data directory."""
    found = find_data_dir(data_dir)
    path = found / "tinyshakespeare" / "input.txt" if found else None
    if path is None or not path.is_file():
        raise UnmaskError(f"tinyshakespeare data not found in {found or 'any data directory'}; pass data_dir= (a "
                          "folder holding tinyshakespeare/input.txt) or set UNMASK_DATA_DIR")
    text = path.read_text(encoding="utf-8")
    out = []
    for block in text.split("\n\n"):
        head, _, body = block.strip().partition(":\n")
        if body:
            out.append((head, body.splitlines()))
    return out


def _shakespeare(n: int, data_dir) -> list[dict]:
    """Every 60th speech of 4 to 10 lines; alternately: quote the line holding a word found in one line
    only (the middle line's longest such word), or rewrite it with its lines numbered."""
    out = []
    for k, (who, lines) in enumerate(s for s in speeches(data_dir)[::60] if 4 <= len(s[1]) <= 10):
        speech = "\n".join(lines)
        if k % 2 == 0:
            mid = lines[len(lines) // 2]
            lone = [w for w in WORD.findall(mid) if sum(w in line for line in lines) == 1]
            if not lone:
                continue
            word = max(lone, key=len)
            text = (f"Here is a speech by {who} from a play by Shakespeare:\n\n{speech}\n\n"
                    f'Quote the line of this speech that contains the word "{word}".')
        else:
            text = f"```\n{speech}\n```\n\nRewrite this text with every line numbered."
        out.append({"task": "shakespeare", "id": f"shakespeare/{k}", "text": text})
    return out[:n]


def grounded_prompts(n: int = 40, data_dir=None) -> list[dict]:
    """``n`` input-grounded prompts ({task, id, text}), ``n // 4`` per task of :data:`TASKS` (the rest from
    the first tasks), interleaved task by task so a prefix of the list mixes every task.
    Raises UnmaskError (one line) when a data file is missing."""
    per = [n // len(TASKS) + (i < n % len(TASKS)) for i in range(len(TASKS))]
    built = [fn(k, data_dir) for fn, k in zip((_mbpp, _humaneval, _gsm8k, _shakespeare), per)]
    return [rows[i] for i in range(max(per)) for rows in built if i < len(rows)]


def open_prompts(n: int = 40) -> list[dict]:
    """The first ``n`` (at most 40) open-ended prompts as {task: "open", id, text}."""
    return [{"task": "open", "id": f"open/{i}", "text": t} for i, t in enumerate(OPEN_ENDED[:n])]
