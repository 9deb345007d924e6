"""From a row's step events to streamed text.

``committed`` mode sends only text that is final and contiguous from the left: the tokens of the
canvas up to the first still-masked slot (and before any stop token), decoded, with two things
held back until they are settled: a trailing incomplete character (U+FFFD from a partial byte
sequence) and a tail that could still become a stop string. When a stop string appears the text
is cut before it, exactly where ``unmask.generate`` (and AR) cut it, and nothing more is sent.
The concatenated deltas therefore equal the final text. A decoder that may still edit committed
tokens (``multiblock`` with token-to-token edits, ``tau_t2t``) has no final text before it ends,
so its text comes in the last chunk only (canvas events still stream).

``canvas`` mode additionally describes every step: the row's whole canvas (ids, ``None`` where
masked, and each slot's display text) and which positions the step committed. A special token (the
stop token a diffusion canvas holds, BOS, ...) has no text in the answer: its display text is ``""``
and its position is listed in ``special``, so a page can mark it rather than print ``<s>``.
"""

from __future__ import annotations

from unmask.decode.engine.stop import StopRule
from unmask.trace import TokenText

CONTEXT_IDS = 8  # ids before a stream's undecoded tail that its decode sees (spaces, merged byte tokens)


def edits_committed(bundle, decoder: str, options: dict) -> bool:
    """Whether the decoder may change tokens it already committed (``multiblock`` token-to-token
    edits, set by ``tau_t2t`` or the checkpoint's decode defaults)."""
    defaults = bundle.meta.get("decode_defaults") or {}
    return decoder == "multiblock" and (options.get("tau_t2t", defaults.get("tau_t2t")) is not None)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """Text up to the earliest stop string, and whether one was found (``unmask.generate``'s cut)."""
    at = min((text.index(s) for s in stop if s in text), default=None)
    return (text, False) if at is None else (text[:at], True)


def _held_tail(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def byte_token(tokenizer, token_id: int) -> bool:
    """Whether ``token_id`` is a byte-fallback token such as ``<0xE6>`` (SentencePiece-style vocabularies)."""
    token = tokenizer.convert_ids_to_tokens(token_id)
    return isinstance(token, str) and len(token) == 6 and token.startswith("<0x") and token.endswith(">")


class TextStream:
    """Turns one request's step events into text deltas (see the module docstring)."""

    def __init__(self, bundle, prompt_ids: list[int], stop: tuple[str, ...], limit: int | None = None,
                 token_text: TokenText | None = None, final_only: bool = False):
        self.bundle, self.prompt_ids, self.stop, self.limit = bundle, list(prompt_ids), tuple(stop), limit
        self.final_only = final_only  # committed tokens may still change (token-to-token edits): text only at the end
        self.rule = StopRule.of(bundle.stop_token_ids, stop)
        self.special_ids = self.rule.ids | set(getattr(bundle.tokenizer, "all_special_ids", None) or ())
        self.sent = ""
        self.stopped = False
        self.token_text = token_text or TokenText(bundle.tokenizer)
        self._head = None if bundle.tokenizer is None else bundle.tokenizer.decode(self.prompt_ids, skip_special_tokens=True)
        self._fixed_ids: list[int] = []  # a prefix of the committed ids whose text can no longer change
        self._fixed_text = ""  # its text (see _continuation)

    def _continuation(self, tokens: list[int]) -> str:
        """``bundle.decode_continuation(prompt_ids, tokens)``, decoding only the ids after the last fixed
        prefix, with the CONTEXT_IDS ids before them as context: a step costs O(new ids), not O(prompt +
        text). Where the context's decode is not a prefix of the tail's (a tokenizer joining across the
        boundary) it starts over. The tail is fixed when it ends on a whole character that is not white
        space and its last id is not a byte-fallback token (``<0xE6>``: a decoder turns a whole run of
        those into U+FFFD when any of them is invalid), after which no later id can change its text."""
        n = len(self._fixed_ids)
        if tokens[:n] != self._fixed_ids:  # committed ids only grow; anything else starts over
            self._fixed_ids, self._fixed_text, n = [], "", 0
        if not n:
            tail = self.bundle.decode_continuation(self.prompt_ids, tokens, self._head)
        else:
            decode = self.bundle.tokenizer.decode
            context = (self.prompt_ids[-CONTEXT_IDS:] + self._fixed_ids[-CONTEXT_IDS:])[-CONTEXT_IDS:]
            head, full = decode(context, skip_special_tokens=True), decode(context + tokens[n:], skip_special_tokens=True)
            if not full.startswith(head):
                self._fixed_ids, self._fixed_text = [], ""
                return self._continuation(tokens)
            tail = full[len(head):]
        text = self._fixed_text + tail
        fixed = tail and not tail[-1].isspace() and "\ufffd" not in tail
        if fixed and not byte_token(self.bundle.tokenizer, tokens[-1]):
            self._fixed_ids, self._fixed_text = list(tokens), text
        return text

    def update(self, canvas: list) -> str:
        """The new final text after a step whose canvas is ``canvas`` (ids, None where masked)."""
        if self.stopped or self.final_only:
            return ""
        # committed ids from the left, up to a masked slot, a stop token or ``limit`` (a diffusion canvas may
        # be longer than the requested tokens)
        text = self._continuation(self.rule.until_stop(canvas[: self.limit], also=(None,)))
        text, hit = cut_at_stop(text, self.stop)
        if hit:
            self.stopped = True
        else:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - _held_tail(text, self.stop)]
        return self._advance(text)

    def finish(self, tokens: list[int]) -> str:
        """The last delta, given the request's final tokens; afterwards ``self.sent`` is the final text."""
        text, _ = cut_at_stop(self.bundle.decode_continuation(self.prompt_ids, tokens, self._head), self.stop)
        self.stopped = True
        delta = self._advance(text)
        self.sent = text
        return delta

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def canvas(self, event: dict) -> dict:
        """The ``canvas`` mode description of one step event, cut to the requested ``limit`` slots
        (a diffusion canvas or a lossless-SBD draft can reach past them; those tokens are not
        part of the answer)."""
        canvas = event["canvas"][: self.limit]
        special = [i for i, t in enumerate(canvas) if t is not None and t in self.special_ids]
        return {"step": event["step"], "canvas": canvas, "special": special,
                "texts": [None if t is None else "" if t in self.special_ids else self.token_text(t) for t in canvas],
                "committed": [p for p in event["positions"] if self.limit is None or p < self.limit]}
