"""``unmask data distill`` (issue 18 item 3): rows are the prompt ids the model was fed plus its
own greedy AR answer (stop token included), resumable after a kill, refused over an existing file."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import one_line_error, run_cli

import unmask
from unmask.errors import UnmaskError
from unmask.train.distill import distill, with_stop_token

PROMPTS = ["Once upon a time", "The cat sat", "Lily went to the park"]
N = 230  # long enough for "The cat sat" to end on a stop token (after 212 tokens)
KEYS = {"ids", "loss_start", "prompt", "answer", "source", "index", "split", "settings"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, stories):
    """(prompt file, the corpus of one uninterrupted run, its bytes)."""
    d = tmp_path_factory.mktemp("distill")
    f = d / "p.txt"
    f.write_text("\n".join(PROMPTS) + "\n")
    out = d / "full.jsonl"
    summary = distill(out, model=stories, prompts=[f], max_new_tokens=N, batch_size=2, val_fraction=0.34)
    assert summary["written"] == 3 and summary["stopped"] == 1
    return f, out, out.read_bytes()


def test_rows_are_prompt_ids_plus_the_greedy_answer(corpus, stories):
    _, out, _ = corpus
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ref = unmask.generate(PROMPTS, stories, "ar", max_new_tokens=N)
    assert [set(r) for r in rows] == [KEYS] * 3
    assert [r["index"] for r in rows] == [0, 1, 2] and {r["source"] for r in rows} == {"p.txt"}
    assert [r["prompt"] for r in rows] == PROMPTS and [r["answer"] for r in rows] == ref.texts
    assert sorted(r["split"] for r in rows) == ["train", "train", "val"]
    for r, p, t in zip(rows, ref.prompt_tokens, ref.tokens):
        assert r["loss_start"] == len(p) and r["ids"][:len(p)] == p and p[0] == stories.bos_token_id
        answer = r["ids"][len(p):]
        if len(t) == N:
            assert answer == t
        else:  # ended on a stop token: it is kept, and it is the token greedy decoding drew there
            assert answer[:-1] == t
            ids = torch.tensor([p + t])
            with torch.inference_mode():
                nxt = int(stories.model(ids).logits[0, -1].argmax())
            assert answer[-1] == nxt and nxt in stories.stop_token_ids


def test_resume_after_a_kill_gives_the_same_file(corpus, stories, tmp_path):
    f, _, full = corpus
    out = tmp_path / "c.jsonl"
    first = full.index(b"\n") + 1
    out.write_bytes(full[: first + 40])  # one whole row and a partial second one
    summary = distill(out, model=stories, prompts=[f], max_new_tokens=N, batch_size=2, val_fraction=0.34, resume=True)
    assert summary["skipped"] == 1 and summary["written"] == 2
    assert out.read_bytes() == full
    again = distill(out, model=stories, prompts=[f], max_new_tokens=N, batch_size=2, val_fraction=0.34, resume=True)
    assert again["written"] == 0 and out.read_bytes() == full


def test_resume_refuses_rows_of_other_prompts(corpus, stories, tmp_path):
    _, _, full = corpus
    other = tmp_path / "q.txt"
    other.write_text("A dog ran\n")
    out = tmp_path / "c.jsonl"
    out.write_bytes(full)
    with pytest.raises(UnmaskError, match="line 1 .*--overwrite"):
        distill(out, model=stories, prompts=[other], max_new_tokens=4, resume=True)


def test_existing_out_is_refused_without_overwrite(capsys, corpus, tmp_path):
    f, _, full = corpus
    out = tmp_path / "c.jsonl"
    out.write_bytes(full)
    base = ["data", "distill", "--model", "stories260K", "--prompts", f, "--out", out, "-n", "4", "--no-progress"]
    one_line_error(capsys, *base, match="--resume")
    one_line_error(capsys, *base, "--resume", "--overwrite", match="contradict")
    one_line_error(capsys, "data", "distill", "--model", "stories260K", "--prompts", "nope", "--out",
                   tmp_path / "x.jsonl", match="gsm8k, humaneval, mbpp")
    one_line_error(capsys, "data", "distill", "--model", "stories260K", "--prompts", f, "--system", "x", "--out",
                   tmp_path / "x.jsonl", match="no chat template")
    code, stdout, err = run_cli(capsys, *base, "--overwrite")
    assert code == 0, err
    assert "written=3" in stdout and len(out.read_text().splitlines()) == 3


def test_messages_rows_and_task_prompts(stories, tmp_path, data_dir):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "system", "content": "Stories."},
                                          {"role": "user", "content": "A cat"}]}) + "\n")
    out = tmp_path / "c.jsonl"
    distill(out, model=stories, prompts=["gsm8k", f], limit=2, max_new_tokens=4, data_dir=data_dir, val_fraction=0)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["source"], r["index"], r["split"]) for r in rows] == [("gsm8k", 0, "train"), ("gsm8k", 1, "train"),
                                                                     ("p.jsonl", 2, "train")]
    assert rows[0]["prompt"].startswith("Solve the following math problem") and rows[0]["prompt"].endswith("Answer:")
    assert rows[2]["prompt"] == "A cat" and rows[2]["messages"][0]["role"] == "system"
    plain = stories.encode("Stories.\n\nUser: A cat\nAssistant:")
    assert rows[2]["ids"][:rows[2]["loss_start"]] == plain


def test_stop_token_is_put_back(stories):
    class One:  # a bundle with a single stop id needs no forward
        stop_token_ids = (7,)

    assert with_stop_token(One(), [1], [5, 6], 4) == [5, 6, 7]
    assert with_stop_token(One(), [1], [5, 6, 6, 6], 4) == [5, 6, 6, 6]  # ran to the budget: no stop


# Fault-injection findings: options are checked before OUT is touched, --overwrite replaces OUT only
# when complete, and --resume refuses other settings without editing the file.

def _cli(f, out, *extra):
    return ["data", "distill", "--model", "stories260K", "--prompts", f, "--out", out, "-n", "4", "--no-progress",
            *extra]


def _siblings(out):
    """Everything next to ``out`` but ``out`` itself (a temporary or lock file left behind)."""
    return sorted(p.name for p in out.parent.iterdir() if p != out)


@pytest.mark.parametrize("bad, match", [(("--temperature", "-1"), "temperature"),
                                        (("--temperature", "nan"), "temperature"),
                                        (("--dtype", "float16"), "float32 or bfloat16"),
                                        (("--batch-size", "0"), "--batch-size"),
                                        (("--val-fraction", "1"), "--val-fraction")])
def test_a_bad_option_leaves_out_untouched(capsys, corpus, tmp_path, bad, match):
    f, _, full = corpus
    new = tmp_path / "new" / "a.jsonl"
    new.parent.mkdir()
    one_line_error(capsys, *_cli(f, new, *bad), match=match)
    assert not new.exists() and _siblings(new) == []  # no 0-byte file
    good = tmp_path / "good.jsonl"
    good.write_bytes(full)
    one_line_error(capsys, *_cli(f, good, "--overwrite", *bad), match=match)
    assert good.read_bytes() == full and _siblings(good) == ["new"]


def test_out_that_is_a_directory_is_named_as_one(capsys, corpus, tmp_path):
    f, _, _ = corpus
    one_line_error(capsys, *_cli(f, tmp_path), match="is a directory")
    one_line_error(capsys, *_cli(f, tmp_path, "--overwrite"), match="is a directory")


def test_interrupted_overwrite_keeps_the_old_corpus(corpus, stories, tmp_path):
    f, _, full = corpus
    out = tmp_path / "c.jsonl"
    old = b'{"old": "corpus"}\n'
    out.write_bytes(old)

    def stop(done, total):
        if done:  # after the first batch was written (to the temporary file)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(out, model=stories, prompts=[f], max_new_tokens=N, batch_size=2, val_fraction=0.34, overwrite=True,
                progress=stop)
    assert out.read_bytes() == old and _siblings(out) == []
    summary = distill(out, model=stories, prompts=[f], max_new_tokens=N, batch_size=2, val_fraction=0.34,
                      overwrite=True)
    assert summary["written"] == 3 and out.read_bytes() == full and _siblings(out) == []


def test_a_failed_first_batch_leaves_no_new_file(corpus, stories, tmp_path, monkeypatch):
    import unmask.api

    f, _, _ = corpus
    out = tmp_path / "c.jsonl"

    def broken(*args, **kwargs):
        raise UnmaskError("decoding failed; test")

    monkeypatch.setattr(unmask.api, "generate", broken)
    with pytest.raises(UnmaskError, match="decoding failed"):
        distill(out, model=stories, prompts=[f], max_new_tokens=4)
    assert not out.exists() and _siblings(out) == []


def test_rows_record_the_settings(corpus, stories):
    _, out, _ = corpus
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    want = {"adapter": None, "model": "stories260K", "dtype": "float32", "max_new_tokens": N, "temperature": 0.0,
            "seed": 0, "val_fraction": 0.34, "system": None, "prompts": 3}
    assert [r["settings"] for r in rows] == [want] * 3


def _with_settings(full: bytes, **changed) -> bytes:
    rows = [json.loads(line) for line in full.decode().splitlines()]
    for r in rows:
        r["settings"].update(changed)
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.mark.parametrize("run, stored, flag", [
    ({"temperature": 0.7}, {}, "--temperature 0.0"),
    ({"seed": 1}, {}, "--seed 0"),
    ({"max_new_tokens": 8}, {}, f"--max-new-tokens {N}"),
    ({"val_fraction": 0.5}, {}, "--val-fraction 0.34"),
    ({}, {"model": "smollm2"}, "--model smollm2"),
    ({}, {"adapter": "sbd"}, "--adapter sbd"),
    ({}, {"system": "Be brief."}, "--system"),
    ({}, {"dtype": "bfloat16"}, "--dtype bfloat16"),
])
def test_resume_refuses_other_settings_and_leaves_the_file(corpus, stories, tmp_path, run, stored, flag):
    f, _, full = corpus
    out = tmp_path / "c.jsonl"
    first = full.index(b"\n") + 1
    data = _with_settings(full[:first], **stored) + full[first:first + 40]  # a row and a partial line
    out.write_bytes(data)
    options = {"max_new_tokens": N, "batch_size": 2, "val_fraction": 0.34, **run}
    with pytest.raises(UnmaskError) as e:
        distill(out, model=stories, prompts=[f], resume=True, **options)
    msg = str(e.value)
    assert flag in msg and "same flags" in msg and "--overwrite" in msg and "\n" not in msg, msg
    assert out.read_bytes() == data  # refused: the partial line is not cut either


def test_resume_refuses_another_limit_and_rows_without_settings(corpus, stories, tmp_path):
    f, _, full = corpus
    out = tmp_path / "c.jsonl"
    first = full.index(b"\n") + 1
    out.write_bytes(full[:first])
    with pytest.raises(UnmaskError, match="3 prompts .*--limit.*2 prompts"):
        distill(out, model=stories, prompts=[f], max_new_tokens=N, val_fraction=0.34, limit=2, resume=True)
    row = json.loads(full[:first])
    del row["settings"]
    old = (json.dumps(row) + "\n").encode() + b'{"ids": [1'
    out.write_bytes(old)
    with pytest.raises(UnmaskError, match="records no settings.*--overwrite"):
        distill(out, model=stories, prompts=[f], max_new_tokens=N, val_fraction=0.34, resume=True)
    assert out.read_bytes() == old


def test_refused_resume_of_other_prompts_keeps_the_partial_line(corpus, stories, tmp_path):
    _, _, full = corpus
    other = tmp_path / "q.txt"
    other.write_text("A dog ran\n")
    out = tmp_path / "c.jsonl"
    out.write_bytes(full + b'{"ids": [1, 2')
    with pytest.raises(UnmaskError, match="another prompt"):
        distill(out, model=stories, prompts=[other], max_new_tokens=N, val_fraction=0.34, resume=True)
    assert out.read_bytes() == full + b'{"ids": [1, 2'
