"""Evaluation tasks: their prompts, generation budgets, stop strings and scorers.

A task turns into a list of :class:`Item` (an id, a prompt and the data its scorer needs) and
scores the generated continuations. Four tasks:

- ``stories``: the 120 built-in story openings (:mod:`unmask.eval.story_openings`); quality
  is label-free (:mod:`unmask.eval.quality`): judge NLL, 100·exp(−NLL), distinct-4 and
  agreement with the greedy AR output of the same model. Quality in percent:
  ``judge_prob_pct`` = 100·exp(−mean NLL).
- ``gsm8k``: zero-shot or k-shot GSM8K test problems, strict and flexible exact match.
  Quality in percent: ``flexible_pct`` (the last number of the answer; base models seldom
  write the ``####`` line the strict extractor needs; *our choice*).
- ``humaneval`` / ``mbpp``: code run in the sandbox, pass@1 in percent (``pass_at_1_pct``).

Running the decoder is :mod:`unmask.eval.runner`'s job; the functions here are pure given
the texts (except the code scorers, which run child processes).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

from unmask.errors import UnmaskError
from unmask.eval import quality
from unmask.eval.code_tasks import (
    HUMANEVAL_FULL_STOPS,
    MBPP_STOPS,
    SPECIAL_STOPS,
    evaluate_humaneval,
    evaluate_mbpp,
)
from unmask.eval.extract import GSM8K_STOP, gsm8k_extract, gsm8k_score


@dataclass(frozen=True)
class Item:
    """One prompt of a task; ``data`` is what the scorer needs (a gold answer, a code task).
    ``messages``: the chat conversation when the task is asked in chat form (``prompt`` is then
    its last user turn)."""

    id: str
    prompt: str
    data: Any = None
    messages: tuple[dict, ...] | None = None

    @property
    def query(self) -> str | list[dict]:
        """What the decoder is given: the conversation, else the prompt text."""
        return list(self.messages) if self.messages is not None else self.prompt


@dataclass(frozen=True)
class TaskSpec:
    """Static facts of a task.

    max_new_tokens: default generation budget. stop: stop strings passed to the decoder (the
    text is cut there; scorers cut again, so a decoder that ignores them changes no score).
    quality_metrics: summary keys in percent a sweep may use as its quality axis, the first
    being the default. default_shots: ``None`` where shots do not apply. chat_stop: the stop
    strings of the chat form where they differ (a chat answer opens with a code fence that
    ``stop`` would cut at).
    """

    name: str
    description: str
    max_new_tokens: int
    stop: tuple[str, ...]
    quality_metrics: tuple[str, ...]
    default_shots: int | None = None
    needs_data: bool = True
    chat_stop: tuple[str, ...] | None = None


TASKS: dict[str, TaskSpec] = {
    "stories": TaskSpec("stories", "continue built-in story openings; judge NLL, distinct-4, agreement with AR",
                        128, (), ("judge_prob_pct", "agreement_pct"), needs_data=False),
    "gsm8k": TaskSpec("gsm8k", "GSM8K test problems; strict and flexible exact match",
                      256, GSM8K_STOP, ("flexible_pct", "strict_pct"), default_shots=0),
    # Only the stops that both post-processing paths cut at, so a restated function survives.
    "humaneval": TaskSpec("humaneval", "HumanEval; code run in the sandbox, pass@1",
                          256, HUMANEVAL_FULL_STOPS, ("pass_at_1_pct",), chat_stop=SPECIAL_STOPS),
    "mbpp": TaskSpec("mbpp", "MBPP evaluation split (tasks 11-510); code run in the sandbox, pass@1",
                     256, MBPP_STOPS, ("pass_at_1_pct",), default_shots=3),
}


def get_task(name: str) -> TaskSpec:
    """The :class:`TaskSpec` named ``name``; raise :class:`UnmaskError` if unknown."""
    if name not in TASKS:
        raise UnmaskError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[name]


def load_items(task: str, *, limit: int | None = None, shots: int | None = None,
               data_dir: str | os.PathLike | None = None, chat: bool = False) -> list[Item]:
    """The task's items in a fixed order, the first ``limit`` of them.

    ``shots``: GSM8K k-shot (first k train problems) or MBPP 0 / 3 shots (tasks 2-4);
    ``None`` = the task default. ``chat``: items in chat form (``Item.messages``): shots become
    earlier user/assistant turns, HumanEval and MBPP ask for a fenced code answer
    (:mod:`unmask.eval.datasets`' ``*_chat_*`` builders). Raises :class:`UnmaskError` for a
    missing data file (the message names ``--data-dir``), shots on a task without them, chat on
    ``stories``, or ``limit`` < 1.
    """
    spec = get_task(task)
    if limit is not None and limit < 1:
        raise UnmaskError(f"--limit must be >= 1, got {limit}; leave it out to evaluate every item")
    if shots is not None and spec.default_shots is None and shots != 0:
        raise UnmaskError(f"--shots does not apply to task {task!r}; drop it")
    shots = spec.default_shots if shots is None else shots
    if task == "stories":
        if chat:
            raise UnmaskError("task stories continues story openings and has no chat form; drop --chat")
        from unmask.eval.story_openings import STORY_OPENINGS

        return [Item(f"story/{i}", text) for i, text in enumerate(STORY_OPENINGS[:limit])]
    from unmask.eval import datasets as ds

    if task == "gsm8k":
        pool = ds.load_gsm8k(split="train", data_dir=data_dir, limit=shots) if shots else ()
        test = ds.load_gsm8k(split="test", data_dir=data_dir, limit=limit)
        if chat:
            return [_chat_item(f"gsm8k/{i}", ds.gsm8k_chat_messages(ex.question, shots=shots, examples=pool), ex)
                    for i, ex in enumerate(test)]
        return [Item(f"gsm8k/{i}", ds.gsm8k_prompt(ex.question, shots=shots, examples=pool), ex)
                for i, ex in enumerate(test)]
    if task == "humaneval":
        if chat:
            return [_chat_item(t.task_id, [{"role": "user", "content": ds.humaneval_chat_prompt(t)}], t)
                    for t in ds.load_humaneval(data_dir=data_dir, limit=limit)]
        return [Item(t.task_id, t.prompt, t) for t in ds.load_humaneval(data_dir=data_dir, limit=limit)]
    if shots not in (0, 3):
        raise UnmaskError(f"MBPP prompts take 0 or 3 shots (the standard tasks 2-4), got {shots}; pass --shots 0 or 3")
    examples = ds.load_mbpp(split="prompt", data_dir=data_dir) if shots else []
    if chat:
        return [_chat_item(f"Mbpp/{t.task_id}", ds.mbpp_chat_messages(t, shots=examples), t)
                for t in ds.load_mbpp(split="eval", data_dir=data_dir, limit=limit)]
    return [Item(f"Mbpp/{t.task_id}", ds.mbpp_prompt(t, shots=examples), t)
            for t in ds.load_mbpp(split="eval", data_dir=data_dir, limit=limit)]


def _chat_item(id: str, messages: list[dict], data: Any) -> Item:
    return Item(id, messages[-1]["content"], data, tuple(messages))


def score_texts(task: str, items: Sequence[Item], texts: Sequence[str], *, workers: int = 2,
                timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Per-item scores of a labelled task (gsm8k, humaneval, mbpp) from generated texts.

    gsm8k: ``{"strict", "flexible", "gold", "extracted", "extracted_strict", "no_answer"}``:
    ``extracted`` is the flexible answer (the last number of the text cut at the stop strings),
    ``extracted_strict`` the number after ``####``, each None when absent; ``no_answer`` is True
    when the text holds no number at all. Code: ``{"passed", "status", "reason"}``, ``reason``
    None for a pass, else one short line (:func:`unmask.eval.code_tasks.failure_reason`:
    assertion, exception type and message, timeout, syntax error, empty completion).
    ``workers`` and ``timeout_s`` are the sandbox's (see :func:`unmask.eval.code_tasks.pass_at_1`).
    """
    if len(items) != len(texts):
        raise UnmaskError(f"{len(items)} items but {len(texts)} texts")
    if task == "gsm8k":
        return [{**gsm8k_score(t, it.data.answer), "gold": it.data.target, **gsm8k_extract(t)}
                for it, t in zip(items, texts)]
    if task in ("humaneval", "mbpp"):
        run = evaluate_humaneval if task == "humaneval" else evaluate_mbpp
        res = run(tasks=[it.data for it in items], completions=list(texts), workers=workers,
                  timeout_s=timeout_s)
        return [{"passed": r.passed, "status": r.status, "reason": why} for r, why in zip(res.results, res.reasons)]
    raise UnmaskError(f"task {task!r} is not scored from texts alone")


def score_stories(tokens: Sequence[Sequence[int]], *, nll: Sequence[float],
                  reference: Sequence[Sequence[int]] | None) -> list[dict[str, Any]]:
    """Per-item story scores: ``nll`` (from :func:`quality.reference_nll`), ``judge_prob_pct``,
    ``distinct_4`` and, given the reference continuations, ``agreement_prefix`` and
    ``agreement_positional`` (``None`` without a reference)."""
    rows = []
    for i, toks in enumerate(tokens):
        agree = quality.agreement(toks, reference[i]) if reference is not None else None
        rows.append({"nll": None if math.isnan(nll[i]) else nll[i],
                     "judge_prob_pct": None if math.isnan(nll[i]) else quality.judge_prob_pct(nll[i]),
                     "distinct_4": quality.distinct_n(toks, 4),
                     "agreement_prefix": agree["prefix"] if agree else None,
                     "agreement_positional": agree["positional"] if agree else None})
    return rows


def summarize(task: str, scores: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Task-level metrics from per-item scores (means over items; accuracies in percent).

    stories: ``nll`` (mean of per-item NLL), ``judge_prob_pct`` = 100·exp(−nll),
    ``distinct_4``, ``agreement_prefix``, ``agreement_positional`` (means, fractions) and
    ``agreement_pct`` = 100·``agreement_positional``, ``identical_pct`` (items whose tokens equal the
    reference's, in percent). gsm8k: ``strict_pct``,
    ``flexible_pct``. code: ``pass_at_1_pct``. Metrics without data are ``None``.
    """
    n = len(scores)
    if task == "stories":
        nll = quality.mean([s["nll"] for s in scores])
        pos = quality.mean([s["agreement_positional"] for s in scores])
        return {"nll": nll, "judge_prob_pct": None if nll is None else quality.judge_prob_pct(nll),
                "distinct_4": quality.mean([s["distinct_4"] for s in scores]),
                "agreement_prefix": quality.mean([s["agreement_prefix"] for s in scores]),
                "agreement_positional": pos, "agreement_pct": None if pos is None else 100.0 * pos,
                "identical_pct": None if pos is None else
                100.0 * quality.mean([float(s["agreement_positional"] == 1.0) for s in scores])}
    pct = lambda key: 100.0 * sum(bool(s[key]) for s in scores) / n if n else None  # noqa: E731
    if task == "gsm8k":
        return {"strict_pct": pct("strict"), "flexible_pct": pct("flexible")}
    if task in ("humaneval", "mbpp"):
        return {"pass_at_1_pct": pct("passed")}
    raise UnmaskError(f"unknown task {task!r}")
