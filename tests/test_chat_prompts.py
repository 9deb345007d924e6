"""Chat prompts (issue 18 item 2): the chat template applied to prompts in the API, the CLI, the
server and eval; no second BOS; JSONL prompt files and their one-line errors."""

from __future__ import annotations

import json

import pytest
from conftest import one_line_error, run_cli, tiny_bundle, tiny_llama

import unmask
from unmask.errors import UnmaskError
from unmask.prompts import read_prompts_file

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A Llama-2-like template that writes BOS itself, for a tokenizer that also adds BOS to text.
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")


def byte_tokenizer(specials: list[str], *, bos: str, eos: str, add_bos: bool = False, template: str | None = None):
    """A real transformers fast tokenizer built offline: one token per byte (ids 0-255) and the
    ``specials`` after them; BOS added to every text when ``add_bos``."""
    from tokenizers import Tokenizer, decoders, models, processors
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 256 + specials.index(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=specials[0])
    fast.chat_template = template
    return fast


def chatml_bundle():
    """A tiny Llama with a SmolLM2-like ChatML tokenizer (BOS token = <|im_start|>, none added to
    text); a byte per token, so the context is long enough for GSM8K prompts."""
    tok = byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos="<|im_start|>", eos="<|im_end|>",
                         template=CHATML)
    return tiny_bundle(tiny_llama(vocab=260, max_position_embeddings=1024), tokenizer=tok, stop_token_ids=(258,))


def bos_bundle():
    tok = byte_tokenizer(["<pad>", "<s>", "</s>"], bos="<s>", eos="</s>", add_bos=True, template=BOS_TEMPLATE)
    return tiny_bundle(tiny_llama(vocab=260), tokenizer=tok, stop_token_ids=(258,))


def test_chat_prompt_is_the_template_with_one_bos():
    b = chatml_bundle()
    tok = b.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    g = unmask.generate("Hi there", b, "ar", max_new_tokens=3, chat=True, system="Be brief.")
    assert g.prompt_tokens[0] == want
    assert g.prompts[0] == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert g.prompt_tokens[0][0] == 257 and g.prompt_tokens[0].count(257) == 3  # system, user, assistant
    # a conversation given as messages is the same prompt; so is a list holding it
    assert unmask.generate(messages, b, "ar", max_new_tokens=3).prompt_tokens == g.prompt_tokens
    assert unmask.generate([messages, "Hi"], b, "ar", max_new_tokens=3).prompt_tokens[0] == want
    # without chat the text is continued as it is
    assert unmask.generate("Hi there", b, "ar", max_new_tokens=3).prompt_tokens[0] == tok("Hi there")["input_ids"]


def test_a_template_that_writes_bos_gets_no_second_one():
    b = bos_bundle()
    g = unmask.generate("Hi", b, "ar", max_new_tokens=2, chat=True)
    assert g.prompt_tokens[0][0] == 257 and g.prompt_tokens[0].count(257) == 1
    assert b.encode(g.prompts[0]).count(257) == 2  # what encoding the template text would have fed


def test_model_without_template_gets_the_plain_template(stories):
    g = unmask.generate("Tell me a story", stories, "ar", max_new_tokens=8, chat=True, system="Stories.")
    ref = unmask.generate("Stories.\n\nUser: Tell me a story\nAssistant:", stories, "ar", max_new_tokens=8)
    assert g.prompt_tokens == ref.prompt_tokens and g.tokens == ref.tokens
    assert g.prompts == ref.prompts


def test_server_chat_uses_the_template_ids():
    from unmask.serve.protocol import parse

    b = chatml_bundle()
    messages = [{"role": "user", "content": "Hi"}]
    req = parse({"messages": messages, "max_tokens": 4}, b, "tiny", chat=True, default_timeout=1.0)
    assert req.prompt_ids == b.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                             return_dict=False)
    assert req.prompt_ids[0] == 257  # the old text path dropped this <|im_start|> as if it were an added BOS
    from unmask.serve.errors import ApiError

    with pytest.raises(ApiError, match="unknown parameter 'system'"):  # generate's --system is no decoder knob
        parse({"messages": messages, "system": "x"}, b, "tiny", chat=True, default_timeout=1.0)


def test_api_refuses_bad_chat_input(stories):
    with pytest.raises(UnmaskError, match="chat=True"):
        unmask.generate("Hi", stories, "ar", max_new_tokens=2, system="x")
    with pytest.raises(UnmaskError, match=r"prompt 1\[0\]\.role 'robot'"):
        unmask.generate([[{"role": "robot", "content": "x"}]], stories, "ar", max_new_tokens=2)


def test_prompts_file_rows(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Once upon a time"}\n\n{"messages": [{"role": "user", "content": "Hi"}], "id": 3}\n')
    assert read_prompts_file(f) == ["Once upon a time", [{"role": "user", "content": "Hi"}]]
    t = tmp_path / "p.txt"
    t.write_text("a\n\n b\n")
    assert read_prompts_file(t) == ["a", " b"]


@pytest.mark.parametrize("line, match", [
    ("not json", "line 2: not valid JSON"),
    ('["x"]', "line 2: a JSON list is not a prompt row"),
    ('{"text": "x"}', "line 2: the row has neither 'prompt' nor 'messages'"),
    ('{"prompt": "x", "messages": []}', "both 'prompt' and 'messages'"),
    ('{"prompt": ""}', "'prompt' must be non-empty text"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "line 2: 'messages'[0].role 'robot' is not supported"),
    ('{"messages": [{"role": "user", "content": 3}]}', "line 2: 'messages'[0].content must be text"),
])
def test_bad_prompt_rows_are_one_line_errors(capsys, tmp_path, line, match):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    err = one_line_error(capsys, "generate", "--prompts-file", f, "-m", "stories260K", "-n", "2", match=match)
    assert str(f) in err


def test_cli_chat_and_messages_rows(capsys, tmp_path, stories):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n"
                 + json.dumps({"prompt": "Once upon a time"}) + "\n")
    code, out, err = run_cli(capsys, "generate", "--prompts-file", f, "-m", "stories260K", "-n", "6", "--json",
                             "--no-progress")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0, err
    assert [r["prompt"] for r in rows] == ["User: Hi\nAssistant:", "Once upon a time"]  # messages rows imply chat
    ref = unmask.generate(["User: Hi\nAssistant:", "Once upon a time"], stories, "ar", max_new_tokens=6)
    assert [r["text"] for r in rows] == ref.texts
    code, out, err = run_cli(capsys, "generate", "Hi", "--chat", "--system", "Be kind.", "-m", "stories260K",
                             "-n", "6", "--json", "--no-progress")
    assert code == 0 and json.loads(out)["prompt"] == "Be kind.\n\nUser: Hi\nAssistant:"
    one_line_error(capsys, "generate", "Hi", "--system", "x", "-m", "stories260K", match="add --chat")


def test_eval_items_in_chat_form(data_dir):
    from unmask.eval.code_tasks import postprocess_humaneval, postprocess_mbpp
    from unmask.eval.extract import truncate_at
    from unmask.eval.tasks import TASKS, load_items

    g = load_items("gsm8k", limit=1, shots=2, data_dir=data_dir, chat=True)[0]
    assert [m["role"] for m in g.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert g.prompt.startswith("Question: ") and "<<" not in g.messages[1]["content"]
    h = load_items("humaneval", limit=1, data_dir=data_dir, chat=True)[0]
    assert h.data.prompt.strip() in h.prompt and "```python" in h.prompt
    # a chat answer opens with a fence: the chat stops keep it, the code extraction reads it
    answer = f"Sure:\n```python\n{h.data.prompt}{h.data.canonical_solution}```\nDone.<|im_end|>"
    kept = truncate_at(answer, TASKS["humaneval"].chat_stop)
    assert postprocess_humaneval(kept, entry_point=h.data.entry_point).strip().startswith(
        h.data.prompt.strip().splitlines()[0])
    m = load_items("mbpp", limit=1, data_dir=data_dir, chat=True)[0]
    assert [x["role"] for x in m.messages] == ["user", "assistant"] * 3 + ["user"]
    assert postprocess_mbpp(f"```python\n{m.data.code}\n```") == m.data.code.strip("\n")
    with pytest.raises(UnmaskError, match="drop --chat"):
        load_items("stories", chat=True)


def test_eval_uses_the_template_when_the_model_has_one(data_dir):
    from unmask.eval.runner import evaluate

    b = chatml_bundle()
    kw = dict(limit=2, batch_size=2, max_new_tokens=4, data_dir=data_dir, warmup=False)
    res = evaluate("gsm8k", b, "ar", **kw)
    assert res.summary["config"]["chat"] is True
    assert all(r["prompt"].startswith("<|im_start|>user\nSolve") for r in res.rows)
    raw = evaluate("gsm8k", b, "ar", chat=False, **kw)
    assert raw.summary["config"]["chat"] is False and raw.rows[0]["prompt"].startswith("Solve")
    with pytest.raises(UnmaskError, match="--system"):
        evaluate("gsm8k", b, "ar", chat=False, system="x", **kw)


def test_a_json_prompts_file_is_refused_not_read_as_text_lines(tmp_path):
    """Found by the new-user pass: p.json was read line by line, its JSON text becoming the prompt."""
    from unmask.errors import UnmaskError
    from unmask.prompts import read_prompts_file

    path = tmp_path / "p.json"
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(UnmaskError, match=r"is \.json; write one JSON object per line and name it \.jsonl"):
        read_prompts_file(path)


def test_a_deeply_nested_row_is_a_one_line_error(tmp_path):
    from unmask.errors import UnmaskError
    from unmask.prompts import read_prompts_file
    from unmask.train.data import read_documents

    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100000 + "\n")
    with pytest.raises(UnmaskError, match="nested too deeply"):
        read_prompts_file(path)
    with pytest.raises(UnmaskError, match="nested too deeply"):
        read_documents(path)
