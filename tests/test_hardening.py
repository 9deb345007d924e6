"""Regression tests for issue 14 (interrupts, the sandbox verdict, non-finite training, model
kinds, data loss, concurrent writers, tracebacks and late refusals), one or more per item, all
in-process. The reproductions that need real processes, signals or a full disk live in
test_faults.py."""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

import pytest
import torch
from conftest import SMALL_RUN, STORIES_DIR, ids_file, one_line_error, run_cli

import unmask
from unmask.errors import UnmaskError

BIN, TOK = STORIES_DIR / "stories260K.bin", STORIES_DIR / "tok512.bin"
needs_stories_bin = pytest.mark.skipif(not BIN.is_file(), reason=f"{BIN} not found; set UNMASK_DATA_DIR")


def _forbid(monkeypatch, target: str, what: str) -> None:
    """Make ``target`` fail the test when called: the refusal must come before it."""

    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran before the refusal")

    monkeypatch.setattr(target, fail)


# --- 1. Ctrl-C ---------------------------------------------------------------------------------


def test_ctrl_c_during_generate_exits_130_and_writes_no_trace(capsys, monkeypatch, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("unmask.api.generate", interrupted)
    trace = tmp_path / "t.json"
    code, out, err = run_cli(capsys, "generate", "Once", "-m", "stories260K-sbd", "--trace", trace)
    assert (code, err) == (130, "interrupted\n") and out == ""
    assert not trace.exists()


def test_ctrl_c_during_data_stories_exits_130_and_leaves_nothing(capsys, monkeypatch, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("unmask.train.data.generate_stories", interrupted)
    out = tmp_path / "corpus.jsonl"
    code, _, err = run_cli(capsys, "data", "stories", "--out", out, "--sampled", 2, "--greedy", 0)
    assert (code, err) == (130, "interrupted\n")
    assert sorted(os.listdir(tmp_path)) == []  # no corpus, no lock file


def test_other_returned_exit_codes_are_kept(capsys, monkeypatch):
    from unmask import cli

    monkeypatch.setattr(cli, "app", lambda **kw: 3)
    assert run_cli(capsys, "models")[0] == 3


def test_import_unmask_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, unmask, unmask.entry; assert 'torch' not in sys.modules; print(unmask.UnmaskError.__name__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(unmask.__file__).parents[1])})
    assert r.returncode == 0 and r.stdout.strip() == "UnmaskError", r.stderr


# --- 2. Sandbox verdicts -----------------------------------------------------------------------


@pytest.mark.parametrize("escape", [
    "import sys; sys.exit(0)",
    "raise SystemExit(0)",
    "import os; os._exit(0)",
    "import atexit, os; atexit.register(os._exit, 0)",
    "import os; os.execv('/bin/true', ['true'])",
    "import threading, os, time; threading.Thread(target=lambda: os._exit(0)).start(); time.sleep(5)",
])
def test_an_early_exit_with_status_0_is_not_a_pass(escape):
    from unmask.eval.code_tasks import pass_at_1

    program = f"def add(a, b):\n    return a - b\n{escape}\n\ndef check(f):\n    assert f(1, 2) == 3\n\ncheck(add)\n"
    result = pass_at_1(programs=[program], timeout_s=5)
    assert result.pass_at_1 == 0.0 and result.results[0].status == "failed", result.results[0]
    assert pass_at_1(programs=[program.replace(escape, "pass").replace("a - b", "a + b")]).pass_at_1 == 1.0


# --- 4. Non-finite training and decoding -------------------------------------------------------


@pytest.mark.parametrize("flag", ["--lr", "--weight-decay", "--clip"])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_non_finite_hyperparameters_are_refused(capsys, monkeypatch, tmp_path, flag, value):
    _forbid(monkeypatch, "unmask.train.sbd._load_base", "loading the base")
    data = ids_file(tmp_path / "d.jsonl")
    one_line_error(capsys, "train", "sbd", "--data", data, "--out", tmp_path / "m", flag, value, match="finite")


def test_divergence_stops_training_and_publishes_nothing(tmp_path, monkeypatch):
    from unmask.train import config
    from unmask.train.sbd import train_sbd

    monkeypatch.setattr(config, "MAX_LR", math.inf)  # lr 1e30 is refused up front now; here it must diverge
    out = tmp_path / "m"
    with pytest.raises(UnmaskError, match="diverged"):
        train_sbd(base="stories260K", data=ids_file(tmp_path / "d.jsonl"), out=out, **{**SMALL_RUN, "lr": 1e30})
    assert not out.exists()
    for ckpt in (tmp_path / "m.run" / "checkpoints").glob("step-*"):  # any checkpoint kept holds finite weights
        from safetensors.torch import load_file

        assert all(torch.isfinite(t).all() for t in load_file(ckpt / "model.safetensors").values())


def test_decoding_refuses_non_finite_weights(tiny_llama, tiny_bundle):
    model = tiny_llama()
    bundle = tiny_bundle(model)
    unmask.generate("1 2 3", bundle, "ar", max_new_tokens=2)  # finite: fine
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(UnmaskError, match="non-finite weights"):
        unmask.generate("1 2 3", bundle, "ar", max_new_tokens=2)


# --- 5. Model kinds ----------------------------------------------------------------------------


def test_data_stories_refuses_a_masked_diffusion_model(capsys, tmp_path):
    out = tmp_path / "c.jsonl"
    one_line_error(capsys, "data", "stories", "--model", "stories260K-dlm", "--out", out, "--sampled", 2,
                   "--greedy", 0, match="masked-diffusion model")
    assert not out.exists()


def test_kind_cannot_override_a_recorded_kind(capsys):
    with pytest.raises(UnmaskError, match="cannot override"):
        unmask.load("stories260K-sbd", kind="causal")
    one_line_error(capsys, "generate", "Once", "-m", "stories260K-dlm", "--kind", "causal", match="cannot override")


# --- 6. Data loss ------------------------------------------------------------------------------


@pytest.mark.parametrize("inside", [False, True])
def test_run_dir_inside_out_is_refused(capsys, monkeypatch, tmp_path, inside):
    _forbid(monkeypatch, "unmask.train.sbd._load_base", "loading the base")
    out = tmp_path / "m"
    run_dir = out / "run" if inside else out
    one_line_error(capsys, "train", "sbd", "--data", ids_file(tmp_path / "d.jsonl"), "--out", out, "--run-dir",
                   run_dir, match="inside --out")
    assert not out.exists()


def _fake_checkpoint(run_dir: Path) -> Path:
    ckpt = run_dir / "checkpoints" / "step-00000007"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.pt").write_bytes(b"kept")
    return ckpt


@pytest.mark.parametrize("bad", [["--base", "no-such-model"], ["--seq-len", "100000"], ["--steps", "0"]])
def test_overwrite_keeps_the_old_run_until_everything_is_validated(capsys, tmp_path, bad):
    out = tmp_path / "m"
    ckpt = _fake_checkpoint(tmp_path / "m.run")
    one_line_error(capsys, "train", "sbd", "--data", ids_file(tmp_path / "d.jsonl"), "--out", out, "--overwrite",
                   *bad)
    assert (ckpt / "trainer_state.pt").read_bytes() == b"kept"


def test_a_crash_while_saving_a_router_keeps_the_previous_one(monkeypatch, tmp_path):
    from unmask.routers import io
    from unmask.routers.lps import LPSConfig, LPSRouter

    torch.manual_seed(0)
    old, new = LPSRouter(LPSConfig()), LPSRouter(LPSConfig())
    io.save_router(old, tmp_path, meta={"tau_psi": 0.5})

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies between writing the weights and the JSON

    monkeypatch.setattr(io, "atomic_write_json", crash)
    with pytest.raises(KeyboardInterrupt):
        io.save_router(new, tmp_path, meta={"tau_psi": 0.9})
    router, info = io.load_router(tmp_path, "lps")
    assert info["tau_psi"] == 0.5
    assert all(torch.equal(a, b) for a, b in zip(router.state_dict().values(), old.state_dict().values()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lps.json", "lps.safetensors"]  # no staging left


def test_publish_dir_swaps_in_one_step(monkeypatch, tmp_path):
    from unmask import fileio

    dst, src = tmp_path / "out", tmp_path / "new"
    dst.mkdir()
    (dst / "old").write_text("o")
    src.mkdir()
    (src / "new").write_text("n")
    monkeypatch.setattr(fileio.os, "replace", lambda *a: pytest.fail("two renames instead of one swap"))
    fileio.publish_dir(src, dst)
    assert [p.name for p in dst.iterdir()] == ["new"] and not src.exists()


def test_outputs_are_not_replaced_without_overwrite(capsys, monkeypatch, tmp_path):
    _forbid(monkeypatch, "unmask.models.load", "loading the model")
    _forbid(monkeypatch, "unmask.eval.runner.evaluate", "the evaluation")
    _forbid(monkeypatch, "unmask.eval.sweep.sweep", "the sweep")
    existing = tmp_path / "x.json"
    existing.write_text("precious")
    png = tmp_path / "x.png"
    png.write_text("precious")
    one_line_error(capsys, "generate", "Once", "--trace", existing, match="already exists")
    one_line_error(capsys, "eval", "--task", "stories", "-o", existing, match="already exists")
    one_line_error(capsys, "sweep", "--task", "stories", "--param", "gamma", "--values", "0,1", "-o", existing,
                   match="already exists")
    one_line_error(capsys, "sweep", "--task", "stories", "--param", "gamma", "--values", "0,1", "--out-png",
                   tmp_path / "x", match="already exists")
    one_line_error(capsys, "roofline", "--png", png, match="already exists")
    assert existing.read_text() == png.read_text() == "precious"
    pytest.importorskip("matplotlib")
    code, out, _ = run_cli(capsys, "roofline", "--png", png, "--overwrite")
    assert code == 0 and png.read_bytes().startswith(b"\x89PNG")


# --- 7. Concurrent writers ---------------------------------------------------------------------


def test_a_second_writer_of_the_same_output_is_refused(capsys, monkeypatch, tmp_path):
    from unmask.fileio import output_lock

    _forbid(monkeypatch, "unmask.train.sbd._load_base", "loading the base")
    out = tmp_path / "m"
    data = ids_file(tmp_path / "d.jsonl")
    with output_lock(out):
        one_line_error(capsys, "train", "sbd", "--data", data, "--out", out, match="another unmask process")
        one_line_error(capsys, "data", "stories", "--out", out, match="another unmask process")
    with output_lock(tmp_path / "m.run"):  # the run directory is locked too
        one_line_error(capsys, "train", "sbd", "--data", data, "--out", out, match="another unmask process")
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]  # locks released and removed


def test_output_lock_is_released_on_error_and_reusable(tmp_path):
    from unmask.fileio import output_lock

    with pytest.raises(RuntimeError):
        with output_lock(tmp_path / "o"):
            raise RuntimeError
    with output_lock(tmp_path / "o"):
        with pytest.raises(UnmaskError, match="another unmask process"):
            with output_lock(tmp_path / "o"):
                pass


# --- 8. Tracebacks turned into one-line errors ---------------------------------------------------


@pytest.mark.parametrize("t", ["1e-320", "1e-45", "1e308"])
def test_extreme_temperatures_are_one_line_errors(capsys, t):
    one_line_error(capsys, "generate", "Once", "-m", "stories260K", "-d", "ar", "-n", "4", "-t", t, match="temperature")
    with pytest.raises(UnmaskError, match="temperature"):
        unmask.Sampling(temperature=float(t))


def test_top_p_below_float32_range_keeps_the_top_token():
    from unmask.policies import EntropyBound, commit
    from unmask.sampling import filter_logits

    logits = torch.tensor([[[0.0, 3.0, 1.0, -2.0]]])  # (B=1, N=1, V=4)
    _, tokens = commit(logits, torch.ones(1, 1, dtype=torch.bool), EntropyBound(gamma=0.1), temperature=1.0,
                       top_p=1e-320, generator=torch.Generator().manual_seed(0))
    assert tokens.tolist() == [[1]]
    assert torch.isfinite(filter_logits(logits, top_p=1e-320)).sum() == 1


@needs_stories_bin
def test_llama2c_header_with_odd_head_size_is_one_line_error(capsys, tmp_path):
    from unmask.models.llama2c import Llama2cHeader

    header = Llama2cHeader(dim=6, hidden_dim=8, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=512, seq_len=4)
    bad = tmp_path / "odd.bin"
    fields = (header.dim, header.hidden_dim, header.n_layers, header.n_heads, header.n_kv_heads, header.vocab_size,
              header.seq_len)
    bad.write_bytes(struct.pack("<7i", *fields) + bytes(4 * header.n_floats()))
    one_line_error(capsys, "convert", "llama2c", bad, TOK, tmp_path / "out", "--no-verify", match="odd head size")


def test_garbage_traces_file_is_one_line_error(tmp_path):
    from unmask.train.lps_fit import LPSTraces

    for content in (b"garbage", b""):
        bad = tmp_path / "t.pt"
        bad.write_bytes(content)
        with pytest.raises(UnmaskError, match="not an LPS traces file"):
            LPSTraces.load(bad)
    torch.save({"features": [1]}, tmp_path / "other.pt")
    with pytest.raises(UnmaskError, match="not an LPS traces file"):
        LPSTraces.load(tmp_path / "other.pt")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished three-step SBD run on stories260K: (out, run_dir)."""
    from unmask.train.sbd import train_sbd

    root = tmp_path_factory.mktemp("run")
    result = train_sbd(base="stories260K", data=ids_file(root / "d.jsonl"), out=root / "m", **SMALL_RUN)
    return result.out, root / "m.run"


def _resume_copy(trained_run, tmp_path) -> tuple[Path, Path]:
    import shutil

    out, run_dir = trained_run
    shutil.copytree(run_dir, tmp_path / "m.run")
    shutil.copy(out.parent / "d.jsonl", tmp_path / "d.jsonl")
    return tmp_path / "m.run", next((tmp_path / "m.run" / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("damage", ["truncated weights", "garbage state", "empty state", "foreign state"])
def test_resume_from_a_damaged_checkpoint_is_one_line_error(capsys, trained_run, tmp_path, damage):
    run_dir, ckpt = _resume_copy(trained_run, tmp_path)
    if damage == "truncated weights":  # the HF export and the distributed checkpoint it resumes from
        for w in (ckpt / "model.safetensors", *(ckpt / "dcp").glob("*.distcp")):
            w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif damage == "foreign state":
        torch.save({"hello": 1}, ckpt / "trainer_state.pt")
    else:
        (ckpt / "trainer_state.pt").write_bytes(b"" if damage == "empty state" else b"\x80garbage")
    one_line_error(capsys, "train", "sbd", "--data", tmp_path / "d.jsonl", "--out", tmp_path / "m", "--resume",
                   "--seq-len", 32, "--steps", 4, "--batch-size", 2, "--warmup", 1, "--ckpt-every", 2,
                   "--eval-every", 0, match=str(ckpt))


@pytest.mark.parametrize("error", ["torch", "safetensors", "oserror"])
def test_full_disk_while_checkpointing_is_one_line_error(monkeypatch, tiny_llama, tmp_path, error):
    from safetensors import SafetensorError

    from unmask.train import checkpoint

    model = tiny_llama()
    first = checkpoint.save_checkpoint(tmp_path, 1, model, {"step": 1})
    exc = {"torch": RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing "
                                 "file data/0: file write failed"),
           "safetensors": SafetensorError("Error while serializing: IoError(No space left on device)"),
           "oserror": OSError(28, "No space left on device")}[error]

    def full(*args, **kwargs):
        raise exc

    if error == "safetensors":
        monkeypatch.setattr(checkpoint, "save_model", full)
    else:
        monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(UnmaskError, match="cannot write checkpoint") as e:
        checkpoint.save_checkpoint(tmp_path, 2, model, {"step": 2})
    assert "\n" not in str(e.value)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [first.name]  # no staging left, old kept


def test_checkpoints_have_published_permissions(trained_run):
    out, run_dir = trained_run
    for root in (out, *(run_dir / "checkpoints").glob("step-*")):
        assert stat.S_IMODE(root.stat().st_mode) == 0o755
        files = [f for f in root.rglob("*") if f.is_file()]
        assert files and {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o644}
        assert {stat.S_IMODE(d.stat().st_mode) for d in root.rglob("*") if d.is_dir()} <= {0o755}


def test_load_with_device_none_uses_the_cpu():
    assert unmask.load("stories260K", device=None).device.type == "cpu"
    with pytest.raises(UnmaskError, match="device"):
        unmask.load("stories260K", device=3.5)


def test_prompts_that_are_not_valid_unicode_are_refused(stories):
    with pytest.raises(UnmaskError, match="not valid Unicode"):
        unmask.generate(["Once", "bad \ud800 text"], stories, "ar", max_new_tokens=2)


# --- 9. Late refusals --------------------------------------------------------------------------


def test_eval_workers_and_unwritable_out_are_refused_before_generating(capsys, monkeypatch, tmp_path):
    _forbid(monkeypatch, "unmask.eval.runner._load", "loading the model")
    one_line_error(capsys, "eval", "--task", "humaneval", "--workers", 0, match="--workers")
    with pytest.raises(UnmaskError, match="workers"):
        from unmask.eval.runner import evaluate

        evaluate("humaneval", "stories260K", workers=0)
    if os.path.isdir("/proc"):
        one_line_error(capsys, "eval", "--task", "stories", "-o", "/proc/unmask-test.json", match="cannot write")


def test_train_out_under_a_file_is_refused_before_loading(capsys, monkeypatch, tmp_path):
    _forbid(monkeypatch, "unmask.train.sbd._load_base", "loading the base")
    _forbid(monkeypatch, "unmask.train.block_diffusion.load_base", "loading the base")
    (tmp_path / "file").write_text("x")
    data = ids_file(tmp_path / "d.jsonl")
    one_line_error(capsys, "train", "sbd", "--data", data, "--out", tmp_path / "file" / "m", match="is a file")
    one_line_error(capsys, "train", "block-diffusion", "--block-size", 4, "--data", data, "--out",
                   tmp_path / "file" / "m", match="is a file")


def test_finite_checks_cover_every_float_option():
    from unmask.train.loop import TrainConfig

    for name in ("lr", "weight_decay", "clip", "min_lr_ratio", "max_minutes"):
        with pytest.raises(UnmaskError, match="finite"):
            TrainConfig(**{name: math.inf})
    with pytest.raises(UnmaskError, match="finite"):
        TrainConfig(betas=(0.9, math.nan))
    json.dumps(TrainConfig().__dict__)  # still a plain, JSON-able config
