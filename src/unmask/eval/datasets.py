"""Offline evaluation data: GSM8K, HumanEval and MBPP loaders and prompt builders.

The files live in a data directory laid out as ``shared/data`` is (spec README "Data"):
``gsm8k/{train,test}.jsonl``, ``humaneval/HumanEval.jsonl.gz``, ``mbpp/mbpp.jsonl``.
:func:`find_data_dir` says where that directory is looked for.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Sequence

from unmask.errors import UnmaskError

DATA_DIR_ENV = "UNMASK_DATA_DIR"


def data_dir_candidates(explicit: str | os.PathLike | None = None) -> list[Path]:
    """The data directories :func:`find_data_dir` considers, in order.

    1. ``explicit`` (a ``--data-dir`` option), alone if given;
    2. else ``$UNMASK_DATA_DIR``, alone if set;
    3. else ``../shared/data`` relative to the current directory (a checkout next to
       ``shared/``, run from the repository root), then the sibling ``shared/data`` of the
       repository that holds this file (``<repo>/../shared/data``).
    An explicit choice is never silently replaced by a default.
    """
    if explicit is not None:
        return [Path(explicit)]
    if os.environ.get(DATA_DIR_ENV):
        return [Path(os.environ[DATA_DIR_ENV])]
    repo = Path(__file__).resolve().parents[3]  # src/unmask/eval/datasets.py -> repo root
    return [Path.cwd().parent / "shared" / "data", repo.parent / "shared" / "data"]


def find_data_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """The first existing directory of :func:`data_dir_candidates`, or ``None``."""
    return next((p for p in data_dir_candidates(explicit) if p.is_dir()), None)


def _data_file(label: str, rel: str, data_dir: str | os.PathLike | None) -> Path:
    """Locate ``rel`` under the data dir; raise a one-line :class:`UnmaskError` if absent."""
    found = find_data_dir(data_dir)
    if found is not None and (found / rel).is_file():
        return found / rel
    where = found if found is not None else " or ".join(map(str, data_dir_candidates(data_dir)))
    raise UnmaskError(f"{label} data not found in {where}; pass --data-dir DIR (a folder "
                      f"holding {rel}) or set {DATA_DIR_ENV}")


class _Row(dict):
    """A JSONL row whose missing field is a one-line UnmaskError naming the file and line."""

    where = ""

    def __missing__(self, key):
        raise UnmaskError(f"{self.where} lacks the field {key!r}; restore the file from the original data")

    def text(self, key: str) -> str:
        """The field as text; a number, list or null there is a one-line UnmaskError (it failed later as an
        AttributeError on ``.strip``)."""
        value = self[key]
        if not isinstance(value, str):
            raise UnmaskError(f"{self.where}: field {key!r} must be text (got {type(value).__name__}); "
                              "restore the file from the original data")
        return value

    def integer(self, key: str) -> int:
        value = self[key]
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
            raise UnmaskError(f"{self.where}: field {key!r} must be an integer (got {value!r}); "
                              "restore the file from the original data")
        return int(value)


def _jsonl(path: Path) -> Iterator[dict]:
    """The JSON object of each non-blank line. Raises UnmaskError for an unreadable file, a line
    that is not a JSON object, or a row read without a field the caller needs."""
    opener = gzip.open if path.suffix == ".gz" else open
    n = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ValueError("not a JSON object")
                    row = _Row(row)
                    row.where = f"{path} line {n}"
                    yield row
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise UnmaskError(f"{path} line {n + 1 if isinstance(e, (OSError, EOFError)) else n} cannot be read "
                          f"({reason}); restore the file from the original data") from None


# ---------------------------------------------------------------- GSM8K


@dataclass(frozen=True)
class GSM8KExample:
    """One GSM8K problem. ``answer`` is the full solution ending ``#### N``; ``target`` is N."""

    question: str
    answer: str
    target: str


def load_gsm8k(*, split: Literal["train", "test"] = "test",
               data_dir: str | os.PathLike | None = None,
               limit: int | None = None) -> list[GSM8KExample]:
    """Load ``gsm8k/{split}.jsonl`` (1,319 test / 7,473 train rows), in file order.

    Raises :class:`UnmaskError` if the split is unknown or the file is missing.
    """
    if split not in ("train", "test"):
        raise UnmaskError(f"unknown GSM8K split {split!r}; use 'train' or 'test'")
    path = _data_file("GSM8K", f"gsm8k/{split}.jsonl", data_dir)
    rows = [GSM8KExample(r.text("question"), r.text("answer"), r.text("answer").rsplit("####", 1)[-1].strip())
            for r in _jsonl(path)]
    return rows[:limit] if limit is not None else rows


_CALCULATOR = re.compile(r"<<[^<>]*>>")

GSM8K_ZERO_SHOT_INSTRUCTION = ("Solve the following math problem step by step. "
                               "End with a final line of the form '#### <number>'.")


def gsm8k_prompt(question: str, *, shots: int = 0, examples: Sequence[GSM8KExample] = (),
                 data_dir: str | os.PathLike | None = None,
                 strip_calculator: bool = True) -> str:
    """Build a GSM8K prompt in the ``Question: ...\\nAnswer:`` format.

    ``shots = 0``: :data:`GSM8K_ZERO_SHOT_INSTRUCTION`, a blank line, then the question
    (the instruction asks for the ``####`` line the strict extractor reads; *our choice*).
    ``shots = k``: the first k rows of the train split (fixed and deterministic; *our
    choice*, where lm-eval samples with a seed), each as ``Question: q\\nAnswer: a`` with
    calculator annotations ``<<48/2=24>>`` removed, joined by blank lines. ``examples``
    overrides the train split. The prompt ends with ``Answer:`` (no trailing space).
    """
    if shots < 0:
        raise UnmaskError(f"shots must be >= 0, got {shots}; pass --shots 0 for zero-shot")
    query = f"Question: {question.strip()}\nAnswer:"
    if shots == 0:
        return f"{GSM8K_ZERO_SHOT_INSTRUCTION}\n\n{query}"
    pool = list(examples) or load_gsm8k(split="train", data_dir=data_dir, limit=shots)
    if len(pool) < shots:
        raise UnmaskError(f"asked for {shots} shots but only {len(pool)} examples exist; "
                          f"pass --shots {len(pool)} or fewer")
    blocks = []
    for ex in pool[:shots]:
        answer = _CALCULATOR.sub("", ex.answer) if strip_calculator else ex.answer
        blocks.append(f"Question: {ex.question.strip()}\nAnswer: {answer.strip()}")
    return "\n\n".join([*blocks, query])


def gsm8k_chat_prompt(question: str) -> str:
    """The user turn of a zero-shot GSM8K chat prompt: the zero-shot instruction, a blank line and
    ``Question: ...`` (no ``Answer:``; the assistant turn is the answer)."""
    return f"{GSM8K_ZERO_SHOT_INSTRUCTION}\n\nQuestion: {question.strip()}"


def gsm8k_chat_messages(question: str, *, shots: int = 0, examples: Sequence[GSM8KExample] = ()) -> list[dict]:
    """A GSM8K chat conversation: k shots as earlier user/assistant turns (the first k train
    problems, calculator notes removed, as :func:`gsm8k_prompt` takes them), the instruction in the
    first user turn, the question in the last."""
    if len(examples) < shots:
        raise UnmaskError(f"asked for {shots} shots but only {len(examples)} examples exist; "
                          f"pass --shots {len(examples)} or fewer")
    turns = []
    for ex in list(examples)[:shots]:
        turns += [{"role": "user", "content": f"Question: {ex.question.strip()}"},
                  {"role": "assistant", "content": _CALCULATOR.sub("", ex.answer).strip()}]
    turns.append({"role": "user", "content": f"Question: {question.strip()}"})
    turns[0] = {"role": "user", "content": f"{GSM8K_ZERO_SHOT_INSTRUCTION}\n\n{turns[0]['content']}"}
    return turns


# ---------------------------------------------------------------- HumanEval


@dataclass(frozen=True)
class HumanEvalTask:
    """One HumanEval task (the file's fields, unchanged)."""

    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str


def load_humaneval(*, data_dir: str | os.PathLike | None = None,
                   limit: int | None = None) -> list[HumanEvalTask]:
    """Load the 164 tasks of ``humaneval/HumanEval.jsonl.gz`` in task order."""
    path = _data_file("HumanEval", "humaneval/HumanEval.jsonl.gz", data_dir)
    rows = [HumanEvalTask(r.text("task_id"), r.text("prompt"), r.text("entry_point"),
                          r.text("canonical_solution"), r.text("test")) for r in _jsonl(path)]
    return rows[:limit] if limit is not None else rows


HUMANEVAL_CHAT_INSTRUCTION = ("Complete the following Python function. Reply with the whole function, "
                              "imports included, in one Python code block.")


def humaneval_chat_prompt(task: HumanEvalTask) -> str:
    """The user turn of a HumanEval chat prompt: :data:`HUMANEVAL_CHAT_INSTRUCTION` and the task
    prompt in a code fence. A chat model restates the function in a fence, which
    :func:`unmask.eval.code_tasks.postprocess_humaneval` reads (*our choice*, after EvalPlus's
    instruction prompt)."""
    return f"{HUMANEVAL_CHAT_INSTRUCTION}\n\n```python\n{task.prompt.strip()}\n```"


# ---------------------------------------------------------------- MBPP

MBPP_EVAL_IDS = range(11, 511)      # google-research mbpp/README.md: evaluation split
MBPP_PROMPT_IDS = (2, 3, 4)         # the paper's 3-shot prompt tasks


@dataclass(frozen=True)
class MBPPTask:
    """One MBPP task; ``code`` and ``test_setup_code`` have line ends normalised to ``\\n``
    (the file uses ``\\r\\n``, and a few solutions end in a lone ``\\r``)."""

    task_id: int
    text: str
    code: str
    test_list: tuple[str, ...]
    test_setup_code: str = ""
    challenge_test_list: tuple[str, ...] = ()


def load_mbpp(*, split: Literal["eval", "prompt", "all"] = "eval",
              data_dir: str | os.PathLike | None = None,
              limit: int | None = None) -> list[MBPPTask]:
    """Load ``mbpp/mbpp.jsonl``: ``eval`` = task_ids 11–510 (500 tasks), ``prompt`` = tasks
    2, 3, 4, ``all`` = every row; sorted by task_id."""
    if split not in ("eval", "prompt", "all"):
        raise UnmaskError(f"unknown MBPP split {split!r}; use 'eval', 'prompt' or 'all'")
    path = _data_file("MBPP", "mbpp/mbpp.jsonl", data_dir)
    keep = {"eval": set(MBPP_EVAL_IDS), "prompt": set(MBPP_PROMPT_IDS)}.get(split)
    nl = lambda s: s.replace("\r\n", "\n").replace("\r", "\n")  # noqa: E731
    rows = [MBPPTask(r.integer("task_id"), r.text("text"), nl(r.text("code")), tuple(r["test_list"]),
                     nl(r.get("test_setup_code") or ""), tuple(r.get("challenge_test_list") or ()))
            for r in _jsonl(path) if keep is None or r.integer("task_id") in keep]
    rows.sort(key=lambda t: t.task_id)
    return rows[:limit] if limit is not None else rows


def _mbpp_header(task: MBPPTask) -> str:
    tests = "\n".join(task.test_list)
    return (f"You are an expert Python programmer, and here is your task: {task.text} "
            f"Your code should pass these tests:\n\n{tests}\n")


def mbpp_prompt(task: MBPPTask, *, shots: Sequence[MBPPTask] | None = None,
                data_dir: str | os.PathLike | None = None) -> str:
    """The standard MBPP prompt (Austin et al. 2021): 3 shots from tasks 2, 3, 4.

    Each shot is the task header, ``[BEGIN]``, its code and ``[DONE]``; the query ends
    with ``[BEGIN]\\n`` so the model writes code and then ``[DONE]``. ``shots=[]`` gives
    a zero-shot prompt; ``shots=None`` loads tasks 2, 3, 4.
    """
    if shots is None:
        shots = load_mbpp(split="prompt", data_dir=data_dir)
    parts = [f"{_mbpp_header(s)}[BEGIN]\n{s.code.strip()}\n[DONE]\n" for s in shots]
    return "".join(parts) + f"{_mbpp_header(task)}[BEGIN]\n"


MBPP_CHAT_INSTRUCTION = "Reply with the code in one Python code block."


def mbpp_chat_prompt(task: MBPPTask) -> str:
    """The user turn of an MBPP chat prompt: the paper's task header and
    :data:`MBPP_CHAT_INSTRUCTION` (the answer's fence is what
    :func:`unmask.eval.code_tasks.postprocess_mbpp` unwraps)."""
    return f"{_mbpp_header(task)}{MBPP_CHAT_INSTRUCTION}"


def mbpp_chat_messages(task: MBPPTask, *, shots: Sequence[MBPPTask] = ()) -> list[dict]:
    """An MBPP chat conversation: each shot a user turn (its header) and an assistant turn (its code
    in a fence), then the task's user turn (:func:`mbpp_chat_prompt`)."""
    turns = []
    for s in shots:
        turns += [{"role": "user", "content": mbpp_chat_prompt(s)},
                  {"role": "assistant", "content": f"```python\n{s.code.strip()}\n```"}]
    return [*turns, {"role": "user", "content": mbpp_chat_prompt(task)}]
