"""The OpenAI request fields that shape what a decoder returns, beside its sampling: ``logprobs`` /
``top_logprobs``, ``n`` (and ``best_of``), ``logit_bias``, ``response_format`` and unmask's
``structured_outputs`` -> :class:`Asks`, each error an :class:`ApiError` (400) naming its field.

- ``logprobs``: completions take an integer k in [0, 20] (the alternatives kept per token); chat takes
  ``true`` with ``top_logprobs`` k in [0, 20] (``top_logprobs`` alone is refused, as OpenAI does). Every
  decoder serves them (:mod:`unmask.decode.engine.shaping`). A completion's ``echo`` with ``logprobs``
  is refused: the prompt's own logprobs are not computed.
- ``n``: choices per prompt, 1 to the server's ``--max-n``; ``best_of`` only absent or equal to ``n``.
- ``logit_bias``: {token id: bias in [-100, 100]}; an id outside the vocabulary is refused by name.
- ``response_format`` (``text``, ``json_object``, ``json_schema``) or ``structured_outputs`` (vLLM's
  shape: exactly one of ``json``, ``regex``, ``grammar``, ``choice``, ``json_object``): a grammar,
  compiled here (cached per model and grammar) so an invalid one is answered before anything runs,
  and only for a decoder whose config takes one (``ar``, lossless ``sbd``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from unmask.decode.engine.registry import grammar_decoders
from unmask.decode.engine.shaping import check_logit_bias, check_logprobs
from unmask.errors import is_int
from unmask.grammar import Grammar, compile as compile_grammar
from unmask.serve.errors import ApiError, refused_as

FIELDS = ("n", "best_of", "logprobs", "top_logprobs", "logit_bias", "response_format", "structured_outputs")


@dataclass(frozen=True)
class Asks:
    """logprobs: None, or k in [0, 20] (the alternatives per token); logit_bias: {id: bias} or None;
    grammar: a :class:`unmask.grammar.Compiled` or None, ``grammar_field`` the field that gave it (the ``param``
    of a grammar error met while decoding); n: choices per prompt."""

    logprobs: int | None = None
    logit_bias: dict | None = None
    grammar: object = None
    n: int = 1
    grammar_field: str | None = None


def _int(name: str, value) -> int:
    if not is_int(value):
        raise ApiError(400, f"{name} must be an integer (got {json.dumps(value)}); fix or drop {name!r}", param=name)
    return value


def _logprobs(body: dict, chat: bool, echo: bool) -> int | None:
    """The alternatives per token the request asks for, or None (no logprobs)."""
    given, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if given is not None and not isinstance(given, bool):
            raise ApiError(400, f"logprobs must be true or false in a chat request (got {json.dumps(given)}); the "
                                "alternatives per token are top_logprobs", param="logprobs")
        if top is not None:
            _int("top_logprobs", top)
            if top and given is not True:
                raise ApiError(400, 'top_logprobs needs "logprobs": true; add it or drop top_logprobs',
                               param="top_logprobs")
        if given is not True:
            return None
        with refused_as("top_logprobs"):
            return check_logprobs(top or 0, "top_logprobs")
    if top not in (None, 0) or isinstance(top, bool):
        raise ApiError(400, "top_logprobs is a chat field; completions take \"logprobs\": k (the alternatives per "
                            "token); drop 'top_logprobs'", param="top_logprobs")
    if given is None or given is False:  # false: what some clients send for "none"
        return None
    if given is True:
        raise ApiError(400, "logprobs of a completion is the number of alternatives per token, an integer in "
                            "[0, 20] (got true); pass e.g. 5", param="logprobs")
    with refused_as("logprobs"):
        k = check_logprobs(given)
    if echo:
        raise ApiError(400, "logprobs of the prompt are not served, so echo and logprobs do not go together; drop "
                            "'echo' or 'logprobs'", param="echo")
    return k


def _n(body: dict, max_n: int) -> int:
    n = 1 if body.get("n") is None else _int("n", body["n"])
    if not 1 <= n <= max_n:
        raise ApiError(400, f"n must be in [1, {max_n}], the choices per prompt this server returns (got {n}); "
                            "send fewer, or start the server with a larger --max-n", param="n")
    best = body.get("best_of")
    if best is not None and _int("best_of", best) != n:
        raise ApiError(400, f"best_of is served only equal to n (every choice is returned; got best_of {best}, "
                            f"n {n}); drop 'best_of'", param="best_of")
    return n


def _grammar(body: dict, bundle, decoder: str, cfg):
    """(the request's compiled grammar, the field that gave it), or (None, None)."""
    fmt, structured = body.get("response_format"), body.get("structured_outputs")
    with refused_as("response_format"):
        grammar, field = Grammar.of_response_format(fmt), "response_format"
    if structured is not None:
        if grammar is not None:
            raise ApiError(400, "send one of response_format and structured_outputs, not both",
                           param="structured_outputs")
        field = "structured_outputs"
        with refused_as(field):
            grammar = Grammar.of_structured(structured)
    if grammar is None:
        return None, None
    with refused_as(field, first_line=True):  # options that contradict (the decoder reports them too)
        takes = cfg.takes_grammar(bundle)
    if not takes:
        takers = grammar_decoders(bundle)
        why = (f"decoder {decoder!r} takes a grammar only where it decodes exactly (lossless), and these options "
               "make it lossy" if decoder in takers else f"decoder {decoder!r} does not take a grammar")
        if not takers:  # no request to this server can fix it, only another model can
            raise ApiError(400, f"{field}: {why}, nor does any decoder of this model (structured output runs on ar "
                                f"and lossless sbd: a causal or sbd model); drop {field!r}", param=field)
        served = ", ".join(f"{t} (lossless)" if t == "sbd" else t for t in takers)
        raise ApiError(400, f"{field}: {why}; structured output is served by {served} on this model: choose one, or "
                            f"drop {field!r}", param=field)
    with refused_as(field, first_line=True):
        return compile_grammar(bundle, grammar), field


def parse_asks(body: dict, bundle, *, chat: bool, decoder: str, cfg, echo: bool, max_n: int) -> Asks:
    """The fields of the module docstring of a request ``body`` for ``decoder`` (its config ``cfg``, which
    says whether it takes a grammar) on ``bundle``; ``max_n``: the server's ``--max-n``. Raises ApiError (400, ``param`` the field)."""
    logprobs, n = _logprobs(body, chat, echo), _n(body, max_n)
    with refused_as("logit_bias"):
        bias = check_logit_bias(body.get("logit_bias"), int(bundle.model.config.vocab_size))
    grammar, field = _grammar(body, bundle, decoder, cfg)
    return Asks(logprobs=logprobs, logit_bias=bias, grammar=grammar, n=n, grammar_field=field)


__all__ = ["Asks", "FIELDS", "parse_asks"]
