"""Issue 49, the verify family: ``ar`` and ``sbd`` are registry decoders (a config and a running batch,
driven by the generic ``Spec.decode``), their options are resolved once (``SBDOptions.resolve``,
``VerifyConfig.of``), the server's batch keys come from the config, and verify/ has no import cycle."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import unmask
from unmask.decode import DECODERS
from unmask.sampling import Sampling
from unmask.errors import UnmaskError

SRC = Path(unmask.__file__).parent
MINE = [*sorted((SRC / "decode" / "verify").glob("*.py")), SRC / "decode" / "blocks" / "sbd.py", SRC / "decode" / "choice.py"]


@pytest.fixture(scope="module")
def sbd_model():
    return unmask.load("stories260K-sbd")  # decode_defaults: lossless, budget of 16 queries (4/0,4/5)


@pytest.fixture(scope="module")
def causal():
    return unmask.load("stories260K")


def test_ar_and_sbd_are_a_config_and_a_batch_with_no_decode_wrapper():
    from unmask.decode.blocks import sbd
    from unmask.decode.verify import ar, steps

    for name in ("ar", "sbd"):
        assert not hasattr(DECODERS[name], "run") and callable(DECODERS[name].batch)
    for module, gone in ((ar, "decode"), (sbd, "decode"), (sbd, "serving_batch"), (steps, "decode"),
                         (steps, "window_layout"), (steps, "cut_row"), (steps, "VerifyConfig")):
        assert not hasattr(module, gone), f"{module.__name__}.{gone}"


def test_sbd_options_resolve_once_to_the_config_that_runs(sbd_model):
    from unmask.decode.blocks.sbd import SBDConfig, SBDOptions
    from unmask.decode.verify.config import VerifyConfig

    assert SBDOptions().resolve(sbd_model) == VerifyConfig(5, "4/0,4/5")  # the checkpoint's 16-query layout
    assert SBDOptions(queries=8).resolve(sbd_model) == VerifyConfig(4, "3/3/4")
    assert SBDOptions(block_size=4).resolve(sbd_model) == VerifyConfig(4, "linear")  # a K asks for a named layout
    lossy = SBDOptions(gamma=0.5).resolve(sbd_model)  # a policy option: the lossy path, defaults fill the block
    assert isinstance(lossy, SBDConfig) and lossy.block_size == 8 and lossy.policy.gamma == 0.5
    for options, msg in ((dict(verify=True, gamma=0.3), "--gamma set a lossy commit policy"),
                         (dict(verify=False, draft="linear"), "--draft applies to lossless SBD only"),
                         (dict(verify=True, block_size=1), "block size >= 2")):
        with pytest.raises(UnmaskError, match=msg):
            SBDOptions(**options).resolve(sbd_model)


def test_batch_keys_are_the_servers_running_batches(sbd_model, causal):
    from unmask.decode.blocks.sbd import SBDOptions
    from unmask.decode.verify.ar import AROptions

    assert AROptions().batch_key(sbd_model, 16) == ("verify", "4/0,4/5")  # AR rows beside the default lossless ones
    assert AROptions().batch_key(causal, 16) == ("verify", "linear")
    assert SBDOptions().batch_key(sbd_model, 16) == ("verify", "4/0,4/5")
    assert SBDOptions(draft="budget", queries=8).batch_key(sbd_model, 16) == ("verify", "3/3/4")
    assert SBDOptions(verify=True, block_size=4).batch_key(sbd_model, 16) == ("verify", "linear")
    assert SBDOptions(verify=True, block_size=1).batch_key(sbd_model, 16) == ("verify", "linear")  # refused at join
    assert SBDOptions(gamma=0.5).batch_key(sbd_model, 16) == ("sbd", SBDOptions(gamma=0.5))
    for bad in (dict(verify=True, gamma=0.5), dict(verify=False, draft="linear"), dict(draft="9/x/1")):
        assert SBDOptions(**bad).batch_key(sbd_model, 16) is None  # per call: its decode reports the error


def test_a_verify_config_is_resolved_by_of_and_only_validated_by_construction():
    from unmask.decode.verify.config import VerifyConfig
    with pytest.raises(UnmaskError, match="not resolved; build the config with VerifyConfig.of"):
        VerifyConfig(8, "3/0,2,3/4")  # a layout fixes K = D + 1: nothing is patched on a frozen config
    assert VerifyConfig.of(8, "3/0,2,3/4") == VerifyConfig(4, "3/0,2,3/4")
    assert VerifyConfig.of(draft="budget:8").draft == "2/0/5"
    assert VerifyConfig.of(8, "4/0,4/5", smaller=("3/3/4", "3/3/4")).smaller == ("3/3/4",)
    assert "__setattr__" not in (SRC / "decode" / "verify" / "config.py").read_text()


def test_the_server_builds_a_verify_batch_from_a_layout(sbd_model, causal):
    from unmask.decode.verify.batch import Verify
    from unmask.decode.verify.serving import for_layout
    from unmask.decode.verify.config import VerifyConfig

    b = for_layout(sbd_model, "3/0,2,3/4", capacity=2, smaller=())
    assert isinstance(b, Verify) and b.cfg == VerifyConfig(4, "3/0,2,3/4") and b.default_K == 4 and not b.ar
    assert for_layout(causal, "linear", capacity=2).ar  # no mask token: AR rows only
    assert list(inspect.signature(for_layout).parameters)[:2] == ["bundle", "draft"]


def _imports(path: Path, module: str) -> set[str]:
    """Every unmask module ``path`` imports, function-local imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
            out |= {f"{base}.{a.name}" for a in node.names} | {base}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("unmask")}


def test_no_import_cycle_reaches_the_verify_family():
    """Tarjan over src/unmask (function-local imports count): no cycle contains a verify module or choice."""
    files = {".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in SRC.rglob("*.py")}
    graph = {m: {i for i in _imports(p, m) if i in files and i != m} for m, p in files.items()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    mine = [c for c in cycles if any(m.startswith("unmask.decode.verify") or m == "unmask.decode.choice" for m in c)]
    assert not mine


def test_the_verify_family_reads_in_short_files():
    sizes = {p.name: len(p.read_text().splitlines()) for p in MINE}
    assert max(sizes.values()) < 400, sizes
    assert sizes["ar.py"] < 80  # AR: the K = 1 verify step, told in one file


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
@pytest.mark.parametrize("name, options", [("ar", {}), ("sbd", dict(verify=True, block_size=4)),
                                           ("sbd", dict(verify=True, draft="3/0,1,3/4+1g3"))])
def test_a_registry_verify_batch_reads_the_host_once_with_events_on(monkeypatch, sampling, name, options):
    """The server's case: 8 rows, ``on_step`` and ``on_token`` set; every step (those where rows finish
    included) reads the host at most once, and the events are built from that read."""
    from batch_helpers import job
    from test_r5_host_syncs import SAMPLED, Recorder, SyncCounter
    from test_sbd_verify import verify_bundle

    bundle = verify_bundle("llama", "sdpa", vocab=8, seed=2)
    spec = DECODERS[name]
    hook, tokens = Recorder(), []
    dec = spec.batch(bundle, spec.config.of(options), capacity=8, on_step=hook, on_token=tokens.append,
                     stop_token_ids=(2,))
    smp = SAMPLED if sampling == "sampled" else Sampling()
    jobs = [job([1] + [3 + (i * j) % 5 for j in range(1 + i)], 10 + 3 * i, smp) for i in range(8)]
    for i, j in enumerate(jobs):
        j.id = i
    steps, done = SyncCounter(monkeypatch).drain(dec, [jobs[:5], [], jobs[5:]])
    assert steps >= 3 and done and hook.events and tokens
