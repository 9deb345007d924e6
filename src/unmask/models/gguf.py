"""``unmask convert gguf``: a GGUF checkpoint -> a plain Hugging Face directory.

transformers reads GGUF files (``from_pretrained(dir, gguf_file=name)``) and dequantises every
tensor while loading, but the model it returns still carries the GGUF quantizer, so
``save_pretrained`` refuses it ("The model is quantized with gguf and is not serializable"). The
conversion therefore copies the dequantised weights into a freshly built model of the same
config, re-ties the embeddings and saves that, with the GGUF's tokenizer and chat template.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import importlib.util
import io
import os
import shutil
from pathlib import Path

import torch

from unmask.compat import quiet_transformers
from unmask.errors import UnmaskError
from unmask.fileio import (check_model_out_dir, output_lock, probe_writable, publish_dir, staging_dir, sweep_stale_staging,
                           write_errors)

GGUF_MAGIC = b"GGUF"
GGUF_HEADER_BYTES = 24  # magic, version (uint32), tensor count and metadata count (uint64 each)
GGUF_MIN_VERSION = (0, 10)  # transformers' own minimum for its GGUF loader
GGUF_FIX = "run: pip install 'unmask[smollm2]' (or pip install 'gguf>=0.10')"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# general.architecture values converted: the decoder-only transformers unmask's decoders run (Llama-style
# attention with a KV cache and explicit positions).
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def require_gguf_package() -> None:
    """Raise UnmaskError unless the ``gguf`` package transformers' GGUF loader needs is installed."""
    if importlib.util.find_spec("gguf") is None:
        raise UnmaskError(f"reading GGUF files needs the gguf package, which is not installed; {GGUF_FIX}")
    try:
        found = importlib.metadata.version("gguf")
        version = tuple(int(p) for p in found.split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return  # a source checkout without metadata: let transformers judge it
    if version < GGUF_MIN_VERSION:
        raise UnmaskError(f"reading GGUF files needs gguf >= 0.10 (installed: {found}); {GGUF_FIX}")


def check_gguf_file(path: str | os.PathLike) -> Path:
    """The path of a readable file that starts with the GGUF magic and is at least a GGUF header
    long. Raises UnmaskError otherwise (a shorter file that starts like one is "truncated")."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UnmaskError(f"GGUF file {path} does not exist; pass the path of a .gguf checkpoint")
    if path.is_dir():
        raise UnmaskError(f"{path} is a directory; pass the .gguf file inside it")
    try:
        with open(path, "rb") as f:
            head = f.read(GGUF_HEADER_BYTES)
    except OSError as e:
        raise UnmaskError(f"cannot read {path}: {e.strerror or e}; check the file's permissions") from None
    magic = head[:len(GGUF_MAGIC)]
    if len(head) < GGUF_HEADER_BYTES and GGUF_MAGIC.startswith(magic):  # also the empty file
        raise _corrupt(path, f"{len(head)} bytes, shorter than a GGUF header")
    if magic != GGUF_MAGIC:
        raise UnmaskError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); "
                          "pass a .gguf checkpoint")
    return path


def _corrupt(path: Path, reason: str) -> UnmaskError:
    return UnmaskError(f"{path} is truncated or corrupt ({reason}); re-download or re-export it")


def check_gguf_intact(path: str | os.PathLike) -> None:
    """Raise UnmaskError ("truncated or corrupt") unless the ``gguf`` reader parses the file's
    header, metadata and tensor table and the tensor data that table describes fits in the file.
    Takes about 2 s for a 100 MB GGUF (the reader parses the tokenizer's metadata arrays)."""
    from gguf import GGUFReader

    path = Path(path)
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
        need = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # a short buffer surfaces as ValueError, IndexError, struct.error, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        raise _corrupt(path, f"{size:,} bytes; its header or tensor table cannot be read: {first}") from None
    if need > size:
        raise _corrupt(path, f"{size:,} bytes, but its tensor table needs {need:,}")


def gguf_architecture(path: Path) -> tuple[str | None, int | None]:
    """(``general.architecture``, ``<arch>.block_count``) of a GGUF file, each None when absent.
    Raises UnmaskError ("truncated or corrupt") when the gguf reader cannot parse the file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # a short buffer surfaces as ValueError, IndexError, struct.error, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        size = path.stat().st_size
        raise _corrupt(path, f"{size:,} bytes; its header or tensor table cannot be read: {first}") from None

    def scalar(key: str):
        field = reader.fields.get(key)
        if field is None or not field.data:
            return None
        value = field.parts[field.data[0]]
        return bytes(value).decode("utf-8", errors="replace") if value.dtype.kind == "u" and value.itemsize == 1 \
            else value.tolist()[0]

    arch = scalar("general.architecture")
    blocks = scalar(f"{arch}.block_count") if isinstance(arch, str) else None
    return (arch if isinstance(arch, str) else None), (blocks if isinstance(blocks, int) else None)


def gguf_tensor_name(hf_name: str, arch: str, blocks: int | None) -> str:
    """The GGUF tensor name (``blk.0.attn_v.weight``) of a Hugging Face parameter name
    (``model.layers.0.self_attn.v_proj.weight``), or the HF name when gguf's map has none."""
    import gguf

    archs = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in archs:
        return hf_name
    name = gguf.get_tensor_name_map(archs[arch], blocks or 1).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    return name or hf_name


def load_gguf(path: str | os.PathLike):
    """(model, tokenizer) read by transformers' GGUF loader: the model holds float32 dequantised
    weights but still carries the GGUF quantizer (so it cannot be saved; see :func:`to_plain`).

    Raises UnmaskError for a missing, non-GGUF, truncated or corrupt file, a missing ``gguf``
    package, an architecture (``general.architecture``) outside GGUF_ARCHITECTURES, a GGUF
    transformers cannot read, one that lacks a tensor of its architecture (named, e.g.
    ``blk.0.attn_v.weight``) or holds one in another shape, or a ``context_length`` below 1.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = check_gguf_file(path)
    require_gguf_package()
    arch, blocks = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        # transformers maps more architectures (mamba, t5, ...), and builds the model of the one the
        # file names whatever tensors it holds: a mamba header over Llama tensors "converted" to a
        # randomly initialised Mamba with exit 0.
        raise UnmaskError(f"{path} holds a {arch or 'unnamed'} model (general.architecture); unmask converts the "
                          f"decoder-only transformer architectures {', '.join(GGUF_ARCHITECTURES)}; pass a GGUF of "
                          "one of those")
    try:
        # The loader's tqdm bar ("Converting and de-quantizing GGUF tensors") ignores
        # transformers' progress-bar switch; the CLI prints its own line instead.
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model, info = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                               output_loading_info=True)
    except Exception as e:
        # A truncated file fails deep in the loader (struct.error, "cannot reshape array"): name
        # that first, and blame the architecture only for a file the gguf reader reads whole.
        check_gguf_intact(path)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnmaskError(f"cannot read the GGUF checkpoint {path}: {first.rstrip('.:')}; unmask converts the "
                          "causal-LM architectures transformers' GGUF loader supports (llama, qwen2, mistral, ...)") from None
    # transformers initialises a parameter the file lacks at random and only logs it: refuse instead
    missing = sorted(info.get("missing_keys") or ()) + sorted(k for k, *_ in info.get("mismatched_keys") or ())
    if missing:
        tensor = gguf_tensor_name(missing[0], arch, blocks)
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UnmaskError(f"{path} lacks the tensor {tensor} ({missing[0]}){more} of a {arch} model with "
                          f"{blocks} layers, or holds it in another shape; the file is incomplete, re-export it")
    context = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(context, int) or context < 1:  # the converted model would refuse every prompt
        raise UnmaskError(f"{path}: {arch}.context_length is {context!r}, and a model needs a context of at least "
                          "1 token; fix the GGUF's metadata (gguf-set-metadata) or re-export it")
    return model.eval(), tokenizer


def to_plain(model, dtype: torch.dtype = torch.float32):
    """A plain (unquantised, saveable) copy of a GGUF-loaded model: same class and config minus
    ``quantization_config``, the same weights cast to ``dtype``, embeddings tied again when the
    config ties them, and the same generation config (its EOS is what decoders stop on)."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.tie_weights()
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.to(dtype).eval()


def read_plain(gguf_path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """(plain model, tokenizer) of a GGUF checkpoint, ready for ``save_pretrained``."""
    model, tokenizer = load_gguf(gguf_path)
    plain = to_plain(model, dtype)
    tokenizer.model_max_length = int(getattr(plain.config, "max_position_embeddings", 2048))
    return plain, tokenizer


def save_plain(plain, tokenizer, out: Path) -> None:
    """Write config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and chat_template.jinja (when the tokenizer has a template) into ``out``."""
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def resolve_gguf_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise UnmaskError(f"unknown dtype {dtype!r} for the converted weights; use float32 or bfloat16")
    return DTYPES[dtype]


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False,
                 dtype: str = "float32") -> Path:
    """``unmask convert gguf``: write a plain Hugging Face directory (safetensors weights in
    ``dtype``, tokenizer, chat template, generation config) for a GGUF checkpoint.

    Quantised tensors (e.g. Q4_1) are dequantised to float32 by transformers' loader; ``float32``
    keeps those values exactly, ``bfloat16`` rounds them. The directory is assembled in a
    temporary sibling and renamed into place, so an interrupted conversion never leaves a
    half-written ``out_dir``; ``out_dir`` is locked against a second writer meanwhile, and the
    staging folders of earlier conversions to ``out_dir`` that were killed are removed
    (:func:`unmask.fileio.sweep_stale_staging`).

    Raises UnmaskError for a missing, non-GGUF, truncated or corrupt file, a missing ``gguf``
    package, an unknown dtype, an unnamed ``out_dir`` or one holding the input file, an existing
    ``out_dir`` without ``overwrite``, another process writing ``out_dir``, or
    a write that fails (full disk, no permission).
    """
    torch_dtype = resolve_gguf_dtype(dtype)
    check_gguf_file(gguf_file)
    out = check_model_out_dir(out_dir, [gguf_file], overwrite)
    require_gguf_package()
    quiet_transformers()
    with output_lock(out, "OUT_DIR"):
        if out.exists() and not overwrite:
            raise UnmaskError(f"{out} already exists; choose another OUT_DIR or pass --overwrite")
        if out.exists() and not out.is_dir():
            raise UnmaskError(f"{out} is a file, not a model directory; choose another OUT_DIR or remove the file")
        probe_writable(out.parent, f"OUT_DIR {out}")
        sweep_stale_staging(out)  # a killed conversion's half-written copy
        plain, tokenizer = read_plain(gguf_file, torch_dtype)
        tmp = None
        try:
            with write_errors(out, "free disk space or choose a writable OUT_DIR"):
                tmp = staging_dir(out)
                save_plain(plain, tokenizer, tmp)
                publish_dir(tmp, out)
        finally:
            if tmp is not None and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out
