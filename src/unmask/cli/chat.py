"""``unmask chat``: a multi-turn conversation on a terminal, each answer streamed as it is decoded."""

from __future__ import annotations

import copy
import inspect
import sys

import typer

from unmask.cli.root import app
from unmask.cli.generate import generate_cmd
from unmask.errors import UnmaskError

PROMPT = ">>> "
# generate's options that do not apply to a conversation typed at a terminal (the output options:
# logprobs need --json, a grammar or a bias is set per request, not for a whole conversation)
NOT_FOR_CHAT = ("prompts", "prompts_file", "chat", "show", "trace", "as_json", "overwrite", "tp", "reference_nfe",
                "stream", "logprobs", "logit_bias", "json_schema", "json_object", "regex", "grammar", "choice")
VERBOSE_HELP = "print each prompt as the model reads it (the rendered chat template) and each answer's statistics"


def chat_loop(bundle, decoder: str | None = None, *, system: str | None = None, verbose: bool = False,
              read=input, out=None, **kwargs) -> None:
    """Read user turns with ``read(PROMPT)`` until EOFError and stream each answer to ``out``
    (default stdout), keeping the conversation: every turn is rendered with the whole history through
    the chat template (:func:`unmask.prompts.render`; the plain template for a model without one).
    ``/reset`` clears the history. A KeyboardInterrupt while an answer streams stops that answer (the
    text shown so far stays in the history); one at the prompt propagates. When the history no longer
    fits the context window with ``max_new_tokens``, its oldest turns are dropped. A turn's
    UnmaskError (e.g. an option the decoder refuses) is printed as one ``error:`` line and the loop
    goes on. ``kwargs``: :func:`unmask.generate`'s (max_new_tokens, temperature, decoder knobs...)."""
    from rich.console import Console

    from unmask.api import generate, new_tokens, prepare_prompts
    from unmask.cli.live import LiveText
    from unmask.decode import default_decoder

    out = out if out is not None else sys.stdout
    console, err = Console(file=out), Console(stderr=True)
    history: list[dict] = []
    limit = new_tokens(kwargs.get("max_new_tokens"), kwargs.get("gen_length"))
    options = {k: v for k, v in kwargs.items() if k not in ("max_new_tokens", "temperature", "top_k", "top_p",
                                                            "seed", "stop")}
    while True:
        try:
            line = read(PROMPT)
        except EOFError:  # Ctrl-D: the conversation ends
            out.write("\n")
            return
        if not line.strip():
            continue
        if line.strip() == "/reset":
            history.clear()
            console.print("[dim](history cleared)[/dim]")
            continue
        turn = {"role": "user", "content": line}
        live = None
        try:
            rendered, ids = prepare_prompts(bundle, [history + [turn]], chat=True, system=system)
            while len(ids[0]) + limit > bundle.context_length and history:
                history = history[2:]  # the oldest user turn and its answer
                rendered, ids = prepare_prompts(bundle, [history + [turn]], chat=True, system=system)
                console.print("[dim](the oldest turn was dropped to fit the context window)[/dim]")
            if verbose:
                console.print(rendered[0], style="dim", soft_wrap=True, markup=False, highlight=False)
            live = LiveText(bundle, ids[0], stop=kwargs.get("stop") or (), limit=limit,
                            decoder=decoder or default_decoder(bundle.kind), options=options, out=out, strip=True)
            result = generate([history + [turn]], bundle, decoder, system=system, on_step=live, **kwargs)
            text = live.finish(result.tokens[0])
        except KeyboardInterrupt:  # this answer stops; the conversation goes on
            text = live.written if live is not None else ""
            console.print("\n[dim](stopped)[/dim]")
        except UnmaskError as e:
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
            continue
        else:
            out.write("\n")
            if verbose:
                s = result.stats
                err.print(f"[dim]NFE {s.nfe} · generated {s.generated} · TPF {s.tpf:.2f} · {s.tps:.1f} tok/s[/dim]")
        if text.strip():
            history += [turn, {"role": "assistant", "content": text.strip()}]


def chat_cmd(**kwargs) -> None:
    """Chat with a model at the terminal: each line you type is a user turn, the answer streams as
    it is decoded, and the conversation is kept across turns (through the model's chat template, or
    the plain 'User: ...\\nAssistant:' one). /reset clears the history; Ctrl-D ends; Ctrl-C stops an
    answer, and at the prompt exits. Takes generate's model and decoder options."""
    from unmask.cli.progress import status
    from unmask.models import load

    try:
        import readline  # noqa: F401 (line editing and history for input())
    except ImportError:  # pragma: no cover - a Python built without it
        pass
    setup = {k: kwargs.pop(k) for k in ("model", "kind", "adapter", "device", "dtype", "no_progress",
                                                "verbose", "system", "decoder", "compile")}
    with status(f"loading {setup['model'] or 'the default model'}", enabled=not setup["no_progress"]):
        bundle = load(setup["model"], kind=setup["kind"], device=setup["device"],
                      dtype=setup["dtype"], adapter=setup["adapter"])
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs["stop"] = kwargs.get("stop") or None
    if setup["compile"]:
        kwargs["compile"] = True
        _compile_ahead(bundle, setup, kwargs)
    chat_loop(bundle, setup["decoder"], system=setup["system"], verbose=setup["verbose"],
              **kwargs)


def _compile_ahead(bundle, setup: dict, kwargs: dict) -> None:
    """``--compile``: a short answer to a first turn before the prompt appears, under a spinner naming
    each step graph it compiles, so the first real answer does not stop for the compile. A bad option
    is left for the first turn to report."""
    from unmask.api import generate
    from unmask.cli.progress import compiling, status

    message = f"compiling {bundle.name}'s decode step"
    with status(message, enabled=not setup["no_progress"]) as spin, compiling(spin, message):
        try:
            generate([[{"role": "user", "content": "Hi"}]], bundle, setup["decoder"], system=setup["system"],
                     **{**kwargs, "max_new_tokens": 8})
        except UnmaskError:
            pass


def _options_of_generate():
    """``generate``'s parameters (their typer options) less the ones a terminal chat has no use for,
    so both commands take the same model and decoder options from one definition."""
    params = [p for name, p in inspect.signature(generate_cmd).parameters.items() if name not in NOT_FOR_CHAT]
    params = [p.replace(default=typer.Option(False, "--verbose", help=VERBOSE_HELP)) if p.name == "verbose" else p
              for p in params]
    for i, p in enumerate(params):
        if p.name == "system":  # a copy: generate's option keeps its own help
            option = copy.copy(p.default)
            option.help = "a system turn put first in the conversation"
            params[i] = p.replace(default=option)
    return inspect.Signature(params)


chat_cmd.__signature__ = _options_of_generate()
chat_cmd.__annotations__ = {k: v for k, v in generate_cmd.__annotations__.items() if k in chat_cmd.__signature__.parameters}
app.command("chat")(chat_cmd)
