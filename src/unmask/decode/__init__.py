"""Decoders: the registry (:data:`DECODERS`, name -> :class:`Spec`) and the one ``decode()``.

Every decoder is a frozen :class:`Config` of knobs plus a running batch, registered once
(:mod:`unmask.decode.engine.registry`). The built-in ones are registered here; plug-ins through the
``unmask.decoders`` entry-point group (docs/engine.md "Writing a decoder").
"""

from __future__ import annotations

import inspect

from unmask.decode.blocks.sbd import SPEC as _SBD
from unmask.decode.blocks.single import SPEC as _BLOCK
from unmask.decode.dllm.diffusion_batch import SPEC as _DIFFUSION
from unmask.decode.dllm.early_bird_batch import SPEC as _EARLY_BIRD
from unmask.decode.engine.registry import DECODERS, Config, Knob, Spec, knob, load_plugins, register
from unmask.decode.engine.stats import DecodeOutput, DecodeStats
from unmask.decode.multiblock.batch import SPEC as _MULTIBLOCK
from unmask.decode.verify.ar import SPEC as _AR
from unmask.errors import UnmaskError

for _spec in (_AR, _SBD, _DIFFUSION, _EARLY_BIRD, _BLOCK, _MULTIBLOCK):
    register(_spec)
load_plugins()

DEFAULT_FOR_KIND = {"causal": "ar", "sbd": "sbd", "masked-diffusion": "diffusion", "block-diffusion": "block"}


def spec_for(name: str, kind: str) -> Spec:
    """The registered decoder ``name``, checked against the model kind. Raises UnmaskError (one line,
    naming the decoders that fit) for an unknown name or a kind it does not decode."""
    spec = DECODERS.get(name)
    if spec is None:
        raise UnmaskError(f"unknown decoder {name!r}; choose one of: {', '.join(DECODERS)}")
    if kind not in spec.kinds:
        works = ", ".join(spec.kinds)
        fits = [d.name for d in DECODERS.values() if kind in d.kinds]
        hint = f"use --decoder {' or '.join(fits) or 'another'} or {'an' if works.startswith('sbd') else 'a'} {works} model"
        if name == "sbd" and kind == "causal":  # a gated SBD adapter makes any causal model an sbd one
            hint = (f"use --decoder {', '.join(fits) or 'ar'}, an sbd model, or --adapter NAME|DIR (a gated SBD "
                    "adapter: 'unmask models' lists shipped ones, 'unmask train sbd-adapter' trains one)")
        raise UnmaskError(f"decoder {name!r} needs a model of kind {works}, but this model is {kind!r}; {hint}")
    return spec


def decode(bundle, prompts: list[list[int]], *, decoder: str | None = None, **kwargs) -> DecodeOutput:
    """Decode ``prompts`` (token ids per row) with ``decoder`` (default: the model kind's,
    :func:`default_decoder`): :meth:`Spec.decode` of :func:`spec_for`; ``kwargs`` as it takes them
    (``max_new_tokens``, ``sampling``, stop ids and strings, ``compile``, ``on_step``, the knobs)."""
    return spec_for(decoder or default_decoder(bundle.kind), bundle.kind).decode(bundle, prompts, **kwargs)


def get_decoder(name: str, kind: str):
    """The ``decode`` function of decoder ``name`` for a model of ``kind`` (:func:`spec_for`): its own
    ``run``, else :meth:`Spec.decode` with a signature that names its knobs (keyword-only), so callers
    that read the signature (option checks, ``eval -O`` types) see them."""
    spec = spec_for(name, kind)
    if spec.run is not None:
        return spec.run

    def run(bundle, prompts, **kwargs) -> DecodeOutput:
        return spec.decode(bundle, prompts, **kwargs)

    P = inspect.Parameter
    params = [p for p in inspect.signature(spec.decode).parameters.values() if p.kind is not P.VAR_KEYWORD]
    run.__signature__ = inspect.Signature(params + [P(k.name, P.KEYWORD_ONLY, default=k.default, annotation=k.type)
                                                    for k in spec.knobs()])
    return run


def default_decoder(kind: str) -> str:
    return DEFAULT_FOR_KIND.get(kind, "ar")


__all__ = ["Config", "DECODERS", "DecodeOutput", "DecodeStats", "Knob", "Spec", "decode", "default_decoder", "get_decoder",
           "knob", "load_plugins", "register", "spec_for"]
