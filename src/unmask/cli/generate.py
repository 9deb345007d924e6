"""``unmask generate``: the main job."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import typer

from unmask.cli import app
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


@app.command("generate")
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
    decoder: str = typer.Option(None, "--decoder", "-d", help="ar, sbd, ... (default: the model kind's natural decoder; "
                                "ar for an SBD model whose lossless sbd is expected slower here, with a note)"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", "-n",
                                       help="tokens to generate per prompt (default 128; with --gen-length, the whole canvas)"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
    top_k: int = typer.Option(0, "--top-k", help="sample from the k most likely tokens (0 = off)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling mass in (0, 1]"),
    seed: int = typer.Option(0, "--seed", help="seed of the sampling generator"),
    stop: list[str] = typer.Option(None, "--stop", help="stop string (repeatable)"),
    policy: str = typer.Option(None, "--policy", help="commit policy: entropy-bound, confidence-bound, threshold, factor, top-k, entropy-threshold"),
    gamma: float = typer.Option(None, "--gamma", help="EB-sampler bound γ >= 0 (entropy-bound / confidence-bound)"),
    preset: str = typer.Option(None, "--preset", help="γ preset: reasoning-low, reasoning-high, chat-low, chat-high"),
    tau: float = typer.Option(None, "--tau", help="confidence threshold τ in (0, 1] (threshold policy)"),
    factor: float = typer.Option(None, "--factor", help="Fast-dLLM factor f (factor policy)"),
    factor_compat: bool = typer.Option(None, "--factor-compat", help="diffusion: Fast-dLLM's factor rule bit for bit "
                                       "(float64 untempered κ, and its last-rank quirk; spec diffusion.md §6)"),
    tokens_per_step: int = typer.Option(None, "--tokens-per-step", help="tokens committed per step (top-k policy)"),
    eta: float = typer.Option(None, "--eta", help="diffusion: entropy bound η in nats (entropy-threshold policy)"),
    block_size: int = typer.Option(None, "--block-size", "-k", help="block size (sbd --verify: the draft size K)"),
    verify: bool = typer.Option(None, "--verify/--no-verify",
                                help="sbd: lossless SBD, the NTP mode verifies the block-mode draft (output = ar); "
                                     "default from the model"),
    draft: str = typer.Option(None, "--draft", help="sbd --verify: draft layout, linear, quadratic, budget (the "
                              "model's calibrated layout for --queries) or D/S/G text such as 3/0,2,3/4, with "
                              "siblings: 3/0,1,3/4+1g3 (spec/sbd_exact.md §5.3); default from the model (budget "
                              "where calibrated, else linear)"),
    queries: int = typer.Option(None, "--queries", help="sbd --verify, budgeted draft (--draft budget, the calibrated "
                                "models' default): query tokens per row per forward; the stored layout of the largest "
                                "budget <= Q runs (below the smallest: 1/0/Q-2, uncalibrated); default: the model's, "
                                "else 16"),
    reference_nfe: bool = typer.Option(False, "--reference-nfe", help="dLLM decoders (diffusion, early-bird, block, "
                                       "multiblock): decode the whole canvas as the reference code does, not stopping "
                                       "after the EOS block, so NFE equals theirs (the text is still cut at EOS)"),
    compile: bool = typer.Option(False, "--compile", help="a preallocated static KV cache (no-cache diffusion and "
                                 "early-bird: their canvas) and a torch.compile'd step, for every decoder but --schedule "
                                 "dream (the first call compiles, ~10-30 s per shape on a CPU core, more for a decoder "
                                 "with several shapes; same tokens)"),
    gen_length: int = typer.Option(None, "--gen-length", help="diffusion: fixed generation length (canvas size)"),
    steps: int = typer.Option(None, "--steps", help="diffusion: total denoising steps (top-k policy, LLaDA; --schedule dream); block: steps per block"),
    cache: str = typer.Option(None, "--cache", help="diffusion: none, prefix or dual (approximate caches)"),
    schedule: str = typer.Option(None, "--schedule", help="a published reference decoding: dream (diffusion: Dream's "
                                 "diffusion_generate), llada2 or sdar (block: their generate loops)"),
    alg: str = typer.Option(None, "--alg", help="--schedule dream: origin, maskgit_plus, topk_margin or entropy"),
    slots: int = typer.Option(None, "--slots", help="multiblock: Block Buffer slots N_buf"),
    tau_add: float = typer.Option(None, "--tau-add", help="multiblock: fill ratio that activates the next block"),
    tau_semi: float = typer.Option(None, "--tau-semi", help="multiblock: fill ratio of the preceding block that allows a forced commit"),
    tau_m2t: float = typer.Option(None, "--tau-m2t", help="multiblock: mask-to-token commit threshold"),
    tau_t2t: float = typer.Option(None, "--tau-t2t", help="multiblock: token-to-token edit threshold (off when unset)"),
    lps: bool = typer.Option(None, "--lps/--no-lps", help="early-bird: use the LPS commit router (default on)"),
    show: bool = typer.Option(False, "--show", help="render the decoding trajectory live in the terminal"),
    trace: str = typer.Option(None, "--trace", help="write the per-step commit trace as JSON to FILE"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object per prompt per line"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --trace file"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16"),
    tp: int = typer.Option(None, "--tp", help="under torchrun: load the model tensor-parallel over N processes"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no loading / generating spinner on stderr "
                                     "(it shows only on a terminal)"),
) -> None:
    """Generate continuations and print text plus NFE / TPF / TPS.

    Under torchrun the prompts are split over the processes (data parallel) and printed by rank
    0 in their original order; with --tp N every process decodes every prompt on its shard
    of the weights (docs/scaling.md)."""
    from unmask import dist
    from unmask.api import generate_sharded
    from unmask.cli.progress import status
    from unmask.models import load

    texts = read_prompts(prompts or [], prompts_file)
    if system is not None and not chat and all(isinstance(t, str) for t in texts):
        raise UnmaskError("--system applies to chat prompts; add --chat (or give messages rows in a .jsonl --prompts-file)")
    options = {"policy": policy, "gamma": gamma, "preset": preset, "tau": tau, "factor": factor,
               "factor_compat": factor_compat,
               "tokens_per_step": tokens_per_step, "eta": eta, "block_size": block_size, "gen_length": gen_length,
               "steps": steps, "cache": cache, "slots": slots, "tau_add": tau_add, "tau_semi": tau_semi,
               "tau_m2t": tau_m2t, "tau_t2t": tau_t2t, "lps": lps, "verify": verify, "draft": draft, "queries": queries,
               "schedule": schedule, "alg": alg}
    options = {k: v for k, v in options.items() if v is not None}
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
    if decoder is None:  # the fastest exact one here (README "Lossless and lossy SBD", the default)
        from unmask.decode.choice import default_for

        chosen = default_for(bundle, options)
        decoder = chosen.decoder
        if chosen.note and dist.is_main():
            typer.echo(chosen.note, err=True)
    tracer = None
    if show or trace is not None:
        import inspect

        from rich.console import Console

        from unmask.api import prepare_prompts
        from unmask.decode import DECODERS, default_decoder, get_decoder
        from unmask.trace import attach_trace

        def decoders_for(kind):
            return [d for d, info in DECODERS.items() if kind in info.kinds]

        name = decoder or default_decoder(bundle.kind)
        if "on_step" not in inspect.signature(get_decoder(name, bundle.kind)).parameters:
            able = [d for d in DECODERS if d in decoders_for(bundle.kind)
                    and "on_step" in inspect.signature(get_decoder(d, bundle.kind)).parameters]
            raise UnmaskError(f"--show/--trace are not available for decoder {name!r}; use --decoder "
                              f"{' or '.join(able) or 'diffusion, sbd, early-bird, block or multiblock on their models'}")
        shown = prepare_prompts(bundle, texts, chat=chat, system=system)[0]  # the rendered chat prompts
        # With --json, or stdout piped, the live view goes to stderr: stdout holds the result once
        # (piped, rich prints only the live view's last frame, which is the text again)
        import sys

        extra = attach_trace(show=show, trace_file=trace, bundle=bundle, prompts=shown,
                             console=Console(stderr=True) if as_json or not sys.stdout.isatty() else None)
        tracer = extra["on_step"]
        options.update(extra)
    spinner = status(f"generating {len(texts)} prompt{'s' if len(texts) > 1 else ''} with {bundle.name}",
                     enabled=not no_progress and not show)
    try:
        with spinner:
            result = generate_sharded(texts, bundle, decoder, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_k=top_k, top_p=top_p, seed=seed, stop=stop or None, chat=chat,
                                      system=system, reference_nfe=reference_nfe, **options)
    except BaseException:
        if tracer is not None:
            tracer.close(write=False)
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
    from rich.console import Console
    from rich.text import Text

    console = Console()
    # soft_wrap: the terminal wraps long lines; piped output keeps the generated text intact.
    for prompt, text in zip(result.prompts, result.texts):
        console.print(Text.assemble((prompt, "bold"), (text, "")), soft_wrap=True, end="" if text.endswith("\n") else "\n")
        console.print()  # one blank line before the next prompt or the stats, also after a text ending in a newline
    s = result.stats
    q = "" if s.queries_per_forward is None else f" · {s.queries_per_forward:g} queries/forward"  # lossless sbd
    nfe = f"NFE {s.nfe}" if len(result.tokens) == 1 else f"NFE {s.nfe} batch forwards, {sum(s.nfe_per_row)} row forwards"
    console.print(f"[dim]{result.model} · decoder {result.decoder} · {nfe} · generated {s.generated} · "
                  f"TPF {s.tpf:.2f}{q} · {s.tps:.1f} tok/s · {s.seconds:.2f} s[/dim]", soft_wrap=True)
