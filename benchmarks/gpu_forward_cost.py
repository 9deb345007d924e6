"""Measured cost of a k-token forward against a KV cache, next to the corrected roofline (SBD §4).

Reproduces the quantity of SBD Table 3, time(k) / time(1), on real hardware: a random-weight
model with the Llama-3.1-8B shape in bf16 on one CUDA GPU (built on the device with weight
initialisation skipped, then filled with N(0, 0.02); no download), forwarding a block of k
tokens per row against a KV cache holding L tokens, for k ∈ {1, 2, 4, 8, 16, 32, 64},
L ∈ {1024, 4096, 16384} and batch ∈ {1, 4, 8}. The prediction printed next to each measured
slowdown is :mod:`unmask.bench.roofline` in corrected mode for the same shape with bf16
weights, KV cache and activations (2/2/2 bytes) on an H200 at BF16 peak for every GEMM
(989e12 FLOP/s dense, 4.8e12 B/s; datasheet values, unverified), logits for all k rows.

Method. The cache is a transformers ``StaticCache`` of ``L + k`` slots whose write pointer is
set to L (so no L-token prefill is run: the timing does not depend on the cached values);
each timed forward writes k new K/V at positions L..L+k-1 and the pointer is moved back with
``crop(-k)``. Attention therefore reads L + k keys, as the roofline's corrected mode assumes.
Each forward is captured in a CUDA graph when capture works (so Python launch overhead,
several ms for 32 eager layers, does not hide the GPU time of small blocks) and replayed;
otherwise it runs eagerly, and the ``mode`` column says so. Times are CUDA-event times:
``--warmup`` untimed runs, then the median of ``--reps``. A ``--budget-s`` deadline (default
420 s) skips the remaining cells rather than overrun; the full grid takes about a minute on
one H200.

    python benchmarks/gpu_forward_cost.py [--reps 10] [--json out.json]
    python benchmarks/gpu_forward_cost.py --tiny      # CPU smoke test with a tiny shape

Without a CUDA device and without ``--tiny`` it refuses with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time

import torch

from unmask.bench.roofline import GPUSpec, ModelShape, Precision, roofline
from unmask.compat import cache_keyword, set_static_length

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                rope_theta=500000.0, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096,
            tie_word_embeddings=False)
# An H200 running bf16 GEMMs: the BF16 dense peak for linear layers too (the h200 preset
# assumes FP8 weights), 4.8 TB/s HBM3e. Datasheet values, unverified.
H200_BF16 = GPUSpec("h200-bf16", 989e12, 989e12, 4.8e12, "datasheet (unverified): BF16 dense, 4.8 TB/s")
GRID = {"blocks": (1, 2, 4, 8, 16, 32, 64), "kv": (1024, 4096, 16384), "batches": (1, 4, 8)}
TINY_GRID = {"blocks": (1, 2, 4, 8), "kv": (64, 256), "batches": (1, 2)}
REFUSAL = ("gpu_forward_cost needs a CUDA GPU and none is visible; run it on an H200, "
           "or pass --tiny for the CPU smoke test")


def build_model(shape: dict, *, device: torch.device, dtype: torch.dtype):
    """A random ``LlamaForCausalLM`` of ``shape`` built directly on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        no_init_weights = contextlib.nullcontext
    config = LlamaConfig(attn_implementation="sdpa", bos_token_id=1, eos_token_id=2, **shape)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), no_init_weights():
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # skipped init leaves garbage (maybe NaN): make it finite
            p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


class Timer:
    """Elapsed milliseconds of a callable: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


@torch.inference_mode()
def time_block(model, *, k: int, batch: int, kv_len: int, warmup: int, reps: int,
               use_graph: bool) -> tuple[float, str]:
    """Median milliseconds of one forward of ``k`` tokens per row over ``kv_len`` cached keys,
    and the mode used (``graph`` or ``eager``)."""
    from transformers import StaticCache

    device = model.device
    cache = StaticCache(config=model.config, max_cache_len=kv_len + k)
    ids = torch.randint(3, model.config.vocab_size, (batch, k), device=device)  # (B, k)
    pos = torch.arange(kv_len, kv_len + k, device=device).expand(batch, k)  # (B, k)
    kwargs = {"input_ids": ids, "position_ids": pos, cache_keyword(model): cache, "use_cache": True,
              "logits_to_keep": k}
    model(**kwargs)  # allocates the static K/V buffers (lazy initialisation)
    set_static_length(cache, kv_len)  # the cache now "holds" kv_len tokens

    def step():
        model(**kwargs)
        set_static_length(cache, kv_len)  # move the write pointer back: every step writes the same k slots

    run, mode = step, "eager"
    if use_graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run, mode = graph.replay, "graph"
        except Exception:  # noqa: BLE001 - capture is an optimisation; eager timing still measures
            torch.cuda.synchronize()
            set_static_length(cache, kv_len)
    timer = Timer(device)
    for _ in range(warmup):
        timer(run)
    times = [timer(run) for _ in range(reps)]
    return statistics.median(times), mode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (smoke test)")
    ap.add_argument("--reps", type=int, default=None, help="timed forwards per cell (default 10; tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed forwards per cell (default 3; tiny 1)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining cells after this many seconds")
    ap.add_argument("--no-graph", action="store_true", help="time eager forwards (no CUDA graph capture)")
    ap.add_argument("--json", default=None, help="write every cell as JSON to FILE")
    args = ap.parse_args(argv)

    if not args.tiny and not torch.cuda.is_available():
        print(f"error: {REFUSAL}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    if args.tiny:
        shape, grid, device, dtype = TINY, TINY_GRID, torch.device("cpu"), torch.float32
        reps, warmup = args.reps or 3, 1 if args.warmup is None else args.warmup
        precision = Precision(4, 4, 4)
    else:
        shape, grid, device, dtype = LLAMA_8B, GRID, torch.device("cuda"), torch.bfloat16
        reps, warmup = args.reps or 10, 3 if args.warmup is None else args.warmup
        precision = Precision(2, 2, 2)
    model = build_model(shape, device=device, dtype=dtype)
    cost = roofline(mode="corrected", shape=ModelShape.from_config(shape, name="tiny" if args.tiny else "llama-3.1-8b"),
                    gpu=H200_BF16, precision=precision)
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{'tiny' if args.tiny else 'Llama-3.1-8B'} shape, random weights, {str(dtype).removeprefix('torch.')} "
          f"on {hw}; built in {time.monotonic() - t_start:.1f} s; median of {reps} after {warmup} warm-up")
    print(f"roofline: corrected mode, {cost.gpu.name}, {precision.weight:g}/{precision.kv:g}/{precision.act:g} "
          "bytes (weights/KV/activations), logits for all k rows")

    cells, skipped = [], 0
    use_graph = device.type == "cuda" and not args.no_graph
    for batch in grid["batches"]:
        for kv in grid["kv"]:
            print(f"\nbatch {batch}, KV {kv}")
            print(f"{'k':>4}  {'ms':>9}  {'measured':>8}  {'roofline':>8}  mode")
            t1 = None
            for k in grid["blocks"]:
                if time.monotonic() - t_start > args.budget_s:
                    skipped += 1
                    continue
                ms, mode = time_block(model, k=k, batch=batch, kv_len=kv, warmup=warmup, reps=reps,
                                      use_graph=use_graph)
                if use_graph and mode == "eager":
                    use_graph = False  # capture failed once: it will fail again, so stop trying
                    print("      (CUDA graph capture failed; timing eager forwards from here on)")
                t1 = ms if k == 1 else t1
                measured = ms / t1 if t1 else float("nan")
                predicted = cost.slowdown(k=k, batch=batch, kv_len=kv)
                cells.append({"batch": batch, "kv": kv, "k": k, "ms": ms, "measured_slowdown": measured,
                              "roofline_slowdown": predicted, "roofline_ms": 1e3 * cost.time(n=k, batch=batch, kv_len=kv),
                              "mode": mode})
                print(f"{k:>4}  {ms:>9.3f}  {measured:>8.3f}  {predicted:>8.3f}  {mode}")
    if skipped:
        print(f"\n{skipped} cells skipped: the --budget-s of {args.budget_s:g} s ran out")
    print(f"\ntotal {time.monotonic() - t_start:.1f} s")
    if args.json:
        from unmask.eval.env import fingerprint
        from unmask.fileio import atomic_write_json

        atomic_write_json(args.json, {"cells": cells, "skipped": skipped, "reps": reps, "warmup": warmup,
                                      "gpu_spec": dataclasses.asdict(cost.gpu),
                                      "env": fingerprint(device=str(device), dtype=str(dtype), batch_size=None)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
