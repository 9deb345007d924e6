"""What one request may cost the server, checked before it is admitted.

A request's memory is set by the query tokens it puts into each forward (the attention scores of
one row are ``heads x Q x (cache + Q)`` floats) and by its KV cache (prompt + completion tokens).
Both are known from the decoder and its knobs before anything runs, so a request over a limit is
answered 400 at once, naming the limit and the ``unmask serve`` flag that raises it, instead of
being allowed to run the process out of memory (lossless ``sbd`` with ``draft: quadratic`` and
``block_size: 128`` puts K + K² = 16,512 queries into each forward). A batch's forward is bounded
by ``--max-batch-size`` x ``--max-query-tokens``.

A batch is bounded by memory at start (:func:`check_batch_memory`): ``--max-batch-size`` rows, each
with a KV cache of ``--max-cache-tokens`` and its slot tensors, must fit in the memory free on the
model's device, or the server does not start.

Body and prompt sizes are bounded too: the body by ``--max-body-bytes`` (413, checked from
``Content-Length`` and while reading, before parsing) and the prompt text by
``--max-prompt-chars`` (400, before tokenizing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from unmask import memory
from unmask.decode.blocks.sbd import DEFAULT_BLOCK_SIZE, SBDOptions, runs_lossless
from unmask.decode.blocks.single import native_block_size
from unmask.decode.dllm.diffusion import DiffusionOptions
from unmask.decode.verify import config as sbd_verify, layout as draft_layout, siblings as sibling_layout
from unmask.decode.verify.drafting import DEFAULT_DRAFT_TOKENS, HOST
from unmask.errors import UnmaskError, is_int
from unmask.routers.io import routers_dir
from unmask.serve.errors import ApiError

DEFAULT_MAX_BODY_BYTES = 2 * 2**20  # 2 MiB: a full 128k-token prompt as JSON fits, a 16 MiB body does not
DEFAULT_MAX_QUERY_TOKENS = 2048  # per request and forward, like vLLM's default --max-num-batched-tokens
DEFAULT_MAX_N = 8  # choices per prompt (OpenAI's n)
CHARS_PER_TOKEN = 32  # default prompt cap: context window x 32 characters (no tokenizer averages more)


@dataclass(frozen=True)
class Limits:
    """Per-request limits of one server. ``max_body_bytes``: request body bytes (413 above it);
    ``max_prompt_chars``: prompt characters (None: ``CHARS_PER_TOKEN`` x the cache limit);
    ``max_query_tokens``: query tokens one request puts into one decode forward (the prompt's
    prefill aside); ``max_cache_tokens``: prompt + completion tokens one request keeps in its
    KV cache (None: the model's context window); ``max_n``: choices one prompt may ask for (OpenAI's ``n``).

    Raises:
        UnmaskError: a limit that is not an integer >= 1.
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int | None = None
    max_query_tokens: int = DEFAULT_MAX_QUERY_TOKENS
    max_cache_tokens: int | None = None
    max_n: int = DEFAULT_MAX_N

    def __post_init__(self):
        for name in ("max_body_bytes", "max_prompt_chars", "max_query_tokens", "max_cache_tokens", "max_n"):
            value = getattr(self, name)
            if value is None and name in ("max_prompt_chars", "max_cache_tokens"):
                continue
            if not is_int(value) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise UnmaskError(f"{flag} must be an integer >= 1 (got {value!r}); pass e.g. "
                                  f"{flag} {getattr(Limits, name) or 4096}")

    def cache_tokens(self, bundle) -> int:
        return self.max_cache_tokens if self.max_cache_tokens is not None else int(bundle.context_length)

    def prompt_chars(self, bundle) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else CHARS_PER_TOKEN * self.cache_tokens(bundle)


def query_tokens(bundle, decoder: str, options: dict, max_tokens: int, draft_k: int = 1) -> tuple[int, str, str]:
    """(query tokens one row puts into one decode forward, how they arise, the knob that sets them)
    for a request, from the decoder's knobs and the checkpoint's decode defaults. ``draft_k``: the
    largest K the server's draft-size table may give a lossless sbd request that fixes no block size.
    Knobs the decoder will refuse count as the defaults (the decoder reports them)."""
    defaults = bundle.meta.get("decode_defaults") or {}

    def knob(name, *fallbacks):  # the option if it is a valid count, else the first fallback set
        v = options.get(name)
        return next(x for x in (v if is_int(v) and v >= 1 else None, *fallbacks) if x is not None)

    if decoder in ("ar", "sbd") and options.get("draft_source") in HOST:  # the verify part alone
        n = knob("draft_tokens", DEFAULT_DRAFT_TOKENS)
        return n + 1, f"{decoder} with {options['draft_source']} drafts of up to {n} tokens: {n + 1} queries per row", \
            "draft_tokens"
    if decoder == "sbd" and runs_lossless(bundle, options):
        own, fixed = sbd_verify.default_block_size(bundle), options.get("block_size") is not None
        # unless the request fixes K: the draft-size table's K or the checkpoint's default, whichever is larger
        k = knob("block_size", sbd_verify.DEFAULT_BLOCK_SIZE) if fixed else max(draft_k, own)
        of_k = f"block_size {k}" if fixed or k == own else \
            f"K = {k} from the server's --draft-sizes table (a request's block_size fixes K)"
        try:
            draft = SBDOptions(**{k: options.get(k) for k in ("draft", "block_size", "queries")}).layout(bundle)
        except UnmaskError:
            draft = sbd_verify.DEFAULT_DRAFT  # the decoder reports the bad budget
        if draft_layout.is_layout(draft):
            q = sibling_layout.parse(draft).queries  # siblings (spec §5.3) cost queries too
            param = "draft" if "draft" in options and "queries" not in options else "queries"  # the knob that chose it
            return q, f"lossless sbd with draft layout {draft}: {q} queries per row", param
        if draft == "quadratic":
            return k + k * k, f"lossless sbd with draft quadratic and {of_k}: K + K² queries per row", "block_size"
        return 2 * k, f"lossless sbd with {of_k}: 2K queries per row", "block_size"
    if decoder in ("sbd", "block"):
        k = knob("block_size", defaults.get("block_size"), DEFAULT_BLOCK_SIZE)
        return k, f"{decoder} with block_size {k}", "block_size"
    if decoder == "multiblock":
        b = knob("block_size", native_block_size(bundle), 1)
        s = knob("slots", defaults.get("slots"), 2)
        return s * b, f"multiblock with {s} slots of block_size {b}", "slots"
    if decoder == "early-bird":  # its canvas is the LBS router's length, whatever max_tokens asks for
        length = early_bird_length(bundle, options) or knob("gen_length", max_tokens)
        return length, f"early-bird over a canvas of {length} tokens (the LBS router's gen_length)", "gen_length"
    if decoder == "diffusion":
        try:  # the whole canvas is scored in a refresh (or every step without a cache)
            length = DiffusionOptions(**{k: v for k, v in options.items() if k in ("gen_length", "block_size")}
                                      ).resolve(bundle, max_tokens).gen_length
        except (UnmaskError, TypeError):
            length = knob("gen_length", max_tokens)
        return length, f"{decoder} over a canvas of {length} tokens (gen_length)", "gen_length"
    return 1, decoder, "decoder"


def early_bird_length(bundle, options: dict) -> int | None:
    """The canvas length an early-bird request decodes: the ``gen_length`` of the LBS router it
    will load (``options["routers"]`` or the model's own), read from ``lbs.json`` without loading
    the weights. None when no router is found (the decoder reports that when the batch starts)."""
    try:
        where = routers_dir(bundle, options.get("routers"))
        length = json.loads((where / "lbs.json").read_text())["config"]["gen_length"]
    except Exception:  # noqa: BLE001 - any unreadable router is the decoder's error to report
        return None
    return length if is_int(length) and length >= 1 else None


def check_cost(bundle, limits: Limits, *, decoder: str, options: dict, prompt_tokens: int, max_tokens: int,
               draft_k: int = 1) -> None:
    """Raise ApiError (400, code ``request_too_large``) when a request's query tokens per forward
    or its cache tokens pass the server's limits; the message names the flag that raises them."""
    q, why, param = query_tokens(bundle, decoder, options, max_tokens, draft_k)
    if q > limits.max_query_tokens:
        raise ApiError(400, f"this request puts {q} query tokens into each forward ({why}), more than this "
                            f"server's limit of {limits.max_query_tokens}; lower {param}"
                            f"{' or use draft linear' if 'quadratic' in why else ''}, or start the server with "
                            f"a larger --max-query-tokens", param=param, code="request_too_large")
    # a diffusion canvas is cached whole, however few tokens are asked for
    length = max(max_tokens, q) if param == "gen_length" else max_tokens
    cache = prompt_tokens + length
    if cache > limits.cache_tokens(bundle):
        raise ApiError(400, f"this request keeps {cache} tokens in its cache ({prompt_tokens} prompt + {length} "
                            f"completion), more than this server's limit of {limits.cache_tokens(bundle)}; lower "
                            "max_tokens or shorten the prompt, or start the server with a larger --max-cache-tokens",
                       param="max_tokens", code="request_too_large")


def check_defaults(bundle, limits: Limits, decoder: str, options: dict, draft_k: int = 1) -> None:
    """Raise UnmaskError (one line) when the server's default request (``decoder``, ``options``) breaks
    ``limits`` (:func:`check_cost`): every such request would be refused, so the server does not start."""
    try:
        check_cost(bundle, limits, decoder=decoder, options=options, prompt_tokens=1, max_tokens=1, draft_k=draft_k)
    except ApiError as e:
        raise UnmaskError(f"every default request would be refused: {e.message}") from None


def check_batch_memory(bundle, limits: Limits, max_batch_size: int) -> None:
    """Raise UnmaskError (one line, with the numbers) when a full batch of ``max_batch_size`` rows cannot
    fit in the memory free on the model's device: per row, the KV cache of ``limits.cache_tokens``
    tokens (at most the context window), its token and position slots, and the (K, V) float32 draft
    probabilities a sampled lossless row keeps (:mod:`unmask.memory`; a lower bound, so a refused size never fits)."""
    if not is_int(max_batch_size) or max_batch_size < 1:
        return  # the scheduler refuses it by name
    model = bundle.model
    # a request's prompt + completion must fit the context window: a larger --max-cache-tokens is never reached
    tokens = min(limits.cache_tokens(bundle), int(bundle.context_length))
    vocab = int(getattr(model.config, "vocab_size", None) or 0)
    k = sbd_verify.default_block_size(bundle)
    # per cache column: its K/V, and the slots' ids and positions (long) and two masks (bool)
    kv = memory.kv_bytes_per_token(model) // int(bundle.meta.get("tp") or 1)  # tensor-parallel: a rank's heads
    per_row = tokens * (kv + 18) + int(k) * vocab * 4
    memory.check(max_batch_size, per_row, next(iter(model.parameters())).device,
                 what=f"a row's {tokens}-token KV cache and slot tensors", flag="--max-batch-size",
                 fix=lambda fit: f"pass --max-batch-size {fit} or less, or a smaller --max-cache-tokens" if fit
                 else "not even one row fits: pass a smaller --max-cache-tokens")
