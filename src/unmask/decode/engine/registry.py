"""The decoder registry: one :class:`Spec` per decoder, the one source of truth for its knobs.

A decoder is a frozen :class:`Config` subclass whose fields, declared with :func:`knob`, *are* its
knobs (name, type, default, help, range), plus one running-batch class (:mod:`.running`). Its
:class:`Spec` names both, the model kinds it decodes and whether ``compile=True`` runs it on a static,
compiled cache. ``unmask.decode`` registers the built-in decoders; a package outside unmask
registers its own through the ``unmask.decoders`` entry-point group (:func:`load_plugins`) or one
:func:`register` call. From the registry come ``decode()``, the CLI's decoder options, the server's
request schema and running batches, ``eval -O`` types and README's option table
(docs/writing-a-decoder.md: the contract and a complete plug-in).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import types
import typing
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, ClassVar

import torch

from unmask.decode.engine.running import drain, requests_for
from unmask.decode.engine.shaping import request_asks
from unmask.decode.engine.stats import DecodeOutput
from unmask.errors import UnmaskError
from unmask.kinds import KINDS
from unmask.sampling import Sampling

log = logging.getLogger("unmask.decode")
ENTRY_POINTS = "unmask.decoders"  # the entry-point group a plug-in decoder registers through
_META = "unmask.knob"
TYPES = (int, float, str, bool)  # a knob's value type; anything else is a Python-API-only object
NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")  # a decoder: a flag value, a JSON string, an entry-point name
KNOB = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")  # a knob: a Python keyword, a JSON field and --its-flag
# Names no knob may take: the options of `unmask generate` / `unmask.generate` (and the flags --json, --help,
# --no-progress), decode()'s and a batch's own arguments, and the server's request fields; a knob so named
# would be shadowed by, or shadow, one of them (tests/test_r49_breaking.py keeps this covering all three).
RESERVED = frozenset({
    "prompts", "prompts_file", "chat", "system", "model", "kind", "adapter", "decoder", "max_new_tokens", "temperature",
    "top_k", "top_p", "seed", "stop", "reference_nfe", "compile", "show", "stream", "verbose", "trace", "json",
    "as_json", "overwrite", "device", "dtype", "tp", "no_progress", "progress", "help",
    "bundle", "sampling", "stop_token_ids", "stop_strings", "static", "on_step", "on_forward", "on_token", "capacity",
    "prompt", "messages", "max_tokens", "max_completion_tokens", "stream_mode", "timeout", "n", "best_of", "echo",
    "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "suffix", "user",
    "stream_options", "response_format", "structured_outputs", "grammar", "tools", "tool_choice", "functions", "function_call",
    "json_schema", "json_object", "regex", "choice"})  # unmask generate's grammar flags
RESERVED_SHORT = ("-m", "-d", "-n", "-t", "-h")  # unmask generate's own one-letter flags


def plain_scalar(value):
    """A numpy scalar (``np.int64(4)``, ``np.float32(0.5)``, ``np.bool_(True)``) as the Python number
    it holds, so it passes the checks a plain int / float / bool passes; anything else unchanged."""
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        return value.item()
    return value


def _not_taken(names, decoder: str) -> UnmaskError:
    flags = ", ".join("--" + k.replace("_", "-") for k in sorted(names))
    takers = [d for d, spec in DECODERS.items() if set(names) <= {k.name for k in spec.knobs()}]
    named = f" ({', '.join(takers)})" if takers else ""
    return UnmaskError(f"{flags} does not apply to decoder {decoder!r}; drop it or choose a decoder that takes it{named}")


@dataclass(frozen=True)
class Knob:
    """One decoder option. ``name``: the Python / JSON name (``block_size``; the CLI flag
    ``--block-size``); ``type``: int, float, str, bool, or ``object`` for a Python-API-only value (a
    router, a callable); ``default``: None means "resolved from the model and the other knobs" (the
    help says how); ``choices``: the allowed strings, if a closed set; ``low`` / ``high``: an
    inclusive range, if any (``choices``, ``low``, ``high``: metadata for tools reading the registry; the
    help text states them and the config's ``__post_init__`` enforces them); ``cli``: a flag of ``unmask
    generate``; ``serve``: a field the server takes (default: as ``cli``; neither: the Python API only);
    ``short``: a one-letter CLI alias (``-k``)."""

    name: str
    type: type
    help: str
    default: Any = None
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    cli: bool = True
    serve: bool = True
    short: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def type_name(self) -> str:
        return self.type.__name__ if self.type in TYPES else "object"


def knob(help: str, *, default=None, choices: tuple[str, ...] = (), low: float | None = None,
         high: float | None = None, cli: bool = True, serve: bool | None = None, short: str | None = None):
    """A :class:`Config` field that is a knob: ``x: int | None = knob("help")`` (see :class:`Knob`)."""
    meta = {"help": help, "choices": tuple(choices), "low": low, "high": high, "cli": cli, "serve": serve,
            "short": short}
    return field(default=default, metadata={_META: meta})


def _value_type(hint) -> type:
    """``int | None`` -> int; ``float`` -> float; anything not a knob type -> object."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    args = [a for a in args if a is not type(None)]
    return args[0] if len(args) == 1 and args[0] in TYPES else object


class Config:
    """Base of a decoder's knobs: subclass it as ``@dataclass(frozen=True)`` with :func:`knob` fields.

    Construction validates (``__post_init__`` of the subclass); :meth:`of` builds one from the
    options a user passed (names as in the Python API), refusing names the decoder does not take.
    """

    decoder: ClassVar[str] = ""  # set by register(): the name errors use

    @classmethod
    @functools.cache  # read once per class: each request's options are checked against them
    def knobs(cls) -> tuple[Knob, ...]:
        """The knobs in declaration order."""
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            meta = f.metadata.get(_META)
            if meta is not None:
                kind = _value_type(hints[f.name])
                serve = meta["serve"] if meta["serve"] is not None else meta["cli"] and kind in TYPES
                out.append(Knob(f.name, kind, default=f.default, **{**meta, "serve": serve}))
        return tuple(out)

    @classmethod
    def of(cls, options: dict, decoder: str | None = None) -> "Config":
        """The config of these options (None values are "unset"; numpy scalars read as the numbers they
        hold). Raises UnmaskError, one line, for an option the decoder does not take or an integer beyond
        64 bits; the subclass's checks follow, any other error they raise becoming a one-line UnmaskError."""
        name = decoder or cls.decoder
        taken = {k.name for k in cls.knobs()}
        extra = [k for k in options if k not in taken]
        if extra:
            raise _not_taken(extra, name)
        options = {k: plain_scalar(v) for k, v in options.items()}
        for k, v in options.items():
            if isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
                raise UnmaskError(f"--{k.replace('_', '-')} is out of range (a 64-bit integer: at most {2**63 - 1}); "
                                  "pass a smaller value")
        try:
            return cls(**options)
        except UnmaskError:
            raise
        except Exception as e:  # a plug-in's config checking with ValueError / assert, or tripping on a type
            raise UnmaskError(f"decoder {name!r} refused its options ({_line(e)}); fix the values, or report it to the "
                              "decoder's author if they are right") from e

    def batch_key(self, bundle, max_new_tokens: int):
        """The server's running-batch key of a request with this config: requests with equal keys share
        one running batch (built by :attr:`Spec.batch` from the first one's config); None: the request
        cannot join a running batch and runs per call. Default: the decoder and this (hashable) config."""
        return self.decoder, self

    def takes_grammar(self, bundle) -> bool:
        """Whether its rows take a request's grammar (structured output; ``ar``, lossless ``sbd``). Default False."""
        return False


@dataclass(frozen=True)
class Spec:
    """A registered decoder.

    name: ``--decoder NAME``; config: its :class:`Config` subclass; batch: the running-batch factory,
    ``batch(bundle, config, *, capacity, prompts=None, max_new_tokens=None, compile=False, static=False,
    on_step=None, on_token=None, on_forward=None, stop_token_ids=())`` -> a
    :class:`~unmask.decode.engine.running.RunningDecoder` (``prompts`` given: :meth:`decode`'s batch,
    sized for them; None: a server's batch, rows joining and leaving at any step); kinds: the model kinds it decodes;
    summary: one line for ``unmask models`` and README; compiles: ``unmask serve --compile`` runs its
    running batches on a static cache with a compiled forward (``decode(compile=True)`` is taken by every
    decoder)."""

    name: str
    config: type
    batch: Callable | None
    kinds: tuple[str, ...]
    summary: str
    compiles: bool = False

    def knobs(self) -> tuple[Knob, ...]:
        return self.config.knobs()

    @torch.inference_mode()
    def decode(self, bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
               stop_token_ids=(), stop_strings=(), compile: bool = False, static: bool = False, on_step=None,
               on_forward=None, logprobs: int | None = None, logit_bias: dict | None = None, grammar=None,
               **options) -> DecodeOutput:
        """Decode ``prompts`` (token ids per row) with this decoder: build the config of ``options``
        (:meth:`Config.of`), join every prompt into one running batch sized for them, ``step()`` until
        every row ended (:func:`~unmask.decode.engine.running.drain`). A row ends at a stop id, after a
        stop string or at ``max_new_tokens``. ``compile``: the static cache and a compiled forward (same
        tokens and NFE); ``static``: the static cache eagerly (tests); ``on_step(event)``: the
        :mod:`unmask.trace` step events, ``row`` the prompt's index; ``on_forward`` (tests): the
        decoder's per-forward hook; ``logprobs``, ``logit_bias``, ``grammar``: every row's (checked by
        :func:`~unmask.decode.engine.shaping.request_asks`). Returns DecodeOutput. Raises UnmaskError (one
        line) for bad options, and for a plug-in decoder's batch raising anything else (the error chained)."""
        max_new_tokens = plain_scalar(max_new_tokens)  # the options' numpy scalars: Config.of
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise UnmaskError(f"max_new_tokens must be an integer >= 0 (got {max_new_tokens!r}); pass e.g. 64")
        cfg = self.config.of(options, self.name)
        if self.batch is None:
            raise UnmaskError(f"decoder {self.name!r} has no running batch (its Spec's batch is None); register it "
                              "with one")
        asks = request_asks(self.name, cfg, bundle, grammar_decoders, logprobs=logprobs,
                            logit_bias=logit_bias, grammar=grammar)
        requests = requests_for(prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=stop_strings,
                                device=bundle.device, **asks)
        events = None if on_step is None else (lambda row, event: on_step({**event, "row": row.job.id}))

        def make(capacity: int):
            return self.batch(bundle, cfg, capacity=capacity, prompts=prompts, max_new_tokens=max_new_tokens,
                              compile=compile, static=static, on_step=events, on_forward=on_forward,
                              stop_token_ids=tuple(stop_token_ids))

        try:
            return drain(make, requests)
        except UnmaskError:
            raise
        except Exception as e:
            home = getattr(self.batch, "__module__", None) or self.config.__module__
            if home.split(".")[0] == "unmask":  # unmask's own bug: its traceback
                raise
            raise UnmaskError(f"decoder {self.name!r} failed ({_line(e)}); it is a plug-in ({home}): report it to its "
                              "author, or choose another decoder") from e


def grammar_decoders(bundle=None) -> list[str]:
    """The registered decoders whose config overrides :meth:`Config.takes_grammar` (of ``bundle``'s kind when given)."""
    return [n for n, s in DECODERS.items() if (bundle is None or bundle.kind in s.kinds)
            and s.config.takes_grammar is not Config.takes_grammar]


def _line(e: BaseException) -> str:
    """``Type: first line of the message`` of an exception."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


DECODERS: dict[str, Spec] = {}


def register(spec: Spec, *, replace: bool = False) -> Spec:
    """Add ``spec`` to :data:`DECODERS` (a plug-in's one call). Raises UnmaskError, one line, for what the
    CLI, the server or the Python API could not take: a name taken by another decoder (unless ``replace``)
    or not of lowercase letters, digits and dashes; a config that is not a frozen :class:`Config` dataclass
    of its own (one class per decoder) with a default for every field; no model kinds, or one outside
    ``unmask.kinds.KINDS``; a batch that is not callable; a summary that is not one line; a knob named
    like an option of unmask itself (:data:`RESERVED`) or not ``lower_snake_case``, whose type, or whether
    the CLI and the server take it, differs from the same-named knob of a registered decoder, a
    Python-object knob with ``serve=True``, or a short alias that is malformed or taken."""
    if not isinstance(spec, Spec):
        raise UnmaskError(f"register() takes a unmask.decode.Spec (got {type(spec).__name__})")
    if not spec.name or not isinstance(spec.name, str):
        raise UnmaskError(f"a decoder needs a non-empty name (got {spec.name!r})")
    name = spec.name
    if not NAME.fullmatch(name):
        raise UnmaskError(f"decoder name {name!r} must be lowercase letters, digits and dashes (such as 'my-decoder'): "
                          "it is a flag value and a JSON string; rename it")
    if name in DECODERS and not replace and DECODERS[name] is not spec:
        raise UnmaskError(f"decoder {name!r} is already registered; choose another name or pass replace=True")
    cfg = spec.config
    if not (isinstance(cfg, type) and issubclass(cfg, Config) and dataclasses.is_dataclass(cfg)
            and cfg.__dataclass_params__.frozen):
        raise UnmaskError(f"decoder {name!r}: config must be a @dataclass(frozen=True) subclass of "
                          f"unmask.decode.Config (got {cfg!r})")
    other = DECODERS.get(cfg.decoder)
    if other is not None and other.name != name and other.config is cfg:  # its batch_key would name the other one
        raise UnmaskError(f"decoder {name!r}: its config {cfg.__name__} is decoder {other.name!r}'s; give each decoder "
                          "its own Config subclass")
    if not spec.kinds:
        raise UnmaskError(f"decoder {name!r} names no model kind; pass kinds=(\"causal\",) or others")
    if not (isinstance(spec.kinds, tuple) and all(isinstance(k, str) and k for k in spec.kinds)):
        raise UnmaskError(f"decoder {name!r}: kinds must be a tuple of model kinds, such as (\"causal\",) (got "
                          f"{spec.kinds!r})")
    unknown = [k for k in spec.kinds if k not in KINDS]
    if unknown:  # load() gives only these kinds: a decoder for another could never run
        raise UnmaskError(f"decoder {name!r}: unknown model kind {unknown[0]!r}; choose from {', '.join(KINDS)}")
    if spec.batch is not None and not callable(spec.batch):
        raise UnmaskError(f"decoder {name!r}: batch must be a callable returning its running batch (got "
                          f"{spec.batch!r})")
    if not (isinstance(spec.summary, str) and spec.summary.strip() and "\n" not in spec.summary):
        raise UnmaskError(f"decoder {name!r}: summary must be one line of text for 'unmask models' (got "
                          f"{spec.summary!r})")
    for f in dataclasses.fields(cfg):
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UnmaskError(f"decoder {name!r}: config field {f.name!r} has no default; give it one (a config is "
                              "built from the knobs a user gives)")
    try:
        knobs = cfg.knobs()
    except Exception as e:  # e.g. an annotation naming a type its module cannot resolve
        raise UnmaskError(f"decoder {name!r}: the knobs of {cfg.__name__} cannot be read ({_line(e)}); fix its "
                          "annotations") from e
    for k in knobs:
        _check_knob(name, k)
    DECODERS[name] = spec
    cfg.decoder = name
    return spec


def _reach(k: Knob) -> str:
    return {(True, True): "as a command-line/server option", (False, False): "from Python only",
            (True, False): "as a command-line option only", (False, True): "as a server option only"}[(k.cli, k.serve)]


def _check_knob(decoder: str, k: Knob) -> None:
    """Raise UnmaskError when knob ``k`` of ``decoder`` cannot sit beside the registered decoders' knobs."""
    where = f"decoder {decoder!r}: knob {k.name!r}"
    if not KNOB.fullmatch(k.name) or k.name.startswith("no_"):
        raise UnmaskError(f"{where} must be lower_snake_case, not starting with no_ (a bool's --no-X is its off "
                          "form); rename it")
    if k.name in RESERVED:
        raise UnmaskError(f"{where} is named like an option of unmask itself (generate, decode or the server); "
                          "rename it")
    if k.type_name == "object" and k.serve:
        raise UnmaskError(f"{where} is a Python object (not int, float, str or bool): JSON cannot carry it; drop "
                          "serve=True")
    for d, o in all_knobs().get(k.name, []):
        if d == decoder:
            continue
        if o.type_name != k.type_name:
            raise UnmaskError(f"{where} is {k.type_name}, but other decoders take it as {o.type_name}; rename it or "
                              "use the same type")
        if (o.cli, o.serve) != (k.cli, k.serve):  # one name, one reach: the CLI / server field serves every decoder
            raise UnmaskError(f"{where} is taken {_reach(k)} here, but decoder {d!r} takes it {_reach(o)}; give it "
                              "the same cli= / serve= or rename it")
    if k.short is not None:
        owner = "unmask generate" if k.short in RESERVED_SHORT else next(
            (f"knob {o.name!r}" for entries in all_knobs().values() for d, o in entries
             if d != decoder and o.short == k.short and o.name != k.name), None)
        if not re.fullmatch(r"-[A-Za-z]", str(k.short)):
            raise UnmaskError(f"{where}: short alias {k.short!r} must be a dash and one letter, such as '-w'")
        if owner is not None:
            raise UnmaskError(f"{where}: short alias {k.short!r} is taken by {owner}; choose another letter or "
                              "drop short=")


def knob_types() -> dict[str, str]:
    """Every knob taken by a registered decoder -> its value type name (int, float, str, bool, object)."""
    return {name: entries[0][1].type_name for name, entries in all_knobs().items()}


def all_knobs() -> dict[str, list[tuple[str, Knob]]]:
    """Knob name -> [(decoder, Knob), ...] over the registered decoders, in registration order."""
    out: dict[str, list[tuple[str, Knob]]] = {}
    for spec in DECODERS.values():
        for k in spec.knobs():
            out.setdefault(k.name, []).append((spec.name, k))
    return out


def load_plugins() -> list[str]:
    """Register the decoders of the ``unmask.decoders`` entry-point group: each entry point names a
    :class:`Spec` or a function returning one (or a list of them). A plug-in that fails to load is
    skipped with a one-line warning naming it. Returns the names registered."""
    names = []
    for ep in entry_points(group=ENTRY_POINTS):
        try:
            got = ep.load()
            specs = got() if callable(got) and not isinstance(got, Spec) else got
            for spec in specs if isinstance(specs, (list, tuple)) else [specs]:
                names.append(register(spec).name)
        except Exception as e:  # a broken plug-in must not take the built-in decoders down with it
            log.warning("decoder plug-in %r (%s) was not loaded: %s", ep.name, ep.value,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
    return names


__all__ = ["Config", "DECODERS", "ENTRY_POINTS", "Knob", "Spec", "all_knobs", "knob", "knob_types", "load_plugins",
           "register"]
