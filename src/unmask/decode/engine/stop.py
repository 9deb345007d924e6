"""The one stop rule of decoders, the server and the API: stop token ids and stop strings.

A row ends at its first stop id (the id is not part of the text; it counts for TPF where it was
committed) or, with stop strings, after the token that completes one (that token is kept, the text
is cut before the string, as OpenAI does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class StopRule:
    """ids: stop token ids (EOS and the chat template's end-of-turn ids); strings: stop strings."""

    ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()

    @classmethod
    def of(cls, ids: Iterable[int] = (), strings: Iterable[str] = ()) -> "StopRule":
        return cls(frozenset(int(i) for i in ids), tuple(strings))

    def first_id(self, tokens: list[int], also: Iterable[int] = (), start: int = 0) -> int | None:
        """Index of the first stop id (or id of ``also``, e.g. a mask) in ``tokens[start:]``, or None;
        ``start``: the tokens before it are known to hold none (a running row's earlier commits)."""
        ends = self.ids.union(also) if also else self.ids
        return next((i for i in range(max(start, 0), len(tokens)) if tokens[i] in ends), None)

    def until_stop(self, tokens: list[int], also: Iterable[int] = ()) -> list[int]:
        """``tokens`` up to, not including, the first stop id (or id of ``also``)."""
        return list(tokens[:self.first_id(tokens, also)])

    def in_text(self, text: str) -> bool:
        return any(s in text for s in self.strings)

    def hit(self, bundle, prompt: list[int], tokens: list[int], also: Iterable[int] = ()) -> bool:
        """Whether the text of ``tokens`` (cut at the first stop id or id of ``also``) after ``prompt``
        holds a stop string."""
        if not self.strings:
            return False
        return self.in_text(bundle.decode_continuation(list(prompt), self.until_stop(tokens, also)))

    def string_end(self, bundle, prompt: list[int], tokens: list[int], start: int = 0) -> int | None:
        """The length of ``tokens`` up to and including the token that completes a stop string,
        searched from token ``start`` on; None when none does."""
        if not self.strings:
            return None
        for end in range(max(start, 0) + 1, len(tokens) + 1):
            if self.in_text(bundle.decode_continuation(list(prompt), list(tokens[:end]))):
                return end
        return None


__all__ = ["StopRule"]
