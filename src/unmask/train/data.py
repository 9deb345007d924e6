"""Training corpora: a self-sampled story corpus, written as JSONL records.

The user data files, their train/validation split and the packing into (N, L+1) chunks are
:mod:`unmask.train.documents` (re-exported here). Model-kind neutral: SBD, masked-diffusion and
block-diffusion recipes all consume the packed chunks; each objective builds its own layout from them.

Self-sampled corpus (our choice; no TinyStories text is available offline). Two sources:

- ``sampled``: stories drawn at temperature 1.0 from BOS, the model's own distribution;
- ``greedy``: a short prefix sampled at T = 1.0, then the model's *greedy* continuation. This is
  the distribution the model is decoded under, which is what speculative-decoding drafters are
  trained on; in a prototype it roughly doubled SBD's tokens per forward.

A record is ``{"ids": [...], "text": ..., "source": "sampled"|"greedy", "split": "train"|"val"}``;
``ids`` never hold the leading BOS/separator (:func:`unmask.train.documents.pack` adds it).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from unmask.errors import UnmaskError
from unmask.fileio import atomic_write_text
# user data files, splitting and packing; public here too, where recipes import them from
from unmask.train.documents import (SPLITS, check_data_files, load_corpus, load_records, pack,  # noqa: F401
                                    pack_labelled, read_documents, separator_id, split_documents)

SOURCES = ("sampled", "greedy")

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
