"""What a request asks of a decoder's target distribution and outputs, beside its sampling: a
``logit_bias`` added to the logits of every token it commits, and ``logprobs`` (each generated
token's log-probability and its k most likely alternatives). Shared by every running batch.

A token's logprobs are the log-softmax of the model's logits at the query that produced it, raw:
before ``logit_bias``, a grammar's mask, temperature and top-k/top-p (suppressed ids such as the mask
token stay at -inf). The verify batch (``ar``, lossless ``sbd``) takes them from its verify forward,
so they equal AR's; the canvas decoders from the forward that committed the token (commit-time).
"""

from __future__ import annotations

import math
import numbers
import operator
import re
import struct
from dataclasses import dataclass

import torch

from unmask.grammar import compile as compile_grammar
from unmask.errors import UnmaskError

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_BIAS = 100.0  # OpenAI's bound on a logit_bias value
TOKEN_ID = re.compile(r"-?[0-9]{1,18}")  # a JSON key naming an id: ASCII digits only (int() reads "٣" and trips on "³")


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: ``token`` its id, ``logprob`` its log-probability (nats, float32), ``top``
    the k most likely ids at its position with theirs, most likely first (k = the request's logprobs)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_logprobs(k, where: str = "logprobs") -> int | None:
    """A request's ``logprobs`` (top alternatives per token) as an int in [0, 20], or None (none asked).
    Raises UnmaskError."""
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise UnmaskError(f"{where} must be an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives kept per token; "
                          f"got {k!r}); pass e.g. 5")
    return int(k)  # a numpy integer too


def check_logit_bias(bias, vocab: int, where: str = "logit_bias") -> dict[int, float] | None:
    """A request's ``logit_bias`` ({token id: bias}, ids as integers (numpy's and 0-d tensors too) or ASCII
    decimal strings as JSON sends them, biases real numbers in [-100, 100]) as {int: float}; None or {} -> None. Raises UnmaskError naming the ids outside
    the model's vocabulary [0, vocab) or the values out of range."""
    if bias is None or (isinstance(bias, dict) and not bias):
        return None
    if not isinstance(bias, dict):
        raise UnmaskError(f"{where} must be an object of token id -> bias (got {type(bias).__name__}); "
                          "pass e.g. {\"50256\": -100}")
    out, unknown = {}, []
    for key, value in bias.items():
        tid = _token_id(key)
        if tid is None or not 0 <= tid < vocab:
            unknown.append(_short(str(key)))
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -MAX_BIAS <= value <= MAX_BIAS \
                or not math.isfinite(value):  # bounds first: an int past float's range is out of them (nan fails both)
            raise UnmaskError(f"{where}[{_short(str(key))}] must be a number in [-100, 100] (got {_short(repr(value))})")
        out[tid] = float(value)
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise UnmaskError(f"{where} names keys that are not token ids of this model ({shown}); its keys are ids "
                          f"0..{vocab - 1}, as integers or decimal text")
    return out


def _token_id(key) -> int | None:
    """A logit_bias key as a token id, or None for one that names no id (a float, text that is not decimal)."""
    if isinstance(key, str):
        return int(key) if TOKEN_ID.fullmatch(key.strip()) else None
    if isinstance(key, bool) or isinstance(key, numbers.Real) and not isinstance(key, numbers.Integral):
        return None  # True is not token 1, nor 13.0 token 13
    try:
        return operator.index(key)  # int, numpy integers, a 0-d integer tensor
    except TypeError:
        return None


def _short(text: str, most: int = 24) -> str:
    """An echoed key or value, cut: a 5,000-digit id is named by its first digits."""
    return text if len(text) <= most else text[: most - 3] + "..."


def asks_logprobs(job) -> int | None:
    """A job's ``logprobs`` (k), None when it asks none (a job type without the field asks none)."""
    return getattr(job, "logprobs", None)


def asks_bias(job) -> dict | None:
    """A job's ``logit_bias``, None when it has none."""
    return getattr(job, "logit_bias", None)


def asks_grammar(job):
    """A job's compiled grammar, None when it has none."""
    return getattr(job, "grammar", None)


def asks_any(job) -> bool:
    return asks_logprobs(job) is not None or bool(asks_bias(job)) or asks_grammar(job) is not None


class SlotBias:
    """The dense bias of a forward over slots [0, n): ``self(rows, V, device)`` with ``rows`` the row in
    each slot (None: free) -> (n, V) float32, or None when no row has a bias; cached while the rows in
    those slots are the same rows (compared by identity)."""

    def __init__(self):
        self._key: tuple | None = None
        self._bias: torch.Tensor | None = None

    def __call__(self, rows: list, V: int, device) -> torch.Tensor | None:
        key = (V, *rows)
        if key != self._key:
            self._key = key
            self._bias = bias_rows([None if r is None else asks_bias(r.job) for r in rows], V, device)
        return self._bias


def bias_rows(biases: list, V: int, device) -> torch.Tensor | None:
    """One dense bias row per slot: ``biases`` a list of {id: bias} or None per slot -> (R, V) float32
    (zeros where None), or None when no slot has a bias."""
    if not any(biases):
        return None
    out = torch.zeros((len(biases), V), dtype=torch.float32)
    for i, b in enumerate(biases):
        if b:
            out[i, list(b)] = torch.tensor(list(b.values()), dtype=torch.float32)
    return out.to(device)


def add_bias(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """logits (R, Q, V) or (R, V) plus bias (R, V) per row, in place (a no-op for None)."""
    if bias is not None:
        logits += (bias[:, None, :] if logits.dim() == 3 else bias).to(logits.dtype)
    return logits


def columns(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logprob columns of tokens (...,) drawn at logits (..., V): the chosen token's logprob (...,),
    the top-k ids (..., k) and their logprobs (..., k), float32 (log-softmax in float32 whatever the
    logits' dtype; ties in the top-k ordered by id as ``torch.topk`` breaks them)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (..., V)
    chosen = lp.gather(-1, tokens[..., None].clamp(min=0))[..., 0]  # (...,)
    vals, ids = lp.topk(k, dim=-1) if k else (lp[..., :0], tokens[..., None][..., :0])
    return chosen, ids, vals


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """float32 values as int32 bit patterns, for :class:`~unmask.decode.engine.host.HostRead` (exact)."""
    return t.float().contiguous().view(torch.int32)


def from_bits(bits: list[int]) -> list[float]:
    """int32 bit patterns (as :func:`as_bits` packed them, read back as Python ints) -> the float32 values."""
    return list(struct.unpack(f"{len(bits)}f", struct.pack(f"{len(bits)}i", *bits)))


def entries(tokens: list[int], chosen: list[int], top_ids: list[list[int]], top_vals: list[list[int]]) -> list[TokenLogprob]:
    """TokenLogprobs from a host read: ``chosen`` and ``top_vals`` as bit patterns (:func:`as_bits`)."""
    lp = from_bits(chosen)
    return [TokenLogprob(t, lp[i], tuple(zip(top_ids[i], from_bits(top_vals[i])))) for i, t in enumerate(tokens)]


def request_asks(decoder: str, cfg, bundle, takers, *, logprobs=None, logit_bias=None, grammar=None) -> dict:
    """A request's per-row asks, checked, as :class:`~unmask.decode.engine.running.Request` fields:
    ``logprobs`` (k in [0, 20]), ``logit_bias`` (ids in the model's vocabulary, biases in [-100, 100]) and
    ``grammar`` (a :class:`unmask.grammar.Grammar`) compiled for ``bundle``, refused when ``cfg`` does not
    ``takes_grammar`` (``takers(bundle=None)``: the decoders that do, of ``bundle``'s kind when given, for the
    message). Raises UnmaskError."""
    out = {"logprobs": check_logprobs(logprobs), "logit_bias": check_logit_bias(logit_bias, bundle.model.config.vocab_size)}
    if grammar is not None:
        if not cfg.takes_grammar(bundle):
            takes = " and ".join("lossless sbd" if n == "sbd" else n for n in takers())
            fix = "choose one of them" if takers(bundle) else \
                "no decoder of this model takes one: load a model they decode ('unmask models' lists them)"
            raise UnmaskError(f"decoder {decoder!r} does not take a grammar (structured output runs on {takes}, "
                              f"exact to constrained AR); {fix} or drop the grammar")
        out["grammar"] = compile_grammar(bundle, grammar)
    return out


__all__ = ["MAX_BIAS", "MAX_TOP_LOGPROBS", "SlotBias", "TokenLogprob", "add_bias", "asks_any", "asks_bias",
           "asks_grammar", "asks_logprobs", "as_bits", "bias_rows", "check_logit_bias",
           "check_logprobs", "columns", "entries", "from_bits", "request_asks"]
