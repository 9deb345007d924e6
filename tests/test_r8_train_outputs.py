"""Training commands never replace or delete what is not theirs (fault pass 8): ``--out`` / ``--run-dir``
that is a file, a folder of user files, the --data file or a folder holding it, the --base model, or
a path without a name is refused in one line before the base loads, and the user's files stay as they
were. The checks are :func:`unmask.fileio.check_model_out_dir`, shared with ``unmask convert``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import ids_file, one_line_error

from unmask.errors import UnmaskError
from unmask.models.registry import shipped

# Each training command with the options that reach its output checks, and the loader that must not run.
TRAINERS = {
    "sbd": ([], "unmask.train.sbd._load_base"),
    "sbd-adapter": ([], "unmask.train.sbd_adapter._load_base"),
    "diffusion": ([], "unmask.train.diffusion._load_base"),
    "block-diffusion": (["--block-size", "4"], "unmask.train.block_diffusion.load_base"),
    "multitf": ([], "unmask.train.multitf.load_base"),
}
ROUTERS = ["lbs", "lps"]


@pytest.fixture
def no_loading(monkeypatch):
    """Loading any base or router model fails the test: every refusal comes before it."""
    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    for target in [t for _, t in TRAINERS.values()] + ["unmask.train.routers._load"]:
        monkeypatch.setattr(target, fail)


def _train(capsys, command: str, data: Path, out, *more, match: str) -> str:
    extra, _ = TRAINERS[command]
    return one_line_error(capsys, "train", command, *extra, "--data", data, "--out", out, *more, match=match)


def _user_folder(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "sub" / "deep.txt").write_text("deep")
    return path


def _untouched(path: Path) -> bool:
    return (path / "notes.txt").read_text() == "mine" and (path / "sub" / "deep.txt").read_text() == "deep"


@pytest.mark.parametrize("command", [*TRAINERS, *ROUTERS])
def test_out_that_is_a_file_is_refused(capsys, tmp_path, no_loading, command):
    data = ids_file(tmp_path / "d.jsonl")
    v = tmp_path / "v.txt"
    v.write_text("keep me")
    for more in ([], ["--overwrite"]):
        if command in ROUTERS:
            one_line_error(capsys, "train", command, "--data", data, "--out", v, *more, match=f"--out {v} is a file")
        else:
            _train(capsys, command, data, v, *more, match=f"--out {v} is a file")
        assert v.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "v.txt"]  # no lock, staging or run dir


@pytest.mark.parametrize("command", TRAINERS)
def test_overwrite_keeps_a_folder_of_user_files(capsys, tmp_path, no_loading, command):
    data = ids_file(tmp_path / "d.jsonl")
    proj = _user_folder(tmp_path / "proj")
    kind = "an adapter directory" if command == "sbd-adapter" else "a model directory"
    for more in ([], ["--overwrite"]):
        _train(capsys, command, data, proj, *more, match=f"--out {proj} is a folder but not {kind}")
        assert _untouched(proj)


@pytest.mark.parametrize("command", ROUTERS)
def test_routers_keep_a_folder_of_user_files(capsys, tmp_path, no_loading, command):
    data = ids_file(tmp_path / "d.jsonl")
    proj = _user_folder(tmp_path / "proj")
    one_line_error(capsys, "train", command, "--data", data, "--out", proj, "--overwrite",
                   match=f"--out {proj} is a folder but not a router directory")
    assert _untouched(proj) and sorted(p.name for p in proj.iterdir()) == ["notes.txt", "sub"]


@pytest.mark.parametrize("command", [*TRAINERS, *ROUTERS])
def test_out_that_is_or_holds_the_data_is_refused(capsys, tmp_path, no_loading, command):
    folder = tmp_path / "corpus"
    folder.mkdir()
    data = ids_file(folder / "d.jsonl")
    before = data.read_bytes()
    for out, match in ((data, f"--out {data} is the --data file"), (folder, f"--out {folder} holds the --data file")):
        if command in ROUTERS:
            one_line_error(capsys, "train", command, "--data", data, "--out", out, "--overwrite", match=match)
        else:
            _train(capsys, command, data, out, "--overwrite", match=match)
        assert data.read_bytes() == before and sorted(p.name for p in folder.iterdir()) == ["d.jsonl"]


@pytest.fixture
def base(tmp_path) -> Path:
    """A local copy of stories260K with an adapter of its own, as a --base directory."""
    m = tmp_path / "m"
    shutil.copytree(shipped()["stories260K"], m)
    (m / "adapters" / "mine").mkdir(parents=True, exist_ok=True)
    (m / "adapters" / "mine" / "adapter.json").write_text("{}")
    return m


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", ["sbd", "sbd-adapter", "diffusion"])
def test_out_that_is_or_holds_the_base_is_refused(capsys, tmp_path, no_loading, base, command):
    data = ids_file(tmp_path / "d.jsonl")
    before = _snapshot(base)
    for out, match in ((base, f"--out {base} is the --base model"), (tmp_path, f"--out {tmp_path} holds")):
        _train(capsys, command, data, out, "--base", base, "--overwrite", match=match)
        assert _snapshot(base) == before


def test_adapter_out_inside_the_base_adapters_is_still_accepted(tmp_path, base):
    from unmask.train.wiring import check_out_paths, read_paths

    data = ids_file(tmp_path / "d.jsonl")
    reads = read_paths([data], str(base))
    new = base / "adapters" / "new"
    assert check_out_paths(new, None, reads, resume=False, overwrite=True, adapter=True) == (new, base / "adapters" /
                                                                                            "new.run")
    check_out_paths(base / "adapters" / "mine", None, reads, resume=False, overwrite=True, adapter=True)  # an adapter
    with pytest.raises(UnmaskError, match="is the --init adapter mine"):
        check_out_paths(base / "adapters" / "mine", None, read_paths([data], str(base), "mine"), resume=False,
                        overwrite=True, adapter=True)
    with pytest.raises(UnmaskError, match="not an adapter directory"):  # the folder of all its adapters
        check_out_paths(base / "adapters", None, reads, resume=False, overwrite=True, adapter=True)


def test_overwrite_still_replaces_a_model_or_an_empty_folder(tmp_path):
    from unmask.train.wiring import check_out_paths, read_paths

    reads = read_paths([ids_file(tmp_path / "d.jsonl")], "stories260K")
    model, empty = tmp_path / "model", tmp_path / "empty"
    model.mkdir()
    (model / "config.json").write_text("{}")
    empty.mkdir()
    for out in (model, empty, tmp_path / "new"):
        assert check_out_paths(out, None, reads, resume=False, overwrite=True)[0] == out
    with pytest.raises(UnmaskError, match="is the --base model stories260K"):  # a shipped name is its directory
        check_out_paths(shipped()["stories260K"], None, reads, resume=False, overwrite=True)


@pytest.mark.parametrize("command", [*TRAINERS, *ROUTERS])
def test_out_without_a_name_is_one_line(capsys, tmp_path, monkeypatch, no_loading, command):
    data = ids_file(tmp_path / "d.jsonl")
    monkeypatch.chdir(tmp_path)
    for out in ("", ".", "/"):
        if command in ROUTERS:
            one_line_error(capsys, "train", command, "--data", data, "--out", out, "--overwrite",
                           match="names no new directory")
        else:
            _train(capsys, command, data, out, "--overwrite", match="names no new directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


@pytest.mark.parametrize("command", TRAINERS)
def test_run_dir_that_is_a_file_is_named(capsys, tmp_path, no_loading, command):
    data = ids_file(tmp_path / "d.jsonl")
    run = tmp_path / "run"
    run.write_text("keep me")
    for more in ([], ["--overwrite"]):
        _train(capsys, command, data, tmp_path / "m", "--run-dir", run, *more, match=f"--run-dir {run} is a file")
        assert run.read_text() == "keep me"
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("command", TRAINERS)
def test_overwrite_never_discards_a_run_dir_that_is_not_a_run(capsys, tmp_path, monkeypatch, no_loading, command):
    monkeypatch.chdir(tmp_path)  # for --run-dir .
    data_folder = tmp_path / "corpus"
    data_folder.mkdir()
    data = ids_file(data_folder / "d.jsonl")
    proj = _user_folder(tmp_path / "proj")
    _train(capsys, command, data, tmp_path / "m", "--run-dir", proj, "--overwrite",
           match=f"--run-dir {proj} is a folder but not a run directory")
    assert _untouched(proj)
    _train(capsys, command, data, tmp_path / "m", "--run-dir", data_folder, "--overwrite",
           match=f"--run-dir {data_folder} holds the --data file")
    assert sorted(p.name for p in data_folder.iterdir()) == ["d.jsonl"]
    _train(capsys, command, data, tmp_path / "m", "--run-dir", ".", "--overwrite", match="names no new directory")
