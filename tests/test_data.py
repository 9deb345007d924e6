"""Training corpora: self-sampled stories, user data files, packing (unmask.train.data)."""

from __future__ import annotations

import json

import pytest
import torch

from unmask.errors import UnmaskError
from unmask.train.data import (
    StoryCorpusConfig,
    dedupe,
    generate_stories,
    load_corpus,
    pack,
    read_documents,
    save_jsonl,
    separator_id,
    split_documents,
)


def _records(n: int) -> list[dict]:
    return [{"ids": [3 + i % 7, 4 + i], "source": "sampled"} for i in range(n)]


def test_dedupe_keeps_first_occurrences_in_order():
    recs = [{"ids": [5, 6], "source": "greedy"}, {"ids": [7], "source": "sampled"},
            {"ids": [5, 6], "source": "sampled"}, {"ids": [7, 7], "source": "greedy"}, {"ids": [7], "source": "greedy"}]
    out = dedupe(recs)
    assert out == [recs[0], recs[1], recs[3]]
    assert dedupe(recs) == out  # deterministic


def test_split_is_seeded_by_document_and_deterministic():
    recs = _records(40)
    a, b = split_documents(recs, 0.1, seed=3), split_documents(recs, 0.1, seed=3)
    assert a == b
    assert [r["ids"] for r in a] == [r["ids"] for r in recs]  # order and content unchanged
    assert sum(r["split"] == "val" for r in a) == 4
    c = split_documents(recs, 0.1, seed=4)
    assert [r["split"] for r in a] != [r["split"] for r in c]
    assert sum(r["split"] == "val" for r in split_documents(_records(3), 0.05, 0)) == 1  # at least one held out
    assert all(r["split"] == "train" for r in split_documents(recs, 0.0, 0))


def test_generated_story_corpus_is_deterministic(stories, tmp_path):
    cfg = StoryCorpusConfig(n_sampled=3, n_greedy=5, seed=1, max_new_tokens=12, prefix_range=(2, 4), batch_size=4,
                            val_fraction=0.25)
    a = generate_stories(stories, cfg)
    assert a == generate_stories(stories, cfg)
    assert {r["source"] for r in a} == {"sampled", "greedy"}
    assert len({tuple(r["ids"]) for r in a}) == len(a) <= 8  # de-duplicated
    assert all(r["split"] in ("train", "val") and isinstance(r["text"], str) and r["ids"] for r in a)
    assert all(1 not in r["ids"] and 2 not in r["ids"] for r in a)  # no BOS/EOS inside a document
    path = save_jsonl(tmp_path / "c.jsonl", a)
    back = [json.loads(line) for line in path.read_text().splitlines()]
    assert back == a
    train, val = load_corpus([path])
    assert len(train) + len(val) == len(a) and len(val) == sum(r["split"] == "val" for r in a)


def test_read_txt_documents_split_on_blank_lines(stories, tmp_path):
    f = tmp_path / "d.txt"
    f.write_text("Once upon a time.\nThe end.\n\n\n  \nTom had a dog.\n")
    docs = read_documents(f, stories.tokenizer)
    assert len(docs) == 2
    assert docs[0]["ids"] == list(stories.tokenizer("Once upon a time.\nThe end.", add_special_tokens=False)["input_ids"])
    assert docs[0]["ids"][0] != stories.bos_token_id  # separators are added by pack


def test_read_jsonl_text_ids_and_split(stories, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "Hi there."}\n\n{"ids": [5, 6, 7], "split": "val"}\n')
    docs = read_documents(f, stories.tokenizer, vocab_size=512)
    assert docs[1] == {"ids": [5, 6, 7], "split": "val"} and docs[0]["split"] is None
    train, val = load_corpus([f], stories.tokenizer)
    assert val == [[5, 6, 7]] and len(train) == 1


@pytest.mark.parametrize("name,content,match", [
    ("missing.jsonl", None, "not found"),
    ("empty.txt", "", "empty"),
    ("blank.txt", "\n \n\n", "no document"),
    ("bad.jsonl", '{"ids": [1, 2]}\nnot json\n', "line 2 is not valid JSON"),
    ("noids.jsonl", '{"foo": 1}\n', "'ids' or 'text'"),
    ("float.jsonl", '{"ids": [1.5]}\n', "list of integers"),
    ("range.jsonl", '{"ids": [600]}\n', "outside the vocabulary"),
    ("split.jsonl", '{"ids": [5], "split": "test"}\n', "split must be"),
    ("data.csv", "a,b\n", "unsupported data file"),
])
def test_bad_data_files_raise_one_line_errors(stories, tmp_path, name, content, match):
    f = tmp_path / name
    if content is not None:
        f.write_text(content)
    with pytest.raises(UnmaskError, match=match) as exc:
        read_documents(f, stories.tokenizer, vocab_size=512)
    assert "\n" not in str(exc.value)


def test_pack_starts_every_document_with_bos():
    docs = [[5, 6, 7], [1, 8, 9], [10, 11, 12, 13]]  # the second already starts with BOS
    chunks = pack(docs, 4, sep_id=1)
    assert chunks.dtype == torch.long and chunks.shape == (2, 5)
    assert chunks.flatten().tolist() == [1, 5, 6, 7, 1, 8, 9, 1, 10, 11]  # tail [12, 13] dropped
    assert pack([[5]], 8, 1).shape == (0, 9)
    with pytest.raises(UnmaskError):
        pack(docs, 0, 1)


def test_separator_falls_back_to_eos(stories):
    class NoBos:
        bos_token_id, eos_token_id = None, 7

    assert separator_id(stories.tokenizer) == 1 and separator_id(NoBos()) == 7


def test_cli_data_stories(tmp_path, capsys):
    from unmask.cli import main

    out = tmp_path / "c.jsonl"
    args = ["data", "stories", "--out", str(out), "--sampled", "2", "--greedy", "2", "--max-new-tokens", "8",
            "--batch-size", "4", "--seed", "5"]
    main(args)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows and set(rows[0]) == {"ids", "text", "source", "split"}
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and "already exists" in capsys.readouterr().err
