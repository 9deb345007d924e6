"""Decoders: the registry (:data:`DECODERS`, name -> :class:`Spec`) and the one ``decode()``.

Every decoder is a frozen :class:`Config` of knobs plus a running batch, registered once
(:mod:`unmask.decode.engine.registry`). The built-in ones are registered here; plug-ins through the
``unmask.decoders`` entry-point group (docs/writing-a-decoder.md).
"""

from __future__ import annotations


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

DEFAULT_FOR_KIND = {"causal": "ar", "sbd": "sbd", "masked-diffusion": "diffusion", "block-diffusion": "block"}


def spec_for(name: str, kind: str) -> Spec:
    """The registered decoder ``name``, checked against the model kind. Raises UnmaskError (one line,
    naming the decoders that fit) for an unknown name or a kind it does not decode."""
    if not isinstance(name, str):  # a list or a number: the caller's mistake, not an unknown name
        raise UnmaskError(f"decoder must be a decoder name such as 'ar' (got {type(name).__name__} {name!r}); pass "
                          f"one of: {', '.join(DECODERS)}")
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
    name = default_decoder(bundle.kind) if decoder is None else decoder  # "" is refused, not the default
    return spec_for(name, bundle.kind).decode(bundle, prompts, **kwargs)


def default_decoder(kind: str) -> str:
    return DEFAULT_FOR_KIND.get(kind, "ar")


__all__ = ["Config", "DECODERS", "DecodeOutput", "DecodeStats", "Knob", "Spec", "decode", "default_decoder",
           "knob", "load_plugins", "register", "spec_for"]

load_plugins()  # last: a plug-in may import anything defined above (spec_for, decode, ...)
