"""End-to-end decode speed of AR, lossless SBD and multiblock, eager and compiled, next to the roofline.

Runs the decoders themselves (``DECODERS[name].decode`` of ``ar``, lossless ``sbd`` and ``multiblock``) on one CUDA
GPU with a random-weight model of the Llama-3.1-8B shape in bf16 (built on the device with
weight initialisation skipped, by ``benchmarks/gpu_forward_cost.py``'s ``build_model``; no
download). Greedy decoding of ``--batch`` rows of ``--prompt-len`` random prompt ids, exactly
``--max-new-tokens`` new tokens per row (no stop tokens). Each decoder runs eagerly and, where a
compiled path exists, with ``compile=True`` (``unmask.decode.engine.static`` / ``unmask.decode.engine.kv``: a
StaticCache and a ``torch.compile``-d step, ``mode="reduce-overhead"`` on CUDA); multiblock's
Block Buffer runs on the same static cache.

Random weights. Drafts are accepted only by chance, so the tokens per forward (TPF) are what
these weights gave, not what a trained SBD or block-diffusion model gives: the TPS ratios show
each decoder's per-step cost at the TPF measured here. The "same as AR" column compares each
run's tokens with eager AR's: compiled AR must match it (compiled == eager), lossless SBD
matches it up to bf16 near-ties between the Q-token and the 1-token forward; multiblock is lossy.

Columns, per decoder × {eager, compiled}:

- ``Q``: query tokens per row per step forward (AR 1; linear lossless SBD 2K; multiblock
  slots × block).
- ``NFE``: batch forwards of the run (AR counts its prefill, SBD and multiblock do not);
  ``TPF``: generated tokens / per-row forwards.
- ``ms/step``: wall-clock of the whole decode (prefill, host bookkeeping and the final copy to
  the host included) / NFE, in milliseconds; the median of ``--reps`` runs after one untimed
  warm-up run with the same shapes (the compile happens there).
- ``TPS``: generated tokens of the batch per second of that run; ``ratio``: TPS / TPS of
  compiled AR (eager AR with ``--no-compile``).
- ``roofline ms``: :mod:`unmask.bench.roofline`, corrected mode, predicted time of one Q-token
  forward of the batch with logits for every query, over ``prompt-len + max-new-tokens / 2``
  cached keys (the mean context), on an H200 at BF16 peak with bf16 weights, KV cache and
  activations (``gpu_forward_cost.H200_BF16``); ``roof ratio``: the TPS ratio it predicts at the
  measured TPF, (TPF / TPF_AR) · (t_AR(1) / t(Q)).

A ``--budget-s`` deadline (default 480 s) skips the remaining runs rather than overrun. A run
that raises is reported as failed and the others still run.

    python benchmarks/gpu_decode.py [--batch 1] [--max-new-tokens 256] [--json out.json]
    python benchmarks/gpu_decode.py --tiny      # CPU smoke test with a tiny fp32 shape

Without a CUDA device and without ``--tiny`` it refuses with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from unmask.bench.roofline import ModelShape, Precision, roofline
from unmask.decode import DECODERS
from unmask.models.bundle import ModelBundle
from unmask.sampling import Sampling

REFUSAL = ("gpu_decode needs a CUDA GPU and none is visible; run it on an H200, "
           "or pass --tiny for the CPU smoke test")
# (decoder, compiled) in run order: compiled AR first, the baseline of every ratio
RUNS = (("ar", True), ("ar", False), ("sbd", True), ("sbd", False), ("multiblock", True), ("multiblock", False))
DEFAULTS = dict(batch=1, prompt_len=128, max_new_tokens=256, block_size=8, mb_block_size=32, mb_slots=2, reps=3)
TINY_DEFAULTS = dict(batch=1, prompt_len=12, max_new_tokens=24, block_size=4, mb_block_size=4, mb_slots=2, reps=1)


def _forward_cost_module():
    """benchmarks/gpu_forward_cost.py, imported by path (benchmarks/ is not a package)."""
    path = Path(__file__).resolve().with_name("gpu_forward_cost.py")
    spec = importlib.util.spec_from_file_location("gpu_forward_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gfc = _forward_cost_module()


def build_bundles(shape: dict, *, device: torch.device, dtype: torch.dtype, mb_block_size: int) -> dict:
    """One random ``LlamaForCausalLM`` of ``shape`` shared by three ModelBundles: ``ar`` (kind
    causal), ``sbd`` (kind sbd) and ``multiblock`` (kind block-diffusion, block ``mb_block_size``).

    The mask token is the last vocabulary id (a random embedding row) in all three, so every
    decoder suppresses the same id and greedy AR and lossless SBD decode the same sequence.
    RMSNorm weights are reset to 1 (as transformers initialises them); the other weights are
    ``build_model``'s N(0, 0.02). No tokenizer (the decoders take ids) and no stop tokens.
    """
    model = gfc.build_model(shape, device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
    mask_id = shape["vocab_size"] - 1

    def bundle(kind: str, block_size: int | None = None) -> ModelBundle:
        return ModelBundle(model=model, tokenizer=None, kind=kind, name=f"random-{kind}", bos_token_id=1,
                           pad_token_id=0, mask_token_id=mask_id, block_size=block_size)

    return {"ar": bundle("causal"), "sbd": bundle("sbd"), "multiblock": bundle("block-diffusion", mb_block_size)}


def random_prompts(batch: int, length: int, vocab: int, *, seed: int = 0) -> list[list[int]]:
    """``batch`` rows of ``length`` ids drawn uniformly from [3, vocab - 1) (no special ids, no mask)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 1, (batch, length), generator=gen).tolist()


def decode_fn(name: str, bundle: ModelBundle, prompts: list[list[int]], *, compiled: bool, max_new_tokens: int,
              block_size: int, mb_slots: int):
    """A no-argument callable running one greedy decode of ``prompts`` with decoder ``name``."""
    if name == "ar":
        return lambda: DECODERS["ar"].decode(bundle, prompts, max_new_tokens=max_new_tokens, sampling=Sampling(),
                                 compile=compiled)
    if name == "sbd":
        return lambda: DECODERS["sbd"].decode(bundle, prompts, max_new_tokens=max_new_tokens, verify=True,
                                              block_size=block_size, draft="linear", compile=compiled)
    return lambda: DECODERS["multiblock"].decode(bundle, prompts, max_new_tokens=max_new_tokens, slots=mb_slots, compile=compiled)


def queries(name: str, *, block_size: int, mb_block_size: int, mb_slots: int) -> int:
    """Query tokens per row of one step forward: AR 1, linear lossless SBD 2K, multiblock slots × block."""
    return {"ar": 1, "sbd": 2 * block_size, "multiblock": mb_slots * mb_block_size}[name]


def timed_run(fn, device: torch.device, *, reps: int) -> tuple[float, object]:
    """Median milliseconds of ``reps`` calls of ``fn`` after one untimed warm-up call, and the
    last call's output. CUDA-event times on a GPU, perf_counter on the CPU."""
    timer = gfc.Timer(device)
    out = [fn()]  # warm-up: compiles the step, records CUDA graphs, fills allocator caches
    times = [timer(lambda: out.append(fn())) for _ in range(reps)]
    return statistics.median(times), out[-1]


def run(*, tiny: bool = False, batch: int, prompt_len: int, max_new_tokens: int, block_size: int,
        mb_block_size: int, mb_slots: int, reps: int, compile: bool = True, budget_s: float = 480.0,
        log=print) -> dict:
    """Run every decoder × mode of RUNS and return the results (what ``--json`` writes).

    Returns {"setup", "rows", "skipped", "gpu_spec", "total_s"}: one row per run that started,
    with decoder, mode ("eager" | "compiled"), Q, nfe, tpf, ms_per_step (ms), tps (tokens/s),
    tps_ratio, roofline_ms, roofline_ratio, same_as_ar (its tokens equal eager AR's; None when
    either run failed or was skipped), seconds (the median run, s), baseline (the run the ratios
    divide by, e.g. "ar compiled"; None without an AR run) and error (None, or the exception's
    first line when the run raised); "skipped" names the runs the budget left out.
    """
    t_start = time.monotonic()
    if tiny:
        shape, device, dtype, precision = gfc.TINY, torch.device("cpu"), torch.float32, Precision(4, 4, 4)
    else:
        shape, device, dtype, precision = gfc.LLAMA_8B, torch.device("cuda"), torch.bfloat16, Precision(2, 2, 2)
    bundles = build_bundles(shape, device=device, dtype=dtype, mb_block_size=mb_block_size)
    prompts = random_prompts(batch, prompt_len, shape["vocab_size"])
    cost = roofline(mode="corrected", shape=ModelShape.from_config(shape, name="tiny" if tiny else "llama-3.1-8b"),
                    gpu=gfc.H200_BF16, precision=precision)
    kv_mean = prompt_len + max_new_tokens // 2
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    setup = {"shape": "tiny" if tiny else "llama-3.1-8b", "dtype": str(dtype).removeprefix("torch."), "device": hw,
             "batch": batch, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens, "block_size": block_size,
             "draft": "linear", "mb_block_size": mb_block_size, "mb_slots": mb_slots, "reps": reps,
             "roofline_kv_len": kv_mean, "build_s": time.monotonic() - t_start}
    log(f"{setup['shape']} shape, random weights, {setup['dtype']} on {hw}; built in {setup['build_s']:.1f} s; "
        f"batch {batch}, prompt {prompt_len}, {max_new_tokens} new tokens (greedy, no stops), median of {reps} "
        "after 1 warm-up")
    log(f"lossless SBD: linear drafts, K = {block_size}; multiblock: block {mb_block_size}, {mb_slots} slots")
    log(f"roofline: corrected mode, {cost.gpu.name}, {precision.weight:g}/{precision.kv:g}/{precision.act:g} bytes "
        f"(weights/KV/activations), logits for every query, {kv_mean} cached keys")
    log("random weights: drafts are accepted by chance only; TPS ratios show per-step cost at the TPF measured here")

    rows, skipped, tokens = [], [], {}
    for name, compiled in RUNS:
        mode = "compiled" if compiled else "eager"
        if compiled and not compile:
            continue
        if time.monotonic() - t_start > budget_s:
            skipped.append(f"{name} {mode}")
            continue
        Q = queries(name, block_size=block_size, mb_block_size=mb_block_size, mb_slots=mb_slots)
        row = {"decoder": name, "mode": mode, "Q": Q, "nfe": None, "tpf": None, "ms_per_step": None, "tps": None,
               "tps_ratio": None, "roofline_ms": 1e3 * cost.time(n=Q, batch=batch, kv_len=kv_mean),
               "roofline_ratio": None, "same_as_ar": None, "seconds": None, "error": None}
        rows.append(row)
        fn = decode_fn(name, bundles[name], prompts, compiled=compiled, max_new_tokens=max_new_tokens,
                       block_size=block_size, mb_slots=mb_slots)
        try:
            ms, out = timed_run(fn, device, reps=reps)
        except Exception as e:  # noqa: BLE001 - one failed run (e.g. a compile error) must not lose the others
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            row["error"] = f"{type(e).__name__}: {first}"
            continue
        st = out.stats
        row.update(nfe=st.nfe, tpf=st.tpf, ms_per_step=ms / max(1, st.nfe), tps=1e3 * st.generated / ms,
                   seconds=ms / 1e3)
        tokens[name, mode] = out.tokens
    reference = tokens.get(("ar", "eager"))  # compiled AR runs first, so compare once all have run
    for row in rows:
        mine = tokens.get((row["decoder"], row["mode"]))
        row["same_as_ar"] = None if reference is None or mine is None else mine == reference
    _ratios(rows, cost, batch=batch, kv_len=kv_mean)
    return {"setup": setup, "rows": rows, "skipped": skipped, "gpu_spec": dataclasses.asdict(cost.gpu),
            "total_s": time.monotonic() - t_start}


def _ratios(rows: list[dict], cost, *, batch: int, kv_len: int) -> None:
    """Fill tps_ratio (measured TPS / baseline TPS) and roofline_ratio ((TPF / TPF_base) ·
    (t_base / t(Q)), the roofline's TPS ratio at the measured TPF) in place. Baseline: compiled AR,
    else eager AR."""
    for r in rows:
        r["baseline"] = None
    ok = [r for r in rows if r["error"] is None]
    base = next((r for r in ok if r["decoder"] == "ar" and r["mode"] == "compiled"), None)
    base = base or next((r for r in ok if r["decoder"] == "ar"), None)
    if base is None:
        return
    t_base = cost.time(n=1, batch=batch, kv_len=kv_len)
    for r in ok:
        r["tps_ratio"] = r["tps"] / base["tps"]
        r["roofline_ratio"] = (r["tpf"] / base["tpf"]) * t_base / cost.time(n=r["Q"], batch=batch, kv_len=kv_len)
    for r in rows:
        r["baseline"] = f"{base['decoder']} {base['mode']}"


def format_table(rows: list[dict]) -> str:
    """The results as a fixed-width text table, one line per run."""
    head = (f"{'decoder':<10} {'mode':<8} {'Q':>4} {'NFE':>6} {'TPF':>6} {'ms/step':>9} {'TPS':>9} {'ratio':>6} "
            f"{'roofline ms':>11} {'roof ratio':>10}  same as AR")
    lines = [head]
    for r in rows:
        if r["error"] is not None:
            lines.append(f"{r['decoder']:<10} {r['mode']:<8} {r['Q']:>4}  failed: {r['error']}")
            continue
        ratio = "-" if r["tps_ratio"] is None else f"{r['tps_ratio']:.2f}"
        roof = "-" if r["roofline_ratio"] is None else f"{r['roofline_ratio']:.2f}"
        same = {None: "-", True: "yes", False: "no"}[r["same_as_ar"]]
        lines.append(f"{r['decoder']:<10} {r['mode']:<8} {r['Q']:>4} {r['nfe']:>6} {r['tpf']:>6.2f} "
                     f"{r['ms_per_step']:>9.3f} {r['tps']:>9.1f} {ratio:>6} {r['roofline_ms']:>11.4g} {roof:>10}  "
                     f"{same}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 shape on the CPU (smoke test)")
    ap.add_argument("--batch", type=int, default=None, help="rows decoded together (default 1)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt ids per row (default 128; tiny 12)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per row (default 256; tiny 24)")
    ap.add_argument("--block-size", type=int, default=None, help="lossless SBD draft block K (default 8; tiny 4)")
    ap.add_argument("--mb-block-size", type=int, default=None, help="multiblock block size (default 32; tiny 4)")
    ap.add_argument("--mb-slots", type=int, default=None, help="multiblock buffer slots N_buf (default 2)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per decoder and mode (default 3; tiny 1)")
    ap.add_argument("--no-compile", action="store_true", help="eager runs only (the ratio baseline is eager AR)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip the remaining runs after this many seconds")
    ap.add_argument("--json", default=None, help="write the results as JSON to FILE")
    args = ap.parse_args(argv)

    if not args.tiny and not torch.cuda.is_available():
        print(f"error: {REFUSAL}", file=sys.stderr)
        return 2
    opts = dict(TINY_DEFAULTS if args.tiny else DEFAULTS)
    opts.update({k: v for k, v in vars(args).items() if k in opts and v is not None})
    res = run(tiny=args.tiny, compile=not args.no_compile, budget_s=args.budget_s, **opts)
    base = res["rows"][0]["baseline"] if res["rows"] else None
    print(f"\nTPS ratio and roofline ratio vs {base or 'nothing (no AR run completed)'}")
    print(format_table(res["rows"]))
    if res["skipped"]:
        print(f"\nskipped (the --budget-s of {args.budget_s:g} s ran out): {', '.join(res['skipped'])}")
    print(f"\ntotal {res['total_s']:.1f} s")
    if args.json:
        from unmask.eval.env import fingerprint
        from unmask.fileio import atomic_write_json

        device = "cpu" if args.tiny else "cuda"
        atomic_write_json(args.json, {**res, "env": fingerprint(device=device, dtype=res["setup"]["dtype"],
                                                                batch_size=res["setup"]["batch"])})
    return 1 if any(r["error"] is not None for r in res["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
