"""``unmask roofline``: the paper tables as printed, the corrected model, JSON and plots."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from unmask.models.registry import shipped


def cells(text: str, *key: str) -> list[str]:
    """The value cells of the first row whose leading cells are ``key``."""
    for line in text.splitlines():
        parts = line.split()
        if parts[:len(key)] == list(key):
            return parts[len(key):]
    raise AssertionError(f"no row {key} in\n{text}")


def test_sbd_paper_preset_prints_the_reference_cells(capsys):
    code, out, err = run_cli(capsys, "roofline", "--preset", "sbd-paper")
    assert code == 0, err
    table3, table4 = out.split("SBD Table 4")
    assert "SBD Table 3" in table3
    # Table 3, batch 1, KV <= 16384 (the first five KV columns): 1.000 ... 1.015 over k.
    want = {"1": "1.000", "2": "1.000", "4": "1.001", "8": "1.002", "16": "1.004", "32": "1.008", "64": "1.015"}
    for k, v in want.items():
        assert cells(table3, "1", k)[:5] == [v] * 5
    assert cells(table3, "16", "64")[:3] == ["3.799"] * 3  # batch 16, k = 64, KV <= 1024
    for nfe, v in (("2", "1.992"), ("4", "3.982"), ("8", "7.955")):
        assert cells(table4, "1", "16", nfe)[:5] == [v] * 5  # batch 1, block 16, KV <= 16384


def test_corrected_mode_json_and_png(capsys, tmp_path):
    png = tmp_path / "rf.png"
    code, out, err = run_cli(capsys, "roofline", "--gpu", "h200", "--nfe-speedup", "2,4", "--json", "--png", str(png))
    assert code == 0, err
    slow, speed = json.loads(out)["tables"]
    assert slow["mode"] == "corrected" and slow["gpu"]["name"] == "h200" and slow["shape"]["name"] == "llama-3.1-8b"
    assert {r["nfe_speedup"] for r in speed["rows"]} == {2.0, 4.0}
    row = next(r for r in slow["rows"] if r["batch"] == 1 and r["block"] == 16)
    assert all(v < 1.02 for v in row["values"])  # spec sbd.md §7.6 sanity property
    assert png.is_file() and (tmp_path / "rf-speedup.png").is_file()


def test_config_from_a_file_a_shipped_model_and_a_custom_gpu(capsys):
    config = shipped()["stories260K"] / "config.json"
    code, out, err = run_cli(capsys, "roofline", "--config", str(config), "--gpu", "custom", "--peak-flops", "1e15",
                             "--attn-flops", "5e14", "--bandwidth", "2e12")
    assert code == 0, err
    assert "corrected mode, custom, stories260K" in out and "Table 4" not in out
    code, out, err = run_cli(capsys, "roofline", "--config", "stories260K", "--json")
    assert json.loads(out)["tables"][0]["shape"]["hidden"] == 64


@pytest.mark.parametrize("argv, match", [
    (["--gpu", "custom", "--peak-flops", "1e15"], "--gpu custom needs"),
    (["--peak-flops", "1e15"], "go with --gpu custom"),
    (["--gpu", "v100"], "unknown GPU preset"),
    (["--config", "no-such-model"], "no config.json, model directory"),
    (["--preset", "other"], "only preset is sbd-paper"),
    (["--nfe-speedup", "2,x"], "comma-separated numbers"),
    (["--preset", "sbd-paper", "--nfe-speedup", "16"], "NFE speed-up"),
])
def test_bad_options_are_one_line_errors(capsys, argv, match):
    code, out, err = run_cli(capsys, "roofline", *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], err
