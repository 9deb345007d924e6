"""Block-diffusion teacher-forcing training (spec/multiblock.md §1.3): packing, noise, layout, loss,
train_block_diffusion and its CLI."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import SMALL_RUN, descend, ids_file, run_cli, tiny_llama, with_mask_row
from unmask.errors import UnmaskError
from unmask.masks import bd_training_mask, block_causal_mask
from unmask.train.block_diffusion import (IGNORE, TFObjective, iid_ratios, mask_by_ratio, mask_counts, masked_ce_loss,
                                          pack_aligned)

VOCAB, MASK = 64, 64


# ---------------------------------------------------------------------------------------------
# Packing, noise and layout
# ---------------------------------------------------------------------------------------------


def test_pack_aligned_starts_every_row_at_a_document():
    docs = [[5, 6, 7], [1, 8, 9, 10, 11], [12], [13, 14, 15, 16]]
    rows = pack_aligned(docs, 4, sep_id=1)
    stream = [1, 5, 6, 7, 1, 8, 9, 10, 11, 1, 12, 1, 13, 14, 15, 16]
    assert rows.tolist() == [stream[0:5], stream[4:9], stream[9:14], stream[11:16]]
    assert bool((rows[:, 0] == 1).all())
    assert pack_aligned([[3, 4]], 4, 1).shape == (0, 5)
    with pytest.raises(UnmaskError):
        pack_aligned(docs, 0, 1)


def test_mask_by_ratio_counts_positions_and_rounding():
    g = torch.Generator().manual_seed(0)
    R, B, K = 64, 8, 6
    maskable = torch.ones(R, K * B, dtype=torch.bool)
    maskable[:, 0] = False  # BOS
    maskable[5, 8:16] = False  # one whole block not maskable
    ratios = torch.rand(R, K, generator=g)
    noise = mask_by_ratio(maskable, ratios, B, g)
    valid = maskable.view(R, K, B).sum(-1)
    assert torch.equal(noise.view(R, K, B).sum(-1), (valid * ratios.double()).floor().long())
    assert not bool((noise & ~maskable).any())
    full = mask_by_ratio(maskable, torch.ones(R, K), B, g)
    assert torch.equal(full, maskable)
    # stochastic rounding: unbiased counts, both ends reachable
    r = torch.full((4000, 1), 0.3)
    n = mask_counts(torch.full((4000, 1), 8), r, "stochastic", g)
    assert set(n.flatten().tolist()) == {2, 3} and n.double().mean().item() == pytest.approx(2.4, abs=0.05)
    # positions are uniform: every maskable position is hit about equally often
    hits = mask_by_ratio(torch.ones(20000, 8, dtype=torch.bool), torch.full((20000, 1), 0.25), 8, g).float().mean(0)
    assert torch.allclose(hits, torch.full((8,), 0.25), atol=0.02)
    with pytest.raises(UnmaskError, match="multiple"):
        mask_by_ratio(torch.ones(1, 7, dtype=torch.bool), torch.ones(1, 1), 8, g)
    with pytest.raises(UnmaskError, match="rounding"):
        mask_counts(valid, ratios, "round", g)


def test_iid_ratios():
    g = torch.Generator().manual_seed(0)
    t = iid_ratios(500, 10, 0.2, 0.6, g)
    assert t.shape == (500, 10) and t.min() >= 0.2 and t.max() <= 0.6 and t.std(dim=1).min() > 0
    s = iid_ratios(50, 10, 0.0, 1.0, g, "sequence")
    assert bool((s == s[:, :1]).all())
    with pytest.raises(UnmaskError, match="noise"):
        iid_ratios(1, 1, 0.0, 1.0, g, "token")


@pytest.mark.parametrize("L,B", [(16, 4), (24, 8), (8, 1)])
def test_tf_batch_layout(L, B):
    obj = TFObjective(mask_token_id=MASK, block_size=B)
    chunks = torch.randint(3, VOCAB, (5, L + 1), generator=torch.Generator().manual_seed(L))
    b = obj.batch(chunks, torch.Generator().manual_seed(1))
    clean, noise = chunks[:, :L], b["noise_mask"]
    assert torch.equal(b["input_ids"], torch.cat([torch.where(noise, MASK, clean), clean], 1))  # [x_t ; x_0]
    assert torch.equal(b["position_ids"], torch.arange(L).repeat(2).expand(5, -1))
    assert torch.equal(b["labels"], torch.where(noise, clean, IGNORE))  # unshifted
    assert not bool(noise[:, 0].any())
    assert torch.equal(b["attention"][0], bd_training_mask(L, B))


def test_tf_objective_refuses_bad_options():
    for bad in [dict(block_size=0), dict(t_low=0.5, t_high=0.2), dict(t_high=1.2), dict(noise="x"),
                dict(rounding="ceil"), dict(prompt_len=-1), dict(mask_token_id=-1)]:
        with pytest.raises(UnmaskError):
            TFObjective(**{"mask_token_id": MASK, "block_size": 4, **bad})
    obj = TFObjective(mask_token_id=MASK, block_size=4)
    with pytest.raises(UnmaskError, match="multiple of the block size"):
        obj.batch(torch.zeros(2, 11, dtype=torch.long), torch.Generator())
    with pytest.raises(UnmaskError, match="nothing to mask"):
        TFObjective(mask_token_id=MASK, block_size=4, prompt_len=8).batch(torch.zeros(2, 9, dtype=torch.long),
                                                                        torch.Generator())


# ---------------------------------------------------------------------------------------------
# Loss (§1.3, §4.4)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_masked_ce_is_the_unshifted_mean_over_masked_positions(impl):
    model = tiny_llama(vocab=VOCAB + 1, seed=1, attn_implementation=impl)
    obj = TFObjective(mask_token_id=MASK, block_size=4)
    b = obj.batch(torch.randint(3, VOCAB, (3, 17), generator=torch.Generator().manual_seed(0)),
                  torch.Generator().manual_seed(2))
    loss, terms = masked_ce_loss(model, b, MASK)
    mask = bd_training_mask(16, 4)[None, None]
    if impl == "eager":
        from unmask.masks import to_additive

        mask = to_additive(mask)
    logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=mask).logits[:, :16]
    logits[..., MASK] = float("-inf")
    ref = F.cross_entropy(logits.reshape(-1, VOCAB + 1), b["labels"].reshape(-1), ignore_index=IGNORE)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    assert int(terms["masked"]) == int((b["labels"] != IGNORE).sum()) and 0 <= float(terms["acc"]) <= 1


def test_noisy_block_logits_equal_an_inference_forward():
    """What block k is trained on is what SingleBD feeds it: the clean prefix (cache) + itself."""
    B, L = 4, 16
    model = tiny_llama(vocab=VOCAB + 1, seed=2)
    chunks = torch.randint(3, VOCAB, (1, L + 1), generator=torch.Generator().manual_seed(0))
    b = TFObjective(mask_token_id=MASK, block_size=B).batch(chunks, torch.Generator().manual_seed(0))
    ids = b["input_ids"]
    with torch.no_grad():
        train = model(input_ids=ids, position_ids=b["position_ids"], attention_mask=b["attention"][None]).logits
        for k in range(L // B):
            seq = torch.cat([ids[:, L : L + k * B], ids[:, k * B : (k + 1) * B]], 1)  # clean prefix, noisy block
            n = seq.shape[1]
            ref = model(input_ids=seq, position_ids=torch.arange(n)[None],
                        attention_mask=block_causal_mask(n, B)[None, None]).logits
            torch.testing.assert_close(train[:, k * B : (k + 1) * B], ref[:, -B:], atol=1e-5, rtol=1e-5)


def test_tf_loss_decreases_in_20_steps():
    model = with_mask_row(tiny_llama(vocab=VOCAB, seed=0).train())
    obj = TFObjective(mask_token_id=MASK, block_size=4)
    g = torch.Generator().manual_seed(0)
    motifs = torch.randint(3, VOCAB, (8, 3), generator=g)
    chunks = motifs.repeat(1, 9)[:, :25]  # (8, 25) repeated motifs: learnable

    def val() -> float:
        with torch.no_grad():
            return float(masked_ce_loss(model, obj.batch(chunks, torch.Generator().manual_seed(99)), MASK)[0])

    before = val()
    descend(model, obj, chunks, g, steps=20, lr=1e-2)
    assert val() < 0.6 * before


# ---------------------------------------------------------------------------------------------
# train_block_diffusion and the CLI (on the shipped stories260K)
# ---------------------------------------------------------------------------------------------


def test_train_block_diffusion_writes_a_decodable_model(tmp_path):
    import unmask
    from unmask.train.block_diffusion import train_block_diffusion

    out = tmp_path / "bd"
    result = train_block_diffusion(base="stories260K", block_size=8, data=ids_file(tmp_path / "d.jsonl"), out=out,
                                   rounding="stochastic", **SMALL_RUN)
    assert result.out == out and result.step == 3
    bundle = unmask.load(str(out))
    assert bundle.kind == "block-diffusion" and bundle.block_size == 8 and bundle.mask_token_id == 512
    assert bundle.stop_token_ids == (2, 1)
    meta = json.loads((out / "unmask_config.json").read_text())
    assert {k: meta[k] for k in ("kind", "block_size", "mask_token_id", "stop_token_ids")} == {
        "kind": "block-diffusion", "block_size": 8, "mask_token_id": 512, "stop_token_ids": [2, 1]}
    assert meta["training"]["objective_config"]["rounding"] == "stochastic" and meta["training"]["step"] == 3
    for decoder in ("block", "multiblock"):
        gen = unmask.generate(["Once upon a time", "Tom had a ball"], bundle, decoder, max_new_tokens=20)
        assert gen.stats.nfe >= 1 and all(len(t) <= 20 for t in gen.tokens)
    # continuing a block-diffusion model keeps its mask token and block size
    again = train_block_diffusion(base=str(out), data=ids_file(tmp_path / "d.jsonl"), out=tmp_path / "bd2", **SMALL_RUN)
    assert unmask.load(str(again.out)).mask_token_id == 512


def test_train_block_diffusion_refuses_bad_input(tmp_path):
    from unmask.train.block_diffusion import train_block_diffusion

    data = ids_file(tmp_path / "d.jsonl")
    o = tmp_path / "o"
    with pytest.raises(UnmaskError, match="--block-size"):
        train_block_diffusion(base="stories260K", data=data, out=o, **SMALL_RUN)
    with pytest.raises(UnmaskError, match="multiple of the block size"):
        train_block_diffusion(base="stories260K", block_size=5, data=data, out=o, **SMALL_RUN)
    with pytest.raises(UnmaskError, match="not found"):
        train_block_diffusion(base="stories260K", block_size=8, data=tmp_path / "missing.jsonl", out=o, **SMALL_RUN)
    with pytest.raises(UnmaskError, match="fewer than one sequence"):
        train_block_diffusion(base="stories260K", block_size=8, data=ids_file(tmp_path / "s.jsonl", 1, 10), out=o,
                              **SMALL_RUN)
    with pytest.raises(UnmaskError, match="noise"):
        train_block_diffusion(base="stories260K", block_size=8, data=data, out=o, noise="token", **SMALL_RUN)
    with pytest.raises(UnmaskError, match="context"):
        train_block_diffusion(base="stories260K", block_size=8, data=data, out=o, **{**SMALL_RUN, "seq_len": 1024})
    sbd = tmp_path / "sbd"  # a model of another kind
    import unmask
    from unmask.models.mask_token import add_mask_token

    stories = unmask.load("stories260K")
    add_mask_token(stories.model)
    stories.model.save_pretrained(sbd)
    stories.tokenizer.save_pretrained(sbd)
    (sbd / "unmask_config.json").write_text(json.dumps({"kind": "sbd", "mask_token_id": 512}))
    with pytest.raises(UnmaskError, match="sbd model"):
        train_block_diffusion(base=str(sbd), block_size=8, data=data, out=o, **SMALL_RUN)
    (tmp_path / "exists").mkdir()
    with pytest.raises(UnmaskError, match="already exists"):
        train_block_diffusion(base="stories260K", block_size=8, data=data, out=tmp_path / "exists", **SMALL_RUN)


def test_block_size_must_match_a_block_diffusion_base(tmp_path):
    from unmask.train.block_diffusion import train_block_diffusion

    data = ids_file(tmp_path / "d.jsonl")
    bd = train_block_diffusion(base="stories260K", block_size=4, data=data, out=tmp_path / "bd", **SMALL_RUN).out
    with pytest.raises(UnmaskError, match="disagrees"):
        train_block_diffusion(base=str(bd), block_size=8, data=data, out=tmp_path / "x", **SMALL_RUN)


def test_cli_train_block_diffusion(tmp_path, capsys):
    data = str(ids_file(tmp_path / "d.jsonl"))
    args = ["train", "block-diffusion", "--block-size", "8", "--data", data, "--out", str(tmp_path / "m"),
            "--seq-len", "32", "--batch-size", "2", "--warmup", "1", "--ckpt-every", "2", "--eval-every", "0"]
    code, out, err = run_cli(capsys, *args, "--steps", "2")
    assert code == 0 and "wrote" in out and "mat" in out
    code, out, err = run_cli(capsys, *args, "--steps", "4", "--resume")
    assert code == 0 and "after 4 steps" in out
    code, out, err = run_cli(capsys, *args, "--steps", "2")
    assert code == 2 and "already exists" in err and err.count("\n") == 1
    code, out, err = run_cli(capsys, "train", "block-diffusion", "--data", data, "--out", tmp_path / "n", "--seq-len",
                             "32")
    assert code == 2 and "--block-size" in err
