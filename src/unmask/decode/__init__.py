"""Decoders. Each takes a ModelBundle and token-id prompts and returns a DecodeOutput.

A decoder module exposes ``decode(bundle, prompts, *, max_new_tokens, sampling,
stop_token_ids, stop_strings, **options)``; this registry maps the user-facing names to
modules and to the model kinds each one works on.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from unmask.decode.stats import DecodeOutput, DecodeStats
from unmask.errors import UnmaskError


@dataclass(frozen=True)
class DecoderInfo:
    name: str
    module: str
    kinds: tuple[str, ...]
    summary: str


DECODERS: dict[str, DecoderInfo] = {
    "ar": DecoderInfo("ar", "unmask.decode.ar", ("causal", "sbd"), "autoregressive, one token per forward, exact KV cache"),
    "sbd": DecoderInfo("sbd", "unmask.decode.sbd", ("sbd",), "Set Block Decoding: block of masks, EB sampler, exact KV cache"),
    "diffusion": DecoderInfo("diffusion", "unmask.decode.diffusion", ("masked-diffusion",),
                             "semi-AR masked diffusion: LLaDA top-k steps, Fast-dLLM threshold/factor, EB; "
                             "approximate prefix/dual caches"),
    "early-bird": DecoderInfo("early-bird", "unmask.decode.early_bird", ("masked-diffusion",),
                              "Early-Bird: learned variable blocks (LBS) and learned parallel commits (LPS)"),
    "block": DecoderInfo("block", "unmask.decode.block", ("block-diffusion",),
                         "SingleBD: one block at a time over an exact block-causal KV cache"),
    "multiblock": DecoderInfo("multiblock", "unmask.decode.multiblock", ("block-diffusion",),
                              "Multi-Block Diffusion: Block Buffer of N_buf slots, one static forward per step"),
}


def get_decoder(name: str, kind: str):
    """The ``decode`` function for decoder ``name``, checked against the model kind."""
    info = DECODERS.get(name)
    if info is None:
        raise UnmaskError(f"unknown decoder {name!r}; choose one of: {', '.join(DECODERS)}")
    if kind not in info.kinds:
        works = ", ".join(info.kinds)
        fits = [d.name for d in DECODERS.values() if kind in d.kinds]
        hint = f"use --decoder {' or '.join(fits) or 'another'} or {'an' if works.startswith('sbd') else 'a'} {works} model"
        if name == "sbd" and kind == "causal":  # a gated SBD adapter makes any causal model an sbd one
            hint = (f"use --decoder {', '.join(fits) or 'ar'}, an sbd model, or --adapter NAME|DIR (a gated SBD "
                    "adapter: 'unmask models' lists shipped ones, 'unmask train sbd-adapter' trains one)")
        raise UnmaskError(f"decoder {name!r} needs a model of kind {works}, but this model is {kind!r}; {hint}")
    return importlib.import_module(info.module).decode


def default_decoder(kind: str) -> str:
    return {"causal": "ar", "sbd": "sbd", "masked-diffusion": "diffusion", "block-diffusion": "block"}.get(kind, "ar")


__all__ = ["DECODERS", "DecodeOutput", "DecodeStats", "DecoderInfo", "default_decoder", "get_decoder"]
