"""ModelBundle: a loaded model with everything a decoder needs to know about it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unmask.devices import resolve_device, resolve_dtype  # noqa: F401 (also public here)
from unmask.errors import UnmaskError, is_int
from unmask.fileio import read_json_object
from unmask.kinds import KINDS
from unmask.models.checkpoint_checks import (check_config_fields, check_decode_defaults, check_default_sizes,
                                             check_explicit_mask_id, check_float_weights, check_tokenizer_ids,
                                             check_weights_match)
from unmask.models.tensor_parallel import tp_load_options

UNMASK_CONFIG = "unmask_config.json"


@dataclass
class ModelBundle:
    """A model, its tokenizer and the facts decoders read (spec/models.md §2.1 adapter contract).

    kind: one of KINDS. mask_token_id: None for plain causal models. logit_shift: 1 when the
    logits at position i-1 score token i (Dream-style diffusion), else 0. block_size: the native
    block of block-diffusion models. stop_token_ids: ids that end generation (EOS, and BOS for
    llama2.c story models whose documents are BOS-delimited).
    """

    model: torch.nn.Module
    tokenizer: object
    kind: str
    name: str
    path: Path | None = None
    bos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    mask_token_id: int | None = None
    logit_shift: int = 0
    block_size: int | None = None
    meta: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def suppress_ids(self) -> tuple[int, ...]:
        """Token ids never to be generated (the mask token; it is a tied output row)."""
        return () if self.mask_token_id is None else (self.mask_token_id,)

    def encode(self, text: str) -> list[int]:
        """Prompt text -> ids, with BOS when the tokenizer adds one. Raises UnmaskError when the
        checkpoint has no tokenizer (pass token ids to the decoders instead)."""
        if self.tokenizer is None:
            raise UnmaskError(f"{self.name} has no tokenizer files; add the checkpoint's tokenizer to its directory "
                              "or pass token ids to the decoders")
        return list(self.tokenizer(text)["input_ids"])

    def decode_continuation(self, prompt_ids: list[int], new_ids: list[int], head: str | None = None) -> str:
        """The text that ``new_ids`` add after ``prompt_ids`` (tokenizers drop a leading space
        after BOS, so the continuation is the difference of two decodes). ``head``: the prompt's own
        decode when the caller keeps it (a stream decodes the same prompt on every event)."""
        if self.tokenizer is None:
            raise UnmaskError(f"{self.name} has no tokenizer files; add the checkpoint's tokenizer to its directory "
                              "or read the token ids")
        full = self.tokenizer.decode(list(prompt_ids) + list(new_ids), skip_special_tokens=True)
        head = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=True) if head is None else head
        return full[len(head):] if full.startswith(head) else self.tokenizer.decode(new_ids, skip_special_tokens=True)


def check_finite_weights(bundle: ModelBundle) -> None:
    """Refuse to decode with weights holding nan or inf (e.g. a diverged training run): every
    logit would be non-finite and the "decoded" text garbage. The result is cached on the model
    until a parameter is modified in place (its ``_version`` counter moves).

    Raises:
        UnmaskError: a parameter or buffer is not finite.
    """
    tensors = [t for t in (*bundle.model.parameters(), *bundle.model.buffers()) if t.is_floating_point()]
    try:
        key = tuple((id(t), t._version) for t in tensors)
    except RuntimeError:  # inference tensors keep no version counter: check every time
        key = None
    if key is not None and getattr(bundle.model, "_unmask_finite_key", None) == key:
        return
    for name, t in (*bundle.model.named_parameters(), *bundle.model.named_buffers()):
        if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()):
            raise UnmaskError(f"model {bundle.name!r} has non-finite weights ({name} holds nan or inf), so its logits "
                              "are not finite; retrain it (lower --lr) or load another checkpoint")
    if key is not None:
        bundle.model._unmask_finite_key = key


def check_placement(bundle: ModelBundle, device=None, dtype=None) -> None:
    """Refuse a ``device`` / ``dtype`` that differ from where an already loaded ``bundle`` is: they
    would be ignored silently (the bundle is not moved or cast). None, or the bundle's own device
    (``cuda`` matches any CUDA index) or dtype, passes. Raises UnmaskError."""
    if device is not None:
        want, have = resolve_device(device, available=False), bundle.device
        if want.type != have.type or (want.index is not None and want.index != have.index):
            raise UnmaskError(f"the model {bundle.name!r} is already loaded on {have}, so device={str(device)!r} "
                              f"would be ignored; load it with unmask.load(..., device={str(want)!r}) or pass the "
                              "model's name instead of the loaded bundle, or drop device=")
    if dtype is not None:
        want_dtype, have_dtype = resolve_dtype(dtype), bundle.dtype
        if want_dtype != have_dtype:
            want_name, have_name = (str(t).removeprefix("torch.") for t in (want_dtype, have_dtype))
            raise UnmaskError(f"the model {bundle.name!r} is already loaded in {have_name}, so dtype={dtype!r} "
                              f"would be ignored; load it with unmask.load(..., dtype={want_name!r}) or pass the "
                              "model's name instead of the loaded bundle, or drop dtype=")


def read_unmask_config(path: Path) -> dict:
    f = path / UNMASK_CONFIG
    if not f.is_file():
        return {}
    return read_json_object(f, "restore it or re-save the checkpoint")


def _stop_ids(model, tokenizer, meta: dict, path: Path) -> tuple[tuple[int, ...], str]:
    """(stop ids, where they were read: the file and field, for error messages)."""
    if "stop_token_ids" in meta:
        ids = meta["stop_token_ids"]
        if not isinstance(ids, list):
            ids = [ids]
        return tuple(_as_id(i, f"stop_token_ids in {UNMASK_CONFIG}") for i in ids), f"stop_token_ids in {UNMASK_CONFIG}"
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    # transformers reads generation_config.json, else derives the generation config from config.json
    where = f"eos_token_id in {'generation_config.json' if (path / 'generation_config.json').is_file() else 'config.json'}"
    if ids is None:
        ids, where = getattr(tokenizer, "eos_token_id", None), "the tokenizer's eos_token"
    if ids is None:
        return (), where
    return tuple(int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])), where


def _read_hf_config(path: Path) -> dict:
    return read_json_object(path / "config.json", "restore the checkpoint")


def _as_id(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnmaskError(f"{what} must be an integer token id (got {value!r}); give the id of the mask token")
    if value < 0:  # a negative id would index the vocabulary from its end (or overflow the tokenizer)
        raise UnmaskError(f"{what} must be a token id >= 0 (got {value}); give the id of the mask token")
    return value


def _mask_id(explicit, meta: dict, model, tokenizer, family, path: Path) -> int | None:
    """Mask id: explicit option > unmask_config.json > HF config > the family's documented id >
    tokenizer. The config and tokenizer must agree when both name one (models.md §2.1)."""
    if explicit is not None:
        return _as_id(explicit, "mask_token_id")
    if meta.get("mask_token_id") is not None:
        return _as_id(meta["mask_token_id"], f"mask_token_id in {path / UNMASK_CONFIG}")
    from_config = getattr(model.config, "mask_token_id", None)
    from_tokenizer = getattr(tokenizer, "mask_token_id", None)
    if from_config is not None and from_tokenizer is not None and int(from_config) != int(from_tokenizer):
        raise UnmaskError(f"{path}: config.json names mask token {from_config} but the tokenizer's is {from_tokenizer}; "
                          "pass mask_token_id= to choose one")
    # The family's documented id outranks the tokenizer: SDAR's tokenizer_config names a
    # "<|MASK|>" its added_tokens.json does not hold (data/dllm_configs/sdar/SOURCE.md).
    for candidate in (from_config, getattr(family, "mask_token_id", None), from_tokenizer):
        if candidate is not None:
            return int(candidate)
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer.tiktoken")


def _load_tokenizer(path: Path, family, native: bool, trust_remote_code: bool):
    """The directory's tokenizer, or None when it holds no tokenizer vocabulary (config and
    weights only: the decoders' token-id entry points still work). Published dLLM families are
    read with their transformers class, never with the tokenizer code a directory may ship."""
    from transformers import AutoTokenizer

    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    if native:
        import transformers

        # tokenizer.json holds the whole pipeline; without it (Dream ships vocab.json + merges.txt)
        # the family's class rebuilds it. AutoTokenizer would follow the remote auto_map instead.
        cls = "PreTrainedTokenizerFast" if (path / "tokenizer.json").is_file() else family.tokenizer
        return getattr(transformers, cls).from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _block_size(meta: dict, hf_config: dict, family) -> int | None:
    """unmask_config.json's block size, else (when the HF config names none) the family's native one."""
    if meta.get("block_size") is not None:
        return meta["block_size"]
    if family is not None and not any(k in hf_config for k in ("block_size", "block_length")):
        return family.block_size
    return None
def load_dir(path: Path, *, name: str, kind: str | None = None, device="cpu", dtype="float32",
             mask_token_id: int | None = None, logit_shift: int | None = None,
             trust_remote_code: bool = False, tp: int | None = None, force_mask_id: bool = False) -> ModelBundle:
    """Load a local Hugging Face directory into a ModelBundle.

    The kind comes from ``kind``, else from ``unmask_config.json`` in the directory, else the
    dLLM family's (``masked-diffusion`` for LLaDA/Dream, ``block-diffusion`` for SDAR/LLaDA2),
    else ``causal``. Masked-diffusion facts (models.md §2.3-2.6): the mask id comes from
    ``mask_token_id``, else unmask_config.json, the HF config, the family's documented id or the
    tokenizer; the logit shift from ``logit_shift``, else unmask_config.json, else the family
    (Dream 1, others 0), else 0; the block size from unmask_config.json, the HF config, else the
    family (SDAR 4, LLaDA2 32).

    Published LLaDA, Dream, SDAR and LLaDA2.0 checkpoints (recognised by ``architectures`` in
    config.json) load into unmask's native classes (:mod:`unmask.models.families`) with no remote
    code, whatever ``trust_remote_code`` says. Other directories with their own code (``auto_map``)
    load through the auto class it registers and need ``trust_remote_code=True``. A directory
    without tokenizer files loads with ``tokenizer=None``.

    ``tp`` > 1 loads the weights tensor-parallel over the ``tp`` processes of a torchrun launch
    through transformers' distributed loading (``DistributedConfig(tp_plan="auto")``, the
    model's own plan); every rank then holds a shard and computes the same, all-reduced logits.

    An explicit ``mask_token_id`` that is a special or ordinary token of the vocabulary (EOS,
    ``<unk>``, a word) is refused unless ``force_mask_id=True``.

    Raises UnmaskError for a directory without config.json, unreadable weights, an unknown kind, a
    ``kind`` that contradicts the one ``unmask_config.json`` records, remote code without
    ``trust_remote_code``, disagreeing mask ids, a mask id that is a vocabulary token (without
    ``force_mask_id``), a kind that needs a mask token the checkpoint does not name, a JSON file
    that is invalid or nested too deeply, a config.json size field below 1 or one the weights do not
    fit, a NaN or Infinity in config.json, integer-typed weights without a ``quantization_config``,
    invalid ``decode_defaults`` (a non-finite number, a block size past the context window), a stop id outside the
    vocabulary (outside the published families), a mask id that is also a stop id, or a tokenizer
    with token ids past the input embedding's rows; each names the file and the field (or the ids).
    """
    import transformers
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    from unmask.compat import quiet_transformers
    from unmask.models.adapters import family_of, loader_name
    from unmask.models.families import load_native, native_module

    if not (path / "config.json").is_file():
        raise UnmaskError(f"{path} is not a Hugging Face model directory (no config.json); "
                          "pass a directory written by save_pretrained or a shipped model name")
    meta = read_unmask_config(path)
    hf_config = _read_hf_config(path)
    check_config_fields(path, hf_config)
    if "decode_defaults" in meta:  # null too: read as {} it would turn lossless SBD into the lossy sampler
        meta["decode_defaults"] = check_decode_defaults(meta["decode_defaults"], str(path / UNMASK_CONFIG))
        check_default_sizes(path, meta["decode_defaults"], hf_config)
    family = family_of(hf_config)
    native = native_module(hf_config)
    if kind is not None and kind not in KINDS:
        raise UnmaskError(f"unknown model kind {kind!r}; choose one of: {', '.join(KINDS)}")
    kind_given = kind is not None
    if kind is not None and meta.get("kind") is not None and kind != meta["kind"]:
        raise UnmaskError(f"{path} is a {meta['kind']} checkpoint (kind in {UNMASK_CONFIG}); --kind {kind} cannot "
                          "override it, drop --kind")
    kind = kind or meta.get("kind") or (family.kind if family is not None else "causal")
    if kind not in KINDS:
        raise UnmaskError(f"unknown model kind {kind!r}; choose one of: {', '.join(KINDS)}")
    if native is None and hf_config.get("auto_map") and not trust_remote_code:
        raise UnmaskError(f"{path} ships its own model code (auto_map in config.json); load it with "
                          "trust_remote_code=True if you trust that code")
    if logit_shift is not None and logit_shift not in (0, 1):
        raise UnmaskError(f"logit_shift must be 0 or 1 (got {logit_shift}); use 1 for Dream-style models")
    device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    quiet_transformers()
    extra = {}
    if tp is not None and tp != 1:
        if native is not None:
            raise UnmaskError(f"--tp is not supported for the native {family.name if family else 'dLLM'} classes yet; "
                              "drop --tp (data parallel still works under torchrun)")
        device, extra = tp_load_options(tp, device, hf_config, trust_remote_code)
    check_float_weights(path, hf_config)
    try:
        if native is not None:
            model = load_native(native, path, hf_config, dtype=torch_dtype)
        else:
            auto = getattr(transformers, loader_name(hf_config, family))
            model, info = auto.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                               output_loading_info=True, ignore_mismatched_sizes=True, **extra)
            check_weights_match(path, hf_config, info)
        tokenizer = _load_tokenizer(path, family, native is not None, trust_remote_code)
    except UnmaskError:
        raise
    except StrictDataclassError as e:  # transformers' config classes validate their fields
        cause = re.sub(r"^(ValueError|TypeError): ", "", [x.strip() for x in str(e).splitlines() if x.strip()][-1])
        raise UnmaskError(f"{path / 'config.json'} is not a valid {hf_config.get('model_type', 'model')} config: "
                          f"{cause.rstrip('.')}; fix the file or restore the checkpoint") from None
    except ImportError as e:  # a missing or half-imported package: the files are not at fault
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnmaskError(f"cannot load the checkpoint in {path}: a Python import failed ({first.rstrip('.:')}), "
                          "not its files; install the package named, or restart the process") from None
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, ArithmeticError, RecursionError,
            SafetensorError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnmaskError(f"cannot load the checkpoint in {path}: {first.rstrip('.:')}; "
                          "the directory is incomplete or corrupt, restore or re-save it") from None
    layers = getattr(model.config, "num_hidden_layers", 1)
    if not is_int(layers) or layers < 1:
        raise UnmaskError(f"{path / 'config.json'} has num_hidden_layers {model.config.num_hidden_layers!r}; a model "
                          "needs at least one layer, fix the file or restore the checkpoint")
    check_tokenizer_ids(tokenizer, model, path)
    model.to(device).eval()
    from unmask.threads import after_load

    after_load(model)
    if kind == "causal":  # a causal model may still carry a mask token (e.g. before SBD fine-tuning)
        mask_id = mask_token_id if mask_token_id is not None else meta.get("mask_token_id")
        if mask_id is not None:
            mask_id = _as_id(mask_id, "mask_token_id")
    else:
        mask_id = _mask_id(mask_token_id, meta, model, tokenizer, family, path)
    if kind != "causal" and mask_id is None:
        how = "drop --kind, or for a causal model use --adapter sbd (a gated SBD adapter)" if kind_given and kind == "sbd" \
            else "pass mask_token_id=ID to unmask.load or add it to the model's unmask_config.json"
        a = "an" if kind == "sbd" else "a"
        raise UnmaskError(f"{path} is read as {a} {kind} model (--kind {kind}) but names no mask token; {how}"
                          if kind_given else f"{path} is {a} {kind} model but names no mask token; {how}")
    if mask_token_id is not None and not force_mask_id:
        named = (meta.get("mask_token_id"), getattr(model.config, "mask_token_id", None),
                 getattr(family, "mask_token_id", None))
        check_explicit_mask_id(int(mask_id), [int(i) for i in named if isinstance(i, int)], tokenizer, path)
    vocab = getattr(model.config, "vocab_size", None)
    if mask_id is not None and isinstance(vocab, int) and not 0 <= int(mask_id) < vocab:
        raise UnmaskError(f"{path}: mask token id {mask_id} is outside the model's vocabulary of {vocab}; "
                          "pass the right mask_token_id")
    if logit_shift is None:
        logit_shift = meta.get("logit_shift", family.logit_shift if family is not None else 0)
        if logit_shift not in (0, 1) or isinstance(logit_shift, bool):
            raise UnmaskError(f"logit_shift in {path / UNMASK_CONFIG} must be 0 or 1 (got {logit_shift!r}); "
                              "use 1 for Dream-style models, 0 otherwise")
    stops, stops_from = _stop_ids(model, tokenizer, meta, path)
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    # An id past the vocabulary is never generated, so never a stop: every decode would run to its
    # length limit. Published dLLM families are read as published (their ids are known good; a
    # shrunken copy keeps them) and their documented stop ids are filtered to the vocabulary below.
    beyond = [i for i in stops if vocab and i >= vocab] if family is None else []
    if beyond:
        raise UnmaskError(f"{path}: {stops_from} holds {beyond[0]}, outside the model's vocabulary of {vocab}; fix the "
                          "file or restore the checkpoint")
    if family is not None and "stop_token_ids" not in meta:
        stops = tuple(dict.fromkeys(stops + tuple(i for i in family.stop_token_ids if i < vocab)))
    if mask_id is not None and int(mask_id) in stops and not (mask_token_id is not None and force_mask_id):
        # decoders suppress the mask id, so the model could never stop; and a committed EOS would read as masked
        mask_from = "mask_token_id" if mask_token_id is not None else \
            f"mask_token_id in {UNMASK_CONFIG}" if meta.get("mask_token_id") is not None else "config.json or the tokenizer"
        raise UnmaskError(f"{path}: the mask token {mask_id} ({mask_from}) is also a stop token ({stops_from}); give it a "
                          "token of its own, fix the file or restore the checkpoint")
    if family is not None:
        meta = {"family": family.name, **meta}
    if extra:  # tensor-parallel: every rank runs the same decode (no data-parallel sharding)
        meta = {**meta, "tp": tp}
    bos = getattr(tokenizer, "bos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None) if tokenizer is None else None
    return ModelBundle(
        model=model, tokenizer=tokenizer, kind=kind, name=name, path=path, bos_token_id=bos,
        stop_token_ids=stops, pad_token_id=int(pad) if pad is not None else 0,
        mask_token_id=None if mask_id is None else int(mask_id),
        logit_shift=int(logit_shift), block_size=_block_size(meta, hf_config, family), meta=meta,
    )
