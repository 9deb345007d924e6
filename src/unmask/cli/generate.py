"""``unmask generate``: the main job."""

from __future__ import annotations

import inspect
import json
import math
import os
from pathlib import Path

import typer
from rich.markup import escape

from unmask.cli.root import app
from unmask.decode import DECODERS
from unmask.decode.engine.registry import TYPES, all_knobs
from unmask.errors import UnmaskError
from unmask.fileio import check_output_file


def read_prompts(prompts: list[str], prompts_file: Path | None) -> list:
    """Prompts from arguments and/or a file: ``.txt`` one prompt per line, ``.jsonl``
    ``{"prompt": ...}`` or ``{"messages": [...]}`` rows (:func:`unmask.prompts.read_prompts_file`).
    Raises UnmaskError."""
    from unmask.prompts import read_prompts_file

    out: list = []
    for p in prompts:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:
            raise UnmaskError("a prompt argument is not valid UTF-8; pass UTF-8 text") from None
        out.append(p)
    if prompts_file is not None:
        out.extend(read_prompts_file(prompts_file))
    if not out:
        raise UnmaskError("no prompt given; pass PROMPT or --prompts-file FILE")
    return out


def shown_prompt(given, rendered: str, *, chat: bool, verbose: bool = False) -> str:
    """The prompt as the text output shows it before its answer: a plain prompt as given; a chat
    prompt (``--chat``, or a conversation) as its last user turn on a line of its own, or with
    ``verbose`` as the whole rendered template (what ``--json`` reports as ``prompt``)."""
    if verbose or not (chat or isinstance(given, list)):
        return rendered
    if isinstance(given, list):
        given = next((m["content"] for m in reversed(given) if m["role"] == "user"), "")
    return given + "\n"


def _stream_on(stream: bool | None, texts: list, *, as_json: bool, show: bool, torchrun: bool,
               compile: bool = False) -> bool:
    """Whether ``generate`` streams: as asked, else for one prompt on a terminal without --json /
    --show / --compile / torchrun. Raises UnmaskError for --stream with a flag it cannot work with."""
    import sys

    if stream is None:  # with --compile the spinner reports each graph's compile instead
        return len(texts) == 1 and sys.stdout.isatty() and not (as_json or show or torchrun or compile)
    if stream:
        clash = "--json" if as_json else "--show" if show else "torchrun" if torchrun else None
        if clash is not None:
            raise UnmaskError(f"--stream prints text to a terminal and cannot be combined with {clash}; drop one of them")
        if len(texts) > 1:
            raise UnmaskError(f"--stream follows one prompt (got {len(texts)}); pass one prompt or drop --stream")
    return stream


def generate_cmd(
    prompts: list[str] = typer.Argument(None, help="prompt text(s) to continue"),
    prompts_file: Path = typer.Option(None, "--prompts-file", help="prompts: .txt one per line, or .jsonl rows "
                                      '{"prompt": ...} or {"messages": [...]} (messages rows use the chat template)'),
    chat: bool = typer.Option(False, "--chat", help="apply the chat template: each prompt becomes a user turn "
                              "(a model without a template gets the plain 'User: ...\\nAssistant:' one)"),
    system: str = typer.Option(None, "--system", help="with --chat or messages rows: a system turn put first (a messages row with its own system turn keeps it; plain rows without --chat stay raw)"),
    model: str = typer.Option(None, "--model", "-m", help="shipped model name or local HF directory (default: the default shipped model)"),
    kind: str = typer.Option(None, "--kind", help="model kind for a local directory: causal, sbd, masked-diffusion, block-diffusion"),
    adapter: str = typer.Option(None, "--adapter", help="gated SBD adapter: a name the model ships (e.g. sbd) or a directory"),
    decoder: str = typer.Option(None, "--decoder", "-d", help="DECODERS (default: the model kind's natural decoder; "
                                "ar for an SBD model whose lossless sbd is expected slower here, with a note)"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", "-n",
                                       help="tokens to generate per prompt (default 128; with --gen-length, the whole canvas)"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
    top_k: int = typer.Option(0, "--top-k", help="sample from the k most likely tokens (0 = off)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling mass in (0, 1]"),
    seed: int = typer.Option(0, "--seed", help="seed of the sampling generator"),
    stop: list[str] = typer.Option(None, "--stop", help="stop string (repeatable)"),
    logprobs: int = typer.Option(None, "--logprobs", metavar="K", help="with --json: each row's \"logprobs\", per token its "
                                 "log-probability and the K most likely ids (K in 0..20; raw, before bias, grammar and "
                                 "temperature; ar and lossless sbd: equal to AR's)"),
    logit_bias: list[str] = typer.Option(None, "--logit-bias", metavar="ID=BIAS", help="TOKEN_ID=BIAS added to that token's logit, "
                                         "BIAS in [-100, 100] (repeatable)"),
    json_schema: Path = typer.Option(None, "--json-schema", metavar="FILE", help="output grammar: a JSON object matching the "
                                     "JSON schema in FILE (ar and lossless sbd)"),
    json_object: bool = typer.Option(False, "--json-object", help="output grammar: any JSON object"),
    regex: str = typer.Option(None, "--regex", metavar="REGEX", help="output grammar: text matching the regex"),
    grammar: Path = typer.Option(None, "--grammar", metavar="FILE", help="output grammar: the Lark grammar in FILE (or GBNF: "
                                 "rules written name ::= ...)"),
    choice: list[str] = typer.Option(None, "--choice", metavar="TEXT", help="output grammar: exactly one of these texts (repeatable)"),
    reference_nfe: bool = typer.Option(False, "--reference-nfe", help="dLLM decoders (diffusion, early-bird, block, "
                                       "multiblock): decode the whole canvas as the reference code does, not stopping "
                                       "after the EOS block, so NFE equals theirs (the text is still cut at EOS)"),
    compile: bool = typer.Option(False, "--compile", help="a preallocated static KV cache (no-cache diffusion and "
                                 "early-bird: their canvas) and a torch.compile'd step, for every decoder but --schedule "
                                 "dream (the first call of each shape compiles, the spinner naming it: minutes on a "
                                 "busy CPU, README 'The fast path'; same tokens)"),
    show: bool = typer.Option(False, "--show", help="render the decoding trajectory live in the terminal"),
    stream: bool = typer.Option(None, "--stream/--no-stream", help="print the text as the decoder commits it "
                                "(any decoder; default: on for one prompt on a terminal, off when stdout is piped, "
                                "with --json, --show or --compile)"),
    verbose: bool = typer.Option(False, "--verbose", help="with --chat: print the whole rendered chat template "
                                 "before the answer, not just the user's prompt"),
    trace: str = typer.Option(None, "--trace", help="write the per-step commit trace as JSON to FILE"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object per prompt per line"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --trace file"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16"),
    tp: int = typer.Option(None, "--tp", help="under torchrun: load the model tensor-parallel over N processes"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no loading / generating spinner on stderr "
                                     "(it shows only on a terminal)"),
    **knobs,
) -> None:
    """Generate continuations and print text plus NFE / TPF / TPS.

    Under torchrun the prompts are split over the processes (data parallel) and printed by rank
    0 in their original order; with --tp N every process decodes every prompt on its shard
    of the weights (docs/scaling.md)."""
    from unmask import dist
    from unmask.api import generate_sharded
    from unmask.cli.progress import compiling, status
    from unmask.cli.structured import check_for_model, check_logprobs_output, parse_logit_bias, read_grammar
    from unmask.decode import default_decoder
    from unmask.models import load

    texts = read_prompts(prompts or [], prompts_file)
    stream = _stream_on(stream, texts, as_json=as_json, show=show, torchrun=dist.launched(), compile=compile)
    if system is not None and not chat and all(isinstance(t, str) for t in texts):
        raise UnmaskError("--system applies to chat prompts; add --chat (or give messages rows in a .jsonl --prompts-file)")
    check_logprobs_output(logprobs, as_json=as_json)
    output, grammar_flag = read_grammar(json_schema=json_schema, json_object=json_object, regex=regex,
                                        grammar=grammar, choice=choice)  # files read before the model loads
    asks = {"logprobs": logprobs, "logit_bias": parse_logit_bias(logit_bias), "grammar": output}
    options = {k: v for k, v in knobs.items() if v is not None}  # the decoder flags given
    for k, v in options.items():  # the server refuses them too (JSON has no infinity)
        if isinstance(v, float) and not math.isfinite(v):
            raise UnmaskError(f"--{k.replace('_', '-')} must be a finite number (got {v}); for \"reveal everything\" "
                              "pass a large value such as 1e9")
    if compile:
        options["compile"] = True
    if trace is not None:  # before loading anything
        trace = check_output_file(os.path.expanduser(trace), "--trace", exists_ok=overwrite, probe=True)  # "" stays empty
    if dist.launched():
        if show or trace is not None:
            raise UnmaskError("--show/--trace follow one process; run them without torchrun")
        device = str(dist.setup(device))
        no_progress = no_progress or dist.env_rank() != 0
    with status(f"loading {model or 'the default model'}", enabled=not no_progress):
        bundle = load(model, kind=kind, device=device, dtype=dtype, tp=tp, adapter=adapter)
    check_for_model(bundle, output, grammar_flag, asks["logit_bias"])
    if decoder is None:  # the fastest exact one here (README "Lossless and lossy SBD", the default)
        from unmask.decode.choice import default_for

        chosen = default_for(bundle, options)
        decoder = chosen.decoder
        if chosen.note and dist.is_main():
            typer.echo(chosen.note, err=True)
    tracer = None
    if show or trace is not None:
        from rich.console import Console

        from unmask.api import prepare_prompts
        from unmask.trace import attach_trace

        shown = prepare_prompts(bundle, texts, chat=chat, system=system)[0]  # the rendered chat prompts
        # With --json, or stdout piped, the live view goes to stderr: stdout holds the result once
        # (piped, rich prints only the live view's last frame, which is the text again)
        import sys

        extra = attach_trace(show=show, trace_file=trace, bundle=bundle, prompts=shown,
                             console=Console(stderr=True) if as_json or not sys.stdout.isatty() else None)
        tracer = extra["on_step"]
        options.update(extra)
    from rich.console import Console
    from rich.text import Text

    console = Console()
    live = None
    if stream:
        from unmask.api import new_tokens, prepare_prompts
        from unmask.cli.live import LiveText

        rendered, ids = prepare_prompts(bundle, texts, chat=chat, system=system)
        live = LiveText(bundle, ids[0], stop=stop or (), limit=new_tokens(max_new_tokens, options.get("gen_length")),
                        decoder=decoder or default_decoder(bundle.kind), options=options)
        options["on_step"] = live if tracer is None else (lambda event: (tracer(event), live(event)))  # --trace too
        # soft_wrap: the terminal wraps long lines; piped output keeps the generated text intact.
        console.print(Text(shown_prompt(texts[0], rendered[0], chat=chat, verbose=verbose), "bold"), end="",
                      soft_wrap=True)
        console.file.flush()
    message = f"generating {len(texts)} prompt{'s' if len(texts) > 1 else ''} with {bundle.name}"
    spinner = status(message, enabled=not no_progress and not show and not stream)
    try:
        with spinner as spin, compiling(spin, message):
            result = generate_sharded(texts, bundle, decoder, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_k=top_k, top_p=top_p, seed=seed, stop=stop or None, chat=chat,
                                      system=system, reference_nfe=reference_nfe, **asks, **options)
    except BaseException:
        if tracer is not None:
            tracer.close(write=False)
        if live is not None:  # an interrupted answer: the error line goes below the text shown so far
            console.print()
        raise
    if tracer is not None:
        s = result.stats
        tracer.close({"decoder": result.decoder, "model": result.model, "texts": result.texts, "nfe": s.nfe,
                      "nfe_per_row": s.nfe_per_row, "tokens_per_row": s.tokens_per_row, "tpf": s.tpf})
    if not dist.is_main():  # under torchrun rank 0 prints the gathered result
        return
    if as_json:
        for row in result.rows():
            typer.echo(json.dumps(row, ensure_ascii=False))
        return
    if live is not None:
        text = live.finish(result.tokens[0])
        console.print(end="" if text.endswith("\n") else "\n")
        console.print()
    for prompt, text, given in zip(result.prompts, result.texts, texts) if live is None else ():
        prompt = shown_prompt(given, prompt, chat=chat, verbose=verbose)
        console.print(Text.assemble((prompt, "bold"), (text, "")), soft_wrap=True, end="" if text.endswith("\n") else "\n")
        console.print()  # one blank line before the next prompt or the stats, also after a text ending in a newline
    s = result.stats
    q = "" if s.queries_per_forward is None else f" · {round(s.queries_per_forward, 2):g} queries/forward"  # lossless sbd
    drafts = s.extra.get("drafts") or {}
    if set(drafts) - {"block"}:  # a model-free source ran: how much of what it drafted the model kept
        q += "".join(f" · {src} drafts {n['accepted']}/{n['drafted']} accepted" for src, n in drafts.items())
    nfe = f"NFE {s.nfe}" if len(result.tokens) == 1 else f"NFE {s.nfe} batch forwards, {sum(s.nfe_per_row)} row forwards"
    console.print(f"[dim]{result.model} · decoder {result.decoder} · {nfe} · generated {s.generated} · "
                  f"TPF {s.tpf:.2f}{q} · {s.tps:.1f} tok/s · {s.seconds:.2f} s[/dim]", soft_wrap=True)


def _knob_help(entries: list) -> str:
    """A decoder flag's help: the decoders that take it before their text ("sbd, diffusion, block: ...",
    one group per distinct text), as README's option table lists them; rich markup escaped, as typer
    renders help with it (a plug-in's "[0, 1] [/]")."""
    texts: dict[str, list[str]] = {}
    for decoder, k in entries:
        texts.setdefault(escape(k.help), []).append(decoder)
    return "; ".join(f"{', '.join(names)}: {text}" for text, names in texts.items())


def with_decoder_flags(cmd):
    """``cmd`` (whose ``**knobs`` take the decoder flags) with a signature typer reads: its own
    options, then one option per ``cli`` knob of the registered decoders (a bool: ``--x/--no-x``;
    unset by default, so the decoder's own default applies), and ``--decoder``'s help listing them."""
    params = []
    own = cmd.__dict__.setdefault("own_signature", inspect.signature(cmd))  # before any decoder flag was added
    for p in own.parameters.values():
        if p.name == "decoder":
            option = typer.Option(None, *p.default.param_decls, help=p.default.help.replace(
                "DECODERS", "; ".join(f"{s.name}: {escape(s.summary)}" for s in DECODERS.values())))
            p = p.replace(default=option)
        if p.kind is not p.VAR_KEYWORD:
            params.append(p)
    taken = {p.name for p in params}
    at = next(i for i, p in enumerate(params) if p.name == "stop") + 1  # the decoder flags follow the sampling ones
    for name, entries in all_knobs().items():
        entries = [(d, k) for d, k in entries if k.cli and k.type in TYPES]
        if not entries or name in taken:  # a knob named as one of generate's own options stays off the CLI
            continue
        k = entries[0][1]
        decls = [f"{k.flag}/--no-{k.flag[2:]}" if k.type is bool else k.flag]
        decls += sorted({k.short for _, k in entries if k.short})
        option = typer.Option(None, *decls, help=_knob_help(entries))
        params.insert(at, inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option,
                                            annotation=k.type))
        at += 1
    cmd.__signature__ = inspect.Signature(params)
    return cmd


app.command("generate")(with_decoder_flags(generate_cmd))
