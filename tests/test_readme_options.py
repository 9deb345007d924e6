"""Issue 49: README's decoder option table is the registry's. One row per knob a user sets (a flag of ``unmask
generate`` or a field of ``unmask serve`` requests) of the built-in decoders: its name, value type, the decoders
that take it, its default and its help must be what ``unmask.decode.DECODERS`` says.

Print the table from the registry (to paste into README.md): ``PYTHONPATH=src python tests/test_readme_options.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
HEADER = "| knob | type | decoders | default | help |"


def builtin_specs():
    """The registered decoders unmask itself ships (a plug-in installed here is not README's)."""
    from unmask.decode import DECODERS

    return [s for s in DECODERS.values() if s.config.__module__.startswith("unmask.")]


def table_rows() -> list[list[str]]:
    """[knob, type, decoders, default, help] per user-set knob, in registration order. ``help``: the one help
    text, or per group of decoders that share one; ``(server and Python API only)`` for a knob with no flag."""
    uses: dict[str, list] = {}
    for spec in builtin_specs():
        for k in spec.knobs():
            if k.cli or k.serve:
                uses.setdefault(k.name, []).append((spec.name, k))
    rows = []
    for name, pairs in uses.items():
        k = pairs[0][1]
        helps: dict[str, list[str]] = {}
        for decoder, kk in pairs:
            helps.setdefault(kk.help, []).append(decoder)
        text = next(iter(helps)) if len(helps) == 1 else "; ".join(
            f"{', '.join(f'`{d}`' for d in ds)}: {h}" for h, ds in helps.items())
        if not k.cli:
            text += " (server and Python API only)"
        elif not k.serve:
            text += " (command line and Python API only)"
        rows.append([f"`{name}`", k.type_name, ", ".join(f"`{d}`" for d, _ in pairs),
                     "—" if k.default is None else f"`{k.default!r}`", text.replace("|", "\\|")])
    return rows


def render() -> str:
    return "\n".join([HEADER, "|---|---|---|---|---|", *("| " + " | ".join(r) + " |" for r in table_rows())])


def readme_rows() -> list[list[str]]:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines.count(HEADER) == 1, f"README.md needs one option table starting with {HEADER!r}"
    out = []
    for line in lines[lines.index(HEADER) + 2:]:
        if not line.startswith("|"):
            break
        out.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
    return out


def test_readme_option_table_is_the_registry_s():
    fix = "regenerate it: PYTHONPATH=src python tests/test_readme_options.py"
    want, got = table_rows(), readme_rows()
    assert [r[0] for r in got] == [r[0] for r in want], f"README's knobs differ from the registry's; {fix}"
    for g, w in zip(got, want):
        assert len(g) == 5 and g[:4] == w[:4], f"README row {g[:4]} != registry {w[:4]}; {fix}"
        assert g[4] == w[4], f"README's help of {g[0]} is not the registry's ({w[4]!r}); {fix}"


def test_the_table_covers_every_user_knob_and_only_those():
    names = {r[0].strip("`") for r in table_rows()}
    assert {"block_size", "gamma", "tau", "slots", "confidence"} <= names  # confidence: a server field, no flag
    assert not names & {"routers", "lbs_router", "max_nfe", "eos_early_stop"}  # Python-API-only knobs


def test_generate_help_names_the_decoders_of_each_flag_as_the_table_does():
    """A user reading `unmask generate --help` learns which decoders take a flag, shared help text or not."""
    from typer.main import get_command

    from unmask.cli import app

    helps = {o.name: " ".join(o.help.split()) for o in get_command(app).commands["generate"].params}
    for row in readme_rows():
        name, decoders = row[0].strip("`"), [d.strip("`") for d in row[2].split(", ")]
        if name in helps:  # a server-only knob has no flag
            for d in decoders:
                assert re.search(rf"(^|; )([\w-]+, )*{re.escape(d)}(, [\w-]+)*: ", helps[name]), (
                    f"--{name.replace('_', '-')}'s help does not name {d}: {helps[name]!r}")


if __name__ == "__main__":
    print(render())
