"""Self-distilled block mode (spec/sbd_exact.md §5.5, issue 26 item 3): the CE + λ·KL loss against a
hand computation, the detached teacher, the frozen base of an adapter, --distill's one-line errors,
and short end-to-end runs (SBD from a causal base, an SBD fine-tune, an adapter from --init)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import unmask
from conftest import SMALL_RUN, ids_file, one_line_error, run_cli, tiny_llama, tiny_qwen3, with_mask_row
from unmask.compat import forward
from unmask.models.adapter_io import ADAPTER_JSON, weights_hash
from unmask.models.sbd_adapter import AdapterSpec, attach
from unmask.train.objectives import IGNORE, SBDObjective, sbd_attention_mask, sbd_batch, sbd_loss
from unmask.train.sbd_adapter import AdapterObjective, adapter_loss
from unmask.train.sbd_distill import chunked_kl, kl_to_teacher, sbd_distill_loss, teacher_pairs

V = 64  # tiny vocabulary; the mask token is id V (one added row)
FACTORIES = {"llama": tiny_llama, "qwen3": tiny_qwen3}


def _hand_kl(student: torch.Tensor, teacher: torch.Tensor, drop: int) -> torch.Tensor:
    """Σ_v p_t(v) (log p_t(v) − log p_s(v)) over the vocabulary without ``drop``, row by row in float64."""
    out = []
    for s, t in zip(student.double().tolist(), teacher.double().tolist()):
        s = [x for v, x in enumerate(s) if v != drop]
        t = [x for v, x in enumerate(t) if v != drop]
        zs = torch.tensor(s).exp().sum().log()
        zt = torch.tensor(t).exp().sum().log()
        out.append(sum(float((ti - zt).exp()) * float((ti - zt) - (si - zs)) for si, ti in zip(s, t)))
    return torch.tensor(out, dtype=torch.float64)


def test_kl_to_teacher_matches_hand_computation_and_detaches_the_teacher():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(5, 9, generator=g, requires_grad=True)
    teacher = torch.randn(5, 9, generator=g, requires_grad=True)
    kl = kl_to_teacher(student, teacher, suppress=8)
    assert torch.allclose(kl.double(), _hand_kl(student.detach(), teacher.detach(), 8), atol=1e-6)
    assert (kl > 0).all()
    kl.sum().backward()
    assert teacher.grad is None and student.grad is not None  # no gradient into the teacher path
    assert torch.allclose(kl_to_teacher(teacher, teacher, 8), torch.zeros(5), atol=1e-6)  # KL(p‖p) = 0


def test_chunked_kl_equals_one_piece_and_keeps_the_head_out_of_the_teacher():
    g = torch.Generator().manual_seed(1)
    hs, ht = torch.randn(7, 4, generator=g, requires_grad=True), torch.randn(7, 4, generator=g)
    w = torch.randn(11, 4, generator=g, requires_grad=True)
    one = chunked_kl(hs, ht, w, suppress=3, chunk=100)
    three = chunked_kl(hs, ht, w, suppress=3, chunk=3)
    assert torch.allclose(one, three, atol=1e-6)
    assert torch.allclose(one, kl_to_teacher(hs @ w.T, ht @ w.T, 3), atol=1e-6)
    (gw,) = torch.autograd.grad(one.sum(), w)
    ref = kl_to_teacher(hs @ w.T, (ht @ w.T).detach(), 3).sum()
    (gref,) = torch.autograd.grad(ref, w)
    leaky = kl_to_teacher(hs @ w.T, ht @ w.T, 3)  # kl_to_teacher detaches; rebuild a leaky one by hand
    lt, ls = F.log_softmax((ht @ w.T)[:, [i for i in range(11) if i != 3]], -1), \
        F.log_softmax((hs @ w.T)[:, [i for i in range(11) if i != 3]], -1)
    (gleak,) = torch.autograd.grad((lt.exp() * (lt - ls)).sum(), w)
    assert torch.allclose(gw, gref, atol=1e-6)
    assert not torch.allclose(gw, gleak, atol=1e-4)  # the check can fail: a head-through-teacher gradient differs
    assert torch.allclose(leaky, (lt.exp() * (lt - ls)).sum(-1), atol=1e-6)


def test_teacher_pairs_line_up_each_masked_target_with_the_clean_position_before_it():
    valid = torch.tensor([[True, True, False, True], [False, True, True, True]])
    student, teacher = teacher_pairs(valid)
    assert student.tolist() == [[False, True, False, True], [False, True, True, True]]
    assert teacher.tolist() == [[True, False, True, False], [True, True, True, False]]


def _hand_sbd_distill(model, batch, k, lam):
    """Eq. 14 + λ KL from the full (B, 2L, V) logits of one forward, term by term."""
    L = batch["L"]
    B = batch["input_ids"].shape[0]
    attn = sbd_attention_mask(model, L, k, "cpu").expand(B, -1, -1, -1)
    logits = forward(model, batch["input_ids"], position_ids=batch["position_ids"], attention_mask=attn)  # (B, 2L, V+1)
    keep = [v for v in range(logits.shape[-1]) if v != V]
    labels = batch["labels"]
    ce_sum, n, kl_sum = 0.0, 0, 0.0
    for b in range(B):
        for t in range(2 * L):
            if labels[b, t] == IGNORE:
                continue
            n += 1
            ce_sum = ce_sum - F.log_softmax(logits[b, t, keep], -1)[int(labels[b, t])]
            if t > L:  # a masked target at noisy position i = t - L >= 1: teacher = clean position i - 1
                lt = F.log_softmax(logits[b, t - L - 1, keep].detach(), -1)
                ls = F.log_softmax(logits[b, t, keep], -1)
                kl_sum = kl_sum + (lt.exp() * (lt - ls)).sum()
    return (ce_sum + lam * kl_sum) / n


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_sbd_distill_loss_equals_hand_computation(family, impl):
    model = with_mask_row(FACTORIES[family](vocab=V, seed=3, attn_implementation=impl, initializer_range=0.2))
    g = torch.Generator().manual_seed(4)
    chunks = torch.randint(3, V, (3, 17), generator=g)
    labels = torch.ones_like(chunks, dtype=torch.bool)
    labels[0, :5] = False  # answer-only rows: a prompt of 5 tokens
    batch = sbd_batch(chunks, V, 4, g, eta=torch.tensor([1.0, 0.6, 0.4]), labels=labels)
    loss, terms = sbd_distill_loss(model, batch, 4, V, 0.7)
    ref = _hand_sbd_distill(model, batch, 4, 0.7)
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-5
    assert float(terms["kl"]) > 0
    zero, _ = sbd_distill_loss(model, batch, 4, V, 0.0)
    plain, _ = sbd_loss(model, batch, 4, V)
    assert abs(float(zero) - float(plain)) < 1e-5  # λ = 0 is exactly Eq. 14
    # the gradient is the one of CE + λ KL with the teacher detached (the hand loss detaches it)
    params = [p for p in model.parameters()]
    got = torch.autograd.grad(loss, params, allow_unused=True)
    want = torch.autograd.grad(ref, params, allow_unused=True)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.allclose(a, b, atol=1e-5)


def test_objective_with_distill_lambda_runs_the_distill_loss_and_logs_kl():
    obj = SBDObjective(mask_token_id=V, block_range=(2, 4), distill_lambda=0.5)
    assert obj.term_names == ("ntp", "mat", "kl") and obj.distill_lambda == 0.5
    assert SBDObjective(mask_token_id=V).term_names == ("ntp", "mat")
    model = with_mask_row(tiny_llama(vocab=V, seed=1))
    chunks = torch.randint(3, V, (2, 13), generator=torch.Generator().manual_seed(0))
    loss, terms = obj.loss(model, chunks, torch.Generator().manual_seed(2), k=3)
    batch = sbd_batch(chunks, V, 3, torch.Generator().manual_seed(2))
    assert abs(float(loss) - float(_hand_sbd_distill(model, batch, 3, 0.5))) < 1e-5 and "kl" in terms
    with pytest.raises(unmask.UnmaskError, match="distill-lambda"):
        SBDObjective(mask_token_id=V, distill_lambda=-1.0)
    with pytest.raises(unmask.UnmaskError, match="distill-lambda"):
        AdapterObjective(V, distill_lambda=float("nan"))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_adapter_distill_loss_hand_computed_teacher_is_the_untouched_base(impl):
    base = tiny_qwen3(vocab=V, seed=0, attn_implementation=impl, initializer_range=0.2)
    model = tiny_qwen3(vocab=V, seed=0, attn_implementation=impl, initializer_range=0.2)
    ad = attach(model, AdapterSpec(rank=None, mask_token_id=V, base_vocab=V))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ad.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    chunks = torch.randint(3, V, (3, 21), generator=g)
    batch = sbd_batch(chunks, V, 6, g, eta=torch.tensor([1.0, 0.5, 0.3]))
    draft = torch.tensor([True, False, False])
    lam = 1.3
    loss, terms = adapter_loss(model, batch, 6, V, draft, ntp=True, distill_lambda=lam)
    L = batch["L"]
    attn = sbd_attention_mask(model, L, 6, "cpu").expand(3, -1, -1, -1)
    full = forward(model, batch["input_ids"], position_ids=batch["position_ids"], attention_mask=attn)  # (3, 2L, V+1)
    clean_base = forward(base, batch["input_ids"][:, :L], position_ids=batch["position_ids"][:, :L])  # (3, L, V)
    assert torch.allclose(full[:, :L, :V], clean_base, atol=1e-5)  # the clean half is the base
    labels = batch["labels"][:, L:]
    ce, kl, n = 0.0, 0.0, 0
    for b in range(3):
        for i in range(L):
            if labels[b, i] == IGNORE:
                continue
            n += 1
            ls = F.log_softmax(full[b, L + i, :V], -1)
            ce = ce - ls[int(labels[b, i])]
            if i >= 1:
                lt = F.log_softmax(clean_base[b, i - 1], -1)
                kl = kl + (lt.exp() * (lt - ls)).sum()
    assert abs(float(loss) - float((ce + lam * kl) / n)) < 1e-5
    plain, ref_terms = adapter_loss(model, batch, 6, V, draft, ntp=True)
    assert abs(float(terms["mat"]) - float(plain)) < 1e-5 and abs(float(terms["ntp"]) - float(ref_terms["ntp"])) < 1e-5


def test_adapter_distill_training_leaves_the_base_bit_identical():
    model = tiny_llama(vocab=V, seed=6, initializer_range=0.2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ad = attach(model, AdapterSpec(rank=None, mask_token_id=V, base_vocab=V))
    objective = AdapterObjective(V, block_range=(2, 6), eval_block_size=4, distill_lambda=1.0)
    g = torch.Generator().manual_seed(0)
    chunks = torch.randint(3, V, (4, 4), generator=g).repeat(1, 7)[:, :25]  # (4, 25)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    start = [p.detach().clone() for p in ad.parameters()]
    for _ in range(5):
        model.train()
        loss, terms = objective.loss(model, chunks, g, **objective.step_params(g))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert float(terms["kl"]) > 0
    assert any(not torch.equal(a, b) for a, b in zip(start, ad.parameters()))  # the adapter did train
    after = dict(model.named_parameters())
    for name, t in before.items():
        moved = (name.replace("_proj.weight", "_proj.base.weight").replace("embed_tokens.weight", "embed_tokens.base.weight")
                 .replace("lm_head.weight", "lm_head.base.weight"))
        assert torch.equal(after[moved], t), name


# ---------------------------------------------------------------------------------------------
# --distill: corpora and bad combinations
# ---------------------------------------------------------------------------------------------


def _distill_rows(path, *, model="stories260K", adapter=None, temperature=0.0, n=12, length=40):
    g = torch.Generator().manual_seed(0)
    settings = {"adapter": adapter, "model": model, "dtype": "float32", "max_new_tokens": 64,
                "temperature": temperature, "seed": 0, "val_fraction": 0.05, "system": None, "prompts": n}
    rows = [{"ids": torch.randint(3, 512, (length,), generator=g).tolist(), "loss_start": 6, "index": i,
             "split": "train", "settings": settings} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def real_corpora(tmp_path_factory):
    """Greedy distillation corpora of stories260K and stories260K-sbd (8 openings, 40 tokens)."""
    from unmask.train.distill import distill

    root = tmp_path_factory.mktemp("distill")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in
                               ["A cat sat", "Tim ran to", "The sun was", "Lily had a", "One day a dog",
                                "Once there was", "Ben and Sue", "A red ball"]))
    out = {}
    for name in ("stories260K", "stories260K-sbd"):
        out[name] = root / f"{name}.jsonl"
        distill(out[name], model=name, prompts=[prompts], max_new_tokens=40, batch_size=8)
    return out


@pytest.mark.parametrize("cmd", ["sbd", "sbd-adapter"])
@pytest.mark.parametrize("case,match", [
    ("lambda-alone", "pass --distill too"),
    ("negative", "finite number >= 0"),
    ("no-answer-only", "not on the prompts"),
    ("fsdp", "drop --fsdp"),
    ("plain-corpus", "not a self-distillation row"),
    ("txt", "not a .jsonl"),
    ("sampled", "temperature 0.8"),
    ("other-model", "not of the model being trained"),
    ("with-adapter", "decoded with adapter"),
])
def test_distill_bad_combinations_are_one_line_errors(tmp_path, capsys, cmd, case, match):
    good = _distill_rows(tmp_path / "good.jsonl")
    data, extra = good, ["--distill"]
    if case == "lambda-alone":
        extra = ["--distill-lambda", "0.5"]
    elif case == "negative":
        extra = ["--distill", "--distill-lambda", "-0.1"]
    elif case == "no-answer-only":
        extra = ["--distill", "--no-answer-only"]
    elif case == "fsdp":
        extra = ["--distill", "--fsdp"]
    elif case == "plain-corpus":
        data = ids_file(tmp_path / "plain.jsonl")
    elif case == "txt":
        data = tmp_path / "c.txt"
        data.write_text("Once upon a time.\n")
    elif case == "sampled":
        data = _distill_rows(tmp_path / "s.jsonl", temperature=0.8)
    elif case == "other-model":
        data = _distill_rows(tmp_path / "o.jsonl", model="stories260K-dlm")
    elif case == "with-adapter":
        data = _distill_rows(tmp_path / "a.jsonl", adapter="sbd")
    out = tmp_path / "out"
    one_line_error(capsys, "train", cmd, "--base", "stories260K", "--data", data, "--out", out, "--steps", 1,
                   "--seq-len", 32, *extra, match=match)
    assert not out.exists() and not (tmp_path / "out.run").exists()  # nothing written


def test_init_adapter_of_another_base_is_refused(tmp_path, capsys, real_corpora):
    shipped = unmask.load("stories260K").path / "adapters" / "sbd"
    one_line_error(capsys, "train", "sbd-adapter", "--base", "stories260K-sbd", "--init", shipped, "--data",
                   real_corpora["stories260K-sbd"], "--out", tmp_path / "a", "--steps", 1, "--seq-len", 32,
                   match="was trained on")


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


def test_train_sbd_distill_from_a_causal_base_end_to_end(tmp_path, real_corpora):
    from unmask.train.sbd import train_sbd

    out = tmp_path / "m"
    res = train_sbd(base="stories260K", data=real_corpora["stories260K"], out=out, distill=True, **SMALL_RUN)
    assert res.out == out and res.step == 3 and res.last["kl"] > 0
    meta = json.loads((out / "unmask_config.json").read_text())
    assert meta["kind"] == "sbd" and "KL" in meta["training"]["objective"] and "init" not in meta
    assert unmask.load(str(out)).kind == "sbd"


def test_distill_fine_tune_of_the_shipped_sbd_model_keeps_its_preset_and_record(tmp_path, capsys, real_corpora):
    shipped = unmask.load("stories260K-sbd")
    out = tmp_path / "m"
    code, _, err = run_cli(capsys, "train", "sbd", "--base", "stories260K-sbd", "--data",
                           real_corpora["stories260K-sbd"], "--out", out, "--distill", "--distill-lambda", "0.5",
                           "--steps", 2, "--seq-len", 32, "--batch-size", 2, "--warmup", 1, "--eval-every", 0,
                           "--ckpt-every", 0, "--no-progress")
    assert code == 0, err
    meta = json.loads((out / "unmask_config.json").read_text())
    assert meta["mask_token_id"] == shipped.mask_token_id
    assert meta["decode_defaults"] == shipped.meta["decode_defaults"]
    assert meta["init"]["model"] == "stories260K-sbd"
    assert meta["init"]["training"] == shipped.meta["training"]  # the stage before is kept
    assert "0.5 KL" in meta["training"]["objective"]
    # lossless greedy output is the fine-tuned model's own AR output
    trained = unmask.load(str(out))
    prompt = ["Once upon a time, there was a little girl named Lily."]
    ar = unmask.generate(prompt, trained, "ar", max_new_tokens=24).tokens
    assert unmask.generate(prompt, trained, "sbd", max_new_tokens=24, verify=True, block_size=8,
                           draft="linear").tokens == ar


def test_train_sbd_adapter_distill_from_the_shipped_adapter(tmp_path, capsys, real_corpora, stories):
    base_hash = weights_hash(stories.path)
    shipped = json.loads((stories.path / "adapters" / "sbd" / ADAPTER_JSON).read_text())
    out = tmp_path / "adapter"
    code, _, err = run_cli(capsys, "train", "sbd-adapter", "--base", "stories260K", "--init", "sbd", "--data",
                           real_corpora["stories260K"], "--out", out, "--distill", "--steps", 2, "--seq-len", 32,
                           "--batch-size", 2, "--warmup", 1, "--eval-every", 0, "--ckpt-every", 0, "--no-progress")
    assert code == 0, err
    cfg = json.loads((out / ADAPTER_JSON).read_text())
    assert cfg["rank"] == shipped["rank"] and cfg["target_modules"] == shipped["target_modules"]
    assert cfg["decode_defaults"] == shipped["decode_defaults"]
    assert cfg["training"]["init"]["training"] == shipped["training"]
    assert "KL" in cfg["training"]["objective"]
    assert weights_hash(stories.path) == base_hash  # the base checkpoint is never written
    bundle = unmask.load("stories260K", adapter=out)
    prompt = ["Tom had a big red ball that he loved very much."]
    ar = unmask.generate(prompt, unmask.load("stories260K"), "ar", max_new_tokens=24).tokens
    assert unmask.generate(prompt, bundle, "sbd", max_new_tokens=24, verify=True, block_size=8,
                           draft="linear").tokens == ar


def test_story_prompts_are_deduplicated_and_exclude_the_held_out_openings(stories):
    from unmask.train.data import story_prompts

    first = story_prompts(stories, 24, seed=3)
    assert first == story_prompts(stories, 24, seed=3)  # seeded
    assert len(first) == len(set(first)) and all(first)
    held = [first[0] + " and more", first[1][:3]]  # one opening starts a held-out one, the other is started by one
    kept = story_prompts(stories, 24, seed=3, exclude=held)
    assert first[0] not in kept and first[1] not in kept and set(kept) <= set(first)
