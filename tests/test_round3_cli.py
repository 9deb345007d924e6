"""Issue 28, the command line's share: threads (items 1, 2, 25), README drift (4), the adapter hint
(5), reference NFE (13), interrupts (20, 26), training logs, --json rows and scripts/test.sh (6)."""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path

import pytest
import torch

import unmask
from conftest import one_line_error, run_cli
from unmask import threads

ROOT = Path(__file__).resolve().parents[1]

@pytest.fixture
def clean_threads(monkeypatch):
    """No thread choice made by anyone, torch at its (pretended) import-time default of 2."""
    before, policy = torch.get_num_threads(), threads._policy
    for var in (threads.ENV, "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    threads._policy = None  # an in-process CLI run leaves "auto" behind
    monkeypatch.setattr(threads, "_DEFAULT", 2)
    torch.set_num_threads(2)
    yield
    threads._policy = policy
    torch.set_num_threads(before)


def _spy_decoder(monkeypatch):
    """Record torch's thread count inside each decoder call of unmask.generate."""
    from unmask.decode import Spec

    seen: list[int] = []
    real = Spec.decode

    @functools.wraps(real)
    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Spec, "decode", spy)
    return seen


# -- item 1: the Python API applies the auto policy per call --------------------------------------

def test_python_generate_runs_a_small_model_on_one_thread_and_restores_torch(clean_threads, monkeypatch):
    bundle = unmask.load("stories260K")
    seen = _spy_decoder(monkeypatch)
    unmask.generate("Zoo", bundle, "ar", max_new_tokens=4)
    assert seen == [1]  # the 260K model: one thread inside the call
    assert torch.get_num_threads() == 2  # and torch's count is the user's again afterwards


def test_python_generate_restores_torch_after_an_error(clean_threads):
    bundle = unmask.load("stories260K")
    with pytest.raises(unmask.UnmaskError):
        unmask.generate("Zoo", bundle, "ar", max_new_tokens=10**6)
    assert torch.get_num_threads() == 2 and threads._depth == 0


@pytest.mark.parametrize("how", ["torch", "set_threads", "env", "omp"])
def test_a_users_own_thread_choice_wins_over_the_per_call_policy(clean_threads, monkeypatch, how):
    bundle = unmask.load("stories260K")
    seen = _spy_decoder(monkeypatch)
    if how == "torch":
        torch.set_num_threads(3)  # differs from the import-time default: the user's choice
    elif how == "set_threads":
        unmask.set_threads(3)
    elif how == "env":
        monkeypatch.setenv(threads.ENV, "3")
        torch.set_num_threads(3)  # what a load under UNMASK_THREADS=3 leaves
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
    expected = torch.get_num_threads()
    unmask.generate("Zoo", bundle, "ar", max_new_tokens=4)
    assert seen == [expected] and torch.get_num_threads() == expected


def test_evaluate_runs_on_the_auto_count_and_restores_torch(clean_threads, monkeypatch):
    from unmask.eval.runner import evaluate

    seen = _spy_decoder(monkeypatch)
    evaluate("stories", "stories260K", "ar", limit=1, max_new_tokens=4, warmup=False)
    assert seen and set(seen) == {1} and torch.get_num_threads() == 2


# -- item 2: auto never uses more threads than idle cores; --threads after the command ------------

@pytest.mark.parametrize("load, expected", [(0.0, 2), (0.4, 2), (1.0, 1), (1.8, 1), (7.5, 1)])
def test_auto_for_a_large_model_is_capped_at_the_idle_cores(monkeypatch, load, expected):
    monkeypatch.setattr(threads, "_DEFAULT", 2)
    monkeypatch.setattr(threads, "cores", lambda: 2)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load))
    assert threads.for_model(135_000_000) == expected
    assert threads.for_model(260_000) == 1  # small models: one thread whatever the load


def test_idle_cores_without_a_load_average_is_every_core(monkeypatch):
    def no_load():
        raise OSError("unavailable")

    monkeypatch.setattr(threads.os, "getloadavg", no_load)
    assert threads.idle_cores() == threads.cores()


@pytest.mark.parametrize("argv", [["generate", "--threads", "1", "Zoo"], ["generate", "Zoo", "--threads", "1"],
                                  ["eval", "--task", "stories", "--threads", "1"]])
def test_threads_is_accepted_after_the_subcommand(capsys, clean_threads, argv):
    extra = ["--model", "stories260K", "--decoder", "ar", "-n", "2"] + (["--limit", "1", "--no-progress"]
                                                                       if argv[0] == "eval" else [])
    code, out, err = run_cli(capsys, *argv, *extra)
    assert code == 0, err
    assert threads._policy == 1 and torch.get_num_threads() == 1


def test_threads_after_the_subcommand_wins_over_the_global_option(capsys, clean_threads):
    code, _, err = run_cli(capsys, "--threads", "2", "generate", "Zoo", "--threads", "1", "-m", "stories260K",
                           "-n", "2")
    assert code == 0, err
    assert torch.get_num_threads() == 1


# -- item 25: absurd thread counts are refused with one line ---------------------------------------

@pytest.mark.parametrize("value", [str(10**5), str(2**31), str(10**10), str(10**30)])
@pytest.mark.parametrize("where", ["global", "after", "train"])
def test_absurd_thread_counts_are_one_line_errors(capsys, clean_threads, value, where):
    argv = {"global": ["--threads", value, "models"], "after": ["generate", "Zoo", "--threads", value],
            "train": ["train", "sbd-adapter", "--threads", value, "--data", "x.jsonl", "--out", "o"]}[where]
    one_line_error(capsys, *argv, match="threads must be at most")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("value", [10**5, 2**31, 1e10])
def test_absurd_thread_counts_are_refused_in_python_and_in_the_environment(clean_threads, monkeypatch, value):
    with pytest.raises(unmask.UnmaskError, match="threads must be at most"):
        unmask.set_threads(value)
    monkeypatch.setenv(threads.ENV, str(int(value)))
    with pytest.raises(unmask.UnmaskError, match="threads must be at most"):
        unmask.load("stories260K")
    assert torch.get_num_threads() == 2


def test_the_largest_accepted_count_is_four_per_core(clean_threads):
    assert threads.parse(threads.max_threads()) == 4 * threads.cores()
    with pytest.raises(unmask.UnmaskError):
        threads.parse(threads.max_threads() + 1)


# -- item 5: sbd on a causal model names the adapter route -----------------------------------------

def test_sbd_on_a_causal_model_names_the_adapter_and_its_trainer(capsys):
    line = one_line_error(capsys, "generate", "Zoo", "--model", "stories260K", "--decoder", "sbd", "--verify",
                          match="--adapter")
    assert "train sbd-adapter" in line and "--decoder ar" in line


def test_sbd_on_a_diffusion_model_does_not_offer_an_adapter(capsys):
    line = one_line_error(capsys, "generate", "Zoo", "--model", "stories260K-dlm", "--decoder", "sbd")
    assert "adapter" not in line


# -- item 6: scripts/test.sh runs the paths it is given ---------------------------------------------

def test_the_test_script_runs_only_the_given_paths():
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(["bash", "scripts/test.sh", "tests/test_test_script.py", "--collect-only"], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 test collected" in run.stdout, run.stdout[-2000:]


# -- item 6: piped training logs: one unwrapped line per interval ------------------------------------

def test_piped_training_progress_is_one_unwrapped_line_per_interval(monkeypatch):
    import io

    from rich.console import Console

    import unmask.train.progress as P

    clock = iter(range(1000))
    monkeypatch.setattr(P.time, "monotonic", lambda: float(next(clock)))  # one second per call
    piped = Console(file=io.StringIO(), width=80)  # not a terminal: what a pipe or log file gets
    terms = {f"term_{i}": 1.0 + i for i in range(12)}  # a line far wider than 80 columns
    with P.TrainProgress(piped, total=30, start=0, term_names=tuple(terms), interval=10) as progress:
        for step in range(1, 31):
            progress.update(step, terms, 1234.0)
    header, *lines = piped.file.getvalue().splitlines()
    assert header.startswith("columns: ") and "term_11 = term_11" in header  # issue 52: the columns are named first
    assert [line.split()[1] for line in lines] == ["1/30", "11/30", "21/30", "30/30"]
    assert all(line.startswith("step ") and "term_11 12.000" in line and line.endswith("tok/s") for line in lines)


def test_training_progress_defaults_to_thirty_seconds():
    from unmask.train.progress import TrainProgress

    assert TrainProgress(None, 10, 0, ()).interval == 30.0


# -- item 6: --json rows give per-row and batch figures apart ----------------------------------------

def test_json_rows_have_per_row_and_batch_speed(capsys):
    code, out, err = run_cli(capsys, "generate", "Zoo", "Once upon a time", "--model", "stories260K", "--decoder", "ar",
                             "-n", "8", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 2
    total = sum(len(r["tokens"]) for r in rows)
    for r in rows:
        assert r["seconds"] == r["batch_seconds"] > 0
        assert r["tps"] == pytest.approx(len(r["tokens"]) / r["seconds"])
        assert r["batch_tps"] == pytest.approx(total / r["batch_seconds"])
    assert rows[0]["tps"] < rows[0]["batch_tps"]  # a row's own speed is its share, not the batch's


def test_eval_rows_have_per_row_and_batch_speed():
    from unmask.eval.runner import evaluate

    res = evaluate("stories", "stories260K", "ar", limit=2, batch_size=2, max_new_tokens=6, warmup=False)
    for r in res.rows:
        assert r["tps"] == pytest.approx(r["n_tokens"] / r["seconds"])
        assert r["batch_tps"] == pytest.approx(sum(x["n_tokens"] for x in res.rows) / r["batch_seconds"])


# -- items 20 and 26: a signal once the output is published ----------------------------------------

# Runs `unmask ARGV` like the console script, with a pause announced on stdout ("PAUSE") at one
# moment, so that the test's SIGINT lands exactly there: after the trainer printed "wrote OUT"
# (inside the command), after the command returned (inside entry.main), or after entry.main
# returned (interpreter shutdown).
_PAUSED_RUN = r"""
import json, sys, time
moment, argv = sys.argv[1], json.loads(sys.argv[2])

def pause():
    print("PAUSE", flush=True)
    time.sleep(20)

if moment == "after-wrote":
    import unmask.cli.train as t
    echo = t.typer.echo
    def echo_then_pause(message=None, *a, **k):
        echo(message, *a, **k)
        if str(message).startswith("wrote "):
            pause()
    t.typer.echo = echo_then_pause
if moment == "after-command":
    import unmask.cli
    run = unmask.cli.main
    def run_then_pause(argv):
        run(argv)
        pause()
    unmask.cli.main = run_then_pause
from unmask.entry import main
main(argv)
if moment == "shutdown":
    pause()
"""


def _train_argv(tmp_path) -> list[str]:
    from conftest import ids_file

    corpus = ids_file(tmp_path / "c.jsonl")
    return ["train", "sbd", "--base", "stories260K", "--data", str(corpus), "--out", str(tmp_path / "m"),
            "--steps", "1", "--seq-len", "16", "--batch-size", "1", "--warmup", "0", "--eval-every", "0",
            "--ckpt-every", "0", "--no-progress"]


def _interrupt_at_pause(tmp_path, moment: str, argv: list[str]):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(unmask.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_RUN, moment, json.dumps(argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.strip() == "PAUSE":
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(out) + rest, err


@pytest.mark.parametrize("moment", ["after-wrote", "after-command", "shutdown"])
def test_a_signal_after_the_output_is_published_keeps_it_and_exits_0(tmp_path, moment):
    code, out, err = _interrupt_at_pause(tmp_path, moment, _train_argv(tmp_path))
    assert "PAUSE" in out, (code, out, err)
    assert (tmp_path / "m" / "config.json").is_file()
    assert code == 0, (code, err)  # published: the output stands (before: 130 "interrupted", or -2)
    assert "Traceback" not in err and "interrupted\n" not in err.replace("warning: interrupted", "")
    if moment != "shutdown":  # the command had not ended yet: it says what happened
        assert f"warning: interrupted after {tmp_path / 'm'} was written complete" in err


def test_a_signal_before_anything_is_published_still_exits_130(tmp_path):
    # the pause is after a command that publishes nothing (generate prints to stdout)
    code, out, err = _interrupt_at_pause(tmp_path, "after-command", ["generate", "Zoo", "-m", "stories260K", "-n", "2"])
    assert code == 130 and err.strip().splitlines()[-1] == "interrupted", (code, err)


def test_publishing_defers_a_signal_until_the_output_is_recorded(tmp_path):
    import os
    import signal

    from unmask import fileio

    fileio.forget_published()
    src = fileio.staging_dir(tmp_path / "out")
    (src / "f").write_text("x")
    real = os.replace

    def replace_with_a_signal(a, b):
        os.kill(os.getpid(), signal.SIGINT)  # lands mid-publish
        real(a, b)

    with fileio.output_lock(tmp_path / "out"):
        os.replace = replace_with_a_signal
        try:
            with pytest.raises(KeyboardInterrupt):
                fileio.publish_dir(src, tmp_path / "out")
        finally:
            os.replace = real
    assert (tmp_path / "out" / "f").read_text() == "x"
    assert fileio.published_outputs() == [tmp_path / "out"]  # the interrupt came after the record
    fileio.forget_published()


def test_ctrl_c_while_compile_compiles_is_exit_130_with_one_line(tmp_path):
    """Guard (issue 28 item 26): SIGINT a few seconds into torch.compile's first compile."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    src = str(Path(unmask.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src}
    proc = subprocess.Popen([sys.executable, "-m", "unmask", "generate", "Zoo", "-m", "stories260K", "--compile",
                             "-n", "8", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)
    time.sleep(8)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the compile finished before the signal")
    if proc.returncode == -signal.SIGINT and not err:  # a loaded machine: still importing, default SIGINT death
        pytest.skip("the signal arrived before the CLI had started")
    assert proc.returncode == 130 and err.strip().splitlines() == ["interrupted"], (proc.returncode, err[-2000:])


# -- item 13: --reference-nfe reproduces the reference code's forward counts ------------------------

def _early_stop_dlm():
    """stories260K-dlm with "." as a stop token: its rows stop blocks before the canvas ends."""
    bundle = unmask.load("stories260K-dlm")
    bundle.stop_token_ids = tuple(bundle.encode(".")[-1:])
    return bundle


def test_reference_nfe_decodes_the_whole_canvas_as_the_reference_does():
    from unmask.decode import DECODERS

    bundle = _early_stop_dlm()
    kw = dict(max_new_tokens=64, block_size=8)
    ours = unmask.generate("Once upon a time", bundle, "diffusion", **kw)
    ref = unmask.generate("Once upon a time", bundle, "diffusion", reference_nfe=True, **kw)
    raw = DECODERS["diffusion"].decode(bundle, ref.prompt_tokens, stop_token_ids=(), **kw)  # the API's old only way
    assert ours.stats.nfe < ref.stats.nfe == raw.stats.nfe  # the default stops after the stop token's block
    assert ref.tokens == ours.tokens and ref.texts == ours.texts  # text cut at the stop token all the same
    assert ref.stats.tokens_per_row == [len(t) for t in ref.tokens]


def test_reference_nfe_on_the_command_line(capsys, monkeypatch):
    import unmask.models as models

    bundle = _early_stop_dlm()
    monkeypatch.setattr(models, "load", lambda *a, **k: bundle)
    argv = ["generate", "Once upon a time", "--model", "stories260K-dlm", "--block-size", "8", "-n", "64", "--json"]
    rows = []
    for extra in ([], ["--reference-nfe"]):
        code, out, err = run_cli(capsys, *argv, *extra)
        assert code == 0, err
        rows.append(json.loads(out.splitlines()[0]))
    assert rows[0]["nfe"] < rows[1]["nfe"] and rows[0]["tokens"] == rows[1]["tokens"]


def test_reference_nfe_with_more_steps_than_tokens_runs_llada_s_zero_quota_steps(capsys):
    # LLaDA's generate runs every one of its steps, also the trailing ones whose quota is 0
    argv = ["generate", "Zoo", "--model", "stories260K-dlm", "--gen-length", "16", "--block-size", "8",
            "--policy", "top-k", "--steps", "32", "--json"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    ours = json.loads(out)
    code, out, err = run_cli(capsys, *argv, "--reference-nfe")
    assert code == 0, err
    ref = json.loads(out)
    assert ours["nfe"] == 16 and ref["nfe"] == 32 and ref["tokens"] == ours["tokens"][:len(ref["tokens"])]
    assert "warning" not in err


def test_reference_nfe_is_refused_for_decoders_whose_reference_stops_at_eos(capsys):
    one_line_error(capsys, "generate", "Zoo", "--model", "stories260K", "--decoder", "ar", "--reference-nfe",
                   match="--reference-nfe applies to the dLLM decoders")


def test_eval_takes_reference_nfe_and_records_it(capsys):
    from unmask.eval.runner import evaluate

    res = evaluate("stories", _early_stop_dlm(), "diffusion", limit=1, max_new_tokens=32, block_size=8,
                   warmup=False, reference_nfe=True)
    assert res.summary["config"]["reference_nfe"] is True
    assert "--reference-nfe" in run_cli(capsys, "eval", "--help")[1]
    assert "--reference-nfe" in run_cli(capsys, "bench", "--help")[1]


# -- item 4: every `unmask ...` line of README.md parses as pasted -----------------------------------

README_PLACEHOLDER = r"^(\[.*|[A-Z][A-Z_]*|.*\|.*)$"  # [--opt X], DIR / N / TEXT, a|b alternatives


def _readme_commands() -> list[tuple[int, list[str]]]:
    """(line number, argv after 'unmask') of every unmask invocation in README.md's bash blocks, in
    document order: continuation lines joined, comments dropped, `&&`/`;`/`|` chains split, and
    `torchrun ... -m unmask ...` included."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    found, in_bash, pending, start = [], False, "", 0
    for n, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            in_bash = line.strip() in ("```bash", "```sh", "```shell") and not in_bash
            continue
        if not in_bash:
            continue
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical, pending = pending + line, ""
        tokens = shlex.split(logical, comments=True)
        segment: list[str] = []
        for tok in tokens + [";"]:
            if tok in ("&&", "||", ";", "|"):
                if "unmask" in segment:
                    i = segment.index("unmask")
                    if i == 0 or segment[i - 1] == "-m":
                        found.append((start, segment[i + 1:]))
                segment = []
            else:
                segment.append(tok)
    assert re.compile(README_PLACEHOLDER)  # the pattern compiles
    return found


def _parse_unmask(argv: list[str]):
    """Parse ``unmask ARGV`` with the real command tree without running it -> (command path, the
    leaf's parameter values). Raises click's UsageError for unknown commands or options."""
    from unmask.cli import command

    cmd, name, parent, path = command(), "unmask", None, []
    args = list(argv)
    while True:
        ctx = cmd.make_context(name, list(args), parent=parent)
        if not hasattr(cmd, "commands"):
            return path, ctx.params
        rest = list(getattr(ctx, "_protected_args", [])) + list(ctx.args)
        assert rest, f"no subcommand in {argv}"
        name, cmd, args = cmd.resolve_command(ctx, rest)
        path.append(name)
        parent = ctx


def test_readme_lists_unmask_commands():
    commands = _readme_commands()
    assert len(commands) > 40 and any(argv[:1] == ["serve"] for _, argv in commands)


def test_every_readme_unmask_line_parses_and_has_no_placeholders(clean_threads):
    import re

    bad = []
    for line, argv in _readme_commands():
        holders = [a for a in argv if re.match(README_PLACEHOLDER, a)]
        if holders:
            bad.append(f"README.md:{line}: placeholder(s) {holders} in 'unmask {' '.join(argv)}'")
            continue
        try:
            _parse_unmask(argv)
        except Exception as e:  # noqa: BLE001 - reported per line
            bad.append(f"README.md:{line}: 'unmask {' '.join(argv)}' does not parse: {e}")
    assert not bad, "\n".join(bad)


def test_readme_commands_use_only_inputs_that_exist_or_an_earlier_line_makes(clean_threads):
    """A corpus, prompt file or model directory a README line reads is in the repository, a shipped
    model, an explicit path of the user's own (./DIR, /DIR) or written by an earlier line."""
    import re
    from pathlib import Path

    from unmask.models.registry import WHEEL_MODELS, shipped

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text(encoding="utf-8")
    made: set[str] = {m for m in re.findall(r"> ?([\w./-]+)", text)}  # shell redirections (printf > FILE)
    names = set(shipped()) | set(WHEEL_MODELS)
    bad = []
    for line, argv in _readme_commands():
        try:
            path, params = _parse_unmask(argv)
        except Exception:  # noqa: BLE001 - the parse test reports it
            continue
        keys = ("data", "prompts_file", "model", "base", "adapter")
        keys += ("prompts",) if path == ["data", "distill"] else ()
        reads = {k: params.get(k) for k in keys}
        for key, value in reads.items():
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                if v is None:
                    continue
                v = str(v).removeprefix("./")
                known = (v in made or v in names or (root / v).exists() or v.startswith(("/", "..", "$"))
                         or (key == "adapter" and v == "sbd")
                         or (key == "prompts" and v in ("gsm8k", "humaneval", "mbpp"))
                         or (key in ("model", "base") and str(value).startswith("./")))
                if not known:
                    bad.append(f"README.md:{line}: --{key.replace('_', '-')} {v} is read before any line makes it")
        for key in ("out", "out_dir"):
            if params.get(key) is not None:
                made.add(str(params[key]).removeprefix("./"))
    assert not bad, "\n".join(bad)


def test_readme_examples_write_only_under_the_git_ignored_runs_folder(clean_threads):
    """Issue 52 item 8: README's examples wrote my-* models and corpora into the repository root,
    untracked, and the tree then failed the GPU plan's size check. Every file or directory an
    ``unmask`` line writes (``--out``, ``-o``, ``--out-png``, ``--png``, OUT_DIR) and every shell
    redirection in a bash block is under ``runs/``, which .gitignore ignores."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text(encoding="utf-8")
    bash, in_bash = [], False
    for n, row in enumerate(text.splitlines(), start=1):
        if row.startswith("```"):
            in_bash = row.strip() == "```bash" and not in_bash
        elif in_bash:
            bash += [(n, m) for m in re.findall(r"(?<![0-9&])> ?([\w./-]+)", row.split(" #")[0])]  # printf > FILE
    written = [(n, m) for n, m in bash if m != "/dev/null"]
    for line, argv in _readme_commands():
        try:
            _, params = _parse_unmask(argv)
        except Exception:  # noqa: BLE001 - the parse test reports it
            continue
        written += [(line, str(params[k])) for k in ("out", "out_dir", "out_png", "png") if params.get(k) is not None]
    assert len(written) >= 15
    bad = [f"README.md:{line}: writes {path}" for line, path in written if not path.startswith("runs/")]
    assert not bad, "\n".join(bad)
    ignored = subprocess.run(["git", "check-ignore", "-q", "runs/my-sbd/model.safetensors"], cwd=root)
    assert ignored.returncode == 0, "runs/ is not git-ignored"


# -- issue 48 item 6: CI runs README's test commands and nothing else --------------------------------

def _readme_bash_blocks() -> list[list[str]]:
    blocks, block = [], None
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            if block is not None:
                blocks.append(block)
            block = [] if line.strip() == "```bash" and block is None else None
        elif block is not None:
            block.append(line)
    return blocks


def _ci_commands() -> list[str]:
    """The commands .ci/run runs: its lines that are not comments, shell setup or the helper, with
    ``optional "CMD"`` read as CMD."""
    setup = ("#", "set -", "cd ", "optional() ")
    out = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(setup):
            continue
        if line.startswith("optional "):
            (line,) = shlex.split(line)[1:]
        out.append(line)
    return out


def test_ci_runs_exactly_a_readme_block_that_is_the_readme_test_command_plus_extras():
    commands = _ci_commands()
    block = next((b for b in _readme_bash_blocks() if [x.split("  #")[0].strip() for x in b if x.strip()] == commands),
                 None)
    assert block is not None, f".ci/run runs {commands}, which is no bash block of README.md"
    readme_test_command = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
                           "pip install -e '.[test]' && bash scripts/test.sh")
    assert any(b == [readme_test_command] for b in _readme_bash_blocks())
    # the CI block is README's test command with the optional installs before its last step
    assert commands[0] + " && " + commands[-1] == readme_test_command
    installs = commands[1:-1]
    assert all(c.startswith(("pip install ", "apt-get ")) and "'.[test]'" not in c for c in installs), installs


def test_the_test_extra_holds_gguf_which_the_convert_gguf_tests_import():
    """gguf was installed only by .ci/run: `pip install -e '.[test]'` alone failed 7 tests."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(req.startswith("gguf") for req in extra), extra


def test_a_signal_after_data_distill_wrote_its_corpus_keeps_it_and_exits_0(tmp_path):
    (tmp_path / "p.txt").write_text("Once upon a time\nZoo\n")
    argv = ["data", "distill", "--model", "stories260K", "--prompts", str(tmp_path / "p.txt"), "--out",
            str(tmp_path / "d.jsonl"), "--max-new-tokens", "4", "--no-progress"]
    code, out, err = _interrupt_at_pause(tmp_path, "after-command", argv)
    assert code == 0 and "was written complete" in err, (code, err)
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 2


def test_models_lists_the_decoders_of_each_model_and_the_routers(capsys, monkeypatch):
    # README's model table has a decoders column and names stories260K-dlm's LBS/LPS routers;
    # `unmask models` printed neither (new-user pass)
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run_cli(capsys, "models")
    assert code == 0, err
    row = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") >= 4}
    assert "decoders: diffusion, early-bird." in row["stories260K-dlm"] and "routers: lbs, lps" in row["stories260K-dlm"]
    assert "block, multiblock" in row["stories260K-bd"] and "ar, sbd" in row["stories260K-sbd (default)"]
    assert "ar, sbd" in row["└ --adapter sbd"]
