"""AR-to-diffusion adaptation (spec/diffusion.md §1–2): the loss, the noising, BOS-led packing,
the objective on a tiny model, train_diffusion's published directory and its CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import SMALL_RUN, ids_file, run_cli, tiny_llama, with_mask_row
from unmask.errors import UnmaskError
from unmask.train.diffusion import MaskedDiffusionObjective, diffusion_batch, pack_bos_chunks
from unmask.train.loop import TrainConfig, evaluate, latest_checkpoint, train
from unmask.train.objectives import masked_diffusion_loss, masked_token_nll

VOCAB, MASK = 64, 64


def _manual(logits, x0, masked, t, shift, norm, maskable=None, mask_id=None):
    """The §1 objective written as loops, straight from the formula."""
    B, T, V = logits.shape
    if maskable is None:
        maskable = torch.ones(B, T, dtype=torch.bool)
        if shift:
            maskable[:, 0] = False
    per_row, counts = [], []
    for b in range(B):
        s = 0.0
        for i in range(T):
            if masked[b, i]:
                row = logits[b, i - 1 if shift else i].clone()
                if mask_id is not None:
                    row[mask_id] = float("-inf")
                s += -torch.log_softmax(row, -1)[x0[b, i]] / t[b]
        per_row.append(s)
        counts.append(int(maskable[b].sum()))
    if norm == "token":
        return sum(per_row) / sum(counts)
    if norm == "sequence":
        return sum(p / n for p, n in zip(per_row, counts) if n) / sum(1 for n in counts if n)
    return sum(per_row) / B


def _case(seed=0, B=3, T=7, V=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    x0 = torch.randint(0, V - 1, (B, T), generator=g)
    masked = torch.rand(B, T, generator=g) < 0.5
    masked[:, 0] = False
    masked[0, 3] = True
    t = torch.tensor([0.25, 0.5, 0.9])[:B]
    return logits, x0, masked, t


# ---------------------------------------------------------------------------------------------
# The loss (diffusion.md §1)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["token", "sequence", "batch"])
@pytest.mark.parametrize("shift", [False, True])
def test_loss_matches_the_formula(norm, shift):
    logits, x0, masked, t = _case()
    maskable = torch.ones_like(masked)
    maskable[:, 0] = False
    maskable[2, :3] = False  # a prompt prefix on row 2 (not masked there)
    masked &= maskable
    got = masked_diffusion_loss(logits, x0, masked, t, shift, norm, maskable=maskable, mask_id=10)
    torch.testing.assert_close(got, _manual(logits, x0, masked, t, shift, norm, maskable, mask_id=10))
    got.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[..., 10].abs().max() == 0  # no gradient to m


def test_inverse_t_weight_and_token_normalisation_by_hand():
    # V = 2, uniform logits: every masked token costs log 2. Row 0: 2 masked of 4, t = 0.5;
    # row 1: 1 masked of 4, t = 0.25. Token norm: (2 log2 / 0.5 + log2 / 0.25) / 8 = log 2.
    logits = torch.zeros(2, 4, 2)
    x0 = torch.zeros(2, 4, dtype=torch.long)
    masked = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 1]], dtype=torch.bool)
    t = torch.tensor([0.5, 0.25])
    log2 = math.log(2)
    assert masked_diffusion_loss(logits, x0, masked, t, False).item() == pytest.approx(log2)
    assert masked_diffusion_loss(logits, x0, masked, t, False, "batch").item() == pytest.approx(8 * log2 / 2)
    assert masked_diffusion_loss(logits, x0, masked, t, False, "sequence").item() == pytest.approx(log2)
    doubled = masked_diffusion_loss(logits, x0, masked, 2 * t, False)
    assert doubled.item() == pytest.approx(log2 / 2)  # 1/t: twice the ratio, half the weight


def test_shift_reads_position_i_from_logits_at_i_minus_1():
    x0 = torch.tensor([[1, 3, 0, 2]])
    logits = torch.full((1, 4, 5), -30.0)
    for i in range(1, 4):
        logits[0, i - 1, x0[0, i]] = 30.0  # row i-1 is certain of token i
    masked = torch.tensor([[False, True, True, True]])
    t = torch.tensor([1.0])
    assert masked_diffusion_loss(logits, x0, masked, t, True).item() < 1e-6
    assert masked_diffusion_loss(logits, x0, masked, t, False).item() > 10  # unshifted reads the wrong rows
    nll = masked_token_nll(logits, x0, masked, True)
    assert nll.shape == (1, 4) and nll[0, 0] == 0


def test_mask_logit_is_minus_infinity():
    logits = torch.zeros(1, 3, 4)
    logits[..., 3] = 50.0  # the mask row would take all the mass
    x0 = torch.tensor([[1, 2, 0]])
    masked = torch.tensor([[False, True, True]])
    t = torch.ones(1)
    with_m = masked_diffusion_loss(logits, x0, masked, t, True, mask_id=3)
    assert with_m.item() == pytest.approx(math.log(3) * 2 / 2)  # uniform over the 3 real tokens
    assert masked_diffusion_loss(logits, x0, masked, t, True).item() > 40


def test_loss_refuses_bad_inputs():
    logits, x0, masked, t = _case()
    with pytest.raises(UnmaskError, match="position 0"):
        bad = masked.clone()
        bad[1, 0] = True
        masked_diffusion_loss(logits, x0, bad, t, True)
    with pytest.raises(UnmaskError, match="normalisation"):
        masked_diffusion_loss(logits, x0, masked, t, True, "mean")
    with pytest.raises(UnmaskError, match=r"\(0, 1\]"):
        masked_diffusion_loss(logits, x0, masked, torch.tensor([0.0, 0.5, 0.5]), True)
    with pytest.raises(UnmaskError, match="outside `maskable`"):
        masked_diffusion_loss(logits, x0, masked, t, True, maskable=torch.zeros_like(masked))
    with pytest.raises(UnmaskError, match="one mask ratio per row"):
        masked_diffusion_loss(logits, x0, masked, t[:2], True)


# ---------------------------------------------------------------------------------------------
# Noising and packing
# ---------------------------------------------------------------------------------------------


def test_noising_keeps_bos_and_prefixes_clean():
    chunks = torch.randint(3, VOCAB, (4000, 33), generator=torch.Generator().manual_seed(0))
    chunks[:, 0] = 1
    b = diffusion_batch(chunks, MASK, torch.Generator().manual_seed(1), prefix_prob=0.5)
    masked, maskable, t, c = b["masked"], b["maskable"], b["t"], b["prefix"]
    assert not masked[:, 0].any() and not maskable[:, 0].any()  # BOS never masked
    assert torch.equal(maskable, torch.arange(33)[None, :] >= c[:, None])  # clean prefix of length c
    assert not (masked & ~maskable).any()
    assert torch.equal(b["input_ids"], torch.where(masked, MASK, chunks))
    assert t.min() >= 1e-3 and t.max() < 1
    assert 0.45 < (c > 1).float().mean() < 0.55  # half the rows keep a prefix (c = 1: BOS only, p = 1/32)
    frac = masked.sum(1) / maskable.sum(1)  # (B,)
    full = c == 1
    assert (frac[full] - t[full]).abs().mean() < 0.08  # each token masked with probability t
    assert set(c[~full].unique().tolist()) == set(range(2, 33))  # prefix lengths cover the range
    b0 = diffusion_batch(chunks[:100], MASK, torch.Generator().manual_seed(1), prefix_prob=0.0)
    assert (b0["prefix"] == 1).all()


def test_pack_bos_chunks_starts_every_chunk_with_bos():
    docs = [[5, 6, 7], [1, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18]]
    chunks = pack_bos_chunks(docs, 3, 1)
    assert chunks.tolist() == [[1, 5, 6, 7], [1, 8, 9, 10], [1, 11, 12, 1], [1, 13, 14, 15], [1, 16, 17, 18]]
    assert pack_bos_chunks([[5]], 4, 1).shape == (0, 5)
    with pytest.raises(UnmaskError):
        pack_bos_chunks(docs, 0, 1)


# ---------------------------------------------------------------------------------------------
# The objective on a tiny model
# ---------------------------------------------------------------------------------------------


def _motif_chunks(n=8, L=24, seed=0):
    """BOS + a short random motif repeated: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    motifs = torch.randint(3, VOCAB, (n, 4), generator=g)  # (n, 4)
    body = motifs.repeat(1, L // 4 + 1)[:, :L]  # (n, L)
    return torch.cat([torch.ones(n, 1, dtype=torch.long), body], dim=1)  # (n, L + 1)


def test_objective_forward_is_bidirectional_with_shift():
    model = with_mask_row(tiny_llama(vocab=VOCAB))
    objective = MaskedDiffusionObjective(MASK)
    chunks = _motif_chunks(2, 12)
    loss, terms = objective.loss(model, chunks, torch.Generator().manual_seed(0))
    b = diffusion_batch(chunks, MASK, torch.Generator().manual_seed(0))
    from unmask.compat import forward

    pos = torch.arange(13).expand(2, 13)
    logits = forward(model, b["input_ids"], position_ids=pos, is_causal=False)  # (2, 13, V)
    expected = masked_diffusion_loss(logits, chunks, b["masked"], b["t"], True, maskable=b["maskable"], mask_id=MASK)
    torch.testing.assert_close(loss, expected)
    ids = b["input_ids"].clone()
    ids[:, -1] = (ids[:, -1] + 1) % VOCAB
    later = forward(model, ids, position_ids=pos, is_causal=False)
    assert (later[:, 0] - logits[:, 0]).abs().max() > 1e-6  # the last token reaches position 0
    assert 0 < terms["masked"] <= 1


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_twenty_steps_lower_the_loss(impl, tmp_path):
    model = with_mask_row(tiny_llama(vocab=VOCAB, attn_implementation=impl))
    objective = MaskedDiffusionObjective(MASK)
    data = _motif_chunks(8, 24)
    cfg = TrainConfig(lr=1e-2, warmup=2, steps=20, batch_size=4, ckpt_every=0, eval_every=0, log_every=5,
                      eval_batches=2)
    before = evaluate(model, objective, data, cfg, "cpu")
    result = train(model, objective, data, data, cfg, tmp_path)
    assert result.step == 20 and result.stopped == "done"
    assert result.val["loss"] < 0.85 * before["loss"], (before, result.val)
    assert result.val["nll"] < 0.85 * before["nll"], (before, result.val)


# ---------------------------------------------------------------------------------------------
# train_diffusion and the CLI (on the shipped stories260K)
# ---------------------------------------------------------------------------------------------


def test_train_diffusion_writes_a_loadable_dllm(tmp_path):
    import unmask
    from unmask.train.diffusion import train_diffusion

    out = tmp_path / "dlm"
    result = train_diffusion(base="stories260K", data=ids_file(tmp_path / "d.jsonl"), out=out, **SMALL_RUN)
    assert result.out == out and result.step == 3
    bundle = unmask.load(str(out))
    assert bundle.kind == "masked-diffusion" and bundle.logit_shift == 1 and bundle.mask_token_id == 512
    assert bundle.stop_token_ids == (2, 1) and bundle.model.get_input_embeddings().weight.shape[0] == 513
    meta = json.loads((out / "unmask_config.json").read_text())
    assert meta["kind"] == "masked-diffusion" and meta["logit_shift"] == 1 and meta["version"] == 1
    assert meta["training"]["step"] == 3 and set(meta["training"]["val"]) >= {"loss", "nll"}
    for cache in ("none", "prefix"):
        gen = unmask.generate(["Once upon a time", "Tom had a ball."], model=bundle, decoder="diffusion",
                              max_new_tokens=16, block_size=8, cache=cache)
        assert len(gen.tokens) == 2 and gen.stats.nfe >= 1 and all(512 not in row for row in gen.tokens)
    ckpt = unmask.load(str(latest_checkpoint(tmp_path / "dlm.run")))
    assert ckpt.kind == "masked-diffusion" and ckpt.mask_token_id == 512  # checkpoints load as dLLMs too


def test_train_diffusion_refuses_bad_input(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    import unmask
    from unmask.train.diffusion import train_diffusion

    data = ids_file(tmp_path / "d.jsonl")
    (tmp_path / "exists").mkdir()
    with pytest.raises(UnmaskError, match="already exists"):
        train_diffusion(base="stories260K", data=data, out=tmp_path / "exists", **SMALL_RUN)
    with pytest.raises(UnmaskError, match="not found"):
        train_diffusion(base="stories260K", data=tmp_path / "missing.jsonl", out=tmp_path / "o", **SMALL_RUN)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UnmaskError, match="empty"):
        train_diffusion(base="stories260K", data=tmp_path / "empty.txt", out=tmp_path / "o", **SMALL_RUN)
    with pytest.raises(UnmaskError, match="fewer than one sequence"):
        train_diffusion(base="stories260K", data=ids_file(tmp_path / "s.jsonl", 1, 10), out=tmp_path / "o", **SMALL_RUN)
    with pytest.raises(UnmaskError, match="normalisation"):
        train_diffusion(base="stories260K", data=data, out=tmp_path / "o", norm="mean", **SMALL_RUN)
    with pytest.raises(UnmaskError, match="seq-len"):
        train_diffusion(base="stories260K", data=data, out=tmp_path / "o", **{**SMALL_RUN, "seq_len": 512})
    base = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(base)
    unmask.load("stories260K").tokenizer.save_pretrained(base)
    with pytest.raises(UnmaskError, match="not a transformers decoder-only LM"):
        train_diffusion(base=str(base), data=data, out=tmp_path / "o", **SMALL_RUN)
    assert not (tmp_path / "o").exists()


def test_cli_train_diffusion(tmp_path, capsys):
    data = str(ids_file(tmp_path / "d.jsonl"))
    args = ["train", "diffusion", "--data", data, "--out", str(tmp_path / "m"), "--seq-len", "32", "--batch-size",
            "2", "--warmup", "1", "--ckpt-every", "0", "--eval-every", "0", "--steps", "2"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0 and "wrote" in out and "after 2 steps" in out
    assert json.loads((tmp_path / "m" / "unmask_config.json").read_text())["kind"] == "masked-diffusion"
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and err.count("\n") == 1 and "already exists" in err
    code, out, err = run_cli(capsys, "train", "diffusion", "--out", str(tmp_path / "n"))
    assert code == 2 and err.startswith("error:") and "--data" in err
    missing = str(tmp_path / "nope.jsonl")
    code, out, err = run_cli(capsys, "train", "diffusion", "--data", missing, "--out", str(tmp_path / "n"))
    assert code == 2 and "not found" in err and err.count("\n") == 1
