"""SBD training (spec/sbd.md §3): layout, Eq. 14 loss, the loop's resume/atomicity, train_sbd and its CLI."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from dataclasses import replace

import pytest
import torch

from conftest import SMALL_RUN, ids_file, run_cli, tiny_llama, tiny_qwen3, with_mask_row
from unmask.errors import UnmaskError
from unmask.train import loop
from unmask.train.loop import TrainConfig, checkpoints, evaluate, latest_checkpoint, save_checkpoint, train
from unmask.train.objectives import IGNORE, SBDObjective, sample_block_size, sbd_attention_mask, sbd_batch, sbd_loss

VOCAB, MASK = 64, 64  # tiny models get one extra row for the mask token


def _chunks(n: int = 8, L: int = 24, seed: int = 0) -> torch.Tensor:
    """A few fixed, learnable sequences: each row repeats a short random motif."""
    g = torch.Generator().manual_seed(seed)
    motifs = torch.randint(3, VOCAB, (n, 5), generator=g)  # (n, 5)
    return motifs.repeat(1, (L + 1) // 5 + 1)[:, : L + 1].contiguous()  # (n, L+1)


# ---------------------------------------------------------------------------------------------
# Layout (sbd.md §3.1–3.2) and loss (§3.4)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L,k", [(8, 3), (12, 4), (16, 16), (10, 2), (7, 16)])
def test_sbd_batch_layout(L, k):
    chunks = torch.randint(0, VOCAB, (6, L + 1), generator=torch.Generator().manual_seed(L * 31 + k))
    b = sbd_batch(chunks, MASK, k, torch.Generator().manual_seed(1))
    ids, labels, pos, noise = b["input_ids"], b["labels"], b["position_ids"], b["noise_mask"]
    assert ids.shape == labels.shape == pos.shape == (6, 2 * L) and noise.shape == (6, L)
    assert torch.equal(ids[:, :L], chunks[:, :-1])  # clean copy
    assert torch.equal(labels[:, :L], chunks[:, 1:])  # NTP targets, shifted
    assert torch.equal(ids[:, L:], torch.where(noise, MASK, chunks[:, :-1]))  # noisy copy
    assert torch.equal(pos, torch.cat([torch.arange(L), torch.arange(L)]).expand(6, -1))  # repeated positions
    complete = torch.arange(L) < (L // k) * k  # (L,)
    scored = labels[:, L:] != IGNORE
    assert torch.equal(scored, noise & complete)  # exactly the masked positions of complete blocks
    assert torch.equal(labels[:, L:][scored], chunks[:, :-1][scored])  # unshifted targets
    assert (labels[:, L:][:, ~complete] == IGNORE).all()  # the tail block is never scored


def test_noise_level_is_per_sequence():
    b = sbd_batch(torch.zeros(64, 2001, dtype=torch.long), MASK, 4, torch.Generator().manual_seed(0))
    frac = b["noise_mask"].float().mean(dim=1)  # (64,)
    assert torch.allclose(frac, b["eta"], atol=0.05)  # η ~ U(0,1) drawn per row
    assert b["eta"].min() < 0.2 and b["eta"].max() > 0.8


def test_block_size_is_uniform_on_2_to_16():
    g = torch.Generator().manual_seed(0)
    draws = [sample_block_size(g) for _ in range(3000)]
    assert set(draws) == set(range(2, 17))
    objective = SBDObjective(MASK)
    assert {objective.step_params(g)["k"] for _ in range(500)} == set(range(2, 17))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_sbd_loss_is_eq14_with_mask_logit_suppressed(impl):
    model = with_mask_row(tiny_llama(vocab=VOCAB, attn_implementation=impl))
    L, k = 12, 4
    b = sbd_batch(_chunks(3, L), MASK, k, torch.Generator().manual_seed(3))
    loss, terms = sbd_loss(model, b, k, MASK)
    attn = sbd_attention_mask(model, L, k, "cpu")
    assert attn.dtype == (torch.bool if impl == "sdpa" else torch.float32)
    logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=attn.expand(3, -1, -1, -1)).logits
    logits[..., MASK] = float("-inf")
    logp = torch.log_softmax(logits, -1)  # (B, 2L, V)
    labels = b["labels"]
    valid = labels != IGNORE
    nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]  # (B, 2L)
    torch.testing.assert_close(loss, nll[valid].mean())
    torch.testing.assert_close(terms["ntp"], nll[:, :L][valid[:, :L]].mean())
    torch.testing.assert_close(terms["mat"], nll[:, L:][valid[:, L:]].mean())
    loss.backward()
    assert torch.isfinite(loss)


def test_noisy_block_only_reaches_its_own_block():
    """sbd.md §3.8: perturbing a noisy token in block b changes neither the clean half nor other blocks."""
    model = with_mask_row(tiny_llama(vocab=VOCAB))
    L, k = 12, 4
    b = sbd_batch(_chunks(1, L), MASK, k, torch.Generator().manual_seed(0))
    attn = sbd_attention_mask(model, L, k, "cpu")

    def logits(ids):
        return model(input_ids=ids, position_ids=b["position_ids"], attention_mask=attn).logits[0]

    base = logits(b["input_ids"])
    ids = b["input_ids"].clone()
    ids[0, L + 5] = (ids[0, L + 5] + 1) % VOCAB  # a noisy token of block 1
    after = logits(ids)
    changed = (after - base).abs().amax(-1) > 1e-6  # (2L,)
    assert changed[L + 4 : L + 8].any()
    assert not changed[:L].any() and not changed[L : L + 4].any() and not changed[L + 8 :].any()


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

FAST = TrainConfig(lr=1e-2, warmup=2, steps=20, batch_size=4, clip=1.0, ckpt_every=0, eval_every=0, log_every=5,
                   eval_batches=2, seed=0)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_twenty_steps_lower_both_terms(factory, tmp_path):
    model = with_mask_row(factory(vocab=VOCAB))
    objective = SBDObjective(MASK)
    data = _chunks(8, 24)
    before = evaluate(model, objective, data, FAST, "cpu")
    result = train(model, objective, data, data, FAST, tmp_path)
    after = result.val
    assert result.step == 20 and result.stopped == "done"
    assert after["ntp"] < 0.7 * before["ntp"], (before, after)
    assert after["mat"] < 0.8 * before["mat"], (before, after)
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert {"ntp", "mat", "tok_s", "lr"} <= set(lines[0])


def test_evaluate_spreads_its_rows_over_the_whole_validation_set():
    # Rows grouped by source (8 of one kind, then 8 of another): with room for 4 rows the score
    # must see both groups, not just the first rows.
    seen = []

    class Recorder:
        name, term_names = "rec", ("first",)

        def step_params(self, g):
            return {}

        def loss(self, model, batch, g):
            seen.extend(batch[:, 0].tolist())
            return torch.tensor(0.0), {"first": torch.tensor(float(batch[:, 0].float().mean()))}

    rows = torch.cat([torch.zeros(8, 5, dtype=torch.long), torch.ones(8, 5, dtype=torch.long)])  # (16, 5)
    cfg = replace(FAST, batch_size=2, eval_batches=2)
    out = evaluate(torch.nn.Linear(1, 1), Recorder(), rows, cfg, "cpu")
    assert len(seen) == 4 and set(seen) == {0, 1} and out["first"] == 0.5
    seen.clear()
    evaluate(torch.nn.Linear(1, 1), Recorder(), rows[:3], cfg, "cpu")  # fewer rows than room: all of them
    assert seen == [0, 0, 0]


class _InterruptAt:
    """SBDObjective that sends itself SIGINT during optimizer step ``at`` (1-based)."""

    def __init__(self, inner, at: int):
        self.inner, self.at, self.calls, self.sent = inner, at, 0, False
        self.name, self.term_names = inner.name, inner.term_names

    def step_params(self, generator):
        self.calls += 1
        return self.inner.step_params(generator)

    def loss(self, model, chunks, generator, **params):
        if self.calls == self.at and not self.sent:  # once: a second SIGINT interrupts at once
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return self.inner.loss(model, chunks, generator, **params)


def test_interrupt_then_resume_is_bit_identical(tmp_path):
    cfg = replace(FAST, steps=8, grad_accum=2, weight_decay=0.1, ckpt_every=3)
    data = _chunks(8, 16)
    straight = with_mask_row(tiny_llama(vocab=VOCAB))
    train(straight, SBDObjective(MASK), data, data, cfg, tmp_path / "a")

    model = with_mask_row(tiny_llama(vocab=VOCAB))
    first = train(model, _InterruptAt(SBDObjective(MASK), 4), data, data, cfg, tmp_path / "b")
    assert first.stopped == "interrupted" and first.step == 4
    assert [p.name for p in checkpoints(tmp_path / "b")] == ["step-00000004"]  # keep_checkpoints=1
    resumed_model = with_mask_row(tiny_llama(vocab=VOCAB, seed=123))  # different weights: must be overwritten
    second = train(resumed_model, SBDObjective(MASK), data, data, cfg, tmp_path / "b", resume=True)
    assert second.step == 8 and second.stopped == "done"
    for (name, p), q in zip(straight.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name


def test_resume_refuses_changed_settings(tmp_path):
    data = _chunks(8, 16)
    train(with_mask_row(tiny_llama(vocab=VOCAB)), SBDObjective(MASK), data, None, replace(FAST, steps=2), tmp_path)
    with pytest.raises(UnmaskError, match="lr="):
        train(with_mask_row(tiny_llama(vocab=VOCAB)), SBDObjective(MASK), data, None,
              replace(FAST, steps=4, lr=5e-3), tmp_path, resume=True)


def test_time_budget_stops_cleanly_and_saves(tmp_path):
    cfg = replace(FAST, steps=10_000, max_minutes=1e-4)  # 6 ms: stops after the first step or so
    result = train(with_mask_row(tiny_llama(vocab=VOCAB)), SBDObjective(MASK), _chunks(4, 16), None, cfg, tmp_path)
    assert result.stopped == "time" and result.step < 10_000
    assert latest_checkpoint(tmp_path).name == f"step-{result.step:08d}"


def test_crash_during_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    model = with_mask_row(tiny_llama(vocab=VOCAB))
    good = save_checkpoint(tmp_path, 2, model, {"step": 2})
    before = (good / "model.safetensors").read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(loop.torch, "save", crash)  # fails after the weights are written
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(UnmaskError, match="cannot write checkpoint .*disk full"):  # one line, not a traceback
        save_checkpoint(tmp_path, 4, model, {"step": 4})
    assert checkpoints(tmp_path) == [good]
    assert (good / "model.safetensors").read_bytes() == before
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000002"]  # no staging left
    (tmp_path / "checkpoints" / ".step-00000006.killed").mkdir()  # what a SIGKILL mid-write leaves
    assert latest_checkpoint(tmp_path) == good


# ---------------------------------------------------------------------------------------------
# train_sbd and the CLI (on the shipped stories260K and a tiny Qwen3 directory)
# ---------------------------------------------------------------------------------------------


def test_train_sbd_writes_a_loadable_sbd_model(tmp_path):
    import unmask
    from unmask.train import train_sbd

    out = tmp_path / "model"
    result = train_sbd(base="stories260K", data=ids_file(tmp_path / "d.jsonl"), out=out, **SMALL_RUN)
    assert result.out == out and result.step == 3
    bundle = unmask.load(str(out))
    assert bundle.kind == "sbd" and bundle.mask_token_id == 512 and bundle.stop_token_ids == (2, 1)
    assert bundle.model.get_input_embeddings().weight.shape[0] == 513
    meta = json.loads((out / "unmask_config.json").read_text())
    assert meta["train_block_range"] == [2, 16] and meta["version"] == 1 and meta["base"] == "stories260K"
    # a new SBD model decodes losslessly by default: its greedy text is its own AR text
    assert meta["decode_defaults"] == {"verify": True, "verify_block_size": 8, "draft": "linear"}
    out_sbd = unmask.generate("Once upon a time", bundle, max_new_tokens=12)
    assert out_sbd.stats.extra["verify"] is True
    assert out_sbd.tokens == unmask.generate("Once upon a time", bundle, "ar", max_new_tokens=12).tokens
    assert meta["training"]["step"] == 3 and set(meta["training"]["val"]) >= {"ntp", "mat"}
    data = tmp_path / "d.jsonl"  # provenance without the machine's absolute path
    assert meta["training"]["data"] == [{"name": "d.jsonl", "bytes": data.stat().st_size,
                                         "sha256": hashlib.sha256(data.read_bytes()).hexdigest()}]
    assert unmask.load(str(latest_checkpoint(tmp_path / "model.run"))).kind == "sbd"  # checkpoints load too


def test_train_sbd_on_a_qwen3_directory(tmp_path):
    import unmask
    from unmask.train import train_sbd

    stories = unmask.load("stories260K")
    base = tmp_path / "qwen3"
    tiny_qwen3(vocab=512).save_pretrained(base)
    stories.tokenizer.save_pretrained(base)
    out = tmp_path / "out"
    train_sbd(base=str(base), data=ids_file(tmp_path / "d.jsonl"), out=out, **SMALL_RUN)
    bundle = unmask.load(str(out))
    assert type(bundle.model).__name__ == "Qwen3ForCausalLM" and bundle.kind == "sbd" and bundle.mask_token_id == 512


def test_train_sbd_refuses_bad_input(tmp_path):
    from unmask.train import train_sbd

    data = ids_file(tmp_path / "d.jsonl")
    (tmp_path / "exists").mkdir()
    with pytest.raises(UnmaskError, match="already exists"):
        train_sbd(base="stories260K", data=data, out=tmp_path / "exists", **SMALL_RUN)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UnmaskError, match="empty"):
        train_sbd(base="stories260K", data=tmp_path / "empty.txt", out=tmp_path / "o", **SMALL_RUN)
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    with pytest.raises(UnmaskError, match="no document"):
        train_sbd(base="stories260K", data=tmp_path / "blank.txt", out=tmp_path / "o", **SMALL_RUN)
    with pytest.raises(UnmaskError, match="not found"):
        train_sbd(base="stories260K", data=tmp_path / "missing.jsonl", out=tmp_path / "o", **SMALL_RUN)
    with pytest.raises(UnmaskError, match="fewer than one sequence"):
        train_sbd(base="stories260K", data=ids_file(tmp_path / "short.jsonl", 1, 10), out=tmp_path / "o", **SMALL_RUN)


def test_train_sbd_refuses_a_non_causal_base(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    import unmask
    from unmask.train import train_sbd

    base = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(base)
    unmask.load("stories260K").tokenizer.save_pretrained(base)
    with pytest.raises(UnmaskError, match="not a decoder-only causal LM"):
        train_sbd(base=str(base), data=ids_file(tmp_path / "d.jsonl"), out=tmp_path / "o", **SMALL_RUN)


def test_cli_train_sbd_resume_and_errors(tmp_path, capsys):
    data = str(ids_file(tmp_path / "d.jsonl"))
    args = ["train", "sbd", "--data", data, "--out", str(tmp_path / "m"), "--seq-len", "32", "--batch-size", "2",
            "--warmup", "1", "--ckpt-every", "2", "--eval-every", "0"]
    code, out, err = run_cli(capsys, *args, "--steps", "2")
    assert code == 0 and "wrote" in out
    code, out, err = run_cli(capsys, *args, "--steps", "2")
    assert code == 2 and err.count("\n") == 1 and "already exists" in err
    code, out, err = run_cli(capsys, *args, "--steps", "4", "--resume")  # continues the finished run from step 2
    assert code == 0 and "after 4 steps" in out
    assert json.loads((tmp_path / "m" / "unmask_config.json").read_text())["training"]["step"] == 4
    (tmp_path / "empty.jsonl").write_text("")
    code, out, err = run_cli(capsys, "train", "sbd", "--data", tmp_path / "empty.jsonl", "--out", tmp_path / "n")
    assert code == 2 and err.startswith("error:") and "empty" in err and err.count("\n") == 1


def test_set_decode_defaults_feeds_the_sbd_decoder(tmp_path):
    import unmask
    from unmask.train import train_sbd
    from unmask.train.wiring import set_decode_defaults

    out = tmp_path / "model"
    train_sbd(base="stories260K", data=ids_file(tmp_path / "d.jsonl"), out=out, **SMALL_RUN)
    meta = set_decode_defaults(out, block_size=4, gamma=0.6)
    assert meta["decode_defaults"] == {"block_size": 4, "gamma": 0.6} and meta["kind"] == "sbd"
    res = unmask.generate("Once upon a time", str(out), max_new_tokens=8)
    assert res.stats.extra["block_size"] == 4 and res.stats.extra["policy"] == "entropy-bound"
    with pytest.raises(UnmaskError, match="γ|gamma"):
        set_decode_defaults(out, block_size=4, gamma=-1)
    with pytest.raises(UnmaskError, match="no unmask_config.json"):
        set_decode_defaults(tmp_path, block_size=4, gamma=0.1)
