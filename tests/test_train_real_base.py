"""SBD training for a real base (issue 18 item 4): answer-only label masks from ``loss_start``,
the memory-lean loss (logits only at target positions, chunked and checkpointed), the draft-mode
masked CE per block offset, and the trainers' new flags. Tiny random Llamas and stories260K only."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import one_line_error, run_cli, tiny_llama, with_mask_row
from torch.utils._python_dispatch import TorchDispatchMode

from unmask.errors import UnmaskError
from unmask.models.sbd_adapter import AdapterSpec, GatedLinear, attach
from unmask.train import lm_loss
from unmask.train.data import pack, pack_labelled, read_documents
from unmask.train.lm_loss import chunked_cross_entropy
from unmask.train.objectives import IGNORE, SBDObjective, offset_ce, sbd_attention_mask, sbd_batch, sbd_loss
from unmask.train.sbd_adapter import AdapterObjective, adapter_loss
from unmask.train.wiring import load_labelled_chunks

VOCAB, MASK = 64, 64  # with_mask_row adds id 64


def _rows(n: int = 3, L: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, L + 1), generator=torch.Generator().manual_seed(seed))  # (n, L+1)


def _labels(chunks: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A prompt/answer split per row at a random boundary (labels False before it)."""
    cut = torch.randint(1, chunks.shape[1] - 2, (chunks.shape[0], 1), generator=torch.Generator().manual_seed(seed))
    return torch.arange(chunks.shape[1])[None, :] >= cut  # (n, L+1)


def _full_logits(monkeypatch):
    """Force the full-logits path of lm_nll (the reference the lean path must equal)."""
    monkeypatch.setattr(lm_loss, "head_weights", lambda model: None)


# ---------------------------------------------------------------------------------------------
# loss_start in the data
# ---------------------------------------------------------------------------------------------


def test_loss_start_is_read_and_packed_as_labels(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"ids": [5, 6, 7, 8], "loss_start": 2}\n{"ids": [9, 10, 11]}\n{"ids": [1, 12, 13], "loss_start": 0}\n')
    docs = read_documents(f, vocab_size=VOCAB)
    assert [d.get("loss_start") for d in docs] == [2, None, 0]
    chunks, labels = pack_labelled([d["ids"] for d in docs], [d.get("loss_start") for d in docs], 4, sep_id=1)
    assert torch.equal(chunks, pack([d["ids"] for d in docs], 4, sep_id=1))
    # stream: [1] 5 6 | 7 8 [1] 9 10 11 [1] 12 13 -> two chunks of 5; separators never targets
    assert chunks.tolist() == [[1, 5, 6, 7, 8], [1, 9, 10, 11, 1]]
    assert labels.tolist() == [[False, False, False, True, True], [False, True, True, True, False]]


@pytest.mark.parametrize("value", ["-1", "5", '"2"', "true", "2.0"])
def test_bad_loss_start_is_one_line_error(tmp_path, value):
    f = tmp_path / "c.jsonl"
    f.write_text('{"ids": [5, 6, 7, 8], "loss_start": %s}\n' % value)
    with pytest.raises(UnmaskError, match=r"line 1: loss_start must be an integer in \[0, 4\]") as e:
        read_documents(f)
    assert "\n" not in str(e.value) and "; " in str(e.value)


def test_answer_only_is_on_by_default_when_the_corpus_has_loss_start(tmp_path):
    rows = [{"ids": list(range(3, 23)), "loss_start": 12, "split": s} for s in ("train", "train", "val")]
    with_start = tmp_path / "a.jsonl"
    with_start.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = tmp_path / "p.jsonl"
    plain.write_text("".join(json.dumps({"ids": r["ids"], "split": r["split"]}) + "\n" for r in rows))
    kw = dict(val_fraction=0.0, seed=0, config=SimpleNamespace(bos_token_id=1))  # the separator
    auto = load_labelled_chunks([with_start], None, VOCAB, 8, **kw)
    assert auto.answer_only and auto.train_labels.shape == auto.train.shape and auto.val_labels is not None
    assert 0 < int(auto.train_labels.sum()) < auto.train_labels.numel()
    off = load_labelled_chunks([with_start], None, VOCAB, 8, answer_only=False, **kw)
    assert not off.answer_only and off.train_labels is None and torch.equal(off.train, auto.train)
    assert load_labelled_chunks([plain], None, VOCAB, 8, **kw).train_labels is None
    with pytest.raises(UnmaskError, match="--answer-only needs records with 'loss_start'"):
        load_labelled_chunks([plain], None, VOCAB, 8, answer_only=True, **kw)


# ---------------------------------------------------------------------------------------------
# Labels in the SBD objectives
# ---------------------------------------------------------------------------------------------


def test_all_true_labels_are_exactly_todays_batch_and_losses():
    model = with_mask_row(tiny_llama(vocab=VOCAB))
    chunks = _rows()
    ones = torch.ones_like(chunks, dtype=torch.bool)
    a = sbd_batch(chunks, MASK, 4, torch.Generator().manual_seed(3))
    b = sbd_batch(chunks, MASK, 4, torch.Generator().manual_seed(3), labels=ones)
    for key in ("input_ids", "labels", "position_ids", "noise_mask"):
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(sbd_loss(model, a, 4, MASK)[0], sbd_loss(model, b, 4, MASK)[0])
    objective = AdapterObjective(MASK, block_range=(2, 6))
    model.train()
    la, ta = objective.loss(model, chunks, torch.Generator().manual_seed(4), k=4)
    lb, tb = objective.loss(model, chunks, torch.Generator().manual_seed(4), k=4, labels=ones)
    assert torch.equal(la, lb) and all(torch.equal(torch.as_tensor(ta[n]), torch.as_tensor(tb[n])) for n in ta)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_prompt_tokens_are_never_targets(impl):
    """With labels, the loss is the full-logits Eq. 14 over labelled targets only: NTP where the
    predicted token is labelled, masked CE where the masked token is; prompt tokens stay unmasked."""
    model = with_mask_row(tiny_llama(vocab=VOCAB, attn_implementation=impl))
    chunks, L, k = _rows(3, 16), 16, 4
    labels = _labels(chunks)
    b = sbd_batch(chunks, MASK, k, torch.Generator().manual_seed(5), labels=labels)
    assert not (b["noise_mask"] & ~labels[:, :-1]).any()  # only answer tokens are masked
    assert ((b["labels"][:, :L] != IGNORE) == labels[:, 1:]).all()
    assert not ((b["labels"][:, L:] != IGNORE) & ~labels[:, :-1]).any()
    loss, terms = sbd_loss(model, b, k, MASK)
    attn = sbd_attention_mask(model, L, k, "cpu").expand(3, -1, -1, -1)
    logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=attn).logits
    logits[..., MASK] = float("-inf")
    want = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE)
    torch.testing.assert_close(loss, want)
    assert int(terms["ntp_tokens"]) == int(labels[:, 1:].sum())


# ---------------------------------------------------------------------------------------------
# Memory-lean loss: equal to full logits, never (B, 2L, V)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_cross_entropy_equals_full_logits_values_and_grads(chunk):
    model = tiny_llama(vocab=VOCAB)
    weight = model.get_output_embeddings().weight.detach().clone().requires_grad_(True)  # (V, d)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, weight.shape[1], generator=g).requires_grad_(True)  # (n, d)
    targets = torch.randint(0, VOCAB, (23,), generator=g)
    targets[targets == 7] = 8  # id 7 is suppressed below
    got = chunked_cross_entropy(hidden, weight, targets, suppress=7, chunk=chunk)
    (got * torch.arange(23)).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden @ weight.t()
    logits[:, 7] = float("-inf")
    want = F.cross_entropy(logits, targets, reduction="none")
    (want * torch.arange(23)).sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_sbd_loss_lean_equals_full_logits_values_and_grads(monkeypatch):
    chunks = _rows(2, 20)
    labels = _labels(chunks)
    results = []
    for lean in (True, False):
        model = with_mask_row(tiny_llama(vocab=VOCAB))
        if not lean:
            _full_logits(monkeypatch)
        b = sbd_batch(chunks, MASK, 5, torch.Generator().manual_seed(2), labels=labels)
        loss, terms = sbd_loss(model, b, 5, MASK)
        loss.backward()
        results.append((loss.detach(), terms, _grads(model)))
    (l1, t1, g1), (l2, t2, g2) = results
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(t1["ntp"], t2["ntp"]) and torch.testing.assert_close(t1["mat"], t2["mat"])
    assert g1.keys() == g2.keys() and len(g1) > 5
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=name)


def test_adapter_loss_lean_equals_full_logits_values_and_grads(monkeypatch):
    chunks = _rows(3, 18)
    labels = _labels(chunks)
    draft = torch.tensor([True, False, True])
    results = []
    for lean in (True, False):
        model = tiny_llama(vocab=VOCAB, initializer_range=0.2)
        ad = attach(model, AdapterSpec(rank=4, mask_token_id=VOCAB, base_vocab=VOCAB))
        with torch.no_grad():
            for p in ad.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        if not lean:
            _full_logits(monkeypatch)
        b = sbd_batch(chunks, VOCAB, 6, torch.Generator().manual_seed(1), eta=torch.tensor([1.0, 0.5, 1.0]),
                      labels=labels)
        loss, terms = adapter_loss(model, b, 6, VOCAB, draft, ntp=True)
        loss.backward()
        results.append((loss.detach(), terms, _grads(model)))
    (l1, t1, g1), (l2, t2, g2) = results
    torch.testing.assert_close(l1, l2)
    for name in ("draft", "ntp", "d0", "d1", "d2", "d3"):
        torch.testing.assert_close(t1[name], t2[name], msg=name)
    assert g1.keys() == g2.keys() and any("lora_B" in n for n in g1)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=name)


class _LargestLogits(TorchDispatchMode):
    """Records the largest tensor any op (forward, checkpoint recompute, backward) returns whose
    last dimension is the vocabulary: a logits-shaped tensor (the head weight's transpose,
    (hidden, V), is not one)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.weight_t, self.largest = vocab, (hidden, vocab), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab
                    and tuple(t.shape) != self.weight_t):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_logits_over_the_whole_layout_are_created(monkeypatch):
    """Forward and backward of sbd_loss never hold more than chunk (or B) rows of logits; the
    full-logits path does hold (B, 2L, V), so the probe sees logits when they exist."""
    B, L, k, V = 4, 24, 4, VOCAB + 1
    chunks = _rows(B, L)
    monkeypatch.setattr(lm_loss, "LOGITS_BUDGET", 3 * V)  # 3 rows per chunk
    sizes = []
    for lean in (True, False):
        model = with_mask_row(tiny_llama(vocab=VOCAB))
        if not lean:
            _full_logits(monkeypatch)
        b = sbd_batch(chunks, MASK, k, torch.Generator().manual_seed(0))
        with _LargestLogits(V, model.config.hidden_size) as probe:
            loss, _ = sbd_loss(model, b, k, MASK)
            loss.backward()
        sizes.append(probe.largest)
    lean_size, full_size = sizes
    assert full_size >= B * 2 * L * V
    assert lean_size <= max(3, B) * V  # B: the one position logits_to_keep=1 leaves to the head


# ---------------------------------------------------------------------------------------------
# Masked CE per block offset
# ---------------------------------------------------------------------------------------------


def test_offset_ce_is_the_adapter_validation_numbers():
    model = tiny_llama(vocab=VOCAB, initializer_range=0.2)
    ad = attach(model, AdapterSpec(rank=4, mask_token_id=VOCAB, base_vocab=VOCAB))
    with torch.no_grad():
        for p in ad.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    chunks = _rows(3, 24)
    labels = _labels(chunks)
    model.eval()
    with torch.no_grad():
        _, terms = AdapterObjective(VOCAB, eval_block_size=8).loss(model, chunks, torch.Generator(), k=3,
                                                                   labels=labels)
    got = offset_ce(model, chunks, labels, VOCAB, k=8)
    assert set(got) == {"ntp", "d0", "d1", "d2", "d3", "d7"}
    for name, value in got.items():
        assert abs(value - float(terms[name])) < 1e-5, name
    assert got["d0"] != got["d7"]


def test_offset_ce_of_an_sbd_model_reads_the_block_offsets():
    """d_j is the mean masked CE at offset j of all-mask blocks; ntp the clean half's NTP CE."""
    model = with_mask_row(tiny_llama(vocab=VOCAB))
    chunks = _rows(2, 16)
    got = offset_ce(model, chunks, None, MASK, k=4, offsets=(0, 3))
    b = sbd_batch(chunks, MASK, 4, torch.Generator(), eta=torch.ones(2))
    attn = sbd_attention_mask(model, 16, 4, "cpu").expand(2, -1, -1, -1)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=attn).logits
    logits[..., MASK] = float("-inf")
    nll = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE,
                          reduction="none").view(2, 32)
    assert abs(got["ntp"] - float(nll[:, :16].mean())) < 1e-5
    assert abs(got["d3"] - float(nll[:, 16:][:, 3::4].mean())) < 1e-5
    assert set(got) == {"ntp", "d0", "d3"}


def test_sbd_objective_reports_offsets_at_validation():
    model = with_mask_row(tiny_llama(vocab=VOCAB))
    extra = SBDObjective(MASK, eval_block_size=4).diagnostics(model, _rows(2, 16), None)
    assert set(extra) == {"d0", "d1", "d2", "d3"}


# ---------------------------------------------------------------------------------------------
# The adapter is LoRA, gated to mask positions
# ---------------------------------------------------------------------------------------------


def test_rank_r_adapter_is_gated_lora():
    model = tiny_llama(vocab=VOCAB)
    ad = attach(model, AdapterSpec(rank=3, mask_token_id=VOCAB, base_vocab=VOCAB))
    layers = [m for m in model.modules() if isinstance(m, GatedLinear)]
    assert layers and all(m.lora_A.shape[0] == 3 and m.lora_B.shape[1] == 3 and not m.lora_B.any() for m in layers)
    assert not hasattr(layers[0], "delta")
    with torch.no_grad():
        for m in layers:
            m.lora_B.normal_()
    ids = torch.tensor([[5, 6, VOCAB, VOCAB, 7]])
    base = tiny_llama(vocab=VOCAB)
    with torch.no_grad():
        got = model(input_ids=ids).logits[0, :2, :VOCAB]  # causal: positions before the first mask
        want = base(input_ids=ids.clamp(max=VOCAB - 1)).logits[0, :2]
    assert torch.equal(got, want) and ad.num_parameters() > 0


# ---------------------------------------------------------------------------------------------
# Trainer flags end to end (stories260K, a few steps)
# ---------------------------------------------------------------------------------------------


def _answer_corpus(path, n: int = 24, length: int = 40):
    g = torch.Generator().manual_seed(0)
    rows = [{"ids": torch.randint(3, 512, (length,), generator=g).tolist(), "loss_start": 15,
             "split": "val" if i % 6 == 0 else "train"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("command", ["sbd", "sbd-adapter"])
def test_train_flags_end_to_end(tmp_path, capsys, monkeypatch, command):
    from unmask.train.progress import TrainProgress

    monkeypatch.setattr(TrainProgress, "INTERVAL", 0.0)  # piped lines every 30 s in use; every step here
    corpus = _answer_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "m"
    extra = ["--full-rank"] if command == "sbd-adapter" else ["--no-progress"]
    code, _, err = run_cli(capsys, "train", command, "--base", "stories260K", "--data", corpus, "--out", out, *extra,
                           "--steps", 3, "--seq-len", 24, "--batch-size", 2, "--warmup", 1, "--block-range", "2:4",
                           "--block-size", 4, "--log-every", 1, "--ckpt-every", 1, "--keep-checkpoints", 2,
                           "--eval-every", 2, "--threads", 1, "--dtype", "float32")
    assert code == 0, err
    if command == "sbd-adapter":  # stderr is no terminal here: one plain line per interval (0 s: every step)
        assert [line.split()[1] for line in err.splitlines() if line.startswith("step ") and "/" in line.split()[1]] \
            == ["1/3", "2/3", "3/3"], err
    run = out.with_name("m.run")
    lines = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3]  # --log-every 1
    val = [r for r in lines if "val_loss" in r]
    assert val and {"val_d0", "val_d1", "val_d2", "val_d3", "val_ntp"} <= set(val[0])
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith(".")) == \
        ["step-00000002", "step-00000003"]  # --keep-checkpoints 2
    state = torch.load(run / "checkpoints" / "step-00000003" / "trainer_state.pt", weights_only=True)
    meta = json.loads(state["meta"])
    assert meta["answer_only"] is True and meta["dtype"] == "float32"


@pytest.mark.parametrize(("argv", "match"), [
    (["--block-range", "2-4"], "--block-range must be LOW:HIGH"),
    (["--block-range", "2:x"], "--block-range must be LOW:HIGH"),
    (["--block-range", "2:4", "--min-block", "3"], "pass only one of them"),
    (["--block-range", "5:3"], "block range"),
    (["--dtype", "float16"], "--dtype must be float32 or bfloat16"),
    (["--threads", "0"], "threads must be an integer"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1"),
    (["--log-every", "-1"], "--log-every must be >= 0"),
    (["--answer-only"], "--answer-only needs records"),
])
def test_train_flag_errors_are_one_line(tmp_path, capsys, argv, match):
    corpus = tmp_path / "plain.jsonl"
    corpus.write_text("".join(json.dumps({"ids": list(range(3, 60))}) + "\n" for _ in range(4)))
    one_line_error(capsys, "train", "sbd-adapter", "--base", "stories260K", "--data", corpus, "--out",
                   tmp_path / "o", "--seq-len", 16, *argv, match=match)


def test_resume_keeps_the_answer_only_setting(tmp_path, capsys):
    corpus = _answer_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "m"
    args = ["train", "sbd-adapter", "--base", "stories260K", "--data", corpus, "--out", out, "--full-rank",
            "--seq-len", 24, "--batch-size", 2, "--warmup", 1, "--ckpt-every", 1, "--eval-every", 0, "--no-progress"]
    code, _, err = run_cli(capsys, *args, "--steps", 1)
    assert code == 0, err
    one_line_error(capsys, *args, "--steps", 2, "--resume", "--no-answer-only", match="trained with answer-only")
    code, _, err = run_cli(capsys, *args, "--steps", 2, "--resume")
    assert code == 0, err


def test_a_micro_batch_without_any_target_steps_with_zero_gradients(tmp_path):
    """Found by the new-user pass: a micro-batch with no target (prompt-only rows, or no masked
    token at batch size 1) gives a loss without a gradient path, which used to crash ``backward``.
    The loop now steps with zero gradients: AdamW's first step then moves nothing."""
    from types import SimpleNamespace

    import unmask
    from unmask.train.loop import TrainConfig, train

    model = unmask.load("stories260K").model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    objective = SimpleNamespace(name="no-target", term_names=("mat",), step_params=lambda g: {},
                                loss=lambda m, chunks, g: (torch.zeros(()), {"mat": 0.0}))
    chunks = torch.randint(3, 512, (4, 17))
    cfg = TrainConfig(steps=1, batch_size=2, warmup=1, eval_every=0, ckpt_every=0)
    result = train(model, objective, chunks, None, cfg, tmp_path / "run")
    assert result.step == 1
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_a_corpus_without_any_answer_token_is_refused(tmp_path, capsys):
    """Found by the fault pass: every row prompt-only trained on nothing and published."""
    g = torch.Generator().manual_seed(0)
    rows = [{"ids": torch.randint(3, 512, (30,), generator=g).tolist(), "loss_start": 30} for _ in range(8)]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one_line_error(capsys, "train", "sbd-adapter", "--base", "stories260K", "--data", corpus, "--out", tmp_path / "m",
                   "--full-rank", "--steps", 2, "--seq-len", 16, match="no training row holds an answer token")
    assert not (tmp_path / "m").exists()


def test_validation_rows_without_an_answer_token_warn_instead_of_reporting_zero(tmp_path, capsys):
    """Found by the new-user pass: packing cut the held-out answers off, and validation showed a
    'perfect' loss of 0.0. Now a one-line warning says there are no validation numbers."""
    g = torch.Generator().manual_seed(0)
    rows = [{"ids": torch.randint(3, 512, (40,), generator=g).tolist(), "loss_start": 5} for _ in range(8)]
    rows.append({"ids": torch.randint(3, 512, (30,), generator=g).tolist(), "loss_start": 20, "split": "val"})
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = run_cli(capsys, "train", "sbd-adapter", "--base", "stories260K", "--data", corpus, "--out",
                           tmp_path / "m", "--full-rank", "--steps", 2, "--seq-len", 16, "--batch-size", 2,
                           "--warmup", 1, "--eval-every", 1, "--threads", 1)
    assert code == 0, err
    assert "warning: the validation rows hold no answer token at this --seq-len" in err
    assert json.loads((tmp_path / "m" / "adapter.json").read_text())["training"].get("val") is None
