"""Host syncs per step and drain time of the eager serving batches with ``on_step`` set, as the
server runs them (issue 49): diffusion (stories260K-dlm, block 8), block (stories260K-bd) and
multiblock (stories260K-mbd), 8 greedy streams of 64 new tokens joined at once.

    PYTHONPATH=src python benchmarks/host_syncs_on_step.py --reps 3

Prints one JSON line: per decoder, host reads per step (every tensor -> Python conversion, a read
nested in another counted once) and the median seconds to drain the batch. Results:
benchmarks/results/host_syncs_on_step.md."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import unmask
from unmask.decode import DECODERS
from unmask.decode.engine.running import requests_for
from unmask.sampling import Sampling

PROMPTS = ["Once upon a time", "Tom", "Lily wanted to play with her big red ball", "The dog", "One day, a little",
           "Sam and Mia", "There was a bird", "The sun was"]
CASES = {
    "diffusion": ("stories260K-dlm", lambda b, h: DECODERS["diffusion"].batch(b, DECODERS["diffusion"].config(block_size=8), capacity=8,
                                                                             on_step=h)),
    "block": ("stories260K-bd", lambda b, h: DECODERS["block"].batch(b, DECODERS["block"].config(), capacity=8,
                                                                     on_step=h)),
    "multiblock": ("stories260K-mbd", lambda b, h: DECODERS["multiblock"].batch(b, DECODERS["multiblock"].config(),
                                                                               capacity=8, on_step=h)),
}
SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


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


def drain(make, bundle, new_tokens: int, reads: Reads | None = None) -> tuple[float, int]:
    """Seconds to join 8 requests and step until empty; the steps run."""
    dec = make(bundle, lambda row, event: None)  # the server posts each event: the batch builds it
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


def main(reps: int = 3, new_tokens: int = 64) -> dict:
    out = {}
    for name, (model, make) in CASES.items():
        bundle = unmask.load(model)
        drain(make, bundle, new_tokens)  # warm-up
        seconds = statistics.median(drain(make, bundle, new_tokens)[0] for _ in range(reps))
        out[name] = {"median_s": round(seconds, 4)}
    reads = Reads()  # after the timings: counting slows every read
    for name, (model, make) in CASES.items():
        reads.n = 0
        _, steps = drain(make, unmask.load(model), new_tokens, reads)
        out[name]["host_reads_per_step"] = round(reads.n / steps, 2)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    print(json.dumps(main(args.reps, args.new_tokens)))
