"""Trajectory view and commit trace (unmask.trace): the step-event contract, the JSON trace, the rich
live view, and the decoders and CLI that feed them."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli, tiny_bundle, tiny_llama

import unmask
from unmask.cli import main
from unmask.decode import DECODERS
from unmask.models.mask_token import add_mask_token
from unmask.trace import MASK_GLYPH, Trace, TokenText, attach_trace, step_event

STORIES = Path(unmask.__file__).parent / "checkpoints" / "stories260K"


@pytest.fixture(scope="module")
def dlm_dir(tmp_path_factory) -> Path:
    """stories260K + mask token 512 as a masked-diffusion directory (meaningless outputs, real shapes)."""
    out = tmp_path_factory.mktemp("trace") / "dlm"
    bundle = unmask.load("stories260K")
    mask_id = add_mask_token(bundle.model)
    bundle.model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, out / name)
    (out / "unmask_config.json").write_text(json.dumps({"kind": "masked-diffusion", "mask_token_id": mask_id}))
    return out


def tiny_dllm():
    model = tiny_llama(vocab=64, initializer_range=0.4)
    return tiny_bundle(model, kind="masked-diffusion", mask_token_id=add_mask_token(model))


def test_step_event_from_tensors():
    event = step_event(3, 1, torch.tensor([False, True, True]), torch.tensor([7, 8, 9]), 4,
                       torch.tensor([5, 6, 99, 99, 99, 8, 9, -1]), 99, block=1)
    assert event == {"step": 3, "row": 1, "block": 1, "positions": [5, 6], "tokens": [8, 9],
                     "canvas": [5, 6, None, None, None, 8, 9, None]}


def test_token_text_keeps_word_initial_spaces():
    bundle = unmask.load("stories260K")
    text = TokenText(bundle.tokenizer)
    the = bundle.encode("Once upon the time")[-2]
    assert bundle.tokenizer.decode([the]) == "the"  # decoded alone, the word-initial space is lost
    assert text(the) == " the"
    assert TokenText(None)(5) == " 5"


def test_diffusion_events_replay_to_the_final_canvas():
    bundle = tiny_dllm()
    events = []
    out = DECODERS["diffusion"].decode(bundle, [[1, 5, 9], [1, 2]], max_new_tokens=16, block_size=8, tau=0.5,
                           on_step=events.append)
    assert len(events) == sum(out.stats.nfe_per_row)
    for row in (0, 1):
        mine = [e for e in events if e["row"] == row]
        assert [len(e["positions"]) for e in mine] == out.stats.extra["row_extra"][row]["commits"]
        canvas = [None] * 16
        for e in mine:
            assert all(canvas[p] is None for p in e["positions"])  # a position is committed once
            for p, t in zip(e["positions"], e["tokens"]):
                canvas[p] = t
            assert e["canvas"] == canvas
            assert all(8 * e["block"] <= p < 8 * (e["block"] + 1) for p in e["positions"])
        assert canvas == out.tokens[row]


def test_sbd_emits_step_events():
    model = tiny_llama(vocab=64)
    bundle = tiny_bundle(model, kind="sbd", mask_token_id=add_mask_token(model))
    events = []
    out = DECODERS["sbd"].decode(bundle, [[1, 5, 9]], max_new_tokens=8, block_size=4, gamma=0.5, on_step=events.append)
    assert sum(len(e["positions"]) for e in events) == 8
    assert events[-1]["canvas"] == out.tokens[0]


def test_trace_file_is_written_atomically_on_close(tmp_path):
    bundle = tiny_dllm()
    path = tmp_path / "sub" / "trace.json"
    options = attach_trace(show=False, trace_file=path, bundle=bundle, prompts=["5 9"])
    trace = options["on_step"]
    out = DECODERS["diffusion"].decode(bundle, [[1, 5, 9]], max_new_tokens=8, block_size=8, **options)
    assert not path.exists()  # nothing until close
    trace.close({"nfe": out.stats.nfe})
    data = json.loads(path.read_text())
    assert data["format"] == "unmask-trace/1" and data["prompts"] == ["5 9"] and data["summary"] == {"nfe": out.stats.nfe}
    assert len(data["steps"]) == out.stats.nfe and data["final"] == [out.tokens[0]]
    assert data["steps"][0]["texts"] == [f" {t}" for t in data["steps"][0]["tokens"]]
    assert sorted(p.name for p in path.parent.iterdir()) == ["trace.json"]  # no temporary file left
    unwritten = tmp_path / "failed.json"
    with Trace(trace_file=unwritten) as failing:
        failing({"step": 0, "row": 0, "positions": [0], "tokens": [4], "canvas": [4, None]})
        failing.close(write=False)
    assert not unwritten.exists()


def test_live_view_shows_masks_then_tokens():
    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=True, width=200, color_system=None)
    trace = Trace(show=True, prompts=["P:"], console=console)
    trace({"step": 0, "row": 0, "positions": [1], "tokens": [7], "canvas": [None, 7, None]})
    first = trace.render()
    trace({"step": 1, "row": 0, "positions": [0, 2], "tokens": [5, 6], "canvas": [5, 7, 6]})
    trace.close()
    written = console.file.getvalue()
    assert f"P:{MASK_GLYPH} 7{MASK_GLYPH}" in written and "P: 5 7 6" in written
    plain = Console(file=io.StringIO(), width=200, color_system=None)
    plain.print(first)
    assert MASK_GLYPH in plain.file.getvalue()


def test_cli_show_and_trace(dlm_dir, tmp_path, capsys):
    path = tmp_path / "t.json"
    main(["generate", "Once upon a time", "-m", str(dlm_dir), "-n", "16", "--block-size", "8", "--show",
          "--trace", str(path), "--cache", "dual"])
    printed = capsys.readouterr().out
    assert "decoder diffusion" in printed
    data = json.loads(path.read_text())
    assert data["summary"]["decoder"] == "diffusion" and data["prompts"] == ["Once upon a time"]
    assert sum(len(s["positions"]) for s in data["steps"]) == 16
    main(["generate", "Once upon a time", "-m", str(dlm_dir), "-n", "8", "--block-size", "8", "--show", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # the live view went to stderr
    assert rows[0]["decoder"] == "diffusion" and rows[0]["cache"] == "none"


def test_cli_shows_ar_too(capsys):
    # issue 52 item 2: every decoder emits step events now; --show was refused for ar
    main(["generate", "Once upon a time", "-m", "stories260K", "-n", "4", "--show"])
    captured = capsys.readouterr()
    assert "decoder ar" in captured.out and "error" not in captured.err


def test_piped_show_ends_on_the_reported_text_not_the_canvas_past_the_stop(capsys):
    # issue 15 item 5: the last frame showed tokens past the stop while the printed text was cut there
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200, color_system=None)  # not a terminal: piped
    trace = Trace(show=True, prompts=["P:"], console=console)
    trace({"step": 0, "row": 0, "positions": [0, 1, 2], "tokens": [5, 2, 6], "canvas": [5, 2, 6, None]})
    trace.close({"texts": [" 5"]})
    frames = console.file.getvalue().strip().splitlines()
    assert frames[-2] == "P: 5" and "6" not in frames[-2] and MASK_GLYPH not in frames[-2]
    code, out, err = run_cli(capsys, "generate", "Once upon a time", "--model", "stories260K-dlm", "--gen-length", "64",
                             "--block-size", "32", "--show", "--stop", "Lily")
    assert code == 0
    # piped, the live view goes to stderr and stdout holds the result once
    frames = [x for x in err.splitlines() if x.strip()]
    step = next(i for i, x in enumerate(frames) if x.startswith("step "))
    lines = [x for x in out.splitlines() if x.strip()]
    assert not any(x.startswith("step ") for x in lines) and len(lines) == 2  # the text, then the stats line
    assert frames[step - 1] == lines[0]  # last frame == the printed result
    assert "Lily" not in lines[0] and MASK_GLYPH not in frames[step - 1]
