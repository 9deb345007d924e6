"""The Python API: ``unmask.load`` and ``unmask.generate``."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from unmask.decode import Config, DecodeStats, Spec, spec_for
from unmask.decode.choice import default_for
from unmask.decode.engine.registry import plain_scalar
from unmask.errors import UnmaskError
from unmask.grammar import Grammar
from unmask.models import ModelBundle, load
from unmask.models.bundle import check_finite_weights, check_placement
from unmask.prompts import check_text
from unmask.sampling import Sampling
from unmask.threads import scoped, use_for


@dataclass
class Generation:
    """The result of ``generate``: one text and id list per prompt, and the run's statistics."""

    prompts: list[str]
    texts: list[str]
    tokens: list[list[int]]
    prompt_tokens: list[list[int]]
    stats: DecodeStats
    decoder: str
    model: str
    logprobs: list | None = None  # per prompt, one TokenLogprob per token (generate(logprobs=k)); None: not asked

    def rows(self) -> list[dict]:
        """One JSON-ready dict per prompt: the CLI ``--json`` contract.

        Per row: ``nfe`` and ``tpf`` (its forwards), ``seconds`` (the call's wall-clock: the rows of
        a batch are decoded together and all arrive when it ends) and ``tps`` (the row's own tokens
        per second, ``len(tokens) / seconds``). Per batch: ``batch_seconds`` and ``batch_tps`` (every
        row's tokens per second of the call, the figure the text output prints). ``accept_histogram``:
        the row's {tokens committed in a forward: forwards} where the decoder keeps it (lossless SBD:
        summing to its ``nfe``); lossless SBD adds ``queries_per_forward`` (query tokens per row per
        verify forward, the batch's mean; :class:`~unmask.decode.engine.stats.DecodeStats`). With
        ``logprobs`` asked: ``logprobs``, per token ``{"token", "logprob", "top_logprobs": [[id, logprob], ...]}``."""
        out = []
        secs = self.stats.seconds
        for i, prompt in enumerate(self.prompts):
            row = self.stats.row(i)
            lossless = {k: row[k] for k in ("queries_per_forward", "accept_histogram") if k in row}
            out.append({"prompt": prompt, "text": self.texts[i], "tokens": self.tokens[i], "nfe": row["nfe"],
                        "tpf": row["tpf"], "seconds": secs, "tps": row["generated"] / secs if secs > 0 else 0.0,
                        "batch_seconds": secs, "batch_tps": self.stats.tps, **lossless,
                        "decoder": self.decoder, "model": self.model, **self.stats.extra.get("row_extra", [{}] * len(self.prompts))[i]})
            if self.logprobs is not None:
                out[-1]["logprobs"] = [{"token": e.token, "logprob": e.logprob, "top_logprobs": [list(t) for t in e.top]}
                                       for e in self.logprobs[i]]
        return out


def prepare_prompts(bundle: ModelBundle, prompts: list, *, chat: bool = False,
                    system: str | None = None) -> tuple[list[str], list[list[int]]]:
    """Validate prompts and turn them into (prompt texts, prompt ids) as the model is fed them.

    A prompt is text, or a conversation (a list of ``{"role", "content"}`` messages); a
    conversation, and with ``chat=True`` every text prompt as a user turn, goes through the chat
    template (:mod:`unmask.prompts`: the tokenizer's, else the plain one), with ``system`` as a
    first system turn. Raises UnmaskError."""
    from unmask import prompts as P

    if not prompts:
        raise UnmaskError("no prompt given; pass PROMPT or --prompts-file FILE")
    if system is not None and not isinstance(system, str):
        raise UnmaskError(f"system must be text (got {type(system).__name__}); pass e.g. system=\"Be brief.\"")
    if system is not None and not chat and all(isinstance(p, str) for p in prompts):
        raise UnmaskError("system applies to chat prompts; pass chat=True (--chat) or conversations")
    texts, encoded = [], []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not prompt.strip():
                raise UnmaskError(f"prompt {i + 1} is empty; give some text to continue")
            P.check_text(prompt, f"prompt {i + 1}")
        elif not isinstance(prompt, list):
            raise UnmaskError(f"prompt {i + 1} is not text (got {type(prompt).__name__}); pass prompts as str, "
                              "or a conversation as a list of {role, content} messages")
        if isinstance(prompt, str) and not chat:
            texts.append(prompt)
            encoded.append(bundle.encode(prompt))
            continue
        if bundle.tokenizer is None:
            raise UnmaskError(f"{bundle.name} has no tokenizer files, which chat prompts need; add the checkpoint's "
                              "tokenizer to its directory or pass plain token ids to the decoders")
        text, ids = P.render(bundle, P.conversation(prompt, system, where=f"prompt {i + 1}"))
        texts.append(text)
        encoded.append(ids)
    return texts, encoded


def check_fit(bundle: ModelBundle, ids: list[list[int]], max_new_tokens: int, gen_length: int | None = None) -> None:
    """Prompt + new tokens must fit the context window, where the new tokens are ``gen_length``
    when a diffusion canvas length is given, else ``max_new_tokens``. Raises UnmaskError."""
    ctx = bundle.context_length
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise UnmaskError(f"max_new_tokens must be an integer > 0 (got {max_new_tokens!r}); pass e.g. 64")
    if isinstance(gen_length, int) and not isinstance(gen_length, bool) and gen_length >= ctx:  # -n defaults to it
        raise UnmaskError(f"gen length {gen_length} exceeds the context window of {ctx} tokens; lower --gen-length")
    if max_new_tokens >= ctx:
        raise UnmaskError(f"max_new_tokens {max_new_tokens} exceeds the context window of {ctx} tokens; lower --max-new-tokens")
    for i, p in enumerate(ids):
        if gen_length is not None and isinstance(gen_length, int) and len(p) + gen_length > ctx:
            raise UnmaskError(f"prompt {i + 1} is {len(p)} tokens; with --gen-length {gen_length} it exceeds the "
                              f"context window of {ctx}; shorten the prompt or lower --gen-length")
        if gen_length is None and len(p) + max_new_tokens > ctx:
            raise UnmaskError(f"prompt {i + 1} is {len(p)} tokens; with --max-new-tokens {max_new_tokens} it exceeds the "
                              f"context window of {ctx}; shorten the prompt or lower --max-new-tokens")


def encode_prompts(bundle: ModelBundle, prompts: list, max_new_tokens: int, gen_length: int | None = None, *,
                   chat: bool = False, system: str | None = None) -> list[list[int]]:
    """Tokenise prompts (:func:`prepare_prompts`) and validate them against the context window
    (:func:`check_fit`). Raises UnmaskError."""
    if not prompts:
        raise UnmaskError("no prompt given; pass PROMPT or --prompts-file FILE")
    check_fit(bundle, [], max_new_tokens, gen_length)  # the budget first, before any tokenizing
    ids = prepare_prompts(bundle, prompts, chat=chat, system=system)[1]
    check_fit(bundle, ids, max_new_tokens, gen_length)
    return ids


def new_tokens(max_new_tokens: int | None, gen_length=None) -> int:
    """The tokens :func:`generate` reports per prompt: ``max_new_tokens`` when given, else a
    diffusion ``gen_length`` (an int), else 128."""
    if max_new_tokens is not None:
        return max_new_tokens
    return gen_length if isinstance(gen_length, int) and not isinstance(gen_length, bool) else 128


# How a decode runs, not what it decodes: taken by every decoder beside its config's knobs.
RUN_OPTIONS = ("compile", "static", "on_step", "on_forward")


def check_options(spec: Spec, options: dict) -> Config:
    """The config of the decoder ``spec`` for ``options`` (:meth:`Config.of`; the run options
    :data:`RUN_OPTIONS` set aside). Raises UnmaskError, one line, for an option the decoder does not
    take, an integer beyond 64 bits, or a value its config refuses."""
    return spec.config.of({k: v for k, v in options.items() if k not in RUN_OPTIONS}, spec.name)


def as_prompt_list(prompts) -> list:
    """``prompts`` as a list of prompts: one text, one conversation (a list of message dicts), or
    a list of texts and conversations. Raises UnmaskError for anything else."""
    if isinstance(prompts, (bytes, bytearray, dict)) or not isinstance(prompts, (str, Iterable)):
        raise UnmaskError(f"prompts must be a str or a list of str (got {type(prompts).__name__}); "
                          "pass e.g. [\"Once upon a time\"]")
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, dict) for p in prompts):  # one conversation
        return [prompts]
    return [list(p) if isinstance(p, tuple) else p for p in prompts]


@scoped
def generate(prompts: str | list[str] | list[dict] | list[list[dict]], model: str | ModelBundle | None = None,
             decoder: str | None = None, *, max_new_tokens: int | None = None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = 0, stop: list[str] | None = None,
             chat: bool = False, system: str | None = None, device: str | None = None,
             dtype: str | None = None, reference_nfe: bool = False, logprobs: int | None = None,
             logit_bias: dict | None = None, response_format: dict | None = None, grammar=None, n: int = 1,
             **options) -> Generation:
    """Generate continuations of ``prompts`` with any decoder.

    prompts: a text, a list of texts, a conversation (a list of ``{"role", "content"}`` messages)
    or a list mixing texts and conversations. Conversations, and with ``chat=True`` every text as
    a user turn, are rendered with the tokenizer's chat template (``add_generation_prompt``), or
    the plain template for a model without one (:mod:`unmask.prompts`); ``system`` adds a system
    turn to conversations that have none. ``Generation.prompts`` then holds the rendered prompt
    text and ``prompt_tokens`` its exact ids (the template's own BOS, never a second one).

    model: a ModelBundle, a shipped name or a local directory (default: the default shipped
    model). device / dtype: where a name or directory is loaded (default cpu, float32); with a
    ModelBundle they must be None or the bundle's own (it is not moved or cast). decoder: ``ar``,
    ``sbd``, ... (default: :func:`unmask.decode.choice.default_for`, the natural decoder of the
    model's kind, except ``ar`` for an SBD model whose lossless SBD is expected slower than AR on
    this device).
    ``options`` go to the decoder (e.g. ``policy="entropy-bound", gamma=0.35, block_size=16``).
    max_new_tokens: tokens reported per prompt; default 128, or the whole canvas when a
    diffusion ``gen_length`` is given (a smaller value cuts the canvas and ends decoding early).
    reference_nfe: the dLLM decoders (``diffusion``, ``early-bird``, ``block``, ``multiblock``)
    decode the whole canvas as the published reference code does, instead of stopping after the
    block that holds EOS (and after the block that holds ``max_new_tokens``), so NFE is the
    reference's; the text and token counts are still cut at the first stop token and at
    ``max_new_tokens``. LLaDA's zero-quota steps (``steps`` above the gen length) run too, as in
    the reference (NFE = steps). ``ar`` and ``sbd`` stop at EOS as their references do: refused there.
    logprobs: k in [0, 20]: ``Generation.logprobs`` holds, per token, its logprob and the k most likely
    ids at its position (raw: the log-softmax before ``logit_bias``, a grammar, temperature and top-k/top-p;
    ``ar`` and lossless ``sbd`` from the verify forward, equal to AR's; the canvas decoders from the
    forward that committed the token). logit_bias: {token id: bias in [-100, 100]} added to the logits
    of every committed token. response_format: OpenAI's (``{"type": "json_object"}``, ``{"type":
    "json_schema", "json_schema": {"schema": {...}}}``); grammar: a :class:`unmask.grammar.Grammar`
    (``Grammar.regex(...)``, ``.lark(...)``, ``.choice([...])``, ``.json_schema(...)``) or Lark text: the
    output matches it (``ar`` and lossless ``sbd``; greedy output equals constrained AR's). n: choices per
    prompt (each its own row; ``Generation`` lists them prompt by prompt, choice i of prompt p at p * n + i,
    drawn with the generator ``unmask serve`` gives choice i, so a seeded choice is reproducible).
    Numbers may be numpy scalars (read as the Python numbers they hold).
    Raises UnmaskError for every invalid input (an invalid schema or grammar with the engine's
    message), and for a model whose weights are not finite.
    """
    max_new_tokens, temperature, top_k, top_p, seed, n = map(plain_scalar, (max_new_tokens, temperature, top_k, top_p,
                                                                            seed, n))
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UnmaskError(f"n must be an integer >= 1 (choices per prompt; got {n!r}); pass e.g. n=3")
    options = {k: plain_scalar(v) for k, v in options.items()}
    if not (model is None or isinstance(model, (str, os.PathLike, ModelBundle))):
        raise UnmaskError(f"model must be a shipped name, a directory path or a ModelBundle (got {type(model).__name__}); "
                          "pass e.g. model=\"stories260K\"")
    prompts = as_prompt_list(prompts)
    if not isinstance(chat, bool):
        raise UnmaskError(f"chat must be True or False (got {chat!r}); pass chat=True")
    if not (stop is None or isinstance(stop, (str, list, tuple))):
        raise UnmaskError(f"stop must be text or a list of texts (got {type(stop).__name__}); pass e.g. stop=[\"\\n\"]")
    for hook in ("on_step", "on_forward", "on_token"):
        if options.get(hook) is not None and not callable(options[hook]):
            raise UnmaskError(f"{hook} must be a function (got {type(options[hook]).__name__}); pass a callable or None")
    stop = [stop] if isinstance(stop, str) else list(stop or ())
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise UnmaskError(f"stop strings must be non-empty text (got {s!r}); drop it or give the text to stop at")
        check_text(s, f"stop string {i + 1}")  # a lone surrogate could never match the decoded text
    if isinstance(model, ModelBundle):
        check_placement(model, device, dtype)  # a loaded bundle is not moved: a different device would be ignored
        bundle = model
    else:
        bundle = load(model, device=device, dtype="float32" if dtype is None else dtype)
    use_for(bundle.model)  # the auto thread count for this call, unless the user chose one (unmask.threads)
    decoder = default_for(bundle, options).decoder if decoder is None else decoder  # "": refused, not the default
    spec = spec_for(decoder, bundle.kind)
    decode = spec.decode
    if "compile" in options and not isinstance(options["compile"], bool):
        raise UnmaskError(f"compile must be True or False (got {options['compile']!r}); pass compile=True")
    if options.get("compile") is False:  # an explicit "off" is the default of every decoder
        options.pop("compile")
    check_options(spec, options)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    max_new_tokens = new_tokens(max_new_tokens, options.get("gen_length"))
    if not prompts:
        raise UnmaskError("no prompt given; pass PROMPT or --prompts-file FILE")
    check_fit(bundle, [], max_new_tokens, options.get("gen_length"))
    prompts, ids = prepare_prompts(bundle, prompts, chat=chat, system=system)
    check_fit(bundle, ids, max_new_tokens, options.get("gen_length"))
    prompts, ids = [p for p in prompts for _ in range(n)], [list(i) for i in ids for _ in range(n)]
    check_finite_weights(bundle)
    if not isinstance(reference_nfe, bool):
        raise UnmaskError(f"reference_nfe must be True or False (got {reference_nfe!r}); pass reference_nfe=True")
    asks = {"logprobs": logprobs, "logit_bias": logit_bias, "grammar": output_grammar(response_format, grammar)}
    if reference_nfe:
        if any(v is not None for v in asks.values()):
            raise UnmaskError("reference_nfe decodes the whole canvas without a stop rule; drop logprobs, logit_bias "
                              "and the grammar with it")
        out = _reference_decode(decode, decoder, bundle, ids, max_new_tokens, sampling, stop, options)
    else:
        out = decode(bundle, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                     stop_token_ids=bundle.stop_token_ids, stop_strings=tuple(stop or ()), **asks, **options)
    texts = []
    for p, toks in zip(ids, out.tokens):
        text = bundle.decode_continuation(p, toks)
        for s in stop or ():
            if s in text:
                text = text[: text.index(s)]
        texts.append(text)
    return Generation(prompts=prompts, texts=texts, tokens=out.tokens, prompt_tokens=ids, stats=out.stats,
                      decoder=decoder, model=bundle.name, logprobs=out.logprobs)


def output_grammar(response_format=None, grammar=None):
    """The :class:`unmask.grammar.Grammar` of :func:`generate`'s ``response_format`` (OpenAI's) and
    ``grammar`` (a Grammar, or Lark text); None for neither (or ``{"type": "text"}``). Raises UnmaskError
    for both at once or a value of the wrong kind."""
    fmt = Grammar.of_response_format(response_format)
    if isinstance(grammar, str):
        grammar = Grammar.lark(grammar)
    if grammar is not None and not isinstance(grammar, Grammar):
        raise UnmaskError(f"grammar must be a unmask.grammar.Grammar or Lark text (got {type(grammar).__name__}); "
                          "pass e.g. Grammar.regex(\"[0-9]+\")")
    if fmt is not None and grammar is not None:
        raise UnmaskError("pass response_format or grammar, not both")
    return fmt or grammar


REFERENCE_NFE_DECODERS = ("diffusion", "early-bird", "block", "multiblock")


def _reference_decode(decode, decoder: str, bundle: ModelBundle, ids: list[list[int]], max_new_tokens: int,
                      sampling: Sampling, stop: list[str], options: dict):
    """:func:`generate`'s ``reference_nfe=True``: decode the whole canvas without stop tokens or
    strings (the reference code's forwards), then cut each row at its first stop token and at
    ``max_new_tokens``, recounting its generated tokens (NFE stays the whole canvas's).
    Raises UnmaskError for a decoder outside :data:`REFERENCE_NFE_DECODERS`."""
    from unmask.decode import DecodeOutput
    from unmask.decode.engine.stats import stop_flags

    if decoder not in REFERENCE_NFE_DECODERS:
        raise UnmaskError(f"--reference-nfe applies to the dLLM decoders ({', '.join(REFERENCE_NFE_DECODERS)}), "
                          f"not {decoder!r}, whose reference stops at EOS too; drop --reference-nfe")
    gen_length = options.get("gen_length")
    budget = max(max_new_tokens, gen_length) if isinstance(gen_length, int) else max_new_tokens
    if decoder == "diffusion":
        options = {**options, "reference_steps": True}  # LLaDA's zero-quota steps run too (NFE = steps)
    out = decode(bundle, ids, max_new_tokens=budget, sampling=sampling, stop_token_ids=(), stop_strings=(), **options)
    stops = set(bundle.stop_token_ids)
    tokens = []
    for row in out.tokens:
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        tokens.append(row[:min(cut, max_new_tokens)])
    s = out.stats
    # the stop token rule of DecodeStats: a stop token committed within max_new_tokens counts for TPF
    stats = DecodeStats(nfe=s.nfe, nfe_per_row=s.nfe_per_row, tokens_per_row=[len(t) for t in tokens],
                        seconds=s.seconds, extra={**s.extra, "reference_nfe": True},
                        stops_per_row=stop_flags(out.tokens, tokens, stops, max_new_tokens))
    return DecodeOutput(tokens=tokens, stats=stats)


@scoped
def generate_sharded(prompts: str | list[str], model: str | ModelBundle | None = None, decoder: str | None = None,
                     **kwargs) -> Generation:
    """:func:`generate` data-parallel under torchrun: rank r decodes the r-th contiguous share of
    ``prompts`` as one batch, and every rank gets the whole :class:`Generation` back in prompt
    order. Outside torchrun, or for a tensor-parallel bundle (every rank decodes every prompt), it
    is :func:`generate`.

    Under greedy decoding the rows are identical to one process (a row's tokens do not depend on
    the rows batched with it); sampled rows draw from their share's seeded generator, so they are
    reproducible for a given number of processes but differ from one process. Statistics: NFE is
    the forwards of all ranks, seconds the slowest rank's, ``extra["processes"]`` the world size.

    Raises:
        UnmaskError: as :func:`generate`, on every rank when any rank's share fails.
    """
    from unmask import dist

    prompts = as_prompt_list(prompts)
    if not dist.active() or (isinstance(model, ModelBundle) and model.meta.get("tp")):
        return generate(prompts, model, decoder, **kwargs)  # one process, or tensor-parallel: all ranks alike
    n, w, r = len(prompts), dist.world(), dist.rank()
    lo, hi = r * n // w, (r + 1) * n // w
    try:
        part = generate(prompts[lo:hi], model, decoder, **kwargs) if hi > lo else None
        payload = ("ok", lo, part)
    except UnmaskError as e:  # every rank must reach the gather, then all raise the same error
        payload = ("error", lo, str(e))
    shares = dist.gather_ordered([(r, payload)])
    errors = [p[2] for p in shares if p[0] == "error"]
    if errors:
        raise UnmaskError(errors[0])
    parts = [p[2] for p in shares if p[2] is not None]
    row_extra = [x for g in parts for x in g.stats.extra.get("row_extra", [{}] * len(g.prompts))]
    extra = {"row_extra": row_extra, "processes": w}
    for key in ("accepts", "query_windows"):  # lossless SBD's histograms: the shares' sums
        if all(key in g.stats.extra for g in parts):
            extra[key] = dict(sorted(sum((Counter(g.stats.extra[key]) for g in parts), Counter()).items()))
    stats = DecodeStats(nfe=sum(g.stats.nfe for g in parts),
                        nfe_per_row=[x for g in parts for x in g.stats.nfe_per_row],
                        tokens_per_row=[x for g in parts for x in g.stats.tokens_per_row],
                        stops_per_row=[g.stats.row(i)["stop_token"] for g in parts for i in range(len(g.prompts))],
                        seconds=max(g.stats.seconds for g in parts), extra=extra)
    return Generation(prompts=[x for g in parts for x in g.prompts], texts=[x for g in parts for x in g.texts],
                      tokens=[x for g in parts for x in g.tokens],
                      prompt_tokens=[x for g in parts for x in g.prompt_tokens], stats=stats,
                      decoder=parts[0].decoder, model=parts[0].model)
