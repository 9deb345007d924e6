"""Training corpora: a self-sampled story corpus, user data files, and packing into chunks.

Model-kind neutral: SBD, masked-diffusion and block-diffusion recipes all consume the packed
(N, L+1) chunks made here; each objective builds its own layout from them.

Self-sampled corpus (our choice; no TinyStories text is available offline). Two sources:

- ``sampled``: stories drawn at temperature 1.0 from BOS, the model's own distribution;
- ``greedy``: a short prefix sampled at T = 1.0, then the model's *greedy* continuation. This is
  the distribution the model is decoded under, which is what speculative-decoding drafters are
  trained on; in a prototype it roughly doubled SBD's tokens per forward.

A record is ``{"ids": [...], "text": ..., "source": "sampled"|"greedy", "split": "train"|"val"}``;
``ids`` never hold the leading BOS/separator (:func:`pack` adds it).

Answer-only training (issue 18): a record may carry ``loss_start``, the index in ``ids`` of its
first trained token (a distilled ``PROMPT_IDS + ANSWER_IDS`` record has ``loss_start =
len(PROMPT_IDS)``). :func:`pack_labelled` turns it into an (N, L+1) bool label mask next to the
chunks: True where a token is a loss target, False on prompt tokens and on every separator.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.fileio import atomic_write_text, file_lines

SOURCES = ("sampled", "greedy")
SPLITS = ("train", "val")


# ---------------------------------------------------------------------------------------------
# Self-sampled corpus
# ---------------------------------------------------------------------------------------------


STORY_SEED_MAX = 2**63 // 100_003 - 1_000_000  # seeds of the batches: seed * 100_003 + batch


@dataclass(frozen=True)
class StoryCorpusConfig:
    """How :func:`generate_stories` draws its documents.

    n_sampled / n_greedy: documents drawn from each source (before de-duplication).
    max_new_tokens: cap of a sampled story; of a greedy continuation after its prefix.
    prefix_range: inclusive range of the sampled prefix length (tokens after BOS) of a greedy
    document. batch_size: rows per batched AR decode. val_fraction: share of documents held out.
    """

    n_sampled: int = 1000
    n_greedy: int = 1000
    seed: int = 0
    max_new_tokens: int = 320
    prefix_range: tuple[int, int] = (4, 40)
    batch_size: int = 128
    temperature: float = 1.0
    val_fraction: float = 0.05

    def __post_init__(self):
        if self.n_sampled < 0 or self.n_greedy < 0 or self.n_sampled + self.n_greedy == 0:
            raise UnmaskError(f"need at least one document (--sampled {self.n_sampled}, --greedy {self.n_greedy}); "
                              "pass --sampled and --greedy >= 0 with at least one of them > 0")
        lo, hi = self.prefix_range
        if not 1 <= lo <= hi:
            raise UnmaskError(f"prefix_range must satisfy 1 <= low <= high, got {self.prefix_range}; "
                              "pass e.g. prefix_range=(4, 40)")
        if self.max_new_tokens < 1:
            raise UnmaskError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}; "
                              "pass --max-new-tokens 1 or more")
        if self.batch_size < 1:
            raise UnmaskError(f"--batch-size must be >= 1, got {self.batch_size}; pass --batch-size 1 or more")
        if not 0 <= self.val_fraction < 1:
            raise UnmaskError(f"--val-fraction must be in [0, 1), got {self.val_fraction}; "
                              "pass a share below 1, e.g. --val-fraction 0.05")
        # each batch samples with seed * 100_003 + batch (generate_stories): bound the seed so that
        # this stays a valid generator seed, and name the user's value rather than the derived one
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or abs(self.seed) > STORY_SEED_MAX:
            raise UnmaskError(f"--seed must be an integer between -{STORY_SEED_MAX:,} and {STORY_SEED_MAX:,} (got "
                              f"{self.seed!r}); pass e.g. --seed 0")
        if not self.temperature > 0:
            raise UnmaskError(f"temperature must be > 0, got {self.temperature}; pass a positive temperature, e.g. 1.0")


def generate_stories(bundle, config: StoryCorpusConfig, progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Draw a self-sampled corpus with the batched AR decoder, de-duplicate and split it.

    Documents start right after BOS (the decoder is prompted with ``[BOS]``; stories260K's
    stories are BOS-delimited) and end before the stop token, or at ``max_new_tokens``.
    Deterministic for a given model, config and thread count.

    Args:
        bundle: a loaded causal ModelBundle with a BOS token.
        progress: called as ``progress(done_documents, total_documents)`` after each batch.

    Returns:
        records (see module docstring), de-duplicated and split by :func:`split_documents`.

    Raises:
        UnmaskError: the tokenizer has no BOS token.
    """
    from unmask.decode import DECODERS
    from unmask.sampling import Sampling

    bos = bundle.bos_token_id
    if bos is None:
        raise UnmaskError(f"{bundle.name} has no BOS token to start the story documents with; "
                          "pass a --model whose tokenizer has one")
    stop = bundle.stop_token_ids
    total = config.n_sampled + config.n_greedy
    rng = random.Random(config.seed)
    records: list[dict] = []
    batch_no = 0

    def batches(n: int):
        for start in range(0, n, config.batch_size):
            yield min(config.batch_size, n - start)

    for rows in batches(config.n_sampled):
        out = DECODERS["ar"].decode(bundle, [[bos]] * rows, max_new_tokens=config.max_new_tokens,
                     sampling=Sampling(temperature=config.temperature, seed=config.seed * 100_003 + batch_no),
                     stop_token_ids=stop)
        batch_no += 1
        records += [{"ids": ids, "source": "sampled"} for ids in out.tokens]
        if progress:
            progress(len(records), total)
    lo, hi = config.prefix_range
    for rows in batches(config.n_greedy):
        pre = DECODERS["ar"].decode(bundle, [[bos]] * rows, max_new_tokens=hi,
                     sampling=Sampling(temperature=config.temperature, seed=config.seed * 100_003 + batch_no),
                     stop_token_ids=stop)
        batch_no += 1
        prefixes = [ids[: rng.randint(lo, hi)] for ids in pre.tokens]
        out = DECODERS["ar"].decode(bundle, [[bos] + p for p in prefixes], max_new_tokens=config.max_new_tokens,
                     sampling=Sampling(temperature=0.0), stop_token_ids=stop)
        records += [{"ids": p + ids, "source": "greedy"} for p, ids in zip(prefixes, out.tokens)]
        if progress:
            progress(len(records), total)
    records = dedupe([r for r in records if r["ids"]])
    for r in records:
        r["text"] = bundle.tokenizer.decode(r["ids"], skip_special_tokens=True)
    return split_documents(records, config.val_fraction, config.seed)


def story_prompts(bundle, n: int, *, seed: int = 0, prefix_range: tuple[int, int] = (4, 40),
                  exclude: Sequence[str] = (), batch_size: int = 128) -> list[str]:
    """Story openings for a self-distillation corpus (spec/sbd_exact.md §5.5): the sampled
    prefixes of :func:`generate_stories`' greedy documents, as text.

    ``n`` rows are sampled at T = 1.0 from BOS (seeded per batch), each cut to a length drawn from
    ``prefix_range`` (tokens), decoded, stripped and de-duplicated; an opening that starts one of
    ``exclude`` (held-out prompts), or that one of them starts, is dropped. Returns at most ``n``
    prompts, in order. Raises UnmaskError when the tokenizer has no BOS token.
    """
    from unmask.decode import DECODERS
    from unmask.sampling import Sampling

    if bundle.bos_token_id is None:
        raise UnmaskError(f"{bundle.name} has no BOS token to sample openings from; pass a model whose tokenizer "
                          "has one")
    lo, hi = prefix_range
    rng = random.Random(seed)
    held = [e.strip() for e in exclude]
    seen: set[str] = set()
    out: list[str] = []
    for batch_no, start in enumerate(range(0, n, batch_size)):
        rows = min(batch_size, n - start)
        pre = DECODERS["ar"].decode(bundle, [[bundle.bos_token_id]] * rows, max_new_tokens=hi,
                     sampling=Sampling(temperature=1.0, seed=seed * 100_003 + batch_no),
                     stop_token_ids=bundle.stop_token_ids)
        for ids in pre.tokens:
            text = bundle.tokenizer.decode(ids[: rng.randint(lo, hi)], skip_special_tokens=True).strip()
            if text and text not in seen and not any(h.startswith(text) or text.startswith(h) for h in held):
                seen.add(text)
                out.append(text)
    return out


def dedupe(records: Sequence[dict]) -> list[dict]:
    """Drop records whose ``ids`` repeat an earlier record's; order is kept (deterministic)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for r in records:
        key = tuple(r["ids"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


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


def make_story_corpus(out: str | Path, *, model: str = "stories260K", n_sampled: int = 1000, n_greedy: int = 1000,
                      seed: int = 0, overwrite: bool = False, progress: Callable[[int, int], None] | None = None,
                      **options) -> dict:
    """``unmask data stories``: generate a self-sampled corpus with ``model`` and save it as JSONL.

    ``options`` are further :class:`StoryCorpusConfig` fields. Returns counts per source and
    split, and ``dropped``: documents generated twice and kept once, or empty (greedy continuations of
    a small model often coincide), so ``documents`` may be below ``n_sampled + n_greedy``. ``out`` is locked against a second writer for the whole run.

    Raises:
        UnmaskError: an existing ``out`` without ``overwrite``, an unwritable ``out``, another
            process writing ``out``, a model the ``ar`` decoder cannot sample (not causal or sbd),
            or bad options.
    """
    from unmask.fileio import check_output_file, output_lock

    out = Path(out)
    check_output_file(out, "--out", exists_ok=overwrite, probe=True)
    with output_lock(out, "--out"):
        return _make_story_corpus(out, model, n_sampled, n_greedy, seed, overwrite, progress, options)


def _make_story_corpus(out: Path, model: str, n_sampled: int, n_greedy: int, seed: int, overwrite: bool,
                       progress, options: dict) -> dict:
    from unmask.decode import DECODERS
    from unmask.models import load

    if out.exists() and not overwrite:  # again, now that no other writer can be there
        raise UnmaskError(f"{out} already exists; pass --overwrite to replace it or choose another --out")
    try:
        config = StoryCorpusConfig(n_sampled=n_sampled, n_greedy=n_greedy, seed=seed, **options)
    except TypeError as e:
        raise UnmaskError(f"unknown corpus option ({e}); see StoryCorpusConfig") from None
    bundle = load(model)
    if bundle.kind not in DECODERS["ar"].kinds:  # the stories are sampled autoregressively, as the ar decoder does
        raise UnmaskError(f"--model {model} is a {bundle.kind} model, but the corpus is sampled autoregressively; "
                          f"pass a {' or '.join(DECODERS['ar'].kinds)} model, e.g. --model stories260K")
    records = generate_stories(bundle, config, progress)
    save_jsonl(out, records)
    counts = {f"{src}/{split}": 0 for src in SOURCES for split in SPLITS}
    for r in records:
        counts[f"{r['source']}/{r['split']}"] += 1
    return {"out": str(out), "documents": len(records), "dropped": n_sampled + n_greedy - len(records),
            "tokens": sum(len(r["ids"]) for r in records), **counts}


def save_jsonl(path: str | Path, records: Sequence[dict]) -> Path:
    """Write records as JSONL atomically (temporary file + rename)."""
    path = Path(path)
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


# ---------------------------------------------------------------------------------------------
# User data files
# ---------------------------------------------------------------------------------------------


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
