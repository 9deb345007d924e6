"""A choice's token logprobs in OpenAI's response shapes, whole or chunk by chunk.

The values are the rows' :class:`~unmask.decode.engine.shaping.TokenLogprob`: one per generated token
(``usage.completion_tokens`` of them, a token past a stop string included), raw log-softmax values (before
``logit_bias``, a grammar's mask, temperature and top-k/top-p); ``-inf`` (a suppressed id) is sent as
-9999.0, since JSON has no infinity.

- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}``; each
  ``top_logprobs`` object holds the k alternatives and the chosen token (OpenAI's "up to logprobs + 1").
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``
  with the k alternatives.

A token's text is its display text (:class:`unmask.trace.TokenText`: a word-initial space kept);
``text_offset`` is where its text starts in the answer, from decoding it after the ids before it (the
byte-fallback tokens of one character all start where that character does). A
streamed chunk carries the logprobs of the tokens whose text it completes, as far as the decoder has
reported them (the verify batch as it commits; the other decoders when the row finishes); the rest
come with the choice's last chunk.
"""

from __future__ import annotations

from contextlib import suppress

from unmask.serve.stream import CONTEXT_IDS, byte_token
from unmask.trace import TokenText

FLOOR = -9999.0  # what a -inf logprob is sent as (JSON has no infinity)


def _lp(value: float) -> float:
    return value if value > FLOOR else FLOOR  # also NaN -> FLOOR


def token_bytes(tokenizer, token: int, text: str) -> list[int]:
    """The UTF-8 bytes of a token: a byte-fallback token such as ``<0xE6>`` is its one byte."""
    if tokenizer is not None and byte_token(tokenizer, token):
        with suppress(ValueError):
            return [int(tokenizer.convert_ids_to_tokens(token)[3:5], 16)]
    return list(text.encode("utf-8", "backslashreplace"))


class ChoiceLogprobs:
    """The logprobs of one choice: ``add`` the entries a row reports as it goes, take the ones a chunk of
    ``n`` characters of text completes with :meth:`upto`, the rest with :meth:`rest`, or all with
    :meth:`whole`. ``chat``: the chat shape, else the completions shape."""

    def __init__(self, bundle, prompt_ids: list[int], chat: bool, token_text: TokenText | None = None):
        self.tokenizer, self.prompt_ids, self.chat = bundle.tokenizer, list(prompt_ids), chat
        self.text = token_text or TokenText(bundle.tokenizer)
        self.entries: list = []
        self.offsets: list[int] = [0]  # offsets[i]: where token i's text starts; offsets[-1]: where the next would
        self.sent = 0  # entries already sent in chunks

    def add(self, entries) -> None:
        self.entries.extend(entries)

    def _offset(self, i: int) -> int:
        """Where token i's text starts (decoding each token once, after up to CONTEXT_IDS ids before it)."""
        while len(self.offsets) <= i:
            j = len(self.offsets) - 1
            before = (self.prompt_ids + [e.token for e in self.entries[max(0, j - CONTEXT_IDS):j]])[-CONTEXT_IDS:]
            self.offsets.append(self.offsets[-1] + self._chars(before, self.entries[j].token))
        return self.offsets[i]

    def _chars(self, before: list[int], token: int) -> int:
        """The characters of the answer that ``token`` completes after ``before``. A character split over
        byte-fallback tokens counts once, at its last byte: each decode drops its trailing U+FFFD (the
        bytes of a character not complete yet), so '☃' = <0xE2> <0x98> <0x83> gives 0, 0, 1."""
        if self.tokenizer is None:
            return len(self.text(token))
        head = self.tokenizer.decode(before, skip_special_tokens=True).rstrip("\ufffd")
        full = self.tokenizer.decode(before + [token], skip_special_tokens=True).rstrip("\ufffd")
        return len(full) - len(head) if full.startswith(head) else len(self.text(token))

    def upto(self, chars: int) -> dict | None:
        """The shaped logprobs of the tokens not yet sent whose text ends within the first ``chars``
        characters of the answer (None when there are none)."""
        end = self.sent
        while end < len(self.entries) and self._offset(end + 1) <= chars:
            end += 1
        return self._take(end)

    def rest(self, final: list | None) -> dict | None:
        """The shaped logprobs of every token not yet sent; ``final``: the row's whole list, which wins."""
        if final is not None:
            self.entries = list(final)
            self.offsets = self.offsets[: self.sent + 1]
        return self._take(len(self.entries))

    def whole(self, final: list | None) -> dict:
        """The shaped logprobs of every token; ``final``: the row's whole list."""
        self.sent, self.offsets = 0, [0]
        if final is not None:
            self.entries = list(final)
        return self._take(len(self.entries), always=True)

    def _take(self, end: int, always: bool = False) -> dict | None:
        start, self.sent = self.sent, end
        if start >= end and not always:
            return None
        return self.shape(start, end)

    def shape(self, start: int, end: int) -> dict:
        """Entries [start, end) in the response shape (the module docstring)."""
        picked = self.entries[start:end]
        if self.chat:
            def item(token, value):
                text = self.text(token)
                return {"token": text, "logprob": _lp(value), "bytes": token_bytes(self.tokenizer, token, text)}

            return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                                for e in picked]}
        tops = []
        for e in picked:
            top = {self.text(t): _lp(v) for t, v in e.top}
            top.setdefault(self.text(e.token), _lp(e.logprob))
            tops.append(top)
        return {"tokens": [self.text(e.token) for e in picked], "token_logprobs": [_lp(e.logprob) for e in picked],
                "top_logprobs": tops, "text_offset": [self._offset(i) for i in range(start, end)]}


__all__ = ["ChoiceLogprobs", "FLOOR", "token_bytes"]
