"""Live text on a terminal: a decode's committed text written as it becomes final (``generate
--stream``, ``unmask chat``), built on the decoders' step events (:mod:`unmask.trace`)."""

from __future__ import annotations

import sys

from unmask.serve.stream import TextStream, edits_committed


class LiveText:
    """A decoder's ``on_step`` hook that writes one row's committed text to ``out`` (default
    stdout) as soon as it is final: contiguous from the left, an incomplete character or a possible
    stop-string start held back, cut before a stop string (:class:`unmask.serve.stream.TextStream`,
    the server's ``committed`` stream). ``finish(tokens)`` writes the rest; everything written is
    then exactly the text :func:`unmask.generate` returns for that row.

    bundle: the loaded model; prompt_ids: the row's prompt ids as fed to the model; stop: stop
    strings; limit: the row's ``max_new_tokens`` (a diffusion canvas may be longer); decoder and
    options: the decode's, to hold the text back to the end for a decoder that may still edit
    committed tokens (``multiblock`` with ``tau_t2t``); row: the row whose events are shown; strip:
    leave out the text's leading white space on screen (a chat answer after its template)."""

    def __init__(self, bundle, prompt_ids: list[int], *, stop=(), limit: int | None = None, decoder: str = "",
                 options: dict | None = None, out=None, row: int = 0,
                 strip: bool = False):
        self.out, self.row, self.strip = out if out is not None else sys.stdout, row, strip
        self.stream = TextStream(bundle, prompt_ids, tuple(stop or ()), limit=limit,
                                 final_only=edits_committed(bundle, decoder, options or {}))

    def __call__(self, event: dict) -> None:
        if event.get("row", 0) == self.row:
            self._write(self.stream.update(event["canvas"]))

    @property
    def written(self) -> str:
        """The text written so far."""
        return self.stream.sent

    def finish(self, tokens: list[int]) -> str:
        """Write the rest of the row's text given its final ``tokens``; returns the whole text."""
        self._write(self.stream.finish(tokens))
        return self.stream.sent

    def _write(self, delta: str) -> None:
        if self.strip and not self.stream.sent[: -len(delta) or None].strip():  # nothing shown yet
            delta = delta.lstrip()
        if delta:
            self.out.write(delta)
            self.out.flush()
