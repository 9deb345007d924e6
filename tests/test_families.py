"""Published diffusion-LM checkpoints load natively (spec/models.md §2.3-2.6, issue 19).

Each family gets a tiny directory exactly as a user has it: the published ``config.json`` (shrunk
to tiny sizes, every other field and ``auto_map`` kept; tests/data/dllm_configs), the published
``generation_config.json``, and random weights saved under the **published** parameter names by
this file (not by unmask). Logits are checked against an independent float64 re-implementation
of the architecture written from the published descriptions, reading those same published names.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import unmask
from unmask.decode import DECODERS
from unmask.decode.blocks import single as block_decode
from unmask.errors import UnmaskError
from unmask.models.adapters import realign

CONFIGS = Path(__file__).parent / "data" / "dllm_configs"
VOCAB, MASK, EOS = 160, 150, 151
H, N_HEADS, N_KV, HEAD, LAYERS, FF = 32, 4, 2, 8, 2, 48
EXPERTS, MOE_FF = 8, 16  # LLaDA2: 8 routed experts in 4 groups, 2 chosen from the 2 best groups, 1 shared

# family -> published config overrides that make it tiny (ids moved inside the tiny vocabulary).
TINY = {
    "llada": dict(d_model=H, n_heads=N_HEADS, n_kv_heads=N_KV, n_layers=LAYERS, mlp_hidden_size=FF, vocab_size=VOCAB,
                  embedding_size=VOCAB, max_sequence_length=256, mask_token_id=MASK, eos_token_id=EOS,
                  pad_token_id=EOS),
    "dream": dict(hidden_size=H, num_attention_heads=N_HEADS, num_key_value_heads=N_KV, num_hidden_layers=LAYERS,
                  intermediate_size=FF, vocab_size=VOCAB, max_position_embeddings=256, max_window_layers=LAYERS,
                  mask_token_id=MASK, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS),
    "sdar": dict(hidden_size=H, num_attention_heads=N_HEADS, num_key_value_heads=N_KV, head_dim=HEAD,
                 num_hidden_layers=LAYERS, intermediate_size=FF, vocab_size=VOCAB, max_position_embeddings=256,
                 max_window_layers=LAYERS, bos_token_id=EOS, eos_token_id=EOS),
    "llada2_mini": dict(hidden_size=H, num_attention_heads=N_HEADS, num_key_value_heads=N_KV, head_dim=HEAD,
                        num_hidden_layers=LAYERS, intermediate_size=FF, moe_intermediate_size=MOE_FF,
                        num_experts=EXPERTS, num_experts_per_tok=2, n_group=4, topk_group=2, vocab_size=VOCAB,
                        max_position_embeddings=256, max_window_layers=LAYERS, pad_token_id=EOS, rotary_dim=HEAD // 2,
                        eos_token_id=EOS),
}


def published_weights(family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the published parameter names of ``family`` (fp32)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    def norm():
        return 1.0 + 0.1 * torch.randn(H, generator=g)

    def mlp(p, ff):
        return {p + "gate_proj.weight": w(ff, H), p + "up_proj.weight": w(ff, H), p + "down_proj.weight": w(H, ff)}

    sd, kv = {}, N_KV * HEAD
    if family == "llada2_mini":
        sd["model.word_embeddings.weight"] = w(VOCAB, H)
        for i in range(LAYERS):
            p = f"model.layers.{i}."
            sd.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                       p + "attention.query_key_value.weight": w((N_HEADS + 2 * N_KV) * HEAD, H),
                       p + "attention.dense.weight": w(H, N_HEADS * HEAD),
                       p + "attention.query_layernorm.weight": 1.0 + 0.1 * torch.randn(HEAD, generator=g),
                       p + "attention.key_layernorm.weight": 1.0 + 0.1 * torch.randn(HEAD, generator=g)})
            if i == 0:  # first_k_dense_replace = 1
                sd.update(mlp(p + "mlp.", FF))
                continue
            sd.update({p + "mlp.gate.weight": w(EXPERTS, H) * 5, p + "mlp.gate.expert_bias": 0.3 * w(EXPERTS)})
            for e in range(EXPERTS):
                sd.update(mlp(p + f"mlp.experts.{e}.", MOE_FF))
            sd.update(mlp(p + "mlp.shared_experts.", MOE_FF))
        sd["model.norm.weight"] = norm()
        sd["lm_head.weight"] = w(VOCAB, H)
        return sd
    if family == "llada":
        sd["model.transformer.wte.weight"] = w(VOCAB, H)
        for i in range(LAYERS):
            p = f"model.transformer.blocks.{i}."
            sd.update({p + "attn_norm.weight": norm(), p + "ff_norm.weight": norm(), p + "q_proj.weight": w(H, H),
                       p + "k_proj.weight": w(kv, H), p + "v_proj.weight": w(kv, H), p + "attn_out.weight": w(H, H),
                       p + "ff_proj.weight": w(FF, H), p + "up_proj.weight": w(FF, H), p + "ff_out.weight": w(H, FF)})
        sd["model.transformer.ln_f.weight"] = norm()
        sd["model.transformer.ff_out.weight"] = w(VOCAB, H)
        return sd
    sd["model.embed_tokens.weight"] = w(VOCAB, H)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                   p + "self_attn.q_proj.weight": w(N_HEADS * HEAD, H), p + "self_attn.k_proj.weight": w(kv, H),
                   p + "self_attn.v_proj.weight": w(kv, H), p + "self_attn.o_proj.weight": w(H, N_HEADS * HEAD),
                   p + "mlp.gate_proj.weight": w(FF, H), p + "mlp.up_proj.weight": w(FF, H),
                   p + "mlp.down_proj.weight": w(H, FF)})
        if family == "dream":  # Qwen2: q/k/v biases
            sd.update({p + "self_attn.q_proj.bias": w(H), p + "self_attn.k_proj.bias": w(kv),
                       p + "self_attn.v_proj.bias": w(kv)})
        if family == "sdar":  # Qwen3: per-head q/k RMSNorm
            sd.update({p + "self_attn.q_norm.weight": 1.0 + 0.1 * torch.randn(HEAD, generator=g),
                       p + "self_attn.k_norm.weight": 1.0 + 0.1 * torch.randn(HEAD, generator=g)})
    sd["model.norm.weight"] = norm()
    sd["lm_head.weight"] = w(VOCAB, H)
    return sd


def published_dir(tmp_path: Path, family: str, *, config: dict | None = None, shards: int = 1) -> Path:
    """A checkpoint directory as published: config.json (tiny), generation_config.json, weights
    under published names in ``shards`` safetensors files (with an index when > 1)."""
    out = tmp_path / family
    n = 1
    while out.exists():
        n += 1
        out = tmp_path / f"{family}-{n}"
    out.mkdir()
    src = CONFIGS / family
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(TINY[family], **(config or {}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", out / "generation_config.json")
    sd = published_weights(family)
    if shards == 1:
        save_file(sd, out / "model.safetensors")
        return out
    names, weight_map = sorted(sd), {}
    for s in range(shards):
        part = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {k: sd[k] for k in names[s::shards]}
        save_file(chunk, out / part)
        weight_map.update({k: part for k in chunk})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


# -- an independent float64 reference of the published architectures -------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta, rotary: int | None = None):
    """Half-split rotary embedding (the published ``rotate_half``) of the first ``rotary`` dims
    (default all) of x (B, nh, T, d) at pos (T,); the rest pass through."""
    if rotary is not None and rotary < x.shape[-1]:
        return torch.cat([_rope(x[..., :rotary], pos, theta), x[..., rotary:]], -1)
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    ang = pos.double()[:, None] * inv[None]  # (T, d/2)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # (T, d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(family: str, sd: dict, ids: torch.Tensor, *, theta: float, eps: float,
                     allowed: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) in float64 of the published ``family`` forward; allowed: (T, T) bool."""
    sd = {k: v.double() for k, v in sd.items()}
    if family == "llada2_mini":
        return _llada2_reference(sd, ids, theta=theta, eps=eps, allowed=allowed)
    if family == "llada":
        names = {k.replace("model.transformer.", ""): v for k, v in sd.items()}
        emb, head, final = names["wte.weight"], names["ff_out.weight"], names["ln_f.weight"]
        layer = {"in": "attn_norm", "post": "ff_norm", "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "attn_out",
                 "gate": "ff_proj", "up": "up_proj", "down": "ff_out"}
        prefix = "blocks.{i}."
    else:
        names = {k.replace("model.", "", 1) if k.startswith("model.") else k: v for k, v in sd.items()}
        emb, head, final = names["embed_tokens.weight"], names["lm_head.weight"], names["norm.weight"]
        layer = {"in": "input_layernorm", "post": "post_attention_layernorm", "q": "self_attn.q_proj",
                 "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj", "gate": "mlp.gate_proj",
                 "up": "mlp.up_proj", "down": "mlp.down_proj"}
        prefix = "layers.{i}."
    B, T = ids.shape
    pos = torch.arange(T)
    x = emb[ids]  # (B, T, H)
    for i in range(LAYERS):
        p = prefix.format(i=i)

        def lin(name, h):
            out = h @ names[p + layer[name] + ".weight"].T
            bias = names.get(p + layer[name] + ".bias")
            return out if bias is None else out + bias

        h = _rms(x, names[p + layer["in"] + ".weight"], eps)
        q = lin("q", h).view(B, T, N_HEADS, HEAD).transpose(1, 2)  # (B, nh, T, d)
        k = lin("k", h).view(B, T, N_KV, HEAD).transpose(1, 2)  # (B, nkv, T, d)
        v = lin("v", h).view(B, T, N_KV, HEAD).transpose(1, 2)
        if family == "sdar":
            q = _rms(q, names[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, names[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        k, v = k.repeat_interleave(N_HEADS // N_KV, 1), v.repeat_interleave(N_HEADS // N_KV, 1)  # (B, nh, T, d)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD)  # (B, nh, T, T)
        att = att.masked_fill(~allowed, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(B, T, N_HEADS * HEAD)  # (B, T, nh*d)
        x = x + lin("o", o)
        h = _rms(x, names[p + layer["post"] + ".weight"], eps)
        x = x + lin("down", torch.nn.functional.silu(lin("gate", h)) * lin("up", h))
    return _rms(x, final, eps) @ head.T  # (B, T, V)


def _swiglu(sd, p, h):
    gate, up = h @ sd[p + "gate_proj.weight"].T, h @ sd[p + "up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ sd[p + "down_proj.weight"].T


def _moe(sd, p, h):
    """The published LLaDA2 MoE on h (N, H): sigmoid router, expert choice on score + expert_bias
    limited to the 2 best of 4 groups (group score = sum of its two best), 2 experts weighted by
    their normalised unbiased scores x routed_scaling_factor 2.5, plus the shared expert."""
    scores = torch.sigmoid(h @ sd[p + "gate.weight"].T)  # (N, E)
    choice = scores + sd[p + "gate.expert_bias"]
    out = _swiglu(sd, p + "shared_experts.", h)
    for n in range(h.shape[0]):
        groups = choice[n].view(4, EXPERTS // 4)  # (groups, experts per group)
        best_groups = groups.topk(2, -1).values.sum(-1).topk(2).indices
        allowed = torch.zeros(4, EXPERTS // 4, dtype=torch.bool)
        allowed[best_groups] = True
        chosen = choice[n].masked_fill(~allowed.flatten(), float("-inf")).topk(2).indices
        weights = scores[n, chosen] / scores[n, chosen].sum() * 2.5
        for e, wt in zip(chosen.tolist(), weights):
            out[n] += wt * _swiglu(sd, p + f"experts.{e}.", h[n: n + 1])[0]
    return out


def _llada2_reference(sd, ids, *, theta, eps, allowed):
    B, T = ids.shape
    pos = torch.arange(T)
    x = sd["model.word_embeddings.weight"][ids]  # (B, T, H)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], eps)
        qkv = (h @ sd[p + "attention.query_key_value.weight"].T).view(B, T, N_HEADS + 2 * N_KV, HEAD)
        q, k, v = qkv.split([N_HEADS, N_KV, N_KV], dim=2)  # heads: all queries, then keys, then values
        q = _rms(q, sd[p + "attention.query_layernorm.weight"], eps).transpose(1, 2)  # (B, nh, T, d)
        k = _rms(k, sd[p + "attention.key_layernorm.weight"], eps).transpose(1, 2)
        v = v.transpose(1, 2)
        q, k = _rope(q, pos, theta, HEAD // 2), _rope(k, pos, theta, HEAD // 2)  # partial_rotary_factor 0.5
        k, v = k.repeat_interleave(N_HEADS // N_KV, 1), v.repeat_interleave(N_HEADS // N_KV, 1)
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(HEAD)).masked_fill(~allowed, float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(B, T, -1) @ sd[p + "attention.dense.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        x = x + (_swiglu(sd, p + "mlp.", h) if i == 0 else _moe(sd, p + "mlp.", h.view(B * T, H)).view(B, T, H))
    return _rms(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T  # (B, T, V)


FAMILY_FACTS = {  # family -> (kind, logit shift, block size, theta, eps)
    "llada": ("masked-diffusion", 0, None, 500000.0, 1e-5),
    "dream": ("masked-diffusion", 1, None, 1000000.0, 1e-6),
    "sdar": ("block-diffusion", 0, 4, 1000000.0, 1e-6),
    "llada2_mini": ("block-diffusion", 0, 32, 600000.0, 1e-6),
}
ALL = list(FAMILY_FACTS)


def _allowed(family: str, T: int) -> torch.Tensor:
    if family in ("sdar", "llada2_mini"):
        blk = torch.arange(T) // FAMILY_FACTS[family][2]
        return blk[None, :] <= blk[:, None]  # (T, T) block-causal
    return torch.ones(T, T, dtype=torch.bool)  # bidirectional


def _load(path: Path, family: str, **kw):
    if family in ("sdar", "llada2_mini"):  # the published configs name no mask id; 151669 / 156895 lie outside
        # the tiny vocabulary
        kw.setdefault("mask_token_id", MASK)
    return unmask.load(str(path), **kw)


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_published_directory_matches_reference_forward(tmp_path, family, attn):
    path = published_dir(tmp_path, family, shards=2)
    bundle = _load(path, family)
    bundle.model.config._attn_implementation = attn
    kind, shift, block, theta, eps = FAMILY_FACTS[family]
    assert (bundle.kind, bundle.logit_shift, bundle.block_size, bundle.mask_token_id) == (kind, shift, block, MASK)
    assert bundle.tokenizer is None and bundle.meta["family"] == family.split("_")[0]
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))  # > 1 block of 32
    with torch.no_grad():
        got = bundle.model(input_ids=ids).logits.double()  # no mask passed: the family's own attention
    want = reference_logits(family, published_weights(family), ids, theta=theta, eps=eps,
                            allowed=_allowed(family, 40))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ALL)
def test_no_remote_code_is_imported(tmp_path, family, monkeypatch):
    """A poisoned modeling file next to the weights: importing it (any trust_remote_code path) fails."""
    import transformers.dynamic_module_utils as dyn

    path = published_dir(tmp_path, family)
    for module in {v.split(".")[0] for v in json.loads((path / "config.json").read_text())["auto_map"].values()}:
        (path / f"{module}.py").write_text("raise RuntimeError('remote code was imported')\n")

    def refuse(*args, **kwargs):
        raise AssertionError("get_class_from_dynamic_module was called")

    monkeypatch.setattr(dyn, "get_class_from_dynamic_module", refuse)
    bundle = _load(path, family)
    assert type(bundle.model).__module__.startswith("unmask.models.families.")
    assert not bundle.model.config.to_dict().get("auto_map")
    for flag in (False, True):  # an explicit trust_remote_code=True still takes the native class
        assert type(_load(path, family, trust_remote_code=flag).model).__module__.startswith("unmask.models.")


def test_family_defaults_come_from_the_checkpoint(tmp_path):
    # SDAR's published config names no mask id: the family's documented 151669 is taken (and is
    # outside this tiny vocabulary, hence the error naming it).
    with pytest.raises(UnmaskError, match="mask token id 151669 is outside"):
        unmask.load(str(published_dir(tmp_path, "sdar")))
    llada = unmask.load(str(published_dir(tmp_path, "llada", config={"mask_token_id": 7})))
    assert llada.mask_token_id == 7  # config.json wins over the documented 126336
    dream = unmask.load(str(published_dir(tmp_path, "dream")))
    assert dream.stop_token_ids == (151643,)  # generation_config.json's eos, as published
    sdar = unmask.load(str(published_dir(tmp_path, "sdar", config={"block_size": 8})), mask_token_id=MASK)
    assert sdar.block_size is None and block_decode.resolve_block_size(sdar, None) == 8  # config.json's block


def test_unsupported_llada_options_are_refused(tmp_path):
    with pytest.raises(UnmaskError, match="alibi=True; unmask implements the published LLaDA-8B"):
        unmask.load(str(published_dir(tmp_path, "llada", config={"alibi": True})))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cached_bidirectional_forward_matches_reference(tmp_path, family):
    """DynamicCache + 4D mask + explicit positions (the prefix cache's path): the tail's logits equal
    the reference forward in which the cached prefix attends only to itself."""
    from unmask.compat import attention_mask, forward, new_cache

    bundle = _load(published_dir(tmp_path, family), family)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(10)[None]
    with torch.no_grad():
        full = forward(bundle.model, ids, position_ids=pos, is_causal=False)
        cache = new_cache(bundle.model)
        forward(bundle.model, ids[:, :6], position_ids=pos[:, :6], cache=cache, is_causal=False)
        ones = torch.ones(1, 1, 4, 10, dtype=torch.bool)
        tail = forward(bundle.model, ids[:, 6:], position_ids=pos[:, 6:], cache=cache,
                       attention_mask=attention_mask(bundle.model, ones), is_causal=False)
    allowed = torch.ones(10, 10, dtype=torch.bool)
    allowed[:6, 6:] = False
    kind, shift, block, theta, eps = FAMILY_FACTS[family]
    want = reference_logits(family, published_weights(family), ids, theta=theta, eps=eps, allowed=allowed)
    torch.testing.assert_close(tail.double(), want[:, 6:], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(full[:, :6].double(), want[:, :6], atol=1e-3)  # full attention differs


PROMPTS = [[3, 17, 42, 9, 88, 5], [64, 12, 7]]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("policy, cache", [("top-k", "none"), ("threshold", "prefix"), ("entropy-bound", "dual"),
                                           ("factor", "none")])
def test_diffusion_decoder_batch_equals_single(tmp_path, family, policy, cache):
    bundle = _load(published_dir(tmp_path, family), family)
    opts = dict(max_new_tokens=8, block_size=4, policy=policy, cache=cache)
    if policy == "top-k":
        opts["steps"] = 8
    out = DECODERS["diffusion"].decode(bundle, PROMPTS, **opts)
    assert out.stats.extra["sampler"] == ("dream" if family == "dream" else "llada")
    for i, p in enumerate(PROMPTS):
        single = DECODERS["diffusion"].decode(bundle, [p], **opts)
        assert single.tokens[0] == out.tokens[i]
    assert all(MASK not in row for row in out.tokens)


@pytest.mark.parametrize("family", ["sdar", "llada2_mini"])
@pytest.mark.parametrize("decoder", ["block", "multiblock"])
def test_block_decoders_batch_equals_single(tmp_path, family, decoder):
    bundle = _load(published_dir(tmp_path, family), family)
    B = FAMILY_FACTS[family][2]
    decode = DECODERS["block"].decode if decoder == "block" else DECODERS["multiblock"].decode
    out = decode(bundle, PROMPTS, max_new_tokens=B + 4)
    assert out.stats.extra["block_size"] == B and out.stats.nfe >= 2
    for i, p in enumerate(PROMPTS):
        assert decode(bundle, [p], max_new_tokens=B + 4).tokens[0] == out.tokens[i]
    assert all(MASK not in row for row in out.tokens)
    with pytest.raises(UnmaskError, match=f"disagrees with the checkpoint's block size {B}"):
        decode(bundle, PROMPTS, max_new_tokens=8, block_size=B * 2)


def test_dream_logits_are_realigned(tmp_path):
    bundle = _load(published_dir(tmp_path, "dream"), "dream")
    ids = torch.tensor([[5, 9, 11, 2]])
    with torch.no_grad():
        raw = bundle.model(input_ids=ids).logits
    aligned = realign(raw, bundle.logit_shift)
    torch.testing.assert_close(aligned[:, 1:], raw[:, :-1])


def test_save_pretrained_round_trips_published_names(tmp_path):
    from safetensors.torch import load_file

    bundle = _load(published_dir(tmp_path, "llada"), "llada")
    out = tmp_path / "saved"
    bundle.model.save_pretrained(out)
    assert set(load_file(out / "model.safetensors")) == set(published_weights("llada"))
    again = unmask.load(str(out))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(again.model(input_ids=ids).logits, bundle.model(input_ids=ids).logits)
    assert (again.kind, again.mask_token_id) == ("masked-diffusion", MASK)


DREAM_TOKENIZER_MAP = {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}  # as published


def _word_tokenizer(path: Path, tokenizer_config: dict) -> None:
    """A tokenizer.json over the tiny vocabulary (w0..w149, the mask 150, the end 151)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(MASK)} | {"<|mask|>": MASK, "<|endoftext|>": EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def test_tokenizer_files_load_without_remote_code(tmp_path):
    """Dream's tokenizer_config names its remote DreamTokenizer; the bundle reads tokenizer.json
    natively, agrees with the config on the mask id, and generates from text."""
    path = published_dir(tmp_path, "dream")
    _word_tokenizer(path, {"tokenizer_class": "DreamTokenizer", "mask_token": "<|mask|>", "eos_token": "<|endoftext|>",
                           "pad_token": "<|endoftext|>", "auto_map": DREAM_TOKENIZER_MAP})
    (path / "tokenization_dream.py").write_text("raise RuntimeError('remote code was imported')\n")
    bundle = unmask.load(str(path))
    assert bundle.tokenizer.mask_token_id == MASK == bundle.mask_token_id
    assert bundle.encode("w3 w5 w7") == [3, 5, 7]
    out = unmask.generate(["w3 w5 w7"], bundle, max_new_tokens=4, block_size=4)
    assert out.decoder == "diffusion" and len(out.tokens[0]) <= 4


def test_qwen2_vocab_and_merges_load_as_qwen2_tokenizer(tmp_path):
    """Without tokenizer.json (Dream ships vocab.json + merges.txt) the family's transformers class reads them."""
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from unmask.models.adapters import FAMILIES
    from unmask.models.bundle import _load_tokenizer

    alphabet = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"he": 256}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "DreamTokenizer",
                                                                "auto_map": DREAM_TOKENIZER_MAP}))
    tok = _load_tokenizer(tmp_path, FAMILIES["dream"], True, False)
    assert isinstance(tok, transformers.Qwen2Tokenizer)
    assert tok("hehe")["input_ids"] == [256, 256]


def test_bundle_without_tokenizer_refuses_text(tmp_path):
    bundle = unmask.load(str(published_dir(tmp_path, "llada")))
    with pytest.raises(UnmaskError, match="has no tokenizer files; add the checkpoint's tokenizer"):
        unmask.generate(["hello"], bundle, max_new_tokens=4)


def llada2_generate_reference(model, prompt: list[int], *, gen_length: int, block: int = 32, steps: int = 32,
                              threshold: float = 0.95, mask_id: int = MASK) -> list[int]:
    """The published LLaDA2.0 ``generate`` loop, greedy, written from its description: the whole
    window [0, end of current block) is re-run each step with an additive block-causal mask
    (log of a block-tril 0/1 matrix) and explicit positions, no cache; per step the quota is
    block/steps (remainder first); commit every mask with p > threshold if at least the quota of
    them, else the top-quota by p."""
    P = len(prompt)
    n_blocks = (P + gen_length + block - 1) // block
    total = n_blocks * block
    tril = torch.tril(torch.ones(n_blocks, n_blocks))
    additive = tril.repeat_interleave(block, 0).repeat_interleave(block, 1).log()[None, None]  # (1, 1, T, T)
    x = torch.full((1, total), mask_id, dtype=torch.long)
    x[0, :P] = torch.tensor(prompt)
    quotas = [block // steps + (s < block % steps) for s in range(steps)]
    for b in range(P // block, n_blocks):
        end = (b + 1) * block
        for s in range(steps):
            active = x[0, end - block: end] == mask_id
            if not active.any():
                break
            with torch.no_grad():
                logits = model(input_ids=x[:, :end], attention_mask=additive[:, :, :end, :end],
                               position_ids=torch.arange(end)[None]).logits[0, -block:]
            probs = logits.float().softmax(-1)
            p, tok = probs.max(-1)
            conf = torch.where(active, p, torch.tensor(float("-inf")))
            high = conf > threshold
            if int(high.sum()) >= quotas[s]:
                pick = high
            else:
                pick = torch.zeros(block, dtype=torch.bool)
                pick[conf.topk(min(quotas[s], int(active.sum()))).indices] = True
            x[0, end - block: end] = torch.where(pick, tok, x[0, end - block: end])
    return x[0, P: P + gen_length].tolist()


def test_llada2_generate_schedule_reproduces_the_published_loop(tmp_path):
    bundle = _load(published_dir(tmp_path, "llada2_mini"), "llada2_mini")
    prompts = [list(range(3, 40)), [64, 12, 7]]  # a prompt longer than one block, and a short one
    out = DECODERS["block"].decode(bundle, prompts, max_new_tokens=40, schedule="llada2", stop_token_ids=())
    assert out.stats.extra["steps"] == 32 and out.stats.extra["block_size"] == 32
    for row, p in zip(out.tokens, prompts):
        want = llada2_generate_reference(bundle.model, p, gen_length=40)
        assert row == want[: len(row)] and len(row) == 40
    # a coarser schedule: 4 steps of 8 tokens each per block, still the same loop
    out4 = DECODERS["block"].decode(bundle, prompts[:1], max_new_tokens=40, schedule="llada2", steps=4)
    assert out4.tokens[0] == llada2_generate_reference(bundle.model, prompts[0], gen_length=40, steps=4)
    assert out4.stats.nfe < out.stats.nfe
    with pytest.raises(UnmaskError, match="not policy 'top-k'"):
        DECODERS["block"].decode(bundle, prompts, max_new_tokens=8, schedule="llada2", policy="top-k")


def dream_generate_reference(model, prompt: list[int], *, gen_length: int, steps: int, alg: str,
                             eps: float = 1e-3, mask_id: int = MASK) -> list[int]:
    """Dream's ``diffusion_generate`` for one row at temperature 0, written from its description
    (diffusion.md §5): full forward per step, logits shifted right by one, k = int(n (1 - s/t))
    (all at the last step) most confident masks by the alg's score."""
    x = torch.tensor([prompt + [mask_id] * gen_length])
    ts = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        masked = x[0] == mask_id
        with torch.no_grad():
            logits = model(input_ids=x).logits[0]
        logits = torch.cat([logits[:1], logits[:-1]])  # (T, V): index i scores token i
        probs = logits[masked].float().softmax(-1)
        conf, tok = probs.max(-1)
        if alg == "topk_margin":
            top2 = probs.topk(2, -1).values
            conf = top2[:, 0] - top2[:, 1]
        elif alg == "entropy":
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)
        n = masked.sum() / 1
        k = int(n * (1 - ts[i + 1] / ts[i])) if i < steps - 1 else int(n)
        full = torch.full(masked.shape, float("-inf"))
        full[masked] = conf
        cand = torch.full_like(x[0], mask_id)
        cand[masked] = tok
        if k > 0:
            pick = full.topk(k).indices
            x[0, pick] = cand[pick]
    return x[0, len(prompt):].tolist()


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
def test_dream_schedule_reproduces_diffusion_generate(tmp_path, alg):
    bundle = _load(published_dir(tmp_path, "dream"), "dream")
    prompt = [3, 17, 42, 9]
    out = DECODERS["diffusion"].decode(bundle, [prompt], max_new_tokens=12, schedule="dream", alg=alg, steps=5)
    want = dream_generate_reference(bundle.model, prompt, gen_length=12, steps=5, alg=alg)
    assert out.tokens[0] == want[: len(out.tokens[0])] and MASK not in want
    assert out.stats.extra["schedule"] == "dream" and out.stats.nfe == 5


@pytest.mark.parametrize("alg, alg_temp", [("origin", None), ("entropy", 0.5)])
def test_dream_schedule_random_choices_batch_equals_single(tmp_path, alg, alg_temp):
    bundle = _load(published_dir(tmp_path, "dream"), "dream")
    opts = dict(max_new_tokens=8, schedule="dream", alg=alg, alg_temp=alg_temp, steps=4)
    out = DECODERS["diffusion"].decode(bundle, PROMPTS, **opts)
    for i, p in enumerate(PROMPTS):
        assert DECODERS["diffusion"].decode(bundle, [p], **opts).tokens[0] == out.tokens[i]
    assert out.stats.extra["alg"] == alg


def test_dream_schedule_refuses_block_options(tmp_path):
    bundle = _load(published_dir(tmp_path, "dream"), "dream")
    with pytest.raises(UnmaskError, match="--block-size, --cache do\\(es\\) not apply to --schedule dream"):
        DECODERS["diffusion"].decode(bundle, PROMPTS, max_new_tokens=8, schedule="dream", block_size=4, cache="prefix")
    with pytest.raises(UnmaskError, match="add --schedule dream"):
        DECODERS["diffusion"].decode(bundle, PROMPTS, max_new_tokens=8, alg="entropy")
    with pytest.raises(UnmaskError, match="unknown alg 'greedy'"):
        DECODERS["diffusion"].decode(bundle, PROMPTS, max_new_tokens=8, schedule="dream", alg="greedy")


@pytest.mark.parametrize("family, args", [("dream", ["--schedule", "dream", "--alg", "entropy", "--steps", "4"]),
                                          ("llada2_mini", ["--schedule", "llada2"]),
                                          ("sdar", ["--decoder", "multiblock"])])
def test_cli_generates_from_a_published_directory(tmp_path, capsys, family, args):
    from conftest import run_cli

    path = published_dir(tmp_path, family, config={"mask_token_id": MASK})
    _word_tokenizer(path, {"mask_token": "<|mask|>", "eos_token": "<|endoftext|>"})
    code, out, err = run_cli(capsys, "generate", "w3 w5 w7", "--model", str(path), "-n", "6", "--json", *args)
    assert code == 0, err
    row = json.loads(out.splitlines()[0])
    assert row["nfe"] >= 1 and len(row["tokens"]) <= 6


def _ids_corpus(path: Path, n: int = 12, length: int = 24) -> Path:
    g = torch.Generator().manual_seed(5)
    rows = [{"ids": torch.randint(3, MASK, (length,), generator=g).tolist()} for _ in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("family", ["sdar", "llada2_mini"])
def test_multitf_post_trains_a_published_block_model(tmp_path, family):
    """MultiTF takes the published directory and writes a checkpoint in the published names that reloads natively."""
    from safetensors.torch import load_file

    from unmask.train.multitf import train_multitf

    B = FAMILY_FACTS[family][2]
    base = published_dir(tmp_path, family, config={"mask_token_id": MASK})
    out = tmp_path / "out"
    result = train_multitf(base=str(base), data=_ids_corpus(tmp_path / "ids.jsonl", length=2 * B + 8), out=out,
                           seq_len=2 * B, g_max=2, steps=2, batch_size=1, eval_every=0, ckpt_every=0, progress=False)
    assert result.out is not None
    trained = unmask.load(str(out))
    assert (trained.kind, trained.block_size, trained.meta["family"]) == ("block-diffusion", B, family.split("_")[0])
    assert type(trained.model).__name__ == json.loads((base / "config.json").read_text())["architectures"][0]
    names = set().union(*(load_file(f).keys() for f in out.glob("*.safetensors")))
    assert names == set(published_weights(family))
    assert DECODERS["multiblock"].decode(trained, PROMPTS, max_new_tokens=B).stats.nfe >= 1


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_lbs_router_trains_on_a_published_masked_diffusion_model(tmp_path, family):
    from unmask.decode import DECODERS
    from unmask.train.routers import LBSTrainConfig, run_lbs

    path = published_dir(tmp_path, family)
    summary = run_lbs(model=str(path), data=[_ids_corpus(tmp_path / "ids.jsonl")], n_prompts=4, gen_length=8,
                      block_size=4, gen_batch=4, train=LBSTrainConfig(block=4, epochs=1, batch_size=4),
                      router={"d": 8, "layers": 1, "ffn": 16})
    assert (path / "routers").is_dir() and summary
    lps = family == "dream"
    if lps:  # and the LPS router on the LBS router's traces (few traces: a coarse FPR curve may warn)
        import warnings

        from unmask.train.routers import LPSTrainConfig, run_lps

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            run_lps(model=str(path), data=[tmp_path / "ids.jsonl"], n_prompts=6, block_size=4, l_min=2, g_max=2,
                    gen_batch=4, train=LPSTrainConfig(max_epochs=2, batch_size=16),
                    router={"d": 8, "layers": 1, "ffn": 16})
    bundle = unmask.load(str(path))
    out = DECODERS["early-bird"].decode(bundle, PROMPTS, max_new_tokens=8, lps=lps)
    assert all(MASK not in row for row in out.tokens) and out.stats.extra["lps"] == lps


def test_missing_weights_are_an_error_not_random_layers(tmp_path):
    from safetensors.torch import load_file

    path = published_dir(tmp_path, "llada")
    sd = load_file(path / "model.safetensors")
    del sd["model.transformer.blocks.1.ff_out.weight"]
    save_file(sd, path / "model.safetensors")
    with pytest.raises(UnmaskError, match="lacks weights the LLaDAModelLM architecture needs "
                                          r"\(model.layers.1.mlp.down_proj.weight\)"):
        unmask.load(str(path))


@pytest.mark.parametrize("family", ALL)
def test_left_padded_batch_forward_equals_single_rows(tmp_path, family):
    """The standard forward arguments: 2D padding mask + positions counting real tokens only."""
    bundle = _load(published_dir(tmp_path, family), family)
    rows = [[5, 9, 11, 2, 7, 30, 31, 3, 44, 12], [8, 6, 4]]
    T = max(map(len, rows))
    ids = torch.tensor([[EOS] * (T - len(r)) + r for r in rows])  # (2, T) left-padded
    pad = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    pos = (pad.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = bundle.model(input_ids=ids, attention_mask=pad, position_ids=pos).logits
        for i, r in enumerate(rows):
            single = bundle.model(input_ids=torch.tensor([r])).logits[0]
            torch.testing.assert_close(batch[i, T - len(r):], single, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["sdar", "llada2_mini"])
def test_static_cache_prefill_then_block_equals_full_forward(tmp_path, family):
    """A StaticCache holds the prefix's K/V (4D mask over max_cache_len keys); the next block's logits
    equal those of one uncached block-causal forward."""
    from transformers import StaticCache

    from unmask.compat import attention_mask, set_static_length
    from unmask.masks import as_4d, block_causal_mask

    bundle = _load(published_dir(tmp_path, family), family)
    B = FAMILY_FACTS[family][2]
    ids = torch.randint(0, VOCAB, (1, 2 * B), generator=torch.Generator().manual_seed(3))
    cap = 3 * B
    with torch.no_grad():
        full = bundle.model(input_ids=ids).logits[:, B:]  # (1, B, V): the second block
        cache = StaticCache(config=bundle.model.config, max_cache_len=cap)

        def mask(past, q):
            m = torch.zeros(q, cap, dtype=torch.bool)
            m[:, : past + q] = block_causal_mask(q, B, past)  # keys past the written ones stay invisible
            return attention_mask(bundle.model, as_4d(m))

        bundle.model(input_ids=ids[:, :B], attention_mask=mask(0, B), position_ids=torch.arange(B)[None], cache=cache)
        set_static_length(cache, B)
        got = bundle.model(input_ids=ids[:, B:], attention_mask=mask(B, B), position_ids=torch.arange(B, 2 * B)[None],
                           cache=cache).logits
    torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, bad, match", [
    ("llada", {"n_layers": "two"}, "does not match the published LLaDAModelLM schema .*num_hidden_layers"),
    ("sdar", {"hidden_size": None}, "does not match the published SDARForCausalLM schema .*hidden_size"),
    ("llada2_mini", {"num_shared_experts": 0}, "^LLaDA2 config without routed or shared experts"),
    ("llada2_mini", {"use_bias": True}, "^LLaDA2 config has use_bias=True"),
])
def test_bad_published_configs_are_one_line_errors(tmp_path, family, bad, match):
    with pytest.raises(UnmaskError, match=match) as info:
        unmask.load(str(published_dir(tmp_path, family, config=bad)), mask_token_id=MASK)
    assert "\n" not in str(info.value)
