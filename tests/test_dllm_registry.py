"""The masked-diffusion family as registry decoders (issue 49): a real batch and no ``run``, no
import cycle or function-local import in ``decode/dllm``, every module under 400 lines."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import unmask
from unmask.decode import DECODERS
from unmask.decode.dllm.diffusion import DiffusionOptions
from unmask.decode.dllm.early_bird import EarlyBirdOptions

DLLM = Path(unmask.__file__).parent / "decode" / "dllm"


def _imports(path: Path) -> tuple[set[str], list[int]]:
    """(unmask modules imported anywhere in the file, lines of imports inside a function)."""
    tree = ast.parse(path.read_text())
    names, local = set(), []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        local += [n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("unmask"):
            names.update(f"{n.module}.{a.name}" for a in n.names)
            names.add(n.module)
        elif isinstance(n, ast.Import):
            names.update(a.name for a in n.names if a.name.startswith("unmask"))
    return names, local


def test_dllm_modules_have_no_cycle_no_local_import_and_stay_short():
    graph = {}
    for path in sorted(DLLM.glob("*.py")):
        names, local = _imports(path)
        assert not local, f"{path.name}: function-local imports at lines {local}"
        assert len(path.read_text().splitlines()) < 400, f"{path.name} is over 400 lines"
        graph[f"unmask.decode.dllm.{path.stem}"] = {n for n in names if n.startswith("unmask.decode.dllm.")}

    def reach(start, seen):
        for nxt in graph.get(start, ()):
            if nxt not in seen:
                seen.add(nxt)
                reach(nxt, seen)
        return seen

    for mod in graph:
        assert mod not in reach(mod, set()), f"{mod} imports itself through a cycle"


def test_the_specs_are_a_config_and_a_batch():
    for name, options in (("diffusion", DiffusionOptions), ("early-bird", EarlyBirdOptions)):
        spec = DECODERS[name]
        assert not hasattr(spec, "run") and spec.config is options and spec.batch.__name__ == "batch"
        assert not hasattr(sys.modules[spec.batch.__module__], "OPTIONS")  # the knob class is the list
