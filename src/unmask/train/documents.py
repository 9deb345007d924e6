"""Training documents from user data files, split into train and validation, packed into chunks.

A record is ``{"ids": [...], "split": "train"|"val"|None}`` (plus ``"loss_start"`` for answer-only
training, issue 18); ``ids`` never hold the leading BOS/separator (:func:`pack` adds it).
:func:`pack_labelled` turns ``loss_start`` into an (N, L+1) bool label mask next to the chunks: True
where a token is a loss target, False on prompt tokens and on every separator.
:class:`ChunkSampler` is the order the training loop reads the packed chunks in.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.fileio import file_lines


SPLITS = ("train", "val")


def split_documents(records: Sequence[dict], val_fraction: float, seed: int) -> list[dict]:
    """Return copies of ``records`` with ``split`` set: ``round(n * val_fraction)`` documents
    (at least 1 when val_fraction > 0 and n >= 2) chosen by a ``random.Random(seed)`` shuffle
    go to ``val``. Whole documents only, so no validation text leaks into training chunks."""
    n = len(records)
    n_val = 0 if val_fraction <= 0 or n < 2 else max(1, round(n * val_fraction))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    val = set(order[:n_val])
    return [{**r, "split": "val" if i in val else "train"} for i, r in enumerate(records)]


def check_data_files(paths: Sequence[str | Path]) -> list[Path]:
    """Fail fast, before any model is loaded: every path must be a non-empty .txt/.jsonl file.

    Raises:
        UnmaskError: no path, a missing file, an empty file or an unsupported extension.
    """
    if not paths:
        raise UnmaskError("no data file given; pass --data FILE (.txt or .jsonl)")
    out = []
    for p in map(Path, paths):
        if not p.is_file():
            raise UnmaskError(f"data file not found: {p}; pass an existing .txt or .jsonl file with --data")
        if p.suffix.lower() not in (".txt", ".jsonl"):
            raise UnmaskError(f"unsupported data file {p}; use .txt (documents separated by blank lines) or .jsonl")
        if p.stat().st_size == 0:
            raise UnmaskError(f"data file {p} is empty; give it at least one document")
        out.append(p)
    return out


def read_documents(path: str | Path, tokenizer=None, vocab_size: int | None = None) -> list[dict]:
    """Read one data file into records ``{"ids": [...], "split": "train"|"val"|None}``, plus
    ``"loss_start": int`` where the line gives one.

    ``.txt``: documents separated by blank lines. ``.jsonl``: one object per line with
    ``ids`` (token ids) or ``text``; an optional ``split`` is kept, and an optional
    ``loss_start`` (the index in ``ids`` of the first trained token; tokens before it are a
    prompt that is never a loss target). Text is encoded without special tokens (:func:`pack`
    adds the document separator).

    Raises:
        UnmaskError: a missing/empty/unreadable file, a bad JSONL line, text without a tokenizer,
            ids outside ``[0, vocab_size)``, a ``loss_start`` that is not an integer in
            ``[0, len(ids)]``, or a file holding no document.
    """
    (path,) = check_data_files([path])
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UnmaskError(f"data file {path} is not valid UTF-8; convert it to UTF-8") from None
    except OSError as e:
        raise UnmaskError(f"cannot read data file {path}: {e.strerror or e}; check the path and its "
                          "permissions") from None

    def encode(text: str, where: str) -> list[int]:
        if tokenizer is None:
            raise UnmaskError(f"{where} holds text but no tokenizer was given to encode it; pass the model's "
                              "tokenizer, or give token ids ({'ids': [...]} JSONL lines)")
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    records = []
    if path.suffix.lower() == ".txt":
        for doc in re.split(r"\n\s*\n", raw):
            if doc.strip():
                records.append({"ids": encode(doc.strip(), str(path)), "split": None})
    else:
        for n, line in enumerate(file_lines(raw), 1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UnmaskError(f"{where} is not valid JSON ({e.msg}); fix or remove the line") from None
            except RecursionError:
                raise UnmaskError(f"{where} is nested too deeply to parse; fix or remove the line") from None
            if not isinstance(obj, dict) or ("ids" not in obj and "text" not in obj):
                raise UnmaskError(f"{where} is not an object with 'ids' or 'text'; write each line as "
                                  '{"ids": [...]} or {"text": "..."}')
            if "ids" in obj:
                ids = obj["ids"]
                if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise UnmaskError(f"{where}: 'ids' is not a list of integers; write it as a list of token ids")
            else:
                if not isinstance(obj["text"], str):
                    raise UnmaskError(f"{where}: 'text' is not a string; write the document as one JSON string")
                ids = encode(obj["text"], where)
            split = obj.get("split")
            if split is not None and split not in SPLITS:
                raise UnmaskError(f"{where}: split must be 'train' or 'val', got {split!r}; fix the line or drop "
                                  "its 'split'")
            start = obj.get("loss_start")
            if start is not None and (isinstance(start, bool) or not isinstance(start, int)
                                      or not 0 <= start <= len(ids)):
                raise UnmaskError(f"{where}: loss_start must be an integer in [0, {len(ids)}] (the number of prompt "
                                  f"ids), got {start!r}; fix the line or drop its 'loss_start'")
            if ids:
                records.append({"ids": ids, "split": split, **({} if start is None else {"loss_start": start})})
    records = [r for r in records if r["ids"]]
    if not records:
        raise UnmaskError(f"data file {path} holds no document; put text in it (or 'ids'/'text' JSONL lines)")
    if vocab_size is not None:
        for r in records:
            bad = [i for i in r["ids"] if not 0 <= i < vocab_size]
            if bad:
                raise UnmaskError(f"{path} holds token id {bad[0]} outside the vocabulary of {vocab_size}; "
                                  "was it made with another tokenizer? Regenerate it with this model's tokenizer")
    return records


def load_records(paths: Sequence[str | Path], tokenizer=None, *, vocab_size: int | None = None,
                 val_fraction: float = 0.05, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Records of every file (:func:`read_documents`) -> (train records, validation records).

    Records with an explicit ``split`` keep it. If no record says ``val``, a seeded
    ``val_fraction`` of the documents is held out (:func:`split_documents`).

    Raises:
        UnmaskError: see :func:`read_documents`; every document in the validation split.
    """
    records = []
    for p in check_data_files(paths):
        records += read_documents(p, tokenizer, vocab_size)
    if not any(r["split"] == "val" for r in records):
        records = split_documents(records, val_fraction, seed)
    train = [r for r in records if r["split"] != "val"]
    val = [r for r in records if r["split"] == "val"]
    if not train:
        raise UnmaskError("every document is in the validation split; mark some 'train' or add data")
    return train, val


def load_corpus(paths: Sequence[str | Path], tokenizer=None, *, vocab_size: int | None = None,
                val_fraction: float = 0.05, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Documents of every file -> (train documents, validation documents), each a list of ids
    (:func:`load_records` without the per-record fields).

    Raises:
        UnmaskError: see :func:`load_records`.
    """
    train, val = load_records(paths, tokenizer, vocab_size=vocab_size, val_fraction=val_fraction, seed=seed)
    return [r["ids"] for r in train], [r["ids"] for r in val]


def pack(docs: Sequence[Sequence[int]], seq_len: int, sep_id: int) -> torch.Tensor:
    """Concatenate documents, each starting with ``sep_id`` (BOS), and cut (N, seq_len + 1) chunks.

    The trailing partial chunk is dropped. A document whose first id already is ``sep_id`` gets
    no second one.

    Returns:
        (N, seq_len + 1) long, N >= 0 (0 when the data is shorter than one chunk).
    """
    return pack_labelled(docs, [None] * len(docs), seq_len, sep_id)[0]


def pack_labelled(docs: Sequence[Sequence[int]], loss_starts: Sequence[int | None], seq_len: int,
                  sep_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack`, plus which packed tokens are loss targets (answer-only training, issue 18).

    Token ``j`` of document ``i`` is a target iff ``j >= loss_starts[i]`` (None: every token of
    the document); a separator, added or already leading the document, never is. The chunks
    are exactly :func:`pack`'s.

    Args:
        docs: documents, lists of ids without a leading separator (one there is kept, not doubled).
        loss_starts: one entry per document, an index in ``[0, len(doc)]`` or None.

    Returns:
        (chunks, labels): (N, seq_len + 1) long and (N, seq_len + 1) bool.

    Raises:
        UnmaskError: ``seq_len < 1``, or ``loss_starts`` and ``docs`` of different lengths.
    """
    if seq_len < 1:
        raise UnmaskError(f"--seq-len must be >= 1, got {seq_len}; pass --seq-len 1 or more")
    if len(loss_starts) != len(docs):
        raise UnmaskError(f"{len(loss_starts)} loss starts for {len(docs)} documents; pass one per document")
    stream: list[int] = []
    label: list[bool] = []
    for d, start in zip(docs, loss_starts):
        if not d:
            continue
        start = 0 if start is None else start
        if d[0] != sep_id:
            stream.append(sep_id)
            label.append(False)
        stream.extend(d)
        label.extend(j >= start and not (j == 0 and d[0] == sep_id) for j in range(len(d)))
    n = len(stream) // (seq_len + 1)
    flat = torch.tensor(stream[: n * (seq_len + 1)], dtype=torch.long)  # (N * (L+1),)
    flags = torch.tensor(label[: n * (seq_len + 1)], dtype=torch.bool)  # (N * (L+1),)
    return flat.view(n, seq_len + 1), flags.view(n, seq_len + 1)  # (N, L+1) each


def separator_id(tokenizer) -> int:
    """The id that starts every packed document: BOS, else EOS (Qwen has no BOS).

    Raises:
        UnmaskError: the tokenizer has neither.
    """
    for name in ("bos_token_id", "eos_token_id"):
        i = getattr(tokenizer, name, None)
        if i is not None:
            return int(i)
    raise UnmaskError("the tokenizer has neither a BOS nor an EOS token to separate documents; "
                      "use a base model whose tokenizer has one")


class ChunkSampler:
    """Epoch-wise shuffled mini-batches of chunk indices; its whole state is checkpointed."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise UnmaskError("no training chunk; add data or lower --seq-len")
        self.n = n
        self.generator = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(n, generator=self.generator)  # (n,)
        self.cursor = 0
        self.epoch = 0

    def next(self, size: int) -> torch.Tensor:
        """(size,) long indices; an epoch boundary reshuffles (batches may straddle it)."""
        parts, need = [], size
        while need:
            if self.cursor == self.n:
                self.perm = torch.randperm(self.n, generator=self.generator)
                self.cursor, self.epoch = 0, self.epoch + 1
            take = min(need, self.n - self.cursor)
            parts.append(self.perm[self.cursor : self.cursor + take])
            self.cursor += take
            need -= take
        return torch.cat(parts)  # (size,)

    def state_dict(self) -> dict:
        return {"perm": self.perm, "cursor": self.cursor, "epoch": self.epoch, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if len(state["perm"]) != self.n:
            raise UnmaskError(f"the checkpoint was trained on {len(state['perm'])} chunks, this data packs into "
                              f"{self.n}; resume with the same data and --seq-len, or pass --overwrite")
        self.perm, self.cursor, self.epoch = state["perm"], int(state["cursor"]), int(state["epoch"])
        self.generator.set_state(state["generator"])
