"""Checks of a checkpoint's files and ids at load, each naming the file and the field (or the ids)
it refuses: config.json sizes, integer-typed weights, weights that do not fill the config, a mask
id that is a vocabulary token, tokenizer ids past the input embedding, decode defaults that are no
decoder options."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

from safetensors import SafetensorError, safe_open

from unmask.errors import UnmaskError, is_int

# config.json sizes that must be >= 1 where they are integers (0 divides by zero in transformers'
# config checks; a context of 0 refuses every prompt). Other types are left to transformers' own
# field validation, and num_hidden_layers to the check after the load.
POSITIVE_CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                          "intermediate_size", "max_position_embeddings")
# a weight stored as an integer type is quantised: a float load would cast its codes to garbage values
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def non_finite(value, where: str = "") -> tuple[str, float] | None:
    """The first (dotted key path, value) of a NaN or infinite number in a JSON value, else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := non_finite(item, f"{where}.{key}" if where else str(key))) is not None:
            return found
    return None


def check_config_fields(path: Path, hf_config: dict) -> None:
    """Raises UnmaskError naming config.json and the field for an integer size field below 1, or for
    a NaN / Infinity anywhere in it (json reads them; a NaN rms_norm_eps made every logit NaN)."""
    if (found := non_finite(hf_config)) is not None:
        raise UnmaskError(f"{path / 'config.json'}: {found[0]} is {found[1]!r}, not a finite number; fix the file "
                          "or restore the checkpoint")
    for key in POSITIVE_CONFIG_FIELDS:
        value = hf_config.get(key)
        if is_int(value) and value < 1:
            raise UnmaskError(f"{path / 'config.json'}: {key} must be an integer >= 1 (got {value!r}); fix the file "
                              "or restore the checkpoint")


def check_default_sizes(path: Path, defaults: dict, hf_config: dict) -> None:
    """Raises UnmaskError for a decode_defaults block size past the context window: no request could
    use it (and the server's start-up memory check would count its drafts and blame the batch)."""
    ctx = hf_config.get("max_position_embeddings")
    for key in ("block_size", "verify_block_size"):
        value = defaults.get(key)
        if is_int(ctx) and is_int(value) and value > ctx:
            shown = str(value) if len(str(value)) <= 20 else str(value)[:20] + "..."
            raise UnmaskError(f"{path / 'unmask_config.json'}: decode_defaults {key} {shown} is larger than the context "
                              f"window of {ctx}; fix the file or restore the checkpoint")


def check_float_weights(path: Path, hf_config: dict) -> None:
    """Refuse safetensors weights (``*.weight`` / ``*.bias``) stored as integers in a checkpoint
    without a ``quantization_config``: loading casts the raw codes to float and the model writes
    garbage. Reads the files' headers only. Raises UnmaskError naming the file and tensor."""
    if hf_config.get("quantization_config") is not None:
        return
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    dtype = fh.get_slice(key).get_dtype()
                    if dtype not in FLOAT_DTYPES and key.endswith((".weight", ".bias")):
                        raise UnmaskError(f"{f}: {key} is stored as {dtype}, and config.json has no "
                                          "quantization_config; save the weights in float32 or bfloat16")
        except SafetensorError:
            return  # unreadable: the load that follows names it


def check_weights_match(path: Path, hf_config: dict, info: dict) -> None:
    """Refuse a checkpoint whose weights do not fill the model config.json describes: transformers
    would initialise the missing or mis-sized parameters at random (e.g. ``model_type`` edited to another
    architecture, a size edited) and the model would write noise. Raises UnmaskError."""
    mismatched = sorted((str(k), tuple(a), tuple(b)) for k, a, b in info.get("mismatched_keys") or ())
    if mismatched:  # loaded with ignore_mismatched_sizes so that the shapes can be named here
        key, ckpt, model = mismatched[0]
        raise UnmaskError(f"the weights in {path} do not fit its config.json: {len(mismatched)} tensors differ, e.g. "
                          f"{key} is {ckpt} in the checkpoint but {model} by config.json; fix config.json (a size "
                          "edited, or a key given twice: the last wins) or restore the checkpoint")
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise UnmaskError(f"the weights in {path} do not fit its config.json (model_type "
                          f"{hf_config.get('model_type')!r}): {len(missing)} parameters missing, e.g. {missing[0]}; "
                          "fix config.json or restore the checkpoint")


def vocabulary_token(token_id: int, tokenizer) -> str | None:
    """``"ordinary vocabulary token ','"`` / ``"special token '</s>'"`` when ``token_id`` is a
    token of ``tokenizer`` that cannot serve as a mask, else None: no tokenizer, the tokenizer's
    mask token, a token whose name says mask, or a row the tokenizer has no token for (an
    added embedding row)."""
    if token_id == getattr(tokenizer, "mask_token_id", None):
        return None
    try:
        size = len(tokenizer)
        token = tokenizer.convert_ids_to_tokens(token_id) if token_id < size else None
    except (TypeError, ValueError, IndexError):
        return None
    if token is None or "mask" in str(token).lower():
        return None
    special = token_id in set(getattr(tokenizer, "all_special_ids", []) or [])
    return f"{'special token' if special else 'ordinary vocabulary token'} {token!r}"


def check_explicit_mask_id(mask_id: int, declared: list[int], tokenizer, path: Path) -> None:
    """Refuse an explicit mask id that is a special or ordinary token of the vocabulary (issue 15).

    Accepted: the checkpoint's own mask id, the tokenizer's mask token, a token whose name says
    mask, or a row the tokenizer has no token for (an added embedding row). Decoders suppress the
    mask id and read it as "not yet decoded", so using EOS or <unk> corrupts every decode silently.
    """
    if mask_id in declared:
        return
    token = vocabulary_token(mask_id, tokenizer)
    if token is None:
        return
    named = f"the checkpoint's is {declared[0]}" if declared else "the checkpoint names none"
    raise UnmaskError(f"mask_token_id {mask_id} is the {token} of {path.name} ({named}); pass the "
                      "model's mask token id, or force_mask_id=True to use this token as the mask anyway")


def check_tokenizer_ids(tokenizer, model, path: Path) -> None:
    """Raise UnmaskError naming the token ids ``tokenizer`` can produce that the model's input embedding
    has no row for (e.g. a token added to tokenizer.json past ``vocab_size``): a prompt holding one
    fails inside the forward, and in the server it would take the requests prefilled with it along."""
    if tokenizer is None:
        return
    try:
        rows = int(model.get_input_embeddings().weight.shape[0])  # (V, d)
    except (AttributeError, NotImplementedError, TypeError):
        return
    base = int(getattr(tokenizer, "vocab_size", 0) or 0)
    added = (getattr(tokenizer, "added_tokens_decoder", None) or {}).keys()
    over = sorted(set(range(rows, base)) | {int(i) for i in added if int(i) >= rows})
    if not over:
        return
    shown = ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in over[:5]) + ", ..." * (len(over) > 5)
    raise UnmaskError(f"{path}: the tokenizer has {len(over)} token id(s) past the model's {rows} embedding rows "
                      f"({shown}); remove them from tokenizer.json, or resize the embeddings to {over[-1] + 1} rows "
                      "and re-save the model")


def check_decode_defaults(defaults, where: str) -> dict:
    """``defaults`` (a model's or adapter's ``decode_defaults``) checked as SBD decoder options:
    a JSON object whose keys are options of the ``sbd`` decoder (:class:`unmask.decode.blocks.sbd.SBDOptions`) (``block_size``,
    ``policy``, ``gamma``, ``preset``, ``tau``, ``factor``, ``tokens_per_step``, ``verify``,
    ``verify_block_size``, ``draft``) with valid values. Returns a copy.

    Raises:
        UnmaskError: naming ``where`` and the key, for a non-object, an unknown key or a bad value.
    """
    # the decoders' configs, imported here: loading a model needs them only when it has decode_defaults
    from unmask.decode.blocks.sbd import LOSSLESS_KEYS, SBDConfig
    from unmask.decode.verify.config import VerifyConfig

    if not isinstance(defaults, dict):
        raise UnmaskError(f"{where}: 'decode_defaults' must be a JSON object of decoder options (got "
                          f"{type(defaults).__name__} {defaults!r}); restore it or set it with set_decode_defaults "
                          "(a model) or set_adapter_decode_defaults (an adapter)")
    lossy_keys = [k for k in inspect.signature(SBDConfig.from_options).parameters if k != "defaults"]
    known = (*lossy_keys, *LOSSLESS_KEYS)
    for key, value in defaults.items():
        if key not in known:
            raise UnmaskError(f"{where}: unknown decode_defaults key {key!r}; the sbd decoder's options are "
                              f"{', '.join(known)}")
        if not isinstance(value, (bool, int, float, str)) and value is not None:
            raise UnmaskError(f"{where}: decode_defaults {key}={value!r} is not a number, string or boolean; "
                              "pass a plain value")
        if isinstance(value, float) and not math.isfinite(value):  # json reads NaN and Infinity
            raise UnmaskError(f"{where}: decode_defaults {key}={value!r} is not a finite number; pass a finite "
                              "value, as on the command line")
    try:
        SBDConfig.from_options(**{k: v for k, v in defaults.items() if k not in LOSSLESS_KEYS})
        if "verify" in defaults and not isinstance(defaults["verify"], bool):
            raise UnmaskError(f"verify must be true or false (got {defaults['verify']!r}); pass verify=True or False")
        if any(k in defaults for k in LOSSLESS_KEYS):
            VerifyConfig.of(block_size=defaults.get("verify_block_size", VerifyConfig.block_size),
                            draft=defaults.get("draft", VerifyConfig.draft))
            if "queries" in defaults or "draft_layouts" in defaults:  # a calibrated table (spec §5.4)
                from unmask.decode.verify import layout as draft_layout

                draft_layout.resolve("budget", defaults.get("queries"), defaults)
    except (UnmaskError, TypeError) as e:
        raise UnmaskError(f"{where}: decode_defaults: {e}") from None
    return dict(defaults)
