"""Request bodies of the OpenAI-compatible endpoints -> validated :class:`ServeRequest`.

Validation reuses the library's own checks: the decoder name and model kind (``spec_for``), the
options a decoder takes (``check_options``: its config), the sampling knobs (``Sampling``) and the
prompt against the context window (``encode_prompts``); the knob names and value types are the
registered decoders' ``serve`` knobs (:mod:`unmask.decode`). Each error becomes an :class:`ApiError` (HTTP 400)
with the offending field in ``param``. The decoder's own checks of its option values (block
size, γ, τ, ...) run when the batch starts and are answered with 400 too. ``logprobs`` / ``top_logprobs``,
``n``, ``logit_bias``, ``response_format`` and ``structured_outputs`` are checked by :mod:`unmask.serve.asks`.

Chat messages become prompt ids as everywhere in unmask (:mod:`unmask.prompts`): the
tokenizer's chat template tokenized by itself, or the plain template when the tokenizer has none.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache

from unmask.api import check_options, encode_prompts
from unmask.decode import DECODERS, default_decoder, spec_for
from unmask.decode.verify.drafting import HOST
from unmask.errors import UnmaskError, is_int, is_number
from unmask.prompts import check_messages, check_text, has_chat_template, plain_template, render
from unmask.sampling import Sampling
from unmask.serve.asks import FIELDS as ASK_FIELDS, Asks, parse_asks
from unmask.serve.errors import ApiError, refused_as
from unmask.serve.limits import Limits, check_cost

DEFAULT_MAX_TOKENS = 128
MAX_STOP, MAX_STOP_CHARS = 64, 256  # stop strings per request (OpenAI takes 4) and their length
STREAM_MODES = ("committed", "canvas")
SAMPLING = ("temperature", "top_p", "top_k", "seed")  # the Sampling fields a request sets
# template characters counted per message before rendering (the plain template adds 2 to a system
# turn, 7 to a user turn): bounds the template's work on a huge list of empty messages
MESSAGE_CHARS = 2
# The request fields that are not decoder knobs (those come from the registry: decoder_knobs()).
# (logprobs, n, logit_bias and the grammar fields: :mod:`unmask.serve.asks`)
FIELDS = ("model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_mode", "timeout", "decoder", "reference_nfe", *ASK_FIELDS)
# OpenAI fields that are accepted only at their neutral value.
_NEUTRAL = {"echo": (None, False), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
            "suffix": (None, ""), "user": None, "stream_options": None, "max_completion_tokens": None,
            # tool calling is not served; client wrappers may still send an empty tool list
            "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
            "function_call": (None, "none")}


def decoder_knobs() -> dict[str, str]:
    """Request fields that are decoder knobs -> value type name (``int``, ``float``, ``str``, ``bool``):
    the ``serve`` knobs of the registered decoders, plug-ins included."""
    return _serve_knobs(tuple(DECODERS.values()))


@lru_cache(maxsize=4)
def _serve_knobs(specs: tuple) -> dict[str, str]:
    return {k.name: k.type_name for spec in specs for k in spec.knobs() if k.serve}


def _float_range(name: str, value) -> None:
    """Raise ApiError (400) for a JSON integer no float holds (309+ digits), where a number is read as a float."""
    if is_int(value):
        try:
            float(value)
        except OverflowError:
            raise ApiError(400, f"{name} is out of range (an integer of {len(str(abs(value)))} digits); pass a "
                                "number below 1e308", param=name) from None


# a knob's value type -> (its name in words, its check)
_TYPES = {"int": ("an integer", is_int), "float": ("a number", is_number),
          "str": ("a string", lambda v: isinstance(v, str)), "bool": ("true or false", lambda v: isinstance(v, bool))}


def _typed(name: str, value, kind: str):
    what, check = _TYPES[kind]
    ok = check(value)
    if not ok and kind == "float" and isinstance(value, float) and math.isinf(value):
        raise ApiError(400, f"{name} must be a finite number (got {value!r}; JSON has no infinity): for "
                            f"\"reveal everything\" pass a large value such as 1e9", param=name)
    if not ok:
        raise ApiError(400, f"{name} must be {what} (got {value!r}); fix or drop it", param=name)
    if kind == "str" and not value.strip():
        raise ApiError(400, f"{name} must not be empty; give a value or drop {name!r}", param=name)
    return float(value) if kind == "float" else value


def api_message(message: str) -> str:
    """A CLI error message in API terms: ``--block-size`` -> ``block_size``, ``--max-new-tokens``
    -> ``max_tokens``, ``--no-verify`` -> ``"verify": false``."""
    message = message.replace("--max-new-tokens", "max_tokens").replace("max_new_tokens", "max_tokens")
    # a CLI switch's "off" form is the field set to false: --no-verify -> "verify": false
    message = re.sub(r"--no-([a-z][a-z0-9-]*)", lambda m: f'"{m.group(1).replace("-", "_")}": false', message)
    return re.sub(r"--([a-z][a-z0-9-]*)", lambda m: m.group(1).replace("-", "_"), message)


def named_param(message: str, options) -> str | None:
    """The option of ``options`` that an (API-worded) error ``message`` names first, as a whole
    word in either spelling (block_size, block size): its subject, so "steps must be ... (gen
    length 32 / ...)" is about steps; at one place the longer name wins (tau_add, not tau). None
    when it names none."""
    low = message.lower()

    def first(k: str) -> int:
        spots = [m.start() for name in {k, k.replace("_", " ")}
                 for m in re.finditer(rf"(?<![a-z0-9_]){re.escape(name)}(?![a-z0-9_])", low)]
        return min(spots, default=len(low))

    named = sorted((first(k), -len(k), k) for k in options)
    return named[0][2] if named and named[0][0] < len(low) else None


def check_prompt_chars(bundle, prompt: str | list[dict], limits: Limits, field: str) -> None:
    """Raise ApiError (400 ``context_length_exceeded``) when the prompt passes ``--max-prompt-chars``,
    before anything is tokenized. A conversation counts as the chat template renders it (63,000
    empty messages are 441,000 characters of ``User: \n``): first as its contents plus
    ``MESSAGE_CHARS`` per message, so a huge message list is refused before the template runs
    over it, then as rendered (untokenized)."""
    limit = limits.prompt_chars(bundle)

    def refuse(chars: int, what: str):
        raise ApiError(400, f"the prompt has {chars} characters{what}, more than this server's limit of {limit}; "
                            "shorten it, or start the server with a larger --max-prompt-chars", param=field,
                       code="context_length_exceeded")

    if isinstance(prompt, str):
        if len(prompt) > limit:  # before tokenizing: a 5 MB prompt costs seconds of CPU
            refuse(len(prompt), "")
        return
    n = f"{len(prompt)} message{'s' if len(prompt) != 1 else ''}"
    contents = sum(len(m["content"]) for m in prompt)
    if contents > limit:
        refuse(contents, "")
    if contents + MESSAGE_CHARS * len(prompt) > limit:
        refuse(contents + MESSAGE_CHARS * len(prompt),
               f" (the contents of its {n} and {MESSAGE_CHARS} characters of chat template per message)")
    if not has_chat_template(bundle):
        text = plain_template(prompt)
    else:
        try:
            text = bundle.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses the messages is reported by render()
            return
    if len(text) > limit:
        refuse(len(text), f" as the chat template renders its {n}")


@dataclass(frozen=True, kw_only=True)
class ServeRequest(Asks):
    """A validated completion request (one prompt). ``logprobs``, ``logit_bias``, ``grammar`` (compiled),
    ``grammar_field`` and ``n`` (choices): :class:`unmask.serve.asks.Asks`."""

    prompt: str
    prompt_ids: list[int]
    decoder: str
    options: dict
    sampling: Sampling
    max_tokens: int
    stop: tuple[str, ...]
    stream: bool
    stream_mode: str
    timeout: float
    echo: bool = False  # completions: the answer's text starts with the prompt


def parse(body, bundle, model_name: str, *, chat: bool, default_timeout: float,
          defaults: dict | None = None, limits: Limits | None = None, draft_k: int = 1) -> ServeRequest:
    """Validate a request body. ``defaults``: the server's decoder and knobs (``unmask serve
    --decoder sbd --gamma 0.35``); the knobs apply only to requests that use that decoder, and a
    request's own knobs win. ``limits``: the server's per-request limits (prompt characters,
    checked before tokenizing; query and cache tokens, :func:`unmask.serve.limits.check_cost`);
    ``draft_k``: the largest K the server's draft-size table gives. Raises ApiError (400 naming
    the offending field; 404 ``model_not_found`` for another model, as OpenAI answers)."""
    limits = limits or Limits()
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    knobs = decoder_knobs()
    known = {*FIELDS, *knobs, *_NEUTRAL} - {"prompt" if chat else "messages"}
    for name in body:
        if name in ("prompt", "messages") and name not in known:
            raise ApiError(400, f"{'chat completions take messages' if chat else 'completions take a prompt'}, not "
                                f"{name!r}; post {name!r} to {'/v1/completions' if chat else '/v1/chat/completions'}",
                           param=name)
        if name not in known:
            raise ApiError(400, f"unknown parameter {name!r}; drop it (unmask fields: decoder, stream_mode, structured_outputs, timeout, top_k, {', '.join(sorted(knobs))})",
                           param=name)
    if body.get("reference_nfe") is not None and body["reference_nfe"] is not False:
        raise ApiError(400, "reference_nfe is not served (the server stops every request at its stop tokens); "
                            "measure the reference NFE with `unmask generate --reference-nfe`, and drop "
                            "'reference_nfe'", param="reference_nfe")
    echo = False if chat or body.get("echo") is None else body["echo"]
    if not isinstance(echo, bool):
        raise ApiError(400, f"echo must be true or false (got {json.dumps(echo)})", param="echo")
    for name, neutral in _NEUTRAL.items():
        if name == "echo" and not chat:  # completions take echo; chat has none (OpenAI's)
            continue
        # bool is an int in Python (True == 1): a boolean is refused where a number is expected
        wrong_type = isinstance(body.get(name), bool) and not any(isinstance(v, bool) for v in neutral or ())
        if neutral is not None and name in body and (wrong_type or body[name] not in neutral):
            if wrong_type:
                raise ApiError(400, f"{name} must be a number, not {json.dumps(body[name])}; drop {name!r}", param=name)
            raise ApiError(400, f"{name} is not supported; drop {name!r}", param=name)
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}", param="model",
                       code="model_not_found")

    for name in ("timeout", "temperature", "top_p", *(k for k, t in knobs.items() if t == "float")):
        _float_range(name, body.get(name))
    stream = False if body.get("stream") is None else body["stream"]  # 0, "" or []: refused, not read as false
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false (got {stream!r})", param="stream")
    mode = body.get("stream_mode", "committed")
    if mode not in STREAM_MODES:
        raise ApiError(400, f"stream_mode must be one of {', '.join(STREAM_MODES)} (got {mode!r})", param="stream_mode")
    timeout = default_timeout if body.get("timeout") is None else body["timeout"]
    if not (is_number(timeout) and timeout > 0):
        raise ApiError(400, f"timeout must be a number of seconds > 0 (got {timeout!r})", param="timeout")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)  # 0, {} or false: refused below
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of them", param="stop")
    for i, s in enumerate(stop):  # a lone surrogate could never match the decoded text
        with refused_as("stop"):
            check_text(s, f"stop[{i}]")
    # every stop string is matched against the text at every step, on the event loop (streams)
    if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each "
                            f"(got {len(stop)}, the longest {max(map(len, stop))}); send fewer or shorter ones",
                       param="stop")

    defaults = dict(defaults or {})
    server_decoder = defaults.pop("decoder", None) or default_decoder(bundle.kind)
    decoder = server_decoder if body.get("decoder") is None else body["decoder"]
    if not isinstance(decoder, str) or not decoder.strip():  # "", 0, false, []: never the default in disguise
        raise ApiError(400, f"decoder must be a decoder name such as {server_decoder!r} (got {json.dumps(decoder)}); "
                            "fix or drop it", param="decoder")
    given = {k: body[k] for k in knobs if body.get(k) is not None and k != "decoder"}
    if given.get("draft_source") not in (None, *HOST):  # the server's draft_tokens sizes its model-free default only
        defaults.pop("draft_tokens", None)
    merged = {**(defaults if decoder == server_decoder else {}), **given}
    options = {k: _typed(k, v, knobs[k]) for k, v in merged.items()}
    try:
        spec = spec_for(decoder, bundle.kind)
    except UnmaskError as e:
        raise ApiError(400, api_message(str(e)), param="decoder") from None
    try:
        cfg = check_options(spec, options)
    except UnmaskError as e:
        message = api_message(str(e))
        raise ApiError(400, message, param=named_param(message, options)) from None
    asks = parse_asks(body, bundle, chat=chat, decoder=decoder, cfg=cfg, echo=echo, max_n=limits.max_n)

    given = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if len(given) == 2 and given[0] != given[1]:
        raise ApiError(400, f"max_tokens ({given[0]!r}) and max_completion_tokens ({given[1]!r}) differ; send one of "
                            "them", param="max_completion_tokens")
    max_tokens = given[0] if given else DEFAULT_MAX_TOKENS
    try:  # null is the default, as an absent field (Sampling's defaults)
        sampling = Sampling(**{k: body[k] for k in SAMPLING if body.get(k) is not None})
    except UnmaskError as e:
        param = next((p for p in SAMPLING if p.replace("_", "-") in str(e)), None)
        raise ApiError(400, api_message(str(e)), param=param) from None

    if chat:
        with refused_as("messages"):
            prompt, field = check_messages(body.get("messages")), "messages"
    else:
        prompt, field = body.get("prompt"), "prompt"
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if prompt is None:
            raise ApiError(400, "prompt is required: send the text to continue as \"prompt\"", param="prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, f"prompt must be a string or a list of strings (got {_json_kind(prompt)}; token-id "
                                "prompts are not served): send the text", param="prompt")
    check_prompt_chars(bundle, prompt, limits, field)
    try:
        ids = encode_prompts(bundle, [prompt], max_tokens, options.get("gen_length"))[0]
        if chat:
            prompt = render(bundle, prompt)[0]  # the conversation as the model reads it
    except UnmaskError as e:
        msg = api_message(str(e))
        code = "context_length_exceeded" if "context window" in msg else None
        param = "max_tokens" if msg.startswith("max_tokens") else field
        raise ApiError(400, msg.replace("prompt 1 ", "the prompt "), param=param, code=code) from None
    check_cost(bundle, limits, decoder=decoder, options=options, prompt_tokens=len(ids), max_tokens=max_tokens,
               draft_k=draft_k)
    return ServeRequest(prompt=prompt, prompt_ids=ids, decoder=decoder, options=options, sampling=sampling,
                        max_tokens=max_tokens, stop=tuple(stop), stream=stream, stream_mode=mode, timeout=float(timeout),
                        echo=echo, **vars(asks))


def _json_kind(value) -> str:
    if isinstance(value, list):
        return "an empty list" if not value else \
            f"a list holding {_json_kind(next((v for v in value if not isinstance(v, str)), value[0]))}"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)


def prompt_bodies(body, *, chat: bool, max_prompts: int) -> list:
    """A completions ``body`` whose ``prompt`` is a list of several strings -> one body per prompt
    (OpenAI's batched completions: answered as choices indexed by prompt); any other body -> ``[body]``
    (:func:`parse` checks it). Raises ApiError (400) for more than ``max_prompts`` prompts, the
    server's queue bound, which such a request could never fit."""
    prompt = body.get("prompt") if isinstance(body, dict) and not chat else None
    if not (isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt)):
        return [body]
    if len(prompt) > max_prompts:
        raise ApiError(400, f"the request holds {len(prompt)} prompts, more than the {max_prompts} requests this "
                            "server queues; send fewer prompts per request, or start the server with a larger "
                            "--max-queue", param="prompt")
    return [{**body, "prompt": p} for p in prompt]
