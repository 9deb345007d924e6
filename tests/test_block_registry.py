"""``block`` and ``multiblock`` as registry decoders (issue 49): a knob config resolved once into the
frozen config a running batch runs, ``Spec.batch`` as the one factory of ``decode()``'s batch and the
server's, no import cycle in their folders, and a Block Buffer step with stop strings that still
reads the host once."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from batch_helpers import job
from test_block_decode import bd_bundle
from test_block_engine import SyncCounter

import unmask
from unmask.decode import DECODERS
from unmask.decode.blocks.single import BlockConfig, BlockOptions
from unmask.decode.multiblock.window import DEFAULTS, MultiBlockOptions
from unmask.errors import UnmaskError
from unmask.policies import EntropyBound, Threshold

SRC = Path(unmask.__file__).parent


def test_block_options_resolve_once_into_a_frozen_config():
    bundle = bd_bundle()  # native block size 4
    cfg = BlockOptions(tau=0.5).resolve(bundle)
    assert cfg == BlockConfig(block_size=4, policy=Threshold(0.5, strict=True), store="separate", steps=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 8
    assert BlockOptions().resolve(bundle).policy == Threshold(0.95, strict=True)
    sdar = BlockOptions(schedule="sdar").resolve(bundle)  # the quota rule: steps = B, τ 0.85, inclusive policy object
    assert (sdar.steps, sdar.policy) == (4, Threshold(0.85))
    eb = BlockOptions(policy="entropy-bound", gamma=0.3, store="fused").resolve(bundle)
    assert eb.policy == EntropyBound(0.3) and eb.store == "fused"
    with pytest.raises(UnmaskError, match="disagrees with the checkpoint's block size 4"):
        BlockOptions(block_size=8).resolve(bundle)
    with pytest.raises(UnmaskError, match="quota-threshold rule"):
        BlockOptions(steps=2, policy="top-k").resolve(bundle)


def test_multiblock_options_resolve_every_knob_once():
    bundle = bd_bundle()
    cfg = MultiBlockOptions(tau_add=0.3).resolve(bundle)
    assert cfg.block_size == 4 and cfg.tau_add == 0.3
    assert all(getattr(cfg, k) == (0.3 if k == "tau_add" else v) for k, v in DEFAULTS.items())
    assert cfg.resolve(bundle) == cfg  # resolved is a fixed point
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.slots = 3
    with pytest.raises(UnmaskError, match="--slots"):
        MultiBlockOptions(slots=0)  # validated at construction, before any model is read
    with pytest.raises(UnmaskError, match="--tau-stable"):
        MultiBlockOptions(tau_stable=2)
    assert MultiBlockOptions.knobs()[[k.name for k in MultiBlockOptions.knobs()].index("tau_stable")].type is float


@pytest.mark.parametrize("name", ["block", "multiblock"])
def test_the_registry_batch_is_decode_and_the_server(name):
    spec, bundle = DECODERS[name], bd_bundle()
    assert not hasattr(spec, "run")  # decode() is the generic one: Config.of -> spec.batch -> drain
    cfg = spec.config.of({"block_size": None})
    served = spec.batch(bundle, cfg, capacity=4)  # prompts None: the server's batch (rows move on at once)
    lockstep = spec.batch(bundle, cfg, capacity=4, prompts=[[1, 2]], max_new_tokens=4)
    assert (getattr(served, "lockstep", None), getattr(served, "drained", None)) != (
        getattr(lockstep, "lockstep", None), getattr(lockstep, "drained", None))
    assert served.cfg == lockstep.cfg and served.cfg.block_size == 4
    out = unmask.decode.decode(bundle, [[1, 2, 3]], decoder=name, max_new_tokens=6)
    assert out.stats.extra["block_size"] == 4 and len(out.tokens[0]) <= 6
    with pytest.raises(UnmaskError, match="does not apply to decoder"):
        unmask.decode.decode(bundle, [[1, 2]], decoder=name, max_new_tokens=4, gen_length=8)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_block_family_has_no_import_cycle():
    files = [p for d in ("blocks", "multiblock") for p in (SRC / "decode" / d).glob("*.py")]
    mods = {"unmask." + ".".join(p.relative_to(SRC).with_suffix("").parts): p for p in files}
    graph = {m: {d for d in _imports(p) if d in mods and d != m} for m, p in mods.items()}

    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, (*seen, n))) for n in graph[a])

    assert [m for m in graph if reaches(m, m)] == []
    for m, p in mods.items():  # and no import inside a function that could close one later
        body = ast.parse(p.read_text()).body
        local = [n for f in body if isinstance(f, (ast.FunctionDef, ast.ClassDef)) for n in ast.walk(f)
                 if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("unmask")]
        assert not local, f"{m} imports {local[0].module} inside a function"


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_multiblock_step_with_stop_strings_reads_the_host_once(monkeypatch, static):
    # Stop strings are checked on the host, in the sequences the step's one read brought back.
    bundle = unmask.load("stories260K-mbd")
    spec = DECODERS["multiblock"]
    dec = spec.batch(bundle, spec.config.of({}), capacity=4, static=static, on_step=lambda row, event: None)
    texts = ["Once upon a time", "Tom", "Lily wanted to play with her big red ball", "The dog"]
    jobs = [job(bundle.encode(t), 40, stop=(stop, "zz")) for t, stop in zip(texts, ("was", "the", "to", "\n"))]
    for i, j in enumerate(jobs):
        j.id = i
    counter, steps, done = SyncCounter(monkeypatch), 0, []
    dec.join(jobs)
    while len(dec):
        finished, syncs = counter.step(dec)
        assert syncs <= 1, f"step {steps} read the host {syncs} times"
        steps, done = steps + 1, done + finished
    assert steps > 3 and sorted(r.job.id for r in done) == [0, 1, 2, 3]
    assert any(r.finish == "stop" and len(r.tokens) < 40 for r in done)  # a stop string ended a row


def test_a_resolved_config_is_what_the_batch_runs():
    bundle = bd_bundle()
    spec = DECODERS["multiblock"]
    dec = spec.batch(bundle, spec.config.of({"slots": 3}), capacity=2)
    assert dec.cfg == MultiBlockOptions(slots=3).resolve(bundle) and dec.cfg.tau_m2t == DEFAULTS["tau_m2t"]
    assert torch.equal(dec.stops, torch.tensor(sorted(bundle.stop_token_ids) or [-1]))
