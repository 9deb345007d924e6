"""Self-distillation corpora: a model's own answers to prompts, as training rows.

``unmask data distill`` decodes each prompt with the batched ``ar`` decoder (through
:func:`unmask.generate`: greedy, or sampled with a seed) and writes one JSON line per prompt::

    {"ids": PROMPT_IDS + ANSWER_IDS, "loss_start": len(PROMPT_IDS), "prompt": ..., "answer": ...,
     "source": "gsm8k"|"humaneval"|"mbpp"|<file name>, "index": i, "split": "train"|"val"}

PROMPT_IDS are exactly the ids the model was fed (the chat template's, BOS included where the
template or tokenizer writes one); ANSWER_IDS exactly the generated ids, ending with the stop
token when the model generated one (the decoders drop it from their output; here it is put back,
so that a model trained on the rows learns to stop). With one stop id (``<|im_end|>`` for ChatML
models) that is the id; a model with several (stories260K stops at EOS or BOS) gets the one of
them the model ranks highest at that position, which is the one greedy decoding drew (for sampled
decoding it is the most likely of them). ``prompt`` is the prompt as given (for a ``messages``
row, the last user turn; the row then also holds ``messages``), ``answer`` the decoded answer.

Prompts: ``gsm8k`` (the GSM8K train questions), ``humaneval`` (its 164 prompts: the evaluation
set itself, mind the contamination), ``mbpp`` (the tasks outside the evaluation split: 1-10 and
511-974) in their zero-shot form, and prompt files (``.txt`` one per line, ``.jsonl`` ``prompt``
or ``messages`` rows). Text prompts are put in the chat template as a user turn when the model has
one (the task prompts in the form ``unmask eval`` gives chat models); ``messages`` rows always
are (the plain template for a model without one).

The split is by prompt: a seeded ``val_fraction`` of the prompt indices (see
:func:`unmask.train.data.split_documents`), fixed by the prompt list and the seed.

Settings: every row also holds ``"settings": {"model", "adapter", "dtype", "max_new_tokens",
"temperature", "seed", "val_fraction", "system", "prompts"}`` (``prompts``: how many prompts the
run has), the choices that decide its answer and split. They are kept in the rows rather than in a
sidecar file so that a corpus is one file, written (and replaced) in one piece.

Writing: every option is checked, and the model loaded, before ``out`` is touched. A new ``out``
is created with its first batch and appended to per finished batch (flushed), so a killed run
leaves whole lines plus at most one partial last line, which ``resume`` continues. With
``overwrite`` the corpus is built in a temporary file next to ``out`` and renamed over it only
when complete: a failed or interrupted run leaves the old corpus as it was.

Resuming: ``resume=True`` checks that every whole row belongs to the same prompt list and was
written with the same settings (UnmaskError naming the first differing setting otherwise, the
file untouched), then drops the partial last line and decodes only the prompts whose index is
missing. A prompt index on two lines (a corpus concatenated or edited by hand) is refused, the
file untouched, rather than deduplicated: the two rows may differ, and which one to keep is the
user's decision.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from unmask.errors import UnmaskError

TASK_SOURCES = ("gsm8k", "humaneval", "mbpp")


@dataclass(frozen=True)
class DistillPrompt:
    """One prompt of the corpus: where it comes from and the prompt as given (text, or a
    validated conversation)."""

    source: str
    prompt: str | list


def task_prompts(task: str, *, chat: bool, data_dir: str | os.PathLike | None = None) -> list[str]:
    """The zero-shot prompts of a task source: the user turn ``unmask eval`` gives chat models when
    ``chat``, else the raw prompt. Raises UnmaskError for a missing data file."""
    from unmask.eval import datasets as ds

    if task == "gsm8k":
        questions = [ex.question for ex in ds.load_gsm8k(split="train", data_dir=data_dir)]
        return [ds.gsm8k_chat_prompt(q) if chat else ds.gsm8k_prompt(q, shots=0) for q in questions]
    if task == "humaneval":
        return [ds.humaneval_chat_prompt(t) if chat else t.prompt for t in ds.load_humaneval(data_dir=data_dir)]
    tasks = [t for t in ds.load_mbpp(split="all", data_dir=data_dir) if t.task_id not in ds.MBPP_EVAL_IDS]
    return [ds.mbpp_chat_prompt(t) if chat else ds.mbpp_prompt(t, shots=[]) for t in tasks]


def collect_prompts(sources: Sequence[str | os.PathLike], *, chat: bool, limit: int | None = None,
                    data_dir: str | os.PathLike | None = None) -> list[DistillPrompt]:
    """Every source's prompts in the order given, the first ``limit`` of each.

    A source is ``gsm8k``, ``humaneval``, ``mbpp`` (write ``./gsm8k`` for a file of that name) or
    a ``.txt``/``.jsonl`` prompt file. Raises UnmaskError for an unknown source or a bad file."""
    from unmask.prompts import read_prompts_file

    if not sources:
        raise UnmaskError("no prompts given; pass --prompts gsm8k|humaneval|mbpp|FILE (repeatable)")
    out: list[DistillPrompt] = []
    for src in sources:
        name = str(src)
        if name in TASK_SOURCES:
            prompts, label = task_prompts(name, chat=chat, data_dir=data_dir), name
        else:
            path = Path(src)
            if path.suffix.lower() not in (".txt", ".jsonl") or not path.is_file():
                raise UnmaskError(f"prompt source {name!r} (--prompts) is not gsm8k, humaneval, mbpp or an existing "
                                  ".txt/.jsonl file; pass a task name or a prompt file, not prompt text")
            prompts, label = read_prompts_file(path), path.name
        out += [DistillPrompt(label, p) for p in prompts[:limit]]
    return out


def val_indices(n: int, val_fraction: float, seed: int) -> set[int]:
    """The prompt indices held out for validation (as :func:`split_documents` chooses them)."""
    from unmask.train.data import split_documents

    rows = split_documents([{}] * n, val_fraction, seed)
    return {i for i, r in enumerate(rows) if r["split"] == "val"}


def _shown(prompt: str | list) -> tuple[str, list | None]:
    """(``prompt`` field, ``messages`` field or None) of a row."""
    if isinstance(prompt, str):
        return prompt, None
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return (users[-1] if users else prompt[-1]["content"]), prompt


def with_stop_token(bundle, prompt_ids: list[int], answer: list[int], max_new_tokens: int) -> list[int]:
    """``answer`` with the stop token the decoder dropped put back (module docstring): a row that
    ended before ``max_new_tokens`` ended on a stop token (no stop strings are used here)."""
    stops = sorted(set(bundle.stop_token_ids))
    if len(answer) >= max_new_tokens or not stops:
        return list(answer)
    if len(stops) == 1:
        return [*answer, stops[0]]
    from unmask.compat import forward

    ids = torch.tensor([[*prompt_ids, *answer]], device=bundle.device)  # (1, T)
    pos = torch.arange(ids.shape[1], device=bundle.device)[None]  # (1, T)
    with torch.inference_mode():
        logits = forward(bundle.model, ids, position_ids=pos, logits_to_keep=1)[0, -1]  # (V,)
    # argmax over the stop ids; ties go to the lowest id, as argmax over the vocabulary does
    return [*answer, stops[int(torch.argmax(logits[stops]))]]


_FLAGS = {"adapter": "--adapter", "model": "--model", "dtype": "--dtype", "max_new_tokens": "--max-new-tokens",
          "temperature": "--temperature", "seed": "--seed", "val_fraction": "--val-fraction", "system": "--system",
          "prompts": "--prompts/--limit"}


def run_settings(bundle, *, n_prompts: int, max_new_tokens: int, temperature: float, seed: int,
                 val_fraction: float, system: str | None) -> dict:
    """The ``settings`` every row records (module docstring), in the order a resume compares them."""
    adapter = bundle.meta.get("adapter") or {}
    return {"adapter": adapter.get("name"), "model": bundle.name, "dtype": str(bundle.dtype).removeprefix("torch."),
            "max_new_tokens": max_new_tokens, "temperature": float(temperature), "seed": seed,
            "val_fraction": float(val_fraction), "system": system, "prompts": n_prompts}


def _shown_setting(key: str, value) -> str:
    if value is None:
        return f"no {_FLAGS[key]}"
    if key == "prompts":
        return f"{value} prompts (--prompts, --limit)"
    return f"{_FLAGS[key]} {json.dumps(value) if isinstance(value, str) and key == 'system' else value}"


def _read_existing(out: Path, plan: list[DistillPrompt], settings: dict) -> tuple[set[int], int]:
    """(the prompt indices already in ``out``, the length of its whole lines). Reads only: the
    caller cuts a killed run's partial last line once the resume proceeds. Raises UnmaskError for a
    row that is not one of this corpus's rows or was written with other settings."""
    data = out.read_bytes()
    end = data.rfind(b"\n") + 1
    done: dict[int, int] = {}  # prompt index -> its line
    fix = "resume with the same --prompts, --limit and --model, or pass --overwrite to start over"
    for n, line in enumerate(data[:end].decode("utf-8", errors="replace").splitlines(), 1):
        try:
            row = json.loads(line)
            i = row["index"]
            given = plan[i] if isinstance(i, int) and 0 <= i < len(plan) else None
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UnmaskError(f"{out} line {n} is not a distillation row; {fix}") from None
        if given is None or (row.get("source"), row.get("prompt"), row.get("messages")) != (given.source, *_shown(given.prompt)):
            raise UnmaskError(f"{out} line {n} holds another prompt than prompt {i} of this run; {fix}")
        was = row.get("settings")
        if not isinstance(was, dict):
            raise UnmaskError(f"{out} line {n} records no settings (written by an older unmask), so a resume cannot "
                              "check them; pass --overwrite to start over")
        for key, now in settings.items():
            if was.get(key) != now:
                raise UnmaskError(f"{out} was written with {_shown_setting(key, was.get(key))}, this run has "
                                  f"{_shown_setting(key, now)}; resume with the same flags as the run that wrote "
                                  "it, or pass --overwrite to start over")
        if i in done:  # training on it would count the prompt twice; which copy to keep is the user's call
            raise UnmaskError(f"{out} line {n} repeats prompt {i} of line {done[i]} ({given.source}); a corpus holds "
                              f"each prompt once, delete one of the two lines or pass --overwrite to start over")
        done[i] = n
    return set(done), end


def distill(out: str | os.PathLike, *, model, prompts: Sequence[str | os.PathLike], adapter: str | None = None,
            system: str | None = None, max_new_tokens: int = 256, batch_size: int = 16, temperature: float = 0.0,
            seed: int = 0, limit: int | None = None, val_fraction: float = 0.05, resume: bool = False,
            overwrite: bool = False, data_dir: str | os.PathLike | None = None, device: str = "cpu",
            dtype: str = "float32", progress: Callable[[int, int], None] | None = None) -> dict:
    """``unmask data distill``: write ``model``'s own ``ar`` answers to ``prompts`` as JSONL rows
    (module docstring: row format, stop token, prompt sources, split and resuming).

    model: a ModelBundle, shipped name or directory (``adapter``: its gated SBD adapter).
    system: a system turn for every chat prompt (needs a model with a chat template).
    temperature / seed: 0 = greedy; else sampled with per-row generators seeded by ``seed`` (the
    seed also draws the split). limit: first N prompts of each source. progress:
    ``progress(done, total)`` after every batch. ``out`` is locked against a second writer.

    Returns a summary: out, prompts, written, skipped (already there), tokens written, train/val
    rows written, stopped (answers that ended on a stop token).

    Raises:
        UnmaskError: an existing ``out`` without ``resume`` or ``overwrite`` (or both given), a bad
            source or option, a model the ``ar`` decoder cannot run, ``system`` for a model without
            a chat template, a prompt that does not fit the context, or a resumed ``out`` written
            from other prompts or with other settings or holding a prompt twice (``out`` is then
            left as it was).
    """
    from unmask.fileio import check_output_file, output_lock

    out = Path(out)
    if resume and overwrite:
        raise UnmaskError("--resume and --overwrite contradict each other; pass one of them")
    for name, value, low in (("--batch-size", batch_size, 1), ("--max-new-tokens", max_new_tokens, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise UnmaskError(f"{name} must be an integer >= {low} (got {value!r}); pass e.g. {name} 16")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise UnmaskError(f"--limit must be >= 1 (got {limit!r}); leave it out to use every prompt")
    if not (isinstance(val_fraction, (int, float)) and not isinstance(val_fraction, bool) and 0 <= val_fraction < 1):
        raise UnmaskError(f"--val-fraction must be in [0, 1) (got {val_fraction}); pass e.g. 0.05")
    if dtype not in ("float32", "bfloat16"):
        raise UnmaskError(f"--dtype must be float32 or bfloat16, got {dtype!r}; pass --dtype float32 or bfloat16")
    if system is not None and not isinstance(system, str):
        raise UnmaskError(f"--system must be text (got {type(system).__name__}); pass e.g. --system \"Be brief.\"")
    from unmask.sampling import Sampling

    Sampling(temperature=temperature, seed=seed)  # raises for a bad --temperature or --seed
    check_output_file(out, "--out", probe=True)  # a directory is named as one
    if out.exists() and not (resume or overwrite):
        raise UnmaskError(f"--out {out} already exists; pass --resume to continue it, --overwrite to replace it, "
                          "or choose another path")
    with output_lock(out, "--out"):
        return _distill(out, model=model, prompts=prompts, adapter=adapter, system=system,
                        max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature, seed=seed,
                        limit=limit, val_fraction=val_fraction, resume=resume, overwrite=overwrite,
                        data_dir=data_dir, device=device, dtype=dtype, progress=progress)


def _distill(out: Path, *, model, prompts, adapter, system, max_new_tokens, batch_size, temperature, seed, limit,
             val_fraction, resume, overwrite, data_dir, device, dtype, progress) -> dict:
    from unmask.api import check_fit, generate, prepare_prompts
    from unmask.decode import DECODERS
    from unmask.models import ModelBundle, load
    from unmask.prompts import has_chat_template

    if isinstance(model, ModelBundle) and adapter is not None:
        raise UnmaskError("adapter goes with a model name or directory; load the bundle with its adapter instead")
    bundle = model if isinstance(model, ModelBundle) else load(model, device=device, dtype=dtype, adapter=adapter)
    if bundle.kind not in DECODERS["ar"].kinds:
        raise UnmaskError(f"--model {bundle.name} is a {bundle.kind} model, but answers are decoded autoregressively; "
                          f"pass a {' or '.join(DECODERS['ar'].kinds)} model")
    chat = has_chat_template(bundle)
    if system is not None and not chat:
        raise UnmaskError(f"model {bundle.name} has no chat template, so --system has no turn to go in; drop --system")
    plan = collect_prompts(prompts, chat=chat, limit=limit, data_dir=data_dir)
    val = val_indices(len(plan), val_fraction, seed)
    settings = run_settings(bundle, n_prompts=len(plan), max_new_tokens=max_new_tokens, temperature=temperature,
                            seed=seed, val_fraction=val_fraction, system=system)
    done, whole = _read_existing(out, plan, settings) if resume and out.exists() else (set(), None)
    todo = [i for i in range(len(plan)) if i not in done]
    for i in todo:  # every prompt must fit before the first batch, named by source and number
        try:
            check_fit(bundle, prepare_prompts(bundle, [plan[i].prompt], chat=chat, system=system)[1], max_new_tokens)
        except UnmaskError as e:
            inner = str(e).replace('prompt 1 ', 'it ')  # the wrapped message carries its own "; fix"
            raise UnmaskError(f"{plan[i].source} prompt {i + 1}; {inner}") from None
    counts = {"written": 0, "tokens": 0, "train": 0, "val": 0, "stopped": 0}
    if progress is not None:
        progress(len(done), len(plan))
    if whole is not None and whole < out.stat().st_size:  # the checks passed: cut a killed run's partial line
        with open(out, "r+b") as f:
            f.truncate(whole)
    with _Sink(out, staged=overwrite and not resume) as sink:
        for s in range(0, len(todo), batch_size):
            batch = todo[s:s + batch_size]
            g = generate([plan[i].prompt for i in batch], bundle, "ar", max_new_tokens=max_new_tokens,
                         temperature=temperature, seed=seed, chat=chat, system=system)
            lines = []
            for j, i in enumerate(batch):
                answer = with_stop_token(bundle, g.prompt_tokens[j], g.tokens[j], max_new_tokens)
                shown, messages = _shown(plan[i].prompt)
                row = {"ids": [*g.prompt_tokens[j], *answer], "loss_start": len(g.prompt_tokens[j]), "prompt": shown,
                       "answer": g.texts[j], "source": plan[i].source, "index": i,
                       "split": "val" if i in val else "train"}
                if messages is not None:
                    row["messages"] = messages
                row["settings"] = settings
                lines.append(json.dumps(row, ensure_ascii=False) + "\n")
                counts["tokens"] += len(row["ids"])
                counts[row["split"]] += 1
                counts["stopped"] += len(answer) > len(g.tokens[j])
            sink.write("".join(lines).encode("utf-8"))
            counts["written"] += len(batch)
            if progress is not None:
                progress(len(done) + s + len(batch), len(plan))
    return {"out": str(out), "prompts": len(plan), "skipped": len(done), **counts}


class _Sink:
    """Where the batches go (module docstring, Writing): appended to ``out``, which is created with the
    first batch; or, ``staged``, a temporary file next to ``out`` that replaces it when the ``with``
    block ends normally and is removed when it does not. Every write is whole batches, flushed and
    synced, so a kill leaves at most one partial line."""

    def __init__(self, out: Path, *, staged: bool):
        self.out, self.staged, self.f, self.tmp = out, staged, None, None
        self.created = False  # this run created out (appending): a failed first write removes it again
        again = "rerun with --overwrite" if staged else "rerun with --resume"
        self.fix = f"free some space or choose another --out, then {again}"

    def __enter__(self) -> _Sink:
        return self

    def _open(self) -> None:
        from unmask.fileio import write_errors

        with write_errors(f"--out {self.out}", self.fix):
            if self.staged:
                fd, tmp = tempfile.mkstemp(prefix=f".{self.out.name}.", suffix=".tmp", dir=self.out.parent)
                self.tmp = Path(tmp)
                self.f = os.fdopen(fd, "wb")
            else:
                self.out.parent.mkdir(parents=True, exist_ok=True)
                self.created = not self.out.exists()
                self.f = open(self.out, "ab")

    def write(self, data: bytes) -> None:
        from unmask.fileio import write_errors

        if self.f is None:
            self._open()
        whole = self.f.tell()  # the file ends with whole batches up to here
        try:
            with write_errors(f"--out {self.out}", self.fix):
                self.f.write(data)
                self.f.flush()
                os.fsync(self.f.fileno())
        except BaseException:
            self._cut(whole)
            raise

    def _cut(self, whole: int) -> None:
        """After a failed write (a full disk): drop the partial batch, so that the file holds whole
        lines only, and remove a file this run created and never completed a batch of."""
        import contextlib

        with contextlib.suppress(OSError):
            self.f.close()
        with contextlib.suppress(OSError):
            if self.created and whole == 0 and self.tmp is None:
                self.out.unlink(missing_ok=True)
            else:
                os.truncate(self.tmp if self.tmp is not None else self.out, whole)

    def __exit__(self, kind, value, tb) -> None:
        from unmask.fileio import mark_published, replace_output, write_errors

        try:
            if kind is None:
                if self.f is None:  # nothing to decode: the (empty or resumed) corpus still exists after the run
                    self._open()
                with write_errors(f"--out {self.out}", self.fix):
                    self.f.close()
                    if self.tmp is not None:
                        os.chmod(self.tmp, 0o644)
                        replace_output(self.tmp, self.out)  # a Ctrl-C from here on keeps the corpus (exit 0)
                        self.tmp = None
                    else:
                        mark_published(self.out)  # every row is on disk
        finally:
            if self.f is not None and not self.f.closed:
                self.f.close()
            if self.tmp is not None:  # failed or interrupted: the old corpus stays as it was
                self.tmp.unlink(missing_ok=True)
