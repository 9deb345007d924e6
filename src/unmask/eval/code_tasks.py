"""HumanEval and MBPP: completion post-processing, program assembly and pass@1.

A model completion becomes a solution and the task's tests (:class:`JudgedProgram`);
:func:`pass_at_1` runs each in the sandbox (:mod:`unmask.eval.sandbox`), the tests in a process
of their own that the solution cannot reach, and reports the fraction whose tests ran to their
end (one sample per task, so pass@1 is the plain mean).

What MBPP scores (audited against google-research ``mbpp/README.md``, Austin et al. 2021 and
lm-eval's ``mbpp`` task): the evaluation split is task_ids 11–510; the prompt is the paper's
wrapper ("You are an expert Python programmer, and here is your task: ... Your code should pass
these tests:" + the 3 ``test_list`` asserts, code between ``[BEGIN]`` and ``[DONE]``, 3 shots from
tasks 2–4); a task passes when the program ``code``, then ``test_setup_code`` (task 367 builds its
tree from the solution's class, so setup must follow the code), then the ``test_list`` asserts
exits 0. ``challenge_test_list`` (extra tests on 11 evaluation tasks) is not part of the published
score and is run only with ``challenge=True``.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from unmask.errors import UnmaskError
from unmask.eval.datasets import HumanEvalTask, MBPPTask
from unmask.eval.extract import truncate_at
from unmask.eval.sandbox import RunResult, run_program

# End-of-text markers a decoder may leave in the text.
SPECIAL_STOPS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "</s>", "<|end_of_text|>")
# Where a HumanEval body continuation ends (the Codex paper's stops, plus asserts and
# fences): a new top-level statement after the function.
HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ",
                   "\n```", *SPECIAL_STOPS)
# A completion that restates the whole function may define helpers after it, so it is
# only cut at top-level code that would run at import.
HUMANEVAL_FULL_STOPS = ("\nif __name__", "\nprint(", "\nassert ", "\n```", *SPECIAL_STOPS)
MBPP_STOPS = ("[DONE]", "\nYou are an expert Python programmer", *SPECIAL_STOPS)

_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)


def _fenced(text: str) -> str | None:
    """The content of the first Markdown code fence (an unclosed one runs to the end)."""
    m = _FENCE.search(text)
    return m.group(1) if m else None


def postprocess_humaneval(completion: str, *, entry_point: str | None = None) -> str:
    """Turn a raw HumanEval completion into text to append to the task prompt.

    - A base-model continuation of the function body is cut at the first of
      :data:`HUMANEVAL_STOPS`.
    - If the text (or its first Markdown fence) restates ``def <entry_point>(`` at column 0,
      as chat models do, the whole code is kept (cut only at :data:`HUMANEVAL_FULL_STOPS`)
      and returned after a newline: appended to the prompt it redefines the function.
    """
    text = completion.replace("\r\n", "\n")
    fenced = _fenced(text)
    code = fenced if fenced is not None else text
    if entry_point and re.search(rf"^def {re.escape(entry_point)}\s*\(", code, re.M):
        return "\n" + truncate_at("\n" + code, HUMANEVAL_FULL_STOPS).lstrip("\n")
    return truncate_at(code, HUMANEVAL_STOPS)


def _unquoted(code: str) -> str:
    """Drop the quotes of the original MBPP prompt's ``[BEGIN] 'code' [DONE]`` form.

    Only when the text starts and ends with one ``'`` (not a triple quote) and is not valid
    Python as it stands: a quoted multi-line program is an unterminated string, while a program
    that merely ends in a string literal compiles and is kept."""
    inner = code.strip()
    if len(inner) < 2 or inner[0] != "'" or inner[-1] != "'" or inner.startswith("'''") or inner.endswith("'''"):
        return code
    try:
        compile(inner, "<mbpp>", "exec")
        return code
    except (SyntaxError, ValueError):
        return inner[1:-1].strip("\n")


def postprocess_mbpp(completion: str) -> str:
    """Turn a raw MBPP completion (after ``[BEGIN]``) into code: cut at ``[DONE]`` or the next
    prompt, drop a repeated ``[BEGIN]``, unwrap a Markdown fence if there is one, and drop the
    quotes of the ``[BEGIN] 'code' [DONE]`` form. Line ends CRLF and CR become LF first."""
    text = completion.replace("\r\n", "\n").replace("\r", "\n")
    text = truncate_at(text, MBPP_STOPS).strip()
    text = text.removeprefix("[BEGIN]").strip()
    fenced = _fenced(text)
    return _unquoted((fenced if fenced is not None else text).strip("\n"))


class JudgedProgram(NamedTuple):
    """A solution and the tests that judge it, run in two processes so that the solution cannot
    reach the verdict: see :func:`unmask.eval.sandbox.run_program` with ``tests``."""

    solution: str
    tests: str


def humaneval_judged(task: HumanEvalTask, completion: str) -> JudgedProgram:
    """Prompt + completion as the solution; the task's ``check`` function + ``check(entry_point)``
    as the tests. ``completion`` is used as given; post-process it first
    (:func:`postprocess_humaneval`)."""
    return JudgedProgram(f"{task.prompt}{completion}\n", f"{task.test}\n\ncheck({task.entry_point})\n")


def humaneval_program(task: HumanEvalTask, completion: str) -> str:
    """Prompt + completion + the task's ``check`` function + ``check(entry_point)``, as one
    program (:func:`humaneval_judged` in one piece).

    ``completion`` is used as given; post-process it first (:func:`postprocess_humaneval`).
    """
    solution, tests = humaneval_judged(task, completion)
    return f"{solution}\n{tests}"


def mbpp_program(task: MBPPTask, code: str, *, challenge: bool = False) -> str:
    """The solution code, then the task's setup code (which may use the solution's
    classes, e.g. task 367), then its ``test_list`` asserts (and ``challenge_test_list``'s
    when ``challenge``)."""
    tests = task.test_list + (task.challenge_test_list if challenge else ())
    parts = [code, task.test_setup_code, "\n".join(tests)]
    return "\n\n".join(p for p in parts if p.strip()) + "\n"


def mbpp_judged(task: MBPPTask, code: str, *, challenge: bool = False) -> JudgedProgram:
    """The solution code as the solution; the task's setup code (which may use the solution's
    classes, e.g. task 367) and its asserts as the tests (see :func:`mbpp_program`)."""
    tests = task.test_list + (task.challenge_test_list if challenge else ())
    parts = [task.test_setup_code, "\n".join(tests)]
    return JudgedProgram(code + "\n", "\n\n".join(p for p in parts if p.strip()) + "\n")


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
_SYNTAX = ("SyntaxError", "IndentationError", "TabError")
REASON_CHARS = 160  # a reason is one short line; the stderr tail keeps the rest


def failure_reason(result: RunResult, code: str | None = None) -> str | None:
    """Why a program did not pass, in one short line; None when it passed.

    ``code`` is the post-processed completion: an empty one is ``"empty completion"`` whatever
    the program did. Otherwise: ``"timeout"``, ``"crash (signal N)"``, ``"assertion failed"``
    (with the assert's message if it has one), ``"syntax error: <message>"``, ``"<ExceptionType>:
    <message>"`` from the traceback's last line (cut to :data:`REASON_CHARS`), the sandbox's own
    note (an exit with status 0 before the last statement, the disk quota), else the exit status.
    """
    if result.passed:
        return None
    if code is not None and not code.strip():
        return "empty completion"
    if result.status == "timeout":
        return "timeout"
    if result.status == "crash":
        rc = result.returncode
        return f"crash (signal {-rc})" if isinstance(rc, int) and rc < 0 else "crash"
    lines = [ln for ln in result.stderr_tail.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if last.startswith("unmask sandbox: "):
        return last.removeprefix("unmask sandbox: ")[:REASON_CHARS]
    m = _EXCEPTION_LINE.match(last)
    if m and "Traceback" in result.stderr_tail:
        name, message = m.group(1), (m.group(2) or "").strip()
        short = name.rsplit(".", 1)[-1]
        if short == "AssertionError":
            reason = "assertion failed" + (f": {message}" if message else "")
        elif short in _SYNTAX:
            reason = f"syntax error: {message}" if message else "syntax error"
        else:
            reason = f"{short}: {message}" if message else short
        return reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 3] + "..."
    return f"exit status {result.returncode}"


@dataclass(frozen=True)
class CodeEvalResult:
    """pass@1 over a task list: ``results[i]`` belongs to ``task_ids[i]``; ``codes[i]`` is the
    post-processed completion when known (for :attr:`reasons`)."""

    task_ids: tuple[str, ...]
    results: tuple[RunResult, ...]
    codes: tuple[str | None, ...] = ()

    @property
    def reasons(self) -> list[str | None]:
        """:func:`failure_reason` per task (None for a pass)."""
        codes = self.codes or (None,) * len(self.results)
        return [failure_reason(r, c) for r, c in zip(self.results, codes)]

    @property
    def pass_at_1(self) -> float:
        """Fraction of tasks whose program passed (0.0 for no tasks)."""
        return sum(r.passed for r in self.results) / len(self.results) if self.results else 0.0

    @property
    def failed_ids(self) -> list[str]:
        return [t for t, r in zip(self.task_ids, self.results) if not r.passed]

    def to_dict(self) -> dict[str, Any]:
        return {"pass_at_1": self.pass_at_1, "n": len(self.results),
                "tasks": [{"task_id": t, "status": r.status, "reason": why, "seconds": round(r.seconds, 4),
                           "stderr_tail": r.stderr_tail[-300:]}
                          for t, r, why in zip(self.task_ids, self.results, self.reasons)]}


def pass_at_1(*, programs: Sequence[str | JudgedProgram], task_ids: Sequence[str] | None = None,
              workers: int = 2, timeout_s: float = 10.0, memory_mb: int = 2048) -> CodeEvalResult:
    """Run one program per task in the sandbox, ``workers`` at a time, and score them.

    Args:
        programs: :class:`JudgedProgram` (from :func:`humaneval_judged` or :func:`mbpp_judged`),
            which passes iff its tests run to their last statement in their own process, or a
            complete Python program (from :func:`humaneval_program` or :func:`mbpp_program`), which
            passes iff it runs to its last statement (the final ``check(...)`` or assert) and exits
            with status 0 in time; see :func:`unmask.eval.sandbox.run_program`. Only the first
            kind's verdict is out of the solution's reach.
        task_ids: names for the report (default: "0", "1", ...).
        workers: concurrent child processes.
        timeout_s, memory_mb: per-program limits, see :func:`unmask.eval.sandbox.run_program`.

    Raises:
        UnmaskError: ``task_ids`` and ``programs`` differ in length, or ``workers`` < 1.
    """
    ids = tuple(task_ids) if task_ids is not None else tuple(map(str, range(len(programs))))
    if len(ids) != len(programs):
        raise UnmaskError(f"pass_at_1: {len(programs)} programs but {len(ids)} task ids")
    if workers < 1:
        raise UnmaskError(f"pass_at_1: workers must be >= 1, got {workers}")
    def run(program: str | JudgedProgram) -> RunResult:
        if isinstance(program, JudgedProgram):
            return run_program(program.solution, tests=program.tests, timeout_s=timeout_s, memory_mb=memory_mb)
        return run_program(program, timeout_s=timeout_s, memory_mb=memory_mb)

    pool = ThreadPoolExecutor(max_workers=workers)  # each thread waits on a child
    try:
        results = tuple(pool.map(run, programs))
    finally:  # on Ctrl-C, drop the programs not started yet instead of running them all first
        pool.shutdown(wait=True, cancel_futures=True)
    return CodeEvalResult(ids, results)


def evaluate_humaneval(*, tasks: Sequence[HumanEvalTask], completions: Sequence[str],
                       postprocess: bool = True, **limits: Any) -> CodeEvalResult:
    """pass@1 of one completion per HumanEval task (``limits`` go to :func:`pass_at_1`)."""
    if len(tasks) != len(completions):
        raise UnmaskError(f"{len(tasks)} HumanEval tasks but {len(completions)} completions")
    codes = [postprocess_humaneval(c, entry_point=t.entry_point) if postprocess else c
             for t, c in zip(tasks, completions)]
    programs = [humaneval_judged(t, c) for t, c in zip(tasks, codes)]
    res = pass_at_1(programs=programs, task_ids=[t.task_id for t in tasks], **limits)
    return CodeEvalResult(res.task_ids, res.results, tuple(codes))


def evaluate_mbpp(*, tasks: Sequence[MBPPTask], completions: Sequence[str],
                  postprocess: bool = True, challenge: bool = False, **limits: Any) -> CodeEvalResult:
    """pass@1 of one completion per MBPP task (``limits`` go to :func:`pass_at_1`); ``challenge``
    adds the ``challenge_test_list`` asserts (not part of the published score)."""
    if len(tasks) != len(completions):
        raise UnmaskError(f"{len(tasks)} MBPP tasks but {len(completions)} completions")
    codes = [postprocess_mbpp(c) if postprocess else c for c in completions]
    programs = [mbpp_judged(t, c, challenge=challenge) for t, c in zip(tasks, codes)]
    res = pass_at_1(programs=programs, task_ids=[f"Mbpp/{t.task_id}" for t in tasks], **limits)
    return CodeEvalResult(res.task_ids, res.results, tuple(codes))
