"""Prompts as users give them: text, or chat messages; prompt files; messages -> prompt ids.

A prompt is a ``str`` (continued as it is, or made the user turn of a conversation with
``chat=True``) or a conversation: a list of ``{"role": "system"|"user"|"assistant", "content": str}``
messages (``developer`` is read as ``system``; content may also be a list of text parts, as the
OpenAI API sends it).

A conversation becomes prompt ids through the tokenizer's chat template with
``add_generation_prompt=True``, tokenized by the template itself (``apply_chat_template(...,
tokenize=True)``): the ids are exactly the template's, with the BOS or ``<|im_start|>`` it writes
and no second BOS from the tokenizer (encoding the template *text* with the tokenizer's special
tokens switched on would add one). A model without a chat template (the shipped stories models)
gets the plain template, the same one ``unmask serve`` answers chat completions with::

    {system message}\\n\\n            (only when there is one)
    User: {content}\\n                 (one line per message, role capitalised)
    Assistant: {content}\\n
    Assistant:                        (the model continues from here)

encoded like any text prompt (with BOS when the tokenizer adds one).

Prompt files: ``.txt`` holds one prompt per line (blank lines skipped); ``.jsonl`` one object per
line, ``{"prompt": "..."}`` or ``{"messages": [...]}`` (other keys are ignored).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from unmask.errors import UnmaskError
from unmask.fileio import file_lines

Message = dict
Prompt = Union[str, list]  # text, or a conversation (a list of messages)
ROLES = ("system", "user", "assistant")
# A prompts file is read whole and each line becomes a prompt: bounded, so a wrong path
# (/dev/zero, a model file) is refused by name instead of filling memory.
MAX_FILE_BYTES = 64 * 2**20
MAX_LINE_CHARS = 4 * 2**20  # far above any context window's text (128k tokens x 32 characters)


def check_text(text: str, where: str) -> str:
    """``text`` when it encodes as UTF-8; UnmaskError naming ``where`` for a lone surrogate (e.g. from
    bytes read with ``errors="surrogateescape"``, or a JSON ``"\\udfff"``), which tokenizers reject
    with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnmaskError(f"{where} is not valid Unicode ({e.reason} at character {e.start}); "
                          "pass text that encodes as UTF-8") from None
    return text


def check_messages(messages, where: str = "messages") -> list[dict]:
    """Validate a conversation and return it as plain ``{"role", "content"}`` dicts (text parts
    joined, ``developer`` read as ``system``).

    Raises:
        UnmaskError: not a non-empty list, a message that is not an object with a known role, or
            content that is not text; the message names ``where`` and the offending message.
    """
    if not isinstance(messages, list) or not messages:
        raise UnmaskError(f"{where} must be a non-empty list of {{role, content}} objects; "
                          'write e.g. [{"role": "user", "content": "Hi"}]')
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UnmaskError(f"{where}[{i}] must be an object with a role and a content; "
                              'write it as {"role": "user", "content": "..."}')
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise UnmaskError(f"{where}[{i}].content may only hold text parts; give the content as text")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise UnmaskError(f"{where}[{i}].content must be text; give the message's content as a string")
        check_text(content, f"{where}[{i}].content")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ROLES:
            raise UnmaskError(f"{where}[{i}].role {m['role']!r} is not supported; use system, user or assistant")
        clean.append({"role": role, "content": content})
    return clean


def conversation(prompt: Prompt, system: str | None = None, where: str = "prompt") -> list[dict]:
    """A text prompt as one user turn, or a conversation validated; ``system`` is put first as a
    system turn when the conversation has none. Raises UnmaskError (see :func:`check_messages`)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else check_messages(prompt, where)
    if system is not None and not any(m["role"] == "system" for m in messages):
        check_text(system, "the system prompt")
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def has_chat_template(bundle) -> bool:
    """Whether the bundle's tokenizer carries a chat template."""
    return bool(getattr(bundle.tokenizer, "chat_template", None))


def plain_template(messages: list[dict]) -> str:
    """The plain chat template (module docstring) of validated ``messages``."""
    head = "".join(m["content"] + "\n\n" for m in messages if m["role"] == "system")
    body = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages if m["role"] != "system")
    return head + body + "Assistant:"


def render(bundle, messages: list[dict]) -> tuple[str, list[int]]:
    """Validated ``messages`` -> (prompt text, prompt ids), ready for the assistant's answer.

    With a chat template the ids come from the template tokenized by itself (so BOS appears once,
    as the template writes it) and the text is the same template untokenized; without one, the
    plain template encoded with :meth:`ModelBundle.encode`.

    Raises:
        UnmaskError: the bundle has no tokenizer, or its template refuses the messages (e.g. a
            template that takes no system turn).
    """
    tok = bundle.tokenizer
    if not has_chat_template(bundle):
        text = plain_template(messages)
        return text, bundle.encode(text)
    from jinja2 import TemplateError

    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UnmaskError(f"the chat template of {bundle.name} refuses these messages ({reason.rstrip('.')}); "
                          "change the roles (e.g. drop the system turn) or pass plain text prompts") from None
    return text, [int(i) for i in ids]


# ------------------------------------------------------------------------------- prompt files


def _file_error(path: Path, line: int, problem: str, fix: str) -> UnmaskError:
    return UnmaskError(f"{path} line {line}: {problem}; {fix}")


def parse_row(obj, path: Path, line: int) -> Prompt:
    """One JSONL prompt row -> its prompt (text or a validated conversation). Raises UnmaskError
    naming the file and line."""
    fix = 'write each line as {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}'
    if not isinstance(obj, dict):
        raise _file_error(path, line, f"a JSON {type(obj).__name__} is not a prompt row", fix)
    if ("prompt" in obj) == ("messages" in obj):
        what = "both 'prompt' and 'messages'" if "prompt" in obj else "neither 'prompt' nor 'messages'"
        raise _file_error(path, line, f"the row has {what}", fix)
    if "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise _file_error(path, line, "'prompt' must be non-empty text", fix)
        return text
    try:
        return check_messages(obj["messages"], "'messages'")
    except UnmaskError as e:
        raise UnmaskError(f"{path} line {line}: {e}") from None


def read_prompts_file(path: str | Path) -> list[Prompt]:
    """The prompts of a ``.txt`` file (one per line) or a ``.jsonl`` file (``prompt`` or
    ``messages`` rows), in file order, blank lines skipped.

    Raises:
        UnmaskError: an unreadable or non-UTF-8 file, one over ``MAX_FILE_BYTES`` or with a line over
            ``MAX_LINE_CHARS`` characters, a bad JSONL row (naming file, line and the
            fix), or a file holding no prompt.
    """
    path = Path(path)
    if path.suffix.lower() == ".json":  # read as text lines, a JSON file would become literal prompts
        raise UnmaskError(f"prompts file {path} is .json; write one JSON object per line and name it .jsonl "
                          "(or use a .txt file with one prompt per line)")
    try:
        with open(path, "rb") as f:  # at most one byte past the limit: a device or FIFO may never end
            raw = f.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            size = f"{MAX_FILE_BYTES // 2**20} MiB" if MAX_FILE_BYTES % 2**20 == 0 else f"{MAX_FILE_BYTES} bytes"
            raise UnmaskError(f"prompts file {path} is larger than {size}, the limit of a prompts file; split it into "
                              "smaller files, one prompt per line")
        text = raw.decode("utf-8-sig")  # a leading BOM (Windows editors) is not part of the first prompt
    except OSError as e:
        raise UnmaskError(f"cannot read prompts file {path}: {e.strerror or e}; "
                          "pass a readable .txt (one prompt per line) or .jsonl file") from None
    except UnicodeDecodeError:
        raise UnmaskError(f"prompts file {path} is not valid UTF-8; convert it to UTF-8") from None
    out: list[Prompt] = []
    lines = file_lines(text)
    for n, line in enumerate(lines, 1):
        if len(line) > MAX_LINE_CHARS:
            raise _file_error(path, n, f"the line has {len(line)} characters, more than the limit of {MAX_LINE_CHARS}",
                              "shorten the prompt (one prompt per line)")
    if path.suffix.lower() == ".jsonl":
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise _file_error(path, n, f"not valid JSON ({e.msg})",
                                  'write one JSON object per line, e.g. {"prompt": "..."}') from None
            except RecursionError:
                raise _file_error(path, n, "nested too deeply to parse",
                                  'write one flat JSON object per line, e.g. {"prompt": "..."}') from None
            out.append(parse_row(obj, path, n))
    else:
        out = [line for line in lines if line.strip()]
    if not out:
        raise UnmaskError(f"prompts file {path} holds no prompt; put one prompt per line "
                          '(.txt) or one {"prompt": ...} object per line (.jsonl)')
    return out
