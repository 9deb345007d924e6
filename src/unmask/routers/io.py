"""Saving and loading LBS / LPS routers next to their base model.

Layout (our choice): ``MODEL_DIR/routers/lbs.safetensors`` + ``lbs.json`` and
``MODEL_DIR/routers/lps.safetensors`` + ``lps.json``. The JSON holds the format tag, the router
config, the sha256 of the weights file (a weights file that does not match its JSON is refused),
facts about the base model it was trained with, ``tau_psi`` for LPS, and training metrics.

:func:`save_router` stages a copy of the router directory, writes the new pair there and swaps
the directory in one step; a recipe that writes both routers stages the whole directory and
publishes it with :func:`unmask.fileio.publish_dir` too.

Compatibility: LBS embeds top-1 tokens with the base model's input embedding, so an LBS router
trained for another vocabulary or embedding width is refused; a different embedding of the same
shape (e.g. a retrained base model) only warns. LPS is vocabulary-free and loads anywhere (§4.4).
"""

from __future__ import annotations

import hashlib
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path


from unmask.errors import UnmaskError
from unmask.fileio import atomic_write_json, publish_dir, read_json_object, staging_dir
from unmask.routers.lbs import LBSConfig, LBSRouter
from unmask.routers.lps import LPSConfig, LPSRouter

ROUTERS_DIR = "routers"
FORMAT = "unmask-router/1"
KINDS = {"lbs": (LBSConfig, LBSRouter), "lps": (LPSConfig, LPSRouter)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def embedding_fingerprint(model) -> str:
    """First 16 hex digits of the sha256 of the input embedding (float32 bytes)."""
    w = model.get_input_embeddings().weight.detach().float().cpu().contiguous()
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()[:16]


def base_model_facts(bundle) -> dict:
    """What a router records about the base model it was trained with."""
    emb = bundle.model.get_input_embeddings().weight
    return {"name": bundle.name, "vocab_size": int(emb.shape[0]), "d_base": int(emb.shape[1]),
            "mask_token_id": bundle.mask_token_id, "logit_shift": int(bundle.logit_shift),
            "embedding": embedding_fingerprint(bundle.model)}


def save_router(router, directory: str | Path, *, meta: dict | None = None) -> Path:
    """Write ``router`` (LBSRouter or LPSRouter) as ``directory/{kind}.safetensors`` + ``.json``.

    ``meta`` (JSON-able) is stored as is, e.g. ``{"base_model": base_model_facts(bundle),
    "tau_psi": 0.9, "metrics": {...}}``. Returns the JSON path.

    The router directory is published as one unit: a staged copy of ``directory`` (the other
    router's files included) receives the new pair and is swapped in atomically
    (:func:`unmask.fileio.publish_dir`), so a crash at any moment leaves the previous, matching
    weights and JSON in place.

    Raises:
        UnmaskError: the directory cannot be written (full disk, no permission).
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    directory = Path(directory)
    state = {k: v.detach().cpu().contiguous() for k, v in router.state_dict().items()}
    try:
        stage = staging_dir(directory)
    except OSError as e:
        raise UnmaskError(f"cannot write the router to {directory}: {e.strerror or e}; choose a writable --out") from None
    try:
        if directory.is_dir():
            shutil.copytree(directory, stage, dirs_exist_ok=True, symlinks=True)
        weights = stage / f"{router.kind}.safetensors"
        save_file(state, str(weights))
        info = {"format": FORMAT, "router": router.kind, "config": router.config.to_dict(),
                "weights_sha256": _sha256(weights), "n_params": sum(p.numel() for p in router.parameters()),
                **(meta or {})}
        atomic_write_json(stage / f"{router.kind}.json", info)
        publish_dir(stage, directory)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(stage, ignore_errors=True)
        reason = getattr(e, "strerror", None) or str(e)
        raise UnmaskError(f"cannot write the router to {directory}: {reason}; free disk space or choose another "
                          "--out") from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return directory / f"{router.kind}.json"


def load_router(directory: str | Path, kind: str, *, device="cpu"):
    """Load ``directory/{kind}.json`` + ``.safetensors`` -> (router in eval mode, info dict).

    Raises UnmaskError for a missing or unreadable file, another format, or weights that do not
    match the JSON (sha256) or the config (keys/shapes).
    """
    from safetensors.torch import load_file

    if kind not in KINDS:
        raise UnmaskError(f"unknown router kind {kind!r}; choose lbs or lps")
    directory = Path(directory)
    path, weights = directory / f"{kind}.json", directory / f"{kind}.safetensors"
    if not path.is_file() or not weights.is_file():
        raise UnmaskError(f"no {kind.upper()} router in {directory} (need {path.name} and {weights.name})")
    info = read_json_object(path, "retrain the router")
    if info.get("format") != FORMAT or info.get("router") != kind:
        raise UnmaskError(f"{path} is not an unmask {kind.upper()} router ({FORMAT}); retrain it")
    if info.get("weights_sha256") != _sha256(weights):
        raise UnmaskError(f"{weights} does not match {path.name} (sha256); the save was interrupted or the files "
                          "were mixed up; retrain or restore the router")
    config_cls, router_cls = KINDS[kind]
    try:
        config = config_cls(**info["config"])
    except (TypeError, KeyError) as e:
        raise UnmaskError(f"{path}: bad router config ({e}); retrain the router") from None
    router = router_cls(config)
    try:
        router.load_state_dict(load_file(str(weights)))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise UnmaskError(f"{weights} does not fit its config ({first}); retrain the router") from None
    return router.to(device).eval(), info


def check_lbs_fits(info: dict, bundle) -> None:
    """Refuse an LBS router trained for another vocabulary or embedding width; warn when the
    embedding itself differs (the router reads W_e(x̂), §3.2)."""
    base = info.get("base_model") or {}
    emb = bundle.model.get_input_embeddings().weight
    vocab, d_base = int(emb.shape[0]), int(emb.shape[1])
    cfg = info.get("config", {})
    if int(cfg.get("vocab_size", -1)) != vocab or int(cfg.get("d_base", -1)) != d_base:
        raise UnmaskError(f"this LBS router was trained for {base.get('name', 'another model')!r} with a vocabulary of "
                          f"{cfg.get('vocab_size')} and embedding width {cfg.get('d_base')}, but {bundle.name!r} has "
                          f"{vocab} and {d_base}; LBS does not transfer across vocabularies, train one with "
                          f"`unmask train lbs --model {bundle.name}`")
    if base.get("embedding") and base["embedding"] != embedding_fingerprint(bundle.model):
        warnings.warn(f"the LBS router was trained on a different embedding table than {bundle.name!r}'s "
                      "(same shape); retrain it if the base model was retrained", stacklevel=3)


def routers_dir(bundle, routers: str | Path | None = None) -> Path | None:
    """The router directory: ``routers`` when given, else ``MODEL_DIR/routers`` (None without a path)."""
    if routers is not None:
        return Path(routers).expanduser()
    return None if bundle.path is None else Path(bundle.path) / ROUTERS_DIR


@dataclass
class Routers:
    """Routers loaded for one base model; lps is None for LBS-only decoding."""

    lbs: LBSRouter
    lps: LPSRouter | None
    tau_psi: float | None
    lbs_info: dict
    lps_info: dict | None


def _how_to_train(bundle) -> str:
    from unmask.models.registry import shipped

    # A shipped name resolves anywhere; a local model is named by its directory.
    model = bundle.name if bundle.name in shipped() or bundle.path is None else str(bundle.path)
    recipe = " (or python recipes/stories260K_dlm_routers.py)" if bundle.name == "stories260K-dlm" else ""
    return (f"train them with `unmask train lbs --model {model} --data CORPUS` then `unmask train lps --model "
            f"{model} --data CORPUS`{recipe}, or pass routers=DIR (Python API)")


def load_routers(bundle, *, routers: str | Path | None = None, lps: bool = True) -> Routers:
    """The LBS (and, with ``lps``, LPS) routers of ``bundle``, from ``routers`` or MODEL_DIR/routers.

    Raises UnmaskError naming how to train them when they are missing, and for an LBS router of
    another vocabulary.
    """
    where = routers_dir(bundle, routers)
    if where is None or not (where / "lbs.json").is_file():
        place = f" in {where}" if where is not None else " (the model has no directory)"
        raise UnmaskError(f"no Early-Bird routers for {bundle.name!r}{place}; {_how_to_train(bundle)}")
    device = bundle.device
    lbs, lbs_info = load_router(where, "lbs", device=device)
    check_lbs_fits(lbs_info, bundle)
    if not lps:
        return Routers(lbs, None, None, lbs_info, None)
    if not (where / "lps.json").is_file():
        raise UnmaskError(f"no LPS router for {bundle.name!r} in {where}; train it with `unmask train lps --model "
                          f"{bundle.name}`, or decode LBS-only with --no-lps")
    lps_router, lps_info = load_router(where, "lps", device=device)
    tau_psi = lps_info.get("tau_psi")
    if not isinstance(tau_psi, (int, float)) or not 0 < tau_psi < 1:
        raise UnmaskError(f"{where / 'lps.json'} holds no valid tau_psi in (0, 1) (got {tau_psi!r}); retrain LPS "
                          "or pass tau_psi=")
    return Routers(lbs, lps_router, float(tau_psi), lbs_info, lps_info)
