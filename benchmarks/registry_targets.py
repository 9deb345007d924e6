"""Issue 49's targets in one run: the code's shape and the host syncs of every registered decoder.

    PYTHONPATH=src python benchmarks/registry_targets.py            # prints one JSON object
    PYTHONPATH=src python benchmarks/registry_targets.py --reps 3   # and drain times with on_step set / unset

Shape: import cycles in src/unmask counting function-local imports (the graph of
tests/test_structure.py), modules over 400 lines, lines of decode/ + serve/, imports of unmask.cli
under serve/. Host syncs: every decoder's running batch (``Spec.batch``, as the server builds it)
with 8 greedy streams of 48 new tokens joined at once, host reads per step (every tensor -> Python
conversion; a read nested in another counts once) with ``on_step`` unset and set (the server's case).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

import unmask
from unmask.decode import DECODERS
from unmask.decode.engine.running import requests_for
from unmask.sampling import Sampling

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Once upon a time", "Tom", "Lily wanted to play with her big red ball", "The dog", "One day, a little",
           "Sam and Mia", "There was a bird", "The sun was"]
# decoder -> (model, options): each decoder on the shipped model of its kind
CASES = {"ar": ("stories260K", {}), "sbd": ("stories260K-sbd", {"verify": False}),
         "sbd-lossless": ("stories260K-sbd", {"verify": True}), "diffusion": ("stories260K-dlm", {"block_size": 8}),
         "early-bird": ("stories260K-dlm", {}), "block": ("stories260K-bd", {}), "multiblock": ("stories260K-mbd", {})}
SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


def shape() -> dict:
    """Cycles, module sizes and decode/ + serve/ lines of src/unmask."""
    spec = importlib.util.spec_from_file_location("test_structure", ROOT / "tests" / "test_structure.py")
    ts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ts)
    src = ROOT / "src"
    graph = ts.import_graph(src, "unmask")
    files = list((src / "unmask").rglob("*.py"))
    lines = {f: len(f.read_text().splitlines()) for f in files}
    ds = sum(n for f, n in lines.items() if {"decode", "serve"} & set(f.relative_to(src / "unmask").parts[:1]))
    return {"import_cycles": ts.cycles(graph), "modules_over_400": sorted(str(f.relative_to(src)) for f, n in lines.items()
                                                                             if n > 400),
            "decode_plus_serve_lines": ds,
            "serve_imports_cli": sorted({f"{a} -> {b}" for a, b in graph.edges if a.startswith("unmask.serve")
                                         and b.startswith("unmask.cli")})}


class Reads:
    """Counts tensor -> host reads while ``on`` (a read made inside another counts once)."""

    def __init__(self):
        self.n, self.on = 0, False
        for name in SYNCS:
            setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))

    def _counted(self, real):
        def counted(t, *a, **kw):
            if not self.on:
                return real(t, *a, **kw)
            self.n, self.on = self.n + 1, False
            try:
                return real(t, *a, **kw)
            finally:
                self.on = True
        return counted


def drain(name: str, bundle, hook, new_tokens: int, reads: Reads | None = None) -> tuple[float, int]:
    """Seconds to join 8 requests into the server's running batch of ``name`` and step until empty; steps."""
    spec = DECODERS[name.removesuffix("-lossless")]
    cfg = spec.config.of(CASES[name][1])
    dec = spec.batch(bundle, cfg, capacity=8, on_step=hook, stop_token_ids=tuple(bundle.stop_token_ids))
    reqs = requests_for([bundle.encode(p) for p in PROMPTS], max_new_tokens=new_tokens, sampling=Sampling(),
                        device=bundle.device)
    t0, steps = time.perf_counter(), 0
    dec.join(reqs)
    while len(dec):
        if reads is not None:
            reads.on = True
        dec.step()
        if reads is not None:
            reads.on = False
        steps += 1
    return time.perf_counter() - t0, steps


def main(reps: int, new_tokens: int) -> dict:
    out = {"shape": shape(), "decoders": {}}
    hooks = {"quiet": None, "on_step": lambda row, event: None}  # the server posts each event: the batch builds it
    bundles = {m: unmask.load(m) for m, _ in CASES.values()}
    for name, (model, _) in CASES.items():
        row = out["decoders"][name] = {}
        for label, hook in hooks.items():
            if reps:
                drain(name, bundles[model], hook, new_tokens)  # warm-up
                row[f"median_s_{label}"] = round(statistics.median(
                    drain(name, bundles[model], hook, new_tokens)[0] for _ in range(reps)), 4)
    reads = Reads()  # after the timings: counting slows every read
    for name, (model, _) in CASES.items():
        for label, hook in hooks.items():
            reads.n = 0
            _, steps = drain(name, bundles[model], hook, new_tokens, reads)
            out["decoders"][name][f"host_reads_per_step_{label}"] = round(reads.n / steps, 2)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=0, help="drain-time repetitions per decoder (0: host reads only)")
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(main(args.reps, args.new_tokens), indent=1))
