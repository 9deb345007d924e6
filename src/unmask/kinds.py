"""The model kinds unmask loads (``unmask.models``) and a decoder names in its ``Spec.kinds``: a leaf module,
so the decoder registry can check a plug-in's kinds without importing the model loader."""

KINDS = ("causal", "sbd", "masked-diffusion", "block-diffusion")

__all__ = ["KINDS"]
