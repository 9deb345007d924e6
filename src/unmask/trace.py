"""Decoding trajectories: ``--show`` (live terminal view) and ``--trace FILE`` (JSON).

**The step-event contract.** A decoder that supports tracing takes ``on_step`` and calls it after
every forward, once per row that committed (or could have committed) in it, with a dict

    {"step": i,            # index of the forward in the run (0-based)
     "row": r,             # prompt index in the batch
     "block": b,           # block index (optional)
     "positions": [...],   # generated-token indices committed by this forward (0 = first new token)
     "tokens": [...],      # their ids, same order
     "canvas": [...]}      # the row's generated region after the commit: ids, None where still masked

:func:`host_event` builds one from host lists a decoder read in its step's one host sync (a
running batch packs what its events need into that read); :func:`step_event` from tensors (each
call reads the host). The canvas may grow between events (block decoders that only know the
blocks so far).

:func:`attach_trace` returns the decoder options (``{"on_step": trace}``); the :class:`Trace`
records every event, renders the canvases live with rich when ``show`` is on (masked positions as
``░``, the tokens of the latest step highlighted) and, on :meth:`Trace.close`, writes the commit
trace as JSON atomically. Token texts come from the bundle's tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.fileio import atomic_write_json, check_output_file

MASK_GLYPH = "░"
TRACE_FORMAT = "unmask-trace/1"


def host_event(step: int, row: int, committed: list, tokens: list[int], offset: int, canvas: list[int],
               mask_id: int, **extra) -> dict:
    """One step event from host lists (no tensor read).

    committed: N truthy/falsy flags over a window that starts at generated index ``offset``;
    tokens: the N candidate ids for that window; canvas: the ids of the generated region after the
    commit, ``mask_id`` (or a negative id) where nothing is committed yet. ``extra`` (e.g. block=)
    is added to the event.
    """
    return {"step": int(step), "row": int(row), **extra,
            "positions": [offset + i for i, c in enumerate(committed) if c],
            "tokens": [t for c, t in zip(committed, tokens) if c],
            "canvas": [None if (t == mask_id or t < 0) else t for t in canvas]}


def step_event(step: int, row: int, committed: torch.Tensor, tokens: torch.Tensor, offset: int,
               canvas: torch.Tensor, mask_id: int, **extra) -> dict:
    """:func:`host_event` from tensors: committed (N,) bool, tokens (N,) long, canvas (L,) long
    (three host reads)."""
    return host_event(step, row, committed.tolist(), tokens.tolist(), offset, canvas.tolist(), mask_id, **extra)


class TokenStep(Mapping):
    """The step event of a row that commits one token per step, as a view: its ``n``-th token
    appended to ``tokens`` (a list that only grows), i.e. ``{"step": n - 1, "row": 0, "positions":
    [n - 1], "tokens": [tokens[n - 1]], "canvas": tokens[:n]}``. Made in O(1) (the server's AR rows
    post one per token); a reader gets the canvas copied, whenever and on whichever thread it reads."""

    __slots__ = ("_tokens", "_n")
    KEYS = ("step", "row", "positions", "tokens", "canvas")

    def __init__(self, tokens: list[int], n: int):
        self._tokens, self._n = tokens, n

    def __getitem__(self, key):
        n = self._n
        if key == "canvas":
            return self._tokens[:n]
        return {"step": n - 1, "row": 0, "positions": [n - 1], "tokens": [self._tokens[n - 1]]}[key]

    def __iter__(self):
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)

    def __repr__(self) -> str:
        return repr(dict(self))


class TokenText:
    """Display text of single token ids, cached. A token is decoded after a copy of itself and the
    first copy's text removed, so SentencePiece/BPE word-initial spaces survive."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self.cache:
            self.cache[token] = self._text(token)
        return self.cache[token]

    def _text(self, token: int) -> str:
        if self.tokenizer is None:
            return f" {token}"
        try:
            one = self.tokenizer.decode([token])
            two = self.tokenizer.decode([token, token])
        except (TypeError, ValueError, IndexError, KeyError, OverflowError):
            return f"<{token}>"
        return two[len(one):] if two.startswith(one) and len(two) > len(one) else one


class Trace:
    """Records step events; optionally renders them live; writes the JSON trace on close.

    Use as the decoder's ``on_step`` callback. ``console`` (a rich Console) defaults to one on
    standard output; tests pass a recording console.
    """

    def __init__(self, *, show: bool = False, trace_file: str | Path | None = None, tokenizer=None,
                 prompts: list[str] | None = None, console=None, meta: dict | None = None):
        self.show, self.trace_file = bool(show), None if trace_file is None else Path(trace_file)
        self.prompts = list(prompts) if prompts is not None else None
        self.meta = dict(meta or {})
        self.text = TokenText(tokenizer)
        self.events: list[dict] = []
        self.canvases: dict[int, list] = {}
        self.latest: dict[int, set[int]] = {}
        self._console, self._live, self._closed = console, None, False
        self.final_texts: list[str] | None = None  # set by close(): the last frame shows the reported texts

    def __call__(self, event: dict) -> None:
        row = int(event["row"])
        self.events.append({k: v for k, v in event.items() if k != "canvas"})
        self.canvases[row] = list(event["canvas"])
        self.latest = {row: set(event["positions"])}
        if self.show:
            self._refresh()

    # -- live view ----------------------------------------------------------------------------

    def render(self):
        """A rich renderable of every row's canvas (prompt, committed tokens, ``░`` for masks)."""
        from rich.console import Group
        from rich.text import Text

        lines = []
        for row in sorted(self.canvases):
            line = Text()
            if self.prompts is not None and row < len(self.prompts):
                line.append(self.prompts[row], style="bold")
            if self.final_texts is not None and row < len(self.final_texts):
                # The canvas runs past a stop token or string; the result is cut there.
                lines.append(line.append(self.final_texts[row]))
                continue
            fresh = self.latest.get(row, set())
            for i, token in enumerate(self.canvases[row]):
                if token is None:
                    line.append(MASK_GLYPH, style="dim")
                else:
                    line.append(self.text(token), style="bold green" if i in fresh else "")
            lines.append(line)
        step = self.events[-1]["step"] if self.events else 0
        lines.append(Text(f"step {step} · forwards traced {len(self.events)}", style="dim"))
        return Group(*lines)

    def _refresh(self) -> None:
        if self._live is None:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self.render(), console=self._console or Console(), auto_refresh=False,
                              transient=False)
            self._live.start()
        self._live.update(self.render(), refresh=True)

    # -- output -------------------------------------------------------------------------------

    def to_dict(self, summary: dict | None = None) -> dict:
        """The JSON trace: every step's commits (with token texts) and each row's final canvas."""
        steps = [{**e, "texts": [self.text(t) for t in e["tokens"]]} for e in self.events]
        final = [self.canvases.get(r) for r in range(max(self.canvases, default=-1) + 1)]
        return {"format": TRACE_FORMAT, "prompts": self.prompts, "meta": self.meta, "steps": steps,
                "final": final, "summary": summary or {}}

    def close(self, summary: dict | None = None, *, write: bool = True) -> None:
        """Stop the live view and, when a trace file was asked for and ``write``, write it atomically.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            if summary is not None and isinstance(summary.get("texts"), list):
                self.final_texts = [str(t) for t in summary["texts"]]
                self._live.update(self.render(), refresh=True)
            self._live.stop()
            if not self._live.console.is_terminal:  # rich leaves the last rendered line open there
                self._live.console.line()
        if write and self.trace_file is not None:
            try:
                atomic_write_json(self.trace_file, self.to_dict(summary), output=True)
            except OSError as e:
                raise UnmaskError(f"cannot write the trace to {self.trace_file}: {e.strerror or e}; "
                                  "choose a writable --trace path") from None

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(write=exc_type is None)


def attach_trace(*, show: bool, trace_file: Path | None, bundle=None, prompts: list[str] | None = None,
                 console=None) -> dict:
    """Decoder options that record and/or render the trajectory: ``{"on_step": Trace}``.

    bundle: gives the tokenizer for token texts (ids are shown without it). prompts: texts shown
    before each row. The caller must call ``options["on_step"].close(summary)`` after decoding to
    stop the live view and write ``trace_file``. Raises UnmaskError when the trace file's folder
    cannot be created.
    """
    if trace_file is not None:
        check_output_file(Path(trace_file).expanduser(), "trace file")
        folder = Path(trace_file).expanduser().resolve().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UnmaskError(f"cannot create the folder of the trace file {trace_file}: {e.strerror or e}; "
                              "choose a writable --trace path") from None
        trace_file = Path(trace_file).expanduser()
    meta = {"model": getattr(bundle, "name", None)} if bundle is not None else {}
    trace = Trace(show=show, trace_file=trace_file, tokenizer=getattr(bundle, "tokenizer", None), prompts=prompts,
                  console=console, meta=meta)
    return {"on_step": trace}
