"""Gated SBD adapters (spec/sbd_exact.md §3): exactness of the NTP mode, save/load, the base-hash
check, loading through ``unmask.load(..., adapter=...)`` and the CLI, and the adapter trainer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import unmask
from conftest import ids_file, one_line_error, run_cli, tiny_llama, tiny_qwen3, with_mask_row
from unmask.compat import attention_mask, forward, new_cache
from unmask.errors import UnmaskError
from unmask.masks import as_4d, sbd_inference_mask
from unmask.models.adapter_io import (ADAPTER_JSON, ADAPTER_WEIGHTS, adapter_config, save_adapter, weights_hash)
from unmask.models.sbd_adapter import AdapterSpec, attach
from unmask.train.objectives import sbd_batch, sbd_loss
from unmask.train.sbd_adapter import AdapterObjective, adapter_loss, train_sbd_adapter

V = 64  # tiny models' vocabulary; the adapter adds mask id V
FACTORIES = {"llama": tiny_llama, "qwen3": tiny_qwen3}


def _adapted(family: str, impl: str, rank: int | None, seed: int = 0, scale: float = 0.3):
    """(base, adapted copy with a random non-zero adapter, adapter) of the same tiny model."""
    base = FACTORIES[family](vocab=V, seed=seed, attn_implementation=impl)
    model = FACTORIES[family](vocab=V, seed=seed, attn_implementation=impl)
    ad = attach(model, AdapterSpec(rank=rank, mask_token_id=V, base_vocab=V))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in ad.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return base, model, ad


def _kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


# ---------------------------------------------------------------------------------------------
# Exactness: the NTP mode is the base model, bit for bit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("rank", [None, 4])
def test_ntp_logits_and_cache_exactly_the_base(family, impl, rank):
    base, model, _ = _adapted(family, impl, rank)
    ids = torch.randint(3, V, (3, 20), generator=torch.Generator().manual_seed(2))  # no mask token
    pos = torch.arange(20).expand(3, -1)
    with torch.no_grad():
        caches = [new_cache(m) for m in (base, model)]
        ref, got = (forward(m, ids[:, :14], position_ids=pos[:, :14], cache=c) for m, c in zip((base, model), caches))
        assert got.shape[-1] == V + 1  # the added mask column (suppressed by decoders)
        assert torch.equal(got[..., :V], ref)
        ref, got = (forward(m, ids[:, 14:], position_ids=pos[:, 14:], cache=c) for m, c in zip((base, model), caches))
        assert torch.equal(got[..., :V], ref)  # cached decode steps too
        for (kb, vb), (ka, va) in zip(_kv(caches[0]), _kv(caches[1])):
            assert torch.equal(kb, ka) and torch.equal(vb, va)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_non_mask_kv_do_not_depend_on_the_adapter(family, impl):
    """One forward over a prefix (causal) + an all-mask block (sbd.md §1 rule): the prefix's K/V
    and logits are identical whatever the adapter holds; the block's logits change with it."""
    _, model, ad = _adapted(family, impl, rank=None)
    B, P, K = 2, 10, 4
    ids = torch.cat([torch.randint(3, V, (B, P), generator=torch.Generator().manual_seed(3)),
                     torch.full((B, K), V)], dim=1)  # (B, P + K)
    pos = torch.arange(P + K).expand(B, -1)
    mask = attention_mask(model, as_4d(sbd_inference_mask(0, P, K), B))  # (B, 1, P+K, P+K)

    def run():
        cache = new_cache(model)
        with torch.no_grad():
            logits = forward(model, ids, position_ids=pos, attention_mask=mask, cache=cache)
        return logits, [(k[:, :, :P], v[:, :, :P]) for k, v in _kv(cache)]

    logits1, kv1 = run()
    with torch.no_grad():
        for p in ad.parameters():
            p.mul_(-2.0)
    logits2, kv2 = run()
    for (k1, v1), (k2, v2) in zip(kv1, kv2):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(logits1[:, :P, :V], logits2[:, :P, :V])  # column V is the (suppressed) mask logit
    assert (logits1[:, P:, :V] - logits2[:, P:, :V]).abs().max() > 1e-2


def test_fresh_adapter_is_option_a_mask_token():
    """B = 0 / ΔW = 0 and the mean mask row: the adapted model equals spec/sbd.md §2 Option A
    (a resized embedding with the mean row) on mask tokens too."""
    ref = with_mask_row(tiny_llama(vocab=V, seed=4))
    model = tiny_llama(vocab=V, seed=4)
    attach(model, AdapterSpec(rank=4, mask_token_id=V, base_vocab=V))
    ids = torch.tensor([[1, 5, 9, V, V, V, 7, V]])
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits  # (1, 8, V + 1)
    assert torch.allclose(got[..., :V], want[..., :V], atol=1e-5)  # column V: suppressed, defined differently


def test_adapter_trains_only_its_own_tensors():
    _, model, ad = _adapted("llama", "sdpa", rank=4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(ad.state_dict())
    assert "model.embed_tokens.row" in trainable
    assert sum(1 for n in trainable if n.endswith("lora_A")) == 2 * 7  # 2 layers x q k v o gate up down
    with pytest.raises(UnmaskError, match="already carries"):
        attach(model, AdapterSpec(rank=4, mask_token_id=V, base_vocab=V))
    with pytest.raises(UnmaskError, match="rank"):
        AdapterSpec(rank=0, mask_token_id=V, base_vocab=V)


# ---------------------------------------------------------------------------------------------
# Save / load / hash
# ---------------------------------------------------------------------------------------------


def _stories_adapter(tmp_path, rank=4, seed=0, defaults=None):
    """An adapter with random weights for the shipped stories260K, saved under tmp_path/ad."""
    bundle = unmask.load("stories260K")
    ad = attach(bundle.model, AdapterSpec(rank=rank, mask_token_id=512, base_vocab=512))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ad.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    cfg = adapter_config(ad, base_name="stories260K", base_sha256=weights_hash(bundle.path),
                         decode_defaults=defaults or {"block_size": 4})
    save_adapter(ad, tmp_path / "ad", cfg)
    return bundle, ad, tmp_path / "ad"


def test_save_load_round_trip_is_bit_exact(tmp_path):
    bundle, ad, where = _stories_adapter(tmp_path)
    assert sorted(p.name for p in where.iterdir()) == [ADAPTER_JSON, ADAPTER_WEIGHTS]
    cfg = json.loads((where / ADAPTER_JSON).read_text())
    assert cfg["format"] == "unmask-sbd-adapter" and cfg["version"] == 1 and cfg["rank"] == 4
    assert cfg["base"] == {"name": "stories260K", "sha256": weights_hash(bundle.path)}
    assert cfg["mask_token_id"] == 512 and cfg["mask_token_added"] and cfg["base_vocab_size"] == 512
    loaded = unmask.load("stories260K", adapter=where)
    from unmask.models.sbd_adapter import adapter_of

    for name, t in ad.state_dict().items():
        assert torch.equal(adapter_of(loaded.model).state_dict()[name], t)
    ids = torch.tensor([[1, 40, 41, 512, 512, 512]])
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids).logits, bundle.model(input_ids=ids).logits)
    assert loaded.kind == "sbd" and loaded.mask_token_id == 512 and 512 in loaded.suppress_ids
    assert loaded.name == "stories260K+ad" and loaded.meta["adapter"]["name"] == "ad"
    assert loaded.meta["decode_defaults"] == {"block_size": 4}


def test_set_adapter_decode_defaults(tmp_path):
    from unmask.models.adapter_io import set_adapter_decode_defaults

    _, _, where = _stories_adapter(tmp_path)
    set_adapter_decode_defaults(where, block_size=4, verify=True, draft="linear")
    assert unmask.load("stories260K", adapter=where).meta["decode_defaults"] == {
        "block_size": 4, "verify": True, "draft": "linear"}
    with pytest.raises(UnmaskError, match="not a number"):
        set_adapter_decode_defaults(where, block_size=[4])


def test_weights_hash_is_deterministic_and_sees_any_change(tmp_path):
    src = unmask.load("stories260K").path
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    assert weights_hash(src) == weights_hash(copy) == weights_hash(src)
    from safetensors.torch import load_file, save_file

    state = load_file(str(copy / "model.safetensors"))
    key = sorted(state)[0]
    state[key] = state[key].clone()
    state[key].view(-1)[0] += 1e-6
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert weights_hash(copy) != weights_hash(src)


def test_hash_mismatch_is_refused_with_one_line(tmp_path, capsys):
    _, _, where = _stories_adapter(tmp_path)
    with pytest.raises(UnmaskError) as e:
        unmask.load("stories260K-sbd", adapter=where)
    msg = str(e.value)
    assert "\n" not in msg and "stories260K" in msg and "stories260K-sbd" in msg and "train sbd-adapter" in msg
    one_line_error(capsys, "generate", "--model", "stories260K-sbd", "--adapter", where, "Once",
                   match="was trained on base")


def test_bare_name_resolves_in_the_model_dir(tmp_path, capsys):
    _, _, where = _stories_adapter(tmp_path)
    model_dir = tmp_path / "m"
    shutil.copytree(unmask.load("stories260K").path, model_dir)
    shutil.copytree(where, model_dir / "adapters" / "fast")
    bundle = unmask.load(model_dir, adapter="fast")
    assert bundle.kind == "sbd" and bundle.meta["adapter"]["path"] == str(model_dir / "adapters" / "fast")
    with pytest.raises(UnmaskError, match="adapters are: fast"):
        unmask.load(model_dir, adapter="nope")
    one_line_error(capsys, "generate", "--model", model_dir, "--adapter", "nope", "Once", match="unknown adapter")


# ---------------------------------------------------------------------------------------------
# Decoding with an adapter bundle
# ---------------------------------------------------------------------------------------------


def test_adapter_bundle_runs_the_sbd_decoder_and_keeps_ar_output(tmp_path, stories):
    _, _, where = _stories_adapter(tmp_path)
    bundle = unmask.load("stories260K", adapter=where)
    prompts = ["Once upon a time", "The cat sat"]
    sbd = unmask.generate(prompts, bundle, "sbd", max_new_tokens=12, block_size=4, gamma=0.0)
    assert all(len(t) == 12 and 512 not in t for t in sbd.tokens)
    assert sbd.stats.nfe == 12  # γ = 0: one token per forward
    ar_adapted = unmask.generate(prompts, bundle, "ar", max_new_tokens=24)
    ar_base = unmask.generate(prompts, stories, "ar", max_new_tokens=24)
    assert ar_adapted.tokens == ar_base.tokens


def test_cli_generate_with_adapter(tmp_path, capsys):
    _, _, where = _stories_adapter(tmp_path)
    code, out, err = run_cli(capsys, "generate", "--model", "stories260K", "--adapter", where, "--decoder", "ar",
                             "-n", "8", "--json", "Once upon a time")
    assert code == 0, err
    row = json.loads(out.splitlines()[0])
    code, out, err = run_cli(capsys, "generate", "--model", "stories260K", "--decoder", "ar", "-n", "8", "--json",
                             "Once upon a time")
    assert row["tokens"] == json.loads(out.splitlines()[0])["tokens"] and row["model"] == "stories260K+ad"


# ---------------------------------------------------------------------------------------------
# Training (masked term of Eq. 14, draft rows)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_two_pass_loss_equals_one_forward(impl):
    """adapter_loss (clean half cached without grad, then the noisy half) equals the masked term
    of the single 2L-token forward of sbd_loss."""
    _, model, _ = _adapted("qwen3", impl, rank=4)
    g = torch.Generator().manual_seed(5)
    chunks = torch.randint(3, V, (3, 21), generator=g)
    batch = sbd_batch(chunks, V, 6, g, eta=torch.tensor([1.0, 0.5, 0.3]))
    loss, terms = adapter_loss(model, batch, 6, V, torch.tensor([True, False, False]), ntp=True)
    _, ref = sbd_loss(model, batch, 6, V)
    assert abs(float(loss.detach()) - float(ref["mat"])) < 1e-5 and abs(float(terms["ntp"]) - float(ref["ntp"])) < 1e-5
    assert batch["noise_mask"][0].all()  # η = 1: all-mask blocks


def test_training_lowers_masked_loss_and_leaves_base_untouched():
    # initializer_range 0.2: with the default 0.02 the frozen random LM head caps every logit near
    # 0, so no adapter could make a sharp prediction
    model = tiny_llama(vocab=V, seed=6, initializer_range=0.2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ad = attach(model, AdapterSpec(rank=None, mask_token_id=V, base_vocab=V))
    objective = AdapterObjective(V, block_range=(2, 6), draft_fraction=0.5, eval_block_size=4)
    g = torch.Generator().manual_seed(0)
    motifs = torch.randint(3, V, (6, 4), generator=g)  # learnable: each row repeats a motif
    chunks = motifs.repeat(1, 7)[:, :25]  # (6, 25)

    def val() -> float:
        model.eval()
        with torch.no_grad():
            return float(objective.loss(model, chunks, torch.Generator().manual_seed(1), k=4)[1]["draft"])

    start = val()
    opt = torch.optim.AdamW(ad.parameters(), lr=1e-2)
    for _ in range(40):
        model.train()
        loss, _ = objective.loss(model, chunks, g, **objective.step_params(g))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert val() < 0.5 * start
    after = dict(model.named_parameters())
    renamed = {n.replace("_proj.weight", "_proj.base.weight").replace("embed_tokens.weight", "embed_tokens.base.weight")
               .replace("lm_head.weight", "lm_head.base.weight"): t for n, t in before.items()}
    for name, t in renamed.items():
        assert torch.equal(after[name], t), name


def test_train_sbd_adapter_end_to_end(tmp_path, capsys, stories):
    corpus = ids_file(tmp_path / "c.jsonl", n_docs=16)
    out = tmp_path / "adapter"
    base_hash = weights_hash(stories.path)
    code, _, err = run_cli(capsys, "train", "sbd-adapter", "--base", "stories260K", "--data", corpus, "--out", out,
                           "--full-rank", "--steps", 3, "--seq-len", 32, "--batch-size", 2, "--warmup", 1,
                           "--ckpt-every", 2, "--eval-every", 0)
    assert code == 0, err
    cfg = json.loads((out / ADAPTER_JSON).read_text())
    assert cfg["rank"] is None and cfg["full_rank"] and cfg["training"]["step"] == 3
    assert cfg["decode_defaults"] == {"verify": True, "verify_block_size": 8, "draft": "linear"}
    assert {"d0", "d1", "d2", "d3", "d7", "ntp"} <= set(cfg["training"]["val"])
    assert (out.with_name("adapter.run") / "checkpoints").is_dir()
    assert weights_hash(stories.path) == base_hash  # the base checkpoint is never written
    bundle = unmask.load("stories260K", adapter=out)
    assert bundle.kind == "sbd" and bundle.meta["decode_defaults"]["verify_block_size"] == 8
    one_line_error(capsys, "train", "sbd-adapter", "--base", "stories260K", "--data", corpus, "--out", out,
                   "--steps", 1, match="already exists")


def test_resume_reloads_the_adapter_checkpoint(tmp_path):
    corpus = ids_file(tmp_path / "c.jsonl", n_docs=16)
    opts = dict(base="stories260K", data=corpus, rank=2, seq_len=32, batch_size=2, warmup=1, eval_every=0,
                progress=False)
    straight = train_sbd_adapter(out=tmp_path / "a", steps=4, ckpt_every=2, **opts)
    first = train_sbd_adapter(out=tmp_path / "b", steps=4, ckpt_every=2, max_minutes=1e-9, **opts)
    assert first.step < 4 and first.stopped == "time"  # the budget is read after each step
    resumed = train_sbd_adapter(out=tmp_path / "b", steps=4, ckpt_every=2, resume=True, **opts)
    assert straight.step == resumed.step == 4
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "a" / ADAPTER_WEIGHTS)), load_file(str(tmp_path / "b" / ADAPTER_WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------
# Shipped adapters: listing and the bench
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def registry_with_adapter(monkeypatch, tmp_path):
    """A shipped copy of stories260K, ``toy-base``, that ships the random adapter ``fast``."""
    import unmask.models.registry as registry

    _, _, where = _stories_adapter(tmp_path)
    base = tmp_path / "toy-base"
    shutil.copytree(unmask.load("stories260K").path, base)
    shutil.copytree(where, base / "adapters" / "fast")
    real = registry.shipped()
    monkeypatch.setattr(registry, "shipped", lambda: {**real, "toy-base": base})
    return base


def test_models_lists_adapters_under_their_model(registry_with_adapter, capsys):
    code, out, err = run_cli(capsys, "models")
    assert code == 0, err
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "toy-base" in line and "--adapter" not in line)
    assert "--adapter fast" in lines[at + 1] and "rank 4" in out
    assert unmask.load("toy-base", adapter="fast").name == "toy-base+fast"


def test_bench_runs_adapter_rows(registry_with_adapter):
    from unmask.bench import side_by_side

    assert ("sbd", "toy-base", "fast") in side_by_side.adapter_pairs(["fast"])
    with pytest.raises(UnmaskError, match="no shipped model ships an adapter named 'nope'"):
        side_by_side.adapter_pairs(["nope"])
    res = side_by_side.bench(limit=1, max_new_tokens=4, models=["toy-base"], adapters=["fast"], decoders=["ar", "sbd"])
    rows = {(r["decoder"], r["model"]): r for r in res.rows}
    assert set(rows) == {("ar", "toy-base"), ("sbd --verify", "toy-base+fast"), ("sbd --no-verify", "toy-base+fast")}
    for variant in ("sbd --verify", "sbd --no-verify"):
        assert not rows[(variant, "toy-base+fast")].get("error") and rows[(variant, "toy-base+fast")]["n"] == 1


def test_shipped_adapter_keeps_stories260K_output(capsys, stories):
    """checkpoints/stories260K/adapters/sbd (recipes/stories260K_sbd_adapter.py): listed, loads by
    name onto the unchanged stories260K, and its NTP mode is stories260K's own greedy output."""
    from unmask.models.adapter_io import list_adapters, read_adapter_config

    assert "sbd" in list_adapters(stories.path)
    cfg = read_adapter_config(stories.path / "adapters" / "sbd")
    assert cfg["base"] == {"name": "stories260K", "sha256": weights_hash(stories.path)}
    assert cfg["decode_defaults"]["verify"] is True and cfg["mask_token_id"] == 512
    bundle = unmask.load("stories260K", adapter="sbd")
    prompts = ["Once upon a time, there was a little girl named Lily.", "Tom had a big red ball."]
    want = unmask.generate(prompts, stories, "ar", max_new_tokens=48).tokens
    assert unmask.generate(prompts, bundle, "ar", max_new_tokens=48).tokens == want
    lossless = unmask.generate(prompts, bundle, "sbd", max_new_tokens=48)  # the adapter's decode defaults
    assert lossless.stats.extra["verify"] is True and lossless.tokens == want  # lossless SBD: the base's own text
    assert lossless.stats.nfe < 48  # and fewer forwards than AR's 48
    code, out, err = run_cli(capsys, "models")
    assert code == 0 and "--adapter sbd" in out, err


@pytest.mark.parametrize("args,match", [(("--rank", "0"), "rank"), (("--draft-fraction", "2"), "draft-fraction"),
                                        (("--block-size", "0"), "block-size")])
def test_train_sbd_adapter_bad_options(tmp_path, capsys, args, match):
    corpus = ids_file(tmp_path / "c.jsonl")
    one_line_error(capsys, "train", "sbd-adapter", "--data", corpus, "--out", tmp_path / "o", "--seq-len", 32,
                   "--steps", 1, *args, match=match)
    assert not (tmp_path / "o").exists()


def test_cli_eval_with_adapter(tmp_path, capsys):
    _, _, where = _stories_adapter(tmp_path)
    out = tmp_path / "rows.jsonl"
    code, _, err = run_cli(capsys, "eval", "--task", "stories", "--model", "stories260K", "--adapter", where,
                           "--decoder", "sbd", "--gamma", "0", "--limit", "1", "-n", "8", "--no-progress", "--out", out)
    assert code == 0, err
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["model"] == "stories260K+ad" and summary["decoder"] == "sbd" and summary["nfe"] == 8
