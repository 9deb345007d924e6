"""Shared test helpers: the data directory, tiny random real transformers models, a bundle
wrapper with a minimal tokenizer stand-in, the shipped stories260K checkpoint, the in-process
CLI runner, small training inputs, and references shared by several test files.

The factories are plain functions (``from conftest import tiny_llama``) and are also exposed
as fixtures of the same name that return the factory, so both styles work::

    def test_x(tiny_llama):
        model = tiny_llama(vocab=64, seed=0, attn_implementation="eager")
"""

from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch

from unmask.models.bundle import ModelBundle


@pytest.fixture(autouse=True)
def _signal_handlers_restored(request):
    """Every test leaves SIGINT / SIGTERM as it found them. A handler left behind (SIG_IGN above all,
    which child processes inherit) made the signal tests that ran later on the same xdist worker
    hang or not raise (CI, round 7); the test that left it is named in a warning."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    if blocked := signal.pthread_sigmask(signal.SIG_BLOCK, []) & sigs:  # children inherit a blocked mask too
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        warnings.warn(f"{sorted(s.name for s in blocked)} were blocked before {request.node.nodeid}; unblocked")
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.warn(f"SIGINT was ignored before {request.node.nodeid}; restored")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in before.items():
        if signal.getsignal(s) is not handler:
            signal.signal(s, handler)
            warnings.warn(f"{request.node.nodeid} left the {signal.Signals(s).name} handler changed; restored")


# The default decoder of an SBD model weighs its recorded TPF against a timed forward-cost ratio
# (unmask.decode.choice); a loaded machine would move that timing, so the suite fixes a typical CPU
# ratio (subprocesses inherit it). stories260K-sbd (TPF 2.99) and stories260K+sbd (2.50) keep
# lossless sbd at 2.0; SmolLM2+sbd (1.44) falls back to ar.
os.environ.setdefault("UNMASK_FORWARD_COST", "2.0")

DATA_DIR = Path(os.environ.get("UNMASK_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")
STORIES_DIR = DATA_DIR / "tinyllamas-stories260K"
NO_DATA = f"shared data not found at {DATA_DIR}; set UNMASK_DATA_DIR to the shared/data folder"


def pytest_report_header(config):
    """The data folder the tests read, first thing in the run (a missing one skips the tests that read it)."""
    return f"unmask shared data: {DATA_DIR}" + ("" if DATA_DIR.is_dir() else " (NOT FOUND: tests that read it skip)")


def pytest_terminal_summary(terminalreporter):
    if not DATA_DIR.is_dir():  # said again at the end, where a skip count is read
        terminalreporter.write_line(f"warning: {NO_DATA}; the tests that read it were skipped", yellow=True)

# Every model under test is tiny: intra-op threads only add synchronisation, and on a shared
# machine OpenMP spin-waits make a 56-token decode swing from 0.3 s to 5 s. One thread keeps the
# suite fast and its timings steady.
torch.set_num_threads(1)

# Shapes of every tiny model: small enough that a forward costs well under a millisecond.
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256)


def _tiny(config_cls, model_cls, vocab: int, seed: int, attn_implementation: str, **overrides):
    config = config_cls(vocab_size=vocab, attn_implementation=attn_implementation, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0, **{**TINY, **overrides})
    torch.manual_seed(seed)
    return model_cls(config).to(torch.float32).eval()


def tiny_llama(vocab: int = 64, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A random fp32 ``LlamaForCausalLM`` (hidden 32, 2 layers, 4 heads, 2 KV heads, head_dim 8,
    256 positions) in eval mode; ``overrides`` go to ``LlamaConfig``. Same seed, same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny(LlamaConfig, LlamaForCausalLM, vocab, seed, attn_implementation, **overrides)


def tiny_qwen3(vocab: int = 64, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A random fp32 ``Qwen3ForCausalLM`` with the same shapes as ``tiny_llama`` (q/k norms included)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _tiny(Qwen3Config, Qwen3ForCausalLM, vocab, seed, attn_implementation, **overrides)


def with_mask_row(model):
    """``model`` with one embedding row added for a mask token (``add_mask_token``), whose id
    is asserted to be the old vocabulary size."""
    from unmask.models.mask_token import add_mask_token

    vocab = model.config.vocab_size
    assert add_mask_token(model) == vocab
    return model


def descend(model, objective, chunks: torch.Tensor, generator: torch.Generator, *, steps: int, lr: float) -> dict:
    """``steps`` AdamW steps of ``objective.loss`` on the same ``chunks`` (N, L+1); returns the
    last step's terms. For "the loss decreases" tests on tiny models."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    terms = {}
    for _ in range(steps):
        loss, terms = objective.loss(model, chunks, generator)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return terms


class IdTokenizer:
    """Tokenizer stand-in for tiny models: text is space-separated token ids.

    ``encode("5 6 7") == [bos, 5, 6, 7]``; other words map to ``3 + sum(bytes) % (vocab - 3)``.
    ``decode`` writes ids back as space-separated numbers (special ids dropped when asked), so
    ``decode(prompt + new)`` starts with ``decode(prompt)`` as ``ModelBundle.decode_continuation``
    expects. Decoders only ever see ids; this exists so the API layer has something to call.
    """

    def __init__(self, vocab: int, bos_token_id: int | None = 1, eos_token_id: int | None = 2, pad_token_id: int = 0):
        self.vocab_size = vocab
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id

    def _word(self, w: str) -> int:
        if w.isdigit() and int(w) < self.vocab_size:
            return int(w)
        return 3 + sum(w.encode("utf-8")) % (self.vocab_size - 3)

    def __call__(self, text: str) -> dict:
        ids = [self._word(w) for w in text.split()]
        return {"input_ids": ([self.bos_token_id] if self.bos_token_id is not None else []) + ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        special = {self.bos_token_id, self.eos_token_id, self.pad_token_id}
        return "".join(f" {int(i)}" for i in ids if not (skip_special_tokens and int(i) in special))


def tiny_bundle(model, kind: str = "causal", mask_token_id: int | None = None, *, name: str = "tiny",
                stop_token_ids: tuple[int, ...] = (), tokenizer=None) -> ModelBundle:
    """Wrap ``model`` into a ModelBundle with an ``IdTokenizer`` (unless ``tokenizer`` is given).

    No stop tokens by default so that decoders run to ``max_new_tokens`` on random weights.
    """
    vocab = model.config.vocab_size
    return ModelBundle(model=model, tokenizer=tokenizer or IdTokenizer(vocab), kind=kind, name=name,
                       bos_token_id=1, stop_token_ids=tuple(stop_token_ids), pad_token_id=0,
                       mask_token_id=mask_token_id)


def load_benchmark(name: str):
    """A script of ``benchmarks/`` (not a package) imported as a module, e.g. ``gpu_decode``."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """Run ``unmask ARGV`` in-process (each argument through ``str``); returns (exit code, stdout,
    stderr). A SystemExit whose code is not an int counts as exit code 1."""
    from unmask.cli import main

    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys, *argv, match: str = "", fix: bool = True) -> str:
    """Run the CLI; assert exit 2, exactly one ``error: problem; fix`` line on stderr, no
    traceback, and ``match`` in the line (case-insensitive); return the line. ``fix=False``
    skips the ``; fix`` check, for click's own usage errors, which carry none."""
    code, out, err = run_cli(capsys, *argv)
    lines = err.strip("\n").splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err
    assert not fix or ";" in lines[0], f"no fix after the problem: {lines[0]}"
    assert match.lower() in lines[0].lower(), lines[0]
    return lines[0]


def ids_file(path: Path, n_docs: int = 12, length: int = 40) -> Path:
    """A JSONL corpus of ``n_docs`` documents of ``length`` random ids in [3, 512) (stories260K's
    vocabulary), the same for every call."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 512, (length,), generator=g).tolist() for _ in range(n_docs)]
    path.write_text("".join(json.dumps({"ids": r}) + "\n" for r in rows))
    return path


# A training run of three steps on stories260K: options of train_sbd / train_diffusion / ...
SMALL_RUN = dict(seq_len=32, steps=3, batch_size=2, warmup=1, ckpt_every=2, eval_every=0, progress=False)


def assert_batch_equals_single_rows(decode, bundle, prompts: list[list[int]], **kw):
    """Decoding ``prompts`` as one batch gives every row the tokens, forwards and per-row extras
    that decoding it alone gives (STYLE habit 9). Returns the batch's output."""
    batch = decode(bundle, prompts, **kw)
    for i, p in enumerate(prompts):
        single = decode(bundle, [p], **kw)
        assert single.tokens[0] == batch.tokens[i]
        assert single.stats.nfe_per_row[0] == batch.stats.nfe_per_row[i]
        assert single.stats.extra["row_extra"][0] == batch.stats.extra["row_extra"][i]
    return batch


# Texts of more than 9 tokens on the stories260K tokenizer, cut to each prompt length of a compiled == eager test
EDGE_TEXTS = ("Once upon a time there was a little girl named Lily", "Tom had a red ball and he liked to play")


def prompts_around_a_block(bundle, B: int, batch: int) -> list[list[list[int]]]:
    """Batches of ``batch`` prompts, each batch of ONE length, in the order 1, B + 1, 2, B - 1, B, B + 1
    tokens (B: the decoder's block or draft size): a compiled == eager test that runs them in turn on one
    model, after or before its long prompts, first traces on a prompt shorter than a block (nothing to
    prefill: the compiled step makes the first write), then runs long after short and short after long,
    so a graph that one prompt shape poisons shows in the next (issue 48 item 1)."""
    ids = [bundle.encode(t) for t in EDGE_TEXTS]
    assert min(map(len, ids)) > B + 1, "EDGE_TEXTS are too short for this block size"
    return [[ids[r % 2][:n] for r in range(batch)] for n in (1, B + 1, 2, B - 1, B, B + 1)]


def llama2c_decode(pieces: list[bytes], ids: list[int], prev: int = 1) -> str:
    """Reference decoding of llama2.c tokenizers (spec/models.md §1.5, run.c): pieces → bytes;
    after BOS (id 1) one leading space is dropped; ``<0xHH>`` is the byte HH; UTF-8 with
    errors="replace" (our choice). ``prev`` is the token before ``ids``."""
    out = b""
    for i in ids:
        piece = pieces[i]
        if prev == 1 and piece.startswith(b" "):
            piece = piece[1:]
        if len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
            piece = bytes([int(piece[3:5], 16)])
        out += piece
        prev = i
    return out.decode("utf-8", errors="replace")


@pytest.fixture(name="tiny_llama")
def _tiny_llama_factory():
    return tiny_llama


@pytest.fixture(name="tiny_qwen3")
def _tiny_qwen3_factory():
    return tiny_qwen3


@pytest.fixture(name="tiny_bundle")
def _tiny_bundle_factory():
    return tiny_bundle


@pytest.fixture(scope="session")
def stories():
    """The shipped stories260K checkpoint as a ModelBundle (loaded once per session; do not mutate)."""
    import unmask

    return unmask.load("stories260K")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA_DIR.is_dir():
        pytest.skip(NO_DATA)
    return DATA_DIR
