"""Issue 48 item 16: how a signal ends `train` — 143 for SIGTERM as everywhere else, and never a
silent exit 0 when Ctrl-C lands after the last step but before the model is published."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ids_file

SRC = Path(__file__).resolve().parents[1] / "src"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")

# Runs `unmask ARGV` like the console script, announcing "PAUSE" on stdout at one moment of the
# training loop and waiting there until the test has sent its signal (and created `go`):
# mid-run: in the first step of two; last-step: in the only step (the stop request is then seen
# by the loop's last all-reduce but no step follows); after-loop: after the last step, during the
# final checks, before the model is published.
_PAUSED_TRAIN = r"""
import json, os, sys, time
moment, argv = sys.argv[1], json.loads(sys.argv[2])

def pause():
    print("PAUSE", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists("go") and time.monotonic() < deadline:
        time.sleep(0.01)

if moment in ("mid-run", "last-step"):
    import unmask.train.parallel as parallel
    no_sync, calls = parallel.no_sync, []
    def paused_no_sync(*a, **k):
        if not calls:
            pause()
        calls.append(1)
        return no_sync(*a, **k)
    parallel.no_sync = paused_no_sync
if moment == "after-loop":
    import unmask.train.loop as loop
    exploded = loop.exploded
    def paused_exploded(*a, **k):
        pause()
        return exploded(*a, **k)
    loop.exploded = paused_exploded
from unmask.entry import main
main(argv)
"""


def _train_argv(tmp_path: Path, steps: int, *extra: str) -> list[str]:
    corpus = ids_file(tmp_path / "c.jsonl")
    return ["train", "sbd", "--base", "stories260K", "--data", str(corpus), "--out", str(tmp_path / "m"),
            "--steps", str(steps), "--seq-len", "16", "--batch-size", "1", "--warmup", "0", "--eval-every", "0",
            "--ckpt-every", "0", "--no-progress", *extra]


def _run(tmp_path: Path, moment: str, argv: list[str], sig: int | None) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_TRAIN, moment, json.dumps(argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        for line in proc.stdout:
            if line.strip() == "PAUSE":
                if sig is not None:
                    proc.send_signal(sig)
                (tmp_path / "go").touch()
                break
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    (tmp_path / "go").unlink(missing_ok=True)
    return proc.returncode, err


def _published(tmp_path: Path) -> bool:
    return (tmp_path / "m" / "unmask_config.json").is_file() or (tmp_path / "m" / "config.json").is_file()


@linux_only
@pytest.mark.parametrize(("moment", "sig", "code"), [
    ("mid-run", signal.SIGINT, 130), ("mid-run", signal.SIGTERM, 143),
    ("last-step", signal.SIGINT, 130), ("after-loop", signal.SIGINT, 130), ("after-loop", signal.SIGTERM, 143)])
def test_a_signal_before_the_model_is_published_stops_the_run(tmp_path, moment, sig, code):
    """Exit 130 (SIGINT) or 143 (SIGTERM), one line that names the way on, no model published —
    wherever in the run the signal lands, the last step and the final checks included (before: a
    SIGTERM gave 130, and a Ctrl-C there was swallowed: the model was published with exit 0 and
    no warning)."""
    code_, err = _run(tmp_path, moment, _train_argv(tmp_path, 2 if moment == "mid-run" else 1), sig)
    assert code_ == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not _published(tmp_path), err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == "interrupted" or (last.startswith("interrupted at step ") and last.endswith("rerun with --resume")), err


@linux_only
def test_a_run_stopped_at_its_last_step_resumes_to_publish(tmp_path):
    code, err = _run(tmp_path, "last-step", _train_argv(tmp_path, 1), signal.SIGINT)
    assert code == 130 and not _published(tmp_path), err[-3000:]
    code, err = _run(tmp_path, "none", _train_argv(tmp_path, 1, "--resume"), None)
    assert code == 0 and _published(tmp_path), err[-3000:]


def test_a_signal_after_the_last_look_is_not_lost():
    """The loop's stop flag re-delivers a signal that came after the loop last read the flag (the
    window between the final checks and leaving the block), to the caller's handler."""
    from unmask.train.loop import _StopFlag

    with pytest.raises(KeyboardInterrupt):
        with _StopFlag() as stop:
            assert not stop.take()
            signal.raise_signal(signal.SIGINT)  # lands after the last look
            assert stop.set and stop.signum == signal.SIGINT
    seen = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with _StopFlag() as stop:
            signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGTERM]
        with _StopFlag() as stop:  # a request the loop acted on is not delivered again
            signal.raise_signal(signal.SIGTERM)
            assert stop.take()
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


# Under torchrun each rank runs this: `unmask ARGV` as the console script does, recording the
# status the process ends with (entry ends an interrupted command with os._exit).
_RECORDED_RANK = r"""
import json, os, sys
rank, real_exit = os.environ["RANK"], os._exit
def record(code):
    with open(f"rank{rank}.rc", "w") as f:
        f.write(str(code))
def recording_exit(code):
    record(code)
    real_exit(code)
os._exit = recording_exit
from unmask.entry import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    record(e.code if isinstance(e.code, int) else 1)
    raise
record(0)
"""


@linux_only
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_torchrun_ends_every_rank_with_130_or_143(tmp_path, sig, code):
    """docs/scaling.md: torchrun forwards the signal to every process; they save one checkpoint
    together and each exits 130 (143 for SIGTERM; before, 130 for both). torchrun itself then ends
    with its own SignalException traceback and status 1 (torch's launcher, not ours), which the
    docs say."""
    import shutil
    import time

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    if not Path(torchrun).is_file():
        pytest.skip("torchrun not installed")
    (tmp_path / "rank.py").write_text(_RECORDED_RANK)
    argv = _train_argv(tmp_path, 100_000)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([torchrun, "--nproc-per-node", "2", "rank.py", *argv], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log, deadline = tmp_path / "m.run" / "log.jsonl", time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not (log.is_file() and log.read_text()):
            time.sleep(0.2)  # the first step logged: both ranks are in the training loop
        assert log.is_file(), proc.communicate(timeout=60)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0, err[-3000:]
    assert [(tmp_path / f"rank{r}.rc").read_text() for r in (0, 1)] == [str(code)] * 2, err[-3000:]
    assert "interrupted at step " in err and "rerun with --resume" in err, err[-3000:]
    assert len(list((tmp_path / "m.run" / "checkpoints").iterdir())) == 1
    assert not _published(tmp_path)
