"""scripts/gpu_session.py (issue 27): the rehearsal of the GPU session on the CPU, the device's
limits it plans and packs within, chunk reassembly, bring-back, and where the brought-back
adapter shows up (``unmask models``, benchmarks/real_base.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_session  # noqa: E402
import gpu_stage  # noqa: E402
from gpu_session import SessionError  # noqa: E402

MiB = 1 << 20


def test_the_rehearsal_runs_every_phase_cuts_the_overrun_and_brings_back(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "scripts/gpu_session.py", "--rehearse", "--keep", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rehearsal passed" in proc.stdout
    records = {r["phase"]: r for r in json.loads((tmp_path / "work" / "session.json").read_text())}
    assert list(records) == ["stage1", "carry", "stage2", "distill", "train", "check", "bench", "overrun", "pack"]
    assert records["carry"]["status"] == "ok"  # the middle of 3 chunks: every chunk on the machine checked
    assert records["overrun"]["status"] == "cut" and records["overrun"]["seconds"] < records["overrun"]["budget_s"] + 6
    assert all(r["status"] == "ok" for n, r in records.items() if n != "overrun")  # pack ran after the cut
    out = tmp_path / "out"
    files = [p.relative_to(out) for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(f.parts) <= 3 for f in files)
    assert any(f.name.startswith("adapter.safetensors.part-") for f in files)  # split, then joined by bring-back
    shipped = tmp_path / "shipped" / "sbd"
    assert sorted(p.name for p in shipped.iterdir()) == ["adapter.json", "adapter.safetensors"]
    report = json.loads((tmp_path / "results" / "gpu_session.json").read_text())
    check = report["results"]["check"]["tasks"]["all"]
    assert check["identical"] == check["prompts"] == 4
    assert "| overrun | 2 |" in (tmp_path / "results" / "gpu_session.md").read_text()


def test_a_file_over_16_mib_is_split_and_an_over_limit_pack_is_refused(tmp_path):
    assert gpu_stage.limit_checks(tmp_path) == []
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(33 * MiB)
    pieces = gpu_session.pack_plan([("adapter/w.safetensors", big)])
    assert [p["dest"] for p in pieces] == [f"adapter/w.safetensors.part-{k}" for k in range(3)]
    assert sum(p["bytes"] for p in pieces) == 33 * MiB and max(p["bytes"] for p in pieces) <= 16 * MiB
    with pytest.raises(SessionError, match="at most 8"):
        gpu_session.pack_plan([(f"x{i}", big) for i in range(3)])  # 9 pieces


def test_write_pack_pieces_join_back_bit_exactly_and_damage_is_caught(tmp_path):
    src = tmp_path / "w.bin"
    src.write_bytes(os.urandom(1000))
    plan = gpu_session.pack_plan([("a/w.bin", src)], max_file=300)
    files = gpu_session.write_pack(plan, tmp_path / "out")
    assert len(files) == 4
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({"profile": "gpu", "files": files}))
    have = gpu_stage._verified(tmp_path / "out", tmp_path / "joined")
    assert have["a/w.bin"].read_bytes() == src.read_bytes()
    piece = tmp_path / "out" / "a" / "w.bin.part-2"
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    with pytest.raises(SessionError, match="damaged"):
        gpu_stage._verified(tmp_path / "out", tmp_path / "joined2")


def test_chunks_join_only_when_complete_and_intact(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(5001))
    m = gpu_stage.stage_chunks(tmp_path / "stage", src)
    parts = [tmp_path / "stage" / f"part{i + 1}" / p["name"] for i, p in enumerate(m["pieces"])]
    assert [p["bytes"] for p in m["pieces"]] == [2501, 2500]
    dest = tmp_path / "model" / "x.gguf"
    joined = gpu_session.join_files(parts, dest, sha256=m["sha256"], pieces=m["pieces"])
    assert joined.read_bytes() == src.read_bytes()
    dest.unlink()
    last = parts[1].read_bytes()
    parts[1].write_bytes(last[:-1] + bytes([last[-1] ^ 0xFF]))  # always a change (a random last byte was 0 once in 256)
    with pytest.raises(SessionError, match="damaged"):
        gpu_session.join_files(parts, dest, sha256=m["sha256"], pieces=m["pieces"])
    parts[1].unlink()
    with pytest.raises(SessionError, match="missing; rerun the staging command"):
        gpu_session.join_files(parts, dest, sha256=m["sha256"], pieces=m["pieces"])
    assert not dest.exists()


def test_the_gpu_plan_fits_the_device_limits():
    # a clean checkout's tree: files a README example or a user left untracked are not the plan's (issue 52 item 8)
    plan = gpu_session.plan(gpu_session.gpu_phases(2), tree=gpu_session.tree_bytes(untracked=False))
    assert [c["phases"] for c in plan["commands"]] == [
        {"stage1": 30}, {"stage2": 60, "distill": 120, "train": 150, "pack": 15},
        {"check": 50, "bench": 60, "pack": 15}]
    assert plan["total_s"] <= 12 * 60
    for c in plan["commands"]:
        assert len(c["command"]) <= 2000 and c["timeout_s"] <= 600 and len(c["carry"]) <= 8
        assert c["budget_s"] < c["timeout_s"]  # the runner ends its phases before the tool's timeout
    # each staging command carries one chunk of the GGUF next to the working tree (command 1 also
    # the wheels and prompts, ~2 MiB): as many chunks as that takes, each command under 64 MiB
    gguf, side = 98_362_432, 4 * MiB
    parts = gpu_session.parts_needed(gguf, plan["tree_bytes"], side)
    assert plan["tree_bytes"] + -(-gguf // parts) + side <= 64 * MiB
    assert parts == 2 or plan["tree_bytes"] + -(-gguf // (parts - 1)) + side + MiB > 64 * MiB  # the fewest


def test_the_clean_tree_leaves_untracked_files_out_and_the_plan_takes_it(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "tracked.txt").write_text("x" * 1000)
    subprocess.run([*git, "add", "tracked.txt"], cwd=tmp_path, check=True)
    with open(tmp_path / "corpus.jsonl", "wb") as f:  # an untracked 70 MiB file (sparse)
        f.truncate(70 * MiB)
    assert gpu_session.tree_bytes(tmp_path, untracked=False) == 1000
    assert gpu_session.tree_bytes(tmp_path) == 1000 + 70 * MiB
    with pytest.raises(SessionError, match="would carry"):  # the real session still counts what travels
        gpu_session.plan(gpu_session.gpu_phases(2), repo=tmp_path)
    plan = gpu_session.plan(gpu_session.gpu_phases(2), repo=tmp_path, tree=gpu_session.tree_bytes(tmp_path, untracked=False))
    assert plan["tree_bytes"] == 1000


def test_more_chunks_add_middle_staging_commands_that_only_carry():
    phases = gpu_session.gpu_phases(4)
    commands = sorted({p.command for p in phases})
    assert commands == [1, 2, 3, 4, 5]
    assert [p.name for p in phases if p.command in (2, 3)] == ["carry", "carry"]
    assert [p.name for p in phases if p.command == 4] == ["stage2", "distill", "train", "pack"]
    carry = gpu_session.carry_for(4)
    assert carry[1] == (".stage/part1", ".stage/wheels", ".stage/data")
    assert [carry[n] for n in (2, 3, 4, 5)] == [(".stage/part2",), (".stage/part3",), (".stage/part4",), ()]
    with pytest.raises(gpu_session.SessionError, match="no room for a GGUF chunk"):
        gpu_session.parts_needed(98_362_432, 63 * MiB, 2 * MiB)


def test_run_names_unknown_phases_in_one_line(capsys):
    assert gpu_session.main(["run", "--phases", "stage1,warp", "--out", "/tmp/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown phase(s) warp; choose from stage1") and err.count("\n") == 1


def test_bring_back_keeps_a_rehearsal_out_of_the_package(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"profile": "rehearse", "files": {}}))
    with pytest.raises(SessionError, match="pass --adapter-dest and --results-dir"):
        gpu_stage.bring_back(out)
    with pytest.raises(SessionError, match="no manifest.json"):
        gpu_stage.bring_back(tmp_path, adapter_dest=tmp_path / "a", results_dir=tmp_path / "r")


def _package_with_smollm2_adapter(tmp_path, monkeypatch):
    from unmask.models import registry

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    os.symlink(registry.CHECKPOINTS / "stories260K", pkg / "stories260K")
    adapter = pkg / "smollm2-135m" / "adapters" / "sbd"
    adapter.mkdir(parents=True)
    cfg = json.loads((registry.CHECKPOINTS / "stories260K" / "adapters" / "sbd" / "adapter.json").read_text())
    (adapter / "adapter.json").write_text(json.dumps({**cfg, "rank": 32, "full_rank": False, "base": {"name": "smollm2-135m",
                                                                                   "sha256": "sha256:0"}}))
    monkeypatch.setattr(registry, "CHECKPOINTS", pkg)


def test_unmask_models_lists_the_brought_back_smollm2_adapter(tmp_path, monkeypatch, capsys):
    _package_with_smollm2_adapter(tmp_path, monkeypatch)
    monkeypatch.setenv("COLUMNS", "400")
    code, out, err = run_cli(capsys, "models")
    assert code == 0, err
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "smollm2-135m" in line and "SmolLM2-135M-Instruct" in line)
    assert "--adapter sbd" in lines[at + 1] and "rank 32" in lines[at + 1] and "smollm2-135m's" in lines[at + 1]


def test_real_base_takes_the_shipped_adapter_when_present(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("real_base_under_test", REPO / "benchmarks" / "real_base.py")
    real_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real_base)
    assert real_base.parse_args([]).adapter == "auto"
    _package_with_smollm2_adapter(tmp_path, monkeypatch)
    assert real_base.chosen_adapter("smollm2-135m", "auto") == "sbd"
    assert real_base.chosen_adapter("smollm2-135m", "none") is None
    assert real_base.chosen_adapter("smollm2-135m", "/some/dir") == "/some/dir"
    converted = tmp_path / "cache" / "smollm2-135m"  # a directory, even one named like the model
    converted.mkdir(parents=True)
    assert real_base.chosen_adapter(str(converted), "auto") is None
    shutil.rmtree(tmp_path / "pkg" / "smollm2-135m")
    assert real_base.chosen_adapter("smollm2-135m", "auto") is None


def test_pack_halves_a_bf16_trained_adapter_exactly_and_keeps_other_tensors(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    import gpu_phases

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    g = torch.Generator().manual_seed(0)
    lora = torch.randn(64, 32, generator=g).to(torch.bfloat16).float()  # what a bf16 run saves
    row = torch.randn(32, generator=g)  # a float32 value bf16 cannot hold
    save_file({"lora": lora, "row": row}, str(adapter / "adapter.safetensors"))
    out = gpu_phases.compact_adapter(adapter, tmp_path)
    back = load_file(str(out))
    assert back["lora"].dtype == torch.bfloat16 and torch.equal(back["lora"].float(), lora)
    assert back["row"].dtype == torch.float32 and torch.equal(back["row"], row)
    save_file({"row": row}, str(adapter / "adapter.safetensors"))
    assert gpu_phases.compact_adapter(adapter, tmp_path / "x") == adapter / "adapter.safetensors"


def test_bring_back_rounds_an_adapter_over_20_mb_to_bf16_or_refuses(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    staged = tmp_path / "a"
    staged.mkdir()
    (staged / "adapter.json").write_text("{}")
    save_file({"w": torch.ones(1000)}, str(staged / "adapter.safetensors"))
    assert gpu_stage.fit_adapter(staged) is False
    save_file({"w": torch.full((6_000_000,), 0.1)}, str(staged / "adapter.safetensors"))  # 24 MB
    assert gpu_stage.fit_adapter(staged) is True
    assert load_file(str(staged / "adapter.safetensors"))["w"].dtype == torch.bfloat16
    save_file({"w": torch.zeros(11_000_000)}, str(staged / "adapter.safetensors"))  # 22 MB in bf16
    with pytest.raises(SessionError, match="even in bf16"):
        gpu_stage.fit_adapter(staged)


def _gpu_out(tmp_path, adapter_cfg: dict) -> Path:
    """A returned $OUT of the GPU profile holding stories260K's shipped adapter (config edited)."""
    from unmask.models import registry

    src = registry.CHECKPOINTS / "stories260K" / "adapters" / "sbd"
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter.json").write_text(json.dumps(adapter_cfg))
    items = [("adapter/adapter.json", tmp_path / "ad" / "adapter.json"),
             ("adapter/adapter.safetensors", src / "adapter.safetensors")]
    out = tmp_path / "out"
    files = gpu_session.write_pack(gpu_session.pack_plan(items, max_file=400_000), out)  # 3 pieces
    (out / "manifest.json").write_text(json.dumps({"profile": "gpu", "files": files}))
    return out


def test_bring_back_ships_into_the_base_models_package_folder(tmp_path, monkeypatch):
    from unmask.models import registry

    real = registry.CHECKPOINTS / "stories260K"
    cfg = json.loads((real / "adapters" / "sbd" / "adapter.json").read_text())
    pkg = tmp_path / "pkg"
    shutil.copytree(real, pkg / "stories260K")
    monkeypatch.setattr(registry, "CHECKPOINTS", pkg)
    out = _gpu_out(tmp_path, cfg)
    with pytest.raises(SessionError, match="exists; pass --overwrite"):
        gpu_stage.bring_back(out, results_dir=tmp_path / "results")
    report = gpu_stage.bring_back(out, results_dir=tmp_path / "results", overwrite=True)
    shipped = pkg / "stories260K" / "adapters" / "sbd"
    assert report["adapter"]["path"] == str(shipped) and report["adapter"]["load_checked"]
    weights = "adapter.safetensors"
    assert (shipped / weights).read_bytes() == (real / "adapters" / "sbd" / weights).read_bytes()
    assert (tmp_path / "results" / "gpu_session.json").is_file()


def test_bring_back_refuses_an_adapter_whose_base_is_a_path(tmp_path):
    from unmask.models import registry

    cfg = json.loads((registry.CHECKPOINTS / "stories260K" / "adapters" / "sbd" / "adapter.json").read_text())
    out = _gpu_out(tmp_path, {**cfg, "base": {**cfg["base"], "name": "/machine/.stage/work/cache/models/x"}})
    with pytest.raises(SessionError, match="is not a model of the package; pass --adapter-dest"):
        gpu_stage.bring_back(out, results_dir=tmp_path / "results")
